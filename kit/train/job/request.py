"""A ModelArts training-job request (API v2, `POST /v2/{project_id}/training-jobs`, the body of the SDK's
`CreateTrainingJobRequest`) built from a TrainConfig, the manifests of its inputs and a JobConfig.

The body is plain JSON here, so the dry run needs no SDK; `kit.train.job.submit` turns it into the SDK's request models
field by field (an unknown field is an error) and the SDK sends exactly what the dry run printed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional

from kit.train.config import TrainConfig
from kit.train.job.config import JobConfig
from kit.train.resolve import TrainPlan

# where ModelArts puts a job's inputs, outputs and code in each container (huaweicloudsdkmodelarts Input.local_dir;
# Huawei Cloud docs "Managing Environment Variables of a Training Container": MA_JOB_DIR)
MA_INPUTS = "/home/ma-user/modelarts/inputs"
MA_OUTPUTS = "/home/ma-user/modelarts/outputs"
MA_JOB_DIR = "/home/ma-user/modelarts/user-job-dir"
NODE_BOOT_FILE = "kit/train/job/node.py"  # what a preset engine starts (it has no `command`)
NODE_ARGS_ENV = "KIT_NODE_ARGS"  # the launcher's arguments, JSON, for that boot file

# Launch settings each node takes from the variables ModelArts injects (MA_NUM_HOSTS, VC_TASK_INDEX,
# VC_WORKER_HOSTS, MA_NUM_GPUS; mapped by `kit train launch` on the node), so they are never written here.
NODE_FIELDS = ("master_addr", "nnodes", "node_rank", "master_port", "nproc_per_node")
PLACED_FIELDS = ("dataset_path", "model_path", "work_dir")  # the job's own input and output folders
# credentials must never travel in a job's environment (jobs get temporary ones from their agency)
SECRET_NAME = re.compile(r"(^|_)(AK|SK|SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|SECRET_KEY|KEY_ID)($|_)", re.I)
SECRET_ENV = (
    "HUAWEICLOUD_SDK_AK",
    "HUAWEICLOUD_SDK_SK",
    "HUAWEICLOUD_SDK_SECURITY_TOKEN",
    "OBS_ACCESS_KEY_ID",
    "OBS_SECRET_ACCESS_KEY",
    "OBS_SECURITY_TOKEN",
)
REDACTED = "***"


@dataclass
class Upload:
    """A local stage output the job reads from OBS: copy it there before submitting."""

    what: str
    local: str
    obs_url: str
    manifest_sha256: Optional[str] = None

    def command(self) -> str:
        """The obsutil line that copies the folder's contents to its OBS folder."""
        return f"obsutil cp {shlex.quote(self.local.rstrip('/') + '/')} {self.obs_url} -r -f -flat"


@dataclass
class JobPlan:
    """The request body, the command each node runs, what to upload first, and every problem found."""

    body: dict
    node_args: List[str]
    command: str
    uploads: List[Upload] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self, environ: Optional[Mapping[str, str]] = None) -> str:
        """The dry run: the exact body (secrets redacted), the node command, the uploads and the problems."""
        lines = [
            "ModelArts training job (dry run, nothing sent; `--submit` sends it): "
            "POST /v2/{project_id}/training-jobs",
            json.dumps(redact(self.body, environ), indent=2, ensure_ascii=False),
            f"each of the {self.body['spec']['resource']['node_count']} nodes runs: "
            + redact(self.command, environ),
        ]
        if self.uploads:
            lines.append("upload first (the job reads these from OBS):")
            for u in self.uploads:
                sha = f", manifest sha256 {u.manifest_sha256[:12]}" if u.manifest_sha256 else ""
                lines.append(f"  {u.what}: {u.command()}  ({u.local}{sha})")
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s); submitting is refused until they are fixed:")
            lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def summary(self, environ: Optional[Mapping[str, str]] = None) -> dict:
        """What a notebook records about the plan (redacted, like the dry run)."""
        res = self.body["spec"]["resource"]
        return redact(
            {
                "job_name": self.body["metadata"]["name"],
                "node_count": res["node_count"],
                "flavor": res.get("flavor_id"),
                "command": self.command,
                "inputs": {
                    i["name"]: i["remote"]["obs"]["obs_url"] for i in self.body["algorithm"]["inputs"]
                },
                "outputs": {
                    o["name"]: o["remote"]["obs"]["obs_url"] for o in self.body["algorithm"]["outputs"]
                },
                "uploads": [vars(u) for u in self.uploads],
                "problems": self.problems,
                "body": self.body,
            },
            environ,
        )


