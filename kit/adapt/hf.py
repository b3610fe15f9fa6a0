"""Route transformers-native models (Llama, Qwen2/3, Mistral) through kit ops via transformers' registries.

`adapt_model(model)` registers the attention function "kit" in transformers' AttentionInterface (and a matching
mask builder in AttentionMaskInterface), switches the model to it, and swaps RMSNorm / SwiGLU MLP / rotary for
the fused kit ops after checking on a probe input that each swap gives the same numbers. Packed samples
(position_ids restarting inside a row) and padding run as TND varlen attention, so no attention crosses dialogs.
"""

from __future__ import annotations

import sys
import types
from dataclasses import asdict, dataclass, field

import torch

from kit.adapt.varlen import plan_varlen
from kit.ops import MAX_TOKENS, fusion_attention, resolve_backend
from kit.ops import fused as kit_fused

ATTENTION_NAME = "kit"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class AdaptReport:
    """What adapt_model changed, so notebooks and logs can show it."""

    model_type: str
    attention: str  # the attention implementation now in use
    attention_modules: int = 0
    rms_norms: int = 0
    mlps: int = 0
    rotary: list = field(default_factory=list)  # modeling modules whose apply_rotary_pos_emb now uses kit
    backend: str = "torch"  # where kit ops run for this model's parameters
    skipped: list = field(default_factory=list)  # what was left alone, and why

    def to_dict(self) -> dict:
        return asdict(self)


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
    """transformers attention function: q/k/v (B, N, S, D) in, (B, S, N, D) out, through kit.ops.fusion_attention."""
    if softcap:
        raise ValueError(
            "attention softcap is not supported by kit attention; use attn_implementation='eager'."
        )
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(
            "attention sinks are not supported by kit attention; use attn_implementation='eager'."
        )
    batch, nq, sq, _ = query.shape
    skv = key.shape[2]
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    keep_prob = 1.0 - float(dropout or 0.0)
    pre = int(sliding_window) - 1 if sliding_window else MAX_TOKENS  # HF window counts the token itself
    common = dict(scale=scaling, keep_prob=keep_prob)

    if attention_mask is not None and attention_mask.dim() == 4:
        # A full mask from transformers (generation with a cache): bool True = attend, or additive float.
        masked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
        out = fusion_attention(query, key, value, nq, "BNSD", atten_mask=masked, **common)
        return out.transpose(1, 2).contiguous(), None

    plan = None
    if sq == skv:
        plan = plan_varlen(kwargs.get("position_ids"), attention_mask, batch, sq)
    elif attention_mask is not None and not bool(attention_mask.all()):
        masked = ~attention_mask.to(torch.bool)[:, None, None, -skv:].expand(batch, 1, sq, skv)
        out = fusion_attention(
            query, key, value, nq, "BNSD", atten_mask=masked, causal=causal, pre_tokens=pre, **common
        )
        return out.transpose(1, 2).contiguous(), None
    if plan is None:
        out = fusion_attention(query, key, value, nq, "BNSD", causal=causal, pre_tokens=pre, **common)
        return out.transpose(1, 2).contiguous(), None

    # Varlen: (B, N, S, D) -> (B*S, N, D), drop padding, one TND call, scatter back (padding rows get 0).
    def flat(t):
        t = t.transpose(1, 2).reshape(batch * sq, t.shape[1], t.shape[3])
        return t if plan.indices is None else t.index_select(0, plan.indices)

    dv = value.shape[-1]
    if plan.num_sequences == 0:
        return query.new_zeros(batch, sq, nq, dv), None
    out = fusion_attention(
        flat(query),
        flat(key),
        flat(value),
        nq,
        "TND",
        causal=causal,
        pre_tokens=pre,
        actual_seq_qlen=plan.cumulative,
        actual_seq_kvlen=plan.cumulative,
        **common,
    )
    if plan.indices is not None:
        out = out.new_zeros(batch * sq, nq, dv).index_copy(0, plan.indices, out)
    return out.view(batch, sq, nq, dv), None


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


