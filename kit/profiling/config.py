"""The one set of capture options, mapped to torch_npu.profiler on NPU and to torch.profiler elsewhere, and the
limits of the slow-operator advisor's rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LEVELS = ("Level_none", "Level0", "Level1", "Level2")  # torch_npu.profiler.ProfilerLevel attribute names
AIC_METRICS = (
    "AiCoreNone",
    "PipeUtilization",
    "ArithmeticUtilization",
    "Memory",
    "MemoryL0",
    "MemoryUB",
    "ResourceConflictRatio",
    "L2Cache",
    "MemoryAccess",
)  # torch_npu.profiler.AiCMetrics names
DEVICES = ("auto", "npu", "cuda", "cpu")


@dataclass
class ProfileConfig:
    """Capture options; schedule fields follow torch.profiler.schedule, level/aic_metrics apply on NPU only."""

    wait: int = 1
    """Steps ignored at the start of each cycle."""
    warmup: int = 1
    """Steps traced but thrown away (the profiler's own start-up cost)"""
    active: int = 3
    """Steps recorded."""
    repeat: int = 1
    """Cycles; 0 = until the loop ends (one trace per cycle)"""
    skip_first: int = 0
    """Steps skipped once before the first cycle (compilation, first batches)"""
    level: str = "Level1"
    """NPU: Level_none | Level0 | Level1 (unit ratios, op_statistic) | Level2 (+AI CPU data)"""
    aic_metrics: str = "PipeUtilization"
    """NPU: AI Core counters; forced to AiCoreNone at Level0/Level_none."""
    l2_cache: bool = False
    """NPU: L2 cache hit rates (l2_cache.csv)"""
    record_op_args: bool = False
    """NPU: dump operator arguments (for AOE / op analysis)"""
    record_shapes: bool = True
    """Input shapes of every op."""
    profile_memory: bool = False
    """Allocations (memory_record.csv on NPU)"""
    with_stack: bool = False
    """Python call stacks (slower, bigger traces)"""
    analyse: bool = True
    """NPU: parse to ASCEND_PROFILER_OUTPUT right away (False: raw data, analyse() later)"""
    device: str = "auto"
    """Which profiler to use: auto | npu | cuda | cpu."""
    tag: str = ""
    """Short label in the capture folder name, e.g. "bf16" (profile stage: empty = the run type)"""

    def problems(self) -> list:
        """Every invalid value, each with what is allowed."""
        out = []
        for k in ("wait", "warmup", "active", "repeat", "skip_first"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                out.append(f"{k}={v!r} must be an integer >= 0")
        if isinstance(self.active, int) and self.active < 1:
            out.append(f"active={self.active} records nothing; use 1 or more")
        if self.level not in LEVELS:
            out.append(f"level={self.level!r} is not one of {LEVELS}")
        if self.aic_metrics not in AIC_METRICS:
            out.append(f"aic_metrics={self.aic_metrics!r} is not one of {AIC_METRICS}")
        if self.device not in DEVICES:
            out.append(f"device={self.device!r} is not one of {DEVICES}")
        if any(c in self.tag for c in "/\\ ") or len(self.tag) > 40:
            out.append(f"tag={self.tag!r} must be a short name without spaces or slashes")
        return out

    @property
    def effective_aic_metrics(self) -> str:
        """What torch_npu will really use: it resets AI Core metrics to none at Level0 and Level_none."""
        return "AiCoreNone" if self.level in ("Level0", "Level_none") else self.aic_metrics

    @property
    def steps_needed(self) -> int:
        """Steps the loop must run for the first trace to be written."""
        return self.skip_first + self.wait + self.warmup + self.active


@dataclass
class Thresholds:
    """Limits of the advisor's rules; the first six are the ModelArts guide's, the rest the kit's."""

    cast_max_us: float = 30.0
    """A Cast kernel slower than this (us) -> enable mixed precision."""
    cast_share_pct: float = 1.0
    """Cast share of computation time (%) above this -> enable mixed precision."""
    aicpu_max_us: float = 1000.0
    """An AI_CPU kernel slower than this (us) -> replace the API / change dtypes."""
    aicpu_share_pct: float = 10.0
    """AI_CPU share of computation time (%) above this -> replace the API / change dtypes."""
    unit_ratio: float = 0.8
    """In (0, 1]: every aic_*/aiv_* ratio below this (no unit busy) -> AOE."""
    block_dim_vs_cores: bool = True
    """Block Dim below the core count -> AOE."""
    min_op_share_pct: float = 1.0
    """(kit) The ratio and block-dim rules only judge operators above this share of computation time (%)."""
    free_share_pct: float = 20.0
    """(kit) Device idle (Free) above this share of step time (%) -> host-bound."""
    top_n: int = 5
    """How many operators each top list shows."""
    ai_core_num: Optional[int] = None
    """Cube core count when PROF_*/device_*/info.json is missing."""
    aiv_num: Optional[int] = None
    """Vector core count when PROF_*/device_*/info.json is missing."""

    def problems(self) -> list:
        """Every invalid value, as messages."""
        out = [
            f"{k}={getattr(self, k)!r} must be >= 0"
            for k in (
                "cast_max_us",
                "cast_share_pct",
                "aicpu_max_us",
                "aicpu_share_pct",
                "unit_ratio",
                "min_op_share_pct",
                "free_share_pct",
            )
            if getattr(self, k) < 0
        ]
        if not 0 < self.unit_ratio <= 1:
            out.append(f"unit_ratio={self.unit_ratio} must be in (0, 1]")
        if self.top_n < 1:
            out.append(f"top_n={self.top_n} must be >= 1")
        return out
