"""A tiny Qwen3 through 02 -> 03 -> 04 -> 06 in one workspace through the kit API: dialogs prepared with the
kit's `qwen3` template, conversion to Megatron TP2 x PP2 verified, the Megatron plan's Qwen3 flags, LoRA
training with kit.adapt (loss down, every adapter tensor exported), the held-out evaluation, and the trained model
back through 03. The same for a tiny Qwen3-MoE, a tiny GLM-4.5 and a tiny DeepSeek-V3 (routed experts at EP2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.convert import families as fam_models
from fixtures.convert import routed_moe as routed_models
from safetensors import safe_open

from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    EVALUATION,
    HF_MODEL,
    PREPARED_DATA,
    TRAINING_RUN,
    read_manifest,
)

tiny_qwen3_dir = fam_models.tiny_qwen3_dir  # shared session fixture

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _prepare_dialogs(src: str, ws):
    """02: alpaca dialogs with the folder's tokenizer and the kit's qwen3 template, 4 held out."""
    from kit.data import DataConfig, prepare

    cfg = DataConfig(
        kind="sft",
        name="alpaca",
        tokenizer=src,
        template="qwen3",
        max_length=64,
        max_records=48,
        heldout_records=4,
    )
    return prepare(cfg, ws, progress=False).hf_dir


def _lora_config(name: str, src: str, data, ws, targets):
    """04: 8 LoRA iterations with the kit's adapted ops, merged HF export."""
    from kit.train import TrainConfig

    return TrainConfig(
        run_type="lora", model_name=name, model_path=src, dataset_path=str(data), work_dir=str(ws.root),
        train_iters=8, mbs=2, gbs=4, lr=1e-2, warmup_iters=1, lora_r=8, lora_alpha=32, lora_targets=targets,
        save_hf=True,
    )  # fmt: skip


@pytest.mark.slow
def test_qwen3_through_data_convert_train_evaluate(tmp_path, tiny_qwen3_dir):
    from kit.convert import ConvertConfig
    from kit.convert.result import run as convert_run
    from kit.core.workspace import get_workspace
    from kit.evaluate import EvalConfig
    from kit.evaluate import run as evaluate
    from kit.train import train
    from kit.train.config import replace
    from kit.train.megatron import build
    from kit.train.resolve import resolve

    ws = get_workspace(tmp_path / "ws", model="tiny")
    src = str(tiny_qwen3_dir)
    # 02: the Qwen3 folder's tokenizer, the kit's qwen3 template (MindSpeed-LLM --prompt-type qwen3)
    data = _prepare_dialogs(src, ws)
    data_man = read_manifest(data, expect=PREPARED_DATA)
    assert data_man["template"] == "qwen3" and "--prompt-type" in data_man["megatron_flags"]

    # 03: HF -> Megatron TP2 x PP2 (tied embeddings: the last stage holds its copy), verified both ways
    conv = convert_run(ConvertConfig(source=src, tp=2, pp=2), ws, progress=False)
    checks = conv.verify(scratch=tmp_path / "verify")
    assert checks["passed"], checks["table"]
    converted = read_manifest(conv.target, expect=CONVERTED_CHECKPOINT)
    assert converted["family"] == "qwen3" and converted["model"]["head_dim"] == 32

    # 04: LoRA with the kit's fused ops
    cfg = _lora_config("tiny", src, data, ws, LORA_TARGETS)
    result = train(cfg, ws, progress=False)
    assert result.status == "completed" and result.losses[-1] < result.losses[0], result.losses
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as fh:
        saved = [k for k in fh.keys() if "lora_" in k]
    assert len(saved) == 2 * len(LORA_TARGETS) * 2  # 2 layers x targets x (A, B)
    run_man = read_manifest(result.output_dir, expect=TRAINING_RUN)
    assert run_man.consumed(PREPARED_DATA)[0].manifest_sha256 == data_man.sha256

    # the same run on Megatron/MindSpeed-LLM: 03's checkpoint with the flags Qwen3 needs
    plan = build(resolve(replace(cfg, engine="megatron", run_type="sft", model_path=str(conv.target)), ws))
    text = plan.describe()
    assert str(conv.target) in text and "--qk-layernorm" in plan.argv
    assert plan.argv[plan.argv.index("--prompt-type") + 1] == "qwen3"
    assert plan.argv[plan.argv.index("--kv-channels") + 1] == "32"  # head_dim, not hidden/heads = 16
    assert "--untie-embeddings-and-output-weights" not in plan.argv

    # 06: the held-out dialogs 02 set aside, base vs trained
    ev = evaluate(EvalConfig(parts=["heldout"], engine="kit"), ws, progress=False)
    man = read_manifest(ev.folder, expect=EVALUATION)
    assert {c.kind: c.manifest_sha256 for c in man.inputs}[TRAINING_RUN] == run_man.sha256
    models = ev.results["models"]
    assert models["trained"]["heldout_tokens"] > 0
    assert models["trained"]["heldout_loss"] < models["base"]["heldout_loss"]

    # the exported (merged) model goes back through 03 and stays a Qwen3
    back = convert_run(
        ConvertConfig(source=str(run_man["hf"]), target=str(tmp_path / "trained_tp2"), tp=2), progress=False
    )
    assert back.manifest["family"] == "qwen3"
    assert back.manifest.consumed(HF_MODEL)[0].manifest_sha256 == read_manifest(run_man["hf"]).sha256
    assert back.verify(scratch=tmp_path / "verify2")["passed"]


