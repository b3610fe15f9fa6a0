"""The `${workdir}` layout, atomic outputs and config validation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

from kit.core.configs import ConfigError, check, save_config
from kit.core.workspace import Workspace, default_root, get_workspace
from kit.storage.atomic import OutputExistsError, atomic_dir, atomic_write_text


def test_layout_matches_the_modelarts_manual(tmp_path):
    ws = get_workspace(tmp_path, model="GLM3-6B")
    rel = {str(p.relative_to(tmp_path)) for p in ws.folders()}
    for expected in [
        "llm_train",
        "processed_for_ma_input/GLM3-6B/data/pretrain",
        "processed_for_ma_input/GLM3-6B/data/finetune",
        "processed_for_ma_input/GLM3-6B/converted_weights",
        "saved_dir_for_ma_output/GLM3-6B/logs",
        "saved_dir_for_ma_output/GLM3-6B/lora",
        "saved_dir_for_ma_output/GLM3-6B/sft",
        "saved_dir_for_ma_output/GLM3-6B/pretrain",
        "tokenizers/GLM3-6B",
        "training_data/pretrain",
        "training_data/finetune",
    ]:
        assert expected in rel
        assert (tmp_path / expected).is_dir()
    assert ws.missing() == []
    assert ws.output("retrain") == ws.output("pretrain")
    with pytest.raises(ValueError, match="RUN_TYPE"):
        ws.output("finetune")
    tree = ws.tree().splitlines()
    assert "            converted_weights/" in tree and "        GLM3-6B/" in tree


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "a b", "x;rm"])
def test_bad_model_names_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="plain folder name"):
        Workspace(tmp_path, bad)


def test_default_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("KIT_WORKSPACE", str(tmp_path / "w"))
    assert default_root() == tmp_path / "w"
    monkeypatch.delenv("KIT_WORKSPACE")
    assert default_root().name == "ws" and default_root().parent.name == "runs"


def test_summary_is_written(tmp_path):
    ws = get_workspace(tmp_path)
    path = ws.write_summary("99_x", {"n": 3, "path": tmp_path})
    assert json.loads(path.read_text()) == {"n": 3, "path": str(tmp_path)}


def test_atomic_dir_commits_only_on_success(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_dir(target) as tmp:
        (tmp / "done.bin").write_bytes(b"ok")
    assert (target / "done.bin").read_bytes() == b"ok"
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        with atomic_dir(target):
            pass
    with atomic_dir(target, overwrite=True) as tmp:
        (tmp / "new.bin").write_bytes(b"new")
    assert sorted(p.name for p in target.iterdir()) == ["new.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("fails_at", [1, 2])
def test_atomic_dir_interrupted_at_its_renames_leaves_no_temporary_folder(tmp_path, monkeypatch, fails_at):
    """A Ctrl-C landing after the body, at the first or second rename: the temporary folder is removed and the
    previous output (when there is one) is where it was, whole."""
    import kit.storage.atomic

    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "v1.bin").write_bytes(b"one")
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(1)
        if len(calls) == fails_at:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(kit.storage.atomic.os, "replace", replace)
    cases = [(True, target)] + (
        [(False, tmp_path / "fresh")] if fails_at == 1 else []
    )  # a new one: one rename
    for overwrite, where in cases:
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            with atomic_dir(where, overwrite=overwrite) as tmp:
                (tmp / "v2.bin").write_bytes(b"two")
    monkeypatch.setattr(kit.storage.atomic.os, "replace", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["v1.bin"]


def test_atomic_file_keeps_old_content_on_error(tmp_path):
    p = atomic_write_text(tmp_path / "a.txt", "old")
    from kit.storage.atomic import atomic_file

    with pytest.raises(ValueError):
        with atomic_file(p, "w") as fh:
            fh.write("partial")
            raise ValueError
    assert p.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


@dataclass
class _Cfg:
    mbs: int = 1
    gbs: int = 3

    def problems(self):
        out = []
        if self.mbs < 1:
            out.append(f"MBS={self.mbs} must be >= 1")
        if self.gbs % max(self.mbs, 1):
            out.append(f"GBS={self.gbs} is not divisible by MBS={self.mbs}")
        return out


def test_config_errors_list_every_problem(tmp_path):
    with pytest.raises(ConfigError) as exc:
        check(_Cfg(mbs=0, gbs=3))
    assert len(exc.value.problems) == 1
    with pytest.raises(ConfigError) as exc:
        check(_Cfg(mbs=2, gbs=3))
    assert "GBS=3" in str(exc.value)
    assert check(_Cfg(mbs=1, gbs=3)).gbs == 3
    assert json.loads(save_config(_Cfg(), tmp_path).read_text()) == {"mbs": 1, "gbs": 3}


def test_atomic_outputs_get_normal_permissions(tmp_path):
    import os
    import stat

    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "f").write_text("x")
    p = atomic_write_text(tmp_path / "t.txt", "y")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask


def test_current_umask_reads_and_keeps_the_mask():
    import os

    from kit.storage.atomic import current_umask

    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027 and current_umask() == 0o027  # reading it does not change it
    finally:
        os.umask(old)


def test_write_all_writes_every_byte_and_names_the_file(tmp_path, monkeypatch):
    import errno
    import os

    import kit.storage.atomic
    from kit.storage.atomic import write_all

    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    real = os.write
    monkeypatch.setattr(kit.storage.atomic.os, "write", lambda f, b: real(f, bytes(b[:3])))  # short writes
    write_all(fd, b"0123456789", path)
    monkeypatch.setattr(
        kit.storage.atomic.os, "write", lambda f, b: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
    )
    with pytest.raises(OSError) as info:
        write_all(fd, b"x", path)
    os.close(fd)
    assert path.read_bytes() == b"0123456789"
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(path))
