"""A strict CPU stand-in for `torch_npu.profiler` (torch_npu 2.13.0), for testing kit.profiling's NPU mapping.

Signatures copied as facts from the 2.13.0 wheel (`torch_npu/profiler/profiler.py`, `scheduler.py`,
`experimental_config.py`): `profile(*, ...)` is keyword-only; `schedule` is `Schedule(wait, active, warmup=0,
repeat=0, skip_first=0, skip_first_wait=0)`; `_ExperimentalConfig` resets aic_metrics to ACL_AICORE_NONE at
Level0/Level_none (recorded in `.warnings`). Where the real one prints a warning and silently resets an invalid
value, this one raises, so a test sees the mistake. On a schedule's RECORD_AND_SAVE step the trace handler writes
a small `*_ascend_pt` folder (kit.profiling.sample) shaped like the level asked for.
"""

from __future__ import annotations

import enum
import os
import shutil
import sys
import time
import types
from pathlib import Path

CREATED: list = []  # every profile() made while installed, for assertions


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class ProfilerAction(enum.Enum):
    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


class ProfilerLevel:
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"
    Level_none = "Level_none"


class AiCMetrics:
    PipeUtilization = "ACL_AICORE_PIPE_UTILIZATION"
    ArithmeticUtilization = "ACL_AICORE_ARITHMETIC_UTILIZATION"
    Memory = "ACL_AICORE_MEMORY_BANDWIDTH"
    MemoryL0 = "ACL_AICORE_L0B_AND_WIDTH"
    MemoryUB = "ACL_AICORE_MEMORY_UB"
    ResourceConflictRatio = "ACL_AICORE_RESOURCE_CONFLICT_RATIO"
    L2Cache = "ACL_AICORE_L2_CACHE"
    MemoryAccess = "ACL_AICORE_MEMORY_ACCESS"
    AiCoreNone = "ACL_AICORE_NONE"


class ExportType:
    Db = "db"
    Text = "text"


LEVELS = {ProfilerLevel.Level0, ProfilerLevel.Level1, ProfilerLevel.Level2, ProfilerLevel.Level_none}
METRICS = {v for k, v in vars(AiCMetrics).items() if not k.startswith("_")}


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Invalid parameter {name}: {value!r} (torch_npu would reset it to 0)")


class Schedule:
    """torch_npu's Schedule: note the positional order wait, active, warmup."""

    def __init__(
        self,
        wait: int,
        active: int,
        warmup: int = 0,
        repeat: int = 0,
        skip_first: int = 0,
        skip_first_wait: int = 0,
    ):
        for k, v in dict(
            wait=wait,
            active=active,
            warmup=warmup,
            repeat=repeat,
            skip_first=skip_first,
            skip_first_wait=skip_first_wait,
        ).items():
            _check_int(k, v)
        if active < 1:
            raise ValueError(
                "Invalid parameter active, which must be larger than 0 (torch_npu resets it to 1)"
            )
        self.wait, self.active, self.warmup = wait, active, warmup
        self.repeat, self.skip_first, self.skip_first_wait = repeat, skip_first, skip_first_wait

    def __call__(self, step: int) -> ProfilerAction:
        if step < 0:
            raise ValueError("Invalid parameter step, which must be not less than 0.")
        if step < self.skip_first:
            return ProfilerAction.NONE
        step -= self.skip_first
        if self.skip_first_wait != 0:
            step += self.wait
        num_steps = self.wait + self.warmup + self.active
        if self.repeat > 0 and step / num_steps >= self.repeat:
            return ProfilerAction.NONE
        mod_step = step % num_steps
        if mod_step < self.wait:
            return ProfilerAction.NONE
        if mod_step < self.wait + self.warmup:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD if mod_step < num_steps - 1 else ProfilerAction.RECORD_AND_SAVE


schedule = Schedule


class _ExperimentalConfig:
    def __init__(
        self,
        profiler_level: str = ProfilerLevel.Level0,
        aic_metrics: str = AiCMetrics.PipeUtilization,
        l2_cache: bool = False,
        msprof_tx: bool = False,
        mstx: bool = False,
        data_simplification: bool = True,
        record_op_args: bool = False,
        op_attr: bool = False,
        gc_detect_threshold=None,
        export_type="text",
        host_sys=None,
        mstx_domain_include=None,
        mstx_domain_exclude=None,
        sys_io: bool = False,
        sys_interconnection: bool = False,
    ):
        if profiler_level not in LEVELS:
            raise ValueError(f"Invalid parameter profiler_level: {profiler_level!r}")
        if aic_metrics not in METRICS:
            raise ValueError(f"Invalid parameter aic_metrics: {aic_metrics!r}")
        for k, v in dict(
            l2_cache=l2_cache,
            msprof_tx=msprof_tx,
            mstx=mstx,
            record_op_args=record_op_args,
            op_attr=op_attr,
            sys_io=sys_io,
            sys_interconnection=sys_interconnection,
        ).items():
            if not isinstance(v, bool):
                raise ValueError(f"Invalid parameter {k}, which must be of bool type")
        self.warnings: list = []
        if (
            profiler_level in (ProfilerLevel.Level0, ProfilerLevel.Level_none)
            and aic_metrics != AiCMetrics.AiCoreNone
        ):
            self.warnings.append(
                "Please use level1 or level2 if you want to collect aic metrics, reset aic metrics to None!"
            )
            aic_metrics = AiCMetrics.AiCoreNone
        self.profiler_level, self.aic_metrics, self.l2_cache = profiler_level, aic_metrics, l2_cache
        self.record_op_args, self.data_simplification, self.export_type = (
            record_op_args,
            data_simplification,
            export_type,
        )


