"""A tiny stand-in for notebook 04's output, for the tests and the browser suite: manifests as 04 writes them.

`tiny_training_run` prepares a few Alpaca dialogs with kit.data (four records held out, as notebook 02 does),
takes a second seeded tiny Llama as the "trained" model and writes the training-run and hf-model manifests that
tie them to the base model and the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

PathLike = Union[str, Path]


def tiny_training_run(ws_root: PathLike, base: PathLike, trained: PathLike, model: str = "tiny") -> Path:
    """Write a workspace holding a training run of `base` -> `trained` (made with seed 1); return the run folder."""
    from kit.data import DataConfig, prepare
    from kit.manifest import HF_MODEL, PREPARED_DATA, TRAINING_RUN, read_manifest, write_manifest
    from kit.samples import tiny_llama
    from kit.workspace import get_workspace

    ws = get_workspace(ws_root, model=model)
    trained = Path(trained)
    if not (trained / "config.json").is_file():
        tiny_llama(trained, seed=1)
    cfg = DataConfig(
        kind="sft",
        name="alpaca",
        max_length=64,
        max_records=40,
        template="chatml",
        heldout_records=4,
        overwrite=True,
    )
    data = read_manifest(prepare(cfg, ws, progress=False).hf_dir, expect=PREPARED_DATA)
    # not notebook 04's sft/ folder: a real run there stays intact
    run_dir = ws.model_output / "tiny_eval_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    run = write_manifest(
        run_dir,
        TRAINING_RUN,
        {
            "run_type": "sft",
            "config": {},
            "sources": {},
            "data": str(data.folder),
            "model": str(Path(base).resolve()),
            "checkpoints": [],
            "hf": str(trained.resolve()),
            "metrics": str(run_dir / "metrics.jsonl"),
            "log": str(run_dir / "sft.log"),
            "heldout": data["heldout"],
        },
        inputs=[data.as_input()],
    )
    write_manifest(
        trained,
        HF_MODEL,
        {"family": "llama", "source": str(run_dir.resolve()), "base_model": str(Path(base).resolve())},
        inputs=[run.as_input()],
    )
    return run_dir
