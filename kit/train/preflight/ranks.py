"""One CPU rank of the preflight: megatron-core's GPTModel, pipeline schedule, DDP, DistributedOptimizer and scheduler on
the converted shards, fed by megatron-core's dataset classes; every number it measures goes to `rank_<r>.json`.

Started by kit.train.preflight.run through torchrun as `python -m kit.train.preflight.ranks JOB.json` (gloo, torchrun's
rendezvous; each rank's output goes to `rank_<r>.log`); megatron-core is imported only here, inside
kit.train.preflight.cpu_patches' context.
"""

from __future__ import annotations

import json
import os
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

MTP_PREFIX = "mtp."  # GPTModel's multi-token-prediction block (DeepSeek-V3 / GLM-4.5 checkpoints carry one)


def _quiet() -> None:
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)


def moe_fields(args, job: dict, with_mtp: bool = True) -> dict:
    """TransformerConfig's MoE fields from the checkpoint's args ({} for a dense model): SequentialMLP experts (no
    grouped GEMM on CPU), the router as converted, expert parallelism as the job's EP, and sequence parallelism with
    TP > 1 (megatron-core's MoELayer refuses to train at TP > 1 without it, moe_layer.py `forward`). with_mtp False
    leaves the checkpoint's MTP layers out of the model."""
    from kit.train.preflight.inputs import bias_update_rate

    experts = int(getattr(args, "num_experts", None) or 0)
    if not experts:
        return {}
    return dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=int(args.moe_ffn_hidden_size),
        moe_router_topk=int(args.moe_router_topk),
        # HF's norm_topk_prob=True is softmax over the top-k logits (pre_softmax False); False: softmax, then top-k
        moe_router_pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        # the job's: the sigmoid router's coefficient is DeepSeek-V3's sequence-wise loss (megatron-core's
        # seq_aux_loss), which the converted args (Megatron-LM's names, no --seq-aux) cannot say
        moe_router_load_balancing_type=job["moe"].get("aux_loss_type")
        or getattr(args, "moe_router_load_balancing_type", None)
        or "aux_loss",
        moe_aux_loss_coeff=float(getattr(args, "moe_aux_loss_coeff", 0.0) or 0.0),
        moe_token_dispatcher_type=job["moe"]["dispatcher"],
        moe_grouped_gemm=False,
        moe_layer_freq=list(getattr(args, "moe_layer_freq", None) or [1] * int(args.num_layers)),
        # DeepSeek-V3 / GLM-4.5: sigmoid router with expert bias, grouped top-k, scaling; shared experts; MTP
        moe_router_score_function=getattr(args, "moe_router_score_function", None) or "softmax",
        moe_router_enable_expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        # the checkpoint's --moe-router-bias-update-rate or the default; the HF side moves its biases at the same rate
        moe_router_bias_update_rate=bias_update_rate(args),
        moe_router_topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        moe_router_num_groups=getattr(args, "moe_router_num_groups", None),
        moe_router_group_topk=getattr(args, "moe_router_group_topk", None),
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        mtp_num_layers=getattr(args, "mtp_num_layers", None) if with_mtp else None,
        expert_model_parallel_size=job["ep"],
        expert_tensor_parallel_size=job["etp"],
        sequence_parallel=job["tp"] > 1,
    )


