"""Kit attention for transformers models, in BSND: through the attention registry, or the flash-attention-2 path.

transformers >= 4.55 (AttentionInterface): `kit_attention_forward` is registered as "kit". Older transformers (4.44
and 4.46 on ModelArts images) have no registry: the model is switched to its FlashAttention2 attention classes
(same weights) and the modeling module's `_flash_attention_forward` is replaced by `kit_flash_attention_forward`, so
the model hands the 2-D padding mask and position_ids down as it does for flash-attn; no flash-attn is needed.
Both paths run q/k/v as BSND, the layout HF's projections already have, so there is no transpose copy, and turn
packed rows (position_ids restarting) and padding into TND varlen attention: no attention crosses dialogs.
"""

from __future__ import annotations

import logging

import torch

from kit.adapt.varlen import plan_varlen
from kit.errors import KitError
from kit.ops import MAX_TOKENS, fusion_attention
from kit.ops.attention_args import MAX_VARLEN_SEQUENCES

ATTENTION_NAME = "kit"


class AdaptError(KitError, RuntimeError):
    """This transformers version / model offers no way to plug kit attention in."""


# modeling module -> FlashAttention2 class name, for transformers without the attention registry
FA2_CLASSES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaFlashAttention2"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2FlashAttention2"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralFlashAttention2"),
}


class _Flattened:
    """Set (by the trainer) while a padding-free row of several sequences runs: the sequences are then known only
    from position_ids, so an attention call without them would let every sequence see the ones before it."""

    active = 0

    def __enter__(self):
        _Flattened.active += 1
        return self

    def __exit__(self, *exc) -> None:
        _Flattened.active -= 1


def flattened_rows() -> _Flattened:
    """`with flattened_rows(): model(**batch)` makes kit attention refuse a call without position_ids."""
    return _Flattened()


def _bsnd_attention(query, key, value, attention_mask, *, causal, pre, scale, keep_prob, position_ids):
    """q (B, Sq, N, D), k/v (B, Skv, Nkv, D), 2-D padding mask or None -> (B, Sq, N, Dv)."""
    if _Flattened.active and position_ids is None:
        raise AdaptError(
            "this model does not pass position_ids to its attention, which padding-free (flattened) micro-batches "
            "need to keep sequences apart; train it with ADAPT=False (and PACK=False data)."
        )
    batch, sq, nq, _ = query.shape
    skv = key.shape[1]
    common = dict(scale=scale, keep_prob=keep_prob)
    plan = None
    if sq == skv:
        plan = plan_varlen(position_ids, attention_mask, batch, sq)
    elif attention_mask is not None and not bool(attention_mask.all()):
        masked = ~attention_mask.to(torch.bool)[:, None, None, -skv:].expand(batch, 1, sq, skv)
        return fusion_attention(
            query, key, value, nq, "BSND", atten_mask=masked, causal=causal, pre_tokens=pre, **common
        )
    if plan is None:
        return fusion_attention(query, key, value, nq, "BSND", causal=causal, pre_tokens=pre, **common)

    # Varlen: (B, S, N, D) -> (B*S, N, D) is a view; drop padding, TND calls, scatter back (padding rows get 0).
    def flat(t):
        t = t.reshape(batch * sq, t.shape[2], t.shape[3])
        return t if plan.indices is None else t.index_select(0, plan.indices)

    dv = value.shape[-1]
    if plan.num_sequences == 0:
        return query.new_zeros(batch, sq, nq, dv)
    q, k, v = flat(query), flat(key), flat(value)
    outs, start, token0 = [], 0, 0
    ends = plan.cumulative
    while start < len(ends):  # at most MAX_VARLEN_SEQUENCES sequences per TND call (torch_npu's varlen limit)
        stop = min(start + MAX_VARLEN_SEQUENCES, len(ends))
        token1 = ends[stop - 1]
        local = [e - token0 for e in ends[start:stop]]
        outs.append(
            fusion_attention(
                q[token0:token1],
                k[token0:token1],
                v[token0:token1],
                nq,
                "TND",
                causal=causal,
                pre_tokens=pre,
                actual_seq_qlen=local,
                actual_seq_kvlen=local,
                **common,
            )
        )
        start, token0 = stop, token1
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    if plan.indices is not None:
        out = out.new_zeros(batch * sq, nq, dv).index_copy(0, plan.indices, out)
    return out.view(batch, sq, nq, dv)


def kit_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    is_causal=None,
    **kwargs,
):
    """transformers attention function: q/k/v (B, N, S, D) in, (B, S, N, D) out, through kit.ops.fusion_attention.

    HF's q/k/v are transposed views of (B, S, N, D) projections: they go to the kernel as BSND without a copy.
    """
    if softcap:
        raise ValueError(
            "attention softcap is not supported by kit attention; use attn_implementation='eager'."
        )
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(
            "attention sinks are not supported by kit attention; use attn_implementation='eager'."
        )
    nq = query.shape[1]
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    keep_prob = 1.0 - float(dropout or 0.0)
    pre = int(sliding_window) - 1 if sliding_window else MAX_TOKENS  # HF window counts the token itself
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attention_mask is not None and attention_mask.dim() == 4:
        # A full mask from transformers (generation with a cache): bool True = attend, or additive float.
        masked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
        out = fusion_attention(q, k, v, nq, "BSND", atten_mask=masked, scale=scaling, keep_prob=keep_prob)
        return out, None
    out = _bsnd_attention(
        q,
        k,
        v,
        attention_mask,
        causal=causal,
        pre=pre,
        scale=scaling,
        keep_prob=keep_prob,
        position_ids=kwargs.get("position_ids"),
    )
    return out, None


