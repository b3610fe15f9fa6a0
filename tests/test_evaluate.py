"""kit.evaluate on tiny seeded models: held-out loss vs an independent computation, multiple choice vs lm-eval,
the results folder and its manifest, and one-line errors for bad tasks, prompts and folders."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kit.core.manifest import (
    EVALUATION,
    PREPARED_DATA,
    TRAINING_RUN,
    read_manifest,
)
from kit.errors import InputError
from kit.evaluate import EvalConfig, load_task, run
from kit.evaluate.tasks import SAMPLE_TASKS_DIR

FAST = dict(
    batch_sizes=[1, 2], prompt_lengths=[8, 16], decode_tokens=2, max_new_tokens=4, task_limit=4, engine="kit"
)


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_llama_dir):
    """A workspace with prepared SFT data and its held-out split, a base model (seed 0), a 'trained' one (seed 1)
    and the training-run / hf-model manifests that tie them together, as notebook 04 writes them."""
    from fixtures.training_run import tiny_training_run

    from kit.core.workspace import get_workspace

    root = tmp_path_factory.mktemp("evalchain")
    run_dir = tiny_training_run(root / "ws", tiny_llama_dir, root / "trained")
    run_man = read_manifest(run_dir, expect=TRAINING_RUN)
    data = Path(run_man["data"])
    return {
        "ws": get_workspace(root / "ws", model="tiny"),
        "run": run_dir,
        "run_sha": run_man.sha256,
        "data": data,
        "heldout": read_manifest(data, expect=PREPARED_DATA)["heldout"],
        "base": tiny_llama_dir,
        "trained": root / "trained",
    }


def _independent_loss(model_dir: Path, heldout_path: str) -> tuple:
    """Summed NLL and token count, one dialog at a time, written without kit.evaluate's code."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    total, count = 0.0, 0
    for row in load_from_disk(heldout_path):
        start = 0
        lens = row["seq_lens"] if row.get("seq_lens") else [sum(row["attention_mask"])]
        for n in lens:
            ids = torch.tensor([row["input_ids"][start : start + n]])
            labels = row["labels"][start : start + n]
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            for t in range(1, n):
                if labels[t] != -100:
                    total -= float(logp[t - 1, labels[t]])
                    count += 1
            start += n
    return total, count


