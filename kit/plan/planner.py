"""Will it fit, and how fast: the plans for a model, sequence length and set of cards, ranked.

`make_plan(PlanInputs)` reads the model's config.json (no weights), counts its parameters exactly, traces one
micro-batch at full size on fake tensors (kit.plan.trace), and lays the result out per card for every plan the kit
can run, each with and without full recompute (RECOMPUTE): DeepSpeed ZeRO 0-3 (notebook 04's trainer) and
megatron-core TP x PP (x EP) with the distributed optimizer (the Megatron path). A plan's total is its tensors plus a stated
allocator margin plus what the card's runtime holds; it fits when that total is within the card's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence

from kit.core.workspace import LORA_TARGETS
from kit.errors import InputError
from kit.plan.cards import GIB, Card, card
from kit.plan.engines import Memory, Run, deepspeed_memory, dpo_reference_memory, megatron_memory
from kit.plan.model import Counts, counts, dense_layers, load_config, sliced
from kit.plan.trace import TraceKey, trace

# The share of the tensors the caching allocator adds in fragmentation and rounding. A stated planning figure:
# it was not measured on an NPU or a GPU (the CPU check measures tensors, where it is zero); the device check
# (kit adapt device-check) is where it gets measured.
ALLOCATOR_MARGIN = 0.08
# Model FLOPs utilisation a prediction assumes when no run of the user's says better: a planning figure (large
# dense runs on Ascend A2 and on GPUs commonly report 0.35-0.5); `--mfu` or a finished run's own replaces it.
DEFAULT_MFU = 0.40
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class PlanInputs:
    model: str
    """A model folder with config.json (or the file): HF, or converted by notebook 03."""
    seq_len: int
    mbs: int = 1
    gbs: Optional[int] = None
    """Global batch in sequences; default MBS x cards (one micro-batch per card per step)."""
    cards: int = 8
    card: str = "910B-64G"
    card_memory_gib: Optional[float] = None
    peak_tflops: Optional[float] = None
    lora_r: int = 0
    """0: full training; else LoRA at this rank on lora_targets."""
    lora_targets: Sequence[str] = LORA_TARGETS
    dtype: str = "auto"
    """auto: bf16 on an accelerator card, fp32 on this machine's CPU."""
    engines: Sequence[str] = ("deepspeed", "megatron")
    mfu: float = DEFAULT_MFU
    adapt: bool = True
    zero_stage: Optional[int] = None
    """The plan the run is set to (marked in the list): ZeRO stage for DeepSpeed, and whether it recomputes."""
    recompute: bool = False
    dpo_reference: str = ""
    """RUN_TYPE=dpo: its reference (adapters_off | precompute | copy; kit.train.dpo.reference_kind); '' for the
    other run types. A DPO micro-batch of MBS pairs is 2 x MBS sequences (chosen and rejected)."""
    pairs: int = 0
    """RUN_TYPE=dpo with the precomputed reference: the number of pairs (two fp32 log-probabilities each)."""


@dataclass
class PlanRow:
    engine: str
    layout: str
    mbs: int
    grad_accum: int
    memory: Memory
    total: int
    fits: bool
    tokens_per_s_per_card: float
    flags: str = ""
    chosen: bool = False

    def row(self, capacity: int) -> dict:
        return {
            "plan": self.layout + (" (this run)" if self.chosen else ""),
            "MBS x GA": f"{self.mbs} x {self.grad_accum}",
            "GiB per card": round(self.total / GIB, 1),
            "headroom GiB": round((capacity - self.total) / GIB, 1),
            "fits": "yes" if self.fits else "no",
            "tokens/s/card": round(self.tokens_per_s_per_card) if self.tokens_per_s_per_card else "-",
            "settings": self.flags,
        }


@dataclass
class PlanReport:
    inputs: PlanInputs
    card: Card
    counts: Counts
    dtype: str
    flops_per_token: float
    rows: List[PlanRow] = field(default_factory=list)
    trace_seconds: float = 0.0

    @property
    def capacity(self) -> int:
        return int(self.card.memory_gib * GIB)

    def fitting(self) -> List[PlanRow]:
        return [r for r in self.rows if r.fits]

    def chosen(self) -> Optional[PlanRow]:
        return next((r for r in self.rows if r.chosen), None)


def _dtype(inputs: PlanInputs) -> str:
    if inputs.dtype != "auto":
        if inputs.dtype not in DTYPE_BYTES:
            raise InputError(f"dtype {inputs.dtype!r} is not one of auto, {', '.join(DTYPE_BYTES)}.")
        return inputs.dtype
    return "float32" if inputs.card == "here" and card("here").peak_tflops == 0 else "bfloat16"


