"""Strict CPU stand-in for the parts of torch_npu the kit calls; `install(monkeypatch)` puts it in place.

Use in a test:  `fake = install(monkeypatch)` then `with kit.ops.use_backend("npu"): ...` so kit ops take their
NPU branch on CPU tensors; `fake.CALLS` lists every torch_npu call made. Nothing here imports the real torch_npu.
"""

from __future__ import annotations

import sys
import types

from . import ops

STANDIN_VERSION = "2.13.0+standin"
OP_NAMES = (
    "npu_fusion_attention",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_fast_gelu",
    "npu_scaled_masked_softmax",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_gating_top_k",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_grouped_matmul",
    "npu_grouped_matmul_add_",
)


SET_DEVICE_CALLS: list = []  # every torch.npu.set_device(...) argument, in order


def _npu_namespace(bf16: bool = True, count: int = 1) -> types.SimpleNamespace:
    """The `torch.npu` functions kit.system.device uses, answering as Atlas A2 cards would (bf16=False: a 910A)."""
    return types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: count,
        get_device_name=lambda index=0: "Ascend910B2 (stand-in)" if bf16 else "Ascend910A (stand-in)",
        is_bf16_supported=lambda: bf16,
        synchronize=lambda device=None: None,
        current_device=lambda: 0,
        set_device=SET_DEVICE_CALLS.append,
        manual_seed=lambda seed: None,
        manual_seed_all=lambda seed: None,
        empty_cache=lambda: None,
        memory_allocated=lambda device=None: 0,
        max_memory_allocated=lambda device=None: 0,
        reset_peak_memory_stats=lambda device=None: None,
    )


def build_module() -> types.ModuleType:
    """A fresh fake `torch_npu` module holding the strict ops and a CALLS list."""
    module = types.ModuleType("torch_npu")
    module.__version__ = STANDIN_VERSION
    module.__path__ = []  # a package, so `import torch_npu.profiler` can resolve a submodule entry
    for name in OP_NAMES:
        setattr(module, name, getattr(ops, name))
    module.CALLS = ops.CALLS
    module.StandinError = ops.StandinError
    return module


def install(monkeypatch, *, profiler: bool = True, bf16: bool = True, count: int = 1) -> types.ModuleType:
    """Install the fake torch_npu (+ torch.npu functions, + fake profiler if present); undone by monkeypatch."""
    import torch

    import kit.system.device as device

    ops.CALLS.clear()
    SET_DEVICE_CALLS.clear()
    fake = build_module()
    fake.SET_DEVICE_CALLS = SET_DEVICE_CALLS
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", _npu_namespace(bf16, count), raising=False)

    def torch_npu_import():
        return fake, None

    torch_npu_import.cache_clear = lambda: None  # callers treat it like the lru_cache'd original
    # Replacing the module attribute (not clearing the original's cache) leaves nothing behind after the test.
    monkeypatch.setattr(device, "torch_npu_import", torch_npu_import)
    if profiler:
        try:
            from .profiler import install_profiler
        except ImportError:  # the profiler stand-in is optional for ops tests
            install_profiler = None
        if install_profiler is not None:
            install_profiler(monkeypatch)
    return fake
