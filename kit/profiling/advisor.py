"""Slow-operator advice: the ModelArts guide's rules, each finding with its evidence and its fix.

Rules and thresholds come from the ModelArts best practice "优化算子执行 / 加速慢算子的执行速度" (Huawei Cloud
ModelArts best practices, modelarts_10_2510): Cast max > 30 us or share > 1% -> mixed precision; AI_CPU op > 1000 us or
AI_CPU share > 10% -> replace the API / change input types; unit ratios < 0.8 or Block Dim < core count -> AOE;
top operators by total / average / max time. Shares are of all computation time on the device (communication
tasks excluded), which is what op_statistic.csv's Ratio(%) means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pandas as pd

from kit.profiling.config import Thresholds
from kit.profiling.moe import moe_rule
from kit.profiling.profile_data import ProfileData
from kit.profiling.tables import compute_kernels, operator_table, step_breakdown

AOE_FIX = (
    "Tune these operators with AOE (Ascend Optimization Engine, operator tuning), or change their shapes "
    "(multiples of 16 for cube, 32 bytes for vector) so the tiling fills every core; if they stay slow, "
    "send this profile to Huawei engineers."
)


@dataclass
class Finding:
    """One rule's verdict: severity 'warning' (damaged input), 'problem', 'info' or 'skipped' (data missing)."""

    rule: str
    severity: str
    title: str
    evidence: str
    fix: str
    operators: list = field(default_factory=list)
    numbers: dict = field(default_factory=dict)


def _fmt_ops(t: pd.DataFrame, n: int) -> str:
    """'Name (type, core): max X us, total Y us, Z%' for the first n rows."""
    return "; ".join(
        f"{r.name} ({r.type}, {r.core}): {r.calls} calls, max {r.max_us:.1f} us, "
        f"total {r.total_us:.1f} us, {r.share_pct:.2f}%"
        for r in t.head(n).itertuples()
    )


def _merge(left: pd.DataFrame, by_name: pd.DataFrame) -> pd.DataFrame:
    """Join per-operator figures with the by-name operator table (keys as plain text: categories differ)."""
    keys = ["name", "type", "core"]
    left = left.astype({k: "string" for k in keys})
    return left.merge(by_name.astype({k: "string" for k in keys}), on=keys)


def cast_rule(by_type: pd.DataFrame, th: Thresholds) -> list:
    """Cast slower than cast_max_us or above cast_share_pct -> mixed precision."""
    cast = by_type[by_type["type"].str.lower() == "cast"]
    if cast.empty:
        return []
    mx, share = float(cast["max_us"].max()), float(cast["share_pct"].sum())
    if mx <= th.cast_max_us and share <= th.cast_share_pct:
        return []
    return [
        Finding(
            "cast",
            "problem",
            "Cast operators are slow or frequent",
            f"Cast: {int(cast['calls'].sum())} calls, max {mx:.1f} us (limit {th.cast_max_us:g}), "
            f"{share:.2f}% of computation time (limit {th.cast_share_pct:g}%)",
            "Enable mixed precision (bf16 on Atlas A2: autocast/amp, or the trainer's bf16 option) so tensors are not "
            "converted back and forth; look for .float()/.to(dtype) and fp32 buffers in the model and loss.",
            operators=sorted(set(cast["type"])),
            numbers={"max_us": mx, "share_pct": share},
        )
    ]


def aicpu_rule(by_name: pd.DataFrame, th: Thresholds) -> list:
    """Any AI_CPU kernel above aicpu_max_us, or AI_CPU share above aicpu_share_pct -> replace API / dtypes."""
    ai = by_name[by_name["core"] == "AI_CPU"].sort_values("total_us", ascending=False)
    if ai.empty:
        return []
    slow = ai[ai["max_us"] > th.aicpu_max_us]
    share = float(ai["share_pct"].sum())
    if slow.empty and share <= th.aicpu_share_pct:
        return []
    ops = slow if share <= th.aicpu_share_pct else ai
    return [
        Finding(
            "aicpu",
            "problem",
            "Operators run on the AI CPU",
            f"AI_CPU share {share:.2f}% (limit {th.aicpu_share_pct:g}%), {len(slow)} op(s) above "
            f"{th.aicpu_max_us:g} us: {_fmt_ops(ops, th.top_n)}",
            "Replace the API or change input types/shapes so the adapter dispatches the op to AI Core (e.g. int64 or "
            "float64 inputs -> int32/float32, torch.topk on a 1-D tensor -> a 2-D view, avoid nonzero/boolean indexing "
            "inside the step).",
            operators=list(ops["type"].unique()),
            numbers={"share_pct": share, "max_us": float(ai["max_us"].max())},
        )
    ]


