"""Logit parity: Megatron shards run with TP simulated (per-rank compute + sum) vs the HF model, fp32."""

from __future__ import annotations

import pytest
import torch
from fixtures.convert import models as convert_models

from kit.convert import ConvertConfig, hf_to_megatron
from kit.convert.hf_io import HFReader
from kit.convert.megatron_io import load_rank_file, save_rank
from kit.convert.tensor_ops import interleave_qkv
from kit.convert.verify import logits_check

TOL = 1e-4
GRID = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]

tiny_baichuan_dir = convert_models.tiny_baichuan_dir  # shared session fixtures
tiny_baichuan7b_dir = convert_models.tiny_baichuan7b_dir
tiny_glm_dir = convert_models.tiny_glm_dir  # shared session fixtures


def convert_and_check(src, out, tp, pp, **kw) -> dict:
    hf_to_megatron(ConvertConfig(str(src), str(out), tp=tp, pp=pp, **kw), progress=False)
    return logits_check(src, out, tolerance=TOL)


@pytest.mark.parametrize("tp,pp", GRID)
def test_llama_gqa_and_mha(tiny_llama_dir, tiny_llama_tied_dir, tmp_path, tp, pp):
    gqa = convert_and_check(
        tiny_llama_dir, tmp_path / "gqa", tp, pp
    )  # TP4 > 2 KV groups: mcore >= 0.16 layout
    mha = convert_and_check(tiny_llama_tied_dir, tmp_path / "mha", tp, pp, flavor="legacy")
    for r in (gqa, mha):
        assert r["passed"] and r["max_abs_diff"] <= TOL and r["argmax_agree"] == 1.0, r
        assert (r["tp"], r["pp"]) == (tp, pp)


@pytest.mark.parametrize("tp,pp", GRID)
def test_chatglm3_shaped(tiny_glm_dir, tmp_path, tp, pp):
    r = convert_and_check(tiny_glm_dir, tmp_path / "m", tp, pp)
    assert r["family"] == "chatglm" and r["passed"], r


@pytest.mark.parametrize("tp,pp", GRID)
def test_baichuan2_shaped(tiny_baichuan_dir, tmp_path, tp, pp):
    r = convert_and_check(tiny_baichuan_dir, tmp_path / "m", tp, pp)
    assert r["family"] == "baichuan" and r["passed"], r


@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1)])
def test_baichuan2_7b_layout_with_rope(tiny_baichuan7b_dir, tmp_path, tp, pp):
    r = convert_and_check(tiny_baichuan7b_dir, tmp_path / "m", tp, pp)
    assert r["family"] == "baichuan" and r["passed"], r


def test_reference_forward_matches_transformers_for_llama(tiny_llama_dir):
    """The plain-torch HF reference (used for ChatGLM3/Baichuan2) agrees with transformers on a Llama."""
    from kit.convert.families import LLAMA
    from kit.convert.reference import hf_forward
    from kit.convert.verify import hf_logits, sample_tokens

    reader = HFReader(tiny_llama_dir)
    spec = LLAMA.read_config(reader.config)
    ids = sample_tokens(spec.vocab_size, 12)
    ours = hf_forward({k: reader.read(k) for k in reader.keys()}, spec, ids)
    assert float((ours - hf_logits(tiny_llama_dir, ids)).abs().max()) < 1e-5


# ---- negative controls: the check must catch the two classic conversion bugs -----------------------------------


def _rewrite(folder, fn):
    for path in sorted((folder / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt")):
        state = load_rank_file(path)
        fn(path.parent.name, state["model"])
        save_rank(path, state["args"], state["model"])


def test_negative_control_naive_qkv_concat_is_caught(tiny_llama_dir, tmp_path):
    out = tmp_path / "m"
    assert convert_and_check(tiny_llama_dir, out, 2, 1)["passed"]
    hf = HFReader(tiny_llama_dir)

    def naive(rank, model):  # [Q; K; V] chunked over ranks instead of grouped per KV head
        r = int(rank.split("_")[2])
        for i in range(2):
            qkv = torch.cat([hf.read(f"model.layers.{i}.self_attn.{n}_proj.weight") for n in "qkv"])
            model[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.chunk(qkv, 2)[r].clone()

    _rewrite(out, naive)
    bad = logits_check(tiny_llama_dir, out, tolerance=TOL)
    assert not bad["passed"] and bad["max_abs_diff"] > 1e-2, bad


def test_negative_control_naive_gate_up_split_is_caught(tiny_glm_dir, tmp_path):
    out = tmp_path / "m"
    assert convert_and_check(tiny_glm_dir, out, 2, 1)["passed"]
    hf = HFReader(tiny_glm_dir)

    def naive(rank, model):  # chunk(cat(gate, up)) gives rank 0 all of gate and rank 1 all of up
        r = int(rank.split("_")[2])
        for i in range(2):
            fc1 = hf.read(f"transformer.encoder.layers.{i}.mlp.dense_h_to_4h.weight")
            model[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.chunk(fc1, 2)[r].clone()

    _rewrite(out, naive)
    bad = logits_check(tiny_glm_dir, out, tolerance=TOL)
    assert not bad["passed"] and bad["max_abs_diff"] > 1e-2, bad


def test_negative_control_wrong_group_order_with_correct_shapes(tiny_glm_dir, tmp_path):
    """Grouping K/V per query head (MHA-style) instead of per multi-query group: shapes agree, logits do not."""
    out = tmp_path / "m"
    convert_and_check(tiny_glm_dir, out, 1, 1)
    hf = HFReader(tiny_glm_dir)

    def wrong(rank, model):
        for i in range(2):
            for kind in ("weight", "bias"):
                w = hf.read(f"transformer.encoder.layers.{i}.self_attention.query_key_value.{kind}")
                q, k, v = w.split([64, 32, 32])
                model[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = interleave_qkv(q, k, v, 1)

    _rewrite(out, wrong)
    assert not logits_check(tiny_glm_dir, out, tolerance=TOL)["passed"]
