"""Profile the training notebook 04 configured (notebook 05, `python -m kit profile demo`).

The stage reads a `training-run` manifest (given, or the run named for the later stages: kit.core.inputs.named), rebuilds that run's TrainConfig
from the manifest's `config`, and runs a few steps of the same training (model, data, settings) through
`kit.train.train(cfg, step_callbacks=[capture])`. The steps write into the capture folder, never over the run's
own checkpoints and logs. The capture folder gets the advice, the top-operators plot and a `profile-capture`
manifest that names the run it profiled (folder + manifest hash); it appears under its final name only when all
of that is written. With no training run named in the workspace, a run is configured here from the defaults notebook
04 uses (demo model, the shipped SFT sample) and the stage says so in one line.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

from kit.core.inputs import Input, named
from kit.core.manifest import (
    MANIFEST_NAME,
    PROFILE_CAPTURE,
    TRAINING_RUN,
    Consumed,
    Manifest,
    read_manifest,
    write_manifest,
)
from kit.profiling.capture import Capture, profile
from kit.profiling.config import ProfileConfig
from kit.profiling.profile_data import CaptureError, ProfileError

PathLike = Union[str, Path]
RUN = Input("RUN", TRAINING_RUN)  # the run profiled; its model, data and settings follow its manifest
TRAINING_FOLDER = "training"  # inside the capture folder: the profiled steps' own workspace (logs, metrics)
# What a run configured here uses when the workspace has no training run: notebook 04's parameter defaults.
DEFAULT_RUN = {"run_type": "sft", "mbs": 1, "gbs": 2, "lr": 1e-4, "warmup_iters": 1, "save_interval": 0}


def schedule_steps(cfg: ProfileConfig) -> int:
    """Optimizer steps the schedule needs for every cycle to be written (repeat=0 counts as one cycle)."""
    return cfg.skip_first + max(cfg.repeat, 1) * (cfg.wait + cfg.warmup + cfg.active)


def profiled_config(train_cfg: Any, work_dir: PathLike, steps: int) -> Tuple[Any, List[str]]:
    """The run's config for `steps` profiled steps written under `work_dir`; notes say what had to change."""
    notes = []
    if train_cfg.engine != "deepspeed":
        raise ProfileError(
            f"the run uses ENGINE={train_cfg.engine!r}, which trains outside this process; profile it with "
            f"torch_npu.profiler inside its launch script, or profile an ENGINE='deepspeed' run here."
        )
    changes = dict(
        train_iters=steps,
        warmup_iters=min(train_cfg.warmup_iters, steps),
        save_interval=0,
        save_hf=False,
        overwrite=True,
        work_dir=str(work_dir),
    )
    if train_cfg.run_type == "retrain":  # the new workspace has no checkpoint to resume: train as the run did
        changes["run_type"] = train_cfg.resume_from
        notes.append(f"RUN_TYPE=retrain profiled as {train_cfg.resume_from} steps (no checkpoint is resumed)")
    if train_cfg.world_size > 1:
        # one process here: the same micro batches per card and optimizer step as each card of the run
        changes.update(nnodes=1, nproc_per_node=1, node_rank=0, gbs=train_cfg.mbs * train_cfg.grad_accum)
        notes.append(
            f"the run used {train_cfg.world_size} processes; profiled in one process with "
            f"GBS={changes['gbs']} (MBS={train_cfg.mbs} x grad accum {train_cfg.grad_accum}, the work of one card)"
        )
    from kit.train.config import replace

    return replace(train_cfg, **changes), notes


def configure_default_run(
    ws: Any, model_path: Optional[PathLike] = None, seq_len: Optional[int] = None
) -> Tuple[Any, List[Consumed], str]:
    """(TrainConfig, consumed inputs, one line) for a run like notebook 04's defaults, when there is none.

    Its values are found as notebook 04 finds them: the demo model unless `model_path`, notebook 02's data in the
    workspace, else the shipped sample prepared now (the profiled run is resolved once, by `run`).
    """
    from kit.train.config import TrainConfig
    from kit.train.resolve import resolve_values
    from kit.train.run_manifest import consumed_inputs

    given = dict(DEFAULT_RUN)
    if model_path is not None:
        given["model_path"] = str(model_path)
    if seq_len is not None:
        given["seq_len"] = int(seq_len)
    cfg = resolve_values(TrainConfig(**given), ws)
    inputs, _facts = consumed_inputs(cfg)
    line = (
        f"no training run named in {ws.model_output} (notebook 04 trains and names one): profiling {cfg.run_type} steps of "
        f"{Path(cfg.model_path).name} on {cfg.dataset_path}, configured here from notebook 04's defaults"
    )
    return cfg, inputs, line


