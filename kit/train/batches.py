"""Training batches: load notebook 02's prepared rows and cut them into deterministic global batches (resumable)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterator, Union

from kit.data.prepared import (
    COLUMNS,
    MODEL_INPUTS,
)  # the model-input columns, declared once by the data stage
from kit.errors import InputError
from kit.train.inputs import DATA_KIND_FOR_RUN

PathLike = Union[str, Path]


def load_dataset(path: PathLike):
    """The prepared `datasets.Dataset` (validated by kit.data, torch format, model inputs only) and its meta."""
    from kit.data import load_prepared

    ds, meta = load_prepared(path, return_meta=True)
    want = (
        COLUMNS["dpo"] if meta.kind == "dpo" else MODEL_INPUTS
    )  # preference pairs: laid out by kit.train.dpo
    missing = [c for c in want if c not in ds.column_names]
    if missing:
        raise InputError(f"{path} lacks column(s) {missing} (has {ds.column_names}); re-run the data stage.")
    return ds.with_format("torch", columns=list(want)), meta


def max_token_id(ds) -> int:
    """The largest token id of the rows (input_ids, or a pair's three columns), computed with Arrow (no Python loop
    over samples)."""
    import pyarrow.compute as pc

    table = ds.with_format(None).data
    names = [c for c in ("input_ids",) + COLUMNS["dpo"] if c in table.column_names]
    return max(int(pc.max(pc.list_flatten(table.column(c))).as_py()) for c in names)


def dataset_problems(cfg) -> list:
    """Problems between a config, its dataset and its model: kind, length, vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    p = []
    try:
        ds, meta = load_dataset(cfg.dataset_path)
    except (OSError, ValueError) as exc:
        return [f"DATASET_PATH={cfg.dataset_path!r} cannot be loaded: {exc}"]
    want = DATA_KIND_FOR_RUN.get(cfg.run_type)
    if want and meta.get("kind") != want:
        p.append(
            f"DATASET_PATH holds {meta.get('kind')!r} data but RUN_TYPE={cfg.run_type} needs {want!r} data "
            f"(prepare it in notebook 02 with the matching kind)."
        )
    length = int(meta.get("max_length", 0))
    if cfg.seq_len and cfg.seq_len != length:
        p.append(
            f"SEQ_LEN={cfg.seq_len} but the dataset was prepared with max_length={length}; set SEQ_LEN=None "
            f"(inherit the dataset's) or re-prepare the data with max_length={cfg.seq_len}."
        )
    if len(ds) == 0:
        p.append(f"DATASET_PATH={cfg.dataset_path!r} has no samples.")
    model_cfg = AutoConfig.from_pretrained(cfg.model_path)
    model_vocab = int(getattr(model_cfg, "vocab_size", 0) or 0)
    tok_dir = cfg.tokenizer_path or cfg.model_path
    try:
        tok_vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    except (OSError, ValueError) as exc:
        p.append(f"TOKENIZER_PATH={tok_dir!r} has no loadable tokenizer ({exc}).")
        tok_vocab = 0
    if tok_vocab > model_vocab:
        p.append(
            f"tokenizer {tok_dir} has {tok_vocab} tokens but the model's vocab_size is {model_vocab}; use the "
            f"model's own tokenizer or resize the embeddings first."
        )
    if len(ds) and model_vocab:
        top = max_token_id(ds)
        if top >= model_vocab:
            p.append(
                f"DATASET_PATH contains token id {top} >= model vocab_size {model_vocab}: the data was "
                f"tokenized with another tokenizer ({meta.get('tokenizer')}); re-prepare it with the model's."
            )
    return p


@functools.lru_cache(maxsize=2)
def _permutation(num_samples: int, seed: int, epoch: int) -> tuple:
    import torch

    return tuple(torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist())


def global_batch_indices(iteration: int, gbs: int, num_samples: int, seed: int) -> list:
    """Sample indices of optimizer step `iteration` (0-based): a seeded permutation per epoch, epochs chained."""
    out = []
    for g in range(iteration * gbs, (iteration + 1) * gbs):
        epoch, pos = divmod(g, num_samples)
        out.append(_permutation(num_samples, seed, epoch)[pos])
    return out


def micro_batches(ds, iteration: int, cfg, rank: int) -> Iterator[dict]:
    """This rank's micro-batches of one optimizer step: every rank and micro-step takes a disjoint slice.

    The union over ranks and micro-steps is the same global batch whatever the DP/MBS layout, which is what makes
    a 2-card run and a 1-card run with the same GBS see the same data.
    """
    idx = global_batch_indices(iteration, cfg.gbs, len(ds), cfg.seed)
    per_micro = cfg.mbs * cfg.dp
    for m in range(cfg.grad_accum):
        chunk = idx[m * per_micro + rank * cfg.mbs : m * per_micro + (rank + 1) * cfg.mbs]
        yield ds[chunk]


def tokens_in(batch: dict) -> int:
    """Real (non-padding) tokens in a batch: what throughput should count."""
    return int(batch["attention_mask"].bool().sum())
