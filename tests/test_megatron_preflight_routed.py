"""`python -m kit megatron preflight` on a converted tiny GLM-4.5 (sigmoid router with score-correction bias, grouped
top-k, routed scaling, shared expert, a dense first layer, q/k norm and q/k/v bias, half-dim RoPE, an MTP layer) and
a tiny DeepSeek-V3 (the same MoE block after 2 dense layers, multi-head latent attention with a query latent,
interleaved RoPE or the published yarn, and once the published aux_loss_alpha / seq_aux) at TP x PP x EP on 4 CPU
gloo ranks against transformers' own Glm4MoeForCausalLM / DeepseekV3ForCausalLM, biases moved on both sides.

One launch per case (4 ranks on a 2-core machine are slow); the data is a module fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.convert import routed_moe

pytest.importorskip(
    "megatron.core", reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)"
)
pytestmark = pytest.mark.slow

tiny_glm45_dir = routed_moe.tiny_glm45_dir  # shared session fixtures
tiny_deepseek3_dir = routed_moe.tiny_deepseek3_dir
tiny_deepseek3_yarn_dir = routed_moe.tiny_deepseek3_yarn_dir

# no aux-loss row: GLM-4.5 has no router aux loss in transformers (coefficient 0 on both sides)
CHECKS = ["shards loaded", "loss vs HF", "grad norm vs HF", "losses over steps", "params after steps",
          "expert bias after steps", "checkpoint back to HF"]  # fmt: skip


@pytest.fixture(scope="module")
def ws(tmp_path_factory, tiny_glm45_dir):
    """A workspace with notebook 02's pretraining data and packed fine-tuning data, the GLM-4.5 model's tokenizer."""
    from test_megatron_preflight import data_workspace

    return data_workspace(tmp_path_factory.mktemp("pfglm") / "ws", str(tiny_glm45_dir))


@pytest.fixture(scope="module")
def ws_ds3(tmp_path_factory, tiny_deepseek3_dir):
    """The same data made with the DeepSeek-V3 model's tokenizer (the yarn model has the same)."""
    from test_megatron_preflight import data_workspace

    return data_workspace(tmp_path_factory.mktemp("pfds3") / "ws", str(tiny_deepseek3_dir))


def _preflight(src, ws, tmp_path: Path, data: str, tp: int, pp: int, ep: int, layers=(2, 1), mbs: int = 1):
    """layers at PP2: GLM-4.5's 3 (the dense one and a MoE layer, then the last MoE layer); DeepSeek-V3's 4 as
    (3, 1) (both dense layers and a MoE layer, then the last), so each stage holds experts. mbs: rows per
    micro-batch."""
    from kit.convert import ConvertConfig, hf_to_megatron
    from kit.train.preflight.run import PreflightConfig, run

    ckpt = tmp_path / "c"
    layers = list(layers) if pp == 2 else None
    hf_to_megatron(
        ConvertConfig(str(src), str(ckpt), tp=tp, pp=pp, ep=ep, num_layer_list=layers), progress=False
    )
    return run(PreflightConfig(checkpoint=str(ckpt), dataset_path=str(ws[data]), output=str(tmp_path / "pf"),
                               work_dir=str(ws["root"]), model_name="tiny", dp=4 // (tp * pp),
                               micro_batches=2, mbs=mbs))  # fmt: skip


def _assert_all_pass(res, aux: bool = False) -> dict:
    """Every check passed within the tolerances; aux: with the "aux loss vs HF" row (a DeepSeek-V3 aux_loss_alpha)."""
    assert res.passed, res.failures()
    checks = {c["check"]: c for c in res.checks}
    assert list(checks) == (CHECKS[:3] + ["aux loss vs HF"] + CHECKS[3:] if aux else CHECKS)
    for name in ("loss vs HF", "grad norm vs HF", "losses over steps") + (("aux loss vs HF",) if aux else ()):
        assert checks[name]["value"] <= 1e-5, checks[name]
    assert checks["params after steps"]["value"] <= 1e-4
    assert checks["expert bias after steps"]["value"] <= 1e-4
    assert "moved up to 2.0e-03" in checks["expert bias after steps"]["detail"]  # two steps of 1e-3
    assert "MTP layer" in checks["shards loaded"]["detail"]
    assert res.facts["losses"][1] < res.facts["losses"][0]
    return checks


