"""Mixture-of-experts operators in a profile: routing, token permute / unpermute, grouped matmul, all-to-all.

Operator types as the torch_npu 2.13.0 MoE kernels appear in kernel_details.csv (op names of `_op_plugin_docs.py`
without the `npu_` prefix, in CamelCase: MoeGatingTopKSoftmax, MoeTokenPermute(Grad), GroupedMatmul,
GroupedMatmulAdd, ...), HCCL's all-to-all tasks (hcom_alltoall*, AlltoAllV) and torch's `aten::_grouped_mm`.
Names are matched with case, `_`, `:` and spaces ignored, on the operator type and the kernel name.
"""

from __future__ import annotations

import re

import pandas as pd

from kit.profiling.profile_data import ProfileData

# role -> pattern over the squashed (lower-case, alphanumerics only) type or kernel name; first match wins
MOE_ROLES = (
    ("routing", re.compile(r"moegatingtopk|moecomputeexperttokens")),  # softmax/top-k gate, tokens per expert
    ("token unpermute", re.compile(r"moetokenunpermute|moefinalizerouting")),  # combine back to token order
    ("token permute", re.compile(r"moetokenpermute|moeinitrouting")),  # dispatch: sort tokens by expert
    ("grouped matmul", re.compile(r"groupedmatmul|groupedmm|grouped_mm")),  # the experts' GEMMs (fwd + bwd)
    ("all-to-all", re.compile(r"alltoall")),  # expert-parallel token exchange (HCCL AlltoAll / AlltoAllV)
)
MOE_COLUMNS = ["role", "type", "core", "calls", "total_us", "share_pct"]


def moe_role(text) -> str:
    """The MoE role of an operator type or kernel name, '' when it is none of them."""
    squashed = re.sub(r"[^a-z0-9]", "", str(text).lower())
    for role, pattern in MOE_ROLES:
        if pattern.search(squashed):
            return role
    return ""


def moe_operators(data: ProfileData) -> pd.DataFrame:
    """One row per MoE operator type and core: role, calls, total us, share of all device time (communication
    included, so all-to-all and the experts' compute compare); empty when the profile has none."""
    k = data.kernels
    if len(k):
        g = k.groupby(["type", "core", "name"], sort=False, dropna=False, observed=True)["dur_us"]
        t = g.agg(calls="count", total_us="sum").reset_index()
        total = float(k["dur_us"].sum())
    elif data.op_statistic is not None:
        t = data.op_statistic[["type", "core", "calls", "total_us"]].assign(name="")
        total = float(t["total_us"].sum())
    else:
        return pd.DataFrame(columns=MOE_COLUMNS)
    t = t.astype({"type": "string", "core": "string", "name": "string"})
    roles = [moe_role(typ) or moe_role(name) for typ, name in zip(t["type"], t["name"])]
    t = t.assign(role=roles)
    t = t[t["role"] != ""]
    if t.empty:
        return pd.DataFrame(columns=MOE_COLUMNS)
    t = (
        t.groupby(["role", "type", "core"], sort=False, observed=True)[["calls", "total_us"]]
        .sum()
        .reset_index()
    )
    t["share_pct"] = 100.0 * t["total_us"] / total if total else 0.0
    t["calls"] = t["calls"].astype("int64")
    order = {role: i for i, (role, _) in enumerate(MOE_ROLES)}
    t = t.assign(_o=t["role"].map(order)).sort_values(
        ["_o", "total_us"], ascending=[True, False], kind="stable"
    )
    return t[MOE_COLUMNS].reset_index(drop=True)


def moe_rule(data: ProfileData) -> list:
    """Information: where a MoE model's time goes, by role, naming the operators."""
    from kit.profiling.advisor import Finding

    t = moe_operators(data)
    if t.empty:
        return []
    by_role = t.groupby("role", sort=False)[["total_us", "share_pct"]].sum()
    parts = [
        f"{role} {row.share_pct:.1f}% ({', '.join(t.loc[t['role'] == role, 'type'])})"
        for role, row in by_role.iterrows()
    ]
    return [
        Finding(
            "moe_operators",
            "info",
            "MoE operators",
            "share of device time: " + "; ".join(parts),
            "Grouped matmul is the experts' compute and should lead; routing or permute/unpermute near it means "
            "few tokens per expert (raise MBS or SEQ_LEN), a large all-to-all share means expert-parallel "
            "exchange that is not hidden behind compute (fewer EP ranks, or more tokens per step).",
            operators=list(dict.fromkeys(t["type"])),
            numbers={f"{role}_pct": float(row.share_pct) for role, row in by_role.iterrows()},
        )
    ]
