"""Training config: the ModelArts user manual's hyper-parameter table plus the kit trainer's own settings.

Fields that another stage already decided are `None` here (unset) and are inherited when the config is resolved
(`kit.train.resolve.resolve`, which also checks the inputs): sequence length, tokenizer, chat template and pack mode from notebook 02's
prepared-data manifest; TP, PP, layer list and padded vocabulary from notebook 03's converted-checkpoint manifest.
Precedence: a value given explicitly (notebook parameter, constructor keyword, command-line option) > an
environment variable of the manual's table (section "Step1 配置预训练超参") > the manifest > the default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from kit.core.workspace import LORA_TARGETS, RUN_TYPES
from kit.errors import InputError, ParameterError

ENGINES = ("deepspeed", "megatron")

# The manual's table (ModelArts user manual, section "Step1 配置预训练超参"): these names are read from the
# environment exactly as the AscendCloud shell scripts read them (`MODEL_TYPE=GLM3-6B RUN_TYPE=pretrain ... sh
# scripts/glm3/glm3_base.sh`). MODEL_TYPE is the manual's name for the workspace model folder (model_name here).
MANUAL_ENV = {
    "MODEL_TYPE": "model_name",
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
    # the launch variables of the manual's multi-node scripts ("Step2 启动训练脚本") and torchrun's own names
    "MASTER_PORT": "master_port",
    "NPROC_PER_NODE": "nproc_per_node",
}
# inherited from the prepared-data manifest (field -> manifest field) and the converted-checkpoint manifest
FROM_DATA = {"seq_len": "max_length", "tokenizer_path": "tokenizer", "template": "template", "pack": "pack"}
FROM_CHECKPOINT = {
    "tp": "tp",
    "pp": "pp",
    "num_layer_list": "num_layer_list",
    "padded_vocab_size": "padded_vocab_size",
}
# what an inheritable field becomes when nothing sets it
INHERITED_DEFAULTS = {
    "dataset_path": None,
    "model_path": None,
    "tokenizer_path": None,
    "seq_len": None,
    "template": None,
    "pack": None,
    "tp": 1,
    "pp": 1,
    "num_layer_list": None,
    "padded_vocab_size": None,
}


@dataclass(init=False)
class TrainConfig:
    """One training run: the manual's names (lower-case here, upper-case in env/notebooks) and the trainer's knobs."""

    run_type: str = "sft"
    """pretrain | retrain (resume the latest checkpoint) | sft | lora | dpo (preference pairs, docs/train.md)."""
    resume_from: str = "pretrain"
    """Retrain only: the run folder to resume (pretrain | sft | lora | dpo)"""
    model_name: str = "demo"
    """The workspace model folder (saved_dir_for_ma_output/<name>); env MODEL_TYPE."""
    dataset_path: Optional[str] = None
    """Notebook 02's prepared-data folder; None: the workspace's, or the sample."""
    model_path: Optional[str] = None
    """HF folder (or, ENGINE megatron, notebook 03's converted checkpoint); None: demo."""
    tokenizer_path: Optional[str] = None
    """Tokenizer folder; None: the one the data was prepared with."""
    seq_len: Optional[int] = None
    """Tokens per sample; None: the length the data was prepared (packed) for."""
    template: Optional[str] = None
    """Chat template of SFT data; None: the data's (a different one is an error)"""
    pack: Optional[bool] = None
    """Packed SFT rows; None: the data's (a different one is an error)"""
    train_iters: int = 200
    """Optimizer steps in total (retrain: the new total, counted from iteration 0)"""
    mbs: int = 1
    """Micro batch size per card."""
    gbs: int = 64
    """Global batch size: samples per optimizer step over all cards."""
    tp: Optional[int] = None
    """Tensor parallel size; None: the converted checkpoint's, else 1."""
    pp: Optional[int] = None
    """Pipeline parallel size; None: the converted checkpoint's, else 1."""
    num_layer_list: Optional[List[int]] = None
    """Layers per pipeline stage, e.g. [7,8,8,7]; None: the checkpoint's."""
    padded_vocab_size: Optional[int] = None
    """Megatron's padded vocabulary; None: the converted checkpoint's."""
    master_addr: str = "localhost"
    """Address of node 0 (multi-node)"""
    nnodes: int = 1
    """Number of nodes."""
    node_rank: int = 0
    """This node's index, 0-based."""
    work_dir: str = ""
    """The `${workdir}` root; empty = the kit's default workspace."""
    nproc_per_node: int = 1
    """Processes (cards) per node; world size = nnodes * nproc_per_node."""
    master_port: int = 0
    """Rendezvous port; 0 = a free one (one node) or 6000 (several nodes: same on each)"""
    engine: str = "deepspeed"
    """deepspeed (kit trainer) | megatron (AscendCloud / MindSpeed-LLM scripts)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3."""
    dtype: str = "auto"
    """auto (bf16 where the card has it, fp16 on other accelerators, fp32 on CPU) | bfloat16 | float16 | float32."""
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_iters: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm (0 = off)"""
    seed: int = 1234
    """Random number generator seed (data order, initialisation of LoRA)"""
    save_interval: int = 0
    """Checkpoint every N steps (0 = only at the end, on SIGTERM)"""
    log_interval: int = 1
    """Print a Megatron-style line every N steps."""
    eval_every: int = 50
    """Held-out loss every N steps and at the last (on up to 32 rows of the data's held-out split; 0 = off)."""
    adapt: bool = True
    """Patch the model with kit ops (kit.adapt.adapt_model): fused NPU attention/norm/SwiGLU."""
    recompute: bool = False
    """Recompute each layer's activations in the backward instead of keeping them (HF gradient checkpointing;
    Megatron --recompute-granularity full): about a third more compute for far less activation memory (kit plan)."""
    lora_r: int = 8
    """LoRA rank (RUN_TYPE lora)"""
    lora_alpha: int = 16
    """LoRA alpha."""
    lora_dropout: float = 0.0
    """LoRA dropout."""
    lora_targets: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Modules that get LoRA adapters."""
    dpo_beta: float = 0.1
    """DPO: beta, how far the model may move from the reference (larger: closer to it)."""
    dpo_label_smoothing: float = 0.0
    """DPO: the share of pairs assumed mislabelled (cDPO), 0 <= x < 0.5."""
    dpo_sft_weight: float = 0.0
    """DPO: weight of an SFT term (mean negative log-probability of the chosen answers' tokens) added to the loss."""
    dpo_reference: str = "auto"
    """DPO reference: auto (LoRA: adapters off; full: precompute) | precompute | copy (a frozen copy in memory)."""
    dpo_lora: bool = False
    """DPO: train LoRA adapters (LORA_* settings) instead of every weight."""
    router_aux_loss_coef: Optional[float] = None
    """MoE models: weight of the router's load-balancing loss in the training loss (None: the model's own
    router_aux_loss_coef; 0: off)."""
    save_hf: bool = True
    """At the end, save a plain HF folder (LoRA: merged weights) beside the checkpoints."""
    overwrite: bool = False
    """Allow starting over into an output folder that already holds checkpoints."""
    clean_partial: bool = False
    """Delete leftovers of killed runs (.partial-iter_*, .hf.partial-*) in the run folder (else only reported)."""
    obs_home: str = ""
    """obs://bucket/prefix: checkpoints uploaded there in the background, retrain resumes from there (docs/obs.md)"""
    sources: Dict[str, str] = field(default_factory=dict)
    """Set by resolve(): field -> where its value came from."""

    def __init__(self, **values: Any):
        # Keyword-only, so the config knows which fields were given (explicit) and which are defaults: the
        # environment and the manifests may fill only the latter. `model_type=` (the manual's MODEL_TYPE) is
        # accepted as model_name.
        if "model_type" in values:
            if "model_name" in values and values["model_name"] != values["model_type"]:
                raise ParameterError("give model_name or model_type (the same setting), not both.")
            values["model_name"] = values.pop("model_type")
        known = {f.name: f for f in fields(TrainConfig)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ParameterError(
                f"unknown training parameter(s) {[u.upper() for u in unknown]}; allowed: "
                f"{sorted(n.upper() for n in known if n != 'sources')}"
            )
        for name, f in known.items():
            if name in values:
                value = values[name]
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                value = f.default_factory()  # type: ignore[misc]
            else:
                value = f.default
            setattr(self, name, value)
        self.__dict__["_given"] = frozenset(n for n in values if n != "sources")

    @property
    def given(self) -> frozenset:
        """The fields set explicitly when this config was made (the rest are defaults or inheritable)."""
        return self.__dict__.get("_given", frozenset())

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def lora(self) -> bool:
        """Whether the run trains LoRA adapters (RUN_TYPE lora, or dpo with DPO_LORA)."""
        return self.run_type == "lora" or (self.run_type == "dpo" and bool(self.dpo_lora))

    @property
    def world_size(self) -> int:
        return max(1, self.nnodes) * max(1, self.nproc_per_node)

    @property
    def dp(self) -> int:
        return max(1, self.world_size // max(1, (self.tp or 1) * (self.pp or 1)))

    @property
    def grad_accum(self) -> int:
        return max(1, self.gbs // max(1, self.mbs * self.dp))

    def workspace(self):
        """The workspace this run reads from and writes to (WORK_DIR, MODEL_NAME)."""
        from kit.core.workspace import get_workspace

        return get_workspace(self.work_dir or None, model=self.model_name)

    def output_dir(self) -> Path:
        """saved_dir_for_ma_output/<MODEL_NAME>/<pretrain|sft|lora> (retrain: RESUME_FROM's folder)."""
        return self.workspace().output(self.resume_from if self.run_type == "retrain" else self.run_type)

    def log_dir(self) -> Path:
        return self.workspace().logs

    # ---- validation -----------------------------------------------------------------------------------------
    def problems(self) -> list:
        """Every problem with these settings, each naming the value, what is allowed and what to do (no file is
        read: the inputs are checked once, by kit.train.resolve)."""
        p = []
        tp, pp = self.tp or 1, self.pp or 1
        if self.run_type not in RUN_TYPES:
            p.append(f"RUN_TYPE={self.run_type!r} is not one of {', '.join(RUN_TYPES)}.")
        if self.run_type == "retrain" and self.resume_from not in ("pretrain", "sft", "lora", "dpo"):
            p.append(f"RESUME_FROM={self.resume_from!r} is not one of pretrain, sft, lora, dpo.")
        if self.run_type == "dpo":
            p.extend(_dpo_problems(self))
        if self.engine not in ENGINES:
            p.append(f"ENGINE={self.engine!r} is not one of {', '.join(ENGINES)}.")
        for name in ("train_iters", "mbs", "gbs", "nnodes", "nproc_per_node", "log_interval"):
            if int(getattr(self, name)) < 1:
                p.append(f"{name.upper()}={getattr(self, name)} must be >= 1.")
        for name in ("tp", "pp", "seq_len"):
            value = getattr(self, name)
            if value is not None and int(value) < 1:
                p.append(f"{name.upper()}={value} must be >= 1 (or None to inherit it).")
        for name in ("save_interval", "eval_every", "warmup_iters", "master_port", "node_rank"):
            if int(getattr(self, name)) < 0:
                p.append(f"{name.upper()}={getattr(self, name)} must be >= 0.")
        if self.nnodes >= 1 and not 0 <= self.node_rank < self.nnodes:
            p.append(f"NODE_RANK={self.node_rank} must be in 0..NNODES-1 (NNODES={self.nnodes}).")
        if self.nnodes > 1 and not self.master_addr:
            # a loopback address is allowed: every node on this host, a rehearsal of the job (docs/train.md)
            p.append(
                f"NNODES={self.nnodes} needs MASTER_ADDR set to node 0's address (got {self.master_addr!r})."
            )
        if tp >= 1 and pp >= 1 and self.world_size % (tp * pp):
            p.append(
                f"world size {self.world_size} (NNODES={self.nnodes} x NPROC_PER_NODE={self.nproc_per_node}) is "
                f"not divisible by TP x PP = {tp} x {pp}; change TP/PP or the number of cards."
            )
        if self.mbs >= 1 and self.gbs >= 1 and self.gbs % (self.mbs * self.dp):
            p.append(
                f"GBS={self.gbs} is not divisible by MBS x DP = {self.mbs} x {self.dp}; "
                f"use GBS = a multiple of {self.mbs * self.dp}."
            )
        if self.engine == "deepspeed" and (tp != 1 or pp != 1):
            p.append(
                f"TP={tp}, PP={pp}: the kit's DeepSpeed engine is data-parallel only (TP=PP=1); "
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
        if self.lora and (
            self.lora_r < 1 or self.lora_alpha < 1 or not self.lora_targets or not 0 <= self.lora_dropout < 1
        ):
            p.append(
                f"LoRA needs LORA_R >= 1, LORA_ALPHA >= 1, 0 <= LORA_DROPOUT < 1 and LORA_TARGETS non-empty "
                f"(got {self.lora_r}, {self.lora_alpha}, {self.lora_dropout}, {self.lora_targets})."
            )
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            p.append(
                f"ROUTER_AUX_LOSS_COEF={self.router_aux_loss_coef} must be >= 0 (0 turns the router's "
                "auxiliary loss off; None takes the model's router_aux_loss_coef)."
            )
        if self.obs_home and not (self.obs_home.startswith("obs://") and self.obs_home[6:].strip("/")):
            p.append(
                f"OBS_HOME={self.obs_home!r} is not an OBS prefix; write obs://<bucket>/<prefix> (or leave it empty)."
            )
        if not self.model_name:
            p.append("MODEL_NAME (the manual's MODEL_TYPE) is required: the model's folder in the workspace.")
        return p

    def to_dict(self) -> dict:
        """Every field as plain JSON values (what config.json and the training-run manifest hold)."""
        from kit.core.configs import to_jsonable

        return to_jsonable(self)


def _dpo_problems(cfg: TrainConfig) -> list:
    from kit.train.dpo import REFERENCES

    p = []
    if cfg.engine == "megatron":  # MindSpeed-LLM's --stage dpo: what it cannot run as the kit defines it
        from kit.train.megatron_dpo import setting_problems

        p.extend(setting_problems(cfg))
    if not cfg.dpo_beta > 0:
        p.append(f"DPO_BETA={cfg.dpo_beta} must be > 0 (0.1 is usual).")
    if not 0 <= cfg.dpo_label_smoothing < 0.5:
        p.append(f"DPO_LABEL_SMOOTHING={cfg.dpo_label_smoothing} must be in [0, 0.5).")
    if not cfg.dpo_sft_weight >= 0:
        p.append(f"DPO_SFT_WEIGHT={cfg.dpo_sft_weight} must be >= 0.")
    if cfg.dpo_reference not in REFERENCES:
        p.append(f"DPO_REFERENCE={cfg.dpo_reference!r} is not one of {', '.join(REFERENCES)}.")
    elif cfg.dpo_reference == "adapters_off" and not cfg.lora:
        p.append(
            "DPO_REFERENCE='adapters_off' needs DPO_LORA=True; full training uses 'precompute' or 'copy'."
        )
    return p


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """A copy with `changes`, keeping which fields were given (dataclasses.replace would mark every field given,
    so the environment and the manifests could no longer fill the unset ones)."""
    values = {n: getattr(cfg, n) for n in cfg.given}
    values.update(changes)
    if cfg.sources:
        values["sources"] = {k: v for k, v in cfg.sources.items() if k not in changes}
    return TrainConfig(**values)


def coerce(name: str, raw: str) -> Any:
    """A field's value from its text (environment variable or `--set KEY=VALUE`), typed as the field."""
    import typing

    from kit.core.configs import _field_kind, _parse_value

    hint = typing.get_type_hints(TrainConfig)[name]
    kind = _field_kind(hint)
    if kind[0] is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if raw.strip().lower() in ("none", "null") and name in INHERITED_DEFAULTS:
        return None
    return _parse_value(raw, kind)


def from_dict(values: Mapping[str, Any], where: str = "config") -> TrainConfig:
    """A TrainConfig from saved values (config.json / a manifest's `config`); unknown keys are an error."""
    names = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(values) - names - {"model_type"})
    if unknown:
        raise InputError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
    return TrainConfig(**dict(values))


def load_config(path: Union[str, Path]) -> TrainConfig:
    """Read a config.json written by the trainer (unknown keys are an error, so typos are caught)."""
    return from_dict(json.loads(Path(path).read_text(encoding="utf-8")), str(path))


def from_manifest(run: Any) -> TrainConfig:
    """The resolved TrainConfig of a training run: give its folder, or its Manifest (`read_manifest(...)`)."""
    from kit.core.manifest import TRAINING_RUN, Manifest, read_manifest

    man = run if isinstance(run, Manifest) else read_manifest(run, expect=TRAINING_RUN)
    if man.kind != TRAINING_RUN:
        raise InputError(
            f"{man.folder} is a {man.kind} folder; expected a training-run folder (notebook 04)."
        )
    return from_dict(man["config"] or {}, f"{man.folder} manifest config")
