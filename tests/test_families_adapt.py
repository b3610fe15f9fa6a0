"""kit.adapt on Qwen3 (q/k norms before rotary, head_dim != hidden/heads, tied), GLM-4 (fused gate_up MLP, partial
interleaved rotary) and Llama-3.1 (llama3 rope scaling): same logits and gradients as transformers' eager model,
packed dialogs kept apart."""

from __future__ import annotations

import copy

import pytest
import torch
from fixtures.convert import families as fam_models

from kit.adapt import adapt_model
from kit.system.hf_compat import dtype_kw

FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "glm4": ("glm", dict(head_dim=16, partial_rotary_factor=0.5)),
    "llama31": ("llama", dict(rope_scaling=dict(fam_models.LLAMA31_ROPE), max_position_embeddings=131072)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    from transformers import AutoConfig, AutoModelForCausalLM

    from kit.adapt.attention import has_registry

    model_type, extra = FAMILIES[request.param]
    fam_models.require(model_type)
    if model_type == "glm" and not has_registry():
        pytest.skip(
            "GLM-4 is adapted through transformers' AttentionInterface (no flash-attention-2 mapping)"
        )
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, **dtype_kw(torch.float32)).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a misplaced weight
        for name, p in base.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn_like(p) * 0.1)
    adapted = copy.deepcopy(base)
    return request.param, base, adapted, adapt_model(adapted)


def test_report_names_what_was_swapped(pair):
    name, _, _, report = pair
    assert report.attention == "kit" and report.attention_modules == 2 and report.mlps == 2
    # RMSNorms: 2 per layer + final; Qwen3 adds q_norm and k_norm per layer
    assert report.rms_norms == (9 if name == "qwen3" else 5)
    assert report.skipped == [] and len(report.rotary) == 1
    if name == "glm4":  # half-dim interleaved pairs: npu_rotary_mul's interleave mode on the first half
        assert report.rotary[0].endswith("modeling_glm")


def test_same_logits_and_gradients(pair):
    _, base, adapted, _ = pair
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    for model in (base, adapted):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(adapted(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in base.named_parameters()}
    for n, p in adapted.named_parameters():
        if n.endswith("gate_up_proj.weight") and n not in grads:  # Llama/Qwen: merged at adaptation
            prefix = n[: -len("gate_up_proj.weight")]
            got = torch.cat([grads[prefix + "gate_proj.weight"], grads[prefix + "up_proj.weight"]])
            torch.testing.assert_close(p.grad, got, rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_rows_attend_within_each_dialog(pair):
    _, base, adapted, _ = pair
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        packed = adapted(ids, position_ids=pos).logits
        for start, end in [(0, 5), (5, 12)]:
            torch.testing.assert_close(
                packed[:, start:end], base(ids[:, start:end]).logits, rtol=1e-5, atol=1e-5
            )


def test_npu_branch_under_standin(pair, monkeypatch):
    """With the strict torch_npu stand-in: each family's swaps reach the NPU calls (GLM-4's rotary as
    npu_rotary_mul's interleave mode on the first half of each head) and packed dialogs still match."""
    from npu_standin import install

    from kit.adapt import hf
    from kit.ops import use_backend

    name, base, _, _ = pair
    fake = install(monkeypatch)
    monkeypatch.setattr(hf, "_allocate", lambda device: torch.device("cpu"))  # no NPU memory on CPU
    adapted = copy.deepcopy(base)
    ids = torch.randint(3, 200, (1, 10), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    with use_backend("npu"):
        report = adapt_model(adapted)
        fake.CALLS.clear()
        with torch.no_grad():
            logits = adapted(input_ids=ids, position_ids=pos).logits
    assert report.backend == "npu" and report.skipped == []
    calls = {n for n, _ in fake.CALLS}
    assert {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= calls
    modes = {a.get("rotary_mode", "half") for n, a in fake.CALLS if n == "npu_rotary_mul"}
    assert modes == ({"interleave"} if name == "glm4" else {"half"})
    for start, end in [(0, 6), (6, 10)]:
        with torch.no_grad():
            alone = base(input_ids=ids[:, start:end]).logits[0]
        torch.testing.assert_close(logits[0, start:end], alone, rtol=1e-5, atol=1e-5)
