"""RUN_TYPE=dpo on the kit trainer (CPU, real DeepSpeed): the preference margin grows, the metrics reach the log and
the manifest, the precomputed reference makes resume exact, LoRA's reference is the model with its adapters off, and
the settings are checked."""

from __future__ import annotations

import json
import math

import pytest

from kit.core.configs import ConfigError, check
from kit.data import DataConfig, prepare
from kit.train import TrainConfig, Trainer, train
from kit.train.dpo import METRICS, REF_FILE
from kit.train.resolve import resolve


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs")
    return prepare(
        DataConfig(kind="dpo", out_dir=str(out), max_length=64, template="chatml"), progress=False
    ).hf_dir


def _cfg(model, data, ws, **kw):
    values = dict(
        run_type="dpo",
        model_name="tiny",
        work_dir=str(ws),
        model_path=str(model),
        dataset_path=str(data),
        train_iters=6,
        gbs=8,
        mbs=4,
        lr=1e-3,
        seed=0,
    )
    values.update(kw)
    return TrainConfig(**values)


def test_full_dpo_learns_the_preference_and_records_trls_metrics(tmp_path, tiny_llama_dir, pairs):
    result = train(_cfg(tiny_llama_dir, pairs, tmp_path / "ws"), progress=False)
    assert result.status == "completed"
    assert result.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at the first step
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["rewards/margins"] > 0.1 and result.losses[-1] < result.losses[0] - 0.05
    assert all(0.0 <= r["rewards/accuracies"] <= 1.0 for r in rows)
    assert "rewards/accuracies: " in result.log_path.read_text()
    dpo = result.manifest["dpo"]
    assert dpo["reference"] == "precompute" and dpo["beta"] == 0.1
    assert dpo["metrics"] == {k: rows[-1][k] for k in METRICS}
    assert (result.output_dir / REF_FILE).is_file() and result.manifest["run_type"] == "dpo"
    assert (result.hf_dir / "config.json").is_file()


def test_a_stopped_dpo_run_resumes_to_the_uninterrupted_losses(tmp_path, tiny_llama_dir, pairs):
    full = train(_cfg(tiny_llama_dir, pairs, tmp_path / "a"), progress=False)
    first = Trainer(resolve(_cfg(tiny_llama_dir, pairs, tmp_path / "b")), progress=False)
    first.step_callbacks.append(lambda it: first.request_stop("test") if it == 3 else None)
    stopped = first.train()
    assert stopped.status == "preempted" and stopped.losses == full.losses[:3]
    resumed = train(
        TrainConfig(
            run_type="retrain",
            resume_from="dpo",
            model_name="tiny",
            work_dir=str(tmp_path / "b"),
            train_iters=6,
        ),
        progress=False,
    )
    # the reference sums are read back from the run folder, not recomputed from the trained weights
    assert resumed.status == "completed" and resumed.losses == full.losses[3:]


def test_a_frozen_copy_gives_the_precomputed_reference_losses(tmp_path, tiny_llama_dir, pairs):
    pre = train(_cfg(tiny_llama_dir, pairs, tmp_path / "a", train_iters=3), progress=False)
    copy = train(
        _cfg(tiny_llama_dir, pairs, tmp_path / "b", train_iters=3, dpo_reference="copy"), progress=False
    )
    assert copy.manifest["dpo"]["reference"] == "copy" and not (copy.output_dir / REF_FILE).exists()
    assert copy.losses == pytest.approx(pre.losses, abs=1e-6)


def test_lora_dpo_uses_the_adapters_off_as_reference(tmp_path, tiny_llama_dir, pairs):
    result = train(_cfg(tiny_llama_dir, pairs, tmp_path / "ws", train_iters=4, dpo_lora=True), progress=False)
    assert result.status == "completed" and result.manifest["dpo"]["reference"] == "adapters_off"
    assert result.losses[0] == pytest.approx(math.log(2), abs=1e-6)  # LoRA starts as the identity
    assert result.losses[-1] != result.losses[0]
    assert (result.adapter_dir / "adapter_config.json").is_file() and result.hf_dir.name == "merged"


