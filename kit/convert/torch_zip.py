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


class _StorageRef:
    """Stands for a storage already written as record data/<key>."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly like a contiguous CPU tensor whose storage is already on disk."""

    def __init__(self, ref: _StorageRef, shape: Tuple[int, ...], stride: Tuple[int, ...]):
        self.ref, self.shape, self.stride = ref, shape, stride

    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_tensor_v2,
                (self.ref, 0, self.shape, self.stride, False, collections.OrderedDict()))


class StreamingTorchFile:
    """`store(tensor)` writes its bytes now and returns a stub; `finish(obj)` pickles obj (with stubs) and closes."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._writer = torch._C.PyTorchFileWriter(str(self.path))
        self._count = 0
        self.bytes = 0

    def store(self, tensor: torch.Tensor) -> _TensorStub:
        t = tensor.detach().cpu().contiguous()
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view of a larger buffer: write only its own bytes
        key = str(self._count)
        self._count += 1
        storage = t.untyped_storage()
        self._writer.write_record(f"data/{key}", storage, storage.nbytes())
        self.bytes += storage.nbytes()
        return _TensorStub(_StorageRef(key, t.dtype, t.numel()), tuple(t.shape), tuple(t.stride()))

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
        for name, value in ((".format_version", "1"), (".storage_alignment", "64"), ("byteorder", sys.byteorder)):
            self._writer.write_record(name, value, len(value))
        self._writer.write_end_of_file()
