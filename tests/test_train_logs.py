"""Log parsing (kit and Megatron lines, HF train metrics), run comparison, and the Megatron/MindSpeed command plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.train import TrainConfig
from kit.train.logs import compare_runs, parse_line, parse_log, parse_train_metrics, plot_runs, summarize
from kit.train.megatron import build
from kit.train.metrics import format_line, tokens_per_second_per_card

FIXTURES = Path(__file__).parent / "fixtures" / "train"


def test_tokens_per_second_per_card_is_the_seed_formula():
    # GLM3-6B defaults: GBS 64, SEQ_LEN 8192, 8 cards, 4000 ms per iteration -> 16384 tokens/s/p
    assert tokens_per_second_per_card(64, 8192, 8, 4000.0) == pytest.approx(64 * 8192 / (8 * 4000.0) * 1000)
    assert tokens_per_second_per_card(64, 8192, 8, 4000.0) == pytest.approx(16384.0)
    assert tokens_per_second_per_card(64, 8192, 8, 0.0) == 0.0


def test_megatron_fixture_parses_with_computed_throughput():
    df = parse_log(FIXTURES / "megatron_glm3_pretrain.log", seq_len=8192, cards=16)
    assert list(df["iteration"]) == [1, 2, 3, 4, 5, 6]
    assert df["loss"].iloc[0] == pytest.approx(3.1021) and df["loss"].iloc[-1] == pytest.approx(2.5987)
    assert df["elapsed_ms"].iloc[1] == pytest.approx(4210.3)
    assert df["lr"].iloc[2] == pytest.approx(3.75e-6) and df["gbs"].iloc[0] == 128
    assert df["grad_norm"].iloc[0] == pytest.approx(4.723)
    assert df["tflops_per_card"].iloc[0] == pytest.approx(181.3)
    assert df["tokens_per_s_per_card"].iloc[1] == pytest.approx(128 * 8192 / (16 * 4210.3) * 1000)
    assert df["samples_per_s"].iloc[1] == pytest.approx(128 / 4.2103)
    s = summarize(df)
    assert s["iterations"] == 6 and s["first_loss"] == pytest.approx(3.1021)
    assert s["elapsed_ms_mean"] == pytest.approx(
        sum([4210.3, 4198.7, 4201.9, 4188.2, 4195.0]) / 5
    )  # warm-up skipped


def test_kit_line_round_trips_and_restart_keeps_the_later_line():
    rec = {
        "iteration": 7,
        "consumed_samples": 28,
        "elapsed_ms": 123.45,
        "lr": 2.5e-4,
        "gbs": 4,
        "loss": 3.25,
        "grad_norm": 0.5,
        "tokens_per_s_per_card": 1037.1,
        "samples_per_s": 32.41,
    }
    line = format_line(rec, train_iters=10)
    parsed = parse_line(line)
    assert parsed["iteration"] == 7 and parsed["train_iters"] == 10 and parsed["loss"] == pytest.approx(3.25)
    assert parsed["tokens_per_s_per_card"] == pytest.approx(1037.1) and parsed["grad_norm"] == pytest.approx(
        0.5
    )
    assert parse_line("saving checkpoint at iteration       5 to /x") is None
    again = format_line(dict(rec, loss=3.0), train_iters=10)
    df = parse_log(line + "\nresumed from ...\n" + again + "\n")
    assert len(df) == 1 and df["loss"].iloc[0] == pytest.approx(3.0)


def test_hf_train_metrics_and_side_by_side_table(tmp_path):
    base = parse_train_metrics(FIXTURES / "hf_train_metrics_baseline.txt")
    assert base["train_runtime"] == pytest.approx(2 * 3600 + 15 * 60 + 20.44)
    assert base["train_samples_per_second"] == pytest.approx(12.61) and base["train_loss"] == pytest.approx(
        3.0146
    )
    df = parse_log(FIXTURES / "megatron_glm3_pretrain.log", seq_len=8192, cards=16)
    faster = df.assign(elapsed_ms=df["elapsed_ms"] / 2, samples_per_s=df["samples_per_s"] * 2)
    table = compare_runs({"baseline": df, "tuned": faster})
    assert table.loc["tuned", "speed_vs_baseline"] == pytest.approx(2.0)
    fig = plot_runs({"baseline": df, "tuned": faster}, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 5000 and len(fig.axes) == 2


def test_kit_log_written_by_the_trainer_parses(tmp_path, tiny_llama_dir):
    import test_train_helpers as H

    from kit.train import train

    data = H.make_pretrain(tmp_path / "p_hf", num_samples=8)
    result = train(
        H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", train_iters=3, log_interval=2), progress=False
    )
    df = parse_log(result.log_path)
    assert list(df["iteration"]) == [2]  # LOG_INTERVAL=2: only iteration 2 printed
    jsonl = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert df["loss"].iloc[0] == pytest.approx(jsonl[1]["loss"], rel=1e-6)


def _megatron_tree(tmp_path: Path, tiny_llama_dir: Path, tp: int, pp: int) -> tuple:
    code = tmp_path / "ws" / "llm_train" / "AscendSpeed"
    (code / "ModelLink").mkdir(parents=True)
    (code / "ModelLink" / "pretrain_gpt.py").write_text("# stand-in for the code package's entry point\n")
    (code / "scripts" / "glm3").mkdir(parents=True)
    (code / "scripts" / "glm3" / "glm3_base.sh").write_text("#!/bin/sh\n")
    data = tmp_path / "data" / "alpaca_text_document"
    data.parent.mkdir()
    for ext in (".bin", ".idx"):
        Path(str(data) + ext).write_bytes(b"\0")
    ckpt = tmp_path / "converted"
    for t in range(tp):
        for p in range(pp):
            (ckpt / "iter_0000001" / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")).mkdir(
                parents=True
            )
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    return code, str(data), str(ckpt)


def test_megatron_pretrain_command_is_built_and_validated(tmp_path, tiny_llama_dir):
    code, data, ckpt = _megatron_tree(tmp_path, tiny_llama_dir, tp=2, pp=2)
    cfg = TrainConfig(
        engine="megatron",
        run_type="pretrain",
        model_type="tiny",
        model_path=str(tiny_llama_dir),
        dataset_path=data,
        work_dir=str(tmp_path / "ws"),
        tp=2,
        pp=2,
        nproc_per_node=4,
        mbs=1,
        gbs=8,
        seq_len=4096,
        train_iters=200,
    )
    plan = build(cfg, load=ckpt)
    assert plan.problems == [], plan.problems
    argv = plan.argv
    assert argv[0] == "torchrun" and "pretrain_gpt.py" in argv and plan.cwd == code / "ModelLink"
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--tensor-model-parallel-size"] == "2" and flag["--pipeline-model-parallel-size"] == "2"
    assert flag["--global-batch-size"] == "8" and flag["--seq-length"] == "4096"
    assert flag["--num-query-groups"] == "2" and flag["--data-path"] == data and flag["--load"] == ckpt
    assert "--untie-embeddings-and-output-weights" in argv and "--no-load-optim" in argv
    assert plan.env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    # the wrong layout, data suffix and TP are all reported at once
    bad = build(
        TrainConfig(**{**cfg.__dict__, "tp": 4, "dataset_path": data + ".bin", "nproc_per_node": 8}),
        load=ckpt,
    )
    text = "\n".join(bad.problems)
    assert (
        "TP=4 must divide" in text
        and "`<name>_text_document` prefix" in text
        and "needs ['mp_rank_00_000'" in text
    )


def test_megatron_script_plan_uses_the_seed_variables(tmp_path, tiny_llama_dir):
    code, data, _ = _megatron_tree(tmp_path, tiny_llama_dir, tp=1, pp=1)
    cfg = TrainConfig(
        engine="megatron",
        run_type="pretrain",
        model_type="GLM3-6B",
        dataset_path=data,
        tokenizer_path=str(tiny_llama_dir),
        work_dir=str(tmp_path / "ws"),
        tp=2,
        pp=4,
        nproc_per_node=8,
        mbs=1,
        gbs=64,
        seq_len=8192,
        train_iters=200,
    )
    plan = build(cfg, script="scripts/glm3/glm3_base.sh")
    assert plan.problems == [] and plan.argv == ["sh", "scripts/glm3/glm3_base.sh"] and plan.cwd == code
    assert plan.env == {
        "MODEL_TYPE": "GLM3-6B",
        "RUN_TYPE": "pretrain",
        "DATASET_PATH": data,
        "TOKENIZER_PATH": str(tiny_llama_dir),
        "TRAIN_ITERS": "200",
        "MBS": "1",
        "GBS": "64",
        "TP": "2",
        "PP": "4",
        "SEQ_LEN": "8192",
        "WORK_DIR": str((tmp_path / "ws").resolve()),
    }
    assert plan.describe().startswith(f"cd {code} && MODEL_TYPE=GLM3-6B RUN_TYPE=pretrain")
    two = build(
        TrainConfig(**{**cfg.__dict__, "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "gbs": 128}),
        script="scripts/glm3/glm3_base.sh",
    )
    assert (two.env["MASTER_ADDR"], two.env["NNODES"], two.env["NODE_RANK"]) == ("10.0.0.1", "2", "1")
    missing = build(cfg, script="scripts/glm3/nope.sh", code_dir=str(tmp_path / "absent"))
    assert any("AscendCloud-3rdLLM" in p for p in missing.problems)


def test_cli_log_prints_summary(tmp_path, capsys):
    from kit.__main__ import main

    out_csv = tmp_path / "m.csv"
    rc = main(
        [
            "train",
            "log",
            str(FIXTURES / "megatron_glm3_pretrain.log"),
            "--seq-len",
            "8192",
            "--cards",
            "16",
            "--csv",
            str(out_csv),
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["iterations"] == 6 and summary["tokens_per_s_per_card"] > 0
    assert out_csv.read_text().splitlines()[0].startswith("iteration,")


def test_megatron_plan_finds_the_prefix_beside_a_kit_dataset(tmp_path, tiny_llama_dir):
    import test_train_helpers as H

    hf = H.make_sft(tmp_path / "alpaca_hf", num_samples=2)
    for key in ("input_ids", "attention_mask", "labels"):
        for ext in ("bin", "idx"):
            (tmp_path / f"alpaca_packed_{key}_document.{ext}").write_bytes(b"\0")
    cfg = TrainConfig(
        engine="megatron",
        run_type="sft",
        model_type="tiny",
        model_path=str(tiny_llama_dir),
        dataset_path=str(hf),
        work_dir=str(tmp_path / "ws"),
        seq_len=48,
        gbs=2,
    )
    plan = build(cfg)
    assert plan.argv[plan.argv.index("--data-path") + 1] == str(tmp_path / "alpaca")
    assert "posttrain_gpt.py" in plan.argv and "--is-instruction-dataset" in plan.argv
    assert not any("data file" in p for p in plan.problems), plan.problems
    script = build(cfg, script="scripts/x.sh")
    assert script.env["DATASET_PATH"] == str(tmp_path / "alpaca")
    assert script.env["TOKENIZER_PATH"] == str(tiny_llama_dir)
