"""Read torch_npu's `*_ascend_pt/ASCEND_PROFILER_OUTPUT/` into normalised tables, tolerating header drift.

Drift handled (torch_npu 2.13.0 wheel, `profiler/analysis/prof_view/_kernel_view_parser.py`): `Block Dim` (older torch_npu) vs `Block Num` (2.13),
optional `Step Id` / `Device_id`, CANN op_summary names (`Op Name`, `OP Type`, `Task Type`, `Task Duration(us)`),
`N/A` and empty cells, numbers with a trailing tab, ratio columns matched by pattern (`aic_mac_ratio` or
`aic_cube_ratio`, legacy un-prefixed `vec_ratio`).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Optional

import pandas as pd

from kit.profiling.profile_data import COMMUNICATION_CORES, KERNEL_COLUMNS, ProfileData, ProfileError

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


# Accelerator Core / Task Type / Core Type spellings -> the one label the rules use. msprof's op_summary writes
# AI_CORE, AI_VECTOR_CORE, AI_CPU, MIX_AIC, MIX_AIV (CANN "op_summary" field reference); the CANN runtime
# registers its task types as KERNEL_AICORE, KERNEL_AICPU, KERNEL_MIX_AIC, KERNEL_MIX_AIV (hicann/runtime
# profiling_agent.cc), and task_time / db exports and older CANN releases write AICPU, AIV, AIVEC. Keys are the
# label upper-cased with spaces, '-' and '_' removed.
CORE_ALIASES = {
    "AICORE": "AI_CORE",
    "KERNELAICORE": "AI_CORE",
    "AICPU": "AI_CPU",
    "KERNELAICPU": "AI_CPU",
    "AIVECTORCORE": "AI_VECTOR_CORE",
    "AIVECTOR": "AI_VECTOR_CORE",
    "VECTORCORE": "AI_VECTOR_CORE",
    "AIV": "AI_VECTOR_CORE",
    "AIVEC": "AI_VECTOR_CORE",
    "KERNELAIVEC": "AI_VECTOR_CORE",
    "MIXAIC": "MIX_AIC",
    "KERNELMIXAIC": "MIX_AIC",
    "MIXAIV": "MIX_AIV",
    "KERNELMIXAIV": "MIX_AIV",
    "HCCL": "HCCL",
    "COMMUNICATION": "COMMUNICATION",
    "COMMUNICATIONTASK": "COMMUNICATION_TASK",
    "NA": "N/A",
}
# Task types that appear in kernel views but that no rule judges (msprof-analyze trace_event_bean.py lists them).
OTHER_CORES = {
    "FFTS_PLUS",
    "SDMA_SQE",
    "PCIE_DMA_SQE",
    "WRITE_BACK",
    "MEMCPY_ASYNC",
    "EVENT_RECORD",
    "EVENT_WAIT",
}


def normalize_core(label) -> str:
    """One spelling per accelerator core: 'AICPU', 'ai_cpu', 'KERNEL_AICPU' -> 'AI_CPU'; others upper-cased."""
    text = str(label).strip()
    if not text or text.upper() in ("N/A", "NAN", "NONE"):
        return "N/A"
    key = re.sub(r"[\s_\-]", "", text.upper())
    return CORE_ALIASES.get(key, re.sub(r"[\s\-]+", "_", text.upper()))


def unknown_cores(labels) -> list:
    """Normalised core labels that are neither a rule's core nor a known other task type."""
    known = set(CORE_ALIASES.values()) | OTHER_CORES | {"CPU", "GPU"}
    return sorted({str(x) for x in labels} - known)


def _canon(header: str) -> Optional[str]:
    """Normalised name for a kernel_details header, or None when the analyzer does not need it."""
    h = str(header).strip().strip("\ufeff").strip()
    if h in KERNEL_HEADER_MAP:
        return KERNEL_HEADER_MAP[h]
    return h if RATIO_PATTERN.match(h) else None


class _Head(io.RawIOBase):
    """The first `limit` bytes of an open binary file: lets pandas read a cut file up to its last full line."""

    def __init__(self, fh, limit: int):
        self._fh, self._left = fh, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self._left)
        if n <= 0:
            return 0
        data = self._fh.read(n)
        buf[: len(data)] = data
        self._left -= len(data)
        return len(data)


