"""fusion_attention's argument rules and shapes, shared by `kit.ops.attention` and both backends.

The front end (`attention.py`) checks arguments with these; the torch_npu backend (`attention_npu.py`) and the
PyTorch backend (`attention_torch.py`) use the band mask and sizes. They live here so that no backend imports
the front end that imports it.
"""

from __future__ import annotations

LAYOUTS = ("BSND", "BSH", "SBH", "BNSD", "TND")
MAX_TOKENS = 2147483647  # torch_npu's "no limit" value for pre/next tokens
# torch_npu 2.13.0 `_op_plugin_docs.py` (npu_fusion_attention) says both "actual_seq_qlen holds 1..2K entries" and
# "in the varlen case at most 1K": the safe side is 1024 sequences per TND call, on every backend.
MAX_VARLEN_SEQUENCES = 1024


def check_layout(input_layout: str) -> str:
    """Validate and normalise an input_layout name."""
    layout = str(input_layout).upper()
    if layout not in LAYOUTS:
        raise ValueError(f"input_layout={input_layout!r} is not one of {LAYOUTS} (torch_npu's layouts).")
    return layout


def head_dims(query, key, value, layout: str, head_num: int) -> tuple[int, int, int, int]:
    """(Nq, Nkv, D, Dv) from the tensors, checking head_num, GQA ratio, dtypes and ranks like torch_npu does."""
    rank = 3 if layout in ("BSH", "SBH", "TND") else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; layout {layout} needs {rank}-D tensors.")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"query/key/value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype}); cast them first."
        )
    # a value head narrower than the key's (MLA: Dv < Dk) only where D is an axis of its own
    per_head = layout not in ("BSH", "SBH")
    if tuple(key.shape[:-1]) != tuple(value.shape[:-1]) or not (
        value.shape[-1] == key.shape[-1] or (per_head and value.shape[-1] < key.shape[-1])
    ):
        raise ValueError(
            f"key shape {tuple(key.shape)} and value shape {tuple(value.shape)}: torch_npu needs them equal "
            "but for a value head_dim below the key's (Dk >= Dv) in BSND/BNSD/TND."
        )
    if layout in ("BSH", "SBH"):
        if head_num <= 0 or query.shape[2] % head_num:
            raise ValueError(f"head_num={head_num} does not divide the query hidden size {query.shape[2]}.")
        d = query.shape[2] // head_num
        if key.shape[2] % d:
            raise ValueError(f"key hidden size {key.shape[2]} is not a multiple of head_dim {d}.")
        nq, nkv, dv = head_num, key.shape[2] // d, d
    else:
        axis = 1 if layout in ("BNSD", "TND") else 2
        nq, nkv, d, dv = query.shape[axis], key.shape[axis], query.shape[-1], value.shape[-1]
        if head_num != nq:
            raise ValueError(f"head_num={head_num} but the query has {nq} heads (axis {axis} of {layout}).")
        if key.shape[-1] != d:
            raise ValueError(f"query head_dim {d} != key head_dim {key.shape[-1]}.")
    if nkv == 0 or nq % nkv:
        raise ValueError(
            f"{nq} query heads are not a multiple of {nkv} key/value heads (GQA needs Nq % Nkv == 0)."
        )
    if layout != "TND" and query.shape[1 if layout == "SBH" else 0] != key.shape[1 if layout == "SBH" else 0]:
        raise ValueError(f"query batch {query.shape[0]} != key batch {key.shape[0]}.")
    return nq, nkv, d, dv


def lengths_from_cumulative(cumulative, total: int, name: str) -> list[int]:
    """Per-sequence lengths from torch_npu's cumulative list (no leading 0; trailing 0s = unused batches)."""
    if cumulative is None:
        raise ValueError(
            f"input_layout='TND' needs {name} (cumulative lengths, e.g. cu_seqlens[1:].tolist())."
        )
    if hasattr(cumulative, "tolist"):
        cumulative = cumulative.tolist()
    values = [int(v) for v in cumulative]
    while len(values) > 1 and values[-1] == 0:  # trailing zeros: batches that take no part
        values.pop()
    if not values or len(values) > MAX_VARLEN_SEQUENCES:
        raise ValueError(f"{name} has {len(values)} entries; torch_npu supports 1..{MAX_VARLEN_SEQUENCES}.")
    lengths, previous = [], 0
    for v in values:
        if v < previous:
            raise ValueError(
                f"{name}={values[:8]}... is not cumulative (non-decreasing). Pass running totals without the "
                "leading 0, e.g. lengths [2, 3] -> [2, 5]."
            )
        lengths.append(v - previous)
        previous = v
    if previous != total:
        raise ValueError(f"{name} ends at {previous} but the tensor has {total} tokens along T.")
    return lengths


