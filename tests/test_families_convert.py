"""Qwen3, GLM-4 (HF-native and chatglm-format), Llama-3.1 rope scaling and Qwen2.5 through conversion: HF -> Megatron
-> HF bit-exact at TP x PP, logits of the rank files (TP simulated) against transformers' own model, the Megatron
flags each family needs, and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.convert import families as fam_models

from kit.convert import ConversionError, ConvertConfig, hf_to_megatron, model_facts
from kit.convert.hf_io import HFReader
from kit.convert.manifests import architecture_flags
from kit.convert.megatron_io import MegatronReader
from kit.convert.verify import hf_logits, logits_check, megatron_checksums, round_trip, sample_tokens
from kit.core.manifest import read_manifest
from kit.errors import InputError

tiny_qwen3_dir = fam_models.tiny_qwen3_dir  # shared session fixtures
tiny_qwen3_untied_dir = fam_models.tiny_qwen3_untied_dir
tiny_glm4_dir = fam_models.tiny_glm4_dir
tiny_llama31_dir = fam_models.tiny_llama31_dir
tiny_qwen25_dir = fam_models.tiny_qwen25_dir
tiny_mistral_dir = fam_models.tiny_mistral_dir

TOL = 1e-4
GRID = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]  # TP4 > 2 KV groups: mcore >= 0.16 split-group layout


def _both_ways(src, tmp_path, tp, pp, flavor="local", seq_len=16):
    """HF -> Megatron -> HF bit-exact, and the Megatron files' logits (TP simulated) vs transformers."""
    rt = round_trip(src, tmp_path, tp=tp, pp=pp, flavor=flavor)
    assert rt["bit_exact"], {k: rt[k] for k in ("different", "missing", "extra")}
    assert rt["identical"] == rt["tensors"]
    lc = logits_check(src, rt["megatron"], tolerance=TOL, seq_len=seq_len)
    assert lc["passed"] and lc["argmax_agree"] == 1.0, lc
    return rt, lc


@pytest.mark.parametrize("tp,pp", GRID)
def test_qwen3_tied_both_ways_any_tp_pp(tiny_qwen3_dir, tmp_path, tp, pp):
    rt, lc = _both_ways(tiny_qwen3_dir, tmp_path, tp, pp)
    assert lc["family"] == "qwen3"
    mr = MegatronReader(rt["megatron"])
    for t in range(tp):  # q/k norms are replicated: every TP rank holds the whole [head_dim] weight
        model = mr.state(t, 0)["model"]
        qn = model["decoder.layers.0.self_attention.q_layernorm.weight"]
        want = HFReader(tiny_qwen3_dir).read("model.layers.0.self_attn.q_norm.weight")
        assert qn.shape == (32,) and torch.equal(qn, want)
        assert "decoder.layers.0.self_attention.k_layernorm.weight" in model
    assert "output_layer.weight" not in mr.state(0, 0)["model"] or pp > 1  # tied: no own output layer
    args = mr.state(0, 0)["args"]
    assert (args.kv_channels, args.qk_layernorm, args.untie_embeddings_and_output_weights) == (
        32,
        True,
        False,
    )


@pytest.mark.parametrize("tp,pp,layers", [(2, 2, None), (1, 4, None), (2, 2, [1, 3])])
def test_qwen3_untied_uneven_pipeline_and_te_names(tiny_qwen3_untied_dir, tmp_path, tp, pp, layers):
    kw = {"num_layer_list": layers} if layers else {}
    out = tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(tiny_qwen3_untied_dir), str(out), tp=tp, pp=pp, **kw), progress=False)
    assert logits_check(tiny_qwen3_untied_dir, out, tolerance=TOL)["passed"]
    if layers is None and pp == 2:
        rt, _ = _both_ways(tiny_qwen3_untied_dir, tmp_path / "te", tp, pp, flavor="te")
        keys = set(MegatronReader(rt["megatron"]).state(0, 0)["model"])
        assert "decoder.layers.0.self_attention.q_layernorm.weight" in keys  # TE spec: same q/k norm names
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys


