"""Preference pairs (DPO data): a prompt and two answers, chosen and rejected, read from the formats users have,
rendered through the SFT chat templates and tokenized once, the prompt stored once and shared by both answers.

Formats (detected per record, columns renamed with DataConfig.columns):
- `trl`: TRL's `prompt` / `chosen` / `rejected`, plain strings or conversational (a message list for the prompt, a
  one-message list or a message for each answer). A plain prompt is one user turn and goes through the chat template,
  as the SFT data does (TRL itself tokenizes plain text as it is).
- `alpaca`, `sharegpt`: LLaMA-Factory's ranking data: `instruction` / `input` (optional `system`, `history`) or a
  `conversations` list (ShareGPT `from` / `value`, or OpenAI `role` / `content` under `messages`) ending with a user
  turn, and `chosen` / `rejected` as strings or messages.
- `hh`: both answers are whole dialogs sharing their prompt (Anthropic HH-RLHF's `\\n\\nHuman: ... \\n\\nAssistant: ...`
  text, or TRL's implicit-prompt message lists); the prompt is their common prefix of turns (TRL's `extract_prompt`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from kit.data.accounting import PrepReport
from kit.data.dialogs import ASSISTANT_ROLES, USER_ROLES, Dialog, record_error
from kit.data.heldout import DROP_REASON, HELDOUT, SAME_AS_HELDOUT, HeldoutPicker
from kit.data.prepared import IGNORE_INDEX
from kit.data.readers import Record
from kit.errors import InputError

PAIR_FORMATS = ("trl", "alpaca", "sharegpt", "hh")
PAIR_COLUMNS: Dict[str, Dict[str, str]] = {
    "trl": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system"},
    "alpaca": {
        "instruction": "instruction",
        "input": "input",
        "chosen": "chosen",
        "rejected": "rejected",
        "system": "system",
        "history": "history",
    },
    "sharegpt": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system"},
    "hh": {"chosen": "chosen", "rejected": "rejected"},
}
_HH_TURN = re.compile(r"\n\nHuman: |\n\nAssistant: ")
Ids = np.ndarray  # int32 token ids


@dataclass
class Pair:
    """A prompt (a dialog whose last turn's answer is left empty) and the two answers to it."""

    prompt: Dialog
    chosen: str
    rejected: str

    def dialog(self, answer: str) -> Dialog:
        """The whole dialog with `answer` as its last turn's answer."""
        turns = list(self.prompt.turns)
        turns[-1] = (turns[-1][0], answer)
        return Dialog(self.prompt.system, turns)


def detect_pair_format(rec: Record, overrides: Dict[str, str]) -> str:
    """The pair format of one record, from its keys (after the user's column mapping)."""
    for fmt, key in (
        ("trl", "prompt"),
        ("alpaca", "instruction"),
        ("sharegpt", "messages"),
        ("hh", "chosen"),
    ):
        cols = {**PAIR_COLUMNS[fmt], **{k: v for k, v in overrides.items() if k in PAIR_COLUMNS[fmt]}}
        if key == "messages" and "messages" in rec.data and "messages" not in overrides:
            return fmt  # OpenAI-style messages under their own name
        if cols[key] in rec.data:
            return fmt
    raise record_error(
        rec,
        f"cannot tell the preference-pair format of a record with keys {sorted(rec.data)}",
        "give prompt/chosen/rejected (TRL), instruction/chosen/rejected or conversations/chosen/rejected "
        "(LLaMA-Factory), or chosen/rejected whole dialogs (HH); map other names with columns={...}",
        "unknown_format",
    )


def _field(rec: Record, cols: Dict[str, str], key: str, required: bool = True) -> Any:
    col = cols[key]
    if rec.data.get(col) is None:
        if required:
            raise record_error(
                rec,
                f"missing field {col!r} (found {sorted(rec.data)})",
                f"every pair needs a prompt, a chosen and a rejected answer; map your column with "
                f"columns={{'{key}': '<your column>'}}",
                "missing_field",
            )
        return None
    return rec.data[col]


def _message(rec: Record, m: Any, what: str) -> Tuple[str, str]:
    """(role, content) of one message: OpenAI (`role`/`content`) or ShareGPT (`from`/`value`)."""
    if isinstance(m, dict):
        role, content = m.get("role", m.get("from")), m.get("content", m.get("value"))
        if isinstance(role, str) and isinstance(content, str):
            return role.lower(), content
    raise record_error(
        rec,
        f"{what} is not a message with a role and a text content",
        "write {'role': ..., 'content': ...}",
        "bad_type",
    )


def _messages(rec: Record, value: Any, what: str) -> List[Tuple[str, str]]:
    if not isinstance(value, list):
        raise record_error(
            rec, f"{what} is a {type(value).__name__}, not a list of messages", "store a list", "bad_type"
        )
    return [_message(rec, m, f"{what} item {i}") for i, m in enumerate(value)]


def _answer(rec: Record, value: Any, what: str) -> str:
    """One answer: a string, a message, or a list holding one assistant message."""
    if isinstance(value, str):
        return value
    msgs = [_message(rec, value, what)] if isinstance(value, dict) else _messages(rec, value, what)
    if len(msgs) != 1 or msgs[0][0] not in ASSISTANT_ROLES:
        raise record_error(
            rec,
            f"{what} is not one assistant answer (roles {[r for r, _ in msgs]})",
            "give one answer",
            "malformed",
        )
    return msgs[0][1]


def _prompt(rec: Record, msgs: List[Tuple[str, str]], system: Optional[str]) -> Dialog:
    """A prompt dialog from messages: an optional system message, then user/assistant turns ending with a user."""
    if msgs and msgs[0][0] == "system":
        system, msgs = msgs[0][1], msgs[1:]
    roles = [r for r, _ in msgs]
    ok = len(msgs) % 2 == 1 and all(
        r in (USER_ROLES if i % 2 == 0 else ASSISTANT_ROLES) for i, r in enumerate(roles)
    )
    if not ok:
        raise record_error(
            rec,
            f"the prompt's roles {roles} do not alternate user/assistant ending with a user turn",
            "keep one optional system message first, then user and assistant in turn, the last one a user's",
            "malformed",
        )
    turns = [(msgs[i][1], msgs[i + 1][1]) for i in range(0, len(msgs) - 1, 2)] + [(msgs[-1][1], "")]
    return Dialog(system or None, turns)


def _hh_messages(text: str) -> Optional[List[Tuple[str, str]]]:
    """Anthropic HH-RLHF text ('\\n\\nHuman: q\\n\\nAssistant: a...') as messages; None when it is not in that form."""
    marks = list(_HH_TURN.finditer(text))
    if not marks or text[: marks[0].start()].strip():
        return None
    out = []
    for m, nxt in zip(marks, marks[1:] + [None]):
        role = "user" if "Human" in m.group() else "assistant"
        out.append((role, text[m.end() : nxt.start() if nxt else len(text)]))
    return out


def _implicit(rec: Record, chosen: Any, rejected: Any) -> Pair:
    """HH style: two whole dialogs; the prompt is their longest common prefix of messages (TRL's extract_prompt)."""
    sides = []
    for what, value in (("chosen", chosen), ("rejected", rejected)):
        msgs = _hh_messages(value) if isinstance(value, str) else _messages(rec, value, what)
        if msgs is None:
            raise record_error(
                rec,
                f"{what} is plain text without a prompt (no '\\n\\nHuman:' / '\\n\\nAssistant:' turns)",
                "give the prompt in its own field (prompt, instruction or conversations)",
                "missing_field",
            )
        sides.append(msgs)
    a, b = sides
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    if a == b and len(a) > 1 and a[-1][0] in ASSISTANT_ROLES:
        return Pair(
            _prompt(rec, a[:-1], None), a[-1][1], b[-1][1]
        )  # identical: counted as such by the caller
    if (
        k == 0
        or len(a) != k + 1
        or len(b) != k + 1
        or a[k][0] not in ASSISTANT_ROLES
        or b[k][0] not in ASSISTANT_ROLES
    ):
        raise record_error(
            rec,
            "chosen and rejected do not share a prompt followed by one answer each",
            "make both the same dialog up to their last assistant turn",
            "malformed",
        )
    return Pair(_prompt(rec, a[:k], None), a[k][1], b[k][1])


def parse_pair(rec: Record, fmt: str, cols: Dict[str, str]) -> Pair:
    """The Pair of one record in format `fmt` (see the module doc); a bad record is a DataInputError at its line."""
    chosen, rejected = _field(rec, cols, "chosen"), _field(rec, cols, "rejected")
    if fmt == "hh":
        return _implicit(rec, chosen, rejected)
    system = _field(rec, cols, "system", required=False)
    if system is not None and not isinstance(system, str):
        raise record_error(rec, "system is not a string", "store it as a string", "bad_type")
    if fmt == "trl":
        prompt = _field(rec, cols, "prompt")
        msgs = [("user", prompt)] if isinstance(prompt, str) else _messages(rec, prompt, "prompt")
        dialog = _prompt(rec, msgs, system)
    elif fmt == "alpaca":
        instruction, extra = (
            _field(rec, cols, "instruction"),
            _field(rec, cols, "input", required=False) or "",
        )
        history = _field(rec, cols, "history", required=False) or []
        if not (isinstance(instruction, str) and isinstance(extra, str) and isinstance(history, list)):
            raise record_error(
                rec, "instruction/input are not strings or history not a list", "fix the types", "bad_type"
            )
        msgs = []
        for i, turn in enumerate(history):
            if not (
                isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)
            ):
                raise record_error(
                    rec, f"history item {i} is not a [question, answer] pair", "fix it", "bad_type"
                )
            msgs += [("user", turn[0]), ("assistant", turn[1])]
        msgs.append(("user", instruction + ("\n" + extra if extra else "")))
        dialog = _prompt(rec, msgs, system)
    else:  # sharegpt
        key = "messages" if "messages" in rec.data and cols["messages"] not in rec.data else cols["messages"]
        dialog = _prompt(rec, _messages(rec, rec.data.get(key), key), system)
    return Pair(dialog, _answer(rec, chosen, "chosen"), _answer(rec, rejected, "rejected"))


