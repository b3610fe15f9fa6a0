"""DeepSeek-V3 / GLM-4.5 MoE (sigmoid routing with the score-correction bias, grouped top-k, shared experts):
kit.ops.moe and kit.adapt.moe against HF's blocks (transformers >= 5), on torch and on the torch_npu stand-in."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from fixtures.convert import routed_moe
from npu_standin import install
from test_moe import _called, _run, run_kit_and_hf  # the Qwen3-MoE block tests' helpers

from kit.ops import moe as kit_moe
from kit.ops import use_backend

routed_moe.skip_module_without_the_families()

FAMILIES = ("deepseek_v3", "glm4_moe")
DIFFS: dict = {}  # the largest difference each equality test measured (printed with -s)


def tiny_config(family: str, **overrides):
    """A tiny DeepseekV3Config / Glm4MoeConfig: 16 experts in 4 groups, 2 groups kept, top-4, one shared expert."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config

        # MLA: q/k heads of 8 + 4 = 12 channels, value heads of 6
        extra = dict(
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            num_key_value_heads=4,
        )  # fmt: skip
    else:
        from transformers import Glm4MoeConfig as Config

        extra = dict(head_dim=8, num_key_value_heads=2)
    args = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
        pad_token_id=0,
        **extra,
    )
    args.update(overrides)
    config = Config(**args)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # the reference: HF's per-expert loop
    return config


def _modeling(family: str):
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

        return modeling, modeling.DeepseekV3MoE
    from transformers.models.glm4_moe import modeling_glm4_moe as modeling

    return modeling, modeling.Glm4MoeMoE


def hf_block(family: str, seed: int = 0, **overrides):
    """HF's MoE block with random weights and a random score-correction bias (so the bias changes the choice)."""
    _, cls = _modeling(family)
    block = cls(tiny_config(family, **overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        block.gate.e_score_correction_bias.copy_(torch.rand(16, generator=gen) * 0.5)
    return block


def kit_block(block):
    from kit.adapt.moe import is_moe_block, moe_block_forward, prepare_block

    assert is_moe_block(block)
    out = copy.deepcopy(block)
    prepare_block(out)
    out.forward = types.MethodType(moe_block_forward, out)
    return out


def _max_diff(pairs) -> float:
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)


def test_sigmoid_routing_selects_with_the_bias_and_weighs_without_it():
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5, -0.5]])
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # expert 0 wins the choice through the bias alone
    w, idx = kit_moe.moe_route_sigmoid(logits, 2, bias, norm_topk_prob=False, routed_scaling_factor=2.0)
    assert sorted(idx[0].tolist()) == [0, 3]
    by_expert = dict(zip(idx[0].tolist(), w[0].tolist()))
    assert by_expert[0] == pytest.approx(2.0 * 0.5) and by_expert[3] == pytest.approx(
        2.0 * float(torch.sigmoid(torch.tensor(2.0)))
    )
    # groups of 3, one kept: the group {3, 4, 5} (top-2 sum 0.88 + 0.62) beats {0, 1, 2} (0.73 + 0.5) without bias
    w, idx = kit_moe.moe_route_sigmoid(logits, 2, torch.zeros(6), n_group=2, topk_group=1)
    assert sorted(idx[0].tolist()) == [3, 4] and float(w.sum()) == pytest.approx(1.0)


@pytest.mark.parametrize("backend", ["torch", "torch-loop", "npu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_kit_block_equals_hf_outputs_gradients_and_router_logits(family, backend, monkeypatch):
    block = hf_block(family)
    kit = kit_block(block)
    got, want, x = run_kit_and_hf(kit, block, backend, monkeypatch)
    assert got[3].keys() == want[3].keys() and "shared_experts.gate_proj.weight" in want[3]
    pairs = list(zip(got[:3], want[:3])) + [(got[3][n], want[3][n]) for n in want[3]]
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    DIFFS[f"block {family} {backend}"] = _max_diff(pairs)
    for op in ("npu_moe_token_permute", "npu_grouped_matmul", "npu_swiglu", "npu_moe_token_unpermute"):
        assert _called(op) == (backend == "npu"), op
    assert not _called("npu_moe_gating_top_k")  # training keeps torch's routing: the router learns
    if backend == "npu":
        with use_backend("npu"), torch.no_grad():
            got_eval = kit(x)
            torch.testing.assert_close(got_eval, block(x), atol=1e-5, rtol=1e-5)
            DIFFS[f"block {family} npu inference"] = _max_diff([(got_eval, block(x))])
        assert _called("npu_moe_gating_top_k")  # inference: sigmoid + bias + groups in one kernel


@pytest.mark.parametrize("backend", ["torch", "npu"])
def test_bf16_block_within_bf16_rounding_of_hf(backend, monkeypatch):
    """A bf16 block (the router stays fp32 as transformers keeps it): kit within bf16 rounding of HF's."""
    block = hf_block("deepseek_v3")
    block.experts.bfloat16(), block.shared_experts.bfloat16()
    kit = kit_block(block)
    gen = torch.Generator().manual_seed(2)
    x, grad = (
        torch.randn(1, 64, 64, generator=gen).bfloat16(),
        torch.randn(1, 64, 64, generator=gen).bfloat16(),
    )
    want = _run(block, x, grad)
    if backend == "npu":
        install(monkeypatch)
    with use_backend(backend):
        got = _run(kit, x, grad)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)  # fp32 router logits
    pairs = [(got[0], want[0]), (got[2], want[2])] + [(got[3][n], want[3][n]) for n in want[3]]
    pairs = [(a.detach(), b.detach()) for a, b in pairs]
    worst = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in pairs)
    assert worst < 2e-2
    DIFFS[f"block deepseek_v3 bf16 {backend} (relative to the largest value)"] = worst


def test_gating_kernel_only_within_its_documented_limits(monkeypatch):
    fake = install(monkeypatch)
    logits, bias = torch.randn(5, 16), torch.rand(16)
    with use_backend("npu"), torch.no_grad():
        for kwargs, kernel in [
            (dict(n_group=4, topk_group=2), True),
            (dict(n_group=8, topk_group=2), False),  # 2 experts per group: the kernel wants > 2
            (dict(n_group=4, topk_group=2, norm_topk_prob=False), False),  # its eps renormalises always
        ]:
            fake.CALLS.clear()
            want = kit_moe.moe_route_sigmoid(logits, 4, bias, backend="torch", **kwargs)
            got = kit_moe.moe_route_sigmoid(logits, 4, bias, **kwargs)
            assert _called("npu_moe_gating_top_k") == kernel, kwargs
            order_w, order_g = want[1].argsort(-1), got[1].argsort(-1)
            assert torch.equal(want[1].gather(1, order_w), got[1].gather(1, order_g))
            torch.testing.assert_close(want[0].gather(1, order_w), got[0].gather(1, order_g))
    with pytest.raises(fake.StandinError, match="must be > 2"):
        fake.npu_moe_gating_top_k(logits, 4, bias=bias, k_group=2, group_count=8, norm_type=1)
    with pytest.raises(fake.StandinError, match="bias dtype"):
        fake.npu_moe_gating_top_k(logits, 4, bias=bias.half(), k_group=2, group_count=4, norm_type=1)
    with pytest.raises(TypeError):  # everything after k is keyword-only ("*" in its section)
        fake.npu_moe_gating_top_k(logits, 4, bias)


def test_report_measured_differences():
    """Runs last in file order: prints what the equality tests measured (pytest -s)."""
    for name, value in DIFFS.items():
        print(f"{name}: max |kit - hf| = {value:.3e}")
