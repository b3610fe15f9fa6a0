"""Preference accuracy (kit.evaluate.preference) and the DPO chain around an evaluated run (kit.evaluate.chain), on
tiny seeded models and runs written as notebook 04 writes them; the real 02 -> 04 DPO -> 06 chain is in
tests/test_evaluate_chain.py."""

from __future__ import annotations

import math

import pytest

from kit.core.manifest import EVALUATION, read_manifest
from kit.errors import InputError
from kit.evaluate import EvalConfig, run
from kit.evaluate.preference import PairScores, load_pairs, score_pairs

FAST = dict(parts=["heldout", "preference"], overwrite=True)


@pytest.fixture(scope="module")
def sft_ws(tmp_path_factory, tiny_llama_dir):
    """A workspace holding an SFT run (base seed 0 -> 'trained' seed 1) and nothing else."""
    from fixtures.training_run import tiny_training_run

    from kit.core.workspace import get_workspace

    root = tmp_path_factory.mktemp("prefws")
    sft = tiny_training_run(root / "ws", tiny_llama_dir, root / "sft")
    return {"root": root, "ws": get_workspace(root / "ws", model="tiny"), "sft": sft}


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    from kit.data import DataConfig, prepare

    out = tmp_path_factory.mktemp("pairs")
    cfg = DataConfig(
        kind="dpo", out_dir=str(out), max_length=64, template="chatml", heldout_records=6, heldout_every=5
    )
    return prepare(cfg, progress=False).hf_dir


def test_the_scores_follow_their_definitions():
    s = PairScores(chosen=[-1.0, -5.0, -2.0, -3.0], rejected=[-2.0, -4.0, -2.0, -6.0])
    assert s.pairs == 4 and s.accuracy == 0.5  # the tie (-2, -2) is no preference
    assert s.margin == pytest.approx((1.0 - 1.0 + 0.0 + 3.0) / 4)
    ref = PairScores(chosen=[-1.0, -4.0, -2.0, -3.0], rejected=[-1.0, -4.0, -3.0, -3.0])
    r = s.rewards(ref, beta=0.5)
    # per pair: 0.5 * ((c - rc) - (r - rr)) = 0.5 * (0 + 1), 0.5 * (-1 - 0), 0.5 * (0 - 1), 0.5 * (0 + 3)
    assert r == {"reward_margin": pytest.approx((0.5 - 0.5 - 0.5 + 1.5) / 4), "reward_accuracy": 0.5}
    broken = PairScores(chosen=[float("nan"), -1.0], rejected=[-2.0, -2.0])
    assert math.isnan(broken.accuracy)  # NaN > x is False: not a plausible 50%
    assert math.isnan(broken.rewards(PairScores([-1.0, -1.0], [-1.0, -1.0]), 0.1)["reward_accuracy"])


def test_batching_and_padding_leave_every_pair_score_unchanged(tiny_llama_dir, pairs_dir):
    from kit.data.prepared import read_prepared
    from kit.system.hf_compat import load_causal_lm

    model = load_causal_lm(tiny_llama_dir).eval()
    held = load_pairs(read_prepared(pairs_dir).heldout, 0)
    assert len(held) == 6 and len(load_pairs(read_prepared(pairs_dir).heldout, 4)) == 4
    one = score_pairs(model, held, batch_tokens=1)  # a pair per forward pass, no padding
    many = score_pairs(model, held, pad_id=7, batch_tokens=10_000)  # all in one padded batch
    assert many.chosen == pytest.approx(one.chosen, abs=1e-4) and many.rejected == pytest.approx(
        one.rejected, abs=1e-4
    )
    assert len(set(one.chosen)) == 6  # six different pairs, not one score repeated


def test_pairs_of_another_tokenizer_are_refused(tiny_llama_dir, pairs_dir):
    from datasets import Dataset

    from kit.system.hf_compat import load_causal_lm

    model = load_causal_lm(tiny_llama_dir).eval()
    rows = Dataset.from_dict({"prompt_ids": [[1, 2]], "chosen_ids": [[3, 10**6]], "rejected_ids": [[4]]})
    with pytest.raises(InputError, match="token id 1000000, beyond the model's vocabulary"):
        score_pairs(model, rows)


def test_without_a_dpo_run_one_sentence_says_so_and_the_rest_is_as_before(sft_ws):
    res = run(EvalConfig(name="nodpo", **FAST), sft_ws["ws"], progress=False)
    assert list(res.results["models"]) == ["base", "trained"] and res.preference is None
    assert res.preference_note == (
        f"preference accuracy skipped: no DPO run started from {sft_ws['sft'].resolve()} in the workspace "
        f"(notebook 04 trains one from it with RUN_TYPE='dpo') and no PAIRS given."
    )
    assert res.results["models"]["trained"]["heldout_loss"] > 0
    assert list(res.table.columns) == ["base", "trained", "change"]


