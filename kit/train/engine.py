"""The pieces DeepSpeed needs: process group, model (adapted, LoRA-wrapped), optimizer, LR schedule, ds_config."""

from __future__ import annotations

import math
import os
from typing import Optional

from kit.system.noise import quiet
from kit.system.procs import free_port, in_process_env, in_process_rendezvous


def resolve_dtype(cfg, info) -> str:
    """The training dtype: DTYPE if set, else the device's choice (bf16/fp16 on NPU/GPU, fp32 on CPU)."""
    return info.dtype if cfg.dtype == "auto" else cfg.dtype


def init_distributed(info, log=None) -> tuple:
    """Join (or create) the process group on the device's backend; return (rank, world_size, local_rank).

    A process started without a launcher (a notebook cell) becomes a world of one on a free local port. What
    DeepSpeed's op probes print goes to `log` (kit.system.noise).
    """
    import torch.distributed as dist

    if info.kind == "npu" and not os.environ.get("ASCEND_HOME_PATH"):
        # DeepSpeed's NPU op builders read os.environ["ASCEND_HOME_PATH"] unguarded (DeepSpeed `op_builder/npu/builder.py`).
        raise RuntimeError(
            "ASCEND_HOME_PATH is not set: source CANN's set_env.sh (/usr/local/Ascend/cann/set_env.sh "
            "or /usr/local/Ascend/ascend-toolkit/set_env.sh) before training; notebook 00 shows how."
        )
    if not dist.is_initialized():
        env = os.environ
        # A launcher sets all four, with its own MASTER_PORT, not the one the kit set below for a world of one (the
        # kit's values may be inherited: a kernel started from a process that trained in-process). A partial set (a
        # variable left over in a kernel's environment) is no launch either: DeepSpeed would look for MPI.
        full = all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
        launched = full and "MASTER_PORT" not in in_process_rendezvous(env)
        if not launched:
            # Always a fresh port: a kernel started from a process that trained in-process inherits its
            # MASTER_PORT, which that process still holds.
            env.update(
                in_process_env(str(free_port()))
            )  # the marker: the next run here knows these are the kit's
        elif "LOCAL_WORLD_SIZE" in env:
            # DeepSpeed's CPU accelerator counts local devices from LOCAL_SIZE (its launcher sets it) and else runs
            # `numactl --hardware` (deepspeed/accelerator/cpu_accelerator.py device_count, 0.15), which ZeRO-3
            # calls and most images lack.
            env["LOCAL_SIZE"] = env["LOCAL_WORLD_SIZE"]
        import deepspeed

        with quiet(log):
            deepspeed.init_distributed(dist_backend=info.backend, verbose=False)
        if info.kind == "cpu":  # every rank calls it (it may hold a barrier)
            release_shm_buffer(dist.get_rank(), dist.get_world_size())
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))


def shm_buffer_path(rank: int) -> str:
    """The /dev/shm file DeepSpeed's CPU allreduce maps for `rank` of the group at MASTER_ADDR:MASTER_PORT
    (deepspeed/ops/csrc/cpu/comm/shm.cpp: deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>)."""
    env = os.environ
    return (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
        f"{env.get('MASTER_PORT', '')}_{rank}"
    )


