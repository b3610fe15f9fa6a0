"""The engine as a managed subprocess (kit.system.procs.Proc): started in its own process group, ready once GET
/health answers, stopped with every child (at `stop()`, at interpreter exit, and by the kernel's death through
PR_SET_PDEATHSIG on Linux).

A busy port is found before the engine starts; an engine that exits before /health answers is reported with its log
tail and one line saying why (the port, a model it cannot load, its package missing).
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

from kit.errors import KitError
from kit.system.procs import Proc

_LIVE: List[Server] = []


class PortBusyError(KitError, OSError):
    """The port the server should listen on is taken."""


class EngineStartError(KitError, RuntimeError):
    """The engine exited, or did not answer /health in time, after it was started."""


def port_is_free(host: str, port: int) -> bool:
    """True when `port` on `host` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_port(host: str, port: int) -> None:
    if not port_is_free(host, port):
        raise PortBusyError(
            f"port {port} on {host} is already in use (another server?); choose another PORT (0: a free one) or stop "
            f"the process holding it (`ss -ltnp | grep :{port}` shows it)."
        )


def _reason(tail: List[str], model: str) -> str:
    text = "\n".join(tail)
    if re.search(r"address already in use|Errno 98", text, re.I):
        return "the port is already in use; choose another PORT (0: a free one)"
    if re.search(r"No module named '?(vllm|fastapi|uvicorn|openai)", text):
        mod = re.search(r"No module named '?([\w.]+)", text).group(1)
        return f"the engine's package {mod!r} is missing; `pip install -e .[serve]` (CPU) or see envs/README.md (NPU)"
    errors = [ln.strip() for ln in tail if re.match(r"^\s*[\w.]*(Error|Exception)\b.*:", ln)]
    if errors:
        return f"the engine could not load {model}: {errors[-1][:300]} (is it an HF model folder the engine supports?)"
    last = [ln.strip() for ln in tail if ln.strip()]
    return last[-1][:300] if last else "no output"


class Server:
    """One engine process serving one model on host:port; use as a context manager or call `stop()`."""

    def __init__(self, argv: List[str], host: str, port: int, model: str, log_path: Path, engine: str = "?"):
        self.argv, self.host, self.port, self.model, self.engine = list(argv), host, port, model, engine
        self.log_path = Path(log_path)
        self.proc: Optional[Proc] = None
        self.info: Dict[str, Any] = {}
        self.served: Any = None  # the kit.serve.model.ServedModel behind it, when kit.serve.serve started it

    @property
    def url(self) -> str:
        """http://host:port (loopback when the server listens on every address)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root (`openai.OpenAI(base_url=...)`)."""
        return self.url + "/v1"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 600.0, env: Optional[Dict[str, str]] = None) -> Server:
        """Start the engine and return once GET /health answers 200; EngineStartError (with the log tail) if not."""
        check_port(self.host, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        self.proc = Proc(self.argv, env=env, output=self.log_path)  # its own group: stop() ends every child
        _LIVE.append(self)
        t0 = time.monotonic()
        try:
            while True:
                if self.proc.poll() is not None:
                    self._fail(f"exited with code {self.proc.returncode} before GET /health answered")
                if self.health():
                    self.info["startup_s"] = round(time.monotonic() - t0, 2)
                    return self
                if time.monotonic() - t0 > timeout:
                    self._fail(f"did not answer GET /health within {timeout:g} s (raise STARTUP_TIMEOUT?)")
                time.sleep(0.25)
        except BaseException:  # Ctrl-C / SIGTERM (kit.storage.partial) while it starts: none of it is left
            self.stop()
            raise

    def _fail(self, what: str) -> None:
        self.stop()
        tail = self.log_tail(15)
        print(f"--- last lines of {self.log_path} ---\n" + "\n".join(tail), file=sys.stderr)
        raise EngineStartError(
            f"the {self.engine} server {what}: {_reason(tail, self.model)}; log: {self.log_path}"
        )

    def health(self) -> bool:
        """True when GET /health answers 200."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, lines: int = 20) -> List[str]:
        if not self.log_path.is_file():
            return []
        data = self.log_path.read_bytes()[-65536:].decode("utf-8", "replace")
        return data.splitlines()[-lines:]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds; safe to call twice."""
        if self.proc is not None:
            self.proc.stop(grace)
        if self in _LIVE:
            _LIVE.remove(self)

    def openai_client(self, **kwargs):
        """An `openai.OpenAI` client for this server (the key is not checked by the engine)."""
        import openai

        return openai.OpenAI(
            base_url=self.base_url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"), **kwargs
        )

    def summary(self) -> Dict[str, Any]:
        return {
            "url": self.url,
            "engine": self.engine,
            "model": self.model,
            "pid": self.proc.pid if self.proc else None,
            "log": str(self.log_path),
            **self.info,
        }

    def __repr__(self) -> str:
        state = "running" if self.alive else "stopped"
        return f"<Server {self.engine} {state} at {self.url} serving {self.model}>"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_all() -> None:
    """Stop every server this process started (registered with atexit; a kernel shutdown runs it)."""
    for server in list(_LIVE):
        server.stop(grace=5.0)


atexit.register(stop_all)