def test_pairs_given_are_scored_for_any_model_and_must_be_pairs(sft_ws, pairs_dir):
    from kit.data.prepared import read_prepared

    res = run(EvalConfig(name="pairs", pairs=str(pairs_dir), **FAST), sft_ws["ws"], progress=False)
    for label in ("base", "trained"):
        scores = res.results["models"][label]
        assert scores["preference_pairs"] == 6 and 0.0 <= scores["preference_accuracy"] <= 1.0
        assert "reward_margin" not in scores  # no DPO run: no reference, no implicit reward
    man = read_manifest(res.folder, expect=EVALUATION)
    assert read_prepared(pairs_dir).manifest.sha256 in {c.manifest_sha256 for c in man.inputs}
    assert man["pairs"] == str(read_prepared(pairs_dir).folder) and man["dpo_run"] is None
    sft_data = read_manifest(sft_ws["sft"])["data"]
    with pytest.raises(InputError, match="holds sft data, not preference pairs"):
        run(EvalConfig(name="bad", pairs=sft_data, **FAST), sft_ws["ws"], progress=False)


def test_dpo_run_must_be_a_dpo_run_of_the_evaluated_run(sft_ws, tiny_llama_dir, tmp_path):
    from fixtures.training_run import tiny_dpo_run, tiny_training_run

    with pytest.raises(InputError, match="is a sft run, not a DPO run"):
        run(EvalConfig(name="x", dpo_run=str(sft_ws["sft"]), **FAST), sft_ws["ws"], progress=False)
    other_sft = tiny_training_run(tmp_path / "ws", tiny_llama_dir, tmp_path / "other")
    other_dpo = tiny_dpo_run(tmp_path / "ws", other_sft, tmp_path / "other_dpo")
    with pytest.raises(InputError, match="not from the run evaluated"):
        run(
            EvalConfig(name="x", run=str(sft_ws["sft"]), dpo_run=str(other_dpo), **FAST),
            sft_ws["ws"],
            progress=False,
        )


def test_a_dpo_run_from_a_plain_model_is_base_vs_trained_with_its_reward(tmp_path, tiny_llama_dir):
    from fixtures.training_run import tiny_dpo_run

    from kit.core.workspace import get_workspace

    dpo = tiny_dpo_run(tmp_path / "ws", tiny_llama_dir, tmp_path / "dpo", beta=0.2)
    res = run(EvalConfig(name="plain", **FAST), get_workspace(tmp_path / "ws", model="tiny"), progress=False)
    assert res.inputs.dpo_run == dpo.resolve() and res.inputs.sft_run is None
    assert list(res.results["models"]) == ["base", "trained"]
    # its data are pairs: no held-out dialogs, said in one line
    assert "held-out loss skipped: the run trained on preference pairs" in " ".join(res.notes)
    trained, base = (res.results["preference"]["models"][k] for k in ("trained", "base"))
    gaps = [
        0.2 * ((c - rc) - (r - rr))
        for c, r, rc, rr in zip(
            trained["chosen_logps"], trained["rejected_logps"], base["chosen_logps"], base["rejected_logps"]
        )
    ]
    assert res.results["models"]["trained"]["reward_margin"] == pytest.approx(sum(gaps) / len(gaps))
    assert res.results["preference"]["reference"] == "base" and res.results["preference"]["beta"] == 0.2


def test_the_newest_of_two_dpo_runs_is_taken_and_the_line_says_so(tmp_path, tiny_llama_dir):
    from fixtures.training_run import tiny_dpo_run, tiny_training_run

    from kit.core.workspace import get_workspace

    ws_root = tmp_path / "ws"  # a workspace of its own: the module's stays without a DPO run
    sft = tiny_training_run(ws_root, tiny_llama_dir, tmp_path / "sft")
    ws = get_workspace(ws_root, model="tiny")
    tiny_dpo_run(ws_root, sft, tmp_path / "dpo_a", name="dpo_a")
    newer = tiny_dpo_run(ws_root, sft, tmp_path / "dpo_b", name="dpo_b")
    res = run(EvalConfig(name="two", run=str(sft), **FAST), ws, progress=False)
    assert res.inputs.dpo_run == newer.resolve()
    line = next(n for n in res.notes if n.startswith("DPO run "))
    assert line.startswith(f"DPO run {newer.resolve()}: DPO_RUN not given: the newest training-run")
    assert "1 older one(s) passed over" in line
    assert list(res.results["models"]) == ["base", "sft", "dpo"]
    # pairs prepared without a held-out split: one sentence, the rest as before
    tiny_dpo_run(ws_root, sft, tmp_path / "dpo_c", name="dpo_c", heldout_records=0)
    res = run(EvalConfig(name="none", run=str(sft), **FAST), ws, progress=False)
    assert res.preference_note.startswith("preference accuracy skipped: the pairs ")
    assert "hold none out" in res.preference_note and res.results["models"]["dpo"]["heldout_loss"] > 0
