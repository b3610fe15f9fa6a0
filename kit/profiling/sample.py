"""Build a small Ascend PyTorch profile to the documented torch_npu 2.13 layout, with planted problems for tests.

Layout and column names follow the torch_npu 2.13.0 wheel (`profiler/analysis/`:
`prof_view/_kernel_view_parser.py`, `_trace_step_time_parser.py`, `_operator_view_parser.py`). The numbers are
invented; nothing here came from a real device.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from kit.storage.atomic import atomic_dir

PathLike = Union[str, Path]

AI_CORE_NUM = 24  # cube cores of an Atlas A2 (910B) card, as written to PROF_*/device_0/info.json.0
AIV_NUM = 48  # vector cores of the same card

AIC_RATIOS = ["aic_mac_ratio", "aic_scalar_ratio", "aic_mte1_ratio", "aic_mte2_ratio", "aic_fixpipe_ratio"]
AIV_RATIOS = ["aiv_vec_ratio", "aiv_scalar_ratio", "aiv_mte2_ratio", "aiv_mte3_ratio"]
BASE_HEADERS = [
    "Device_id",
    "Model ID",
    "Task ID",
    "Stream ID",
    "Name",
    "Type",
    "OP State",
    "Accelerator Core",
    "Start Time(us)",
    "Duration(us)",
    "Wait Time(us)",
    "Block Num",
    "Mix Block Num",
    "HF32 Eligible",
    "Input Shapes",
    "Input Data Types",
    "Input Formats",
    "Output Shapes",
    "Output Data Types",
    "Output Formats",
    "Context ID",
]
METRIC_HEADERS = (
    ["aicore_time(us)", "aic_total_cycles"]
    + AIC_RATIOS
    + ["aic_icache_miss_rate", "aiv_time(us)", "aiv_total_cycles"]
    + AIV_RATIOS
    + ["aiv_icache_miss_rate", "cube_utilization(%)"]
)
STEP_TRACE_HEADERS = [
    "Device_id",
    "Step",
    "Computing",
    "Communication(Not Overlapped)",
    "Overlapped",
    "Communication",
    "Free",
    "Stage",
    "Bubble",
    "Communication(Not Overlapped and Exclude Receive)",
    "Preparing",
]
OP_STAT_HEADERS = [
    "Device_id",
    "OP Type",
    "Core Type",
    "Count",
    "Total Time(us)",
    "Min Time(us)",
    "Avg Time(us)",
    "Max Time(us)",
    "Ratio(%)",
]


@dataclass(frozen=True)
class _Op:
    name: str
    type: str
    core: str
    dur_us: float
    per_step: int
    block: int
    peak_ratio: float  # the best unit's utilisation; < 0.8 for every unit means "no bound" (AOE candidate)
    torch_op: str


CLEAN_OPS = [
    _Op("aclnnMm_MatMulCommon_MatMulV2", "MatMulV2", "AI_CORE", 120.0, 8, AI_CORE_NUM, 0.86, "aten::mm"),
    _Op("aclnnAdd_AddAiCore_Add", "Add", "AI_VECTOR_CORE", 12.0, 10, AIV_NUM, 0.83, "aten::add"),
    _Op("aclnnMul_MulAiCore_Mul", "Mul", "AI_VECTOR_CORE", 10.0, 8, AIV_NUM, 0.82, "aten::mul"),
    _Op(
        "aclnnSoftmax_SoftmaxV2AiCore_SoftmaxV2",
        "SoftmaxV2",
        "AI_VECTOR_CORE",
        30.0,
        4,
        AIV_NUM,
        0.88,
        "aten::_softmax",
    ),
    _Op(
        "aclnnRmsNorm_RmsNormAiCore_RmsNorm",
        "RmsNorm",
        "AI_VECTOR_CORE",
        20.0,
        4,
        AIV_NUM,
        0.84,
        "npu_rms_norm",
    ),
    _Op(
        "aclnnFlashAttentionScore_FlashAttentionScore",
        "FlashAttentionScore",
        "MIX_AIC",
        200.0,
        2,
        AI_CORE_NUM,
        0.83,
        "npu_fusion_attention",
    ),
    _Op("aclnnCast_CastAiCore_Cast", "Cast", "AI_VECTOR_CORE", 3.0, 2, AIV_NUM, 0.81, "aten::to"),
]
# The planted problems, one per advisor rule (see kit.profiling.advisor).
PLANTED_OPS = [
    _Op("aclnnCast_CastAiCore_Cast", "Cast", "AI_VECTOR_CORE", 45.0, 4, AIV_NUM, 0.81, "aten::to"),
    _Op(
        "aclnnNonzero_NonZeroAiCpu_NonZero", "NonZero", "AI_CPU", 1500.0, 1, 1, float("nan"), "aten::nonzero"
    ),
    _Op(
        "aclnnBatchMatMul_BatchMatMulV2", "BatchMatMulV2", "AI_CORE", 150.0, 2, AI_CORE_NUM, 0.42, "aten::bmm"
    ),
    _Op(
        "aclnnPermute_TransposeAiCore_Transpose",
        "Transpose",
        "AI_VECTOR_CORE",
        60.0,
        2,
        8,
        0.85,
        "aten::permute",
    ),
]
PLANTED = {"cast": ["Cast"], "aicpu": ["NonZero"], "low_ratio": ["BatchMatMulV2"], "block_dim": ["Transpose"]}


def _ratios(op: _Op, rng: random.Random) -> dict:
    """Per-unit ratios: the peak unit gets `peak_ratio`, the others less; the other core's columns are N/A."""
    out = {c: "N/A" for c in AIC_RATIOS + AIV_RATIOS}
    if op.core == "AI_CPU":
        return out
    cols = AIC_RATIOS if op.core in ("AI_CORE", "MIX_AIC") else AIV_RATIOS
    peak = min(0.99, op.peak_ratio + rng.uniform(0.0, 0.01))
    for i, c in enumerate(cols):
        out[c] = f"{peak if i == 0 else peak * rng.uniform(0.2, 0.9):.3f}"
    return out


