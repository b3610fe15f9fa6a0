"""A real JupyterLab server for the browser tests: started on 127.0.0.1 with a token, stopped whatever happens."""

from __future__ import annotations

import ast
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from kit.core.notebooks import parameters_of

# User settings a fresh JupyterLab gets here: every cell stays in the DOM (so checks and screenshots see the
# whole notebook) and no news / update pop-ups (this machine has no network and the toasts cover cells).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
}
PAGE_CONFIG = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_copy(nb_path: Path, dest: Path, overrides: dict) -> Path:
    """Copy a notebook to `dest`, its `parameters` cell rewritten to `overrides` (what a user would type there)."""
    known = parameters_of(nb_path)  # also checks there is exactly one literal-only parameters cell
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"{nb_path.name} has no parameter(s) {unknown}; its parameters are {sorted(known)}.")
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    cell = next(
        c
        for c in nb["cells"]
        if c["cell_type"] == "code" and "parameters" in c.get("metadata", {}).get("tags", [])
    )
    src = "".join(cell["source"])
    lines = src.splitlines()
    # replace whole statements (a literal may span lines), bottom-up so earlier line numbers stay valid
    for node in sorted(ast.parse(src).body, key=lambda n: -n.lineno):
        name = node.targets[0].id
        if name in overrides:
            comment = lines[node.end_lineno - 1].partition("#")[2].strip()
            new = f"{name} = {overrides[name]!r}" + (f"  # {comment}" if comment else "")
            lines[node.lineno - 1 : node.end_lineno] = [new]
    cell["source"] = "\n".join(lines) + "\n"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return dest


class JupyterLab:
    """One `jupyter lab` process serving `root`; `url(path)` opens a file, `stop()` ends it and its kernels."""

    def __init__(self, root: Path, home: Path, env: Optional[dict] = None, python: str = sys.executable):
        self.root, self.home = Path(root), Path(home)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self.home / "jupyterlab.log"
        self.env = dict(os.environ, **(env or {}))
        # a private Jupyter config/data/runtime: no user settings or kernels from this machine leak in
        for sub in ("config", "data", "runtime", "settings", "workspaces"):
            (self.home / sub).mkdir(parents=True, exist_ok=True)
        self.env["JUPYTER_CONFIG_DIR"] = str(self.home / "config")
        self.env["JUPYTER_DATA_DIR"] = str(self.home / "data")
        self.env["JUPYTER_RUNTIME_DIR"] = str(self.home / "runtime")
        self.env["JUPYTER_PLATFORM_DIRS"] = "1"
        self.env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        for name, values in LAB_SETTINGS.items():
            plugin, _, file = name.rpartition("/")
            (self.home / "settings" / plugin).mkdir(parents=True, exist_ok=True)
            (self.home / "settings" / plugin / file).write_text(json.dumps(values))
        labconfig = Path(self.env["JUPYTER_CONFIG_DIR"]) / "labconfig"
        labconfig.mkdir(parents=True, exist_ok=True)
        (labconfig / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
        self.cmd = [
            python,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            f"--LabApp.user_settings_dir={self.home / 'settings'}",
            f"--LabApp.workspaces_dir={self.home / 'workspaces'}",
            "--ServerApp.open_browser=False",
            "--LabApp.news_url=",
            "--ServerApp.terminals_enabled=False",
        ] + (
            ["--allow-root"] if hasattr(os, "getuid") and os.getuid() == 0 else []
        )  # CI containers run as root
        self.proc: Optional[subprocess.Popen] = None
        self._workspaces = 0

    def start(self, timeout: float = 90.0) -> JupyterLab:
        """Start the server and wait until its API answers with our token."""
        log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the server's lifetime
        # own session: stop() can end the server and every kernel it started, and nothing else
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=self.root,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(
            f"jupyter lab did not answer on {self.base} within {timeout:.0f} s; log:\n{self.log_tail()}"
        )

    def api(self, method: str, path: str, body: Optional[dict] = None, timeout: float = 10.0):
        """Call the Jupyter REST API with our token; returns the decoded JSON (or None)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def url(self, path: str = "") -> str:
        """Browser address of a file under root (or the launcher), with the token, in a fresh lab workspace.

        A fresh workspace each time: the default one would reopen every earlier notebook (and its kernel).
        """
        self._workspaces += 1
        ws = f"{self.base}/lab/workspaces/e2e-{self._workspaces}"
        return f"{ws}/tree/{path}?reset&token={self.token}" if path else f"{ws}?reset&token={self.token}"

    def shutdown_kernels(self) -> None:
        """End every session and kernel (between tests: each notebook's kernel holds torch in memory)."""
        for s in self.api("GET", "/api/sessions") or []:
            self.api("DELETE", f"/api/sessions/{s['id']}")
        for k in self.api("GET", "/api/kernels") or []:
            self.api("DELETE", f"/api/kernels/{k['id']}")

    def log_tail(self, n: int = 4000) -> str:
        """The last characters of the server log (for failure messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Shut kernels and server down politely, then end the process group we started."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.shutdown_kernels()
            self.api("POST", "/api/shutdown")
            self.proc.wait(timeout=15)
        except Exception:  # noqa: BLE001 - whatever went wrong, fall through to the signals
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue


def browser_available() -> Optional[str]:
    """None when chromium and the playwright package are installed, else why the e2e tests are skipped."""
    missing = []
    if not chromium_path():
        missing.append("Debian's chromium (/usr/bin/chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the Python package playwright")
    if missing:
        return f"{' and '.join(missing)} not installed; run tests/e2e/setup_e2e.sh (make e2e does)"
    return None


def chromium_path() -> Optional[str]:
    """Chromium from the system packages (Playwright's own browser download is not possible here)."""
    return os.environ.get("KIT_E2E_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
