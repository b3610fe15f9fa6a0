"""torch.save's file format written and read in plain Python: a stored (uncompressed) zip with real CRC32s.

Format facts (torch/serialization.py `_save`/`_load`, caffe2/serialize/inline_container.cc, PKWARE APPNOTE 4.3):
every record is `<archive>/<name>`; `data.pkl` is the pickled object where a tensor is
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)` and a storage is the persistent
id `("storage", torch.<Type>Storage, key, location, numel)` whose bytes are record `data/<key>`; `byteorder` and
`version` complete it; torch aligns every record's data to 64 bytes (padding in the local header's extra field)
so that `torch.load(mmap=True)` maps storages in place. No private torch API is used, so the same bytes come out
on torch 2.1 to 2.13 and `torch.load`, `zipfile` and `unzip -t` all read (and check) them.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import sys
from pathlib import Path
from typing import Dict, Tuple

from kit.convert.file_slices import (
    DTYPES,
    STORAGE_TO_NAME,
    Scratch,
    dtype_name,
    itemsize,
    piece_info,
    reserve,
    write_piece,
)
from kit.errors import IntegrityError
from kit.storage.atomic import write_all

# ISA-L's CRC32 (the isal package, in the convert extra) is zlib's checksum, about 3x faster here (carry-less
# multiply). Both release the GIL on large buffers, so rank files written on parallel threads checksum in parallel.
try:
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

ARCHIVE = "archive"
ALIGN = 64  # torch's kFieldAlignment
ZIP64_AT = 0xFFFFFFFF  # sizes and offsets from here on need zip64 fields (a test lowers it)
_U32, _U16 = 0xFFFFFFFF, 0xFFFF
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, fixed: the same input gives the same bytes
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # 20 bytes


# ---- writing ----------------------------------------------------------------------------------------------------


class ZipWriter:
    """Stored zip entries with 64-byte aligned data, CRC32 computed as the bytes go by, zip64 where needed."""

    def __init__(self, path):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._reserving = (
            True  # allocate each record's blocks before writing it (until the file system says no)
        )
        self.pos = 0
        self.entries = []  # (name bytes, crc, size, local header offset)
        self._open = None

    def _raw(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.pos += len(mv)
        write_all(self.fd, mv, self.path)

    def begin(self, name: str, size: int) -> None:
        """Start a record of exactly `size` bytes; then write() them and end()."""
        raw = f"{ARCHIVE}/{name}".encode()
        big = size >= ZIP64_AT
        zip64 = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        start = self.pos + _LOCAL.size + len(raw) + len(zip64) + 4  # data start with an empty padding field
        pad = -start % ALIGN
        extra = zip64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # 'FB' padding field, as torch writes
        if self._reserving and size >= 65536:  # a system call per tensor; not for the small ones
            self._reserving = reserve(
                self.fd, self.pos, _LOCAL.size + len(raw) + len(extra) + size, self.path
            )
        self._raw(
            _LOCAL.pack(
                0x04034B50,
                45 if big else 20,
                0,
                0,
                0,
                _DOS_DATE,
                0,
                _U32 if big else size,
                _U32 if big else size,
                len(raw),
                len(extra),
            )
            + raw
            + extra
        )
        self._open = [raw, 0, size, self.pos - _LOCAL.size - len(raw) - len(extra), size]

    def write(self, mv) -> None:
        # Checksummed while the buffer is hot in cache; the parallelism is one thread per rank file (kit.convert).
        self._open[1] = crc32(mv, self._open[1])
        self._open[4] -= len(mv)
        self._raw(mv)

    def end(self) -> None:
        raw, crc, size, offset, left = self._open
        if left:
            raise AssertionError(f"record {raw!r}: {left} bytes announced but not written")
        os.pwrite(self.fd, struct.pack("<I", crc), offset + 14)  # the CRC field of the local header
        self.entries.append((raw, crc, size, offset))
        self._open = None

    def add(self, name: str, data: bytes) -> None:
        self.begin(name, len(data))
        self.write(data)
        self.end()

    def close(self) -> None:
        cd_start = self.pos
        for raw, crc, size, offset in self.entries:
            zs, zo = size >= ZIP64_AT, offset >= ZIP64_AT
            z = ([size, size] if zs else []) + ([offset] if zo else [])
            extra = struct.pack(f"<HH{len(z)}Q", 1, 8 * len(z), *z) if z else b""
            self._raw(
                _CENTRAL.pack(
                    0x02014B50, 45 if z else 20, 45 if z else 20, 0, 0, 0, _DOS_DATE, crc,
                    _U32 if zs else size, _U32 if zs else size, len(raw), len(extra),
                    0, 0, 0, 0, _U32 if zo else offset,
                )
                + raw
                + extra
            )  # fmt: skip
        cd_size, n = self.pos - cd_start, len(self.entries)
        if n >= _U16 or cd_start >= ZIP64_AT or cd_size >= ZIP64_AT:
            at = self.pos
            self._raw(_EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, n, n, cd_size, cd_start))
            self._raw(_LOCATOR.pack(0x07064B50, 0, at, 1))
            self._raw(_EOCD.pack(0x06054B50, 0, 0, _U16, _U16, _U32, _U32, 0))
        else:
            self._raw(_EOCD.pack(0x06054B50, 0, 0, n, n, cd_size, cd_start, 0))
        # No fsync, like torch.save and safetensors: an interrupted run is caught by the temporary folder
        # (renamed only when complete), and a flush per file would double the time of a conversion.
        os.close(self.fd)


class TorchGlobal:
    """A name torch's unpickler resolves (`torch.bfloat16`, `torch._utils._rebuild_tensor_v2`), pickled as a plain
    GLOBAL reference so that writing a rank file never imports torch."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"

    def __call__(self, *args, **kwargs):  # pickle wants a callable in a reduce tuple; it is never called here
        raise TypeError(f"{self!r} is a reference written into a pickle, not the torch object")

    def __eq__(self, other) -> bool:
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


