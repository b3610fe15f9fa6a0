"""Answers of the base and the trained model side by side, each prompt wrapped in the data's chat template."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Union

from kit.errors import InputError, MissingInputError

PathLike = Union[str, Path]


def read_prompts(prompts: Sequence[str], prompts_file: Optional[PathLike] = None) -> List[str]:
    """The prompt list: one prompt per non-empty line of `prompts_file` (a .txt, or .jsonl with "prompt"), or `prompts`."""
    if prompts_file:
        import json

        path = Path(prompts_file).expanduser()
        if not path.is_file():
            raise MissingInputError(
                f"prompts file {str(path)!r} does not exist; give a text file, one prompt a line."
            )
        out = []
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                if path.suffix == ".jsonl":
                    try:
                        rec = json.loads(line)
                    except ValueError as exc:
                        raise InputError(f"{path}: line {n}: not valid JSON ({exc}).") from None
                    text = rec.get("prompt") if isinstance(rec, dict) else None
                    if not isinstance(text, str) or not text.strip():
                        raise InputError(f'{path}: line {n}: needs a non-empty "prompt" field.')
                    out.append(text)
                else:
                    out.append(line.rstrip("\n"))
        if not out:
            raise InputError(f"{path}: line 1: the prompts file is empty; write one prompt per line.")
        return out
    prompts = [p for p in (prompts or []) if isinstance(p, str) and p.strip()]
    if not prompts:
        raise InputError("PROMPTS is empty: give at least one prompt (or PROMPTS_FILE, one prompt a line).")
    return list(prompts)


def chat_prompt(
    tokenizer, prompt: str, template: Optional[str], where: str, enable_thinking: Optional[bool] = None
) -> List[int]:
    """Token ids of `prompt` as one user turn plus the assistant's opening, in the data's template.

    `template` is the prepared data's template: a kit template name (kit.data.templates) or "tokenizer" / None
    for the tokenizer's own `chat_template`. `where` names the tokenizer folder for the error message.
    `enable_thinking` is the data's (None: the template's default): False ends a reasoning template's prompt with
    the empty think block, as the model was trained to see it.
    """
    if template and template != "tokenizer":
        from kit.data.templates import prompt_text

        text = prompt_text(tokenizer, prompt, template, enable_thinking)
        # the prepared data tokenizes template text without added special tokens (kit.data.tokenizing)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise InputError(
            f"{where}/tokenizer_config.json: line 1: the tokenizer has no chat_template, so prompts cannot be "
            f"wrapped as chat turns; set TEMPLATE to a kit template (e.g. 'chatml') or use a chat model's tokenizer."
        )
    thinking = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **thinking,
    )["input_ids"]


def generate_answers(model, tokenizer, prompt_ids: List[List[int]], max_new_tokens: int) -> List[str]:
    """Greedy answers, one prompt at a time (no padding effects), special tokens removed."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids], device=device)
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            out.append(tokenizer.decode(y[0, len(ids) :], skip_special_tokens=True))
    return out
