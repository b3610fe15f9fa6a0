"""Read torch_npu's `*_ascend_pt/ASCEND_PROFILER_OUTPUT/` into normalised tables, tolerating header drift.

Drift handled (shared/reference/profiling_env.md A3): `Block Dim` (older torch_npu) vs `Block Num` (2.13),
optional `Step Id` / `Device_id`, CANN op_summary names (`Op Name`, `OP Type`, `Task Type`, `Task Duration(us)`),
`N/A` and empty cells, numbers with a trailing tab, ratio columns matched by pattern (`aic_mac_ratio` or
`aic_cube_ratio`, legacy un-prefixed `vec_ratio`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pandas as pd

from kit.profiling.data import KERNEL_COLUMNS, ProfileData, ProfileError

OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
# header (tabs/spaces stripped) -> normalised column; several spellings map to one name.
KERNEL_HEADER_MAP = {
    "Step Id": "step",
    "Device_id": "device",
    "Name": "name",
    "Op Name": "name",
    "Type": "type",
    "OP Type": "type",
    "Accelerator Core": "core",
    "Task Type": "core",
    "Start Time(us)": "start_us",
    "Task Start Time(us)": "start_us",
    "Duration(us)": "dur_us",
    "Task Duration(us)": "dur_us",
    "Wait Time(us)": "wait_us",
    "Task Wait Time(us)": "wait_us",
    "Block Num": "block_dim",
    "Block Dim": "block_dim",
    "Mix Block Num": "mix_block_dim",
    "Mix Block Dim": "mix_block_dim",
}
RATIO_PATTERN = re.compile(r"^((aic|aiv)_[a-z0-9]+|vec|mac|cube|scalar|mte1|mte2|mte3|fixpipe)_ratio$")
REQUIRED_KERNEL = ["name", "type", "core", "dur_us"]
NUMERIC = ["step", "device", "start_us", "dur_us", "wait_us", "block_dim", "mix_block_dim"]
OP_STAT_MAP = {
    "OP Type": "type",
    "Core Type": "core",
    "Count": "calls",
    "Total Time(us)": "total_us",
    "Min Time(us)": "min_us",
    "Avg Time(us)": "avg_us",
    "Max Time(us)": "max_us",
    "Ratio(%)": "share_pct",
    "Device_id": "device",
}
STEP_MAP = {
    "Step": "step",
    "Device_id": "device",
    "Computing": "computing_us",
    "Communication(Not Overlapped)": "communication_us",
    "Free": "free_us",
}
NA_VALUES = ["N/A", "NA", "n/a", "", "\t"]


def _canon(header: str) -> Optional[str]:
    """Normalised name for a kernel_details header, or None when the analyzer does not need it."""
    h = str(header).strip().strip("\ufeff").strip()
    if h in KERNEL_HEADER_MAP:
        return KERNEL_HEADER_MAP[h]
    return h if RATIO_PATTERN.match(h) else None


def _read_csv(path: Path, usecols=None) -> pd.DataFrame:
    """pandas.read_csv with the profiler's N/A spellings, turning parser errors into ProfileError."""
    try:
        return pd.read_csv(path, usecols=usecols, na_values=NA_VALUES, keep_default_na=True, low_memory=False)
    except pd.errors.EmptyDataError as exc:
        raise ProfileError(
            f"{path} is empty (0 bytes or no header); the profiler did not finish writing it. "
            f"Re-run the parse (torch_npu.profiler.profiler.analyse) or collect again."
        ) from exc
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise ProfileError(
            f"{path} is not a readable CSV ({type(exc).__name__}: {str(exc)[:200]}); it may be "
            f"truncated or corrupt. Parse the raw data again or collect a new profile."
        ) from exc


def _to_number(df: pd.DataFrame, cols: list, path: Path, notes: list) -> None:
    """Make `cols` numeric in place; strip tabs/spaces first when pandas left text; count unparseable cells."""
    for c in cols:
        if c not in df.columns or pd.api.types.is_numeric_dtype(df[c]):
            continue
        raw = df[c].astype("string").str.strip()
        num = pd.to_numeric(raw, errors="coerce")
        bad = int((num.isna() & raw.notna() & ~raw.isin(NA_VALUES)).sum())
        if bad:
            notes.append(f"{path.name}: {bad} non-numeric value(s) in column {c!r} read as missing")
        df[c] = num.astype("float64")


