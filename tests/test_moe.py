"""Qwen3-MoE: kit.ops.moe against HF's sparse block (portable path and the torch_npu stand-in), kit.adapt on the tiny
model (router logits, aux loss, packed rows), kit.train full fine-tune and LoRA, and the profiler's MoE table."""

from __future__ import annotations

import copy
import csv
import types

import pytest
import test_train_helpers as H
import torch
from fixtures.convert import families as fam_models
from npu_standin import install
from npu_standin import ops as standin_ops

from kit.ops import moe as kit_moe
from kit.ops import use_backend

tiny_qwen3_moe_dir = fam_models.tiny_qwen3_moe_dir  # the shared session fixture


def _called(name: str) -> bool:
    return any(call[0] == name for call in standin_ops.CALLS)


def _hf_block(norm: bool = True, dtype=torch.float32, seed: int = 0):
    """HF's Qwen3MoeSparseMoeBlock (8 experts, top-2, hidden 64) with random weights, eager experts."""
    fam_models.require("qwen3_moe")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

    config = Qwen3MoeConfig(
        hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm
    )
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"  # the reference: HF's per-expert loop
    block = modeling.Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block.to(dtype)


def _kit_block(block):
    from kit.adapt.moe import moe_block_forward, prepare_block

    out = copy.deepcopy(block)
    prepare_block(out)
    out.forward = types.MethodType(moe_block_forward, out)
    return out


def kit_moe_fused(block) -> bool:
    from kit.adapt.moe import fused_experts

    return fused_experts(block)


