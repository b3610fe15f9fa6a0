"""`serve(cfg, ws) -> Server`: notebook 04's model behind an OpenAI-compatible engine on the detected device."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from kit.convert.weights_check import check_hf_weights
from kit.core.configs import check
from kit.serve.config import ServeConfig
from kit.serve.engines import build_command, check_cpu_head_size, choose_engine, require_engine
from kit.serve.model import ServedModel, resolve_model
from kit.serve.server import Server, check_port
from kit.system.procs import free_port


def serving_dir(ws) -> Path:
    """The workspace's folder for server logs, load tests and packages."""
    return Path(ws.model_output) / "serving"


def _device_kind(cfg: ServeConfig) -> str:
    if cfg.device:
        return cfg.device
    from kit.system.device import detect

    return detect(None).kind


def serve(cfg: ServeConfig, ws, model: Optional[ServedModel] = None) -> Server:
    """Start the engine on the model `cfg` names (or `model`); return the running Server once /health answers."""
    check(cfg)
    kind = _device_kind(cfg)
    engine = choose_engine(cfg.engine, kind)
    found = require_engine(engine, cfg.engine_python, kind)
    served = model or resolve_model(cfg, ws)
    # a model with NaN/inf weights answers with garbage, never an error: refuse it before the engine starts
    check_hf_weights(served.path)
    if engine == "vllm" and kind == "cpu":
        check_cpu_head_size(served.path)
    port = cfg.port or free_port(cfg.host)
    check_port(cfg.host, port)
    adapter = served.adapter if cfg.adapter else None
    cmd = build_command(
        engine,
        found.python,
        served.path,
        cfg.host,
        port,
        kind,
        adapter=adapter,
        base=served.base,
        max_model_len=cfg.max_model_len,
        extra_args=cfg.extra_args,
        vllm_cli=bool(found.versions.get("vllm")),
        enforce_eager=cfg.enforce_eager,
        cpu_kv_cache_gb=cfg.cpu_kv_cache_gb,
    )
    for note in found.notes + cmd.notes:  # said once, here, and kept in the server's notes
        print(note)
        served.notes.append(note)
    if adapter is not None and not cmd.serves_adapter:
        served.notes.append(f"{engine} serves no LoRA adapters: serving the merged model {served.path}")
    log = serving_dir(ws) / "logs" / f"{engine}-{port}.log"
    env = dict(os.environ, **cmd.env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never a hub look-up
    server = Server(cmd.argv, cfg.host, port, cmd.model_name, log, engine=engine)
    server.info.update(
        {
            "device": kind,
            "model_path": str(served.path),
            "adapter": str(adapter) if cmd.serves_adapter else None,
            "template": served.template,
            "context_length": cfg.max_model_len or served.context_length(),
            "prompt_logprobs": cmd.prompt_logprobs,
            "notes": served.notes,
        }
    )
    server.served = served
    print(f"starting {engine} on {server.url} ({kind}) for {served.path} ...", flush=True)
    server.start(timeout=cfg.startup_timeout, env=env)
    (log.parent / f"{engine}-{port}.json").write_text(json.dumps(server.summary(), indent=2) + "\n")
    print(f"ready: {server.url} (OpenAI API at {server.base_url}, {server.info['startup_s']} s)")
    return server
