"""Per-iteration metrics: the ModelArts manual's tokens/s/p, Megatron-style log lines, metrics.jsonl and TensorBoard scalars."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from kit.errors import writing


def tokens_per_second_per_card(gbs: int, seq_len: int, cards: int, elapsed_ms: float) -> float:
    """The ModelArts manual's throughput (section "查看性能"): global batch size * seq_length / (cards * elapsed ms per iteration) * 1000."""
    if elapsed_ms <= 0 or cards <= 0:
        return 0.0
    return gbs * seq_len / (cards * elapsed_ms) * 1000.0


def format_line(m: dict, train_iters: int) -> str:
    """One Megatron-style line (field names and number formats as Megatron's training_log prints them)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("time", time.time())))
    parts = [
        f" [{stamp}] iteration {m['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {m['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {m['elapsed_ms']:.1f}",
        f"learning rate: {m['lr']:.6E}",
        f"global batch size: {m['gbs']:5d}",
        f"lm loss: {m['loss']:.6E}",
        # the held-out loss, on the steps that measure it (EVAL_EVERY)
        *([f"eval loss: {m['eval_loss']:.6E}"] if m.get("eval_loss") is not None else []),
        f"loss scale: {m.get('loss_scale', 1.0):.1f}",
    ]
    # DPO: the metrics TRL logs, named as it names them (kit.train.dpo.METRICS)
    parts += [f"{k}: {m[k]:.6E}" for k in m if k.startswith(("rewards/", "logps/"))]
    if m.get("grad_norm") is not None:
        parts.append(f"grad norm: {m['grad_norm']:.3f}")
    parts += [
        f"number of skipped iterations: {m.get('skipped', 0):3d}",
        f"number of nan iterations: {m.get('nan', 0):3d}",
        f"tokens/s/p: {m['tokens_per_s_per_card']:.1f}",
        *([f"memory (GiB): {m['memory_gib']:.2f}"] if m.get("memory_gib") is not None else []),
        f"samples/s: {m['samples_per_s']:.3f}",
    ]
    return " | ".join(parts) + " |"


class MetricsWriter:
    """Writes each iteration's metrics to the log file (Megatron lines), metrics.jsonl and TensorBoard (rank 0)."""

    def __init__(
        self, log_dir: Path, run_name: str, train_iters: int, enabled: bool = True, echo: bool = True
    ):
        self.log_dir, self.train_iters, self.enabled, self.echo = Path(log_dir), train_iters, enabled, echo
        self.log_path = self.log_dir / f"{run_name}.log"
        self.jsonl_path = self.log_dir / f"{run_name}.metrics.jsonl"
        self.tb_dir = self.log_dir / "tensorboard" / run_name
        self._tb = None
        if enabled:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def _writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional; the jsonl file carries the same numbers
                self._tb = False
            else:
                self._tb = SummaryWriter(str(self.tb_dir))
        return self._tb

    def text(self, line: str, echo: bool = True) -> None:
        """A free-form line in the log (start, checkpoint saved, stop reasons); `echo`: also printed (when the
        writer echoes at all)."""
        if not self.enabled:
            return
        if self.echo and echo:
            # one write: under a launcher (unbuffered) print's two writes let another rank's line land between
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        with writing(self.log_path), open(self.log_path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    def iteration(self, m: dict, print_line: bool = True, echo: bool = True) -> None:
        """Record one optimizer step (every step goes to jsonl/TensorBoard; lines every LOG_INTERVAL, printed too
        unless `echo` is False: a notebook's live view shows them)."""
        if not self.enabled:
            return
        with writing(self.jsonl_path), open(self.jsonl_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(m) + "\n")
        if print_line:
            self.text(format_line(m, self.train_iters), echo)
        tb = self._writer()
        if tb:
            keys = (
                "loss",
                "eval_loss",
                "lr",
                "grad_norm",
                "tokens_per_s_per_card",
                "samples_per_s",
                "elapsed_ms",
                "memory_gib",
            )
            for key in keys + tuple(k for k in m if k.startswith(("rewards/", "logps/"))):
                if m.get(key) is not None:
                    tb.add_scalar(f"train/{key}", m[key], m["iteration"])

    def close(self) -> None:
        if self._tb:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(path: Path, since: Optional[int] = None) -> list:
    """The records of a metrics.jsonl file (a later record for the same iteration replaces the earlier one)."""
    by_iter = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            by_iter[rec["iteration"]] = rec
    return [by_iter[k] for k in sorted(by_iter) if since is None or k > since]
