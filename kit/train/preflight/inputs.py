"""The preflight's inputs from the workspace's manifests: notebook 03's converted checkpoint, notebook 02's data with
Megatron files made with the same tokenizer, and the job every rank is told (plain JSON values)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from kit.core.inputs import Found, Input, newest
from kit.core.manifest import CONVERTED_CHECKPOINT, PREPARED_DATA
from kit.errors import InputError

CHECKPOINT = Input("--checkpoint", CONVERTED_CHECKPOINT)  # notebook 03's output at the planned TP/PP
DATA = Input("--dataset-path", PREPARED_DATA, "with Megatron files")  # notebook 02's, made with its tokenizer


def find_megatron_data(ws: Any, tokenizer_sha256: Optional[str] = None) -> Optional[Found]:
    """The newest prepared-data output of the workspace that has Megatron files (made with this tokenizer, if given)."""

    def fits(man) -> bool:
        theirs = man.get("tokenizer_sha256")
        return bool(man.get("megatron_prefix")) and (
            not tokenizer_sha256 or not theirs or theirs == tokenizer_sha256
        )

    return newest(ws, DATA, fits)


def inputs_missing(cfg) -> Optional[str]:
    """Why the preflight has nothing to run on (no converted checkpoint or Megatron data), or None when it has."""
    try:
        resolve_inputs(cfg)
    except InputError as exc:
        return str(exc)
    return None


def resolve_inputs(cfg):
    """(checkpoint folder, its MegatronReader, data facts, data folder, output folder) of the config."""
    from kit.convert.megatron_io import MegatronReader
    from kit.core.workspace import get_workspace
    from kit.data.prepared import read_prepared
    from kit.train.megatron import data_problems

    ws = get_workspace(cfg.work_dir or None, model=cfg.model_name)
    found = None if cfg.checkpoint else newest(ws, CHECKPOINT)
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint else found and found.folder
    if ckpt is None:
        raise InputError(
            f"no converted checkpoint under {ws.converted_weights}: convert the HF weights in notebook 03 at the "
            f"planned TP/PP, or give --checkpoint."
        )
    from kit.core.manifest import MANIFEST_NAME, read_manifest

    tok = read_manifest(ckpt).get("tokenizer_sha256") if (ckpt / MANIFEST_NAME).is_file() else None
    found = None if cfg.dataset_path else find_megatron_data(ws, tok)
    data = Path(cfg.dataset_path) if cfg.dataset_path else found and found.folder
    if data is None:
        raise InputError(
            f"no prepared data with Megatron files in {ws.model_input}/data: prepare it in notebook 02 with "
            f"MEGATRON=True, or give --dataset-path."
        )
    man = read_prepared(data).manifest  # notebook 02's folder, or the Megatron prefix beside it
    facts = man.fields
    theirs = facts.get("tokenizer_sha256")
    if tok and theirs and tok != theirs:
        raise InputError(
            f"the data {man.folder} was tokenized with another tokenizer (tokenizer_sha256 {theirs[:12]}...) than "
            f"the checkpoint {ckpt} carries ({tok[:12]}...): prepare the data with the model's tokenizer in notebook 02."
        )
    problems = data_problems(facts, str(man.folder))
    if problems:
        raise InputError(problems[0])
    reader = MegatronReader(ckpt)
    out = Path(cfg.output) if cfg.output else ws.reports / "megatron_preflight"
    return ckpt, reader, facts, man.folder, out


def build_job(cfg, reader, facts: dict, out: Path) -> dict:
    """What every rank is told (plain JSON values)."""
    from kit.convert.spec import ModelSpec

    meta = reader.meta or {}
    spec = ModelSpec(**meta["spec"]) if meta.get("spec") else None
    if spec is None:
        raise InputError(
            f"{reader.folder} has no kit_convert.json spec: convert it with notebook 03 (python -m kit convert)."
        )
    _refuse_rope_scaling(spec, reader.folder)
    if spec.position != "rope":
        raise InputError(
            f"{reader.folder} is a {spec.family} model with {spec.position} positions; megatron-core has no "
            f"{spec.position} (only MindSpeed-LLM trains it): the preflight covers RoPE models."
            + (
                " (Convert decided from the HF folder's modeling_baichuan.py, or from the hidden size when it had "
                "none: a RoPE Baichuan2-7B-style model needs its own modeling file there.)"
                if spec.family == "baichuan"
                else ""
            )
        )
    args = reader.args
    kind = facts.get("data_kind") if facts.get("data_kind") in ("sft", "dpo") else "pretrain"
    if kind == "dpo" and spec.family in ("chatglm", "baichuan"):
        raise InputError(
            f"the DPO preflight's HF side is the kit's DPO step on transformers' own model, which has no {spec.family} "
            f"(remote code): run the preflight on SFT or pretraining data for this model."
        )
    if kind == "sft" and not facts.get("pack"):
        raise InputError(
            "the fine-tuning data is not packed; MindSpeed-LLM's packed layout (PACK=True in notebook 02) is what "
            "the preflight reads."
        )
    seq = int(cfg.seq_len or facts.get("max_length") or 0)
    if kind in ("sft", "dpo"):  # packed rows, and pairs cut to it, have the data's length
        if cfg.seq_len and int(cfg.seq_len) != int(facts.get("max_length")):
            raise InputError(
                f"SEQ_LEN={cfg.seq_len} but the {kind} rows are {facts.get('max_length')} tokens long "
                f"(notebook 02's max_length); leave SEQ_LEN unset or prepare the data again."
            )
        seq = int(facts.get("max_length"))
    pad = facts.get("pad_token_id")
    eod = facts.get("eos_token_id")
    data_vocab = int(facts.get("vocab_size") or 0)
    if data_vocab > spec.vocab_size:
        raise InputError(
            f"the data's tokenizer has {data_vocab} tokens but the checkpoint's vocabulary is {spec.vocab_size}: "
            f"they were not made for each other (tokenizer of notebook 02 vs model of notebook 03)."
        )
    tp, pp = reader.tp, reader.pp
    ep, etp, moe = moe_job(spec, args, reader, int(cfg.dp))
    return {
        "checkpoint": str(reader.folder),
        "tp": tp,
        "pp": pp,
        "dp": int(cfg.dp),
        "ep": ep,
        "etp": etp,
        "moe": moe,
        "world": tp * pp * int(cfg.dp),
        "layer_list": reader.layer_list(spec.num_layers),
        "data": {
            "kind": kind,
            "prefix": facts["megatron_prefix"],
            "eod": int(eod if eod is not None else 0),
            "pad": int(pad if pad is not None else (eod or 0)),
        },
        "vocab_size": spec.vocab_size,
        "padded_vocab_size": int(getattr(args, "padded_vocab_size", spec.vocab_size)),
        "seq_len": seq,
        "samples": int(cfg.steps) * int(cfg.dp) * int(cfg.micro_batches) * int(cfg.mbs),
        "steps": int(cfg.steps),
        "micro_batches": int(cfg.micro_batches),
        "mbs": int(cfg.mbs),
        "lr": float(cfg.lr),
        "min_lr": float(cfg.min_lr),
        "warmup_iters": int(cfg.warmup_iters),
        "weight_decay": float(cfg.weight_decay),
        "clip_grad": float(cfg.clip_grad),
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_eps": float(cfg.adam_eps),
        "seed": int(cfg.seed),
        "timeout_s": int(cfg.timeout_s),
        "out": str(out),
        "spec": meta["spec"],
        "dpo": {"beta": float(cfg.dpo_beta), "label_smoothing": float(cfg.dpo_label_smoothing)}
        if kind == "dpo"
        else None,
    }


# what megatron-core 0.16's RotaryEmbedding._apply_scaling fixes (it takes only the factor)
MCORE_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _refuse_rope_scaling(spec, folder) -> None:
    """One line when the checkpoint's rope scaling is not the one megatron-core's GPTModel can build."""
    kind = getattr(spec, "rope_scaling", "")
    if not kind or (kind == "yarn" and getattr(spec, "multi_latent_attention", False)):
        return  # DeepSeek-V3's YaRN: megatron-core's MLA builds it (YarnRotaryEmbedding)
    if kind != "llama3":
        raise InputError(
            f"{folder} uses {kind!r} rope scaling; megatron-core's GPTModel builds only Llama-3.x's llama3 scaling "
            f"(and MLA's yarn)."
        )
    differ = [
        f"{name} {getattr(spec, name)} (megatron-core fixes {want})"
        for name, want in MCORE_LLAMA3.items()
        if float(getattr(spec, name)) != float(want)
    ]
    if differ:
        raise InputError(
            f"{folder} uses llama3 rope scaling with {', '.join(differ)}; megatron-core 0.16's GPTModel takes only "
            f"the factor, so it would train other positions than the checkpoint's."
        )


def bias_update_rate(args) -> float:
    """The checkpoint's --moe-router-bias-update-rate, or Megatron-LM's default (megatron-core's too)."""
    from kit.train.expert_bias import UPDATE_RATE

    return float(getattr(args, "moe_router_bias_update_rate", None) or UPDATE_RATE)


def moe_job(spec, args, reader, dp: int):
    """(EP, expert TP, the MoE facts the ranks and the checks need or None) of a checkpoint; one line when its EP does
    not fit the preflight's TP x PP x DP ranks (kit.core.parallel's rule, the one conversion and training apply)."""
    if not spec.num_experts:
        return 1, reader.tp, None
    from kit.core.parallel import expert_parallel_problems

    world = reader.tp * reader.pp * dp
    problems = expert_parallel_problems(spec.num_experts, reader.ep, reader.tp, reader.pp, world)
    if problems:
        raise InputError(
            f"{reader.folder} is TP{reader.tp} x PP{reader.pp} x EP{reader.ep}; with DP={dp} (--dp) the preflight "
            f"has {world} ranks: {' '.join(problems)}"
        )
    if getattr(args, "moe_grouped_gemm", False):
        raise InputError(
            f"{reader.folder} holds grouped-GEMM experts (TEGroupedMLP keys); the preflight builds megatron-core's "
            f"local SequentialMLP experts (no Transformer Engine on CPU): convert without grouped GEMM."
        )
    sigmoid = getattr(spec, "moe_router_score_function", "softmax") == "sigmoid"
    bias = bool(getattr(spec, "moe_router_enable_expert_bias", False))
    moe = {
        "num_experts": int(spec.num_experts),
        "topk": int(spec.moe_router_topk),
        "aux_loss_coeff": float(spec.moe_aux_loss_coeff),
        "score_function": "sigmoid" if sigmoid else "softmax",
        # megatron-core's name of the loss both sides add: DeepSeek-V3's aux_loss_alpha is sequence-wise (its seq_aux,
        # MindSpeed-LLM's --seq-aux); Qwen3-MoE's router_aux_loss_coef over the micro-batch
        "aux_loss_type": "seq_aux_loss" if sigmoid else "aux_loss",
        # DeepSeek-V3 / GLM-4.5: the score-correction bias both sides move after each step, at Megatron-LM's rate
        "expert_bias_rate": bias_update_rate(args) if bias else None,
        # trained by neither side (transformers has no MTP forward): the ranks carry them through as loaded
        "mtp_layers": int(getattr(spec, "mtp_num_layers", 0) or 0),
        # the checkpoint's own (alltoall, as MindSpeed-LLM's MoE recipes); kit.train.preflight.cpu_patches runs it on gloo
        "dispatcher": getattr(args, "moe_token_dispatcher_type", None) or "alltoall",
    }
    return reader.ep, int(getattr(args, "expert_tensor_parallel_size", None) or reader.tp), moe
