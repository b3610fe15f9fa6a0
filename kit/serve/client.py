"""Talking to a served model through the official `openai` client: one user turn in the data's chat template.

With the tokenizer's own template (or none given) the turn goes to /v1/chat/completions and the engine renders it;
with a kit template (kit.data.templates, the prepared data's `template`) the kit renders the turn exactly as the
training data was and sends the text to /v1/completions. A prompt longer than the model's context is refused
before it is sent (`transformers serve` would accept it silently); an engine's 4xx answer becomes one line.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional

from kit.errors import InputError, KitError


class RequestRefusedError(KitError, RuntimeError):
    """The engine answered a request with an error status."""


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def render(tokenizer, prompt: str, template: Optional[str]) -> str:
    """The text of one user turn plus the assistant's opening in `template` (a kit template name)."""
    from kit.data.dialogs import Dialog
    from kit.data.templates import TEMPLATES, template_segments

    if template not in TEMPLATES:
        raise InputError(f"template {template!r} is not one of {sorted(TEMPLATES)} or 'tokenizer'.")
    specials = {"bos": tokenizer.bos_token or "", "eos": tokenizer.eos_token or ""}
    pieces = template_segments(Dialog(None, [(prompt, "")]), TEMPLATES[template], specials)
    return "".join(t for t, role in pieces if role in ("prefix", "system", "user"))


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

    info = getattr(server, "info", {})
    template = template if template is not None else info.get("template")
    tok = _tokenizer(info.get("model_path") or server.model)
    client = server.openai_client()
    use_kit_template = bool(template) and template != "tokenizer"
    if use_kit_template:
        text = render(tok, prompt, template)
        n = check_length(
            tok, tok(text, add_special_tokens=False)["input_ids"], max_tokens, info.get("context_length")
        )
        kwargs = dict(model=server.model, prompt=text, max_tokens=max_tokens, temperature=temperature)
        call = client.completions.create
    else:
        msgs = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        n = check_length(tok, list(ids), max_tokens, info.get("context_length"))
        kwargs = dict(model=server.model, messages=msgs, max_tokens=max_tokens, temperature=temperature)
        call = client.chat.completions.create
    pieces, usage = [], None
    try:
        if stream:
            if not use_kit_template:
                kwargs["stream_options"] = {"include_usage": True}
            for chunk in call(stream=True, **kwargs):
                if chunk.choices:
                    c = chunk.choices[0]
                    piece = c.text if use_kit_template else (c.delta.content or "")
                    if piece:
                        pieces.append(piece)
                        if echo:
                            sys.stdout.write(piece)
                            sys.stdout.flush()
                if getattr(chunk, "usage", None):
                    usage = chunk.usage
            if echo:
                sys.stdout.write("\n")
        else:
            out = call(**kwargs)
            c = out.choices[0]
            pieces.append(c.text if use_kit_template else (c.message.content or ""))
            usage = out.usage
    except openai.APIStatusError as exc:
        raise refused(exc) from None
    return {
        "text": "".join(pieces),
        "prompt_tokens": usage.prompt_tokens if usage else n,
        "completion_tokens": usage.completion_tokens if usage else None,
        "template": template or "tokenizer",
        "endpoint": "completions" if use_kit_template else "chat.completions",
        "chunks": len(pieces),
    }