tiny_qwen3_moe_dir = fam_models.tiny_qwen3_moe_dir  # shared session fixture

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # LoRA on MoE models: attention (docs/adapt.md)


@pytest.mark.slow
def test_qwen3_moe_through_data_convert_train_evaluate(tmp_path, tiny_qwen3_moe_dir):
    """A tiny Qwen3-MoE (4 experts, top-2) through 02 -> 03 (TP1 x PP2 x EP2) -> 04 (LoRA with the adapted MoE
    blocks and the router's aux loss; the Megatron plan at EP2) -> 06, and the trained model back through 03."""
    from kit.convert import ConvertConfig
    from kit.convert.result import run as convert_run
    from kit.core.workspace import get_workspace
    from kit.evaluate import EvalConfig
    from kit.evaluate import run as evaluate
    from kit.train import train
    from kit.train.config import replace
    from kit.train.megatron import build
    from kit.train.resolve import resolve

    ws = get_workspace(tmp_path / "ws", model="tiny-moe")
    src = str(tiny_qwen3_moe_dir)
    data = _prepare_dialogs(src, ws)
    data_man = read_manifest(data, expect=PREPARED_DATA)

    # 03: experts split over two EP ranks, layers over two pipeline stages, verified both ways
    conv = convert_run(ConvertConfig(source=src, tp=1, pp=2, ep=2), ws, progress=False)
    checks = conv.verify(scratch=tmp_path / "verify")
    assert checks["passed"], checks["table"]
    converted = read_manifest(conv.target, expect=CONVERTED_CHECKPOINT)
    assert converted["family"] == "qwen3_moe" and converted["ep"] == 2
    assert converted["model"]["num_experts"] == 4 and converted["model"]["moe_router_topk"] == 2

    # 04: LoRA on the attention projections; every MoE block runs through kit.ops.moe, the aux loss is in the loss
    cfg = _lora_config("tiny-moe", src, data, ws, ATTENTION_TARGETS)
    result = train(cfg, ws, progress=False)
    assert result.status == "completed" and result.losses[-1] < result.losses[0], result.losses
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as fh:
        saved = [k for k in fh.keys() if "lora_" in k]
    assert len(saved) == 4 * len(ATTENTION_TARGETS) * 2  # 4 layers x targets x (A, B)
    run_man = read_manifest(result.output_dir, expect=TRAINING_RUN)
    assert run_man.consumed(PREPARED_DATA)[0].manifest_sha256 == data_man.sha256

    # the same run on Megatron/MindSpeed-LLM: 03's EP2 checkpoint with the MoE flags
    plan = build(
        resolve(
            replace(cfg, engine="megatron", run_type="sft", model_path=str(conv.target), nproc_per_node=4), ws
        )
    )
    assert [p for p in plan.problems if not p.startswith("code folder")] == [], (
        plan.problems
    )  # no MindSpeed here
    flag = dict(zip(plan.argv, plan.argv[1:]))
    assert flag["--expert-model-parallel-size"] == "2" and flag["--num-experts"] == "4"
    assert flag["--moe-aux-loss-coeff"] == "0.001" and "--norm-topk-prob" in plan.argv

    # 06: held-out dialogs, base vs trained
    ev = evaluate(EvalConfig(parts=["heldout"], engine="kit"), ws, progress=False)
    models = ev.results["models"]
    assert models["trained"]["heldout_tokens"] > 0
    assert models["trained"]["heldout_loss"] < models["base"]["heldout_loss"]

    # the exported (merged) model goes back through 03 and stays a Qwen3-MoE
    back = convert_run(
        ConvertConfig(source=str(run_man["hf"]), target=str(tmp_path / "trained_ep2"), ep=2), progress=False
    )
    assert back.manifest["family"] == "qwen3_moe"
    assert back.verify(scratch=tmp_path / "verify2")["passed"]