def flops_per_token(
    config, c: Counts, seq: int, lora: bool, recompute: bool = False, reference: bool = False
) -> float:
    """Training FLOPs per token: 2 per multiply-add of every weight a token meets (MoE: its experts only; the
    embedding lookup is no matmul), attention scores and values over a causal sequence (half of S x S), times 3
    for forward + backward (2 with LoRA: no weight gradients of the frozen model), plus a forward with recompute,
    plus one for a DPO reference scored at every step (`reference`: adapters off, or the frozen copy)."""
    weights = c.active - (c.embedding if c.head else 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (config.hidden_size // max(heads, 1)))
    attention = 2 * 2 * seq * heads * head_dim * c.layers / 2
    forward = 2 * weights + attention
    return forward * ((2 if lora else 3) + (1 if recompute else 0) + (1 if reference else 0))


def _speed(report: PlanReport, config, recompute: bool, bubble: float, mfu: float) -> float:
    if not report.card.peak_tflops:
        return 0.0
    r = report.inputs
    per_token = flops_per_token(config, report.counts, r.seq_len, bool(r.lora_r), recompute, _online(r))
    return mfu * report.card.peak_tflops * 1e12 / per_token * bubble


def _online(inputs: PlanInputs) -> bool:
    """A DPO reference that runs a forward at every step (the precomputed one ran once, before the first)."""
    return inputs.dpo_reference in ("adapters_off", "copy")


def _total(memory: Memory, the_card: Card) -> int:
    return int(memory.tensors * (1 + ALLOCATOR_MARGIN) + the_card.runtime_reserve_gib * GIB)


def _mbs_options(inputs: PlanInputs, dp: int, gbs: int) -> List[tuple]:
    """(MBS, grad accumulation) pairs that keep the global batch on `dp` data-parallel ranks, largest MBS first."""
    out = []
    for mbs in range(inputs.mbs, 0, -1):
        if gbs % (mbs * dp) == 0:
            out.append((mbs, gbs // (mbs * dp)))
    return out


def make_plan(inputs: PlanInputs) -> PlanReport:
    """Every plan for `inputs`, those that fit first, faster first (see the module)."""
    if inputs.seq_len < 1 or inputs.mbs < 1 or inputs.cards < 1:
        raise InputError("seq_len, mbs and cards must be positive integers.")
    if inputs.dpo_reference not in ("", "adapters_off", "precompute", "copy"):
        raise InputError(
            f"dpo_reference {inputs.dpo_reference!r} is not one of adapters_off, precompute, copy ('' for no DPO)."
        )
    if inputs.dpo_reference == "adapters_off" and not inputs.lora_r:
        raise InputError("a DPO reference with the adapters off needs LoRA: give lora_r (--lora-r).")
    the_card = card(inputs.card, inputs.card_memory_gib, inputs.peak_tflops)
    config = load_config(inputs.model)
    targets = tuple(inputs.lora_targets) if inputs.lora_r else ()
    c = counts(config, inputs.lora_targets)
    dtype = _dtype(inputs)
    gbs = inputs.gbs or inputs.mbs * inputs.cards
    per_token = flops_per_token(config, c, inputs.seq_len, bool(inputs.lora_r), reference=_online(inputs))
    report = PlanReport(inputs, the_card, c, dtype, per_token)
    key = TraceKey(inputs.seq_len, 1, dtype, inputs.lora_r, targets, inputs.adapt)
    traced = trace(config, key)
    report.trace_seconds += traced.seconds
    b = DTYPE_BYTES[dtype]
    if "deepspeed" in inputs.engines:
        recomputed = trace(config, replace(key, recompute=True))
        report.trace_seconds += recomputed.seconds
        mbs, ga = (_mbs_options(inputs, inputs.cards, gbs) or [(inputs.mbs, 1)])[0]
        sequences = 2 * mbs if inputs.dpo_reference else mbs  # DPO: each pair's chosen and rejected answers
        for zero in (0, 1, 2, 3):
            for rc, t in ((False, traced), (True, recomputed)):
                run = Run(c, b, inputs.lora_r, mbs, gbs)
                memory = deepspeed_memory(run, t, inputs.cards, zero, scale=sequences)
                if inputs.dpo_reference:
                    memory.reference = dpo_reference_memory(run, inputs.dpo_reference, inputs.pairs)
                    memory.notes.append(_dpo_note(inputs, mbs))
                total = _total(memory, the_card)
                report.rows.append(
                    PlanRow(
                        "deepspeed",
                        f"DeepSpeed ZeRO-{zero}" + (" + recompute" if rc else ""),
                        mbs,
                        ga,
                        memory,
                        total,
                        total <= report.capacity,
                        _speed(report, config, rc, 1.0, inputs.mfu),
                        f"ZERO_STAGE={zero}" + (" RECOMPUTE=True" if rc else ""),
                        chosen=inputs.zero_stage == zero and inputs.recompute == rc,
                    )
                )
    # DPO runs on the kit's DeepSpeed trainer only (kit.train.config)
    if "megatron" in inputs.engines and not inputs.lora_r and dtype != "float32" and not inputs.dpo_reference:
        _megatron_rows(report, config, key, gbs)
    # those that fit, faster first; then those that do not, nearest first
    report.rows.sort(key=lambda r: (0, -r.tokens_per_s_per_card, r.total) if r.fits else (1, r.total, 0))
    return report


def _dpo_note(inputs: PlanInputs, mbs: int) -> str:
    ref = {
        "adapters_off": "the model with its adapters off, nothing more held",
        "precompute": f"{inputs.pairs} pairs' log-probabilities computed before the first step",
        "copy": "a frozen copy of the weights",
    }.get(inputs.dpo_reference, inputs.dpo_reference)
    return f"DPO: {2 * mbs} sequences per micro-batch (chosen + rejected); reference: {ref}"


def layer_terms(config, key: TraceKey) -> tuple:
    """(outside the layers, per layer) transient bytes of one micro-batch, from slices of k+1 and k+2 layers (k
    leading dense layers: the difference is a layer like the rest)."""
    k = dense_layers(config)
    peaks = []
    for layers in (k + 1, k + 2):
        t = trace(sliced(config, layers), key)
        peaks.append(max((tr for _g, tr in t.frontier), default=0))
    per_layer = peaks[1] - peaks[0]
    return peaks[0] - (k + 1) * per_layer, per_layer


def _megatron_rows(report: PlanReport, config, key: TraceKey, gbs: int) -> None:
    from kit.core.parallel import ep_candidates, pipeline_problems, tp_candidates

    c, inputs = report.counts, report.inputs
    heads = int(config.num_attention_heads)
    groups = int(getattr(config, "num_key_value_heads", heads) or heads)
    moe_ffn = int(getattr(config, "moe_intermediate_size", 0) or 0) if c.num_experts else 0
    terms = layer_terms(config, key)
    recompute = layer_terms(config, replace(key, recompute=True))
    tps = [t for t in tp_candidates(heads, int(config.intermediate_size), groups, "local", moe_ffn) if t <= 8]
    for tp in tps:
        for pp in range(1, c.layers + 1):
            if inputs.cards % (tp * pp) or pipeline_problems(c.layers, pp):
                continue
            dp = inputs.cards // (tp * pp)
            eps = ep_candidates(c.num_experts, tp, pp, inputs.cards) if c.num_experts else [1]
            for ep in eps:
                options = _mbs_options(inputs, dp, gbs)
                if not options:
                    continue
                mbs, ga = options[0]
                for rc in (False, True):
                    run = Run(c, 2, 0, mbs, gbs)
                    memory = megatron_memory(run, terms, inputs.cards, tp, pp, ep, recompute if rc else None)
                    total = _total(memory, report.card)
                    bubble = ga / (ga + pp - 1)
                    layout = (
                        f"Megatron TP{tp} PP{pp}"
                        + (f" EP{ep}" if c.num_experts else "")
                        + (" + recompute" if rc else "")
                    )
                    flags = (
                        f"TP={tp} PP={pp}"
                        + (f" EP={ep}" if c.num_experts else "")
                        + (
                            " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
                            if rc
                            else ""
                        )
                    )
                    report.rows.append(
                        PlanRow(
                            "megatron",
                            layout,
                            mbs,
                            ga,
                            memory,
                            total,
                            total <= report.capacity,
                            _speed(report, config, rc, bubble, inputs.mfu),
                            flags,
                        )
                    )


def inputs_for(plan, card_name: str = "here", **overrides) -> PlanInputs:
    """The planner's inputs for a resolved training run (kit.train.resolve.TrainPlan): its model, sequence length
    (the prepared data's), batch sizes, cards, ZeRO stage and LoRA rank; `overrides` replace any of them."""
    cfg = plan.cfg
    lora = cfg.run_type == "lora" or (cfg.run_type == "dpo" and getattr(cfg, "dpo_lora", False))
    dpo = {}
    if (
        cfg.run_type == "dpo"
    ):  # its reference as kit.train.dpo.reference_kind resolves 'auto' (train imports plan)
        ref = cfg.dpo_reference if cfg.dpo_reference != "auto" else ("adapters_off" if lora else "precompute")
        dpo = dict(dpo_reference=ref, pairs=int(plan.data.get("num_samples") or 0))
    values = dict(
        model=str(cfg.model_path),
        seq_len=int(cfg.seq_len or plan.data.get("max_length") or 0),
        mbs=cfg.mbs,
        gbs=cfg.gbs,
        cards=cfg.world_size,
        card=card_name,
        lora_r=cfg.lora_r if lora else 0,
        lora_targets=tuple(cfg.lora_targets),
        dtype=cfg.dtype,
        adapt=cfg.adapt,
        zero_stage=cfg.zero_stage if cfg.engine == "deepspeed" else None,
        recompute=bool(cfg.recompute),
        engines=("deepspeed",) if cfg.engine == "deepspeed" else ("megatron",),
        **dpo,
    )
    values.update(overrides)
    return PlanInputs(**values)
