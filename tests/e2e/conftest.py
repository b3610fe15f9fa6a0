"""Fixtures for the browser tests: one JupyterLab over a temporary copy of notebooks/, one headless Chromium."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # e2e_*.py helpers sit beside this file

from e2e_cases import tiny_parameters  # noqa: E402
from e2e_lab import JupyterLab, browser_available, chromium_path, tiny_copy  # noqa: E402
from e2e_ui import CHROMIUM_ARGS, VIEWPORT  # noqa: E402

from kit.core.notebooks import numbered_notebooks  # noqa: E402
from kit.core.workspace import repo_root  # noqa: E402

SCREENSHOTS = Path(os.environ.get("KIT_E2E_SCREENSHOTS") or repo_root() / "runs" / "e2e")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "e2e: drives JupyterLab in headless Chromium (needs tests/e2e/setup_e2e.sh; make e2e runs it)",
    )


@pytest.fixture(scope="session")
def e2e_available() -> None:
    """Skip (or, under KIT_E2E_REQUIRED=1 as `make e2e` sets, fail) when chromium or playwright is missing."""
    reason = browser_available()
    if reason and os.environ.get("KIT_E2E_REQUIRED") == "1":
        pytest.fail(f"KIT_E2E_REQUIRED=1 but {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def e2e_root(e2e_available, tmp_path_factory) -> Path:
    """The temporary root JupyterLab serves: tiny-parameter copies of every numbered notebook + a workspace."""
    root = tmp_path_factory.mktemp("e2e-lab")
    for nb in numbered_notebooks():
        tiny_copy(nb, root / nb.name, tiny_parameters(nb.name[:2], root))
    zh = numbered_notebooks(lang="zh")[0]  # the Chinese walkthrough's first notebook (ZH_NOTEBOOK)
    tiny_copy(zh, root / "zh" / zh.name, tiny_parameters(zh.name[:2], root))
    return root


@pytest.fixture(scope="session")
def lab(e2e_root, tmp_path_factory):
    """One JupyterLab server for all browser tests, on 127.0.0.1 with a random token; always shut down."""
    home = tmp_path_factory.mktemp("e2e-jupyter")
    # kernels get the workspace and a private .condarc (notebook 01 registers envs there when conda exists)
    server = JupyterLab(
        e2e_root, home, env={"KIT_WORKSPACE": str(e2e_root / "ws"), "CONDARC": str(home / "condarc")}
    )
    try:
        yield server.start()
    finally:
        server.stop()


# Module scope, not session: sync Playwright runs its asyncio loop in a greenlet of the main thread, so while it
# is started that loop counts as running there and any `asyncio.run()` in the process raises "cannot be called
# from a running event loop". Stopping it after each e2e module closes the loop before any other test
# (package scope would not do: tests/e2e has no __init__.py, and there it acts as session scope).
@pytest.fixture(scope="module")
def sync_playwright_started():
    """Sync Playwright, started per e2e test module and stopped (its event loop closed) after it."""
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        yield pw
    finally:
        pw.stop()


@pytest.fixture(scope="module")
def browser(sync_playwright_started, lab):
    """Headless Debian Chromium driven by Playwright (its own browser download is not used)."""
    chromium = sync_playwright_started.chromium.launch(
        executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
    )
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture
def page(browser, lab):
    """A fresh browser context and tab per test; afterwards its kernels are shut down."""
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(60_000)
    try:
        yield context.new_page()
    finally:
        context.close()
        lab.shutdown_kernels()


@pytest.fixture(scope="session")
def screenshots() -> Path:
    """runs/e2e/ (or KIT_E2E_SCREENSHOTS): one full-page PNG (+ the notebook as run) per test, from this run only."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in [*SCREENSHOTS.glob("*.png"), *SCREENSHOTS.glob("*.ipynb")]:
        old.unlink()
    return SCREENSHOTS
