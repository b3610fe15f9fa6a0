"""Streaming access to HF checkpoint folders: read row/column slices of single tensors, write sharded safetensors."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from kit.convert.file_slices import SafetensorsFile, dtype_name, piece_info, write_safetensors
from kit.errors import InputError

PathLike = Union[str, Path]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")


def read_json(path: Path) -> dict:
    """A JSON object file; damage is a one-line InputError naming it."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not valid JSON ({exc}); download or copy it again.") from None
    if not isinstance(value, dict):
        raise InputError(f"{path} holds a JSON {type(value).__name__}, not an object; is it the right file?")
    return value


class HFReader:
    """Index of an HF folder; `read(key, rows, cols)` loads only that slice (pread of safetensors, mmap'd .bin)."""

    def __init__(self, folder: PathLike):
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.folder} has no config.json; point the source at an HF model folder "
                f"(the one holding config.json and the weight shards)."
            )
        self.config = read_json(self.folder / "config.json")
        self._handles: Dict[str, object] = {}
        self._lock = threading.Lock()  # rank files are written by several threads
        self.weight_map = self._weight_map()
        missing = sorted({f for f in self.weight_map.values() if not (self.folder / f).is_file()})
        if missing:
            raise FileNotFoundError(
                f"{self.folder}: shard(s) listed in the index are missing: {missing}; "
                f"download them again (the index names {len(set(self.weight_map.values()))})."
            )

    def _weight_map(self) -> Dict[str, str]:
        for name in INDEX_NAMES:
            path = self.folder / name
            if path.is_file():
                index = read_json(path)
                if not isinstance(index.get("weight_map"), dict):
                    raise InputError(f"{path} has no weight_map; download the index again.")
                return dict(index["weight_map"])
        for name in SINGLE_NAMES:
            if (self.folder / name).is_file():
                return {k: name for k in self._open(name).keys()}
        raise FileNotFoundError(
            f"{self.folder} has neither an index ({' / '.join(INDEX_NAMES)}) nor "
            f"{' / '.join(SINGLE_NAMES)}; it is not an HF checkpoint folder."
        )

    def _open(self, fname: str):
        handle = self._handles.get(fname)
        if handle is not None:
            return handle
        with self._lock:
            return self._open_locked(fname)

    def _open_locked(self, fname: str):
        handle = self._handles.get(fname)
        if handle is None:
            path = str(self.folder / fname)
            if fname.endswith(".safetensors"):
                handle = SafetensorsFile(path)
            else:  # .bin: zip pickles; mmap keeps tensors on disk until sliced
                import torch

                handle = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            self._handles[fname] = handle
        return handle

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def shape(self, key: str) -> Tuple[int, ...]:
        h = self._open(self.weight_map[key])
        return tuple(h[key].shape) if isinstance(h, dict) else h.entries[key][1]

    def dtype(self, key: str) -> str:
        """The tensor's dtype name ('bfloat16')."""
        h = self._open(self.weight_map[key])
        return dtype_name(h[key].dtype if isinstance(h, dict) else h.entries[key][0])

    def read(
        self,
        key: str,
        rows: Optional[Tuple[int, int]] = None,
        cols: Optional[Tuple[int, int]] = None,
        copy: bool = True,
    ):
        """The tensor `key`, or rows[0]:rows[1] (and cols[0]:cols[1]) of it, as a CPU tensor.

        copy=False allows a lazier result for callers that write it out at once: a FileSlice (bytes still on
        disk, read straight into the writer's buffer) or a view of a memory-mapped .bin file.
        """
        h = self._open(self.weight_map[key])
        if isinstance(h, dict):
            t = h[key]
            t = t[slice(*rows) if rows else slice(None)]
            t = t[:, cols[0] : cols[1]] if cols else t
            return t.clone() if copy else t
        shape = h.entries[key][1]
        if cols:  # row-parallel block: all rows of the tensor, this rank's columns
            if rows and tuple(rows) != (0, shape[0]):
                raise ValueError(f"{key}: a column block must span all {shape[0]} rows, got rows {rows}")
            piece = h.columns(key, *cols)
        elif shape:
            piece = h.rows(key, *(rows or (0, shape[0])))
        else:
            piece = h.slice(key)
        return piece if not copy else piece.tensor()

    def weight_bytes(self) -> int:
        return sum((self.folder / f).stat().st_size for f in set(self.weight_map.values()))

    def close(self) -> None:
        for h in self._handles.values():
            if isinstance(h, SafetensorsFile):
                h.close()
        self._handles.clear()


def copy_small(src: Path, dst: Path) -> None:
    """Copy a side file (config, tokenizer, remote code) with its mode and times: shutil.copy2's result, in 1 MiB
    reads (shutil itself, with the bz2 and lzma it imports, would add a few ms to the convert CLI's start-up)."""
    st = os.stat(src)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for block in iter(lambda: fin.read(1 << 20), b""):
            fout.write(block)
    os.chmod(dst, st.st_mode & 0o7777)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def copy_side_files(src: PathLike, dst: PathLike) -> List[str]:
    """Copy config, generation config, tokenizer and remote-code files (everything but weights and indexes)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for p in sorted(src.iterdir()):
        if (
            p.is_file()
            and not p.name.endswith(WEIGHT_SUFFIXES)
            and p.name not in INDEX_NAMES
            and not p.name.startswith(".")
        ):
            copy_small(p, dst / p.name)
            copied.append(p.name)
    return copied


class HFWriter:
    """Collects tensors (or pieces still on disk) into safetensors shards of at most `max_shard_bytes`, then writes
    the index. Pieces are streamed when their shard is written, so memory holds descriptions, not weights."""

    def __init__(self, folder: PathLike, max_shard_bytes: int = 2 * 1024**3, check=None):
        self.check = (
            check  # a kit.convert.weights_check.StreamCheck: NaN / inf counted as the shards are written
        )
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._buf: List[Tuple[str, object]] = []
        self._buf_bytes = 0
        self._shards: List[Tuple[str, List[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor) -> None:
        """A tensor, a piece or a Rows list of pieces (kept by reference until its shard is written)."""
        from kit.convert.file_slices import itemsize

        shape, name = piece_info(tensor)
        nbytes = itemsize(name)
        for d in shape:
            nbytes *= d
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf.append((key, tensor))
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        name = f".shard-{len(self._shards) + 1:05d}.safetensors"
        if self.check is not None:
            self.check.file = name
        write_safetensors(str(self.folder / name), self._buf, metadata={"format": "pt"}, check=self.check)
        self._shards.append((name, [k for k, _ in self._buf]))
        self._buf, self._buf_bytes = [], 0

    def close(self) -> Path:
        """Flush, give shards their final `model-0000i-of-0000N` names, write model.safetensors.index.json."""
        if self._buf:
            self._flush()
        n = len(self._shards)
        weight_map, names = {}, {}
        for i, (tmp, keys) in enumerate(self._shards, 1):
            final = names[tmp] = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp, self.folder / final)
            weight_map.update({k: final for k in keys})
        if self.check is not None:  # what it found, under the shards' final names
            self.check.bad = [(names.get(f, f), *rest) for f, *rest in self.check.bad]
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        path = self.folder / "model.safetensors.index.json"
        path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return path
