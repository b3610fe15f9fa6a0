"""Tensors still on disk: safetensors headers parsed directly, row ranges read with pread into the caller's buffer.

Format (safetensors spec): 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets: [begin, end]}}` (offsets relative to the end of the header), then the raw C-order bytes. A row range of
a tensor is therefore one contiguous byte range of the file, read with one system call and no page faults, which
keeps conversion close to the speed of copying the file.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, Tuple

import torch

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class FileSlice:
    """A C-contiguous tensor of `shape` and `dtype` stored at bytes [offset, offset + nbytes) of an open file; or,
    with `row_pitch`, a column block: shape[0] rows of shape[1] elements, each row_pitch bytes after the last."""

    __slots__ = ("fd", "offset", "shape", "dtype", "row_pitch")

    def __init__(self, fd: int, offset: int, shape: Tuple[int, ...], dtype: torch.dtype, row_pitch: int = 0):
        self.fd, self.offset, self.shape, self.dtype, self.row_pitch = (
            fd,
            offset,
            tuple(shape),
            dtype,
            row_pitch,
        )

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def numel(self) -> int:
        return _numel(self.shape)

    def _pread(self, view: memoryview, offset: int) -> None:
        done, total = 0, len(view)
        while done < total:  # pread may return less than asked (e.g. > 2 GiB on Linux)
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"unexpected end of file reading {total} bytes at offset {offset}")
            done += n

    def read_into(self, buf: torch.Tensor) -> None:
        """Fill a contiguous uint8 CPU tensor of nbytes with the slice's bytes."""
        view = memoryview(buf.numpy()).cast("B")
        if not self.row_pitch:
            self._pread(view, self.offset)
            return
        row = self.nbytes // self.shape[0]
        for i in range(self.shape[0]):  # one read per row: only this block's bytes, never the whole matrix
            self._pread(view[i * row : (i + 1) * row], self.offset + i * self.row_pitch)

    def tensor(self) -> torch.Tensor:
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        self.read_into(out)
        return out.view(self.dtype).view(self.shape)


class SafetensorsFile:
    """One .safetensors file: its header, and row ranges of its tensors as FileSlices."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes); download it again.")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(self.fd).st_size
        if n > size - 8:
            raise ValueError(
                f"{path}: header length {n} exceeds the file size {size}; the file is truncated."
            )
        header = json.loads(os.pread(self.fd, n, 8))
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries: Dict[str, tuple] = {}
        for key, info in header.items():
            begin, end = info["data_offsets"]
            if self.base + end > size:
                raise ValueError(
                    f"{path}: tensor {key!r} ends at byte {self.base + end} but the file has {size} "
                    f"bytes; the file is truncated, download it again."
                )
            self.entries[key] = (ST_DTYPES[info["dtype"]], tuple(info["shape"]), self.base + begin)

    def keys(self):
        return list(self.entries)

    def rows(self, key: str, start: int, stop: int) -> FileSlice:
        """Rows [start, stop) of tensor `key` (1-D tensors: elements)."""
        dtype, shape, offset = self.entries[key]
        row_bytes = _numel(shape[1:]) * torch.empty((), dtype=dtype).element_size()
        return FileSlice(self.fd, offset + start * row_bytes, (stop - start, *shape[1:]), dtype)

    def columns(self, key: str, start: int, stop: int) -> FileSlice:
        """Columns [start, stop) of every row of 2-D tensor `key`."""
        dtype, shape, offset = self.entries[key]
        item = torch.empty((), dtype=dtype).element_size()
        return FileSlice(
            self.fd, offset + start * item, (shape[0], stop - start), dtype, row_pitch=shape[1] * item
        )

    def close(self) -> None:
        os.close(self.fd)
