"""megatron-core's CUDA assumptions, replaced for CPU ranks (gloo): applied only inside the preflight's rank processes.

Supports megatron-core 0.16.0-0.16.x (SUPPORTED; `check_version` refuses others in one line): every file patched or
cited below is the same in 0.16.0 and 0.16.1, and the line numbers are 0.16.1's.

megatron-core 0.16 asks CUDA for its device in many places; on CPU each is one of four shapes, and each shape gets
one patch here (1-4); the MoE path adds a CUDA stream, a name it needs Transformer Engine for, a norm that refuses
sequence parallelism and an all-gather gloo does not run (5-8):

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

5. The MoE alltoall token dispatcher's device-to-host step (`transformer/moe/token_dispatcher.py`
   `MoEAlltoAllTokenDispatcher`: l.445 creates a `torch.cuda.Stream()`, l.862-901 `_maybe_dtoh_and_synchronize` copies
   the split sizes to the host on it and turns them into numpy arrays, which `torch.distributed.all_to_all_single`
   takes as sequences) -> no stream is made, and the split sizes, already on the host, become the same numpy arrays
   (`maybe_move_tensor_to_cpu` skips CPU tensors, and gloo's all_to_all_single refuses tensors as split sizes).
   gloo itself runs the uneven all-to-all (torch 2.13: `all_to_all_single` with split lists), so the preflight uses
   the dispatcher MindSpeed-LLM's MoE recipes use (`--moe-token-dispatcher-type alltoall`), not the allgather one.

6. Not a CUDA call but a missing name without Transformer Engine: the router's gating linear tests
   `te_general_gemm is not None` (`transformer/moe/moe_utils.py` l.1192, l.1225), a name only the module's TE import
   (l.22-35) defines, so without TE the router raises NameError -> the name is defined as None, megatron-core's own
   torch.mm branch then runs.

7. Not a CUDA call either: sequence parallelism, which megatron-core's MoELayer needs to train at TP > 1
   (`transformer/moe/moe_layer.py` `forward`), is refused by the local spec's norm (`transformer/torch_norm.py` l.32
   `WrappedTorchNorm`: torch's RMSNorm does not mark its weight `sequence_parallel`, the mark
   `finalize_model_grads` sums a norm's grads over TP by, `distributed/finalize_model_grads.py` l.354; TE's and
   Apex's norms set it) -> with sequence parallelism the same torch norm is built and its weight gets that mark.

8. gloo's all_gather takes equal sizes only; the alltoall dispatcher at TP > 1 gathers its received tokens over TP
   in uneven parts (`transformer/moe/token_dispatcher.py` `dispatch_postprocess` ->
   `tensor_parallel/mappings.py` l.149 `_gather_along_first_dim` with output_split_sizes, `all_gather` of a list of
   unequal tensors, which NCCL and HCCL take) -> for unequal sizes each part is padded to the largest, gathered,
   and cut back. Its backward, the uneven reduce_scatter, gloo runs as it is.

The pipeline's `torch.cuda.synchronize()` (`p2p_communication.py` l.242) is avoided by `batch_p2p_sync=False` in
the model config, not patched. GLM-4.5's router needs nothing more: its `expert_bias` and `local_tokens_per_expert`
buffers are made on `torch.cuda.current_device()` (`transformer/moe/router.py` l.164-180, shape 1), and their update
after each step (`distributed/finalize_model_grads.py` l.293-315, l.476) is an all-reduce gloo runs.
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
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

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


def _host_splits(self, point: str, tokens_per_expert=None):
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on CPU (patch 5): the split sizes as numpy arrays at
    the dispatcher's device-to-host point, as its CUDA path leaves them; no stream to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if value is not None and hasattr(value, "numpy"):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _sequence_parallel_norm(plain_new):
    """WrappedTorchNorm.__new__ that accepts sequence parallelism (patch 7): torch's norm, weight marked."""

    def new(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return plain_new(cls, config, *args, **kwargs)
        config.sequence_parallel = (
            False  # only for the wrapper's own refusal; construction is single-threaded
        )
        try:
            norm = plain_new(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def _uneven_gather(plain):
    """mappings._gather_along_first_dim with gloo's equal-size all_gather for unequal parts (patch 8)."""
    import torch

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = [int(n) for n in output_split_sizes] if output_split_sizes is not None else None
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return plain(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros([max(sizes), *input_.shape[1:]])
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    return gather


@contextlib.contextmanager
def cpu_patched():
    """Inside: megatron-core runs on CPU ranks (see the module doc); everything is restored on exit."""
    check_version()  # before the import: a moved module must give the one line, not a traceback
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A2A
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = torch.cuda.current_device, torch.cuda.synchronize, tracker.fork
    saved_a2a = A2A.cuda_dtoh_stream, A2A.__dict__["_maybe_dtoh_and_synchronize"]
    torch.cuda.current_device = lambda: "cpu"  # patch 1
    torch.cuda.synchronize = lambda *a, **k: (
        None
    )  # DDP's optional synchronize (distributed_data_parallel.py l.588)
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # patch 4
    A2A.cuda_dtoh_stream = "no stream on CPU"  # patch 5: not None, so __init__ makes no torch.cuda.Stream()
    A2A._maybe_dtoh_and_synchronize = _host_splits
    plain_norm_new = WrappedTorchNorm.__dict__["__new__"]
    WrappedTorchNorm.__new__ = staticmethod(_sequence_parallel_norm(plain_norm_new.__func__))  # patch 7
    plain_gather = mappings._gather_along_first_dim
    mappings._gather_along_first_dim = _uneven_gather(plain_gather)  # patch 8
    no_te_gemm = not hasattr(moe_utils, "te_general_gemm")
    if no_te_gemm:  # patch 6
        moe_utils.te_general_gemm = None
    try:
        with _cpu_mode():  # patches 2 and 3
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize, tracker.fork = saved
        A2A.cuda_dtoh_stream, A2A._maybe_dtoh_and_synchronize = saved_a2a
        WrappedTorchNorm.__new__ = plain_norm_new
        mappings._gather_along_first_dim = plain_gather
        if no_te_gemm:
            del moe_utils.te_general_gemm
