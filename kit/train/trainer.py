"""The kit trainer: DeepSpeed over an HF causal LM, with exact resume, SIGTERM checkpoints and a NaN stop."""

from __future__ import annotations

import dataclasses
import math
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from kit.configs import check, save_config
from kit.train import checkpoint
from kit.train.config import TrainConfig, load_config

StepCallback = Callable[[int], None]


@dataclass
class TrainResult:
    """How a run ended and where its outputs are."""

    status: str  # completed | preempted (SIGTERM/SIGINT: checkpoint saved) | nan (stopped, last good checkpoint kept)
    iteration: int
    output_dir: Path
    checkpoint: Optional[Path]
    log_path: Path
    metrics_path: Path
    hf_dir: Optional[Path] = None
    adapter_dir: Optional[Path] = None
    losses: list = field(default_factory=list)
    message: str = ""
    seconds: float = 0.0


def effective_config(cfg: TrainConfig) -> TrainConfig:
    """RUN_TYPE retrain continues the saved run: its config, with the new TRAIN_ITERS and save/log intervals."""
    if cfg.run_type != "retrain":
        return cfg
    saved_path = cfg.output_dir() / "config.json"
    if not saved_path.is_file():
        raise FileNotFoundError(
            f"RUN_TYPE=retrain: {saved_path} is missing, so there is no run to resume there."
        )
    saved = load_config(saved_path)
    return dataclasses.replace(
        saved,
        train_iters=cfg.train_iters,
        save_interval=cfg.save_interval,
        log_interval=cfg.log_interval,
        work_dir=cfg.work_dir or saved.work_dir,
        master_addr=cfg.master_addr,
        master_port=cfg.master_port,
    )