def why_unusable(pair: Pair) -> Optional[str]:
    """The drop reason of a parsed pair that cannot teach a preference (None: usable)."""
    if not pair.prompt.turns[-1][0].strip():
        return "empty_prompt"
    if not pair.chosen.strip() or not pair.rejected.strip():
        return "empty_answer"
    if pair.chosen == pair.rejected:
        return "same_answers"  # the loss would be log 2 whatever the model: nothing to learn
    return None


def pair_job(pairs: List[Pair]) -> List[Tuple[Ids, Ids, Ids]]:
    """(prompt ids, chosen ids, rejected ids) of each pair: both dialogs rendered by the SFT path's template
    (kit.data.sft.render_samples, the last answer learned) and split where the last answer starts; the pieces are
    tokenized apart and joined, as for SFT, so prompt + answer are the ids SFT data of that dialog would hold."""
    from kit.data.sft import render_samples
    from kit.data.tokenizing import encode_texts, worker_state

    state = worker_state()
    tok, s = state["tok"], dict(state["settings"], mask_history=True)
    split = []
    for p in pairs:
        sides = []
        for answer in (p.chosen, p.rejected):
            pieces = render_samples(p.dialog(answer), tok, s)[-1]
            last = max(i for i, (_, role) in enumerate(pieces) if role == "assistant")
            sides.append(([t for t, _ in pieces[:last]], [t for t, _ in pieces[last:]]))
        if sides[0][0] != sides[1][0]:
            raise InputError(
                "the chat template renders a pair's prompt differently for its two answers, so they cannot share it; "
                "use a named template (DataConfig.template)."
            )
        split.append((sides[0][0], sides[0][1], sides[1][1]))
    encoded = encode_texts(tok, [t for parts in split for side in parts for t in side])
    out, k = [], 0
    for parts in split:
        ids = []
        for side in parts:
            ids.append(np.fromiter((t for e in encoded[k : k + len(side)] for t in e), dtype=np.int32))
            k += len(side)
        out.append(tuple(ids))
    return out