def test_run_compares_base_and_trained_and_writes_a_manifest(chain):
    res = run(EvalConfig(run=str(chain["run"]), name="t1", **FAST), chain["ws"], progress=False)
    # folder and manifest: in the run's folder, naming models, data split, tasks and device
    assert res.folder == (chain["run"] / "evaluation" / "t1").resolve()
    man = read_manifest(res.folder, expect=EVALUATION)
    assert man["model"] == str(chain["trained"].resolve()) and man["base_model"] == str(
        chain["base"].resolve()
    )
    assert man["heldout"] == chain["heldout"] and man["device"]["kind"] == "cpu"
    assert [t["name"] for t in man["tasks"]] == ["kit_mc_en", "kit_mc_zh"]
    kinds = {c.kind: c.manifest_sha256 for c in man.inputs}
    assert kinds[TRAINING_RUN] == chain["run_sha"] and PREPARED_DATA in kinds
    # held-out loss equals an independent computation, perplexity = exp(mean token loss)
    for label, model_dir in (("base", chain["base"]), ("trained", chain["trained"])):
        total, count = _independent_loss(model_dir, chain["heldout"]["path"])
        scores = res.results["models"][label]
        assert scores["heldout_tokens"] == count > 0
        assert scores["heldout_loss"] == pytest.approx(total / count, rel=1e-5)
        assert scores["heldout_perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    # the table: one row per metric, base / trained / change
    table = res.table
    assert list(table.columns) == ["base", "trained", "change"]
    assert table.loc["heldout_loss", "change"] == pytest.approx(
        table.loc["heldout_loss", "trained"] - table.loc["heldout_loss", "base"]
    )
    for metric in ("kit_mc_en_acc", "kit_mc_zh_acc", "ttft_ms", "decode_tokens_per_s"):
        assert metric in table.index
    assert 0.0 <= table.loc["kit_mc_en_acc", "base"] <= 1.0
    # speed: every (prompt length, batch) per model, positive numbers; the plot exists
    speed = res.speed
    assert sorted(set(zip(speed["prompt_len"], speed["batch"]))) == [(8, 1), (8, 2), (16, 1), (16, 2)]
    assert (speed["decode_tokens_per_s"] > 0).all() and (speed["memory_mb"] > 0).all()
    assert (res.folder / "speed.png").stat().st_size > 1000
    # generations side by side, one answer per prompt and model
    gens = res.generations
    assert list(gens.columns) == ["prompt", "base", "trained"] and len(gens) == len(EvalConfig().prompts)
    summary = res.summary()
    assert summary["trained_heldout_loss"] == res.results["models"]["trained"]["heldout_loss"]
    assert json.loads((res.folder / "results.json").read_text())["engine"] == "kit"


def test_newest_run_is_found_and_results_are_not_overwritten(chain):
    cfg = EvalConfig(parts=["heldout"], name="t2", heldout_rows=2)
    first = run(cfg, chain["ws"], progress=False)
    assert (
        first.inputs.run == chain["run"].resolve() and first.results["models"]["base"]["heldout_tokens"] > 0
    )
    with pytest.raises(Exception, match="exists"):
        run(cfg, chain["ws"], progress=False)


def test_hf_model_folder_with_explicit_base_and_data(chain, tmp_path):
    cfg = EvalConfig(
        model_path=str(chain["trained"]),
        base_model=str(chain["base"]),
        data=str(chain["data"]),
        parts=["heldout", "generation"],
        max_new_tokens=3,
        out_dir=str(tmp_path / "ev"),
    )
    res = run(cfg, chain["ws"], progress=False)
    assert set(res.results["models"]) == {"base", "trained"}
    assert res.inputs.template == "chatml"  # the data's template wraps the prompts
    assert read_manifest(tmp_path / "ev", expect=EVALUATION)["data"] == str(chain["data"].resolve())


def test_kit_accuracy_equals_lm_eval_run_directly(chain, tmp_path):
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from kit.evaluate.scoring import score_task
    from kit.evaluate.tasks import resolved_yaml
    from kit.system.hf_compat import load_causal_lm

    # a three-choice task whose choices are one token each after the prompt: the kit's one-forward path
    (tmp_path / "abc.jsonl").write_text(
        "".join(
            json.dumps({"question": q, "A": "yes", "B": "no", "C": "maybe", "answer": a}) + "\n"
            for q, a in (
                ("Is water wet?", "A"),
                ("Is fire cold?", "B"),
                ("Will it rain?", "C"),
                ("Is 2 even?", "A"),
            )
        )
    )
    abc = (
        (SAMPLE_TASKS_DIR / "kit_mc_en.yaml").read_text().replace("mc_en.jsonl", str(tmp_path / "abc.jsonl"))
    )
    abc = abc.replace("task: kit_mc_en", "task: abc").replace('["A", "B", "C", "D"]', '["A", "B", "C"]')
    abc = abc.replace("D. {{D}}\\n", "").replace("['A', 'B', 'C', 'D']", "['A', 'B', 'C']")
    (tmp_path / "abc.yaml").write_text(abc)
    sizes = {"kit_mc_en": 12, "kit_mc_zh": 12, str(tmp_path / "abc.yaml"): 4}
    for name, size in sizes.items():
        task = load_task(name)
        name = task.name
        resolved_yaml(task, tmp_path / "tasks")
        # lm-eval on its own: the model loaded by lm-eval from the folder, the task from the YAML file
        direct = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={chain['trained']},dtype=float32",
            tasks=[name],
            task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
            device="cpu",
            batch_size=4,
            log_samples=True,
        )
        mine = score_task(
            load_causal_lm(chain["trained"]).eval(),
            AutoTokenizer.from_pretrained(str(chain["trained"])),
            task,
        )
        assert mine["acc"] == direct["results"][name]["acc,none"]
        assert mine["acc_norm"] == direct["results"][name]["acc_norm,none"]
        samples = sorted(direct["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples) == len(mine["details"]) == size
        for s, d in zip(samples, mine["details"]):
            assert [r[0] for r in s["filtered_resps"]] == pytest.approx(d["logliks"], abs=1e-4)
            assert s["target"] == d["gold"]


def test_accuracy_by_hand_on_a_two_question_task(chain, tmp_path):
    """Log-likelihoods computed from one forward pass over prompt + ' A' etc. (no kit code), argmax vs gold."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit.evaluate.scoring import score_task

    (tmp_path / "q.jsonl").write_text(
        '{"question": "1+1?", "A": "2", "B": "3", "C": "4", "D": "5", "answer": "A"}\n'
        '{"question": "Sky color?", "A": "red", "B": "blue", "C": "green", "D": "black", "answer": "B"}\n'
    )
    yaml_text = (SAMPLE_TASKS_DIR / "kit_mc_en.yaml").read_text().replace("mc_en.jsonl", "q.jsonl")
    (tmp_path / "two.yaml").write_text(yaml_text.replace("task: kit_mc_en", "task: two"))
    task = load_task(tmp_path / "two.yaml")
    tok = AutoTokenizer.from_pretrained(str(chain["base"]))
    model = AutoModelForCausalLM.from_pretrained(str(chain["base"])).eval()
    hits = 0
    for q, gold in zip(task.questions, (0, 1)):
        lls = []
        for letter in "ABCD":
            ctx = tok.encode(q.context)
            full = tok.encode(q.context + " " + letter)
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([full])).logits[0], -1)
            lls.append(sum(float(logp[i - 1, full[i]]) for i in range(len(ctx), len(full))))
        hits += int(max(range(4), key=lambda i: lls[i]) == gold)
    assert score_task(model, tok, task)["acc"] == hits / 2


@pytest.mark.parametrize("select", [True, False], ids=["head-at-target-positions", "every-logit"])
def test_heldout_loss_equals_one_dialog_at_a_time_at_any_batch_size(chain, monkeypatch, select):
    """heldout_loss batches dialogs of different lengths and (where the model takes positions) runs the LM head
    only where a target follows in some row; the summed loss and the token count equal an independent
    computation one dialog at a time, for one dialog per batch, a few, and all of them."""
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    import kit.system.hf_compat
    from kit.evaluate.scoring import heldout_loss

    model = AutoModelForCausalLM.from_pretrained(str(chain["base"])).eval()
    if select and not kit.system.hf_compat.takes_logit_positions(model):
        pytest.skip("this transformers' models take no logits_to_keep positions")
    if not select:
        monkeypatch.setattr(kit.system.hf_compat, "takes_logit_positions", lambda model: False)
    total, count = _independent_loss(chain["base"], chain["heldout"]["path"])
    rows = list(load_from_disk(chain["heldout"]["path"]))
    assert len(rows) > 2
    for batch_tokens in (1, 100, 1 << 20):
        got = heldout_loss(model, rows, batch_tokens=batch_tokens)
        assert got.tokens == count and got.loss_sum == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("select", [True, False], ids=["head-at-scored-positions", "every-logit"])
def test_batched_choice_scores_equal_one_forward_per_choice(chain, monkeypatch, select):
    """task_logliks batches rows of different lengths (padded on the right), mixes one-row questions (one-token
    choices after the same context) with one-row-per-choice ones and an empty context; every score equals the
    summed log-probabilities from one unpadded forward pass per context + choice, at any batch size, with the
    LM head at the scored positions only or everywhere."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kit.system.hf_compat
    from kit.evaluate.scoring import _rows_of, encode_pair, task_logliks

    tok = AutoTokenizer.from_pretrained(str(chain["base"]))
    model = AutoModelForCausalLM.from_pretrained(str(chain["base"])).eval()
    if select and not kit.system.hf_compat.takes_logit_positions(model):
        pytest.skip("this transformers' models take no logits_to_keep positions")
    if not select:
        monkeypatch.setattr(kit.system.hf_compat, "takes_logit_positions", lambda model: False)
    questions = [
        ("Question: 1+1?\nA. 2\nB. 3\nAnswer:", ["A", "B", "the", "and"]),  # one token each here
        ("Sky color?", ["red", "bright blue", "a green and grey haze"]),
        ("", ["yes", "no way"]),
        (
            "A much longer question about nothing in particular, to make the rows differ in length:",
            ["x", "yz"],
        ),
    ]
    assert [len(_rows_of(tok, [q], " ", 2048)) for q in questions] == [1, 3, 2, 2]  # both kinds of row
    by_hand = []
    for context, choices in questions:
        scores = []
        for choice in choices:
            ctx, cont = encode_pair(tok, context, " " + choice)
            ctx = ctx or [tok.eos_token_id]
            full = ctx + cont
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
            scores.append(sum(float(logp[len(ctx) + k - 1, t]) for k, t in enumerate(cont)))
        by_hand.append(scores)
    for batch_tokens in (1, 40, 4096):
        got = task_logliks(model, tok, questions, " ", batch_tokens=batch_tokens)
        for mine, want in zip(got, by_hand):
            assert mine == pytest.approx(want, abs=1e-4)


def test_speed_prefill_computes_the_last_logits_only_and_decodes_what_generate_does(chain):
    """The timed prefill asks for the last position's logits only, as generate() does (not [batch, prompt, vocab]),
    where the model takes that keyword; the cached greedy steps pick the tokens generate() picks."""
    import functools
    import inspect

    import torch
    from transformers import AutoModelForCausalLM

    from kit.evaluate import speed
    from kit.system.hf_compat import last_logits_only

    model = AutoModelForCausalLM.from_pretrained(str(chain["base"])).eval()
    real, shapes, picked = model.forward, [], []

    @functools.wraps(real)
    def forward(*args, **kwargs):
        out = real(*args, **kwargs)
        shapes.append(tuple(out.logits.shape))
        picked.append(out.logits[:, -1].argmax(-1))
        return out

    model.forward = forward
    vocab = model.config.vocab_size
    row = speed.measure(model, batch=2, prompt_len=12, decode_tokens=3, vocab=vocab)
    assert row["ttft_ms"] > 0 and row["decode_tokens_per_s"] > 0
    keyword = last_logits_only(model)
    assert shapes[0] == ((2, 1, vocab) if keyword else (2, 12, vocab)) and len(shapes) == 4
    if "logits_to_keep" in inspect.signature(real).parameters:  # transformers >= 4.50
        assert keyword == {"logits_to_keep": 1}
    model.forward = real
    ids = torch.randint(0, max(2, vocab // 2), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, 12:]
    assert torch.equal(torch.stack(picked, 1), want)


# ---- bad input: one line naming file and line ----


def _task(tmp_path, rows: str, yaml_edit=lambda s: s) -> Path:
    (tmp_path / "mc.jsonl").write_text(rows, encoding="utf-8")
    text = (SAMPLE_TASKS_DIR / "kit_mc_en.yaml").read_text().replace("mc_en.jsonl", "mc.jsonl")
    (tmp_path / "t.yaml").write_text(yaml_edit(text), encoding="utf-8")
    return tmp_path / "t.yaml"


GOOD = '{"question": "q?", "A": "a", "B": "b", "C": "c", "D": "d", "answer": "A"}\n'


def test_task_row_missing_a_field_names_file_and_line(tmp_path):
    bad = GOOD.replace('"C": "c", ', "")
    with pytest.raises(InputError, match=r"mc\.jsonl: line 3: missing field\(s\) 'C'"):
        load_task(_task(tmp_path, GOOD + GOOD + bad))


def test_answer_key_out_of_range_names_file_and_line(tmp_path):
    with pytest.raises(InputError, match=r"mc\.jsonl: line 2: .*'answer': 'E'"):
        load_task(_task(tmp_path, GOOD + GOOD.replace('"answer": "A"', '"answer": "E"')))
    numeric = lambda s: s.replace("{{['A', 'B', 'C', 'D'].index(answer)}}", "{{answer}}")  # noqa: E731
    with pytest.raises(InputError, match=r"mc\.jsonl: line 1: answer key 7 is out of range"):
        load_task(_task(tmp_path, GOOD.replace('"answer": "A"', '"answer": 7'), numeric))


def test_task_yaml_missing_a_key_names_the_file(tmp_path):
    drop = lambda s: "\n".join(ln for ln in s.splitlines() if not ln.startswith("doc_to_text"))  # noqa: E731
    with pytest.raises(InputError, match=r"t\.yaml: line 1: the task lacks 'doc_to_text'"):
        load_task(_task(tmp_path, GOOD, drop))
    remote = lambda s: s.replace("dataset_path: json", "dataset_path: cais/mmlu")  # noqa: E731
    with pytest.raises(InputError, match=r"t\.yaml: line 4: dataset_path 'cais/mmlu' is not a local format"):
        load_task(_task(tmp_path, GOOD, remote))


def test_csv_task_with_header_like_c_eval(tmp_path):
    (tmp_path / "x_val.csv").write_text(
        "id,question,A,B,C,D,answer,explanation\n0,q1,a,b,c,d,B,\n1,q2,a,b,c,d,Z,\n", encoding="utf-8"
    )
    text = (SAMPLE_TASKS_DIR / "kit_mc_zh.yaml").read_text()
    text = text.replace("dataset_path: json", "dataset_path: csv").replace("mc_zh.jsonl", "x_val.csv")
    (tmp_path / "c.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=r"x_val\.csv: line 3: .*'answer': 'Z'"):
        load_task(tmp_path / "c.yaml")


def test_tokenizer_without_chat_template_and_empty_prompts(tmp_path):
    from transformers import AutoTokenizer

    from kit.core.samples import sample_tokenizer_dir
    from kit.evaluate.generation import chat_prompt, read_prompts

    tok = AutoTokenizer.from_pretrained(str(sample_tokenizer_dir()))
    tok.chat_template = None
    with pytest.raises(
        InputError, match=r"/m/tokenizer_config\.json: line 1: the tokenizer has no chat_template"
    ):
        chat_prompt(tok, "hi", None, "/m")
    assert (
        chat_prompt(tok, "hi", "chatml", "/m")
        == tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
            "input_ids"
        ]
    )
    # a reasoning template: data made without thinking is prompted with the empty think block it was trained on
    opening = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for thinking, text in ((True, opening), (None, opening), (False, opening + "<think>\n\n</think>\n\n")):
        assert (
            chat_prompt(tok, "hi", "qwen3", "/m", thinking)
            == tok(text, add_special_tokens=False)["input_ids"]
        )
    with pytest.raises(InputError, match="PROMPTS is empty"):
        read_prompts([])
    (tmp_path / "p.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"p\.txt: line 1: the prompts file is empty"):
        read_prompts(["x"], tmp_path / "p.txt")


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kit", "evaluate", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_cli_errors_are_one_line(chain, tmp_path):
    bad = _task(tmp_path, GOOD + GOOD.replace('"answer": "A"', '"answer": "E"'))
    out = _cli(
        "--run",
        str(chain["run"]),
        "--tasks",
        str(bad),
        "--parts",
        "accuracy",
        "--workspace",
        str(chain["ws"].root),
        "--workspace-model",
        "tiny",
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "mc.jsonl: line 2" in lines[0], out.stderr
    # a folder of another kind as the run: the error names the stage that makes runs
    out = _cli("--run", str(chain["data"]), "--parts", "heldout", "--workspace", str(chain["ws"].root))
    assert out.returncode == 2 and "is a prepared-data folder" in out.stderr and "notebook 04" in out.stderr
    out = _cli(
        "--parts",
        "generation",
        "--prompts",
        "[]",
        "--run",
        str(chain["run"]),
        "--workspace",
        str(chain["ws"].root),
    )
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: PROMPTS is empty: give at least one prompt (or PROMPTS_FILE, one prompt a line)."
    )


def test_megatron_checkpoint_is_converted_back_to_hf_first(chain, tmp_path):
    from kit.convert import ConvertConfig
    from kit.convert import run as convert
    from kit.core.manifest import CONVERTED_CHECKPOINT

    mg = tmp_path / "mg"
    convert(
        ConvertConfig(source=str(chain["trained"]), target=str(mg), direction="hf_to_megatron", tp=2),
        progress=False,
    )
    common = dict(base_model=str(chain["base"]), data=str(chain["data"]), parts=["heldout"], heldout_rows=2)
    via_mg = run(
        EvalConfig(model_path=str(mg), out_dir=str(tmp_path / "a"), **common), chain["ws"], progress=False
    )
    direct = run(
        EvalConfig(model_path=str(chain["trained"]), out_dir=str(tmp_path / "b"), **common),
        chain["ws"],
        progress=False,
    )
    # the round trip HF -> Megatron (TP 2) -> HF keeps the weights: the same held-out loss
    assert via_mg.results["models"]["trained"]["heldout_loss"] == pytest.approx(
        direct.results["models"]["trained"]["heldout_loss"], rel=1e-6
    )
    assert (
        via_mg.inputs.model != chain["trained"].resolve() and (via_mg.inputs.model / "config.json").is_file()
    )
    kinds = {c.kind for c in read_manifest(tmp_path / "a", expect=EVALUATION).inputs}
    assert CONVERTED_CHECKPOINT in kinds


def test_alone_in_an_empty_workspace_says_so_in_one_line(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    """No training run: the demo model (here the tiny one) on its own, on a held-out split prepared now."""
    import kit.core.samples
    from kit.core.workspace import get_workspace

    monkeypatch.setattr(kit.core.samples, "demo_model_dir", lambda: tiny_llama_dir)
    ws = get_workspace(tmp_path / "ws", model="demo")
    res = run(EvalConfig(parts=["heldout"], heldout_rows=2), ws, progress=False)
    said = [ln for ln in capsys.readouterr().out.splitlines() if "no training run" in ln]
    assert len(said) == 1 and "evaluating the demo model" in said[0] and "held-out split" in said[0]
    assert list(res.results["models"]) == ["model"] and res.results["models"]["model"]["heldout_tokens"] > 0
    assert res.folder == (ws.model_output / "evaluations" / "eval").resolve()
    assert read_manifest(res.folder, expect=EVALUATION)["heldout"]["records"] == 8


def test_speed_differences_are_judged_against_the_repeat_spread():
    import pandas as pd

    from kit.evaluate.speed import noise_note

    def rows(spread_b, spread_t, ttft_t):
        return pd.DataFrame(
            [
                {"model": "base", "prompt_len": 16, "batch": 1, "ttft_ms": 100.0, "ttft_spread": spread_b},
                {
                    "model": "trained",
                    "prompt_len": 16,
                    "batch": 1,
                    "ttft_ms": ttft_t,
                    "ttft_spread": spread_t,
                },
                {"model": "base", "prompt_len": 16, "batch": 2, "ttft_ms": 200.0, "ttft_spread": spread_b},
                {"model": "trained", "prompt_len": 16, "batch": 2, "ttft_ms": 210.0, "ttft_spread": spread_t},
            ]
        )

    nan = float("nan")
    assert "from one timing per point (REPEATS = 1)" in noise_note(rows(nan, nan, 800.0))
    assert "2 of 2 points show no difference beyond that noise." in noise_note(rows(1.1, 1.2, 115.0))
    note = noise_note(rows(1.1, 1.2, 800.0))
    assert note.startswith("trained / base time to first token: 1.05-8.00x") and "1 of 2 points" in note
    assert noise_note(rows(1.1, 1.1, 100.0)[lambda t: t["model"] == "base"]) == ""
