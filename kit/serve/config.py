"""The serving stage's configs: what to serve with which engine, how to load-test it, how to package it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

ENGINES = ("auto", "transformers", "vllm")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _port_problem(name: str, value) -> List[str]:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
        return [f"{name}={value!r}: use a TCP port 1..65535 (0: a free one)."]
    return []


@dataclass
class ServeConfig:
    """Which model to serve, with which engine, where."""

    run: Optional[str] = None
    """Training-run folder (notebook 04); None: the named run (notebook 04's, else the last one finished)."""
    model_path: Optional[str] = None
    """HF model folder to serve instead of a run's exported model."""
    adapter: bool = True
    """Serve a LoRA run as base + adapter where the engine serves adapters (vLLM), else its merged folder"""
    engine: str = "auto"
    """transformers (`transformers serve`) | vllm (vLLM / vllm-ascend) | auto (vllm on npu/cuda, else transformers)"""
    engine_python: Optional[str] = None
    """Python of the env holding the engine (the vllm-ascend env, kit.envs); None: this kernel's Python, or for vLLM on
    a CPU the env `make vllm-env` built."""
    device: Optional[str] = None
    """npu | cuda | cpu; None: what kit.system.device finds."""
    host: str = "127.0.0.1"
    """Address the server listens on (0.0.0.0 to reach it from outside)."""
    port: int = 0
    """TCP port (0: a free one)"""
    max_model_len: Optional[int] = None
    """Context length the engine accepts (vLLM --max-model-len); None: the model's max_position_embeddings."""
    startup_timeout: float = 600.0
    """Seconds to wait for GET /health before giving up (vllm-ascend compiles graphs on start)"""
    enforce_eager: bool = False
    """vLLM --enforce-eager: no torch.compile (CPU, 135M model: /health after 45 s, not 110 s; TPOT x1.14)"""
    cpu_kv_cache_gb: int = 4
    """vLLM on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE; unset, vLLM wants 0.92 of the machine's memory free)"""
    extra_args: List[str] = field(default_factory=list)
    """More engine options, passed as they are (e.g. ["--tensor-parallel-size", "2"])."""

    def problems(self) -> List[str]:
        out = []
        if self.engine not in ENGINES:
            out.append(f"engine={self.engine!r}: use one of {', '.join(ENGINES)}.")
        if self.device not in (None, "npu", "cuda", "cpu"):
            out.append(f"device={self.device!r}: use npu, cuda, cpu or None (auto).")
        out += _port_problem("port", self.port)
        if not isinstance(self.startup_timeout, (int, float)) or self.startup_timeout <= 0:
            out.append(f"startup_timeout={self.startup_timeout!r}: use a positive number of seconds.")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            out.append(f"max_model_len={self.max_model_len!r}: use a positive integer or None.")
        if (
            not isinstance(self.cpu_kv_cache_gb, int)
            or isinstance(self.cpu_kv_cache_gb, bool)
            or self.cpu_kv_cache_gb < 1
        ):
            out.append(f"cpu_kv_cache_gb={self.cpu_kv_cache_gb!r}: use a whole number of GiB >= 1.")
        if not isinstance(self.extra_args, list) or not all(isinstance(a, str) for a in self.extra_args):
            out.append(f"extra_args={self.extra_args!r}: use a list of strings.")
        return out


@dataclass
class BenchConfig:
    """A load test: closed-loop concurrency sweep and open-loop Poisson sweep over length grids."""

    url: Optional[str] = None
    """Base URL of a running server (http://host:port); None: start one as the serve settings say."""
    model_name: Optional[str] = None
    """Model name the server expects in requests; None: the served LoRA adapter, else the first of GET /v1/models"""
    concurrency: List[int] = field(default_factory=lambda: [1, 2])
    """Closed loop: requests in flight at once, one point each."""
    request_rates: List[float] = field(default_factory=lambda: [4.0])
    """Open loop: Poisson arrival rates (requests/s), one point each ([] : none)."""
    prompt_lengths: List[int] = field(default_factory=lambda: [32])
    """Prompt lengths (tokens) of the grid."""
    output_lengths: List[int] = field(default_factory=lambda: [16])
    """Output lengths (max_tokens) of the grid."""
    num_prompts: int = 8
    """Measured requests per point."""
    warmup: int = 2
    """Requests sent before each point and left out of its figures."""
    ttft_target_ms: float = 2000.0
    """Goodput: a request counts when its TTFT is at most this ..."""
    tpot_target_ms: float = 500.0
    """... and its TPOT at most this."""
    timeout: float = 300.0
    """Seconds one request may take before it counts as failed."""
    seed: int = 0
    """Seed of the prompts and the Poisson arrivals."""
    out_dir: Optional[str] = None
    """Results folder; None: the workspace's serving/<name>."""
    name: str = "bench"
    """Name of the results folder."""
    overwrite: bool = False
    """Replace an existing results folder of the same name."""

    def problems(self) -> List[str]:
        out = []
        for name in ("concurrency", "prompt_lengths", "output_lengths"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v
            ):
                out.append(f"{name}={v!r}: use a list of positive integers, e.g. [1, 4].")
        if not self.prompt_lengths or not self.output_lengths:
            out.append("prompt_lengths and output_lengths need at least one value each.")
        if not isinstance(self.request_rates, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in self.request_rates
        ):
            out.append(f"request_rates={self.request_rates!r}: use a list of positive numbers (requests/s).")
        if not self.concurrency and not self.request_rates:
            out.append("concurrency and request_rates are both empty: give at least one point.")
        for name in ("num_prompts",):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{name}={v!r}: use a positive integer.")
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            out.append(f"warmup={self.warmup!r}: use an integer >= 0.")
        for name in ("ttft_target_ms", "tpot_target_ms", "timeout"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                out.append(f"{name}={v!r}: use a positive number.")
        if self.url is not None and not re.match(r"^https?://", str(self.url)):
            out.append(f"url={self.url!r}: use http://host:port or https://host:port.")
        if not _NAME.match(self.name or ""):
            out.append(f"name={self.name!r}: use a plain folder name of letters, digits, '.', '_' or '-'.")
        return out


@dataclass
class PackageConfig:
    """A ModelArts custom-engine folder: model/, run.sh, Dockerfile."""

    base_image: str = "quay.io/ascend/vllm-ascend:v0.23.0"
    """Ascend base image holding the engine (the vllm-ascend release matching your CANN; see envs/README.md)."""
    engine: str = "vllm"
    """Engine run.sh starts in the image: vllm (vllm-ascend) | transformers."""
    port: int = 8080
    """Port run.sh serves on inside the container (ModelArts' samples use 8080)."""
    copy_model: bool = True
    """Copy the model into model/ (False: hard-link files where the filesystem allows)"""
    ssl_certfile: Optional[str] = None
    """Certificate path inside the container: run.sh serves HTTPS with it and SSL_KEYFILE; None: plain HTTP."""
    ssl_keyfile: Optional[str] = None
    """Private key path inside the container (mount it at deployment; the package never holds it)."""
    max_size_gb: float = 30.0
    """Image + model limit of the ModelArts pool (public pool: 30 GB)."""
    image_size_gb: float = 0.0
    """Size of the base image in GB, for the limit check (0: unknown, the model alone is checked)."""
    out_dir: Optional[str] = None
    """Package folder; None: the workspace's serving/package."""
    overwrite: bool = False
    """Replace an existing package folder."""

    def problems(self) -> List[str]:
        out = []
        if self.engine not in ("vllm", "transformers"):
            out.append(f"engine={self.engine!r}: use vllm or transformers.")
        out += _port_problem("port", self.port)
        if self.port == 0:
            out.append("port=0: the container needs a fixed port (ModelArts' default is 8080).")
        if not self.base_image or any(c.isspace() for c in self.base_image):
            out.append(
                f"base_image={self.base_image!r}: give an image reference such as swr.<region>.../name:tag."
            )
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            out.append("ssl_certfile and ssl_keyfile go together: give both for HTTPS or neither.")
        if self.ssl_certfile and self.engine != "vllm":
            out.append(
                f"ssl_certfile with engine={self.engine!r}: transformers serve has no HTTPS; use engine='vllm'."
            )
        for name in ("max_size_gb", "image_size_gb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                out.append(f"{name}={v!r}: use a number >= 0.")
        return out
