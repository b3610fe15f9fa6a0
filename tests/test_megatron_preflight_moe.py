"""`python -m kit megatron preflight` on a converted tiny Qwen3-MoE at TP x PP x EP: megatron-core 0.16's MoE
GPTModel (SequentialMLP experts, alltoall dispatcher) on 4 CPU gloo ranks against transformers' own Qwen3-MoE.

One launch per layout (4 ranks on a 2-core machine are slow); the data and the checkpoints are module fixtures. The
refusal of an EP that does not fit the ranks needs no launch.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.convert import families as fam_models

pytest.importorskip(
    "megatron.core", reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)"
)
pytestmark = pytest.mark.slow

tiny_qwen3_moe_dir = fam_models.tiny_qwen3_moe_dir  # shared session fixture

CHECKS = ["shards loaded", "loss vs HF", "grad norm vs HF", "aux loss vs HF", "losses over steps",
          "params after steps", "checkpoint back to HF"]  # fmt: skip


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tiny_qwen3_moe_dir):
    """A workspace with notebook 02's pretraining data and packed fine-tuning data, the MoE model's tokenizer."""
    fam_models.require("qwen3_moe")
    from test_megatron_preflight import data_workspace

    return data_workspace(tmp_path_factory.mktemp("pfmoe") / "ws", str(tiny_qwen3_moe_dir))


def _convert(src, out: Path, tp: int, pp: int, ep: int) -> Path:
    from kit.convert import ConvertConfig, hf_to_megatron

    hf_to_megatron(ConvertConfig(str(src), str(out), tp=tp, pp=pp, ep=ep), progress=False)
    return out


@pytest.fixture(scope="module")
def pp2_ep2(tmp_path_factory, tiny_qwen3_moe_dir) -> Path:
    return _convert(tiny_qwen3_moe_dir, tmp_path_factory.mktemp("moe") / "tp1pp2ep2", 1, 2, 2)


def _cli(ckpt: Path, data: Path, out: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kit", "megatron", "preflight", "--checkpoint", str(ckpt), "--dataset-path",
            str(data), "--output", str(out), "--work-dir", str(root), "--model-name", "tiny", *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=900)


def test_tp1_pp2_ep2_pretraining_data_passes_every_check(ws, pp2_ep2, tmp_path):
    """4 ranks: 2 stages x 2 data-parallel ranks, the 4 experts of each layer split over those 2 as EP."""
    out = tmp_path / "pf"
    proc = _cli(pp2_ep2, ws["pretrain"], out, ws["root"], "--dp", "2", "--micro-batches", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "preflight.json").read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert list(checks) == CHECKS and all(c["passed"] for c in checks.values())
    for name in ("loss vs HF", "grad norm vs HF", "aux loss vs HF", "losses over steps"):
        assert checks[name]["value"] <= 1e-5, checks[name]
    assert checks["params after steps"]["value"] <= 1e-4
    facts = report["facts"]
    assert (facts["tp"], facts["pp"], facts["ep"], facts["dp"]) == (1, 2, 2, 2)
    assert facts["moe"]["dispatcher"] == "alltoall" and facts["moe"]["num_experts"] == 4
    losses = facts["losses"]
    assert all(math.isfinite(x) for x in losses + facts["grad_norms"]) and losses[1] < losses[0]
    # every layer's aux loss, from megatron-core's tracker; transformers' pooled definition is another number
    assert len(facts["aux_losses"][0]) == 4 and all(x > 0 for x in facts["aux_losses"][0])
    hf_own = facts["hf_load_balancing_loss"][0]
    assert abs(hf_own - sum(facts["aux_losses"][0])) > 0.1
    assert "4 rank files" in checks["shards loaded"]["detail"]
    ranks = sorted(p.name for p in (out / "checkpoint" / "iter_0000002").iterdir())
    assert ranks == ["mp_rank_00_000_000", "mp_rank_00_000_001", "mp_rank_00_001_000", "mp_rank_00_001_001"]
    assert "aux loss vs HF" in proc.stdout and "passed" in proc.stdout


def test_tp2_ep2_packed_fine_tuning_data(ws, tiny_qwen3_moe_dir, tmp_path):
    """TP2 x EP2 x DP2: sequence parallel (megatron-core's MoE needs it at TP > 1), experts split over TP too, the
    alltoall dispatcher's uneven gathers over TP; packed rows, so the HF side attends inside each dialog."""
    from kit.train.preflight.run import PreflightConfig, run

    ckpt = _convert(tiny_qwen3_moe_dir, tmp_path / "c", 2, 1, 2)
    res = run(PreflightConfig(checkpoint=str(ckpt), dataset_path=str(ws["sft"]), output=str(tmp_path / "pf"),
                              work_dir=str(ws["root"]), model_name="tiny", dp=2, micro_batches=2))  # fmt: skip
    assert res.passed, res.failures()
    checks = {c["check"]: c for c in res.checks}
    assert list(checks) == CHECKS
    assert checks["loss vs HF"]["value"] <= 1e-5 and checks["grad norm vs HF"]["value"] <= 1e-5
    assert (res.facts["tp"], res.facts["ep"], res.facts["data_kind"]) == (2, 2, "sft")
    assert res.facts["losses"][1] < res.facts["losses"][0]
    shards, numel = res.facts["optimizer_shard_numel"], res.facts["model_numel"]
    assert len(shards) == 4 and all(
        0 < s < m for s, m in zip(shards, numel)
    )  # the distributed optimizer shards


def test_ep_that_does_not_fit_the_ranks_is_refused_in_one_line(ws, pp2_ep2, tmp_path):
    """EP2 at TP1 x PP2 needs 2 data-parallel ranks (megatron-core keeps EP inside DP): DP=1 is one line."""
    proc = _cli(pp2_ep2, ws["pretrain"], tmp_path / "pf", ws["root"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "EP2" in lines[0] and "DP=1" in lines[0] and "EP sizes that fit" in lines[0]
    assert not (tmp_path / "pf").exists()
