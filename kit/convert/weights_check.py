"""No number from a broken model: NaN / inf weights are found when a model is loaded, and named.

A float is NaN or infinite exactly when all its exponent bits are set (IEEE 754; bfloat16 has float32's 8-bit
exponent), so a tensor's raw bytes are checked as integers in numpy (two read-only maxima per piece, `_count`):
files are mapped a window at a time (never loaded whole), torch is not needed (conversion runs without it), and a
damaged safetensors header is an error naming the shard (kit.convert.file_slices.SafetensorsFile). Evaluate and
anything that serves a model call `check_hf_weights(folder)` (files) or `check_model(model)` (a model in memory).
The converter checks the bytes it writes as they pass through its writers (`StreamCheck`): its source is read and
its output written once, and what a cast made infinite is caught too.
"""

from __future__ import annotations

import json
import mmap
import time
from pathlib import Path
from typing import Any, Collection, Dict, Iterable, List, Optional, Tuple, Union

from kit.errors import IntegrityError

PathLike = Union[str, Path]
# safetensors dtype code -> (unsigned integer of the same width, its exponent mask)
EXPONENT_MASKS: Dict[str, Tuple[str, int]] = {
    "F64": ("uint64", 0x7FF0000000000000),
    "F32": ("uint32", 0x7F800000),
    "F16": ("uint16", 0x7C00),
    "BF16": ("uint16", 0x7F80),
}
_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_PIECE = 1 << 24  # elements checked at a time: temporaries stay at a few tens of MB whatever the tensor
_PIECE_BYTES = 8 << 20  # bytes of a file mapped at a time (a multiple of every float's size)
_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")


class NonFiniteWeights(IntegrityError):
    """A model file holds NaN or infinite weights: whatever it computes is not a valid number."""


def count_nonfinite(raw: Any, dtype: str) -> int:
    """NaN and infinite values among the elements whose bytes are `raw` (uint8), of dtype `dtype` (a safetensors
    code such as 'BF16', or a torch name such as 'bfloat16'); 0 for integer dtypes."""
    code = _NAMES.get(dtype.replace("torch.", ""), dtype)
    if code not in EXPONENT_MASKS:
        return 0
    kind, mask = EXPONENT_MASKS[code]
    return _count(raw.view(kind), mask)


def _count(values: Any, mask: int, signed: Any = None) -> int:
    """NaN / inf among `values` (an unsigned integer view of the floats, `mask` their exponent bits).

    Without its sign bit a value is NaN or infinite exactly when it is >= the mask. Two maxima decide it without
    a temporary (SIMD in numpy, read-only, so the bytes stay in cache for the writer): read as signed integers the
    largest value is the largest positive float, read as unsigned it is the largest negative one (the sign bit
    puts every negative above every positive). The exact count only when there is something to count."""
    import numpy as np

    if signed is None:
        signed = values.view(values.dtype.str.replace("u", "i"))
    sign = 1 << (8 * values.itemsize - 1)
    n = 0
    for i in range(0, values.size, _PIECE):
        piece = values[i : i + _PIECE]
        if piece.size and (
            np.maximum.reduce(signed[i : i + _PIECE]) >= mask or np.maximum.reduce(piece) >= sign | mask
        ):
            n += int(np.count_nonzero(np.bitwise_and(piece, sign - 1) >= mask))
    return n


def _error(source: str, bad: List[Tuple[str, int, int]], fix: str) -> NonFiniteWeights:
    name, n, total = bad[0]
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    return NonFiniteWeights(
        f"{source}: tensor {name!r} holds {n} NaN/inf value(s) of {total}{more}; a model with non-finite weights "
        f"gives no valid score or answer. {fix}"
    )


_FIX = "Use an earlier checkpoint (training diverged, or the file is damaged: copy it again)"


def weight_files(folder: PathLike) -> List[Path]:
    """The weight files of an HF folder: those its index lists, else its single model file."""
    folder = Path(folder)
    for name in _INDEX_NAMES:
        if (folder / name).is_file():
            try:
                files = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise IntegrityError(
                    f"{folder / name}: not a valid weight index ({exc}); copy it again."
                ) from None
            return [folder / f for f in files]
    return [folder / n for n in _SINGLE_NAMES if (folder / n).is_file()]


def check_safetensors(path: PathLike, source: Optional[str] = None, skip: Collection[str] = ()) -> int:
    """Check one .safetensors file (its header, then every float tensor but those named in `skip`); return the
    tensors checked."""
    import numpy as np

    from kit.convert.file_slices import DTYPES, SafetensorsFile

    st = SafetensorsFile(str(path))  # a truncated file or garbled header is an error naming the file
    try:
        bad = []
        for key, (name, shape, offset) in st.entries.items():
            if DTYPES[name][0] not in EXPONENT_MASKS or key in skip:
                continue
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            size, n, at = count * DTYPES[name][1], 0, 0
            while at < size:
                # a window of the file mapped at a time: no copy, and only the window counts in RSS
                start = offset + at
                base = start - start % mmap.ALLOCATIONGRANULARITY
                want = min(_PIECE_BYTES, size - at)
                try:
                    window = mmap.mmap(st.fd, start + want - base, offset=base, access=mmap.ACCESS_READ)
                except ValueError:  # the file shrank since its header was read
                    raise IntegrityError(
                        f"{path}: tensor {key!r} ends past the file; copy it again."
                    ) from None
                try:
                    raw = np.frombuffer(window, dtype=np.uint8, count=want, offset=start - base)
                    n += count_nonfinite(raw, name)
                    del raw
                finally:
                    window.close()
                at += want
            if n:
                bad.append((key, n, count))
        if bad:
            raise _error(f"{source or path}", bad, _FIX)
        return sum(1 for k in st.entries if k not in skip)
    finally:
        st.close()


