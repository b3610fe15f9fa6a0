"""The one set of capture options, mapped to torch_npu.profiler on NPU and to torch.profiler elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

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
