"""Benchmark kit.ops on this machine: overhead vs the torch expression each op wraps, attention vs eager, MoE, masks.

Run: .venv/bin/python benchmarks/bench_ops.py [--quick]   (a few minutes on 2 CPU cores, --quick about one; every
figure is a ratio against a baseline measured in the same run, best of alternated repeats). On an NPU the same
script times the torch_npu kernels (tensors on npu). Each figure also prints one line
`ops | <figure> | <ratio>x | goal <goal> | MET/MISSED/-` and the baseline's code under it.
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from kit import ops
from kit.system.device import get_device, synchronize


def _once(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(DEVICE)
    return (time.perf_counter() - start) / inner


REPEAT_SCALE = 1.0  # --quick: fewer alternated samples (never fewer than 3)


def compare(kit_fn, base_fn, repeat: int = 60, inner: int = 1) -> tuple[float, float]:
    """Best (minimum) seconds per call of both, sampled alternately: the least load-disturbed estimate."""
    repeat = max(3, round(repeat * REPEAT_SCALE))
    for _ in range(2):
        kit_fn()
        base_fn()
    synchronize(DEVICE)
    kit_s, base_s = [], []
    for _ in range(repeat):
        kit_s.append(_once(kit_fn, inner))
        base_s.append(_once(base_fn, inner))
    return min(kit_s), min(base_s)


def timeit(fn, repeat: int = 15, inner: int = 5) -> float:
    """Best (minimum) seconds per call."""
    repeat = max(3, round(repeat * REPEAT_SCALE))
    fn()
    synchronize(DEVICE)
    return min(_once(fn, inner) for _ in range(repeat))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rms(x, w, eps=1e-6):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def eager_attention(q, k, v, causal_mask, scale):
    """The matmul-softmax-matmul most remote-code models use (B, N, S, D), with repeat_kv for GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(causal_mask, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def figure_line(name: str, ratio: float, goal, baseline: str) -> None:
    """The one-line form `make bench` collects (benchmarks/run_all.py), with the baseline's code under it."""
    verdict = "-" if goal is None else ("MET" if ratio >= goal else "MISSED")
    print(f"ops | {name.strip()} | {ratio:.2f}x | goal {'-' if goal is None else f'>= {goal}x'} | {verdict}")
    print(f"    baseline: {baseline}")


EAGER = (
    "torch.softmax((q @ repeat_kv(k).transpose(-1, -2) * scale).masked_fill(mask, min), -1) @ repeat_kv(v)"
)


def row(name: str, kit_fn, base_fn, baseline: str, goal=None, code: str = "", **kw) -> None:
    kit_s, base_s = compare(kit_fn, base_fn, **kw)
    print(
        f"{name:<34} kit {kit_s * 1e3:8.3f} ms   {baseline:<28} {base_s * 1e3:8.3f} ms   speed x{base_s / kit_s:5.2f}"
    )
    figure_line(f"{name.strip()} vs {baseline}, time per call", base_s / kit_s, goal, code or baseline)


def bench_overhead() -> None:
    print("\n== kit op vs the torch expression it wraps (goal: speed >= x0.95) ==")
    g = torch.Generator().manual_seed(0)
    orow = partial(row, goal=0.95)  # a wrapper may cost at most 5% over the expression it replaces
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    x, w = mk(8, 256, 512), mk(512)
    orow(
        "rms_norm (8x256x512)",
        lambda: ops.rms_norm(x, w),
        lambda: hf_rms(x, w),
        "HF RMSNorm expr",
        code="w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # h = x.float()",
    )
    q, cos, sin = mk(4, 8, 256, 64), mk(1, 1, 256, 64), mk(1, 1, 256, 64)
    orow(
        "rotary_mul half (4x8x256x64)",
        lambda: ops.rotary_mul(q, cos, sin),
        lambda: q * cos + rotate_half(q) * sin,
        "x*cos + rotate_half(x)*sin",
    )
    gate, up = mk(8, 256, 1024), mk(8, 256, 1024)
    orow(
        "silu_mul (8x256x1024)",
        lambda: ops.silu_mul(gate, up),
        lambda: F.silu(gate) * up,
        "F.silu(gate) * up",
    )
    gu = torch.cat((gate, up), -1)
    orow(
        "swiglu (8x256x2048)",
        lambda: ops.swiglu(gu),
        lambda: F.silu(gu[..., :1024]) * gu[..., 1024:],
        "silu(a) * b on halves",
    )
    orow(
        "fast_gelu (8x256x1024)",
        lambda: ops.fast_gelu(gate),
        lambda: gate * torch.sigmoid(1.702 * gate),
        "x * sigmoid(1.702x)",
    )
    s = mk(4, 8, 256, 256)
    m = torch.ones(256, 256, dtype=torch.bool, device=DEVICE).triu(1)
    orow(
        "scaled_masked_softmax (4x8x256²)",
        lambda: ops.scaled_masked_softmax(s, m, 0.125),
        lambda: torch.softmax((s.float() * 0.125).masked_fill(m, -1e9), -1),
        "masked_fill + softmax",
        code="torch.softmax((s.float() * 0.125).masked_fill(m, -1e9), -1)",
    )
    a, b, empty = mk(32, 256, 64), mk(32, 64, 256), torch.empty(32, 256, 256, device=DEVICE)
    orow(
        "baddbmm beta=0 (32x256²)",
        lambda: ops.baddbmm(empty, a, b, beta=0.0, alpha=0.125),
        lambda: torch.baddbmm(empty, a, b, beta=0.0, alpha=0.125),
        "torch.baddbmm(beta=0)",
    )
    row(
        "  same, NPU rule: bmm * alpha",
        lambda: torch.bmm(a, b) * 0.125,
        lambda: torch.baddbmm(empty, a, b, beta=0.0, alpha=0.125),
        "torch.baddbmm(beta=0)",
    )
    q, k = mk(2, 8, 512, 64), mk(2, 2, 512, 64)
    orow(
        "fusion_attention BNSD causal GQA",
        lambda: ops.fusion_attention(q, k, k, 8, "BNSD", causal=True),
        lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True),
        "F.sdpa direct",
    )


