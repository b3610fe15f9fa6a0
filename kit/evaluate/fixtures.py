"""A tiny stand-in for notebook 04's output, for the tests and the browser suite: manifests as 04 writes them.

`tiny_training_run` prepares a few Alpaca dialogs with kit.data, holds four rows out (unless the data stage
already named a held-out split), takes a second seeded tiny Llama as the "trained" model and writes the
prepared-data (when missing), training-run and hf-model manifests that tie them to the base model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

PathLike = Union[str, Path]


def tiny_training_run(ws_root: PathLike, base: PathLike, trained: PathLike, model: str = "tiny") -> Path:
    """Write a workspace holding a training run of `base` -> `trained` (made with seed 1); return the run folder."""
    from datasets import load_from_disk

    from kit.data import DataConfig, prepare
    from kit.manifest import (
        HF_MODEL,
        PREPARED_DATA,
        TRAINING_RUN,
        find_manifest,
        read_manifest,
        tokenizer_sha256,
        write_manifest,
    )
    from kit.samples import sample_tokenizer_dir, tiny_llama
    from kit.workspace import get_workspace

    ws = get_workspace(ws_root, model=model)
    trained = Path(trained)
    if not (trained / "config.json").is_file():
        tiny_llama(trained, seed=1)
    cfg = DataConfig(
        kind="sft", name="alpaca", max_length=64, max_records=40, template="chatml", overwrite=True
    )
    data = Path(prepare(cfg, ws, progress=False).hf_dir)
    man = read_manifest(data) if find_manifest(data) is not None else None
    if man is None or not man.get("heldout"):
        held = data.parent / "alpaca_heldout_hf"
        load_from_disk(str(data)).select(range(4)).save_to_disk(str(held))
        tok = str(sample_tokenizer_dir())
        fields = dict(man.fields) if man else {}
        fields.update(
            {
                "data_kind": "sft",
                "max_length": 64,
                "tokenizer": tok,
                "tokenizer_sha256": tokenizer_sha256(tok),
                "template": "chatml",
                "pack": True,
                "eos_token_id": 2,
                "pad_token_id": 0,
                "vocab_size": 2522,
                "hf_path": str(data),
                "megatron_prefix": fields.get("megatron_prefix"),
                "megatron_flags": fields.get("megatron_flags", []),
                "heldout": {"path": str(held), "records": 4, "rule": "first 4 rows (tiny test run)"},
                "counts": fields.get("counts", {}),
            }
        )
        man = write_manifest(data, PREPARED_DATA, fields)
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
            "data": str(data),
            "model": str(Path(base).resolve()),
            "checkpoints": [],
            "hf": str(trained.resolve()),
            "metrics": str(run_dir / "metrics.jsonl"),
            "log": str(run_dir / "sft.log"),
            "heldout": man["heldout"],
        },
        inputs=[man.as_input()],
    )
    write_manifest(
        trained,
        HF_MODEL,
        {"family": "llama", "source": str(run_dir.resolve()), "base_model": str(Path(base).resolve())},
        inputs=[run.as_input()],
    )
    return run_dir
