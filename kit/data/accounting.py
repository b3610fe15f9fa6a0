"""Accounting of a preparation run: what was read, written, dropped, truncated and why; a length histogram."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

MAX_EXAMPLES = 20  # problems kept verbatim in the report (all are counted)
# the report's counts that its table, prepare()'s summary and the prepared-data manifest show, in this order
COUNT_KEYS = (
    "records_read",
    "records_written",
    "records_dropped",
    "dropped",
    "files_skipped",
    "truncated",
    "heldout_records",
    "tokens_in",
    "tokens_out",
    "tokens_learned",
    "remainder_tokens",
    "samples",
    "padding_ratio",
    "padding_ratio_unpacked",
)


@dataclass
class PrepReport:
    """Counts of one run; `lengths` is a bounded histogram of record lengths in tokens."""

    kind: str
    max_length: int
    records_read: int = 0
    records_written: int = 0
    dropped: Dict[str, int] = field(default_factory=dict)
    files_skipped: Dict[str, int] = field(default_factory=dict)
    formats: Dict[str, int] = field(default_factory=dict)
    special_strings: Dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    heldout: int = 0
    turn_samples: int = 0
    """Samples beyond one per dialog: a reasoning template (qwen3) makes one sample per assistant turn."""
    reasoning_left_out: int = 0
    """Dialogs whose reasoning the template does not render (no think block, or enable_thinking=False)."""
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_learned: int = 0
    remainder_tokens: int = 0
    samples: int = 0
    padding_tokens: int = 0
    padding_ratio_unpacked: Optional[float] = None
    problems: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    histogram: List[int] = field(default_factory=list)

    def __post_init__(self):
        # one bucket per length up to `hist_cap`, longer records counted at hist_cap; documents (pretrain) are
        # often longer than a sample, so their histogram reaches further
        self.hist_cap = self.max_length * (8 if self.kind == "pretrain" else 1)
        self._hist = (
            np.zeros(self.hist_cap + 1, dtype=np.int64)
            if not self.histogram
            else np.asarray(self.histogram, dtype=np.int64)
        )
        self._dropped = collections.Counter(self.dropped)

    def drop(self, reason: str, message: Optional[str] = None, count: int = 1) -> None:
        """Count `count` dropped records under `reason`; keep the first messages verbatim."""
        self._dropped[reason] += count
        if message and len(self.problems) < MAX_EXAMPLES:
            self.problems.append(message)

    def skip_file(self, reason: str, message: str) -> None:
        """Count one input file left out (or left from a line on) under `reason`."""
        self.files_skipped[reason] = self.files_skipped.get(reason, 0) + 1
        if len(self.problems) < MAX_EXAMPLES:
            self.problems.append(message)

    def count_format(self, fmt: str) -> None:
        """Count one record read in dialog format `fmt` (files may mix formats)."""
        self.formats[fmt] = self.formats.get(fmt, 0) + 1

    def count_special_strings(self, counts: Dict[str, int]) -> None:
        """Add occurrences of special-token strings (e.g. '<|endoftext|>') found in the raw text."""
        for k, v in counts.items():
            self.special_strings[k] = self.special_strings.get(k, 0) + int(v)

    def add_lengths(self, lengths: np.ndarray) -> None:
        """Add record lengths (tokens) to the histogram."""
        lengths = np.minimum(np.asarray(lengths, dtype=np.int64), self.hist_cap)
        self._hist += np.bincount(lengths, minlength=self.hist_cap + 1)

    def finish(self) -> PrepReport:
        """Freeze the counters into the plain fields (for JSON)."""
        self.dropped = dict(sorted(self._dropped.items()))
        self.histogram = self._hist.tolist()
        return self

    @property
    def records_dropped(self) -> int:
        return int(sum(self._dropped.values()))

    @property
    def padding_ratio(self) -> float:
        total = self.samples * self.max_length
        return self.padding_tokens / total if total else 0.0

    def as_dict(self) -> dict:
        """The report as plain values (histogram as its non-empty buckets)."""
        self.finish()
        hist = {int(i): int(n) for i, n in enumerate(self.histogram) if n}
        return {
            "kind": self.kind,
            "max_length": self.max_length,
            "records_read": self.records_read,
            "records_written": self.records_written,
            "records_dropped": self.records_dropped,
            "dropped": self.dropped,
            "files_skipped": dict(sorted(self.files_skipped.items())),
            "formats": dict(sorted(self.formats.items())),
            "special_token_strings": dict(sorted(self.special_strings.items())),
            "truncated": self.truncated,
            "heldout_records": self.heldout,
            "turn_samples": self.turn_samples,
            "reasoning_left_out": self.reasoning_left_out,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "tokens_learned": self.tokens_learned,
            "remainder_tokens": self.remainder_tokens,
            "samples": self.samples,
            "padding_tokens": self.padding_tokens,
            "padding_ratio": round(self.padding_ratio, 6),
            "padding_ratio_unpacked": None
            if self.padding_ratio_unpacked is None
            else round(self.padding_ratio_unpacked, 6),
            "problems": self.problems,
            "warnings": self.warnings,
            "length_histogram": hist,
        }

    def sentence(self) -> str:
        """The accounting in one sentence: read, written, held out, dropped (by reason), truncated."""
        noun = {"pretrain": "documents", "sft": "dialogs", "dpo": "pairs"}.get(self.kind, "records")
        self.finish()
        why = ", ".join(f"{k}: {v}" for k, v in self.dropped.items())
        return (
            f"{self.records_read} {noun} read: {self.records_written} written for training, {self.heldout} held "
            f"out, {self.records_dropped} dropped{f' ({why})' if why else ''}, {self.truncated} truncated to "
            f"{self.max_length} tokens."
        )

    def table(self) -> object:
        """The key counts as a two-column pandas DataFrame, for notebooks."""
        import pandas as pd

        d = self.as_dict()
        rows = [
            (k, d[k]) for k in COUNT_KEYS if not isinstance(d[k], dict)
        ]  # the dicts: one row per reason below
        rows += [(f"dropped: {k}", v) for k, v in d["dropped"].items()]
        rows += [(f"files skipped: {k}", v) for k, v in d["files_skipped"].items()]
        rows += [(f"format: {k}", v) for k, v in d["formats"].items()]
        rows += [(f"special-token string in text: {k}", v) for k, v in d["special_token_strings"].items()]
        # object dtype keeps counts as integers next to the ratios
        return pd.DataFrame(
            {"value": pd.Series([v for _, v in rows], index=[k for k, _ in rows], dtype=object)}
        )


def plot_lengths(report: PrepReport, png: Path, title: str = "") -> Path:
    """Histogram of record lengths against max_length, saved as PNG; returns the path."""
    # a bare Figure (no pyplot): works headless and leaves a notebook's backend alone
    from matplotlib.figure import Figure

    report.finish()
    hist = np.asarray(report.histogram)
    fig = Figure(figsize=(7, 3.5))
    ax = fig.add_subplot()
    used = np.nonzero(hist)[0]
    if used.size:
        # re-bin the per-length counts into at most 60 bars (no per-record expansion: corpora are large)
        hi = int(used[-1]) + 1
        width = max(1, -(-hi // 60))
        edges = np.arange(0, hi + width, width)
        padded = np.pad(hist, (0, max(0, int(edges[-1]) - hist.size)))[: edges[-1]]
        counts = np.add.reduceat(padded, edges[:-1])
        ax.stairs(counts, edges, fill=True, color="#4477aa")
    ax.axvline(report.max_length, color="#cc3311", linestyle="--", label=f"max_length = {report.max_length}")
    what = "document" if report.kind == "pretrain" else "dialog"
    ax.set_xlabel(f"{what} length in tokens (longer ones counted at {report.hist_cap})")
    ax.set_ylabel(f"{what}s")
    ax.set_title(
        title or f"{report.kind}: {report.records_written} {what}s, padding {100 * report.padding_ratio:.1f}%"
    )
    ax.legend()
    fig.tight_layout()
    from kit.storage.atomic import atomic_file

    png = Path(png)
    with atomic_file(png, "wb") as fh:
        fig.savefig(fh, format="png", dpi=100)
    return png
