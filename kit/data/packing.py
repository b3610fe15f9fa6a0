"""Packing whole dialogs into fixed-length samples: best-fit decreasing, deterministic, never splitting a dialog."""

from __future__ import annotations

import bisect
from typing import Dict, List, Sequence, Tuple

import numpy as np

IGNORE = -100


def pack_lengths(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Group item indices into bins of total length <= capacity; bins and their items in input order.

    Best-fit decreasing: longest first, each into the fullest bin it still fits (ties by index), which wastes
    less padding than first-fit in arrival order. Items longer than `capacity` are an error (filter them first).
    """
    too_long = [i for i, n in enumerate(lengths) if n > capacity or n <= 0]
    if too_long:
        raise ValueError(
            f"items {too_long[:5]} have lengths outside 1..{capacity}; truncate or drop them first"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: List[Tuple[int, int]] = []  # (room left, bin id), sorted: the first with room >= n is the best fit
    bins: List[List[int]] = []
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, b = free.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    for b in bins:
        b.sort()
    bins.sort(key=lambda b: b[0])
    return bins


def build_packs(
    items: List[Tuple[np.ndarray, np.ndarray]], bins: List[List[int]], max_length: int, pad_id: int
) -> Dict[str, object]:
    """Rows of the HF columns (and MindSpeed segment-id masks) for `bins` of (ids, labels) items."""
    n = len(bins)
    input_ids = np.full((n, max_length), pad_id, dtype=np.int32)
    labels = np.full((n, max_length), IGNORE, dtype=np.int32)
    attention = np.zeros((n, max_length), dtype=np.int32)
    positions = np.zeros((n, max_length), dtype=np.int32)
    segments = np.zeros((n, max_length), dtype=np.int32)
    seq_lens: List[List[int]] = []
    for r, b in enumerate(bins):
        at, lens = 0, []
        for s, i in enumerate(b, 1):
            ids, lab = items[i]
            m = ids.size
            input_ids[r, at : at + m] = ids
            labels[r, at : at + m] = lab
            positions[r, at : at + m] = np.arange(m, dtype=np.int32)
            segments[r, at : at + m] = s
            at += m
            lens.append(m)
        attention[r, :at] = 1
        seq_lens.append(lens)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention,
        "position_ids": positions,
        "segment_ids": segments,
        "seq_lens": seq_lens,
    }