def complete_size(path: Path) -> tuple:
    """(bytes up to and including the last newline, bytes after it): a non-zero tail means a cut last line."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    with open(path, "rb") as fh:
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return size, 0
        pos = size
        while pos > 0:
            start = max(0, pos - (1 << 16))
            fh.seek(start)
            i = fh.read(pos - start).rfind(b"\n")
            if i >= 0:
                return start + i + 1, size - (start + i + 1)
            pos = start
    return 0, size


def _read_csv(path: Path, usecols=None) -> tuple:
    """(DataFrame, cut) via pandas.read_csv with the profiler's N/A spellings; cut=True when the file ended
    mid-line (that partial line is left out). Unreadable files raise ProfileError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ProfileError(
            f"{path} is a folder, but a CSV file belongs here; remove or rename it and parse the profile again "
            f"(torch_npu.profiler.profiler.analyse)."
        )
    kw = dict(usecols=usecols, na_values=NA_VALUES, keep_default_na=True, low_memory=False)
    try:
        end, tail = complete_size(path)
        if tail and end == 0:
            raise ProfileError(
                f"{path} is cut inside its header line ({tail} bytes, no complete line): the file is truncated. "
                f"Copy it again or re-run the parse (torch_npu.profiler.profiler.analyse)."
            )
        if not tail:
            return pd.read_csv(path, **kw), False
        with open(path, "rb") as fh:
            return pd.read_csv(io.BufferedReader(_Head(fh, end)), encoding="utf-8", **kw), True
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
    except OSError as exc:
        raise ProfileError(
            f"{path} cannot be read ({exc.strerror or exc}); check the file and its permissions."
        ) from exc


def _to_number(df: pd.DataFrame, cols: list, path: Path, notes: list) -> dict:
    """Make `cols` numeric in place (tabs/spaces stripped); returns {column: non-numeric cells read as missing}."""
    bad_by_col = {}
    for c in cols:
        if c not in df.columns or pd.api.types.is_numeric_dtype(df[c]):
            continue
        raw = df[c].astype("string").str.strip()
        num = pd.to_numeric(raw, errors="coerce")
        bad = int((num.isna() & raw.notna() & ~raw.isin(NA_VALUES)).sum())
        if bad:
            bad_by_col[c] = bad
            notes.append(f"{path.name}: {bad} non-numeric value(s) in column {c!r} read as missing")
        df[c] = num.astype("float64")
    return bad_by_col


def _labels(col: pd.Series) -> pd.Series:
    """A text column as a stripped categorical: a few hundred distinct names over millions of rows."""
    cat = pd.Categorical(col.fillna("N/A"))
    return pd.Series(cat.map(lambda v: str(v).strip() or "N/A"), index=col.index).astype("category")


def _cores(col: pd.Series) -> pd.Series:
    """The core column with one spelling per core (mapped per category, not per row)."""
    col = col.astype("category")
    cats = list(col.cat.categories)
    mapped = [normalize_core(c) for c in cats]
    new = pd.Index(sorted(set(mapped)))
    codes = new.get_indexer(mapped)[col.cat.codes.to_numpy()]
    return pd.Series(pd.Categorical.from_codes(codes, new), index=col.index)


def _truncation_warning(path: Path, rows: int) -> str:
    return (
        f"{path.name} ends in the middle of a row: the file is truncated (interrupted copy or download, or a "
        f"parse that was killed). Its last, partial row was dropped and {rows} complete row(s) were read; "
        f"copy the file again or re-run torch_npu.profiler.profiler.analyse on the *_ascend_pt folder."
    )


def _account(rows: Optional[dict], name: str, read: int, used: int, dropped: dict) -> None:
    if rows is not None:
        rows[name] = {
            "read": int(read),
            "used": int(used),
            "dropped": {k: int(v) for k, v in dropped.items() if v},
        }


