"""NPU branch of `fusion_attention`: one torch_npu.npu_fusion_attention call with the right sparse_mode and mask.

Facts used (torch_npu 2.13.0 `_op_plugin_docs.py`, npu_fusion_attention): atten_mask True = masked; with
sparse_mode 2/3/4 the mask is the compressed 2048x2048 `triu(ones, 1)`; 3 = causal aligned bottom-right, 4 = band
(pre/next_tockens, origin bottom-right); sparse_mode 0 with a full mask for anything else; no mask = full
attention; `scale` defaults to 1.0 so it is always passed; TND takes cumulative int lists; output index 0;
sparse_mode 3 ignores pre/next_tockens (so a causal call with a negative next goes to band mode 4);
inner_precise 2 "enables invalid-row computation" for rows with every key masked (0/1 are reserved).
What the kernel writes into such a row is not documented: the kit zeroes those rows itself (no host sync), which
is also what the torch branch returns.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from kit.ops.attention_args import MAX_TOKENS, band_keep, sizes
from kit.ops.backend import torch_npu_module

COMPRESSED_MASK_SIZE = 2048
SPARSE_DEFAULT, SPARSE_CAUSAL_BOTTOM_RIGHT, SPARSE_BAND = 0, 3, 4
_MASK_CACHE: dict = {}


def compressed_causal_mask(device) -> torch.Tensor:
    """The 2048x2048 upper-triangular bool mask (True = masked) torch_npu wants, built once per device."""
    key = str(device)
    mask = _MASK_CACHE.get(key)
    if mask is None:
        # torch.triu on the device: no numpy round trip and no host-to-device copy (the TeleChat NPU adaptation notes build it with np.triu + torch.from_numpy)
        ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
        mask = _MASK_CACHE[key] = torch.triu(ones, diagonal=1)
    return mask


def sparse_arguments(
    atten_mask, query, key, layout: str, *, causal: bool, pre_tokens: int, next_tokens: int, seq_q, seq_kv
) -> dict[str, Any]:
    """atten_mask, sparse_mode, pre_tockens, next_tockens for npu_fusion_attention."""
    nxt = min(next_tokens, 0) if causal else next_tokens
    banded = pre_tokens < MAX_TOKENS or nxt < MAX_TOKENS
    if atten_mask is None:
        if not banded:
            return dict(
                atten_mask=None, sparse_mode=SPARSE_DEFAULT, pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS
            )
        mask = compressed_causal_mask(query.device)
        if causal and pre_tokens >= MAX_TOKENS and nxt == 0:
            return dict(
                atten_mask=mask,
                sparse_mode=SPARSE_CAUSAL_BOTTOM_RIGHT,
                pre_tockens=MAX_TOKENS,
                next_tockens=0,
            )
        return dict(atten_mask=mask, sparse_mode=SPARSE_BAND, pre_tockens=pre_tokens, next_tockens=nxt)
    # An explicit mask: fold causal/band into it and let sparse_mode 0 read the full mask.
    mask = atten_mask.to(device=query.device, dtype=torch.bool)
    if banded:
        if layout == "TND":
            if any(a != b for a, b in zip(seq_q, seq_kv)):
                raise ValueError(
                    "TND with an explicit atten_mask plus causal/band needs Sq == Skv per sequence."
                )
            sq, skv = mask.shape
        else:
            sq, skv = mask.shape[-2:]
        keep = band_keep(sq, skv, causal, pre_tokens, next_tokens, mask.device)
        if keep is not None:
            mask = mask | ~keep
    return dict(
        atten_mask=mask.contiguous(),
        sparse_mode=SPARSE_DEFAULT,
        pre_tockens=MAX_TOKENS,
        next_tockens=MAX_TOKENS,
    )


def dead_rows(kwargs: dict, query, key, layout: str, *, causal: bool, pre_tokens: int, next_tokens: int):
    """Bool tensor (B|1, N|1, Sq) of query rows that see no key, or None when there can be none (no host sync)."""
    if layout == "TND":
        return None  # varlen refuses rows without keys before the call
    mask = kwargs["atten_mask"]
    if mask is None:
        return None
    _b, sq, skv = sizes(query, key, layout)
    if kwargs["sparse_mode"] == SPARSE_DEFAULT:  # a full mask: every row of it may be fully masked
        dead = mask.all(dim=-1)
        return dead.reshape((1, 1) + tuple(dead.shape)) if dead.dim() == 1 else dead
    nxt = min(next_tokens, 0) if causal else next_tokens
    if nxt >= sq - skv and pre_tokens >= 0:  # every row keeps at least one key (origin bottom-right)
        return None
    keep = band_keep(sq, skv, causal, pre_tokens, next_tokens, query.device)
    return (~keep.any(dim=-1)).reshape(1, 1, sq)


def zero_rows(out, dead, layout: str, head_num: int):
    """out with the rows in `dead` (B|1, N|1, Sq) set to 0, for the output layout."""
    if layout == "BNSD":
        return out.masked_fill(dead.unsqueeze(-1), 0.0)
    rows = dead.transpose(1, 2).unsqueeze(-1)  # (B|1, Sq, N|1, 1)
    if layout == "BSND":
        return out.masked_fill(rows, 0.0)
    if layout == "BSH":
        b, s, h = out.shape
        return out.view(b, s, head_num, h // head_num).masked_fill(rows, 0.0).view(b, s, h)
    s, b, h = out.shape  # SBH
    view = out.view(s, b, head_num, h // head_num)
    return view.masked_fill(rows.transpose(0, 1), 0.0).view(s, b, h)


NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM, MAX_QUERY_HEADS = 768, 256


def check_limits(query, key, head_num: int, layout: str) -> None:
    """The kernel's documented limits (dtype, D <= 768, Nq <= 256), as errors naming the way out."""
    if query.dtype not in NPU_DTYPES:
        raise ValueError(f"npu_fusion_attention takes fp16/bf16/fp32, not {query.dtype}; cast q/k/v first.")
    d = query.shape[2] // head_num if layout in ("BSH", "SBH") else query.shape[-1]
    if d > MAX_HEAD_DIM or head_num > MAX_QUERY_HEADS:
        raise ValueError(
            f"npu_fusion_attention supports head_dim <= {MAX_HEAD_DIM} and <= {MAX_QUERY_HEADS} query "
            f"heads, got D={d}, N={head_num}; use backend='torch' for this call."
        )


