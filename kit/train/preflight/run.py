"""The Megatron preflight: notebook 03's shards at their TP x PP (x DP) on CPU ranks with megatron-core, fed notebook
02's Megatron files through megatron-core's dataset classes, held against the HF weights on the same tokens.

The ranks start once (kit.train.preflight.ranks through torchrun, gloo) and make every measurement; this process then compares:
shards loaded strictly, first loss and grad norm vs HF (fp32, 1e-5 relative), N steps of megatron-core's
DistributedOptimizer + OptimizerParamScheduler vs the same steps on the HF weights (losses 1e-5, parameters 1e-4),
and the Megatron checkpoint the ranks saved (`iter_XXXXXXX/mp_rank_..`), converted back to HF by notebook 03's code,
equal to the trained weights.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from kit.errors import InputError


@dataclass
class PreflightConfig:
    """What to run the Megatron preflight on; unset inputs come from the workspace's manifests."""

    checkpoint: Optional[str] = None
    """Notebook 03's converted checkpoint; None: the newest under the workspace's converted_weights/."""
    dataset_path: Optional[str] = None
    """Notebook 02's prepared-data folder with Megatron files; None: the newest in the workspace."""
    dp: int = 1
    """Data-parallel ranks (world size = TP x PP x DP); 2 or more shards the distributed optimizer; an MoE checkpoint's
    EP lives inside DP x TP (EP2 at TP1 needs DP 2)."""
    steps: int = 2
    """Optimizer steps of megatron-core's DistributedOptimizer held against the same steps on the HF weights."""
    micro_batches: int = 1
    """Micro-batches per step and data-parallel rank (through megatron-core's pipeline schedule; 2+ interleaves them)."""
    mbs: int = 1
    """Rows per micro-batch."""
    seq_len: Optional[int] = None
    """Tokens per row; None: the prepared data's max_length."""
    lr: float = 1e-3
    """Peak learning rate of the steps."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_iters: int = 0
    """Warm-up iterations (0: megatron-core's and the kit trainer's schedules agree step for step)."""
    weight_decay: float = 0.1
    """Weight decay (not on norms and biases, as megatron-core's standard overrides)."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm."""
    adam_eps: float = 1e-6
    """Adam's epsilon; above float noise, which Adam would turn into LR-sized steps where a gradient is zero in exact
    arithmetic (ChatGLM3's key bias on the unrotated half of each head)."""
    seed: int = 1234
    """Seed of megatron-core's GPTDataset sample order."""
    dpo_beta: float = 0.1
    """Preference pairs only: DPO's beta (the sigmoid loss of kit.train.dpo on both sides)."""
    dpo_label_smoothing: float = 0.0
    """Preference pairs only: DPO's label smoothing (cDPO), 0 <= x < 0.5."""
    timeout_s: int = 600
    """Wall-clock limit of the ranks (and of each collective); they are killed after it."""
    work_dir: Optional[str] = None
    """The workspace root; None: KIT_WORKSPACE, /home/ma-user/ws on ModelArts, else runs/ws."""
    model_name: str = "demo"
    """The workspace's model name."""
    output: Optional[str] = None
    """Where the report, the trained checkpoint and its HF form go; None: <workspace>/reports/megatron_preflight."""

    def problems(self) -> List[str]:
        out = []
        for name in ("dp", "steps", "micro_batches", "mbs", "timeout_s"):
            if int(getattr(self, name)) < 1:
                out.append(f"{name.upper()}={getattr(self, name)} must be at least 1.")
        if self.seq_len is not None and int(self.seq_len) < 2:
            out.append(f"SEQ_LEN={self.seq_len} must be at least 2.")
        if not self.dpo_beta > 0:
            out.append(f"DPO_BETA={self.dpo_beta} must be > 0 (0.1 is usual).")
        if not 0 <= self.dpo_label_smoothing < 0.5:
            out.append(f"DPO_LABEL_SMOOTHING={self.dpo_label_smoothing} must be in [0, 0.5).")
        return out


@dataclass
class PreflightResult:
    """Per-check rows, the measurements, and where the files are."""

    checks: List[dict]
    facts: Dict[str, Any]
    folder: Path
    wall_s: float
    notes: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks)

    def failures(self) -> List[str]:
        """One line per failed check, with the number that failed."""
        return [f"preflight check {c['check']} failed: {c['detail']}" for c in self.checks if not c["passed"]]

    def table(self):
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "check": c["check"],
                    "passed": c["passed"],
                    "value": c["value"],
                    "limit": c["limit"],
                    "detail": c["detail"],
                }
                for c in self.checks
            ]
        )

    def summary(self) -> dict:
        return {
            "passed": self.passed,
            "checks": self.checks,
            "facts": self.facts,
            "notes": self.notes,
            "folder": str(self.folder),
            "wall_s": round(self.wall_s, 1),
        }


