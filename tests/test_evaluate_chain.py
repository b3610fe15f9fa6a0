"""02 -> 04 -> 06 for real on a tiny model: data prepared by kit.data (with its held-out split), a few SFT steps
by kit.train, then the evaluation reads only the training run's manifest; and the DPO chain: preference pairs
prepared, a DPO run started from the SFT run, base / SFT / DPO side by side on the held-out pairs."""

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


def _direct_logps(model_dir, rows) -> tuple:
    """Each pair's summed answer log-probabilities, one unpadded sequence at a time in float64, written without
    kit.train.dpo's or kit.evaluate's code."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    chosen, rejected = [], []
    for row in rows:
        prompt = list(row["prompt_ids"])
        for answer, out in ((row["chosen_ids"], chosen), (row["rejected_ids"], rejected)):
            ids = torch.tensor([prompt + list(answer)])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            # the token at position t is predicted at t - 1; the answer's tokens are the ones after the prompt
            out.append(sum(float(logp[len(prompt) + k - 1, t]) for k, t in enumerate(answer)))
    return chosen, rejected


@pytest.mark.slow
def test_dpo_chain_pairs_to_dpo_from_sft_to_preference_accuracy(tmp_path, tiny_llama_dir):
    """02 pairs -> 04 DPO from the SFT run -> 06: base, SFT and DPO side by side, found through the manifests alone."""
    from datasets import load_from_disk

    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare
    from kit.data.prepared import read_prepared
    from kit.evaluate import EvalConfig, run
    from kit.evaluate.preference import score_pairs
    from kit.system.hf_compat import load_causal_lm
    from kit.train import TrainConfig, train

    ws = get_workspace(tmp_path / "ws", model="tiny")
    sft_data = prepare(
        DataConfig(
            kind="sft", name="alpaca", max_length=64, max_records=32, template="chatml", heldout_records=4
        ),
        ws,
        progress=False,
    ).hf_dir
    common = dict(model_name="tiny", work_dir=str(ws.root), mbs=4, gbs=8, seed=0, save_hf=True)
    sft = train(
        TrainConfig(
            run_type="sft",
            model_path=str(tiny_llama_dir),
            dataset_path=str(sft_data),
            train_iters=2,
            lr=3e-3,
            warmup_iters=1,
            **common,
        ),
        ws,
        progress=False,
    )
    fast = dict(parts=["heldout", "preference"], overwrite=True)
    # no DPO run yet: 06 says so in one sentence and evaluates base vs trained as before
    before = run(EvalConfig(name="before", **fast), ws, progress=False)
    assert list(before.results["models"]) == ["base", "trained"] and before.results["preference"] is None
    assert before.preference is None and before.preference_note.startswith(
        f"preference accuracy skipped: no DPO run started from {sft.output_dir.resolve()}"
    )
    assert "heldout_loss" in before.results["models"]["trained"]

    pairs = prepare(
        DataConfig(
            kind="dpo", name="pairs", max_length=64, template="chatml", heldout_records=8, heldout_every=5
        ),
        ws,
        progress=False,
    ).hf_dir
    dpo = train(
        TrainConfig(
            run_type="dpo",
            model_path=str(sft.output_dir),  # the SFT run's folder: its exported model, through its manifest
            dataset_path=str(pairs),
            train_iters=6,
            lr=1e-3,
            **common,
        ),
        ws,
        progress=False,
    )
    assert dpo.status == "completed" and dpo.manifest["model"] == str(sft.hf_dir.resolve())

    # the DPO run names itself for 05-07: 06 goes back from it to its SFT run and base model
    ev = run(EvalConfig(name="chain", **fast), ws, progress=False)
    assert ev.inputs.run == ev.inputs.dpo_run == dpo.output_dir.resolve()
    assert ev.inputs.sft_run == sft.output_dir.resolve() and ev.inputs.pairs == read_prepared(pairs).folder
    assert ev.results["paths"] == {
        "base": str(tiny_llama_dir.resolve()),
        "sft": str(sft.hf_dir.resolve()),
        "dpo": str(dpo.hf_dir.resolve()),
    }
    assert any("is a DPO run: it started from the model the run" in n for n in ev.notes)
    # from the SFT run the newest DPO run started from it is found, and the line says which and why
    forward = run(EvalConfig(run=str(sft.output_dir), name="forward", **fast), ws, progress=False)
    assert any(n.startswith(f"DPO run {dpo.output_dir.resolve()}: DPO_RUN not given") for n in forward.notes)
    assert forward.results["models"] == ev.results["models"]

    # the evaluation's manifest records everything it consumed: both runs, the SFT data and the pairs
    man = read_manifest(ev.folder, expect=EVALUATION)
    used = {(c.kind, c.path): c.manifest_sha256 for c in man.inputs}
    assert used[(TRAINING_RUN, str(dpo.output_dir.resolve()))] == dpo.manifest.sha256
    assert used[(TRAINING_RUN, str(sft.output_dir.resolve()))] == sft.manifest.sha256
    assert used[(PREPARED_DATA, str(read_prepared(pairs).folder))] == read_prepared(pairs).manifest.sha256
    assert (
        used[(PREPARED_DATA, str(read_prepared(sft_data).folder))] == read_prepared(sft_data).manifest.sha256
    )
    assert man["pairs_heldout"]["records"] == 8 and man["dpo_run"] == str(dpo.output_dir.resolve())

    # the numbers: every model scored on the 8 held-out pairs, equal to a direct computation
    held = load_from_disk(man["pairs_heldout"]["path"])
    beta = dpo.manifest["dpo"]["beta"]
    direct = {}
    for label, path in ev.results["paths"].items():
        scores = ev.results["models"][label]
        c, r = _direct_logps(path, held)
        direct[label] = (c, r)
        got = ev.results["preference"]["models"][label]
        assert got["chosen_logps"] == pytest.approx(c, abs=1e-3) and got["rejected_logps"] == pytest.approx(
            r, abs=1e-3
        )
        assert scores["preference_pairs"] == 8 and 0.0 <= scores["preference_accuracy"] <= 1.0
        assert scores["preference_accuracy"] == sum(x > y for x, y in zip(c, r)) / 8
        assert scores["preference_margin"] == pytest.approx(sum(x - y for x, y in zip(c, r)) / 8, abs=1e-3)
    (c, r), (rc, rr) = direct["dpo"], direct["sft"]
    gaps = [beta * ((a - ra) - (b - rb)) for a, b, ra, rb in zip(c, r, rc, rr)]
    dpo_scores = ev.results["models"]["dpo"]
    assert dpo_scores["reward_margin"] == pytest.approx(sum(gaps) / 8, abs=1e-4)
    assert dpo_scores["reward_accuracy"] == sum(g > 0 for g in gaps) / 8
    assert "reward_margin" not in ev.results["models"]["sft"]  # the reference's reward is 0 by definition
    # side by side: one row per model, preference next to the held-out loss of the SFT data
    side = ev.preference
    assert list(side.index) == ["base", "sft", "dpo"] and "heldout_loss" in side.columns
    assert side.loc["dpo", "preference_accuracy"] == dpo_scores["preference_accuracy"]
    assert list(ev.table.columns) == ["base", "sft", "dpo", "sft - base", "dpo - sft"]
    assert ev.summary()["dpo_preference_margin"] == dpo_scores["preference_margin"]
    assert "DPO's implicit reward margin of dpo against sft" in ev.preference_note

    # DPO did what it trains for: on its own training pairs the DPO model prefers the chosen answers far more than
    # the SFT model it started from (policy = reference at step 0, so only the 6 steps can make this gap)
    train_pairs = read_prepared(pairs).dataset()
    on_train = {
        label: score_pairs(load_causal_lm(ev.results["paths"][label]).eval(), train_pairs)
        for label in ("sft", "dpo")
    }
    rewards = on_train["dpo"].rewards(on_train["sft"], beta)
    assert on_train["dpo"].margin > on_train["sft"].margin + 1.0
    # (here: +2.9 nats, 37 of 47 pairs moved towards the chosen answer; these thresholds hold a third of that)
    assert on_train["dpo"].margin > on_train["sft"].margin + 1.0
    assert rewards["reward_margin"] > 0.1 and rewards["reward_accuracy"] >= 0.6
    assert on_train["dpo"].accuracy >= on_train["sft"].accuracy
