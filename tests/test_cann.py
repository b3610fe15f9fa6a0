"""The one CANN set_env.sh search (kit.system.cann): both install layouts, and the doctor and kit.envs agree on it."""

from __future__ import annotations

from pathlib import Path

import kit.envs as envs
from kit.doctor import report as doctor
from kit.system import cann

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
OLD_LAYOUT = FIXTURES / "ascend_toolkit"  # <root>/ascend-toolkit/set_env.sh
NEW_LAYOUT = FIXTURES / "ascend_cann"  # <root>/cann/set_env.sh + <root>/nnal/atb/set_env.sh
NO_ENV: dict = {}


def test_both_layouts_found():
    assert cann.find_set_env_scripts([OLD_LAYOUT], NO_ENV) == [OLD_LAYOUT / "ascend-toolkit" / "set_env.sh"]
    assert cann.find_set_env_scripts([NEW_LAYOUT], NO_ENV) == [
        NEW_LAYOUT / "cann" / "set_env.sh",
        NEW_LAYOUT / "nnal" / "atb" / "set_env.sh",
    ]
    assert cann.find_set_env_scripts([FIXTURES / "nothing-here"], NO_ENV) == []


def test_versioned_folder_and_ascend_home_path(tmp_path):
    root = tmp_path / "Ascend"
    for v in ("8.3.0", "8.5.0"):
        (root / f"cann-{v}").mkdir(parents=True)
        (root / f"cann-{v}" / "set_env.sh").write_text("export ASCEND_HOME_PATH=/x\n")
    # the newest versioned folder wins when there is no cann/ or ascend-toolkit/
    assert cann.find_set_env_scripts([root], NO_ENV) == [root / "cann-8.5.0" / "set_env.sh"]
    # ASCEND_HOME_PATH of the running process points at the install even when no default root holds it
    env = {"ASCEND_HOME_PATH": str(NEW_LAYOUT / "cann" / "latest")}
    assert cann.find_set_env_scripts([tmp_path / "elsewhere"], env)[0] == NEW_LAYOUT / "cann" / "set_env.sh"


def test_doctor_and_envs_name_the_same_scripts(tmp_path, monkeypatch):
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    versioned = tmp_path / "Ascend"  # cann-X.Y.Z/ (the doctor used to miss it: "no CANN installation found")
    (versioned / "cann-8.5.0").mkdir(parents=True)
    (versioned / "cann-8.5.0" / "set_env.sh").write_text("export ASCEND_HOME_PATH=/x\n")
    for layout in (OLD_LAYOUT, NEW_LAYOUT, versioned):
        scripts = envs.find_set_env_scripts([layout])
        assert scripts == cann.find_set_env_scripts([layout], NO_ENV)
        report = doctor.diagnose(
            env={"PATH": "/usr/bin"}, roots=[str(layout)], npu_smi="npu-smi-absent", deepspeed=False
        )
        line = report.get("CANN").detail
        assert line.split("set_env.sh: ", 1)[1] == ", ".join(map(str, scripts))


def test_version_read_from_the_found_toolkit(tmp_path):
    root = tmp_path / "Ascend"
    info = root / "cann" / "latest" / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=cann\nversion=8.5.0\n")
    (root / "cann" / "set_env.sh").write_text("export ASCEND_HOME_PATH=/x\n")
    assert cann.cann_version_from_disk(NO_ENV, [root]) == "8.5.0"
    assert cann.cann_version_from_disk(NO_ENV, [tmp_path / "none"]) is None
