"""Parity self-check: every kit op on this device (torch_npu kernels on NPU) against the float64 portable path.

`parity_report()` is what to run first on a new NPU image: it shows, op by op, whether the fused kernels give the
numbers the portable code gives (the CI only checks the NPU branch against a CPU stand-in of torch_npu).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kit.ops import attention as _attention
from kit.ops import fused

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _cases(gen: torch.Generator) -> list:
    """(name, fn(tensors...) -> tensor, input tensors) triples; shapes fit every kernel's documented limits."""
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    angles = torch.rand(1, 1, 64, 32, generator=gen) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    lengths = [40, 1, 23]
    cum = torch.tensor(lengths).cumsum(0).tolist()
    mask = torch.rand(2, 1, 64, 64, generator=gen) > 0.8
    mask[..., 0] = False
    fa = _attention.fusion_attention
    left_pad = torch.zeros(2, 1, 64, 64, dtype=torch.bool)
    left_pad[0, :, :, :5] = True
    left_pad[0, :, :5, :] = True  # padding queries see no key: inner_precise=2 on NPU, rows are 0
    interleave_cos, interleave_sin = (
        angles.repeat_interleave(2, -1).cos(),
        angles.repeat_interleave(2, -1).sin(),
    )
    return [
        (
            "attention BSND causal GQA",
            lambda q, k, v: fa(q, k, v, 8, "BSND", causal=True),
            (r(2, 64, 8, 64), r(2, 64, 2, 64), r(2, 64, 2, 64)),
        ),
        (
            "attention BNSD sliding window",
            lambda q, k, v: fa(q, k, v, 4, "BNSD", causal=True, pre_tokens=15),
            (r(2, 4, 64, 64), r(2, 4, 64, 64), r(2, 4, 64, 64)),
        ),
        (
            "attention SBH explicit mask",
            lambda q, k, v: fa(q, k, v, 4, "SBH", atten_mask=mask.to(q.device)),
            (r(64, 2, 256), r(64, 2, 256), r(64, 2, 256)),
        ),
        (
            "attention TND varlen causal",
            lambda q, k, v: fa(q, k, v, 4, "TND", causal=True, actual_seq_qlen=cum, actual_seq_kvlen=cum),
            (r(64, 4, 64), r(64, 2, 64), r(64, 2, 64)),
        ),
        (
            "attention causal next_tokens=-2",
            lambda q, k, v: fa(q, k, v, 4, "BSND", causal=True, next_tokens=-2),
            (r(2, 64, 4, 64), r(2, 64, 4, 64), r(2, 64, 4, 64)),
        ),
        (
            "attention rows without keys",
            lambda q, k, v: fa(q, k, v, 4, "BNSD", atten_mask=left_pad.to(q.device)),
            (r(2, 4, 64, 64), r(2, 4, 64, 64), r(2, 4, 64, 64)),
        ),
        ("rms_norm", lambda x, w: fused.rms_norm(x, w, 1e-6), (r(4, 64, 256), r(256))),
        ("rotary_mul half", lambda x, c, s: fused.rotary_mul(x, c, s), (r(2, 8, 64, 64), cos, sin)),
        (
            "rotary_mul interleave",
            lambda x, c, s: fused.rotary_mul(x, c, s, "interleave"),
            (r(2, 8, 64, 64), interleave_cos, interleave_sin),
        ),
        ("swiglu", lambda x: fused.swiglu(x), (r(4, 64, 512),)),
        ("fast_gelu", lambda x: fused.fast_gelu(x), (r(4, 64, 512),)),
        (
            "scaled_masked_softmax masked rows",
            lambda x: fused.scaled_masked_softmax(x, left_pad.to(x.device), scale=0.125),
            (r(2, 4, 64, 64),),
        ),
        (
            "scaled_masked_softmax causal",
            lambda x: fused.scaled_masked_softmax(x, scale=0.125, causal=True),
            (r(2, 4, 64, 64),),
        ),
        (
            "baddbmm beta=0",
            lambda a, b: fused.baddbmm(a.new_empty(4, 64, 64), a, b, beta=0.0, alpha=0.5),
            (r(4, 64, 32), r(4, 32, 64)),
        ),
    ]


def parity_report(device=None, dtype: Optional[torch.dtype] = None, backend: Optional[str] = None) -> list:
    """Rows {op, device, dtype, backend, max_rel_err, tolerance, ok} comparing each op with float64 on CPU."""
    from kit.ops.backend import resolve
    from kit.system.device import detect

    info = detect()
    device = torch.device(device or info.device)
    dtype = dtype or info.torch_dtype
    rows = []
    for name, fn, inputs in _cases(torch.Generator().manual_seed(0)):
        ref = _run(fn, [t.double() for t in inputs], "torch")
        got_inputs = [t.to(device=device, dtype=dtype) for t in inputs]
        used = resolve(got_inputs[0], backend)
        got = _run(fn, got_inputs, used)
        err = float((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        tol = TOLERANCE.get(dtype, 1e-2)
        rows.append(
            dict(
                op=name,
                device=str(device),
                dtype=str(dtype).replace("torch.", ""),
                backend=used,
                max_rel_err=err,
                tolerance=tol,
                ok=err <= tol,
            )
        )
    return rows


def _run(fn: Callable, inputs, backend: str):
    from kit.ops.backend import use_backend

    with use_backend(backend):
        return fn(*inputs)
