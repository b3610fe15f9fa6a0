"""TrainConfig resolution: explicit > environment > manifest > default, the source of every value, contradictions
(both values and sources shown), wrong-kind / manifest-less folders, and the training-run config loaded back."""

from __future__ import annotations

import json

import pytest
import test_train_helpers as H

from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    TRAINING_RUN,
    read_manifest,
    tokenizer_sha256,
    write_manifest,
)
from kit.errors import InputError
from kit.train.config import TrainConfig, from_dict, from_manifest, replace
from kit.train.resolve import ConfigConflictError, input_problems, resolve_values


@pytest.fixture()
def data(tmp_path, tiny_llama_dir):
    return H.prepared(tmp_path / "alpaca_hf", tiny_llama_dir)


def cfg_for(tmp_path, tiny_llama_dir, data, **kw):
    return TrainConfig(
        model_path=str(tiny_llama_dir), dataset_path=str(data), work_dir=str(tmp_path / "ws"), **kw
    )


def test_unset_values_are_inherited_from_the_data_manifest_with_their_source(tmp_path, tiny_llama_dir, data):
    cfg = resolve_values(cfg_for(tmp_path, tiny_llama_dir, data, lr=2e-4), environ={})
    assert (cfg.seq_len, cfg.template, cfg.pack, cfg.tokenizer_path) == (
        48,
        "chatml",
        True,
        str(tiny_llama_dir),
    )
    where = f"manifest {data.resolve()}"
    assert cfg.sources["seq_len"] == where and cfg.sources["template"] == where
    assert cfg.sources["tokenizer_path"] == where and cfg.sources["pack"] == where
    assert cfg.sources["lr"] == "explicit" and cfg.sources["gbs"] == "default"
    assert (cfg.tp, cfg.pp, cfg.sources["tp"]) == (1, 1, "default")
    assert set(cfg.sources) == {f for f in TrainConfig.__dataclass_fields__ if f != "sources"}


def test_an_explicit_value_equal_to_the_manifest_is_kept_as_explicit(tmp_path, tiny_llama_dir, data):
    cfg = resolve_values(cfg_for(tmp_path, tiny_llama_dir, data, seq_len=48), environ={})
    assert cfg.seq_len == 48 and cfg.sources["seq_len"] == "explicit"


def test_a_longer_seq_len_than_the_data_was_packed_for_shows_both_values_and_sources(
    tmp_path, tiny_llama_dir, data
):
    with pytest.raises(ConfigConflictError) as err:
        resolve_values(cfg_for(tmp_path, tiny_llama_dir, data, seq_len=512, template="llama3"), environ={})
    text = str(err.value)
    assert f"SEQ_LEN=512 (explicit) but max_length=48 (manifest {data.resolve()})" in text
    assert f"TEMPLATE='llama3' (explicit) but template='chatml' (manifest {data.resolve()})" in text
    assert isinstance(err.value, InputError)
    with pytest.raises(ConfigConflictError, match=r"SEQ_LEN=16 \(environment SEQ_LEN\) but max_length=48"):
        resolve_values(cfg_for(tmp_path, tiny_llama_dir, data), environ={"SEQ_LEN": "16"})


def test_another_tokenizer_than_the_datas_is_a_contradiction(tmp_path, tiny_llama_dir, data):
    other = tmp_path / "other_tok"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"model": "another"}')
    with pytest.raises(ConfigConflictError) as err:
        resolve_values(cfg_for(tmp_path, tiny_llama_dir, data, tokenizer_path=str(other)), environ={})
    text = str(err.value)
    assert f"TOKENIZER_PATH='{other}' (explicit)" in text and f"tokenizer='{tiny_llama_dir}'" in text
    assert tokenizer_sha256(tiny_llama_dir)[:12] in text


def test_environment_fills_only_what_was_not_given_and_beats_the_manifest(tmp_path, tiny_llama_dir, data):
    env = {"TRAIN_ITERS": "77", "MBS": "2", "GBS": "8", "MODEL_TYPE": "GLM3-6B", "LR": "5", "SEQ_LEN": "48"}
    cfg = resolve_values(cfg_for(tmp_path, tiny_llama_dir, data, train_iters=3), environ=env)
    assert (cfg.train_iters, cfg.sources["train_iters"]) == (3, "explicit")  # env does not beat explicit
    assert (cfg.mbs, cfg.gbs, cfg.sources["gbs"]) == (2, 8, "environment GBS")
    assert (cfg.model_name, cfg.sources["model_name"]) == ("GLM3-6B", "environment MODEL_TYPE")
    assert (cfg.seq_len, cfg.sources["seq_len"]) == (48, "environment SEQ_LEN")  # env beats the manifest
    assert cfg.lr == 1e-5  # LR is not one of the manual's variables: the environment does not set it


def test_bound_notebook_values_are_explicit_and_none_inherits(tmp_path, tiny_llama_dir, data):
    from kit.core.configs import bind

    params = {
        "TRAIN_ITERS": 200,
        "SEQ_LEN": None,
        "MODEL_PATH": str(tiny_llama_dir),
        "DATASET_PATH": str(data),
    }
    cfg = resolve_values(
        bind(TrainConfig, params, work_dir=str(tmp_path / "ws")), environ={"TRAIN_ITERS": "5"}
    )
    assert (cfg.train_iters, cfg.sources["train_iters"]) == (
        200,
        "explicit",
    )  # typed 200 = default, still wins
    assert cfg.seq_len == 48 and cfg.sources["seq_len"].startswith("manifest ")