def kit_attention_mask(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs
):
    """Mask builder for "kit": the 2-D padding mask (or None) when training; transformers' full mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    plain = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
    if plain and q_length == kv_length:
        if attention_mask is not None:
            attention_mask = attention_mask[:, -kv_length:]
            if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
                attention_mask = None
        return attention_mask
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def has_registry() -> bool:
    """True when transformers exports AttentionInterface (4.55 does, 4.53 does not)."""
    import transformers

    return getattr(transformers, "AttentionInterface", None) is not None


def register() -> str:
    """Register the "kit" attention function and mask builder with transformers (idempotent)."""
    import transformers

    interface = getattr(transformers, "AttentionInterface", None)
    if interface is None:
        raise AdaptError(
            f"transformers {transformers.__version__} has no AttentionInterface (it came with 4.55); "
            "adapt_model uses the flash-attention-2 path there instead (transformers 4.44-4.47)."
        )
    interface.register(ATTENTION_NAME, kit_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers build 4-D masks in the model; kit attention reads those too
        return ATTENTION_NAME
    AttentionMaskInterface.register(ATTENTION_NAME, kit_attention_mask)
    return ATTENTION_NAME


# ---- transformers without the registry: the flash-attention-2 path ------------------------------------------------
class _NoOpCastFilter(logging.Filter):
    """Drops the FA2 classes' "hidden states seems to be silently casted in float32 ... cast back the input in
    torch.float32": on float32 weights (CPU, fp32 runs) the cast is to float32 itself, so nothing happened to warn
    about. The same warning with another target dtype is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("silently casted in float32" in message and message.rstrip().endswith("torch.float32."))


def _drop_no_op_cast_warning(module_name: str) -> None:
    logger = logging.getLogger(module_name)
    if not any(isinstance(f, _NoOpCastFilter) for f in logger.filters):
        logger.addFilter(_NoOpCastFilter())


def kit_flash_attention_forward(
    query_states,
    key_states,
    value_states,
    attention_mask,
    query_length,
    is_causal=True,
    dropout=0.0,
    position_ids=None,
    softmax_scale=None,
    sliding_window=None,
    use_top_left_mask=False,
    softcap=None,
    deterministic=None,
    **kwargs,
):
    """Stand-in for transformers' `_flash_attention_forward` (4.44-4.47): q/k/v (B, S, N, D) -> (B, Sq, N, D).

    Same contract: 2-D padding mask (1 = token) or None, position_ids for packed rows, causal bottom-right
    (use_top_left_mask False). sliding_window W keeps W keys including the token itself, as these versions' eager
    and sdpa masks do (their flash-attn call passed window (W, W), one more key; newer transformers use W - 1).
    """
    if softcap:
        raise ValueError(
            "attention softcap is not supported by kit attention; use attn_implementation='eager'."
        )
    causal = bool(is_causal) and not (use_top_left_mask and query_length == 1)
    pre = int(sliding_window) - 1 if sliding_window else MAX_TOKENS
    if attention_mask is not None and attention_mask.dim() == 4:  # a model still building full masks
        masked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
        return fusion_attention(
            query_states,
            key_states,
            value_states,
            query_states.shape[2],
            "BSND",
            atten_mask=masked,
            scale=softmax_scale,
            keep_prob=1.0 - float(dropout or 0.0),
        )
    return _bsnd_attention(
        query_states,
        key_states,
        value_states,
        attention_mask,
        causal=causal,
        pre=pre,
        scale=softmax_scale,
        keep_prob=1.0 - float(dropout or 0.0),
        position_ids=position_ids,
    )


def use_fa2_path(model, model_type: str) -> int:
    """Switch a model's attention modules to its FlashAttention2 classes running kit attention; returns how many."""
    import importlib

    if model_type not in FA2_CLASSES:
        raise AdaptError(
            f"model_type {model_type!r} has no flash-attention-2 mapping in kit ({sorted(FA2_CLASSES)}); "
            "upgrade transformers (>= 4.55 has the attention registry) to adapt it."
        )
    module_name, class_name = FA2_CLASSES[model_type]
    modeling = importlib.import_module(module_name)
    fa2 = getattr(modeling, class_name, None)
    if fa2 is None:
        import transformers

        raise AdaptError(
            f"transformers {transformers.__version__} has neither AttentionInterface (>= 4.55) nor {class_name} "
            "(<= 4.47), the two ways adapt_model plugs kit attention in: use one of those versions, or ADAPT=False."
        )
    # the FA2 classes look the function up in their module's globals at call time
    modeling._flash_attention_forward = kit_flash_attention_forward
    _drop_no_op_cast_warning(modeling.__name__)
    base = fa2.__mro__[1]
    count = 0
    for module in model.modules():
        if isinstance(module, base) and type(module) is not fa2:
            module.__class__ = fa2  # same parameters and attributes; only forward differs
            module._flash_attn_uses_top_left_mask = False  # kit causal is bottom-right (flash-attn >= 2.1)
            count += 1
        elif type(module) is fa2:
            module._flash_attn_uses_top_left_mask = False
            count += 1
    # the model then passes 2-D masks and position_ids; some models (Mistral 4.44) copy the choice at __init__
    model.config._attn_implementation = "flash_attention_2"
    for module in model.modules():
        if "_attn_implementation" in vars(module):
            module._attn_implementation = "flash_attention_2"
    return count
