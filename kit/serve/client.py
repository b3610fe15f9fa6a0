"""Talking to a served model through the official `openai` client: one user turn in the data's chat template, its
answer whole or streamed (`stream`, also behind notebook 07's chat box, `chat_box`).

With the tokenizer's own template (or none given) the turn goes to /v1/chat/completions and the engine renders it;
with a kit template (kit.data.templates, the prepared data's `template`) the kit renders the turn exactly as the
training data was and sends the text to /v1/completions. A prompt longer than the model's context is refused
before it is sent (`transformers serve` would accept it silently); an engine's 4xx answer becomes one line.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterator, Optional

from kit.errors import InputError, KitError


class RequestRefusedError(KitError, RuntimeError):
    """The engine answered a request with an error status."""


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def refused(exc: Exception) -> RequestRefusedError:
    """One line for an `openai.APIStatusError` (e.g. vLLM's 400 for a prompt longer than --max-model-len)."""
    status = getattr(exc, "status_code", "?")
    body = getattr(exc, "body", None)
    msg = body.get("message") if isinstance(body, dict) else None
    msg = msg or (body.get("detail") if isinstance(body, dict) else None) or str(exc)
    return RequestRefusedError(f"the engine refused the request ({status}): {str(msg).splitlines()[0][:300]}")


def check_length(tokenizer, text_or_ids: Any, max_tokens: int, context: Optional[int]) -> int:
    """Prompt tokens; InputError when prompt + max_tokens exceed the context the model was built for."""
    n = len(text_or_ids) if isinstance(text_or_ids, list) else len(tokenizer(text_or_ids)["input_ids"])
    if context and n + max_tokens > context:
        raise InputError(
            f"the prompt is {n} tokens and asks for {max_tokens} more, over the model's context of {context} "
            f"(max_position_embeddings); shorten the prompt or lower MAX_TOKENS."
        )
    return n


def _request(server, prompt: str, max_tokens: int, template: Optional[str], temperature: float):
    """(the client call, its arguments, whether the kit renders the template, prompt tokens, the template)."""
    info = getattr(server, "info", {})
    template = template if template is not None else info.get("template")
    tok = _tokenizer(info.get("model_path") or server.model)
    client = server.openai_client()
    use_kit_template = bool(template) and template != "tokenizer"
    if use_kit_template:
        from kit.data.templates import prompt_text

        text = prompt_text(tok, prompt, template)
        n = check_length(
            tok, tok(text, add_special_tokens=False)["input_ids"], max_tokens, info.get("context_length")
        )
        kwargs = dict(model=server.model, prompt=text, max_tokens=max_tokens, temperature=temperature)
        return client.completions.create, kwargs, True, n, template
    msgs = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    n = check_length(tok, list(ids), max_tokens, info.get("context_length"))
    kwargs = dict(model=server.model, messages=msgs, max_tokens=max_tokens, temperature=temperature)
    return client.chat.completions.create, kwargs, False, n, template


def stream(
    server,
    prompt: str,
    max_tokens: int = 64,
    template: Optional[str] = None,
    temperature: float = 0.0,
    usage: Optional[Dict[str, Any]] = None,
) -> Iterator[str]:
    """The answer to one user turn in the data's template (see the module doc), piece by piece as the engine
    streams it; `usage`, when given, gets the server's token counts (`usage`), the endpoint and the template."""
    import openai

    call, kwargs, use_kit_template, n, template = _request(server, prompt, max_tokens, template, temperature)
    if usage is not None:
        usage.update(prompt_tokens=n, template=template or "tokenizer", usage=None)
        usage["endpoint"] = "completions" if use_kit_template else "chat.completions"
    if not use_kit_template:
        kwargs["stream_options"] = {"include_usage": True}
    try:
        for chunk in call(stream=True, **kwargs):
            if chunk.choices:
                c = chunk.choices[0]
                piece = c.text if use_kit_template else (c.delta.content or "")
                if piece:
                    yield piece
            if getattr(chunk, "usage", None) and usage is not None:
                usage["usage"] = chunk.usage
    except openai.APIStatusError as exc:
        raise refused(exc) from None


def chat(
    server,
    prompt: str,
    max_tokens: int = 64,
    template: Optional[str] = None,
    stream: bool = True,
    echo: bool = True,
    temperature: float = 0.0,
) -> Dict[str, Any]:
    """Send one user turn; print the answer as it streams when `echo`; return {text, prompt_tokens, ...}."""
    import openai

    if stream:
        facts: Dict[str, Any] = {}
        pieces = []
        for piece in _stream(server, prompt, max_tokens, template, temperature, facts):
            pieces.append(piece)
            if echo:
                sys.stdout.write(piece)
                sys.stdout.flush()
        if echo:
            sys.stdout.write("\n")
        usage, n, template, endpoint = (
            facts["usage"],
            facts["prompt_tokens"],
            facts["template"],
            facts["endpoint"],
        )
    else:
        call, kwargs, use_kit_template, n, template = _request(
            server, prompt, max_tokens, template, temperature
        )
        endpoint = "completions" if use_kit_template else "chat.completions"
        try:
            out = call(**kwargs)
        except openai.APIStatusError as exc:
            raise refused(exc) from None
        c = out.choices[0]
        pieces = [c.text if use_kit_template else (c.message.content or "")]
        usage = out.usage
    return {
        "text": "".join(pieces),
        "prompt_tokens": usage.prompt_tokens if usage else n,
        "completion_tokens": usage.completion_tokens if usage else None,
        "template": template or "tokenizer",
        "endpoint": endpoint,
        "chunks": len(pieces),
    }


_stream = stream  # chat()'s argument `stream` hides the function inside it


def chat_box(
    server, question: str, max_tokens: int = 64, template: Optional[str] = None, interactive=None
) -> str:
    """A chat box on the served model (kit.core.chatbox): each question one user turn in the data's template, the
    answer streamed from the endpoint; headless, `question` and its answer in one sentence. Returns the answer."""
    from functools import partial

    from kit.core.chatbox import chat_box as box

    ask = partial(stream, server, max_tokens=max_tokens, template=template)
    return box(ask, question, name="the served model", interactive=interactive)
