"""One error contract for the whole kit: expected failures are `KitError`s that read as one line.

Every stage raises a subclass of `KitError` for a failure the user can fix (bad input, wrong config, an output
that exists, damaged files). The command line prints `error: <message>` (`错误：<message>` in Chinese,
kit.core.i18n) and exits 2; a notebook shows the same line instead of a traceback (IPython calls
`_render_traceback_`). `--debug` / `KIT_DEBUG=1` shows tracebacks.
Operating-system failures that a user can act on (disk full, read-only filesystem, name too long, permission
denied) are turned into the same kind of line by `describe_os_error`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import Iterator, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

EXIT_USER_ERROR = 2
EXIT_UNEXPECTED = 1
# A training run stopped by SIGTERM/SIGINT after saving a checkpoint: sysexits' EX_TEMPFAIL ("temporary failure,
# retry later"), so a job scheduler can tell a preemption to resume from a completed run (0) and a failure (1, 2).
EXIT_PREEMPTED = 75


# The line's prefix in each language of the kit's messages (kit.core.i18n: its catalog holds this as "error.prefix").
ERROR_PREFIX = {"en": "error: ", "zh": "错误："}


def _english() -> str:
    return "en"


# Which language the notebook's error line (and a lower layer's refusal, kit.storage.atomic) is in. The setting lives
# above this module (KIT_LANG or the project's language, read by kit.core.i18n), so kit.core.i18n installs its lookup
# here when it is imported; until then, English.
_language = _english


def set_language_lookup(lookup) -> None:
    """Have current_language() (the error line's prefix, a lower layer's refusal) answer `lookup()`: en or zh."""
    global _language
    _language = lookup


def current_language() -> str:
    """The kit's language for the layers below kit.core (English until kit.core.i18n is loaded)."""
    return _language()


def error_line(message: str) -> str:
    """`error: <message>` with the prefix in the kit's language (English until kit.core.i18n is loaded)."""
    return ERROR_PREFIX.get(current_language(), ERROR_PREFIX["en"]) + message