def _kernel_rows(ops: list, steps: int, level: str, rng: random.Random) -> tuple[list, list]:
    """kernel_details rows (dicts) and per-step (start, end) device windows."""
    rows, windows, t = [], [], 1_700_000_000_000.0
    task = 0
    for step in range(1, steps + 1):
        start = t
        seq = [op for op in ops for _ in range(op.per_step)]
        rng.shuffle(seq)
        for op in seq:
            dur = round(op.dur_us * rng.uniform(0.97, 1.03), 3)
            if op.core == "AI_CPU" and op.type == "NonZero":
                dur = round(op.dur_us * rng.uniform(1.0, 1.05), 3)  # keep the planted one above 1000 us
            wait = round(rng.uniform(0.5, 2.0), 3)
            t += wait
            task += 1
            row = {
                "Step Id": step,
                "Device_id": 0,
                "Model ID": "4294967295",
                "Task ID": task,
                "Stream ID": 2,
                "Name": op.name,
                "Type": op.type,
                "OP State": "static",
                "Accelerator Core": op.core,
                "Start Time(us)": f"{t:.3f}\t",
                "Duration(us)": dur,
                "Wait Time(us)": wait,
                "Block Num": op.block,
                "Mix Block Num": op.block if op.core.startswith("MIX") else 0,
                "HF32 Eligible": "NO",
                "Input Shapes": '"4,128,576"',
                "Input Data Types": "DT_BF16",
                "Input Formats": "ND",
                "Output Shapes": '"4,128,576"',
                "Output Data Types": "DT_BF16",
                "Output Formats": "ND",
                "Context ID": "N/A",
            }
            if level != "Level0":
                r = _ratios(op, rng)
                row.update(r)
                aic = op.core in ("AI_CORE", "MIX_AIC")
                row.update(
                    {
                        "aicore_time(us)": round(dur * 0.95, 3) if aic else "N/A",
                        "aic_total_cycles": int(dur * 1800) if aic else "N/A",
                        "aic_icache_miss_rate": "0.010" if aic else "N/A",
                        "aiv_time(us)": "N/A" if aic or op.core == "AI_CPU" else round(dur * 0.95, 3),
                        "aiv_total_cycles": "N/A" if aic or op.core == "AI_CPU" else int(dur * 1800),
                        "aiv_icache_miss_rate": "N/A" if aic or op.core == "AI_CPU" else "0.010",
                        "cube_utilization(%)": f"{float(r['aic_mac_ratio']) * 100:.2f}" if aic else "N/A",
                    }
                )
            rows.append((row, op))
            t += dur
        windows.append((start, t))
        t += 30.0  # host gap between steps: shows up as Free
    return rows, windows


def _csv(path: Path, headers: list, rows: list) -> None:
    """Write rows (dicts) with only `headers`, quoting like the profiler (values with commas are quoted)."""
    import csv

    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(headers)
        for r in rows:
            w.writerow([str(r.get(h, "N/A")).strip('"') for h in headers])


