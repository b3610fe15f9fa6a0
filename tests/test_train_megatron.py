"""The Megatron/MindSpeed plan takes 03's converted checkpoint and 02's data through their manifests: TP/PP/layer
list/padded vocab inherited and checked with kit.core.parallel, data prefix and flags from the data manifest, model facts
through the family maps (ChatGLM3, Baichuan2), the manual's variables for the AscendCloud scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_train_helpers as H
from fixtures.convert import models as convert_models

from kit.train.config import TrainConfig, replace
from kit.train.megatron import build
from kit.train.resolve import ConfigConflictError, resolve

tiny_glm_dir = convert_models.tiny_glm_dir  # shared session fixtures
tiny_baichuan_dir = convert_models.tiny_baichuan_dir


def code_package(root: Path) -> Path:
    code = root / "llm_train" / "AscendSpeed"
    (code / "ModelLink").mkdir(parents=True)
    for entry in ("pretrain_gpt.py", "posttrain_gpt.py"):
        (code / "ModelLink" / entry).write_text("# stand-in for the code package's entry point\n")
    (code / "scripts" / "glm3").mkdir(parents=True)
    (code / "scripts" / "glm3" / "glm3_base.sh").write_text("#!/bin/sh\n")
    return code


def megatron_data(folder: Path, tokenizer: Path, kind: str, **fields) -> Path:
    """A prepared-data folder with its Megatron files, as notebook 02 writes them (megatron=True)."""
    name = folder.name[: -len("_hf")]
    if kind == "pretrain":
        prefix = str(folder.parent / f"{name}_text_document")
        files = [prefix + ".bin", prefix + ".idx"]
        flags = []
    else:
        prefix = str(folder.parent / name)
        files = [f"{prefix}_packed_{k}_document.{e}" for k in ("input_ids", "labels") for e in ("bin", "idx")]
        flags = ["--reset-attention-mask", "--neat-pack"]
    folder.parent.mkdir(parents=True, exist_ok=True)
    for f in files:
        Path(f).write_bytes(b"\0")
    fields.setdefault("max_length", 64)
    return H.prepared(folder, tokenizer, kind=kind, megatron_prefix=prefix, megatron_flags=flags, **fields)


def flags_of(argv: list) -> dict:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def test_sft_plan_loads_the_converted_checkpoint_with_its_7887_layer_list(tmp_path, tiny_llama_dir):
    ws = tmp_path / "ws"
    code = code_package(ws)
    ckpt = H.converted(tmp_path / "converted", tp=4, pp=4, layer_list=(7, 8, 8, 7))
    data = megatron_data(tmp_path / "data" / "alpaca_hf", tiny_llama_dir, "sft")
    cfg = TrainConfig(
        engine="megatron", run_type="sft", model_name="tiny", model_path=str(ckpt), dataset_path=str(data),
        work_dir=str(ws), nproc_per_node=16, gbs=16,
    )  # fmt: skip
    plan = build(resolve(cfg))
    assert plan.problems == [], plan.problems
    argv, flag = plan.argv, flags_of(plan.argv)
    assert "posttrain_gpt.py" in argv and plan.cwd == code / "ModelLink"
    assert flag["--tensor-model-parallel-size"] == "4" and flag["--pipeline-model-parallel-size"] == "4"
    assert flag["--num-layer-list"] == "7,8,8,7" and flag["--num-layers"] == "30"
    assert flag["--padded-vocab-size"] == "32000" and flag["--num-query-groups"] == "4"
    assert flag["--seq-length"] == "64"  # inherited from the data manifest
    assert flag["--data-path"] == str(tmp_path / "data" / "alpaca") and flag["--load"] == str(ckpt.resolve())
    assert "--reset-attention-mask" in argv and "--neat-pack" in argv  # the data manifest's flags
    assert "--no-load-optim" in argv and plan.env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"


def test_layout_problems_come_from_kit_parallel_and_the_checkpoint(tmp_path, tiny_llama_dir):
    ws = tmp_path / "ws"
    code_package(ws)
    # a checkpoint whose manifest says TP2 PP2 but whose rank folders are TP1 PP1, for a model of 3 heads
    ckpt = H.converted(tmp_path / "converted", tp=1, pp=1, layer_list=(30,))
    man = json.loads((ckpt / "kit_manifest.json").read_text())
    man["fields"].update(tp=2, pp=2, num_layer_list=[15, 15])
    man["fields"]["model"].update(num_heads=3, num_attention_heads=3, num_groups=3, num_kv_groups=3)
    (ckpt / "kit_manifest.json").write_text(json.dumps(man))
    data = megatron_data(tmp_path / "data" / "corpus_hf", tiny_llama_dir, "pretrain")
    cfg = TrainConfig(
        engine="megatron", run_type="pretrain", model_path=str(ckpt), dataset_path=str(data), work_dir=str(ws),
        nproc_per_node=4, gbs=4,
    )  # fmt: skip
    text = "\n".join(build(resolve(cfg)).problems)
    assert "tensor parallel size 2 does not divide the 3 attention heads" in text
    assert "needs ['mp_rank_00_000'" in text
    dense = "\n".join(build(resolve(replace(cfg, router_aux_loss_coef=0.01))).problems)
    assert "ROUTER_AUX_LOSS_COEF=0.01 is set, but this model has no experts" in dense
    # a TP the checkpoint was not converted with: both values and where each came from, nothing else checked
    with pytest.raises(ConfigConflictError, match=r"TP=4 \(explicit\) but tp=2 \(manifest"):
        resolve(replace(cfg, tp=4))


def test_chatglm3_and_baichuan2_configs_through_the_builder(tmp_path, tiny_glm_dir, tiny_baichuan_dir):
    ws = tmp_path / "ws"
    code_package(ws)
    for model, family in ((tiny_glm_dir, "chatglm"), (tiny_baichuan_dir, "baichuan")):
        conf = json.loads((Path(model) / "config.json").read_text())
        data = megatron_data(
            tmp_path / family / "corpus_hf", model, "pretrain", tokenizer_sha256=None, max_length=32
        )
        cfg = TrainConfig(
            engine="megatron", run_type="pretrain", model_path=str(model), dataset_path=str(data),
            work_dir=str(ws), gbs=4,
        )  # fmt: skip
        plan = build(
            resolve(cfg)
        )  # ChatGLM3's config has no num_hidden_layers: the family map reads num_layers
        assert plan.problems == [], (family, plan.problems)
        flag = flags_of(plan.argv)
        layers = conf.get("num_layers", conf.get("num_hidden_layers"))
        assert flag["--num-layers"] == str(layers) and flag["--hidden-size"] == str(conf["hidden_size"])
        if family == "chatglm":
            assert (
                flag["--num-query-groups"] == str(conf["multi_query_group_num"])
                and "--add-qkv-bias" in plan.argv
            )


def test_script_plan_passes_the_manuals_variables(tmp_path, tiny_llama_dir):
    ws = tmp_path / "ws"
    code = code_package(ws)
    data = megatron_data(tmp_path / "data" / "corpus_hf", tiny_llama_dir, "pretrain", max_length=8192)
    cfg = TrainConfig(
        engine="megatron", run_type="pretrain", model_name="GLM3-6B", model_path=str(tiny_llama_dir),
        dataset_path=str(data), work_dir=str(ws), tp=2, pp=4, nproc_per_node=8, gbs=64, train_iters=200,
    )  # fmt: skip
    plan = build(resolve(cfg), script="scripts/glm3/glm3_base.sh")
    assert plan.problems == [] and plan.argv == ["sh", "scripts/glm3/glm3_base.sh"] and plan.cwd == code
    assert plan.env == {
        "MODEL_TYPE": "GLM3-6B",
        "RUN_TYPE": "pretrain",
        "DATASET_PATH": str(tmp_path / "data" / "corpus_text_document"),
        "TOKENIZER_PATH": str(tiny_llama_dir),
        "TRAIN_ITERS": "200",
        "MBS": "1",
        "GBS": "64",
        "TP": "2",
        "PP": "4",
        "SEQ_LEN": "8192",
        "WORK_DIR": str(ws.resolve()),
    }
    assert plan.describe().startswith(f"cd {code} && MODEL_TYPE=GLM3-6B RUN_TYPE=pretrain")
    two = build(
        resolve(replace(cfg, nnodes=2, node_rank=1, master_addr="10.0.0.1", gbs=128)),
        script="scripts/glm3/glm3_base.sh",
    )
    assert (two.env["MASTER_ADDR"], two.env["NNODES"], two.env["NODE_RANK"]) == ("10.0.0.1", "2", "1")
    missing = build(resolve(cfg), script="scripts/glm3/nope.sh", code_dir=str(tmp_path / "absent"))
    assert any("AscendCloud-3rdLLM" in p for p in missing.problems)


def test_data_without_megatron_files_is_a_problem_naming_notebook_02(tmp_path, tiny_llama_dir):
    data = H.prepared(tmp_path / "alpaca_hf", tiny_llama_dir)  # megatron_prefix None
    cfg = TrainConfig(
        engine="megatron", run_type="pretrain", model_path=str(tiny_llama_dir), dataset_path=str(data),
        work_dir=str(tmp_path / "ws"), gbs=4,
    )  # fmt: skip
    assert any("MEGATRON=True" in p and "notebook 02" in p for p in build(resolve(cfg)).problems)


def test_megatron_plan_defaults_to_notebook_03s_checkpoint_in_the_workspace(tmp_path, tiny_llama_dir):
    from kit.core.workspace import get_workspace

    ws = get_workspace(tmp_path / "ws", model="tiny")
    code_package(ws.root)
    ckpt = H.converted(ws.converted_weights / "tp4pp4_local", tp=4, pp=4, layer_list=(7, 8, 8, 7))
    data = megatron_data(ws.data_finetune / "alpaca_hf", tiny_llama_dir, "sft")
    cfg = TrainConfig(
        engine="megatron", run_type="sft", tokenizer_path=str(tiny_llama_dir), nproc_per_node=16, gbs=16
    )
    plan = build(resolve(cfg, ws))  # no MODEL_PATH, no DATASET_PATH: 03's and 02's outputs in the workspace
    assert plan.problems == [], plan.problems
    flag = flags_of(plan.argv)
    assert flag["--load"] == str(ckpt.resolve()) and flag["--data-path"] == str(ws.data_finetune / "alpaca")
    assert flag["--num-layer-list"] == "7,8,8,7" and data.is_dir()


@pytest.fixture(scope="module")
def megatron_pairs(tmp_path_factory):
    """Notebook 02's preference pairs with their MindSpeed-LLM pairwise files (the real data stage)."""
    from kit.data import DataConfig, prepare

    out = tmp_path_factory.mktemp("pairs")
    return prepare(DataConfig(kind="dpo", out_dir=str(out), max_length=64, template="chatml"), progress=False)


