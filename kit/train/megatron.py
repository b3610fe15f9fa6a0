"""The Megatron / MindSpeed-LLM path: the AscendCloud script (seed's variables) or a `pretrain_gpt.py` command.

Built and validated here from the same TrainConfig; it cannot run on a machine without the AscendCloud code
package and NPUs, so `execute` refuses with the reason. Facts: seed 002 (Step1/Step2 table and commands),
npu_anchors.md 1.3-1.6 (data prefixes, script skeleton, flags) and 7.18-7.19 (data naming, checkpoint layout).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kit.train.config import SEED_ENV, TrainConfig

# MindSpeed-LLM scripts export these for every NPU job (npu_anchors.md 1.6).
SCRIPT_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "HCCL_CONNECT_TIMEOUT": "3600",
    "HCCL_EXEC_TIMEOUT": "3600",
}
# The Llama-style flag set the MindSpeed-LLM example scripts pass (npu_anchors.md 1.6).
LLAMA_FLAGS = [
    "--use-mcore-models",
    "--use-flash-attn",
    "--use-fused-rmsnorm",
    "--use-fused-swiglu",
    "--use-fused-rotary-pos-emb",
    "--no-masked-softmax-fusion",
    "--attention-softmax-in-fp32",
    "--no-gradient-accumulation-fusion",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--disable-bias-linear",
    "--make-vocab-size-divisible-by",
    "1",
    "--ckpt-format",
    "torch",
    "--transformer-impl",
    "local",
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
        """The shell line a user could paste on the node (variables first, like the seed's Step2)."""
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in self.env.items())
        text = f"cd {shlex.quote(str(self.cwd))} && {env} {' '.join(shlex.quote(a) for a in self.argv)}"
        if self.problems:
            text += "\n" + "\n".join(f"  problem: {p}" for p in self.problems)
        return text


def megatron_prefix(dataset_path: str) -> str:
    """The Megatron data prefix beside a kit `<name>_hf` folder (pretrain: `<name>_text_document`, SFT: `<name>`)."""
    folder = Path(dataset_path)
    meta = folder / "meta.json"
    if not (folder.name.endswith("_hf") and meta.is_file()):
        return dataset_path  # already a prefix
    name = str(folder)[: -len("_hf")]
    kind = json.loads(meta.read_text(encoding="utf-8")).get("kind")
    return name + "_text_document" if kind == "pretrain" else name


def data_problems(cfg: TrainConfig) -> list:
    """Megatron data naming: pretrain `<name>_text_document(.bin/.idx)`, SFT the bare prefix with `_packed_*`."""
    prefix = cfg.dataset_path
    if not prefix:
        return [
            "DATASET_PATH is required: the Megatron data prefix from notebook 02 (e.g. .../alpaca_text_document)."
        ]
    if cfg.run_type == "pretrain" or (cfg.run_type == "retrain" and prefix.endswith("_text_document")):
        if not prefix.endswith("_text_document"):
            return [f"DATASET_PATH={prefix!r}: pretraining takes the full `<name>_text_document` prefix."]
        files = [prefix + ".bin", prefix + ".idx"]
    else:
        if prefix.endswith(("_document", ".bin", ".idx")):
            return [
                f"DATASET_PATH={prefix!r}: fine-tuning takes the bare prefix (MindSpeed globs "
                f"`<prefix>_packed_*_document*`), e.g. {prefix.split('_packed_')[0]!r}."
            ]
        files = [
            f"{prefix}_packed_{k}_document.{ext}"
            for k in ("input_ids", "attention_mask", "labels")
            for ext in ("bin", "idx")
        ]
    missing = [f for f in files if not Path(f).is_file()]
    return [f"data file {m} is missing; prepare the data in notebook 02 (megatron=True)." for m in missing]


