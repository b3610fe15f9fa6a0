"""Pretraining data: tokenize documents, append EOS, concatenate, cut into max_length samples."""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import numpy as np

from kit.data.accounting import PrepReport
from kit.data.heldout import DROP_REASON, HELDOUT, TRAIN, HeldoutPicker
from kit.data.hf_rows import ArrowSink
from kit.data.indexed import IndexedWriter
from kit.data.tokenizing import encode_texts, worker_state


def pretrain_job(texts: List[str]) -> Tuple[np.ndarray, np.ndarray, Dict[str, int]]:
    """Tokenize a batch of documents: (all ids back to back, each with EOS, as int32; document lengths;
    special-token strings found in the text)."""
    state = worker_state()
    tok, settings = state["tok"], state["settings"]
    keep = settings.get("keep_special_tokens", False)
    encoded = encode_texts(tok, texts, specials_as_text=not keep)
    head = [tok.bos_token_id] if settings["add_bos"] and tok.bos_token_id is not None else []
    eos = [tok.eos_token_id]
    lengths = np.fromiter((len(e) + len(head) + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    # one pass from the Python lists into int32 (fromiter over the chained lists: ~25% less than building one
    # big list and converting it)
    pieces = itertools.chain.from_iterable(itertools.chain(head, e, eos) for e in encoded)
    flat = np.fromiter(pieces, dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths, state["count_specials"](texts)


class PretrainAssembler:
    """Receives tokenized batches in order; writes Megatron documents and max_length HF rows."""

    def __init__(
        self,
        sink: ArrowSink,
        writer: Optional[IndexedWriter],
        report: PrepReport,
        keep_special_tokens: bool = False,
        heldout: Optional[HeldoutPicker] = None,
    ):
        self.sink, self.writer, self.report = sink, writer, report
        self.heldout = heldout
        self.keep_special_tokens = keep_special_tokens
        self.max_length = report.max_length
        self.carry = np.zeros(0, dtype=np.int32)

    def add(self, result: Tuple[np.ndarray, np.ndarray, Dict[str, int]]) -> None:
        flat, lengths, specials = result
        self.report.count_special_strings(specials)
        if not lengths.size:
            return
        if self.heldout is not None:
            flat, lengths = self._split_heldout(flat, lengths)
            if not lengths.size:
                return
        self.report.tokens_in += int(flat.size)
        self.report.records_written += int(lengths.size)
        self.report.add_lengths(lengths)
        if self.writer is not None:
            self.writer.add_documents(flat, lengths)
        length = self.max_length
        if self.carry.size:  # complete the row begun by the previous batch; the rest is cut without a copy
            need = length - self.carry.size
            if flat.size < need:
                self.carry = np.concatenate([self.carry, flat])
                return
            self.sink.write_tokens(np.concatenate([self.carry, flat[:need]]).reshape(1, length))
            flat = flat[need:]
        rows = flat.size // length
        if rows:
            self.sink.write_tokens(flat[: rows * length].reshape(rows, length))
        self.carry = flat[rows * length :].copy()

    def _split_heldout(self, flat: np.ndarray, lengths: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The documents trained on; held-out ones go to the picker, copies of held-out ones are counted as dropped."""
        ends = np.cumsum(lengths)
        keep = np.ones(lengths.size, dtype=bool)
        for i, (end, n) in enumerate(zip(ends.tolist(), lengths.tolist())):
            verdict = self.heldout.take(flat[end - n : end])
            if verdict == TRAIN:
                continue
            keep[i] = False
            if verdict == HELDOUT:
                self.report.heldout += 1
            else:
                self.report.drop(
                    DROP_REASON, "a document with the same tokens as a held-out one (left out of training)"
                )
        if keep.all():
            return flat, lengths
        tokens = np.repeat(keep, lengths)
        return flat[tokens], lengths[keep]

    def finish(self) -> None:
        r = self.report
        r.samples = self.sink.rows
        r.tokens_out = r.samples * self.max_length
        r.tokens_learned = r.tokens_out
        # the tail shorter than max_length is left out of the HF rows (as run_clm's group_texts does); Megatron
        # keeps it, its sampler builds its own sequences
        r.remainder_tokens = int(self.carry.size)
        if r.special_strings:
            found = ", ".join(
                f"{k!r} x{v}" for k, v in sorted(r.special_strings.items(), key=lambda kv: -kv[1])
            )
            if self.keep_special_tokens:
                r.warnings.append(
                    f"special-token strings in the text became control tokens mid-document ({found}); "
                    f"keep_special_tokens=False tokenizes them as plain text"
                )
            else:
                r.warnings.append(
                    f"special-token strings in the text were tokenized as plain text ({found}); "
                    f"keep_special_tokens=True makes them control tokens"
                )
