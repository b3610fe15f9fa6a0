"""`fusion_attention`: the semantics of torch_npu.npu_fusion_attention on any device, with safe defaults.

Differences from the raw torch_npu call, on purpose (each one is a classic adaptation bug):
- `scale` defaults to 1/sqrt(head_dim) (torch_npu's default is 1.0);
- you say `causal=True` / `pre_tokens` / `next_tokens` and the kit picks `sparse_mode` and builds the compressed
  2048x2048 mask once per device; causal is bottom-right aligned (flash-attn >= 2.1, sparse_mode 3), which equals
  top-left when Sq == Skv;
- it returns the attention output only (torch_npu returns a 7-tuple).
Kept as in torch_npu: layouts, `atten_mask` polarity (True = masked), GQA without repeating K/V,
`keep_prob` (= 1 - dropout_p), cumulative `actual_seq_qlen/kvlen` without a leading 0 for TND.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from kit.ops.attention_args import (  # noqa: F401  (LAYOUTS, MAX_TOKENS, ... stay importable from here)
    LAYOUTS,
    MAX_TOKENS,
    MAX_VARLEN_SEQUENCES,
    band_keep,
    check_band,
    check_layout,
    check_mask,
    head_dims,
    lengths_from_cumulative,
)
from kit.ops.backend import resolve


def fusion_attention(
    query,
    key,
    value,
    head_num: int,
    input_layout: str = "BSND",
    *,
    atten_mask=None,
    causal: bool = False,
    scale: Optional[float] = None,
    keep_prob: float = 1.0,
    pre_tokens: int = MAX_TOKENS,
    next_tokens: int = MAX_TOKENS,
    actual_seq_qlen: Optional[Sequence[int]] = None,
    actual_seq_kvlen: Optional[Sequence[int]] = None,
    backend: Optional[str] = None,
):
    """Attention softmax(scale*q.k^T masked)·v in any torch_npu layout; runs torch_npu on NPU, torch SDPA elsewhere."""
    layout = check_layout(input_layout)
    nq, nkv, d, _dv = head_dims(query, key, value, layout, head_num)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not 0.0 < float(keep_prob) <= 1.0:
        raise ValueError(f"keep_prob={keep_prob} must be in (0, 1]; it is 1 - dropout_p (not dropout_p).")
    pre_tokens, next_tokens = int(pre_tokens), int(next_tokens)
    check_band(pre_tokens, next_tokens, causal, query, key, layout)
    seq_q = seq_kv = None
    if layout == "TND":
        seq_q = lengths_from_cumulative(actual_seq_qlen, query.shape[0], "actual_seq_qlen")
        seq_kv = lengths_from_cumulative(actual_seq_kvlen, key.shape[0], "actual_seq_kvlen")
        if len(seq_q) != len(seq_kv):
            raise ValueError(
                f"actual_seq_qlen has {len(seq_q)} sequences but actual_seq_kvlen has {len(seq_kv)}."
            )
        for i, (sq, skv) in enumerate(zip(seq_q, seq_kv)):
            if sq > 0 and (skv == 0 or (causal and sq > skv)):
                raise ValueError(
                    f"TND sequence {i} has {sq} queries and {skv} keys: some queries would see no key, which "
                    "torch_npu does not allow in varlen mode (no fully masked rows). Drop padding tokens instead."
                )
    elif actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise ValueError(f"actual_seq_qlen/kvlen are only for input_layout='TND', not {layout!r}.")
    if atten_mask is not None:
        check_mask(atten_mask, query, key, layout, nq, seq_q, seq_kv)
    args = dict(
        atten_mask=atten_mask,
        causal=bool(causal),
        scale=float(scale),
        keep_prob=float(keep_prob),
        pre_tokens=int(pre_tokens),
        next_tokens=int(next_tokens),
        seq_q=seq_q,
        seq_kv=seq_kv,
    )
    if resolve(query, backend) == "npu":
        from kit.ops import attention_npu

        return attention_npu.run(query, key, value, head_num, layout, **args)
    from kit.ops import attention_torch

    return attention_torch.run(query, key, value, nq, nkv, layout, **args)
