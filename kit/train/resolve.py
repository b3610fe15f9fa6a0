"""Resolve a training run once into a TrainPlan: the one place that reads the inputs' manifests, the environment,
a saved run (retrain) and OBS inputs, and checks the dataset, tokenizer and vocabulary. The trainer, its ranks, the
launcher, the job request and the Megatron command take the plan and never resolve again.

Precedence of a value: explicit (given to the config) > environment (the manual's variables,
kit.train.config.MANUAL_ENV, and a ModelArts training job's, kit.train.jobenv) > manifest (notebook 02's
prepared-data, notebook 03's converted-checkpoint) > default; its source is recorded. A job's value that differs
from an explicit one or a kit variable, and a set value that contradicts the inputs, are errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from kit.core.inputs import newest
from kit.core.manifest import CONVERTED_CHECKPOINT, Manifest, find_manifest, read_manifest
from kit.errors import InputError, MissingInputError
from kit.system.procs import in_process_rendezvous
from kit.train.config import (
    FROM_CHECKPOINT,
    FROM_DATA,
    INHERITED_DEFAULTS,
    MANUAL_ENV,
    TrainConfig,
    coerce,
    from_dict,
    load_config,
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


@dataclass(frozen=True)
class TrainPlan:
    """A training run decided once by resolve(): what every process of the run reads and none re-derives."""

    cfg: TrainConfig
    """The resolved config the run trains with (retrain: the saved run's, with the new length and intervals)."""
    resumed: bool = False
    """RUN_TYPE retrain: the run continues the checkpoints in its folder."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """The prepared-data manifest's fields (notebook 02's folder)."""
    obs_inputs: Mapping[str, str] = field(default_factory=dict)
    """OBS_HOME: field -> the obs:// folder that input was downloaded from (a resume fetches them again)."""
    obs_missing: Tuple[str, ...] = ()
    """OBS_HOME retrain: this node's files of the checkpoint to resume that OBS lacks."""

    @property
    def folder(self) -> Path:
        """The run folder (retrain: the one RESUME_FROM names, wherever the run was made)."""
        return self.cfg.output_dir()

    def describe(self) -> str:
        """One line per value that did not come from the default, with its source."""
        cfg = self.cfg
        return "\n".join(
            f"{n.upper()} = {getattr(cfg, n)!r}  ({src})" for n, src in cfg.sources.items() if src != DEFAULT
        )

    def save(self, path: Union[str, Path]) -> Path:
        """Write the plan as JSON (atomically): what the ranks of a launched run read."""
        from kit.core.configs import to_jsonable
        from kit.storage.atomic import atomic_write_text

        atomic_write_text(Path(path), json.dumps(to_jsonable(self), indent=2, ensure_ascii=False) + "\n")
        return Path(path)

    @staticmethod
    def load(path: Union[str, Path]) -> TrainPlan:
        """The plan a launcher wrote (TrainPlan.save)."""
        values = json.loads(Path(path).read_text(encoding="utf-8"))
        cfg = from_dict(values.pop("cfg"), str(path))
        return TrainPlan(cfg, **dict(values, obs_missing=tuple(values["obs_missing"])))


def resolve(
    cfg: TrainConfig,
    ws: Any = None,
    environ: Optional[Mapping[str, str]] = None,
    max_records: Optional[int] = None,
) -> TrainPlan:
    """The run's plan: its settings checked, OBS inputs fetched, every value decided (resolve_values), a retrain's
    saved run taken, and its inputs checked once; every problem found is raised together (ConfigError) for the kit
    trainer (ENGINE deepspeed)."""
    from kit.core.configs import ConfigError, check

    # the kit trainer's settings alone, before any data is found, prepared or downloaded; the Megatron command lists
    # its problems instead (kit.train.megatron.build)
    if cfg.engine == "deepspeed":
        check(cfg, "training config")
    obs_inputs: dict = {}
    obs_missing: tuple = ()
    if cfg.obs_home:  # OBS as the run's home: inputs and the checkpoint to resume come to local disk first
        from kit.train import obs_home

        cfg, obs_inputs = obs_home.localize_inputs(cfg)
        if cfg.run_type == "retrain":
            obs_missing = tuple(obs_home.fetch_for_resume(cfg, cfg.output_dir()))
    values = resolve_values(cfg, ws, environ, max_records)
    if obs_inputs:
        obs_inputs = obs_home.inputs_of(values, obs_inputs)
    run = saved_run(values)
    if run is not values and values.obs_home:  # the resumed run's inputs, fetched again onto this node
        run, obs_inputs = obs_home.localize_inputs(run, obs_home.saved_inputs(values.output_dir()))
    where = "training config" if run is values else "saved training config (retrain)"
    problems = run.problems() + input_problems(run) if run.engine == "deepspeed" else []
    if problems:
        raise ConfigError(problems, where)
    from kit.data.prepared import read_prepared

    data = dict(read_prepared(run.dataset_path).manifest.fields) if run.dataset_path else {}
    return TrainPlan(run, values.run_type == "retrain", data, obs_inputs, obs_missing)


