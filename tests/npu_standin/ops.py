"""Strict CPU stand-ins for the torch_npu ops kit.ops calls (semantics of torch_npu 2.13.0 `_op_plugin_docs.py`).

Each function has the real signature (so a misspelled keyword such as `pre_tokens` fails as on NPU), computes
the documented result in float32 on CPU tensors, and raises where the real op rejects the input or where the
docs say the result would be wrong (e.g. sparse_mode 3 with a full S x S mask instead of the compressed
2048 x 2048 one). Every call is appended to CALLS as (name, arguments) for assertions.
"""

from __future__ import annotations

import torch

CALLS: list = []
MAX = 2147483647
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


GARBAGE = 12345.0  # what the stand-in writes where the real kernel's output is undocumented


class StandinError(ValueError):
    """What the real torch_npu would reject (or silently compute wrongly)."""


def _record(name: str, **args) -> None:
    CALLS.append((name, args))


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise StandinError(message)


def _check_int_list(name: str, values) -> list:
    _need(
        isinstance(values, (list, tuple)) and all(type(v) is int for v in values),
        f"{name} must be a list/tuple of Python ints (int[]), got {type(values).__name__}",
    )
    return list(values)


def _lengths(name: str, cumulative: list, total: int) -> list:
    values = list(cumulative)
    while len(values) > 1 and values[-1] == 0:
        values.pop()
    # the docs give 1..2K entries and "at most 1K in varlen": TND is varlen, so 1024 (safe side)
    _need(1 <= len(values) <= 1024, f"{name}: 1..1024 entries allowed in varlen, got {len(values)}")
    out, prev = [], 0
    for v in values:
        _need(v >= prev, f"{name} must be cumulative (non-decreasing): {values}")
        out.append(v - prev)
        prev = v
    _need(prev == total, f"{name} ends at {prev}, tensor has T={total}")
    return out


def _compressed_ok(mask) -> bool:
    ref = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    return tuple(mask.shape) == (2048, 2048) and bool(torch.equal(mask.to(torch.bool).cpu(), ref))


