"""`package(cfg, ws) -> PackageResult`: a ModelArts custom-engine folder, and `check_package` that runs it here.

The folder follows the manual's custom-engine rules (sections "背景说明" of the TF Serving / Triton migration to a
custom engine and "使用镜像创建AI应用"; the spec "自定义引擎创建模型规范"): the model as `model/` (copied to
/home/mind/model), `run.sh` starting the engine on 0.0.0.0:8080 (HTTPS when a certificate is given), a Dockerfile
on the chosen Ascend base image running as `ma-user` (uid 1000, group gid 100) with `CMD sh /home/mind/run.sh`, and
GET /health on the service port for the platform's health check. Image + model must fit the pool's limit (30 GB
on the public pool). `check_package` runs the very run.sh on this machine against the CPU engine on a loopback port
and probes /health and one completion, as the manual's local `docker run --user 1000:100 ... curl` step does.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from kit.core.configs import check, save_config
from kit.errors import InputError, KitError
from kit.serve.config import PackageConfig, ServeConfig

GB = 1024**3
MODEL_DIR = "/home/mind/model"

RUN_SH = """#!/bin/sh
# Starts the OpenAI-compatible engine for ModelArts (custom engine: CMD sh /home/mind/run.sh).
# ENGINE: vllm (vllm-ascend in the image) | transformers; MODEL_DIR, HOST, PORT can be overridden for a local check.
# HTTPS: set SSL_CERTFILE and SSL_KEYFILE (paths inside the container) and the engine serves TLS on the same port.
set -e
ENGINE="${{ENGINE:-{engine}}}"
MODEL_DIR="${{MODEL_DIR:-{model_dir}}}"
HOST="${{HOST:-0.0.0.0}}"
PORT="${{PORT:-{port}}}"
PYTHON="${{PYTHON:-python3}}"
if [ "$ENGINE" = "vllm" ]; then
  set -- --model "$MODEL_DIR" --served-model-name model --host "$HOST" --port "$PORT"
  if [ -n "$SSL_CERTFILE" ]; then set -- "$@" --ssl-certfile "$SSL_CERTFILE" --ssl-keyfile "$SSL_KEYFILE"; fi
  exec "$PYTHON" -m vllm.entrypoints.openai.api_server "$@" $ENGINE_ARGS
fi
if [ -n "$SSL_CERTFILE" ]; then
  echo "run.sh: transformers serve has no HTTPS option; use ENGINE=vllm (vllm-ascend) for HTTPS" >&2
  exit 2
fi
exec "$PYTHON" -m transformers.cli.transformers serve "$MODEL_DIR" --host "$HOST" --port "$PORT" $ENGINE_ARGS
"""

DOCKERFILE = """# ModelArts custom engine: {engine} serving model/ at /home/mind/model on port {port} (GET /health).
# Build: docker build -t <swr-registry>/<org>/<name>:<tag> .   Local check as ModelArts runs it:
#   docker run --user 1000:100 -p {port}:{port} <image>   then   curl http://127.0.0.1:{port}/health
FROM {base_image}
USER root
# ModelArts runs the container as ma-user (uid 1000) in group ma-group (gid 100)
RUN (getent group 100 >/dev/null || groupadd -g 100 ma-group) && \\
    (id -u ma-user >/dev/null 2>&1 || useradd -m -d /home/ma-user -s /bin/bash -u 1000 -g 100 ma-user) && \\
    mkdir -p /home/mind && chown 1000:100 /home/mind