@dataclass
class ProfileResult:
    """One profiled training: the capture, what it trained, the operator table, advice and files written."""

    capture: Capture
    manifest: Manifest  # the capture's profile-capture manifest
    training_run: Optional[Manifest]  # the run profiled; None when the run was configured here
    train_config: Any  # the TrainConfig the profiled steps ran with
    train_result: Any  # kit.train.TrainResult of those steps
    data: Any  # ProfileData of the capture
    table: Any  # operator table (top operators)
    advice: Any  # kit.profiling.Advice
    files: dict = field(default_factory=dict)  # role -> path (advice files, plot)
    configured_here: str = ""  # the one line said when no training run existed
    notes: List[str] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        return self.capture.folder

    def describe(self) -> str:
        """Which run was profiled, where the capture is, what it recorded."""
        what = self.training_run.folder if self.training_run else "a run configured here"
        return f"profiled {what}: {self.data.describe()}"

    def summary(self) -> dict:
        """Scalars and paths for the notebook's summary: the capture and the run it profiled (path + hash)."""
        run = self.training_run
        return {
            "capture_folder": str(self.folder),
            "capture_kind": self.capture.kind,
            "capture_steps": self.capture.steps,
            "capture_traces": [str(p) for p in self.capture.traces],
            "capture_git_commit": self.data.meta.get("capture", {}).get("git_commit"),
            "capture_top_operators": list(self.table["type"].head(5)),
            "capture_problems": self.advice.problems,
            "capture_advice": str(self.files["json"]),
            "capture_plot": str(self.files["plot"]),
            "capture_manifest": str(self.folder / MANIFEST_NAME),
            "capture_manifest_sha256": self.manifest.sha256,
            "training_run": str(run.folder) if run else None,
            "training_run_manifest_sha256": run.sha256 if run else None,
            "inputs": [dataclasses.asdict(c) for c in self.manifest.inputs],
            "configured_here": self.configured_here,
            "profiled_run_type": self.train_config.run_type,
            "profiled_model_path": self.train_config.model_path,
            "profiled_dataset_path": self.train_config.dataset_path,
            "profiled_train_iters": self.train_config.train_iters,
            "profiled_training": str(self.folder / TRAINING_FOLDER),
            "train_status": self.train_result.status,
            "train_losses": list(self.train_result.losses),
            "notes": list(self.notes),
        }


def _published(path: Path, cap: Capture) -> Path:
    """A path inside the capture's temporary folder, as it reads once the folder is published."""
    return cap.folder / Path(path).relative_to(cap.work_folder)


def _published_json(value: Any, cap: Capture) -> Any:
    """JSON values with every path inside the capture's temporary folder as it reads once published."""
    text = json.dumps(value)
    for temp in {str(cap.work_folder.resolve()), str(cap.work_folder)}:
        text = text.replace(json.dumps(temp)[1:-1], json.dumps(str(cap.folder))[1:-1])
    return json.loads(text)


def _keep_measurements(result: Any, cap: Capture) -> List[str]:
    """Delete the profiled steps' checkpoint (trained to be measured, not kept: it would only fill the disk) and
    rewrite their training-run manifest so it lists what is left, under the capture's final paths."""
    shutil.rmtree(Path(result.output_dir) / "checkpoints", ignore_errors=True)
    nested = getattr(result, "manifest", None)
    if nested is None:
        return []
    fields = _published_json(dict(nested.fields), cap)
    fields.update(checkpoints=[], hf=None, profiled_by=str(cap.folder))
    write_manifest(nested.folder, TRAINING_RUN, fields, inputs=nested.inputs)
    return [f"the profiled steps' checkpoint was deleted; their logs and metrics are in {TRAINING_FOLDER}/"]


