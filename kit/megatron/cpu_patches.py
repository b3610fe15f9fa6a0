"""megatron-core's CUDA assumptions, replaced for CPU ranks (gloo): applied only inside the preflight's rank processes.

megatron-core 0.16 asks CUDA for its device in many places; on CPU each is one of four shapes, and each shape gets
one patch here (file/line references are megatron-core 0.16.1):

1. `torch.cuda.current_device()` as a device: rotary embedding (`models/common/embeddings/rotary_pos_embedding.py`
   l.162 `inv_freq.to(...)`), pipeline receive buffers (`pipeline_parallel/p2p_communication.py` l.313, l.321), the
   grad buffers (`distributed/param_and_grad_buffer.py` l.783-806), the TP gathers (`tensor_parallel/mappings.py`)
   -> returns "cpu".
2. `device="cuda"` literals and `Tensor.cuda()`: the schedule's token counter (`pipeline_parallel/schedules.py`
   l.596, l.983), the optimizer's scalars (`optimizer/optimizer.py` l.473-485), `clip_grads.py` l.90-207, and the
   tied embedding's copy to the last stage at PP > 1 (`models/common/language_module/language_module.py` l.244
   `weight.data.cuda()`) -> a TorchFunctionMode sends them to the CPU.
3. The fp32 type check `param.type() == 'torch.cuda.FloatTensor'` (`optimizer/distrib_optimizer.py` l.420,
   `optimizer/optimizer.py` l.690) -> the same mode answers a CPU float32 tensor's `.type()` with the CUDA name.
4. The CUDA RNG tracker (`tensor_parallel/random.py` `CudaRNGStatesTracker.fork`, entered by attention and
   dropout) -> a no-op context (the preflight runs with dropout 0, so no random state is drawn there).

The pipeline's `torch.cuda.synchronize()` (`p2p_communication.py` l.242) is avoided by `batch_p2p_sync=False` in
the model config, not patched. A megatron-core outside SUPPORTED gets one line, not a traceback (`check_version`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

from kit.errors import InputError

SUPPORTED = ((0, 16, 0), (0, 16, 99))  # the releases whose lines above were read; others may have moved them


class UnsupportedMegatronError(InputError):
    """The installed megatron-core is not one the CPU patches were written for."""


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def supported_range() -> str:
    lo, hi = SUPPORTED
    return f"{lo[0]}.{lo[1]}.{lo[2]}-{hi[0]}.{hi[1]}.x"


def check_version(version: Optional[str] = None) -> str:
    """The installed megatron-core's version; UnsupportedMegatronError (one line) if absent or outside SUPPORTED."""
    if version is None:
        try:
            from importlib.metadata import PackageNotFoundError
            from importlib.metadata import version as dist_version
        except ImportError:  # pragma: no cover - Python < 3.8
            raise UnsupportedMegatronError("megatron-core cannot be looked up on this Python") from None
        try:
            version = dist_version("megatron-core")
        except PackageNotFoundError:
            raise UnsupportedMegatronError(
                f"megatron-core is not installed; the preflight supports megatron-core {supported_range()} "
                f"(Python >= 3.10, torch >= 2.6): pip install megatron-core==0.16.1"
            ) from None
    lo, hi = SUPPORTED
    if not lo <= _version_tuple(version) <= hi:
        raise UnsupportedMegatronError(
            f"megatron-core {version} is installed; the preflight supports megatron-core {supported_range()} "
            f"(its CPU patches name lines of that release): pip install megatron-core==0.16.1"
        )
    return version


def _cpu_mode():
    """A TorchFunctionMode: `device="cuda"` -> cpu, `Tensor.cuda()` -> itself, `.type()` of fp32 -> the CUDA name."""
    import torch
    from torch.overrides import TorchFunctionMode

    tensor_cuda, tensor_type = torch.Tensor.cuda, torch.Tensor.type

    class CudaIsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is tensor_cuda:
                return args[0]
            if func is tensor_type and len(args) == 1 and not kwargs:
                name = func(*args)
                return {"torch.FloatTensor": "torch.cuda.FloatTensor"}.get(name, name)
            dev = kwargs.get("device")
            if dev is not None and str(dev).startswith("cuda"):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    return CudaIsCpu()


@contextlib.contextmanager
def cpu_patched():
    """Inside: megatron-core runs on CPU ranks (see the module doc); everything is restored on exit."""
    check_version()  # before the import: a moved module must give the one line, not a traceback
    import torch
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = torch.cuda.current_device, torch.cuda.synchronize, tracker.fork
    torch.cuda.current_device = lambda: "cpu"  # patch 1
    torch.cuda.synchronize = lambda *a, **k: (
        None
    )  # DDP's optional synchronize (distributed_data_parallel.py l.588)
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # patch 4
    try:
        with _cpu_mode():  # patches 2 and 3
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, tracker.fork = saved
