"""The cards a plan is made for: memory per card and peak dense bf16/fp16 throughput.

Memory is the card's HBM in GiB as `npu-smi info` / `nvidia-smi` show it. Peak FLOPS are dense (no sparsity) matrix
throughput in bf16/fp16: NVIDIA's datasheets for the GPUs; for the Ascend cards the figures commonly quoted for them
(Huawei publishes no per-SKU table), so `--peak-tflops` takes the user's own. Nothing here was measured by the kit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kit.errors import InputError

GIB = 2**30


@dataclass(frozen=True)
class Card:
    name: str
    memory_gib: float
    peak_tflops: float
    """Dense bf16/fp16 matrix throughput, TFLOP/s."""
    runtime_reserve_gib: float
    """What the device runtime holds outside PyTorch's allocator (context, collective and kernel workspaces)."""


# keys are what --card takes; the ModelArts flavors carry these cards (kit job: POOL_FLAVOR_CARDS counts them)
CARDS = {
    "910B-64G": Card("Ascend 910B 64 GB (Atlas 800T A2)", 64, 313, 3.0),
    "910B4-32G": Card("Ascend 910B4 32 GB", 32, 280, 3.0),
    "A100-80G": Card("NVIDIA A100 80 GB", 80, 312, 1.5),
    "H100-80G": Card("NVIDIA H100 80 GB SXM", 80, 989, 1.5),
    "H200-141G": Card("NVIDIA H200 141 GB", 141, 989, 1.5),
}


def card(name: str, memory_gib: Optional[float] = None, peak_tflops: Optional[float] = None) -> Card:
    """The card called `name` (a key of CARDS, or 'here': this machine's device), with explicit values replacing
    its memory or peak."""
    if name == "here":
        base = this_device()
    elif name in CARDS:
        base = CARDS[name]
    else:
        raise InputError(
            f"card {name!r} is not known; use one of {', '.join(CARDS)}, or 'here' for this device."
        )
    return Card(
        base.name,
        float(memory_gib) if memory_gib is not None else base.memory_gib,
        float(peak_tflops) if peak_tflops is not None else base.peak_tflops,
        base.runtime_reserve_gib,
    )


def this_device() -> Card:
    """This machine's accelerator (kit.system.device), or its host memory on a CPU-only machine."""
    import torch

    from kit.system.device import detect

    info = detect()
    if info.kind in ("npu", "cuda"):
        module = getattr(torch, info.kind)
        props = module.get_device_properties(0)
        name = getattr(props, "name", info.kind)
        gib = props.total_memory / GIB
        known = [c for c in CARDS.values() if c.memory_gib * 0.85 <= gib <= c.memory_gib * 1.02]
        peak = known[0].peak_tflops if known else 0.0  # 0: MFU-based speeds need --peak-tflops
        return Card(f"{name} (this machine)", round(gib, 1), peak, 3.0 if info.kind == "npu" else 1.5)
    from kit.system.memory import available_memory

    free, _ = available_memory()
    return Card("this machine's CPU (host memory available now)", round(free / GIB, 1), 0.0, 0.0)
