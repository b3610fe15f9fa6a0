"""Write a `torch.save`-compatible file one tensor at a time, so a rank file never has to be whole in memory.

torch.save's zip layout (torch/serialization.py `_save`): `data.pkl` (the pickled object, tensors as
`_rebuild_tensor_v2` of persistent storage ids), `.format_version`, `.storage_alignment`, `byteorder`, and one
record `data/<key>` per storage. Records are found by name, so the storages can be written first, as they are
produced, and the pickle last. Plain `torch.load(..., weights_only=True, mmap=True)` reads the result.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from pathlib import Path
from typing import Tuple

import torch

from kit.convert.file_slices import FileSlice


class _StorageRef:
    """Stands for a storage already written as record data/<key>."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly like a contiguous CPU tensor whose storage is already on disk."""

    def __init__(self, ref: _StorageRef, shape: Tuple[int, ...], stride: Tuple[int, ...]):
        self.ref, self.shape, self.stride = ref, shape, stride

    def __reduce_ex__(self, protocol):
        return (
            torch._utils._rebuild_tensor_v2,
            (self.ref, 0, self.shape, self.stride, False, collections.OrderedDict()),
        )


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


class StreamingTorchFile:
    """`store(tensor)` writes its bytes now and returns a stub; `finish(obj)` pickles obj (with stubs) and closes."""

    def __init__(self, path: Path):
        self.path = Path(path)
        # No zip CRC32 (torch.serialization.config.save.compute_crc32=False does the same): it costs a CPU pass
        # over every byte and torch.load does not need it.
        self._writer = torch._C.PyTorchFileWriter(str(self.path), False)
        self._count = 0
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.bytes = 0

    def store(self, tensor) -> _TensorStub:
        """Write the next storage: a tensor, a FileSlice (bytes still on disk), or a Rows list of them (stacked
        along dim 0). Pieces are gathered into one reused buffer; a contiguous in-memory tensor is written as is."""
        pieces = list(tensor) if isinstance(tensor, list) else [tensor]
        first = pieces[0]
        dtype = first.dtype
        shape = (sum(p.shape[0] for p in pieces), *first.shape[1:]) if len(pieces) > 1 else tuple(first.shape)
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        storage = None
        if (
            len(pieces) == 1
            and isinstance(first, torch.Tensor)
            and first.is_contiguous()
            and first.storage_offset() == 0
            and first.untyped_storage().nbytes() == nbytes
        ):
            storage = first.untyped_storage()  # a tensor owning exactly its bytes: written as is
        else:
            buf, at = self._buffer(nbytes), 0
            for p in pieces:
                n = p.nbytes if isinstance(p, FileSlice) else p.numel() * p.element_size()
                if isinstance(p, FileSlice):
                    p.read_into(buf[at : at + n])
                else:
                    buf[at : at + n].view(p.dtype).view(p.shape).copy_(p)
                at += n
            storage = buf.untyped_storage()  # the reused buffer starts at its storage's first byte
        key = str(self._count)
        self._count += 1
        self._writer.write_record(f"data/{key}", storage, nbytes)
        self.bytes += nbytes
        return _TensorStub(_StorageRef(key, dtype, _numel(shape)), tuple(shape), _contiguous_stride(shape))

    def _buffer(self, nbytes: int) -> torch.Tensor:
        # One buffer reused for every tensor: fresh allocations would page-fault on every write.
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def finish(self, obj) -> None:
        names = torch.storage._dtype_to_storage_type_map()

        class Pickler(pickle.Pickler):
            def persistent_id(self, o):
                if isinstance(o, _StorageRef):
                    return ("storage", getattr(torch, names[o.dtype]), o.key, "cpu", o.numel)
                return None

        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump(obj)  # protocol 2: what torch.save uses by default
        data = buf.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        for name, value in (
            (".format_version", "1"),
            (".storage_alignment", "64"),
            ("byteorder", sys.byteorder),
        ):
            self._writer.write_record(name, value, len(value))
        self._writer.write_end_of_file()