def check_hf_weights(folder: PathLike, source: Optional[str] = None, skip: Collection[str] = ()) -> int:
    """Check every weight file of the HF folder `folder` (see the module doc); return the tensors checked.

    `source` names the file in messages instead (e.g. the checkpoint a temporary folder was converted from);
    `skip`: tensors checked elsewhere (those a converter checks as it writes them, StreamCheck)."""
    total = 0
    for path in weight_files(folder):
        if not path.is_file():
            raise IntegrityError(f"{path} is missing (its index lists it); copy the model folder again.")
        where = f"{source} ({path.name})" if source else str(path)
        if path.suffix == ".safetensors":
            total += check_safetensors(path, where, skip)
        else:
            import torch

            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            total += check_tensors([(k, v) for k, v in state.items() if k not in skip], where)
    return total


class StreamCheck:
    """The same rule applied to bytes on their way into an output file `file` (a converter's writer, which then
    never reads its output again): `watch(sink, dtype)` wraps the writer's sink (anything with
    `write(memoryview)`) for one tensor, `done(name, watched)` records what it found in `bad`. One per output
    file (so one per writing thread)."""

    def __init__(self, file: str = "") -> None:
        self.file = file  # named in `bad`; a writer of several files sets it before each
        self.seconds = (
            0.0  # CPU seconds spent counting (the benchmark sets them against the conversion's wall)
        )
        self.bad: List[Tuple[str, str, int, int]] = []  # (file, tensor, NaN/inf count, elements)

    def watch(self, sink: Any, dtype: str) -> Any:
        """`sink` itself for an integer dtype; else a sink that counts NaN / inf in what it passes on."""
        code = _NAMES.get(str(dtype).replace("torch.", ""), str(dtype))
        return _Watched(self, sink, code) if code in EXPONENT_MASKS else sink

    def done(self, name: str, watched: Any) -> int:
        """After a tensor's last write: its NaN / inf count (0 for a sink watch() did not wrap), kept in `bad`."""
        n = getattr(watched, "nonfinite", 0)
        if n:
            self.bad.append((self.file, name, n, watched.elements))
        return n

    def error(self, source: str, fix: str = _FIX) -> NonFiniteWeights:
        """The error for what `bad` holds, like check_hf_weights': `source (file): tensor ... holds ...`."""
        file = self.bad[0][0]
        return _error(f"{source} ({file})", [b[1:] for b in self.bad if b[0] == file], fix)


class _Watched:
    """A sink counting the NaN / inf of one tensor's elements (whole elements per write; one split between two
    writes is carried over)."""

    def __init__(self, check: StreamCheck, sink: Any, code: str):
        import numpy as np

        self.check, self.sink, self.np = check, sink, np
        kind, self.mask = EXPONENT_MASKS[code]
        self.kind, self.signed = np.dtype(kind), np.dtype(kind[1:])  # uint16 -> int16
        self.nonfinite, self.elements, self.carry = 0, 0, b""

    def write(self, mv: Any) -> None:
        t = time.thread_time()  # this thread's CPU: neither the GIL nor other processes count
        data, item = memoryview(mv).cast("B"), self.kind.itemsize
        if self.carry:  # an element split between two writes: checked once it is whole
            k = min(item - len(self.carry), len(data))
            self.carry, data = self.carry + bytes(data[:k]), data[k:]
            if len(self.carry) == item:
                self._count(self.carry, 1)
                self.carry = b""
        whole = len(data) // item
        if whole:
            self._count(data, whole)
        if len(data) > whole * item:  # (data is left only once a carried element is whole)
            self.carry = bytes(data[whole * item :])
        self.check.seconds += time.thread_time() - t
        self.sink.write(mv)

    def _count(self, buf: Any, n: int) -> None:
        values = self.np.frombuffer(buf, dtype=self.kind, count=n)
        self.elements += n
        self.nonfinite += _count(values, self.mask, values.view(self.signed))


def check_tensors(named: Iterable[Tuple[str, Any]], source: str) -> int:
    """Check torch tensors (name, tensor) with torch.isfinite; return how many were checked."""
    import torch

    bad, n = [], 0
    for name, t in named:
        n += 1
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append((name, int((~torch.isfinite(t)).sum()), t.numel()))
    if bad:
        raise _error(source, bad, _FIX)
    return n


def check_model(model: Any, source: Optional[str] = None) -> int:
    """Check a loaded torch model's parameters and buffers (for weights that did not come from files checked)."""
    with_buffers = list(model.named_parameters()) + list(model.named_buffers())
    return check_tensors(with_buffers, source or type(model).__name__)