def input_problems(cfg: TrainConfig) -> List[str]:
    """The kit (DeepSpeed) engine's inputs against the resolved config: the paths exist, and the dataset's kind,
    length and token ids fit the run, the model and its tokenizer (the one place that opens them to check)."""
    p: List[str] = []
    if cfg.engine != "deepspeed":
        return p
    if cfg.run_type == "retrain":
        from kit.train.checkpoint import latest_iteration

        out = cfg.output_dir()
        if latest_iteration(out / "checkpoints") is None:
            p.append(
                f"RUN_TYPE=retrain but {out / 'checkpoints'} holds no checkpoint; run RUN_TYPE=pretrain (or "
                f"sft/lora into that folder) first, or check MODEL_NAME={cfg.model_name!r} and WORK_DIR."
            )
        return p
    if cfg.model_path and not (Path(cfg.model_path) / "config.json").is_file():
        p.append(f"MODEL_PATH={cfg.model_path!r} has no config.json; point it at an HF model folder.")
    elif cfg.model_path:
        from kit.convert.weights_check import check_hf_weights
        from kit.errors import IntegrityError

        # a damaged shard or NaN / inf weights, named before the ranks start (a NaN weight would only show as a NaN
        # loss at step 1); reads every weight once, ~0.1 s for the demo model's 513 MiB when cached
        try:
            check_hf_weights(cfg.model_path)
        except IntegrityError as exc:
            p.append(f"MODEL_PATH: {exc}")
    if cfg.dataset_path:
        from kit.data.prepared import read_prepared

        try:
            read_prepared(cfg.dataset_path)
        except InputError as exc:
            p.append(f"DATASET_PATH: {exc}")
    if cfg.tokenizer_path and not Path(cfg.tokenizer_path).is_dir():
        p.append(f"TOKENIZER_PATH={cfg.tokenizer_path!r} is not a folder.")
    if p or not (cfg.model_path and cfg.dataset_path):
        return p
    from kit.train.batches import dataset_problems

    return dataset_problems(cfg)


def resolve_values(
    cfg: TrainConfig,
    ws: Any = None,
    environ: Optional[Mapping[str, str]] = None,
    max_records: Optional[int] = None,
) -> TrainConfig:
    """The config with every value decided and `sources` naming where each came from (see the module doc); retrain
    leaves the rest to the saved run (saved_run)."""
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
        from kit.core.project import PROJECT
        from kit.core.workspace import get_workspace

        # MODEL_TYPE and WORK_DIR not given: the project's (kit.core.project), like every notebook's
        given = not sources.get("model_name", DEFAULT).startswith(DEFAULT)
        ws = get_workspace(values["work_dir"] or None, model=values["model_name"] if given else None)
        if values["model_name"] != ws.model:
            values["model_name"], sources["model_name"] = ws.model, f"the project ({ws.origin})"
        if not values["work_dir"] and ws.sources.get("workspace") == PROJECT:
            # written out, so a launched rank or another node does not depend on this machine's project file
            values["work_dir"], sources["work_dir"] = str(ws.root), f"the project ({ws.origin})"
    from kit.train import inputs

    conflicts: List[str] = []
    # the model: HF folder, or (Megatron) notebook 03's converted checkpoint
    if (
        values["model_path"] is None and values["engine"] == "megatron"
    ):  # notebook 03's output, if there is one
        found = newest(ws, inputs.CHECKPOINT)
        if found is not None:
            values["model_path"], sources["model_path"] = (
                str(found.folder),
                f"workspace {found.folder}: {found.why}",
            )
    if values["model_path"] is None:
        values["model_path"], sources["model_path"] = str(inputs.default_model()), "default (the demo model)"
    run_started = None  # DPO: the SFT run it starts from (MODEL_PATH = the run's folder or its hf/ export)
    if values["run_type"] == "dpo":
        from kit.train.dpo import start_from_run

        found_run = start_from_run(values["model_path"])
        if found_run is not None:
            hf, run_started = found_run
            if Path(hf).resolve() != Path(values["model_path"]).resolve():
                src = sources.get("model_path", EXPLICIT)
                values["model_path"], sources["model_path"] = (
                    hf,
                    f"{src}: the model run {run_started.folder} exported",
                )
            # the tokenizer the run trained with (its export's files are re-saved, their hash differs): notebook
            # 02's pairs made with it are found, and checked against it
            run_tok = run_started["config"].get("tokenizer_path")
            if values["tokenizer_path"] is None and run_tok and Path(run_tok).is_dir():
                values["tokenizer_path"], sources["tokenizer_path"] = (
                    run_tok,
                    f"the run {run_started.folder} (its tokenizer)",
                )
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
    from kit.data.prepared import read_prepared  # notebook 02's folder, or the Megatron prefix beside it

    data_man = read_prepared(values["dataset_path"]).manifest
    facts = dict(data_man.fields)
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
    run_template = run_started["config"].get("template") if run_started is not None else None
    if run_template and values["template"] and values["template"] != run_template:
        conflicts.append(
            f"TEMPLATE={values['template']!r} ({sources.get('template', EXPLICIT)}) but the run {run_started.folder} "
            f"this DPO run starts from trained with template={run_template!r}"
        )
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


