"""Activation memory at full size without weights: one training micro-step (forward, loss, backward) of the real
model class at its real size (every layer, the real width, sequence and micro-batch), on fake tensors.

PyTorch's `FakeTensorMode` gives every tensor its real shape, dtype and storage size but no memory; a dispatch
mode (`_Live`) follows every storage as operators make it and PyTorch frees it, weight gradients apart. The model
is adapted as notebook 04 adapts it (kit attention, which like the NPU's fusion attention never holds the S x S
matrix; kit RMSNorm, SwiGLU, rotary; kit MoE), without the numerical probes nothing can be computed for. Packed
rows are traced as one causal sequence each (varlen attention holds the same). The loss is over every position:
the pretraining case; SFT runs the head only where an answer token follows, so it needs less.

What comes out: the (weight gradients, everything else) pairs that can be the step's peak, so that each engine's
rule for how much of the gradients a card keeps gives that card's peak (kit.plan.engines).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from kit.errors import KitError
from kit.plan.model import build

TRACE_VERSION = 1  # part of the cache key: bump when what a trace measures changes
# torch 2.1's fake tensors abort inside the embedding of a fake model (seen on the py39-torch21 stack); 2.5 traces
# the families the kit trains (the py310-torch25 stack runs the planner's tests)
TORCH_NEEDED = (2, 5)


def check_torch() -> None:
    """The trace runs on this torch, or one line says where it can."""
    import torch

    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if have < TORCH_NEEDED:
        raise KitError(
            f"the planner's trace needs torch >= {'.'.join(map(str, TORCH_NEEDED))} (this is {torch.__version__}); "
            "run `python -m kit plan` in an env that has it: it needs only the model's config.json, no NPU and "
            "no weights."
        )


@dataclass(frozen=True)
class Traced:
    """One micro-batch's forward, loss and backward on one device, no partitioning (kit.plan.engines divides).

    `frontier`: (weight-gradient bytes, other transient bytes) at the moments that can be the peak: every moment
    of the step is below one of these in both terms, so for a plan that keeps a share s of the gradients on a
    card, max(transient + s * gradients) over the frontier is that card's forward/backward peak.
    """

    frontier: list
    grads: int
    """All trainable parameters' gradient bytes."""
    seconds: float

    def peak(self, grad_share: float = 1.0, scale: float = 1.0) -> tuple:
        """(activations and temporaries, gradients) at the peak when a card holds `grad_share` of the gradients
        and `scale` times the micro-batch (activations are linear in it)."""
        return max(((t * scale, g * grad_share) for g, t in self.frontier), key=sum, default=(0, 0))


@dataclass(frozen=True)
class TraceKey:
    seq: int
    mbs: int
    dtype: str
    lora_r: int = 0
    lora_targets: Sequence[str] = ()
    adapt: bool = True
    recompute: bool = False


def _cache_dir() -> Path:
    return Path(os.environ.get("KIT_PLAN_CACHE", Path.home() / ".cache" / "ascend-kit" / "plan"))


