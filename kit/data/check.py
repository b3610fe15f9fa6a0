"""`python -m kit data check`: a prepared folder against its own manifest, all of it.

Every row (lengths, token ids in the vocab, labels), the held-out rows, each Megatron `.bin/.idx` file (size and
SHA-256 as recorded when it was written, sequence and document counts, token ids in the vocab) and the tokenizer
the data was made with (its hash now against the recorded one). Loading for training checks the rows too; the
file hashes are read only here (they cost a pass over every byte).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Sequence

from kit.core.manifest import MANIFEST_NAME, tokenizer_sha256
from kit.data.prepared import PathLike, PreparedData, read_prepared
from kit.errors import IntegrityError, KitError
from kit.storage.hashes import sha256_file

_LOAD_FIX = (
    " The folder is damaged"  # where the loader's own advice starts (this check gives it once, at the end)
)


def megatron_record(writers: Sequence[Any]) -> Dict[str, Dict[str, Any]]:
    """The manifest's `megatron_checks`: per final file name, its bytes and SHA-256, and per `.idx` the sequence and
    document counts; taken from the finished (still temporary) files of `IndexedWriter`s."""
    out: Dict[str, Dict[str, Any]] = {}
    for w in writers:
        for tmp, ext in ((w.bin_path, ".bin"), (w.idx_path, ".idx")):
            entry: Dict[str, Any] = {"bytes": os.path.getsize(tmp), "sha256": sha256_file(tmp)}
            if ext == ".idx":
                entry.update(sequences=w.num_sequences, documents=w.num_documents)
            out[w.prefix + ext] = entry
    return out


def _megatron_problems(prepared: PreparedData, hashes: bool) -> List[str]:
    from kit.data.indexed import IndexedReader

    problems: List[str] = []
    recorded: Dict[str, Dict[str, Any]] = prepared.get("megatron_checks") or {}
    files = prepared.megatron_files
    prefixes = sorted({f[: -len(".bin")] for f in files if f.endswith(".bin")})
    top = prepared.vocab_size - 1
    for prefix in prefixes:
        try:
            reader = IndexedReader(prefix)
        except KitError as exc:
            problems.append(str(exc).rstrip("."))
            continue
        want = recorded.get(prefix + ".idx", {})
        for what, have in (("sequences", len(reader)), ("documents", reader.num_documents)):
            if what in want and want[what] != have:
                problems.append(f"{prefix}.idx lists {have} {what}, the manifest {want[what]}")
        ids = reader.tokens
        if ids.size and (prefix.endswith("_text_document") or prefix.endswith("_input_ids_document")):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi > top:
                problems.append(f"{prefix}.bin holds token ids {lo}..{hi}, outside the vocab 0..{top}")
    for path in files:
        want = recorded.get(path)
        if want is None or not os.path.isfile(path):
            continue  # a missing file was named above; an older manifest recorded no sizes and hashes
        size = os.path.getsize(path)
        if size != want["bytes"]:
            problems.append(f"{path} is {size} bytes, the manifest says {want['bytes']}")
        elif hashes and sha256_file(path) != want["sha256"]:
            problems.append(f"{path} does not match its SHA-256 in the manifest (changed or damaged)")
    return problems


def _tokenizer_problem(prepared: PreparedData) -> List[str]:
    recorded = prepared.tokenizer_sha256
    folder = prepared.tokenizer
    if recorded is None:
        return []  # a tokenizer made only by its own code: nothing was hashed
    if not Path(folder).is_dir():
        return [f"the tokenizer {folder} the data was made with is gone (training inherits it from here)"]
    try:
        now = tokenizer_sha256(folder)
    except KitError as exc:
        return [str(exc)]
    if now != recorded:
        return [
            f"the tokenizer {folder} changed since the data was made (its hash is {now[:12]}..., the manifest "
            f"records {recorded[:12]}...); prepare the data again with this tokenizer, or restore it"
        ]
    return []


def check_prepared(path: PathLike, hashes: bool = True) -> Dict[str, Any]:
    """Check the prepared folder at `path` completely (see the module doc); raise one IntegrityError listing every
    problem, else return what was checked."""
    prepared = read_prepared(path)
    problems: List[str] = []
    rows = held = None
    for what, load in (("rows", prepared.dataset), ("held-out rows", prepared.heldout_dataset)):
        try:
            ds = load()
        except KitError as exc:
            problems.append(str(exc).split(_LOAD_FIX)[0].rstrip("."))
            continue
        if what == "rows":
            rows = ds
        else:
            held = ds
    problems += _megatron_problems(prepared, hashes)
    problems += _tokenizer_problem(prepared)
    if problems:
        raise IntegrityError(
            f"{prepared.folder / MANIFEST_NAME}: "
            + "; ".join(problems)
            + ". Prepare the data again (notebook 02 / "
            "`python -m kit data pretrain|sft --overwrite`)."
        )
    recorded = prepared.get("megatron_checks") or {}
    return {
        "samples": len(rows) if rows is not None else 0,
        "columns": rows.column_names if rows is not None else [],
        "heldout_rows": len(held) if held is not None else None,
        "megatron_files": len(prepared.megatron_files),
        "megatron_hashes": "verified"
        if recorded and hashes
        else ("not checked" if recorded else "not recorded"),
        "tokenizer": "hash matches" if prepared.tokenizer_sha256 else "not hashed",
    }
