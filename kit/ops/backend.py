"""Which implementation a kit op runs: the torch_npu kernel ("npu") or the portable torch code ("torch").

Rule: tensors on an ``npu`` device use torch_npu; everything else uses torch. ``use_backend("npu")`` (or the
environment variable ``KIT_OPS_BACKEND=npu``) forces the torch_npu branch whatever the device; the test-suite
uses it with a strict CPU stand-in for torch_npu so the exact NPU calls run in CI. ``"torch"`` forces the
portable code, e.g. to compare against the fused kernels on a real NPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, Optional

BACKENDS = ("auto", "npu", "torch")
_state = threading.local()


def _forced() -> str:
    value = getattr(_state, "backend", None) or os.environ.get("KIT_OPS_BACKEND", "auto") or "auto"
    value = value.lower()
    if value not in BACKENDS:
        raise ValueError(
            f"kit ops backend {value!r} is not one of {BACKENDS}; fix KIT_OPS_BACKEND or use_backend()."
        )
    return value


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force kit ops to the "npu" or "torch" implementation inside the `with` block ("auto" restores the rule)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {BACKENDS}.")
    previous = getattr(_state, "backend", None)
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = previous


def resolve(tensor: Any, backend: Optional[str] = None) -> str:
    """The backend an op on `tensor` runs: explicit argument > use_backend()/KIT_OPS_BACKEND > device type."""
    choice = (backend or _forced()).lower()
    if choice not in BACKENDS:
        raise ValueError(f"backend {choice!r} is not one of {BACKENDS}.")
    if choice == "auto":
        return "npu" if getattr(getattr(tensor, "device", None), "type", None) == "npu" else "torch"
    return choice


def torch_npu_module() -> Any:
    """The torch_npu module for the NPU branch; a clear error when it cannot be imported."""
    from kit.system import device

    module, error = device.torch_npu_import()
    if module is None:
        raise RuntimeError(
            f"the NPU branch of kit.ops needs torch_npu, which did not import ({error}). "
            "Use tensors on CPU/CUDA (portable path) or use_backend('torch'); on NPU run notebook 00 (doctor)."
        )
    return module