def checkpoint_problems(load: Optional[str], tp: int, pp: int) -> list:
    """A converted checkpoint must have the tracker file and exactly the TP x PP rank folders of this run."""
    if not load:
        return []
    from kit.convert.megatron_layout import TRACKER, rank_dir

    tracker = Path(load) / TRACKER
    if not tracker.is_file():
        return [f"--load {load} has no {TRACKER}; convert the HF weights in notebook 03 (TP={tp}, PP={pp})."]
    text = tracker.read_text().strip()
    it_dir = Path(load) / ("release" if text == "release" else f"iter_{int(text):07d}")
    have = sorted(p.name for p in it_dir.glob("mp_rank_*")) if it_dir.is_dir() else []
    want = sorted(rank_dir(t, p, pp) for t in range(tp) for p in range(pp))
    if have != want:
        return [
            f"{it_dir} has rank folders {have[:6]}{'...' if len(have) > 6 else ''} but TP={tp}, PP={pp} "
            f"needs {want[:6]}{'...' if len(want) > 6 else ''}; convert again with the training TP/PP."
        ]
    return []


def model_args(model_dir: str) -> tuple:
    """Architecture flags from an HF config.json, and the problems TP/PP would cause with them."""
    conf = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    heads = int(conf["num_attention_heads"])
    kv = int(conf.get("num_key_value_heads", heads))
    args = [
        "--num-layers",
        conf["num_hidden_layers"],
        "--hidden-size",
        conf["hidden_size"],
        "--ffn-hidden-size",
        conf["intermediate_size"],
        "--num-attention-heads",
        heads,
        "--max-position-embeddings",
        conf.get("max_position_embeddings", 4096),
        "--norm-epsilon",
        conf.get("rms_norm_eps", 1e-6),
        "--rotary-base",
        conf.get("rope_theta", 10000),
        "--padded-vocab-size",
        conf["vocab_size"],
    ]
    if kv != heads:
        args += ["--group-query-attention", "--num-query-groups", kv]
    if not conf.get("tie_word_embeddings", False):
        args.append("--untie-embeddings-and-output-weights")
    return [str(a) for a in args], conf


def _parallel_problems(cfg: TrainConfig, conf: dict) -> list:
    p = []
    heads = int(conf["num_attention_heads"])
    kv = int(conf.get("num_key_value_heads", heads))
    if heads % cfg.tp or kv % cfg.tp:
        p.append(f"TP={cfg.tp} must divide the attention heads ({heads}) and KV heads ({kv}).")
    if int(conf["num_hidden_layers"]) % cfg.pp:
        p.append(f"PP={cfg.pp} must divide num_hidden_layers ({conf['num_hidden_layers']}).")
    return p


