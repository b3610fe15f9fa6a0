"""Streaming readers for jsonl, json, parquet, csv and txt files or folders: one record at a time."""

from __future__ import annotations

import codecs
import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Union

from kit.errors import InputError, MissingInputError

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv", ".txt")
_FIX_ENCODING = "convert it to UTF-8 first (e.g. `iconv -f GBK -t UTF-8 in.jsonl > out.jsonl`)"
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # UTF-32 LE starts like UTF-16 LE
_JSON_WS = re.compile(r"[ \t\n\r]*")  # the whitespace JSON allows between tokens (RFC 8259)
_SKIP_PIECE = 1 << 20  # bytes read at a time past an over-long line


def position(source: str, line: int, item: Optional[int] = None) -> str:
    """`file:line`, plus the item number inside a JSON array; the file alone for whole-file problems."""
    where = f"{source}:{line}" if line else source
    return f"{where} (item {item})" if item else where


class DataInputError(InputError):
    """A record (or a whole input file) that cannot be used; names the file, the line and the fix."""

    def __init__(
        self,
        source: str,
        line: int,
        problem: str,
        fix: str,
        reason: str = "malformed",
        item: Optional[int] = None,
        skippable: bool = True,
    ):
        self.source, self.line, self.item, self.problem, self.reason = source, line, item, problem, reason
        tail = "; or pass on_error='skip' to skip and count such records" if skippable else ""
        super().__init__(f"{position(source, line, item)}: {problem}. Fix: {fix}{tail}.")


class DataPathError(MissingInputError):
    """An input, tokenizer or prepared folder that does not exist or holds nothing usable."""


@dataclass
class Record:
    """One input record and where it came from (1-based line or row number; item number in a JSON array)."""

    source: str
    line: int
    data: dict
    item: Optional[int] = None

    @property
    def where(self) -> str:
        return position(self.source, self.line, self.item)


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
                raise DataPathError(
                    f"folder {p} holds no {'/'.join(EXTENSIONS)} files; point inputs at the "
                    f"data files or the folder that holds them."
                )
            files.extend(found)
        elif p.is_file():
            if p.suffix.lower() not in EXTENSIONS:
                raise InputError(
                    f"{p}: unsupported file type {p.suffix!r}; use one of {', '.join(EXTENSIONS)}."
                )
            files.append(p)
        else:
            raise DataPathError(f"input {p} does not exist; check the path.")
    return files


def too_large(source: str, line: int, size: int, limit: int, item: Optional[int] = None) -> DataInputError:
    """The error for a record of `size` bytes over the `max_record_bytes` limit (it was not read into memory)."""
    return DataInputError(
        source,
        line,
        f"the record is {size:,} bytes, over max_record_bytes={limit:,} (it was not read into memory)",
        "split it into smaller records, or raise max_record_bytes if this machine has the memory for it",
        "too_large",
        item=item,
    )


def _bounded_lines(fh: Any, limit: Optional[int]) -> Iterator[tuple]:
    """(line bytes or None, its size) for each line of the binary file `fh`; a line over `limit` bytes is read
    past in 1 MiB pieces and comes as (None, size), so memory stays within `limit` whatever the input."""
    if limit is None:
        for raw in fh:
            yield raw, len(raw)
        return
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        size = len(raw)
        del raw
        while True:
            piece = fh.readline(_SKIP_PIECE)
            size += len(piece)
            if not piece or piece.endswith(b"\n"):
                break
        yield None, size


def _text_lines(path: Path, per_line: bool = False, limit: Optional[int] = None) -> Iterator[tuple]:
    """(1-based number, line) of a UTF-8 text file. A line that is not UTF-8 or longer than `limit` bytes raises,
    naming the line, or with `per_line` comes as (number, DataInputError) so the caller can skip just that line."""
    n = 0
    with open(path, "rb") as fh:
        for n, (raw, size) in enumerate(_bounded_lines(fh, limit), 1):  # noqa: B007 - n is used after the loop
            if raw is None:
                err = too_large(str(path), n, size, limit or 0)
                if not per_line:
                    raise err
                yield n, err
                continue
            if n == 1:
                raw = _strip_bom(path, raw)
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


def _strip_bom(path: Path, head: bytes) -> bytes:
    """`head` without a UTF-8 byte-order mark (Windows tools write one; it is not part of the data).
    UTF-16 text is refused with its own fix: decoding it as UTF-8 would only report a bad byte."""
    if head.startswith(codecs.BOM_UTF8):
        return head[len(codecs.BOM_UTF8) :]
    if head.startswith(_UTF16_BOMS):
        raise DataInputError(
            str(path),
            0,
            "the file is UTF-16 text (it starts with a UTF-16 byte-order mark)",
            "convert it to UTF-8 first (e.g. `iconv -f UTF-16 -t UTF-8 in.jsonl > out.jsonl`)",
            "encoding",
        )
    return head