@pytest.fixture(scope="module")
def tiny_glm45_dir(tmp_path_factory):
    """The routed-MoE fixture's GLM-4.5 with 4 layers (1 dense + 3 MoE), so that PP2 gives each stage a MoE layer
    (MindSpeed-LLM refuses a stage of dense layers only: first_k_dense_replace < num_layers // pp)."""
    return routed_models.tiny_glm45(tmp_path_factory.mktemp("glm45c") / "tiny-glm45", num_hidden_layers=4)


@pytest.fixture(scope="module")
def tiny_deepseek3_dir(tmp_path_factory):
    """The routed-MoE fixture's DeepSeek-V3 with 6 layers (2 dense + 4 MoE), so that PP2 gives each stage a MoE layer
    (MindSpeed-LLM refuses a stage of dense layers only: first_k_dense_replace 2 < num_layers // pp)."""
    return routed_models.tiny_deepseek3(
        tmp_path_factory.mktemp("ds3c") / "tiny-deepseek3", num_hidden_layers=6
    )


def _tensors(folder, keep) -> dict:
    """The tensors of an HF folder whose names pass `keep`."""
    out = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys() if keep(k)})
    return out


MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]  # with a query latent

# What each routed-MoE chain expects: the fixture, 02's template (and the special tokens the sample tokenizer spells
# out), 03's family, the layers (dense first, then MoE; the MTP layer after them), 04's LR and the LoRA targets
# the defaults become, and the Megatron flags of MindSpeed-LLM's examples/mcore/<family> scripts.
ROUTED = {
    "glm45": dict(
        fixture="tiny_glm45_dir", template="glm4_5", prompt_type="glm4_moe",
        spelled="['<sop>', '<think>', '</think>']", family="glm4_moe", dense=1, layers=4, lr=1e-2,
        targets=ATTENTION_TARGETS,
        flags={"--num-experts": "8", "--moe-router-topk": "2", "--moe-router-num-groups": "2",
               "--moe-router-group-topk": "1", "--rotary-percent": "0.5"},
        present=["--qk-layernorm", "--add-qkv-bias"],
    ),
    # LR 5e-3: the fixture's query/KV latents come out of HF's 0.02-std init small, so their RMSNorms amplify the
    # adapters on q_a_proj / kv_a_proj_with_mqa (grad norm 9 at iteration 4) and 1e-2 overshoots within 8 iterations
    "deepseek3": dict(
        fixture="tiny_deepseek3_dir", template="deepseek3", prompt_type="deepseek3",
        spelled="['<｜User｜>', '<｜Assistant｜>', '<｜end▁of▁sentence｜>']", family="deepseek_v3", dense=2, layers=6,
        lr=5e-3, targets=MLA_TARGETS,
        flags={"--num-experts": "8", "--moe-router-topk": "4", "--moe-router-num-groups": "4",
               "--moe-router-group-topk": "2", "--q-lora-rank": "32", "--kv-lora-rank": "16",
               "--qk-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16"},
        present=["--multi-latent-attention"],  # MLA as architecture_flags states it (Megatron-LM's names)
        model={"multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16},
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ROUTED))
def test_routed_moe_through_data_convert_train_evaluate(name, tmp_path, monkeypatch, request):
    """A tiny GLM-4.5 (1 dense + 3 MoE layers: 8 experts in 2 groups, top-2, GQA) or DeepSeek-V3 (2 dense + 4 MoE
    layers: MLA with a query latent, 8 experts in 4 groups, top-4 inside the best 2), each with a shared expert, the
    sigmoid router with its score-correction bias, scaling 2.5 and an MTP layer in the files, through 02 (the kit's
    template) -> 03 (TP1 x PP2 x EP2) -> 04 (LoRA with the default attention targets through the adapted MoE blocks
    and the kit's attention; router biases and the MTP layer untouched under LoRA) -> the Megatron plan with
    MindSpeed-LLM's flags -> 06, and the trained model back through 03."""
    from kit.convert import ConvertConfig
    from kit.convert.result import run as convert_run
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare
    from kit.evaluate import EvalConfig
    from kit.evaluate import run as evaluate
    from kit.train import engine, train
    from kit.train.config import replace
    from kit.train.megatron import _dense_stage_problems, build
    from kit.train.resolve import resolve

    case = ROUTED[name]
    layers, dense = case["layers"], case["dense"]
    ws = get_workspace(tmp_path / "ws", model=f"tiny-{name}")
    src = str(request.getfixturevalue(case["fixture"]))
    # 02: the family's template (MindSpeed-LLM's --prompt-type); the sample tokenizer spells some special tokens
    # out, and 02 says so
    prep = prepare(
        DataConfig(kind="sft", name="alpaca", tokenizer=src, template=case["template"], max_length=64,
                   max_records=48, heldout_records=4),
        ws, progress=False,
    )  # fmt: skip
    data = prep.hf_dir
    (warning,) = [w for w in prep.report.warnings if case["template"] in w]
    assert case["spelled"] in warning  # the others are single tokens of the sample tokenizer
    data_man = read_manifest(data, expect=PREPARED_DATA)
    assert data_man["template"] == case["template"]
    assert (
        data_man["megatron_flags"][data_man["megatron_flags"].index("--prompt-type") + 1]
        == case["prompt_type"]
    )

    # 03: half the layers a stage (the MTP layer with the last), experts over two EP ranks, verified both ways
    conv = convert_run(ConvertConfig(source=src, tp=1, pp=2, ep=2), ws, progress=False)
    checks = conv.verify(scratch=tmp_path / "verify")
    assert checks["passed"], checks["table"]
    converted = read_manifest(conv.target, expect=CONVERTED_CHECKPOINT)
    model = converted["model"]
    assert converted["family"] == case["family"] and converted["ep"] == 2
    assert model["moe_layer_freq"] == [0] * dense + [1] * (layers - dense) and model["mtp_num_layers"] == 1
    assert model["moe_router_score_function"] == "sigmoid" and model["moe_router_enable_expert_bias"]
    for key, value in case.get("model", {}).items():
        assert model[key] == value, key

    # 04: LoRA with the default targets (kit.adapt.lora_targets turns them into MLA's projections for DeepSeek-V3),
    # the kit's attention, every MoE block through kit.ops.moe's grouped sigmoid routing
    reports, build_model = [], engine.build_model
    monkeypatch.setattr(
        engine, "build_model", lambda *a, **k: reports.append(build_model(*a, **k)) or reports[-1]
    )
    cfg = replace(_lora_config(f"tiny-{name}", src, data, ws, ATTENTION_TARGETS), lr=case["lr"])
    result = train(cfg, ws, progress=False)
    ((_, report),) = reports
    assert report.attention == "kit" and report.attention_modules == layers
    assert report.moe_blocks == layers - dense  # the MoE layers (transformers builds no MTP layer)
    assert result.status == "completed" and result.losses[-1] < result.losses[0], result.losses
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as fh:
        saved = [k for k in fh.keys() if "lora_" in k]
    assert len(saved) == layers * len(case["targets"]) * 2  # layers x targets x (A, B); not the MTP layer
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in saved} == set(case["targets"])
    run_man = read_manifest(result.output_dir, expect=TRAINING_RUN)
    biases = [_tensors(f, lambda k: k.endswith("e_score_correction_bias")) for f in (src, run_man["hf"])]
    mtp = [_tensors(f, lambda k: k.startswith(f"model.layers.{layers}.")) for f in (src, run_man["hf"])]
    assert len(biases[0]) == layers - dense + 1 and len(mtp[0]) > 20  # the MoE layers' and the MTP layer's
    for before, after in (
        biases,
        mtp,
    ):  # LoRA leaves the load-balancing biases and carries the MTP layer as it was
        assert sorted(after) == sorted(before)
        assert all(torch.equal(before[k], after[k]) for k in before)

    # the same run on Megatron/MindSpeed-LLM: the flags of MindSpeed-LLM's examples/mcore scripts, from 03
    plan = build(
        resolve(
            replace(cfg, engine="megatron", run_type="sft", model_path=str(conv.target), nproc_per_node=4), ws
        )
    )
    assert [p for p in plan.problems if not p.startswith("code folder")] == [], plan.problems
    flag = dict(zip(plan.argv, plan.argv[1:]))
    expected = {
        "--expert-model-parallel-size": "2", "--pipeline-model-parallel-size": "2", "--moe-ffn-hidden-size": "32",
        "--n-shared-experts": "1", "--first-k-dense-replace": str(dense), "--moe-layer-freq": "1",
        "--moe-router-load-balancing-type": "none", "--moe-router-dtype": "fp32",
        "--moe-router-score-function": "sigmoid", "--moe-router-topk-scaling-factor": "2.5",
        "--mtp-num-layers": "1", "--prompt-type": case["prompt_type"], **case["flags"],
    }  # fmt: skip
    assert {k: flag.get(k) for k in expected} == expected
    for present in ("--moe-router-enable-expert-bias", "--norm-topk-prob", *case["present"]):
        assert present in plan.argv, present
    assert "--moe-aux-loss-coeff" not in plan.argv and "--moe-router-pre-softmax" not in plan.argv
    # an aux loss asked for on Megatron is DeepSeek-V3's sequence-wise one (MindSpeed-LLM's deepseek3 scripts)
    aux = build(
        resolve(replace(cfg, engine="megatron", model_path=str(conv.target), router_aux_loss_coef=1e-4), ws)
    )
    aux_flag = dict(zip(aux.argv, aux.argv[1:]))
    assert aux_flag["--moe-aux-loss-coeff"] == "0.0001" and "--seq-aux" in aux.argv
    assert aux_flag["--moe-router-load-balancing-type"] == "none"
    # why these layer counts: with twice the dense layers, the first PP2 stage would be dense only
    (refused,) = _dense_stage_problems(plan.argv, 2 * dense, 2)
    assert "dense layers only" in refused and _dense_stage_problems(plan.argv, layers, 2) == []

    # 06: held-out dialogs, base vs trained
    ev = evaluate(EvalConfig(parts=["heldout"], engine="kit"), ws, progress=False)
    models = ev.results["models"]
    assert models["trained"]["heldout_tokens"] > 0
    assert models["trained"]["heldout_loss"] < models["base"]["heldout_loss"]

    # the exported (merged) model, MTP layer included, goes back through 03 and stays the same family
    back = convert_run(
        ConvertConfig(source=str(run_man["hf"]), target=str(tmp_path / "trained_ep2"), ep=2), progress=False
    )
    assert back.manifest["family"] == case["family"] and back.manifest["model"]["mtp_num_layers"] == 1
    assert back.verify(scratch=tmp_path / "verify2")["passed"]
