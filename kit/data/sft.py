"""Fine-tuning data: dialogs through a chat template, answers-only labels, whole dialogs packed per sample."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from kit.data.accounting import PrepReport
from kit.data.dialogs import Dialog
from kit.data.heldout import DROP_REASON, HELDOUT, SAME_AS_HELDOUT, HeldoutPicker
from kit.data.hf_rows import ArrowSink
from kit.data.indexed import IndexedWriter
from kit.data.packing import IGNORE, build_packs, pack_lengths
from kit.data.templates import TEMPLATES, chat_template_samples, learned_flags, template_samples
from kit.data.tokenizing import encode_texts, worker_state

Item = Tuple[np.ndarray, np.ndarray]  # (input ids, labels), int32


def render_samples(dialog: Dialog, tok: Any, s: Dict[str, Any]) -> List[List[Tuple[str, str]]]:
    """The samples one dialog becomes under the settings `s` (template, system, enable_thinking, mask_history), each
    as (text, role) pieces: the tokenizer's own chat template or a kit template (kit.data.templates)."""
    thinking = s.get("enable_thinking", True)
    if s["template"] == "tokenizer":
        return chat_template_samples(dialog, tok, s["system"], thinking, s["mask_history"])
    specials = {"bos": tok.bos_token or "", "eos": tok.eos_token or ""}
    t = TEMPLATES[s["template"]]
    return template_samples(dialog, t, specials, s["system"], thinking, s["mask_history"])


def sft_job(dialogs: List[Dialog]) -> List[List[Item]]:
    """Template and tokenize a batch of dialogs into (ids, labels) with -100 on everything not learned: per dialog
    the samples it becomes (one, or one per assistant turn for a reasoning template; kit.data.templates)."""
    state = worker_state()
    tok, s = state["tok"], state["settings"]
    mask_history = s["mask_history"]
    per_dialog = [render_samples(d, tok, s) for d in dialogs]
    pieces = [segs for samples in per_dialog for segs in samples]
    encoded = encode_texts(tok, [text for segs in pieces for text, _ in segs])
    items: List[Item] = []
    k = 0
    for segs in pieces:
        flags = learned_flags([role for _, role in segs], s["train_on_prompt"], mask_history)
        parts = encoded[k : k + len(segs)]
        k += len(segs)
        ids = np.fromiter((t for p in parts for t in p), dtype=np.int32, count=sum(len(p) for p in parts))
        labels = ids.copy()
        at = 0
        for p, learn in zip(parts, flags):
            if not learn:
                labels[at : at + len(p)] = IGNORE
            at += len(p)
        items.append((ids, labels))
    out, at = [], 0
    for samples in per_dialog:
        out.append(items[at : at + len(samples)])
        at += len(samples)
    return out


