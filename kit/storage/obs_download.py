"""A verified, resumable, parallel download of one OBS object into a file (kit.storage.obs.download_files uses it).

Hand-written over the SDK's `getObject` with a byte range, instead of its `downloadFile`, for one measurable gain:
each byte is CRC-32'd once, as it arrives, in the part threads (zlib releases the GIL), and the part CRCs are
combined; `downloadFile` followed by a CRC pass read every file twice (benchmarks/bench_obs.py measures both).
The parts go into `.partial-<name>` (renamed when the whole file matches the listing); a record beside it
(`.partial-<name>.parts.json`: the CRC of every finished part) lets a cut download resume at the next part, as
`downloadFile`'s `enableCheckpoint` does.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from concurrent.futures import Executor
from http.client import HTTPException
from pathlib import Path

from kit.storage.obs import ObsError

CHUNK = 1 << 20  # bytes read from the response (and CRC'd, written) at a time
_POLY = 0xEDB88320  # CRC-32's reflected polynomial (zlib)


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order), as zlib's crc32_combine computes it."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine, which Python does not expose)."""
    p, k = 1 << 31, 3  # x^0; and len2 bytes are 8 * len2 bits = len2 * 2^3
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def _get_part(store, key: str, fd: int, start: int, end: int) -> int:
    """Bytes [start, end) of the object into the file at the same offset; returns their CRC-32."""
    from obs import GetObjectHeader

    resp = store._check(
        store.client.getObject(store.bucket, key, headers=GetObjectHeader(range=f"{start}-{end - 1}")),
        "download of",
        key,
    )
    stream, crc, pos = resp.body.response, 0, start
    try:
        while True:
            try:
                chunk = stream.read(CHUNK)
            except (
                OSError,
                HTTPException,
            ) as exc:  # cut or stalled mid-part: the record keeps the other parts
                raise ObsError(
                    f"OBS download of obs://{store.bucket}/{key} broke off at byte {pos}: {type(exc).__name__}: "
                    f"{exc or 'no answer'}; run it again (it resumes at this part)."
                ) from None
            if not chunk:
                break
            if pos + len(chunk) > end:
                raise ValueError("more bytes than asked for")
            view = memoryview(chunk)
            while view:
                view = view[os.pwrite(fd, view, pos + len(chunk) - len(view)) :]
            crc = zlib.crc32(chunk, crc)
            pos += len(chunk)
    finally:
        stream.close()
    if pos != end:
        raise ValueError(f"{end - pos} bytes short")
    return crc


def fetch(store, key: str, path: Path, want: dict, pool: Executor) -> bool:
    """Download `key` into `path` in parts of `store.part_size` on `pool`; True when it matches `want` (its size and
    CRC-32: then it is renamed into place), False when not (nothing is left behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".partial-{path.name}"
    record_path = path.parent / f".partial-{path.name}.parts.json"
    size, part = int(want["bytes"]), max(1, int(store.part_size))
    spans = [(s, min(s + part, size)) for s in range(0, size, part)]
    done = _resume(record_path, tmp, want, part)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    lock = threading.Lock()

    def one(span):
        crc = _get_part(store, key, fd, *span)
        with lock:  # the record says which parts are on disk, with their CRCs
            done[str(span[0])] = (span[1], crc)
            _write_record(record_path, want, part, done)
        return crc

    futures, errors = [], []
    try:
        os.ftruncate(fd, size)
        futures = [pool.submit(one, s) for s in spans if str(s[0]) not in done]
    finally:
        for fut in futures:  # every part ends before the file is closed
            try:
                fut.result()
            except Exception as exc:
                errors.append(exc)
        os.close(fd)
    failed = [e for e in errors if not isinstance(e, ValueError)]
    if failed:  # OBS or the network failed: the record keeps the finished parts for the next try
        raise failed[0]
    crc = 0
    if not errors:  # a ValueError: the object is not as long as the listing says
        for start, end in spans:
            crc = crc32_combine(crc, done[str(start)][1], end - start)
    if errors or f"{crc:08x}" != want["crc32"]:
        tmp.unlink(missing_ok=True)
        record_path.unlink(missing_ok=True)
        return False
    os.replace(tmp, path)
    record_path.unlink(missing_ok=True)
    return True


def _resume(record_path: Path, tmp: Path, want: dict, part: int) -> dict:
    """{part start: CRC} of the parts an earlier, cut download of the same listed file left, each read back and
    checked against its recorded CRC (the record may have reached the disk before the part did); else {}."""
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        if record["want"] != want or record["part"] != part or tmp.stat().st_size != int(want["bytes"]):
            return {}
        done = {}
        with open(tmp, "rb") as fh:
            for start, (end, crc) in record["done"].items():
                fh.seek(int(start))
                if zlib.crc32(fh.read(int(end) - int(start))) == int(crc):
                    done[str(start)] = (int(end), int(crc))
        return done
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write_record(record_path: Path, want: dict, part: int, done: dict) -> None:
    tmp = record_path.with_name(record_path.name + ".tmp")
    tmp.write_text(json.dumps({"want": want, "part": part, "done": done}), encoding="utf-8")
    os.replace(tmp, record_path)
