"""Writing the HF `datasets` folder (streamed Arrow, then `save_to_disk`), meta.json, and `load_prepared`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

import numpy as np

FIXED_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids")
COLUMNS = {"pretrain": FIXED_COLUMNS, "sft": FIXED_COLUMNS + ("seq_lens",)}
META_KEYS = ("kind", "max_length", "tokenizer", "vocab_size", "pad_token_id", "eos_token_id", "num_samples")


def _features(kind: str):
    from datasets import Features, List, Value

    return Features({c: List(Value("int32")) for c in COLUMNS[kind]})


class ArrowSink:
    """Append fixed-length rows (and ragged `seq_lens`) to one Arrow file, batch by batch."""

    def __init__(self, path: Path, kind: str, max_length: int):
        from datasets.arrow_writer import ArrowWriter

        self.path, self.kind, self.max_length = Path(path), kind, max_length
        self.rows = 0
        self._writer = ArrowWriter(features=_features(kind), path=str(self.path))

    def write(self, columns: Dict[str, np.ndarray], seq_lens: Union[None, List[List[int]]] = None) -> None:
        """Write rows: each fixed column an (n, max_length) array; `seq_lens` one list per row (sft)."""
        import pyarrow as pa

        n = columns["input_ids"].shape[0]
        if n == 0:
            return
        offsets = pa.array(np.arange(0, (n + 1) * self.max_length, self.max_length, dtype=np.int32))
        arrays, names = [], []
        for name in FIXED_COLUMNS:
            values = pa.array(np.ascontiguousarray(columns[name], dtype=np.int32).reshape(-1))
            arrays.append(pa.ListArray.from_arrays(offsets, values))
            names.append(name)
        if self.kind == "sft":
            lens = np.cumsum([0] + [len(s) for s in seq_lens]).astype(np.int32)
            flat = np.fromiter((x for s in seq_lens for x in s), dtype=np.int32, count=int(lens[-1]))
            arrays.append(pa.ListArray.from_arrays(pa.array(lens), pa.array(flat)))
            names.append("seq_lens")
        self._writer.write_table(pa.Table.from_arrays(arrays, names=names))
        self.rows += n

    def finalize(self) -> int:
        self._writer.finalize()
        return self.rows


def save_dataset(arrow_file: Path, out_dir: Path, fingerprint_of: dict) -> None:
    """Turn the Arrow file into a `save_to_disk` folder with a fingerprint derived from the content."""
    from datasets import Dataset

    ds = Dataset.from_file(str(arrow_file))
    # a content-derived fingerprint keeps state.json byte-identical across runs (the default hashes temp paths)
    ds._fingerprint = hashlib.sha256(json.dumps(fingerprint_of, sort_keys=True).encode()).hexdigest()[:16]
    ds.save_to_disk(str(out_dir))
    del ds


def file_digest(path: Path) -> str:
    """sha256 of a file (streamed)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _resolve(path: Union[str, Path]) -> Path:
    p = Path(path).expanduser()
    if (p / "meta.json").is_file():
        return p
    for cand in (Path(str(p) + "_hf"), p.with_name(p.name.replace("_text_document", "_hf"))):
        if (cand / "meta.json").is_file():
            return cand
    raise FileNotFoundError(
        f"{p} is not a folder prepared by kit.data (no meta.json); give the `<name>_hf` folder written by "
        f"notebook 02 / `python -m kit data`, or prepare the data first.")


def read_meta(path: Union[str, Path]) -> Dict[str, Any]:
    """meta.json of a prepared folder (`<name>_hf`)."""
    return json.loads((_resolve(path) / "meta.json").read_text(encoding="utf-8"))


def load_prepared(path: Union[str, Path], return_meta: bool = False) -> Any:
    """Load and check a prepared `<name>_hf` folder: a `datasets.Dataset` (with its meta if return_meta)."""
    from datasets import load_from_disk

    folder = _resolve(path)
    meta = read_meta(folder)
    problems = [f"meta.json lacks {k!r}" for k in META_KEYS if k not in meta]
    kind = meta.get("kind")
    if kind not in COLUMNS:
        problems.append(f"kind {kind!r} is not pretrain or sft")
    if problems:
        raise ValueError(f"{folder}: " + "; ".join(problems) + ". Prepare the data again with kit.data.")
    ds = load_from_disk(str(folder))
    missing = [c for c in COLUMNS[kind] if c not in ds.column_names]
    if missing:
        problems.append(f"columns {missing} are missing (has {ds.column_names})")
    if len(ds) != meta["num_samples"]:
        problems.append(f"{len(ds)} rows but meta.json says {meta['num_samples']}")
    if len(ds) and not missing:
        first = ds[0]
        if any(len(first[c]) != meta["max_length"] for c in FIXED_COLUMNS):
            problems.append(f"row 0 is not {meta['max_length']} tokens long in every column")
        elif max(first["input_ids"]) >= meta["vocab_size"] or min(first["input_ids"]) < 0:
            problems.append(f"row 0 has token ids outside 0..{meta['vocab_size'] - 1}")
    if problems:
        raise ValueError(f"{folder}: " + "; ".join(problems) + ". The folder is damaged or was changed by hand; "
                         "prepare the data again.")
    return (ds, meta) if return_meta else ds


def megatron_names(kind: str, out_dir: Path, name: str) -> Tuple[str, List[str]]:
    """The data prefix a Megatron / MindSpeed-LLM run is given, and the file prefixes written for it."""
    if kind == "pretrain":
        prefix = str(out_dir / f"{name}_text_document")
        return prefix, [prefix]
    prefix = str(out_dir / name)
    return prefix, [f"{prefix}_packed_{key}_document" for key in ("input_ids", "attention_mask", "labels")]