def _dpo_cfg(tmp_path, data, **kw) -> TrainConfig:
    ws = tmp_path / "ws"
    code_package(ws)
    ckpt = H.converted(tmp_path / "converted", tp=2, pp=2, layer_list=(15, 15))
    values = dict(
        engine="megatron", run_type="dpo", model_name="tiny", model_path=str(ckpt), dataset_path=str(data),
        work_dir=str(ws), nproc_per_node=4, gbs=4, mbs=2, dpo_beta=0.2, dpo_label_smoothing=0.1,
    )  # fmt: skip
    values.update(kw)
    return TrainConfig(**values)


def test_dpo_plan_is_mindspeed_llms_stage_dpo_on_the_pairwise_files(tmp_path, megatron_pairs):
    plan = build(resolve(_dpo_cfg(tmp_path, megatron_pairs.hf_dir)))
    assert plan.problems == [], plan.problems
    argv, flag = plan.argv, flags_of(plan.argv)
    ckpt = str((tmp_path / "converted").resolve())
    assert argv[argv.index("posttrain_gpt.py") - 1].startswith("--master_port")
    i = argv.index("--stage")
    assert argv[i - 1 : i + 11] == [
        "--finetune", "--stage", "dpo", "--is-pairwise-dataset", "--dpo-loss-type", "sigmoid",
        "--dpo-beta", "0.2", "--dpo-label-smoothing", "0.1", "--ref-model", ckpt,
    ]  # fmt: skip
    assert flag["--load"] == ckpt and flag["--data-path"] == megatron_pairs.megatron_prefix
    assert flag["--prompt-type"] == "chatml" and flag["--seq-length"] == "64"
    assert flag["--micro-batch-size"] == "2" and flag["--global-batch-size"] == "4"
    for absent in ("--is-instruction-dataset", "--pref-ftx", "--lora-r", "--neat-pack", "--refer-model-iter"):
        assert absent not in argv, absent
    lora = build(resolve(_dpo_cfg(tmp_path / "lora", megatron_pairs.hf_dir, dpo_lora=True, lora_r=4)))
    assert lora.problems == [] and flags_of(lora.argv)["--lora-r"] == "4" and "dpo" in lora.argv


def test_dpo_settings_mindspeed_llm_cannot_run_are_refused(tmp_path, tiny_llama_dir, megatron_pairs):
    cfg = _dpo_cfg(tmp_path, megatron_pairs.hf_dir, dpo_sft_weight=0.5, dpo_reference="precompute")
    problems = build(resolve(cfg)).problems
    assert len(problems) == 2, problems
    assert problems[0].startswith("DPO_SFT_WEIGHT=0.5: MindSpeed-LLM's --pref-ftx averages")
    assert problems[1].startswith("DPO_REFERENCE='precompute' has no MindSpeed-LLM counterpart")
    sft = megatron_data(tmp_path / "data" / "alpaca_hf", tiny_llama_dir, "sft")
    problems = build(resolve(_dpo_cfg(tmp_path / "sft", sft, dataset_path=str(sft)))).problems
    assert any("holds 'sft' data; RUN_TYPE=dpo trains on preference pairs" in p for p in problems), problems
