"""Every kit chat template against its model's own published format (tests/fixtures/data/chat_templates.json).

The fixture holds, for fixed dialogs, the exact text each model's chat template renders (its source named there):
the whole dialog, and per assistant turn the generation prompt and the answer that follows it. Here the kit's
rendering must equal that text (after the differences docs/data.md lists, applied below by name), its token ids the
tokenizer's encoding of that text, and its loss mask exactly the answers (+ end marker). The tokenizers are built
offline per family: byte-level, no merges (so ids depend only on the text and the special tokens), with the family's
special tokens, BOS and EOS.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kit.data.dialogs import DEFAULT_COLUMNS, messages_dialog
from kit.data.readers import Record
from kit.data.sft import encode_dialogs
from kit.data.templates import TEMPLATES, template_samples

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "data" / "chat_templates.json").read_text("utf-8"))
PUBLISHED = FIXTURE["templates"]
# the family's markers that its tokenizer holds as single tokens (besides BOS / EOS)
FAMILY_TOKENS = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    "qwen2_5": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "intern2": ["<|im_start|>", "<|im_end|>"],
    "llama3": ["<|start_header_id|>", "<|end_header_id|>"],
    "llama2": [],
    "mistral": ["[INST]", "[/INST]"],
    "glm4": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
    "chatglm3": ["[gMASK]", "sop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
    "deepseek3": ["<｜User｜>", "<｜Assistant｜>"],
    "deepseek3_1": ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
    "glm4_5": [
        "[gMASK]",
        "<sop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<think>",
        "</think>",
    ],
    "telechat2": ["<_system>", "<_user>", "<_bot>"],
    "baichuan2": ["<reserved_106>", "<reserved_107>"],
}
PLAIN_CASES = ("single", "single_system", "multi", "multi_system")
REASONING = ("qwen3", "glm4_5", "deepseek3_1")  # templates with a think block: one sample per assistant turn


def _dialog(messages):
    return messages_dialog(Record("fixture", 1, {"messages": messages}), DEFAULT_COLUMNS["openai"])


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory):
    """One tokenizer folder per family: byte-level BPE without merges plus the family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    out = {}
    for name, extra in FAMILY_TOKENS.items():
        bos, eos = PUBLISHED[name]["bos_token"], PUBLISHED[name]["eos_token"]
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = [s for s in [bos, eos, *extra] if s]
        tok.add_special_tokens(list(dict.fromkeys(specials)))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
        folder = tmp_path_factory.mktemp(f"tok-{name}")
        fast.save_pretrained(str(folder))
        out[name] = (str(folder), fast)
    return out


def _expected_plain(name: str, case: dict, dialog) -> tuple:
    """(whole text, learned pieces) the kit must produce for a template without reasoning, from the published
    rendering and the deliberate differences of docs/data.md."""
    eos = PUBLISHED[name]["eos_token"]
    text, answers = case["text"], list(case["answers"])
    if name == "chatglm3":
        # the published jinja writes "<|role|>\n " (the space is sentencepiece's dummy prefix of build_chat_input,
        # which encodes role line and content apart); the kit writes "<|role|>\n"
        text = text.replace("|>\n ", "|>\n")
        answers = [a.replace("\n ", "\n", 1) for a in answers]
    if name in ("chatglm3", "glm4", "baichuan2"):
        # no end marker after the last answer in the published format; the kit appends EOS and learns it
        text += eos
        answers[-1] += eos
    if name == "mistral" and dialog.system:
        # the v0.3 template puts the system text into the user turn that ends the conversation: never, for a whole
        # dialog (it ends with an answer); the kit puts it where generating the last answer sees it
        text = case["prompts"][-1] + " " + dialog.turns[-1][1] + eos
        answers = [" " + a + eos for _, a in dialog.turns]
    return text, answers


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) - set(REASONING)))
def test_template_equals_published_format(name, family_tokenizers):
    folder, tok = family_tokenizers[name]
    t = TEMPLATES[name]
    specials = {"bos": tok.bos_token or "", "eos": tok.eos_token or ""}
    for case_id in PLAIN_CASES:
        case = PUBLISHED[name]["cases"][case_id]
        dialog = _dialog(FIXTURE["dialogs"][case_id])
        text, answers = _expected_plain(name, case, dialog)
        (segs,) = template_samples(dialog, t, specials)
        assert "".join(s for s, _ in segs) == text, (name, case_id)
        ((ids, labels),) = encode_dialogs([dialog], tokenizer=folder, template=name)
        assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"], (name, case_id)
        learned = [int(i) for i, lab in zip(ids, labels) if lab != -100]
        assert learned == tok("".join(answers), add_special_tokens=False)["input_ids"], (name, case_id)
        if name == "mistral" and dialog.system:
            continue  # the answers sit at the same places; the system text moved (checked above)
        # the learned tokens are exactly where the answers are: each answer follows its generation prompt
        starts = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in case["prompts"]]
        if name == "chatglm3":
            starts = [
                len(tok(p.replace("|>\n ", "|>\n"), add_special_tokens=False)["input_ids"])
                for p in case["prompts"]
            ]
        runs = np.flatnonzero(np.diff(np.r_[0, (labels != -100).astype(int)]) == 1).tolist()
        assert runs == starts, (name, case_id)


