"""Streaming readers for jsonl, json, parquet, csv and txt files or folders: one record at a time."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional

from kit.errors import KitError

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv", ".txt")
_FIX_ENCODING = "convert it to UTF-8 first (e.g. `iconv -f GBK -t UTF-8 in.jsonl > out.jsonl`)"


class DataInputError(KitError, ValueError):
    """A record that cannot be used; names the file, the line and the fix."""

    def __init__(self, source: str, line: int, problem: str, fix: str, reason: str = "malformed"):
        self.source, self.line, self.problem, self.reason = source, line, problem, reason
        where = f"{source}:{line}" if line else source
        super().__init__(
            f"{where}: {problem}. Fix: {fix}; or pass on_error='skip' to skip and count such records."
        )


@dataclass
class Record:
    """One input record and where it came from (1-based line or row number)."""

    source: str
    line: int
    data: dict


def list_files(paths: List[str]) -> List[Path]:
    """The data files under `paths` (folders searched recursively, sorted for a stable order)."""
    files: List[Path] = []
    for p in paths:
        p = Path(p).expanduser()
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.suffix.lower() in EXTENSIONS
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise FileNotFoundError(
                    f"folder {p} holds no {'/'.join(EXTENSIONS)} files; point inputs at the "
                    f"data files or the folder that holds them."
                )
            files.extend(found)
        elif p.is_file():
            if p.suffix.lower() not in EXTENSIONS:
                raise ValueError(
                    f"{p}: unsupported file type {p.suffix!r}; use one of {', '.join(EXTENSIONS)}."
                )
            files.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist; check the path.")
    return files


def _text_lines(path: Path, per_line: bool = False) -> Iterator[tuple]:
    """(1-based number, line) of a UTF-8 text file. A line that is not UTF-8 raises, naming the line, or with
    `per_line` comes as (number, DataInputError) so the caller can skip just that line."""
    n = 0
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):  # noqa: B007 - n is used after the loop
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                err = DataInputError(
                    str(path),
                    n,
                    f"not valid UTF-8 ({exc.reason} at byte {exc.start})",
                    _FIX_ENCODING,
                    "encoding",
                )
                if not per_line:
                    raise err from None
                yield n, err
    if n == 0:
        raise DataInputError(
            str(path), 0, "the file is empty", "remove it from inputs or fill it", "empty_file"
        )


def _jsonl(path: Path) -> Iterator[Record]:
    for n, line in _text_lines(path, per_line=True):
        if isinstance(line, DataInputError):
            yield _BadRecord(line)
            continue
        text = line.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            yield _bad(
                path,
                n,
                f"malformed JSON ({exc.msg} at column {exc.colno})",
                "repair the line so it holds one JSON object",
            )
            continue
        if not isinstance(value, dict):
            yield _bad(
                path,
                n,
                f"expected a JSON object, found {type(value).__name__}",
                'write one object per line, e.g. {"text": "..."}',
            )
            continue
        yield Record(str(path), n, value)


def _json(path: Path) -> Iterator[Record]:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from _jsonl(path)  # many ".json" files are really JSON lines
        return
    # A JSON array must be parsed whole; for corpora larger than memory use .jsonl instead.
    raw = path.read_bytes()
    try:
        items = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataInputError(str(path), line, "not valid UTF-8", _FIX_ENCODING, "encoding") from None
    except json.JSONDecodeError as exc:
        raise DataInputError(
            str(path),
            exc.lineno,
            f"malformed JSON ({exc.msg} at column {exc.colno})",
            "repair the file (it must be one JSON array of objects) or convert it to .jsonl",
        ) from None
    for i, value in enumerate(items, 1):
        if not isinstance(value, dict):
            yield _bad(
                path, i, f"item {i} is a {type(value).__name__}, not an object", "make every item an object"
            )
            continue
        yield Record(str(path), i, value)


def _parquet(path: Path, columns: Optional[List[str]], batch_rows: int = 2048) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise DataInputError(
            str(path),
            0,
            f"not a readable parquet file ({exc})",
            "re-export it with pandas/pyarrow",
            "malformed",
        ) from None
    names = set(pf.schema_arrow.names)
    wanted = [c for c in (columns or []) if c in names] or None
    row = 0
    for batch in pf.iter_batches(batch_size=batch_rows, columns=wanted):
        for item in batch.to_pylist():
            row += 1
            yield Record(str(path), row, item)
    if row == 0:
        raise DataInputError(str(path), 0, "the file has no rows", "remove it from inputs", "empty_file")


def _csv(path: Path) -> Iterator[Record]:
    lines = (line for _, line in _text_lines(path))
    reader = csv.DictReader(lines)
    rows = 0
    try:
        for item in reader:
            rows += 1
            if None in item:
                yield _bad(
                    path,
                    reader.line_num,
                    "more values than header columns",
                    "quote values that contain commas",
                )
                continue
            yield Record(str(path), reader.line_num, dict(item))
    except csv.Error as exc:
        raise DataInputError(
            str(path), reader.line_num, f"malformed CSV ({exc})", "repair the quoting"
        ) from None
    if rows == 0 and reader.fieldnames is None:
        raise DataInputError(
            str(path), 0, "the file is empty", "remove it from inputs or fill it", "empty_file"
        )


def _txt(path: Path) -> Iterator[Record]:
    for n, line in _text_lines(path, per_line=True):
        if isinstance(line, DataInputError):
            yield _BadRecord(line)
        else:
            yield Record(str(path), n, {"text": line.rstrip("\r\n")})


class _BadRecord(Record):
    """A record that failed to parse; carries its error so the caller applies on_error."""

    def __init__(self, error: DataInputError):
        super().__init__(error.source, error.line, {})
        self.error = error


def _bad(path: Path, line: int, problem: str, fix: str) -> _BadRecord:
    return _BadRecord(DataInputError(str(path), line, problem, fix))


READERS = {".jsonl": _jsonl, ".json": _json, ".csv": _csv, ".txt": _txt}


def iter_records(
    paths: List[str],
    columns: Optional[List[str]] = None,
    on_bad: Optional[Callable[[DataInputError, bool], None]] = None,
) -> Iterator[Record]:
    """Yield every record of every file in order; problems go to `on_bad(error, whole_file)` (default: raise)."""
    for path in list_files(paths):
        suffix = path.suffix.lower()
        reader = (lambda p: _parquet(p, columns)) if suffix == ".parquet" else READERS[suffix]
        try:
            for rec in reader(path):
                if not isinstance(rec, _BadRecord):
                    yield rec
                elif on_bad is None:
                    raise rec.error
                else:
                    on_bad(rec.error, False)
        except (
            DataInputError
        ) as err:  # whole-file problems (empty, unreadable, broken JSON array) end that file
            if on_bad is None:
                raise
            on_bad(err, True)
