"""In-process chat after training (kit.evaluate.chat): the streamed answer is generate's greedy answer, in the
data's template."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoTokenizer

    from kit.system.hf_compat import load_causal_lm

    return load_causal_lm(str(tiny_llama_dir)).eval(), AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.mark.parametrize("template", ["chatml", "alpaca", None])
def test_the_stream_is_the_greedy_answer_in_the_template(tiny, template):
    from kit.evaluate.chat import stream_answer
    from kit.evaluate.generation import chat_prompt, generate_answers

    model, tok = tiny
    pieces = list(stream_answer(model, tok, "Give three tips.", template, max_new_tokens=8))
    ids = chat_prompt(tok, "Give three tips.", template, "tiny")
    assert "".join(pieces) == generate_answers(model, tok, [ids], 8)[0] != ""
    assert len(pieces) >= 2  # streamed, not whole


def test_the_template_decides_the_prompt(tiny):
    from kit.data.templates import prompt_text
    from kit.evaluate.generation import chat_prompt

    _, tok = tiny
    kit_ids = chat_prompt(tok, "hi", "chatml", "tiny")
    assert (
        tok.decode(kit_ids)
        == prompt_text(tok, "hi", "chatml")
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tok.decode(chat_prompt(tok, "hi", "alpaca", "tiny"))
        == prompt_text(tok, "hi", "alpaca")
        != tok.decode(kit_ids)
    )


def test_a_failed_generate_is_raised_not_hung(tiny):
    from kit.evaluate.chat import stream_answer

    model, tok = tiny
    with pytest.raises(ValueError):
        list(stream_answer(model, tok, "hi", "chatml", max_new_tokens=-1))


def test_headless_chat_box_after_training_prints_one_sentence(tiny_llama_dir, tiny, capsys):
    from kit.evaluate.chat import chat_box, stream_answer

    model, tok = tiny
    answer = chat_box(tiny_llama_dir, "Give three tips.", "chatml", max_new_tokens=8, interactive=False)
    assert answer == "".join(stream_answer(model, tok, "Give three tips.", "chatml", 8))
    out = capsys.readouterr().out
    assert out.startswith("Asked 'Give three tips.', the trained model answered '") and out.count("\n") == 1