REASONING_CASES = [(name, case_id) for name in REASONING for case_id in sorted(PUBLISHED[name]["cases"])]


def _expected_reasoning(name: str, case: dict, dialog, k: int, thinking: bool) -> tuple:
    """(prompt, answer) of sample k for a reasoning template: the published generation prompt and the answer its
    rendering adds after it, with the kit's deliberate differences (docs/data.md) applied by name."""
    eos = PUBLISHED[name]["eos_token"]
    prompt, answer = case["prompts"][k], case["answers"][k]
    reasoning = dialog.reasoning[k] if k < len(dialog.reasoning) else None
    if reasoning is None and "</think>" in dialog.turns[k][1]:
        reasoning = dialog.turns[k][1].split("</think>")[0].split("<think>")[-1]
    bare = dialog.turns[k][1].split("</think>")[-1].lstrip("\n")
    if name == "deepseek3_1":
        # V3.1 keeps the newlines after an earlier answer's `</think>` in its content; the kit trims them, as it
        # reads reasoning in content the Qwen3 way
        prompt = prompt.replace("</think>\n\n", "</think>")
        if answer is not None:
            answer = answer.lstrip("\n")
        if thinking:
            # the template never renders reasoning: after its thinking prompt ("...<｜Assistant｜><think>") the model
            # writes reasoning, "</think>", the answer (llama.cpp #15533 parses V3.1's output so)
            answer = (reasoning or "").strip("\n") + "</think>" + bare + eos
    if answer is None:
        # the template's own rendering keeps this answer's reasoning after a prompt that already closed the think
        # block; the kit leaves the reasoning out (as LLaMA-Factory does with enable_thinking=False)
        assert not thinking
        answer = {"qwen3": bare + "<|im_end|>\n", "glm4_5": "\n" + bare}[name]
    if name == "glm4_5":
        answer += eos  # no end marker after the last answer in the published format; the kit learns EOS
    return prompt, answer


@pytest.mark.parametrize("name,case_id", REASONING_CASES)
def test_reasoning_samples_equal_its_template(name, case_id, family_tokenizers):
    """One sample per assistant turn: sample k is the template's rendering of the dialog up to answer k (earlier
    answers without reasoning, answer k with its think block), answer k alone learned; with enable_thinking=False
    the prompt is the template's non-thinking prompt and reasoning in the data is left out."""
    folder, tok = family_tokenizers[name]
    dialog_id, _, mode = case_id.partition("/")
    thinking = mode != "no_thinking"
    case = PUBLISHED[name]["cases"][case_id]
    dialog = _dialog(FIXTURE["dialogs"][dialog_id])
    samples = encode_dialogs([dialog], tokenizer=folder, template=name, enable_thinking=thinking)
    assert len(samples) == len(dialog.turns)
    for k, (ids, labels) in enumerate(samples):
        prompt, answer = _expected_reasoning(name, case, dialog, k, thinking)
        if k == len(dialog.turns) - 1 and case["answers"][k] is not None and name == "qwen3":
            assert prompt + answer == case["text"]  # the last sample is the template's whole rendering
        assert ids.tolist() == tok(prompt + answer, add_special_tokens=False)["input_ids"], k
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert (labels[:n] == -100).all() and labels[n:].tolist() == ids[n:].tolist(), k
    if name == "qwen3" and all(a is not None for a in case["answers"]):
        assert tok.decode(samples[-1][0]) == case["text"]
    if name == "glm4_5" and (thinking or not dialog.has_reasoning):
        assert tok.decode(samples[-1][0]) == case["text"] + "<|endoftext|>"


