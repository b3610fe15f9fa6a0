"""Chat templates as data: how a dialog becomes text segments, and which segments the loss learns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from kit.core import i18n
from kit.data.dialogs import Dialog
from kit.errors import InputError

Segment = Tuple[str, bool]  # (text, learned by the loss)


@dataclass(frozen=True)
class Think:
    """How a reasoning model's chat template writes an answer's think block (`open` reasoning `close`)."""

    open: str
    close: str
    history: str = ""
    """Before each earlier answer, whose reasoning the template drops (read only)."""
    off: Optional[str] = None
    """The end of a non-thinking prompt (None: the empty block, open + close)."""
    open_in_prompt: bool = False
    """A thinking prompt ends with `open`, so the learned answer starts with the reasoning."""
    user_off: str = ""
    """Appended to every user turn in non-thinking mode (unless the turn already ends with it)."""
    strip: Optional[str] = "\n"
    """Characters trimmed from both ends of the reasoning (None: all whitespace)."""


# Qwen3 (Qwen/Qwen3-8B tokenizer_config.json): "<think>\n" + the reasoning + "\n</think>\n\n" before the answer,
# the empty block "<think>\n\n</think>\n\n" without reasoning or ending a non-thinking prompt; earlier answers bare.
THINK = Think("<think>\n", "\n</think>\n\n")
# GLM-4.5 (zai-org/GLM-4.5 chat_template.jinja): "\n<think>" + reasoning.strip() + "</think>" right after
# <|assistant|>, "\n<think></think>" before earlier answers and ending a non-thinking prompt, whose user turns end
# in "/nothink".
THINK_GLM45 = Think("\n<think>", "</think>", history="\n<think></think>", user_off="/nothink", strip=None)
# DeepSeek-V3.1 (deepseek-ai/DeepSeek-V3.1 tokenizer_config.json chat_template, `thinking` switch): the prompt
# ends "<｜Assistant｜><think>" (thinking) or "<｜Assistant｜></think>" (not), and earlier answers follow "</think>";
# in thinking mode the model writes reasoning + "</think>" + answer (llama.cpp #15533 parses V3.1 output so).
THINK_DSV31 = Think("<think>", "</think>", history="</think>", off="</think>", open_in_prompt=True)


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
    """Put the formatted system text inside a user turn (Llama-2: the first, Mistral: the last)."""
    system_in_last_user: bool = False
    """With system_in_user: the last user turn instead of the first (Mistral-7B-Instruct-v0.3)."""
    think: Optional[Think] = None
    """How an answer's reasoning is written, for reasoning models (Qwen3, GLM-4.5, DeepSeek-V3.1). The last answer of a rendering
    always carries the block (empty without reasoning); earlier answers carry none, as the model's own template
    drops them, so a multi-turn dialog becomes one sample per assistant turn (see `template_samples`)."""
    prompt_type: Optional[str] = None
    """MindSpeed-LLM's `--prompt-type` for this format (configs/finetune/templates.json), None if it has none."""
    special_tokens: Tuple[str, ...] = ()
    """Markers that should be single tokens in the tokenizer (checked, warned about if not)."""
    source: str = ""


QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TELECHAT2_SYSTEM = (
    "你是中国电信星辰语义大模型，英文名是TeleChat，你是由中电信人工智能科技有限公司和中国电信人工智能研究院（TeleAI）"
    "研发的人工智能助手。"
)
_CHATML = {
    "user": "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
    "assistant": "{content}<|im_end|>\n",
    "system": "<|im_start|>system\n{content}<|im_end|>\n",
}
_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")

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
            "telechat2",
            user="<_user>{content}<_bot>",
            assistant="{content}<_end>\n",
            system="<_system>{content}\n",
            default_system=TELECHAT2_SYSTEM,
            special_tokens=("<_user>", "<_bot>", "<_end>", "<_system>"),
            source="Tele-AI/TeleChat2-7B tokenizer_config.json chat_template",
        ),
        Template(
            "chatml",
            **_CHATML,
            prompt_type="chatml",
            special_tokens=_CHATML_TOKENS,
            source="ChatML (OpenAI); LLaMA-Factory 'chatml'",
        ),
        Template(
            "qwen",
            **_CHATML,
            default_system="You are a helpful assistant.",
            prompt_type="qwen",
            special_tokens=_CHATML_TOKENS,
            source="Qwen/Qwen2-7B-Instruct tokenizer_config.json chat_template (Qwen2's default system)",
        ),
        Template(
            "qwen2_5",
            **_CHATML,
            default_system=QWEN25_SYSTEM,
            prompt_type="qwen_lf",
            special_tokens=_CHATML_TOKENS,
            source="Qwen/Qwen2.5-7B-Instruct tokenizer_config.json chat_template (no tools)",
        ),
        Template(
            "qwen3",
            **_CHATML,
            think=THINK,
            prompt_type="qwen3",
            special_tokens=_CHATML_TOKENS + ("<think>", "</think>"),
            source="Qwen/Qwen3-8B tokenizer_config.json chat_template (no tools)",
        ),
        Template(
            "intern2",
            prefix="{bos}",
            **_CHATML,
            prompt_type="intern2",
            special_tokens=_CHATML_TOKENS,
            source="internlm/internlm2_5-7b-chat tokenizer_config.json chat_template",
        ),
        Template(
            "chatglm3",
            prefix="[gMASK]sop",
            user="<|user|>\n{content}<|assistant|>",
            assistant="\n{content}",
            system="<|system|>\n{content}",
            suffix="{eos}",
            prompt_type="chatglm3",
            special_tokens=("[gMASK]", "sop", "<|user|>", "<|assistant|>", "<|system|>"),
            source="THUDM/chatglm3-6b tokenizer build_chat_input / tokenizer_config.json chat_template",
        ),
        Template(
            "glm4",
            prefix="[gMASK]<sop>",
            user="<|user|>\n{content}<|assistant|>",
            assistant="\n{content}",
            system="<|system|>\n{content}",
            suffix="{eos}",
            prompt_type="glm4",
            special_tokens=("[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|system|>"),
            source="THUDM/glm-4-9b-chat tokenizer_config.json chat_template",
        ),
        Template(
            "llama2",
            user="{bos}[INST] {content} [/INST]",
            assistant=" {content} {eos}",
            system="<<SYS>>\n{content}\n<</SYS>>\n\n",
            system_in_user=True,
            prompt_type="llama2",
            special_tokens=("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"),
            source="meta-llama/Llama-2-7b-chat-hf tokenizer_config.json chat_template",
        ),
        Template(
            "mistral",
            prefix="{bos}",
            user="[INST] {content}[/INST]",
            assistant=" {content}{eos}",
            system="{content}\n\n",
            system_in_user=True,
            system_in_last_user=True,
            prompt_type="mistral",
            special_tokens=("[INST]", "[/INST]"),
            source="mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json chat_template (no tools)",
        ),
        Template(
            "baichuan2",
            user="<reserved_106>{content}<reserved_107>",
            assistant="{content}",
            suffix="{eos}",
            prompt_type="baichuan2",
            special_tokens=("<reserved_106>", "<reserved_107>"),
            source="baichuan-inc/Baichuan2-7B-Chat generation_utils.py build_chat_input (user_token_id 195, "
            "assistant_token_id 196)",
        ),
        Template(
            "llama3",
            prefix="{bos}",
            user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            assistant="{content}<|eot_id|>",
            system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
            prompt_type="llama3",
            special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            source="meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json chat_template",
        ),
        Template(
            "deepseek3",
            prefix="{bos}",
            user="<｜User｜>{content}<｜Assistant｜>",
            assistant="{content}<｜end▁of▁sentence｜>",
            prompt_type="deepseek3",
            special_tokens=("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
            source="deepseek-ai/DeepSeek-V3 tokenizer_config.json chat_template (no tools)",
        ),
        Template(
            "deepseek3_1",
            prefix="{bos}",
            user="<｜User｜>{content}<｜Assistant｜>",
            assistant="{content}<｜end▁of▁sentence｜>",
            think=THINK_DSV31,
            # MindSpeed-LLM's deepseek3 template writes V3's format (no think marker), so V3.1's has no prompt type
            special_tokens=("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>"),
            source="deepseek-ai/DeepSeek-V3.1 tokenizer_config.json chat_template (no tools; `thinking` is "
            "enable_thinking)",
        ),
        Template(
            "glm4_5",
            prefix="[gMASK]<sop>",
            user="<|user|>\n{content}<|assistant|>",
            assistant="\n{content}",
            system="<|system|>\n{content}",
            suffix="{eos}",
            think=THINK_GLM45,
            prompt_type="glm4_moe",  # MindSpeed-LLM examples/mcore/glm45/*.sh
            special_tokens=(
                "[gMASK]",
                "<sop>",
                "<|user|>",
                "<|assistant|>",
                "<|system|>",
                "<think>",
                "</think>",
            ),
            source="zai-org/GLM-4.5 chat_template.jinja (no tools)",
        ),
        Template(
            "alpaca",
            user="### Instruction:\n{content}\n\n### Response:\n",
            assistant="{content}{eos}",
            system="{content}\n\n",
            separator="\n\n",
            default_system="Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.",
            prompt_type="alpaca",
            source="Stanford Alpaca prompt; LLaMA-Factory 'alpaca'",
        ),
    )
}


