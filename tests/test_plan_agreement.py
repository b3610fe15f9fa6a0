"""The planner against real training steps of the kit's trainer on CPU: predicted peak tensor memory within 5 % of
the measured (tests/plan_measure.py measures without the planner's tracer)."""

from __future__ import annotations

import plan_measure as M
import pytest


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    llama = M.small_llama(root / "llama")
    return {
        "llama": llama,
        "moe": M.small_moe(root / "moe", llama),
        "pretrain": M.pretrain(root / "pretrain"),
        "sft": M.full_target_sft(root / "sft"),
    }


@pytest.mark.parametrize(
    "model, zero, lora",
    [
        ("llama", 0, False),
        ("llama", 0, True),
        ("moe", 0, False),
        ("llama", 1, False),
        ("llama", 2, False),
        ("llama", 3, False),
        ("moe", 3, False),
    ],
    ids=["dense-zero0", "lora-zero0", "moe-zero0", "dense-zero1", "dense-zero2", "dense-zero3", "moe-zero3"],
)
def test_predicted_peak_is_within_5_percent_of_the_kit_trainers(inputs, tmp_path, model, zero, lora):
    data = inputs["sft" if lora else "pretrain"]
    measured = M.measured_peak(inputs[model], data, tmp_path / "ws", zero=zero, lora=lora)
    memory = M.predicted(inputs[model], zero=zero, lora_r=8 if lora else 0)
    assert memory.tensors == pytest.approx(measured, rel=0.05), (memory.terms(), measured)
