"""`python -m kit`: every stage is reachable, only the asked-for stage is imported, one error contract."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from kit import __main__ as cli
from kit.errors import InputError, KitError, one_line


def test_all_stages_are_registered():
    choices = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(cli.STAGES) <= set(choices)
    assert "unavailable" not in (choices["data"].description or "")


def test_a_broken_stage_is_reported_not_fatal(monkeypatch, capsys):
    monkeypatch.setitem(cli.STAGES, "bogus", ("kit.no_such_stage_module", "broken on purpose"))
    assert cli.main(["doctor", "--explain", "EJ0001: Failed to initialize the HCCP process."]) == 0
    assert cli.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: `python -m kit bogus` cannot run here") and err.count("\n") == 1


def test_help_of_one_stage_imports_only_that_stage():
    code = (
        "import sys\n"
        "from kit.__main__ import main\n"
        "try:\n    main(['convert', '--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('pandas', 'kit.data', 'kit.envs', 'kit.profiling', 'kit.train', 'deepspeed',"
        " 'transformers', 'datasets', 'matplotlib') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: python -m kit convert" in out
    assert out.strip().splitlines()[-1] == "HEAVY []"


def _stage_raising(monkeypatch, exc: BaseException):
    def run(_args):
        raise exc

    def register(sub):
        sub.add_parser("boom").set_defaults(func=run)

    module = type(sys)("kit_test_boom")
    module.register = register
    monkeypatch.setitem(sys.modules, "kit_test_boom", module)
    monkeypatch.setitem(cli.STAGES, "boom", ("kit_test_boom", "raises"))


def test_kit_error_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    _stage_raising(monkeypatch, InputError("2 problem(s) in data:\n  - first\n  - second"))
    assert cli.main(["boom"]) == 2
    err = capsys.readouterr().err
    assert err == "error: 2 problem(s) in data: first; second\n"


@pytest.mark.parametrize(
    "code, words",
    [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only"), (errno.ENAMETOOLONG, "too long")],
)
def test_os_errors_users_can_fix_are_one_line(monkeypatch, capsys, code, words):
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    _stage_raising(monkeypatch, OSError(code, "os says no", "/out/x.bin"))
    assert cli.main(["boom"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write '/out/x.bin':") and words in err and err.count("\n") == 1


def test_unexpected_error_names_debug_and_exits_1(monkeypatch, capsys):
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    _stage_raising(monkeypatch, ZeroDivisionError("division by zero"))
    assert cli.main(["boom"]) == 1
    err = capsys.readouterr().err
    assert "unexpected ZeroDivisionError: division by zero" in err and "--debug" in err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("KIT_DEBUG", "0")  # main() sets it to 1; monkeypatch restores the original afterwards
    _stage_raising(monkeypatch, InputError("bad"))
    with pytest.raises(InputError):
        cli.main(["boom", "--debug"])


def test_notebooks_render_kit_errors_as_one_line(monkeypatch):
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    err = KitError("first line\n  - detail")
    assert err._render_traceback_() == ["error: first line: detail"]
    monkeypatch.setenv("KIT_DEBUG", "1")
    assert len(err._render_traceback_()) >= 1 and "KitError" in err._render_traceback_()[-1]
    assert one_line(ValueError("")) == "ValueError"


def test_notebook_shows_kit_and_disk_errors_as_one_line(tmp_path):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    outputs = {}
    for name, code in {
        "kit": "import kit\nfrom kit.errors import InputError\nraise InputError('bad value — do this')",
        "disk": "import errno, kit\nraise OSError(errno.ENOSPC, 'No space left on device', '/ws/out.bin')",
        "other": "import kit\nraise OSError(errno.EIO if False else 5, 'I/O error', '/ws/x')",
    }.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
        client = NotebookClient(
            nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
        )
        with pytest.raises(CellExecutionError):
            client.execute()
        outputs[name] = [o for o in nb.cells[0].outputs if o["output_type"] == "error"][0]["traceback"]
    assert outputs["kit"] == ["error: bad value — do this"]
    assert outputs["disk"] == [
        "error: cannot write '/ws/out.bin': the disk is full; free space or choose an "
        "output folder on a larger volume"
    ]
    assert len(outputs["other"]) > 1 and "OSError" in "".join(
        outputs["other"]
    )  # not ours: the usual traceback


def test_a_missing_optional_package_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """A stage that imports an extra's package only when it needs it (pack's xxhash) says which one is missing."""
    from kit import envs

    env = envs.create_venv(tmp_path / "env", inherit=False)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash -> ModuleNotFoundError(name='xxhash')
    out = tmp_path / "env.tar.zst"
    assert cli.main(["env", "pack", str(env), "-o", str(out)]) == 2
    lines = capsys.readouterr().err.split("\r")[-1].splitlines()  # after the progress bar's redraws
    assert lines[-1].startswith(
        "error: the package 'xxhash' is not installed: install the kit with its extras"
    )
    assert len(lines) == 1 and not out.exists()
