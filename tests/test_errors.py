"""One error hierarchy: every exception class the kit defines derives from kit.errors.KitError."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import kit
from kit.errors import InputError, IntegrityError, KitError, MissingInputError

KIT = Path(kit.__file__).parent


def _exception_classes():
    """(module, class name) of every class in kit/ whose name says it is an error."""
    for path in sorted(KIT.rglob("*.py")):
        module = ".".join(path.relative_to(KIT.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Exception")):
                yield module, node.name


def test_every_kit_error_is_a_kit_error():
    classes = list(_exception_classes())
    assert len(classes) > 15  # the scan finds the kit's errors (kit.errors itself has 7)
    outside = [
        f"{m}.{n}" for m, n in classes if not issubclass(getattr(importlib.import_module(m), n), KitError)
    ]
    assert outside == []


def test_stage_errors_sit_under_the_shared_kinds():
    """Stage errors refine the kinds of kit.errors, so `except InputError` catches every bad-input error."""
    from kit.convert.torch_zip import RankFileError
    from kit.core.configs import ConfigError
    from kit.data.readers import DataInputError, DataPathError
    from kit.profiling.profile_data import ProfileError

    assert issubclass(RankFileError, IntegrityError) and issubclass(RankFileError, ValueError)
    assert all(issubclass(c, InputError) for c in (ConfigError, DataInputError, ProfileError))
    assert issubclass(DataPathError, MissingInputError) and issubclass(DataPathError, FileNotFoundError)


def test_library_write_failures_name_the_path_being_written(small_disk, remount_read_only):
    """torch.save and safetensors lose the errno and the file; `writing()` gives the one line back (issue 30)."""
    import pytest
    import torch
    from safetensors.torch import save_file

    from kit.errors import OutputError, user_message, writing

    big = {"w": torch.zeros(2**19)}  # 2 MiB: more than the disk holds
    for name, save in (("m.pt", torch.save), ("m.safetensors", lambda t, p: save_file(t, p))):
        target = small_disk / name
        with pytest.raises(OutputError) as err, writing(target):
            save(big, str(target))
        assert user_message(err.value) == (
            f"cannot write {str(target)!r}: the disk is full; free space or choose an output folder on a "
            f"larger volume"
        )
    remount_read_only(small_disk)
    for name, save in (("r.pt", torch.save), ("r.safetensors", lambda t, p: save_file(t, p))):
        target = small_disk / name
        with pytest.raises(OutputError, match=f"cannot write {str(target)!r}: the filesystem is read-only"):
            with writing(target):
                save({"w": torch.zeros(4)}, str(target))


def test_a_write_error_without_a_file_name_names_the_output_not_a_question_mark(tmp_path):
    """RLIMIT_FSIZE (EFBIG from write(2), which names no file): the message names what was being written."""
    import subprocess
    import sys

    code = (
        "import resource, signal, sys\n"
        "from kit.errors import OutputError, user_message, writing\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"  # EFBIG instead of being killed
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        "    with writing(sys.argv[1]), open(sys.argv[1], 'wb') as fh:\n"
        "        fh.write(b'x' * 65536)\n"
        "except OutputError as exc:\n"
        "    sys.exit(f'error: {user_message(exc)}')\n"
    )
    target = tmp_path / "out.bin"
    proc = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"error: cannot write {str(target)!r}: the file is larger than"), (
        proc.stderr
    )


def test_a_plot_on_a_full_disk_names_the_png(small_disk):
    """matplotlib's writer reports ENOSPC without a file name; the kit's plots name theirs."""
    import pytest
    from matplotlib.figure import Figure

    from kit.errors import OutputError
    from kit.profiling.plots import _save

    filler = small_disk / "filler"
    with pytest.raises(OSError), open(filler, "wb") as fh:  # fill the disk to its last block
        fh.write(b"\0" * 2**21)
    fig = Figure(figsize=(4, 3))
    fig.add_subplot().plot(range(100))
    png = small_disk / "top_operators.png"
    with pytest.raises(OutputError, match=f"^cannot write {str(png)!r}: the disk is full"):
        _save(fig, png)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_an_input_the_process_may_not_read_is_named_as_unreadable_not_unwritable(tmp_path):
    """A permission error on a file the stage reads is `cannot read`, not `cannot write`, even inside `writing()`.
    As root the test drops the capabilities that let root read anything (setpriv); as another user chmod is enough."""
    import os
    import shutil
    import subprocess
    import sys

    data = tmp_path / "in.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    data.chmod(0)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv (util-linux) cannot be kept from reading a file")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    cmd = prefix + [sys.executable, "-m", "kit", "data", "sft", str(data), "--out-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last == (
        f"error: cannot read {str(data)!r}: permission denied; fix its permissions or give a file you can read"
    ), proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