def build(
    cfg: TrainConfig,
    code_dir: Optional[str] = None,
    script: Optional[str] = None,
    load: Optional[str] = None,
    nproc_per_node: Optional[int] = None,
) -> MegatronPlan:
    """The AscendCloud script command (if `script` is given) or a torchrun `pretrain_gpt.py` command, validated."""
    cfg = dataclasses.replace(cfg, engine="megatron", dataset_path=megatron_prefix(cfg.dataset_path))
    problems = cfg.problems()
    ws = cfg.workspace()
    code = Path(code_dir) if code_dir else ws.llm_train / "AscendSpeed"
    nproc = nproc_per_node or cfg.nproc_per_node
    if not code.is_dir():
        problems.append(
            f"code folder {code} does not exist: unzip the AscendCloud-3rdLLM package into WORK_DIR "
            f"(seed: 上传代码到工作环境); this path cannot run without it and NPUs."
        )
    if script:
        env = {name: str(getattr(cfg, attr)) for name, attr in SEED_ENV.items()}
        env["WORK_DIR"] = str(ws.root)
        env["TOKENIZER_PATH"] = cfg.tokenizer_path or cfg.model_path
        if not env["TOKENIZER_PATH"]:
            problems.append(
                "TOKENIZER_PATH is required by the scripts (seed: 必填): the tokenizer folder, e.g. "
                "<WORK_DIR>/tokenizers/<MODEL_TYPE>."
            )
        if cfg.nnodes == 1:  # the seed: MASTER_ADDR / NNODES / NODE_RANK are for multi-node runs only
            for key in ("MASTER_ADDR", "NNODES", "NODE_RANK"):
                env.pop(key)
        if cfg.seq_len == 0:
            env.pop("SEQ_LEN")  # the script's own default (8192) applies
        if not (code / script).is_file():
            problems.append(f"script {code / script} does not exist (e.g. scripts/glm3/glm3_base.sh).")
        problems += data_problems(cfg)
        return MegatronPlan(["sh", script], env, code, "script", problems)

    arch, conf = (
        model_args(cfg.model_path)
        if cfg.model_path and (Path(cfg.model_path) / "config.json").is_file()
        else ([], None)
    )
    if conf is None:
        problems.append(
            "MODEL_PATH must be the HF folder the checkpoint was converted from (its config.json gives "
            "the architecture flags)."
        )
    else:
        problems += _parallel_problems(cfg, conf)
    problems += data_problems(cfg) + checkpoint_problems(load, cfg.tp, cfg.pp)
    if not cfg.seq_len:
        problems.append("SEQ_LEN is required for Megatron (the data prefixes carry no length).")
    finetune = cfg.run_type in ("sft", "lora")
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
        "--tensor-model-parallel-size",
        str(cfg.tp),
        "--pipeline-model-parallel-size",
        str(cfg.pp),
        "--micro-batch-size",
        str(cfg.mbs),
        "--global-batch-size",
        str(cfg.gbs),
        "--seq-length",
        str(cfg.seq_len),
        "--train-iters",
        str(cfg.train_iters),
        "--lr",
        str(cfg.lr),
        "--min-lr",
        str(cfg.min_lr),
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        str(cfg.warmup_iters),
        "--weight-decay",
        str(cfg.weight_decay),
        "--clip-grad",
        str(cfg.clip_grad),
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--seed",
        str(cfg.seed),
        *arch,
        *LLAMA_FLAGS,
        "--tokenizer-type",
        "PretrainedFromHF",
        "--tokenizer-name-or-path",
        cfg.tokenizer_path or cfg.model_path,
        "--data-path",
        cfg.dataset_path,
        "--split",
        "100,0,0",
        "--save",
        str(save),
        "--save-interval",
        str(cfg.save_interval or cfg.train_iters),
        "--log-interval",
        str(cfg.log_interval),
        "--eval-iters",
        "0",
        "--distributed-backend",
        "nccl",
    ]
    dtype = cfg.dtype
    if dtype == "auto":
        # the device's choice: Ascend 910A has no bf16 (kit.device asks torch.npu.is_bf16_supported()); on a
        # machine without an accelerator the plan gets neither flag (fp32), never a bf16 the card may lack
        from kit.device import detect

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
    if finetune:
        argv += ["--finetune", "--stage", "sft", "--is-instruction-dataset", "--reset-attention-mask"]
    if cfg.run_type == "lora":
        argv += [
            "--lora-r",
            str(cfg.lora_r),
            "--lora-alpha",
            str(cfg.lora_alpha),
            "--lora-target-modules",
            "linear_qkv",
            "linear_proj",
            "linear_fc1",
            "linear_fc2",
        ]
    cwd = code / "ModelLink" if (code / "ModelLink").is_dir() else code
    return MegatronPlan(argv, dict(SCRIPT_ENV), cwd, "pretrain_gpt", problems)


def execute(plan: MegatronPlan, log_file: Optional[Path] = None) -> int:
    """Run the plan on this node (streams to `log_file` too); refuses while there are problems."""
    if plan.problems:
        raise RuntimeError("the Megatron command has problems; fix them first:\n" + "\n".join(plan.problems))
    env = dict(os.environ)
    env.update(plan.env)
    with open(log_file or os.devnull, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(
            plan.argv, cwd=str(plan.cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            print(line, end="")
            log.write(line)
        return proc.wait()