def release_shm_buffer(rank: int, world: int) -> bool:
    """Unlink this rank's DeepSpeed shm allreduce buffer once every rank has mapped it; True if there was one.

    On the CPU accelerator with all ranks on one machine, DeepSpeed creates a ~66 MB /dev/shm file per rank and never
    unlinks it, so every CPU run (each notebook training run, each test) left them behind until a reboot, RAM that
    tmpfs never gives back. Each rank maps all the others' files inside init_distributed, so after a barrier the
    names can go; the mappings stay valid until the process ends. NPU and GPU runs create none. Call it on every rank.
    """
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    path = shm_buffer_path(rank)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def ds_config(cfg, dtype: str) -> dict:
    """DeepSpeed's config for this run: batch sizes from MBS/GBS/DP, ZeRO stage, precision, clipping."""
    conf = {
        "train_batch_size": cfg.gbs,
        "train_micro_batch_size_per_gpu": cfg.mbs,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": float(cfg.clip_grad),
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW (see adamw): no op build needed on any device
        "steps_per_print": 10**9,  # the kit prints its own Megatron-style lines
        "wall_clock_breakdown": False,
    }
    if dtype == "bfloat16":
        conf["bf16"] = {"enabled": True}
    elif dtype == "float16":
        conf["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    if cfg.zero_stage == 3:
        conf["zero_optimization"].update({"stage3_gather_16bit_weights_on_model_save": True})
    return conf


def lr_lambda(cfg):
    """Linear warm-up over WARMUP_ITERS, then cosine decay from LR to MIN_LR at TRAIN_ITERS (a factor of LR)."""
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if cfg.warmup_iters and step < cfg.warmup_iters:
            return (step + 1) / cfg.warmup_iters
        span = max(1, cfg.train_iters - cfg.warmup_iters)
        progress = min(1.0, (step - cfg.warmup_iters) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def adapt(model) -> Optional[object]:
    """Patch the model with kit ops (kit.adapt, issue 5); a clear error if that module is not installed."""
    try:
        from kit.adapt import adapt_model
    except ImportError as exc:
        raise RuntimeError(
            f"ADAPT=True needs kit.adapt (the NPU-ops stage), which cannot be imported ({exc}); "
            f"set ADAPT=False to train the plain HF model."
        ) from exc
    return adapt_model(model)


def build_model(cfg, torch_dtype=None):
    """Load the HF causal LM (fp32 master copy), adapt it, wrap it in LoRA for RUN_TYPE lora; (model, report)."""
    import torch

    torch.manual_seed(cfg.seed)  # LoRA initialisation draws random numbers
    from kit.system.hf_compat import load_causal_lm

    model = load_causal_lm(cfg.model_path, torch_dtype)
    model.config.use_cache = False
    _router_aux_loss(model, cfg)
    report = adapt(model) if cfg.adapt else None
    if cfg.recompute:  # non-reentrant: frozen inputs (LoRA) need no requires_grad trick
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        from kit.adapt.lora_targets import resolve_targets
        from kit.adapt.moe import lora_target_problems

        targets = resolve_targets(model, cfg.lora_targets)  # DeepSeek-V3: MLA's projection names
        problems = lora_target_problems(model, targets)
        if problems:
            from kit.errors import InputError

            raise InputError(problems[0])
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [t for t in targets if t not in names]
        if missing:
            raise ValueError(
                f"LORA_TARGETS {missing} are not module names of {cfg.model_path}; it has e.g. "
                f"{sorted(n for n in names if n.endswith('proj'))[:8]}."
            )
        lora = LoraConfig(
            task_type="CAUSAL_LM",
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
        )
        with quiet(cfg.log_dir() / "third_party.log"):  # peft asks transformers a deprecated attribute
            model = get_peft_model(model, lora)
    return model, report


def _router_aux_loss(model, cfg) -> None:
    """MoE models get the run's router aux-loss coefficient (kit.adapt.moe); a dense model given one is refused."""
    from kit.adapt.moe import is_moe_model, router_aux_loss_coef

    if is_moe_model(model):
        router_aux_loss_coef(model, cfg.router_aux_loss_coef)
    elif cfg.router_aux_loss_coef is not None:
        from kit.errors import InputError
        from kit.train.expert_bias import bias_routers

        if bias_routers(model):
            raise InputError(
                f"ROUTER_AUX_LOSS_COEF={cfg.router_aux_loss_coef} is set, but {cfg.model_path} (DeepSeek-V3 / "
                "GLM-4.5 routing) has no router aux loss: its experts balance through the score-correction bias, "
                "which training updates itself (kit.train.expert_bias); leave ROUTER_AUX_LOSS_COEF None."
            )
        raise InputError(
            f"ROUTER_AUX_LOSS_COEF={cfg.router_aux_loss_coef} is set, but {cfg.model_path} has no routed experts "
            "(config.num_experts); leave it None for a dense model."
        )


def _check_zero3_collectives() -> None:
    """ZeRO-3 gathers parameters with all_gather_into_tensor; torch 2.1's gloo (CPU) lacks it (`_allgather_base`)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() != "gloo":
        return
    try:
        dist.all_gather_into_tensor(torch.empty(dist.get_world_size()), torch.zeros(1))
    except RuntimeError as exc:
        if "_allgather_base" not in str(exc):
            raise
        from kit.errors import DeviceError

        raise DeviceError(
            f"ZERO_STAGE=3 on CPU needs the gloo all-gather that torch {torch.__version__} lacks; "
            f"use ZERO_STAGE=2 (or 0/1) here, or torch >= 2.5 (README: tested stacks)."
        ) from None


# torch release from which torch.optim.AdamW(fused=True) runs on each device type. CUDA: from the start (2.0).
# CPU: torch 2.4 added the kernel (torch 2.1's constructor refuses fused=True for CPU tensors). NPU: torch_npu
# registers `_fused_adamw_` for its device (read in torch_npu 2.13.0's npu_native_functions_by_codegen.yaml); the
# torch_npu releases for torch < 2.4 were not checked, so there NPU keeps torch's default (foreach).
FUSED_ADAMW_SINCE = {"cuda": (2, 0), "cpu": (2, 4), "npu": (2, 4)}


def fused_adamw(device_type: str, torch_version: Optional[str] = None) -> bool:
    """Whether the trainer's AdamW runs fused on `device_type` with torch `torch_version` (default: this torch).

    Fused is what HF Trainer uses by default on recent torch (adamw_torch_fused) and the same update rule as
    torch's foreach AdamW, in fewer kernel launches.
    """
    import torch

    since = FUSED_ADAMW_SINCE.get(device_type)
    if since is None:
        return False
    release = (torch_version or torch.__version__).split("+")[0].split(".")
    return tuple(int(x) for x in release[:2]) >= since


def adamw(params, cfg):
    """torch AdamW over `params` with the run's settings, fused where fused_adamw says so.

    build_engine hands this to DeepSpeed, which calls it after moving the model to the training device, so torch's
    own constructor checks fused=True against the device the parameters train on.
    """
    import torch

    params = list(params)
    device_type = params[0].device.type if params else "cpu"
    fused = {"fused": True} if fused_adamw(device_type) else {}
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, **fused
    )


def build_engine(cfg, model, dtype: str):
    """deepspeed.initialize over the trainable parameters: DeepSpeed moves the model to the device, builds the AdamW
    (adamw) and the warm-up/cosine schedule there, and clips by global norm (CLIP_GRAD) in every configuration."""
    import deepspeed
    import torch

    if cfg.zero_stage == 3:
        _check_zero3_collectives()

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        optimizer=lambda params: adamw(params, cfg),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg)),
        config=ds_config(cfg, dtype),
    )
    return engine


def reports_grad_norm(engine) -> bool:
    """Whether DeepSpeed reports the step's global gradient norm before clipping (engine.get_global_grad_norm()).

    Its ZeRO, bf16 and fp16 optimizers do. Plain fp32 at ZeRO 0 does not: DeepSpeed clips there and drops the norm
    (DeepSpeedEngine.clip_fp32_gradients), so the trainer takes it itself before the step (Trainer._grad_norm).
    """
    return bool(engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


def quiet_deepspeed() -> None:
    """DeepSpeed logs every config key at INFO; the kit's own lines say what matters."""
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
