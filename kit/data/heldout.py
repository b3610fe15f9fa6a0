"""The held-out split: a few records kept out of training, for evaluation (notebook 06's held-out loss).

The rule is deterministic and independent of batching and worker count: records are judged in input order, after
parsing, the chat template and the over-length policy (so a held-out record is one training could have used). Every
k-th such record is held out until the wanted count is reached. Records are compared by their token ids: a record
identical to one already trained on is passed over (the next one is taken instead), and a later copy of a held-out
record is left out of training and counted as dropped (`same_as_heldout`), so no held-out text is ever trained on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List, Optional, Set, Tuple

import numpy as np

from kit.data.packing import IGNORE, build_packs

TRAIN, HELDOUT, SAME_AS_HELDOUT = 0, 1, 2
DROP_REASON = "same_as_heldout"


def rule_text(kind: str, records: int, every: int) -> str:
    """The rule, as recorded in the manifest."""
    what = {
        "sft": "dialog in input order (after parsing, the chat template and the over-length policy)",
        "dpo": "preference pair in input order (after parsing, the chat template and the over-length policy)",
    }.get(kind, "non-empty document in input order")
    return (
        f"every {every}th usable {what}, at most {records}; a record whose token ids equal one already trained on is passed over, and "
        f"later copies of a held-out record are left out of training (dropped: {DROP_REASON})"
    )


class HeldoutPicker:
    """Decides, record by record in input order, whether a record is trained on or held out (see the module doc)."""

    def __init__(self, records: int, every: int, max_length: int):
        self.wanted, self.every, self.max_length = int(records), int(every), int(max_length)
        self.items: List[Tuple[np.ndarray, np.ndarray]] = []  # (ids, labels) of the held-out records
        self.truncated = 0
        self._held: Set[bytes] = set()
        self._seen: Set[bytes] = set()  # records trained on, kept only until the split is complete
        self._position = 0
        self._due = False
        self._records = 0  # held-out records (a dialog split per turn is one record of several rows)

    @property
    def full(self) -> bool:
        return self._records >= self.wanted

    def take(self, ids: np.ndarray, labels: Optional[np.ndarray] = None) -> int:
        """TRAIN, HELDOUT (kept here, truncated to max_length) or SAME_AS_HELDOUT for one record's token ids."""
        key = hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=16).digest()
        if key in self._held:
            return SAME_AS_HELDOUT
        if self.full:
            return TRAIN
        self._position += 1
        if self._position % self.every == 0:
            self._due = True
        if self._due and key not in self._seen:
            self._due = False
            self._held.add(key)
            if ids.size > self.max_length:
                self.truncated += 1
            n = min(ids.size, self.max_length)
            lab = ids if labels is None else labels
            self.items.append((np.array(ids[:n], dtype=np.int32), np.array(lab[:n], dtype=np.int32)))
            self._records += 1
            if self.full:
                self._seen = set()  # later records are only compared with the held-out ones
            return HELDOUT
        self._seen.add(key)
        return TRAIN

    def follow(self, ids: np.ndarray, labels: Optional[np.ndarray], verdict: int) -> None:
        """Record a later sample of a dialog whose first sample got `verdict` (a dialog split per turn stays on one
        side of the split, so no held-out answer is ever context of a trained one)."""
        key = hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes(), digest_size=16).digest()
        if verdict == HELDOUT:
            self._held.add(key)
            n = min(ids.size, self.max_length)
            self.truncated += int(ids.size > self.max_length)
            lab = ids if labels is None else labels
            self.items.append((np.array(ids[:n], dtype=np.int32), np.array(lab[:n], dtype=np.int32)))
        elif verdict == TRAIN and not self.full:
            self._seen.add(key)

    def write(self, folder: Path, pad_id: int) -> int:
        """Write the held-out rows (one record per row, padded, `seq_lens` = [its length]) as an HF folder."""
        from kit.data.hf_rows import ArrowSink

        sink = ArrowSink(folder, "sft", self.max_length)
        if self.items:
            rows = build_packs(self.items, [[i] for i in range(len(self.items))], self.max_length, pad_id)
            sink.write(
                {k: rows[k] for k in ("input_ids", "labels", "attention_mask", "position_ids")},
                rows["seq_lens"],
            )
        tokens = int(sum(ids.size for ids, _ in self.items))
        learned = int(sum(int((lab != IGNORE).sum()) for _, lab in self.items))
        sink.finalize({"heldout": tokens, "learned": learned, "rows": len(self.items)})
        return sink.rows

    def stats(self) -> dict:
        """Counts for the manifest: records, tokens, learned tokens, truncated."""
        return {
            "records": self._records,
            "rows": len(self.items),
            "tokens": int(sum(ids.size for ids, _ in self.items)),
            "tokens_learned": int(sum(int((lab != IGNORE).sum()) for _, lab in self.items)),
            "truncated": self.truncated,
        }
