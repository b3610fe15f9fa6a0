"""Megatron indexed datasets (`<prefix>.bin` + `<prefix>.idx`), written and read with numpy only.

Byte layout (megatron-core `megatron/core/datasets/indexed_dataset.py`, `_IndexWriter.write`):
`.idx` = b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q n_sequences, <Q n_documents+1, then
int32 lengths[n_seq], int64 byte pointers[n_seq], int64 document indices[n_doc+1] (0 ... n_seq).
`.bin` = the tokens of every sequence back to back in the dtype of the header.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from kit.data.readers import DataPathError
from kit.errors import InputError, IntegrityError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# megatron-core DType enum values
DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (megatron-core `DType.optimal_dtype`: cardinality < 65500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedWriter:
    """Append documents to `<prefix>.bin` and write `<prefix>.idx` on `finalize()`; files under `tmp_suffix`."""

    def __init__(self, prefix: Union[str, Path], dtype: type = np.int32, tmp_suffix: str = ""):
        if dtype not in DTYPE_CODES:
            raise InputError(f"dtype {dtype} is not a Megatron token dtype; use one of {list(DTYPE_CODES)}")
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self.tmp_suffix = tmp_suffix
        self.bin_path = self.prefix + ".bin" + tmp_suffix
        self.idx_path = self.prefix + ".idx" + tmp_suffix
        self._bin = open(self.bin_path, "wb")
        # compact growable buffers: 4 + 8 bytes per sequence, 8 per document (what the .idx holds anyway)
        self._lengths = array("i")
        self._doc_index = array("q", [0])

    def _write(self, tokens: np.ndarray) -> None:
        arr = np.asarray(tokens)
        if arr.size and self.dtype == np.uint16 and (arr.min() < 0 or arr.max() > 65535):
            raise InputError(f"{self.bin_path}: token ids outside 0..65535 cannot be stored as uint16")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))

    def add_document(self, tokens: np.ndarray, lengths: Optional[Sequence[int]] = None) -> None:
        """Add one document: its tokens, split into sequences of `lengths` (default: one sequence)."""
        tokens = np.asarray(tokens)
        self._write(tokens)
        if lengths is None:
            lengths = [tokens.size]
        elif sum(lengths) != tokens.size:
            raise InputError(f"sequence lengths {list(lengths)} do not add up to {tokens.size} tokens")
        self._lengths.extend(int(n) for n in lengths)
        self._doc_index.append(len(self._lengths))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Add many one-sequence documents at once: `tokens` back to back, `lengths` one per document."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != int(np.asarray(tokens).size):
            raise InputError(
                f"document lengths add up to {int(lengths.sum())}, not {np.asarray(tokens).size}"
            )
        self._write(tokens)
        start = len(self._lengths)
        self._lengths.frombytes(lengths.astype(np.int32).tobytes())
        self._doc_index.frombytes(np.arange(start + 1, start + 1 + lengths.size, dtype=np.int64).tobytes())

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._doc_index) - 1

    def finalize(self) -> tuple[str, str]:
        """Close the .bin and write the .idx; return (bin_path, idx_path) (still under tmp_suffix)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = (
            np.frombuffer(self._lengths, dtype=np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        )
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_index = np.frombuffer(self._doc_index, dtype=np.int64)
        with open(self.idx_path, "wb") as fh:
            fh.write(HEADER)
            fh.write(struct.pack("<Q", VERSION))
            fh.write(struct.pack("<B", DTYPE_CODES[self.dtype.type]))
            fh.write(struct.pack("<Q", lengths.size))
            fh.write(struct.pack("<Q", doc_index.size))
            fh.write(lengths.tobytes(order="C"))
            fh.write(pointers.tobytes(order="C"))
            fh.write(doc_index.tobytes(order="C"))
            fh.flush()
            os.fsync(fh.fileno())
        return self.bin_path, self.idx_path

    def abort(self) -> None:
        """Close and delete the partial files."""
        self._bin.close()
        for p in (self.bin_path, self.idx_path):
            if os.path.exists(p):
                os.unlink(p)

    def commit(self) -> tuple[Path, Path]:
        """Rename the finished temporary files to their final names (.bin first, .idx last)."""
        final_bin, final_idx = Path(self.prefix + ".bin"), Path(self.prefix + ".idx")
        if self.tmp_suffix:
            os.replace(self.bin_path, final_bin)
            os.replace(self.idx_path, final_idx)
        return final_bin, final_idx


class IndexedReader:
    """Read-only view of `<prefix>.bin/.idx` (memory-mapped), validating the header and sizes."""

    def __init__(self, prefix: Union[str, Path]):
        self.prefix = str(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise DataPathError(
                    f"{p} is missing; pass the prefix without .bin/.idx (e.g. "
                    f"'.../alpaca_text_document') of a dataset written by `python -m kit data`."
                )
        with open(idx_path, "rb") as fh:
            head = fh.read(34)
        if len(head) < 34 or head[:9] != HEADER:
            raise IntegrityError(f"{idx_path} is not a Megatron index file (bad header {head[:9]!r}).")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != VERSION or code not in CODE_DTYPES:
            raise IntegrityError(f"{idx_path}: unsupported version {version} or dtype code {code}.")
        self.dtype = np.dtype(CODE_DTYPES[code])
        expected = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
        if os.path.getsize(idx_path) < expected:
            raise IntegrityError(f"{idx_path} is truncated ({os.path.getsize(idx_path)} < {expected} bytes).")
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.lengths = np.frombuffer(idx, dtype=np.int32, count=n_seq, offset=34)
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n_seq, offset=34 + n_seq * 4)
        self.doc_index = np.frombuffer(idx, dtype=np.int64, count=n_doc, offset=34 + n_seq * 12)
        self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype)
        total = int(self.lengths.astype(np.int64).sum())
        if self._bin.size != total:
            raise IntegrityError(
                f"{bin_path} holds {self._bin.size} tokens but the index lists {total}; the pair is "
                f"incomplete or mismatched: prepare the data again."
            )

    def __len__(self) -> int:
        return int(self.lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self._bin[start : start + int(self.lengths[i])])

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    @property
    def num_documents(self) -> int:
        return int(self.doc_index.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self._bin.size)

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the `.bin`, memory-mapped."""
        return self._bin
