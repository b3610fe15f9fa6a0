"""A kernel registered with kit.envs shows in the JupyterLab launcher, and a notebook started from it runs there."""

from __future__ import annotations

import re

import pytest
from e2e_ui import full_screenshot, read_cells

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DISPLAY_NAME = "Python (kit-e2e venv)"


@pytest.fixture
def kit_kernel(lab, tmp_path, monkeypatch):
    """A temporary virtualenv registered as a kernel into the lab's own JUPYTER_DATA_DIR, CANN vars included."""
    envs = pytest.importorskip("kit.envs", reason="kit.envs (issue 8) is not in this checkout")
    monkeypatch.setenv("JUPYTER_DATA_DIR", lab.env["JUPYTER_DATA_DIR"])
    prefix = envs.create_venv(tmp_path / "envs" / "e2e-venv")  # sees this interpreter's ipykernel
    # a stand-in for CANN's set_env.sh: its exports must reach the kernel through kernel.json
    set_env = tmp_path / "set_env.sh"
    set_env.write_text('export ASCEND_HOME_PATH="/opt/fake-cann/latest"\n', encoding="utf-8")
    info = envs.register_kernel(
        prefix, "kit-e2e", display_name=DISPLAY_NAME, set_env_scripts=[set_env], envs_root=tmp_path / "envs"
    )
    assert info["cann_vars"] == ["ASCEND_HOME_PATH"]
    yield prefix
    envs.unregister_kernel("kit-e2e", envs_root=tmp_path / "envs")


def test_registered_kernel_in_launcher_runs_a_notebook(kit_kernel, lab, page, screenshots):
    page.goto(lab.url())
    card = page.locator(f'.jp-LauncherCard[data-category="Notebook"][title="{DISPLAY_NAME}"]')
    card.wait_for(timeout=60_000)
    page.screenshot(path=str(screenshots / "kernel_launcher.png"))
    card.click()
    # a new Untitled notebook on that kernel: the status bar names it once it is connected and idle
    status = page.locator("#jp-main-statusbar").get_by_text(
        re.compile(rf"^{re.escape(DISPLAY_NAME)} \| Idle$")
    )
    status.wait_for(timeout=90_000)
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell .cm-content").first.click()
    page.keyboard.type(
        "import os, sys; print('PREFIX', sys.prefix); print('CANN', os.environ['ASCEND_HOME_PATH'])"
    )
    page.keyboard.press("Shift+Enter")
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output").first.wait_for(timeout=60_000)
    cells = read_cells(page)
    full_screenshot(page, screenshots / "kernel_notebook.png")
    text = cells[0].text
    assert f"PREFIX {kit_kernel}" in text, text
    assert "CANN /opt/fake-cann/latest" in text, text