def test_reasoning_prompts_at_inference():
    """The prompt the model sees when serving or evaluating ends as its template's generation prompt does."""
    from kit.data.templates import prompt_text

    class Tok:
        bos_token, eos_token = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

    want = {
        ("deepseek3_1", True): "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>",
        ("deepseek3_1", False): "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>",
        ("glm4_5", True): "[gMASK]<sop><|user|>\nhi<|assistant|>",
        ("glm4_5", False): "[gMASK]<sop><|user|>\nhi/nothink<|assistant|>\n<think></think>",
        ("qwen3", False): "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    }
    for (template, thinking), text in want.items():
        assert prompt_text(Tok(), "hi", template, enable_thinking=thinking) == text, (template, thinking)
    assert TEMPLATES["glm4_5"].prompt_type == "glm4_moe" and TEMPLATES["deepseek3_1"].prompt_type is None


def test_qwen3_mask_history_is_one_sample_of_the_whole_dialog(family_tokenizers):
    folder, tok = family_tokenizers["qwen3"]
    case = PUBLISHED["qwen3"]["cases"]["multi_reasoning"]
    dialog = _dialog(FIXTURE["dialogs"]["multi_reasoning"])
    ((ids, labels),) = encode_dialogs([dialog], tokenizer=folder, template="qwen3", mask_history=True)
    assert tok.decode(ids) == case["text"]
    learned = [int(i) for i, lab in zip(ids, labels) if lab != -100]
    assert tok.decode(learned) == case["answers"][-1]


# A chat template written for this test (not Qwen3's own file) that behaves as the fixture shows Qwen3's does for
# plain dialogs: earlier answers bare, the last with its think block, the empty block in a non-thinking prompt.
QWEN3_LIKE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set r = m.reasoning_content or '' %}"
    "{%- if loop.last %}{{ '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + m.content }}"
    "{%- else %}{{ '<|im_start|>assistant\\n' + m.content }}{%- endif %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_tokenizer_template_that_rewrites_history_gives_per_turn_samples(family_tokenizers, tmp_path):
    """template='tokenizer' on a Qwen3-style chat_template: the same samples as the kit's qwen3 template."""
    folder, tok = family_tokenizers["qwen3"]
    tok.chat_template = QWEN3_LIKE
    own = tmp_path / "qwen3-like"
    tok.save_pretrained(str(own))
    for dialog_id in ("multi", "multi_system", "multi_reasoning"):
        dialog = _dialog(FIXTURE["dialogs"][dialog_id])
        for thinking in (True, False):
            if dialog.has_reasoning and not thinking:
                continue
            a = encode_dialogs([dialog], tokenizer=str(own), template="tokenizer", enable_thinking=thinking)
            b = encode_dialogs([dialog], tokenizer=folder, template="qwen3", enable_thinking=thinking)
            assert [(x.tolist(), y.tolist()) for x, y in a] == [(x.tolist(), y.tolist()) for x, y in b]


def test_every_template_has_a_source_and_known_prompt_type():
    """Each template names its source; its MindSpeed-LLM --prompt-type is one MindSpeed-LLM's argument parser
    accepts (mindspeed_llm/features_manager/tokenizer/build_tokenizer.py choices) or None."""
    mindspeed = {
        "default", "empty", "trl", "chatglm2", "chatglm3", "chatglm3_system", "glm4", "glm4_moe", "chatml",
        "bailing_mini", "chatml_de", "qwen", "qwen_r1", "qwen_math_r1", "llama3", "llama2", "mistral", "mixtral",
        "gemma", "alpaca", "deepseek2", "deepseek2-lite", "minicpm3", "cpm", "baichuan2", "deepseek3", "intern2",
        "hunyuan", "qwen3", "magistral", "plm", "qwen_lf", "gpt_oss", "deepseek4",
    }  # fmt: skip
    for t in TEMPLATES.values():
        assert t.source, t.name
        assert t.prompt_type is None or t.prompt_type in mindspeed, t.name
    assert TEMPLATES["qwen3"].prompt_type == "qwen3" and TEMPLATES["telechat2"].prompt_type is None
    assert set(PUBLISHED) <= set(TEMPLATES)


def test_qwen_default_systems():
    """`qwen` keeps Qwen2's default system (earlier data stays reproducible); `qwen2_5` has Qwen2.5's."""
    assert TEMPLATES["qwen"].default_system == "You are a helpful assistant."
    assert (
        TEMPLATES["qwen2_5"].default_system
        == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    )
    assert TEMPLATES["qwen3"].default_system is None


