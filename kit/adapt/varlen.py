"""Packed-sample plan: which tokens are real and where each dialog starts, from position_ids and the 2-D mask.

A dialog boundary is the start of a row or a place where position_ids do not grow by one (the data stage restarts
them at 0 per dialog); padding (attention_mask 0) is dropped. The plan is computed once per forward step and
reused by every layer (one device-to-host sync per step instead of one per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class VarlenPlan:
    """Tokens to keep (flat indices into B*S, None = all) and cumulative sequence ends for TND."""

    indices: Optional[torch.Tensor]
    cumulative: list
    num_sequences: int


_CACHE: list = []  # [(position_ids, mask, versions, plan)], most recent last
_CACHE_SIZE = 4  # enough for models alternating full and sliding-window masks


def _version(t) -> int:
    return -1 if t is None else int(t._version)


def plan_varlen(position_ids, mask2d, batch: int, seqlen: int) -> Optional[VarlenPlan]:
    """The varlen plan for a (B, S) batch, or None when rows are unpadded single sequences (plain causal)."""
    for pos, mask, versions, plan in reversed(_CACHE):
        if pos is position_ids and mask is mask2d and versions == (_version(pos), _version(mask)):
            return plan
    plan = _compute(position_ids, mask2d, batch, seqlen)
    _CACHE.append((position_ids, mask2d, (_version(position_ids), _version(mask2d)), plan))
    del _CACHE[:-_CACHE_SIZE]
    return plan


def _compute(position_ids, mask2d, batch: int, seqlen: int) -> Optional[VarlenPlan]:
    # Work on host copies of the two small (B, S) tensors: the lengths must become Python ints for torch_npu
    # anyway, and plain CPU ops avoid depending on device kernels such as bincount. Only `indices` goes back.
    device = (
        mask2d.device if mask2d is not None else (position_ids.device if position_ids is not None else "cpu")
    )
    keep = None if mask2d is None else mask2d.detach().to("cpu", torch.bool)
    if keep is not None and bool(keep.all()):
        keep = None
    starts = torch.zeros(batch, seqlen, dtype=torch.bool)
    starts[:, 0] = True
    if position_ids is not None:
        pos = position_ids.detach().to("cpu")
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        pos = pos.expand(batch, -1)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if keep is None and not bool(starts[:, 1:].any()):
        return None
    segment = torch.cumsum(starts.flatten().to(torch.int64), 0) - 1
    if keep is None:
        indices, kept_segments = None, segment
    else:
        indices = keep.flatten().nonzero().squeeze(1)
        kept_segments = segment.index_select(0, indices)
        indices = indices.to(device)
    lengths = torch.bincount(kept_segments, minlength=batch)
    cumulative = torch.cumsum(lengths[lengths > 0], 0).tolist()
    return VarlenPlan(indices=indices, cumulative=cumulative, num_sequences=len(cumulative))


def clear_cache() -> None:
    """Forget cached plans (tests; after editing position_ids in place the version check already does this)."""
    _CACHE.clear()