def _fill(fmt: str, content: str, specials: Dict[str, str]) -> str:
    # str.replace, not str.format: user text may contain braces
    out = fmt.replace("{bos}", specials["bos"]).replace("{eos}", specials["eos"])
    return out.replace("{content}", content)


def split_reasoning(answer: str, reasoning: Optional[str], think: Think) -> Tuple[str, str]:
    """(reasoning, answer) of one assistant message, read as Qwen3's template reads it: the message's own
    reasoning field if it has one, else the text before `</think>` in the content (newlines trimmed as it does)."""
    close, open_ = think.close.strip(), think.open.strip()
    if reasoning is None and close in answer:
        reasoning = answer.split(close)[0].rstrip("\n").split(open_)[-1].lstrip("\n")
        answer = answer.split(close)[-1].lstrip("\n")
    return reasoning or "", answer


def template_segments(
    dialog: Dialog,
    t: Template,
    specials: Dict[str, str],
    system: Optional[str] = None,
    enable_thinking: bool = True,
) -> List[Tuple[str, str]]:
    """The dialog rendered once, as (text, role) pieces, role in prefix/system/user/assistant/separator/suffix.

    With a reasoning template (`t.think`) the last answer carries its think block (learned with it, or with
    enable_thinking=False the empty block is part of the prompt, a "user" piece) and earlier answers carry none."""
    sys_text = dialog.system or system or t.default_system
    think = t.think
    out: List[Tuple[str, str]] = []
    if t.prefix:
        out.append((_fill(t.prefix, "", specials), "prefix"))
    if sys_text and not t.system_in_user:
        out.append((_fill(t.system, sys_text, specials), "system"))
    n = len(dialog.turns)
    sys_turn = n - 1 if t.system_in_last_user else 0
    for i, (user, answer) in enumerate(dialog.turns):
        if i and t.separator:
            out.append((_fill(t.separator, "", specials), "separator"))
        if i == sys_turn and sys_text and t.system_in_user:
            user = _fill(t.system, sys_text, specials) + user
        if think and not enable_thinking and not user.endswith(think.user_off):
            user += think.user_off
        out.append((_fill(t.user, user, specials), "user"))
        block = ""
        if think:
            given = dialog.reasoning[i] if i < len(dialog.reasoning) else None
            reasoning, answer = split_reasoning(answer, given, think)
            if i < n - 1:
                if think.history:
                    out.append((think.history, "user"))  # earlier answers' reasoning is dropped
            elif not enable_thinking:
                off = think.open + think.close if think.off is None else think.off
                out.append((off, "user"))  # a non-thinking prompt ends with the empty block (or its marker)
                answer = answer.lstrip("\n")
            else:
                if think.open_in_prompt:
                    out.append((think.open, "user"))
                block = (
                    ("" if think.open_in_prompt else think.open) + reasoning.strip(think.strip) + think.close
                )
                answer = answer.lstrip("\n")
        out.append((block + _fill(t.assistant, answer, specials), "assistant"))
    if t.suffix:
        out.append((_fill(t.suffix, "", specials), "suffix"))
    return out


def template_samples(
    dialog: Dialog,
    t: Template,
    specials: Dict[str, str],
    system: Optional[str] = None,
    enable_thinking: bool = True,
    mask_history: bool = False,
) -> List[List[Tuple[str, str]]]:
    """The samples one dialog becomes: one rendering for most templates.

    A reasoning template renders earlier answers without their reasoning, so turn k of a dialog is not a prefix of
    turn k+1; each assistant turn then becomes its own sample, its history rendered as the model's template renders
    it at that turn (earlier answers bare, read only: role "history") and its answer with the think block. With
    mask_history only the last turn is learned, so the dialog stays one sample."""
    if not t.think or len(dialog.turns) == 1 or mask_history:
        return [template_segments(dialog, t, specials, system, enable_thinking)]
    out = []
    for k in range(1, len(dialog.turns) + 1):
        part = Dialog(dialog.system, dialog.turns[:k], dialog.reasoning[:k])
        segs = template_segments(part, t, specials, system, enable_thinking)
        last = max(i for i, (_, role) in enumerate(segs) if role == "assistant")
        out.append(
            [
                (text, "history" if role == "assistant" and i < last else role)
                for i, (text, role) in enumerate(segs)
            ]
        )
    return out


