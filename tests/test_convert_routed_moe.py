"""GLM-4.5 (transformers glm4_moe) through conversion: sigmoid-routed experts with a score-correction bias, grouped
top-k, routed scaling, a shared expert, dense first layers and the MTP layer, at TP x PP x EP. HF -> Megatron -> HF
bit-exact, the rank files' logits (TP and EP simulated) against transformers' own model, megatron-core 0.16.1's
strict load at TP1 and EP2, and the combinations megatron-core cannot run refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.convert import routed_moe

from kit.convert import ConvertConfig, hf_to_megatron
from kit.convert.families import family_for_config
from kit.convert.hf_io import HFReader
from kit.convert.megatron_io import load_rank_file, save_rank
from kit.convert.verify import logits_check, round_trip
from kit.core.manifest import read_manifest
from kit.errors import InputError

tiny_glm45_dir = routed_moe.tiny_glm45_dir  # shared session fixture
tiny_deepseek3_yarn_dir = routed_moe.tiny_deepseek3_yarn_dir
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4


def test_glm45_spec_roles_and_aliases(tiny_glm45_dir):
    cfg = HFReader(tiny_glm45_dir).config
    fam = family_for_config(cfg)
    assert fam.name == "glm4_moe" and family_for_config(cfg, "glm45") is fam
    assert family_for_config(cfg, "glm45-air") is fam
    spec = fam.read_config(cfg)
    assert spec.moe_layer_freq == (0, 1, 1) and spec.mtp_num_layers == 1 and spec.all_layers == 4
    assert (spec.num_experts, spec.moe_router_topk, spec.moe_shared_expert_intermediate_size) == (8, 2, 32)
    assert (spec.moe_router_num_groups, spec.moe_router_group_topk) == (2, 1)
    assert spec.moe_router_score_function == "sigmoid" and spec.moe_router_enable_expert_bias
    assert spec.moe_router_topk_scaling_factor == 2.5 and spec.qk_norm and spec.qkv_bias
    assert (spec.rotary_percent, spec.rotary_interleaved) == (0.5, False)  # rotate_half on the first half
    assert fam.layer_roles(spec, 0)[-2:] == ["fc1.weight", "fc2.weight"]
    moe = fam.layer_roles(spec, 1)
    assert {"router.weight", "router.expert_bias", "shared.fc1.weight", "shared.fc2.weight"} <= set(moe)
    assert "fc1.weight" not in moe and "mtp.eh_proj" not in moe
    assert fam.layer_roles(spec, 3)[-6:] == [
        "mtp.enorm", "mtp.hnorm", "mtp.eh_proj", "mtp.final_norm", "mtp.embedding", "mtp.output",
    ]  # fmt: skip
    assert fam.hf_keys("mtp.final_norm", 3) == ("model.layers.3.shared_head.norm.weight",)


@pytest.fixture(scope="module")
def glm45_tp2_pp2_ep2(tiny_glm45_dir, tmp_path_factory) -> dict:
    return round_trip(
        tiny_glm45_dir, tmp_path_factory.mktemp("glm45"), tp=2, pp=2, ep=2, num_layer_list=[2, 1]
    )


def test_glm45_rank_files_hold_router_bias_shared_expert_and_mtp(glm45_tp2_pp2_ep2, tiny_glm45_dir):
    hf = HFReader(tiny_glm45_dir)
    it = Path(glm45_tp2_pp2_ep2["megatron"]) / "iter_0000001"
    state = load_rank_file(it / "mp_rank_01_001_001" / "model_optim_rng.pt")  # TP 1, last stage, EP 1
    model, args = state["model"], state["args"]
    bias = model["decoder.layers.0.mlp.router.expert_bias"]  # local layer 0 of stage 1 = global layer 2
    assert torch.equal(bias, hf.read("model.layers.2.mlp.gate.e_score_correction_bias"))
    gate, up = (hf.read(f"model.layers.2.mlp.shared_experts.{n}_proj.weight") for n in ("gate", "up"))
    fc1 = model["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[16:], up[16:]]))  # [gate_r; up_r] of TP rank 1
    eh = model["mtp.layers.0.eh_proj.weight"]  # column-parallel: rows 32:64 of [h, 2h] on TP rank 1
    assert torch.equal(eh, hf.read("model.layers.3.eh_proj.weight")[32:])
    assert torch.equal(
        model["mtp.layers.0.final_layernorm.weight"], hf.read("model.layers.3.shared_head.norm.weight")
    )
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight" in model
    assert not any("embed" in k for k in model if k.startswith("mtp."))  # the model's embedding is shared
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (2, 1)
    assert args.moe_router_topk_scaling_factor == 2.5 and args.moe_shared_expert_intermediate_size == 32
    assert args.mtp_num_layers == 1 and args.moe_layer_freq == [0, 1, 1] and not args.moe_router_pre_softmax
    flags = " ".join(read_manifest(glm45_tp2_pp2_ep2["megatron"])["megatron_flags"])
    assert (
        "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-router-load-balancing-type none "
        "--first-k-dense-replace 1 --moe-layer-freq 1 --moe-token-dispatcher-type alltoall --norm-topk-prob "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-dtype fp32 "
        "--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 2 --moe-router-group-topk 1 "
        "--n-shared-experts 1 --mtp-num-layers 1"
    ) in flags
    assert "--moe-aux-loss-coeff" not in flags and "--rotary-percent 0.5" in flags
    assert "--rotary-interleaved" not in flags and "--moe-router-pre-softmax" not in flags


# DeepSeek-V3-671B's MoE facts (its config.json) and the MoE flags of MindSpeed-LLM's
# examples/mcore/deepseek3/tune_deepseek3_671b_4k_full_ptd.sh for them (their alltoall_seq dispatcher aside)
DSV3_FACTS = dict(
    num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_aux_loss_coeff=0.001,
    moe_layer_freq=[0] * 3 + [1] * 58, moe_norm_topk_prob=True, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_num_groups=8,
    moe_router_group_topk=4, moe_shared_expert_intermediate_size=2048, mtp_num_layers=1,
)  # fmt: skip
MINDSPEED_DSV3 = {
    "--first-k-dense-replace": "3", "--moe-layer-freq": "1", "--n-shared-experts": "1", "--num-experts": "256",
    "--moe-router-topk": "8", "--moe-ffn-hidden-size": "2048", "--moe-router-load-balancing-type": "none",
    "--moe-router-num-groups": "8", "--moe-router-group-topk": "4", "--moe-router-topk-scaling-factor": "2.5",
    "--moe-router-score-function": "sigmoid", "--moe-router-dtype": "fp32", "--mtp-num-layers": "1",
}  # fmt: skip


def test_routed_moe_flags_are_mindspeed_llms():
    from kit.convert.manifests import moe_flags

    flags = moe_flags(DSV3_FACTS)
    flag = dict(zip(flags, flags[1:]))
    assert {k: flag.get(k) for k in MINDSPEED_DSV3} == MINDSPEED_DSV3
    for name in ("--seq-aux", "--norm-topk-prob", "--moe-router-enable-expert-bias"):
        assert name in flags, name
    assert flag["--moe-aux-loss-coeff"] == "0.001" and "--moe-router-pre-softmax" not in flags
    assert "--moe-shared-expert-intermediate-size" not in flags
    # a shared expert that is no multiple of the routed width keeps megatron-core's own size flag; a dense layer
    # that is not a leading one keeps megatron-core's list (MindSpeed's first-k form cannot say it)
    odd = moe_flags({**DSV3_FACTS, "moe_shared_expert_intermediate_size": 3000, "moe_layer_freq": [1, 0, 1]})
    odd_flag = dict(zip(odd, odd[1:]))
    assert odd_flag["--moe-shared-expert-intermediate-size"] == "3000" and "--n-shared-experts" not in odd
    assert odd_flag["--moe-layer-freq"] == "[1,0,1]" and "--first-k-dense-replace" not in odd
    # no aux_loss_alpha (GLM-4.5): the expert bias alone balances the load
    glm = moe_flags({**DSV3_FACTS, "moe_aux_loss_coeff": 0.0})
    assert "--moe-aux-loss-coeff" not in glm and "--seq-aux" not in glm


def test_megatron_plan_refuses_a_stage_of_dense_layers_only():
    from kit.train.megatron import _dense_stage_problems

    flags = ["--first-k-dense-replace", "1", "--moe-layer-freq", "1"]
    assert _dense_stage_problems(flags, 4, 2) == [] and _dense_stage_problems(flags, 3, 1) == []
    (problem,) = _dense_stage_problems(flags, 3, 2)
    assert "PP=2" in problem and "a PP of at most 1" in problem
    assert _dense_stage_problems(["--moe-layer-freq", "1"], 3, 2) == []


@pytest.mark.parametrize(
    "tp,pp,ep,flavor,grouped",
    [(2, 2, 2, "local", False), (1, 1, 1, "local", False), (1, 1, 8, "local", False), (2, 1, 2, "te", True),
     (2, 1, 2, "local", True)],
)  # fmt: skip
def test_glm45_round_trip_and_logits(
    glm45_tp2_pp2_ep2, tiny_glm45_dir, tmp_path, tp, pp, ep, flavor, grouped
):
    rt = (
        glm45_tp2_pp2_ep2
        if (tp, pp, ep) == (2, 2, 2)
        else round_trip(
            tiny_glm45_dir, tmp_path, tp=tp, pp=pp, ep=ep, flavor=flavor, moe_grouped_gemm=grouped
        )
    )
    assert rt["bit_exact"] and rt["identical"] == rt["tensors"] == 143, rt["different"]
    lc = logits_check(tiny_glm45_dir, rt["megatron"], tolerance=TOL)
    assert lc["passed"] and lc["argmax_agree"] == 1.0, lc


def test_a_cast_keeps_the_router_bias_in_fp32(tiny_glm45_dir, tmp_path):
    """--dtype bfloat16 casts the weights, not the expert bias megatron-core keeps in fp32."""
    out = tmp_path / "bf16"
    hf_to_megatron(ConvertConfig(str(tiny_glm45_dir), str(out), dtype="bfloat16"), progress=False)
    model = load_rank_file(out / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    bias = model["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and model["decoder.layers.1.mlp.router.weight"].dtype == torch.bfloat16
    assert torch.equal(bias, HFReader(tiny_glm45_dir).read("model.layers.1.mlp.gate.e_score_correction_bias"))


def test_glm45_logits_check_sees_the_router_bias(glm45_tp2_pp2_ep2, tiny_glm45_dir, tmp_path):
    """Negative control: the rank files with every expert_bias zeroed route differently and fail the check."""
    bad = tmp_path / "nobias"
    shutil.copytree(glm45_tp2_pp2_ep2["megatron"], bad)
    for path in sorted(bad.glob("iter_0000001/*/model_optim_rng.pt")):
        state = load_rank_file(path)
        weights = {k: (v.clone() * 0 if k.endswith("expert_bias") else v) for k, v in state["model"].items()}
        save_rank(path, state["args"], weights)
    lc = logits_check(tiny_glm45_dir, bad, tolerance=TOL)
    assert not lc["passed"] and lc["max_abs_diff"] > 1e-2, lc


def _config_with(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text(encoding="utf-8"))
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return dst


def test_routings_megatron_core_cannot_run_are_refused_in_one_line(tiny_glm45_dir, tmp_path):
    fam = family_for_config({"model_type": "glm4_moe"})
    base = HFReader(tiny_glm45_dir).config
    with pytest.raises(InputError, match="norm_topk_prob false") as err:
        fam.read_config(dict(base, norm_topk_prob=False))
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(InputError, match="n_group 2, topk_group 2, num_experts_per_tok 2"):
        fam.read_config(dict(base, topk_group=2))
    with pytest.raises(InputError, match="n_group 3"):
        fam.read_config(dict(base, n_group=3))
    with pytest.raises(InputError, match="ties the embedding and the head and has MTP layers"):
        fam.read_config(dict(base, tie_word_embeddings=True))
    src = _config_with(tiny_glm45_dir, tmp_path / "bad", scoring_func="softmax")
    res = subprocess.run(
        [sys.executable, "-m", "kit", "convert", "--source", str(src), "--target", str(tmp_path / "out"),
         "--no-progress"],
        capture_output=True, text=True, cwd=str(ROOT),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "scoring_func 'softmax'" in lines[0] and not (tmp_path / "out").exists()
    res = subprocess.run(
        [sys.executable, "-m", "kit", "convert", "--source", str(tiny_glm45_dir), "--target",
         str(tmp_path / "ep3"), "--target-expert-parallel-size", "3", "--no-progress"],
        capture_output=True, text=True, cwd=str(ROOT),
    )  # fmt: skip
    assert res.returncode == 2 and "does not divide the 8 experts" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_describe_names_the_routing_and_a_wrong_config_is_caught(glm45_tp2_pp2_ep2, tiny_glm45_dir, tmp_path):
    from kit.convert import ConversionError, megatron_to_hf
    from kit.convert.tables import describe

    table = describe(ConvertConfig(str(tiny_glm45_dir), "unused", tp=2, pp=2, ep=2, num_layer_list=[2, 1]))
    row = table["value"]["routing, shared experts, MTP"]
    assert row == "sigmoid + expert bias, top-1 of 2 groups, x2.5; shared FFN 32; MTP layers 1"
    assert table["value"]["experts"].endswith("MoE layers 2/3")
    # the same rank files read against a config without the MTP layer: the args disagree, named
    other = _config_with(tiny_glm45_dir, tmp_path / "nomtp", num_nextn_predict_layers=0)
    with pytest.raises(ConversionError, match="mtp_num_layers: checkpoint args say 1"):
        megatron_to_hf(
            ConvertConfig(glm45_tp2_pp2_ep2["megatron"], str(tmp_path / "hf"), hf_config_dir=str(other)),
            progress=False,
        )


tiny_deepseek3_dir = routed_moe.tiny_deepseek3_dir


def test_deepseek3_spec_roles_and_aliases(tiny_deepseek3_dir):
    cfg = HFReader(tiny_deepseek3_dir).config
    fam = family_for_config(cfg)
    assert fam.name == "deepseek_v3"
    assert all(family_for_config(cfg, a) is fam for a in ("deepseek3", "deepseek2", "deepseek2-lite"))
    spec = fam.read_config(cfg)
    assert spec.multi_latent_attention and (spec.q_lora_rank, spec.kv_lora_rank) == (32, 16)
    assert (spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim, spec.head_dim) == (16, 8, 16, 16)
    assert spec.moe_layer_freq == (0, 0, 1, 1) and spec.all_layers == 5
    assert (spec.moe_router_num_groups, spec.moe_router_group_topk, spec.moe_router_topk) == (4, 2, 4)
    assert fam.layer_roles(spec, 0)[:8] == [
        "input_norm", "mla.q_down", "mla.q_norm", "mla.q_up", "mla.kv_down", "mla.kv_norm", "mla.kv_up",
        "proj.weight",
    ]  # fmt: skip
    assert spec.full_shape("mla.kv_up") == (4 * (16 + 16), 16) and spec.full_shape("proj.weight") == (64, 64)
    from kit.convert.tables import describe

    table = describe(ConvertConfig(str(tiny_deepseek3_dir), "unused"))["value"]
    assert table["multi-head latent attention"] == "q latent 32, kv latent 16; per head q/k 16 + rope 8, v 16"
    assert "q/k norm (per head, before rotary)" not in table
    no_lora = fam.read_config(dict(cfg, q_lora_rank=None))
    assert "mla.q" in fam.layer_roles(no_lora, 0) and "mla.q_down" not in fam.layer_roles(no_lora, 0)


@pytest.fixture(scope="module")
def ds3_tp2_pp2_ep2(tiny_deepseek3_dir, tmp_path_factory) -> dict:
    return round_trip(tiny_deepseek3_dir, tmp_path_factory.mktemp("ds3"), tp=2, pp=2, ep=2)


def test_deepseek3_mla_tensors_are_split_by_rows_over_tp(ds3_tp2_pp2_ep2, tiny_deepseek3_dir):
    """megatron-core's local MLA: every projection column-parallel, so TP rank 1 holds the second half of the rows of
    q_a_proj, kv_a_proj_with_mqa (gathered again in the forward), and of q_b_proj / kv_b_proj (its heads 2-3);
    the latent norms whole; o_proj split by columns."""
    hf = HFReader(tiny_deepseek3_dir)
    it = Path(ds3_tp2_pp2_ep2["megatron"]) / "iter_0000001"
    model = load_rank_file(it / "mp_rank_01_000_000" / "model_optim_rng.pt")["model"]
    pre, hpre = "decoder.layers.1.self_attention.", "model.layers.1.self_attn."
    pairs = {
        "linear_q_down_proj": ("q_a_proj", 16),
        "linear_q_up_proj": ("q_b_proj", 48),
        "linear_kv_down_proj": ("kv_a_proj_with_mqa", 12),
        "linear_kv_up_proj": ("kv_b_proj", 64),
    }
    for meg, (name, half) in pairs.items():
        assert torch.equal(model[pre + meg + ".weight"], hf.read(hpre + name + ".weight")[half:]), meg
    assert torch.equal(model[pre + "kv_layernorm.weight"], hf.read(hpre + "kv_a_layernorm.weight"))
    assert torch.equal(model[pre + "linear_proj.weight"], hf.read(hpre + "o_proj.weight")[:, 32:])
    args = load_rank_file(it / "mp_rank_00_001_001" / "model_optim_rng.pt")["args"]
    assert args.multi_latent_attention and (args.q_lora_rank, args.kv_lora_rank) == (32, 16)
    assert (args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == (16, 8, 16)
    assert args.rope_type == "rope" and args.rotary_scaling_factor == 1.0 and args.qk_layernorm
    flags = " ".join(read_manifest(ds3_tp2_pp2_ep2["megatron"])["megatron_flags"])
    assert (
        "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
        "--v-head-dim 16 --rope-type rope"
    ) in flags
    assert "--qk-layernorm" in flags and "--moe-router-num-groups 4 --moe-router-group-topk 2" in flags


@pytest.mark.parametrize("case", ["tp2pp2ep2", "tp1", "no_q_lora_tp2ep4"])
def test_deepseek3_round_trip_and_logits(ds3_tp2_pp2_ep2, tiny_deepseek3_dir, tmp_path, case):
    if case == "tp2pp2ep2":
        src, rt = tiny_deepseek3_dir, ds3_tp2_pp2_ep2
    elif case == "tp1":
        src, rt = tiny_deepseek3_dir, round_trip(tiny_deepseek3_dir, tmp_path, tp=1)
    else:  # DeepSeek-V2-Lite's layout: q_proj, no query latent
        src = routed_moe.tiny_deepseek3(tmp_path / "nolora", q_lora_rank=None)
        rt = round_trip(src, tmp_path, tp=2, ep=4)
    assert rt["bit_exact"] and rt["identical"] == rt["tensors"], rt["different"]
    lc = logits_check(src, rt["megatron"], tolerance=TOL)
    assert lc["passed"] and lc["argmax_agree"] == 1.0, lc


def test_deepseek3_yarn_logits_and_flags(tiny_deepseek3_yarn_dir, tmp_path):
    """DeepSeek-V3's YaRN: megatron-core's rope_type yarn with the factor, mscales and betas; the rank files' logits
    (64 tokens) match transformers', and the same files read as plain RoPE do not (the check sees YaRN)."""
    import dataclasses

    from kit.convert.megatron_io import MegatronReader
    from kit.convert.reference import megatron_forward
    from kit.convert.verify import hf_logits, sample_tokens

    rt = round_trip(tiny_deepseek3_yarn_dir, tmp_path, tp=2, ep=2)
    assert rt["bit_exact"]
    lc = logits_check(tiny_deepseek3_yarn_dir, rt["megatron"], seq_len=64, tolerance=TOL)
    assert lc["passed"] and lc["argmax_agree"] == 1.0, lc
    man = read_manifest(rt["megatron"])
    spec = man["model"]
    assert (spec["rope_scaling"], spec["rope_scaling_factor"], spec["original_max_position_embeddings"]) == (
        "yarn",
        40.0,
        64,
    )
    flags = " ".join(man["megatron_flags"])
    assert (
        "--rope-type yarn --rope-scaling-type yarn --rope-scaling-factor 40.0 --beta-fast 32.0 --beta-slow 1.0 "
        "--rope-scaling-mscale 1.0 --rope-scaling-mscale-all-dim 1.0 --rope-scaling-original-max-position-embeddings 64"
    ) in flags
    args = MegatronReader(rt["megatron"]).args
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale_all_dim) == ("yarn", 40.0, 1.0)
    assert (args.rope_scaling_type, args.rope_scaling_mscale_all_dim) == (
        "yarn",
        1.0,
    )  # MindSpeed-LLM's names
    assert not args.use_rope_scaling  # Megatron-LM's llama3 switch stays off
    mr = MegatronReader(rt["megatron"])
    fam = family_for_config(HFReader(tiny_deepseek3_yarn_dir).config)
    plain = dataclasses.replace(fam.read_config(HFReader(tiny_deepseek3_yarn_dir).config), rope_scaling="")
    ids = sample_tokens(2522, 64)
    with torch.no_grad():
        wrong = megatron_forward(mr, plain, ids)
    assert float((wrong - hf_logits(tiny_deepseek3_yarn_dir, ids)).abs().max()) > 20 * TOL