# Baichuan2's NormHead normalises lm_head's rows at every forward; megatron-core's GPTModel has a plain output layer
NORM_HEAD_NOTE = (
    "Baichuan2 NormHead: the output rows were normalised at conversion, so the first loss is HF's NormHead loss; "
    "megatron-core trains a plain output layer, and the grad norm, steps and params are checked against HF with "
    "that plain head, not against NormHead training (which renormalises the rows every step)"
)


# what the DPO rows hold against, and what they leave to MindSpeed-LLM (kit.train.preflight.dpo)
DPO_NOTE = (
    "DPO: megatron-core's GPTModel gives each pair's chosen / rejected log-probability (its per-token cross-entropy "
    "summed over the answer tokens) and the kit's sigmoid DPO loss of them; the reference log-probabilities are the "
    "starting weights' (a forward-only pass before the first step, as the kit's precompute), so the first loss is "
    "log 2 on both sides and the log-probs row is what tests the model; not run: MindSpeed-LLM's own DPOTrainer "
    "(its frozen --ref-model run beside the policy in one batch, its log-prob gather over TP)"
)


def mindspeed_refusal() -> str:
    """Why `--engine mindspeed` cannot run here (it needs MindSpeed-LLM and NPUs), in one line."""
    import importlib.util

    missing = [
        n
        for n, m in (("MindSpeed-LLM", "mindspeed_llm"), ("torch_npu", "torch_npu"))
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        return (
            f"--engine mindspeed runs the plan's MindSpeed-LLM command on NPUs; {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed here: use the default engine (megatron-core on CPU)."
        )
    return "--engine mindspeed is not implemented yet: run `python -m kit train megatron --execute` for a few iterations."


def inputs_missing(cfg: PreflightConfig) -> Optional[str]:
    """Why the preflight has nothing to run on (no converted checkpoint or Megatron data), or None when it has."""
    from kit.train.preflight.inputs import inputs_missing as missing

    return missing(cfg)


def launch(job: dict) -> List[dict]:
    """Start the world's ranks once through torchrun (`python -m kit.train.preflight.ranks`, gloo) and wait at most
    timeout_s; SIGTERM/SIGINT to this process stop them (kit.system.procs.running) and end in KeyboardInterrupt. No
    rank outlives this call."""
    import os

    from kit.system.procs import free_port, running, torchrun_command

    out = Path(job["out"])
    (out / "job.json").write_text(json.dumps(job), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), CUDA_VISIBLE_DEVICES="")
    cmd = torchrun_command(
        ["-m", "kit.train.preflight.ranks", str(out / "job.json")], job["world"], free_port()
    )
    deadline = time.monotonic() + job["timeout_s"]
    # torchrun stops every rank when one fails (the others would wait for it) and when it is stopped itself
    with open(out / "launcher.log", "a", encoding="utf-8") as log, running(cmd, 60.0, env=env) as proc:
        for line in proc.lines(lambda text: log.write(f"kit: {text}\n")):
            log.write(line)
            if time.monotonic() > deadline and proc.stopped_by is None:
                raise InputError(
                    f"the {job['world']} preflight ranks did not finish within {job['timeout_s']} s (TIMEOUT_S); "
                    f"they were stopped (logs: {out}/rank_*.log)."
                )
    if proc.stopped_by is not None:
        raise KeyboardInterrupt(f"the preflight was stopped by {proc.stopped_by}; no rank is left")
    results = []
    for r in range(job["world"]):
        path = out / f"rank_{r}.json"
        if not path.is_file():
            log_r = out / f"rank_{r}.log"
            text = log_r.read_text(encoding="utf-8", errors="replace") if log_r.is_file() else ""
            tail = text.strip().splitlines()
            raise InputError(
                f"preflight rank {r} wrote no result (torchrun exited with code {proc.returncode}): "
                f"{tail[-1] if tail else 'no output'} (logs {out}/rank_{r}.log, {out}/launcher.log)"
            )
        results.append(json.loads(path.read_text(encoding="utf-8")))
    return results


