"""Synthetic prepared datasets in the data stage's output format (columns + prepared-data manifest), for trainer tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kit.core.manifest import CONVERTED_CHECKPOINT, PREPARED_DATA, tokenizer_sha256, write_manifest


def _save(rows: dict, folder: Path, meta: dict) -> Path:
    import datasets

    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    (folder / "config.json").write_text(json.dumps({"synthetic": True}), encoding="utf-8")
    kind = meta["kind"]
    fields = {
        "data_kind": kind,
        "max_length": meta["max_length"],
        "tokenizer": meta["tokenizer"],
        "tokenizer_sha256": None,  # a synthetic set: no tokenizer folder
        "template": None,
        "pack": True,
        "eos_token_id": meta["eos_token_id"],
        "pad_token_id": meta["pad_token_id"],
        "vocab_size": meta["vocab_size"],
        "hf_path": str(Path(folder).resolve()),
        "megatron_prefix": None,
        "megatron_flags": ["--reset-attention-mask", "--neat-pack"] if kind == "sft" else [],
        "heldout": None,
        "counts": {"samples": meta["num_samples"]},
        "num_samples": meta["num_samples"],
    }
    write_manifest(folder, PREPARED_DATA, fields)
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


def with_heldout(data: Path, held: Path, records: int) -> Path:
    """`data`'s manifest names `held` (rows like make_sft's) as its held-out split, as notebook 02's does."""
    from kit.core.manifest import read_manifest

    fields = dict(read_manifest(data).fields)
    fields["heldout"] = {"path": str(held), "records": records, "rows": records, "rule": "synthetic"}
    write_manifest(data, PREPARED_DATA, fields)
    return data


def prepared(folder: Path, tokenizer: Path, max_length: int = 48, kind: str = "sft", **fields) -> Path:
    """A prepared-data folder as notebook 02 leaves it: rows + a prepared-data manifest."""
    (make_sft if kind == "sft" else make_pretrain)(folder, num_samples=4, max_length=max_length)
    base = {
        "data_kind": kind,
        "max_length": max_length,
        "tokenizer": str(tokenizer),
        "tokenizer_sha256": fields.pop("tokenizer_sha256")
        if "tokenizer_sha256" in fields
        else tokenizer_sha256(tokenizer),
        "template": "chatml" if kind == "sft" else None,
        "pack": True,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "vocab_size": 2522,
        "hf_path": str(folder),
        "megatron_prefix": None,
        "megatron_flags": ["--reset-attention-mask", "--neat-pack"] if kind == "sft" else [],
        "heldout": None,
        "counts": {"samples": 4},
        "num_samples": 4,
    }
    base.update(fields)
    write_manifest(folder, PREPARED_DATA, base)
    return folder


def converted(folder: Path, tp=4, pp=4, layer_list=(7, 8, 8, 7), padded=32000, layers=30) -> Path:
    """A converted-checkpoint folder as notebook 03 leaves it (manifest + rank folders) for a 30-layer model."""
    for t in range(tp):
        for p in range(pp):
            (folder / "iter_0000001" / f"mp_rank_{t:02d}_{p:03d}").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("1")
    model = {
        "family": "llama", "hidden_size": 256, "ffn_hidden_size": 512, "num_layers": layers, "num_heads": 8,
        "num_groups": 4, "num_kv_groups": 4, "num_attention_heads": 8, "head_dim": 32, "vocab_size": 32000,
        "norm_eps": 1e-5, "tied": False, "qkv_bias": False, "position": "rope", "rotary_base": 10000.0,
        "rotary_percent": 1.0, "rotary_interleaved": False, "max_position_embeddings": 4096, "norm_head": False,
    }  # fmt: skip
    write_manifest(
        folder,
        CONVERTED_CHECKPOINT,
        {
            "direction": "hf_to_megatron", "family": "llama", "flavor": "local", "tp": tp, "pp": pp,
            "num_layer_list": list(layer_list), "padded_vocab_size": padded, "dtype": "bfloat16", "model": model,
            "source": "/hf/model", "tokenizer": None,
        },
    )  # fmt: skip
    return folder


def tiny_config(model_dir: Path, data_dir: Path, work_dir: Path, **kw):
    """A TrainConfig for a few fast CPU steps on the tiny model (override anything with keywords)."""
    from kit.train import TrainConfig

    base = dict(
        run_type="pretrain",
        model_name="tiny",
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


def padded_and_packed_dialogs():
    """Two SFT dialogs (labels on the answers, as kit.data writes them) as a padded batch of two rows, and as the one
    row the trainer feeds without padding (position_ids restarting)."""
    import torch

    from kit.train.trainer import flatten_padded_rows

    d1, d2 = [5, 101, 120, 133, 6, 133, 120, 101, 2], [5, 110, 111, 6, 111, 110, 2]
    l1, l2 = [-100] * 5 + [133, 120, 101, 2], [-100] * 4 + [111, 110, 2]  # kit.data: labels = ids on answers
    pad = len(d1) - len(d2)
    padded = {
        "input_ids": torch.tensor([d1, d2 + [0] * pad]),
        "labels": torch.tensor([l1, l2 + [-100] * pad]),
        "attention_mask": torch.tensor([[1] * len(d1), [1] * len(d2) + [0] * pad]),
        "position_ids": torch.tensor([list(range(len(d1))), list(range(len(d2))) + [0] * pad]),
    }
    packed = flatten_padded_rows(padded)
    assert packed["input_ids"].shape == (1, len(d1) + len(d2))
    return padded, packed
