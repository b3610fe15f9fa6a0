"""A collective check for the NPU path: torch.distributed calls refuse the dtypes HCCL refuses.

HCCL (torch_npu's ProcessGroupHCCL, Ascend/pytorch `torch_npu/csrc/distributed/ProcessGroupHCCL.cpp`) reduces
int8, int16, int32, int64, fp16, fp32 and bf16, plus uint8 (torch's object collectives, e.g.
broadcast_object_list that DeepSpeed calls at start-up, send pickled bytes as uint8 and run on HCCL); float64
works only on the newest SoCs, so a float64 all_reduce fails every multi-card run on Atlas A2/A3. float64,
bool and complex are refused (the safe side).
The real collective still runs (gloo on CPU), so a data-parallel run under the check computes real numbers.

In-process: `install_hccl_check(monkeypatch)`. Launched jobs: put `hccl_site/` on PYTHONPATH; its
sitecustomize patches every child process and, with KIT_HCCL_CHECK_LOG set, appends one line per call there.
"""

from __future__ import annotations

import functools
import os

import torch

from .ops import StandinError

HCCL_DTYPES = (
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.bfloat16,
    torch.uint8,
)
CHECKED = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
)
CALLS: list = []


class HcclDtypeError(StandinError):
    """A collective on a dtype HCCL does not take."""


def _tensors(args, kwargs):
    found = [a for a in args if isinstance(a, torch.Tensor)]
    found += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            found += [t for t in a if isinstance(t, torch.Tensor)]
    return found


def _checked(name: str, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        for t in _tensors(args, kwargs):
            CALLS.append((name, t.dtype))
            log = os.environ.get("KIT_HCCL_CHECK_LOG")
            if log:
                with open(log, "a", encoding="utf-8") as f:
                    f.write(f"{os.getpid()} {name} {str(t.dtype).replace('torch.', '')}\n")
            if t.dtype not in HCCL_DTYPES:
                raise HcclDtypeError(
                    f"HCCL {name} does not support {t.dtype} (allowed: int8/16/32/64, uint8, fp16, fp32, bf16)"
                )
        return original(*args, **kwargs)

    wrapper.__kit_hccl_check__ = True
    return wrapper


def patch_all() -> None:
    """Wrap torch.distributed's collectives in this process (for sitecustomize; no undo)."""
    import torch.distributed as dist

    for name in CHECKED:
        original = getattr(dist, name, None)
        if original is not None and not getattr(original, "__kit_hccl_check__", False):
            setattr(dist, name, _checked(name, original))


def install_hccl_check(monkeypatch) -> list:
    """Wrap torch.distributed's collectives for one test (undone by monkeypatch); returns CALLS."""
    import torch.distributed as dist

    CALLS.clear()
    for name in CHECKED:
        original = getattr(dist, name, None)
        if original is not None:
            monkeypatch.setattr(dist, name, _checked(name, original))
    return CALLS