def torch_dtype_ref(dtype) -> TorchGlobal:
    """`torch.<dtype>` as it appears in a pickle (e.g. args.params_dtype)."""
    return TorchGlobal("torch", dtype_name(dtype))


class StorageRef:
    """A storage of the file: record `data/<key>` holding `numel` elements of `dtype` (written and read alike)."""

    def __init__(self, key: str, dtype: str, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly like a contiguous CPU tensor whose storage is record data/<key>."""

    def __init__(self, ref: StorageRef, shape: Tuple[int, ...]):
        self.ref, self.shape = ref, tuple(shape)

    def __reduce_ex__(self, protocol):
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= n
        args = (self.ref, 0, self.shape, tuple(reversed(stride)), False, collections.OrderedDict())
        return (TorchGlobal("torch._utils", "_rebuild_tensor_v2"), args)


class _Pickler(pickle._Pickler):  # the Python pickler: it lets a type choose its own opcodes (dispatch table)
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_global_ref(self, obj: TorchGlobal) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[TorchGlobal] = _save_global_ref

    def persistent_id(self, obj):
        if isinstance(obj, StorageRef):
            return ("storage", TorchGlobal("torch", DTYPES[obj.dtype][2]), obj.key, "cpu", obj.numel)
        return None


class StreamingTorchFile:
    """`store(tensor)` writes its bytes now and returns a stub; `finish(obj)` pickles obj (with stubs) and closes."""

    def __init__(self, path, scratch: Scratch = None, check=None):
        self.path = Path(path)
        self._zip = ZipWriter(self.path)
        self._scratch = scratch or Scratch()
        self._check = check  # a kit.convert.weights_check.StreamCheck: NaN / inf counted as the bytes go by
        self._count = 0
        self.bytes = 0

    def store(self, x, name: str = "") -> _TensorStub:
        """Write the next storage: a torch tensor, a piece (bytes still on disk) or a Rows list of them. With a
        check, its NaN / inf are counted on the way (`name` is what check.bad calls the tensor)."""
        shape, dtype = piece_info(x)
        n = 1
        for d in shape:
            n *= d
        key = str(self._count)
        self._count += 1
        self._zip.begin(f"data/{key}", n * itemsize(dtype))
        sink = self._zip if self._check is None else self._check.watch(self._zip, dtype)
        write_piece(x, sink, self._scratch)
        if self._check is not None:
            self._check.done(name or f"data/{key}", sink)
        self._zip.end()
        self.bytes += n * itemsize(dtype)
        return _TensorStub(StorageRef(key, dtype, n), shape)

    def finish(self, obj) -> None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)  # protocol 2: what torch.save uses (DEFAULT_PROTOCOL)
        self._zip.add("data.pkl", buf.getvalue())
        self._zip.add("byteorder", sys.byteorder.encode())
        self._zip.add("version", b"3\n")  # torch's produced file format version since 1.x
        self._zip.close()


# ---- reading ----------------------------------------------------------------------------------------------------


class RankFileError(IntegrityError):
    """A rank file that is empty, truncated, garbled or fails its CRC check (converted to ConversionError)."""


class Record:
    __slots__ = ("name", "offset", "size", "crc")

    def __init__(self, name: str, offset: int, size: int, crc: int):
        self.name, self.offset, self.size, self.crc = name, offset, size, crc


class ZipIndex:
    """The records of a torch zip file: name -> data offset, size, CRC, from the central directory."""

    def __init__(self, path):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.records = self._read_index()
        except BaseException:
            os.close(self.fd)
            raise

    def _bad(self, why: str) -> RankFileError:
        return RankFileError(f"{self.path}: {why}")

    def _read_index(self) -> Dict[str, Record]:
        size = os.fstat(self.fd).st_size
        if size == 0:
            raise self._bad("the file is empty (an interrupted copy or save?); copy it again")
        tail = os.pread(
            self.fd, min(size, 65535 + _EOCD.size + _LOCATOR.size + _EOCD64.size), max(0, size - 65535 - 98)
        )
        at = tail.rfind(struct.pack("<I", 0x06054B50))
        if at < 0 or len(tail) - at < _EOCD.size:
            raise self._bad(
                "no zip directory at its end: the file is truncated or not a torch checkpoint; copy it again"
            )
        eocd_pos = size - len(tail) + at
        _, _, _, _, count, cd_size, cd_start, _ = _EOCD.unpack_from(tail, at)
        if count == _U16 or cd_size == _U32 or cd_start == _U32:  # zip64: the locator sits just before
            loc = os.pread(self.fd, _LOCATOR.size, eocd_pos - _LOCATOR.size)
            if len(loc) < _LOCATOR.size or _LOCATOR.unpack(loc)[0] != 0x07064B50:
                raise self._bad("zip64 directory locator missing; the file is damaged")
            rec = os.pread(self.fd, _EOCD64.size, _LOCATOR.unpack(loc)[2])
            if len(rec) < _EOCD64.size or _EOCD64.unpack(rec)[0] != 0x06064B50:
                raise self._bad("zip64 directory record missing; the file is damaged")
            count, cd_size, cd_start = _EOCD64.unpack(rec)[7:10]
        if cd_start + cd_size > eocd_pos:
            raise self._bad("its zip directory points past the end: the file is truncated; copy it again")
        cd = os.pread(self.fd, cd_size, cd_start)
        records, pos = {}, 0
        for _ in range(count):
            if len(cd) - pos < _CENTRAL.size or _CENTRAL.unpack_from(cd, pos)[0] != 0x02014B50:
                raise self._bad("garbled zip directory; the file is damaged, copy it again")
            f = _CENTRAL.unpack_from(cd, pos)
            method, crc, csize, usize, nlen, elen, clen, offset = (
                f[4],
                f[7],
                f[8],
                f[9],
                f[10],
                f[11],
                f[12],
                f[16],
            )
            raw = cd[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]
            extra = cd[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + elen]
            pos += _CENTRAL.size + nlen + elen + clen
            usize, csize, offset = _zip64(extra, usize, csize, offset)
            name = raw.decode("utf-8", "replace")
            if method != 0 or csize != usize:
                raise self._bad(
                    f"record {name!r} is compressed; torch checkpoints store records uncompressed"
                )
            head = os.pread(self.fd, _LOCAL.size, offset)
            if len(head) < _LOCAL.size or _LOCAL.unpack(head)[0] != 0x04034B50:
                raise self._bad(f"record {name!r}: local header missing; the file is damaged, copy it again")
            lh = _LOCAL.unpack(head)
            data = offset + _LOCAL.size + lh[9] + lh[10]
            if data + usize > cd_start:
                raise self._bad(
                    f"record {name!r} runs past the data area: the file is truncated; copy it again"
                )
            short = name.split("/", 1)[1] if "/" in name else name  # torch strips the archive folder name
            records[short] = Record(short, data, usize, crc)
        if "data.pkl" not in records:
            raise self._bad("no data.pkl record: not a torch.save checkpoint")
        return records

    def read(self, name: str) -> bytes:
        r = self.records[name]
        data = os.pread(self.fd, r.size, r.offset)
        if crc32(data) != r.crc and r.crc:
            raise self._bad(f"record {name!r} fails its CRC32 check: the file is damaged, copy it again")
        return data

    def verify(self, scratch: Scratch = None) -> int:
        """Check every record's CRC32 (streamed through one buffer); returns how many records had none (CRC 0,
        as torch.save writes with compute_crc32=False and older kit versions wrote)."""
        from kit.convert.file_slices import pread_into

        scratch, unchecked = scratch or Scratch(), 0
        for r in self.records.values():
            crc, at, end = 0, r.offset, r.offset + r.size
            while at < end:
                buf = scratch.get("crc", min(scratch.size, end - at))
                pread_into(self.fd, buf, at, self.path)
                crc = crc32(buf, crc)
                at += len(buf)
            if r.crc == 0 and crc != 0:
                unchecked += 1
            elif crc != r.crc:
                raise self._bad(
                    f"record {r.name!r} fails its CRC32 check (stored {r.crc:08x}, data {crc:08x}): the file is "
                    f"damaged, copy it again"
                )
        return unchecked

    def close(self) -> None:
        os.close(self.fd)


def _zip64(extra: bytes, usize: int, csize: int, offset: int) -> Tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        hid, n = struct.unpack_from("<HH", extra, pos)
        if hid == 1:
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if usize == _U32:
                usize = vals.pop(0)
            if csize == _U32:
                csize = vals.pop(0)
            if offset == _U32:
                offset = vals.pop(0)
        pos += 4 + n
    return usize, csize, offset


class TensorRef:
    """A tensor of the file, not read: its storage, offset, shape and stride (what `_rebuild_tensor_v2` receives)."""

    def __init__(self, storage: StorageRef, offset: int, shape, stride):
        self.storage, self.offset = storage, int(offset)
        self.shape, self.stride = tuple(shape), tuple(stride)

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    def is_contiguous(self) -> bool:
        acc = 1
        for n, s in zip(reversed(self.shape), reversed(self.stride)):
            if n != 1 and s != acc:
                return False
            acc *= n
        return True

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _rebuild(storage, offset, shape, stride, *_rest):
    return TensorRef(storage, offset, shape, stride)


class _Opaque:
    """Stands for any object a training checkpoint holds besides the weights (optimizer, RNG state, enums in args):
    built without running its class's code, so an untrusted file cannot execute anything."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} (not loaded)>"


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): __import__("argparse").Namespace,
    ("_io", "BytesIO"): io.BytesIO,
    ("io", "BytesIO"): io.BytesIO,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild,
    ("torch._utils", "_rebuild_tensor"): _rebuild,
}


