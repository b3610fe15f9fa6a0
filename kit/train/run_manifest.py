"""The manifests a training run leaves: `training-run` in the run folder, `hf-model` in its exported HF folder.

Written last, when the run completed (a folder with a manifest is complete): the exported model's first, whose input
is the run (the SHA-256 of the run manifest about to be written), so notebook 03 can take the model back to Megatron and
say where it came from; then the run's (the resolved config with the source of every value, the prepared data and model
it consumed, checkpoints, metrics, log). A failure between the two leaves a run without a manifest (not complete),
never a "complete" run whose hf/ has none. A resumed run (RUN_TYPE retrain) rewrites both with its own checkpoints and
config.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, List, Optional, Tuple

from kit.core.manifest import (
    HF_MODEL,
    TRAINING_RUN,
    Consumed,
    Manifest,
    find_manifest,
    read_manifest,
    render_manifest,
    write_manifest,
)
from kit.errors import InputError


def consumed_inputs(cfg: Any) -> Tuple[List[Consumed], dict]:
    """(the prepared-data and model manifests the run consumed, the data's facts)."""
    from kit.data.prepared import read_prepared

    inputs = []
    data_man = read_prepared(cfg.dataset_path).manifest
    facts = dict(data_man.fields)
    inputs.append(data_man.as_input())
    if cfg.model_path and find_manifest(cfg.model_path) is not None:
        try:
            inputs.append(read_manifest(cfg.model_path).as_input())
        except InputError:  # a damaged manifest in a model folder the run could train from anyway
            pass
    return inputs, facts


def _family(hf_dir: Path) -> Optional[str]:
    from kit.convert import model_facts

    try:
        return model_facts(hf_dir).get("family")
    except InputError:  # an architecture the conversion family maps do not cover: the model still exports
        return None


def write_run_manifests(result: Any, ckpt_root: Path) -> Tuple[Manifest, Optional[Manifest]]:
    """Write the exported HF folder's hf-model manifest, then the run folder's training-run manifest."""
    from kit.core.manifest import tokenizer_sha256
    from kit.errors import MissingInputError

    cfg = result.config
    inputs, facts = consumed_inputs(cfg)
    checkpoints = sorted(str(p.resolve()) for p in Path(ckpt_root).glob("iter_*") if p.is_dir())
    fields = {
        "run_type": cfg.run_type,
        "config": cfg.to_dict(),
        "sources": dict(cfg.sources),
        "data": str(Path(cfg.dataset_path).resolve()),
        "model": str(Path(cfg.model_path).resolve()) if cfg.model_path else None,
        "checkpoints": checkpoints,
        "hf": str(Path(result.hf_dir).resolve()) if result.hf_dir else None,
        "metrics": str(Path(result.metrics_path).resolve()),
        "log": str(Path(result.log_path).resolve()),
        "adapter": str(Path(result.adapter_dir).resolve()) if result.adapter_dir else None,
        "status": result.status,
        "iterations": result.iteration,
        "last_loss": result.losses[-1] if result.losses else None,
        "heldout": facts.get("heldout"),  # the data's held-out split, for notebook 06
        "engine": cfg.engine,
    }
    if getattr(result, "dpo", None) is not None:  # RUN_TYPE dpo: beta, the reference, the last step's rewards
        fields["dpo"] = result.dpo
    run_text = render_manifest(TRAINING_RUN, fields, inputs)
    if not result.hf_dir:
        return _named(write_manifest(result.output_dir, TRAINING_RUN, fields, text=run_text), cfg), None
    run_input = Consumed(
        TRAINING_RUN,
        str(Path(result.output_dir).resolve()),
        hashlib.sha256(run_text.encode("utf-8")).hexdigest(),
    )
    hf_dir = Path(result.hf_dir)
    try:
        tok_hash = tokenizer_sha256(hf_dir)
    except MissingInputError:  # models without tokenizer files (tiny test models)
        tok_hash = None
    hf = write_manifest(
        hf_dir,
        HF_MODEL,
        {
            "family": _family(hf_dir),
            "source": str(Path(result.output_dir).resolve()),
            "direction": "trained",
            "tokenizer": str(hf_dir.resolve()),
            "tokenizer_sha256": tok_hash,
            "base_model": fields["model"],
        },
        inputs=[run_input],
    )
    run = write_manifest(result.output_dir, TRAINING_RUN, fields, text=run_text)
    assert run.sha256 == run_input.manifest_sha256  # what hf/'s manifest records as its input
    return _named(run, cfg), hf


def _named(run: Manifest, cfg: Any) -> Manifest:
    """A finished run of the workspace names itself for notebooks 05-07 (kit.core.inputs.name_run); the steps a
    profile capture trains do not."""
    from kit.core.inputs import name_run

    ws = cfg.workspace()
    if (
        Path(ws.model_output).resolve() in run.folder.parents
        and Path(ws.profiles).resolve() not in run.folder.parents
    ):
        name_run(ws, run.folder, f"training (the last run finished: {cfg.run_type}, {run.created})")
    return run
