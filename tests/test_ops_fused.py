"""Fused kit ops vs float64 references, portable path and NPU branch (strict stand-in)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from npu_standin import install, ops

from kit import ops as kops
from kit.ops import use_backend

BACKENDS = ["torch", "npu"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture
def backend(request, monkeypatch):
    ops.CALLS.clear()
    if request.param == "npu":
        install(monkeypatch)
    with use_backend(request.param):
        yield request.param


def rel_err(got, want) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12))


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def called(name: str) -> bool:
    return any(call[0] == name for call in ops.CALLS)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(backend, dtype):
    x, w = rand(2, 5, 16, dtype=dtype), rand(16, seed=1).to(dtype)
    xd = x.double()
    want = w.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = kops.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and rel_err(got, want) <= TOL[dtype]
    assert called("npu_rms_norm") == (backend == "npu")


def ref_rotary(x, theta, mode):
    """Rotate channel pairs by theta (one angle per pair): half pairs (i, i+D/2), interleave pairs (2i, 2i+1)."""
    x = x.double()
    d = x.shape[-1]
    idx = (
        (torch.arange(d // 2), torch.arange(d // 2) + d // 2)
        if mode == "half"
        else (torch.arange(0, d, 2), torch.arange(1, d, 2))
    )
    a, b = x[..., idx[0]], x[..., idx[1]]
    c, s = theta.cos(), theta.sin()
    out = torch.empty_like(x)
    out[..., idx[0]] = a * c - b * s
    out[..., idx[1]] = b * c + a * s
    return out


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_mul(backend, mode, dtype):
    x = rand(2, 4, 6, 16, dtype=dtype)
    theta = torch.rand(1, 1, 6, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 6
    table = torch.cat((theta, theta), -1) if mode == "half" else theta.repeat_interleave(2, -1)
    got = kops.rotary_mul(x, table.cos().to(dtype), table.sin().to(dtype), rotary_mode=mode)
    assert rel_err(got, ref_rotary(x, theta, mode)) <= TOL[dtype]
    assert called("npu_rotary_mul") == (backend == "npu")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_partial_rotary_keeps_the_tail(backend):
    x = rand(1, 2, 5, 12)
    theta = torch.rand(1, 1, 5, 4, dtype=torch.float64) * 3
    table = torch.cat((theta, theta), -1)
    got = kops.rotary_mul(x, table.cos().float(), table.sin().float())
    assert rel_err(got[..., :8], ref_rotary(x[..., :8], theta, "half")) <= 1e-5
    assert torch.equal(got[..., 8:], x[..., 8:])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_apply_rotary_pos_emb_matches_hf_rotate_half(backend):
    from transformers.models.llama.modeling_llama import rotate_half

    q, k = rand(2, 4, 6, 16), rand(2, 2, 6, 16, seed=1)
    theta = torch.rand(2, 6, 16, generator=torch.Generator().manual_seed(3))
    cos, sin = theta.cos(), theta.sin()
    got_q, got_k = kops.apply_rotary_pos_emb(q, k, cos, sin)
    want_q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    assert rel_err(got_q, want_q) <= 1e-5 and rel_err(got_k, want_k) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_silu_mul(backend, dtype):
    x = rand(3, 5, 20, dtype=dtype)
    a, b = x.double().chunk(2, -1)
    want = F.silu(a) * b
    assert rel_err(kops.swiglu(x), want) <= TOL[dtype]
    assert rel_err(kops.silu_mul(x[..., :10], x[..., 10:]), want) <= TOL[dtype]
    assert called("npu_swiglu") == (backend == "npu")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_fast_gelu_formula_and_distance_to_gelu(backend):
    x = torch.linspace(-6, 6, 241)
    got = kops.fast_gelu(x)
    xd = x.double()
    assert rel_err(got, xd * torch.sigmoid(1.702 * xd)) <= 1e-5
    assert float((got - F.gelu(x)).abs().max()) < 0.03  # an approximation, documented as such
    assert called("npu_fast_gelu") == (backend == "npu")


def ref_softmax(x, masked, scale):
    """The kernel's own reference (torch_npu's op test): masked positions are -10000 before the softmax."""
    logits = (x.double() * scale).masked_fill(masked, -10000.0)
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("shape", [(2, 2, 32, 64), (1, 2, 5, 7)])  # kernel-sized, and a fallback shape
def test_scaled_masked_softmax(backend, shape):
    x = rand(*shape)
    sq, sk = shape[-2:]
    mask = torch.rand(shape[0], 1, sq, sk, generator=torch.Generator().manual_seed(4)) > 0.8
    mask[0, 0, 1] = True  # one fully masked row -> uniform, as the kernel's reference defines it
    tri = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    for kwargs, masked in [
        ({"mask": mask}, mask),
        ({"causal": True}, tri),
        ({"mask": mask, "causal": True}, mask | tri),
    ]:
        got = kops.scaled_masked_softmax(x, scale=0.7, **kwargs)
        assert rel_err(got, ref_softmax(x, masked.expand(shape), 0.7)) <= 1e-5
    torch.testing.assert_close(kops.scaled_masked_softmax(x, mask)[0, :, 1], torch.full((2, sk), 1.0 / sk))
    assert called("npu_scaled_masked_softmax") == (backend == "npu" and shape[-1] == 64)
    # the reserved fixed_triu_mask is never set: causal reaches the kernel folded into the mask
    assert all(not args["fixed_triu_mask"] for name, args in ops.CALLS if name == "npu_scaled_masked_softmax")


def test_standin_refuses_fixed_triu_mask_and_uses_the_kernel_reference(monkeypatch):
    fake = install(monkeypatch)
    x = rand(1, 1, 32, 32)
    none = torch.zeros(1, 1, 32, 32, dtype=torch.bool)
    with pytest.raises(fake.StandinError, match="fixed_triu_mask"):
        fake.npu_scaled_masked_softmax(x, none, 1.0, True)
    dead = none.clone()
    dead[..., 3, :] = True
    torch.testing.assert_close(fake.npu_scaled_masked_softmax(x, dead)[0, 0, 3], torch.full((32,), 1 / 32))


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_kernel_shape_rules(monkeypatch, mode):
    """npu_rotary_mul only gets shapes its docs allow (B, N < 1000 / B*N < 1000; interleave: 11SD-type cos)."""
    fake = install(monkeypatch)
    theta = torch.rand(1, 4, 1, 8, generator=torch.Generator().manual_seed(2)) * 6
    cos, sin = torch.cat((theta, theta), -1).cos(), torch.cat((theta, theta), -1).sin()  # 1S1D for BSND
    cases = [
        (rand(2, 4, 3, 16), cos, sin, True),  # BSND, B=2 N=3
        (rand(1, 4, 1000, 16), cos, sin, False),  # N = 1000: over both modes' limits
        (rand(40, 4, 30, 16), cos, sin, mode == "half"),  # B*N = 1200: fine for half, not for interleave
    ]
    b1sd = torch.zeros(2, 1, 4, 16)  # B1SD for BNSD: half only
    cases.append((rand(2, 3, 4, 16), b1sd.cos(), b1sd.sin(), mode == "half"))
    for x, c, s, kernel in cases:
        fake.CALLS.clear()
        with use_backend("npu"):
            got = kops.rotary_mul(x, c, s, mode)
        assert called("npu_rotary_mul") == kernel, (tuple(x.shape), tuple(c.shape))
        with use_backend("torch"):
            torch.testing.assert_close(got, kops.rotary_mul(x, c, s, mode))
    with pytest.raises(fake.StandinError, match="B\\*N < 1000"):
        fake.npu_rotary_mul(rand(40, 4, 30, 16), cos, sin, "interleave")
    with pytest.raises(fake.StandinError, match="allowed interleave broadcast"):
        fake.npu_rotary_mul(rand(2, 3, 4, 16), b1sd.cos(), b1sd.sin(), "interleave")


def test_rotary_on_hf_layout_runs_bsnd_without_copies(monkeypatch):
    """HF's q is a (B, N, S, D) view of (B, S, N, D) memory: rotated as BSND with BS1D cos, no .contiguous()."""
    fake = install(monkeypatch)
    proj = rand(2, 5, 3 * 8)  # what q_proj returns: (B, S, N*D)
    q = proj.view(2, 5, 3, 8).transpose(1, 2)
    k = rand(2, 5, 3 * 8, seed=1).view(2, 5, 3, 8).transpose(1, 2)
    theta = torch.rand(2, 5, 8, generator=torch.Generator().manual_seed(3)) * 6
    cos, sin = theta.cos(), theta.sin()
    with use_backend("npu"):
        q_out, k_out = kops.apply_rotary_pos_emb(q, k, cos, sin)
    calls = [args for name, args in fake.CALLS if name == "npu_rotary_mul"]
    assert [c["shape"] for c in calls] == [(2, 5, 3, 8)] * 2 and calls[0]["cos_shape"] == (2, 5, 1, 8)
    assert calls[0]["data_ptr"] == proj.data_ptr() and calls[0]["contiguous"]
    assert q_out.shape == (2, 3, 5, 8) and q_out.transpose(1, 2).is_contiguous()
    with use_backend("torch"):
        want_q, want_k = kops.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(q_out, want_q)
    torch.testing.assert_close(k_out, want_k)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_baddbmm_beta_zero_is_bmm_and_ignores_input(backend):
    b1, b2 = rand(3, 4, 5), rand(3, 5, 6, seed=1)
    junk = torch.full((3, 4, 6), float("nan"))
    got = kops.baddbmm(junk, b1, b2, beta=0.0, alpha=0.5)
    torch.testing.assert_close(got, torch.baddbmm(torch.zeros(3, 4, 6), b1, b2, beta=0.0, alpha=0.5))
    bias = rand(3, 4, 6, seed=2)
    torch.testing.assert_close(
        kops.baddbmm(bias, b1, b2, beta=1.0, alpha=2.0), torch.baddbmm(bias, b1, b2, beta=1.0, alpha=2.0)
    )


def test_standin_rejects_kernel_limits(monkeypatch):
    fake = install(monkeypatch)
    with pytest.raises(fake.StandinError, match="gamma dtype"):
        fake.npu_rms_norm(rand(2, 8), rand(8).double())
    with pytest.raises(fake.StandinError, match="divisible by 32"):
        fake.npu_scaled_masked_softmax(rand(1, 1, 5, 7), torch.zeros(1, 1, 5, 7, dtype=torch.bool))
    with pytest.raises(fake.StandinError, match=r"\[-1, 1\]"):
        fake.npu_rotary_mul(rand(1, 1, 2, 4), torch.full((1, 1, 2, 4), 2.0), torch.zeros(1, 1, 2, 4))


def test_auto_backend_uses_torch_on_cpu_tensors():
    assert kops.resolve_backend(torch.zeros(1)) == "torch"
    with use_backend("npu"):
        assert kops.resolve_backend(torch.zeros(1)) == "npu"
    with pytest.raises(ValueError, match="backend"):
        kops.resolve_backend(torch.zeros(1), backend="gpu")
