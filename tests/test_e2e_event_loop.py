"""The e2e browser fixtures must not leave Playwright's event loop running for the tests that come after them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

E2E_CONFTEST = Path(__file__).parent / "e2e" / "conftest.py"

# a folder that uses the real fixture, then a test outside it that needs asyncio.run (collected after it)
PACKAGE_CONFTEST = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("kit_e2e_conftest", {str(E2E_CONFTEST)!r})
real = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real)
sync_playwright_started = real.sync_playwright_started
"""
INSIDE = """
import asyncio

def test_uses_playwright(sync_playwright_started):
    assert asyncio.get_event_loop_policy() is not None
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise AssertionError("expected Playwright's loop to run while started (else this test proves nothing)")
"""
AFTER = """
import asyncio

async def _answer():
    return 42

def test_asyncio_run_after_the_e2e_package():
    assert asyncio.run(_answer()) == 42
"""


def test_asyncio_run_works_after_the_browser_fixtures(tmp_path):
    pytest.importorskip("playwright.sync_api")
    pkg = tmp_path / "e2e_like"
    pkg.mkdir()
    # no __init__.py, like tests/e2e
    (pkg / "conftest.py").write_text(PACKAGE_CONFTEST)
    (pkg / "test_inside.py").write_text(INSIDE)
    (tmp_path / "test_zz_after.py").write_text(AFTER)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
