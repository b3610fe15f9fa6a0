"""kit.ops.fusion_attention vs a float64 reference, on the portable path and on the NPU branch (strict stand-in)."""

from __future__ import annotations

import math

import pytest
import torch
from npu_standin import install

from kit.ops import MAX_TOKENS, compressed_causal_mask, fusion_attention, use_backend

BACKENDS = ["torch", "npu"]


@pytest.fixture
def backend(request, monkeypatch):
    """Run the test body with kit ops forced to `request.param`; "npu" installs the strict stand-in."""
    if request.param == "npu":
        install(monkeypatch)
    with use_backend(request.param):
        yield request.param


def ref_keep(sq, skv, causal=False, pre=MAX_TOKENS, nxt=MAX_TOKENS):
    """May-attend matrix written from the definition (origin bottom-right), element by element."""
    keep = torch.ones(sq, skv, dtype=torch.bool)
    for i in range(sq):
        for j in range(skv):
            rel = j - i - (skv - sq)
            if (causal and rel > 0) or rel > nxt or rel < -pre:
                keep[i, j] = False
    return keep


def ref_attention(q, k, v, keep, scale):
    """float64 softmax(scale q k^T) v on (B, N, S, D); GQA by repetition; rows with no key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("bnid,bnjd->bnij", q, k) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)
    probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    return torch.einsum("bnij,bnjd->bnid", probs, v)


def to_layout(x, layout):
    """(B, N, S, D) -> the given layout."""
    b, n, s, d = x.shape
    return {
        "BNSD": x,
        "BSND": x.transpose(1, 2),
        "BSH": x.transpose(1, 2).reshape(b, s, n * d),
        "SBH": x.permute(2, 0, 1, 3).reshape(s, b, n * d),
    }[layout].contiguous()


def from_layout(x, layout, n):
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, n, h // n).transpose(1, 2)
    s, b, h = x.shape
    return x.view(s, b, n, h // n).permute(1, 2, 0, 3)


def rel_err(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))


def qkv(b=2, n=4, nkv=2, sq=9, skv=9, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    return make(b, n, sq, d), make(b, nkv, skv, d), make(b, nkv, skv, d)


CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, pre_tokens=3),
    "band": dict(pre_tokens=2, next_tokens=1),
    "mask": dict(mask=True),
    "mask_causal": dict(mask=True, causal=True),
}


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
@pytest.mark.parametrize("case", list(CASES))
def test_layouts_match_float64_reference(backend, layout, case):
    spec = dict(CASES[case])
    q, k, v = qkv()
    keep = ref_keep(
        9,
        9,
        spec.get("causal", False),
        spec.get("pre_tokens", MAX_TOKENS),
        spec.get("next_tokens", MAX_TOKENS),
    )
    kwargs = {key: val for key, val in spec.items() if key != "mask"}
    if spec.get("mask"):
        user = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(5)) > 0.7  # True = masked
        user[..., 0] = False  # every row keeps one key
        kwargs["atten_mask"] = user
        keep = keep & ~user
    out = fusion_attention(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), 4, layout, **kwargs
    )
    got = from_layout(out, layout, 4)
    assert rel_err(got, ref_attention(q, k, v, keep, 1 / math.sqrt(16))) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH", "TND"])
def test_bf16_within_1e2(backend, layout):
    q, k, v = qkv(dtype=torch.bfloat16)
    keep = ref_keep(9, 9, True, 4)
    if layout == "TND":  # the two batch rows as two sequences
        flat = [t.transpose(1, 2).reshape(18, t.shape[1], 16) for t in (q, k, v)]
        out = fusion_attention(
            *flat, 4, "TND", causal=True, pre_tokens=4, actual_seq_qlen=[9, 18], actual_seq_kvlen=[9, 18]
        )
        got = out.view(2, 9, 4, 16).transpose(1, 2)
    else:
        out = fusion_attention(
            to_layout(q, layout),
            to_layout(k, layout),
            to_layout(v, layout),
            4,
            layout,
            causal=True,
            pre_tokens=4,
        )
        got = from_layout(out, layout, 4)
    assert out.dtype == torch.bfloat16
    assert rel_err(got, ref_attention(q, k, v, keep, 0.25)) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_causal_is_bottom_right_when_fewer_queries(backend):
    q, k, v = qkv(sq=3, skv=8)
    out = fusion_attention(q, k, v, 4, "BNSD", causal=True, scale=0.3)
    assert rel_err(out, ref_attention(q, k, v, ref_keep(3, 8, True), 0.3)) <= 1e-5
    # the last query sees every key: same as non-causal for that row
    full = fusion_attention(q, k, v, 4, "BNSD", scale=0.3)
    torch.testing.assert_close(out[:, :, -1], full[:, :, -1])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("window", [None, 2])
def test_tnd_uneven_lengths_match_per_sequence_reference(backend, window):
    lengths = [5, 1, 0, 7, 3]
    total, n, nkv, d = sum(lengths), 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(total, heads, d, generator=gen) for heads in (n, nkv, nkv))
    cumulative = torch.tensor(lengths).cumsum(0).tolist() + [0, 0]  # trailing 0s: unused batches
    pre = MAX_TOKENS if window is None else window
    out = fusion_attention(
        q,
        k,
        v,
        n,
        "TND",
        causal=True,
        pre_tokens=pre,
        actual_seq_qlen=cumulative,
        actual_seq_kvlen=cumulative,
    )
    start = 0
    for length in lengths:
        if length:
            sl = slice(start, start + length)
            want = ref_attention(
                q[sl].transpose(0, 1)[None],
                k[sl].transpose(0, 1)[None],
                v[sl].transpose(0, 1)[None],
                ref_keep(length, length, True, pre),
                d**-0.5,
            )
            assert rel_err(out[sl].transpose(0, 1)[None], want) <= 1e-5
        start += length


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_dropout_keep_prob_is_unbiased(backend):
    torch.manual_seed(0)
    q, k = torch.zeros(1, 2, 64, 8), torch.zeros(1, 2, 64, 8)  # uniform attention over 64 keys
    v = torch.ones(1, 2, 64, 8)
    out = fusion_attention(q, k, v, 2, "BNSD", keep_prob=0.5)
    assert not torch.allclose(out, torch.ones_like(out))  # dropout happened
    assert abs(float(out.mean()) - 1.0) < 0.05  # rescaled by 1/keep_prob


def test_npu_branch_passes_exact_arguments(monkeypatch):
    fake = install(monkeypatch)
    q, k, v = qkv(d=16)
    with use_backend("npu"):
        fusion_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 4, "BSND", causal=True)
        fusion_attention(q, k, v, 4, "BNSD", causal=True, pre_tokens=4, keep_prob=0.9)
        fusion_attention(q, k, v, 4, "BNSD")
    (_, causal), (_, window), (_, full) = fake.CALLS
    assert causal["sparse_mode"] == 3 and causal["input_layout"] == "BSND" and causal["head_num"] == 4
    assert causal["scale"] == pytest.approx(0.25)  # never torch_npu's default 1.0
    assert causal["atten_mask"] is compressed_causal_mask("cpu")  # built once, cached per device
    assert causal["atten_mask"].shape == (2048, 2048) and causal["atten_mask"].dtype == torch.bool
    assert window["sparse_mode"] == 4 and window["pre_tockens"] == 4 and window["next_tockens"] == 0
    assert window["keep_prob"] == pytest.approx(0.9)
    assert full["atten_mask"] is None and full["sparse_mode"] == 0


def test_npu_branch_tnd_passes_cumulative_int_lists(monkeypatch):
    fake = install(monkeypatch)
    q = torch.randn(6, 2, 8)
    with use_backend("npu"):
        fusion_attention(
            q, q, q, 2, "TND", causal=True, actual_seq_qlen=torch.tensor([2, 6]), actual_seq_kvlen=[2, 6]
        )
    args = fake.CALLS[-1][1]
    assert args["actual_seq_qlen"] == [2, 6] and args["actual_seq_kvlen"] == [2, 6]
    assert all(type(x) is int for x in args["actual_seq_qlen"])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q: fusion_attention(q, q, q, 4, "BHSD"), "input_layout"),
        (lambda q: fusion_attention(q, q, q, 3, "BNSD"), "head_num"),
        (lambda q: fusion_attention(q, q[:, :3], q[:, :3], 4, "BNSD"), "multiple"),
        (lambda q: fusion_attention(q, q, q.double(), 4, "BNSD"), "dtypes"),
        (lambda q: fusion_attention(q, q, q, 4, "BNSD", keep_prob=0.0), "keep_prob"),
        (lambda q: fusion_attention(q, q, q, 4, "BNSD", atten_mask=torch.zeros(9, 9)), "True = masked"),
        (
            lambda q: fusion_attention(q, q, q, 4, "BNSD", atten_mask=torch.zeros(8, 9, dtype=torch.bool)),
            "shape",
        ),
        (
            lambda q: fusion_attention(
                q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), 4, "TND"
            ),
            "actual_seq_qlen",
        ),
        (
            lambda q: fusion_attention(
                q[0].transpose(0, 1),
                q[0].transpose(0, 1),
                q[0].transpose(0, 1),
                4,
                "TND",
                actual_seq_qlen=[5, 4],
                actual_seq_kvlen=[5, 4],
            ),
            "cumulative",
        ),
        (
            lambda q: fusion_attention(
                q[0].transpose(0, 1),
                q[0].transpose(0, 1),
                q[0].transpose(0, 1),
                4,
                "TND",
                actual_seq_qlen=[4, 8],
                actual_seq_kvlen=[4, 8],
            ),
            "ends at 8",
        ),
    ],
)
def test_rejects_what_torch_npu_rejects(backend, call, message):
    q, _, _ = qkv(nkv=4)
    with pytest.raises(ValueError, match=message):
        call(q)


def test_standin_is_strict_about_raw_calls(monkeypatch):
    fake = install(monkeypatch)
    q = torch.randn(1, 2, 4, 8)
    full_mask = torch.ones(4, 4, dtype=torch.bool).triu(1)
    with pytest.raises(fake.StandinError, match="compressed"):  # S x S mask with sparse_mode 3
        fake.npu_fusion_attention(q, q, q, 2, "BNSD", atten_mask=full_mask, sparse_mode=3, scale=0.3)
    with pytest.raises(TypeError):  # the real kwarg is spelled pre_tockens
        fake.npu_fusion_attention(q, q, q, 2, "BNSD", pre_tokens=3)
    t = torch.randn(4, 2, 8)
    with pytest.raises(fake.StandinError, match="int"):  # int[] wants Python ints, not a tensor
        fake.npu_fusion_attention(t, t, t, 2, "TND", actual_seq_qlen=torch.tensor([4]), actual_seq_kvlen=[4])
    out = fake.npu_fusion_attention(q, q, q, 2, "BNSD", scale=0.3)
    assert isinstance(out, tuple) and len(out) == 7


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((2, "bsnd"), {}, "input_layout"),
        ((3, "BNSD"), {"scale": 0.3}, "head_num"),
        ((2, "BNSD"), {"scale": 0.3, "atten_mask": torch.zeros(4, 4)}, "dtype"),
        (
            (2, "BNSD"),
            {"scale": 0.3, "atten_mask": torch.zeros(3, 4, dtype=torch.bool), "sparse_mode": 0},
            "shape",
        ),
        ((2, "BNSD"), {"scale": 1}, "float"),
        ((2, "BNSD"), {"scale": 0.3, "keep_prob": 0.0}, "keep_prob"),
    ],
)
def test_standin_rejects_bad_raw_arguments(monkeypatch, args, kwargs, message):
    fake = install(monkeypatch)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(fake.StandinError, match=message):
        fake.npu_fusion_attention(q, q, q, *args, **kwargs)


def test_standin_rejects_bad_varlen_lists(monkeypatch):
    fake = install(monkeypatch)
    t = torch.randn(6, 2, 8)
    with pytest.raises(fake.StandinError, match="actual_seq"):
        fake.npu_fusion_attention(t, t, t, 2, "TND", scale=0.3)
    with pytest.raises(fake.StandinError, match="cumulative"):
        fake.npu_fusion_attention(
            t, t, t, 2, "TND", scale=0.3, actual_seq_qlen=[4, 2], actual_seq_kvlen=[4, 2]
        )
    with pytest.raises(fake.StandinError, match="fully masked"):  # a row-padding mask inside TND
        mask = torch.zeros(3, 3, dtype=torch.bool)
        mask[2] = True
        fake.npu_fusion_attention(
            t, t, t, 2, "TND", scale=0.3, atten_mask=mask, actual_seq_qlen=[3, 6], actual_seq_kvlen=[3, 6]
        )


def test_npu_branch_checks_kernel_limits_before_calling(monkeypatch):
    fake = install(monkeypatch)
    with use_backend("npu"):
        with pytest.raises(ValueError, match="fp16/bf16/fp32"):
            fusion_attention(*qkv(dtype=torch.float64), 4, "BNSD")
        big = torch.randn(1, 2, 4, 800)
        with pytest.raises(ValueError, match="head_dim <= 768"):
            fusion_attention(big, big, big, 2, "BNSD")
        fusion_attention(
            big.double(), big.double(), big.double(), 2, "BNSD", backend="torch"
        )  # way out works
    assert fake.CALLS == []


def test_portable_gqa_without_native_sdpa_support(monkeypatch):
    from kit.ops import attention_torch

    monkeypatch.setattr(attention_torch, "_NATIVE_GQA", False)  # torch < 2.5 (older ModelArts images)
    q, k, v = qkv()
    out = fusion_attention(q, k, v, 4, "BNSD", causal=True, backend="torch")
    assert rel_err(out, ref_attention(q, k, v, ref_keep(9, 9, True), 0.25)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("causal", [False, True])
def test_tnd_with_more_keys_than_queries(backend, causal):
    seq_q, seq_kv = (
        [2, 3, 1],
        [5, 3, 4],
    )  # e.g. chunked prefill: the queries are the last tokens of each sequence
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(sum(seq_q), 4, 8, generator=gen)
    k, v = torch.randn(sum(seq_kv), 2, 8, generator=gen), torch.randn(sum(seq_kv), 2, 8, generator=gen)
    cum = lambda xs: torch.tensor(xs).cumsum(0).tolist()  # noqa: E731
    out = fusion_attention(
        q, k, v, 4, "TND", causal=causal, actual_seq_qlen=cum(seq_q), actual_seq_kvlen=cum(seq_kv)
    )
    q0 = k0 = 0
    for sq, skv in zip(seq_q, seq_kv):
        want = ref_attention(
            q[q0 : q0 + sq].transpose(0, 1)[None],
            k[k0 : k0 + skv].transpose(0, 1)[None],
            v[k0 : k0 + skv].transpose(0, 1)[None],
            ref_keep(sq, skv, causal),
            8**-0.5,
        )
        assert rel_err(out[q0 : q0 + sq].transpose(0, 1)[None], want) <= 1e-5
        q0, k0 = q0 + sq, k0 + skv


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "SBH"])
def test_causal_with_negative_next_tokens_keeps_the_shift(backend, layout):
    """causal=True, next_tokens=-2: each query sees keys up to 2 before it; the first 2 rows see none (0)."""
    q, k, v = qkv()
    keep = ref_keep(9, 9, True, MAX_TOKENS, -2)
    out = fusion_attention(
        to_layout(q, layout),
        to_layout(k, layout),
        to_layout(v, layout),
        4,
        layout,
        causal=True,
        next_tokens=-2,
    )
    assert rel_err(from_layout(out, layout, 4), ref_attention(q, k, v, keep, 0.25)) <= 1e-5
    assert torch.all(from_layout(out, layout, 4)[:, :, :2] == 0)


def test_npu_branch_negative_next_goes_to_band_mode_with_inner_precise(monkeypatch):
    fake = install(monkeypatch)
    q, k, v = qkv()
    with use_backend("npu"):
        fusion_attention(q, k, v, 4, "BNSD", causal=True, next_tokens=-2)
        fusion_attention(q, k, v, 4, "BNSD", causal=True)
    (_, shifted), (_, plain) = fake.CALLS
    # sparse_mode 3 ignores pre/next_tockens (op docs), so the shift needs band mode 4
    assert shifted["sparse_mode"] == 4 and shifted["next_tockens"] == -2 and shifted["inner_precise"] == 2
    assert plain["sparse_mode"] == 3 and plain["inner_precise"] == 0  # no row without keys: the fast setting


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_left_padding_mask_rows_without_keys_give_zero(backend):
    """An explicit mask where some query rows see no key (left padding): inner_precise=2 on NPU, rows are 0."""
    q, k, v = qkv(b=2, sq=6, skv=6)
    masked = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    masked[0, :, :, :2] = True  # batch 0: the first 2 keys are padding
    masked[0, :, :2, :] = True  # ... and the padding queries see nothing
    out = fusion_attention(q, k, v, 4, "BNSD", atten_mask=masked)
    assert rel_err(out, ref_attention(q, k, v, ~masked, 0.25)) <= 1e-5
    assert torch.all(out[0, :, :2] == 0)


def test_standin_refuses_fully_masked_rows_without_inner_precise(monkeypatch):
    fake = install(monkeypatch)
    q, k, v = qkv(b=1, sq=4, skv=4)
    masked = torch.zeros(4, 4, dtype=torch.bool)
    masked[1] = True
    with pytest.raises(fake.StandinError, match="inner_precise=2"):
        fake.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=masked, scale=0.25)
    with pytest.raises(fake.StandinError, match="inner_precise=1"):
        fake.npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.25, inner_precise=1)
    out = fake.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=masked, scale=0.25, inner_precise=2)[0]
    assert torch.all(out[0, :, 1] == ops_garbage())  # undocumented content: the kit must not use it


def ops_garbage():
    from npu_standin import ops

    return ops.GARBAGE


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_varlen_holds_at_most_1024_sequences(backend):
    """The docs give both 2K and "1K in varlen" for actual_seq_qlen: the kit keeps to 1024 on every backend."""
    q = torch.randn(1025, 2, 8)
    ends = list(range(1, 1026))
    with pytest.raises(ValueError, match="1..1024"):
        fusion_attention(q, q, q, 2, "TND", actual_seq_qlen=ends, actual_seq_kvlen=ends)
    out = fusion_attention(
        q[:1024], q[:1024], q[:1024], 2, "TND", actual_seq_qlen=ends[:-1], actual_seq_kvlen=ends[:-1]
    )
    torch.testing.assert_close(out, q[:1024], rtol=1e-5, atol=1e-5)  # one token per sequence: softmax = 1


def test_standin_refuses_more_than_1024_varlen_sequences(monkeypatch):
    fake = install(monkeypatch)
    q = torch.randn(1025, 2, 8)
    ends = list(range(1, 1026))
    with pytest.raises(fake.StandinError, match="1..1024"):
        fake.npu_fusion_attention(q, q, q, 2, "TND", actual_seq_qlen=ends, actual_seq_kvlen=ends)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pre_tokens=1, next_tokens=-3), "pre_tokens >= 3"),
        (dict(pre_tokens=MAX_TOKENS, next_tokens=-9), "< Skv=9"),
        (dict(pre_tokens=-2, next_tokens=1), "next_tokens >= 2"),
    ],
)
def test_band_rules_of_torch_npu(kwargs, message):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=message):
        fusion_attention(q, k, v, 4, "BNSD", **kwargs)


def test_tnd_refuses_negative_windows():
    q = torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match="varlen"):
        fusion_attention(
            q, q, q, 2, "TND", causal=True, next_tokens=-1, actual_seq_qlen=[3, 6], actual_seq_kvlen=[3, 6]
        )


@pytest.mark.parametrize(
    "module", ["kit.ops.attention_npu", "kit.ops.attention_torch", "kit.ops.attention_args"]
)
def test_backend_imports_first_in_a_fresh_interpreter(module):
    # the backends used to import kit.ops.attention, which imports them: importing one first broke on the cycle
    import subprocess
    import sys

    code = f"import {module}, kit.ops.attention as a; print(a.fusion_attention.__name__, a.MAX_TOKENS)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fusion_attention", "2147483647"]
    # and no backend module imports the front end any more
    import importlib.util
    from pathlib import Path

    source = Path(importlib.util.find_spec(module).origin).read_text()
    assert "from kit.ops.attention import" not in source and "from kit.ops import attention\n" not in source