def run(
    query,
    key,
    value,
    head_num: int,
    layout: str,
    *,
    atten_mask,
    causal,
    scale,
    keep_prob,
    pre_tokens,
    next_tokens,
    seq_q,
    seq_kv,
):
    """Call torch_npu.npu_fusion_attention and return the attention output (index 0 of the 7-tuple)."""
    check_limits(query, key, head_num, layout)
    torch_npu = torch_npu_module()
    dv = value.shape[-1]
    padded = dv < key.shape[-1]  # BSND/BNSD/TND only (attention_args.head_dims refuses it for BSH/SBH)
    if padded:
        # section npu_fusion_attention, 约束说明: "输入key和value的shape必须一致" and "D: Head Dim必须满足Dq=Dk和
        # Dk≥Dv": key and value must have one shape, so a smaller value head (DeepSeek MLA: v_head_dim below
        # qk_nope + qk_rope) goes in zero-padded to Dk; its zero channels give zero output channels, sliced off
        # below (and their gradient with them)
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - dv))
    kwargs = sparse_arguments(
        atten_mask,
        query,
        key,
        layout,
        causal=causal,
        pre_tokens=pre_tokens,
        next_tokens=next_tokens,
        seq_q=seq_q,
        seq_kv=seq_kv,
    )
    dead = dead_rows(
        kwargs, query, key, layout, causal=causal, pre_tokens=pre_tokens, next_tokens=next_tokens
    )
    if layout == "TND":
        kwargs["actual_seq_qlen"] = list(itertools.accumulate(map(int, seq_q)))
        kwargs["actual_seq_kvlen"] = list(itertools.accumulate(map(int, seq_kv)))
    outputs = torch_npu.npu_fusion_attention(
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        head_num,
        layout,
        pse=None,
        padding_mask=None,
        scale=scale,
        keep_prob=keep_prob,
        # 2 = compute rows with every key masked correctly (slower); only where such rows can occur
        inner_precise=0 if dead is None else 2,
        **kwargs,
    )
    out = outputs[0] if dead is None else zero_rows(outputs[0], dead, layout, head_num)
    return out[..., :dv] if padded else out