class PairPicker(HeldoutPicker):
    """The held-out split for pairs: the SFT rule (kit.data.heldout) judged on a pair's ids, pairs kept whole."""

    def __init__(self, records: int, every: int, max_length: int):
        super().__init__(records, every, max_length)
        self.pairs: List[Tuple[Ids, Ids, Ids]] = []

    def take_pair(self, prompt: Ids, chosen: Ids, rejected: Ids) -> int:
        verdict = self.take(np.concatenate([prompt, chosen, rejected]))
        if verdict == HELDOUT:
            self.items.pop()  # the base class kept the joined ids; the pair is kept instead
            self.pairs.append((prompt, chosen, rejected))
        return verdict

    def write(self, folder: Any, pad_id: int) -> int:
        from kit.data.hf_rows import RaggedSink

        sink = RaggedSink(folder, "dpo")
        sink.write(
            {
                c: [p[i] for p in self.pairs]
                for i, c in enumerate(("prompt_ids", "chosen_ids", "rejected_ids"))
            }
        )
        return sink.finalize(self.stats())

    def stats(self) -> dict:
        return {
            "records": self._records,
            "rows": len(self.pairs),
            "tokens": int(sum(sum(len(x) for x in p) for p in self.pairs)),
            "tokens_learned": int(sum(len(c) + len(r) for _, c, r in self.pairs)),
            "truncated": 0,
        }


