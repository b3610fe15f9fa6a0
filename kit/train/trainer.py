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
from typing import Any, Callable, Optional, Sequence, Union

from kit.core.configs import save_config
from kit.core.manifest import MANIFEST_NAME
from kit.system.hf_compat import takes_logit_positions
from kit.train import checkpoint
from kit.train.config import TrainConfig
from kit.train.resolve import TrainPlan, resolve

StepCallback = Callable[[int], None]
PLAN_NAME = "plan.json"  # in the run folder: the plan the run trained with (kit.train.resolve.TrainPlan)
# of the grace period after a stop signal, what the checkpoint uploads may take; the rest is for the exit
UPLOAD_SHARE = 0.9
# held-out rows scored at each evaluation (EVAL_EVERY): the same first rows each time, a few forward passes
EVAL_ROWS = 32


@dataclass
class TrainResult:
    """How a run ended and where its outputs are."""

    # completed | preempted (SIGTERM/SIGINT: checkpoint saved) | nan (stopped, last good checkpoint kept) |
    # upload_failed (trained, outputs whole here, but OBS_HOME lacks some checkpoint: the message says which)
    status: str
    iteration: int
    output_dir: Path
    checkpoint: Optional[Path]
    log_path: Path
    metrics_path: Path
    hf_dir: Optional[Path] = None
    adapter_dir: Optional[Path] = None
    losses: list = field(default_factory=list)
    eval_losses: dict = field(default_factory=dict)  # iteration -> held-out loss (EVAL_EVERY)
    message: str = ""
    seconds: float = 0.0
    config: Optional[TrainConfig] = None  # the resolved config the run trained with (sources included)
    manifest: Any = None  # the run folder's training-run manifest (completed runs)
    hf_manifest: Any = None  # the exported hf/ folder's hf-model manifest
    dpo: Optional[dict] = None  # RUN_TYPE dpo: the loss settings, the reference and the last step's metrics

    def summary(self, **extra) -> dict:
        """Scalars and paths of the run for the notebook's summary: outputs, consumed inputs and their hashes
        (`extra`: further scalars a notebook adds, e.g. the before/after generations)."""
        cfg, man = self.config, self.manifest
        return {
            "run_type": cfg.run_type if cfg else None,
            "status": self.status,
            "iterations": self.iteration,
            "first_loss": self.losses[0] if self.losses else None,
            "last_loss": self.losses[-1] if self.losses else None,
            "losses": list(self.losses),
            "eval_loss": self.eval_losses[max(self.eval_losses)] if self.eval_losses else None,
            "output_dir": self.output_dir,
            "checkpoint": self.checkpoint,
            "hf_dir": self.hf_dir,
            "adapter_dir": self.adapter_dir,
            "log": self.log_path,
            "metrics": self.metrics_path,
            "dataset_path": cfg.dataset_path if cfg else None,
            "model_path": cfg.model_path if cfg else None,
            "seq_len": cfg.seq_len if cfg else None,
            "sources": dict(cfg.sources) if cfg else {},
            "manifest": (man.folder / "kit_manifest.json") if man else None,
            "manifest_sha256": man.sha256 if man else None,
            "hf_manifest_sha256": self.hf_manifest.sha256 if self.hf_manifest else None,
            "inputs": [dataclasses.asdict(c) for c in man.inputs] if man else [],
            "seconds": self.seconds,
            **extra,
        }