def bench_attention() -> None:
    print("\n== attention: kit vs eager matmul-softmax-matmul (remote-code style) ==")
    g = torch.Generator().manual_seed(1)
    for b, s, n, nkv, d in [(2, 512, 8, 8, 64), (2, 1024, 8, 2, 64)]:
        q = torch.randn(b, n, s, d, generator=g).to(DEVICE)
        k, v = (torch.randn(b, nkv, s, d, generator=g).to(DEVICE) for _ in range(2))
        mask = torch.ones(s, s, dtype=torch.bool, device=DEVICE).triu(1)
        scale = 1 / math.sqrt(d)
        row(
            f"causal B{b} S{s} N{n}/{nkv} D{d}",
            partial(ops.fusion_attention, q, k, v, n, "BNSD", causal=True),
            partial(eager_attention, q, k, v, mask, scale),
            "eager attention",
            code=EAGER,
            repeat=9,
        )
    # packed: 4 dialogs in one row of 1024 tokens; eager needs a block-diagonal S x S mask
    lengths, n, d = [300, 200, 400, 124], 8, 64
    total = sum(lengths)
    qt, kt, vt = (torch.randn(total, n, d, generator=g).to(DEVICE) for _ in range(3))
    cum = np.cumsum(lengths).tolist()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(DEVICE)
    block = (seg[:, None] != seg[None, :]) | torch.ones(total, total, dtype=torch.bool, device=DEVICE).triu(1)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (qt, kt, vt))
    row(
        "packed TND 4 dialogs / 1024 tok",
        lambda: ops.fusion_attention(
            qt, kt, vt, n, "TND", causal=True, actual_seq_qlen=cum, actual_seq_kvlen=cum
        ),
        lambda: eager_attention(q4, k4, v4, block, 1 / math.sqrt(d)),
        "eager + block-diag mask",
        code=EAGER + "  # mask: block-diagonal per dialog | causal",
        repeat=9,
    )


