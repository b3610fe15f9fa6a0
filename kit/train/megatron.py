"""The Megatron / MindSpeed-LLM path: the AscendCloud script (the manual's variables) or a `pretrain_gpt.py` command.

Built from the resolved TrainConfig and the inputs' manifests, never from hand-built names: the data prefix and the
flags the data needs (`--reset-attention-mask --neat-pack` for packed SFT) come from notebook 02's prepared-data
manifest; TP, PP, the layer list, the padded vocabulary and the architecture flags from notebook 03's
converted-checkpoint manifest (or, for an HF folder, its model facts through `kit.convert.model_facts`); the TP/PP
rules from `kit.core.parallel`, the same ones conversion applies. It cannot run on a machine without the AscendCloud code
package and NPUs, so `execute` refuses with the reason. Facts: the ModelArts user manual, sections "Step1
配置预训练超参" / "Step2 启动训练脚本" (variables, commands); MindSpeed-LLM example scripts (flags, environment).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from kit.train.config import MANUAL_ENV, TrainConfig
from kit.train.resolve import TrainPlan

# MindSpeed-LLM example scripts export these for every NPU job.
SCRIPT_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "HCCL_CONNECT_TIMEOUT": "3600",
    "HCCL_EXEC_TIMEOUT": "3600",
}
# The fused-kernel and runtime flags of the MindSpeed-LLM example scripts (the architecture flags come from the
# model facts: kit.convert.manifests.architecture_flags).
NPU_FLAGS = [
    "--use-flash-attn",
    "--use-fused-rmsnorm",
    "--use-fused-swiglu",
    "--use-fused-rotary-pos-emb",
    "--no-masked-softmax-fusion",
    "--attention-softmax-in-fp32",
    "--no-gradient-accumulation-fusion",
    "--ckpt-format",
    "torch",
    "--transformer-impl",
    "local",
]
# RECOMPUTE: every layer recomputed in the backward (Megatron-LM arguments.py; what kit plan's "+ recompute" plans are)
RECOMPUTE_FLAGS = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]


@dataclass
class MegatronPlan:
    """A command to run, its environment additions, where it runs, and every problem found on the way."""

    argv: list
    env: dict
    cwd: Path
    mode: str  # script | pretrain_gpt
    problems: list = field(default_factory=list)

    def describe(self) -> str:
        """The shell line a user could paste on the node (variables first, as in the manual's "Step2 启动训练脚本")."""
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in self.env.items())
        text = f"cd {shlex.quote(str(self.cwd))} && {env} {' '.join(shlex.quote(a) for a in self.argv)}"
        if self.problems:
            text += "\n" + "\n".join(f"  problem: {p}" for p in self.problems)
        return text


def data_problems(facts: dict, where: str) -> List[str]:
    """The Megatron files the data manifest names must exist (prefix.bin/.idx, or the `_packed_*` files of SFT)."""
    prefix = facts.get("megatron_prefix")
    if not prefix:
        return [
            f"{where} has no Megatron files (megatron_prefix is empty); prepare the data in notebook 02 with "
            f"MEGATRON=True."
        ]
    folder, name = Path(prefix).parent, Path(prefix).name
    if not any(folder.glob(name + "*.bin")) or not any(folder.glob(name + "*.idx")):
        return [
            f"the Megatron data files {prefix}*.bin/.idx named by {where} are missing; prepare the data again."
        ]
    return []


def checkpoint_problems(load: Optional[str], tp: int, pp: int, ep: int = 1) -> list:
    """A converted checkpoint must have the tracker file and exactly the TP x PP (x EP) rank folders of this run."""
    if not load:
        return []
    from kit.convert.megatron_layout import TRACKER, rank_dir

    tracker = Path(load) / TRACKER
    if not tracker.is_file():
        return [f"--load {load} has no {TRACKER}; convert the HF weights in notebook 03 (TP={tp}, PP={pp})."]
    text = tracker.read_text().strip()
    it_dir = Path(load) / ("release" if text == "release" else f"iter_{int(text):07d}")
    have = sorted(p.name for p in it_dir.glob("mp_rank_*")) if it_dir.is_dir() else []
    want = sorted(rank_dir(t, p, pp, e, ep) for t in range(tp) for p in range(pp) for e in range(ep))
    if have != want:
        layout = f"TP={tp}, PP={pp}" + (f", EP={ep}" if ep > 1 else "")
        return [
            f"{it_dir} has rank folders {have[:6]}{'...' if len(have) > 6 else ''} but {layout} "
            f"needs {want[:6]}{'...' if len(want) > 6 else ''}; convert again with the training TP/PP/EP."
        ]
    return []


