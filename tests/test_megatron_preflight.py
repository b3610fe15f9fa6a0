"""`python -m kit megatron preflight`: megatron-core 0.16 CPU ranks on the kit's converted shards and Megatron data.

Each case is one launch of its ranks (imports dominate); the inputs are module-scoped. A case asserts on the numbers
of preflight.json and on the files the ranks saved, and the damaged inputs each fail their own check in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.convert import families as fam_models
from fixtures.convert import models as convert_models

pytest.importorskip(
    "megatron.core", reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)"
)
pytestmark = pytest.mark.slow

tiny_glm_dir = convert_models.tiny_glm_dir  # shared session fixtures
tiny_baichuan_dir = convert_models.tiny_baichuan_dir
tiny_baichuan7b_dir = convert_models.tiny_baichuan7b_dir
tiny_llama4_dir = convert_models.tiny_llama4_dir
tiny_qwen3_dir = fam_models.tiny_qwen3_dir
tiny_llama31_dir = fam_models.tiny_llama31_dir
tiny_glm4_dir = fam_models.tiny_glm4_dir


def data_workspace(root: Path, tok: str) -> dict:
    """A workspace at `root` with notebook 02's pretraining data and packed fine-tuning data (Megatron files
    written) made with tokenizer `tok`; shared with the MoE preflight's tests."""
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare

    w = get_workspace(root, model="tiny")
    pre = prepare(
        DataConfig(kind="pretrain", name="corpus", tokenizer=tok, max_length=32, max_records=40),
        w,
        progress=False,
    )
    sft = prepare(
        DataConfig(
            kind="sft", name="alpaca", tokenizer=tok, max_length=48, max_records=24, template="tokenizer"
        ),
        w,
        progress=False,
    )
    return {"root": root, "pretrain": Path(pre.hf_dir), "sft": Path(sft.hf_dir)}


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tiny_llama_dir):
    """A workspace with notebook 02's pretraining data and packed fine-tuning data (Megatron files written)."""
    return data_workspace(tmp_path_factory.mktemp("pf") / "ws", str(tiny_llama_dir))


def _convert(src, out: Path, tp: int, pp: int, layers=None) -> Path:
    from kit.convert import ConvertConfig, hf_to_megatron

    hf_to_megatron(ConvertConfig(str(src), str(out), tp=tp, pp=pp, num_layer_list=layers), progress=False)
    return out


def _cli(ckpt: Path, data: Path, out: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kit", "megatron", "preflight", "--checkpoint", str(ckpt), "--dataset-path",
            str(data), "--output", str(out), "--work-dir", str(root), "--model-name", "tiny", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=900)


def _run(ckpt: Path, data: Path, out: Path, root: Path, **kw):
    from kit.train.preflight.run import PreflightConfig, run

    return run(PreflightConfig(checkpoint=str(ckpt), dataset_path=str(data), output=str(out), work_dir=str(root),
                               model_name="tiny", **kw))  # fmt: skip


def _by_name(checks: list) -> dict:
    return {c["check"]: c for c in checks}


