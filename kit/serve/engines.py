"""The engine command lines: `transformers serve` (CPU), vLLM (CUDA) and vllm-ascend (NPU), all OpenAI-compatible.

Each engine is a real server program started as a subprocess (kit.serve.server); the kit only builds its command
line and checks, before starting it, that the engine's package is importable in the Python that will run it.
vllm-ascend pins its own CANN / torch / torch_npu / Python (envs/README.md), so it lives in an env of its own
(`ENGINE_PYTHON`, made with kit.envs) rather than in the training env.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from kit.errors import KitError

# transformers serve: the OpenAI-compatible server with GET /health (checked on 5.24.0)
TRANSFORMERS_SERVE_MIN = "5.0"


class EngineMissingError(KitError, RuntimeError):
    """The engine's package is not installed in the Python meant to run it."""


@dataclass
class EngineCommand:
    """A command line that starts an OpenAI-compatible server, and what the server calls the model."""

    engine: str
    argv: List[str]
    model_name: str
    serves_adapter: bool = False
    prompt_logprobs: bool = False
    """Whether /v1/completions returns prompt log-probabilities (echo + logprobs): lm-eval `local-completions`."""


def choose_engine(engine: str, device_kind: str) -> str:
    """auto: vLLM where there is an accelerator (vllm-ascend on NPU), `transformers serve` on CPU."""
    if engine != "auto":
        return engine
    return "vllm" if device_kind in ("npu", "cuda") else "transformers"


def _has_module(python: Optional[str], module: str) -> bool:
    if python is None or Path(python).resolve() == Path(sys.executable).resolve():
        return importlib.util.find_spec(module) is not None
    probe = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except OSError:
        return False


def require_engine(engine: str, python: Optional[str], device_kind: str) -> str:
    """The Python that runs `engine`; EngineMissingError (one line naming the fix) when its package is missing."""
    py = str(Path(python).expanduser()) if python else sys.executable
    if python and not Path(py).is_file():
        raise EngineMissingError(
            f"ENGINE_PYTHON={python!r} does not exist; give the python of the env holding the engine "
            f"(e.g. <env>/bin/python made with `python -m kit env`)."
        )
    if engine == "transformers":
        if not (
            _has_module(python, "fastapi")
            and _has_module(python, "uvicorn")
            and _has_module(python, "openai")
        ):
            raise EngineMissingError(
                f"`transformers serve` needs transformers' serving extra in {py}: "
                f"`pip install -e .[serve]` (or `pip install 'transformers[serving]>={TRANSFORMERS_SERVE_MIN}'`)."
            )
        if python is None:
            import transformers
            from packaging.version import Version

            if Version(transformers.__version__) < Version(TRANSFORMERS_SERVE_MIN):
                raise EngineMissingError(
                    f"transformers {transformers.__version__} has no OpenAI-compatible `serve` with /health: "
                    f"install transformers>={TRANSFORMERS_SERVE_MIN} with its serving extra (`pip install -e .[serve]`)."
                )
        return py
    if engine == "vllm":
        if not _has_module(python, "vllm"):
            where = (
                "the vllm-ascend env (envs/README.md has the version table)" if device_kind == "npu" else py
            )
            fix = (
                "make an env with vllm-ascend (`python -m kit env ...`, envs/README.md) and set ENGINE_PYTHON to its "
                "python"
                if device_kind == "npu"
                else "`pip install vllm` (CUDA) in that Python or set ENGINE_PYTHON to one that has it"
            )
            raise EngineMissingError(
                f"the vllm engine is not installed in {where}: {fix}; or use ENGINE='transformers'."
            )
        return py
    raise EngineMissingError(f"unknown engine {engine!r}: use transformers or vllm.")


def build_command(
    engine: str,
    python: str,
    model: Path,
    host: str,
    port: int,
    device_kind: str,
    adapter: Optional[Path] = None,
    base: Optional[Path] = None,
    max_model_len: Optional[int] = None,
    extra_args: Optional[List[str]] = None,
) -> EngineCommand:
    """The argv of `engine` serving `model` (or `base` + LoRA `adapter` where it serves adapters) on host:port."""
    extra = list(extra_args or [])
    if engine == "transformers":
        # the server is pinned to the folder (FORCE_MODEL): requests name it by its path, it is loaded at start
        argv = [python, "-m", "transformers.cli.transformers", "serve", str(model)]
        argv += ["--host", host, "--port", str(port), "--device", device_kind]
        argv += ["--log-level", "info"] + extra
        return EngineCommand(engine, argv, model_name=str(model))
    # vLLM / vllm-ascend: the OpenAI server ModelArts' LLM recipes start (vllm.entrypoints.openai.api_server)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port)]
    name = "model"
    if adapter is not None and base is not None:
        argv += ["--model", str(base), "--served-model-name", "base", "--enable-lora"]
        argv += ["--lora-modules", f"{name}={adapter}"]
    else:
        argv += ["--model", str(model), "--served-model-name", name]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    argv += extra
    return EngineCommand(
        engine,
        argv,
        model_name=name,
        serves_adapter=adapter is not None and base is not None,
        prompt_logprobs=True,
    )