def _key(config, key: TraceKey) -> str:
    import torch
    import transformers

    blob = json.dumps(
        [config.to_dict(), asdict(key), TRACE_VERSION, torch.__version__, transformers.__version__],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def trace(config, key: TraceKey, use_cache: bool = True) -> Traced:
    """The transient memory of `config`'s whole model for one micro-batch (cached by the inputs)."""
    check_torch()
    path = _cache_dir() / f"{_key(config, key)}.json"
    if use_cache and path.is_file():
        try:
            return Traced(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError):
            pass  # a damaged entry is traced again
    start = time.perf_counter()
    frontier, grads = _trace(config, key)
    out = Traced(frontier=frontier, grads=grads, seconds=round(time.perf_counter() - start, 2))
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.write_text(json.dumps(asdict(out)), encoding="utf-8")
        tmp.replace(path)
    return out


def _pareto(points) -> list:
    """The (g, t) points no other point matches or beats in both."""
    out, best_t = [], -1
    for g, t in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if t > best_t:
            out.append([int(g), int(t)])
            best_t = t
    return out


def _one_expert_matmul(x, weight):
    """Stand-in for torch's grouped matmul in the trace: the same output and saved inputs, and a gradient of the
    whole expert weight (torch's fake kernel accepts bf16 only; the CPU kernel also fp32)."""

    def run(a, b, offs=None):
        return a @ b[0]

    return run


@contextlib.contextmanager
def _fake_friendly():
    """Packed-row planning reads position values, which fake tensors do not have (one causal row holds the same
    memory); the grouped expert matmul gets its stand-in."""
    import kit.adapt.attention as attention
    import kit.ops.moe as moe

    saved = attention.plan_varlen, moe._grouped_mm
    attention.plan_varlen = lambda *args, **kwargs: None
    moe._grouped_mm = _one_expert_matmul
    try:
        yield
    finally:
        attention.plan_varlen, moe._grouped_mm = saved


class _Live:
    """Live storage bytes after every operator, split into weight gradients and the rest (activations, their
    gradients, temporaries). Storages alive when it starts (weights, buffers) are not counted; a storage is
    counted once however many views share it, and leaves the count when PyTorch frees it (weak reference)."""

    def __init__(self, model) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.sizes: dict = {}  # storage id -> (bytes, is a weight gradient)
        self.refs: dict = {}
        self.total = self.grads = 0
        self.points: list = []
        self.skip = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
        live = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        live.track(t)
                live.points.append((live.grads, live.total - live.grads))
                return out

        self.mode = Mode()
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad)

    def track(self, t) -> None:
        import weakref

        st = t.untyped_storage()
        key = st._cdata
        if key in self.sizes or key in self.skip:
            return
        n = st.nbytes()
        self.sizes[key] = (n, False)
        self.total += n

        def gone(_ref, key=key) -> None:
            size, grad = self.sizes.pop(key)
            self.refs.pop(key, None)
            self.total -= size
            self.grads -= size if grad else 0

        self.refs[key] = weakref.ref(st, gone)

    def _grad(self, p) -> None:
        self.track(p.grad)
        key = p.grad.untyped_storage()._cdata
        size, grad = self.sizes[key]
        if not grad:
            self.sizes[key] = (size, True)
            self.grads += size
        self.points.append((self.grads, self.total - self.grads))


def _trace(config, key: TraceKey) -> tuple:
    """(frontier, gradient bytes) of one forward + loss + backward of the whole model on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = getattr(torch, key.dtype)
    with warnings.catch_warnings(), _fake_friendly():
        warnings.simplefilter("ignore")  # fake storages warn on data_ptr and module-hook bookkeeping
        # made on the meta device (peft's adapter moves cannot swap fake parameters), then given fake storage
        with torch.device("meta"):  # what adapting and LoRA add is made there too
            model = build(config, dtype)
            if key.adapt:
                _adapt(model)
            if key.lora_r:
                model = _lora(model, key)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.train()
            if key.recompute:
                model.config.use_cache = False  # (transformers says so once per model otherwise)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                if key.lora_r:
                    model.enable_input_require_grads()
            trainable = [p for p in model.parameters() if p.requires_grad]
            ids = torch.randint(0, int(config.vocab_size), (key.mbs, key.seq))
            live = _Live(model)
            with live.mode:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
    grads = sum(p.numel() * p.element_size() for p in trainable)
    return _pareto(live.points), int(grads)


def _adapt(model) -> Optional[object]:
    from kit.adapt import adapt_model
    from kit.adapt.hf import SUPPORTED_MODEL_TYPES

    if str(model.config.model_type) not in SUPPORTED_MODEL_TYPES:
        return None  # 04 trains it unadapted too
    return adapt_model(model, device="cpu", probe=False)


def _lora(model, key: TraceKey):
    from peft import LoraConfig, get_peft_model

    from kit.adapt.lora_targets import resolve_targets

    # the targets as the run resolves them (DeepSeek-V3: MLA's projections)
    targets = resolve_targets(model, key.lora_targets)
    lora = LoraConfig(task_type="CAUSAL_LM", r=key.lora_r, lora_alpha=2 * key.lora_r, target_modules=targets)
    return get_peft_model(model, lora)