class SftAssembler:
    """Receives (ids, labels) in order; applies the over-length policy, packs windows, writes rows and files."""

    def __init__(
        self,
        sink: ArrowSink,
        writers: Optional[List[IndexedWriter]],
        report: PrepReport,
        pad_id: int,
        overlong: str,
        pack: bool,
        window: int,
        heldout: Optional[HeldoutPicker] = None,
    ):
        self.sink, self.writers, self.report = sink, writers, report
        self.max_length, self.pad_id, self.overlong, self.pack, self.window = (
            report.max_length,
            pad_id,
            overlong,
            pack,
            window,
        )
        self.heldout = heldout
        self.items: List[Item] = []
        self.useful_tokens = 0
        self.dialogs = 0

    def add(self, groups: List[List[Item]], where: List[str]) -> None:
        """Each dialog's samples (one per dialog unless a reasoning template split it per turn), in input order."""
        r = self.report
        for group, src in zip(groups, where):
            r.turn_samples += len(group) - 1
            verdict = None  # a dialog's samples share the held-out decision of its first sample
            for n, (ids, labels) in enumerate(group):
                at = f"{src} (turn {n + 1})" if len(group) > 1 else src
                verdict = self._add_one(ids, labels, at, verdict)

    def _add_one(
        self, ids: np.ndarray, labels: np.ndarray, src: str, verdict: Optional[int]
    ) -> Optional[int]:
        """Apply the over-length policy and the held-out split to one sample; return the held-out verdict."""
        r = self.report
        r.tokens_in += int(ids.size)
        r.add_lengths(np.array([ids.size]))
        if ids.size > self.max_length:
            if self.overlong == "drop":
                r.drop("too_long", f"{src}: {ids.size} tokens > max_length {self.max_length} (dropped)")
                return verdict
            ids, labels = ids[: self.max_length], labels[: self.max_length]
            if not (labels != IGNORE).any():
                r.drop(
                    "too_long",
                    f"{src}: {ids.size} tokens > max_length {self.max_length}, and no answer "
                    f"token is left after truncation (dropped)",
                )
                return verdict
            r.truncated += 1
        if not (labels != IGNORE).any():
            r.drop("no_answer_tokens", f"{src}: no token is learned (check template and masking options)")
            return verdict
        if self.heldout is not None:
            first = verdict is None
            if first:
                verdict = self.heldout.take(ids, labels)
            else:  # a later turn of the same dialog: held out or trained on with its first turn
                self.heldout.follow(ids, labels, verdict)
            if verdict == HELDOUT:
                r.heldout += int(first)  # records, not rows
                return verdict
            if verdict == SAME_AS_HELDOUT:
                r.drop(DROP_REASON, f"{src}: the same tokens as a held-out dialog (left out of training)")
                return verdict
        self.items.append((ids, labels))
        if len(self.items) >= self.window:
            self._flush()
        return verdict

    def _flush(self) -> None:
        if not self.items:
            return
        lengths = [ids.size for ids, _ in self.items]
        bins = pack_lengths(lengths, self.max_length) if self.pack else [[i] for i in range(len(lengths))]
        rows = build_packs(self.items, bins, self.max_length, self.pad_id)
        self.sink.write(
            {k: rows[k] for k in ("input_ids", "labels", "attention_mask", "position_ids")}, rows["seq_lens"]
        )
        if self.writers is not None:
            # MindSpeed-LLM packed layout: one sequence per sample; attention_mask as segment ids 1..k, 0 on
            # padding (its neat-pack convention, keeps the dialog boundaries)
            for w, key in zip(self.writers, ("input_ids", "segment_ids", "labels")):
                arr = rows[key]
                w.add_documents(arr.reshape(-1), np.full(arr.shape[0], self.max_length, dtype=np.int64))
        r = self.report
        r.records_written += len(self.items)
        r.tokens_out += int(sum(lengths))
        r.tokens_learned += int(sum(int((lab != IGNORE).sum()) for _, lab in self.items))
        r.padding_tokens += len(bins) * self.max_length - int(sum(lengths))
        self.useful_tokens += int(sum(lengths))
        self.dialogs += len(lengths)
        self.items = []

    def finish(self) -> None:
        self._flush()
        r = self.report
        r.samples = self.sink.rows
        if self.dialogs:
            r.padding_ratio_unpacked = 1.0 - self.useful_tokens / (self.dialogs * self.max_length)
        if r.samples == 0:
            r.warnings.append("no dialog was written; see `dropped` and `problems` in the report")
        if r.reasoning_left_out:
            r.warnings.append(
                f"{r.reasoning_left_out} dialogs carry reasoning that the template leaves out (a template without "
                f"a think block, or enable_thinking=False); use template='qwen3' with enable_thinking=True to learn it"
            )


def encode_dialogs(
    dialogs: List[Dialog],
    tokenizer: Optional[str] = None,
    template: Optional[str] = None,
    system: Optional[str] = None,
    train_on_prompt: bool = False,
    mask_history: bool = False,
    trust_remote_code: bool = False,
    enable_thinking: bool = True,
) -> List[Item]:
    """(ids, labels) of each sample exactly as `prepare` encodes them, before truncation and packing (template None:
    DataConfig's default): one per dialog, or one per assistant turn where a reasoning template splits it."""
    from kit.data.config import DataConfig
    from kit.data.tokenizing import init_worker

    init_worker(
        tokenizer,
        trust_remote_code,
        {
            "template": template or DataConfig.template,
            "system": system,
            "add_bos": False,
            "train_on_prompt": train_on_prompt,
            "mask_history": mask_history,
            "enable_thinking": enable_thinking,
        },
    )
    return [item for group in sft_job(list(dialogs)) for item in group]