def _json_value(decode: Callable[[], Any], path: Path, line: int, item: Optional[int] = None) -> Any:
    """decode(), with the parser's own limits (nesting depth, digits of an integer) as errors at `line`."""
    try:
        return decode()
    except RecursionError:
        problem = "JSON nested deeper than the parser allows (about 1,000 levels)"
    except ValueError as exc:  # JSONDecodeError is handled by the callers; this is int's digit limit
        if isinstance(exc, json.JSONDecodeError):
            raise
        problem = f"a JSON number the parser refuses ({str(exc).split(';')[0]})"
    raise DataInputError(str(path), line, problem, "repair or remove the record", "malformed", item=item)


def _jsonl(path: Path, limit: Optional[int] = None) -> Iterator[Record]:
    for n, line in _text_lines(path, per_line=True, limit=limit):
        if isinstance(line, DataInputError):
            yield _BadRecord(line)
            continue
        text = line.strip()
        if not text:
            continue
        try:
            value = _json_value(lambda: json.loads(text), path, n)  # noqa: B023 - called at once
        except json.JSONDecodeError as exc:
            yield _bad(
                path,
                n,
                f"malformed JSON ({exc.msg} at column {exc.colno})",
                "repair the line so it holds one JSON object",
            )
            continue
        except DataInputError as err:
            yield _BadRecord(err)
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


def _json(path: Path, limit: Optional[int] = None) -> Iterator[Record]:
    with open(path, "rb") as fh:
        head = _strip_bom(path, fh.read(4096)).lstrip()
    if not head.startswith(b"["):
        yield from _jsonl(path, limit)  # many ".json" files are really JSON lines
        return
    # A JSON array is read whole (memory grows with the file; .jsonl streams); each item is held to the limit.
    raw = _strip_bom(path, path.read_bytes())
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataInputError(str(path), line, "not valid UTF-8", _FIX_ENCODING, "encoding") from None
    del raw
    for i, line, value in _array_items(path, text, limit):
        if isinstance(value, DataInputError):
            yield _BadRecord(value)
            continue
        if not isinstance(value, dict):
            yield _bad(
                path,
                line,
                f"item {i} is a {type(value).__name__}, not an object",
                "make every item an object",
                item=i,
            )
            continue
        yield Record(str(path), line, value, i)


def _array_items(path: Path, text: str, limit: Optional[int] = None) -> Iterator[tuple]:
    """(item number, line where it starts, value) for each item of the JSON array `text`, parsed one item at a
    time so that every item (and every syntax error) has its line; an item over `limit` bytes comes as its
    DataInputError in place of the value."""
    decoder = json.JSONDecoder()
    fix = "repair the file (it must be one JSON array of objects) or convert it to .jsonl"
    line, counted = 1, 0

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def broken(pos: int, what: str, item: int) -> DataInputError:
        return DataInputError(str(path), line_at(pos), f"malformed JSON ({what})", fix, item=item)

    pos = _JSON_WS.match(text, _JSON_WS.match(text).end() + 1).end()  # past "[" (checked by the caller)
    i = 0
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            i += 1
            try:
                value, end = _json_value(lambda: decoder.raw_decode(text, pos), path, line_at(pos), i)  # noqa: B023
            except json.JSONDecodeError as exc:
                raise DataInputError(
                    str(path), exc.lineno, f"malformed JSON ({exc.msg} at column {exc.colno})", fix, item=i
                ) from None
            chars = end - pos  # a UTF-8 character is 1 to 4 bytes: encode only when it could matter
            size = chars if limit is None or chars * 4 <= limit else len(text[pos:end].encode("utf-8"))
            if limit is not None and size > limit:
                value = too_large(str(path), line_at(pos), size, limit, i)
            yield i, line_at(pos), value
            del value
            pos = _JSON_WS.match(text, end).end()
            if text.startswith(",", pos):
                pos = _JSON_WS.match(text, pos + 1).end()
            elif text.startswith("]", pos):
                pos += 1
                break
            else:
                raise broken(pos, f"expected ',' or ']' after item {i}", i)
    if _JSON_WS.match(text, pos).end() != len(text):
        raise broken(pos, "text after the closing ']'", 0)
    if i == 0:
        raise DataInputError(
            str(path), 0, "the JSON array is empty", "remove it from inputs or fill it", "empty_file"
        )


@dataclass
class TextBlock:
    """Consecutive rows of one string column (no nulls): pretraining text read in bulk, without a Record each."""

    source: str
    line: int
    """Row number (1-based) of the first text."""
    texts: List[str]


def _parquet_batches(pf: Any, path: Path, columns: Optional[List[str]], batch_rows: int) -> Iterator[Any]:
    """Record batches, streamed one row group at a time: a single `ParquetFile.iter_batches` over the whole file
    keeps memory for every row group it has read until it ends (measured with pyarrow 26: +1.5 MB per row group),
    so RSS would grow with the file; one iterator per row group releases it, and still streams inside a group."""
    row = 0
    for group in range(pf.num_row_groups):
        # one thread: the tokenizer workers are the parallelism (pyarrow's pool only adds CPU here)
        batches = pf.iter_batches(batch_rows, row_groups=[group], columns=columns, use_threads=False)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except Exception as exc:  # a damaged page or column chunk
                raise DataInputError(
                    str(path),
                    row + 1,
                    f"damaged parquet data after row {row} ({str(exc).splitlines()[0] if str(exc) else exc!r})",
                    "re-export or re-download the file",
                    "malformed",
                ) from None
            row += batch.num_rows
            yield batch
        del batches