# transformers' model folder -> the block, its config class and a CPU-sized shape. Qwen3-MoE: softmax router, no
# shared expert. DeepSeek-V3: its routing (8 groups, 4 kept, top-8, one shared expert, scaling 2.5) with a quarter of
# its 256 experts, and an expert width near its share of hidden (2048 of 7168; here 64 of 256).
MOE_FAMILIES = {
    "qwen3_moe": dict(
        title="Qwen3-MoE block",
        block="Qwen3MoeSparseMoeBlock",
        config="Qwen3MoeConfig",
        shape=dict(tokens=512, hidden=256, experts=8, top_k=2, inter=128),
    ),
    "deepseek_v3": dict(
        title="DeepSeek-V3 MoE block",
        block="DeepseekV3MoE",
        config="DeepseekV3Config",
        shape=dict(tokens=512, hidden=256, experts=64, top_k=8, inter=64, groups=8, topk_group=4, shared=1),
    ),
}


def _moe_config(family: str):
    """The transformers config of `family` at its MOE_FAMILIES shape."""
    import transformers

    f = MOE_FAMILIES[family]
    s = f["shape"]
    args = dict(hidden_size=s["hidden"], num_experts_per_tok=s["top_k"], moe_intermediate_size=s["inter"])
    if "groups" in s:  # DeepSeek-V3's router: grouped top-k, score-correction bias, shared experts
        args.update(
            n_routed_experts=s["experts"],
            n_group=s["groups"],
            topk_group=s["topk_group"],
            n_shared_experts=s["shared"],
            routed_scaling_factor=2.5,
        )
    else:
        args.update(num_experts=s["experts"])
    return getattr(transformers, f["config"])(norm_topk_prob=True, **args)


def _moe_block(family: str, experts_implementation):
    """HF's MoE block of `family` (MOE_FAMILIES: its shape, random weights) with the given experts implementation.

    A sigmoid router gets a nonzero score-correction bias, small as a trained one: at this shape it changes the
    expert set of about 40% of the tokens without skewing the load (tokens per expert 38-95; 41-86 without it)."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = _moe_config(family)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    block = getattr(modeling, MOE_FAMILIES[family]["block"])(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.01)
    return block.to(DEVICE)


def _moe_step(block, x, dy):
    """One forward + backward of `block`; its output (HF's Qwen3-MoE block of transformers 4.x returns a tuple)."""
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dy)
    return out


def _check_same(kit, hf, x, dy, label: str) -> float:
    """The kit block's output and every gradient (input, router, experts) equal HF's, before anything is timed."""
    results = []
    for block in (kit, hf):
        block.zero_grad(set_to_none=True)
        x.grad = None
        out = _moe_step(block, x, dy).detach()
        results.append([out, x.grad.clone(), *(p.grad.clone() for p in block.parameters())])
    worst = max((a - b).abs().max().item() for a, b in zip(*results))
    if worst > 1e-4:
        raise AssertionError(
            f"{label}: the kit block differs from HF's by {worst:.2e} (output or a gradient)"
        )
    kit.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    x.grad = None
    return worst


