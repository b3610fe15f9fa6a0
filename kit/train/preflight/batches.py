"""The preflight's batches: notebook 02's Megatron files through megatron-core's own dataset classes (`GPTDataset` for
pretraining, `IndexedDataset` for MindSpeed-LLM's packed fine-tuning files), as [n, s] tensors every rank and the HF
side share; the attention mask megatron-core takes for them, and the loss both sides take of them."""

from __future__ import annotations

import numpy as np


class _Tokenizer:
    """What megatron-core's GPTDataset asks of a tokenizer: vocabulary size, end-of-document and pad ids."""

    def __init__(self, vocab_size: int, eod: int, pad: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, pad
        # part of the dataset's description hash (the cache file names)
        self.unique_identifiers = {
            "class": "kit.train.preflight",
            "vocab_size": vocab_size,
            "eod": eod,
            "pad": pad,
        }


def read_batches(job: dict, cache: str) -> dict:
    """Every sample the run consumes, [n, s] tensors: tokens, labels, loss_mask, position_ids, segments (ids)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data, n = job["data"], job["samples"]
    if data["kind"] == "dpo":  # MindSpeed-LLM's pairwise files: [n, 2, s] pairs (kit.train.preflight.dpo)
        from kit.train.preflight.dpo import read_pairs

        return read_pairs(job)
    if data["kind"] == "pretrain":
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.utils import Split

        indexed = IndexedDataset(data["prefix"])
        cfg = GPTDatasetConfig(
            random_seed=job["seed"],
            sequence_length=job["seq_len"],
            blend=([data["prefix"]], None),
            split="100,0,0",
            path_to_cache=cache,
            tokenizer=_Tokenizer(job["vocab_size"], data["eod"], data["pad"]),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
        )
        ds = GPTDataset(
            indexed, data["prefix"], np.arange(len(indexed.document_indices) - 1), n, Split.train, cfg
        )
        rows = [ds[i] for i in range(n)]
        out = {k: torch.stack([r[k] for r in rows]).long() for k in ("tokens", "labels", "position_ids")}
        out["loss_mask"] = torch.stack([r["loss_mask"] for r in rows]).float()
        out["segments"] = torch.ones_like(out["tokens"])
        return out
    # packed fine-tuning rows: MindSpeed-LLM's `<prefix>_packed_<key>_document` files, read by IndexedDataset
    files = {
        k: IndexedDataset(f"{data['prefix']}_packed_{k}_document")
        for k in ("input_ids", "attention_mask", "labels")
    }
    rows = len(files["input_ids"])
    pick = [i % rows for i in range(n)]
    ids = torch.stack([torch.from_numpy(files["input_ids"][i].astype(np.int64)) for i in pick])
    seg = torch.stack([torch.from_numpy(files["attention_mask"][i].astype(np.int64)) for i in pick])
    lab = torch.stack([torch.from_numpy(files["labels"][i].astype(np.int64)) for i in pick])
    # the model predicts token t+1 at t, inside one dialog only (--reset-attention-mask --neat-pack)
    nxt = torch.cat([lab[:, 1:], torch.full_like(lab[:, :1], -100)], 1)
    same = torch.cat([seg[:, 1:] == seg[:, :-1], torch.zeros_like(seg[:, :1], dtype=torch.bool)], 1)
    keep = (nxt != -100) & same & (seg > 0)
    pos = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        start = 0
        for t in range(1, ids.shape[1] + 1):
            if t == ids.shape[1] or seg[b, t] != seg[b, start]:
                pos[b, start:t] = torch.arange(t - start)
                start = t
    return {
        "tokens": ids,
        "labels": torch.where(keep, nxt, torch.zeros_like(nxt)),
        "loss_mask": keep.float(),
        "position_ids": pos,
        "segments": seg,
    }


def megatron_mask(segments):
    """megatron-core's attention mask (True = masked): causal, and only inside one segment."""
    import torch

    s = segments.shape[-1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    return (causal[None] | (segments[:, :, None] != segments[:, None, :]))[:, None]


def masked_mean(values, mask):
    """The preflight's loss on both sides: the mean of per-token values over the loss-masked tokens."""
    return (values * mask).sum() / mask.sum().clamp(min=1)
