"""Per-device memory of a training plan: each engine's own partitioning rules over exact state sizes, plus the
traced transient memory (kit.plan.trace), plus the buffers the engine allocates.

DeepSpeed (the kit's trainer: torch AdamW handed to `deepspeed.initialize`, DeepSpeed 0.19 defaults), per card, with
P trainable parameters, N all parameters, b bytes per weight (2 for bf16/fp16, 4 for fp32), DP cards:
- ZeRO 0: weights N*b, gradients P*b, Adam moments 8P; after the backward the gradients are all-reduced as flat
  copies in buckets of 5e8 elements (engine.py allreduce_gradients -> buffered_allreduce_fallback, on one card too);
  mixed precision adds DeepSpeed's flat fp32 master copy (4P) and, at the step, its flat fp32 gradients (4P)
  (engine.py _do_optimizer_sanity_check: FP16 / DDP_BFLOAT16 -> fp16/fused_optimizer.py).
- ZeRO 1 / 2 (zero/stage_1_and_2.py): parameters flattened into one buffer the model's tensors view; the fp32
  partition the optimizer steps (a clone of this card's 1/DP share, 4P/DP), its moments (8P/DP); gradients P*b
  (stage 1) or P*b/DP (stage 2); the contiguous-gradient bucket of reduce_bucket_size elements (setup_buckets, twice
  with overlap_comm); at the step the fp32 gradient partition (4P/DP, mixed precision only).
- ZeRO 3 (zero/stage3.py): weights, gradients, fp32 partition and moments all 1/DP; parameters under
  param_persistence_threshold elements (1e5) stay whole on every card (the norms of a large model; most of a tiny
  one); the gradient shares live in one flat buffer made with the optimizer; the layer being computed and the prefetch bucket
  are gathered whole.
- Optimizer offload: the fp32 partition and moments live in host memory (listed, not counted on the card).
Megatron (megatron-core with the distributed optimizer, bf16, fp32 main gradients; Megatron-LM's own estimate,
theoretical_memory_usage.py: 6 + 12/DP bytes per parameter), per card of the most loaded pipeline stage: TP splits
every layer's matrices, PP holds its stage's layers (the first stage also the embedding, the last the head), EP
holds num_experts/EP experts, DP = cards / (TP x PP); 1F1B keeps min(PP, micro-batches) micro-batches of
activations on the first stage; sequence parallelism (on with TP > 1) splits the activations by TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from kit.plan.model import SMALL, Counts
from kit.plan.trace import Traced

ADAM_MOMENTS = 8  # exp_avg + exp_avg_sq, fp32
FP32 = 4


def deepspeed_defaults() -> dict:
    """The ZeRO buffer sizes the kit's ds_config leaves at DeepSpeed's defaults (read from DeepSpeed's config class
    when it is installed, else its 0.19 values)."""
    import contextlib
    import io

    from kit.system.noise import quiet

    try:
        with contextlib.redirect_stdout(io.StringIO()), quiet():  # its accelerator probe's log lines
            from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        zc = DeepSpeedZeroConfig()
        return {
            "reduce_bucket_size": int(zc.reduce_bucket_size),
            "prefetch_bucket_size": int(zc.prefetch_bucket_size),
            "param_persistence_threshold": int(zc.param_persistence_threshold),
            "overlap_comm": bool(zc.overlap_comm),
            "allreduce_bucket_size": int(MEMORY_OPT_ALLREDUCE_SIZE),
        }
    except Exception:  # not installed (a planning-only machine)
        return {
            "reduce_bucket_size": 500_000_000,
            "prefetch_bucket_size": 50_000_000,
            "param_persistence_threshold": 100_000,
            "overlap_comm": False,
            "allreduce_bucket_size": 500_000_000,
        }


@dataclass
class Memory:
    """Bytes on the most loaded card, by term (the table's rows)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    """Activations, their gradients and the temporaries (logits and loss over the vocabulary among them)."""
    buffers: int = 0
    host: int = 0
    reference: Optional[int] = None
    """RUN_TYPE=dpo: what its reference holds on the card (0 with LoRA's adapters off); None: not a DPO run."""
    notes: list = field(default_factory=list)

    @property
    def tensors(self) -> int:
        """Everything on the card that PyTorch allocates (what the CPU agreement test measures)."""
        return (
            self.weights
            + self.gradients
            + self.optimizer
            + self.activations
            + self.buffers
            + (self.reference or 0)
        )

    def terms(self) -> Dict[str, int]:
        out = {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer states": self.optimizer,
            "activations and temporaries": self.activations,
            "communication buffers": self.buffers,
        }
        if self.reference is not None:
            out["DPO reference"] = self.reference
        return out


@dataclass(frozen=True)
class Run:
    """What is trained, how: the inputs every plan shares."""

    counts: Counts
    dtype_bytes: int
    lora_r: int = 0
    mbs: int = 1
    gbs: int = 1

    @property
    def trainable(self) -> int:
        return (
            self.lora_r * self.counts.lora_per_layer * self.counts.layers
            if self.lora_r
            else self.counts.total
        )

    @property
    def all_params(self) -> int:
        return self.counts.total + (self.trainable if self.lora_r else 0)

    @property
    def mixed(self) -> bool:
        return self.dtype_bytes < FP32


def deepspeed_memory(
    run: Run, traced: Traced, cards: int, zero: int, offload: bool = False, scale: float = 1.0
) -> Memory:
    """Per-card bytes of the kit's DeepSpeed trainer at ZeRO `zero` on `cards` cards (see the module); `scale`: the
    plan's micro-batch over the traced one."""
    d = deepspeed_defaults()
    b, p, n, dp = run.dtype_bytes, run.trainable, run.all_params, cards
    m = Memory()
    share = p / dp if zero >= 1 else p
    m.weights = n * b
    if zero == 3:  # partitioned, but tensors under the persistence threshold stay whole on every card
        small = run.counts.small if d["param_persistence_threshold"] == SMALL else 0
        m.weights = int((n - small) * b / dp + small * b)
    master = 0
    if run.mixed:
        master = FP32 * share
    elif zero >= 1:
        master = FP32 * share  # the fp32 partition is a clone of the flat parameters' share
    moments = ADAM_MOMENTS * share
    if offload:
        m.host = int(master + moments)
        m.notes.append("optimizer offload: fp32 partition and Adam moments in host memory")
    else:
        m.optimizer = int(master + moments)
    grads = p * b / (dp if zero >= 2 else 1)
    step_fp32_grads = FP32 * share if run.mixed else 0  # made at the step, freed after
    if zero in (1, 2):
        m.buffers = d["reduce_bucket_size"] * b * (2 if d["overlap_comm"] else 1)
    elif zero == 3:
        gathered = run.counts.per_layer + d["prefetch_bucket_size"]
        m.buffers = int(min(gathered, n) * b + d["reduce_bucket_size"] * b)
    # after the backward: every gradient, plus (ZeRO 0) one flat all-reduce bucket of them, or (mixed precision)
    # the fp32 gradients the step makes
    allreduce = min(p, d["allreduce_bucket_size"]) * b if zero == 0 else 0
    after = grads + max(allreduce, step_fp32_grads)
    if zero == 3:
        # each gradient is reduced as it is made and its share copied into one flat partition buffer, made
        # with the optimizer and kept (stage3.py grad_partitions_flat_buffer)
        transient, grads_then = traced.peak(grad_share=0, scale=scale)
        grads_then = grads
    else:
        transient, grads_then = traced.peak(grad_share=1 / dp if zero == 2 else 1, scale=scale)
    if transient + grads_then >= after:  # the forward/backward peak
        m.activations, m.gradients = int(transient), int(grads_then)
    else:
        m.gradients, m.buffers = int(grads), int(m.buffers + allreduce)
        m.activations = int(after - grads - allreduce)  # the step's fp32 gradients
        m.notes.append("the peak comes after the backward (all gradients), when the activations are freed")
    return m


def dpo_reference_memory(run: Run, reference: str, pairs: int = 0) -> int:
    """Bytes a DPO run's reference holds on the card (kit.train.dpo): nothing for LoRA's adapters switched off (the
    same weights); for full training the precomputed log-probabilities, two fp32 numbers per pair (on the card
    while they are computed, then kept with the data); or a frozen copy of the model's weights (DPO_REFERENCE='copy',
    whole on every card, also under ZeRO-3)."""
    if reference == "copy":
        return run.counts.total * run.dtype_bytes
    if reference == "precompute":
        return 2 * FP32 * pairs
    return 0


def megatron_memory(
    run: Run,
    layer_terms: tuple,
    cards: int,
    tp: int,
    pp: int,
    ep: int = 1,
    recompute_terms: Optional[tuple] = None,
) -> Memory:
    """Per-card bytes of the most loaded pipeline stage under megatron-core (see the module). `layer_terms`:
    (outside the layers, per layer) transient bytes of one micro-batch (kit.plan.trace.layer_terms);
    `recompute_terms`: the same with full recompute (a layer then keeps its input only)."""
    c = run.counts
    dp = cards // (tp * pp)
    layers = math.ceil(c.layers / pp)
    experts = (
        c.experts_per_layer * c.expert_layers / c.layers
    )  # a mean layer's (some MoE models lead with dense ones)
    dense_layer = c.per_layer - experts
    per_layer = dense_layer / tp + experts / (ep * tp)
    ends = (c.embedding + c.head) / tp if pp == 1 else max(c.embedding, c.head or c.embedding) / tp
    params = per_layer * layers + ends + c.other
    expert_dp = max(1, cards // (ep * tp * pp))
    expert_share = experts / (ep * tp) * layers
    m = Memory()
    m.weights = int(params * 2)
    m.gradients = int(params * FP32)  # main gradients in fp32
    dense_share = params - expert_share
    m.optimizer = int(12 * (dense_share / dp + expert_share / expert_dp))
    grad_accum = max(1, run.gbs // (run.mbs * dp))
    in_flight = min(pp, grad_accum)
    base, layer = recompute_terms or layer_terms
    first = layer / tp * layers * in_flight
    if recompute_terms is not None:  # one layer's full activations while it is recomputed
        first += layer_terms[1] / tp
    last = layer / tp * layers + layer_terms[0] / tp
    m.activations = int(max(first + (layer_terms[0] / tp if pp == 1 else 0), last) * run.mbs)
    if pp > 1:
        m.notes.append(f"1F1B: {in_flight} micro-batches in flight on the first stage")
    return m