def _labels(col: pd.Series) -> pd.Series:
    """A text column as a stripped categorical: a few hundred distinct names over millions of rows."""
    cat = pd.Categorical(col.fillna("N/A"))
    return pd.Series(cat.map(lambda v: str(v).strip() or "N/A"), index=col.index).astype("category")


def read_kernel_details(path: Path, notes: Optional[list] = None) -> pd.DataFrame:
    """kernel_details.csv (or a CANN op_summary_*.csv) -> one row per kernel with KERNEL_COLUMNS + ratio columns."""
    notes = notes if notes is not None else []
    path = Path(path)
    df = _read_csv(path, usecols=lambda h: _canon(h) is not None)
    df.columns = [_canon(c) for c in df.columns]
    df = df.loc[:, ~pd.Index(df.columns).duplicated()]  # both Block Dim and Block Num: keep the first
    missing = [c for c in REQUIRED_KERNEL if c not in df.columns]
    if missing:
        raise ProfileError(
            f"{path} lacks column(s) {missing} (needs the kernel_details.csv headers Name, Type, Accelerator Core, "
            f"Duration(us), or the CANN op_summary spellings). Check that this is a kernel_details.csv written by "
            f"torch_npu with the NPU activity on (activities=[CPU, NPU])."
        )
    ratio_cols = [c for c in df.columns if RATIO_PATTERN.match(c)]
    _to_number(df, NUMERIC + ratio_cols, path, notes)
    for c in ("name", "type", "core"):
        df[c] = _labels(df[c])
    for c in KERNEL_COLUMNS:
        if c not in df.columns:
            df[c] = float("nan")
    na_type = float((df["type"] == "N/A").mean()) if len(df) else 0.0
    if na_type >= 0.5:
        notes.append(
            f"{path.name}: Type is N/A on {na_type:.0%} of the rows (CANN does this when task_time=l0, "
            f"e.g. some Level0 captures): the Cast and AI_CPU rules only see the other rows. Collect with "
            f"level='Level1' for operator types."
        )
    n_bad = int(df["dur_us"].isna().sum())
    if n_bad:
        notes.append(f"{path.name}: {n_bad} row(s) without a duration dropped")
        df = df[df["dur_us"].notna()]
    return df[KERNEL_COLUMNS + [c for c in df.columns if c not in KERNEL_COLUMNS]].reset_index(drop=True)


def read_op_statistic(path: Path, notes: Optional[list] = None) -> pd.DataFrame:
    """op_statistic.csv -> type, core, calls, total_us, min_us, avg_us, max_us, share_pct (optional device)."""
    notes = notes if notes is not None else []
    df = _read_csv(path)
    df.columns = [OP_STAT_MAP.get(str(c).strip(), str(c).strip()) for c in df.columns]
    missing = [c for c in ("type", "calls", "total_us", "max_us") if c not in df.columns]
    if missing:
        raise ProfileError(
            f"{path} lacks column(s) {missing}; expected OP Type, Core Type, Count, Total Time(us), "
            f"Min/Avg/Max Time(us), Ratio(%)."
        )
    _to_number(df, ["calls", "total_us", "min_us", "avg_us", "max_us", "share_pct", "device"], path, notes)
    if "core" not in df.columns:
        df["core"] = "N/A"
    for c in ("type", "core"):
        df[c] = df[c].astype("string").str.strip().fillna("N/A")
    return df


def read_step_trace(path: Path, notes: Optional[list] = None) -> Optional[pd.DataFrame]:
    """step_trace_time.csv -> step, computing_us, communication_us, free_us, total_us (None when empty)."""
    notes = notes if notes is not None else []
    df = _read_csv(path)
    df.columns = [STEP_MAP.get(str(c).strip(), str(c).strip()) for c in df.columns]
    missing = [c for c in ("computing_us", "free_us") if c not in df.columns]
    if missing:
        notes.append(f"{path.name}: no {missing} column(s); step breakdown skipped")
        return None
    if "communication_us" not in df.columns:
        df["communication_us"] = 0.0
    if "step" not in df.columns:
        df["step"] = float("nan")
    _to_number(df, ["step", "computing_us", "communication_us", "free_us"], path, notes)
    df = df[["step", "computing_us", "communication_us", "free_us"]].fillna({"communication_us": 0.0})
    df["total_us"] = df["computing_us"] + df["communication_us"] + df["free_us"]
    return df if len(df) else None


