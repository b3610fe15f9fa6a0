"""Read torch.profiler (Kineto) Chrome traces `*.pt.trace.json[.gz]` into the same kernel table as Ascend data.

A trace is a dict with `traceEvents` (torch 2.x `torch.profiler.tensorboard_trace_handler`'s Chrome trace). Device kernels (`cat` kernel, gpu_memcpy,
gpu_memset) become rows with core "GPU" and type = the torch op that launched them (matched by `External id`);
a CPU-only trace has none, so its rows are the `cpu_op` events with their *self* time (children subtracted),
core "CPU". Steps come from the `ProfilerStep#N` annotations the profiler schedule adds.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd

from kit.profiling.profile_data import KERNEL_COLUMNS, ProfileData, ProfileError

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def read_trace_json(path: Path):
    """Parse a (possibly gzipped) JSON trace; ProfileError for truncated or corrupt files."""
    path = Path(path)
    try:
        raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
        return json.loads(raw)
    except (OSError, EOFError, ValueError) as exc:
        raise ProfileError(
            f"{path} is not a complete JSON trace ({type(exc).__name__}: {str(exc)[:160]}); the "
            f"profiler was probably stopped while writing it. Collect again (let the `with` block "
            f"finish, or call .stop())."
        ) from exc


def _self_times(ops: pd.DataFrame) -> np.ndarray:
    """Self time of nested cpu_op intervals per thread: duration minus the durations of direct children."""
    self_t = ops["dur"].to_numpy(dtype="float64").copy()
    for _, idx in ops.groupby(["pid", "tid"], sort=False).indices.items():
        order = idx[np.lexsort((-ops["dur"].to_numpy()[idx], ops["ts"].to_numpy()[idx]))]
        stack: list = []  # (end, row)
        ts, dur = ops["ts"].to_numpy(), ops["dur"].to_numpy()
        for i in order:
            while stack and ts[i] >= stack[-1][0]:
                stack.pop()
            if stack:
                self_t[stack[-1][1]] -= dur[i]
            stack.append((ts[i] + dur[i], i))
    return np.maximum(self_t, 0.0)


def load_kineto(path: Path) -> ProfileData:
    """Read one Kineto trace file into a ProfileData (kind 'torch')."""
    path = Path(path)
    doc = read_trace_json(path)
    if isinstance(doc, list):
        raise ProfileError(
            f"{path} is a top-level JSON list: that is an Ascend trace_view.json, not a torch.profiler "
            f"trace. Load its *_ascend_pt folder instead."
        )
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise ProfileError(
            f"{path} has no 'traceEvents': not a torch.profiler trace (export_chrome_trace or "
            f"tensorboard_trace_handler output)."
        )
    ev = pd.DataFrame([e for e in doc["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"])
    if ev.empty:
        raise ProfileError(
            f"{path} holds no complete ('X') events: the schedule never reached an active step. "
            f"Run at least wait+warmup+active steps and call .step() after each."
        )
    for c in ("cat", "args", "pid", "tid"):
        if c not in ev.columns:
            ev[c] = None
    ev["ts"] = pd.to_numeric(ev["ts"], errors="coerce")
    ev["dur"] = pd.to_numeric(ev["dur"], errors="coerce")
    bad_ts, bad_dur = ev["ts"].isna(), ev["dur"].isna() | (ev["dur"] < 0)
    warnings: list = []
    n_read = len(ev)
    if (bad_ts | bad_dur).any():
        warnings.append(
            f"{path.name}: {int((bad_ts | bad_dur).sum())} of {n_read} complete event(s) dropped "
            f"({int(bad_ts.sum())} without a numeric ts, {int((bad_dur & ~bad_ts).sum())} with a missing or "
            f"negative dur)."
        )
    ev = ev[~(bad_ts | bad_dur)].reset_index(drop=True)
    cat = ev["cat"].astype("string").fillna("")
    steps = ev[(cat == "user_annotation") & ev["name"].astype("string").str.startswith("ProfilerStep#")]
    steps = steps.assign(step=steps["name"].str.split("#").str[1].astype("int64")).sort_values("ts")

    dev = ev[cat.isin(DEVICE_CATS)].copy()
    step_ts = None
    if len(dev):
        ops = ev[cat == "cpu_op"]
        ext_of = {
            (a or {}).get("External id"): (n, t) for n, t, a in zip(ops["name"], ops["ts"], ops["args"])
        }
        launch = [ext_of.get((a or {}).get("External id")) for a in dev["args"]]
        dev["type"] = [x[0] if x else n for x, n in zip(launch, dev["name"])]
        # kernels run after their launch, often past the step's end on the host: use the launching op's time
        step_ts = np.array([x[1] if x else t for x, t in zip(launch, dev["ts"])], dtype=float)
        dev["core"] = "GPU"
        rows = dev
    else:
        rows = ev[cat == "cpu_op"].copy()
        if rows.empty:
            raise ProfileError(f"{path} has no cpu_op or kernel events; nothing to analyse.")
        rows["dur"] = _self_times(rows.reset_index(drop=True))
        rows["type"] = rows["name"]
        rows["core"] = "CPU"
    kernels = pd.DataFrame(
        {
            "name": rows["name"].astype("string"),
            "type": rows["type"].astype("string"),
            "core": rows["core"].astype("string"),
            "start_us": rows["ts"].astype("float64"),
            "dur_us": rows["dur"].astype("float64"),
        }
    )
    kernels["step"] = _step_of(kernels["start_us"].to_numpy() if step_ts is None else step_ts, steps)
    for c in KERNEL_COLUMNS:
        if c not in kernels.columns:
            kernels[c] = float("nan")
    step_trace = None
    if len(steps):
        step_trace = pd.DataFrame(
            {"step": steps["step"].to_numpy(), "total_us": steps["dur"].to_numpy(dtype=float)}
        )
    meta = {
        k: doc[k]
        for k in ("schemaVersion", "deviceProperties", "host_name", "baseTimeNanoseconds")
        if k in doc
    }
    return ProfileData(
        kind="torch",
        path=path,
        kernels=kernels[KERNEL_COLUMNS].reset_index(drop=True),
        step_trace=step_trace,
        meta=meta,
        files={"trace": path},
        warnings=warnings,
        rows={
            path.name: {
                "read": n_read,
                "used": len(ev),
                "dropped": {"invalid ts or dur": int((bad_ts | bad_dur).sum())}
                if (bad_ts | bad_dur).any()
                else {},
            }
        },
    )


def _step_of(ts: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """Step number of each timestamp: the ProfilerStep window it falls in (NaN outside every window)."""
    out = np.full(len(ts), np.nan)
    if steps.empty:
        return out
    start = steps["ts"].to_numpy(dtype=float)
    end = start + steps["dur"].to_numpy(dtype=float)
    i = np.searchsorted(start, ts, side="right") - 1
    ok = (i >= 0) & (ts <= end[np.clip(i, 0, None)])
    out[ok] = steps["step"].to_numpy()[i[ok]]
    return out
