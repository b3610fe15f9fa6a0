"""No number from a broken model: NaN / inf weights are found at load by convert and evaluate (one line naming the
tensor and the file), a damaged shard is named, and NaN scores show as "invalid", never as an accuracy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kit.convert.weights_check import (
    NonFiniteWeights,
    StreamCheck,
    check_hf_weights,
    check_model,
    count_nonfinite,
    weight_files,
)
from kit.errors import IntegrityError

BROKEN = "model.layers.0.mlp.down_proj.weight"


def _shard_of(folder: Path, key: str) -> Path:
    from safetensors import safe_open

    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            if key in fh.keys():
                return f
    raise KeyError(key)


def _poison(src: Path, dst: Path, value: float = float("nan")) -> Path:
    """A copy of the HF folder `src` with one element of BROKEN set to `value`; returns the shard changed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    shard = _shard_of(dst, BROKEN)
    tensors = load_file(str(shard))
    tensors[BROKEN][1, 2] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory, tiny_llama_dir) -> Path:
    dst = tmp_path_factory.mktemp("broken") / "trained"
    _poison(tiny_llama_dir, dst)
    return dst


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_count_nonfinite_reads_the_exponent_bits_of_every_float_dtype(dtype):
    import torch

    t = torch.tensor(
        [0.0, 1.5, -2.0, float("nan"), float("inf"), -float("inf"), 3.0e-8], dtype=getattr(torch, dtype)
    )
    raw = t.view(torch.uint8).numpy() if dtype != "bfloat16" else t.view(torch.int16).numpy().view("uint8")
    assert count_nonfinite(raw, dtype) == 3
    assert count_nonfinite(torch.arange(5, dtype=torch.int32).view(torch.uint8).numpy(), "int32") == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_stream_check_counts_what_passes_in_writes_of_any_size(dtype):
    """The converters' check: the bytes reach the sink unchanged, and the count is the file check's whatever the
    writes' sizes (elements split between writes included)."""
    import torch

    t = torch.linspace(-3, 3, 1001, dtype=torch.float64).to(getattr(torch, dtype))
    t[[0, 500, 1000]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=t.dtype)
    raw = bytes(t.view(torch.uint8).numpy())
    got = []

    class Sink:
        def write(self, mv):
            got.append(bytes(mv))

    check = StreamCheck("f.pt")
    watched = check.watch(Sink(), dtype)
    at = 0
    for n in [3, 1, 5, 64, 7, 1000, 2]:  # odd sizes: elements cross the writes
        watched.write(memoryview(raw[at : at + n]))
        at += n
    watched.write(memoryview(raw[at:]))
    assert b"".join(got) == raw and check.done("w", watched) == 3 == count_nonfinite(
        t.view(torch.uint8).numpy(), dtype
    )
    assert check.bad == [("f.pt", "w", 3, 1001)]
    assert check.watch(Sink(), "int64").__class__ is Sink  # integers are not counted
    with pytest.raises(
        NonFiniteWeights, match=r"^out \(f\.pt\): tensor 'w' holds 3 NaN/inf value\(s\) of 1001"
    ):
        raise check.error("out")


def test_one_nan_or_inf_is_named_with_its_tensor_and_file(tmp_path, tiny_llama_dir, nan_model):
    assert check_hf_weights(tiny_llama_dir) > 0
    shard = _shard_of(nan_model, BROKEN)
    with pytest.raises(NonFiniteWeights, match=rf"{shard}: tensor '{BROKEN}' holds 1 NaN/inf value"):
        check_hf_weights(nan_model)
    inf = tmp_path / "inf"
    _poison(tiny_llama_dir, inf, float("-inf"))
    with pytest.raises(NonFiniteWeights, match=BROKEN):
        check_hf_weights(inf)
    # a model in memory (what a server holds): the same check through torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(nan_model))
    with pytest.raises(NonFiniteWeights, match=rf"served: tensor '{BROKEN}'"):
        check_model(model, "served")


