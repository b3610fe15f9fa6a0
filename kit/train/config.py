"""Training config: the seed's hyper-parameter table (MODEL_TYPE ... WORK_DIR) plus the kit trainer's own knobs."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping, Optional, Sequence

from kit.errors import InputError, ParameterError

RUN_TYPES = ("pretrain", "retrain", "sft", "lora")
ENGINES = ("deepspeed", "megatron")

# The seed's table (Step1 预训练超参配置): these names are read from the environment exactly as the AscendCloud
# shell scripts read them (`MODEL_TYPE=6B RUN_TYPE=pretrain ... sh scripts/glm3/glm3_base.sh`).
SEED_ENV = {
    "MODEL_TYPE": "model_type",
    "RUN_TYPE": "run_type",
    "DATASET_PATH": "dataset_path",
    "TOKENIZER_PATH": "tokenizer_path",
    "TRAIN_ITERS": "train_iters",
    "MBS": "mbs",
    "GBS": "gbs",
    "TP": "tp",
    "PP": "pp",
    "SEQ_LEN": "seq_len",
    "MASTER_ADDR": "master_addr",
    "NNODES": "nnodes",
    "NODE_RANK": "node_rank",
    "WORK_DIR": "work_dir",
}
# The kit's extra knobs have the same upper-case spelling in notebooks and on the command line (--set LR=1e-4).
_INT_FIELDS = {
    "train_iters",
    "mbs",
    "gbs",
    "tp",
    "pp",
    "seq_len",
    "nnodes",
    "node_rank",
    "nproc_per_node",
    "master_port",
    "zero_stage",
    "warmup_iters",
    "save_interval",
    "log_interval",
    "seed",
    "lora_r",
    "lora_alpha",
}
_FLOAT_FIELDS = {"lr", "min_lr", "weight_decay", "clip_grad", "lora_dropout"}
_BOOL_FIELDS = {"adapt", "overwrite", "save_hf"}


@dataclass
class TrainConfig:
    """One training run: the seed's names (lower-case here, upper-case in env/notebooks) and the trainer's knobs."""

    run_type: str = "sft"  # pretrain | retrain (resume the latest checkpoint) | sft | lora
    resume_from: str = "pretrain"  # retrain only: the run folder to resume (pretrain | sft | lora)
    model_type: str = (
        "demo"  # model name: the workspace folder under saved_dir_for_ma_output/ (seed: 6B, GLM3-6B)
    )
    dataset_path: str = (
        ""  # a prepared `<name>_hf` folder from notebook 02 (Megatron engine: the bin/idx prefix)
    )
    tokenizer_path: str = ""  # tokenizer folder; empty = the model folder's own tokenizer
    model_path: str = ""  # HF folder to start from (demo model, converted checkpoint, any local HF model)
    train_iters: int = 200  # optimizer steps in total (retrain: the new total, counted from iteration 0)
    mbs: int = 1  # micro batch size per card
    gbs: int = 64  # global batch size: samples per optimizer step over all cards
    tp: int = 1  # tensor parallel size (kit DeepSpeed engine: must be 1; Megatron engine: seed default 2)
    pp: int = 1  # pipeline parallel size (kit DeepSpeed engine: must be 1; Megatron engine: seed default 4)
    seq_len: int = 0  # sequence length; 0 = the dataset's max_length (the seed's default is 8192)
    master_addr: str = "localhost"  # address of node 0 (multi-node)
    nnodes: int = 1  # number of nodes
    node_rank: int = 0  # this node's index, 0-based
    work_dir: str = ""  # the `${workdir}` root; empty = the kit's default workspace
    nproc_per_node: int = 1  # processes (cards) per node; world size = nnodes * nproc_per_node
    master_port: int = 0  # rendezvous port; 0 = a free one (one node) or 6000 (several nodes: same on each)
    engine: str = "deepspeed"  # deepspeed (kit trainer) | megatron (AscendCloud / MindSpeed-LLM scripts)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    dtype: str = (
        "auto"  # auto (bf16 on NPU/GPU with bf16, fp16 otherwise, fp32 on CPU) | bfloat16 | float16 | float32
    )
    lr: float = 1e-5  # peak learning rate
    min_lr: float = 0.0  # learning rate at the end of the cosine decay
    warmup_iters: int = 0  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay
    clip_grad: float = 1.0  # gradient clipping by global norm (0 = off)
    seed: int = 1234  # data order and RNG seed
    save_interval: int = 0  # checkpoint every N steps (0 = only at the end, on SIGTERM)
    log_interval: int = 1  # print a Megatron-style line every N steps
    adapt: bool = (
        True  # patch the model with kit ops (kit.adapt.adapt_model): fused NPU attention/norm/SwiGLU
    )
    lora_r: int = 8  # LoRA rank (RUN_TYPE lora)
    lora_alpha: int = 16  # LoRA alpha
    lora_dropout: float = 0.0  # LoRA dropout
    lora_targets: list = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )  # LoRA modules
    save_hf: bool = True  # at the end, save a plain HF folder (LoRA: merged weights) beside the checkpoints
    overwrite: bool = False  # allow starting over into an output folder that already holds checkpoints

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return max(1, self.nnodes) * max(1, self.nproc_per_node)

    @property
    def dp(self) -> int:
        return max(1, self.world_size // max(1, self.tp * self.pp))

    @property
    def grad_accum(self) -> int:
        return max(1, self.gbs // max(1, self.mbs * self.dp))

    def workspace(self):
        """The workspace this run reads from and writes to (WORK_DIR, MODEL_TYPE)."""
        from kit.workspace import get_workspace

        return get_workspace(self.work_dir or None, model=self.model_type)

    def output_dir(self) -> Path:
        """saved_dir_for_ma_output/<MODEL_TYPE>/<pretrain|sft|lora> (retrain: RESUME_FROM's folder)."""
        return self.workspace().output(self.resume_from if self.run_type == "retrain" else self.run_type)

    def log_dir(self) -> Path:
        return self.workspace().logs

    # ---- validation -----------------------------------------------------------------------------------------
    def problems(self) -> list:
        """Every problem with this config, each naming the value, what is allowed and what to do."""
        p = []
        if self.run_type not in RUN_TYPES:
            p.append(f"RUN_TYPE={self.run_type!r} is not one of {', '.join(RUN_TYPES)}.")
        if self.run_type == "retrain" and self.resume_from not in ("pretrain", "sft", "lora"):
            p.append(f"RESUME_FROM={self.resume_from!r} is not one of pretrain, sft, lora.")
        if self.engine not in ENGINES:
            p.append(f"ENGINE={self.engine!r} is not one of {', '.join(ENGINES)}.")
        for name in ("train_iters", "mbs", "gbs", "tp", "pp", "nnodes", "nproc_per_node", "log_interval"):
            if int(getattr(self, name)) < 1:
                p.append(f"{name.upper()}={getattr(self, name)} must be >= 1.")
        for name in ("seq_len", "save_interval", "warmup_iters", "master_port", "node_rank"):
            if int(getattr(self, name)) < 0:
                p.append(f"{name.upper()}={getattr(self, name)} must be >= 0.")
        if self.nnodes >= 1 and not 0 <= self.node_rank < self.nnodes:
            p.append(f"NODE_RANK={self.node_rank} must be in 0..NNODES-1 (NNODES={self.nnodes}).")
        if self.nnodes > 1 and self.master_addr in ("", "localhost", "127.0.0.1"):
            p.append(
                f"NNODES={self.nnodes} needs MASTER_ADDR set to node 0's IP address (got {self.master_addr!r})."
            )
        if self.tp >= 1 and self.pp >= 1 and self.world_size % (self.tp * self.pp):
            p.append(
                f"world size {self.world_size} (NNODES={self.nnodes} x NPROC_PER_NODE={self.nproc_per_node}) is "
                f"not divisible by TP x PP = {self.tp} x {self.pp}; change TP/PP or the number of cards."
            )
        if self.mbs >= 1 and self.gbs >= 1 and self.gbs % (self.mbs * self.dp):
            p.append(
                f"GBS={self.gbs} is not divisible by MBS x DP = {self.mbs} x {self.dp}; "
                f"use GBS = a multiple of {self.mbs * self.dp}."
            )
        if self.engine == "deepspeed" and (self.tp != 1 or self.pp != 1):
            p.append(
                f"TP={self.tp}, PP={self.pp}: the kit's DeepSpeed engine is data-parallel only (TP=PP=1); "
                f"use ENGINE='megatron' for tensor/pipeline parallelism, or ZERO_STAGE=3 to shard a big model."
            )
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(f"ZERO_STAGE={self.zero_stage} is not one of 0, 1, 2, 3.")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            p.append(f"DTYPE={self.dtype!r} is not one of auto, bfloat16, float16, float32.")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            p.append(f"LR={self.lr}, MIN_LR={self.min_lr}: need LR > 0 and 0 <= MIN_LR <= LR.")
        if self.warmup_iters > self.train_iters:
            p.append(f"WARMUP_ITERS={self.warmup_iters} is more than TRAIN_ITERS={self.train_iters}.")
        if self.clip_grad < 0 or self.weight_decay < 0:
            p.append(f"CLIP_GRAD={self.clip_grad}, WEIGHT_DECAY={self.weight_decay} must be >= 0.")
        if self.run_type == "lora" and (
            self.lora_r < 1 or self.lora_alpha < 1 or not self.lora_targets or not 0 <= self.lora_dropout < 1
        ):
            p.append(
                f"LoRA needs LORA_R >= 1, LORA_ALPHA >= 1, 0 <= LORA_DROPOUT < 1 and LORA_TARGETS non-empty "
                f"(got {self.lora_r}, {self.lora_alpha}, {self.lora_dropout}, {self.lora_targets})."
            )
        if not self.model_type:
            p.append(
                "MODEL_TYPE is required (the model's folder name in the workspace, e.g. 'demo' or 'GLM3-6B')."
            )
        if self.engine == "deepspeed":
            p.extend(_path_problems(self))
        return p

    def to_env(self) -> dict:
        """The seed's variables (and the kit's) as strings, for a launched subprocess or a shell script."""
        env = {}
        for f in fields(self):
            value = getattr(self, f.name)
            env[f.name.upper()] = json.dumps(value) if isinstance(value, list) else str(value)
        return env


def _path_problems(cfg: TrainConfig) -> list:
    """Paths that must exist and vocabularies that must fit, for the kit (DeepSpeed) engine."""
    p = []
    if cfg.run_type == "retrain":
        from kit.train.checkpoint import latest_iteration

        out = cfg.output_dir()
        if latest_iteration(out / "checkpoints") is None:
            p.append(
                f"RUN_TYPE=retrain but {out / 'checkpoints'} holds no checkpoint; run RUN_TYPE=pretrain (or "
                f"sft/lora into that folder) first, or check MODEL_TYPE={cfg.model_type!r} and WORK_DIR."
            )
        return p
    if not cfg.model_path:
        p.append(
            "MODEL_PATH is required: an HF model folder (notebook 03's output, the demo model, or any local "
            "HF checkpoint)."
        )
    elif not (Path(cfg.model_path) / "config.json").is_file():
        p.append(f"MODEL_PATH={cfg.model_path!r} has no config.json; point it at an HF model folder.")
    if not cfg.dataset_path:
        p.append("DATASET_PATH is required: a prepared `<name>_hf` folder written by notebook 02 (kit.data).")
    else:
        from kit.data import read_meta

        try:
            read_meta(cfg.dataset_path)
        except FileNotFoundError:
            p.append(
                f"DATASET_PATH={cfg.dataset_path!r} has no meta.json (not a prepared `<name>_hf` folder); "
                f"prepare it with notebook 02 / `python -m kit data ...`."
            )
    if cfg.tokenizer_path and not Path(cfg.tokenizer_path).is_dir():
        p.append(f"TOKENIZER_PATH={cfg.tokenizer_path!r} is not a folder.")
    if p:
        return p
    from kit.train.data import dataset_problems

    return dataset_problems(cfg)


def _coerce(name: str, raw: str):
    if name in _INT_FIELDS:
        return int(raw)
    if name in _FLOAT_FIELDS:
        return float(raw)
    if name in _BOOL_FIELDS:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if name == "lora_targets":
        return json.loads(raw) if raw.strip().startswith("[") else [s for s in raw.split(",") if s]
    return raw


def from_env(environ: Optional[Mapping] = None, extra: Sequence = (), **overrides) -> TrainConfig:
    """A config from explicit values, overridden by the seed's environment variables where they are set.

    Precedence follows the seed's shell usage: `TRAIN_ITERS=200 MBS=1 ... sh script.sh` wins over defaults.
    Only the seed's names (SEED_ENV) are read from the environment, plus the upper-case names in `extra`.
    """
    environ = os.environ if environ is None else environ
    names = {f.name for f in fields(TrainConfig)}
    unknown = sorted(k for k in list(overrides) + [e.lower() for e in extra] if k.lower() not in names)
    if unknown:
        raise ParameterError(
            f"unknown training parameter(s) {unknown}; allowed: {sorted(n.upper() for n in names)}"
        )
    values = {k.lower(): v for k, v in overrides.items()}
    readable = set(SEED_ENV) | {e.upper() for e in extra}
    for f in fields(TrainConfig):
        key = f.name.upper()
        if key in readable and key in environ and environ[key] != "":
            try:
                values[f.name] = _coerce(f.name, str(environ[key]))
            except ValueError as exc:
                raise InputError(f"environment variable {key}={environ[key]!r} is not valid: {exc}") from exc
    return TrainConfig(**values)


def load_config(path) -> TrainConfig:
    """Read a config.json written by `save_config` (unknown keys are an error, so typos are caught)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    names = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InputError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return TrainConfig(**data)