def test_tp1_pp2_ep2_pretraining_data_passes_every_check(tiny_glm45_dir, ws, tmp_path):
    """2 stages (the dense layer and a MoE layer, then the last MoE layer) x 2 data-parallel ranks, the 8 experts
    of each MoE layer split over those 2 as EP."""
    res = _preflight(tiny_glm45_dir, ws, tmp_path, "pretrain", 1, 2, 2)
    checks = _assert_all_pass(res)
    assert (res.facts["tp"], res.facts["pp"], res.facts["ep"], res.facts["dp"]) == (1, 2, 2, 2)
    assert res.facts["moe"]["score_function"] == "sigmoid" and res.facts["moe"]["expert_bias_rate"] == 1e-3
    assert res.facts["aux_losses"] == [[], []]  # per step: megatron-core logged no aux loss
    assert "4 rank files" in checks["shards loaded"]["detail"]


def test_tp2_ep2_packed_fine_tuning_data_passes_every_check(tiny_glm45_dir, ws, tmp_path):
    """TP2 x EP2 x DP2: sequence parallel, so each TP rank routes its own tokens and megatron-core sums the counts
    over TP x DP, as the HF side counts every token of the step; packed rows."""
    res = _preflight(tiny_glm45_dir, ws, tmp_path, "sft", 2, 1, 2)
    _assert_all_pass(res)
    assert (res.facts["tp"], res.facts["ep"], res.facts["data_kind"]) == (2, 2, "sft")


def test_reference_without_the_bias_update_fails_the_bias_check(tiny_glm45_dir, ws, tmp_path, monkeypatch):
    """Negative control: an HF side that leaves the biases where they were (plain transformers training) is caught."""
    from kit.train import expert_bias

    monkeypatch.setattr(expert_bias.ExpertBiasUpdate, "step", expert_bias.ExpertBiasUpdate.reset)
    res = _preflight(tiny_glm45_dir, ws, tmp_path, "pretrain", 1, 2, 2)
    checks = {c["check"]: c for c in res.checks}
    failed = [c for c, v in checks.items() if not v["passed"]]
    assert failed == ["expert bias after steps"], failed
    assert checks["expert bias after steps"]["value"] >= 1e-3  # at least one step's move


def test_deepseek3_tp1_pp2_ep2_passes_every_check(tiny_deepseek3_dir, ws_ds3, tmp_path):
    """MLA (q and kv latents, interleaved RoPE on 8 of 24 q/k dims, v heads of 16) in megatron-core's local spec,
    2 dense layers then 2 MoE layers over 2 stages, 8 experts in 4 groups (top-4 inside the best 2: 4 / 2 = 2, the
    group score megatron-core and transformers share) split over 2 EP ranks."""
    res = _preflight(tiny_deepseek3_dir, ws_ds3, tmp_path, "pretrain", 1, 2, 2, layers=(3, 1))
    checks = _assert_all_pass(res)
    assert (res.facts["tp"], res.facts["pp"], res.facts["ep"], res.facts["dp"]) == (1, 2, 2, 2)
    assert "4 rank files" in checks["shards loaded"]["detail"]


def test_deepseek3_tp2_ep2_packed_fine_tuning_data_with_seq_aux_passes_every_check(
    tiny_deepseek3_dir, ws_ds3, tmp_path
):
    """TP2: the local spec's column-parallel down projections, the kv latent's rope columns' gradient summed over
    TP as TransformerEngine's path sums it (kit.train.preflight.cpu_patches, patch 10); packed rows. The model
    carries the published config's aux_loss_alpha / seq_aux (at 0.01, to be visible): megatron-core's seq_aux_loss
    on sequence-parallel ranks (each TP rank's share of a row's scores, the counts summed over TP) against the same
    loss from transformers' router logits, in both objectives. (An HF side with the micro-batch loss instead fails
    the aux, grad-norm and params checks: 2.2e-3, 1.8e-5, 2.3e-3.)"""
    import json
    import shutil

    alpha = 0.01
    src = tmp_path / "src"
    shutil.copytree(tiny_deepseek3_dir, src)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    (src / "config.json").write_text(
        json.dumps(dict(cfg, aux_loss_alpha=alpha, seq_aux=True)), encoding="utf-8"
    )
    # 2 rows per micro-batch: with one, the sequence-wise loss is the micro-batch one
    res = _preflight(src, ws_ds3, tmp_path, "sft", 2, 1, 2, mbs=2)
    checks = _assert_all_pass(res, aux=True)
    assert (res.facts["tp"], res.facts["ep"], res.facts["data_kind"]) == (2, 2, "sft")
    moe = res.facts["moe"]
    assert (moe["aux_loss_type"], moe["aux_loss_coeff"]) == ("seq_aux_loss", alpha)
    mg, hf = res.facts["aux_losses"], res.facts["hf_side_aux_losses"]
    # 2 steps x the 2 MoE layers (the 2 dense ones left out)
    assert len(mg) == 2 and all(len(step) == 2 for step in mg)
    assert all(x > 0 for step in mg for x in step)
    assert max(abs(a - b) for sm, sh in zip(mg, hf) for a, b in zip(sm, sh)) <= 1e-5
    assert res.facts["hf_load_balancing_loss"] is None  # transformers' DeepSeek-V3 has no aux loss of its own
    assert "sequence-wise" in checks["aux loss vs HF"]["detail"]


