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

from kit.convert import ConvertConfig
from kit.convert.families import family_for_config
from kit.convert.hf_io import HFReader
from kit.convert.megatron_io import load_rank_file, save_rank
from kit.convert.verify import logits_check, round_trip
from kit.core.manifest import read_manifest
from kit.errors import InputError

tiny_glm45_dir = routed_moe.tiny_glm45_dir  # shared session fixture
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


@pytest.mark.parametrize("tp,pp,ep", [(2, 2, 2), (1, 1, 1), (1, 1, 8)])
def test_glm45_round_trip_and_logits(glm45_tp2_pp2_ep2, tiny_glm45_dir, tmp_path, tp, pp, ep):
    rt = (
        glm45_tp2_pp2_ep2
        if (tp, pp, ep) == (2, 2, 2)
        else round_trip(tiny_glm45_dir, tmp_path, tp=tp, pp=pp, ep=ep)
    )
    assert rt["bit_exact"] and rt["identical"] == rt["tensors"] == 143, rt["different"]
    lc = logits_check(tiny_glm45_dir, rt["megatron"], tolerance=TOL)
    assert lc["passed"] and lc["argmax_agree"] == 1.0, lc


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
