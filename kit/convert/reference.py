"""Plain-torch forwards used as references: HF-layout ChatGLM3 / Baichuan2 / Llama / Qwen3 / GLM-4 from their
published math (Llama-3.1 rope scaling included), and
a Megatron forward from rank files with tensor parallelism simulated (each rank computes its heads / FFN slice and
the row-parallel outputs are summed, as the all-reduce does). Where transformers ships the family, the checks run
transformers' own model instead (transformers_ships); the HF forward is the reference for the remote-code ones."""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from kit.convert import megatron_layout as layout
from kit.convert.file_slices import FileSlice, as_tensor
from kit.convert.megatron_io import MegatronReader
from kit.convert.spec import ModelSpec, expert_role
from kit.core.parallel import stage_layers
from kit.system.memory import give_back_freed

# the model types whose modeling code transformers ships (ChatGLM3 and Baichuan2 bring theirs as remote code)
TRANSFORMERS_NATIVE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm", "glm4_moe", "deepseek_v3")


def transformers_ships(model_type: Optional[str]) -> bool:
    """True when the installed transformers has its own model for this config's model_type."""
    from transformers import CONFIG_MAPPING

    return model_type in TRANSFORMERS_NATIVE and model_type in CONFIG_MAPPING


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama3_scaled(inv: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Llama-3.1 rope scaling of inverse frequencies: wavelengths above original_context/low_freq_factor are
    divided by the factor, those below original_context/high_freq_factor kept, the band between blended
    linearly in original_context/wavelength (the published rule, as transformers' rope_type "llama3")."""
    factor, lo, hi = spec.rope_scaling_factor, spec.low_freq_factor, spec.high_freq_factor
    ctx = float(spec.original_max_position_embeddings)
    wavelen = 2 * math.pi / inv
    smooth = ((ctx / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > ctx / lo, inv / factor, torch.where(wavelen < ctx / hi, inv, blended))


def rope(
    x: torch.Tensor,
    base: float,
    percent: float = 1.0,
    interleaved: bool = False,
    spec: ModelSpec = None,
    positions=None,
) -> torch.Tensor:
    """Rotary embedding on x [seq, heads, head_dim]: rotate the first `percent` of each head.

    interleaved=False pairs dims (i, i + rd/2) (HF Llama rotate_half); True pairs (2i, 2i+1) (ChatGLM, GLM-4).
    A spec with rope_scaling "llama3" rescales the frequencies first. positions [seq]: each token's position (a
    packed row restarts them per segment); None: 0..seq-1.
    """
    s, hd = x.shape[0], x.shape[-1]
    rd = int(hd * percent)
    inv = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if spec is not None and spec.rope_scaling == "llama3":
        inv = llama3_scaled(inv, spec)
    pos = torch.arange(s, dtype=torch.float32) if positions is None else positions.float()
    ang = torch.outer(pos, inv)[:, None, :]  # [s, 1, rd/2]
    cos, sin = ang.cos(), ang.sin()
    rot, keep = x[..., :rd], x[..., rd:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = rot[..., : rd // 2], rot[..., rd // 2 :]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return torch.cat([out, keep], dim=-1)


def alibi_slopes(n: int) -> torch.Tensor:
    """ALiBi head slopes of Baichuan2-13B (`_get_interleave`): powers of 2**(-8/n), interleaved for non-powers."""

    def power_of_2(m: int) -> List[float]:
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return torch.tensor(power_of_2(n))
    closest = 2 ** math.floor(math.log2(n))
    return torch.tensor(power_of_2(closest) + alibi_slopes(2 * closest).tolist()[0::2][: n - closest])


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor = None, segments=None
) -> torch.Tensor:
    """Causal attention; q [s, nh, hd], k/v [s, ng, hd] (groups repeated); optional ALiBi slopes [nh];
    optional segment ids [s]: a token attends only inside its own segment (a packed row)."""
    s, nh, hd = q.shape
    rep = nh // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    pos = torch.arange(s)
    if slopes is not None:
        scores = scores + slopes[:, None, None] * (pos[None, :] - pos[:, None]).float()
    masked = pos[None, :] > pos[:, None]
    if segments is not None:
        masked = masked | (segments[None, :] != segments[:, None])
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)  # v's head dim may differ (MLA)


def sigmoid_route(logits: torch.Tensor, spec: ModelSpec, bias: torch.Tensor):
    """(weights [s, k], expert indices [s, k]) of megatron-core 0.16's sigmoid router (moe_utils
    topk_routing_with_score_function + group_limited_topk): experts chosen by sigmoid + expert_bias, inside the
    moe_router_group_topk groups whose best topk / group_topk experts score highest; weights are the chosen
    sigmoid scores renormalised (top-k > 1), times moe_router_topk_scaling_factor."""
    k, groups = spec.moe_router_topk, spec.moe_router_num_groups
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    if groups:
        per_group = choice.view(choice.shape[0], groups, -1)
        best = per_group.topk(k // spec.moe_router_group_topk, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(spec.moe_router_group_topk, dim=-1)[1], 1)
        mask = keep[:, :, None].expand_as(per_group).reshape(choice.shape).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    idx = choice.topk(k, dim=-1)[1]
    top = scores.gather(1, idx)
    top = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
    return top * (spec.moe_router_topk_scaling_factor or 1.0), idx


def route(logits: torch.Tensor, spec: ModelSpec, megatron: bool = False):
    """(top-k weights [s, k] in fp32, expert indices [s, k]) of router logits [s, experts].

    HF Qwen3-MoE (modeling_qwen3_moe Qwen3MoeTopKRouter): softmax over the experts in fp32, top-k, divided by their
    sum when norm_topk_prob. Megatron (megatron-core 0.16 moe_utils.topk_routing_with_score_function): top-k of the
    logits then a softmax over those k, or with --moe-router-pre-softmax the softmax over all experts first, then
    top-k; the same numbers by a different route, which is what the logits check compares."""
    k = spec.moe_router_topk
    if megatron and spec.moe_norm_topk_prob:
        top, idx = logits.topk(k, dim=-1)
        return torch.softmax(top.float(), dim=-1), idx
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = probs.topk(k, dim=-1)
    if spec.moe_norm_topk_prob and not megatron:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, idx


def moe_mix(h: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, expert_fn) -> torch.Tensor:
    """sum over each token's chosen experts of weight x expert(token); expert_fn(e, rows) -> outputs of those rows."""
    out = torch.zeros_like(h)
    for e in torch.unique(idx).tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, expert_fn(e, h[rows]) * weights[rows, slot, None].to(h.dtype))
    return out


BLOCK_BYTES = 64 << 20  # an output layer read from disk is multiplied in row blocks of about this size (fp32)


def row_block(piece, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of a tensor, or of one still on disk (a FileSlice: only those rows are read)."""
    if isinstance(piece, torch.Tensor):
        return piece[start:stop]
    if isinstance(piece, FileSlice) and not piece.row_pitch:
        return piece.rows(start, stop).tensor()
    return as_tensor(piece)[start:stop]


def embed(parts: list, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows `ids` of an embedding split by rows over `parts` (vocab-parallel ranks, or one); a part on disk has
    only those rows read."""
    if len(parts) == 1 and isinstance(parts[0], torch.Tensor):
        return parts[0][ids].float()
    per = parts[0].shape[0]
    return torch.cat([row_block(parts[i // per], i % per, i % per + 1) for i in ids.tolist()]).float()


def head_logits(x: torch.Tensor, parts: list, normalize: bool = False) -> torch.Tensor:
    """x @ W.T for an output layer split by rows over `parts`; a part on disk is read and cast to fp32 one row block
    at a time, never whole. normalize: Baichuan2's NormHead (rows scaled to unit length at forward time)."""
    out = []
    for part in parts:
        rows = part.shape[0]
        step = rows if isinstance(part, torch.Tensor) else max(1, BLOCK_BYTES // (4 * max(1, part.shape[-1])))
        for a in range(0, rows, step):
            w = row_block(part, a, min(a + step, rows)).float()
            out.append(x @ (F.normalize(w, dim=-1) if normalize else w).T)
    return torch.cat(out, dim=-1)


def _piece(sd, key: str):
    """sd[key]; where sd streams an HF folder (kit.convert.layerwise.Streamed), the tensor still on disk."""
    return sd.piece(key) if hasattr(sd, "piece") else sd[key]


def _swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


def _pos(q, k, spec: ModelSpec, positions=None):
    if spec.position != "rope":
        return q, k
    return (
        rope(q, spec.rotary_base, spec.rotary_percent, spec.rotary_interleaved, spec, positions),
        rope(k, spec.rotary_base, spec.rotary_percent, spec.rotary_interleaved, spec, positions),
    )


def hf_forward(
    sd: Dict[str, torch.Tensor], spec: ModelSpec, ids: torch.Tensor, positions=None, segments=None
) -> torch.Tensor:
    """Logits [seq, vocab] of an HF-layout Llama / Qwen3 / GLM-4 / ChatGLM3 / Baichuan2 state dict (fp32, one
    sequence; a packed row with its `positions` and `segments` ids [seq] attends inside each segment)."""
    glm = spec.family == "chatglm"
    pre = "transformer.encoder.layers.{i}." if glm else "model.layers.{i}."
    emb_key = "transformer.embedding.word_embeddings.weight" if glm else "model.embed_tokens.weight"
    x = embed([_piece(sd, emb_key)], ids)
    nh, ng, hd = spec.num_heads, spec.num_groups, spec.head_dim
    slopes = alibi_slopes(nh) if spec.position == "alibi" else None
    for i in range(spec.num_layers):
        p = pre.format(i=i)
        h = rms_norm(x, sd[p + "input_layernorm.weight"], spec.norm_eps)
        if glm:  # query_key_value = [Q; K; V] rows (modeling_chatglm.py splits nh*hd, ng*hd, ng*hd)
            qkv = h @ sd[p + "self_attention.query_key_value.weight"].T
            qkv = qkv + sd[p + "self_attention.query_key_value.bias"] if spec.qkv_bias else qkv
            q, k, v = qkv.split([nh * hd, ng * hd, ng * hd], dim=-1)
        elif p + "self_attn.W_pack.weight" in sd:  # Baichuan2: W_pack = [Q; K; V]
            q, k, v = (h @ sd[p + "self_attn.W_pack.weight"].T).chunk(3, dim=-1)
        else:
            q, k, v = (h @ sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
            if spec.qkv_bias:
                q, k, v = (t + sd[p + f"self_attn.{n}_proj.bias"] for t, n in zip((q, k, v), "qkv"))
        q, k = q.reshape(-1, nh, hd), k.reshape(-1, ng, hd)
        if spec.qk_norm:  # Qwen3: RMSNorm over each head's dims, before rotary
            q = rms_norm(q, sd[p + "self_attn.q_norm.weight"], spec.norm_eps)
            k = rms_norm(k, sd[p + "self_attn.k_norm.weight"], spec.norm_eps)
        q, k = _pos(q, k, spec, positions)
        o = attention(q, k, v.reshape(-1, ng, hd), slopes, segments)
        x = x + o @ sd[p + ("self_attention.dense.weight" if glm else "self_attn.o_proj.weight")].T
        h = rms_norm(x, sd[p + "post_attention_layernorm.weight"], spec.norm_eps)
        fused_glu = "mlp.dense_h_to_4h.weight" if glm else "mlp.gate_up_proj.weight"  # [gate; up] (GLM-4)
        if spec.num_experts and spec.is_moe_layer(i):  # Qwen3-MoE sparse block (per-expert disk keys)
            weights, idx = route(h @ sd[p + "mlp.gate.weight"].T, spec)

            def expert(e, rows, p=p):
                pe = p + f"mlp.experts.{e}."
                return _swiglu(rows, *(sd[pe + f"{n}_proj.weight"] for n in ("gate", "up", "down")))

            x = x + moe_mix(h, weights, idx, expert)
        elif p + fused_glu in sd:
            g, u = (h @ sd[p + fused_glu].T).chunk(2, dim=-1)
            x = (
                x
                + (F.silu(g) * u) @ sd[p + ("mlp.dense_4h_to_h.weight" if glm else "mlp.down_proj.weight")].T
            )
        else:
            g, u = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(g) * u) @ sd[p + "mlp.down_proj.weight"].T
    x = rms_norm(
        x, sd["transformer.encoder.final_layernorm.weight" if glm else "model.norm.weight"], spec.norm_eps
    )
    head_key = "transformer.output_layer.weight" if glm else "lm_head.weight"
    return head_logits(x, [_piece(sd, head_key if head_key in sd else emb_key)], spec.norm_head)


def _expert_parts(mr: MegatronReader, stages, role: str, layer: int, spec: ModelSpec) -> List[torch.Tensor]:
    """The TP ranks' fp32 parts of global expert role `role` (found on its EP rank, in any experts' layout)."""
    from kit.convert.file_slices import as_tensor
    from kit.convert.megatron_source import role_pieces

    return [as_tensor(p).float() for p in role_pieces(mr, stages, role, layer, spec)[3]]


def _tp_mlp(h: torch.Tensor, fc1: List[torch.Tensor], fc2: List[torch.Tensor]) -> torch.Tensor:
    """A SwiGLU MLP from its TP ranks' fc1 / fc2: mcore chunks each rank's fc1 output into (gate, up), and the
    row-parallel fc2 outputs are summed (the all-reduce)."""
    out = 0
    for a, b in zip(fc1, fc2):
        g, u = (h @ a.T).chunk(2, dim=-1)
        out = out + (F.silu(g) * u) @ b.T
    return out


def _expert(
    mr: MegatronReader, stages, spec: ModelSpec, e: int, layer: int, rows: torch.Tensor
) -> torch.Tensor:
    """Global expert e of a layer on `rows`: found on its EP rank e // per as local expert e % per, split over TP."""
    fc1, fc2 = (
        _expert_parts(mr, stages, expert_role(e, n), layer, spec) for n in ("fc1.weight", "fc2.weight")
    )
    return _tp_mlp(rows, fc1, fc2)


def _mlp(h: torch.Tensor, w, spec: ModelSpec, moe: bool, expert) -> torch.Tensor:
    """A layer's MLP output: the dense one, or the MoE block (router replicated; shared experts split over TP)."""
    if not moe:
        return _tp_mlp(h, w("fc1.weight"), w("fc2.weight"))
    logits = h @ w("router.weight")[0].T
    if spec.moe_router_score_function == "sigmoid":
        weights, idx = sigmoid_route(logits, spec, w("router.expert_bias")[0])
    else:
        weights, idx = route(logits, spec, megatron=True)
    out = moe_mix(h, weights, idx, expert)
    if spec.moe_shared_expert_intermediate_size:
        out = out + _tp_mlp(h, w("shared.fc1.weight"), w("shared.fc2.weight"))
    return out


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope(x: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """RoPE of MLA's rope dims x [seq, heads, d] in interleaved pairs; with YaRN (megatron-core
    yarn_rotary_pos_embedding.py, the published formulas) the frequencies blend interpolation and extrapolation over
    a linear ramp between the beta_fast / beta_slow correction dims, and cos / sin carry mscale / mscale_all_dim."""
    d, base = x.shape[-1], spec.rotary_base
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scale = 1.0
    if spec.rope_scaling == "yarn":
        f, orig = spec.rope_scaling_factor, spec.original_max_position_embeddings

        def dim_of(rot: float) -> float:
            return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(dim_of(spec.yarn_beta_fast)), 0)
        high = min(math.ceil(dim_of(spec.yarn_beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv = inv / f * ramp + inv * (1 - ramp)
        scale = _yarn_mscale(f, spec.yarn_mscale) / _yarn_mscale(f, spec.yarn_mscale_all_dim)
    ang = torch.outer(torch.arange(x.shape[0], dtype=torch.float32), inv)[:, None, :]
    cos, sin = ang.cos() * scale, ang.sin() * scale
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def mla_attention(h: torch.Tensor, w, spec: ModelSpec) -> torch.Tensor:
    """Multi-head latent attention with megatron-core 0.16's local-spec TP: the column-parallel down projections'
    outputs gathered (the ranks' rows concatenated), each rank's heads from its rows of the up projections, the
    row-parallel output projection summed. RoPE on the qk_pos_emb_head_dim dims in interleaved pairs (megatron-core
    reorders them even-then-odd and rotates halves: the same pairs, so the same scores)."""
    nope, rd, vd = spec.qk_head_dim, spec.qk_pos_emb_head_dim, spec.v_head_dim
    if spec.q_lora_rank:
        q_c = rms_norm(h @ torch.cat(w("mla.q_down")).T, w("mla.q_norm")[0], spec.norm_eps)
        q_up = w("mla.q_up")
    else:
        q_c, q_up = h, w("mla.q")
    kv = h @ torch.cat(w("mla.kv_down")).T
    kv_c = rms_norm(kv[:, : spec.kv_lora_rank], w("mla.kv_norm")[0], spec.norm_eps)
    k_pe = mla_rope(kv[:, None, spec.kv_lora_rank :], spec)
    # YaRN scales the softmax too: mscale(factor, mscale_all_dim) squared (1 for plain RoPE), here on q
    soft = (
        _yarn_mscale(spec.rope_scaling_factor, spec.yarn_mscale_all_dim) ** 2
        if spec.rope_scaling == "yarn"
        else 1.0
    )
    out = 0
    for q_w, kv_w, proj in zip(q_up, w("mla.kv_up"), w("proj.weight")):
        q = (q_c @ q_w.T).reshape(h.shape[0], -1, nope + rd)
        kvr = (kv_c @ kv_w.T).reshape(h.shape[0], -1, nope + vd)
        q = torch.cat([q[..., :nope], mla_rope(q[..., nope:], spec)], -1) * soft
        k = torch.cat([kvr[..., :nope], k_pe.expand(-1, q.shape[1], -1)], -1)
        out = out + attention(q, k, kvr[..., nope:]) @ proj.T
    return out


def _tp_attention(h: torch.Tensor, w, spec: ModelSpec, tp: int, slopes) -> torch.Tensor:
    """A layer's attention with Megatron's fused QKV split over `tp` ranks (each rank: its query groups, its slice of
    the output projection); its weights are freed on return, before the MLP's are read."""
    gp, hpg, hd = spec.num_groups // tp, spec.heads_per_group, spec.head_dim
    qkv_w, proj = w("qkv.weight"), w("proj.weight")
    qkv_b = w("qkv.bias") if spec.qkv_bias else [0] * tp
    out = 0
    mixed_all = [h @ qkv_w[r].T + qkv_b[r] for r in range(tp)]
    nq = spec.num_heads // tp
    for r in range(tp):
        if gp:
            mixed = mixed_all[r].reshape(-1, gp, hpg + 2, hd)
            q, k, v = (
                mixed[:, :, :hpg].reshape(-1, gp * hpg, hd),
                mixed[:, :, hpg],
                mixed[:, :, hpg + 1],
            )
        else:  # fewer groups than ranks: all-gather, take this rank's group, then its share of q heads
            per = tp // spec.num_groups
            grp = torch.cat(mixed_all, -1).reshape(-1, spec.num_groups, hpg + 2, hd)[:, r // per]
            q = grp[:, (r % per) * nq : (r % per + 1) * nq]
            k, v = grp[:, hpg : hpg + 1], grp[:, hpg + 1 : hpg + 2]
        if spec.qk_norm:  # mcore q_layernorm / k_layernorm: per head, before rotary
            q = rms_norm(q, w("q_norm")[0], spec.norm_eps)
            k = rms_norm(k, w("k_norm")[0], spec.norm_eps)
        q, k = _pos(q, k, spec)
        sl = slopes[r * nq : (r + 1) * nq] if slopes is not None else None
        out = out + attention(q, k, v, sl) @ proj[r].T
    return out


def megatron_forward(mr: MegatronReader, spec: ModelSpec, ids: torch.Tensor) -> torch.Tensor:
    """Logits [seq, vocab] from Megatron rank files with Megatron semantics and TP simulated rank by rank."""
    tp, fl = mr.tp, mr.flavor
    stages = stage_layers(spec.num_layers, mr.pp, mr.layer_list(spec.num_layers))
    # vocab-parallel embedding: each id's row from the rank holding it (the all-reduce adds zeros from the others)
    x = embed(mr.pieces(layout.key_path(fl, "embedding"), 0), ids)
    slopes = alibi_slopes(spec.num_heads) if spec.position == "alibi" else None
    for s, layers in enumerate(stages):
        for li, g_layer in enumerate(layers):
            moe = spec.num_experts and spec.is_moe_layer(g_layer)

            def w(role, s=s, li=li, moe=moe):
                return [t.float() for t in mr.parts(layout.key_path(fl, role, li, moe), s)]

            h = rms_norm(x, w("input_norm")[0], spec.norm_eps)
            if spec.multi_latent_attention:
                x = x + mla_attention(h, w, spec)
            else:
                x = x + _tp_attention(h, w, spec, tp, slopes)
            h = rms_norm(x, w("post_norm")[0], spec.norm_eps)
            x = x + _mlp(h, w, spec, moe, lambda e, rows, g=g_layer: _expert(mr, stages, spec, e, g, rows))
            give_back_freed()  # this layer's weights
    last = mr.pp - 1
    x = rms_norm(x, mr.parts(layout.key_path(fl, "final_norm"), last)[0].float(), spec.norm_eps)
    role = "output" if not spec.tied else "tied_head" if mr.pp > 1 else "embedding"
    return head_logits(x, mr.pieces(layout.key_path(fl, role), last))[:, : spec.vocab_size]