def test_qwen3_legacy_flavor_refused_with_the_reason(tiny_qwen3_dir, tmp_path):
    with pytest.raises(ConversionError, match="no q/k layernorm"):
        hf_to_megatron(
            ConvertConfig(str(tiny_qwen3_dir), str(tmp_path / "m"), flavor="legacy"), progress=False
        )
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_glm4_hf_native_both_ways(tiny_glm4_dir, tmp_path, tp, pp):
    _, lc = _both_ways(tiny_glm4_dir, tmp_path, tp, pp)
    assert lc["family"] == "glm"


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_llama31_rope_scaling_both_ways(tiny_llama31_dir, tmp_path, tp, pp):
    _, lc = _both_ways(tiny_llama31_dir, tmp_path, tp, pp, seq_len=64)  # the scaling shows at 64 tokens
    assert lc["family"] == "llama"


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_qwen25_is_qwen2_with_bias_and_tied_embeddings(tiny_qwen25_dir, tmp_path, tp, pp):
    rt, _ = _both_ways(tiny_qwen25_dir, tmp_path, tp, pp)
    args = MegatronReader(rt["megatron"]).state(0, 0)["args"]
    assert args.add_qkv_bias and not args.untie_embeddings_and_output_weights


@pytest.mark.parametrize("tp,pp", [(2, 2)])
def test_mistral_is_the_llama_map(tiny_mistral_dir, tmp_path, tp, pp):
    _, lc = _both_ways(tiny_mistral_dir, tmp_path, tp, pp)
    assert lc["family"] == "llama"


def test_reference_forward_applies_llama3_rope_scaling(tiny_llama31_dir):
    """The kit's reference forward equals transformers' Llama-3.1 rotary; without the scaling it does not (the
    scaling moves these 64 tokens' logits by far more than the tolerance, so the parity checks could not pass
    with it ignored)."""
    import dataclasses

    from kit.convert.families import LLAMA
    from kit.convert.reference import hf_forward

    reader = HFReader(tiny_llama31_dir)
    spec = LLAMA.read_config(reader.config)
    sd = {k: reader.read(k) for k in reader.keys()}
    ids = sample_tokens(spec.vocab_size, 64)
    want = hf_logits(tiny_llama31_dir, ids)
    with torch.no_grad():
        ours = hf_forward(sd, spec, ids)
        plain = hf_forward(sd, dataclasses.replace(spec, rope_scaling=""), ids)
    assert float((ours - want).abs().max()) < 1e-5
    assert float((plain - want).abs().max()) > 20 * TOL


def test_qwen3_and_glm4_reference_forward_matches_transformers(tiny_qwen3_dir, tiny_glm4_dir):
    from kit.convert.families import family_for_config
    from kit.convert.reference import hf_forward

    for src in (tiny_qwen3_dir, tiny_glm4_dir):
        reader = HFReader(src)
        spec = family_for_config(reader.config).read_config(reader.config)
        ids = sample_tokens(spec.vocab_size, 12)
        with torch.no_grad():
            ours = hf_forward({k: reader.read(k) for k in reader.keys()}, spec, ids)
        assert float((ours - hf_logits(src, ids)).abs().max()) < 1e-5, spec.family


def test_megatron_flags_each_family_needs(tiny_qwen3_dir, tiny_llama31_dir, tiny_glm4_dir, tmp_path):
    out = tmp_path / "q3"
    hf_to_megatron(ConvertConfig(str(tiny_qwen3_dir), str(out), tp=2), progress=False)
    flags = read_manifest(out)["megatron_flags"]
    joined = " ".join(flags)
    assert "--qk-layernorm" in flags and "--kv-channels 32" in joined  # head_dim 32 != hidden/heads 16
    assert "--group-query-attention --num-query-groups 2" in joined
    assert "--untie-embeddings-and-output-weights" not in flags and "--add-qkv-bias" not in flags
    assert architecture_flags(model_facts(tiny_qwen3_dir), 2560) == [
        f for f in flags if f != "--use-mcore-models"
    ]

    l31 = architecture_flags(model_facts(tiny_llama31_dir))
    i = l31.index("--rope-scaling-type")
    assert l31[i : i + 10] == [
        "--rope-scaling-type", "llama3",
        "--rope-scaling-factor", "8.0",
        "--low-freq-factor", "1.0",
        "--high-freq-factor", "4.0",
        "--original-max-position-embeddings", "8192",
    ]  # fmt: skip
    assert "--qk-layernorm" not in l31

    g4 = " ".join(architecture_flags(model_facts(tiny_glm4_dir)))
    assert "--rotary-percent 0.5 --rotary-interleaved" in g4 and "--add-qkv-bias" in g4
    assert "--rope-scaling-type" not in g4


def test_other_rope_scaling_types_are_refused(tmp_path):
    from kit.convert.families import family_for_config

    cfg = dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    )
    with pytest.raises(InputError, match="rope_scaling type 'yarn' is not supported"):
        family_for_config(cfg).read_config(cfg)