class Trainer:
    """One run of a resolved plan: `Trainer(resolve(cfg)).train()`; `step_callbacks` are called with the iteration
    after each step, `checkpoint_hooks` after each checkpoint (kit.train.obs_home.checkpoint_hooks)."""

    def __init__(
        self,
        plan: TrainPlan,
        step_callbacks: Sequence[StepCallback] = (),
        progress: bool = True,
        echo: bool = True,
        checkpoint_hooks: Sequence[Any] = (),
    ):
        self.plan, self.cfg = plan, plan.cfg
        self.out = plan.folder
        self.step_callbacks = list(step_callbacks)
        # each gets after_save(folder, iteration) for every checkpoint, finish(deadline, why) -> lines for the log at
        # the end (its `errors`: what it could not do) and close() when the run fails
        self.checkpoint_hooks = list(checkpoint_hooks)
        self.progress, self.echo = progress, echo
        self._stop_reason: Optional[str] = None
        self._signal_at: Optional[float] = None  # the first stop signal's time: the grace period runs from it
        self.engine = None
        self.expert_bias = None  # kit.train.expert_bias, set in _setup where the routers have biases

    # ---- set-up ---------------------------------------------------------------------------------------------
    def _setup(self):
        import torch

        from kit.system.device import detect
        from kit.train import engine as eng
        from kit.train.batches import load_dataset
        from kit.train.metrics import MetricsWriter

        cfg = self.cfg
        self.info = detect()
        self.dtype = eng.resolve_dtype(cfg, self.info)
        bind_device(self.info)
        self.rank, self.world, self.local_rank = eng.init_distributed(
            self.info, cfg.log_dir() / "third_party.log"
        )
        if self.world != cfg.world_size:
            raise RuntimeError(
                f"this job has {self.world} processes but the config says NNODES x NPROC_PER_NODE = "
                f"{cfg.world_size}; launch with kit.train.launch (or fix NPROC_PER_NODE)."
            )
        eng.quiet_deepspeed()
        self.ckpt_root = self.out / "checkpoints"
        resume = self.plan.resumed
        replace_old = not resume and checkpoint.latest_iteration(self.ckpt_root) is not None
        if replace_old and not cfg.overwrite:
            raise FileExistsError(
                f"{self.ckpt_root} already holds checkpoints; use RUN_TYPE=retrain to continue "
                f"them, or OVERWRITE=True to start over (they will be deleted once the new model has loaded)."
            )
        self.ds, self.meta = load_dataset(cfg.dataset_path)
        self.heldout, missing = heldout_rows(self.meta, cfg)
        self.seq_len = cfg.seq_len or int(self.meta["max_length"])
        model, self.adapt_report = eng.build_model(cfg)
        check_packing(self.meta, self.adapt_report, cfg.dataset_path, self.ds)
        # kit attention keeps sequences apart by position_ids: padded rows can then go as one padding-free row
        self.flatten = getattr(self.adapt_report, "attention", None) == "kit"
        # a flattened row's logits only where a target follows: prompts and padding skip the LM head (see below)
        self.select_logits = self.flatten and takes_logit_positions(model)
        self.aux_coef = aux_loss_coef(model)  # MoE: the router's load-balancing loss joins the LM loss
        # DeepSeek-V3 / GLM-4.5: the routers' score-correction biases follow the load, in fp32 (taken before the
        # engine casts the model, put back after); not under LoRA, where the base model stays frozen and the
        # adapter could not carry moved biases
        from kit.train.expert_bias import attach

        self.expert_bias = None if cfg.lora else attach(model)
        self.engine = eng.build_engine(cfg, model, self.dtype)
        if self.expert_bias is not None:
            self.expert_bias.restore()  # before any resume loads the checkpoint's biases into them
        self.device = self.engine.device
        self.objective = None  # the SFT/pretraining loss; RUN_TYPE dpo: kit.train.dpo's (set below)
        self.norm_from_deepspeed = eng.reports_grad_norm(self.engine)
        # only now, with the new model loaded, does the old run make way (OVERWRITE): a bad model keeps it
        if self.rank == 0:
            if replace_old:
                shutil.rmtree(self.ckpt_root)
            # the run folder is complete again only when this run writes its manifest
            (self.out / MANIFEST_NAME).unlink(missing_ok=True)
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out)
            self.plan.save(self.out / PLAN_NAME)
        if replace_old:
            self._all_reduce_ints([0])  # every rank waits for the removal before any saves
        self.writer = MetricsWriter(
            cfg.log_dir(), self.out.name, cfg.train_iters, enabled=self.rank == 0, echo=self.echo
        )
        if self.rank == 0:
            self._leftovers()
        # every rank scores the held-out rows or none does: a node without them would leave the others in a collective
        if self._all_reduce_ints([int(self.heldout is not None)])[0] < self.world:
            if self.heldout is not None:
                missing = "another rank's node lacks the data's held-out split: no held-out loss this run."
            self.heldout = None
        if missing:
            self.writer.text(f"warning: {missing}")
        self.start_iter = 0
        self.saved_iteration: Optional[int] = None  # the checkpoint this run saved or resumed last
        if resume and cfg.obs_home:
            # a node that lacks its part of the checkpoint stops the whole job here, in one collective, not in a hang
            if self._all_reduce_ints([len(self.plan.obs_missing)], "max")[0]:
                from kit.errors import MissingInputError
                from kit.train.obs_home import missing_line

                if self.plan.obs_missing:
                    raise MissingInputError(missing_line(list(self.plan.obs_missing), self.ckpt_root))
                raise MissingInputError(
                    "another node lacks its part of the checkpoint to resume (see its log)."
                )
        if resume:
            notes: list = []
            state = checkpoint.load(self.engine, self.ckpt_root, notes=notes)
            for note in notes:
                self.writer.text(note)
            self.start_iter = self.saved_iteration = int(state["iteration"])
            self.writer.text(
                f"resumed from {self.ckpt_root / checkpoint.tag_of(self.start_iter)} "
                f"(iteration {self.start_iter}, consumed samples {state['consumed_samples']})"
            )
        if self.expert_bias is not None:
            self.writer.text(
                f"expert bias: the score-correction biases of {len(self.expert_bias.routers)} MoE layers balance "
                f"their load without an aux loss (update rate {self.expert_bias.rate} per step)"
            )
        if cfg.run_type == "dpo":
            from kit.train.dpo import setup_objective

            setup_objective(self, resume)
        if not resume:  # on resume the RNG comes from the checkpoint
            torch.manual_seed(cfg.seed + self.rank)
        self.writer.text(
            f"training {cfg.run_type} on {self.world} x {self.info.kind} ({self.dtype}), "
            f"MBS={cfg.mbs} GBS={cfg.gbs} DP={cfg.dp} grad accum={cfg.grad_accum} SEQ_LEN={self.seq_len} "
            f"ZeRO={cfg.zero_stage} samples={len(self.ds)} adapt={bool(self.adapt_report)}"
        )

    def _leftovers(self) -> None:
        """Report (CLEAN_PARTIAL: remove) what killed runs left: checkpoints and exports that never finished."""
        from kit.storage.partial import describe, handle_partials

        clean = self.cfg.clean_partial
        for folder in (self.ckpt_root, self.out):
            report = handle_partials(folder, clean=clean)
            for path in report["removed"]:
                self.writer.text(f"removed leftover partial output {path}")
            line = describe(report)
            if line:
                self.writer.text(f"warning: {line}")

    # ---- signals --------------------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame):
        if self._stop_reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C / notebook interrupt stops at once
        self._stop_reason = signal.Signals(signum).name
        self._signal_at = self._signal_at or time.monotonic()

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    # ---- collectives ----------------------------------------------------------------------------------------
    # HCCL (torch_npu's ProcessGroupHCCL, Ascend/pytorch `torch_npu/csrc/distributed/ProcessGroupHCCL.cpp`) reduces
    # int8/16/32/64, fp16, fp32 and bf16 only; float64 is refused on Atlas A2/A3. So floats go as fp32 and counts
    # as int64. Every world size, one included, runs the same collectives.
    def _all_reduce(self, values: list, op: str = "sum") -> list:
        """Sum (or max) of float values over ranks, reduced as fp32."""
        return self._reduce(values, "float32", op)

    def _all_reduce_ints(self, values: list, op: str = "sum") -> list:
        """Sum (or max) of integer values over ranks, reduced as int64."""
        return [int(v) for v in self._reduce(values, "int64", op)]

    def _reduce(self, values: list, dtype: str, op: str) -> list:
        import torch

        return self._reduce_tensor(torch.tensor(values, dtype=getattr(torch, dtype), device=self.device), op)

    def _reduce_tensor(self, t, op: str = "sum") -> list:
        """All-reduce `t` in place (sum or max) and return its values on the host (the one sync)."""
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    # ---- the loop -------------------------------------------------------------------------------------------
    def _one_step(self, iteration: int) -> Optional[dict]:
        """One optimizer step over this rank's micro-batches; None when a loss was not finite (nothing stepped).

        The losses stay on the device until the last micro-batch; there one collective sums each micro-batch's loss
        over the ranks and one host sync brings the sums back: they decide NaN/inf on every rank alike (before the
        step) and make the logged loss, instead of a `.item()` and an all_reduce per micro-batch that would drain
        the NPU's task queue each time.
        """
        import torch

        from kit.system.device import synchronize
        from kit.train.batches import micro_batches

        cfg, engine = self.cfg, self.engine
        lr = engine.lr_scheduler.get_last_lr()[0]
        t0 = time.perf_counter()
        losses, tokens, pre_clip_norm = [], 0, None
        batches = list(micro_batches(self.ds, iteration, cfg, self.rank // (cfg.tp * cfg.pp)))
        if self.objective is not None:
            self.objective.start_step()
        if self.expert_bias is not None:
            self.expert_bias.reset()
        for i, batch in enumerate(batches):
            if self.objective is not None:  # DPO: pairs, laid out and scored by kit.train.dpo
                loss, batch_tokens = self.objective.loss(engine, batch)
            else:
                loss, batch_tokens = self._lm_loss(batch)
            losses.append(loss.detach())
            engine.backward(loss)
            if i == len(batches) - 1:
                # a non-finite loss on any rank makes its sum non-finite on every rank
                values = self._reduce_tensor(torch.stack(losses).float())
                if not all(map(math.isfinite, values)):
                    return None
            if engine.is_gradient_accumulation_boundary() and not self.norm_from_deepspeed:
                # the all-reduced gradients, before DeepSpeed's step clips them
                pre_clip_norm = self._grad_norm()
            engine.step()
            tokens += batch_tokens
        if self.expert_bias is not None:  # after the optimizer step, on this step's tokens
            self.expert_bias.step()
        loss_sum = 0.0
        for v in values:  # summed on the host in float64, micro-batch order
            loss_sum += v
        synchronize(self.device)
        elapsed_ms = self._all_reduce([(time.perf_counter() - t0) * 1000.0])[0] / self.world
        tokens = self._all_reduce_ints([tokens])[0]
        grad_norm = engine.get_global_grad_norm() if pre_clip_norm is None else pre_clip_norm
        from kit.system.memory import peak_memory
        from kit.train.metrics import tokens_per_second_per_card

        extra = self.objective.step_metrics(self._reduce_tensor) if self.objective is not None else {}
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
            "memory_gib": peak_memory(self.device)[0] / 2**30,
            "time": time.time(),
            **extra,
        }

    def _eval_loss(self) -> float:
        """The token-mean loss over the held-out rows (EVAL_ROWS of them), split over the ranks: no dropout, no
        gradients, no MoE aux loss. Every rank runs as many forward passes (ZeRO-3 gathers weights in each), a rank
        short of rows repeats one with no targets; one collective brings the sums."""
        import torch

        from kit.data.prepared import IGNORE_INDEX

        held, mbs = self.heldout, self.cfg.mbs
        n = len(held)
        slots = range(self.rank, -(-n // self.world) * self.world, self.world)
        sums = torch.zeros(2, dtype=torch.float32, device=self.device)  # loss sum, targets
        self.engine.eval()
        try:
            with torch.no_grad():
                for at in range(0, len(slots), mbs):
                    chunk = list(slots[at : at + mbs])
                    batch = dict(held[[i % n for i in chunk]])
                    batch["labels"] = batch["labels"].clone()
                    for r, i in enumerate(chunk):
                        if i >= n:
                            batch["labels"][r] = IGNORE_INDEX
                    targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
                    loss, _ = self._lm_loss(batch, aux=False)
                    if targets:
                        sums += torch.stack([loss.float() * targets, loss.new_tensor(float(targets))])
        finally:
            self.engine.train()
        loss_sum, count = self._reduce_tensor(sums)
        return loss_sum / count if count else float("nan")

    def _lm_loss(self, batch: dict, aux: bool = True):
        """(the micro-batch's causal-LM loss, its real tokens): padded rows go as one padding-free row where kit
        attention keeps them apart, and the LM head then runs only where a target follows. `aux`: with a MoE
        router's load-balancing loss (training; the held-out loss is the LM's alone)."""
        import torch

        from kit.train.batches import tokens_in

        flat, keep, coef = False, None, self.aux_coef if aux else 0.0
        if self.flatten:
            rows, batch = batch, flatten_padded_rows(batch)
            flat = batch is not rows
            if flat and self.select_logits:
                keep = logit_positions(batch["labels"])  # on the host, before the move: no device sync
        batch = {k: v.to(self.device, dtype=torch.long) for k, v in batch.items()}  # kit.data stores int32
        if flat:
            from kit.adapt.attention import flattened_rows

            with flattened_rows():  # kit attention refuses a call that has lost position_ids
                return causal_lm_loss(self.engine, batch, keep, coef), tokens_in(batch)
        return causal_lm_loss(self.engine, batch, None, coef), tokens_in(batch)

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
        self.saved_iteration = iteration
        self.writer.text(f"saved checkpoint {path} at iteration {iteration} ({why})")
        for hook in self.checkpoint_hooks:
            hook.after_save(path, iteration)
        return path

    def train(self) -> TrainResult:
        """Run to TRAIN_ITERS (or to a stop signal / NaN); save checkpoints and, at the end, an HF folder."""
        import os

        from kit.storage.locks import hold

        # one run per folder: the job's rank 0 holds the lock (the other ranks and nodes of the job write into
        # the same folder under it) from before the first read to the run manifest
        rank0 = int(os.environ.get("RANK", "0")) == 0
        try:
            with hold(self.out, "training run", enabled=rank0):
                return self._train()
        except BaseException:
            for hook in self.checkpoint_hooks:  # the OBS uploads stop: a failed run leaves no writer behind
                hook.close()
            raise

    def _train(self) -> TrainResult:
        import os

        from kit.system.procs import PREEMPT_GRACE_VARIABLE, STOP_GRACE_S
        from kit.system.progress import bar as progress_bar
        from kit.system.progress import in_kernel
        from kit.system.waits import seconds
        from kit.train.live import RunView

        t_start = time.time()
        grace_s = seconds(os.environ, PREEMPT_GRACE_VARIABLE, STOP_GRACE_S)
        self._setup()
        cfg = self.cfg
        previous = self._install_signals()
        losses, iteration, status, message, last_ckpt = [], self.start_iter, "completed", "", None
        eval_losses: dict = {}
        deadline = None  # a stop signal's: the checkpoint uploads end by then
        show = self.progress and self.rank == 0
        # in a notebook the live view (kit.train.live), elsewhere tqdm's bar
        view = (
            RunView(cfg.train_iters, self.start_iter, f"{cfg.run_type} ({self.out.name})")
            if show and in_kernel()
            else None
        )
        bar = progress_bar(
            total=cfg.train_iters,
            initial=self.start_iter,
            desc=f"{cfg.run_type} steps",
            disable=not show or view is not None,
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
                evaluate = self.heldout is not None and (
                    iteration % cfg.eval_every == 0 or iteration == cfg.train_iters
                )
                if evaluate:
                    metrics["eval_loss"] = eval_losses[iteration] = self._eval_loss()
                self.writer.iteration(
                    metrics,
                    print_line=iteration % cfg.log_interval == 0 or evaluate,
                    echo=view is None,  # the view shows them
                )
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")
                if view is not None:
                    view.update(metrics)
                for cb in self.step_callbacks:
                    cb(iteration)
                stop = self._all_reduce_ints([1 if self._stop_reason else 0], "max")[0]
                if stop:
                    status = "preempted"
                    if self._signal_at or self._stop_reason is None:  # a signal here or on another rank
                        deadline = (self._signal_at or time.monotonic()) + UPLOAD_SHARE * grace_s
                    last_ckpt = self._save(
                        iteration, f"stop requested ({self._stop_reason or 'another rank'})"
                    )
                    message = (
                        f"stopped at iteration {iteration} on request ({self._stop_reason or 'another rank'}); "
                        f"checkpointed to {last_ckpt}; resume with RUN_TYPE=retrain "
                        f"RESUME_FROM={self.out.name} (--run-type retrain --resume-from {self.out.name})."
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
            eval_losses=eval_losses,
            message=message,
        )
        if status == "completed":
            if self.saved_iteration != iteration:
                result.checkpoint = self._save(iteration, "end of training")
            else:
                result.checkpoint = self.ckpt_root / checkpoint.tag_of(iteration)
            if cfg.save_hf:
                self._export(result)
            result.message = f"trained {iteration} iterations; outputs in {self.out}"
            self.writer.text(result.message)
        failed = []
        why = f"{UPLOAD_SHARE:.0%} of {PREEMPT_GRACE_VARIABLE}={grace_s:g} s after the stop signal"
        for hook in self.checkpoint_hooks:  # e.g. the OBS uploads: the run ends after them
            for line in hook.finish(deadline, why):
                self.writer.text(line)
            failed += hook.errors
        if failed:  # never "completed" while OBS_HOME lacks a checkpoint; the local ones are whole either way
            result.status = "upload_failed" if status == "completed" else status
            more = f" ({len(failed) - 1} more in the log)" if len(failed) > 1 else ""
            result.message = f"{result.message.rstrip('.')}; but {failed[0].rstrip('.')}{more}."
            self.writer.text(result.message)
        self.writer.close()
        if self.rank == 0 and self.writer.enabled and self.writer.jsonl_path.is_file():
            from kit.train.live import plot_loss
            from kit.train.metrics import read_metrics

            records = [r for r in read_metrics(self.writer.jsonl_path) if r.get("loss") is not None]
            if records:  # the whole run's curve, a resumed run's earlier steps too
                plot_loss(records, self.out / "training_loss.png", f"{cfg.run_type} loss ({self.out.name})")
        if view is not None:
            view.close(result.message or f"{status} at iteration {iteration}")
        result.seconds = time.time() - t_start
        result.config = cfg
        if self.objective is not None:
            result.dpo = self.objective.summary()
        if status == "completed" and self.rank == 0:
            from kit.train.run_manifest import write_run_manifests

            result.manifest, result.hf_manifest = write_run_manifests(result, self.ckpt_root)
        return result

    def _export(self, result: TrainResult) -> None:
        from kit.train.export import export_hf, export_lora

        cfg = self.cfg
        tok = cfg.tokenizer_path or cfg.model_path
        if cfg.lora:
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
            result.hf_dir = export_hf(
                self.engine.module, self.out / "hf", tok, cfg.zero_stage, self.rank, base_path=cfg.model_path
            )
        self.writer.text(f"saved HF folder {result.hf_dir}")


def heldout_rows(prepared, cfg) -> tuple:
    """(the held-out rows the run is scored on every EVAL_EVERY steps: the first EVAL_ROWS of notebook 02's split,
    model inputs only, or None; why not, when the data names a split that is not here). None: EVAL_EVERY=0, no
    split, or preference pairs (notebook 06 scores those). A split that is here but damaged is an error."""
    from kit.data.prepared import MODEL_INPUTS

    if not cfg.eval_every or prepared.kind == "dpo" or not prepared.heldout:
        return None, None
    where = Path(prepared.heldout["path"])
    if not where.is_dir():  # e.g. a job given the training rows alone: it trains, without the held-out loss
        return (
            None,
            f"{where} (the data's held-out split) is not here: no held-out loss (EVAL_EVERY) this run.",
        )
    held = prepared.heldout_dataset()
    if len(held) == 0:
        return None, None
    held = held.select(range(min(EVAL_ROWS, len(held))))
    return held.with_format("torch", columns=list(MODEL_INPUTS)), None


def _restarts(ds, rows: int = 64) -> bool:
    """True when some of the first rows restart position_ids inside their real tokens (several dialogs)."""
    sample = ds[: min(rows, len(ds))]
    pos, mask = sample["position_ids"], sample["attention_mask"].bool()
    return bool(((pos[:, 1:] == 0) & mask[:, 1:]).any())


def flatten_padded_rows(batch: dict) -> dict:
    """A micro-batch with padding -> one row of its real tokens (padding-free, like HF's DataCollatorWithFlattening).

    Only for kit attention, which starts a new sequence wherever position_ids restart (every row and every packed
    dialog does), so no token attends across rows; the projections and MLPs then skip the padding (a packed row is
    rarely full: its last dialog does not fit). The loss is the same sum over the same targets: the first token of
    each row, which the row layout never predicts (labels shift by one), gets label -100 so that the last token of
    the previous row does not predict it. A batch without padding is returned as it is.
    """
    import torch

    mask = batch["attention_mask"].bool()
    if bool(mask.all()):
        return batch
    out = {k: batch[k][mask].unsqueeze(0) for k in ("input_ids", "labels", "position_ids")}
    lengths = mask.sum(dim=1)
    starts = (torch.cumsum(lengths, 0) - lengths)[1:]
    out["labels"][0, starts[lengths[1:] > 0]] = -100
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    return out


def logit_positions(labels):
    """For a one-row (flattened) micro-batch: the positions whose next token is a target (labels != -100), or
    None when every position predicts one (pretraining rows: nothing to skip) or the batch has several rows."""
    if labels.shape[0] != 1:
        return None
    keep = labels[0, 1:] != -100
    if bool(keep.all()):
        return None
    return keep.nonzero().squeeze(1)


def aux_loss_coef(model) -> float:
    """The router aux-loss coefficient of a MoE model (set by kit.train.engine.build_model), 0.0 for others."""
    from kit.adapt.moe import is_moe_model

    return float(getattr(model, "router_aux_loss_coef", 0.0) or 0.0) if is_moe_model(model) else 0.0


def causal_lm_loss(engine, batch: dict, positions=None, aux_coef: float = 0.0):
    """The micro-batch's loss, as `engine(**batch).loss` computes it: the mean cross-entropy over the targets
    (labels != -100, shifted by one), in float32; with `aux_coef` (MoE models) plus aux_coef times the router's
    load-balancing loss over the micro-batch's tokens (HF's `load_balancing_loss_func`, attention_mask-weighted).

    With `positions` (logit_positions() of a one-row, flattened micro-batch) the LM head runs only where a
    target follows (`logits_to_keep`): prompt and template tokens and the last token of every packed dialog
    predict nothing that counts, and the head (hidden x vocabulary: a large share of a small model's work, and of
    the activation memory with a big vocabulary) is skipped there, forward and backward. Same loss and
    gradients (test); the positions come from the labels on the host, so no device sync is added.
    """
    extra = {"output_router_logits": True} if aux_coef else {}
    if positions is None:  # with labels, HF's MoE forward adds router_aux_loss_coef * aux_loss itself
        return engine(**batch, **extra).loss
    import torch

    labels = batch["labels"]
    positions = positions.to(labels.device)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = engine(**inputs, logits_to_keep=positions, **extra)
    loss = torch.nn.functional.cross_entropy(out.logits[0].float(), labels[0, 1:][positions])
    return loss + aux_coef * out.aux_loss.to(loss.device) if aux_coef else loss


def check_packing(meta: dict, adapt_report, dataset_path, ds=None) -> None:
    """Refuse packed SFT rows when attention is not kit attention: plain HF attention would mix the dialogs.

    Packed rows restart position_ids at each dialog; only kit attention (ADAPT=True) turns that into varlen
    attention. transformers' eager/sdpa attention ignores it and lets every dialog see the ones before it.
    A meta.json without `packed` (not written by kit.data) is judged from the rows themselves.
    """
    from kit.errors import InputError

    packed = meta.get("packed")
    if packed is None and ds is not None and meta.get("kind") == "sft":
        packed = _restarts(ds)
    packed_sft = meta.get("kind") == "sft" and bool(packed)
    kit_attention = adapt_report is not None and getattr(adapt_report, "attention", None) == "kit"
    if packed_sft and not kit_attention:
        raise InputError(
            f"{dataset_path} packs several dialogs per row, which plain HF attention would let attend to each "
            "other: set ADAPT=True (kit attention keeps dialogs apart) or prepare the data with PACK=False."
        )


def bind_device(info) -> None:
    """Pin this process to its card (LOCAL_RANK) before the process group exists.

    HCCL/NCCL communicators are created on the current device: without an explicit set_device every rank of a
    node would first touch card 0 (torch_npu's distributed docs ask for `torch.npu.set_device(local_rank)`
    before `init_process_group`). torch.npu exists once kit.system.device has imported torch_npu.
    """
    import os

    import torch

    if info.kind not in ("npu", "cuda"):
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    getattr(torch, info.kind).set_device(local_rank)


def train(
    run: Union[TrainConfig, TrainPlan],
    ws: Any = None,
    step_callbacks: Sequence[StepCallback] = (),
    progress: bool = True,
) -> TrainResult:
    """Train in this process (a notebook cell for tiny runs; `kit.train.launch` for real ones): a plan as it is, a
    config resolved once in workspace `ws` (kit.train.resolve). The run folder gets a training-run manifest."""
    from kit.train.obs_home import checkpoint_hooks

    plan = run if isinstance(run, TrainPlan) else resolve(run, ws)
    hooks = checkpoint_hooks(plan)
    return Trainer(plan, step_callbacks=step_callbacks, progress=progress, checkpoint_hooks=hooks).train()