def _to_bnsd(x, layout: str, n: int):
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, n, h // n).transpose(1, 2)
    s, b, h = x.shape
    return x.reshape(s, b, n, h // n).permute(1, 2, 0, 3)


def _from_bnsd(out, layout: str):
    b, n, s, d = out.shape
    if layout == "BSND":
        return out.transpose(1, 2).contiguous()
    if layout == "BNSD":
        return out.contiguous()
    if layout == "BSH":
        return out.transpose(1, 2).reshape(b, s, n * d)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _block_mask(sparse_mode, user, sq, skv, pre, nxt):
    """(Sq, Skv) or (N, Sq, Skv) bool, True = masked, for one batch item; None = nothing masked."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    if sparse_mode == 0:
        return user | (j - i > nxt) | (i - j > pre)
    if sparse_mode == 1:
        return user
    if sparse_mode == 2:
        return j > i
    if sparse_mode == 3:
        return j > i + (skv - sq)
    rel = j - i - (skv - sq)  # sparse_mode 4: band, origin bottom-right
    return (rel > nxt) | (rel < -pre)


def _attend(
    q, k, v, masked, scale, keep_prob, varlen: bool, inner_precise: int = 0, auto_invalid: bool = False
):
    """q (N, Sq, D), k/v (Nkv, Skv, D) -> (N, Sq, Dv) in float32; GQA by repeating inside the stand-in only.

    Rows with every key masked: refused in varlen; elsewhere they need inner_precise=2 (or a case the kernel
    detects itself, `auto_invalid`), and what the kernel writes there is undocumented, so the stand-in writes
    GARBAGE there: a caller must not use those rows (the safe reading of the docs).
    """
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    dead = None
    if masked is not None:
        dead = masked.all(dim=-1, keepdim=True)
        if bool(dead.any()):
            _need(not varlen, "varlen atten_mask has a fully masked row (not allowed in TND)")
            _need(
                inner_precise == 2 or auto_invalid,
                "fully masked rows need inner_precise=2 (invalid-row computation), got "
                f"inner_precise={inner_precise}",
            )
        scores = scores.masked_fill(masked, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    if keep_prob < 1.0:
        probs = probs * (torch.rand_like(probs) < keep_prob) / keep_prob
    out = torch.matmul(probs, v)
    return out if dead is None else out.masked_fill(dead, GARBAGE)


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=MAX,
    next_tockens=MAX,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
    sink=None,
    dropout_mask=None,
    seed=0,
    offset=0,
):
    _record(
        "npu_fusion_attention",
        head_num=head_num,
        input_layout=input_layout,
        atten_mask=atten_mask,
        scale=scale,
        keep_prob=keep_prob,
        pre_tockens=pre_tockens,
        next_tockens=next_tockens,
        sparse_mode=sparse_mode,
        actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen,
        inner_precise=inner_precise,
        shapes=(tuple(query.shape), tuple(key.shape), tuple(value.shape)),
        data_ptrs=(query.data_ptr(), key.data_ptr(), value.data_ptr()),
    )
    _need(input_layout in LAYOUTS, f"input_layout {input_layout!r} not in {LAYOUTS}")
    _need(
        query.dtype in FLOATS and query.dtype == key.dtype == value.dtype, "query/key/value dtypes must match"
    )
    _need(type(head_num) is int and head_num > 0, "head_num must be a positive int")
    _need(
        pse is None and padding_mask is None and prefix is None and sink is None,
        "stand-in: pse/prefix unused",
    )
    _need(isinstance(scale, float), f"scale must be a float, got {type(scale).__name__}")
    _need(0.0 < keep_prob <= 1.0, f"keep_prob {keep_prob} not in (0, 1]")
    _need(sparse_mode in (0, 1, 2, 3, 4), f"sparse_mode {sparse_mode} not modelled by the stand-in")
    # inner_precise: 0 and 1 are reserved values, 2 enables invalid-row computation; 1 is refused (safe side)
    _need(inner_precise in (0, 2), f"inner_precise={inner_precise}: only 0 (default) or 2 are meaningful")
    if sparse_mode in (0, 4) and atten_mask is not None:
        pre, nxt = pre_tockens, next_tockens
        _need(
            pre + nxt >= 0 and (nxt >= 0 or pre >= -nxt) and (pre >= 0 or nxt >= -pre),
            f"pre_tockens={pre}, next_tockens={nxt} leave no band (a negative side needs the other >= its size)",
        )
    _need(tuple(key.shape) == tuple(value.shape), "key and value shapes must be equal")
    _need(all(t.is_contiguous() for t in (query, key, value)), "query/key/value must be contiguous")
    varlen = input_layout == "TND"
    if atten_mask is not None:
        _need(
            atten_mask.dtype in (torch.bool, torch.uint8),
            f"atten_mask dtype {atten_mask.dtype} not bool/uint8",
        )
        if sparse_mode in (2, 3, 4):
            _need(
                _compressed_ok(atten_mask),
                f"sparse_mode {sparse_mode} needs the compressed 2048x2048 triu(ones, 1) mask",
            )
        elif varlen:
            _need(atten_mask.dim() == 2, "TND supports only an SS atten_mask")
    if varlen:
        _need(actual_seq_qlen is not None and actual_seq_kvlen is not None, "TND needs actual_seq_qlen/kvlen")
        seq_q = _lengths(
            "actual_seq_qlen", _check_int_list("actual_seq_qlen", actual_seq_qlen), query.shape[0]
        )
        seq_kv = _lengths(
            "actual_seq_kvlen", _check_int_list("actual_seq_kvlen", actual_seq_kvlen), key.shape[0]
        )
        _need(len(seq_q) == len(seq_kv), "actual_seq_qlen/kvlen lengths differ")
        nq, nkv, d = query.shape[1], key.shape[1], query.shape[2]
        _need(head_num == nq, f"head_num {head_num} != query heads {nq}")
    else:
        _need(actual_seq_qlen is None and actual_seq_kvlen is None, "actual_seq_* are for TND only")
        _need(query.dim() == (3 if input_layout in ("BSH", "SBH") else 4), f"wrong rank for {input_layout}")
        if input_layout in ("BSH", "SBH"):
            _need(query.shape[2] % head_num == 0, "head_num does not divide H")
            d = query.shape[2] // head_num
            nq, nkv = head_num, key.shape[2] // d
        else:
            axis = 1 if input_layout == "BNSD" else 2
            nq, nkv, d = query.shape[axis], key.shape[axis], query.shape[3]
            _need(head_num == nq, f"head_num {head_num} != query heads {nq} for {input_layout}")
    _need(key.shape[-1] == d or input_layout in ("BSH", "SBH"), "Dq must equal Dk")
    _need(
        1 <= d <= 768 and nq <= 256 and nkv > 0 and nq % nkv == 0, f"bad heads/dim: Nq={nq} Nkv={nkv} D={d}"
    )

    q32, k32, v32 = query.float(), key.float(), value.float()
    if varlen:
        outs, q0, k0 = [], 0, 0
        for sq, skv in zip(seq_q, seq_kv):
            if sq:
                _need(skv > 0, "a varlen sequence with queries but no keys")
                user = (
                    None if atten_mask is None or sparse_mode in (2, 3, 4) else atten_mask.bool()[:sq, :skv]
                )
                masked = (
                    None
                    if atten_mask is None
                    else _block_mask(sparse_mode, user, sq, skv, pre_tockens, next_tockens)
                )
                o = _attend(
                    q32[q0 : q0 + sq].transpose(0, 1),
                    k32[k0 : k0 + skv].transpose(0, 1),
                    v32[k0 : k0 + skv].transpose(0, 1),
                    masked,
                    scale,
                    keep_prob,
                    True,
                    inner_precise,
                )
                outs.append(o.transpose(0, 1))
            q0, k0 = q0 + sq, k0 + skv
        out = torch.cat(outs, 0) if outs else q32.new_zeros(0, nq, value.shape[-1])
        out = torch.cat([out, q32.new_zeros(query.shape[0] - out.shape[0], nq, out.shape[-1])], 0)
    else:
        q, k, v = (
            _to_bnsd(q32, input_layout, nq),
            _to_bnsd(k32, input_layout, nkv),
            _to_bnsd(v32, input_layout, nkv),
        )
        b, sq, skv = q.shape[0], q.shape[2], k.shape[2]
        _need(k.shape[0] == b, "batch sizes differ")
        if sparse_mode in (0, 4) and atten_mask is not None:
            _need(
                next_tockens >= 0 or -next_tockens < skv,
                f"|next_tockens|={-next_tockens} must be < Skv={skv}",
            )
            _need(pre_tockens >= 0 or -pre_tockens < sq, f"|pre_tockens|={-pre_tockens} must be < Sq={sq}")
        if atten_mask is not None and sparse_mode in (0, 1):
            allowed = [(sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, nq, sq, skv)]
            _need(
                tuple(atten_mask.shape) in allowed,
                f"atten_mask shape {tuple(atten_mask.shape)} not in {allowed}",
            )
            user = atten_mask.bool().expand(b, nq, sq, skv)
        outs = []
        for bi in range(b):
            masked = None
            if atten_mask is not None:
                ub = user[bi] if sparse_mode in (0, 1) else None
                masked = _block_mask(sparse_mode, ub, sq, skv, pre_tockens, next_tockens)
            # the kernel detects rows without keys itself for sparse_mode 3 with Sq > Skv (docs, inner_precise)
            auto = sparse_mode == 3 and sq > skv
            outs.append(_attend(q[bi], k[bi], v[bi], masked, scale, keep_prob, False, inner_precise, auto))
        out = _from_bnsd(torch.stack(outs, 0), input_layout)
    out = out.to(query.dtype)
    stats = torch.zeros(1, dtype=torch.float32)
    return out, stats, stats, torch.empty(0), 0, 0, 0


def npu_rms_norm(self, gamma, epsilon=1e-06):
    _record("npu_rms_norm", shape=tuple(self.shape), epsilon=epsilon)
    _need(
        self.dtype in FLOATS and gamma.dtype == self.dtype,
        f"gamma dtype {gamma.dtype} must equal {self.dtype}",
    )
    _need(2 <= self.dim() <= 8, "npu_rms_norm takes 2-8 dims")
    _need(tuple(gamma.shape) == tuple(self.shape[-gamma.dim() :]), "gamma must match the trailing dims")
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(self.dtype), rstd


# torch_npu 2.13.0 `_op_plugin_docs.py`, npu_rotary_mul (jit_compile=False): allowed cos/sin broadcasts of the
# first three dims per input layout (1 = broadcast), and the B/N limits per mode.
_ROTARY = {
    "half": {
        "BNSD": ((1, 1, 0), (0, 1, 0), (0, 0, 0)),
        "BSND": ((1, 0, 1), (0, 0, 1), (0, 0, 0)),
        "SBND": ((0, 1, 1), (0, 0, 1), (0, 0, 0)),
    },
    "interleave": {"BNSD": ((1, 1, 0),), "BSND": ((1, 0, 1),), "SBND": ((0, 1, 1),)},
}
_BN_AXES = {"BNSD": (0, 1), "BSND": (0, 2), "SBND": (1, 2)}


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    _record(
        "npu_rotary_mul",
        shape=tuple(input.shape),
        cos_shape=tuple(r1.shape),
        rotary_mode=rotary_mode,
        data_ptr=input.data_ptr(),
        contiguous=input.is_contiguous(),
    )
    _need(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r}")
    _need(rotate is None, "stand-in: rotate unused")
    _need(input.dim() == 4 and r1.dim() == 4 and tuple(r1.shape) == tuple(r2.shape), "4-D input/r1/r2 needed")
    _need(input.dtype in FLOATS and r1.dtype == r2.dtype == input.dtype, "input/r1/r2 dtypes must match")
    d = input.shape[-1]
    _need(d % 2 == 0 and d < 896 and r1.shape[-1] == d, f"D={d} must be even, < 896 and equal r1's")
    layouts = [
        layout
        for layout, patterns in _ROTARY[rotary_mode].items()
        if any(
            all((r1.shape[i] == 1) if bc else (r1.shape[i] == input.shape[i]) for i, bc in enumerate(p))
            for p in patterns
        )
    ]
    _need(
        bool(layouts),
        f"r1 shape {tuple(r1.shape)} is not an allowed {rotary_mode} broadcast of {tuple(input.shape)} "
        "(half: 11SD/B1SD/BNSD, 1S1D/BS1D/BSND, S11D/SB1D/SBND; interleave: 11SD/1S1D/S11D)",
    )
    for layout in layouts:  # a shape several layouts explain must satisfy each (the kernel cannot tell)
        b, n = (input.shape[a] for a in _BN_AXES[layout])
        if rotary_mode == "interleave":
            _need(b * n < 1000, f"interleave needs B*N < 1000, got B={b} N={n} ({layout})")
        else:
            _need(b < 1000 and n < 1000, f"half needs B, N < 1000, got B={b} N={n} ({layout})")
            _need(
                not (r1.requires_grad or r2.requires_grad) or b * n <= 1024,
                f"B*N={b * n} > 1024 with cos/sin gradients",
            )
    _need(
        float(r1.abs().max()) <= 1.0 + 1e-3 and float(r2.abs().max()) <= 1.0 + 1e-3, "r1/r2 outside [-1, 1]"
    )
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, -1)
        rotated = torch.cat((-x2, x1), -1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return (r1.float() * x + r2.float() * rotated).to(input.dtype)


def npu_swiglu(self, dim=-1):
    _record("npu_swiglu", shape=tuple(self.shape), dim=dim, data_ptr=self.data_ptr())
    _need(self.dtype in FLOATS and 1 <= self.dim() <= 8, "npu_swiglu: fp16/bf16/fp32, 1-8 dims")
    _need(self.shape[dim] % 2 == 0, "size along dim must be even")
    a, b = self.float().chunk(2, dim)
    return (torch.nn.functional.silu(a) * b).to(self.dtype)


def npu_fast_gelu(input):
    _record("npu_fast_gelu", shape=tuple(input.shape))
    _need(input.dtype in FLOATS and input.dim() <= 8, "npu_fast_gelu: fp16/bf16/fp32, <= 8 dims")
    x = input.float()
    return (x / (1 + torch.exp(-1.702 * x))).to(input.dtype)  # Atlas A2/A3 formula


def npu_scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    _record(
        "npu_scaled_masked_softmax",
        shape=tuple(x.shape),
        mask_shape=tuple(mask.shape),
        scale=scale,
        fixed_triu_mask=fixed_triu_mask,
    )
    # op-plugin docs/context/torch_npu-npu_scaled_masked_softmax.md: reserved, unfinished, only False supported
    _need(fixed_triu_mask is False, "fixed_triu_mask is a reserved parameter: only False is supported")
    _need(x.dtype in FLOATS and x.dim() == 4, "x must be 4-D fp16/bf16/fp32")
    _need(
        all(32 <= s <= 4096 and s % 32 == 0 for s in x.shape[-2:]),
        f"H, W of {tuple(x.shape)} not in [32, 4096] and divisible by 32",
    )
    _need(mask.dtype == torch.bool, f"mask dtype {mask.dtype} must be bool")
    masked = mask.expand(x.shape)  # raises when not broadcastable
    # the op's reference: masked positions are -10000 before the softmax (a fully masked row is uniform)
    logits = (x.float() * scale).masked_fill(masked, -10000.0)
    return torch.softmax(logits, -1).to(x.dtype)


# ---- MoE (torch_npu 2.13.0 `_op_plugin_docs.py`, the section of each op) -------------------------------------------
INDEX_LIMIT = 16777215


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    _record("npu_moe_gating_top_k_softmax", shape=tuple(x.shape), dtype=x.dtype, k=k)
    _need(x.dtype in FLOATS and x.dim() in (2, 3), "x must be a 2-D/3-D fp16/bf16/fp32 tensor")
    _need(type(k) is int and 0 < k <= x.shape[-1] and k <= 1024, f"k={k!r} must be an int in (0, E], <= 1024")
    _need(finished is None or finished.dtype == torch.bool, "finished must be bool")
    # "该接口支持推理场景下使用": no backward is registered; a caller that needs the gradient must not call it
    _need(
        not (torch.is_grad_enabled() and x.requires_grad),
        "npu_moe_gating_top_k_softmax is inference-only (no backward): called on a tensor that needs a gradient",
    )
    with torch.no_grad():
        probs = torch.softmax(x.float(), dim=-1)
        y, idx = torch.topk(probs, k, dim=-1)
        if finished is not None:
            y = y.masked_fill(finished.unsqueeze(-1), 0.0)
        rows = (
            torch.arange(k * probs[..., 0].numel(), dtype=torch.int32).reshape(k, -1).t().reshape(idx.shape)
        )
    return y.to(x.dtype), idx.to(torch.int32), rows


def npu_moe_gating_top_k(
    x,
    k,
    *,
    bias=None,
    input_ids=None,
    tid2eid=None,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=False,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    """Section npu_moe_gating_top_k: norm (sigmoid for norm_type=1) -> bias -> group top-k -> top-k; y is the
    normed score of each chosen expert, renormalised with eps and times routed_scaling_factor."""
    _record("npu_moe_gating_top_k", shape=tuple(x.shape), k=k, k_group=k_group, group_count=group_count)
    _need(x.dim() == 2 and x.dtype in FLOATS, "x must be a 2-D fp16/bf16/fp32 tensor")
    experts = x.shape[-1]
    _need(experts <= 2048, f"x's last dim {experts} must be <= 2048")
    _need(
        type(k_group) is int and type(group_count) is int and type(k) is int, "k, k_group, group_count: int"
    )
    _need(group_count > 0 and experts % group_count == 0, f"group_count={group_count} must divide {experts}")
    per_group = experts // group_count
    _need(per_group > 2, f"experts per group {per_group} must be > 2")
    _need(-(-per_group // 32) * 32 * group_count <= 2048, "32-aligned experts per group * group_count > 2048")
    _need(1 <= k_group <= group_count, f"k_group={k_group} must be in [1, group_count={group_count}]")
    _need(1 <= k <= per_group * k_group, f"k={k} must be in [1, x_shape[-1] / group_count * k_group]")
    _need(bias is None or (bias.dim() == 1 and bias.shape[0] == experts), "bias must be 1-D of x's last dim")
    _need(bias is None or bias.dtype == x.dtype, f"bias dtype {getattr(bias, 'dtype', None)} must equal x's")
    _need(input_ids is None and tid2eid is None, "the stand-in models the non-hash mode only")
    _need(group_select_mode in (0, 1), "group_select_mode: 0 (group max) or 1 (sum of the group's top 2)")
    _need(renorm == 0, "renorm: only 0 is supported")
    _need(norm_type == 1, "the stand-in models norm_type=1 (sigmoid) only")
    # "该接口支持推理场景下使用": the kit calls it without a gradient (its backward is a separate training op)
    _need(
        not (torch.is_grad_enabled() and x.requires_grad),
        "npu_moe_gating_top_k: the kit calls it for inference only; called on a tensor that needs a gradient",
    )
    with torch.no_grad():
        scores = x.float().sigmoid()
        choice = scores + (0.0 if bias is None else bias.float())
        groups = choice.view(-1, group_count, per_group)
        group_scores = groups.max(-1)[0] if group_select_mode == 0 else groups.topk(2, -1)[0].sum(-1)
        kept = torch.topk(group_scores, k_group, dim=-1)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(per_group, dim=1), float("-inf"))
        idx = torch.topk(choice, k, dim=-1)[1]
        y = scores.gather(1, idx)
        y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    norm_out = scores if out_flag else torch.full_like(scores, GARBAGE)
    return y.to(x.dtype), idx.to(torch.int32), norm_out


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    _record("npu_moe_token_permute", shape=tuple(tokens.shape), indices_shape=tuple(indices.shape))
    _need(tokens.dim() == 2 and tokens.dtype in FLOATS, "tokens must be 2-D fp16/bf16/fp32")
    _need(
        indices.dim() in (1, 2) and indices.dtype in (torch.int32, torch.int64),
        "indices: 1-D/2-D int32/int64",
    )
    _need(padded_mode is False, "padded_mode: only False is supported")
    _need(indices.numel() < INDEX_LIMIT, "indices must have fewer than 16777215 elements")
    top_k = 1 if indices.dim() == 1 else indices.shape[1]
    _need(top_k <= 512, f"topK={top_k} must be <= 512")
    _need(indices.shape[0] == tokens.shape[0], "indices rows must equal tokens rows")
    _need(bool((indices >= 0).all()) and bool((indices < INDEX_LIMIT).all()), "indices out of [0, 16777215)")
    flat = indices.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    sorted_indices = torch.empty_like(order)
    sorted_indices[order] = torch.arange(order.numel())
    permuted = tokens[order // top_k]  # differentiable, as the real op (NpuMoeTokenPermuteBackward0)
    if num_out_tokens:
        permuted = permuted[:num_out_tokens]
    return permuted.contiguous(), sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(
    permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None
):
    _record(
        "npu_moe_token_unpermute",
        shape=tuple(permuted_tokens.shape),
        probs=None if probs is None else (tuple(probs.shape), probs.dtype),
    )
    _need(
        permuted_tokens.dim() == 2 and permuted_tokens.dtype in FLOATS, "permuted_tokens: 2-D fp16/bf16/fp32"
    )
    _need(sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32, "sorted_indices: 1-D int32")
    _need(padded_mode is False and restore_shape is None, "padded_mode False and restore_shape None only")
    top_k = 1 if probs is None else probs.shape[-1]
    _need(top_k <= 512, f"topK={top_k} must be <= 512")
    _need(
        sorted_indices.numel() == permuted_tokens.shape[0], "sorted_indices must have tokens_num * topK rows"
    )
    idx = sorted_indices.long()
    _need(
        bool((idx >= 0).all()) and bool((idx < idx.numel()).all()) and idx.unique().numel() == idx.numel(),
        "sorted_indices must be a permutation of [0, tokens_num * topK) (no repeats)",
    )
    rows = permuted_tokens[idx].float().view(-1, top_k, permuted_tokens.shape[-1])
    if probs is not None:
        _need(probs.dim() == 2 and probs.dtype in FLOATS, "probs: 2-D fp16/bf16/fp32")
        _need(probs.shape[0] * top_k == idx.numel(), "probs must be (tokens_num, topK)")
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)


def _group_sizes(group_list, group_list_type, total):
    _need(
        isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64, "group_list: int64 Tensor"
    )
    _need(group_list.dim() == 1 and 1 <= group_list.numel() <= 1024, "group_list: 1-D, at most 1024 groups")
    values = [int(v) for v in group_list.tolist()]
    _need(all(v >= 0 for v in values), f"group_list must be non-negative: {values}")
    if group_list_type == 0:
        _need(
            all(b >= a for a, b in zip(values, values[1:])), f"cumsum group_list must not decrease: {values}"
        )
        sizes = [b - a for a, b in zip([0] + values[:-1], values)]
    else:
        _need(group_list_type == 1, f"group_list_type={group_list_type!r} must be 0 or 1")
        sizes = values
    return sizes, sum(sizes) if group_list_type == 1 else values[-1]


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
):
    _record(
        "npu_grouped_matmul",
        x_shapes=[tuple(t.shape) for t in x],
        weight_shapes=[tuple(t.shape) for t in weight],
        split_item=split_item,
        group_type=group_type,
        group_list_type=group_list_type,
    )
    _need(
        isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)),
        "x and weight are lists of tensors",
    )
    _need(
        all(v is None for v in (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale)),
        "stand-in: non-quantised, bias-free calls only",
    )
    _need(act_type == 0 and output_dtype is None, "stand-in: act_type 0, output_dtype None")
    # the kit's form: group_type 0 (m-axis), one x, one 3-D weight, one output ("单单单")
    _need(group_type == 0, f"stand-in models group_type=0 only, got {group_type!r}")
    _need(split_item in (2, 3), f"group_type 0 needs split_item 2 or 3, got {split_item!r}")
    _need(len(x) == 1 and len(weight) == 1, "stand-in models one x and one weight tensor")
    a, w = x[0], weight[0]
    _need(a.dim() == 2 and w.dim() == 3, "x must be 2-D and weight 3-D (g, K, N)")
    _need(
        a.dtype in FLOATS and a.dtype == w.dtype, f"x {a.dtype} and weight {w.dtype}: one of fp16/bf16/fp32"
    )
    _need(a.is_contiguous(), "x must not be transposed (contiguous)")
    inner = w[0]
    _need(
        inner.is_contiguous() or inner.t().is_contiguous(),
        "weight[i] must be contiguous or a transposed view of contiguous memory",
    )
    _need(a.shape[1] == w.shape[1], f"x K={a.shape[1]} != weight K={w.shape[1]}")
    _need(a.shape[-1] < 65536 and w.shape[-1] < 65536, "the last dims must be < 65536 (InnerLimit)")
    _need(group_list is not None, "group_type 0 needs group_list")
    sizes, total = _group_sizes(group_list, group_list_type, a.shape[0])
    _need(len(sizes) == w.shape[0], f"group_list has {len(sizes)} groups, weight {w.shape[0]}")
    _need(total == a.shape[0], f"group_list covers {total} rows, x has {a.shape[0]}")
    # no backward is registered for this op: the output carries no gradient (the caller wraps it)
    with torch.no_grad():
        parts = [xs.float() @ w[i].float() for i, xs in enumerate(a.split(sizes))]
        out = torch.cat(parts) if parts else a.new_zeros(0, w.shape[-1])
    return [out.to(a.dtype)]


def npu_grouped_matmul_add_(
    self, x, weight, group_list, *, transpose_x=True, transpose_weight=False, group_type=2, group_list_type=0
):
    _record("npu_grouped_matmul_add_", shape=tuple(self.shape), x_shape=tuple(x.shape), dtype=x.dtype)
    _need(self.dtype == torch.float32 and self.dim() == 3, "self must be a 3-D float32 tensor [g, M, N]")
    _need(x.dim() == 2 and weight.dim() == 2, "x and weight must be 2-D")
    _need(
        x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype,
        f"x {x.dtype} / weight {weight.dtype}: fp16 or bf16, equal",
    )
    _need(transpose_x is True and transpose_weight is False, "only transpose_x=True, transpose_weight=False")
    _need(group_type == 2, f"group_type={group_type!r}: only 2 (K-axis groups)")
    sizes, total = _group_sizes(group_list, group_list_type, x.shape[0])
    _need(total <= x.shape[0] and len(sizes) == self.shape[0], "group_list does not fit x / self")
    _need(x.shape[-1] < 65536 and weight.shape[-1] < 65536, "the last dims must be < 65536")
    with torch.no_grad():
        start = 0
        for i, size in enumerate(sizes):
            self[i] += x[start : start + size].float().t() @ weight[start : start + size].float()
            start += size
    return self
