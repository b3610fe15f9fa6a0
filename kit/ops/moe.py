"""Mixture-of-experts routing and expert compute (Qwen3-MoE, DeepSeek-V3, GLM-4.5): torch_npu's MoE kernels on NPU,
sorted torch elsewhere.

`moe_route` is softmax -> top-k -> optional renormalisation (HF's Qwen3MoeTopKRouter); `moe_route_sigmoid` is
DeepSeek-V3's sigmoid routing with the score-correction bias and grouped top-k (HF's DeepseekV3TopkRouter and
Glm4MoeTopkRouter, which are the same code); `moe_experts` runs every (token, expert) pair through its expert's
SwiGLU MLP and sums the k outputs with the routing weights (HF's Qwen3MoeExperts; DeepSeek-V3's and GLM-4.5's
fused experts are the same). Portable path: the N*k pairs are sorted by expert once (one gather in, one weighted
sum out), then torch's grouped matmul runs each projection for all experts in one kernel where torch has one
(>= 2.9), else each expert runs two matmuls on its contiguous slice (HF's eager loop does a `where` and an
`index_add_` per expert). NPU path (tensors on npu, or `use_backend("npu")`): `npu_moe_token_permute` -> `npu_grouped_matmul` ->
`npu_swiglu` -> `npu_grouped_matmul` -> `npu_moe_token_unpermute`, all trainable (see `_GroupedMatmul`).
Rules quoted per call come from torch_npu 2.13.0 `_op_plugin_docs.py` (the section of the op named there).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from kit.ops import fused as kit_fused
from kit.ops.backend import resolve, torch_npu_module

# npu_moe_gating_top_k_softmax: "k<=1024"; npu_moe_token_permute / unpermute: "topK<=512" (A2/A3);
# npu_grouped_matmul (group_type 0, one weight tensor): "group_list第1维最大支持1024", inner dims < 65536.
MAX_GATING_K, MAX_PERMUTE_K, MAX_GROUPS, INNER_LIMIT = 1024, 512, 1024, 65536
MAX_INDEX = 16777215  # npu_moe_token_permute: indices "元素个数小于16777215"
MAX_GATING_EXPERTS = 2048  # npu_moe_gating_top_k: x's last dim "要求不大于2048"


def moe_route(logits, top_k: int, norm_topk_prob: bool = True, backend: Optional[str] = None):
    """(weights, indices) of the top_k experts per row of `logits` [N, E]: softmax in fp32, top-k, renormalised
    when `norm_topk_prob`; weights in the logits' dtype, indices int64 (HF Qwen3MoeTopKRouter, same numbers).

    NPU (`npu_moe_gating_top_k_softmax`, softmax + top-k in one kernel) only where no gradient is needed: its
    section says "该接口支持推理场景下使用" (inference) and torch_npu 2.13.0 registers no backward for it; training
    keeps torch's softmax/topk (which run on the NPU too) so the router learns.
    """
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if (
        resolve(logits, backend) == "npu"
        and not needs_grad
        and logits.dim() == 2
        and 0 < top_k <= min(logits.shape[-1], MAX_GATING_K)
    ):
        weights, indices, _rows = torch_npu_module().npu_moe_gating_top_k_softmax(
            logits.float(), None, k=int(top_k)
        )
        indices = indices.long()
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), indices


def moe_route_sigmoid(
    logits,
    top_k: int,
    bias,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    backend: Optional[str] = None,
):
    """(weights, indices) of DeepSeek-V3 routing over `logits` [N, E], in fp32 as HF computes them.

    scores = sigmoid(logits); the experts are chosen on scores + `bias` (the score-correction bias [E], which
    only selects): each of `n_group` equal groups is scored by the sum of its two best biased scores, the
    `topk_group` best groups stay, and the top_k experts among them are taken; the weights are the unbiased scores
    of those experts, divided by their sum (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`
    (transformers 5.25 DeepseekV3TopkRouter.forward, Glm4MoeTopkRouter the same).

    NPU (`npu_moe_gating_top_k`: sigmoid + bias + group top-k in one kernel) only where no gradient is needed and
    its limits hold: its section says "该接口支持推理场景下使用" (inference; training keeps torch so the router
    learns), norm_type=1 is sigmoid, group_select_mode=1 is "取组内Top2的专家进行得分累加" (HF's group score), and
    its eps renormalises always (so only with `norm_topk_prob`); bias "数据类型需要与x保持一致" (both fp32 here).
    """
    logits = logits.float()
    bias = bias.to(device=logits.device, dtype=torch.float32)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if (
        resolve(logits, backend) == "npu"
        and not needs_grad
        and norm_topk_prob
        and _gating_fits(logits, top_k, n_group, topk_group)
    ):
        weights, indices, _scores = torch_npu_module().npu_moe_gating_top_k(
            logits,
            int(top_k),
            bias=bias,
            k_group=int(topk_group),
            group_count=int(n_group),
            group_select_mode=1,
            renorm=0,
            norm_type=1,
            out_flag=False,
            routed_scaling_factor=float(routed_scaling_factor),
            eps=1e-20,
        )
        return weights, indices.long()
    scores = logits.sigmoid()
    choice = scores + bias
    n, experts = choice.shape
    if n_group > 1:
        groups = choice.view(n, n_group, experts // n_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(experts // n_group, dim=1), float("-inf"))
    indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, indices


def _gating_fits(logits, top_k: int, n_group: int, topk_group: int) -> bool:
    """npu_moe_gating_top_k's documented limits: E <= 2048; group_count divides E with a quotient > 2 whose
    32-aligned value times group_count is <= 2048; 1 <= k_group <= group_count; 1 <= k <= E / group_count * k_group."""
    if logits.dim() != 2 or n_group < 1:
        return False
    experts = logits.shape[-1]
    per_group = experts // n_group
    return (
        experts <= MAX_GATING_EXPERTS
        and experts % n_group == 0
        and per_group > 2
        and -(-per_group // 32) * 32 * n_group <= MAX_GATING_EXPERTS
        and 1 <= topk_group <= n_group
        and 1 <= top_k <= per_group * topk_group
    )


def _sort_by_expert(indices, num_experts: int):
    """(order, counts): the N*k (token, slot) pairs sorted by expert (stable), and tokens per expert (host ints)."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync: slice sizes
    return order, counts


def _combine(expert_out, order, weights):
    """Back to (token, slot) order, times the routing weights, summed over the k slots -> [N, H].

    A gather by the inverse permutation (measured faster on CPU, forward + backward, than an index_copy by
    `order` or an index_add by token), then a sum over k: deterministic on every device."""
    n, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    slots = expert_out.index_select(0, inverse)
    return (slots.view(n, k, -1) * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)


def moe_experts(x, indices, weights, gate_up, down, backend: Optional[str] = None):
    """sum_j weights[:, j] * down_e(silu(gate_e x) * up_e x) with e = indices[:, j]: HF Qwen3MoeExperts' result.

    x [N, H]; indices/weights [N, k]; gate_up [E, 2I, H] (gate rows first) and down [E, H, I], HF's fused
    expert parameters (transformers >= 5), used in place (no copy). Returns [N, H] in x's dtype.
    """
    num_experts = gate_up.shape[0]
    if resolve(x, backend) == "npu" and _npu_fits(x, indices, gate_up, down):
        return _npu_experts(x, indices, weights, gate_up, down)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    permuted = x.index_select(0, order // indices.shape[1])
    if _grouped_mm(permuted, gate_up) is not None and _grouped_mm(permuted, down) is not None:
        # one kernel per projection over all experts; offsets = the end row of each expert's slice
        # (counted by scatter_add, not bincount: the same counts in a shape known without the data, so the
        # planner's fake-tensor trace (kit.plan) runs this path too)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = _grouped_mm(permuted, gate_up)(permuted, gate_up.transpose(1, 2), offs=offs)
        h = kit_fused.swiglu(h, dim=-1, backend="torch")
        out = _grouped_mm(h, down)(h, down.transpose(1, 2), offs=offs)
    else:
        counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync: slice sizes
        outs = []
        for e, rows in enumerate(permuted.split(counts)):
            if rows.shape[0]:
                h = F.linear(rows, gate_up[e])
                outs.append(F.linear(kit_fused.swiglu(h, dim=-1, backend="torch"), down[e]))
        out = torch.cat(outs) if outs else permuted.new_zeros(0, down.shape[1])
    return _combine(out, order, weights).to(x.dtype)


_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _grouped_mm(x, weight):
    """torch's grouped matmul where it has a kernel for these tensors, else None (then one matmul per expert).

    torch >= 2.9 has CPU and CUDA (sm80+) kernels (`torch._grouped_mm`, `F.grouped_mm` from 2.10); on CPU up to
    2.10 they need 16-byte aligned data, which memory-mapped weights may lack (as transformers' MoE integration
    notes). Measured faster than the per-expert loop on CPU (benchmarks/bench_ops.py).
    """
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None or _TORCH < (2, 9) or x.dtype != weight.dtype:
        return None
    if x.device.type == "cpu":
        aligned = x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
        return fn if _TORCH >= (2, 11) or aligned else None
    # CUDA: sm80+, and bf16 only (the dtype torch's CUDA grouped matmul was introduced for; not run here)
    if x.device.type == "cuda" and x.dtype == torch.bfloat16:
        return fn if torch.cuda.get_device_capability(x.device) >= (8, 0) else None
    return None


def moe_expert_modules(x, indices, weights, experts: Sequence) -> torch.Tensor:
    """The same with one MLP module per expert (transformers 4.51-4.57 `nn.ModuleList` of Qwen3MoeMLP).

    Portable on every device: stacking the per-expert weights for a grouped matmul would copy them every call.
    """
    order, counts = _sort_by_expert(indices, len(experts))
    permuted = x.index_select(0, order // indices.shape[1])
    outs = [experts[e](rows) for e, rows in enumerate(permuted.split(counts)) if rows.shape[0]]
    out = torch.cat(outs) if outs else permuted.new_zeros(0, x.shape[-1])
    return _combine(out, order, weights).to(x.dtype)


# ---- NPU path ---------------------------------------------------------------------------------------------------
def _npu_fits(x, indices, gate_up, down) -> bool:
    """The documented limits of the kernels the NPU path calls; outside them the portable path runs."""
    n, k = indices.shape
    e, two_i, h = gate_up.shape
    return (
        x.dim() == 2
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and gate_up.dtype == down.dtype == x.dtype  # npu_grouped_matmul: x and weight of one dtype
        and k <= MAX_PERMUTE_K
        and n * k < MAX_INDEX
        and e <= MAX_GROUPS
        and max(h, two_i, down.shape[2]) < INNER_LIMIT
    )


def _gmm(x, weight, group_list):
    """npu_grouped_matmul, "单单单" form: x [M, K] (not transposed) times weight[e] [K, N] per group of rows.

    Section npu_grouped_matmul, group_list as a Tensor: group_type=0 (m-axis) needs split_item 2 or 3, a 3-D
    weight (a transposed view is allowed: "支持weight转置"), group_list int64; group_list_type=1 means per-group
    sizes summing to M.
    """
    return torch_npu_module().npu_grouped_matmul(
        [x], [weight], group_list=group_list, split_item=3, group_type=0, group_list_type=1
    )[0]


class _GroupedMatmul(torch.autograd.Function):
    """y = x @ weight[e] for each expert's rows. torch_npu 2.13.0 has no backward for npu_grouped_matmul (its
    section says inference; libtorch_npu registers no GroupedMatmul backward), so the gradients are kernels too:
    dx = grouped matmul with the transposed weights; dweight (fp16/bf16) = `npu_grouped_matmul_add_` (K-axis
    groups, "x必须转置", self float32, x/weight fp16 or bf16 only); fp32 dweight is one mm per expert."""

    @staticmethod
    def forward(ctx, x, weight, group_list, counts):
        ctx.save_for_backward(x, weight, group_list)
        ctx.counts = counts
        return _gmm(x, weight, group_list)

    @staticmethod
    def backward(ctx, grad):
        x, weight, group_list = ctx.saved_tensors
        grad = grad.contiguous()
        dx = _gmm(grad, weight.transpose(1, 2), group_list)
        if x.dtype in (torch.float16, torch.bfloat16):
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
            torch_npu_module().npu_grouped_matmul_add_(
                acc,
                x,
                grad,
                group_list,
                transpose_x=True,
                transpose_weight=False,
                group_type=2,
                group_list_type=1,
            )
            dweight = acc.to(weight.dtype)
        else:
            parts = zip(x.split(ctx.counts), grad.split(ctx.counts))
            dweight = torch.stack([xs.t() @ gs for xs, gs in parts])
        return dx, dweight, None, None


def _npu_experts(x, indices, weights, gate_up, down):
    npu = torch_npu_module()
    # npu_moe_token_permute (second, current section): tokens 2-D fp16/bf16/fp32, indices int64 [N, topK];
    # sorted_indices[i] is where pair i (token i // topK) sits in the expert-sorted permuted_tokens
    permuted, sorted_indices = npu.npu_moe_token_permute(x, indices, num_out_tokens=None, padded_mode=False)
    counts_t = torch.bincount(indices.reshape(-1), minlength=gate_up.shape[0])
    counts = counts_t.tolist()
    hidden = _GroupedMatmul.apply(permuted, gate_up.transpose(1, 2), counts_t, counts)
    hidden = kit_fused.swiglu(hidden, dim=-1, backend="npu")
    out = _GroupedMatmul.apply(hidden, down.transpose(1, 2), counts_t, counts)
    # npu_moe_token_unpermute: probs [N, topK] multiply the rows before the k-sum; padded_mode False only
    return npu.npu_moe_token_unpermute(out, sorted_indices, probs=weights.to(out.dtype), padded_mode=False)
