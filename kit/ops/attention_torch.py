"""Portable branch of `fusion_attention`: torch SDPA per layout, a per-sequence loop for TND (varlen)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kit.ops.attention_args import band_keep


def _to_bnsd(x, layout: str, n: int):
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, n, h // n).transpose(1, 2)
    s, b, h = x.shape  # SBH
    return x.view(s, b, n, h // n).permute(1, 2, 0, 3)


def _from_bnsd(out, layout: str):
    b, n, s, dv = out.shape
    if layout == "BSND":
        return out.transpose(1, 2).contiguous()
    if layout == "BNSD":
        return out
    if layout == "BSH":
        return out.transpose(1, 2).reshape(b, s, n * dv)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * dv)  # SBH


# SDPA takes GQA natively from torch 2.5; ModelArts images with older torch get K/V repeated instead.
_NATIVE_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def _sdpa(q, k, v, keep, *, scale: float, keep_prob: float, is_causal: bool = False):
    """SDPA on (B, N, S, D) with a boolean keep-mask (True = may attend); rows that see no key give 0."""
    extra = {}
    if q.shape[1] != k.shape[1]:
        if _NATIVE_GQA:
            extra["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, dropout_p=1.0 - keep_prob, is_causal=is_causal, scale=scale, **extra
    )
    if keep is not None:
        dead = ~keep.any(dim=-1, keepdim=True)  # no visible key: define the output as 0, never NaN
        if bool(dead.any()):
            out = out.masked_fill(dead, 0.0)
    return out


def _keep_mask(atten_mask, sq: int, skv: int, causal: bool, pre: int, nxt: int, device):
    """Combine band/causal with an explicit mask (True = masked) into one keep-mask, or None."""
    keep = band_keep(sq, skv, causal, pre, nxt, device)
    if atten_mask is not None:
        user = ~atten_mask.to(device=device, dtype=torch.bool)
        keep = user if keep is None else keep & user
    return keep


def run(
    query,
    key,
    value,
    nq: int,
    nkv: int,
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
    """Portable attention with the exact semantics of the NPU branch."""
    if layout == "TND":
        return _run_varlen(
            query, key, value, atten_mask, causal, scale, keep_prob, pre_tokens, next_tokens, seq_q, seq_kv
        )
    q, k, v = _to_bnsd(query, layout, nq), _to_bnsd(key, layout, nkv), _to_bnsd(value, layout, nkv)
    sq, skv = q.shape[2], k.shape[2]
    # a negative next_tokens shifts the causal edge: then the explicit keep-mask, not SDPA's is_causal
    plain_causal = causal and atten_mask is None and sq == skv and pre_tokens >= skv - 1 and next_tokens >= 0
    if plain_causal:  # lets SDPA pick its fused causal kernels
        out = _sdpa(q, k, v, None, scale=scale, keep_prob=keep_prob, is_causal=True)
    else:
        keep = _keep_mask(atten_mask, sq, skv, causal, pre_tokens, next_tokens, q.device)
        out = _sdpa(q, k, v, keep, scale=scale, keep_prob=keep_prob)
    return _from_bnsd(out, layout)


def _run_varlen(query, key, value, atten_mask, causal, scale, keep_prob, pre, nxt, seq_q, seq_kv):
    """TND: each sequence attends only within itself (block-diagonal), run one SDPA call per sequence."""
    outs = []
    q0 = k0 = 0
    for sq, skv in zip(seq_q, seq_kv):
        if sq == 0:
            k0 += skv
            continue
        q = query[q0 : q0 + sq].transpose(0, 1).unsqueeze(0)
        k = key[k0 : k0 + skv].transpose(0, 1).unsqueeze(0)
        v = value[k0 : k0 + skv].transpose(0, 1).unsqueeze(0)
        local = None if atten_mask is None else atten_mask[:sq, :skv]
        if causal and local is None and sq == skv and pre >= skv - 1 and nxt >= 0:
            out = _sdpa(q, k, v, None, scale=scale, keep_prob=keep_prob, is_causal=True)
        else:
            out = _sdpa(
                q,
                k,
                v,
                _keep_mask(local, sq, skv, causal, pre, nxt, q.device),
                scale=scale,
                keep_prob=keep_prob,
            )
        outs.append(out.squeeze(0).transpose(0, 1))
        q0, k0 = q0 + sq, k0 + skv
    if not outs:
        return query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    return torch.cat(outs, dim=0)