def build_model(args, job: dict, with_mtp: bool = True):
    """GPTModel of this pipeline stage from the checkpoint's own args (fp32, dropout 0, local spec); with_mtp False
    builds it without the checkpoint's MTP layers (the preflight: transformers has no MTP forward to hold them to)."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    pp, layers = job["pp"], job["layer_list"]
    layout = None
    if pp > 1:
        layout = [
            (["embedding"] if i == 0 else []) + ["decoder"] * n + (["loss"] if i == pp - 1 else [])
            for i, n in enumerate(layers)
        ]
    moe = moe_fields(args, job, with_mtp)
    config_class, mla = TransformerConfig, {}
    if getattr(args, "multi_latent_attention", False):  # DeepSeek-V3: MLA with plain or yarn RoPE
        config_class = MLATransformerConfig
        yarn = args.rope_type == "yarn"  # its rotary embedding and the mscale in the softmax scale
        mla = dict(
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            rope_type=args.rope_type,
            rotary_base=args.rotary_base,
            rotary_scaling_factor=float(getattr(args, "rotary_scaling_factor", 1.0) or 1.0) if yarn else 1.0,
            mscale=args.mscale,
            mscale_all_dim=args.mscale_all_dim,
            beta_fast=getattr(args, "beta_fast", 32.0),
            beta_slow=getattr(args, "beta_slow", 1.0),
            original_max_position_embeddings=getattr(args, "original_max_position_embeddings", None) or 4096,
        )
        if yarn:
            mla.update(
                original_max_position_embeddings=int(args.original_max_position_embeddings),
                beta_fast=float(args.beta_fast),
                beta_slow=float(args.beta_slow),
            )
    cfg = config_class(
        **moe,
        **mla,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=getattr(args, "num_query_groups", None) or args.num_attention_heads,
        kv_channels=args.kv_channels,
        layernorm_epsilon=args.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=args.swiglu,
        activation_func=F.silu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        rotary_interleaved=args.rotary_interleaved,
        # Qwen3's per-head q/k RMSNorm; with it finalize_model_grads sums those grads over TP (each rank has some heads)
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        tensor_model_parallel_size=job["tp"],
        pipeline_model_parallel_size=pp,
        pipeline_model_parallel_layout=layout,
        pipeline_dtype=torch.float32,
        batch_p2p_sync=False,  # its torch.cuda.synchronize() (p2p_communication.py l.242) has no CPU meaning
        use_cpu_initialization=True,
        # True although every weight comes from the checkpoint: on the CPU path only the initialiser marks TP-split
        # weights `tensor_model_parallel` (tensor_parallel/layers.py `_initialize_affine_weight_cpu`), and without
        # that mark the grad norm skips TP rank > 0's shards (param_is_not_tensor_parallel_duplicate)
        perform_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    mtp_spec = None
    if moe:  # per layer (MoE block or dense MLP, moe_layer_freq), this stage's layers only
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
        if cfg.mtp_num_layers:  # the MTP layer: the decoder's last layer spec inside MTP's norms and eh_proj
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

            mtp_spec = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=args.rotary_percent,
        rotary_base=int(args.rotary_base),
        # Llama-3.1's llama3 scaling: megatron-core 0.16 takes the factor only (low / high freq factors 1 / 4 and
        # original max positions 8192 fixed in RotaryEmbedding._apply_scaling; kit.train.preflight.inputs refuses others)
        rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(getattr(args, "rotary_scaling_factor", 8.0) or 8.0),
    )
    return model, cfg


def load_check(model, file_model: dict) -> list:
    """Problems of a strict load: missing / unexpected keys and shape differences (megatron's _extra_state aside)."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    problems = [f"missing {k}" for k in sorted(set(own) - set(file_model))]
    problems += [f"unexpected {k}" for k in sorted(set(file_model) - set(own))]
    problems += [
        f"{k} shape {tuple(file_model[k].shape)} but the model has {tuple(v.shape)}"
        for k, v in own.items()
        if k in file_model and tuple(file_model[k].shape) != tuple(v.shape)
    ]
    return problems


def main(rank: int, job: dict) -> None:
    """One rank: run everything inside the CPU patches, write `rank_<r>.json` whatever happens."""
    _quiet()
    out = Path(job["out"])
    result: dict = {"rank": rank, "seconds": {}}
    _lap(result, "start")
    try:
        from kit.train.preflight.cpu_patches import cpu_patched

        with cpu_patched():
            _run(rank, job, result)
    except Exception as exc:  # the parent reports it as the failing check; the traceback stays in the file
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        result["traceback"] = traceback.format_exc()
    result.pop("_t", None)
    (out / f"rank_{rank}.json").write_text(json.dumps(result), encoding="utf-8")


def _run(rank: int, job: dict, result: dict) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.manual_seed(job["seed"])
    out = Path(job["out"])
    _lap(result, "import")
    from kit.train.preflight.batches import read_batches

    batches = read_batches(job, str(out / f"cache_{rank}"))  # before the group: no rank waits on another here
    _lap(result, "data")
    if rank == 0:
        torch.save(batches, out / "batches.pt")
    dist.init_process_group(
        "gloo",  # torchrun's rendezvous (env://)
        rank=rank,
        world_size=job["world"],
        timeout=timedelta(seconds=job["timeout_s"]),
    )
    try:
        ps.initialize_model_parallel(
            job["tp"],
            job["pp"],
            expert_model_parallel_size=job.get("ep", 1),
            expert_tensor_parallel_size=job.get("etp") or job["tp"],
        )
        _train(rank, job, result, batches)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _train(rank: int, job: dict, result: dict, batches: dict) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kit.convert.megatron_io import MegatronReader
    from kit.train.preflight.batches import masked_mean, megatron_mask

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    ep = job.get("ep", 1)
    ep_rank = ps.get_expert_model_parallel_rank() if ep > 1 else 0
    result.update(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, ep_rank=ep_rank)
    state = MegatronReader(job["checkpoint"]).state(tp_rank, pp_rank, ep_rank)
    args = state["args"]
    # the MTP layers stay out of training (HF's model has no MTP forward): left out of the model, carried into the
    # saved checkpoint as loaded
    model, tcfg = build_model(args, job, with_mtp=False)
    file_model = {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}
    carried = {k: file_model.pop(k) for k in [k for k in file_model if k.startswith(MTP_PREFIX)]}
    result["mtp_carried"] = len(carried)
    problems = load_check(model, file_model)
    result["load_problems"] = problems
    result["tensors"] = len(file_model)
    bad = torch.tensor([1 if problems else 0])
    dist.all_reduce(bad)  # every rank stops together when one file does not fit
    if int(bad):
        result["stopped"] = "a rank file did not load"
        return
    model.load_state_dict(file_model, strict=False)  # keys and shapes checked above; _extra_state left alone
    _lap(result, "build and load")

    ddp = DistributedDataParallel(
        config=tcfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        ),
        module=model,
    )
    tcfg.no_sync_func = ddp.no_sync
    tcfg.finalize_model_grads_func = finalize_model_grads
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=job["lr"],
        min_lr=job["min_lr"],
        weight_decay=job["weight_decay"],
        adam_beta1=job["adam_beta1"],
        adam_beta2=job["adam_beta2"],
        adam_eps=job["adam_eps"],
        clip_grad=job["clip_grad"],
        use_distributed_optimizer=True,
        params_dtype=torch.float32,
    )
    opt = get_megatron_optimizer(ocfg, [ddp], config_overrides=get_standard_config_overrides(ocfg))
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=job["lr"],
        min_lr=job["min_lr"],
        lr_warmup_steps=job["warmup_iters"],
        lr_decay_steps=job["steps"],
        lr_decay_style="cosine",
        start_wd=job["weight_decay"],
        end_wd=job["weight_decay"],
        wd_incr_steps=job["steps"],
        wd_incr_style="constant",
    )
    shard = sum(g.numel() for g in _shard_params(opt))
    result["optimizer_shard_numel"] = shard
    result["model_numel"] = sum(p.numel() for p in model.parameters())

    mbs, m = job["mbs"], job["micro_batches"]
    fbf = get_forward_backward_func()

    def forward_step(data_iterator, mdl):
        b = next(data_iterator)
        if job.get("dpo"):  # pairs: the sigmoid DPO loss of their log-probs (kit.train.preflight.dpo)
            from kit.train.preflight.dpo import megatron_step

            return megatron_step(mdl, b, job)
        output = mdl(b["tokens"], b["position_ids"], megatron_mask(b["segments"]), labels=b["labels"])

        def loss_func(out_tensor):
            loss = masked_mean(out_tensor.float(), b["loss_mask"])
            return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return output, loss_func

    def micro_batches(step: int) -> list:
        first = (step * dp + dp_rank) * m * mbs
        return [{k: v[first + i * mbs : first + (i + 1) * mbs] for k, v in batches.items()} for i in range(m)]

    refs = _dpo_reference(job, result, fbf, ddp, micro_batches, dp, dp_rank) if job.get("dpo") else None
    losses, norms, norms64, lrs, aux = [], [], [], [], []
    for step in range(job["steps"]):
        micro = micro_batches(step)
        if refs is not None and ps.is_pipeline_last_stage():
            for i, b in enumerate(micro):
                b["ref"] = refs[step][i]
        ddp.zero_grad_buffer()
        opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
        reduced = fbf(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[ddp],
            num_microbatches=m,
            seq_length=job["seq_len"],
            micro_batch_size=mbs * (2 if job.get("dpo") else 1),  # a pair is two rows
            forward_only=False,
        )
        if job.get("moe"):
            aux.append(_aux_losses(m, job["moe"], tcfg.moe_layer_freq))
        ok, norm, _ = opt.step()
        norms64.append(_norm64(opt, norm, job["clip_grad"]))
        sched.step(increment=1)
        norms.append(float(norm) if norm is not None else None)
        if ps.is_pipeline_last_stage():
            mean = torch.stack([r["lm loss"] for r in reduced]).mean()
            dist.all_reduce(mean, group=ps.get_data_parallel_group())
            losses.append(float(mean) / dp)
    result.update(losses=losses, grad_norms=norms, grad_norms_fp64=norms64, lrs=lrs)
    if job.get("moe"):
        result["aux_losses"] = aux
    _lap(result, "steps")
    # one writer per rank file: the (TP, PP[, EP]) coordinates repeat over the (expert) data-parallel ranks
    writer = (ps.get_expert_data_parallel_rank() if ep > 1 else dp_rank) == 0
    if writer:
        _save(job, args, state, model, tp_rank, pp_rank, ep_rank, carried)
    _lap(result, "save")
    dist.barrier()


