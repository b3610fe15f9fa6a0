"""No number from a broken model: NaN / inf weights are found when a model is loaded, and named.

A float is NaN or infinite exactly when all its exponent bits are set (IEEE 754; bfloat16 has float32's 8-bit
exponent), so a tensor's raw bytes are checked with one integer mask in numpy, a piece at a time: the files are
mapped a window at a time (never loaded whole), torch is not needed (conversion runs without it), and a damaged safetensors
header is an error naming the shard (kit.convert.file_slices.SafetensorsFile). Convert, evaluate and anything that
serves a model call `check_hf_weights(folder)` (files) or `check_model(model)` (a model in memory).
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

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


def count_nonfinite(raw: Any, dtype: str, scratch: Optional[Dict[str, Any]] = None) -> int:
    """NaN and infinite values among the elements whose bytes are `raw` (uint8), of dtype `dtype` (a safetensors
    code such as 'BF16', or a torch name such as 'bfloat16'); 0 for integer dtypes. `scratch` (a dict kept by the
    caller) holds the work array between calls: a fresh one would be page-faulted in again for every piece."""
    code = _NAMES.get(dtype.replace("torch.", ""), dtype)
    if code not in EXPONENT_MASKS:
        return 0
    import numpy as np

    kind, mask = EXPONENT_MASKS[code]
    values = raw.view(kind)
    # without the sign bit, a value is NaN or infinite exactly when it is >= the exponent mask: one AND and one max
    # per element (SIMD in numpy); the exact count only when the max says there is something to count
    m = np.dtype(kind).type(mask)
    magnitude = np.dtype(kind).type(mask | (mask - 1))  # every bit but the sign
    scratch = {} if scratch is None else scratch
    n = 0
    for i in range(0, values.size, _PIECE):
        piece = values[i : i + _PIECE]
        if kind not in scratch or scratch[kind].size < piece.size:
            scratch[kind] = np.empty(piece.size, dtype=kind)
        bits = np.bitwise_and(piece, magnitude, out=scratch[kind][: piece.size])
        if bits.size and bits.max() >= m:
            n += int(np.count_nonzero(bits >= m))
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


def check_safetensors(path: PathLike, source: Optional[str] = None) -> int:
    """Check one .safetensors file (its header, then every float tensor); return the tensors checked."""
    import numpy as np

    from kit.convert.file_slices import DTYPES, SafetensorsFile

    st = SafetensorsFile(str(path))  # a truncated file or garbled header is an error naming the file
    scratch: Dict[str, Any] = {}
    try:
        bad = []
        for key, (name, shape, offset) in st.entries.items():
            if DTYPES[name][0] not in EXPONENT_MASKS:
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
                    n += count_nonfinite(raw, name, scratch)
                    del raw
                finally:
                    window.close()
                at += want
            if n:
                bad.append((key, n, count))
        if bad:
            raise _error(f"{source or path}", bad, _FIX)
        return len(st.entries)
    finally:
        st.close()


def check_hf_weights(folder: PathLike, source: Optional[str] = None) -> int:
    """Check every weight file of the HF folder `folder` (see the module doc); return the tensors checked.

    `source` names the file in messages instead (e.g. the checkpoint a temporary folder was converted from)."""
    total = 0
    for path in weight_files(folder):
        if not path.is_file():
            raise IntegrityError(f"{path} is missing (its index lists it); copy the model folder again.")
        where = f"{source} ({path.name})" if source else str(path)
        if path.suffix == ".safetensors":
            total += check_safetensors(path, where)
        else:
            import torch

            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            total += check_tensors(state.items(), where)
    return total


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