def read_kernel_details(
    path: Path, notes: Optional[list] = None, warnings: Optional[list] = None, rows: Optional[dict] = None
) -> pd.DataFrame:
    """kernel_details.csv (or a CANN op_summary_*.csv) -> one row per kernel with KERNEL_COLUMNS + ratio columns.

    Rows with no duration, a negative duration, or cut off at the end of the file are dropped and counted in
    `rows`; ratio cells outside [0, 1] and negative block dims are read as missing; each kind of damage adds one
    line to `warnings`. A file with no usable row raises ProfileError.
    """
    notes = notes if notes is not None else []
    warnings = warnings if warnings is not None else []
    path = Path(path)
    df, cut = _read_csv(path, usecols=lambda h: _canon(h) is not None)
    df.columns = [_canon(c) for c in df.columns]
    df = df.loc[:, ~pd.Index(df.columns).duplicated()]  # both Block Dim and Block Num: keep the first
    missing = [c for c in REQUIRED_KERNEL if c not in df.columns]
    if missing:
        raise ProfileError(
            f"{path} lacks column(s) {missing} (needs the kernel_details.csv headers Name, Type, Accelerator Core, "
            f"Duration(us), or the CANN op_summary spellings). Check that this is a kernel_details.csv written by "
            f"torch_npu with the NPU activity on (activities=[CPU, NPU])."
        )
    n_read = len(df) + int(cut)
    dropped = {"cut off at the end of the file": int(cut)}
    if cut:
        warnings.append(_truncation_warning(path, len(df)))
    ratio_cols = [c for c in df.columns if RATIO_PATTERN.match(c)]
    bad_text = _to_number(df, NUMERIC + ratio_cols, path, notes)
    for c in ("name", "type", "core"):
        df[c] = _labels(df[c])
    df["core"] = _cores(df["core"])
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
    # durations: missing (N/A, empty, text) or negative rows cannot be timed; drop and count them
    no_dur = df["dur_us"].isna()
    neg = df["dur_us"] < 0
    dropped["non-numeric duration"] = bad_text.get("dur_us", 0)
    dropped["no duration (N/A or empty)"] = int(no_dur.sum()) - dropped["non-numeric duration"]
    dropped["negative duration"] = int(neg.sum())
    if no_dur.any() or neg.any():
        df = df[~(no_dur | neg)]
    # ratios are shares of cycles (0..1) and block dims are counts: anything else is read as missing
    invalid = {}
    for c in ratio_cols:
        out = (df[c] < 0) | (df[c] > 1.0 + 1e-6)
        if out.any():
            invalid[c] = int(out.sum())
            df[c] = df[c].mask(out)
    neg_block = df["block_dim"] < 0
    if neg_block.any():
        invalid["block_dim"] = int(neg_block.sum())
        df["block_dim"] = df["block_dim"].mask(neg_block)
    if invalid:
        warnings.append(
            f"{path.name}: values out of range read as missing: "
            + ", ".join(f"{k} {v} cell(s)" for k, v in invalid.items())
            + " (ratios must be in [0, 1], block dims >= 0)."
        )
    for c, n in bad_text.items():
        if c != "dur_us" and c not in ("step", "device", "start_us", "wait_us"):
            warnings.append(f"{path.name}: {n} non-numeric value(s) in {c!r} read as missing.")
    odd = unknown_cores(df["core"].cat.categories) if len(df) else []
    if odd:
        counts = df["core"].value_counts()
        notes.append(
            f"{path.name}: core label(s) not recognised: "
            + ", ".join(f"{k} ({int(counts.get(k, 0))} rows)" for k in odd)
            + "; they count as computation but no core rule (AI_CPU, block dim) applies to them."
        )
    _account(rows, path.name, n_read, len(df), dropped)
    if len(df) == 0:
        raise ProfileError(
            f"{path} has no usable kernel row: read {n_read}, dropped "
            + ", ".join(f"{v} ({k})" for k, v in dropped.items() if v)
            + ". Re-run the parse (torch_npu.profiler.profiler.analyse) or collect a new profile."
        )
    bad_rows = {k: v for k, v in dropped.items() if v and k != "cut off at the end of the file"}
    if bad_rows:
        warnings.append(
            f"{path.name}: {sum(bad_rows.values())} of {n_read} row(s) dropped: "
            + ", ".join(f"{v} {k}" for k, v in bad_rows.items())
            + "; the operator table and shares leave them out."
        )
    return df[KERNEL_COLUMNS + [c for c in df.columns if c not in KERNEL_COLUMNS]].reset_index(drop=True)