def _dpo_reference(job: dict, result: dict, fbf, ddp, micro_batches, dp: int, dp_rank: int) -> list:
    """Every micro-batch's log-probs with the starting weights, before the first step (the DPO reference, as the
    kit's precompute), through the same pipeline schedule forward-only; the last stage's TP rank 0 also reports
    them per pair (`pair_logps`, what the "log-probs vs HF" row compares)."""
    import torch
    from megatron.core import parallel_state as ps

    from kit.train.preflight.dpo import megatron_step

    m, mbs = job["micro_batches"], job["mbs"]
    refs, pairs = [], []
    for step in range(job["steps"]):
        with torch.no_grad():
            reduced = fbf(
                forward_step_func=lambda it, mdl: megatron_step(mdl, next(it), job),
                data_iterator=iter(micro_batches(step)),
                model=[ddp],
                num_microbatches=m,
                seq_length=job["seq_len"],
                micro_batch_size=mbs * 2,
                forward_only=True,
            )
        logps = [r["logps"].float() for r in reduced]
        refs.append(logps)
        first = (step * dp + dp_rank) * m * mbs
        for i, lp in enumerate(logps):
            chosen, rejected = lp.chunk(2)
            for j in range(mbs):
                pairs.append([first + i * mbs + j, float(chosen[j]), float(rejected[j])])
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
        result["pair_logps"] = pairs
    _lap(result, "DPO reference pass")
    return refs


