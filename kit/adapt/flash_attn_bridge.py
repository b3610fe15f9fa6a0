"""A `flash_attn` package made of kit ops, so remote-code models that import flash-attn run unmodified on NPU/CPU.

`install_flash_attn_bridge()` puts `flash_attn`, `flash_attn.flash_attn_interface` and `flash_attn.bert_padding`
into sys.modules. Mapping (flash-attn 2.x API -> kit.ops.fusion_attention): (B, S, N, D) -> "BSND";
varlen (T, N, D) -> "TND" with actual_seq = cu_seqlens[1:] (one host sync per call); window_size (left, right)
-> (pre_tokens, next_tokens), -1 = unlimited; dropout_p -> keep_prob = 1 - dropout_p; softmax_scale None ->
1/sqrt(D); causal is bottom-right aligned as in flash-attn >= 2.1 (identical to 1.x when Sq == Skv).
`flash_attn_unpadded_func` is the 1.x name of the varlen function (TeleChat uses it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch

from kit.ops import MAX_TOKENS, fusion_attention

# The API level emulated: flash-attn 2.6.x, whose flash_attn_func/varlen_func take `softcap` right after
# `window_size` (2.5.9 had `alibi_slopes` there: a positional caller of 2.5 would land in softcap) and whose
# unpad_input still returns 4 values (2.7 returns 5), as remote code expects.
BRIDGE_VERSION = "2.6.3"
_MARK = "__kit_bridge__"


def _attend(
    q, k, v, layout, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, probs, **seq
):
    """Both flash-attn functions' one fusion_attention call (heads = q.shape[-2] in BSND and TND), after refusing
    what it cannot do; `seq` holds TND's actual_seq_qlen / actual_seq_kvlen."""
    if softcap:
        raise NotImplementedError("kit flash-attn bridge: softcap is not supported by npu_fusion_attention.")
    if alibi_slopes is not None:
        raise NotImplementedError(
            "kit flash-attn bridge: alibi_slopes are not supported; use a dense pse instead."
        )
    if probs:
        raise NotImplementedError("kit flash-attn bridge: return_attn_probs=True is not supported.")
    left, right = (int(w) for w in (window_size or (-1, -1)))
    return fusion_attention(
        q,
        k,
        v,
        q.shape[-2],
        layout,
        causal=causal,
        scale=softmax_scale,
        keep_prob=1.0 - dropout_p,
        pre_tokens=MAX_TOKENS if left < 0 else left,
        next_tokens=MAX_TOKENS if right < 0 else right,
        **seq,
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2 `flash_attn_func`: q (B, Sq, N, D), k/v (B, Skv, Nkv, D) -> (B, Sq, N, D)."""
    return _attend(
        q,
        k,
        v,
        "BSND",
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        return_attn_probs,
    )


def _ends(cu_seqlens) -> list:
    """cu_seqlens (with leading 0) -> torch_npu's cumulative ends as Python ints."""
    values = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    if not values or int(values[0]) != 0:
        raise ValueError(f"cu_seqlens must start with 0 (flash-attn convention), got {values[:4]}...")
    return [int(x) for x in values[1:]]


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn 2 `flash_attn_varlen_func`: q (Tq, N, D), k/v (Tk, Nkv, D) with cu_seqlens -> (Tq, N, D)."""
    if block_table is not None:
        raise NotImplementedError("kit flash-attn bridge: paged KV (block_table) is not supported.")
    return _attend(
        q, k, v, "TND", dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
        actual_seq_qlen=_ends(cu_seqlens_q),
        actual_seq_kvlen=_ends(cu_seqlens_k),
    )  # fmt: skip


def flash_attn_unpadded_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale=None,
    causal=False,
    return_attn_probs=False,
    deterministic=False,
):
    """flash-attn 1.x name of the varlen function (TeleChat, early Baichuan/ChatGLM ports)."""
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        return_attn_probs=return_attn_probs,
    )


def flash_attn_qkvpacked_func(
    qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kwargs
):
    """qkv (B, S, 3, N, D)."""
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, **kwargs)


def flash_attn_kvpacked_func(
    q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kwargs
):
    """kv (B, S, 2, Nkv, D)."""
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, **kwargs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **kwargs,
):
    """qkv (T, 3, N, D)."""
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        **kwargs,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **kwargs,
):
    """kv (Tk, 2, Nkv, D)."""
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        **kwargs,
    )


# --- flash_attn.bert_padding ---------------------------------------------------------------------------------


def index_first_axis(x, indices):
    """x[indices] along the first axis (flash-attn's autograd-friendly gather)."""
    return x.index_select(0, indices)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(B, S, ...) + mask (B, S) -> (tokens (T, ...), indices, cu_seqlens int32 with leading 0, max_seqlen)."""
    if unused_mask is not None:
        raise NotImplementedError("kit flash-attn bridge: unpad_input(unused_mask=...) is not supported.")
    mask = attention_mask.to(torch.bool)
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = mask.flatten().nonzero().flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, int(seqlens.max())


def pad_input(hidden_states, indices, batch, seqlen):
    """Inverse of unpad_input: scatter (T, ...) back to (B, S, ...) with zeros on padding."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    return out.index_copy(0, indices, hidden_states).view(batch, seqlen, *hidden_states.shape[1:])


INTERFACE = (
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_unpadded_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
)
PADDING = ("index_first_axis", "unpad_input", "pad_input")
MODULE_NAMES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding")


def _module(name: str, attrs, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(
        name, "kit flash-attn bridge: flash-attn API on kit.ops (npu_fusion_attention / SDPA)"
    )
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        mod.__path__ = []
    setattr(mod, _MARK, True)
    for attr in attrs:
        setattr(mod, attr, globals()[attr])
    return mod


def install_flash_attn_bridge(replace_real: bool = False) -> list:
    """Make `import flash_attn` (and its interface / bert_padding modules) resolve to kit ops; returns the names.

    A real flash-attn (imported, or installed and importable) is kept unless replace_real=True: on a CUDA box
    with flash-attn the real kernels stay in use.
    """
    existing = sys.modules.get("flash_attn")
    if not replace_real:
        if existing is not None and not getattr(existing, _MARK, False):
            return []
        if existing is None and importlib.util.find_spec("flash_attn") is not None:
            return []
    interface = _module("flash_attn.flash_attn_interface", INTERFACE)
    padding = _module("flash_attn.bert_padding", PADDING)
    root = _module("flash_attn", INTERFACE, package=True)
    root.__version__ = BRIDGE_VERSION
    root.flash_attn_interface, root.bert_padding = interface, padding
    for mod in (root, interface, padding):
        sys.modules[mod.__name__] = mod
    return list(MODULE_NAMES)


def remove_flash_attn_bridge() -> None:
    """Take the bridge modules out of sys.modules (a real flash-attn is never touched)."""
    for name in MODULE_NAMES:
        if getattr(sys.modules.get(name), _MARK, False):
            del sys.modules[name]