def check_band(pre_tokens: int, next_tokens: int, causal: bool, query, key, layout: str) -> None:
    """torch_npu's rules for a band (npu_fusion_attention, sparse_mode 0/4): negative values need a wide other side.

    next_tokens < 0: pre_tokens >= |next_tokens| and |next_tokens| < Skv; pre_tokens < 0: next_tokens >=
    |pre_tokens| and |pre_tokens| < Sq. With causal=True the effective next is min(next_tokens, 0). In TND
    (varlen) a negative side leaves the first or last rows of every sequence without keys, which varlen refuses.
    """
    nxt = min(next_tokens, 0) if causal else next_tokens
    if pre_tokens < 0 and nxt < 0:
        raise ValueError(f"pre_tokens={pre_tokens} and next_tokens={nxt} leave no key visible.")
    if nxt >= 0 and pre_tokens >= 0:
        return
    if layout == "TND":
        raise ValueError(
            f"pre_tokens={pre_tokens}, next_tokens={nxt} (causal={causal}) leave rows without keys, which "
            "torch_npu's varlen (TND) mode does not allow; use a non-negative window."
        )
    _b, sq, skv = sizes(query, key, layout)
    if nxt < 0 and not (pre_tokens >= -nxt and -nxt < skv):
        raise ValueError(
            f"next_tokens={nxt} needs pre_tokens >= {-nxt} and |next_tokens| < Skv={skv} (torch_npu band rules)."
        )
    if pre_tokens < 0 and not (nxt >= -pre_tokens and -pre_tokens < sq):
        raise ValueError(
            f"pre_tokens={pre_tokens} needs next_tokens >= {-pre_tokens} and |pre_tokens| < Sq={sq} "
            "(torch_npu band rules)."
        )


def sizes(query, key, layout: str) -> tuple[int, int, int]:
    """(B, Sq, Skv) for the non-varlen layouts."""
    if layout == "SBH":
        return query.shape[1], query.shape[0], key.shape[0]
    if layout == "BNSD":
        return query.shape[0], query.shape[2], key.shape[2]
    return query.shape[0], query.shape[1], key.shape[1]


def check_mask(mask, query, key, layout: str, nq: int, seq_q, seq_kv) -> None:
    """Check an explicit atten_mask: bool/uint8 (True = masked), shape SS/11SS/B1SS/BNSS (TND: maxSq x maxSkv)."""
    import torch

    if mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(
            f"atten_mask dtype {mask.dtype} is not bool/uint8. torch_npu masks are boolean with True = masked "
            "(the opposite of SDPA's boolean mask); convert an additive float mask with `mask < 0`."
        )
    if layout == "TND":
        allowed = [(max(seq_q), max(seq_kv))]
    else:
        b, sq, skv = sizes(query, key, layout)
        allowed = [(sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, nq, sq, skv)]
    if tuple(mask.shape) not in allowed:
        raise ValueError(f"atten_mask shape {tuple(mask.shape)} is not one of {allowed} for layout {layout}.")


def band_keep(sq: int, skv: int, causal: bool, pre_tokens: int, next_tokens: int, device):
    """Boolean (Sq, Skv) "may attend" matrix for causal/band, origin bottom-right; None when nothing is cut."""
    import torch

    nxt = min(next_tokens, 0) if causal else next_tokens
    if nxt >= sq - 1 and pre_tokens >= skv - 1:  # rel spans [1-Skv, Sq-1]
        return None
    rel = torch.arange(skv, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (skv - sq)
    return (rel <= nxt) & (rel >= -pre_tokens)