def _lap(result: dict, name: str) -> None:
    """Seconds since the previous lap (the report shows where a preflight's wall time goes)."""
    import time

    now = time.monotonic()
    last = result.setdefault("_t", now)
    if name != "start":
        result["seconds"][name] = round(now - last, 2)
    result["_t"] = now


def _aux_losses(micro_batches: int, moe: dict, layer_freq: list) -> list:
    """Per MoE layer, megatron-core's load-balancing loss of this step (mean over its micro-batches, no coefficient):
    its own tracker (router.py `attach_and_log_load_balancing_loss`; `seq_load_balancing_loss` for seq_aux_loss),
    reduced by its own `reduce_aux_losses_tracker_across_ranks` (PP and TP sums, DP mean), as its training loop logs
    it; the dense layers' zero entries left out (the HF side has router logits of the MoE layers only)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    name = "seq_load_balancing_loss" if moe.get("aux_loss_type") == "seq_aux_loss" else "load_balancing_loss"
    tracker = get_moe_layer_wise_logging_tracker()
    if name not in tracker:  # no aux loss configured
        return []
    reduce_aux_losses_tracker_across_ranks([name])
    values = tracker[name]["values"].tolist()
    values = [float(v) / micro_batches for v, is_moe in zip(values, layer_freq) if is_moe]
    clear_aux_losses_tracker()
    return values


def _norm64(opt, norm, clip: float) -> float:
    """The global grad norm over megatron-core's own selection of grads (TP duplicates and shared weights once),
    summed in float64: its fp32 norm drifts by up to ~1e-5 relative on CPU for large tensors. Called after the
    step, so the clipped grads are scaled back by megatron-core's coefficient (clip_grads.py, max / (norm + 1e-6))."""
    import torch
    import torch.distributed as dist

    total = torch.zeros(1, dtype=torch.float64)
    # each optimizer of the chain over its own group (MoE: the expert parameters' optimizer reduces over the expert
    # grid), as megatron-core's ChainedOptimizer.get_grad_norm does when the groups differ
    for o in getattr(opt, "chained_optimizers", [opt]):
        part = torch.zeros(1, dtype=torch.float64)
        for g in o.get_main_grads_for_grad_norm():
            part += g.double().pow(2).sum()
        dist.all_reduce(part, group=o.get_grad_stats_parallel_group())
        total += part
    coeff = min(1.0, clip / (float(norm) + 1e-6)) if clip > 0 else 1.0
    return float(total.sqrt()) / coeff


