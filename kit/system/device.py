"""Accelerator choice: NPU (torch_npu) > CUDA > CPU, with dtype, backend and visible-devices variable."""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from kit.errors import DeviceError, InputError

# Which environment variable restricts the visible cards, and which collective backend to use, per kind.
VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES", "cpu": None}
DIST_BACKEND = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


@dataclass
class DeviceInfo:
    """What `detect()` found and chose, with the reasons, for reports and for the trainer."""

    kind: str  # "npu" | "cuda" | "cpu"
    device: str  # e.g. "npu:0", "cuda:0", "cpu"
    count: int
    name: str
    dtype: str  # "bfloat16" | "float16" | "float32"
    dtype_reason: str
    backend: str
    visible_devices_env: Optional[str]
    torch_version: Optional[str] = None
    torch_npu_version: Optional[str] = None
    torch_npu_error: Optional[str] = None  # the real import error, kept for the doctor's report
    cann_version: Optional[str] = None
    reasons: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


def _import_torch_npu() -> tuple[Optional[Any], Optional[str]]:
    """Import torch_npu if it can be imported; return (module, None) or (None, 'ExcType: message')."""
    try:
        module = importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, OSError (libhccl.so), RuntimeError (version mismatch) ...
        return None, f"{type(exc).__name__}: {exc}"
    return module, None


@functools.lru_cache(maxsize=1)
def torch_npu_import() -> tuple[Optional[Any], Optional[str]]:
    """Cached guarded import of torch_npu: (module or None, import error text or None)."""
    return _import_torch_npu()


def _npu_dtype(torch) -> tuple[str, str]:
    try:
        if torch.npu.is_bf16_supported():
            return "bfloat16", "this NPU supports bf16 (Atlas A2/910B class); bf16 keeps fp32's range"
    except Exception as exc:  # pragma: no cover - depends on the card
        return "float16", f"bf16 support could not be queried ({exc}); fp16 is supported on every Ascend NPU"
    return "float16", "this NPU has no bf16 (Ascend 910A class); fp16 with loss scaling is the fast path"


def _cuda_dtype(torch) -> tuple[str, str]:
    if torch.cuda.is_bf16_supported():
        return "bfloat16", "this GPU supports bf16 (compute capability >= 8.0)"
    return "float16", "this GPU has no bf16; fp16 with loss scaling is the fast path"


def detect(prefer: Optional[str] = None) -> DeviceInfo:
    """Detect the best accelerator (or the one named by `prefer` / env KIT_DEVICE) and choose dtype and backend."""
    import torch

    prefer = (prefer or os.environ.get("KIT_DEVICE") or "").lower() or None
    if prefer not in (None, "npu", "cuda", "cpu"):
        raise InputError(
            f"KIT_DEVICE/prefer={prefer!r} is not one of npu, cuda, cpu; unset it to auto-detect."
        )
    reasons: list[str] = []
    npu_mod, npu_err = torch_npu_import()
    npu_ok = False
    if npu_mod is not None:
        try:
            npu_ok = bool(torch.npu.is_available()) and torch.npu.device_count() > 0
        except Exception as exc:  # pragma: no cover - depends on the driver
            npu_err = f"{type(exc).__name__}: {exc}"
        if not npu_ok:
            reasons.append(
                "torch_npu imports but no NPU is visible (check npu-smi info and ASCEND_RT_VISIBLE_DEVICES)"
            )
    else:
        reasons.append(f"torch_npu not importable ({npu_err})")
    cuda_ok = torch.cuda.is_available()
    if not cuda_ok:
        reasons.append("no CUDA device")

    if prefer == "npu" and not npu_ok:
        raise DeviceError(
            f"NPU requested but not usable: {npu_err or 'no visible NPU'}. Run notebook 00 (doctor)."
        )
    if prefer == "cuda" and not cuda_ok:
        raise DeviceError("CUDA requested but torch.cuda.is_available() is False.")
    kind = prefer or ("npu" if npu_ok else "cuda" if cuda_ok else "cpu")

    if kind == "npu":
        count, name = torch.npu.device_count(), str(torch.npu.get_device_name(0))
        dtype, why = _npu_dtype(torch)
        reasons.append(f"chose NPU: {count} visible")
    elif kind == "cuda":
        count, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        dtype, why = _cuda_dtype(torch)
        reasons.append(f"chose CUDA: {count} visible")
    else:
        count, name = 1, "cpu"
        dtype, why = (
            "float32",
            "CPU: fp32 gives results comparable with NPU/GPU runs; bf16 matmuls on CPU are slow",
        )
        reasons.append("chose CPU: no accelerator usable")
    return DeviceInfo(
        kind=kind,
        device=f"{kind}:0" if kind != "cpu" else "cpu",
        count=count,
        name=name,
        dtype=dtype,
        dtype_reason=why,
        backend=DIST_BACKEND[kind],
        visible_devices_env=VISIBLE_DEVICES_ENV[kind],
        torch_version=torch.__version__,
        torch_npu_version=getattr(npu_mod, "__version__", None) if npu_mod else None,
        torch_npu_error=npu_err,
        cann_version=getattr(getattr(torch, "version", None), "cann", None),
        reasons=reasons,
    )


def get_device(local_rank: Optional[int] = None):
    """The torch.device this process should use (local rank from LOCAL_RANK when not given)."""
    import torch

    info = detect()
    if info.kind == "cpu":
        return torch.device("cpu")
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    return torch.device(f"{info.kind}:{rank}")


def synchronize(device=None) -> None:
    """Wait for queued kernels on the device (no-op on CPU); needed for honest timings."""
    import torch

    kind = getattr(device, "type", None) or detect().kind
    if kind == "npu":
        torch.npu.synchronize()
    elif kind == "cuda":
        torch.cuda.synchronize()


def visible_devices_env(kind: Optional[str] = None) -> Optional[str]:
    """The variable that restricts visible cards for `kind` (default: the detected kind)."""
    return VISIBLE_DEVICES_ENV[kind or detect().kind]


def enable_transfer_to_npu() -> bool:
    """Opt-in for users' CUDA-written code: import torch_npu.contrib.transfer_to_npu (patches torch.cuda -> npu).

    The kit's own code never relies on it. Returns False (and changes nothing) when torch_npu is absent.
    """
    mod, _ = torch_npu_import()
    if mod is None:
        return False
    importlib.import_module("torch_npu.contrib.transfer_to_npu")
    return True