def test_deepseek3_mla_flags_without_a_query_latent(tmp_path):
    """MindSpeed-LLM's deepseek3 MLA flags; --q-lora-rank left out where the model has no query latent (V2-Lite)."""
    from kit.convert.manifests import architecture_flags
    from kit.convert.sources import model_facts

    src = routed_moe.tiny_deepseek3(tmp_path / "nolora", q_lora_rank=None, num_nextn_predict_layers=0)
    flags = " ".join(architecture_flags(model_facts(src)))
    assert (
        "--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 "
        "--rope-type rope"
    ) in flags
    assert "--qk-layernorm" in flags and "--q-lora-rank" not in flags and "--rope-scaling-type" not in flags


def test_deepseek3_combinations_megatron_core_cannot_run_are_refused(tiny_deepseek3_dir, tmp_path):
    from kit.convert import ConversionError, megatron_to_hf

    fam = family_for_config({"model_type": "deepseek_v3"})
    base = HFReader(tiny_deepseek3_dir).config
    with pytest.raises(InputError, match="rope_interleave false"):
        fam.read_config(dict(base, rope_interleave=False))
    with pytest.raises(InputError, match="rope scaling 'dynamic'"):
        fam.read_config(dict(base, rope_scaling={"type": "dynamic", "factor": 4}))
    with pytest.raises(InputError, match="YaRN mscale_all_dim without mscale"):
        fam.read_config(dict(base, rope_scaling=dict(routed_moe.DEEPSEEK3_YARN, mscale=None)))
    with pytest.raises(InputError, match="YaRN attention_factor"):
        fam.read_config(dict(base, rope_scaling=dict(routed_moe.DEEPSEEK3_YARN, attention_factor=0.5)))
    with pytest.raises(InputError, match="n_group 4, topk_group 1, num_experts_per_tok 4"):
        fam.read_config(dict(base, topk_group=1))
    with pytest.raises(ConversionError, match="TP 3 does not divide q_lora_rank 32"):
        hf_to_megatron(ConvertConfig(str(tiny_deepseek3_dir), str(tmp_path / "a"), tp=3), progress=False)
    wrong = _config_with(tiny_deepseek3_dir, tmp_path / "wrong", kv_lora_rank=8)
    hf_to_megatron(ConvertConfig(str(tiny_deepseek3_dir), str(tmp_path / "m")), progress=False)
    with pytest.raises(ConversionError, match="kv_lora_rank: checkpoint args say 16"):
        megatron_to_hf(
            ConvertConfig(
                str(tmp_path / "m"),
                str(tmp_path / "hf"),
                direction="megatron_to_hf",
                hf_config_dir=str(wrong),
            ),
            progress=False,
        )
    with pytest.raises(ConversionError, match="flavor 'te' for multi-head latent attention"):
        hf_to_megatron(
            ConvertConfig(str(tiny_deepseek3_dir), str(tmp_path / "b"), flavor="te"), progress=False
        )