class _Unpickler(pickle.Unpickler):
    """Restricted: tensors become TensorRefs, dtypes TorchGlobals, anything unknown an inert _Opaque."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and (name in DTYPES or name in STORAGE_TO_NAME or name == "UntypedStorage"):
            return TorchGlobal(module, name)
        return type(name, (_Opaque,), {"__module__": f"opaque.{module}"})

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        stype, key, numel = pid[1], str(pid[2]), int(pid[4])
        sname = getattr(stype, "name", "")
        dtype = "uint8" if sname == "UntypedStorage" else STORAGE_TO_NAME.get(sname)
        if dtype is None:
            raise pickle.UnpicklingError(f"unknown storage type {stype!r}")
        return StorageRef(key, dtype, numel)


def load_refs(index: ZipIndex) -> dict:
    """Unpickle data.pkl: the saved object with TensorRefs in place of tensors; nothing else is read."""
    try:
        return _Unpickler(io.BytesIO(index.read("data.pkl"))).load()
    except RankFileError:
        raise
    except Exception as exc:  # any pickle failure means a garbled file
        raise RankFileError(
            f"{index.path}: data.pkl cannot be read ({type(exc).__name__}: {exc}); the file is "
            f"damaged, copy it again"
        ) from None


def ref_bytes_range(index: ZipIndex, ref: TensorRef) -> Tuple[int, int]:
    """(file offset, nbytes) of a contiguous TensorRef; checks it lies inside its record."""
    rec = index.records.get(f"data/{ref.storage.key}")
    item = itemsize(ref.dtype)
    nbytes = ref.numel() * item
    if rec is None or (ref.offset * item + nbytes) > rec.size or not ref.is_contiguous():
        raise RankFileError(
            f"{index.path}: tensor storage data/{ref.storage.key} is missing or smaller than its tensor; "
            f"the file is damaged"
        )
    return rec.offset + ref.offset * item, nbytes
