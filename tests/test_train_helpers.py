"""Synthetic prepared datasets in the data stage's exact output format (columns + meta.json), for trainer tests."""

from __future__ import annotations

import json
import random
from pathlib import Path


def _save(rows: dict, folder: Path, meta: dict) -> Path:
    import datasets

    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    (folder / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps({"synthetic": True}), encoding="utf-8")
    return folder


def make_pretrain(
    folder: Path, num_samples: int = 32, max_length: int = 32, vocab_size: int = 2522, seed: int = 0
) -> Path:
    """Packed pretraining samples: each row counts up from a random start by a row-specific stride (learnable)."""
    rng = random.Random(seed)
    rows = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": []}
    for _ in range(num_samples):
        start, stride = rng.randrange(10, 60), rng.choice([1, 2])
        ids = [10 + (start + stride * i) % 50 for i in range(max_length)]
        rows["input_ids"].append(ids)
        rows["labels"].append(list(ids))
        rows["attention_mask"].append([1] * max_length)
        rows["position_ids"].append(list(range(max_length)))
    meta = {
        "kind": "pretrain",
        "max_length": max_length,
        "tokenizer": "synthetic",
        "vocab_size": vocab_size,
        "pad_token_id": 0,
        "eos_token_id": 2,
        "num_samples": num_samples,
    }
    return _save(rows, Path(folder), meta)


def make_sft(
    folder: Path,
    num_samples: int = 32,
    max_length: int = 48,
    vocab_size: int = 2522,
    pad_id: int = 0,
    seed: int = 0,
) -> Path:
    """Packed SFT samples: 1-3 dialogs per row (prompt masked with -100, answer = prompt reversed), then padding."""
    rng = random.Random(seed)
    rows = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": [], "seq_lens": []}
    for _ in range(num_samples):
        ids, labels, pos, lens = [], [], [], []
        while True:
            prompt = [rng.randrange(100, 140) for _ in range(rng.randrange(3, 7))]
            dialog = [5] + prompt + [6] + prompt[::-1] + [2]
            if len(ids) + len(dialog) > max_length:
                break
            ids += dialog
            labels += [-100] * (len(prompt) + 2) + prompt[::-1] + [2]
            pos += list(range(len(dialog)))
            lens.append(len(dialog))
        pad = max_length - len(ids)
        rows["input_ids"].append(ids + [pad_id] * pad)
        rows["labels"].append(labels + [-100] * pad)
        rows["attention_mask"].append([1] * len(ids) + [0] * pad)
        rows["position_ids"].append(pos + [0] * pad)
        rows["seq_lens"].append(lens)
    meta = {
        "kind": "sft",
        "max_length": max_length,
        "tokenizer": "synthetic",
        "vocab_size": vocab_size,
        "pad_token_id": pad_id,
        "eos_token_id": 2,
        "num_samples": num_samples,
    }
    return _save(rows, Path(folder), meta)


def tiny_config(model_dir: Path, data_dir: Path, work_dir: Path, **kw):
    """A TrainConfig for a few fast CPU steps on the tiny model (override anything with keywords)."""
    from kit.train import TrainConfig

    base = dict(
        run_type="pretrain",
        model_type="tiny",
        model_path=str(model_dir),
        dataset_path=str(data_dir),
        work_dir=str(work_dir),
        train_iters=6,
        mbs=2,
        gbs=4,
        lr=3e-3,
        warmup_iters=1,
        seed=7,
        save_hf=False,
    )
    base.update(kw)
    return TrainConfig(**base)