# real hidden sizes and attention shapes (the published config.json files); fewer experts and a smaller vocabulary
# keep the test to a few GB (DeepSeek-V3 has 256 experts of 2048 x 7168 per layer, GLM-4.5-Air 128 of 1408 x 4096)
REAL_SHAPES = {
    "deepseek_v3": dict(
        hidden_size=7168, num_heads=128, num_groups=128, ffn_hidden_size=18432, moe_ffn_hidden_size=2048,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_interleave=True,
    ),
    "glm4_moe": dict(
        hidden_size=4096, num_heads=96, num_groups=8, ffn_hidden_size=10944, moe_ffn_hidden_size=1408,
        head_dim=128, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(REAL_SHAPES))
def test_real_width_conversion_memory_stays_far_below_the_model_size(family, tmp_path):
    """`python -m kit convert` HF -> Megatron TP1 EP2 and back on 2 layers (dense + MoE) and the MTP layer of
    DeepSeek-V3's / GLM-4.5-Air's real widths raise the peak RSS by far less than the model size (one tensor at a
    time), and the way back is bit-exact."""
    from fixtures.convert.synthetic import synthetic_checkpoint

    from kit.convert.verify import compare_hf

    src = synthetic_checkpoint(
        tmp_path / "src", family, num_layers=2, vocab_size=8000, num_experts=2, dtype="bfloat16",
        max_shard_mb=400, with_tokenizer=False, **REAL_SHAPES[family],
    )  # fmt: skip
    model_mb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1024**2
    meg, back = tmp_path / "m", tmp_path / "hf"
    code = (
        "import re, sys, torch\n"
        "from kit.__main__ import main\n"
        "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 1024\n"
        "import safetensors.torch; torch.zeros(1); before = hwm()\n"
        "def run(*a):\n"
        "    assert main(['convert', *a, '--no-progress']) == 0\n"
        f"run('--source', {str(src)!r}, '--target', {str(meg)!r}, '--target-expert-parallel-size', '2')\n"
        "print('RSS', hwm() - before)\n"
        f"run('--source', {str(meg)!r}, '--target', {str(back)!r}, '--direction', 'megatron_to_hf')\n"
        "print('RSS', hwm() - before)\n"
    )
    try:  # three copies of a 1.4 / 3 GiB model: removed at the end, pytest keeps the last runs' tmp folders
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
        assert res.returncode == 0, res.stderr[-2000:]
        to_meg, both = (float(x.split()[1]) for x in res.stdout.splitlines() if x.startswith("RSS "))
        assert model_mb > 1000 and to_meg < 0.35 * model_mb and both < 0.35 * model_mb, (
            to_meg,
            both,
            model_mb,
        )
        assert compare_hf(src, back)["bit_exact"]
        print(f"{family}: model {model_mb:.0f} MiB, peak RSS rise {to_meg:.0f} / {both:.0f} MiB")
    finally:
        for folder in (src, meg, back):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("which", ["glm45", "deepseek3"])
def test_resharding_equals_direct_conversion(which, glm45_tp2_pp2_ep2, ds3_tp2_pp2_ep2, request, tmp_path):
    """TP2 x PP2 x EP2 -> TP1 x PP1 x EP4 re-sharded = HF -> TP1 x PP1 x EP4 directly (same bytes): the MTP layer,
    the router bias, the shared expert and MLA's column-parallel projections merge and split back."""
    from kit.convert import megatron_to_megatron
    from kit.convert.verify import megatron_checksums

    src = request.getfixturevalue({"glm45": "tiny_glm45_dir", "deepseek3": "tiny_deepseek3_dir"}[which])
    meg = {"glm45": glm45_tp2_pp2_ep2, "deepseek3": ds3_tp2_pp2_ep2}[which]["megatron"]
    megatron_to_megatron(
        ConvertConfig(meg, str(tmp_path / "b"), direction="megatron_to_megatron", ep=4), progress=False
    )
    hf_to_megatron(ConvertConfig(str(src), str(tmp_path / "c"), ep=4), progress=False)
    b, c = megatron_checksums(tmp_path / "b"), megatron_checksums(tmp_path / "c")
    assert b == c and any("/mtp.layers.0.eh_proj.weight" in k for k in b)


def test_an_mtp_embedding_that_is_not_the_models_is_refused(tiny_glm45_dir, tmp_path):
    """megatron-core's MTP layer uses the model's embedding and head: a checkpoint whose MTP copies differ from
    them cannot be converted to itself, and says which tensor and rows."""
    from safetensors.torch import load_file, save_file

    from kit.convert import ConversionError

    src = tmp_path / "src"
    shutil.copytree(tiny_glm45_dir, src)
    shard = src / "model-mtp.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.3.embed_tokens.weight"][2000] += 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        ConversionError, match=r"'model.layers.3.embed_tokens.weight' differs from .* rows 0-2521"
    ):
        hf_to_megatron(ConvertConfig(str(src), str(tmp_path / "out")), progress=False)
    assert not (tmp_path / "out").exists()


def test_an_fp8_checkpoint_is_refused_in_one_line_with_the_cast_to_do_first(tmp_path):
    """DeepSeek-V3's published weights are FP8 (block-scaled): the reader names the tensor and the BF16 cast, not a
    damaged file; nothing is written."""
    from safetensors.torch import save_file

    from kit.convert.file_slices import SafetensorsFile

    path = tmp_path / "model.safetensors"
    w = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    save_file(
        {"model.layers.0.self_attn.q_a_proj.weight": w, "x.weight_scale_inv": torch.ones(1, 1)}, str(path)
    )
    with pytest.raises(
        InputError, match=r"'model.layers.0.self_attn.q_a_proj.weight' is F8_E4M3, an FP8 checkpoint"
    ):
        SafetensorsFile(path)