def _secrets(environ: Optional[Mapping[str, str]]) -> List[str]:
    environ = os.environ if environ is None else environ
    return sorted({environ[k] for k in SECRET_ENV if len(environ.get(k) or "") >= 4}, key=len, reverse=True)


def redact(
    value: Any, environ: Optional[Mapping[str, str]] = None, _secrets_cache: Optional[list] = None
) -> Any:
    """`value` with every credential of the environment replaced by ***, and secret-named variables' values too."""
    secrets = _secrets(environ) if _secrets_cache is None else _secrets_cache
    if isinstance(value, str):
        for s in secrets:
            value = value.replace(s, REDACTED)
        return value
    if isinstance(value, dict):
        return {
            k: (
                REDACTED
                if isinstance(k, str) and SECRET_NAME.search(k) and isinstance(v, str)
                else redact(v, environ, secrets)
            )
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [redact(v, environ, secrets) for v in value]
    return value


def _obs_join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)]) + "/"


def _option(name: str, value: Any) -> List[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + name.replace("_", "-")]
    if isinstance(value, (list, tuple)):
        return [flag, ",".join(str(v) for v in value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def carried_fields(cfg: TrainConfig) -> List[str]:
    """The run settings of the resolved `cfg` the job's command states: those set explicitly or by the environment
    here (the rest are the kit's defaults or are inherited on the node from the same manifests)."""
    from kit.train.resolve import EXPLICIT

    names = [n for n, s in cfg.sources.items() if s == EXPLICIT or s.startswith("environment")]
    skip = set(NODE_FIELDS) | set(PLACED_FIELDS) | {"sources"}
    order = [f for f in TrainConfig.__dataclass_fields__ if f in names and f not in skip]
    return order


def node_arguments(
    cfg: TrainConfig, job: JobConfig, data_dir: str, model_dir: str, work_dir: str
) -> List[str]:
    """`python -m kit` arguments every node runs: the kit launcher on the job's folders, the run's settings.

    The launch settings (NNODES, NODE_RANK, MASTER_ADDR, NPROC_PER_NODE) are not given: the launcher reads them
    from the variables ModelArts injects on each node.
    """
    args = ["train", "launch", "--launcher", job.launcher]
    args += ["--dataset-path", data_dir, "--model-path", model_dir, "--work-dir", work_dir]
    for name in carried_fields(cfg):
        value = getattr(cfg, name)
        if value is not None:
            args += _option(name, value)
    return args


def node_command(job: JobConfig, node_args: List[str]) -> str:
    """The shell command of an image-based job: into the uploaded code (if any), then the kit launcher."""
    run = " ".join(shlex.quote(a) for a in [job.python, "-m", "kit", *node_args])
    if job.code_dir:
        code = job.code_dir.rstrip("/").rsplit("/", 1)[-1]
        return f"cd {shlex.quote(MA_JOB_DIR + '/' + code)} && {run}"
    return run


def _job_name(cfg: TrainConfig, job: JobConfig) -> str:
    if job.name:
        return job.name
    model = re.sub(r"[^A-Za-z0-9_-]", "-", cfg.model_name)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"kit-{model}-{cfg.run_type}-{stamp}"[-64:].lstrip("-_") or "kit-job"


def _manifest_sha(folder: str, kind: Optional[str]) -> Optional[str]:
    from kit.core.manifest import find_manifest, read_manifest

    if find_manifest(folder) is None:
        return None
    return read_manifest(folder, expect=kind).sha256


def build_job(plan: TrainPlan, job: JobConfig) -> JobPlan:
    """The training job for the resolved run `plan` (kit.train.resolve) on `job`'s nodes, flavor, image and OBS folders.

    Problems (missing OBS folder, pool, image, a GBS that 2 nodes x 8 cards cannot split...) are collected in
    `plan.problems`; `kit.train.job.submit.submit` refuses a plan that has any.
    """
    from kit.core.manifest import PREPARED_DATA
    from kit.train.config import replace
    from kit.train.resolve import DEFAULT

    cfg = plan.cfg
    problems = list(job.problems())
    if cfg.engine != "deepspeed":
        problems.append(
            f"ENGINE={cfg.engine!r}: a job runs the kit trainer (ENGINE deepspeed); the Megatron path's command "
            "comes from `python -m kit train megatron`."
        )
    if plan.resumed:
        problems.append(
            "RUN_TYPE='retrain' resumes checkpoints on this machine's disk; a job starts from OBS inputs: run "
            "pretrain/sft/lora as the job."
        )
    if cfg.nnodes != job.nodes and not cfg.sources.get("nnodes", DEFAULT).startswith(DEFAULT):
        problems.append(
            f"NNODES={cfg.nnodes} ({cfg.sources['nnodes']}) but the job has NODES={job.nodes}: the job's node "
            "count is NODES; leave NNODES unset."
        )
    cards = job.cards()
    on_job = replace(
        cfg, nnodes=max(1, job.nodes), nproc_per_node=cards or 1, master_addr="job-node-0", node_rank=0
    )
    where = f"on {job.nodes} node(s) x {cards} card(s) of {job.flavor}" if cards else "on the job"
    problems += [f"{where}: {p}" for p in on_job.problems()]
    if cards and not job.force:
        from kit.plan.report import does_not_fit

        refusal = does_not_fit(plan, job.card, on_job.world_size)
        problems += [f"{refusal} FORCE=True sends it anyway."] if refusal else []

    data, model = str(cfg.dataset_path), str(cfg.model_path)
    data_obs = job.data_obs or _obs_join(job.obs_dir, "data", Path(data).name)
    model_obs = job.model_obs or _obs_join(job.obs_dir, "model", Path(model).name)
    uploads = [
        Upload("prepared data (notebook 02)", data, data_obs, _manifest_sha(data, PREPARED_DATA)),
        Upload("model", model, model_obs, _manifest_sha(model, None)),
    ]
    if job.code_dir:
        from kit.core.workspace import repo_root

        uploads.append(Upload("the kit (this checkout)", str(repo_root()), job.code_dir.rstrip("/") + "/"))
    data_dir, model_dir = f"{MA_INPUTS}/data_url_0", f"{MA_INPUTS}/model_url_1"
    work_dir = f"{MA_OUTPUTS}/train_url_0"
    args = node_arguments(cfg, job, data_dir, model_dir, work_dir)
    command = node_command(job, args)

    environments = dict(job.environments)
    for key in environments:
        if SECRET_NAME.search(key):
            problems.append(
                f"ENVIRONMENTS[{key!r}] looks like a credential: a job must not carry one (its agency gives it "
                "temporary credentials); remove it."
            )
    algorithm: dict = {}
    if job.image_url:
        algorithm["command"] = command
        if job.code_dir:
            algorithm["code_dir"] = job.code_dir.rstrip("/") + "/"
        algorithm["engine"] = {"image_url": job.image_url}
    else:
        code_dir = job.code_dir.rstrip("/") + "/"
        algorithm["code_dir"] = code_dir
        algorithm["boot_file"] = code_dir + NODE_BOOT_FILE
        algorithm["engine"] = {"engine_name": job.engine_name, "engine_version": job.engine_version}
        environments[NODE_ARGS_ENV] = json.dumps(args)
    # access_method env: the folders reach the command as variables, not as --data_url=... arguments appended to it
    algorithm["inputs"] = [
        {
            "name": "data_url",
            "local_dir": data_dir,
            "access_method": "env",
            "remote": {"obs": {"obs_url": data_obs}},
        },
        {
            "name": "model_url",
            "local_dir": model_dir,
            "access_method": "env",
            "remote": {"obs": {"obs_url": model_obs}},
        },
    ]
    algorithm["outputs"] = [
        {
            "name": "train_url",
            "local_dir": work_dir,
            "access_method": "env",
            "remote": {"obs": {"obs_url": _obs_join(job.obs_dir, "output")}},
        }
    ]
    if environments:
        algorithm["environments"] = environments
    hashes = ", ".join(
        f"{u.what.split(' ')[0]} {u.manifest_sha256[:12]}" for u in uploads if u.manifest_sha256
    )
    metadata = {
        "name": _job_name(cfg, job),
        "description": job.description
        or f"kit {cfg.run_type} of {cfg.model_name}" + (f"; {hashes}" if hashes else ""),
    }
    if job.workspace_id:
        metadata["workspace_id"] = job.workspace_id
    resource = {"flavor_id": job.flavor, "node_count": job.nodes}
    if job.pool_id:
        resource["pool_id"] = job.pool_id
    body = {
        "kind": "job",
        "metadata": metadata,
        "algorithm": algorithm,
        "spec": {"resource": resource, "log_export_path": {"obs_url": _obs_join(job.obs_dir, "logs")}},
    }
    return JobPlan(body=body, node_args=args, command=command, uploads=uploads, problems=problems)
