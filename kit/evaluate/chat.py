"""Chat with a trained model in this process (after notebook 04): each question one user turn in the data's chat
template (kit.evaluate.generation.chat_prompt, as the side-by-side answers use it), the greedy answer streamed as
transformers generates it (its TextIteratorStreamer), in a notebook chat box (kit.core.chatbox)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator, Optional, Union

from kit.evaluate.generation import chat_prompt

STREAM_TIMEOUT_S = (
    600.0  # the longest wait for the next piece (a step of a big model on a CPU), then an error
)


def stream_answer(
    model,
    tokenizer,
    prompt: str,
    template: Optional[str] = None,
    max_new_tokens: int = 32,
    where: str = "the model's folder",
) -> Iterator[str]:
    """The greedy answer to `prompt` in `template` (a kit template, or None / "tokenizer": the tokenizer's own), piece
    by piece; the same text as kit.evaluate.generation.generate_answers gives whole."""
    import torch
    from transformers import TextIteratorStreamer

    ids = chat_prompt(tokenizer, prompt, template, where)
    x = torch.tensor([ids], device=next(model.parameters()).device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    streamer = TextIteratorStreamer(
        tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=STREAM_TIMEOUT_S
    )
    failed: list = []

    def generate() -> None:
        try:
            with torch.no_grad():
                model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    streamer=streamer,
                )
        except Exception as exc:  # raised again in the caller's thread, after the stream ends
            failed.append(exc)
            streamer.end()

    worker = threading.Thread(target=generate, name="kit-chat-generate", daemon=True)
    worker.start()
    for piece in streamer:
        if piece:
            yield piece
    worker.join()
    if failed:
        raise failed[0]


def chat_box(
    model_dir: Union[str, Path],
    question: str,
    template: Optional[str] = None,
    max_new_tokens: int = 32,
    interactive: Optional[bool] = None,
) -> str:
    """A chat box on the HF model in `model_dir` (e.g. notebook 04's `result.hf_dir`), loaded once, each question in
    `template` (the run's: `cfg.template`); headless, `question` and its answer in one sentence."""
    from functools import partial

    from transformers import AutoTokenizer

    from kit.core.chatbox import chat_box as box
    from kit.system.hf_compat import load_causal_lm

    model = load_causal_lm(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ask = partial(
        stream_answer, model, tok, template=template, max_new_tokens=max_new_tokens, where=str(model_dir)
    )
    return box(ask, question, name="the trained model", interactive=interactive)
