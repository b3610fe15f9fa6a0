"""Shared fixtures: tiny seeded checkpoints, workspaces, and a papermill runner for notebook tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the project settings (kit.core.project) the tests' workspaces read: none, unless a test writes its own (a
# developer's runs/ws/kit_project.json must not change what the tests resolve)
os.environ.setdefault(
    "KIT_PROJECT", os.path.join(tempfile.mkdtemp(prefix="kit-project-"), "kit_project.json")
)
# the tests assert the kit's English lines; a test of the Chinese ones (tests/test_i18n.py, the zh notebooks) sets
# KIT_LANG=zh itself (a developer's own KIT_LANG must not change what the tests read)
os.environ["KIT_LANG"] = "en"

# A test run started in the background of a non-interactive shell (`make test &`, nohup) inherits SIGINT ignored,
# and so would every process the tests start (an ignored signal survives exec; Python then installs no Ctrl-C
# handler): the tests that send SIGINT would wait for an exit that never comes. A handler does not survive exec, so
# with the default one here the processes the tests start get SIGINT's default back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny seeded Llama with GQA (4 heads, 2 KV heads), untied embeddings, sharded safetensors."""
    from kit.core.samples import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama-gqa", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory) -> Path:
    """A tiny seeded Llama with plain multi-head attention and tied embeddings."""
    from kit.core.samples import tiny_llama

    return tiny_llama(
        tmp_path_factory.mktemp("ckpt") / "tiny-llama-mha-tied",
        num_kv_heads=4,
        tie_word_embeddings=True,
        seed=1,
    )


@pytest.fixture
def workspace(tmp_path):
    """A fresh `${workdir}` layout under the test's temporary folder."""
    from kit.core.workspace import get_workspace

    return get_workspace(tmp_path / "ws", model="tiny")


@pytest.fixture
def run_notebook(tmp_path):
    """Run notebooks/<prefix>*.ipynb with papermill on the given parameters over the demo's (make demo's values,
    data_samples/demo_settings.json); return (executed path, summary).

    WORKSPACE defaults to a temporary folder; the summary is the notebook's reports/<stem>.summary.json. A notebook
    that succeeds writes nothing to stderr (third-party chatter goes to logs: kit.system.noise).
    """
    from kit.core.notebooks import demo_parameters, execute, numbered_notebooks

    def run(prefix: str, **params):
        matches = [p for p in numbered_notebooks() if p.name.startswith(prefix)]
        assert len(matches) == 1, f"no single notebook starts with {prefix!r}: {matches}"
        nb = matches[0]
        params = {**demo_parameters(nb), "WORKSPACE": str(tmp_path / "ws"), **params}
        out = execute(nb, tmp_path / "executed" / nb.name, params)
        cells = json.loads(Path(out).read_text(encoding="utf-8"))["cells"]
        stderr = [o["text"] for c in cells for o in c.get("outputs", []) if o.get("name") == "stderr"]
        assert not stderr, f"{nb.name} wrote to stderr on success (a red box in Jupyter): {stderr}"
        summary_path = Path(params["WORKSPACE"]) / "reports" / f"{nb.stem}.summary.json"
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.exists() else None
        return out, summary

    return run


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs): config files and logs fit, a checkpoint or a model does not. Skipped with
    the reason where mounting is not allowed; the `remount_read_only` fixture makes it read-only."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def remount_read_only():
    """A function that makes a small_disk read-only (root ignores file permissions; a read-only mount it cannot).
    A fixture, not an import: `from conftest import` would find tests/e2e/conftest.py in a whole-suite run."""

    def remount(mnt: Path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

    return remount
