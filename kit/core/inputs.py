"""One input finder: a stage finds what an earlier stage made through the manifests (kit.core.manifest), two ways only.

Each stage declares its inputs in a short table of `Input` rows (the setting that names one, its kind, what fits).
`newest(ws, row, match)`: the workspace's newest output of the row's kind that fits, when the setting was not given.
`named(ws, row)`: the training run named for the later stages (`name_run`: every finished run names itself, and
notebook 04 names the run it wants 05-07 to take); the run a stage takes is never "the newest". Only a run tied to the
named one is found by `newest`, among the runs whose manifests say so (06: the DPO runs started from the SFT run).
`consumed(manifest, kind)`: the input of a kind an output records it was made from (`run_outputs` follows a training
run's). Newest means one thing everywhere: the latest manifest `created` time (written when the output was finished),
then the latest manifest file change, then the folder's path. A stage that takes an output it was not given says which
one and why (`Found.why`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    MANIFEST_NAME,
    PREPARED_DATA,
    TRAINING_RUN,
    Manifest,
    read_manifest,
)
from kit.errors import KitError
from kit.storage.atomic import atomic_write_text

NAMED_RUN = "named_run.json"  # in saved_dir_for_ma_output/<model>/: the training run notebooks 05-07 take

# where each kind lives in a workspace (kit.core.workspace.Workspace attributes) and how many levels below them
PLACES = {
    PREPARED_DATA: (("data_pretrain", "data_finetune"), 1),
    CONVERTED_CHECKPOINT: (("converted_weights",), 2),
    TRAINING_RUN: (("model_output",), 3),
}


@dataclass(frozen=True)
class Input:
    """One row of a stage's input table: the setting that names the input, the kind of output it is, what fits."""

    setting: str
    kind: str
    fits: str = ""


@dataclass(frozen=True)
class Found:
    """An output a stage took from the workspace, and the sentence that says why."""

    manifest: Manifest
    why: str

    @property
    def folder(self) -> Path:
        return self.manifest.folder


def _newest_first(man: Manifest) -> tuple:
    return man.created, (man.folder / MANIFEST_NAME).stat().st_mtime_ns, str(man.folder)


def outputs(ws: Any, kind: str, match: Optional[Callable[[Manifest], bool]] = None) -> List[Manifest]:
    """The workspace's finished outputs of `kind` that `match` accepts, newest first (the steps a profile capture
    trained are not outputs of the workspace)."""
    roots, depth = PLACES[kind]
    skip = Path(ws.profiles).resolve()
    found = []
    for attr in roots:
        root = Path(getattr(ws, attr))
        for level in range(1, depth + 1):
            for path in root.glob("*/" * level + MANIFEST_NAME):
                folder = path.parent.resolve()
                if any(p.startswith(".") for p in path.parent.relative_to(root).parts):
                    continue  # unfinished outputs (temporary names)
                if folder == skip or skip in folder.parents:
                    continue
                try:
                    man = read_manifest(folder)
                except (
                    KitError
                ):  # a damaged or foreign folder is not a candidate; naming it is the explicit path's job
                    continue
                if man.kind == kind and (match is None or match(man)):
                    found.append(man)
    return sorted(found, key=_newest_first, reverse=True)


def newest(ws: Any, need: Input, match: Optional[Callable[[Manifest], bool]] = None) -> Optional[Found]:
    """The workspace's newest output of the row's kind that `match` accepts (`need.fits` says how), or None."""
    found = outputs(ws, need.kind, match)
    if not found:
        return None
    others = f"; {len(found) - 1} older one(s) passed over" if len(found) > 1 else ""
    fits = f" {need.fits}" if need.fits else ""
    why = f"{need.setting} not given: the newest {need.kind}{fits} in the workspace (made {found[0].created}{others})"
    return Found(found[0], why)


def name_run(ws: Any, folder: Path, by: str) -> str:
    """Name the training run `folder` as the one the later stages take (`by` says who named it); one sentence back."""
    run = read_manifest(folder, expect=TRAINING_RUN)
    record = {"run": str(run.folder), "by": by}
    atomic_write_text(Path(ws.model_output) / NAMED_RUN, json.dumps(record, indent=1) + "\n")
    return f"notebooks 05-07 take {run.folder} ({by})"


def named(ws: Any, need: Input) -> Optional[Found]:
    """The training run named for this workspace's model (name_run), or None when none is named or it is gone."""
    path = Path(ws.model_output) / NAMED_RUN
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        man = read_manifest(record["run"], expect=need.kind)
    except (OSError, ValueError, KeyError, TypeError, KitError):
        return None
    return Found(man, f"{need.setting} not given: the run named by {record.get('by')} ({path})")


def consumed(man: Manifest, kind: str) -> Optional[Manifest]:
    """The input of `kind` that `man` records it was made from, read through its own manifest; None when it records
    none or that folder is gone."""
    for c in man.consumed(kind):
        try:
            return read_manifest(c.path, expect=kind)
        except KitError:
            continue
    return None


@dataclass(frozen=True)
class RunOutputs:
    """What a training run made and started from, read through its manifest (evaluation and serving start here)."""

    run: Manifest
    hf: Optional[Path]  # the exported HF model (merged, for LoRA)
    adapter: Optional[Path]  # the LoRA adapter, when the run kept one
    base: Optional[Path]  # the model it started from
    data: Optional[Manifest]  # the prepared data it trained on


def run_outputs(folder: Path) -> RunOutputs:
    """The RunOutputs of the training-run folder `folder` (an error in one line when it is not one)."""
    run = read_manifest(folder, expect=TRAINING_RUN)
    adapter = run.get("adapter")
    return RunOutputs(
        run,
        hf=Path(run["hf"]) if run.get("hf") else None,
        adapter=Path(adapter) if adapter and Path(adapter).is_dir() else None,
        base=Path(run["model"]) if run.get("model") else None,
        data=consumed(run, PREPARED_DATA),
    )