def core_counts(pt_dir: Path) -> dict:
    """AI Core / vector core counts from PROF_*/device_*/info.json.* (`ai_core_num`, `aiv_num`), if present."""
    found: dict = {}

    def walk(obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k in ("ai_core_num", "aiv_num") and str(v).strip().isdigit():
                    found.setdefault(k, int(str(v).strip()))
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    for info in sorted(pt_dir.glob("PROF_*/device_*/info.json*")):
        try:
            walk(json.loads(info.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    out = {}
    if "ai_core_num" in found:
        out["AI_CORE"] = out["MIX_AIC"] = found["ai_core_num"]
    if "aiv_num" in found:
        out["AI_VECTOR_CORE"] = out["MIX_AIV"] = found["aiv_num"]
    return out


def output_state(pt_dir: Path) -> str:
    """'ready', 'unfinished' (parse started, no analyse.done) or 'unparsed' (raw data only)."""
    out = pt_dir / OUTPUT_DIR
    if not out.is_dir():
        return "unparsed"
    return "ready" if (out / "analyse.done").exists() else "unfinished"


def load_ascend(pt_dir: Path, allow_unfinished: bool = False) -> ProfileData:
    """Read one `*_ascend_pt` folder; explain what is missing when it was not (fully) parsed."""
    pt_dir = Path(pt_dir)
    state = output_state(pt_dir)
    raw = sorted(p.name for p in pt_dir.glob("PROF_*")) + (
        ["FRAMEWORK"] if (pt_dir / "FRAMEWORK").exists() else []
    )
    if state == "unparsed":
        raise ProfileError(
            f"{pt_dir} has no {OUTPUT_DIR}/ (raw data: {raw or 'none'}). It was collected with analyse_flag=False or "
            f"the parse failed. On the NPU machine, with CANN's set_env.sh sourced (msprof on PATH), run "
            f"`python -c \"from torch_npu.profiler.profiler import analyse; analyse('{pt_dir}')\"`, then load it again."
        )
    notes: list = []
    if state == "unfinished":
        msg = (
            f"{pt_dir / OUTPUT_DIR} has no analyse.done: the parse is still running or was interrupted "
            f"(async_mode=True, killed kernel). Wait for it, or run analyse('{pt_dir}') again"
        )
        if not allow_unfinished:
            raise ProfileError(msg + "; pass allow_unfinished=True to read what is there.")
        notes.append(msg)
    out = pt_dir / OUTPUT_DIR
    files = {}
    kd = out / "kernel_details.csv"
    kernels = None
    if kd.exists():
        kernels = read_kernel_details(kd, notes)
        files["kernel_details"] = kd
    op_stat = None
    if (out / "op_statistic.csv").exists():
        op_stat = read_op_statistic(out / "op_statistic.csv", notes)
        files["op_statistic"] = out / "op_statistic.csv"
    if kernels is None:
        if op_stat is None:
            present = sorted(p.name for p in out.iterdir())
            raise ProfileError(
                f"{out} has neither kernel_details.csv nor op_statistic.csv (found: {present or 'nothing'}). "
                f"Collect with activities=[CPU, NPU] (kit.profiling.profile does) and make sure `msprof` is on PATH "
                f"in the kernel's environment (source CANN set_env.sh), then parse again."
            )
        notes.append("kernel_details.csv missing: per-kernel rules (block dim, ratios) use op_statistic only")
        kernels = pd.DataFrame({c: pd.Series(dtype="float64") for c in KERNEL_COLUMNS})
    step = None
    if (out / "step_trace_time.csv").exists():
        step = read_step_trace(out / "step_trace_time.csv", notes)
        files["step_trace_time"] = out / "step_trace_time.csv"
    meta = {}
    for name in ("profiler_info.json", "profiler_metadata.json"):
        p = pt_dir / name
        if p.exists():
            try:
                meta[name] = json.loads(p.read_text(encoding="utf-8"))
            except ValueError:
                notes.append(f"{name} is not valid JSON; ignored")
    return ProfileData(
        kind="ascend",
        path=pt_dir,
        kernels=kernels,
        op_statistic=op_stat,
        step_trace=step,
        core_counts=core_counts(pt_dir),
        meta=meta,
        notes=notes,
        files=files,
    )
