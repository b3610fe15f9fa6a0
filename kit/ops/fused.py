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


# npu_rotary_mul shape rules (torch_npu 2.13.0 `_op_plugin_docs.py`, npu_rotary_mul, jit_compile=False): the
# first three dims of cos/sin either equal the input's or broadcast (1), in these patterns per input layout;
# half: B < 1000 and N < 1000 (B*N <= 1024 when cos/sin need a gradient); interleave: B*N < 1000 and only the
# 11SD / 1S1D / S11D broadcasts. A shape that fits a pattern of several layouts must fit the limits of each
# (the kernel cannot tell which layout was meant: the safe side); anything else runs the torch expression.
_ROTARY_PATTERNS = {
    "half": {
        "BNSD": ((1, 1, 0), (0, 1, 0), (0, 0, 0)),
        "BSND": ((1, 0, 1), (0, 0, 1), (0, 0, 0)),
        "SBND": ((0, 1, 1), (0, 0, 1), (0, 0, 0)),
    },
    "interleave": {"BNSD": ((1, 1, 0),), "BSND": ((1, 0, 1),), "SBND": ((0, 1, 1),)},
}
_ROTARY_BN_AXES = {"BNSD": (0, 1), "BSND": (0, 2), "SBND": (1, 2)}
ROTARY_MAX_HEAD_DIM, ROTARY_MAX_BN = 896, 1000


def rotary_layouts(x_shape, r_shape, mode: str) -> list:
    """Input layouts under which cos/sin of shape `r_shape` broadcast to `x_shape` as npu_rotary_mul allows."""
    found = []
    for layout, patterns in _ROTARY_PATTERNS[mode].items():
        for pattern in patterns:
            if all((r_shape[i] == 1) if b else (r_shape[i] == x_shape[i]) for i, b in enumerate(pattern)):
                found.append(layout)
                break
    return found


def rotary_kernel_fits(x, cos, sin, mode: str) -> bool:
    """True when npu_rotary_mul accepts these shapes (see the rules above)."""
    if not (x.dim() == cos.dim() == sin.dim() == 4 and tuple(cos.shape) == tuple(sin.shape)):
        return False
    d = x.shape[-1]
    if d % 2 or d >= ROTARY_MAX_HEAD_DIM or cos.shape[-1] != d:
        return False
    if not (x.dtype == cos.dtype == sin.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return False
    layouts = rotary_layouts(tuple(x.shape), tuple(cos.shape), mode)
    needs_grad = cos.requires_grad or sin.requires_grad
    for layout in layouts:
        b, n = (x.shape[a] for a in _ROTARY_BN_AXES[layout])
        if mode == "interleave" and b * n >= ROTARY_MAX_BN:
            return False
        if mode == "half" and (b >= ROTARY_MAX_BN or n >= ROTARY_MAX_BN or (needs_grad and b * n > 1024)):
            return False
    return bool(layouts)


def rotary_mul(x, cos, sin, rotary_mode: str = "half", backend: Optional[str] = None):
    """x*cos + rotate(x)*sin; 'half' is HF `rotate_half`, 'interleave' the GPT-J/ChatGLM pairing.

    Partial rotary (cos narrower than x) rotates the first cos.shape[-1] channels and keeps the rest.
    NPU (`npu_rotary_mul`): saves the cat/neg/mul chain for q and k in every layer, where the kernel's shape rules
    hold (`rotary_kernel_fits`); for BNSD with D not 32-byte aligned the docs advise against it.
    """
    if rotary_mode not in ROTARY_MODES:
        raise ValueError(f"rotary_mode={rotary_mode!r} is not one of {ROTARY_MODES}.")
    rot = cos.shape[-1]
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"rotary width {rot} must be even and <= head_dim {x.shape[-1]}.")
    if rot < x.shape[-1]:
        head, tail = x[..., :rot], x[..., rot:]
        return torch.cat((rotary_mul(head, cos, sin, rotary_mode, backend), tail), dim=-1)
    if resolve(x, backend) == "npu" and rotary_kernel_fits(x, cos, sin, rotary_mode):
        return torch_npu_module().npu_rotary_mul(x, cos, sin, rotary_mode=rotary_mode)
    return x * cos + _rotate(x, rotary_mode) * sin


