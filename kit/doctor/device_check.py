"""`python -m kit device-check`: the checks to run the day a card is there, in a few minutes, on any device.

1. ops: every kit op on this device (torch_npu kernels on NPU) against the float64 portable path
   (`kit.ops.parity_report`), in float32 and in the device's training dtype;
2. model parity: a small causal LM adapted with kit ops vs the same model unadapted, logits on this device;
3. data parallel: 2 launched ranks (HCCL/NCCL) for 2 steps, if 2 cards are visible (skipped otherwise);
4. adapted training: a few steps of SFT on packed sample dialogs (varlen attention), loss must fall;
5. profile: those steps under `kit.profiling.profile`, the trace must be written.
One JSON (every row, the device, timings) and one printed table. On CPU it checks the torch branch of each op.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Union

PathLike = Union[str, Path]
TOLERANCE = {
    "float32": 1e-4,
    "bfloat16": 5e-2,
    "float16": 2e-2,
}  # whole-model logits, relative to max |logit|


@dataclass
class Row:
    """One check: section, name, ok (None = skipped), the measured value, and what it means."""

    section: str
    name: str
    ok: Optional[bool]
    value: str = ""
    detail: str = ""
    seconds: float = 0.0


def _status(ok: Optional[bool]) -> str:
    return "skip" if ok is None else ("ok" if ok else "FAIL")


def format_table(rows: list) -> str:
    """The rows as a fixed-width text table."""
    head = f"{'section':<17} {'check':<44} {'result':<6} {'value':<26} {'s':>6}  detail"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.section:<17} {r.name[:44]:<44} {_status(r.ok):<6} {r.value[:26]:<26} {r.seconds:>6.1f}  {r.detail}"
        )
    return "\n".join(lines)


def _ops(info, dtypes) -> list:
    import torch

    from kit.ops.parity import parity_report

    rows = []
    for dtype in dtypes:
        t0 = time.perf_counter()
        for r in parity_report(dtype=getattr(torch, dtype)):
            rows.append(
                Row(
                    "ops",
                    f"{r['op']} [{r['dtype']}]",
                    bool(r["ok"]),
                    f"rel err {r['max_rel_err']:.1e}",
                    f"{r['backend']} on {r['device']}, tolerance {r['tolerance']:.0e}",
                )
            )
        if rows:
            rows[-1].seconds = time.perf_counter() - t0
    return rows


def _model_parity(info, model_path: Path) -> list:
    import copy

    import torch

    from kit.adapt import adapt_model
    from kit.system.hf_compat import load_causal_lm

    rows = []
    device = torch.device(info.device)
    for dtype in dict.fromkeys(["float32", info.dtype]):
        t0 = time.perf_counter()
        base = load_causal_lm(model_path).to(device=device, dtype=getattr(torch, dtype)).eval()
        adapted = copy.deepcopy(base)
        report = adapt_model(adapted)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(5, int(base.config.vocab_size), (2, 48), generator=gen).to(device)
        with torch.no_grad():
            want, got = base(input_ids=ids).logits.double(), adapted(input_ids=ids).logits.double()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
        ok = err <= TOLERANCE[dtype] and not report.skipped
        detail = f"backend {report.backend}, {report.attention_path} attention, {report.mlps} MLPs"
        if report.skipped:
            detail += f"; skipped: {report.skipped[0]}"
        rows.append(
            Row(
                "model parity",
                f"adapted vs plain logits [{dtype}]",
                ok,
                f"rel err {err:.1e}",
                detail,
                time.perf_counter() - t0,
            )
        )
    return rows


def _train_config(model_path: Path, data: Path, work: Path, name: str, steps: int, **kw):
    from kit.train import TrainConfig

    base = dict(
        run_type="sft",
        model_type=name,
        model_path=str(model_path),
        dataset_path=str(data),
        work_dir=str(work),
        train_iters=steps,
        mbs=2,
        gbs=4,
        lr=3e-3,
        warmup_iters=1,
        seed=7,
        save_hf=False,
        overwrite=True,
        log_interval=1,
    )
    base.update(kw)
    return TrainConfig(**base)


def _data_parallel(info, model_path: Path, data: Path, work: Path) -> list:
    if info.kind not in ("npu", "cuda") or info.count < 2:
        return [
            Row(
                "data parallel",
                "2-rank step",
                None,
                "",
                f"{info.count} {info.kind} device(s) visible; needs 2",
            )
        ]
    from kit.train.launch import launch

    t0 = time.perf_counter()
    cfg = _train_config(model_path, data, work / "dp", "dp", 2, nproc_per_node=2, gbs=4, mbs=1)
    res = launch(cfg, progress=False)
    ok = res.ok and len(res.losses) == 2 and all(math.isfinite(x) for x in res.losses)
    value = " ".join(f"{x:.3f}" for x in res.losses) or f"rc {res.returncode}"
    detail = f"{info.backend} over 2 cards" if ok else " | ".join(res.tail[-3:])
    return [Row("data parallel", "2-rank step (losses)", ok, value, detail, time.perf_counter() - t0)]


def _training_and_profile(model_path: Path, data: Path, work: Path, steps: int) -> list:
    from kit.profiling import profile
    from kit.train.resolve import resolve
    from kit.train.trainer import Trainer

    t0 = time.perf_counter()
    plan = resolve(_train_config(model_path, data, work / "train", "check", steps))
    with profile(work / "profiles", wait=0, warmup=1, active=1, repeat=1, tag="device-check") as cap:
        result = Trainer(plan, step_callbacks=[cap], progress=False, echo=False).train()
    seconds = time.perf_counter() - t0
    losses = result.losses
    ok = (
        result.status == "completed"
        and len(losses) == steps
        and all(math.isfinite(x) for x in losses)
        and losses[-1] < losses[0]
    )
    rows = [
        Row(
            "adapted training",
            f"{steps} SFT steps, packed dialogs",
            ok,
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else result.status,
            result.message[:80],
            seconds,
        )
    ]
    traces = cap.traces
    rows.append(
        Row(
            "profile",
            f"capture ({cap.kind} profiler)",
            bool(traces),
            f"{len(traces)} trace(s)",
            str(cap.folder) + ("; " + "; ".join(cap.notes) if cap.notes else ""),
        )
    )
    return rows


def _prepare(work: Path, model: Optional[PathLike]) -> tuple:
    """(model folder, packed SFT data folder) in `work`: the tiny sample model unless a model is given."""
    from kit.core.samples import tiny_llama
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare

    model_path = Path(model) if model else tiny_llama(work / "tiny-llama", seed=0, overwrite=True)
    ws = get_workspace(work / "ws", model="device-check")
    cfg = DataConfig(
        kind="sft",
        name="device_check_sft",
        tokenizer=str(model_path),
        max_length=128,
        template="chatml",
        max_records=64,
        pack=True,
        overwrite=True,
    )
    return model_path, prepare(cfg, ws, progress=False).hf_dir


def run_device_check(
    json_path: Optional[PathLike] = None,
    work_dir: Optional[PathLike] = None,
    model: Optional[PathLike] = None,
    steps: int = 4,
    echo: Callable[[str], None] = print,
) -> dict:
    """Run every check on this machine's device; write `json_path` (if given); return the report dict."""
    from kit.system.device import detect

    t_start = time.perf_counter()
    info = detect()
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="kit-device-check-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list = []
    steps = max(int(steps), 3)  # the profile schedule needs warm-up + 1 active step, the loss a trend

    def section(name: str, fn, *args) -> None:
        t0 = time.perf_counter()
        try:
            rows.extend(fn(*args))
        except Exception as exc:  # one broken section must not hide the others: it becomes a failed row
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
            rows.append(Row(name, "could not run", False, "", detail[:200], time.perf_counter() - t0))

    echo(f"device check on {info.kind} ({info.name}, {info.count} visible, training dtype {info.dtype})")
    section("ops", _ops, info, list(dict.fromkeys(["float32", info.dtype])))
    prepared: list = []
    section("inputs", lambda: prepared.append(_prepare(work, model)) or [])
    if prepared:
        model_path, data = prepared[0]
        section("model parity", _model_parity, info, model_path)
        section("data parallel", _data_parallel, info, model_path, data, work)
        section("adapted training", _training_and_profile, model_path, data, work, steps)
    report = {
        "kit_device_check": 1,
        "device": info.to_dict(),
        "work_dir": str(work),
        "seconds": time.perf_counter() - t_start,
        "ok": all(r.ok is not False for r in rows),
        "counts": {s: sum(_status(r.ok) == s for r in rows) for s in ("ok", "FAIL", "skip")},
        "rows": [asdict(r) for r in rows],
    }
    echo(format_table(rows))
    c = report["counts"]
    echo(f"{c['ok']} ok, {c['FAIL']} failed, {c['skip']} skipped in {report['seconds']:.0f} s")
    if json_path:
        from kit.storage.atomic import atomic_write_text

        atomic_write_text(json_path, json.dumps(report, indent=2) + "\n")
        echo(f"wrote {json_path}")
    return report


def register(sub) -> None:
    d = sub.add_parser(
        "device-check",
        help="a few minutes on the device: every op vs float64, model parity, 2-card step, adapted training, profile",
    )
    d.add_argument("--json", default=None, help="write the full report to this JSON file")
    d.add_argument(
        "--work-dir", default=None, help="folder for the model, data, run and profile (default: temp)"
    )
    d.add_argument("--model", default=None, help="HF model folder (default: a tiny seeded Llama)")
    d.add_argument("--steps", type=int, default=4, help="training steps (at least 3)")
    d.set_defaults(func=_run)


def _run(args) -> int:
    report = run_device_check(args.json, args.work_dir, args.model, args.steps)
    return 0 if report["ok"] else 1