def run(cfg: PreflightConfig) -> PreflightResult:
    """Run the preflight (see the module doc); the result says which checks passed."""
    from kit.core.configs import check
    from kit.train.preflight.checks import compare
    from kit.train.preflight.cpu_patches import check_version
    from kit.train.preflight.inputs import build_job, resolve_inputs

    check(cfg, "the Megatron preflight config")
    version = check_version()
    t0 = time.monotonic()
    ckpt, reader, facts, data_folder, out = resolve_inputs(cfg)
    if out.exists() and not (out / "preflight.json").is_file():
        raise InputError(
            f"--output {out} exists and is not an earlier preflight's folder; give a new folder."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".preflight-", dir=str(out.parent)))
    try:
        job = build_job(cfg, reader, facts, work)
        t = time.monotonic()
        results = launch(job)
        ranks_wall = round(time.monotonic() - t, 1)
        checks, extra = compare(job, results, work)
        facts_out = {
            "megatron_core": version,
            "checkpoint": str(ckpt),
            "dataset_path": str(data_folder),
            "data_kind": job["data"]["kind"],
            "tp": job["tp"],
            "pp": job["pp"],
            "dp": job["dp"],
            **({"ep": job["ep"], "etp": job["etp"], "moe": job["moe"]} if job.get("moe") else {}),
            "layer_list": job["layer_list"],
            "vocab_size": job["vocab_size"],
            "padded_vocab_size": job["padded_vocab_size"],
            "seq_len": job["seq_len"],
            "steps": job["steps"],
            "micro_batches": job["micro_batches"],
            **extra,
        }
        facts_out["seconds"] = {"ranks (wall)": ranks_wall, **facts_out.get("seconds", {})}
        notes = [
            f"vocabulary padded {job['vocab_size']} -> {job['padded_vocab_size']}: the HF reference's embedding and "
            f"output rows are padded with the same zero rows, so both softmaxes run over {job['padded_vocab_size']} "
            f"columns"
            if job["padded_vocab_size"] > job["vocab_size"]
            else "vocabulary not padded",
            f"HF side: {extra.get('hf_side', 'not run')}",
            "what this does not prove: NPU kernels (flash attention, fused RMSNorm/SwiGLU/RoPE), HCCL, "
            "MindSpeed-LLM's own patches",
        ]
        if job["spec"].get("norm_head"):
            notes.append(NORM_HEAD_NOTE)
        if job.get("dpo"):
            notes.append(DPO_NOTE)
        # kept: the report, the ranks' logs and the trained Megatron checkpoint; the rest was the checks' scratch
        (work / "batches.pt").unlink(missing_ok=True)
        for scratch in [*work.glob("cache_*"), work / "reference_hf", work / "trained_hf"]:
            shutil.rmtree(scratch, ignore_errors=True)
        result = PreflightResult(checks, facts_out, out, time.monotonic() - t0, notes)
        (work / "preflight.json").write_text(json.dumps(result.summary(), indent=2, default=str) + "\n")
        if out.exists():  # an earlier preflight's report, replaced only by a complete one
            shutil.rmtree(out)
        work.rename(out)  # complete: only now under its name
        result.folder = out
        return result
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
