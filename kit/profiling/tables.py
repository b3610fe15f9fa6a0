"""The operator table (name, type, core, calls, total/avg/min/max us, share) and the per-step time breakdown."""

from __future__ import annotations

import pandas as pd

from kit.profiling.profile_data import COMMUNICATION_CORES, ProfileData

TABLE_COLUMNS = ["name", "type", "core", "calls", "total_us", "avg_us", "min_us", "max_us", "share_pct"]


def compute_kernels(data: ProfileData) -> pd.DataFrame:
    """Kernel rows that count as computation (communication tasks excluded)."""
    k = data.kernels
    comm = k["core"].isin(COMMUNICATION_CORES)
    return k[~comm] if comm.any() else k  # no copy of millions of rows when there is nothing to drop


def operator_table(data: ProfileData, by: str = "type", sort: str = "total_us", top=None) -> pd.DataFrame:
    """Aggregate kernels by operator `type` (+core) or by kernel `name`; share_pct of all computation time."""
    problems = []
    if by not in ("type", "name"):
        problems.append(
            f"by={by!r}: use 'type' (one row per operator type and core) or 'name' (per kernel name)"
        )
    if sort not in ("total_us", "avg_us", "max_us", "calls"):
        problems.append(f"sort={sort!r}: use total_us, avg_us, max_us or calls")
    if problems:
        from kit.core.configs import ConfigError

        raise ConfigError(problems, "operator_table")
    k = compute_kernels(data)
    if k.empty and data.op_statistic is not None:
        table = data.op_statistic.copy()
        table["name"] = table["type"]
        total = table["total_us"].sum()
        table["share_pct"] = 100.0 * table["total_us"] / total if total else 0.0
    else:
        keys = ["type", "core"] if by == "type" else ["name", "type", "core"]
        g = k.groupby(keys, sort=False, dropna=False, observed=True)["dur_us"]
        table = g.agg(calls="count", total_us="sum", avg_us="mean", min_us="min", max_us="max").reset_index()
        if by == "type":
            # the kernel name that took most of the type's time, so a row can be found in the trace
            top_name = (
                k.groupby(["type", "core", "name"], sort=False, observed=True)["dur_us"].sum().reset_index()
            )
            top_name = top_name.sort_values("dur_us").drop_duplicates(["type", "core"], keep="last")
            table = table.merge(top_name[["type", "core", "name"]], on=["type", "core"], how="left")
        total = float(k["dur_us"].sum())
        table["share_pct"] = 100.0 * table["total_us"] / total if total else 0.0
    table = table[TABLE_COLUMNS].astype({"name": "string", "type": "string", "core": "string"})
    table = table.sort_values(sort, ascending=False, kind="stable").reset_index(drop=True)
    table["calls"] = table["calls"].astype("int64")
    return table.head(top) if top else table


def step_breakdown(data: ProfileData) -> pd.DataFrame:
    """Per step: computing / communication / free us and their shares (torch traces: step total only)."""
    st = data.step_trace
    if st is None or st.empty:
        return pd.DataFrame(columns=["step", "total_us"])
    out = st.copy()
    for c in ("computing_us", "communication_us", "free_us"):
        if c in out.columns:
            out[c.replace("_us", "_pct")] = 100.0 * out[c] / out["total_us"].where(out["total_us"] > 0)
    return out.reset_index(drop=True)


def mean_step_us(data: ProfileData) -> float:
    """Mean step time in us (NaN when the capture has no step information)."""
    st = step_breakdown(data)
    return float(st["total_us"].mean()) if len(st) else float("nan")
