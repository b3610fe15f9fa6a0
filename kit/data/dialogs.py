"""Records to documents (pretrain) and dialogs (sft): Alpaca, ShareGPT and OpenAI-messages, with field mapping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from kit.data.readers import DataInputError, Record
from kit.errors import InputError

# kit field -> default column per format (Alpaca as in LLaMA-Factory / MindSpeed-LLM `--map-keys`)
DEFAULT_COLUMNS = {
    "text": {"text": "text"},
    "alpaca": {
        "instruction": "instruction",
        "input": "input",
        "output": "output",
        "system": "system",
        "history": "history",
    },
    # reasoning: an assistant message's own reasoning (the `reasoning_content` field Qwen3's chat template reads
    # and OpenAI-compatible servers return); a reasoning template also reads `<think>...</think>` in the content
    "sharegpt": {
        "messages": "conversations",
        "role": "from",
        "content": "value",
        "system": "system",
        "reasoning": "reasoning_content",
    },
    "openai": {
        "messages": "messages",
        "role": "role",
        "content": "content",
        "system": "system",
        "reasoning": "reasoning_content",
    },
}
USER_ROLES = ("user", "human")
ASSISTANT_ROLES = ("assistant", "gpt", "bot", "model")


@dataclass
class Dialog:
    """A system prompt (or None), (user, assistant) turns in order, and each answer's reasoning (None: none given;
    empty list: no answer has any)."""

    system: Optional[str] = None
    turns: List[Tuple[str, str]] = field(default_factory=list)
    reasoning: List[Optional[str]] = field(default_factory=list)

    @property
    def has_reasoning(self) -> bool:
        """Whether any answer comes with reasoning (its own field, or `</think>` in its text)."""
        return any(r for r in self.reasoning) or any("</think>" in a for _, a in self.turns)


def detect_format(rec: Record, kind: str, overrides: Optional[Dict[str, str]] = None) -> str:
    """The input format of one record, from its keys (after the user's column mapping).

    Called per record: a file may mix ShareGPT and OpenAI-messages records (merged datasets often do)."""
    if kind == "pretrain":
        return "text"
    overrides = overrides or {}
    for fmt, key in (("openai", "messages"), ("sharegpt", "messages"), ("alpaca", "instruction")):
        if not set(overrides) <= set(DEFAULT_COLUMNS[fmt]):
            continue
        cols = {**DEFAULT_COLUMNS[fmt], **overrides}
        value = rec.data.get(cols[key])
        if value is None:
            continue
        if key == "messages":
            first = value[0] if isinstance(value, list) and value and isinstance(value[0], dict) else {}
            if cols["role"] not in first and first:
                continue
        return fmt
    raise record_error(
        rec,
        f"cannot tell the dialog format of a record with keys {sorted(rec.data)}",
        "set input_format to 'alpaca', 'sharegpt' or 'openai' and map your fields with columns={...} "
        "(e.g. {'instruction': 'question', 'output': 'answer'})",
        "unknown_format",
    )


def record_error(rec: Record, problem: str, fix: str, reason: str = "malformed") -> DataInputError:
    """A DataInputError at `rec`'s position (file:line, and item number inside a JSON array)."""
    return DataInputError(rec.source, rec.line, problem, fix, reason, item=rec.item)


def column_map(fmt: str, overrides: Dict[str, str]) -> Dict[str, str]:
    """The format's default columns with the user's overrides applied."""
    cols = dict(DEFAULT_COLUMNS[fmt])
    unknown = set(overrides) - set(cols)
    if unknown:
        raise InputError(
            f"columns keys {sorted(unknown)} are not fields of format {fmt!r}; "
            f"use some of {sorted(cols)} (kit field -> your column)."
        )
    cols.update(overrides)
    return cols


def _field(
    rec: Record,
    cols: Dict[str, str],
    key: str,
    required: bool = True,
    kind: type = str,
    fix: str = "store text as a JSON string",
) -> Any:
    """The record's value of kit field `key` (its column from `cols`), None if absent and not required; a missing
    required field, or a value that is not a `kind`, is a record error naming the column and the fix."""
    col = cols[key]
    if col not in rec.data or rec.data[col] is None:
        if required:
            raise record_error(
                rec,
                f"missing field {col!r} (found {sorted(rec.data)})",
                f"add it, or map your column with columns={{'{key}': '<your column>'}}",
                "missing_field",
            )
        return None
    value = rec.data[col]
    if not isinstance(value, kind):
        what = {str: "string", list: "list"}.get(kind, kind.__name__)
        raise record_error(rec, f"field {col!r} is a {type(value).__name__}, not a {what}", fix, "bad_type")
    return value


def document_text(rec: Record, cols: Dict[str, str]) -> str:
    """The pretraining text of a record."""
    return _field(rec, cols, "text")


def alpaca_dialog(rec: Record, cols: Dict[str, str]) -> Dialog:
    """instruction (+ '\\n' + input) -> output, after optional history pairs; optional system."""
    instruction = _field(rec, cols, "instruction")
    extra = _field(rec, cols, "input", required=False) or ""
    output = _field(rec, cols, "output")
    system = _field(rec, cols, "system", required=False) or None
    history = rec.data.get(cols["history"]) or []
    turns = []
    if not isinstance(history, list):
        raise record_error(
            rec,
            f"history is a {type(history).__name__}, not a list",
            "write history as [[question, answer], ...]",
            "bad_type",
        )
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise record_error(
                rec,
                f"history item {i} is not a [question, answer] pair of strings",
                "write history as [[question, answer], ...]",
                "bad_type",
            )
        turns.append((pair[0], pair[1]))
    turns.append((instruction + ("\n" + extra if extra else ""), output))
    return Dialog(system, turns)


def messages_dialog(rec: Record, cols: Dict[str, str]) -> Dialog:
    """ShareGPT / OpenAI message lists: optional system first, then user/assistant alternating."""
    msgs = _field(rec, cols, "messages", kind=list, fix="store the messages as a JSON list of objects")
    system = _field(rec, cols, "system", required=False) if cols["system"] in rec.data else None
    roles, texts, thoughts = [], [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or cols["role"] not in m or cols["content"] not in m:
            raise record_error(
                rec,
                f"message {i} lacks {cols['role']!r}/{cols['content']!r}",
                "give every message a role and a content, or map them with columns",
                "missing_field",
            )
        role, content = m[cols["role"]], m[cols["content"]]
        if not isinstance(content, str) or not isinstance(role, str):
            raise record_error(
                rec,
                f"message {i} has a non-string role or content",
                "store role and content as strings",
                "bad_type",
            )
        thought = m.get(cols["reasoning"])
        if thought is not None and not isinstance(thought, str):
            raise record_error(
                rec,
                f"message {i} has a non-string {cols['reasoning']!r}",
                "store an answer's reasoning as a string (or leave the field out)",
                "bad_type",
            )
        roles.append(role.lower())
        texts.append(content)
        thoughts.append(thought)
    if roles and roles[0] == "system":
        system = texts[0]
        roles, texts, thoughts = roles[1:], texts[1:], thoughts[1:]
    turns = []
    for i in range(0, len(roles), 2):
        pair = roles[i : i + 2]
        if len(pair) < 2 or pair[0] not in USER_ROLES or pair[1] not in ASSISTANT_ROLES:
            raise record_error(
                rec,
                f"roles {roles} do not alternate user/assistant ending with an assistant",
                "keep one optional system message first, then user and assistant in turn",
                "malformed",
            )
        turns.append((texts[i], texts[i + 1]))
    if not turns:
        raise record_error(rec, "no user/assistant turn", "add at least one pair", "malformed")
    reasoning = thoughts[1::2] if any(t is not None for t in thoughts[1::2]) else []
    return Dialog(system or None, turns, reasoning)


PARSERS = {"alpaca": alpaca_dialog, "sharegpt": messages_dialog, "openai": messages_dialog}