def read_op_statistic(
    path: Path, notes: Optional[list] = None, warnings: Optional[list] = None, rows: Optional[dict] = None
) -> pd.DataFrame:
    """op_statistic.csv -> type, core, calls, total_us, min_us, avg_us, max_us, share_pct (optional device)."""
    notes = notes if notes is not None else []
    warnings = warnings if warnings is not None else []
    df, cut = _read_csv(path)
    df.columns = [OP_STAT_MAP.get(str(c).strip(), str(c).strip()) for c in df.columns]
    missing = [c for c in ("type", "calls", "total_us", "max_us") if c not in df.columns]
    if missing:
        raise ProfileError(
            f"{path} lacks column(s) {missing}; expected OP Type, Core Type, Count, Total Time(us), "
            f"Min/Avg/Max Time(us), Ratio(%)."
        )
    if cut:
        warnings.append(_truncation_warning(Path(path), len(df)))
    n_read = len(df) + int(cut)
    _to_number(df, ["calls", "total_us", "min_us", "avg_us", "max_us", "share_pct", "device"], path, notes)
    if "core" not in df.columns:
        df["core"] = "N/A"
    df["type"] = df["type"].astype("string").str.strip().fillna("N/A")
    df["core"] = df["core"].map(normalize_core).astype("string")
    bad = df[["calls", "total_us", "max_us"]].isna().any(axis=1) | (
        df[["calls", "total_us", "max_us"]] < 0
    ).any(axis=1)
    if bad.any():
        warnings.append(
            f"{Path(path).name}: {int(bad.sum())} row(s) with a missing, non-numeric or negative Count / Total / "
            f"Max Time were dropped."
        )
        df = df[~bad]
    _account(
        rows,
        Path(path).name,
        n_read,
        len(df),
        {"cut off at the end of the file": int(cut), "missing or negative values": int(bad.sum())},
    )
    return df


def read_step_trace(
    path: Path, notes: Optional[list] = None, warnings: Optional[list] = None, rows: Optional[dict] = None
) -> Optional[pd.DataFrame]:
    """step_trace_time.csv -> step, computing_us, communication_us, free_us, total_us (None when nothing usable).

    A step whose Computing or Free cell is missing, not a number or negative is dropped and counted (its shares
    would be meaningless); an N/A Communication cell counts as 0 and is reported.
    """
    notes = notes if notes is not None else []
    warnings = warnings if warnings is not None else []
    path = Path(path)
    df, cut = _read_csv(path)
    df.columns = [STEP_MAP.get(str(c).strip(), str(c).strip()) for c in df.columns]
    missing = [c for c in ("computing_us", "free_us") if c not in df.columns]
    if missing:
        notes.append(f"{path.name}: no {missing} column(s); step breakdown skipped")
        return None
    if cut:
        warnings.append(_truncation_warning(path, len(df)))
    n_read = len(df) + int(cut)
    if "communication_us" not in df.columns:
        df["communication_us"] = 0.0
    if "step" not in df.columns:
        df["step"] = float("nan")
    bad_text = _to_number(df, ["step", "computing_us", "communication_us", "free_us"], path, notes)
    parts = ["computing_us", "free_us"]
    missing_part = df[parts].isna().any(axis=1)
    negative = (df[parts + ["communication_us"]] < 0).any(axis=1)
    na_comm = df["communication_us"].isna() & ~missing_part
    drop = missing_part | negative
    if drop.any():
        warnings.append(
            f"{path.name}: {int(drop.sum())} of {len(df)} step row(s) dropped from the step breakdown "
            f"({int(missing_part.sum())} with a missing or non-numeric Computing/Free cell"
            + (f", {sum(bad_text.values())} non-numeric cell(s) in all" if bad_text else "")
            + f", {int((negative & ~missing_part).sum())} with a negative value)."
        )
    if na_comm.any():
        warnings.append(
            f"{path.name}: Communication(Not Overlapped) is N/A or not a number on {int(na_comm.sum())} step "
            f"row(s), read as 0: the communication share may be understated."
        )
    df = df[~drop]
    df = df[["step", "computing_us", "communication_us", "free_us"]].fillna({"communication_us": 0.0})
    df["total_us"] = df["computing_us"] + df["communication_us"] + df["free_us"]
    _account(
        rows,
        path.name,
        n_read,
        len(df),
        {
            "cut off at the end of the file": int(cut),
            "missing or non-numeric Computing/Free": int(missing_part.sum()),
            "negative value": int((negative & ~missing_part).sum()),
        },
    )
    return df.reset_index(drop=True) if len(df) else None


