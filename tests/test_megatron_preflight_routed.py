"""`python -m kit megatron preflight` on a converted tiny GLM-4.5 (sigmoid router with score-correction bias, grouped
top-k, routed scaling, shared expert, a dense first layer, q/k norm and q/k/v bias, half-dim RoPE, an MTP layer) and
a tiny DeepSeek-V3 (the same MoE block after 2 dense layers, multi-head latent attention with a query latent,
interleaved RoPE or the published yarn) at TP x PP x EP on 4 CPU gloo ranks against transformers' own
Glm4MoeForCausalLM / DeepseekV3ForCausalLM, biases moved on both sides.

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


def _preflight(src, ws, tmp_path: Path, data: str, tp: int, pp: int, ep: int, layers=(2, 1)):
    """layers at PP2: GLM-4.5's 3 (the dense one and a MoE layer, then the last MoE layer); DeepSeek-V3's 4 as
    (3, 1) (both dense layers and a MoE layer, then the last), so each stage holds experts."""
    from kit.convert import ConvertConfig, hf_to_megatron
    from kit.train.preflight.run import PreflightConfig, run

    ckpt = tmp_path / "c"
    layers = list(layers) if pp == 2 else None
    hf_to_megatron(
        ConvertConfig(str(src), str(ckpt), tp=tp, pp=pp, ep=ep, num_layer_list=layers), progress=False
    )
    return run(PreflightConfig(checkpoint=str(ckpt), dataset_path=str(ws[data]), output=str(tmp_path / "pf"),
                               work_dir=str(ws["root"]), model_name="tiny", dp=4 // (tp * pp),
                               micro_batches=2))  # fmt: skip


def _assert_all_pass(res) -> dict:
    assert res.passed, res.failures()
    checks = {c["check"]: c for c in res.checks}
    assert list(checks) == CHECKS
    for name in ("loss vs HF", "grad norm vs HF", "losses over steps"):
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


def test_sigmoid_router_with_an_aux_loss_is_refused_in_one_line(tiny_glm45_dir, ws, tmp_path):
    """The HF side has megatron-core's load-balancing loss of a softmax router only: a sigmoid router whose
    checkpoint asks for an aux loss is refused before any rank starts."""
    import json

    from kit.convert import ConvertConfig, hf_to_megatron
    from kit.convert.megatron_io import META_FILE
    from kit.errors import InputError
    from kit.train.preflight.run import PreflightConfig, run

    ckpt = tmp_path / "c"
    hf_to_megatron(ConvertConfig(str(tiny_glm45_dir), str(ckpt)), progress=False)
    meta = json.loads((ckpt / META_FILE).read_text(encoding="utf-8"))
    meta["spec"]["moe_aux_loss_coeff"] = 1e-3
    (ckpt / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(InputError) as err:
        run(PreflightConfig(checkpoint=str(ckpt), dataset_path=str(ws["pretrain"]), output=str(tmp_path / "pf"),
                            work_dir=str(ws["root"]), model_name="tiny"))  # fmt: skip
    line = str(err.value)
    assert "\n" not in line and "sigmoid router with an aux-loss coefficient 0.001" in line
    assert not (tmp_path / "pf").exists()


def test_deepseek3_tp1_pp2_ep2_passes_every_check(tiny_deepseek3_dir, ws_ds3, tmp_path):
    """MLA (q and kv latents, interleaved RoPE on 8 of 24 q/k dims, v heads of 16) in megatron-core's local spec,
    2 dense layers then 2 MoE layers over 2 stages, 8 experts in 4 groups (top-4 inside the best 2: 4 / 2 = 2, the
    group score megatron-core and transformers share) split over 2 EP ranks."""
    res = _preflight(tiny_deepseek3_dir, ws_ds3, tmp_path, "pretrain", 1, 2, 2, layers=(3, 1))
    checks = _assert_all_pass(res)
    assert (res.facts["tp"], res.facts["pp"], res.facts["ep"], res.facts["dp"]) == (1, 2, 2, 2)
    assert "4 rank files" in checks["shards loaded"]["detail"]


def test_deepseek3_tp2_ep2_packed_fine_tuning_data_passes_every_check(tiny_deepseek3_dir, ws_ds3, tmp_path):
    """TP2: the local spec's column-parallel down projections, the kv latent's rope columns' gradient summed over
    TP as TransformerEngine's path sums it (kit.train.preflight.cpu_patches, patch 10); packed rows."""
    res = _preflight(tiny_deepseek3_dir, ws_ds3, tmp_path, "sft", 2, 1, 2)
    _assert_all_pass(res)
    assert (res.facts["tp"], res.facts["ep"], res.facts["data_kind"]) == (2, 2, "sft")


def test_deepseek3_with_yarn_tp2_ep2_passes_every_check(tiny_deepseek3_yarn_dir, ws_ds3, tmp_path):
    """The published yarn rope_scaling (factor 40, mscale_all_dim 1): megatron-core's MLA with rope_type yarn
    (YarnRotaryEmbedding, softmax scale times mscale^2) from the checkpoint's args, transformers' DeepseekV3 yarn."""
    res = _preflight(tiny_deepseek3_yarn_dir, ws_ds3, tmp_path, "pretrain", 2, 1, 2)
    _assert_all_pass(res)
    assert res.facts["tp"] == 2