def test_seq_aux_loss_is_megatron_cores_and_not_the_micro_batch_one(monkeypatch):
    """The HF side's sequence-wise loss equals megatron-core's own router code (TopKRouter._apply_seq_aux_loss on
    compute_routing_scores_for_aux_loss, its tracker's value) on the same sigmoid logits, and differs from the
    micro-batch aux loss: two rows that each crowd 4 of the 8 experts balance each other in the pooled loss only."""
    import types

    import megatron.core.tensor_parallel.mappings as mappings
    import torch
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    from kit.train.preflight.reference import megatron_aux_losses, megatron_seq_aux_losses

    class _OneRank:  # a TP x CP group of one: megatron-core's _reduce passes the counts through
        def size(self):
            return 1

    monkeypatch.setattr(mappings, "get_tensor_model_parallel_group_if_none", lambda group, **kw: group)
    seq, rows, experts, topk = 16, 2, 8, 4
    # megatron's [s, b] order
    logits = torch.randn(seq, rows, experts, generator=torch.Generator().manual_seed(0))
    logits[:, 0, :4] += 2.0
    logits[:, 1, 4:] += 2.0
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(
        logits.reshape(seq * rows, experts), topk, "sigmoid"
    )
    config = types.SimpleNamespace(
        num_moe_experts=experts, moe_router_fusion=False, num_layers=1, mtp_num_layers=None
    )
    router = types.SimpleNamespace(topk=topk, config=config, tp_cp_group=_OneRank(), layer_number=1,
                                   calculate_per_token_loss=False)  # fmt: skip
    router.get_aux_loss_coeff = lambda kind: 1.0 if kind == "seq_aux_loss" else 0.0
    router.attach_and_log_load_balancing_loss = lambda *a, **kw: (
        TopKRouter.attach_and_log_load_balancing_loss(router, *a, **kw)
    )
    moe_utils.clear_aux_losses_tracker()
    TopKRouter._apply_seq_aux_loss(router, torch.zeros(seq * rows, experts), scores, routing_map, seq, rows)
    theirs = float(moe_utils.get_moe_layer_wise_logging_tracker()["seq_load_balancing_loss"]["values"][0])
    moe_utils.clear_aux_losses_tracker()
    hf_logits = logits.transpose(0, 1).reshape(rows * seq, experts)  # transformers' [b, s] order
    ours = float(megatron_seq_aux_losses([hf_logits], topk, experts, rows)[0])
    pooled = float(megatron_aux_losses([hf_logits], topk, experts, "sigmoid")[0])
    assert abs(ours - theirs) <= 1e-6, (ours, theirs)
    assert ours - pooled > 0.1, (ours, pooled)  # each row alone is unbalanced, the two together are not


def test_deepseek3_with_yarn_tp2_ep2_passes_every_check(tiny_deepseek3_yarn_dir, ws_ds3, tmp_path):
    """The published yarn rope_scaling (factor 40, mscale_all_dim 1): megatron-core's MLA with rope_type yarn
    (YarnRotaryEmbedding, softmax scale times mscale^2) from the checkpoint's args, transformers' DeepseekV3 yarn."""
    res = _preflight(tiny_deepseek3_yarn_dir, ws_ds3, tmp_path, "pretrain", 2, 1, 2)
    _assert_all_pass(res)
    assert res.facts["tp"] == 2