def test_convert_refuses_nan_weights_in_both_directions(
    tmp_path, tiny_llama_dir, nan_model, monkeypatch, capsys
):
    import importlib

    from kit.__main__ import main
    from kit.convert import ConvertConfig
    from kit.convert import run as convert

    conv = importlib.import_module("kit.convert.convert")  # the package exports a function of that name
    target = tmp_path / "mg"
    code = main(
        ["convert", "--source", str(nan_model), "--target", str(target), "--direction", "hf_to_megatron"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and err[-1].startswith("error: ")
        and f"tensor '{BROKEN}'" in err[-1]
        and "safetensors" in err[-1]
    )
    assert not target.exists()
    # a Megatron checkpoint that holds the NaN (written with the check switched off) is refused on the way back
    monkeypatch.setattr(conv.StreamCheck, "watch", lambda self, sink, dtype: sink)
    convert(
        ConvertConfig(source=str(nan_model), target=str(target), direction="hf_to_megatron"), progress=False
    )
    monkeypatch.undo()
    with pytest.raises(
        NonFiniteWeights, match=rf"{target} re-sharded \(iter_.*\): tensor '.*layers\.0\.mlp\."
    ):
        convert(
            ConvertConfig(
                source=str(target), target=str(tmp_path / "tp2"), tp=2, direction="megatron_to_megatron"
            ),
            progress=False,
        )
    back = tmp_path / "hf"
    with pytest.raises(NonFiniteWeights, match=rf"{target}, converted \(.*\): tensor '{BROKEN}'"):
        convert(
            ConvertConfig(source=str(target), target=str(back), direction="megatron_to_hf"), progress=False
        )
    assert not back.exists()


def test_convert_names_what_a_cast_made_infinite_and_checks_the_tensors_it_leaves_out(
    tmp_path, tiny_llama_dir
):
    """The conversion checks the bytes it writes: a value finite in the source that a cast to float16 makes
    infinite is refused, naming the Megatron tensor; a tensor the key map leaves out is still checked."""
    import torch
    from safetensors.torch import load_file, save_file

    from kit.convert import ConvertConfig
    from kit.convert import run as convert

    big = tmp_path / "big"
    _poison(tiny_llama_dir, big, 1.0e5)  # above float16's largest finite value (65504)
    target = tmp_path / "mg16"
    with pytest.raises(
        NonFiniteWeights,
        match=r"converted to iter_0000001/mp_rank_00/model_optim_rng\.pt \(.*\): tensor '.*layers\.0\.mlp\.\S+' "
        r"holds 1 NaN/inf value.* casting to float16 overflows",
    ):
        convert(ConvertConfig(source=str(big), target=str(target), dtype="float16"), progress=False)
    assert not target.exists()
    convert(
        ConvertConfig(source=str(big), target=str(target), dtype="bfloat16"), progress=False
    )  # finite there

    dropped = tmp_path / "dropped"
    shutil.copytree(tiny_llama_dir, dropped)
    shard = _shard_of(dropped, BROKEN)
    tensors = load_file(str(shard))
    key = "model.layers.0.self_attn.rotary_emb.inv_freq"  # a buffer the llama map ignores, not converted
    tensors[key] = torch.tensor([1.0, float("nan"), 0.5])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeights, match=rf"{shard}: tensor '{key}' holds 1 NaN/inf value"):
        convert(ConvertConfig(source=str(dropped), target=str(tmp_path / "mg")), progress=False)
    assert not (tmp_path / "mg").exists()


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, tiny_llama_dir, nan_model):
    """A workspace whose training run "trained" the NaN model from the intact tiny one."""
    from fixtures.training_run import tiny_training_run

    from kit.core.workspace import get_workspace

    root = tmp_path_factory.mktemp("nanrun")
    run_dir = tiny_training_run(root / "ws", tiny_llama_dir, nan_model)
    return get_workspace(root / "ws", model="tiny"), run_dir


def test_evaluate_names_the_nan_tensor_and_a_damaged_shard(nan_run, tiny_llama_dir, tmp_path):
    from kit.evaluate import EvalConfig, run

    ws, run_dir = nan_run
    with pytest.raises(NonFiniteWeights, match=rf"tensor '{BROKEN}'"):
        run(EvalConfig(run=str(run_dir), parts=["heldout"], out_dir=str(tmp_path / "e")), ws, progress=False)
    assert not (tmp_path / "e").exists()
    cut = tmp_path / "cut"
    shutil.copytree(tiny_llama_dir, cut)
    shard = weight_files(cut)[-1]
    shard.write_bytes(shard.read_bytes()[:-100])  # a copy that stopped early
    with pytest.raises(IntegrityError, match=rf"{shard}: tensor .* ends at byte"):
        run(EvalConfig(model_path=str(cut), parts=["speed"], out_dir=str(tmp_path / "f")), ws, progress=False)
    shard.unlink()  # a shard the index lists but the copy lacks
    with pytest.raises(IntegrityError, match=rf"{shard} is missing"):
        run(EvalConfig(model_path=str(cut), parts=["speed"], out_dir=str(tmp_path / "f")), ws, progress=False)
    assert not (tmp_path / "f").exists()


def test_nan_scores_are_invalid_in_every_table(nan_run, tmp_path, monkeypatch):
    """With the load check bypassed, what the scores would have been: no loss, no accuracy, "invalid" cells."""
    import kit.convert.weights_check
    from kit.evaluate import EvalConfig, run

    ws, run_dir = nan_run
    monkeypatch.setattr(kit.convert.weights_check, "check_hf_weights", lambda *a, **k: 0)
    cfg = EvalConfig(
        run=str(run_dir),
        parts=["heldout", "accuracy"],
        tasks=["kit_mc_en"],
        task_limit=4,
        heldout_rows=2,
        engine="kit",
        out_dir=str(tmp_path / "e"),
    )
    res = run(cfg, ws, progress=False)
    trained, base = res.results["models"]["trained"], res.results["models"]["base"]
    assert trained["heldout_loss"] is None and trained["kit_mc_en_acc"] is None
    assert base["heldout_loss"] > 0 and 0 <= base["kit_mc_en_acc"] <= 1
    assert "heldout_loss" in res.results["invalid"]["trained"]
    table = res.table
    assert (
        table.loc["kit_mc_en_acc", "trained"] == "invalid"
        and table.loc["heldout_loss", "change"] == "invalid"
    )
    assert res.summary()["trained_kit_mc_en_acc"] is None
    assert any(n.startswith("trained: ") and "heldout_loss" in n and "invalid" in n for n in res.notes)
