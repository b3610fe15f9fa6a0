"""Notebook 01 runs headless on tiny parameters: clone, pack/unpack, kernel with (fake) CANN, restore."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "01_env_clone_to_sfs.ipynb"
SET_ENV = Path(__file__).parent / "fixtures" / "envs" / "ascend_toolkit" / "ascend-toolkit" / "set_env.sh"


@pytest.mark.slow
def test_notebook_01_clones_packs_and_registers_a_working_kernel(run_notebook, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    monkeypatch.delenv("KIT_ENVS_ROOT", raising=False)
    (tmp_path / "home").mkdir()
    _, summary = run_notebook(
        "01_",
        VERIFY_IMPORTS=["json", "ipykernel"],
        SET_ENV_SCRIPTS=[str(SET_ENV)],
        KERNEL_CODE="import kit_fake_cann",
        NAME="nb-env",
    )
    envs_root = tmp_path / "ws" / "envs"
    clone = envs_root / "venvs" / "nb-env"
    assert summary["envs_root"] == str(envs_root) and summary["clone"] == str(clone)
    assert summary["kind"] == "venv" and summary["method"] == "copy"
    assert summary["verify"]["json"].startswith("ok") and summary["verify"]["ipykernel"].startswith("ok")
    assert Path(summary["archive"]) == envs_root / "packs" / "nb-env.tar.zst" and summary["archive_bytes"] > 0
    assert summary["unpacked_prefix"] == str(envs_root / "venvs" / "nb-env-unpacked")
    assert summary["kernel_installed"] == str(tmp_path / "jupyter-data" / "kernels" / "nb-env")
    assert summary["kernel_prefix"] == str(clone) and summary["kernel_code_error"] is None
    home = str(SET_ENV.parent.resolve() / "latest")
    assert summary["kernel_env"]["ASCEND_HOME_PATH"] == home
    assert summary["kernel_env"]["PATH"].startswith(f"{clone}/bin:{home}/bin:")
    assert {"ASCEND_OPP_PATH", "LD_LIBRARY_PATH", "PYTHONPATH"} <= set(summary["cann_vars"])
    spec = json.loads((envs_root / "kernels" / "nb-env" / "kernel.json").read_text())
    assert spec["argv"][0] == str(clone / "bin" / "python")
    assert summary["restore"]["unchanged"] == ["nb-env"] and summary["restore"]["installed"] == []
    assert Path(summary["plot"]).stat().st_size > 1000
    assert summary["conda"] is None or Path(summary["conda"]).exists()