def _row_bytes(batch: Any) -> Any:
    """Bytes of text per row of an arrow batch: the sum over its string and binary columns (nulls count 0)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    total = np.zeros(batch.num_rows, dtype=np.int64)
    for col in batch.columns:
        t = col.type
        if (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
        ):
            total += pc.fill_null(pc.binary_length(col), 0).to_numpy(zero_copy_only=False)
    return total


def _parquet(
    path: Path,
    columns: Optional[List[str]],
    text_column: Optional[str] = None,
    batch_rows: int = 2048,
    limit: Optional[int] = None,
) -> Iterator[Record]:
    import pyarrow as pa
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
    bulk = text_column is not None and wanted == [text_column]
    row = 0
    for batch in _parquet_batches(pf, path, wanted, batch_rows):
        # a batch is as large as the file's row groups make it; rows over the limit go no further than here. A
        # batch whose buffers (text, offsets, validity) fit in the limit holds no row over it: no per-row sizes
        sizes = _row_bytes(batch) if limit is not None and batch.nbytes > limit else None
        over = sizes is not None and bool((sizes > limit).any())
        col = batch.column(0) if bulk else None
        if (
            not over
            and col is not None
            and col.null_count == 0
            and (pa.types.is_string(col.type) or pa.types.is_large_string(col.type))
        ):
            yield TextBlock(str(path), row + 1, col.to_pylist())  # type: ignore[misc]
            row += batch.num_rows
            continue
        if not over:
            for item in batch.to_pylist():  # other types and nulls: per record, so problems name their row
                row += 1
                yield Record(str(path), row, item)
            continue
        for i in range(batch.num_rows):  # row by row: a too large row is never copied into Python
            row += 1
            if sizes[i] > limit:
                yield _BadRecord(too_large(str(path), row, int(sizes[i]), limit))
            else:
                yield Record(str(path), row, batch.slice(i, 1).to_pylist()[0])
    if row == 0:
        raise DataInputError(str(path), 0, "the file has no rows", "remove it from inputs", "empty_file")


def _csv(path: Path, limit: Optional[int] = None) -> Iterator[Record]:
    too_long: List[DataInputError] = []

    def lines() -> Iterator[str]:
        for _, line in _text_lines(path, per_line=True, limit=limit):
            if isinstance(line, DataInputError) and line.reason == "too_large":
                too_long.append(line)
                yield "\n"  # a blank line keeps csv's line count; DictReader skips it
            elif isinstance(line, DataInputError):
                raise line
            else:
                yield line

    reader = csv.DictReader(lines())
    rows = 0
    try:
        for item in reader:
            while too_long:
                yield _BadRecord(too_long.pop(0))
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
    while too_long:
        yield _BadRecord(too_long.pop(0))
    if rows == 0 and reader.fieldnames is None:
        raise DataInputError(
            str(path), 0, "the file is empty", "remove it from inputs or fill it", "empty_file"
        )


def _txt(path: Path, limit: Optional[int] = None) -> Iterator[Record]:
    for n, line in _text_lines(path, per_line=True, limit=limit):
        if isinstance(line, DataInputError):
            yield _BadRecord(line)
        else:
            yield Record(str(path), n, {"text": line.rstrip("\r\n")})


class _BadRecord(Record):
    """A record that failed to parse; carries its error so the caller applies on_error."""

    def __init__(self, error: DataInputError):
        super().__init__(error.source, error.line, {}, error.item)
        self.error = error


def _bad(path: Path, line: int, problem: str, fix: str, item: Optional[int] = None) -> _BadRecord:
    return _BadRecord(DataInputError(str(path), line, problem, fix, item=item))


READERS = {".jsonl": _jsonl, ".json": _json, ".csv": _csv, ".txt": _txt}


def iter_records(
    paths: List[str],
    columns: Optional[List[str]] = None,
    on_bad: Optional[Callable[[DataInputError, bool], None]] = None,
    text_column: Optional[str] = None,
    max_record_bytes: Optional[int] = None,
) -> Iterator[Union[Record, TextBlock]]:
    """Yield every record of every file in order; problems go to `on_bad(error, whole_file)` (default: raise).

    With `text_column`, parquet rows whose only wanted column is that string column come as `TextBlock`s. A record
    over `max_record_bytes` (None: no limit) is such a problem, found without holding it in memory."""
    limit = max_record_bytes
    for path in list_files(paths):
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            reader: Callable[[Path], Iterator[Any]] = lambda p: _parquet(p, columns, text_column, limit=limit)  # noqa: E731
        else:
            reader = lambda p, r=READERS[suffix]: r(p, limit)  # noqa: E731
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
