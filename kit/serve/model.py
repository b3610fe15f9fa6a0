"""What is served: notebook 04's exported model (or its LoRA adapter on the base), found through the manifests.

Given MODEL_PATH, that folder (an `hf-model` manifest inside it leads back to its run, for the chat template);
else RUN or the run named for the later stages (kit.core.inputs.named): its `hf` (the exported, merged model), `adapter` and `model`
(the base) entries, and the chat template its prepared data was made with. No run at all: the demo model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from kit.core.inputs import Input, RunOutputs, consumed, named, run_outputs
from kit.core.manifest import HF_MODEL, TRAINING_RUN, Consumed, find_manifest, read_manifest
from kit.errors import InputError, MissingInputError

RUN = Input(
    "RUN", TRAINING_RUN
)  # the run whose model is served; its adapter, base and template come through its manifest


@dataclass
class ServedModel:
    """The folder the engine loads, the adapter beside it (if any) and where they came from."""

    path: Path
    adapter: Optional[Path] = None
    base: Optional[Path] = None
    template: Optional[str] = None
    run: Optional[Path] = None
    consumed: List[Consumed] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def context_length(self) -> Optional[int]:
        """max_position_embeddings of the served model's config.json (None when it does not say)."""
        cfg = json.loads((self.path / "config.json").read_text(encoding="utf-8"))
        value = cfg.get("max_position_embeddings") or cfg.get("seq_length")
        return int(value) if value else None


def _check_hf(folder: Path, what: str) -> Path:
    if not folder.exists():
        raise MissingInputError(
            f"{what}={str(folder)!r} does not exist; give an HF model folder (config.json)."
        )
    if not (folder / "config.json").is_file():
        raise InputError(
            f"{what}={str(folder)!r} has no config.json: an engine serves HF folders; convert a Megatron "
            f"checkpoint first (python -m kit convert --direction megatron_to_hf) or give notebook 04's hf/ folder."
        )
    return folder.resolve()


def _from_run(made: RunOutputs, out: ServedModel) -> None:
    out.run, out.base, out.adapter = made.run.folder, made.base, made.adapter
    out.consumed.append(made.run.as_input())
    if made.data is not None:
        out.template = made.data.get("template")
        out.consumed.append(made.data.as_input())


def resolve_model(cfg, ws) -> ServedModel:
    """The ServedModel a ServeConfig names; see the module doc."""
    if cfg.model_path:
        folder = _check_hf(Path(cfg.model_path).expanduser(), "MODEL_PATH")
        out = ServedModel(path=folder)
        if find_manifest(folder) is not None:
            man = read_manifest(folder)
            if man.kind == HF_MODEL:
                out.consumed.append(man.as_input())
                run = consumed(man, TRAINING_RUN)
                if cfg.run is None and run is not None:
                    _from_run(run_outputs(run.folder), out)
        if cfg.run:
            _from_run(run_outputs(Path(cfg.run).expanduser()), out)
        return out
    found = None if cfg.run else named(ws, RUN)
    run_folder = Path(cfg.run).expanduser() if cfg.run else found and found.folder
    if run_folder is None:
        from kit.core.samples import demo_model_dir

        model = Path(demo_model_dir())
        note = f"no training run named in {ws.model_output} (notebook 04 trains and names one): serving the demo model {model.name}"
        print(note)
        return ServedModel(path=model.resolve(), template="tokenizer", notes=[note])
    made = run_outputs(run_folder)
    if made.hf is None:
        raise InputError(
            f"{made.run.folder}: the run exported no HF model (hf is None); give MODEL_PATH (a converted folder) "
            f"or train with an HF export."
        )
    out = ServedModel(path=_check_hf(made.hf, "the run's hf"))
    if found is not None:  # the run this stage inherits, and why that one
        out.notes.append(f"serving {found.folder}: {found.why}")
        print(out.notes[-1])
    if find_manifest(out.path) is not None:
        out.consumed.append(read_manifest(out.path).as_input())
    _from_run(made, out)
    return out