def test_dpo_settings_are_checked():
    cfg = TrainConfig(
        run_type="dpo",
        dpo_beta=0.0,
        dpo_label_smoothing=0.5,
        dpo_reference="adapters_off",
        dpo_sft_weight=0.5,
        engine="megatron",
    )
    with pytest.raises(ConfigError) as err:
        check(cfg)
    text = str(err.value)
    for needle in (
        "DPO_BETA=0.0",
        "DPO_LABEL_SMOOTHING=0.5",
        "needs DPO_LORA=True",
        "MindSpeed-LLM's --pref-ftx",
    ):
        assert needle in text, needle


def test_dpo_starts_from_an_sft_run_through_its_manifest(tmp_path, tiny_llama_dir, pairs):
    from kit.train.resolve import ConfigConflictError

    sft = prepare(
        DataConfig(
            kind="sft", out_dir=str(tmp_path / "sft"), max_length=64, template="chatml", max_records=16
        ),
        progress=False,
    )
    ws = tmp_path / "ws"
    run = train(
        TrainConfig(
            run_type="sft",
            model_name="tiny",
            work_dir=str(ws),
            model_path=str(tiny_llama_dir),
            dataset_path=str(sft.hf_dir),
            train_iters=1,
            gbs=4,
            mbs=4,
        ),
        progress=False,
    )
    for given in (run.output_dir, run.hf_dir):  # the run's folder, or its hf/ export
        plan = resolve(_cfg(given, pairs, ws))
        assert plan.cfg.model_path == str(run.hf_dir.resolve()) or plan.cfg.model_path == str(run.hf_dir)
    assert "the model run" in resolve(_cfg(run.output_dir, pairs, ws)).cfg.sources["model_path"]
    # no DATASET_PATH: the workspace's pairs made with the tokenizer the run trained with (its export re-saves the
    # tokenizer files, so their hash is not the one the pairs record)
    from kit.core.workspace import get_workspace
    from kit.train.config import replace

    mine = prepare(
        DataConfig(
            kind="dpo", tokenizer=str(tiny_llama_dir), max_length=64, template="chatml", max_records=8
        ),
        get_workspace(ws, model="tiny"),
        progress=False,
    )
    found = resolve(replace(_cfg(run.output_dir, pairs, ws), dataset_path=None)).cfg
    assert found.dataset_path == str(mine.hf_dir.resolve()) or found.dataset_path == str(mine.hf_dir)
    assert (
        found.tokenizer_path == run.config.tokenizer_path
        and "its tokenizer" in found.sources["tokenizer_path"]
    )
    other = prepare(
        DataConfig(
            kind="dpo", out_dir=str(tmp_path / "alp"), max_length=64, template="telechat", max_records=8
        ),
        progress=False,
    )
    with pytest.raises(ConfigConflictError, match="trained with template='chatml'"):
        resolve(_cfg(run.output_dir, other.hf_dir, ws))


def test_pairs_whose_answers_have_one_length_score_padding_free_as_padded(tiny_llama_dir):
    """A micro-batch without padding (every prompt + answer of one length, as "94 + 31 = 125." against "... = 127."
    often is) stays as rows when laid out padding-free: the same sums as the padded layout, for every way the
    trainer asks (flattened, and flattened with the LM head on answer tokens only)."""
    import torch

    from kit.adapt.attention import flattened_rows
    from kit.system.hf_compat import load_causal_lm
    from kit.train import engine as eng
    from kit.train.dpo import pair_batch, sequence_logps

    model = load_causal_lm(str(tiny_llama_dir), None)
    eng.adapt(model)
    model.eval()
    rows = {
        "prompt_ids": [torch.tensor([5, 11, 12]), torch.tensor([5, 13, 14])],
        "chosen_ids": [torch.tensor([21, 22, 2]), torch.tensor([23, 24, 2])],
        "rejected_ids": [torch.tensor([31, 32, 2]), torch.tensor([33, 34, 2])],
    }
    batch = pair_batch(rows, pad_id=0)
    assert bool(batch["attention_mask"].bool().all())  # nothing to flatten away
    with torch.no_grad():
        padded, counts = sequence_logps(model, batch)
        for select in (False, True):
            with flattened_rows():
                flat, flat_counts = sequence_logps(model, batch, flatten=True, select=select)
            assert (
                torch.allclose(flat, padded, atol=1e-5) and flat_counts.tolist() == counts.tolist() == [3] * 4
            )