def run(
    cfg: ProfileConfig,
    ws: Any,
    training_run: Optional[PathLike] = None,
    model_path: Optional[PathLike] = None,
    seq_len: Optional[int] = None,
    top: int = 10,
    progress: bool = True,
) -> ProfileResult:
    """Profile a few steps of `training_run` (default: the named run; none: notebook 04's defaults)."""
    import matplotlib.pyplot as plt

    from kit.core.configs import check, to_jsonable
    from kit.profiling.advisor import advise
    from kit.profiling.loader import find_profiles, load
    from kit.profiling.plots import plot_top_operators
    from kit.profiling.tables import operator_table
    from kit.train import train
    from kit.train.config import from_dict, from_manifest
    from kit.train.resolve import resolve

    check(cfg, "profiling options")
    taken = []
    if training_run is not None:
        run_m: Optional[Manifest] = read_manifest(training_run, expect=TRAINING_RUN)
    else:
        found = named(ws, RUN)
        run_m = found.manifest if found else None
        if found:  # the run this stage inherits, and why that one
            taken = [f"profiling {found.folder}: {found.why}"]
            print(taken[0])
    line = ""
    if run_m is not None:
        # the resolved TrainConfig the run was made with (its manifest's `config`)
        train_cfg, inputs = from_manifest(run_m), [run_m.as_input()]
    else:
        train_cfg, inputs, line = configure_default_run(ws, model_path, seq_len)
        print(line)
    if not cfg.tag:
        cfg = dataclasses.replace(cfg, tag=str(train_cfg.run_type))
    cap = profile(out_dir=ws.profiles, config=cfg, workspace=ws)
    result = None
    try:
        pcfg, notes = profiled_config(
            train_cfg, cap.work_folder / TRAINING_FOLDER, schedule_steps(cap.config)
        )
        plan = resolve(pcfg)  # before the profiler starts: a bad config records nothing
        cap.start()
        try:
            result = train(plan, step_callbacks=[cap], progress=progress)
        finally:
            if result is None or result.status != "completed":
                work = cap.stop(failed=True)
        if result.status != "completed" and cap.steps:  # SIGTERM / Ctrl-C / NaN before the schedule ended
            raise CaptureError(
                f"the profiled training stopped at step {result.iteration} of {pcfg.train_iters} "
                f"({result.status}); the capture was not published. Its unfinished folder is {work} "
                f"(kit.profiling.load(..., allow_unfinished=True) reads it; delete it when done); rerun the "
                f"capture to get a complete one."
            )
        if result.status != "completed":
            raise CaptureError(
                f"the profiled training stopped before its first step ({result.status}); nothing was recorded "
                f"and nothing was kept; rerun the capture."
            )
    except BaseException:
        if cap.steps == 0:  # stopped before the first profiled step (Ctrl-C while loading): nothing is left
            shutil.rmtree(cap.work_folder, ignore_errors=True)
        raise
    work = cap.stop(publish=False)
    notes = taken + notes + list(cap.notes) + _keep_measurements(result, cap)
    ran_with = _published_json(result.config.to_dict() if result.config else to_jsonable(pcfg), cap)
    data = load(work)
    table = operator_table(data, top=top)
    advice = advise(data)
    files = advice.save(work / "advice")
    files["plot"] = work / "top_operators.png"
    fig = plot_top_operators(
        table, top=top, path=files["plot"], title=f"{cap.kind.upper()} capture: top operators"
    )
    plt.close(fig)
    write_manifest(
        work,
        PROFILE_CAPTURE,
        {
            "device": data.meta.get("capture", {}).get("device", {"kind": cap.kind}),
            "options": to_jsonable(cap.config),
            "training_run": str(run_m.folder) if run_m else None,
            "configured_here": line,
            "profiled_config": ran_with,
            "steps": cap.steps,
            "traces": [str(p.relative_to(work)) for p in find_profiles(work)],
            "git_commit": data.meta.get("capture", {}).get("git_commit"),
            "problems": advice.problems,
            "train_status": result.status,
            "notes": notes,
        },
        inputs=inputs,
    )
    cap.publish()
    return ProfileResult(
        capture=cap,
        manifest=read_manifest(cap.folder, expect=PROFILE_CAPTURE),
        training_run=run_m,
        train_config=from_dict(ran_with, f"{cap.folder} profiled config"),
        train_result=result,
        data=load(cap.folder),
        table=table,
        advice=advice,
        files={k: _published(v, cap) for k, v in files.items()},
        configured_here=line,
        notes=notes,
    )


def profile_trainer(
    train_config: Any,
    config: Optional[ProfileConfig] = None,
    out_dir: Optional[PathLike] = None,
    workspace: Any = None,
    **options: Any,
) -> tuple:
    """Run the kit trainer (kit.train.train) with a capture in its step_callbacks; returns (capture, result).

    The schedule must fit in `train_config.train_iters`; the capture's folder is named after the run type.
    """
    from kit.train import train

    cfg = dataclasses.replace(config or ProfileConfig(), **options)
    if cfg.steps_needed > train_config.train_iters:
        raise ProfileError(
            f"the profile schedule needs {cfg.steps_needed} steps (skip_first+wait+warmup+active) but "
            f"TRAIN_ITERS={train_config.train_iters}; lower ACTIVE/WAIT or train longer."
        )
    if not cfg.tag:
        cfg = dataclasses.replace(cfg, tag=str(getattr(train_config, "run_type", "train")))
    cap = profile(out_dir=out_dir, config=cfg, workspace=workspace)
    with cap:
        result = train(train_config, step_callbacks=[cap], progress=False)
    return cap, result
