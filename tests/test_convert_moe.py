"""Qwen3-MoE through conversion: the router and every expert's fc1 / fc2 at TP x PP x EP, in the rank folders
Megatron-LM / MindSpeed-LLM name for EP; HF -> Megatron -> HF bit-exact, the rank files' logits (TP and EP
simulated) against transformers' own model, the manifest's MoE facts and Megatron flags, and the EP rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.convert import families as fam_models

from kit.convert import ConversionError, ConvertConfig, hf_to_megatron, megatron_to_megatron
from kit.convert.hf_io import HFReader
from kit.convert.megatron_io import MegatronReader, load_rank_file
from kit.convert.verify import logits_check, megatron_checksums, round_trip, verify_conversion
from kit.core.manifest import read_manifest
from kit.core.parallel import expert_parallel_problems

tiny_qwen3_moe_dir = fam_models.tiny_qwen3_moe_dir  # shared session fixture
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4


@pytest.fixture(scope="module")
def moe_tp2_pp2_ep2(tiny_qwen3_moe_dir, tmp_path_factory) -> Path:
    """TP2 x PP2 (uneven: 1 + 3 layers) x EP2: 8 rank files, two of the four experts on each EP rank."""
    out = tmp_path_factory.mktemp("moe") / "tp2pp2ep2"
    cfg = ConvertConfig(str(tiny_qwen3_moe_dir), str(out), tp=2, pp=2, ep=2, num_layer_list=[1, 3])
    hf_to_megatron(cfg, progress=False)
    return out


def test_expert_layout_rank_folders_manifest_and_args(moe_tp2_pp2_ep2, tiny_qwen3_moe_dir):
    it = moe_tp2_pp2_ep2 / "iter_0000001"
    want = [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    assert sorted(p.name for p in it.iterdir()) == want
    hf = HFReader(tiny_qwen3_moe_dir)
    # TP rank 1, stage 1 (global layers 1-3), EP rank 1 (global experts 2 and 3 as local 0 and 1)
    state = load_rank_file(it / "mp_rank_01_001_001" / "model_optim_rng.pt")
    model, args = state["model"], state["args"]
    router = model["decoder.layers.0.mlp.router.weight"]  # local layer 0 = global layer 1; replicated
    assert torch.equal(router, hf.read("model.layers.1.mlp.gate.weight")) and router.shape == (4, 64)
    pre = "model.layers.1.mlp.experts.3."
    gate, up, down = (hf.read(pre + f"{n}_proj.weight") for n in ("gate", "up", "down"))
    fc1 = model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate[16:], up[16:]]))  # [gate_r; up_r] of expert TP rank 1 (ffn 32)
    fc2 = model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(fc2, down[:, 16:])
    assert torch.equal(
        model["decoder.layers.2.pre_mlp_layernorm.weight"],
        hf.read("model.layers.3.post_attention_layernorm.weight"),
    )
    experts = sorted(k for k in model if ".experts." in k)
    assert len(experts) == 3 * 2 * 2 and not any("local_experts.2" in k for k in experts)
    assert not any(k.endswith("mlp.linear_fc1.weight") for k in model)  # no dense MLP in a MoE layer
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    assert (args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (2, 2)
    assert args.moe_layer_freq == [1, 1, 1, 1] and args.norm_topk_prob and not args.moe_router_pre_softmax
    assert args.moe_aux_loss_coeff == 0.001 and args.moe_grouped_gemm is False

    man = read_manifest(moe_tp2_pp2_ep2)
    assert (man["tp"], man["pp"], man["ep"], man["expert_tensor_parallel_size"]) == (2, 2, 2, 2)
    assert man["moe_grouped_gemm"] is False and man["num_layer_list"] == [1, 3]
    facts = man["model"]
    assert facts["family"] == "qwen3_moe" and facts["num_experts"] == 4 and facts["moe_router_topk"] == 2
    assert facts["moe_ffn_hidden_size"] == 32 and facts["moe_norm_topk_prob"] is True
    assert facts["moe_aux_loss_coeff"] == 0.001 and facts["moe_layer_freq"] == [1, 1, 1, 1]
    flags = " ".join(man["megatron_flags"])
    assert (
        "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-router-load-balancing-type aux_loss "
        "--moe-aux-loss-coeff 0.001 --moe-layer-freq 1 --moe-token-dispatcher-type alltoall --norm-topk-prob"
    ) in flags
    assert "--qk-layernorm" in flags and "--num-layer-list 1,3" in flags
    assert "--moe-router-pre-softmax" not in flags and "--moe-grouped-gemm" not in flags


def test_moe_checkpoint_verifies_both_ways_and_against_transformers(
    moe_tp2_pp2_ep2, tiny_qwen3_moe_dir, tmp_path
):
    from kit.convert.tables import describe, layout_table

    table = describe(ConvertConfig(str(tiny_qwen3_moe_dir), "unused", tp=2, pp=2, ep=2))["value"]
    assert table["experts"] == "4 of FFN 32, top-2 renormalised, aux-loss coefficient 0.001, MoE layers 4/4"
    assert table["target layout"] == "TP2 x PP2 x EP2, local key names"
    rows = layout_table(moe_tp2_pp2_ep2)
    assert len(rows) == 8 and rows["rank file"].iloc[1] == "mp_rank_01_000_000/model_optim_rng.pt"
    v = verify_conversion(tiny_qwen3_moe_dir, moe_tp2_pp2_ep2, tmp_path)
    assert v["passed"], v["table"].to_dict("records")
    assert v["details"]["round_trip"]["bit_exact"] and v["details"]["logits"]["ep"] == 2
    assert v["details"]["logits"]["max_abs_diff"] <= TOL


@pytest.mark.parametrize(
    "tp,pp,ep,flavor,grouped",
    [(2, 1, 2, "local", False), (1, 2, 4, "local", False), (2, 2, 2, "te", True), (2, 1, 2, "local", True)],
)
def test_moe_round_trip_and_logits_at_tp_pp_ep(tiny_qwen3_moe_dir, tmp_path, tp, pp, ep, flavor, grouped):
    rt = round_trip(
        tiny_qwen3_moe_dir, tmp_path, tp=tp, pp=pp, flavor=flavor, ep=ep, moe_grouped_gemm=grouped
    )
    assert rt["bit_exact"] and rt["identical"] == rt["tensors"], {k: rt[k] for k in ("different", "missing")}
    lc = logits_check(tiny_qwen3_moe_dir, rt["megatron"], tolerance=TOL)
    assert lc["passed"] and lc["argmax_agree"] == 1.0, lc
    mr = MegatronReader(rt["megatron"])
    assert (mr.tp, mr.pp, mr.ep) == (tp, pp, ep) and len(mr.files) == tp * pp * ep
    keys = set(mr.state(0, 0, ep - 1)["model"])
    if grouped and flavor == "local":  # GroupedMLP: weight1 / weight2 hold the EP rank's two experts
        assert {"decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"} <= keys
        assert not any("local_experts" in k for k in keys)
    elif grouped:  # TEGroupedMLP: one parameter per local expert; the MoE layer's norm is its own module
        assert {
            "decoder.layers.0.mlp.experts.linear_fc1.weight1",
            "decoder.layers.0.pre_mlp_layernorm.weight",
        } <= keys
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
        assert "--moe-grouped-gemm" in read_manifest(rt["megatron"])["megatron_flags"]
    else:
        assert f"decoder.layers.0.mlp.experts.local_experts.{4 // ep - 1}.linear_fc2.weight" in keys


def test_moe_resharding_equals_direct_conversion(moe_tp2_pp2_ep2, tiny_qwen3_moe_dir, tmp_path):
    """TP2 x PP2 x EP2 -> TP1 x PP1 x EP4 re-sharded = HF -> TP1 x PP1 x EP4 directly (same bytes)."""
    megatron_to_megatron(
        ConvertConfig(str(moe_tp2_pp2_ep2), str(tmp_path / "b"), direction="megatron_to_megatron", ep=4),
        progress=False,
    )
    hf_to_megatron(ConvertConfig(str(tiny_qwen3_moe_dir), str(tmp_path / "c"), ep=4), progress=False)
    b, c = megatron_checksums(tmp_path / "b"), megatron_checksums(tmp_path / "c")
    assert b == c and sorted({k.split("/")[0] for k in b}) == [f"mp_rank_00_{e:03d}" for e in range(4)]


def test_expert_parallel_rules():
    assert expert_parallel_problems(4, 2) == [] and expert_parallel_problems(0, 1) == []
    bad = expert_parallel_problems(4, 3)
    assert bad[0] == "expert parallel size 3 does not divide the 4 experts."
    assert bad[-1] == "EP sizes that fit this model (every rule at once): [1, 2, 4]."
    # megatron-core 0.16.1: world % (TP x PP) and world % (expert-TP x EP x PP), expert-TP = TP
    assert expert_parallel_problems(4, 2, tp=2, pp=2, world_size=8) == []
    bad = expert_parallel_problems(4, 4, tp=2, pp=2, world_size=8)
    assert "does not divide the 4 data x tensor parallel ranks of a pipeline stage" in bad[0]
    assert bad[-1] == "EP sizes that fit this model on 8 ranks with TP2 PP2 (every rule at once): [1, 2]."
    assert expert_parallel_problems(4, 2, tp=2, pp=2, world_size=6)[0].startswith(
        "world size 6 is not divisible"
    )
    assert "needs a mixture-of-experts model" in expert_parallel_problems(0, 2)[0]


def test_bad_ep_is_one_line_and_exit_2(tiny_qwen3_moe_dir, tiny_llama_dir, tmp_path):
    with pytest.raises(
        ConversionError, match=r"EP sizes that fit this model \(every rule at once\): \[1, 2, 4\]"
    ):
        hf_to_megatron(ConvertConfig(str(tiny_qwen3_moe_dir), str(tmp_path / "a"), ep=3), progress=False)
    with pytest.raises(ConversionError, match="needs a mixture-of-experts model"):
        hf_to_megatron(ConvertConfig(str(tiny_llama_dir), str(tmp_path / "b"), ep=2), progress=False)
    res = subprocess.run(
        [sys.executable, "-m", "kit", "convert", "--source", str(tiny_qwen3_moe_dir), "--target",
         str(tmp_path / "c"), "--target-expert-parallel-size", "3", "--no-progress"],
        capture_output=True, text=True, cwd=str(ROOT),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "does not divide the 4 experts" in lines[0]
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


@pytest.mark.slow
def test_moe_conversion_memory_stays_far_below_the_model_size(tmp_path):
    """Streaming with experts: HF -> Megatron TP1 EP2 and back raise the peak RSS by far less than the model size
    (one expert tensor at a time, as one dense tensor at a time for dense models)."""
    from fixtures.convert.synthetic import synthetic_checkpoint

    from kit.convert.verify import compare_hf

    src = synthetic_checkpoint(
        tmp_path / "src", "qwen3_moe", hidden_size=512, num_layers=4, num_heads=8, num_groups=2,
        ffn_hidden_size=1024, vocab_size=8000, num_experts=8, moe_ffn_hidden_size=512, max_shard_mb=40,
        with_tokenizer=False,
    )  # fmt: skip
    model_mb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1024**2
    meg, back = tmp_path / "m", tmp_path / "hf"
    code = (
        "import re, torch\n"
        "from kit.convert import ConvertConfig, hf_to_megatron, megatron_to_hf\n"
        "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 1024\n"
        "import safetensors.torch; torch.zeros(1); before = hwm()\n"
        f"hf_to_megatron(ConvertConfig({str(src)!r}, {str(meg)!r}, ep=2), progress=False)\n"
        "print(hwm() - before)\n"
        f"megatron_to_hf(ConvertConfig({str(meg)!r}, {str(back)!r}, direction='megatron_to_hf'), progress=False)\n"
        "print(hwm() - before)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr[-2000:]
    to_meg, both = (float(x) for x in res.stdout.strip().splitlines()[-2:])
    assert model_mb > 100 and to_meg < 0.35 * model_mb and both < 0.35 * model_mb, (to_meg, both, model_mb)
    assert compare_hf(src, back)["bit_exact"]


def test_megatron_plan_takes_ep_and_the_moe_flags_from_the_manifest(
    moe_tp2_pp2_ep2, tiny_qwen3_moe_dir, tmp_path
):
    from test_train_megatron import code_package, flags_of, megatron_data

    from kit.train.config import TrainConfig, replace
    from kit.train.megatron import build
    from kit.train.resolve import resolve

    ws = tmp_path / "ws"
    code_package(ws)
    data = megatron_data(tmp_path / "data" / "alpaca_hf", tiny_qwen3_moe_dir, "sft")
    cfg = TrainConfig(
        engine="megatron", run_type="sft", model_name="tiny", model_path=str(moe_tp2_pp2_ep2),
        dataset_path=str(data), work_dir=str(ws), nproc_per_node=8, gbs=16,
    )  # fmt: skip
    plan = build(resolve(cfg))
    assert plan.problems == [], plan.problems
    flag = flags_of(plan.argv)
    assert flag["--tensor-model-parallel-size"] == "2" and flag["--pipeline-model-parallel-size"] == "2"
    assert flag["--expert-model-parallel-size"] == "2" and flag["--num-layer-list"] == "1,3"
    assert (flag["--num-experts"], flag["--moe-router-topk"], flag["--moe-ffn-hidden-size"]) == (
        "4",
        "2",
        "32",
    )
    assert flag["--moe-aux-loss-coeff"] == "0.001" and flag["--moe-router-load-balancing-type"] == "aux_loss"
    assert flag["--moe-token-dispatcher-type"] == "alltoall" and flag["--moe-layer-freq"] == "1"
    assert "--norm-topk-prob" in plan.argv and "--qk-layernorm" in plan.argv
    # 4 ranks at TP2 x PP2 leave one data-parallel rank: no room for EP2 (megatron-core keeps EP inside DP)
    small = build(resolve(replace(cfg, nproc_per_node=4, gbs=4)))
    assert any(
        "EP sizes that fit this model on 4 ranks with TP2 PP2 (every rule at once): [1]" in p
        for p in small.problems
    ), small.problems
    # ROUTER_AUX_LOSS_COEF (one setting for both engines) overrides the converted model's coefficient
    assert (
        flags_of(build(resolve(replace(cfg, router_aux_loss_coef=0.01))).argv)["--moe-aux-loss-coeff"]
        == "0.01"
    )


def test_grouped_mlp_weights_are_what_megatron_core_multiplies(tiny_qwen3_moe_dir, tmp_path):
    """GroupedMLP (local spec + --moe-grouped-gemm, MindSpeed-LLM's qwen3_moe layout) computes expert k's fc1 as
    x @ weight1.view(n, hidden, -1)[k] and fc2 as y @ weight2.view(n, -1, hidden)[k] (megatron-core 0.16
    experts.py GroupedMLP.forward, gmm with trans_b=False): the rank files must hold [gate_r; up_r].T and down_r.T
    there. Checked on the raw tensors, without the kit's reader (megatron-core's GroupedMLP needs the grouped_gemm
    package, which CPU stacks lack)."""
    out = tmp_path / "g"
    hf_to_megatron(
        ConvertConfig(str(tiny_qwen3_moe_dir), str(out), tp=2, ep=2, moe_grouped_gemm=True), progress=False
    )
    hf = HFReader(tiny_qwen3_moe_dir)
    for t in range(2):
        for e in range(2):
            model = load_rank_file(out / "iter_0000001" / f"mp_rank_{t:02d}_{e:03d}" / "model_optim_rng.pt")[
                "model"
            ]
            w1 = model["decoder.layers.2.mlp.experts.weight1"]
            w2 = model["decoder.layers.2.mlp.experts.weight2"]
            assert w1.shape == (64, 2 * 2 * 16) and w2.shape == (2 * 16, 64)
            for k in range(2):  # global expert 2e + k, TP rank t's half of its FFN
                pre = f"model.layers.2.mlp.experts.{2 * e + k}."
                gate, up, down = (hf.read(pre + f"{n}_proj.weight") for n in ("gate", "up", "down"))
                rows = slice(16 * t, 16 * (t + 1))
                assert torch.equal(w1.view(2, 64, -1)[k], torch.cat([gate[rows], up[rows]]).T)
                assert torch.equal(w2.view(2, -1, 64)[k], down[:, rows].T)
    assert "--moe-grouped-gemm" in read_manifest(out)["megatron_flags"]
    assert read_manifest(out)["moe_grouped_gemm"] is True


def test_a_dense_layer_among_moe_layers_and_the_checks_that_catch_a_wrong_expert(tmp_path):
    """mlp_only_layers=[1]: layer 1 keeps a dense MLP (mcore keys mlp.linear_fc1/fc2, --moe-layer-freq [1,0,1,1]);
    swapping two experts of one EP rank keeps every shape and fails the logits check (routing is exercised);
    a missing EP rank file is named."""
    import shutil

    from kit.convert.megatron_io import save_rank

    src = fam_models.tiny_hf(
        tmp_path / "mixed", "qwen3_moe", 17, head_dim=32, num_hidden_layers=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False,
    )  # fmt: skip
    rt = round_trip(src, tmp_path, tp=2, pp=2, ep=2)
    assert rt["bit_exact"] and logits_check(src, rt["megatron"], tolerance=TOL)["passed"]
    man = read_manifest(rt["megatron"])
    flags = man["megatron_flags"]
    assert flags[flags.index("--moe-layer-freq") + 1] == "[1,0,1,1]" and "--moe-router-pre-softmax" in flags
    assert man["model"]["moe_layer_freq"] == [1, 0, 1, 1] and man["model"]["moe_norm_topk_prob"] is False
    model = MegatronReader(rt["megatron"]).state(0, 0, 1)["model"]
    assert (
        "decoder.layers.1.mlp.linear_fc1.weight" in model
        and "decoder.layers.1.mlp.router.weight" not in model
    )

    bad = tmp_path / "swapped"
    shutil.copytree(rt["megatron"], bad)
    path = bad / "iter_0000001" / "mp_rank_00_001_000" / "model_optim_rng.pt"
    state = load_rank_file(path)
    weights = {k: v.clone() for k, v in state["model"].items()}
    pre = "decoder.layers.0.mlp.experts.local_experts."  # stage 1's first layer = global layer 2
    for name in ("linear_fc1.weight", "linear_fc2.weight"):
        weights[pre + "0." + name], weights[pre + "1." + name] = (
            weights[pre + "1." + name],
            weights[pre + "0." + name],
        )
    save_rank(path, state["args"], weights)
    assert not logits_check(src, bad, tolerance=TOL)["passed"]
    (bad / "iter_0000001" / "mp_rank_01_000_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(
        ConversionError, match=r"1 of 8 rank files missing .* TP2 x PP2 x EP2\): mp_rank_01_000_001"
    ):
        MegatronReader(bad)


def test_the_free_space_check_counts_what_the_expert_layout_writes(
    moe_tp2_pp2_ep2, tiny_qwen3_moe_dir, tmp_path
):
    """Each EP rank file repeats the embedding, attention, norms and router, and each TP rank the norms: the space
    asked for is within 5 % of the bytes written (and not below them), both ways."""
    from kit.convert.convert import _hf_bytes
    from kit.convert.families import family_for_config
    from kit.convert.megatron_source import layout_bytes, stages_of
    from kit.core.parallel import padded_vocab_size

    hf = HFReader(tiny_qwen3_moe_dir)
    fam = family_for_config(hf.config, None)
    spec = fam.read_config(hf.config, hf.folder)
    mr = MegatronReader(moe_tp2_pp2_ep2)
    padded = padded_vocab_size(spec.vocab_size, 2, 128, None)
    need = layout_bytes(fam, spec, "local", stages_of(mr, spec), 2, 2, padded, 4)
    written = sum(p.stat().st_size for p in mr.files.values())
    assert written <= need <= 1.05 * written
    assert need > 1.3 * hf.weight_bytes()  # the HF size alone (what was asked before) falls far short
    back = tmp_path / "hf"
    from kit.convert import megatron_to_hf

    megatron_to_hf(ConvertConfig(str(moe_tp2_pp2_ep2), str(back)), progress=False)
    hf_written = sum(p.stat().st_size for p in back.glob("*.safetensors"))
    assert hf_written <= _hf_bytes(fam, spec, "float32") <= 1.05 * hf_written
