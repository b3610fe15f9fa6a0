"""The conversion stage's config: one dataclass, every problem reported at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from kit.convert.megatron_layout import FLAVORS

DIRECTIONS = ("hf_to_megatron", "megatron_to_hf", "megatron_to_megatron")
DTYPES = (None, "float32", "bfloat16", "float16")


@dataclass
class ConvertConfig:
    """What to convert, into which layout, and where to put it."""

    source: str
    """HF folder (config.json + shards) or Megatron folder (latest_checkpointed_iteration.txt)"""
    target: Optional[str] = None
    """Output folder (refused if it exists); None: ws.converted_weights/<layout>."""
    direction: str = "hf_to_megatron"
    """Which way: hf_to_megatron | megatron_to_hf | megatron_to_megatron."""
    tp: int = 1
    """Target tensor parallel size."""
    pp: int = 1
    """Target pipeline parallel size."""
    ep: int = 1
    """Target expert parallel size (MoE models: each EP rank holds num_experts / EP experts)."""
    num_layer_list: Optional[List[int]] = None
    """Uneven PP: layers per stage, e.g. [7, 8, 8, 7] (CLI 7,8,8,7)"""
    family: Optional[str] = None
    """Model family: llama | qwen3 | glm | chatglm | baichuan | util.py loader (llama2_hf); None: from model_type."""
    flavor: str = "local"
    """Megatron key names: local (mcore local spec, MindSpeed) | legacy | te."""
    moe_grouped_gemm: bool = False
    """MoE experts in the --moe-grouped-gemm layout: local: GroupedMLP weight1/weight2 (MindSpeed-LLM); te: TEGroupedMLP."""
    make_vocab_size_divisible_by: int = 128
    """Megatron's --make-vocab-size-divisible-by (padding rule)"""
    padded_vocab_size: Optional[int] = None
    """Explicit padded vocabulary (ModelLink --padded-vocab-size)"""
    dtype: Optional[str] = None
    """Cast weights: float32 | bfloat16 | float16; None keeps the source dtype."""
    hf_config_dir: Optional[str] = None
    """Megatron source: its HF config/tokenizer folder; None: its hf_meta/."""
    max_shard_mb: int = 2048
    """megatron_to_hf: largest safetensors shard, in MB."""
    workers: int = 0
    """Threads writing rank files; 0: one per CPU core (at most 8), 1: one file at a time."""
    overwrite: bool = False
    """Replace an existing target folder."""
    clean_partial: bool = False
    """Delete .TARGET.partial-* folders of interrupted runs (else only reported)"""

    def problems(self) -> List[str]:
        out = []
        if not self.source:
            out.append("source is empty; give the folder to convert.")
        if not self.target:
            out.append("target is not set; give the output folder, or run(cfg, ws) to use the workspace's.")
        if self.direction not in DIRECTIONS:
            out.append(f"direction {self.direction!r} is not one of {DIRECTIONS}.")
        for name in ("tp", "pp", "ep", "make_vocab_size_divisible_by", "max_shard_mb"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{name} = {v!r} must be a positive integer.")
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
            out.append(f"workers = {self.workers!r} must be 0 (one per CPU core) or a positive integer.")
        if self.flavor not in FLAVORS:
            out.append(f"flavor {self.flavor!r} is not one of {FLAVORS}.")
        if self.dtype not in DTYPES:
            out.append(f"dtype {self.dtype!r} is not one of {DTYPES}.")
        if self.num_layer_list is not None and (
            not isinstance(self.num_layer_list, (list, tuple)) or len(self.num_layer_list) != self.pp
        ):
            out.append(
                f"num_layer_list {self.num_layer_list!r} must list one layer count per stage (pp={self.pp})."
            )
        if self.padded_vocab_size is not None and (
            not isinstance(self.padded_vocab_size, int) or self.padded_vocab_size % max(self.tp, 1)
        ):
            out.append(
                f"padded_vocab_size {self.padded_vocab_size!r} must be an integer divisible by tp={self.tp}."
            )
        return out