def _shard_params(opt):
    """The fp32 parameter shards this rank's DistributedOptimizer updates."""
    inner = getattr(opt, "chained_optimizers", [opt])
    for o in inner:
        for group in o.optimizer.param_groups:
            yield from group["params"]


def _save(
    job: dict, args, state: dict, model, tp_rank: int, pp_rank: int, ep_rank: int = 0, carried=None
) -> None:
    """This rank's trained weights in the layout Megatron / MindSpeed-LLM load (`iter_XXXXXXX/mp_rank_../`), with the
    untrained tensors `carried` (the MTP layers) as they were loaded."""
    import argparse

    import torch

    from kit.convert import megatron_layout as layout

    steps = job["steps"]
    folder = (
        Path(job["out"])
        / "checkpoint"
        / f"iter_{steps:07d}"
        / layout.rank_dir(tp_rank, pp_rank, job["pp"], ep_rank, job.get("ep", 1))
    )
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    weights.update(carried or {})
    saved = {
        "args": argparse.Namespace(**dict(vars(args), iteration=steps)),
        "checkpoint_version": state.get("checkpoint_version", layout.CHECKPOINT_VERSION),
        "iteration": steps,
        "model": weights,
    }
    tmp = folder / f".model_optim_rng.pt.partial-{os.getpid()}"
    torch.save(saved, str(tmp))
    os.replace(tmp, folder / "model_optim_rng.pt")


if __name__ == "__main__":
    import sys

    rank_, job_ = int(os.environ["RANK"]), json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    with open(
        Path(job_["out"]) / f"rank_{rank_}.log", "ab"
    ) as own_log:  # one log per rank, not torchrun's mix
        os.dup2(own_log.fileno(), 1)
        os.dup2(own_log.fileno(), 2)
    main(rank_, job_)