def _model(cfg: TrainConfig) -> tuple:
    """(model facts, converted-checkpoint manifest or None, flavor) of MODEL_PATH."""
    from kit.convert import model_facts
    from kit.train.resolve import _converted

    ckpt = _converted(cfg.model_path)
    facts = dict(ckpt["model"]) if ckpt is not None else model_facts(cfg.model_path)
    return facts, ckpt, (ckpt.get("flavor") if ckpt is not None else "local") or "local"


def _router_aux_coef(flags: List[str], facts: dict, coef: Optional[float]) -> tuple:
    """(flags, problems): an explicit ROUTER_AUX_LOSS_COEF replaces the converted model's --moe-aux-loss-coeff (the
    HF path's one setting, read by both engines); on a model without experts it is a contradiction."""
    if coef is None:
        return flags, []
    if not facts.get("num_experts"):
        return flags, [
            f"ROUTER_AUX_LOSS_COEF={coef} is set, but this model has no experts (it is for MoE models only)."
        ]
    flags = list(flags)
    if "--moe-aux-loss-coeff" in flags:
        flags[flags.index("--moe-aux-loss-coeff") + 1] = str(float(coef))
    else:
        flags += ["--moe-aux-loss-coeff", str(float(coef))]
    # the sigmoid router's loss is DeepSeek-V3's sequence-wise one (kit.convert.manifests._balance_flags)
    if facts.get("moe_router_score_function") == "sigmoid" and "--seq-aux" not in flags:
        flags.append("--seq-aux")
    return flags, []


def _dense_stage_problems(flags: List[str], num_layers: int, pp: int) -> List[str]:
    """MindSpeed-LLM refuses a pipeline stage of dense layers only: --first-k-dense-replace must stay below
    num_layers // PP (mindspeed_llm/features_manager/transformer/transformer_block.py)."""
    if pp <= 1 or "--first-k-dense-replace" not in flags:
        return []
    k = int(flags[flags.index("--first-k-dense-replace") + 1])
    if k < num_layers // pp:
        return []
    return [
        f"PP={pp}: this model's first {k} layer(s) are dense and {num_layers} layers over {pp} stages give "
        f"{num_layers // pp} a stage, so one would hold dense layers only, which MindSpeed-LLM refuses; convert in "
        f"notebook 03 with a PP of at most {max(1, num_layers // (k + 1))}."
    ]


