"""Writing the rows of an HF `datasets` folder: streamed Arrow record batches, then the files `save_to_disk` writes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, List, Union

import numpy as np

from kit.data.prepared import COLUMNS, MODEL_INPUTS


def _features(kind: str):
    from datasets import Features, Value

    try:  # datasets >= 4 names a variable-length list `List`
        from datasets import List as ListFeature
    except ImportError:  # datasets 2.x / 3.x: `Sequence` (see the datasets 4.0.0 release notes)
        from datasets import Sequence as ListFeature

    return Features({c: ListFeature(Value("int32")) for c in COLUMNS[kind]})


DATA_FILE = "data-00000-of-00001.arrow"  # the name `Dataset.save_to_disk` gives a single shard


class ArrowSink:
    """Stream fixed-length rows (and ragged `seq_lens`) into the Arrow file of a `save_to_disk` folder.

    Rows are re-cut into record batches of a fixed row count, so the bytes do not depend on how the caller
    batched its work (batch_size, num_workers).
    """

    def __init__(self, folder: Path, kind: str, max_length: int, rows_per_batch: int = 0):
        from datasets.arrow_writer import ArrowWriter

        self.folder, self.kind, self.max_length = Path(folder), kind, max_length
        self.rows = 0
        # default ~1M tokens (4 MB) per column and record batch
        self.rows_per_batch = rows_per_batch or max(1, (1 << 20) // max_length)
        # one preallocated record batch per column, filled in place: each token is copied once, whatever the
        # caller's batching (no list of pieces to concatenate)
        self._buf = {c: np.empty((self.rows_per_batch, max_length), dtype=np.int32) for c in MODEL_INPUTS}
        self._fill = 0
        if kind == "pretrain":  # every pretraining row: labels = input_ids, mask all ones, positions 0..L-1
            self._buf["attention_mask"][:] = 1
            self._buf["position_ids"][:] = np.arange(max_length, dtype=np.int32)
            self._buf["labels"] = self._buf["input_ids"]
        self._pending_lens: List[List[int]] = []
        self._writer = ArrowWriter(features=_features(kind), path=str(self.folder / DATA_FILE))

    def write_tokens(self, ids: np.ndarray) -> None:
        """Add pretraining rows, (n, max_length) token ids; the other columns follow from them."""
        self._add({"input_ids": ids}, ["input_ids"])

    def write(self, columns: Dict[str, np.ndarray], seq_lens: Union[None, List[List[int]]] = None) -> None:
        """Add rows: each fixed column an (n, max_length) array; `seq_lens` one list per row (sft)."""
        if self.kind == "sft":
            self._pending_lens.extend(seq_lens)
        self._add(columns, MODEL_INPUTS)

    def _add(self, columns: Dict[str, np.ndarray], names) -> None:
        n = columns["input_ids"].shape[0]
        start = 0
        while start < n:
            take = min(n - start, self.rows_per_batch - self._fill)
            for c in names:  # broadcast views (position_ids) are fine here
                self._buf[c][self._fill : self._fill + take] = columns[c][start : start + take]
            self._fill += take
            start += take
            if self._fill == self.rows_per_batch:
                self._flush()
        self.rows += n

    def _flush(self) -> None:
        if self._fill:
            n = self._fill
            self._write_batch({c: a[:n] for c, a in self._buf.items()}, self._pending_lens[:n])
            self._pending_lens = self._pending_lens[n:]
            self._fill = 0

    def _write_batch(self, cols: Dict[str, np.ndarray], seq_lens: List[List[int]]) -> None:
        import pyarrow as pa

        n = cols["input_ids"].shape[0]
        offsets = pa.array(np.arange(0, (n + 1) * self.max_length, self.max_length, dtype=np.int32))
        arrays = [pa.ListArray.from_arrays(offsets, pa.array(cols[c].reshape(-1))) for c in MODEL_INPUTS]
        names = list(MODEL_INPUTS)
        if self.kind == "sft":
            lens = np.cumsum([0] + [len(s) for s in seq_lens]).astype(np.int32)
            flat = np.fromiter((x for s in seq_lens for x in s), dtype=np.int32, count=int(lens[-1]))
            arrays.append(pa.ListArray.from_arrays(pa.array(lens), pa.array(flat)))
            names.append("seq_lens")
        self._writer.write_table(pa.Table.from_arrays(arrays, names=names))

    def finalize(self, fingerprint_of: dict) -> int:
        """Write the last rows and the folder's dataset_info.json / state.json (as save_to_disk does)."""
        self._flush()
        self._writer.finalize()
        _write_info(self.folder, self.kind, fingerprint_of)
        return self.rows


def _write_info(folder: Path, kind: str, fingerprint_of: dict) -> None:
    """The folder's dataset_info.json and state.json, as `save_to_disk` writes them."""
    from datasets import DatasetInfo

    DatasetInfo(features=_features(kind)).write_to_directory(str(folder), pretty_print=True)
    # a content-derived fingerprint keeps state.json byte-identical across runs
    digest = hashlib.sha256(json.dumps(fingerprint_of, sort_keys=True).encode()).hexdigest()[:16]
    state = {
        "_data_files": [{"filename": DATA_FILE}],
        "_fingerprint": digest,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (Path(folder) / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")


class RaggedSink:
    """Stream rows of variable-length int32 columns (preference pairs: prompt, chosen, rejected ids) into the Arrow
    file of a `save_to_disk` folder; same files as ArrowSink, rows as long as their tokens (no padding stored)."""

    def __init__(self, folder: Path, kind: str):
        from datasets.arrow_writer import ArrowWriter

        self.folder, self.kind, self.rows = Path(folder), kind, 0
        self._writer = ArrowWriter(features=_features(kind), path=str(self.folder / DATA_FILE))

    def write(self, columns: Dict[str, List[np.ndarray]]) -> None:
        """Add rows: each column a list of 1-D int32 arrays, one per row."""
        import pyarrow as pa

        names = list(COLUMNS[self.kind])
        arrays = []
        for c in names:
            rows = columns[c]
            offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
            flat = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, dtype=np.int32)
            arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)))
        if arrays and len(columns[names[0]]):
            self._writer.write_table(pa.Table.from_arrays(arrays, names=names))
            self.rows += len(columns[names[0]])

    def finalize(self, fingerprint_of: dict) -> int:
        """Close the Arrow file; write dataset_info.json / state.json."""
        self._writer.finalize()
        _write_info(self.folder, self.kind, fingerprint_of)
        return self.rows