def _bsnd_strided(t) -> bool:
    """A (B, N, S, D) tensor that is a transposed view of contiguous (B, S, N, D) memory (HF's q/k/v)."""
    return t.dim() == 4 and t.transpose(1, 2).is_contiguous()


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """Drop-in for transformers' `apply_rotary_pos_emb(q, k, cos, sin[, position_ids], unsqueeze_dim=1)`.

    transformers <= 4.47 has an unused `position_ids` 5th argument, newer ones not (an int there is unsqueeze_dim).
    On NPU, q/k laid out as (B, S, N, D) memory (HF's `.view(...).transpose(1, 2)`) are rotated as BSND with
    cos/sin as BS1D: no `.contiguous()` copy, and the result stays BSND for the BSND attention call.
    """
    if isinstance(position_ids, int):
        unsqueeze_dim = position_ids
    if (
        unsqueeze_dim == 1
        and cos.dim() == 3
        and resolve(q) == "npu"
        and _bsnd_strided(q)
        and _bsnd_strided(k)
    ):
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        q_out = rotary_mul(q.transpose(1, 2), c, s).transpose(1, 2)
        k_out = rotary_mul(k.transpose(1, 2), c, s).transpose(1, 2)
        return q_out, k_out
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return rotary_mul(q, cos, sin), rotary_mul(k, cos, sin)


def swiglu(x, dim: int = -1, backend: Optional[str] = None):
    """silu(A) * B where A, B are the first and second halves of x along `dim` (A first, as torch_npu).

    NPU (`npu_swiglu`): one kernel and no saved silu(A) activation; pays off when gate and up come out of one
    fused projection (kit.adapt merges gate_proj/up_proj into one at adaptation, so no cat is needed).
    """
    if x.shape[dim] % 2:
        raise ValueError(f"swiglu needs an even size along dim {dim}, got {x.shape[dim]}.")
    if resolve(x, backend) == "npu" and 1 <= x.dim() <= 8:
        return torch_npu_module().npu_swiglu(x, dim=dim)
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def silu_mul(gate, up, backend: Optional[str] = None):
    """silu(gate) * up, the Llama MLP activation; on NPU one `npu_swiglu` over cat([gate, up]).

    The cat costs a copy per call: models adapted by kit.adapt avoid it with a merged gate/up projection.
    """
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


# The kernel's reference (torch_npu's own op test and its accuracy checker): (x * scale).masked_fill(mask, -1e4),
# then softmax. A fully masked row is therefore uniform (1/W), not 0; the torch branch computes the same.
MASK_FILL = -10000.0
_TRIU_CACHE: dict = {}


def _triu_mask(shape, device) -> torch.Tensor:
    """(H, W) bool, True above the diagonal (causal), cached per device and shape."""
    key = (str(device), tuple(shape))
    mask = _TRIU_CACHE.get(key)
    if mask is None:
        mask = _TRIU_CACHE[key] = torch.ones(shape, dtype=torch.bool, device=device).triu(1)
    return mask


def scaled_masked_softmax(
    x, mask=None, scale: float = 1.0, causal: bool = False, backend: Optional[str] = None
):
    """softmax(x * scale) over the last dim, masked positions (True, and/or causal) filled with -10000 first.

    Semantics are the kernel's: a fully masked row comes out uniform (1/W), as in Megatron's fused softmax.
    NPU (`npu_scaled_masked_softmax`): fuses scale, mask and softmax of eager attention scores; pays off in
    remote-code models that still compute attention eagerly. Shapes outside the kernel's limits use torch.
    `fixed_triu_mask` is never set: op-plugin's docs for the op (docs/context/torch_npu-npu_scaled_masked_softmax.md)
    call it reserved and unfinished, only False supported; causal is folded into the mask instead.
    """
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(
            f"mask dtype {mask.dtype} must be bool with True = masked (convert with `mask < 0`)."
        )
    if causal:
        tri = _triu_mask(tuple(x.shape[-2:]), x.device)
        mask = tri if mask is None else mask | tri
    if resolve(x, backend) == "npu" and _softmax_kernel_fits(x):
        if mask is None:
            mask = torch.zeros((1, 1) + tuple(x.shape[-2:]), dtype=torch.bool, device=x.device)
        return torch_npu_module().npu_scaled_masked_softmax(
            x, mask, scale=float(scale), fixed_triu_mask=False
        )
    logits = x.to(torch.float32) * scale
    if mask is not None:
        logits = logits.masked_fill(mask, MASK_FILL)
    return torch.softmax(logits, dim=-1).to(x.dtype)


def baddbmm(input, batch1, batch2, *, beta: float = 1.0, alpha: float = 1.0, backend: Optional[str] = None):
    """torch.baddbmm; with beta == 0 on NPU a plain bmm (x alpha) that never reads `input`.

    ChatGLM-style code calls baddbmm(empty, q, k^T, beta=0, alpha=1/sqrt(d)) only to get a scaled bmm; on NPU
    the bmm is the faster kernel (the ModelArts user manual's ChatGLM-6B adaptation, "算子优化"); on CPU/CUDA baddbmm itself is kept (measured faster
    on CPU, benchmarks/bench_ops.py). Same result on every device, NaN/garbage in `input` ignored when beta == 0.
    """
    if beta == 0 and resolve(batch1, backend) == "npu":
        out = torch.bmm(batch1, batch2)
        return out if alpha == 1 else out * alpha
    # elsewhere baddbmm(beta=0) is already one kernel that skips `input` (and folds alpha in)
    return torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha)