@pytest.fixture(scope="module")
def reasoning_jsonl(tmp_path_factory):
    """Six OpenAI-messages dialogs: two turns each, reasoning on every answer."""
    path = tmp_path_factory.mktemp("reasoning") / "r.jsonl"
    rows = []
    for i in range(6):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"question {i} a"},
                    {"role": "assistant", "content": f"answer {i} a", "reasoning_content": f"because {i} a"},
                    {"role": "user", "content": f"question {i} b"},
                    {"role": "assistant", "content": f"answer {i} b", "reasoning_content": f"because {i} b"},
                ]
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_prepare_qwen3_per_turn_samples_manifest_and_heldout(reasoning_jsonl, family_tokenizers, tmp_path):
    from kit.data import DataConfig, load_prepared, prepare

    folder, tok = family_tokenizers["qwen3"]
    cfg = DataConfig(
        kind="sft", inputs=[str(reasoning_jsonl)], tokenizer=folder, template="qwen3", max_length=256,
        out_dir=str(tmp_path), heldout_records=2, heldout_every=3,
    )  # fmt: skip
    res = prepare(cfg, progress=False)
    rep = res.report.as_dict()
    assert rep["records_read"] == 6 and rep["turn_samples"] == 6 and rep["reasoning_left_out"] == 0
    # dialogs 3 and 6 are held out with both their samples; the other four train with both of theirs
    assert rep["heldout_records"] == 2 and rep["records_written"] == 8
    assert res.prepared.heldout["records"] == 2 and res.prepared.heldout["rows"] == 4
    held = [
        tok.decode([t for t in row["input_ids"] if t != tok.pad_token_id])
        for row in res.prepared.heldout_dataset()
    ]
    assert sum("question 2 a" in h for h in held) == 2 and sum("question 5 a" in h for h in held) == 2
    trained = " ".join(tok.decode(row["input_ids"]) for row in load_prepared(res.hf_dir))
    assert "question 2" not in trained and "question 5" not in trained
    # the first turn's sample learns its reasoning; the second sample shows it bare as history
    assert trained.count("<think>\nbecause 0 a\n</think>\n\nanswer 0 a") == 1
    assert trained.count("<|im_start|>assistant\nanswer 0 a<|im_end|>") == 1
    man = res.manifest
    assert man["prompt_type"] == "qwen3" and man["enable_thinking"] is True
    assert man["megatron_flags"] == ["--reset-attention-mask", "--neat-pack", "--prompt-type", "qwen3"]


def test_reasoning_left_out_is_counted(reasoning_jsonl, family_tokenizers, tmp_path):
    from kit.data import DataConfig, prepare

    folder, _ = family_tokenizers["qwen3"]
    for template, thinking in (("qwen3", False), ("qwen2_5", True)):
        cfg = DataConfig(
            kind="sft", inputs=[str(reasoning_jsonl)], tokenizer=folder, template=template, max_length=256,
            out_dir=str(tmp_path / template), enable_thinking=thinking, megatron=False,
        )  # fmt: skip
        res = prepare(cfg, progress=False)
        assert res.report.reasoning_left_out == 6, template
        assert any("6 dialogs carry reasoning" in w for w in res.report.warnings), template


def test_enable_thinking_on_the_command_line():
    import argparse

    from kit.data import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="stage"))
    args = parser.parse_args(["data", "sft", "x.jsonl", "--template", "qwen3", "--no-enable-thinking"])
    cfg = cli.config_from_args(args)
    assert cfg.template == "qwen3" and cfg.enable_thinking is False
    assert "enable_thinking=1" in "; ".join(type(cfg)(enable_thinking=1).problems())


def test_which_templates_leave_reasoning_out():
    from kit.data import DataConfig
    from kit.data.pipeline import _leaves_out_reasoning

    in_text = _dialog(FIXTURE["dialogs"]["multi_think_in_content"])
    in_field = _dialog(FIXTURE["dialogs"]["multi_reasoning"])
    plain = _dialog(FIXTURE["dialogs"]["multi"])
    cases = {
        ("qwen3", True): (False, False, False),
        ("qwen3", False): (True, True, False),
        ("chatml", True): (False, True, False),  # `<think>` in the text stays text; the field is not rendered
        ("tokenizer", True): (False, False, False),
    }
    for (template, thinking), want in cases.items():
        cfg = DataConfig(template=template, enable_thinking=thinking)
        got = tuple(_leaves_out_reasoning(cfg, d) for d in (in_text, in_field, plain))
        assert got == want, (template, thinking)
