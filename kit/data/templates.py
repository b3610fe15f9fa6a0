"""Chat templates as data: how a dialog becomes text segments, and which segments the loss learns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from kit.data.dialogs import Dialog
from kit.errors import InputError

Segment = Tuple[str, bool]  # (text, learned by the loss)


@dataclass(frozen=True)
class Template:
    """Format strings with `{content}` (and `{bos}` / `{eos}` for the tokenizer's tokens)."""

    name: str
    user: str
    """A user turn including the assistant's opening (never learned unless train_on_prompt)."""
    assistant: str
    """An answer including its end marker (learned)."""
    system: str = "{content}"
    prefix: str = ""
    """Once at the start of each dialog (not learned)."""
    separator: str = ""
    """Between turns (not learned)."""
    suffix: str = ""
    """Once after the last answer (learned with it)."""
    default_system: Optional[str] = None
    system_in_user: bool = False
    """Put the formatted system text inside the first user turn (Llama-2)."""
    special_tokens: Tuple[str, ...] = ()
    """Markers that should be single tokens in the tokenizer (checked, warned about if not)."""
    source: str = ""


TEMPLATES: Dict[str, Template] = {
    t.name: t
    for t in (
        Template(
            "telechat",
            user="<_user>{content}<_bot>",
            assistant="{content}<end>",
            system="<_system>{content}",
            special_tokens=("<_user>", "<_bot>", "<end>", "<_system>"),
            source="TeleChat NPU adaptation notes (data format): <_user>question<_bot>answer<end>",
        ),
        Template(
            "chatml",
            user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
            assistant="{content}<|im_end|>\n",
            system="<|im_start|>system\n{content}<|im_end|>\n",
            special_tokens=("<|im_start|>", "<|im_end|>"),
            source="ChatML (OpenAI); LLaMA-Factory 'chatml'",
        ),
        Template(
            "qwen",
            user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
            assistant="{content}<|im_end|>\n",
            system="<|im_start|>system\n{content}<|im_end|>\n",
            default_system="You are a helpful assistant.",
            special_tokens=("<|im_start|>", "<|im_end|>"),
            source="Qwen/Qwen2 chat format: ChatML with a default system prompt",
        ),
        Template(
            "chatglm3",
            prefix="[gMASK]sop",
            user="<|user|>\n{content}<|assistant|>",
            assistant="\n{content}",
            system="<|system|>\n{content}",
            suffix="{eos}",
            special_tokens=("[gMASK]", "sop", "<|user|>", "<|assistant|>", "<|system|>"),
            source="ChatGLM3-6B tokenizer build_chat_input; LLaMA-Factory 'chatglm3'",
        ),
        Template(
            "llama2",
            user="{bos}[INST] {content} [/INST]",
            assistant=" {content} {eos}",
            system="<<SYS>>\n{content}\n<</SYS>>\n\n",
            system_in_user=True,
            special_tokens=("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"),
            source="Llama-2-chat prompt format (Meta); LLaMA-Factory 'llama2'",
        ),
        Template(
            "baichuan2",
            user="<reserved_106>{content}<reserved_107>",
            assistant="{content}",
            suffix="{eos}",
            special_tokens=("<reserved_106>", "<reserved_107>"),
            source="Baichuan2-Chat generation_utils (user_token_id 195, assistant_token_id 196); LLaMA-Factory",
        ),
        Template(
            "llama3",
            prefix="{bos}",
            user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            assistant="{content}<|eot_id|>",
            system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
            special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            source="Meta Llama-3-Instruct prompt format; LLaMA-Factory 'llama3'",
        ),
        Template(
            "alpaca",
            user="### Instruction:\n{content}\n\n### Response:\n",
            assistant="{content}{eos}",
            system="{content}\n\n",
            separator="\n\n",
            default_system="Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.",
            source="Stanford Alpaca prompt; LLaMA-Factory 'alpaca'",
        ),
    )
}


def _fill(fmt: str, content: str, specials: Dict[str, str]) -> str:
    # str.replace, not str.format: user text may contain braces
    out = fmt.replace("{bos}", specials["bos"]).replace("{eos}", specials["eos"])
    return out.replace("{content}", content)


def template_segments(
    dialog: Dialog, t: Template, specials: Dict[str, str], system: Optional[str] = None
) -> List[Tuple[str, str]]:
    """The dialog as (text, role) pieces, role in prefix/system/user/assistant/separator/suffix."""
    sys_text = dialog.system or system or t.default_system
    out: List[Tuple[str, str]] = []
    if t.prefix:
        out.append((_fill(t.prefix, "", specials), "prefix"))
    if sys_text and not t.system_in_user:
        out.append((_fill(t.system, sys_text, specials), "system"))
    for i, (user, answer) in enumerate(dialog.turns):
        if i and t.separator:
            out.append((_fill(t.separator, "", specials), "separator"))
        if i == 0 and sys_text and t.system_in_user:
            user = _fill(t.system, sys_text, specials) + user
        out.append((_fill(t.user, user, specials), "user"))
        out.append((_fill(t.assistant, answer, specials), "assistant"))
    if t.suffix:
        out.append((_fill(t.suffix, "", specials), "suffix"))
    return out


def chat_template_segments(
    dialog: Dialog, tokenizer: Any, system: Optional[str] = None
) -> List[Tuple[str, str]]:
    """The dialog rendered by the tokenizer's own `chat_template`, split into prompt and answer pieces."""
    msgs = []
    sys_text = dialog.system or system
    if sys_text:
        msgs.append({"role": "system", "content": sys_text})
    out: List[Tuple[str, str]] = []
    done = ""
    for user, answer in dialog.turns:
        msgs.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        msgs.append({"role": "assistant", "content": answer})
        full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise InputError(
                "the tokenizer's chat_template does not render a dialog as a growing prefix (it "
                "rewrites earlier turns), so answers cannot be located for loss masking; use a named "
                f"template instead (one of {sorted(TEMPLATES)})."
            )
        out.append((prompt[len(done) :], "user"))
        out.append((full[len(prompt) :], "assistant"))
        done = full
    return out


def learned_flags(roles: List[str], train_on_prompt: bool, mask_history: bool) -> List[bool]:
    """Which pieces the loss learns: answers (and the suffix); everything with train_on_prompt; last only with mask_history."""
    if train_on_prompt:
        return [True] * len(roles)
    flags = [r in ("assistant", "suffix") for r in roles]
    if mask_history:
        last = max(i for i, r in enumerate(roles) if r == "assistant")
        flags = [f and i >= last for i, f in enumerate(flags)]
    return flags


def missing_special_tokens(t: Template, tokenizer: Any) -> List[str]:
    """Template markers that this tokenizer splits into several tokens (the model has not seen them as one)."""
    out = []
    for tok in t.special_tokens:
        if len(tokenizer(tok, add_special_tokens=False)["input_ids"]) != 1:
            out.append(tok)
    return out
