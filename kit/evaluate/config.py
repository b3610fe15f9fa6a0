"""The evaluation stage's config: one dataclass, every problem reported at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

ENGINES = ("auto", "lm-eval", "kit")
PARTS = ("heldout", "preference", "accuracy", "generation", "speed")
DEFAULT_PROMPTS = [
    "Give three tips for staying healthy.",
    "用一句话介绍长城。",
]


@dataclass
class EvalConfig:
    """What to evaluate against what, on which data and tasks, and where the results go."""

    run: Optional[str] = None
    """Training-run folder (notebook 04); None: the named run (notebook 04's, else the last one finished)."""
    model_path: Optional[str] = None
    """HF folder or Megatron checkpoint to evaluate instead of a run's exported model."""
    base_model: Optional[str] = None
    """HF folder to compare with; None: the model the run started from."""
    data: Optional[str] = None
    """Prepared-data folder whose held-out split is scored; None: the run's data."""
    dpo_run: Optional[str] = None
    """DPO run compared side by side with its SFT run and base; None: the run's own chain (its newest DPO run)."""
    pairs: Optional[str] = None
    """Prepared preference pairs (kind dpo) whose held-out split is scored; None: the DPO run's."""
    parts: List[str] = field(default_factory=lambda: list(PARTS))
    """What to measure: heldout, preference, accuracy, generation, speed."""
    heldout_rows: int = 64
    """Score at most this many held-out rows, and as many held-out pairs (0: all)"""
    tasks: List[str] = field(default_factory=lambda: ["kit_mc_en", "kit_mc_zh"])
    """lm-eval task YAMLs or shipped task names."""
    task_limit: int = 0
    """Questions per task (0: all)"""
    engine: str = "auto"
    """Multiple choice through lm-eval | kit (same recipe) | auto (lm-eval when installed)."""
    prompts: List[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    """Prompts for the side-by-side answers."""
    prompts_file: Optional[str] = None
    """Text file, one prompt a line (or .jsonl with "prompt"); replaces prompts."""
    template: Optional[str] = None
    """Chat template for prompts; None: the data's (else the tokenizer's own)"""
    max_new_tokens: int = 24
    """Tokens generated per prompt."""
    batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4])
    """Batch sizes of the speed measurement."""
    prompt_lengths: List[int] = field(default_factory=lambda: [16, 64])
    """Prompt lengths (tokens); e.g. [128, 2048] on a card."""
    decode_tokens: int = 8
    """Tokens decoded per speed measurement (e.g. 64 on a card)"""
    repeats: int = 3
    """Timings per speed point: the best is kept, their spread is the noise base vs trained is judged by"""
    device: Optional[str] = None
    """npu | cuda | cpu; None: what kit.system.device finds."""
    adapt: bool = True
    """On NPU, run the models with kit attention and fused ops (kit.adapt)"""
    out_dir: Optional[str] = None
    """Results folder; None: <run>/evaluation/<name>, else the workspace's evaluations/<name>."""
    name: str = "eval"
    """Name of the results folder."""
    overwrite: bool = False
    """Replace an existing results folder of the same name."""

    def problems(self) -> List[str]:
        """Every problem with this config, each saying what to change."""
        out = []
        bad = [p for p in (self.parts or []) if p not in PARTS]
        if bad or not self.parts:
            out.append(f"parts={self.parts!r}: use a non-empty list of {', '.join(PARTS)}.")
        if self.engine not in ENGINES:
            out.append(f"engine={self.engine!r}: use one of {', '.join(ENGINES)}.")
        for name in ("heldout_rows", "task_limit"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                out.append(f"{name}={v!r}: use an integer >= 0 (0: all).")
        for name in ("max_new_tokens", "decode_tokens", "repeats"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{name}={v!r}: use a positive integer.")
        for name in ("batch_sizes", "prompt_lengths"):
            v = getattr(self, name)
            if not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
                out.append(f"{name}={v!r}: use a non-empty list of positive integers, e.g. [1, 2, 4].")
        if "accuracy" in (self.parts or []) and not self.tasks:
            out.append("tasks is empty: name at least one task YAML (or drop 'accuracy' from parts).")
        if self.device not in (None, "npu", "cuda", "cpu"):
            out.append(f"device={self.device!r}: use npu, cuda, cpu or None (auto).")
        import re

        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", self.name or ""):
            out.append(f"name={self.name!r}: use a plain folder name of letters, digits, '.', '_' or '-'.")
        return out