def _run(block, x, grad):
    """(output, router logits, input grad, parameter grads) of one forward + backward."""
    seen = []
    hook = block.gate.register_forward_hook(lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
    x = x.clone().requires_grad_(True)
    out = block(x)
    hidden = out[0] if isinstance(out, tuple) else out
    (hidden * grad).sum().backward()
    hook.remove()
    return hidden, seen[0], x.grad, {n: p.grad for n, p in block.named_parameters()}


def run_kit_and_hf(kit, block, backend: str, monkeypatch):
    """(kit's, HF's) `_run` of one seeded batch x [2, 40, 64], and x. Backend "torch-loop" is torch without grouped
    matmuls (torch < 2.9, or unaligned weights: one matmul pair per expert), "npu" the torch_npu stand-in (its calls
    cleared first)."""
    standin_ops.CALLS.clear()
    if backend == "torch-loop":
        monkeypatch.setattr(kit_moe, "_grouped_mm", lambda x, weight: None)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(2, 40, 64, generator=gen), torch.randn(2, 40, 64, generator=gen)
    want = _run(block, x, grad)
    if backend == "npu":
        install(monkeypatch)
    with use_backend("torch" if backend == "torch-loop" else backend):
        return _run(kit, x, grad), want, x


@pytest.mark.parametrize("backend", ["torch", "torch-loop", "npu"])
@pytest.mark.parametrize("norm", [True, False])
def test_kit_block_equals_hf_outputs_gradients_and_router_logits(backend, norm, monkeypatch):
    block = _hf_block(norm)
    kit = _kit_block(block)
    got, want, x = run_kit_and_hf(kit, block, backend, monkeypatch)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got[3].keys() == want[3].keys()
    for name in want[3]:
        torch.testing.assert_close(got[3][name], want[3][name], atol=1e-5, rtol=1e-5, msg=name)
    fused = kit_moe_fused(kit)
    for op in ("npu_moe_token_permute", "npu_grouped_matmul", "npu_swiglu", "npu_moe_token_unpermute"):
        assert _called(op) == (backend == "npu" and fused), op
    # training keeps torch's softmax/top-k: the gating kernel has no backward
    assert not _called("npu_moe_gating_top_k_softmax")
    if backend == "npu":
        with use_backend("npu"), torch.no_grad():
            torch.testing.assert_close(kit(x), block(x), atol=1e-5, rtol=1e-5)
        assert _called("npu_moe_gating_top_k_softmax")  # inference: softmax + top-k in one kernel


def test_the_modulelist_layout_of_transformers_4_51_to_4_57(monkeypatch):
    """Linear router + ModuleList of expert MLPs, the block returning (hidden, router_logits): against a loop over
    tokens (transformers 4.5x itself is not installed here), on both backends."""
    fam_models.require("qwen3_moe")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    from kit.adapt.moe import is_moe_block, moe_block_forward

    class Qwen3MoeSparseMoeBlock(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts, self.top_k, self.norm_topk_prob = 8, 2, True
            self.gate = torch.nn.Linear(64, 8, bias=False)
            self.experts = torch.nn.ModuleList(Qwen3MoeMLP(config, intermediate_size=32) for _ in range(8))

    torch.manual_seed(5)
    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=64))
    assert is_moe_block(block)
    x = torch.randn(1, 24, 64)

    def reference(x):
        flat = x.reshape(-1, 64)
        logits = block.gate(flat)
        weights, idx = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), 2, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        rows = [
            sum(weights[t, j] * block.experts[int(idx[t, j])](flat[t]) for j in range(2)) for t in range(24)
        ]
        return torch.stack(rows).reshape(x.shape), logits

    want = reference(x)
    grads_want = torch.autograd.grad(want[0].square().sum(), list(block.parameters()))
    install(monkeypatch)
    for backend in ("torch", "npu"):
        with use_backend(backend):
            got = moe_block_forward(block, x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        grads = torch.autograd.grad(got[0].square().sum(), list(block.parameters()))
        for a, b in zip(grads, grads_want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bf16_on_the_standin_uses_grouped_matmul_add_for_expert_gradients(monkeypatch):
    block = _hf_block(dtype=torch.bfloat16)
    kit = _kit_block(block)
    if not kit_moe_fused(kit):
        pytest.skip("the ModuleList experts of transformers < 5 run the portable path on NPU too")
    gen = torch.Generator().manual_seed(2)
    x, grad = torch.randn(64, 64, generator=gen).bfloat16(), torch.randn(64, 64, generator=gen).bfloat16()
    want = _run(block, x.unsqueeze(0), grad.unsqueeze(0))
    install(monkeypatch)
    with use_backend("npu"):
        got = _run(kit, x.unsqueeze(0), grad.unsqueeze(0))
    assert _called("npu_grouped_matmul_add_")
    pairs = list(zip(got[:3], want[:3])) + [(got[3][n], want[3][n]) for n in want[3]]
    for a, b in pairs:  # bf16 rounding: the largest difference against the largest value
        a, b = a.detach().float(), b.detach().float()
        assert float((a - b).abs().max() / b.abs().max()) < 2e-2


def test_standin_refuses_what_the_moe_kernels_refuse(monkeypatch):
    fake = install(monkeypatch)
    err = fake.StandinError
    with pytest.raises(err, match="inference-only"):
        fake.npu_moe_gating_top_k_softmax(torch.randn(4, 8, requires_grad=True), None, k=2)
    x, w, groups = torch.randn(6, 16), torch.randn(2, 16, 8), torch.tensor([3, 3])
    with pytest.raises(err, match="split_item 2 or 3"):  # the default split_item=0 is for lists of weights
        fake.npu_grouped_matmul([x], [w], group_list=groups, group_type=0, group_list_type=1)
    with pytest.raises(err, match="covers 5 rows"):
        fake.npu_grouped_matmul(
            [x], [w], group_list=torch.tensor([2, 3]), split_item=3, group_type=0, group_list_type=1
        )
    with pytest.raises(err, match="fp16 or bf16"):  # the dweight kernel takes half precision only
        fake.npu_grouped_matmul_add_(torch.zeros(2, 16, 8), x, torch.randn(6, 8), groups, group_list_type=1)
    with pytest.raises(err, match="<= 512"):
        fake.npu_moe_token_permute(torch.randn(2, 4), torch.zeros(2, 513, dtype=torch.long))
    # the kit keeps to the limits: top-k above npu_moe_token_permute's 512 takes the portable path
    assert not kit_moe._npu_fits(x, torch.zeros(6, 513, dtype=torch.long), w.transpose(1, 2), w)


@pytest.fixture(scope="module")
def moe_models(tiny_qwen3_moe_dir):
    """(plain, adapted, report): the tiny Qwen3-MoE as loaded, and a copy through kit.adapt."""
    from transformers import AutoModelForCausalLM

    from kit.adapt import adapt_model

    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, torch_dtype=torch.float32)
    adapted = copy.deepcopy(plain)
    report = adapt_model(adapted)
    return plain, adapted, report


def test_adapt_replaces_every_moe_block_and_keeps_the_hf_layout(moe_models):
    plain, adapted, report = moe_models
    assert report.moe_blocks == 4 and report.attention == "kit"
    assert not [s for s in report.skipped if "MoeBlock" in s], report.skipped
    want, got = plain.state_dict(), adapted.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.tensor([[5, 101, 120, 133, 6, 133, 120, 101, 2, 7], [5, 110, 111, 6, 111, 110, 2, 9, 8, 3]])
    outs = []
    for model in (plain, adapted):
        model.zero_grad()
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        outs.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (p, pg), (a, ag) = outs
    torch.testing.assert_close(a.logits, p.logits, atol=1e-5, rtol=1e-5)
    assert len(a.router_logits) == 4
    for x, y in zip(a.router_logits, p.router_logits):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert (
        float(p.aux_loss.detach()) > 1.0
    )  # top-2 of 4: the load-balancing loss is 2 for a perfectly even router
    torch.testing.assert_close(a.aux_loss, p.aux_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.loss, p.loss, atol=1e-6, rtol=1e-6)
    for name in pg:
        torch.testing.assert_close(ag[name], pg[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_rows_give_the_padded_batchs_lm_loss_and_aux_loss(moe_models):
    from kit.train.trainer import causal_lm_loss, logit_positions

    _, adapted, _ = moe_models
    coef = 0.25
    padded, packed = H.padded_and_packed_dialogs()
    with torch.no_grad():
        lm_padded = causal_lm_loss(adapted, padded)
        lm_packed = causal_lm_loss(adapted, packed, logit_positions(packed["labels"]))
        total_packed = causal_lm_loss(adapted, packed, logit_positions(packed["labels"]), coef)
        aux_padded = adapted(**padded, output_router_logits=True).aux_loss  # padding masked out
        aux_packed = adapted(**packed, output_router_logits=True).aux_loss  # every real token counts
    torch.testing.assert_close(lm_packed, lm_padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux_packed, aux_padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total_packed, lm_packed + coef * aux_packed, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return H.make_sft(tmp_path_factory.mktemp("moe-data") / "synthetic_sft_hf", num_samples=16)


@pytest.mark.slow
@pytest.mark.parametrize("run_type", ["sft", "lora"])
def test_train_full_and_lora_loss_falls_and_the_export_holds_what_was_trained(
    run_type, tiny_qwen3_moe_dir, sft_data, tmp_path, monkeypatch
):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from kit.train import train
    from kit.train import trainer as trainer_mod

    coefs = []  # the aux-loss coefficient every micro-batch's loss was computed with
    loss_fn = trainer_mod.causal_lm_loss
    monkeypatch.setattr(
        trainer_mod,
        "causal_lm_loss",
        lambda engine, batch, positions=None, aux=0.0: (
            coefs.append(aux) or loss_fn(engine, batch, positions, aux)
        ),
    )

    lora = run_type == "lora"
    cfg = H.tiny_config(
        tiny_qwen3_moe_dir,
        sft_data,
        tmp_path / "ws",
        run_type=run_type,
        train_iters=6,
        gbs=8,
        mbs=4,
        lr=1e-2 if lora else 3e-3,
        save_hf=True,
        lora_alpha=32,
        lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
    )
    result = train(cfg, progress=False)
    assert result.status == "completed" and result.losses[-1] < result.losses[0] - 0.1, result.losses
    assert coefs and set(coefs) == {0.001}  # ROUTER_AUX_LOSS_COEF None: the model's router_aux_loss_coef
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(result.hf_dir).state_dict()
    assert exported.keys() == base.keys()
    changed = {k for k in base if not torch.equal(exported[k], base[k])}
    if lora:
        with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as fh:
            saved = {k for k in fh.keys() if "lora_" in k}
        assert len(saved) == 2 * (4 * 4 + 1)  # (4 layers x q/k/v/o + lm_head) x (A, B)
        assert changed == {k for k in base if k.rsplit(".", 2)[-2] in cfg.lora_targets}
    else:
        assert changed == set(base)  # experts, routers, attention, norms, embeddings: every tensor trained


def test_a_router_aux_loss_for_a_dense_model_and_lora_on_the_router_are_refused():
    from kit.errors import InputError
    from kit.train import TrainConfig
    from kit.train.engine import _router_aux_loss

    dense = types.SimpleNamespace(config=types.SimpleNamespace(num_experts=0))
    cfg = TrainConfig(model_path="/models/dense", router_aux_loss_coef=0.01)
    with pytest.raises(InputError, match="no routed experts"):
        _router_aux_loss(dense, cfg)
    assert any("ROUTER_AUX_LOSS_COEF=-1" in p for p in TrainConfig(router_aux_loss_coef=-1).problems())
    from kit.adapt.moe import lora_target_problems

    moe = types.SimpleNamespace(config=types.SimpleNamespace(num_experts=4, router_aux_loss_coef=0.001))
    assert (
        lora_target_problems(moe, ["q_proj", "v_proj"]) == [] and lora_target_problems(dense, ["gate"]) == []
    )
    assert "'gate' is the router" in lora_target_problems(moe, ["q_proj", "gate"])[0]


MOE_KERNELS = [  # (name, type, core, us): what a Qwen3-MoE step on NPU adds to kernel_details.csv
    ("aclnnMoeGatingTopKSoftmax_MoeGatingTopKSoftmax", "MoeGatingTopKSoftmax", "AI_VECTOR_CORE", 20.0),
    ("aclnnMoeTokenPermute_MoeTokenPermute", "MoeTokenPermute", "AI_VECTOR_CORE", 30.0),
    ("aclnnGroupedMatmul_GroupedMatmul", "GroupedMatmul", "AI_CORE", 400.0),
    ("aclnnMoeTokenUnpermute_MoeTokenUnpermute", "MoeTokenUnpermute", "AI_VECTOR_CORE", 25.0),
    ("hcom_alltoallv__591_0_1", "hcom_alltoallv_", "HCCL", 150.0),
]


def test_advisor_names_the_moe_operators(tmp_path):
    import kit.profiling as kp

    root = kp.write_sample_ascend_profile(tmp_path, clean=True)
    path = root / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    template = rows[0]
    for name, typ, core, us in MOE_KERNELS * 2:
        rows.append(
            dict(template, **{"Name": name, "Type": typ, "Accelerator Core": core, "Duration(us)": us})
        )
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(template))
        w.writeheader()
        w.writerows(rows)
    data = kp.load(root)
    advice = kp.advise(data)
    from kit.profiling.moe import moe_operators

    table = moe_operators(data)
    assert list(table["role"]) == [
        "routing",
        "token unpermute",
        "token permute",
        "grouped matmul",
        "all-to-all",
    ]
    assert list(table["calls"]) == [2] * 5 and float(table["total_us"].sum()) == pytest.approx(2 * 625.0)
    total = float(data.kernels["dur_us"].sum())
    assert float(table.loc[3, "share_pct"]) == pytest.approx(100 * 800.0 / total)
    finding = {f.rule: f for f in advice.findings}["moe_operators"]
    assert finding.severity == "info" and finding.operators == list(table["type"])
    assert finding.operators == [
        "MoeGatingTopKSoftmax", "MoeTokenUnpermute", "MoeTokenPermute", "GroupedMatmul", "hcom_alltoallv_"
    ]  # fmt: skip
    assert "grouped matmul" in finding.evidence and "all-to-all" in finding.evidence
    md = advice.to_markdown()
    assert "## MoE operators" in md and "| all-to-all | hcom_alltoallv_ |" in md
    plain = kp.advise(kp.load(kp.write_sample_ascend_profile(tmp_path / "plain", clean=True)))
    assert "moe_operators" not in {f.rule for f in plain.findings} and "MoE" not in plain.to_markdown()
