"""kit.adapt on tiny DeepSeek-V3 (MLA attention: value heads narrower than query/key heads; sigmoid-routed MoE
with shared experts) and GLM-4.5 (glm4_moe): same logits, router logits and gradients as transformers' eager model,
on torch and on the torch_npu stand-in; padded and packed batches."""

from __future__ import annotations

import copy

import pytest
import test_train_helpers as H
import torch
from fixtures.convert import routed_moe
from npu_standin import install
from npu_standin import ops as standin_ops
from test_moe_sigmoid import DIFFS, tiny_config

from kit.adapt import adapt_model
from kit.ops import use_backend

routed_moe.skip_module_without_the_families()

VARIANTS = {  # name: (family, config overrides)
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-no-q-lora-half-rope": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
    "glm4_moe": ("glm4_moe", {}),
    # Glm4MoeConfig's options: q/k/v biases, q/k norms
    "glm4_moe-bias-qk-norm": ("glm4_moe", dict(attention_bias=True, use_qk_norm=True)),
}


def tiny_model(family: str, seed: int = 0, **overrides):
    """The tiny causal LM with random weights, random norms and a random score-correction bias (eager attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith(("gate_up_proj", "down_proj", "gate.weight")):
                p.normal_(0.0, 0.2, generator=gen)  # HF initialises experts at 0.02: routing would be a tie
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request):
    family, overrides = VARIANTS[request.param]
    base = tiny_model(family, **overrides)
    adapted = copy.deepcopy(base)
    return request.param, base, adapted, adapt_model(adapted)


def test_report_adapts_attention_and_every_moe_block(pair):
    name, base, adapted, report = pair
    assert report.attention == "kit" and report.attention_modules == 2 and report.skipped == []
    assert report.moe_blocks == 1  # layer 0 is dense (first_k_dense_replace=1)
    assert report.mlps == 2  # layer 0's MLP and layer 1's shared experts
    assert type(adapted.model.layers[1].mlp).__name__ in ("DeepseekV3MoE", "Glm4MoeMoE")


def _forward_backward(model, batch, labels):
    model.zero_grad()
    out = model(**batch, labels=labels, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _merged_grads(grads: dict) -> dict:
    """Base-model gradients in the adapted layout: gate_proj/up_proj merged into one gate_up_proj."""
    out = dict(grads)
    for name in list(grads):
        if name.endswith("gate_proj.weight"):
            prefix = name[: -len("gate_proj.weight")]
            out[prefix + "gate_up_proj.weight"] = torch.cat(
                [out.pop(name), out.pop(prefix + "up_proj.weight")]
            )
    return out


BATCHES = {
    "full": dict(attention_mask=None),
    "padded": dict(attention_mask=torch.tensor([[1] * 12, [1] * 8 + [0] * 4])),
}


@pytest.mark.parametrize("batch_name", sorted(BATCHES))
@pytest.mark.parametrize("backend", ["torch", "npu"])
def test_same_logits_router_logits_and_gradients(pair, backend, batch_name, monkeypatch):
    name, base, adapted, _ = pair
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids)
    if BATCHES[batch_name]["attention_mask"] is not None:
        batch["attention_mask"] = BATCHES[batch_name]["attention_mask"]
    keep = batch.get("attention_mask", torch.ones_like(ids)).bool()
    labels = ids.masked_fill(~keep, -100)  # padding: no target (kit attention gives padded rows 0, eager not)
    want, want_grads = _forward_backward(base, batch, labels)
    if backend == "npu":
        install(monkeypatch)
    with use_backend(backend):
        got, got_grads = _forward_backward(adapted, batch, labels)
    pairs = [(got.logits[keep], want.logits[keep]), (got.loss, want.loss)]
    assert len(got.router_logits) == len(want.router_logits) == 1
    pairs += [
        (a[keep.reshape(-1)], b[keep.reshape(-1)]) for a, b in zip(got.router_logits, want.router_logits)
    ]
    want_grads = _merged_grads(want_grads)
    assert got_grads.keys() == want_grads.keys()
    pairs += [(got_grads[n], want_grads[n]) for n in want_grads]
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    DIFFS[f"model {name} {backend} {batch_name}"] = max(float((a - b).detach().abs().max()) for a, b in pairs)
    if backend == "npu":
        calls = [c for c in standin_ops.CALLS if c[0] == "npu_fusion_attention"]
        assert calls and {c[1]["shapes"][1] == c[1]["shapes"][2] for c in calls} == {True}
        if name.startswith("deepseek"):  # values went in zero-padded from 6 to the key's 12 channels
            assert {c[1]["shapes"][2][-1] for c in calls} == {12}


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "TND"])
def test_fusion_attention_takes_value_heads_narrower_than_key_heads(layout, monkeypatch):
    """MLA: Dq = Dk = 12, Dv = 6; torch runs it as is, the NPU branch pads v to 12 (the kernel wants k, v of one
    shape) and slices the output: both equal the reference softmax(q k^T / sqrt(12)) v, causal."""
    from kit.ops import fusion_attention

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 7, 12, generator=gen), torch.randn(2, 4, 7, 12, generator=gen)
    v = torch.randn(2, 4, 7, 6, generator=gen)
    scores = (q @ k.transpose(-1, -2)) / 12**0.5
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, -1) @ v  # BNSD
    args = {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2), "TND": lambda t: t.transpose(1, 2)}
    extra = dict(actual_seq_qlen=[7, 14], actual_seq_kvlen=[7, 14]) if layout == "TND" else {}

    def shaped(t):
        t = args[layout](t).contiguous()
        return t.reshape(14, 4, t.shape[-1]) if layout == "TND" else t

    want = shaped(want)
    fake = install(monkeypatch)
    for backend in ("torch", "npu"):
        with use_backend(backend):
            got = fusion_attention(shaped(q), shaped(k), shaped(v), 4, layout, causal=True, **extra)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        DIFFS[f"fusion_attention Dv<Dk {layout} {backend}"] = float((got - want).abs().max())
    assert {c[1]["shapes"][2][-1] for c in fake.CALLS if c[0] == "npu_fusion_attention"} == {12}
    with pytest.raises(fake.StandinError, match="key and value shapes"):  # what the pad avoids
        fake.npu_fusion_attention(shaped(q), shaped(k), shaped(v), 4, layout, scale=1.0, **extra)
    with pytest.raises(ValueError, match="Dk >= Dv"):  # a value head wider than the key's: refused
        fusion_attention(shaped(q), shaped(v), shaped(k), 4, layout, **extra)


@pytest.mark.parametrize("backend", ["torch", "npu"])
def test_packed_rows_give_the_padded_batchs_loss_and_gradients(pair, backend, monkeypatch):
    """A padding-free row of two dialogs (position_ids restarting, what the trainer feeds with kit attention) gives
    the padded batch's LM loss and gradients (no aux loss in these families: HF's forward adds none)."""
    from kit.train.trainer import causal_lm_loss, logit_positions

    name, base, adapted, _ = pair
    padded, packed = H.padded_and_packed_dialogs()
    if backend == "npu":
        install(monkeypatch)
    results = []
    for model, batch, positions in (
        (base, padded, None),  # HF eager on the padded batch: the reference
        (adapted, padded, None),
        (adapted, packed, logit_positions(packed["labels"])),
    ):
        model.zero_grad()
        with use_backend(backend):
            loss = causal_lm_loss(model, batch, positions)
        loss.backward()
        grads = _merged_grads({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        results.append((loss.detach(), grads))
    (want, want_grads), *rest = results
    pairs = []
    for loss, grads in rest:
        assert grads.keys() == want_grads.keys()
        pairs += [(loss, want)] + [(grads[n], want_grads[n]) for n in want_grads]
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if backend == "npu":  # the packed row went as varlen (TND), each dialog its own sequence
        tnd = [
            c[1]
            for c in standin_ops.CALLS
            if c[0] == "npu_fusion_attention" and c[1]["input_layout"] == "TND"
        ]
        assert tnd and {tuple(c["actual_seq_qlen"]) for c in tnd} == {(9, 16)}
    DIFFS[f"packed vs HF padded {name} {backend}"] = max(float((a - b).abs().max()) for a, b in pairs)


def test_report_measured_differences():
    """Runs last in file order: prints what the equality tests measured (pytest -s)."""
    for name, value in DIFFS.items():
        print(f"{name}: max |kit - reference| = {value:.3e}")