class Trainer:
    """One run of `cfg`: `Trainer(cfg).train()`; `step_callbacks` are called with the iteration after each step."""

    def __init__(
        self,
        cfg: TrainConfig,
        step_callbacks: Sequence[StepCallback] = (),
        progress: bool = True,
        echo: bool = True,
    ):
        check(cfg, "training config")
        self.requested = cfg
        self.cfg = effective_config(cfg)
        if self.cfg is not cfg:
            check(self.cfg, "saved training config (retrain)")
        self.step_callbacks = list(step_callbacks)
        self.progress, self.echo = progress, echo
        self._stop_reason: Optional[str] = None
        self.engine = None

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _setup(self):
        import torch

        from kit.device import detect
        from kit.train import engine as eng
        from kit.train.data import load_dataset
        from kit.train.metrics import MetricsWriter

        cfg = self.cfg
        self.info = detect()
        self.dtype = eng.resolve_dtype(cfg, self.info)
        self.rank, self.world, self.local_rank = eng.init_distributed(self.info)
        if self.world != cfg.world_size:
            raise RuntimeError(
                f"this job has {self.world} processes but the config says NNODES x NPROC_PER_NODE = "
                f"{cfg.world_size}; launch with kit.train.launch (or fix NPROC_PER_NODE)."
            )
        eng.quiet_deepspeed()
        self.out = cfg.output_dir()
        self.ckpt_root = self.out / "checkpoints"
        resume = self.requested.run_type == "retrain"
        if not resume and checkpoint.latest_iteration(self.ckpt_root) is not None:
            if not cfg.overwrite:
                raise FileExistsError(
                    f"{self.ckpt_root} already holds checkpoints; use RUN_TYPE=retrain to continue "
                    f"them, or OVERWRITE=True to start over (they will be deleted)."
                )
            if self.rank == 0:
                shutil.rmtree(self.ckpt_root)
        self.ds, self.meta = load_dataset(cfg.dataset_path)
        self.seq_len = cfg.seq_len or int(self.meta["max_length"])
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out)
        self.writer = MetricsWriter(
            cfg.log_dir(), self.out.name, cfg.train_iters, enabled=self.rank == 0, echo=self.echo
        )
        model, self.adapt_report = eng.build_model(cfg)
        self.engine = eng.build_engine(cfg, model, self.dtype)
        self.device = self.engine.device
        self.start_iter = 0
        if resume:
            state = checkpoint.load(self.engine, self.ckpt_root)
            self.start_iter = int(state["iteration"])
            self.writer.text(
                f"resumed from {self.ckpt_root / checkpoint.tag_of(self.start_iter)} "
                f"(iteration {self.start_iter}, consumed samples {state['consumed_samples']})"
            )
        if not resume:  # on resume the RNG comes from the checkpoint
            torch.manual_seed(cfg.seed + self.rank)
        self.writer.text(
            f"training {cfg.run_type} on {self.world} x {self.info.kind} ({self.dtype}), "
            f"MBS={cfg.mbs} GBS={cfg.gbs} DP={cfg.dp} grad accum={cfg.grad_accum} SEQ_LEN={self.seq_len} "
            f"ZeRO={cfg.zero_stage} samples={len(self.ds)} adapt={bool(self.adapt_report)}"
        )

    # ---- signals --------------------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        if self._stop_reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C / notebook interrupt stops at once
        self._stop_reason = signal.Signals(signum).name

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    # ---- collectives ----------------------------------------------------------------------------------------
    def _all_reduce(self, values: list, op: str = "sum") -> list:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    # ---- the loop -------------------------------------------------------------------------------------------
    def _one_step(self, iteration: int) -> Optional[dict]:
        """One optimizer step over this rank's micro-batches; None when a loss was not finite (nothing stepped)."""
        import torch

        from kit.device import synchronize
        from kit.train.data import micro_batches, tokens_in

        cfg, engine = self.cfg, self.engine
        lr = engine.lr_scheduler.get_last_lr()[0]
        t0 = time.perf_counter()
        loss_sum, tokens, pre_clip_norm = 0.0, 0, None
        for batch in micro_batches(self.ds, iteration, cfg, self.rank // (cfg.tp * cfg.pp)):
            batch = {
                k: v.to(self.device, dtype=torch.long) for k, v in batch.items()
            }  # kit.data stores int32
            loss = engine(**batch).loss
            bad = self._all_reduce([0.0 if math.isfinite(loss.item()) else 1.0], "max")[0]
            if bad:
                return None
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary() and cfg.zero_stage == 0:
                pre_clip_norm = self._grad_norm()  # DeepSpeed reports it only for ZeRO >= 1 / mixed precision
            engine.step()
            loss_sum += loss.item()
            tokens += tokens_in(batch)
        synchronize(self.device)
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        loss_sum, tokens, elapsed_ms = self._all_reduce([loss_sum, tokens, elapsed_ms])
        elapsed_ms /= self.world
        grad_norm = engine.get_global_grad_norm() if pre_clip_norm is None else pre_clip_norm
        from kit.train.metrics import tokens_per_second_per_card

        return {
            "iteration": iteration + 1,
            "consumed_samples": (iteration + 1) * cfg.gbs,
            "elapsed_ms": elapsed_ms,
            "lr": float(lr),
            "gbs": cfg.gbs,
            "loss": loss_sum / (cfg.grad_accum * self.world),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "loss_scale": float(getattr(engine.optimizer, "cur_scale", 1.0) or 1.0),
            "skipped": int(getattr(engine, "skipped_steps", 0) or 0),
            "nan": 0,
            "tokens_per_s_per_card": tokens_per_second_per_card(
                cfg.gbs, self.seq_len, self.world, elapsed_ms
            ),
            "samples_per_s": cfg.gbs / (elapsed_ms / 1000.0) if elapsed_ms > 0 else 0.0,
            "useful_tokens_per_s": tokens / (elapsed_ms / 1000.0) if elapsed_ms > 0 else 0.0,
            "real_tokens": int(tokens),
            "time": time.time(),
        }

    def _grad_norm(self) -> float:
        """Global L2 norm of the (already all-reduced) gradients before clipping, as Megatron logs it."""
        import torch

        grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
        return (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            if grads
            else 0.0
        )

    def request_stop(self, reason: str = "requested") -> None:
        """Ask the loop to save a checkpoint and stop after the current step (like SIGTERM)."""
        self._stop_reason = reason

    def _state(self, iteration: int) -> dict:
        return {
            "iteration": iteration,
            "consumed_samples": iteration * self.cfg.gbs,
            "run_type": self.cfg.run_type,
            "world_size": self.world,
            "seed": self.cfg.seed,
        }

    def _save(self, iteration: int, why: str) -> Path:
        path = checkpoint.save(self.engine, self.ckpt_root, iteration, self._state(iteration))
        self.writer.text(f"saved checkpoint {path} at iteration {iteration} ({why})")
        return path

    def train(self) -> TrainResult:
        """Run to TRAIN_ITERS (or to a stop signal / NaN); save checkpoints and, at the end, an HF folder."""
        from tqdm.auto import tqdm

        t_start = time.time()
        self._setup()
        cfg = self.cfg
        previous = self._install_signals()
        losses, iteration, status, message, last_ckpt = [], self.start_iter, "completed", "", None
        bar = tqdm(
            total=cfg.train_iters,
            initial=self.start_iter,
            desc=f"{cfg.run_type} steps",
            disable=not self.progress or self.rank != 0,
        )
        try:
            while iteration < cfg.train_iters:
                metrics = self._one_step(iteration)
                if metrics is None:
                    status = "nan"
                    good = checkpoint.latest_iteration(self.ckpt_root)
                    where = self.ckpt_root / checkpoint.tag_of(good) if good is not None else None
                    message = (
                        f"loss is NaN/inf at iteration {iteration + 1}; stopped without stepping. Last good "
                        f"checkpoint: {where or 'none (set SAVE_INTERVAL to keep one)'}. Lower LR, raise "
                        f"WARMUP_ITERS or check the data, then resume with RUN_TYPE=retrain."
                    )
                    last_ckpt = where
                    self.writer.text(message)
                    break
                iteration += 1
                losses.append(metrics["loss"])
                self.writer.iteration(metrics, print_line=iteration % cfg.log_interval == 0)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")
                for cb in self.step_callbacks:
                    cb(iteration)
                stop = self._all_reduce([1.0 if self._stop_reason else 0.0], "max")[0]
                if stop:
                    status = "preempted"
                    last_ckpt = self._save(
                        iteration, f"stop requested ({self._stop_reason or 'another rank'})"
                    )
                    message = (
                        f"stopped at iteration {iteration} on request; resume with RUN_TYPE=retrain "
                        f"RESUME_FROM={self.out.name}."
                    )
                    self.writer.text(message)
                    break
                if cfg.save_interval and iteration % cfg.save_interval == 0:
                    last_ckpt = self._save(iteration, "SAVE_INTERVAL")
        finally:
            bar.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        result = TrainResult(
            status,
            iteration,
            self.out,
            last_ckpt,
            self.writer.log_path,
            self.writer.jsonl_path,
            losses=losses,
            message=message,
        )
        if status == "completed":
            if checkpoint.latest_iteration(self.ckpt_root) != iteration:
                result.checkpoint = self._save(iteration, "end of training")
            else:
                result.checkpoint = self.ckpt_root / checkpoint.tag_of(iteration)
            if cfg.save_hf:
                self._export(result)
            result.message = f"trained {iteration} iterations; outputs in {self.out}"
            self.writer.text(result.message)
        self.writer.close()
        result.seconds = time.time() - t_start
        return result

    def _export(self, result: TrainResult) -> None:
        from kit.train.export import export_hf, export_lora

        cfg = self.cfg
        tok = cfg.tokenizer_path or cfg.model_path
        if cfg.run_type == "lora":
            result.adapter_dir, result.hf_dir = export_lora(
                self.engine.module,
                self.out / "adapter",
                self.out / "merged",
                cfg.model_path,
                tok,
                cfg.zero_stage,
                self.rank,
            )
        else:
            result.hf_dir = export_hf(self.engine.module, self.out / "hf", tok, cfg.zero_stage, self.rank)
        self.writer.text(f"saved HF folder {result.hf_dir}")


def train(
    cfg: TrainConfig, step_callbacks: Sequence[StepCallback] = (), progress: bool = True
) -> TrainResult:
    """Train `cfg` in this process (a notebook cell for tiny runs; `kit.train.launch` for real ones)."""
    return Trainer(cfg, step_callbacks=step_callbacks, progress=progress).train()