def megatron_pair(prompt: Ids, chosen: Ids, rejected: Ids) -> Tuple[Ids, Ids, Ids, Ids]:
    """One pair as MindSpeed-LLM's pairwise handler writes it: chosen ids, chosen labels, rejected ids, rejected labels
    (prompt + answer; the labels -100 on the prompt, not shifted)."""
    ignore = np.full(len(prompt), IGNORE_INDEX, dtype=np.int64)
    return (
        np.concatenate([prompt, chosen]),
        np.concatenate([ignore, chosen]),
        np.concatenate([prompt, rejected]),
        np.concatenate([ignore, rejected]),
    )


class PairAssembler:
    """Receives tokenized pairs in order: drops a prompt that leaves no room for an answer, cuts answers to
    max_length (or drops them, overlong='drop'), applies the held-out split, writes rows in batches; with `writers`
    (kit.data.prepared.PAIR_MEGATRON_KEYS' four) also MindSpeed-LLM's pairwise files, one document per pair."""

    def __init__(
        self,
        sink: Any,
        report: PrepReport,
        overlong: str,
        heldout: Optional[PairPicker] = None,
        writers: Optional[List[Any]] = None,
    ):
        self.sink, self.report, self.overlong, self.heldout = sink, report, overlong, heldout
        self.writers = writers
        self.max_length = report.max_length
        self.rows: List[Tuple[Ids, Ids, Ids]] = []

    def add(self, pairs: List[Tuple[Ids, Ids, Ids]], where: List[str]) -> None:
        for (p, c, r), src in zip(pairs, where):
            self._add_one(p, c, r, src)

    def _add_one(self, p: Ids, c: Ids, r: Ids, src: str) -> None:
        rep, room = self.report, self.max_length - p.size
        rep.tokens_in += int(p.size + c.size + r.size)
        rep.add_lengths(np.array([p.size + max(c.size, r.size)]))
        if room < 1:
            rep.drop(
                "prompt_too_long",
                f"{src}: the prompt alone is {p.size} tokens >= max_length {self.max_length}",
            )
            return
        if c.size > room or r.size > room:
            if self.overlong == "drop":
                rep.drop("too_long", f"{src}: prompt + answer > max_length {self.max_length} (dropped)")
                return
            c, r = c[:room], r[:room]  # keep the start, as TRL's truncation_mode='keep_start'
            rep.truncated += 1
            if np.array_equal(c, r):
                rep.drop(
                    "same_answers",
                    f"{src}: the answers are the same once cut to max_length {self.max_length}",
                )
                return
        if self.heldout is not None:
            verdict = self.heldout.take_pair(p, c, r)
            if verdict == HELDOUT:
                rep.heldout += 1
                return
            if verdict == SAME_AS_HELDOUT:
                rep.drop(DROP_REASON, f"{src}: the same tokens as a held-out pair (left out of training)")
                return
        self.rows.append((p, c, r))
        if len(self.rows) >= 1000:
            self._flush()

    def _flush(self) -> None:
        if not self.rows:
            return
        cols = ("prompt_ids", "chosen_ids", "rejected_ids")
        self.sink.write({name: [row[i] for row in self.rows] for i, name in enumerate(cols)})
        if self.writers:
            for p, c, r in self.rows:
                for w, seq in zip(self.writers, megatron_pair(p, c, r)):
                    w.add_document(seq)
        rep = self.report
        rep.records_written += len(self.rows)
        rep.tokens_out += int(sum(p.size + c.size + r.size for p, c, r in self.rows))
        rep.tokens_learned += int(sum(c.size + r.size for _, c, r in self.rows))
        self.rows = []

    def finish(self) -> None:
        self._flush()
        self.report.samples = self.sink.rows
        if self.report.samples == 0:
            self.report.warnings.append("no pair was written; see `dropped` and `problems` in the report")