def build(
    plan: TrainPlan,
    code_dir: Optional[str] = None,
    script: Optional[str] = None,
    nproc_per_node: Optional[int] = None,
) -> MegatronPlan:
    """The AscendCloud script command (if `script` is given) or a torchrun `pretrain_gpt.py` command for a run
    resolved with ENGINE megatron (kit.train.resolve), validated.

    MODEL_PATH: notebook 03's converted checkpoint (loaded with --load; TP/PP/layer list/padded vocabulary inherited
    from it), or an HF folder (architecture only: pretraining from scratch). DATASET_PATH: notebook 02's folder.
    """
    from kit.convert.manifests import architecture_flags
    from kit.core.parallel import layer_list_flag, parallel_problems

    cfg = plan.cfg
    problems: List[str] = cfg.problems()
    if cfg.engine != "megatron":
        problems.append(
            f"ENGINE={cfg.engine!r}: the Megatron command is built for a run resolved with ENGINE megatron."
        )
    ws = cfg.workspace()
    code = Path(code_dir) if code_dir else ws.llm_train / "AscendSpeed"
    nproc = nproc_per_node or cfg.nproc_per_node
    if not code.is_dir():
        problems.append(
            f"code folder {code} does not exist: unzip the AscendCloud-3rdLLM package into WORK_DIR (ModelArts user "
            f'manual, section "上传代码到工作环境"); this path cannot run without it and NPUs.'
        )
    facts_data = plan.data
    problems += data_problems(facts_data, str(cfg.dataset_path))
    prefix = facts_data.get("megatron_prefix") or ""
    if script:
        # the manual's table; the scripts choose their own port and cards per node
        env = {
            name: str(getattr(cfg, attr))
            for name, attr in MANUAL_ENV.items()
            if name not in ("MASTER_PORT", "NPROC_PER_NODE")
        }
        env.update(WORK_DIR=str(ws.root), DATASET_PATH=prefix, TOKENIZER_PATH=str(cfg.tokenizer_path or ""))
        if not env["TOKENIZER_PATH"]:
            problems.append(
                "TOKENIZER_PATH is required by the scripts: the tokenizer folder the data was made with."
            )
        if cfg.nnodes == 1:  # the manual: MASTER_ADDR / NNODES / NODE_RANK are for multi-node runs only
            for key in ("MASTER_ADDR", "NNODES", "NODE_RANK"):
                env.pop(key)
        if not (code / script).is_file():
            problems.append(f"script {code / script} does not exist (e.g. scripts/glm3/glm3_base.sh).")
        return MegatronPlan(["sh", script], env, code, "script", problems)

    facts, ckpt, flavor = _model(cfg)
    # EP is the converted checkpoint's (its rank folders hold num_experts / EP experts each); 1 for dense models
    ep = int((ckpt.get("ep") if ckpt is not None else None) or 1)
    problems += parallel_problems(
        facts,
        int(cfg.tp),
        int(cfg.pp),
        cfg.num_layer_list,
        cfg.padded_vocab_size,
        flavor=flavor,
        ep=ep,
        world_size=cfg.world_size if facts.get("num_experts") else None,
    )
    load = str(ckpt.folder) if ckpt is not None else None
    problems += checkpoint_problems(load, int(cfg.tp), int(cfg.pp), ep)
    finetune = cfg.run_type in ("sft", "lora", "dpo")
    if cfg.run_type == "dpo":
        from kit.train.megatron_dpo import data_kind_problems

        problems += data_kind_problems(facts_data, str(cfg.dataset_path))
    if cfg.run_type == "retrain" and cfg.resume_from == "dpo":
        problems.append(
            "resuming a DPO run is not built for ENGINE='megatron' (MindSpeed-LLM's reference would need "
            "--refer-model-iter of the starting checkpoint); start the DPO run again, or use ENGINE='deepspeed'."
        )
    if finetune and ckpt is None:
        problems.append(
            f"MODEL_PATH={cfg.model_path!r} is an HF folder; fine-tuning with Megatron loads converted weights: "
            f"convert it in notebook 03 (TP={cfg.tp}, PP={cfg.pp}) and give that folder."
        )
    # the converter's own statement of what a run loading it must be told; else the same from the model facts
    model_flags = list((ckpt.get("megatron_flags") if ckpt is not None else None) or [])
    if not model_flags:
        model_flags = architecture_flags(facts, cfg.padded_vocab_size)
        listed = layer_list_flag(cfg.num_layer_list)
        model_flags += ["--num-layer-list", listed] if listed else []
        model_flags += ["--use-mcore-models"] if flavor != "legacy" else []
    model_flags, aux_problem = _router_aux_coef(model_flags, facts, cfg.router_aux_loss_coef)
    problems += aux_problem + _dense_stage_problems(
        model_flags, int(facts.get("num_layers") or 0), int(cfg.pp)
    )
    entry = "posttrain_gpt.py" if finetune else "pretrain_gpt.py"
    if code.is_dir() and not (code / "ModelLink" / entry).is_file() and not (code / entry).is_file():
        problems.append(f"{entry} is in neither {code} nor {code / 'ModelLink'}.")
    save = cfg.output_dir()
    argv = [
        "torchrun",
        f"--nproc_per_node={nproc}",
        f"--nnodes={cfg.nnodes}",
        f"--node_rank={cfg.node_rank}",
        f"--master_addr={cfg.master_addr}",
        f"--master_port={cfg.master_port or 6000}",
        entry,
        "--tensor-model-parallel-size", str(cfg.tp),
        "--pipeline-model-parallel-size", str(cfg.pp),
        *(["--expert-model-parallel-size", str(ep)] if facts.get("num_experts") else []),
        "--micro-batch-size", str(cfg.mbs),
        "--global-batch-size", str(cfg.gbs),
        "--seq-length", str(cfg.seq_len),
        "--train-iters", str(cfg.train_iters),
        "--lr", str(cfg.lr),
        "--min-lr", str(cfg.min_lr),
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(cfg.warmup_iters),
        "--weight-decay", str(cfg.weight_decay),
        "--clip-grad", str(cfg.clip_grad),
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--seed", str(cfg.seed),
        *model_flags,
        *(RECOMPUTE_FLAGS if cfg.recompute else []),
        *NPU_FLAGS,
        "--tokenizer-type", "PretrainedFromHF",
        "--tokenizer-name-or-path", str(cfg.tokenizer_path or ""),
        "--data-path", prefix,
        *list(facts_data.get("megatron_flags") or []),
        "--split", "100,0,0",
        "--save", str(save),
        "--save-interval", str(cfg.save_interval or cfg.train_iters),
        "--log-interval", str(cfg.log_interval),
        "--eval-iters", "0",
        "--distributed-backend", "nccl",
    ]  # fmt: skip
    dtype = cfg.dtype
    if dtype == "auto":
        # the device's choice: Ascend 910A has no bf16 (kit.system.device asks torch.npu.is_bf16_supported()); on a
        # machine without an accelerator the plan gets neither flag (fp32), never a bf16 the card may lack
        from kit.system.device import detect

        dtype = detect().dtype
    if dtype == "bfloat16":
        argv.append("--bf16")
    elif dtype == "float16":
        argv.append("--fp16")
    load_dir = load or (str(save) if cfg.run_type == "retrain" else None)
    if load_dir:
        argv += ["--load", load_dir]
        if cfg.run_type != "retrain":
            argv += ["--no-load-optim", "--no-load-rng"]  # converted weights carry no optimizer state
    if cfg.run_type == "dpo":  # MindSpeed-LLM's --stage dpo (kit.train.megatron_dpo)
        from kit.train.megatron_dpo import dpo_flags

        argv += dpo_flags(cfg, load)
    elif finetune:
        argv += ["--finetune", "--stage", "sft", "--is-instruction-dataset"]
    if cfg.lora:
        argv += [
            "--lora-r", str(cfg.lora_r),
            "--lora-alpha", str(cfg.lora_alpha),
            "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
        ]  # fmt: skip
    cwd = code / "ModelLink" if (code / "ModelLink").is_dir() else code
    return MegatronPlan([str(a) for a in argv], dict(SCRIPT_ENV), cwd, "pretrain_gpt", problems)


def execute(plan: MegatronPlan, log_file: Optional[Path] = None) -> int:
    """Run the plan on this node (streams to `log_file` too); refuses while there are problems. SIGTERM/SIGINT
    to this process stop it (kit.system.procs.running: SIGTERM, then a kill), leaving no process behind."""
    from kit.system.procs import running

    if plan.problems:
        raise RuntimeError("the Megatron command has problems; fix them first:\n" + "\n".join(plan.problems))
    env = dict(os.environ)
    env.update(plan.env)
    with open(log_file or os.devnull, "a", encoding="utf-8") as log:

        def note(text: str) -> None:
            print(f"kit: {text}", flush=True)
            log.write(f"kit: {text}\n")

        with running(plan.argv, env=env, cwd=str(plan.cwd)) as proc:
            for line in proc.lines(note):
                print(line, end="", flush=True)
                log.write(line)
        return proc.returncode
