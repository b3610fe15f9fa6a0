"""NPU-affine operators with portable fallbacks: the same call runs torch_npu kernels on NPU and torch elsewhere.

Backend rule (see `kit.ops.backend`): tensors on an ``npu`` device use torch_npu; others use torch;
``use_backend("npu"|"torch")`` or ``KIT_OPS_BACKEND`` force one side (tests force "npu" with a CPU stand-in).
"""

from kit.ops.attention import LAYOUTS, MAX_TOKENS, fusion_attention
from kit.ops.attention_npu import compressed_causal_mask
from kit.ops.backend import resolve as resolve_backend
from kit.ops.backend import use_backend
from kit.ops.fused import (
    apply_rotary_pos_emb,
    baddbmm,
    fast_gelu,
    rms_norm,
    rotary_mul,
    scaled_masked_softmax,
    silu_mul,
    swiglu,
)
from kit.ops.moe import moe_expert_modules, moe_experts, moe_route
from kit.ops.parity import parity_report

__all__ = [
    "LAYOUTS",
    "MAX_TOKENS",
    "apply_rotary_pos_emb",
    "baddbmm",
    "compressed_causal_mask",
    "fast_gelu",
    "fusion_attention",
    "moe_expert_modules",
    "moe_experts",
    "moe_route",
    "parity_report",
    "resolve_backend",
    "rms_norm",
    "rotary_mul",
    "scaled_masked_softmax",
    "silu_mul",
    "swiglu",
    "use_backend",
]