def core_counts(pt_dir: Path, problems: Optional[list] = None) -> dict:
    """AI Core / vector core counts from PROF_*/device_*/info.json.* (`ai_core_num`, `aiv_num`), if present.

    A device info file that cannot be read or parsed is named in `problems` (it is not the same as missing).
    """
    problems = problems if problems is not None else []
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

    infos = sorted(pt_dir.glob("PROF_*/device_*/info.json*"))
    for info in infos:
        rel = info.relative_to(pt_dir)
        try:
            walk(json.loads(info.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            problems.append(f"{rel} is corrupt (not UTF-8 text)")
        except ValueError as exc:
            problems.append(f"{rel} is corrupt (not valid JSON: {str(exc)[:80]})")
        except OSError as exc:
            problems.append(f"{rel} cannot be read ({exc.strerror or exc})")
    if infos and not found and not problems:
        problems.append(
            f"{', '.join(str(i.relative_to(pt_dir)) for i in infos)} hold no ai_core_num / aiv_num"
        )
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
    files: dict = {}
    warnings: list = []
    rows: dict = {}
    kd = out / "kernel_details.csv"
    kernels = None
    if kd.exists():
        kernels = read_kernel_details(kd, notes, warnings, rows)
        files["kernel_details"] = kd
    op_stat = None
    if (out / "op_statistic.csv").exists():
        op_stat = read_op_statistic(out / "op_statistic.csv", notes, warnings, rows)
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
        step = read_step_trace(out / "step_trace_time.csv", notes, warnings, rows)
        files["step_trace_time"] = out / "step_trace_time.csv"
    if "kernel_details" in files:
        warnings += _cross_checks(kernels, op_stat, step, rows.get(kd.name, {}))
    meta = {}
    for name in ("profiler_info.json", "profiler_metadata.json"):
        p = pt_dir / name
        if p.is_file():
            try:
                meta[name] = json.loads(p.read_text(encoding="utf-8"))
            except (ValueError, OSError) as exc:
                warnings.append(
                    f"{p} is corrupt ({type(exc).__name__}: {str(exc)[:80]}); its settings are ignored"
                )
    info_problems: list = []
    cores = core_counts(pt_dir, info_problems)
    if info_problems:
        warnings.append(
            "device info: "
            + "; ".join(info_problems)
            + " - core counts not read, the block-dim rule needs them"
            if not cores
            else "device info: " + "; ".join(info_problems)
        )
    return ProfileData(
        kind="ascend",
        path=pt_dir,
        kernels=kernels,
        op_statistic=op_stat,
        step_trace=step,
        core_counts=cores,
        meta=meta,
        notes=notes,
        files=files,
        warnings=warnings,
        rows=rows,
        core_counts_problem="; ".join(info_problems) if not cores else "",
    )


def _cross_checks(
    kernels: pd.DataFrame, op_stat: Optional[pd.DataFrame], step: Optional[pd.DataFrame], kd_rows
) -> list:
    """Damage a single file cannot show: kernel_details.csv holding fewer kernels than op_statistic.csv counts,
    or fewer steps than step_trace_time.csv (a file cut at a row boundary still parses)."""
    out = []
    comm = kernels["core"].isin(COMMUNICATION_CORES)
    n_compute = int(kd_rows.get("read", len(kernels)) - (comm.sum() if len(kernels) else 0))
    if op_stat is not None and len(op_stat):
        counted = float(op_stat.loc[~op_stat["core"].isin(COMMUNICATION_CORES), "calls"].sum())
        if counted > n_compute:
            out.append(
                f"kernel_details.csv holds {n_compute} computation kernel row(s) but op_statistic.csv counts "
                f"{counted:.0f}: {counted - n_compute:.0f} are missing, so kernel_details.csv is probably truncated "
                f"(the figures below cover only what it holds)."
            )
    if step is not None and step["step"].notna().any() and kernels["step"].notna().any():
        have = set(kernels["step"].dropna().astype("int64"))
        lost = sorted(int(s) for s in step["step"].dropna() if int(s) not in have)
        if lost:
            out.append(
                f"step_trace_time.csv lists step(s) {lost} that have no row in kernel_details.csv: the kernel file "
                f"is probably truncated or the steps were cut short."
            )
    return out