def _chatglm_format(glm_dir, out):
    """The same weights in the chatglm (remote-code) layout of GLM-4-9B-chat: transformers' own conversion maps
    one onto the other by key renames, [Q;K;V] = query_key_value and rope_theta = 10000 * rope_ratio
    (transformers models/glm/convert_glm_weights_to_hf.py)."""
    from safetensors.torch import save_file

    reader = HFReader(glm_dir)
    c = reader.config
    rope_theta = float(c.get("rope_theta") or c["rope_parameters"]["rope_theta"])
    sd = {
        "transformer.embedding.word_embeddings.weight": reader.read("model.embed_tokens.weight"),
        "transformer.encoder.final_layernorm.weight": reader.read("model.norm.weight"),
        "transformer.output_layer.weight": reader.read("lm_head.weight"),
    }
    for i in range(c["num_hidden_layers"]):
        hf, cg = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        for t in ("weight", "bias"):
            sd[cg + f"self_attention.query_key_value.{t}"] = torch.cat(
                [reader.read(hf + f"self_attn.{n}_proj.{t}") for n in "qkv"]
            )
        for a, b in (
            ("input_layernorm.weight", "input_layernorm.weight"),
            ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
            ("self_attn.o_proj.weight", "self_attention.dense.weight"),
            ("mlp.gate_up_proj.weight", "mlp.dense_h_to_4h.weight"),
            ("mlp.down_proj.weight", "mlp.dense_4h_to_h.weight"),
        ):
            sd[cg + b] = reader.read(hf + a)
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"))
    config = {  # GLM-4-9B-chat's config.json fields (THUDM/glm-4-9b-chat), tiny sizes
        "model_type": "chatglm",
        "architectures": ["ChatGLMModel"],
        "hidden_size": c["hidden_size"],
        "ffn_hidden_size": c["intermediate_size"],
        "num_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"],
        "multi_query_attention": True,
        "multi_query_group_num": c["num_key_value_heads"],
        "kv_channels": c["head_dim"],
        "padded_vocab_size": c["vocab_size"],
        "layernorm_epsilon": c["rms_norm_eps"],
        "rope_ratio": rope_theta / 10000.0,
        "seq_length": c["max_position_embeddings"],
        "add_qkv_bias": True,
        "add_bias_linear": False,
        "rmsnorm": True,
        "post_layer_norm": True,
        "apply_residual_connection_post_layernorm": False,
        "original_rope": True,
    }
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def test_chatglm_format_glm4_goes_through_the_chatglm_map(tiny_glm4_dir, tmp_path):
    """GLM-4-9B-chat in its chatglm layout: the ChatGLM map's reference forward gives transformers' GLM-4 logits,
    and both layouts convert to byte-identical Megatron tensors."""
    old = _chatglm_format(tiny_glm4_dir, tmp_path / "glm4-chatglm")
    ids = sample_tokens(2522, 16)
    assert float((hf_logits(old, ids) - hf_logits(tiny_glm4_dir, ids)).abs().max()) < 1e-5
    a, b = tmp_path / "from_chatglm", tmp_path / "from_hf"
    for src, out in ((old, a), (tiny_glm4_dir, b)):
        hf_to_megatron(ConvertConfig(str(src), str(out), tp=2, pp=2), progress=False)
    assert megatron_checksums(a) == megatron_checksums(b)
    assert logits_check(old, a, tolerance=TOL)["passed"]
    rt = round_trip(old, tmp_path / "rt", tp=2, pp=1)
    assert rt["bit_exact"]


def test_qwen3_resharding_equals_direct_conversion(tiny_qwen3_untied_dir, tmp_path):
    """Megatron TP2 x PP2 -> TP4 x PP1 (q/k norms copied to every new rank) = HF -> TP4 x PP1 directly."""
    from kit.convert import megatron_to_megatron

    src = str(tiny_qwen3_untied_dir)
    hf_to_megatron(ConvertConfig(src, str(tmp_path / "a"), tp=2, pp=2), progress=False)
    megatron_to_megatron(
        ConvertConfig(str(tmp_path / "a"), str(tmp_path / "b"), direction="megatron_to_megatron", tp=4),
        progress=False,
    )
    hf_to_megatron(ConvertConfig(src, str(tmp_path / "c"), tp=4), progress=False)
    b, c = megatron_checksums(tmp_path / "b"), megatron_checksums(tmp_path / "c")
    assert b == c and len(b) == 4 * (4 * 8 + 3)  # 4 ranks x (4 layers x 8 tensors + embedding, norm, output)
    assert sum("q_layernorm" in k for k in b) == 4 * 4
