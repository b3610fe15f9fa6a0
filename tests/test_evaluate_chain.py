"""02 -> 04 -> 06 for real on a tiny model: data prepared by kit.data (with its held-out split), a few SFT steps
by kit.train, then the evaluation reads only the training run's manifest."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kit.core.manifest import EVALUATION, HF_MODEL, PREPARED_DATA, TRAINING_RUN, read_manifest


@pytest.mark.slow
def test_evaluation_of_a_real_training_run(tmp_path, tiny_llama_dir):
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare
    from kit.evaluate import EvalConfig, run
    from kit.train import TrainConfig, train

    ws = get_workspace(tmp_path / "ws", model="tiny")
    data = prepare(
        DataConfig(
            kind="sft", name="alpaca", max_length=64, max_records=48, template="chatml", heldout_records=4
        ),
        ws,
        progress=False,
    ).hf_dir
    result = train(
        TrainConfig(
            run_type="sft",
            model_name="tiny",
            model_path=str(tiny_llama_dir),
            dataset_path=str(data),
            work_dir=str(ws.root),
            train_iters=3,
            mbs=2,
            gbs=4,
            lr=3e-3,
            warmup_iters=1,
            save_hf=True,
        ),
        ws,
        progress=False,
    )
    run_man = read_manifest(result.output_dir, expect=TRAINING_RUN)
    data_man = read_manifest(data, expect=PREPARED_DATA)

    ev = run(
        EvalConfig(parts=["heldout", "accuracy", "generation"], task_limit=2, engine="kit", max_new_tokens=3),
        ws,
        progress=False,
    )
    # everything came from the run's manifests: exported model, base model, data and its template
    assert ev.inputs.run == run_man.folder
    assert ev.inputs.model == Path(run_man["hf"]).resolve()
    assert ev.inputs.base == Path(tiny_llama_dir).resolve()
    assert ev.inputs.data == data_man.folder and ev.inputs.template == data_man["template"] == "chatml"
    man = read_manifest(ev.folder, expect=EVALUATION)
    consumed = {c.kind: c.manifest_sha256 for c in man.inputs}
    assert consumed[TRAINING_RUN] == run_man.sha256 and consumed[PREPARED_DATA] == data_man.sha256
    assert consumed[HF_MODEL] == read_manifest(run_man["hf"], expect=HF_MODEL).sha256
    assert ev.folder == (run_man.folder / "evaluation" / "eval").resolve()
    # the data stage held 4 records out (never trained on): both models are scored on exactly those
    assert data_man["heldout"]["records"] == 4 and man["heldout"] == data_man["heldout"]
    for label in ("base", "trained"):
        scores = ev.results["models"][label]
        assert scores["heldout_tokens"] > 0
        assert scores["heldout_perplexity"] == pytest.approx(math.exp(scores["heldout_loss"]))
    # a few steps at a high learning rate on this data lower the loss on held-out dialogs like it
    assert ev.results["models"]["trained"]["heldout_loss"] < ev.results["models"]["base"]["heldout_loss"]