COPY --chown=1000:100 model /home/mind/model
COPY --chown=1000:100 run.sh /home/mind/run.sh
USER ma-user
ENV ENGINE={engine} PORT={port}{tls}
EXPOSE {port}
CMD sh /home/mind/run.sh
"""


class PackageSizeError(KitError, ValueError):
    """Image + model exceed the ModelArts limit."""


@dataclass
class PackageResult:
    config: PackageConfig
    folder: Path
    model_bytes: int
    notes: List[str] = field(default_factory=list)

    def summary(self) -> Dict[str, Any]:
        return {
            "package": str(self.folder),
            "model_gb": round(self.model_bytes / GB, 4),
            "files": sorted(p.name for p in self.folder.iterdir()),
            "notes": self.notes,
        }


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def check_size(model_bytes: int, cfg: PackageConfig) -> None:
    total = model_bytes / GB + cfg.image_size_gb
    if total > cfg.max_size_gb:
        raise PackageSizeError(
            f"model {model_bytes / GB:.2f} GB + image {cfg.image_size_gb:.2f} GB = {total:.2f} GB is over the "
            f"{cfg.max_size_gb:g} GB limit for image + model (ModelArts public pool: 30 GB); use a dedicated pool "
            f"(raise MAX_SIZE_GB), a smaller base image, or a smaller / quantized model."
        )


def dockerfile(cfg: PackageConfig) -> str:
    """The Dockerfile text for `cfg` (HTTPS: the certificate and key paths inside the container, as ENV)."""
    tls = f" SSL_CERTFILE={cfg.ssl_certfile} SSL_KEYFILE={cfg.ssl_keyfile}" if cfg.ssl_certfile else ""
    return DOCKERFILE.format(engine=cfg.engine, port=cfg.port, base_image=cfg.base_image, tls=tls)


def package(cfg: PackageConfig, ws, serve_cfg: Optional[ServeConfig] = None) -> PackageResult:
    """Write the package folder for the model `serve_cfg` names (default: the run notebook 04 named)."""
    from kit.core.manifest import SERVING_PACKAGE, write_manifest
    from kit.serve.model import resolve_model
    from kit.serve.start import serving_dir
    from kit.storage.atomic import atomic_dir

    check(cfg)
    served = resolve_model(serve_cfg or ServeConfig(), ws)
    model_bytes = folder_bytes(served.path)
    check_size(model_bytes, cfg)
    folder = Path(cfg.out_dir).expanduser() if cfg.out_dir else serving_dir(ws) / "package"
    with atomic_dir(folder, overwrite=cfg.overwrite, what="package folder") as tmp:
        target = tmp / "model"
        link = None if cfg.copy_model else os.link
        shutil.copytree(served.path, target, copy_function=link or shutil.copy2)
        (tmp / "run.sh").write_text(RUN_SH.format(engine=cfg.engine, port=cfg.port, model_dir=MODEL_DIR))
        os.chmod(tmp / "run.sh", 0o755)
        (tmp / "Dockerfile").write_text(dockerfile(cfg))
        save_config(cfg, tmp)
        write_manifest(
            tmp,
            SERVING_PACKAGE,
            {
                "engine": cfg.engine,
                "base_image": cfg.base_image,
                "port": cfg.port,
                "model": str(served.path),
                "model_bytes": model_bytes,
            },
            inputs=served.consumed,
        )
    return PackageResult(cfg, folder.resolve(), model_bytes, notes=list(served.notes))


def check_package(
    folder, port: int = 0, timeout: float = 300.0, python: Optional[str] = None, engine: str = "transformers"
) -> Dict[str, Any]:
    """Run the package's run.sh here with a CPU engine on 127.0.0.1 and probe /health and one completion.

    engine: transformers (`transformers serve`) or vllm (vLLM's CPU build, from `python` or the env
    envs/serve/build.sh made; eager, a 1 GiB KV cache, the model's dtype: a check, not a deployment).
    """
    from kit.serve.engines import check_cpu_head_size, model_dtype, require_engine
    from kit.serve.server import Server
    from kit.system.procs import free_port

    folder = Path(folder).expanduser()
    for name in ("run.sh", "Dockerfile", "model/config.json"):
        if not (folder / name).is_file():
            raise InputError(
                f"{folder}: {name} is missing; make the package with `python -m kit serve package`."
            )
    if engine not in ("transformers", "vllm"):
        raise InputError(f"engine={engine!r}: a package is checked with transformers or vllm.")
    py = require_engine(engine, python, "cpu").python
    model_dir = (folder / "model").resolve()
    port = port or free_port()
    env = dict(os.environ, ENGINE=engine, MODEL_DIR=str(model_dir), HOST="127.0.0.1")
    env.update(PORT=str(port), PYTHON=py, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("SSL_CERTFILE", None)
    model = str(model_dir)
    if engine == "vllm":
        check_cpu_head_size(model_dir)
        dtype = model_dtype(model_dir)
        env["ENGINE_ARGS"] = "--enforce-eager" + (f" --dtype {dtype}" if dtype else "")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        model = "model"  # run.sh's --served-model-name
    log = folder.parent / f".{folder.name}-check.log"
    server = Server(["sh", str(folder / "run.sh")], "127.0.0.1", port, model, log, "run.sh")
    t0 = time.monotonic()
    with server.start(timeout=timeout, env=env):
        health = _get(server.url + "/health")
        body = json.dumps(
            {"model": server.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            completion = json.loads(r.read())
    return {
        "url": server.url,
        "engine": engine,
        "health": health,
        "completion_tokens": completion["usage"]["completion_tokens"],
        "text": completion["choices"][0]["text"],
        "seconds": round(time.monotonic() - t0, 2),
        "log": str(log),
    }


def _get(url: str) -> Dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return {"status": r.status, "body": json.loads(r.read() or b"{}")}
