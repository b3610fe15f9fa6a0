"""Resolve a TrainConfig: every unset value from the environment, the inputs' manifests or the default, with the
source of each value recorded, and every contradiction between what was set and what the inputs are an error.

Precedence: explicit (given to the config) > environment (the manual's variables, kit.train.config.MANUAL_ENV, and
a ModelArts training job's, kit.train.jobenv) > manifest (notebook 02's prepared-data, notebook 03's
converted-checkpoint) > default. A job's value that differs from an explicit one or a kit variable is an error.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from kit.errors import InputError
from kit.manifest import CONVERTED_CHECKPOINT, Manifest, find_manifest, read_manifest
from kit.train.config import (
    FROM_CHECKPOINT,
    FROM_DATA,
    INHERITED_DEFAULTS,
    MANUAL_ENV,
    TrainConfig,
    coerce,
    in_process_rendezvous,
)

EXPLICIT = "explicit"
DEFAULT = "default"


class ConfigConflictError(InputError):
    """A value set for the run contradicts what its inputs were made with (both values and sources shown)."""


def _environment(environ: Mapping[str, str]) -> Dict[str, tuple]:
    """field -> (value, "environment KEY") for the manual's variables that are set (non-empty)."""
    out = {}
    for key, name in MANUAL_ENV.items():
        raw = environ.get(key)
        if raw is None or str(raw) == "":
            continue
        if key in in_process_rendezvous(environ):
            continue  # the kit's own world of one in this process (a notebook that trained), not a setting
        try:
            out[name] = (coerce(name, str(raw)), f"environment {key}")
        except ValueError as exc:
            raise InputError(f"environment variable {key}={raw!r} is not valid: {exc}") from None
    return out


def _same_host(a: Any, b: Any) -> bool:
    if a == b:
        return True
    from kit.train.jobenv import resolve_host

    try:
        return resolve_host(str(a), timeout_s=0) == resolve_host(str(b), timeout_s=0)
    except InputError:
        return False


def _job_environment(cfg: TrainConfig, env: Dict[str, tuple], environ: Mapping[str, str]) -> None:
    """Add a ModelArts job's launch settings to `env` (kit.train.jobenv.modelarts_env); one that differs from an
    explicit value or a kit variable (NNODES, ...) is a ConfigConflictError naming both."""
    from kit.train.jobenv import modelarts_env

    job = modelarts_env(environ)
    clashes = []
    for name, (value, src) in job.items():
        if name in cfg.given and not cfg.sources.get(name, "").startswith(DEFAULT):
            theirs, where = getattr(cfg, name), cfg.sources.get(name, EXPLICIT)
        elif name in env:
            theirs, where = env[name]
        else:
            env[name] = (value, src)
            continue
        same = _same_host(theirs, value) if name == "master_addr" else theirs == value
        if not same:
            clashes.append(f"{name.upper()}={theirs!r} ({where}) but {value!r} ({src})")
    if clashes:
        raise ConfigConflictError(
            "the launch settings contradict the ModelArts training job: "
            + "; ".join(clashes)
            + ". Leave them unset in a job (the job's variables decide), or fix the job's node/card count."
        )


def _converted(model_path: Optional[str]) -> Optional[Manifest]:
    """The converted-checkpoint manifest of MODEL_PATH, or None for an HF folder."""
    if not model_path or find_manifest(model_path) is None:
        return None
    man = read_manifest(model_path)
    return man if man.kind == CONVERTED_CHECKPOINT else None


def _differs(name: str, mine: Any, theirs: Any) -> bool:
    if name == "tokenizer_path":
        from kit.train.inputs import _tokenizer_id

        return _tokenizer_id(mine) != theirs
    if name == "num_layer_list":
        return [int(c) for c in mine] != [int(c) for c in theirs]
    if name in ("seq_len", "tp", "pp", "padded_vocab_size"):
        return int(mine) != int(theirs)
    if name == "pack":
        return bool(mine) != bool(theirs)
    return mine != theirs


