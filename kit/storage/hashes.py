"""File hashes: SHA-256 for what must be identified, CRC-32 for what must be checked fast."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]


def sha256_file(path: PathLike, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def crc32_file(path: PathLike) -> dict:
    """{"bytes", "crc32"} of a file read in 4 MiB blocks: what checkpoints and OBS transfers are checked with.

    CRC-32 (zlib), not SHA-256: it catches accidental damage (every burst of up to 32 bits, a flipped bit, a cut) as
    a zip member's CRC would, and runs about 5x faster here (2.1 vs 0.4 GB/s), which matters for checkpoints of
    tens of GB; nobody forges a checkpoint to match it (they load with weights_only=True anyway).
    """
    import zlib

    crc, size = 0, 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"bytes": size, "crc32": f"{crc:08x}"}
