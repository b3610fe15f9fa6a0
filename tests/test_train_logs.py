"""Log parsing (kit and Megatron lines, HF train metrics), run comparison, and the Megatron/MindSpeed command plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.train.logs import compare_runs, parse_line, parse_log, parse_train_metrics, plot_runs, summarize
from kit.train.metrics import format_line, tokens_per_second_per_card

FIXTURES = Path(__file__).parent / "fixtures" / "train"


def test_tokens_per_second_per_card_is_the_manuals_formula():
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


def test_a_dpo_runs_steps_are_a_table_of_trls_metrics_and_one_sentence(tmp_path):
    """preference_table reads metrics.jsonl (a restarted step's later record wins); preference_report's sentence says
    where the run started (its manifest, else MODEL_PATH) and where its last step stands."""
    from types import SimpleNamespace

    from kit.train.logs import preference_report, preference_table

    steps = [
        {"iteration": 1, "loss": 0.6931, "rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/accuracies": 0.0,
         "rewards/margins": 0.0, "logps/chosen": -20.0, "logps/rejected": -22.0},
        {"iteration": 2, "loss": 0.9, "rewards/chosen": 0.5, "rewards/rejected": 0.1, "rewards/accuracies": 0.0,
         "rewards/margins": 0.4, "logps/chosen": -19.0, "logps/rejected": -21.0},
        {"iteration": 2, "loss": 0.6, "rewards/chosen": 0.05, "rewards/rejected": -0.1, "rewards/accuracies": 0.5,
         "rewards/margins": 0.15, "logps/chosen": -19.5, "logps/rejected": -23.0},
    ]  # fmt: skip
    path = tmp_path / "dpo.metrics.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
    table = preference_table(path)
    assert list(table.index) == [1, 2] and list(table.columns)[:5] == [
        "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"
    ]  # fmt: skip
    assert table.loc[2, "rewards/margins"] == 0.15 and table.loc[2, "logps/rejected"] == -23.0
    result = SimpleNamespace(
        metrics_path=path, manifest=None, status="completed", dpo={"reference": "precompute"},
        config=SimpleNamespace(model_path="/m/sft/hf"),
    )  # fmt: skip
    sentence, shown = preference_report(result)
    assert str(sentence) == (
        "DPO from /m/sft/hf (precompute reference), 2 steps, completed: step 1 compares the model with itself "
        "(loss 0.693, margin +0.000); step 2: loss 0.600, rewards/accuracies 0.50, rewards/margins +0.150 "
        "(chosen +0.050, rejected -0.100)."
    )
    assert shown.equals(table)