def resolve(
    cfg: TrainConfig,
    ws: Any = None,
    environ: Optional[Mapping[str, str]] = None,
    max_records: Optional[int] = None,
) -> TrainConfig:
    """The config with every value decided and `sources` naming where each came from (see the module doc)."""
    environ = os.environ if environ is None else environ
    env = _environment(environ)
    _job_environment(cfg, env, environ)
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name == "sources":
            continue
        value = getattr(cfg, f.name)
        # a value an earlier resolution took from the default is not the user's: resolve it again (a config
        # loaded from a run's manifest and switched to the Megatron engine inherits the converted TP/PP)
        was_default = cfg.sources.get(f.name, "").startswith(DEFAULT)
        if f.name in cfg.given and value is not None and not was_default:
            values[f.name], sources[f.name] = value, cfg.sources.get(f.name, EXPLICIT)
        elif f.name in env:
            values[f.name], sources[f.name] = env[f.name]
        elif f.name in INHERITED_DEFAULTS:
            values[f.name] = None  # inherited below, else its default
        else:
            values[f.name], sources[f.name] = value, DEFAULT
    if ws is not None:  # the workspace object passed along decides where the run lives
        for name, value in (("work_dir", str(ws.root)), ("model_name", ws.model)):
            if values[name] != value:
                values[name], sources[name] = value, "workspace"
    if values["run_type"] == "retrain":  # the saved run's resolved config decides the rest (trainer)
        for name, default in INHERITED_DEFAULTS.items():
            if values[name] is None:
                values[name], sources[name] = default, DEFAULT
        return _made(values, sources)

    if ws is None:
        from kit.workspace import get_workspace

        ws = get_workspace(values["work_dir"] or None, model=values["model_name"])
    from kit.train import inputs

    conflicts: List[str] = []
    # the model: HF folder, or (Megatron) notebook 03's converted checkpoint
    if (
        values["model_path"] is None and values["engine"] == "megatron"
    ):  # notebook 03's output, if there is one
        found = inputs.find_converted(ws)
        if found is not None:
            values["model_path"], sources["model_path"] = str(found), f"workspace {found}"
    if values["model_path"] is None:
        values["model_path"], sources["model_path"] = str(inputs.default_model()), "default (the demo model)"
    ckpt = _converted(values["model_path"])
    if ckpt is not None and values["engine"] != "megatron":
        raise InputError(
            f"MODEL_PATH={values['model_path']!r} is a Megatron checkpoint (notebook 03); the kit's DeepSpeed engine "
            f"trains HF folders: set ENGINE='megatron', or give the HF folder it was converted from."
        )
    tokenizer = values["tokenizer_path"] or (ckpt.get("tokenizer") if ckpt else None) or values["model_path"]
    # the data: given, else notebook 02's output in the workspace, else the sample prepared now
    if values["dataset_path"] is None:
        kind = inputs.DATA_KIND_FOR_RUN.get(values["run_type"]) or "sft"
        found, how = inputs.default_data(ws, kind, tokenizer, values["seq_len"], max_records)
        values["dataset_path"], sources["dataset_path"] = str(found), how
    facts, data_man = inputs.data_facts(values["dataset_path"])
    data_where = f"manifest {data_man.folder}"
    if (
        Path(values["dataset_path"]).resolve() != data_man.folder
    ):  # a Megatron prefix named it: use its folder
        values["dataset_path"] = str(data_man.folder)
    theirs_for = dict(facts)
    data_tok = facts.get("tokenizer")
    if data_tok and not Path(str(data_tok)).is_dir():
        # prepared on another machine (or a synthetic set): the tokenizer cannot be inherited nor compared by
        # path; the model's own tokenizer is used and the hash, if recorded, is still compared
        facts = dict(facts, tokenizer=None)
        theirs_for["tokenizer"] = facts.get("tokenizer_sha256")
        if theirs_for["tokenizer"] and values["tokenizer_path"] is None:
            values["tokenizer_path"], sources["tokenizer_path"] = (
                tokenizer,
                "default (MODEL_PATH's tokenizer)",
            )
    elif facts.get("tokenizer_sha256"):
        theirs_for["tokenizer"] = facts["tokenizer_sha256"]
    elif data_tok:
        theirs_for["tokenizer"] = inputs._tokenizer_id(data_tok)
    for name, key in FROM_DATA.items():
        conflicts += _inherit(values, sources, name, facts.get(key), theirs_for.get(key), data_where, key)
    if ckpt is not None:
        where = f"manifest {ckpt.folder}"
        for name, key in FROM_CHECKPOINT.items():
            conflicts += _inherit(values, sources, name, ckpt.get(key), ckpt.get(key), where, key)
    if conflicts:
        raise ConfigConflictError(
            "the run's settings contradict its inputs: "
            + "; ".join(conflicts)
            + ". Set the parameter to None to inherit it, or re-make the input with the value you want."
        )
    if values["tokenizer_path"] is None and ckpt is None:
        values["tokenizer_path"], sources["tokenizer_path"] = (
            values["model_path"],
            "default (MODEL_PATH's tokenizer)",
        )
    for name, default in INHERITED_DEFAULTS.items():
        if values[name] is None and name not in sources:
            values[name], sources[name] = default, DEFAULT
    return _made(values, sources)


def _inherit(
    values: dict, sources: dict, name: str, value: Any, compare: Any, where: str, key: str
) -> List[str]:
    """Take `value` from a manifest when the field is unset; a set value that differs is a contradiction."""
    if value is None and compare is None:
        return []
    if values[name] is None:
        if value is None:
            return []
        values[name], sources[name] = value, where
        return []
    if compare is not None and _differs(name, values[name], compare):
        shown = (
            f"{value!r}"
            if name != "tokenizer_path"
            else f"{value!r} (tokenizer_sha256 {str(compare)[:12]}...)"
        )
        return [f"{name.upper()}={values[name]!r} ({sources[name]}) but {key}={shown} ({where})"]
    return []


def _made(values: dict, sources: dict) -> TrainConfig:
    out = TrainConfig(**values, sources=dict(sorted(sources.items())))
    return out


def describe_sources(cfg: TrainConfig) -> str:
    """One line per field whose value did not come from the default: NAME = value  (source)."""
    lines = []
    for name, src in cfg.sources.items():
        if src != DEFAULT:
            lines.append(f"{name.upper()} = {getattr(cfg, name)!r}  ({src})")
    return "\n".join(lines)
