"""`kit.profiling.profile(...)`: one capture API over torch_npu.profiler (NPU) and torch.profiler (CUDA, CPU).

Use it as a context manager and call `.step()` after every optimizer step, or hand the capture itself to the
trainer's `step_callbacks` (it is a `(step) -> None` callable). Each capture folder gets `capture.json` (git
commit, config, device, what was passed to the profiler) beside the trace, and only appears under its final name
when the profiler stopped cleanly.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Union

from kit.profiling.config import ProfileConfig
from kit.profiling.loader import CAPTURE_FILE, find_profiles
from kit.profiling.profile_data import CaptureError
from kit.system.noise import quiet

PathLike = Union[str, Path]

PROFILER_LOG = "profiler.log"  # what the profiler prints (kineto's markers, its warnings), beside the trace


def git_state(path: Optional[PathLike] = None) -> dict:
    """{'git_commit', 'git_dirty'} of the repository holding `path` (cwd, then the kit's checkout); None if none."""
    from kit.core.workspace import repo_root

    for where in [Path(path) if path else Path.cwd(), repo_root()]:
        try:
            commit = subprocess.run(
                ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            if commit:
                dirty = subprocess.run(
                    ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout.strip()
                return {"git_commit": commit, "git_dirty": bool(dirty), "git_repo": str(where)}
        except (OSError, subprocess.SubprocessError):
            continue
    return {"git_commit": None, "git_dirty": None, "git_repo": None}


def _device_record(kind: str) -> dict:
    """The chosen profiler kind plus what kit.system.device.detect() says (never fails)."""
    from kit.core.configs import to_jsonable

    rec: dict = {"kind": kind}
    try:
        from kit.system.device import detect

        info = detect()
        rec.update({k: v for k, v in to_jsonable(info).items() if k != "kind"}, detected_kind=info.kind)
    except Exception as exc:  # detection problems must not stop a capture; keep them for the report
        rec["detect_error"] = f"{type(exc).__name__}: {exc}"
    return rec


def _npu_profiler_module():
    """torch_npu.profiler, via the guarded import in kit.system.device."""
    from kit.system.device import torch_npu_import

    mod, err = torch_npu_import()
    if mod is None:
        raise CaptureError(
            f"device='npu' but torch_npu cannot be imported ({err}). Run `python -m kit doctor` "
            f"(notebook 00), or use device='auto' to profile with torch.profiler on this machine."
        )
    return importlib.import_module("torch_npu.profiler")


def npu_profiler_kwargs(cfg: ProfileConfig, tp: Any, trace_dir: Path) -> dict:
    """Keyword arguments for torch_npu.profiler.profile (all keyword-only in 2.13.0, profiler.py:202).

    `tp.schedule` is `Schedule(wait, active, warmup=0, ...)`: positional order differs from torch's, so keywords.
    """
    experimental = tp._ExperimentalConfig(
        profiler_level=getattr(tp.ProfilerLevel, cfg.level),
        aic_metrics=getattr(tp.AiCMetrics, cfg.effective_aic_metrics),
        l2_cache=cfg.l2_cache,
        record_op_args=cfg.record_op_args,
        data_simplification=True,
    )
    return dict(
        activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.NPU],
        schedule=tp.schedule(
            wait=cfg.wait, active=cfg.active, warmup=cfg.warmup, repeat=cfg.repeat, skip_first=cfg.skip_first
        ),
        on_trace_ready=tp.tensorboard_trace_handler(dir_name=str(trace_dir), analyse_flag=cfg.analyse),
        record_shapes=cfg.record_shapes,
        profile_memory=cfg.profile_memory,
        with_stack=cfg.with_stack,
        experimental_config=experimental,
    )


def torch_profiler_kwargs(cfg: ProfileConfig, kind: str, trace_dir: Path) -> dict:
    """Keyword arguments for torch.profiler.profile (CPU, plus CUDA when profiling a GPU)."""
    import torch.profiler as tp

    acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if kind == "cuda" else [])
    return dict(
        activities=acts,
        schedule=tp.schedule(
            wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat, skip_first=cfg.skip_first
        ),
        on_trace_ready=tp.tensorboard_trace_handler(str(trace_dir)),
        record_shapes=cfg.record_shapes,
        profile_memory=cfg.profile_memory,
        with_stack=cfg.with_stack,
    )


class Capture:
    """A profiler run writing into one capture folder; `.step()` after each step; usable as a step callback."""

    def __init__(self, config: ProfileConfig, out_dir: Path, kind: str):
        self.config, self.kind = config, kind
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{stamp}-{kind}" + (f"-{config.tag}" if config.tag else "")
        n = 1
        while (Path(out_dir) / name).exists():  # two captures in the same second
            n += 1
            name = f"{stamp}-{kind}" + (f"-{config.tag}" if config.tag else "") + f"-{n}"
        self.folder = Path(out_dir) / name
        self._partial = Path(out_dir) / f".{name}.partial-{os.getpid()}"
        self.steps = 0
        self.notes: list = []
        self._prof = None
        self.profiler: Any = None  # the underlying profiler object once stopped
        self._record: dict = {}

    def start(self) -> Capture:
        """Create the (temporary) folder and start the profiler."""
        from kit.storage.atomic import refuse_existing

        refuse_existing(self.folder, False, "capture folder")
        self._partial.mkdir(parents=True, exist_ok=True)  # a stage may have put its inputs there first
        cfg = self.config
        if self.kind == "npu":
            tp = _npu_profiler_module()
            kwargs = npu_profiler_kwargs(cfg, tp, self._partial)
            if cfg.aic_metrics != cfg.effective_aic_metrics:
                self.notes.append(
                    f"aic_metrics={cfg.aic_metrics} dropped: torch_npu collects no AI Core metrics at "
                    f"{cfg.level} (use level='Level1' for unit ratios)"
                )
            if cfg.analyse and shutil.which("msprof") is None:
                self.notes.append(
                    "msprof is not on PATH: torch_npu cannot export kernel_details.csv. Start the "
                    "Jupyter kernel with CANN's set_env.sh sourced (notebook 01), or set analyse=False "
                    "and run torch_npu.profiler.profiler.analyse(<folder>) later."
                )
            self._prof = tp.profile(**kwargs)
            profiler = "torch_npu.profiler"
        else:
            import torch.profiler

            kwargs = torch_profiler_kwargs(cfg, self.kind, self._partial)
            if cfg.level != "Level1" or cfg.l2_cache or cfg.record_op_args:
                self.notes.append(
                    "level / aic_metrics / l2_cache / record_op_args apply on NPU only; ignored here"
                )
            self._prof = torch.profiler.profile(**kwargs)
            profiler = "torch.profiler"
        self._record = {
            "kit_capture": 1,
            "profiler": profiler,
            "config": dataclasses.asdict(cfg),
            "effective_aic_metrics": cfg.effective_aic_metrics,
            "device": _device_record(self.kind),
            **git_state(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "profiler_kwargs": {k: repr(v) for k, v in kwargs.items()},
        }
        with quiet(self._partial / PROFILER_LOG):  # kineto's start / stop markers go to the log
            self._prof.start()
        return self

    def step(self) -> None:
        """Tell the profiler one training step finished (drives the wait/warmup/active schedule)."""
        if self._prof is None:
            raise CaptureError(
                "capture not started: use `with kit.profiling.profile(...) as cap:` or call .start()"
            )
        with quiet(self._partial / PROFILER_LOG):
            self._prof.step()
        self.steps += 1

    def __call__(self, step: int) -> None:
        """Trainer hook: `step_callbacks=[capture]` calls this after each optimizer step."""
        self.step()

    def stop(self, failed: bool = False, publish: bool = True) -> Path:
        """Stop the profiler, write capture.json and give the folder its final name (kept .partial on failure).

        publish=False keeps the temporary name, so a stage can add its own files (advice, manifest) before
        `publish()` renames the folder: a capture folder under its final name is always complete.
        """
        if self._prof is None:
            raise CaptureError("capture not started: call .start() (or use the `with` block) first")
        with quiet(self._partial / PROFILER_LOG):
            self._prof.stop()
        self.profiler, self._prof = self._prof, None  # kept: torch.profiler's key_averages() stays usable
        if self.steps < self.config.steps_needed:
            self.notes.append(
                f"the loop ran {self.steps} step(s) but the schedule needs {self.config.steps_needed} "
                f"(skip_first+wait+warmup+active): the trace is partial or missing"
            )
        traces = find_profiles(self._partial)
        if not traces:
            self.notes.append("no trace was written: run more steps, or check the profiler's warnings above")
        self._record.update(
            finished=time.strftime("%Y-%m-%dT%H:%M:%S"),
            steps=self.steps,
            failed=failed,
            notes=self.notes,
            traces=[str(p.relative_to(self._partial)) for p in traces],
        )
        (self._partial / CAPTURE_FILE).write_text(json.dumps(self._record, indent=2) + "\n", encoding="utf-8")
        if failed or not publish:
            return self._partial
        return self.publish()

    @property
    def work_folder(self) -> Path:
        """Where the capture is written until it is published (the temporary folder)."""
        return self._partial

    def publish(self) -> Path:
        """Give a stopped capture its final name (the temporary folder is renamed in one step)."""
        if self._prof is not None:
            raise CaptureError("capture still running: call .stop() before .publish()")
        os.replace(self._partial, self.folder)
        return self.folder

    def __enter__(self) -> Capture:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop(failed=exc_type is not None)

    @property
    def traces(self) -> list:
        """The trace files / *_ascend_pt folders in the finished capture."""
        return find_profiles(self.folder)

    def load(self, allow_unfinished: bool = False):
        """kit.profiling.load on this capture."""
        from kit.profiling.loader import load

        return load(self.folder, allow_unfinished=allow_unfinished)


def profile(
    out_dir: Optional[PathLike] = None,
    config: Optional[ProfileConfig] = None,
    workspace: Any = None,
    **options: Any,
) -> Capture:
    """A Capture writing under `out_dir` (default: the workspace's profiles/); options override `config` fields."""
    from kit.core.configs import check

    cfg = dataclasses.replace(config or ProfileConfig(), **options)
    check(cfg, "profiling options")
    if out_dir is None:
        from kit.core.workspace import get_workspace

        out_dir = (workspace or get_workspace()).profiles
    kind = cfg.device
    if kind == "auto":
        from kit.system.device import detect

        kind = detect().kind
    return Capture(cfg, Path(out_dir), kind)