def tensorboard_trace_handler(
    dir_name=None, worker_name=None, analyse_flag: bool = True, async_mode: bool = False
):
    """Returns a handler that writes `{worker}_{pid}_{ms timestamp}_ascend_pt` under dir_name."""
    for k, v in dict(analyse_flag=analyse_flag, async_mode=async_mode).items():
        if not isinstance(v, bool):
            raise ValueError(f"{k} is not bool")

    def handler_fn(prof) -> None:
        from kit.profiling.sample import write_sample_ascend_profile

        base = Path(dir_name or os.environ.get("ASCEND_WORK_PATH", os.getcwd()))
        name = f"{worker_name or 'standin'}_{os.getpid()}_{time.strftime('%Y%m%d%H%M%S')}{len(prof.saved):03d}_ascend_pt"
        level = prof.experimental_config.profiler_level if prof.experimental_config else ProfilerLevel.Level0
        out = write_sample_ascend_profile(
            base,
            clean=True,
            steps=prof.schedule.active if prof.schedule else 1,
            level="Level0" if level == ProfilerLevel.Level_none else level,
            name=name,
        )
        if not analyse_flag:
            shutil.rmtree(out / "ASCEND_PROFILER_OUTPUT")  # raw data only, to be parsed by analyse() later
        prof.saved.append(out)

    handler_fn.dir_name, handler_fn.analyse_flag, handler_fn.async_mode = dir_name, analyse_flag, async_mode
    return handler_fn


class profile:  # noqa: N801 - the real name
    def __init__(
        self,
        *,
        activities=None,
        schedule=None,
        on_trace_ready=None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        with_modules: bool = False,
        experimental_config=None,
        execution_trace_observer=None,
        custom_trace_id_callback=None,
        use_cuda=None,
    ):
        acts = set(activities) if activities else {ProfilerActivity.CPU, ProfilerActivity.NPU}
        if not acts <= {ProfilerActivity.CPU, ProfilerActivity.NPU}:
            raise ValueError(
                f"activities must be torch_npu.profiler.ProfilerActivity values, got {activities!r}"
            )
        if schedule is not None and not callable(schedule):
            raise ValueError("schedule is not Callable")
        if experimental_config is not None and not isinstance(experimental_config, _ExperimentalConfig):
            raise ValueError("experimental_config must be torch_npu.profiler._ExperimentalConfig")
        if use_cuda is not None:
            raise ValueError("This is npu environment, use_cuda is invalid")
        self.activities, self.schedule, self.on_trace_ready = acts, schedule, on_trace_ready
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.experimental_config = experimental_config
        self.step_num, self.started, self.stopped, self.saved, self.warnings = 0, False, False, [], []
        CREATED.append(self)

    @property
    def action(self) -> ProfilerAction:
        return self.schedule(self.step_num) if self.schedule else ProfilerAction.RECORD

    def start(self) -> None:
        if self.started and not self.stopped:
            raise RuntimeError("profiler already started")
        self.started, self.stopped = True, False

    def step(self) -> None:
        if not self.started or self.stopped:
            raise RuntimeError("step() outside start()/stop()")
        if self.action == ProfilerAction.RECORD_AND_SAVE and self.on_trace_ready:
            self.on_trace_ready(self)
        self.step_num += 1

    def stop(self) -> None:
        if not self.started:
            raise RuntimeError("stop() before start()")
        if self.action == ProfilerAction.RECORD:
            self.warnings.append(
                "Incorrect schedule: Stop profiler while current state is RECORD which may result "
                "in incomplete parsed data."
            )
        if self.action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE) and self.on_trace_ready:
            self.on_trace_ready(self)
        self.stopped = True

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _module() -> types.ModuleType:
    mod = types.ModuleType("torch_npu.profiler")
    for name in (
        "ProfilerActivity",
        "ProfilerAction",
        "ProfilerLevel",
        "AiCMetrics",
        "ExportType",
        "Schedule",
        "schedule",
        "_ExperimentalConfig",
        "tensorboard_trace_handler",
        "profile",
        "CREATED",
    ):
        setattr(mod, name, globals()[name])
    mod.supported_activities = lambda: {ProfilerActivity.CPU, ProfilerActivity.NPU}
    return mod


def install_profiler(monkeypatch) -> types.ModuleType:
    """Put the fake `torch_npu.profiler` (and a bare `torch_npu` if none is installed) into sys.modules."""
    from kit.system.device import torch_npu_import

    CREATED.clear()
    prof = _module()
    npu = sys.modules.get("torch_npu")
    if npu is None:
        npu = types.ModuleType("torch_npu")
        npu.__version__ = "2.13.0+standin"
        npu.__path__ = []  # a package, so `import torch_npu.profiler` finds the entry below
        monkeypatch.setitem(sys.modules, "torch_npu", npu)
    monkeypatch.setattr(npu, "profiler", prof, raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu.profiler", prof)
    torch_npu_import.cache_clear()  # kit.system.device caches the import result; the caller clears it again after
    return prof
