"""kit.core.parallel: the one rule set for TP / PP / layer lists / padded vocabulary (conversion and training)."""

from __future__ import annotations

import pytest

from kit.core import parallel

# SmolLM2-135M: 9 heads, 3 KV groups, FFN 1536, 30 layers, vocab 49152
SMOL = dict(num_layers=30, num_heads=9, num_kv_groups=3, ffn_hidden_size=1536, vocab_size=49152)
# ChatGLM3-6B: 32 heads, 2 multi-query groups, FFN 13696, 28 layers, padded vocab 65024
GLM = dict(num_layers=28, num_heads=32, num_kv_groups=2, ffn_hidden_size=13696, vocab_size=65024)


def test_uneven_layer_list_7887_is_accepted_for_tp4_pp4():
    llama = dict(num_layers=30, num_heads=32, num_kv_groups=32, ffn_hidden_size=11008, vocab_size=32000)
    assert parallel.parallel_problems(llama, tp=4, pp=4, layer_list=[7, 8, 8, 7]) == []
    assert parallel.stage_layers(30, 4, [7, 8, 8, 7])[1] == list(range(7, 15))
    assert parallel.layer_list_flag([7, 8, 8, 7]) == "7,8,8,7"
    assert parallel.layer_list_flag([8, 8]) is None


def test_uneven_split_without_list_names_a_list_that_works():
    (msg,) = parallel.pipeline_problems(30, 4)
    assert "[8, 8, 7, 7]" in msg
    assert parallel.pipeline_problems(30, 4, parallel.even_layer_list(30, 4)) == []


@pytest.mark.parametrize(
    "layer_list, pp",
    [([7, 8, 8], 4), ([7, 8, 8, 8], 4), ([0, 15, 8, 7], 4), (["a", 1], 2)],
)
def test_bad_layer_lists_are_refused(layer_list, pp):
    assert len(parallel.pipeline_problems(30, pp, layer_list)) == 1


def test_pp_larger_than_layers_and_nonpositive_sizes():
    assert "every stage needs a layer" in parallel.pipeline_problems(2, 3)[0]
    assert "positive" in parallel.pipeline_problems(2, 0)[0]
    assert "positive" in parallel.tensor_parallel_problems(8, 8, 8, 0)[0]


def test_tp_candidates_apply_every_rule_at_once():
    # 9 heads: 1, 3, 9 divide; FFN 1536 is not divisible by 9; groups 3 fit 1 and 3 (and 9 on mcore, but FFN fails)
    assert parallel.tp_candidates(9, 1536, 3) == [1, 3]
    problems = parallel.parallel_problems(SMOL, tp=2, pp=1)
    assert "does not divide the 9 attention heads" in problems[0]
    assert problems[-1].endswith("[1, 3].")


def test_kv_groups_rule_depends_on_flavor():
    # ChatGLM3's 2 groups: TP4 is a multiple of the groups (megatron-core >= 0.16), not legal for legacy Megatron
    assert parallel.kv_groups_fit(2, 4, "local") and parallel.kv_groups_fit(2, 4, "te")
    assert not parallel.kv_groups_fit(2, 4, "legacy")
    assert parallel.parallel_problems(GLM, tp=4, pp=2) == []
    legacy = parallel.parallel_problems(GLM, tp=4, pp=2, flavor="legacy")
    assert any("2 KV groups" in p for p in legacy)
    assert legacy[-1].endswith("[1, 2].")
    assert not parallel.kv_groups_fit(3, 2, "local")  # neither divides the other


def test_padded_vocab_follows_megatron_rule():
    assert parallel.padded_vocab_size(49152, 3) == 49152  # 128*3 = 384 divides 49152
    assert parallel.padded_vocab_size(32000, 8) == 32768  # round up to a multiple of 1024
    assert parallel.padded_vocab_size(65024, 4, 64) == 65024
    assert parallel.padded_vocab_size(125696, 1, 128) == 125696  # Baichuan2 vocabulary
    assert parallel.padded_vocab_size(100, 2, explicit=130) == 130
    assert parallel.vocab_problems(100, 98, 2) == ["padded vocabulary 98 is smaller than the vocabulary 100."]
    assert "not divisible by tensor parallel size 4" in parallel.vocab_problems(100, 130, 4)[0]
    assert "not divisible" in parallel.parallel_problems(SMOL, tp=3, pp=1, padded_vocab=49153)[0]


def test_missing_facts_are_named():
    (msg,) = parallel.parallel_problems({"num_heads": 8}, tp=1, pp=1)
    assert "num_layers" in msg and "model_facts" in msg
