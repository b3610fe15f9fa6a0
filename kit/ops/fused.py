"""Fused NPU ops with portable fallbacks: RMSNorm, rotary (half/interleave), SwiGLU, fast GELU, masked softmax, bmm.

Each op runs the torch_npu kernel when `kit.ops.backend.resolve` says "npu" AND the kernel's documented shape
limits hold (torch_npu 2.13.0 `_op_plugin_docs.py`); otherwise it runs the torch expression, which is also the
reference the kernel is tested against. When it pays off on NPU is said per op.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kit.ops.backend import resolve, torch_npu_module

ROTARY_MODES = ("half", "interleave")


def rms_norm(x, weight, eps: float = 1e-6, backend: Optional[str] = None):
    """HF Llama RMSNorm: weight * (x / sqrt(mean(x^2) + eps)) computed in fp32, cast back to x's dtype.

    NPU (`npu_rms_norm`): one kernel instead of ~6 elementwise ops per norm; pays off on every layer, most in
    bf16/fp16 where the fp32 round trip is saved. Gamma is cast to x's dtype (torch_npu requires equal dtypes).
    """
    if resolve(x, backend) == "npu" and 2 <= x.dim() <= 8:
        return torch_npu_module().npu_rms_norm(x, weight.to(x.dtype), epsilon=float(eps))[0]
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x, mode: str):
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_mul(x, cos, sin, rotary_mode: str = "half", backend: Optional[str] = None):
    """x*cos + rotate(x)*sin; 'half' is HF `rotate_half`, 'interleave' the GPT-J/ChatGLM pairing.

    Partial rotary (cos narrower than x) rotates the first cos.shape[-1] channels and keeps the rest.
    NPU (`npu_rotary_mul`): saves the cat/neg/mul chain for q and k in every layer; 4-D only, D even and < 896
    (for BNSD with D not 32-byte aligned the docs advise against it).
    """
    if rotary_mode not in ROTARY_MODES:
        raise ValueError(f"rotary_mode={rotary_mode!r} is not one of {ROTARY_MODES}.")
    rot = cos.shape[-1]
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"rotary width {rot} must be even and <= head_dim {x.shape[-1]}.")
    if rot < x.shape[-1]:
        head, tail = x[..., :rot], x[..., rot:]
        return torch.cat((rotary_mul(head, cos, sin, rotary_mode, backend), tail), dim=-1)
    if resolve(x, backend) == "npu" and x.dim() == 4 and cos.dim() == 4 and sin.dim() == 4 and rot < 896:
        return torch_npu_module().npu_rotary_mul(x, cos, sin, rotary_mode=rotary_mode)
    return x * cos + _rotate(x, rotary_mode) * sin


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` using `rotary_mul`."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return rotary_mul(q, cos, sin), rotary_mul(k, cos, sin)


def swiglu(x, dim: int = -1, backend: Optional[str] = None):
    """silu(A) * B where A, B are the first and second halves of x along `dim` (A first, as torch_npu).

    NPU (`npu_swiglu`): one kernel and no saved silu(A) activation; pays off when gate and up come out of one
    fused projection (no cat needed).
    """
    if x.shape[dim] % 2:
        raise ValueError(f"swiglu needs an even size along dim {dim}, got {x.shape[dim]}.")
    if resolve(x, backend) == "npu" and 1 <= x.dim() <= 8:
        return torch_npu_module().npu_swiglu(x, dim=dim)
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def silu_mul(gate, up, backend: Optional[str] = None):
    """silu(gate) * up, the Llama MLP activation; on NPU one `npu_swiglu` over cat([gate, up])."""
    if resolve(gate, backend) == "npu":
        return swiglu(torch.cat((gate, up), dim=-1), dim=-1, backend="npu")
    return F.silu(gate) * up


def fast_gelu(x, backend: Optional[str] = None):
    """x * sigmoid(1.702 x), the A2/A3 `npu_fast_gelu` formula: an approximation of GELU, not exact GELU.

    NPU: one vector kernel instead of erf; pays off in GELU MLPs (ChatGLM-6B, BLOOM). Use F.gelu where exact
    parity with a GPU run matters (max abs difference to exact GELU is about 0.02).
    """
    if resolve(x, backend) == "npu":
        return torch_npu_module().npu_fast_gelu(x)
    return x * torch.sigmoid(1.702 * x)


def _softmax_kernel_fits(x) -> bool:
    # torch_npu: 4-D (NCHW) with H and W in [32, 4096] and divisible by 32
    return x.dim() == 4 and all(32 <= s <= 4096 and s % 32 == 0 for s in x.shape[-2:])


def scaled_masked_softmax(
    x, mask=None, scale: float = 1.0, causal: bool = False, backend: Optional[str] = None
):
    """softmax(x * scale) over the last dim with mask True = masked (and/or causal); fully masked rows give 0.

    NPU (`npu_scaled_masked_softmax`): fuses scale, mask and softmax of eager attention scores; pays off in
    remote-code models that still compute attention eagerly. Shapes outside the kernel's limits use torch.
    """
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(
            f"mask dtype {mask.dtype} must be bool with True = masked (convert with `mask < 0`)."
        )
    if resolve(x, backend) == "npu" and _softmax_kernel_fits(x):
        if mask is None:
            mask = torch.zeros((1, 1) + tuple(x.shape[-2:]), dtype=torch.bool, device=x.device)
            return torch_npu_module().npu_scaled_masked_softmax(
                x, mask, scale=float(scale), fixed_triu_mask=causal
            )
        if causal:  # fold causal into the explicit mask: exact whatever the kernel does with both
            mask = mask | torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        return torch_npu_module().npu_scaled_masked_softmax(
            x, mask, scale=float(scale), fixed_triu_mask=False
        )
    logits = x.to(torch.float32) * scale
    if causal:
        tri = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).triu(1)
        mask = tri if mask is None else mask | tri
    if mask is None:
        return torch.softmax(logits, dim=-1).to(x.dtype)
    # finite fill keeps gradients NaN-free; rows with every key masked are then set to 0
    probs = torch.softmax(logits.masked_fill(mask, torch.finfo(torch.float32).min), dim=-1)
    dead = mask.all(dim=-1, keepdim=True)  # computed on the (usually smaller, broadcast) mask
    if bool(dead.any()):
        probs = probs.masked_fill(dead, 0.0)
    return probs.to(x.dtype)


def baddbmm(input, batch1, batch2, *, beta: float = 1.0, alpha: float = 1.0, backend: Optional[str] = None):
    """torch.baddbmm; with beta == 0 on NPU a plain bmm (x alpha) that never reads `input`.

    ChatGLM-style code calls baddbmm(empty, q, k^T, beta=0, alpha=1/sqrt(d)) only to get a scaled bmm; on NPU
    the bmm is the faster kernel (the seed's ChatGLM change); on CPU/CUDA baddbmm itself is kept (measured faster
    on CPU, benchmarks/bench_ops.py). Same result on every device, NaN/garbage in `input` ignored when beta == 0.
    """
    if beta == 0 and resolve(batch1, backend) == "npu":
        out = torch.bmm(batch1, batch2)
        return out if alpha == 1 else out * alpha
    # elsewhere baddbmm(beta=0) is already one kernel that skips `input` (and folds alpha in)
    return torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