def register() -> str:
    """Register the "kit" attention function and mask builder with transformers (idempotent)."""
    import transformers

    interface = getattr(transformers, "AttentionInterface", None)
    if interface is None:
        raise RuntimeError(
            f"transformers {transformers.__version__} has no AttentionInterface (added in 4.48), which adapt_model "
            "uses. Upgrade transformers, or for remote-code models use install_flash_attn_bridge()."
        )
    interface.register(ATTENTION_NAME, kit_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # older transformers build 4-D masks in the model; kit attention reads those too
        return ATTENTION_NAME
    AttentionMaskInterface.register(ATTENTION_NAME, kit_attention_mask)
    return ATTENTION_NAME


def _rms_forward(self, hidden_states):
    return kit_fused.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(kit_fused.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _same(a, b) -> bool:
    # fused NPU kernels are not bit-identical: the parity bar is 1e-5 (fp32) / 1e-2 (bf16, fp16)
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 1e-2
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _probe_like(module, width: int):
    param = next(module.parameters())
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, width, generator=gen).to(device=param.device, dtype=param.dtype)


def _swap_forward(module, new_forward, width: int, report: AdaptReport, label: str) -> bool:
    """Replace module.forward if the kit version gives the same output on a probe input."""
    if isinstance(module.__dict__.get("forward"), types.MethodType):
        return True  # already adapted
    try:
        probe = _probe_like(module, width)
        with torch.no_grad():
            expected = module(probe)
            got = new_forward(module, probe)
    except Exception as exc:  # e.g. ZeRO-3 partitioned (empty) weights: adapt before deepspeed.initialize
        report.skipped.append(
            f"{label} {type(module).__name__}: probe failed ({type(exc).__name__}: {exc}); "
            "kept original. Call adapt_model before wrapping the model (DeepSpeed/FSDP)."
        )
        return False
    if not _same(expected, got):
        report.skipped.append(
            f"{label} {type(module).__name__}: kit op differs on a probe input; kept original"
        )
        return False
    module.forward = types.MethodType(new_forward, module)
    return True


def _patch_rotary(attn_module, report: AdaptReport) -> None:
    modeling = sys.modules.get(type(attn_module).__module__)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    name = getattr(modeling, "__name__", "?")
    if original is None or original is kit_fused.apply_rotary_pos_emb or name in report.rotary:
        if original is kit_fused.apply_rotary_pos_emb and name not in report.rotary:
            report.rotary.append(name)
        return
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    cos, sin = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    try:
        want = original(q, k, cos, sin)
    except TypeError:
        report.skipped.append(f"rotary in {name}: unexpected signature; kept original")
        return
    got = kit_fused.apply_rotary_pos_emb(q, k, cos, sin)
    if not all(_same(a, b) for a, b in zip(want, got)):
        report.skipped.append(f"rotary in {name}: differs from kit rotary_mul; kept original")
        return
    # module-global: every model of this family in the process uses it (numerically identical, checked above)
    modeling.apply_rotary_pos_emb = kit_fused.apply_rotary_pos_emb
    report.rotary.append(name)


def adapt_model(
    model,
    *,
    attention: bool = True,
    norms: bool = True,
    mlp: bool = True,
    rotary: bool = True,
    force: bool = False,
) -> AdaptReport:
    """Make a transformers causal LM use kit ops (attention, RMSNorm, SwiGLU, rotary); return what changed."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"adapt_model needs a transformers PreTrainedModel, got {type(model).__name__}.")
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES and not force:
        raise ValueError(
            f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES} that adapt_model was checked on. "
            "Pass force=True to try anyway, or use install_flash_attn_bridge() for remote-code models."
        )
    param = next(model.parameters())
    report = AdaptReport(
        model_type=model_type, attention=str(config._attn_implementation), backend=resolve_backend(param)
    )
    if attention:
        register()
        model.set_attn_implementation(ATTENTION_NAME)
        report.attention = ATTENTION_NAME
    hidden_act = str(getattr(config, "hidden_act", ""))
    for name, module in model.named_modules():
        cls = type(module).__name__
        if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            report.attention_modules += int(attention)
            if rotary:
                _patch_rotary(module, report)
        elif norms and cls.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            if _swap_forward(module, _rms_forward, module.weight.shape[-1], report, name):
                report.rms_norms += 1
        elif mlp and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")):
            if hidden_act not in ("silu", "swish"):
                report.skipped.append(f"{name}: hidden_act={hidden_act!r} is not SwiGLU; kept original")
            elif _swap_forward(module, _mlp_forward, module.gate_proj.in_features, report, name):
                report.mlps += 1
    return report