def write_sample_ascend_profile(
    out_dir: PathLike,
    clean: bool = False,
    steps: int = 5,
    level: str = "Level1",
    legacy_headers: bool = False,
    rng_seed: int = 0,
    overwrite: bool = False,
    name: Optional[str] = None,
) -> Path:
    """Write `<out_dir>/<host>_<pid>_<ts>_ascend_pt/` with ASCEND_PROFILER_OUTPUT CSV/JSON; return that folder.

    clean=False plants one Cast, one AI_CPU, one low-ratio and one low-block-dim problem (see PLANTED);
    level="Level0" drops the ratio columns and op_statistic.csv as torch_npu 2.13 does; legacy_headers writes the
    older names (Block Dim, no Device_id, no Step Id).
    """
    if level not in ("Level0", "Level1", "Level2"):
        from kit.core.configs import ConfigError

        raise ConfigError([f"level={level!r} is not one of Level0, Level1, Level2"], "sample profile")
    rng = random.Random(rng_seed)
    ops = CLEAN_OPS[:-1] + ([CLEAN_OPS[-1]] if clean else PLANTED_OPS)
    out_dir = Path(out_dir)
    name = name or "localhost_4242_20260101120000000_ascend_pt"  # {worker}_{pid}_{ms timestamp}_ascend_pt
    with atomic_dir(out_dir / name, overwrite=overwrite, what="sample profile") as tmp:
        rows, windows = _kernel_rows(ops, steps, level, rng)
        out = tmp / "ASCEND_PROFILER_OUTPUT"
        out.mkdir()
        headers = ["Step Id"] + BASE_HEADERS + (METRIC_HEADERS if level != "Level0" else [])
        if legacy_headers:
            headers = [
                {"Block Num": "Block Dim", "Mix Block Num": "Mix Block Dim"}.get(h, h)
                for h in headers
                if h not in ("Step Id", "Device_id")
            ]
            plain = [
                dict(r, **{"Block Dim": r["Block Num"], "Mix Block Dim": r["Mix Block Num"]}) for r, _ in rows
            ]
        else:
            plain = [r for r, _ in rows]
        _csv(out / "kernel_details.csv", headers, plain)
        if level != "Level0":
            _csv(out / "op_statistic.csv", OP_STAT_HEADERS, _op_statistic([r for r, _ in rows]))
        _csv(out / "step_trace_time.csv", STEP_TRACE_HEADERS, _step_trace(rows, windows))
        _csv(out / "operator_details.csv", OPERATOR_HEADERS, _operator_details(rows))
        (out / "trace_view.json").write_text(json.dumps(_trace_view(rows, windows)), encoding="utf-8")
        _write_side_files(tmp, level)
        (out / "analyse.done").write_text("", encoding="utf-8")  # written last, as torch_npu does
    return out_dir / name


OPERATOR_HEADERS = [
    "Name",
    "Input Shapes",
    "Call Stack",
    "Host Self Duration(us)",
    "Host Total Duration(us)",
    "Device Self Duration(us)",
    "Device Total Duration(us)",
    "Device Self Duration With AICore(us)",
    "Device Total Duration With AICore(us)",
]