def ratio_rule(data: ProfileData, by_name: pd.DataFrame, th: Thresholds) -> list:
    """Operators whose every compute/memory unit ratio stays below unit_ratio -> AOE."""
    cols = data.ratio_columns
    if not cols:
        return [
            Finding(
                "low_ratio",
                "skipped",
                "Unit utilisation not collected",
                "kernel_details.csv has no aic_*_ratio / aiv_*_ratio columns (a Level0 capture, or "
                "aic_metrics=AiCoreNone), so the AOE ratio check could not run.",
                "Collect again with level='Level1' and aic_metrics='PipeUtilization' "
                "(kit.profiling.profile(level='Level1', aic_metrics='PipeUtilization')).",
            )
        ]
    k = compute_kernels(data)
    peak = k[cols].max(axis=1, skipna=True)
    k = pd.DataFrame(
        {
            "name": k["name"],
            "type": k["type"],
            "core": k["core"],
            "dur_us": k["dur_us"],
            "weighted": peak * k["dur_us"],
        }
    )[peak.notna()]  # only the columns needed: 1M-row profiles
    if k.empty:
        return []
    # duration-weighted mean of each kernel's best unit ratio, per operator
    g = k.groupby(["name", "type", "core"], sort=False, observed=True)[["weighted", "dur_us"]].sum()
    agg = (g["weighted"] / g["dur_us"].clip(lower=1e-9)).rename("peak_ratio").reset_index()
    agg = _merge(agg, by_name)
    low = agg[(agg["peak_ratio"] < th.unit_ratio) & (agg["share_pct"] >= th.min_op_share_pct)]
    if low.empty:
        return []
    low = low.sort_values("total_us", ascending=False)
    ev = "; ".join(
        f"{r.name} ({r.type}): best unit ratio {r.peak_ratio:.2f}, {r.share_pct:.2f}%"
        for r in low.head(th.top_n).itertuples()
    )
    return [
        Finding(
            "low_ratio",
            "problem",
            f"Operators keep every compute/memory unit below {th.unit_ratio:.0%} busy",
            f"{len(low)} operator(s): {ev}",
            AOE_FIX,
            operators=list(low["type"].unique()),
            numbers={"worst_ratio": float(low["peak_ratio"].min())},
        )
    ]


def block_dim_rule(data: ProfileData, by_name: pd.DataFrame, th: Thresholds) -> list:
    """Operators launched on fewer blocks than the card has cores -> AOE."""
    if not th.block_dim_vs_cores:
        return []
    cores = dict(data.core_counts)
    if th.ai_core_num:
        cores.update({"AI_CORE": th.ai_core_num, "MIX_AIC": th.ai_core_num})
    if th.aiv_num:
        cores.update({"AI_VECTOR_CORE": th.aiv_num, "MIX_AIV": th.aiv_num})
    k = compute_kernels(data)[["name", "type", "core", "block_dim"]]
    k = k[k["core"].isin(list(cores)) & (k["block_dim"] > 0)]
    if not cores or k["block_dim"].isna().all():
        if cores:
            why = "no Block Num/Block Dim values"
        elif data.core_counts_problem:
            why = f"no core counts: {data.core_counts_problem}"
        else:
            why = "no core counts (PROF_*/device_*/info.json missing)"
        return [
            Finding(
                "block_dim",
                "skipped",
                "Block dim not checked",
                f"{why}.",
                "Pass ai_core_num/aiv_num to the advisor (npu-smi info shows the chip) or keep the PROF_* "
                "folder next to ASCEND_PROFILER_OUTPUT.",
            )
        ]
    if k.empty:
        return []
    med = k.groupby(["name", "type", "core"], sort=False, observed=True)["block_dim"].median().reset_index()
    med = _merge(med, by_name)
    med["cores"] = med["core"].map(cores).astype("float64")
    low = med[(med["block_dim"] < med["cores"]) & (med["share_pct"] >= th.min_op_share_pct)]
    if low.empty:
        return []
    low = low.sort_values("total_us", ascending=False)
    ev = "; ".join(
        f"{r.name} ({r.type}, {r.core}): block dim {r.block_dim:g} < {r.cores} cores, {r.share_pct:.2f}%"
        for r in low.head(th.top_n).itertuples()
    )
    return [
        Finding(
            "block_dim",
            "problem",
            "Operators use fewer blocks than the card has cores",
            f"{len(low)} operator(s): {ev}",
            AOE_FIX,
            operators=list(low["type"].unique()),
            numbers={"min_block_dim": float(low["block_dim"].min())},
        )
    ]


