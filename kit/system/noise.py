"""Third-party chatter kept out of the notebook: what a library prints while the kit calls it goes to a log file.

`quiet(log)` catches, for one block, both the process's stderr (file descriptor 2: compilers DeepSpeed starts, C++
libraries) and Python's (warnings, tqdm bars), and the INFO/WARNING records of the loggers named. Afterwards all of
it is appended to `log` when given. Lines that match none of the known noise below are real warnings: they are
written to stderr again, after the block.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

NOISE = re.compile(
    "|".join(
        (
            r"cannot find -laio|collect2: error: ld returned",  # DeepSpeed's CPU op probe (comm/torch.py build_shm_op)
            # torch's extension builder when DeepSpeed's CPU op does build (torch/utils/cpp_extension.py, verbose)
            r"^No CUDA runtime is found, using CUDA_HOME|as PyTorch extensions root|^Emitting ninja build file"
            r"|^Building extension module|^Allowing ninja to set a default number of workers|^Loading extension module",
            r"^USDT:",  # kineto's profiler start / stop markers
            r"\d+%\|",  # tqdm bars (lm-eval's request loops)
            # lm-eval asks git for the commit of the folder it runs in (lm_eval/loggers/utils.py get_git_commit_hash)
            r"^fatal: not a git repository",
            r"(Future|Deprecation)Warning|^\s*warnings\.warn\(",  # libraries warning about their own next versions
        )
    )
)


def real_lines(text: str) -> list:
    """The lines of `text` (a tqdm bar's frames split at carriage returns) that are not known noise."""
    return [line for line in re.split(r"[\r\n]+", text) if line.strip() and not NOISE.search(line)]


def _to_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def quiet(log: Optional[Union[str, Path]] = None, loggers: Sequence[str] = ()) -> Iterator[None]:
    """Catch stderr (fd 2 and sys.stderr) and the named loggers' records below ERROR for the block; see the module."""
    levels = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    for logger, _ in levels:
        logger.setLevel(logging.ERROR)
    sys.stderr.flush()
    saved, caught, text = os.dup(2), tempfile.TemporaryFile(), io.StringIO()
    os.dup2(caught.fileno(), 2)
    try:
        with contextlib.redirect_stderr(text), warnings.catch_warnings():
            warnings.showwarning = _to_stderr  # here, not to a recorder a test runner or a library installed
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        for logger, level in levels:
            logger.setLevel(level)
        caught.seek(0)
        out = caught.read().decode("utf-8", "replace") + text.getvalue()
        caught.close()
        if out and log is not None:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a", encoding="utf-8") as f:
                f.write(out)
        kept = real_lines(out)
        if kept:
            sys.stderr.write("\n".join(kept) + "\n")
