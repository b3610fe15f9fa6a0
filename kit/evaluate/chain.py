"""Base, SFT and DPO side by side: the runs around the evaluated one, found through their manifests (kit.core.inputs).

A DPO run (notebook 04, RUN_TYPE=dpo) records the model it started from as a consumed `hf-model` input; when that is
the export of a training run, its manifest names the run (the SFT run), whose own `model` is the base. So from a DPO
run the chain goes back to the SFT run and the base model; from an SFT run it goes forward to the DPO runs started
from it in the workspace: the one DPO_RUN names, else the newest, in a printed line that says which and why. The
preference pairs scored are the DPO run's consumed `prepared-data` (kind dpo), their held-out split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from kit.core.inputs import Input, consumed, newest
from kit.core.manifest import HF_MODEL, PREPARED_DATA, TRAINING_RUN, Manifest, find_manifest, read_manifest
from kit.errors import InputError, MissingInputError


def is_dpo(run: Manifest) -> bool:
    """A DPO run, or a resumed one (RUN_TYPE retrain of a dpo run records the same `dpo` block)."""
    return run.get("run_type") == "dpo" or run.get("dpo") is not None


def started_from(dpo: Manifest) -> Optional[Manifest]:
    """The training run whose exported model the DPO run started from (its consumed hf-model's run), or None for a
    DPO run started from a plain model folder."""
    hf = consumed(dpo, HF_MODEL)
    return consumed(hf, TRAINING_RUN) if hf is not None else None


def pairs_of(dpo: Manifest) -> Optional[Manifest]:
    """The preference pairs (prepared-data of kind dpo) the DPO run trained on."""
    data = consumed(dpo, PREPARED_DATA)
    return data if data is not None and data.get("data_kind") == "dpo" else None


def beta_of(dpo: Manifest) -> Optional[float]:
    """The DPO run's β (DPO_BETA): its `dpo` block, else its config."""
    block = dpo.get("dpo") or {}
    beta = block.get("beta", (dpo.get("config") or {}).get("dpo_beta"))
    return float(beta) if beta is not None else None


@dataclass
class Chain:
    """The DPO run and the run it started from (None: a plain model), and the lines saying how they were found."""

    dpo: Manifest
    sft: Optional[Manifest]
    notes: List[str]


def run_of(path: str, setting: str) -> Manifest:
    """A training run given by its folder or by the HF folder it exported."""
    folder = Path(path).expanduser()
    if find_manifest(folder) is None:
        raise MissingInputError(
            f"{setting}={str(folder)!r} holds no kit manifest; give notebook 04's run folder or its hf/ export."
        )
    man = read_manifest(folder, expect=(TRAINING_RUN, HF_MODEL))
    run = consumed(man, TRAINING_RUN) if man.kind == HF_MODEL else man
    if run is None:
        raise InputError(
            f"{setting}={str(folder)!r} is an HF model no training run exported; give a run folder."
        )
    return run


def _same(a: Optional[Manifest], b: Optional[Manifest]) -> bool:
    return a is not None and b is not None and a.folder == b.folder


def find_chain(cfg: Any, ws: Any, run: Optional[Manifest]) -> Optional[Chain]:
    """The DPO run of the evaluation and the SFT run it started from, as the module doc says; None when there is none.
    `run` is the evaluated training run (None: a model folder without a run)."""
    if cfg.dpo_run:
        dpo = run_of(cfg.dpo_run, "DPO_RUN")
        if not is_dpo(dpo):
            raise InputError(
                f"DPO_RUN={cfg.dpo_run!r} is a {dpo.get('run_type')} run, not a DPO run (RUN_TYPE=dpo in notebook 04)."
            )
        sft = started_from(dpo)
        if run is not None and not (_same(run, dpo) or _same(run, sft)):
            raise InputError(
                f"DPO_RUN={cfg.dpo_run!r} started from {sft.folder if sft else dpo.get('model')}, not from the run "
                f"evaluated ({run.folder}); give RUN={str(sft.folder if sft else dpo.folder)!r}, or leave DPO_RUN=None."
            )
        return Chain(dpo, sft, [f"DPO run {dpo.folder}: DPO_RUN given"])
    if run is None:
        return None
    if is_dpo(run):
        sft = started_from(run)
        how = (
            f"it started from the model the run {sft.folder} exported (its consumed hf-model manifest)"
            if sft is not None
            else f"it started from the model folder {run.get('model')}, which no training run exported"
        )
        return Chain(run, sft, [f"the evaluated run {run.folder} is a DPO run: {how}"])
    need = Input("DPO_RUN", TRAINING_RUN, f"of RUN_TYPE=dpo started from the evaluated run {run.folder.name}")
    found = newest(ws, need, lambda m: is_dpo(m) and _same(started_from(m), run))
    if found is None:
        return None
    return Chain(found.manifest, run, [f"DPO run {found.folder}: {found.why}"])