def _op_statistic(rows: list) -> list:
    """op_statistic.csv rows: per (OP Type, Core Type) count/total/min/avg/max and share of all op time."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["Type"], r["Accelerator Core"]), []).append(float(r["Duration(us)"]))
    total = sum(sum(v) for v in groups.values())
    out = []
    for (typ, core), d in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        out.append(
            {
                "Device_id": 0,
                "OP Type": typ,
                "Core Type": core,
                "Count": len(d),
                "Total Time(us)": f"{sum(d):.3f}",
                "Min Time(us)": f"{min(d):.3f}",
                "Avg Time(us)": f"{sum(d) / len(d):.3f}",
                "Max Time(us)": f"{max(d):.3f}",
                "Ratio(%)": f"{100 * sum(d) / total:.2f}",
            }
        )
    return out


def _step_trace(rows: list, windows: list) -> list:
    """step_trace_time.csv rows: device busy time is Computing, gaps inside the window plus the host gap are Free."""
    out = []
    for i, (start, end) in enumerate(windows, start=1):
        busy = sum(float(r["Duration(us)"]) for r, _ in rows if r["Step Id"] == i)
        free = (end - start) - busy + 30.0
        out.append(
            {
                "Device_id": 0,
                "Step": i,
                "Computing": f"{busy:.3f}",
                "Communication(Not Overlapped)": 0,
                "Overlapped": 0,
                "Communication": 0,
                "Free": f"{free:.3f}",
                "Stage": f"{busy + free:.3f}",
                "Bubble": 0,
                "Communication(Not Overlapped and Exclude Receive)": 0,
                "Preparing": "12.500",
            }
        )
    return out


def _operator_details(rows: list) -> list:
    """operator_details.csv rows: one host torch op per device kernel (the sample launches one kernel each)."""
    out = []
    for r, op in rows:
        d = float(r["Duration(us)"])
        out.append(
            {
                "Name": op.torch_op,
                "Input Shapes": '"[4, 128, 576]"',
                "Call Stack": "",
                "Host Self Duration(us)": "8.000",
                "Host Total Duration(us)": "10.000",
                "Device Self Duration(us)": f"{d:.3f}",
                "Device Total Duration(us)": f"{d:.3f}",
                "Device Self Duration With AICore(us)": f"{d:.3f}" if op.core != "AI_CPU" else "0.000",
                "Device Total Duration With AICore(us)": f"{d:.3f}" if op.core != "AI_CPU" else "0.000",
            }
        )
    return out


def _trace_view(rows: list, windows: list) -> list:
    """A minimal trace_view.json: a top-level list, `ts` as strings in us, as torch_npu writes it."""
    ev: list = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "Python"}},
        {"ph": "M", "name": "process_name", "pid": 2, "tid": 0, "args": {"name": "Ascend Hardware"}},
        {"ph": "M", "name": "process_labels", "pid": 2, "tid": 0, "args": {"labels": "NPU 0"}},
        {"ph": "M", "name": "process_name", "pid": 3, "tid": 0, "args": {"name": "Overlap Analysis"}},
    ]
    for i, (start, end) in enumerate(windows, start=1):
        ev.append(
            {
                "ph": "X",
                "name": f"ProfilerStep#{i}",
                "pid": 1,
                "tid": 1,
                "ts": f"{start - 20:.3f}",
                "dur": end - start + 25,
                "cat": "cpu_op",
                "args": {},
            }
        )
    for r, _ in rows:
        ts = r["Start Time(us)"].strip()
        ev.append(
            {
                "ph": "X",
                "name": r["Name"],
                "pid": 2,
                "tid": 2,
                "ts": ts,
                "dur": float(r["Duration(us)"]),
                "args": {"Task Type": r["Accelerator Core"], "Stream Id": 2, "Task Id": r["Task ID"]},
            }
        )
        ev.append(
            {"ph": "X", "name": "Computing", "pid": 3, "tid": 1, "ts": ts, "dur": float(r["Duration(us)"])}
        )
    return ev


def _write_side_files(root: Path, level: str) -> None:
    """profiler_info.json, profiler_metadata.json and the PROF_* device info that carries the core counts."""
    info = {
        "config": {
            "common_config": {
                "activities": ["CPU", "NPU"],
                "schedule": {"wait": 1, "warmup": 1, "active": 5, "repeat": 1, "skip_first": 0},
            },
            "experimental_config": {
                "_profiler_level": level,
                "_aic_metrics": "ACL_AICORE_NONE" if level == "Level0" else "ACL_AICORE_PIPE_UTILIZATION",
            },
        },
        "sample": "built by kit.profiling.sample; numbers are invented",
    }
    (root / "profiler_info.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    (root / "profiler_metadata.json").write_text(
        json.dumps({"torch_npu_version": "2.13.0"}), encoding="utf-8"
    )
    dev = root / "PROF_000001_20260101120000000_SAMPLEKIT" / "device_0"
    dev.mkdir(parents=True)
    (dev / "info.json.0").write_text(
        json.dumps(
            {
                "DeviceInfo": [
                    {"id": 0, "ai_core_num": AI_CORE_NUM, "aiv_num": AIV_NUM, "hwts_frequency": "50"}
                ]
            }
        ),
        encoding="utf-8",
    )


def sample_profile_dir() -> Optional[Path]:
    """The shipped sample under data_samples/ascend_profile_sample/ (None when this checkout lacks it)."""
    from kit.core.samples.paths import DATA_SAMPLES

    root = Path(DATA_SAMPLES) / "ascend_profile_sample"
    found = sorted(root.glob("*_ascend_pt"))
    return found[0] if found else None


def ensure_sample_profile(path: Optional[PathLike] = None, workspace=None, clean: bool = False) -> Path:
    """`path` if given; else the shipped sample (clean=False), or one generated into the workspace's profiles/."""
    if path:
        if not Path(path).exists():
            from kit.profiling.profile_data import ProfileError

            raise ProfileError(
                f"profile {path} does not exist; pass a *_ascend_pt folder or leave it empty "
                f"for the shipped sample."
            )
        return Path(path)
    shipped = None if clean else sample_profile_dir()
    if shipped is not None:
        return shipped
    from kit.core.workspace import get_workspace

    ws = workspace or get_workspace()
    target = Path(ws.profiles) / ("ascend_profile_sample_clean" if clean else "ascend_profile_sample")
    found = sorted(target.glob("*_ascend_pt"))
    if found:
        return found[0]
    print(f"no shipped sample here; writing a {'clean ' if clean else ''}sample profile to {target}")
    return write_sample_ascend_profile(target, clean=clean)