def test_wrong_kind_folder_as_dataset_path_names_notebook_02(tmp_path, tiny_llama_dir):
    run = tmp_path / "a_run"
    run.mkdir()
    write_manifest(run, CONVERTED_CHECKPOINT, {k: None for k in ("direction", "family", "flavor", "tp", "pp",
                   "num_layer_list", "padded_vocab_size", "dtype", "model", "source", "tokenizer")})  # fmt: skip
    with pytest.raises(InputError) as err:
        resolve_values(cfg_for(tmp_path, tiny_llama_dir, run), environ={})
    assert "is a converted-checkpoint folder" in str(err.value) and "notebook 02" in str(err.value)


def test_folder_without_manifest_as_dataset_path_names_notebook_02(tmp_path, tiny_llama_dir):
    empty = tmp_path / "some_folder"
    empty.mkdir()
    with pytest.raises(InputError, match="has no kit_manifest.json.*notebook 02"):
        resolve_values(cfg_for(tmp_path, tiny_llama_dir, empty), environ={})
    problems = input_problems(cfg_for(tmp_path, tiny_llama_dir, empty))
    assert any(p.startswith("DATASET_PATH: ") and "no kit_manifest.json" in p for p in problems), problems


def test_tp_pp_layer_list_and_vocab_come_from_the_converted_checkpoint(tmp_path, tiny_llama_dir, data):
    ckpt = H.converted(tmp_path / "converted")
    base = TrainConfig(
        engine="megatron", model_path=str(ckpt), dataset_path=str(data), tokenizer_path=str(tiny_llama_dir),
        work_dir=str(tmp_path / "ws"), nproc_per_node=16, gbs=16,
    )  # fmt: skip
    cfg = resolve_values(base, environ={})
    assert (cfg.tp, cfg.pp, cfg.num_layer_list, cfg.padded_vocab_size) == (4, 4, [7, 8, 8, 7], 32000)
    assert (
        cfg.sources["tp"] == f"manifest {ckpt.resolve()}"
        and cfg.sources["num_layer_list"] == cfg.sources["tp"]
    )
    with pytest.raises(ConfigConflictError) as err:
        resolve_values(replace(base, pp=2), environ={"TP": "2"})
    text = str(err.value)
    assert f"TP=2 (environment TP) but tp=4 (manifest {ckpt.resolve()})" in text
    assert f"PP=2 (explicit) but pp=4 (manifest {ckpt.resolve()})" in text
    with pytest.raises(InputError, match="ENGINE='megatron'"):
        resolve_values(replace(base, engine="deepspeed"), environ={})


def test_model_type_keyword_is_the_workspace_model_name():
    assert TrainConfig(model_type="GLM3-6B").model_name == "GLM3-6B"
    with pytest.raises(TypeError, match="GLOBAL_BATCH"):
        TrainConfig(global_batch=3)


def test_resolved_config_round_trips_through_json_and_the_manifest(tmp_path, tiny_llama_dir, data):
    cfg = resolve_values(cfg_for(tmp_path, tiny_llama_dir, data, lr=3e-4), environ={"GBS": "4"})
    again = from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.sources == cfg.sources
    run = tmp_path / "run"
    run.mkdir()
    fields = dict.fromkeys(("data", "model", "checkpoints", "hf", "metrics", "log"))
    write_manifest(
        run, TRAINING_RUN, {**fields, "run_type": "sft", "config": cfg.to_dict(), "sources": cfg.sources}
    )
    assert from_manifest(run) == cfg and from_manifest(read_manifest(run)) == cfg
    with pytest.raises(InputError, match="expected a training-run folder"):
        from_manifest(data)
    # resolving the loaded config again changes nothing (a profiled or resumed run trains the same settings)
    assert resolve_values(from_manifest(run), environ={"GBS": "64", "SEQ_LEN": "48"}) == cfg


def test_cli_options_are_generated_from_the_config_and_typed_values_are_explicit(tmp_path):
    import argparse

    from kit.train import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(
        ["train", "run", "--train-iters", "9", "--num-layer-list", "7,8,8,7", "--no-adapt"]
    )
    cfg = cli._config(args)
    assert (cfg.train_iters, cfg.num_layer_list, cfg.adapt) == (9, [7, 8, 8, 7], False)
    assert cfg.given == {"train_iters", "num_layer_list", "adapt"}
    help_text = parser._subparsers._group_actions[0].choices["train"].format_help()
    assert "train" in help_text


def test_the_manuals_megatron_prefix_as_dataset_path_reads_the_folder_beside_it(
    tmp_path, tiny_llama_dir, data
):
    prefix = str(data.parent / "alpaca")  # DATASET_PATH as the manual's scripts take it
    cfg = resolve_values(cfg_for(tmp_path, tiny_llama_dir, prefix), environ={})
    assert cfg.seq_len == 48 and cfg.sources["seq_len"] == f"manifest {data.resolve()}"
    assert cfg.dataset_path == str(data.resolve()) and cfg.sources["dataset_path"] == "explicit"