def test_tp2_pp2_gqa_llama_pretraining_data_passes_every_check(ws, tiny_llama_dir, tmp_path):
    ckpt = _convert(tiny_llama_dir, tmp_path / "c", 2, 2)
    out = tmp_path / "pf"
    proc = _cli(ckpt, ws["pretrain"], out, ws["root"], "--micro-batches", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "preflight.json").read_text())
    checks = _by_name(report["checks"])
    assert list(checks) == ["shards loaded", "loss vs HF", "grad norm vs HF", "losses over steps",
                            "params after steps", "checkpoint back to HF"]  # fmt: skip
    assert all(c["passed"] for c in checks.values())
    assert checks["loss vs HF"]["value"] <= 1e-5 and checks["grad norm vs HF"]["value"] <= 1e-5
    assert checks["params after steps"]["value"] <= 1e-4
    facts = report["facts"]
    assert (facts["tp"], facts["pp"], facts["data_kind"]) == (2, 2, "pretrain")
    assert (facts["vocab_size"], facts["padded_vocab_size"]) == (2522, 2560)
    assert any("padded 2522 -> 2560" in n for n in report["notes"])
    assert facts["losses"][1] < facts["losses"][0]  # the steps trained
    # the checkpoint is in the layout MindSpeed-LLM loads
    assert (out / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    ranks = sorted(p.name for p in (out / "checkpoint" / "iter_0000002").iterdir())
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert "passed" in proc.stdout and "loss vs HF" in proc.stdout


def test_uneven_layer_list_with_packed_fine_tuning_data(ws, tiny_llama4_dir, tmp_path):
    """TP1 x PP2 with layers [1, 3]; the packed rows count the loss on answers only, inside each dialog."""
    ckpt = _convert(tiny_llama4_dir, tmp_path / "c", 1, 2, [1, 3])
    res = _run(ckpt, ws["sft"], tmp_path / "pf", ws["root"], micro_batches=2)
    assert res.passed, res.failures()
    assert res.facts["layer_list"] == [1, 3] and res.facts["data_kind"] == "sft"


def test_tied_embeddings_at_pp2_with_data_parallel_sharding(ws, tiny_llama_tied_dir, tmp_path):
    """TP1 x PP2 x DP2: the tied embedding's grads meet across stages; the distributed optimizer shards by DP."""
    ckpt = _convert(tiny_llama_tied_dir, tmp_path / "c", 1, 2)
    res = _run(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"], dp=2)
    assert res.passed, res.failures()
    assert res.facts["dp"] == 2
    shards = res.facts["optimizer_shard_numel"]
    numel = res.facts["model_numel"]
    assert len(shards) == 4 and all(0 < s < m for s, m in zip(shards, numel))
    assert sum(shards) * 2 == sum(numel)  # the two DP ranks of a stage hold its parameters between them


def test_chatglm3_at_tp2_with_dp2(ws, tiny_glm_dir, tmp_path):
    """ChatGLM3's fused [Q;K;V] with bias and half-rotary heads at TP2, and DP2 x TP2 for the distributed optimizer."""
    ckpt = _convert(tiny_glm_dir, tmp_path / "c", 2, 1)
    res = _run(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"], dp=2)
    assert res.passed, res.failures()
    shards, numel = res.facts["optimizer_shard_numel"], res.facts["model_numel"]
    assert len(shards) == 4 and all(0 < s < m for s, m in zip(shards, numel))


def test_qwen3_tied_at_tp2_pp2_passes_every_check(ws, tiny_qwen3_dir, tmp_path):
    """Qwen3: per-head q/k norms split over TP (their grads summed across it), head_dim 32 != hidden / heads as the
    kv channels, and the tied embedding meeting across the two stages."""
    ckpt = _convert(tiny_qwen3_dir, tmp_path / "c", 2, 2)
    res = _run(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"], micro_batches=2)
    assert res.passed, res.failures()
    checks = _by_name(res.checks)
    assert len(checks) == 6 and all(c["passed"] for c in checks.values())
    assert checks["loss vs HF"]["value"] <= 1e-5 and checks["grad norm vs HF"]["value"] <= 1e-5
    assert (res.facts["tp"], res.facts["pp"]) == (2, 2)
    assert res.facts["losses"][1] < res.facts["losses"][0]


def test_llama31_rope_scaling_at_tp2_passes_every_check(ws, tiny_llama31_dir, tmp_path):
    """Llama-3.1's llama3 rope scaling (factor 8, every frequency band populated) built into GPTModel at TP2. On
    these 32-token rows a GPTModel without the scaling still meets the HF loss, but its grad norm (1e-4 off) and
    its parameters after the steps (3e-3 off) fail their checks."""
    ckpt = _convert(tiny_llama31_dir, tmp_path / "c", 2, 1)
    res = _run(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert res.passed, res.failures()
    checks = _by_name(res.checks)
    assert len(checks) == 6 and all(c["passed"] for c in checks.values())
    assert checks["loss vs HF"]["value"] <= 1e-5 and checks["grad norm vs HF"]["value"] <= 1e-5
    assert res.facts["tp"] == 2


def test_glm4_at_tp2_passes_every_check(ws, tiny_glm4_dir, tmp_path):
    """GLM-4 (HF-native `glm`): q/k/v biases split over TP, the fused gate_up_proj as fc1, rotary on half of each
    head, interleaved."""
    fam_models.require("glm")
    ckpt = _convert(tiny_glm4_dir, tmp_path / "c", 2, 1)
    res = _run(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert res.passed, res.failures()
    checks = _by_name(res.checks)
    assert len(checks) == 6 and all(c["passed"] for c in checks.values())
    assert checks["loss vs HF"]["value"] <= 1e-5 and checks["grad norm vs HF"]["value"] <= 1e-5
    assert res.facts["tp"] == 2


def test_llama31_rope_scaling_megatron_core_cannot_build_is_refused(ws, tmp_path):
    """megatron-core 0.16 fixes the low / high frequency factors and the original positions: others refuse."""
    rope = dict(fam_models.LLAMA31_ROPE, low_freq_factor=2.0, original_max_position_embeddings=4096)
    src = fam_models.tiny_hf(tmp_path / "hf", "llama", 14, rope_scaling=rope, max_position_embeddings=131072)
    ckpt = _convert(src, tmp_path / "c", 1, 1)
    proc = _cli(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "low_freq_factor 2.0" in lines[0] and "original_max_position_embeddings 4096" in lines[0]
    assert "high_freq_factor" not in lines[0]
    assert not (tmp_path / "pf").exists()


def test_baichuan2_7b_layout_at_tp2_passes_every_check(ws, tiny_baichuan7b_dir, tmp_path):
    """Baichuan2-7B's W_pack [Q;K;V] split per TP rank, RoPE (its modeling_baichuan.py decides, at hidden 64), and
    the NormHead rows normalised at conversion: megatron-core trains a plain output layer, the HF side too."""
    from kit.train.preflight.run import NORM_HEAD_NOTE

    ckpt = _convert(tiny_baichuan7b_dir, tmp_path / "c", 2, 1)
    res = _run(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert res.passed, res.failures()
    checks = _by_name(res.checks)
    assert len(checks) == 6 and all(c["passed"] for c in checks.values())
    assert checks["loss vs HF"]["value"] <= 1e-5 and checks["grad norm vs HF"]["value"] <= 1e-5
    assert checks["params after steps"]["value"] <= 1e-4
    assert res.facts["tp"] == 2 and res.facts["losses"][1] < res.facts["losses"][0]
    assert NORM_HEAD_NOTE in res.notes
    # the trained output rows left unit norm; 03's way back in normalises them, and the check says by how much
    assert "comes back row-normalised (NormHead)" in checks["checkpoint back to HF"]["detail"]


def test_normhead_first_loss_is_hfs_but_its_training_is_not_what_megatron_core_runs(tiny_baichuan7b_dir):
    """What the preflight's NormHead note says: rows normalised once give HF's NormHead loss (check 2), but HF's
    NormHead differentiates through the normalisation, so its lm_head gradient is not the plain head's."""
    import torch
    import torch.nn.functional as F

    from kit.convert.families import BAICHUAN
    from kit.convert.hf_io import HFReader
    from kit.convert.reference import hf_forward
    from kit.convert.verify import sample_tokens
    from kit.train.preflight.reference import ForwardReference

    reader = HFReader(tiny_baichuan7b_dir)
    spec = BAICHUAN.read_config(reader.config, reader.folder)
    assert spec.norm_head and spec.position == "rope"
    sd = {k: reader.read(k).float() for k in reader.keys()}
    ids = sample_tokens(spec.vocab_size, 33)
    tokens, labels = ids[None, :-1], ids[None, 1:]
    hf = {k: v.clone().requires_grad_() for k, v in sd.items()}  # HF's NormHead: normalised in every forward
    hf_loss = F.cross_entropy(hf_forward(hf, spec, tokens[0]), labels[0])
    hf_loss.backward()
    converted = dict(sd, **{"lm_head.weight": F.normalize(sd["lm_head.weight"], dim=-1)})  # what 03 writes
    ref = ForwardReference(
        converted, spec, spec.vocab_size
    )  # the preflight's HF side (a plain head), unpadded here
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(1, 32),
             "position_ids": torch.arange(32)[None], "segments": torch.zeros(1, 32, dtype=torch.long)}  # fmt: skip
    plain_loss = ref.terms(batch)["lm"]
    plain_loss.backward()
    assert abs(float(plain_loss) - float(hf_loss)) <= 1e-6 * float(hf_loss)
    for k, p in hf.items():  # every gradient but the head's is the same
        if k != "lm_head.weight":
            assert torch.allclose(p.grad, ref.params[k].grad, rtol=1e-4, atol=1e-7), k
    g_hf, g_plain = hf["lm_head.weight"].grad, ref.params["lm_head.weight"].grad[: spec.vocab_size]
    assert float((g_hf - g_plain).norm() / g_plain.norm()) > 1e-2


def test_baichuan2_with_alibi_is_refused_in_one_line(ws, tiny_baichuan_dir, tmp_path):
    ckpt = _convert(tiny_baichuan_dir, tmp_path / "c", 2, 1)
    proc = _cli(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "alibi" in lines[0] and lines[0].startswith("error: ")


def test_checkpoint_args_mismatch_fails_the_load_check_in_one_line(ws, tiny_llama_dir, tmp_path):
    """A rank file whose QKV rows do not fit its args: the shards check fails and names the tensor."""
    import torch

    ckpt = _convert(tiny_llama_dir, tmp_path / "c", 1, 1)
    path = ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    key = "decoder.layers.0.self_attention.linear_qkv.weight"
    state["model"][key] = state["model"][key][:-16].clone()
    torch.save(state, path)
    proc = _cli(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [line for line in errors if "shards loaded" in line] and len(errors) == 1
    assert key in errors[0] and "shape (112, 64) but the model has (128, 64)" in errors[0]


def test_damaged_shard_fails_in_one_line(ws, tiny_llama_dir, tmp_path):
    ckpt = _convert(tiny_llama_dir, tmp_path / "c", 1, 1)
    path = ckpt / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = _cli(ckpt, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model_optim_rng.pt" in lines[0]
    assert not (tmp_path / "pf").exists()  # nothing that looks like a finished preflight


def test_version_check_names_the_supported_range():
    from kit.train.preflight.cpu_patches import UnsupportedMegatronError, check_version

    assert check_version("0.16.1") == "0.16.1"
    with pytest.raises(UnsupportedMegatronError, match=r"preflight supports megatron-core 0\.16\.0-0\.16\.x"):
        check_version("0.19.2")


def test_mindspeed_engine_refuses_without_npus(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kit", "megatron", "preflight", "--engine", "mindspeed"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MindSpeed-LLM" in lines[0]


def test_data_of_another_tokenizer_is_refused_in_one_line(ws, tiny_llama_dir, tmp_path):
    """Data tokenized for the demo model against a tiny Llama checkpoint: the tokenizer hashes contradict."""
    from kit.core.samples import demo_model_dir
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare

    other = prepare(
        DataConfig(
            kind="pretrain", name="other", tokenizer=str(demo_model_dir()), max_length=32, max_records=8
        ),
        get_workspace(tmp_path / "ws", model="tiny"),
        progress=False,
    )
    ckpt = _convert(tiny_llama_dir, tmp_path / "c", 1, 1)
    proc = _cli(ckpt, Path(other.hf_dir), tmp_path / "pf", ws["root"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "another tokenizer" in lines[0]


@pytest.fixture(scope="module")
def pairs_ws(tmp_path_factory, tiny_llama_dir):
    """A workspace with notebook 02's preference pairs and their MindSpeed-LLM pairwise files."""
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare

    root = tmp_path_factory.mktemp("pfdpo") / "ws"
    cfg = DataConfig(
        kind="dpo", name="pairs", tokenizer=str(tiny_llama_dir), max_length=48, template="tokenizer"
    )
    return {"root": root, "dpo": Path(prepare(cfg, get_workspace(root, model="tiny"), progress=False).hf_dir)}


# TP2 x PP2 only: it runs every part TP1 does (about 90 s on a loaded 2-core machine)
@pytest.mark.parametrize("tp, pp", [(2, 2)])
def test_dpo_pairs_log_probs_and_steps_match_the_kits_dpo_step_on_hf(
    pairs_ws, tiny_llama_dir, tmp_path, tp, pp
):
    """The pairwise files through megatron-core: each pair's chosen / rejected log-probability equals HF's, the first
    DPO loss is log 2 on both sides (reference = the starting weights), and the steps, grad norm and params match
    the kit's DPO step (kit.train.dpo) on the HF weights."""
    import math

    ckpt = _convert(tiny_llama_dir, tmp_path / "c", tp, pp)
    res = _run(ckpt, pairs_ws["dpo"], tmp_path / "pf", pairs_ws["root"], mbs=2, micro_batches=2, dpo_beta=0.5)
    assert res.passed, res.failures()
    checks = _by_name(res.checks)
    assert list(checks) == ["shards loaded", "log-probs vs HF", "loss vs HF", "grad norm vs HF",
                            "losses over steps", "params after steps", "checkpoint back to HF"]  # fmt: skip
    assert checks["log-probs vs HF"]["value"] <= 1e-5 and "8 pairs" in checks["log-probs vs HF"]["detail"]
    losses = res.facts["losses"]
    assert res.facts["data_kind"] == "dpo" and (res.facts["tp"], res.facts["pp"]) == (tp, pp)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(losses[1] - math.log(2)) > 1e-4  # the first step moved the policy away from the reference


def test_dpo_log_probs_row_fails_on_a_difference_or_a_missing_pair():
    """The row the DPO case depends on: off by more than 1e-5 relative, or a pair no rank reported, fails."""
    import torch

    from kit.train.preflight.dpo import logps_check
    from kit.train.preflight.run import PreflightConfig

    hf = torch.tensor([[-50.0, -60.0], [-40.0, -45.0]])
    same = [{"pair_logps": [[0, -50.0, -60.0]]}, {"pair_logps": [[1, -40.0, -45.0]]}, {}]
    assert logps_check(same, hf, 1e-5)["passed"]
    off = [{"pair_logps": [[0, -50.0, -60.0], [1, -40.0, -45.01]]}]
    row = logps_check(off, hf, 1e-5)
    assert not row["passed"] and row["value"] == pytest.approx(0.01 / 45, rel=1e-4)
    assert "pair 1 rejected" in row["detail"]
    missing = logps_check([{"pair_logps": [[0, -50.0, -60.0]]}], hf, 1e-5)
    assert not missing["passed"] and missing["detail"] == "the ranks reported 1 of 2 pairs"
    assert PreflightConfig(dpo_beta=0.0, dpo_label_smoothing=0.5).problems() == [
        "DPO_BETA=0.0 must be > 0 (0.1 is usual).",
        "DPO_LABEL_SMOOTHING=0.5 must be in [0, 0.5).",
    ]