def debug_enabled() -> bool:
    """True when KIT_DEBUG asks for full tracebacks."""
    return os.environ.get("KIT_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


class KitError(Exception):
    """A failure the user can fix; the message says what is wrong and what to do."""

    def _render_traceback_(self) -> list:
        # IPython uses this instead of the traceback when present: the notebook shows the kit's line.
        if debug_enabled():
            import traceback

            return traceback.format_exception(type(self), self, self.__traceback__)
        return [error_line(one_line(self))]


class InputError(KitError, ValueError):
    """A file, folder or value given to the kit is missing, malformed or of the wrong kind."""


class MissingInputError(InputError, FileNotFoundError):
    """A file or folder the kit was pointed at does not exist (or lacks the file that makes it what it is)."""


class ParameterError(InputError, TypeError):
    """An unknown parameter name (a typo in a notebook's parameters or a `--set KEY=VALUE`)."""


class DeviceError(KitError, RuntimeError):
    """The requested accelerator is not usable here."""


class IntegrityError(KitError, ValueError):
    """Stored data failed a check (hash, CRC, size, member list): it is damaged or incomplete."""


class OutputError(KitError, OSError):
    """An output cannot be written (disk full, read-only filesystem, name too long, permission denied)."""

    def __str__(self) -> str:  # OSError(errno, text) would print "[Errno 28] text"
        return self.strerror if self.strerror is not None else super().__str__()


# errno -> what to do; the message always names the path.
_OS_HINTS = {
    errno.ENOSPC: "the disk is full; free space or choose an output folder on a larger volume",
    errno.EDQUOT: "the disk quota is exceeded; free space or choose another output folder",
    errno.EROFS: "the filesystem is read-only; choose an output folder on a writable volume "
    "(on ModelArts: under /home/ma-user/work)",
    errno.ENAMETOOLONG: "the file name is too long for this filesystem; choose a shorter name or folder",
    errno.EACCES: "permission denied; choose a folder you can write to or fix its permissions",
    errno.EPERM: "operation not permitted; choose a folder you own",
    errno.EFBIG: "the file is larger than this filesystem or the process's file-size limit (ulimit -f) allows; "
    "raise the limit or choose another volume",
}


def _read_refused(exc: OSError, output: Optional[PathLike]) -> bool:
    """True when the refused file is something read, not written: it exists, this process may not read it, and it
    lies outside the output being written."""
    filename = exc.filename
    if getattr(exc, "errno", None) not in (errno.EACCES, errno.EPERM) or filename is None:
        return False
    if not os.path.lexists(filename) or os.access(filename, os.R_OK):
        return False
    if output is None:
        return True
    out = os.path.abspath(os.fspath(output))
    return os.path.commonpath([out, os.path.abspath(os.fspath(filename))]) != out


def describe_os_error(exc: OSError, path: Optional[PathLike] = None) -> Optional[str]:
    """One line for an OSError a user can act on, or None when it is not one of those (`path`: what was being
    written, named when the error carries no file name)."""
    code = getattr(exc, "errno", None) or -1
    hint = _OS_HINTS.get(code)
    if hint is None:
        return None
    where = exc.filename if exc.filename is not None else path
    if _read_refused(exc, path):
        return f"cannot read {os.fspath(where)!r}: permission denied; fix its permissions or give a file you can read"
    if where is None:
        return f"cannot write (the system gave no file name): {hint}"
    return f"cannot write {os.fspath(where)!r}: {hint}"


# Writers that lose the errno: safetensors raises SafetensorError("Error while serializing: I/O error: No space left
# on device (os error 28)") (Rust's io::Error; its Debug form reads "Os { code: 28, ..."); torch.save's zip writer
# raises RuntimeError("[enforce fail at inline_container.cc:...] . unexpected pos N vs M", "... open file failed with
# strerror: ..." or "PytorchStreamWriter failed writing file ...") (read from torch 2.13 and safetensors 0.5); torch 2.5's
# writer raises RuntimeError("File <path> cannot be opened.") on a read-only volume.
_RUST_OS_CODE = re.compile(r"(?:os error |Os \{ code: )(\d+)")
_TORCH_WRITE_FAILED = (
    "unexpected pos",
    "PytorchStreamWriter failed",
    "file write failed",
    "open file failed",
    "cannot be opened",
)


def _errno_of_failed_write(exc: BaseException, path: PathLike) -> Optional[int]:
    """The errno behind a library's write failure: read from its message, else from the volume's state (read-only,
    no space left); None when it is not a write failure."""
    text = str(exc)
    found = _RUST_OS_CODE.search(text)
    if found:
        return int(found.group(1))
    if not (isinstance(exc, RuntimeError) and any(s in text for s in _TORCH_WRITE_FAILED)):
        return None
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return errno.EIO
    if st.f_flag & getattr(os, "ST_RDONLY", 1):
        return errno.EROFS
    if st.f_bavail * st.f_frsize < 16 * 2**20:  # less than a few blocks of a checkpoint write left
        return errno.ENOSPC
    return errno.EIO


@contextlib.contextmanager
def writing(path: PathLike) -> Iterator[None]:
    """Within the block, a failed write (disk full, quota, read-only, permissions, file-size limit) raises
    OutputError `cannot write '<path>': <what to do>`; `path` is named when the error carries no file name."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        message = describe_os_error(exc, path)
        if message is None:
            raise
        if _read_refused(exc, path):  # an input read inside the block
            raise InputError(message) from exc
        raise OutputError(exc.errno, message) from exc
    except Exception as exc:  # safetensors' SafetensorError, torch.save's RuntimeError
        code = _errno_of_failed_write(exc, path)
        if code is None:
            raise
        hint = _OS_HINTS.get(code) or f"the write failed ({one_line(exc)})"
        raise OutputError(code, f"cannot write {os.fspath(path)!r}: {hint}") from exc


# what to do when an optional dependency (a stage's extra) is missing: at start-up (kit.__main__) or when a stage
# imports it lazily (user_message)
INSTALL_EXTRAS = (
    "install the kit with its extras (`pip install -e .[data,convert,train,profile,envs,samples,notebooks]`)"
)


def user_message(exc: BaseException) -> Optional[str]:
    """The one-line message for an expected failure, or None for an unexpected one."""
    if isinstance(exc, KitError):
        return one_line(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"the package {exc.name!r} is not installed: {INSTALL_EXTRAS} and retry."
    if isinstance(exc, OSError):
        described = describe_os_error(exc)
        if described:
            return described
        if isinstance(exc, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)):
            return one_line(exc)
    return None


def one_line(exc: BaseException) -> str:
    """The exception's message joined onto one line (multi-problem errors keep `; ` between items)."""
    text = str(exc).strip() or type(exc).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else text
    head, rest = lines[0], [ln.lstrip("- ").strip() for ln in lines[1:]]
    colon = "：" if head.endswith("：") else ": "  # a Chinese head keeps its full-width colon
    return head.rstrip(":：") + colon + "; ".join(rest)


def _ipython_os_error(shell, etype, value, tb, tb_offset=None):
    """IPython custom-exception handler: OSErrors a user can act on show as one `error:` line."""
    message = None if debug_enabled() else describe_os_error(value)
    if message is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None
    shell._showtraceback(etype, value, [error_line(message)])
    return None


def install_notebook_handler() -> bool:
    """In a running IPython kernel, show disk-full / read-only / name-too-long errors as one line; else no-op."""
    import sys

    if "IPython" not in sys.modules:  # not inside IPython: nothing to do, and IPython is not imported
        return False
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return False
    if not getattr(shell, "_kit_os_error_handler", False):
        shell.set_custom_exc((OSError,), _ipython_os_error)
        shell._kit_os_error_handler = True
    return True