def step_rules(data: ProfileData, th: Thresholds) -> list:
    """Step-time breakdown as info, and a problem when the device idles above free_share_pct.

    Shares are taken over the steps whose every part is a valid number (the reader drops the others and says
    so), so they lie in [0, 100] and add up to 100.
    """
    st = step_breakdown(data)
    if "free_us" not in st.columns or st.empty:
        return []
    parts = ["computing_us", "communication_us", "free_us"]
    st = st[st[parts].notna().all(axis=1) & (st[parts] >= 0).all(axis=1)]
    tot = float(st["total_us"].sum())
    if st.empty or tot <= 0:
        return []
    comp, comm, free = (100 * float(st[c].sum()) / tot for c in parts)
    out = [
        Finding(
            "step_breakdown",
            "info",
            "Step time breakdown",
            f"{len(st)} steps, mean {st['total_us'].mean():.1f} us: computing {comp:.1f}%, "
            f"communication (not overlapped) {comm:.1f}%, free {free:.1f}%",
            "",
            numbers={"computing_pct": comp, "communication_pct": comm, "free_pct": free},
        )
    ]
    if free > th.free_share_pct:
        out.append(
            Finding(
                "free",
                "problem",
                "The device idles between operators",
                f"free {free:.1f}% of step time (limit {th.free_share_pct:g}%)",
                "The host does not feed the device fast enough: check data loading (num_workers, "
                "pin_memory), .item()/print of tensors and other synchronisations, and look at the gaps "
                "in trace_view.json.",
                numbers={"free_pct": free},
            )
        )
    return out


def top_rule(by_type: pd.DataFrame, th: Thresholds) -> list:
    """Top operators by total, average and max time (information, ModelArts guide step 4)."""
    if by_type.empty:
        return []
    parts, ops = [], []
    for col, label in (("total_us", "total"), ("avg_us", "average"), ("max_us", "max")):
        t = by_type.sort_values(col, ascending=False).head(th.top_n)
        parts.append(
            f"by {label}: " + ", ".join(f"{r.type} {getattr(r, col):.1f} us" for r in t.itertuples())
        )
        ops += [x for x in t["type"] if x not in ops]
    return [
        Finding(
            "top_operators",
            "info",
            "Top operators",
            " | ".join(parts),
            "Expected heavy hitters (MatMul, attention) are fine; others are the first place to look. If a top "
            "operator stays slow after the fixes above, report it to Huawei engineers with this profile.",
            operators=ops,
        )
    ]


def input_rule(data: ProfileData) -> list:
    """Damaged files or invalid values met while reading: a warning first in the report, with row counts."""
    if not data.warnings:
        return []
    counts = data.row_summary()
    return [
        Finding(
            "input",
            "warning",
            "The profile's files are damaged or hold invalid values; figures cover only the valid rows",
            " | ".join(data.warnings + counts),
            "Copy the profile again (a truncated transfer), or re-run torch_npu.profiler.profiler.analyse on the "
            "*_ascend_pt folder; if the files came from a tool other than torch_npu, check how they were edited.",
            numbers={
                "rows_dropped": sum(sum(r.get("dropped", {}).values()) for r in data.rows.values()),
                "warnings": len(data.warnings),
            },
        )
    ]


def advise(data: ProfileData, thresholds: Optional[Thresholds] = None):
    """Run every rule on a loaded profile; returns an Advice (findings, tables, Markdown/HTML/JSON)."""
    from kit.core.configs import check
    from kit.profiling.advice import Advice

    th = thresholds or Thresholds()
    check(th)
    by_type = operator_table(data, by="type")
    by_name = operator_table(data, by="name") if len(data.kernels) else by_type
    findings: list = input_rule(data)
    if data.kind == "ascend":
        findings += cast_rule(by_type, th) + aicpu_rule(by_name, th)
        if len(data.kernels):
            findings += ratio_rule(data, by_name, th) + block_dim_rule(data, by_name, th)
    findings += step_rules(data, th) + top_rule(by_type, th) + moe_rule(data)
    return Advice(data=data, findings=findings, operators=by_type, thresholds=th)