# what a resumed run may change: where it runs, how long, how often it saves and logs, the rendezvous, whether
# leftovers of killed runs are removed, and recompute (the same math in less memory: a run that ran out resumes)
RESUME_MAY_CHANGE = frozenset(
    "run_type resume_from train_iters save_interval log_interval eval_every save_hf work_dir model_name master_addr master_port "
    "clean_partial node_rank overwrite obs_home recompute".split()
)


def _same_value(name: str, mine: Any, saved: Any) -> bool:
    if name.endswith("_path") and mine and saved:
        return Path(str(mine)).expanduser().resolve() == Path(str(saved)).expanduser().resolve()
    if isinstance(mine, (list, tuple)) or isinstance(saved, (list, tuple)):
        return list(mine or []) == list(saved or [])
    return mine == saved


def saved_run(cfg: TrainConfig) -> TrainConfig:
    """RUN_TYPE retrain continues the run in the folder it names (WORK_DIR, MODEL_NAME, RESUME_FROM), wherever
    it was made: its saved config, with the new TRAIN_ITERS, intervals and rendezvous. A setting given explicitly
    that contradicts the saved run is an error listing every one. Other run types: `cfg` itself."""
    if cfg.run_type != "retrain":
        return cfg
    folder = cfg.output_dir()
    saved_path = folder / "config.json"
    if not saved_path.is_file():
        raise MissingInputError(
            f"RUN_TYPE=retrain: {saved_path} is missing, so there is no run to resume there — check "
            f"WORK_DIR, MODEL_NAME and RESUME_FROM."
        )
    saved = load_config(saved_path)
    if saved.run_type != cfg.resume_from:
        raise InputError(
            f"RUN_TYPE=retrain RESUME_FROM={cfg.resume_from!r}: the run in {folder} is a {saved.run_type!r} run "
            f"(its config.json) — set RESUME_FROM={saved.run_type!r} or resume the folder it belongs to."
        )
    explicit = [n for n, src in cfg.sources.items() if src == EXPLICIT or src.startswith("environment")]
    clashes = [
        f"{n.upper()}={getattr(cfg, n)!r} ({cfg.sources[n]}) but the run was made with {getattr(saved, n)!r}"
        for n in sorted(explicit)
        if n not in RESUME_MAY_CHANGE and not _same_value(n, getattr(cfg, n), getattr(saved, n))
    ]
    if clashes:
        raise ConfigConflictError(
            f"RUN_TYPE=retrain continues {folder} as it was made: "
            + "; ".join(clashes)
            + f". Leave these unset to resume (only {', '.join(sorted(n.upper() for n in RESUME_MAY_CHANGE))} "
            f"may change), or start a new run (RUN_TYPE={saved.run_type!r}, another MODEL_NAME or OVERWRITE)."
        )
    # the folder it was found in is the run's, not the MODEL_NAME/WORK_DIR its config.json recorded (a copy
    # continues the copy, a moved run resumes where it is)
    keep = (
        "train_iters",
        "save_interval",
        "log_interval",
        "eval_every",
        "work_dir",
        "model_name",
        "master_addr",
    )
    keep += ("master_port", "obs_home", "clean_partial", "recompute")
    return dataclasses.replace(saved, **{n: getattr(cfg, n) for n in keep})


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