def bench_moe(family: str = "qwen3_moe") -> None:
    """A MoE block, forward + backward: the kit's (kit.adapt.moe) vs HF's on the same weights (MOE_FAMILIES).

    CPU: the kit sorts the token-expert pairs by expert once (one gather in, one weighted sum out) and runs each
    projection for all experts as one torch grouped matmul (torch >= 2.9; else two matmuls per expert on its
    slice); HF's eager experts do a `where`, a gather and an `index_add_` per expert, transformers 5's default
    `grouped_mm` a sort, the grouped matmuls, a histogram and an inverse permutation. DeepSeek-V3's router
    (sigmoid, bias-corrected grouped top-k) is `kit.ops.moe.moe_route_sigmoid`; its shared expert is HF's MLP on
    both sides. On NPU the kit block runs torch_npu kernels instead: `npu_moe_token_permute` (the gather),
    `npu_grouped_matmul` x 2 with `npu_grouped_matmul_add_` for the expert weight gradients (the per-expert
    matmuls), `npu_swiglu` and `npu_moe_token_unpermute` (the weighted sum); `npu_moe_gating_top_k_softmax`
    (`npu_moe_gating_top_k` for the sigmoid router) replaces the routing where no gradient is needed (evaluation).
    Outputs and gradients are checked equal before anything is timed.
    """
    import copy
    import types

    f = MOE_FAMILIES[family]
    try:
        probe = _moe_block(family, None)
    except (ImportError, AttributeError, TypeError) as e:  # transformers without this family (or its config)
        print(f"\n== {f['title']}: skipped, this transformers has no usable {family} ({e}) ==")
        return
    from kit.adapt.moe import is_moe_block, moe_block_forward, prepare_block

    if not is_moe_block(probe):  # e.g. DeepSeek-V3 of transformers 4.x: the kit keeps HF's forward
        print(f"\n== {f['title']}: skipped, the kit does not adapt this transformers' block ==")
        return
    s = f["shape"]
    routing = f"top-{s['top_k']}"
    if "groups" in s:
        routing += (
            f" of {s['topk_group']}/{s['groups']} groups, bias-corrected sigmoid, {s['shared']} shared expert"
        )
    print(
        f"\n== {f['title']}, forward + backward ({s['tokens']} tokens, hidden {s['hidden']}, "
        f"{s['experts']} experts {routing}, expert width {s['inter']}): kit vs HF (goal: speed >= x1.0) =="
    )
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, s["tokens"], s["hidden"], generator=g).to(DEVICE).requires_grad_(True)
    dy = torch.randn(1, s["tokens"], s["hidden"], generator=g).to(DEVICE)
    fused = hasattr(probe.experts, "gate_up_proj")  # transformers >= 5

    for impl in ("eager", "grouped_mm") if fused else (None,):
        hf = _moe_block(family, impl)
        kit = copy.deepcopy(hf)
        prepare_block(kit)
        kit.forward = types.MethodType(moe_block_forward, kit)
        label = f"HF block, experts {impl}" if impl else "HF block"
        worst = _check_same(kit, hf, x, dy, f"{f['title']} vs {label}")
        print(f"{label}: output and every gradient equal the kit block's (largest difference {worst:.1e})")
        row(
            f"{f['title']} fwd+bwd",
            lambda kit=kit: _moe_step(kit, x, dy),
            lambda hf=hf: _moe_step(hf, x, dy),
            label,
            goal=1.0,
            code=f"{f['block']}.forward + backward ({label})",
            repeat=40,  # ~10 ms calls against the same algorithm (grouped_mm): more samples, 3 calls each
            inner=3,
        )


def bench_masks(size: int = 2048) -> None:
    print(f"\n== causal mask {size}x{size}: the seed's three ways ==")
    dev = DEVICE

    def numpy_way():
        return torch.from_numpy(np.triu(np.ones([size, size]), k=1)).bool().to(dev)

    def torch_way():
        return torch.triu(torch.ones(size, size, device=dev), 1).bool()

    def cached_way():
        return ops.compressed_causal_mask(dev)

    # bytes allocated per call by the intermediates (float64 numpy arrays; float32 torch; bool result)
    cells = size * size
    ways = [
        ("numpy triu + from_numpy", numpy_way, cells * 8 * 2 + cells),
        ("torch.triu per call", torch_way, cells * 4 * 2 + cells),
        ("kit cached (once per device)", cached_way, 0),
    ]
    base = timeit(numpy_way, repeat=7, inner=2)
    for name, fn, nbytes in ways:
        t = timeit(fn, repeat=7, inner=2)
        print(
            f"{name:<34} {t * 1e3:9.3f} ms/call  x{base / t:10.1f} vs numpy   {nbytes / 2**20:7.1f} MiB/call"
        )
        if fn is not numpy_way:
            figure_line(
                f"causal mask {size}x{size}: {name} vs numpy triu + from_numpy, time per call",
                base / t,
                None,
                "torch.from_numpy(np.triu(np.ones([S, S]), k=1)).bool().to(device)",
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="half the samples (well under a minute on 2 cores)")
    if ap.parse_args().quick:
        REPEAT_SCALE = 0.5
    DEVICE = get_device()
    if DEVICE.type == "cpu":
        torch.set_num_threads(
            1
        )  # one thread: ratios are far less disturbed by other processes on a shared box
    torch.manual_seed(0)
    print(
        f"device {DEVICE}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"ops backend {ops.resolve_backend(torch.zeros(1, device=DEVICE))}"
    )
    bench_overhead()
    bench_attention()
    for family in MOE_FAMILIES:
        bench_moe(family)
    bench_masks()