def prompt_text(tokenizer: Any, prompt: str, template: str, enable_thinking: Optional[bool] = None) -> str:
    """The text of one user turn plus the assistant's opening in kit template `template`: the prompt the model sees
    at inference (evaluation, serving). `enable_thinking` is the data's (None: the template's default); False ends
    a reasoning template's prompt with the empty think block the model was trained to see."""
    if template not in TEMPLATES:
        raise InputError(i18n.t("template.unknown", template=template, choices=sorted(TEMPLATES)))
    specials = {"bos": tokenizer.bos_token or "", "eos": tokenizer.eos_token or ""}
    thinking = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    pieces = template_segments(Dialog(None, [(prompt, "")]), TEMPLATES[template], specials, **thinking)
    # everything up to the (empty) answer: prefix, system, the user turn with the assistant's opening
    return "".join(t for t, role in pieces if role in ("prefix", "system", "user"))


def _messages(dialog: Dialog, system: Optional[str], upto: int) -> List[Dict[str, str]]:
    msgs: List[Dict[str, str]] = []
    sys_text = dialog.system or system
    if sys_text:
        msgs.append({"role": "system", "content": sys_text})
    for i, (user, answer) in enumerate(dialog.turns[:upto]):
        msgs.append({"role": "user", "content": user})
        msg = {"role": "assistant", "content": answer}
        if i < len(dialog.reasoning) and dialog.reasoning[i] is not None:
            msg["reasoning_content"] = dialog.reasoning[i]  # the field Qwen3's template reads
        msgs.append(msg)
    return msgs


def chat_template_samples(
    dialog: Dialog,
    tokenizer: Any,
    system: Optional[str] = None,
    enable_thinking: bool = True,
    mask_history: bool = False,
) -> List[List[Tuple[str, str]]]:
    """The dialog rendered by the tokenizer's own `chat_template`, split into prompt and answer pieces.

    A template that renders each turn as a prefix of the next gives one sample; one that rewrites earlier turns
    (Qwen3 drops their reasoning) gives one sample per assistant turn, each rendered by the template with the
    history up to that turn (or, with mask_history, one sample learning the last answer)."""
    n = len(dialog.turns)

    def render(upto: int, prompt: bool) -> str:
        msgs = _messages(dialog, system, upto)
        if prompt:
            msgs = msgs[:-1]
        return tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=prompt, enable_thinking=enable_thinking
        )

    def answer_of(k: int) -> Tuple[str, str]:
        prompt, full = render(k, True), render(k, False)
        if not full.startswith(prompt):
            raise InputError(
                "the tokenizer's chat_template renders an answer that does not continue its own generation "
                "prompt, so answers cannot be located for loss masking; use a named template instead (one of "
                f"{sorted(TEMPLATES)})."
            )
        return prompt, full

    out: List[Tuple[str, str]] = []
    done = ""
    growing = True
    for k in range(1, n + 1):
        prompt, full = answer_of(k)
        if not prompt.startswith(done):
            growing = False
            break
        out.append((prompt[len(done) :], "user"))
        out.append((full[len(prompt) :], "assistant"))
        done = full
    if growing:
        return [out]
    samples = []
    for k in range(n if mask_history else 1, n + 1):
        prompt, full = answer_of(k)
        samples.append([(prompt, "user"), (full[len(prompt) :], "assistant")])
    return samples


def learned_flags(roles: List[str], train_on_prompt: bool, mask_history: bool) -> List[bool]:
    """Which pieces the loss learns: answers (and the suffix); everything with train_on_prompt; last only with mask_history."""
    if train_on_prompt:
        return [True] * len(roles)
    flags = [r in ("assistant", "suffix") for r in roles]
    if mask_history and any(flags):
        last = max(i for i, r in enumerate(roles) if r == "assistant")
        flags = [f and i >= last for i, f in enumerate(flags)]
    return flags


def missing_special_tokens(t: Template, tokenizer: Any) -> List[str]:
    """Template markers that this tokenizer splits into several tokens (the model has not seen them as one)."""
    return [
        tok for tok in t.special_tokens if len(tokenizer(tok, add_special_tokens=False)["input_ids"]) != 1
    ]
