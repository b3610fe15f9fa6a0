"""megatron-core's CUDA assumptions, replaced for CPU ranks (gloo): applied only inside the preflight's rank processes.

Supports megatron-core 0.16.0-0.16.x (SUPPORTED; `check_version` refuses others in one line): every file patched or
cited below is the same in 0.16.0 and 0.16.1, and the line numbers are 0.16.1's.

megatron-core 0.16 asks CUDA for its device in many places; on CPU each is one of four shapes, and each shape gets
one patch here (1-4); the MoE path adds a CUDA stream, a name it needs Transformer Engine for, a norm that refuses
sequence parallelism and an all-gather gloo does not run (5-8); DeepSeek-V3's MLA a keyword only TE takes (9) and, at TP > 1, a gradient the local spec drops (10):

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

9. Without Transformer Engine: multi-latent attention hands its core attention `k_channels` / `v_channels`
   (`transformer/multi_latent_attention.py` l.155-165), which only TE's attention takes; the local spec's
   `DotProductAttention` raises TypeError -> the local spec's core attention takes and drops them. It needs neither:
   MLA passes its softmax scale (yarn's mscale included) explicitly, and kv_channels, which the kit's args set to
   v_head_dim, sizes the output; q and k of qk_head_dim + qk_pos_emb_head_dim only meet each other in its baddbmm.
   The same module's TE flag (l.54-65) is True when megatron-core's TE extension imports without TE and leaves
   `TELinear` None, and its fp8 check (l.183-185) then calls isinstance with None -> the flag is False while TELinear
   is not a class.

10. Not CPU-specific: at TP > 1 the local spec's MLA builds its down projections column-parallel and all-gathers
   their outputs (`transformer/multi_latent_attention.py` l.604-607, `gather_from_tensor_model_parallel_region`, whose
   backward only splits the gradient, `tensor_parallel/mappings.py` l.271-273). The rope part of the kv latent
   (k_pos_emb, the last qk_pos_emb_head_dim columns) then feeds every head of the rank, and its gradient from the
   other ranks' heads is dropped: the rope columns of linear_kv_down_proj train on 1/TP of their gradient.
   TransformerEngine's spec (what runs on the cluster) builds that projection duplicated and gathers k_pos_emb
   over the sequence (l.619-622, a reduce-scatter backward), which sums it -> the gathered kv latent's rope
   columns get their gradient summed over TP before the split, as the TE path sums it. The q latent and the
   kv latent proper need nothing: their column-parallel up projections already sum theirs over TP.

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


def _mla_core_attention():
    """LocalSpecProvider.core_attention that builds a DotProductAttention accepting MLA's TE-only keywords (patch 9)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return lambda self: LocalMLADotProductAttention


def _mla_kv_gather(plain, mla_cls):
    """The kv latent's gather (patch 10): the plain all-gather, its rope columns' gradient summed over TP first.
    Returns (the gather for the MLA module's namespace, the wrapped get_query_key_value_tensors)."""
    import torch
    from megatron.core import parallel_state

    class SumRopeGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cols, group):
            ctx.cols, ctx.group = cols, group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            tail = grad[..., -ctx.cols :].contiguous()
            torch.distributed.all_reduce(tail, group=ctx.group)
            grad[..., -ctx.cols :] = tail
            return grad, None, None

    state: dict = {}
    plain_qkv = mla_cls.get_query_key_value_tensors

    def gather(input_, group=None):
        out = plain(input_, group)
        cfg = state.get("config")
        if cfg is None:
            return out
        call = state["calls"]
        state["calls"] += 1
        if call != (1 if cfg.q_lora_rank is not None else 0):  # megatron-core gathers the q latent first
            return out
        assert out.size(-1) == cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim, out.shape
        group = group or parallel_state.get_tensor_model_parallel_group()
        return SumRopeGrad.apply(out, cfg.qk_pos_emb_head_dim, group)

    def qkv(self, *args, **kwargs):
        state.update(config=self.config, calls=0)
        try:
            return plain_qkv(self, *args, **kwargs)
        finally:
            state.clear()

    return gather, qkv


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
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import multi_latent_attention as mla
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
    plain_core_attention = LocalSpecProvider.__dict__["core_attention"]
    LocalSpecProvider.core_attention = _mla_core_attention()  # patch 9
    plain_mla_te = mla.HAVE_TE
    mla.HAVE_TE = plain_mla_te and isinstance(mla.TELinear, type)
    plain_mla_gather, plain_qkv = (
        mla.gather_from_tensor_model_parallel_region,
        mla.MLASelfAttention.__dict__["get_query_key_value_tensors"],
    )
    mla.gather_from_tensor_model_parallel_region, mla.MLASelfAttention.get_query_key_value_tensors = (
        _mla_kv_gather(plain_mla_gather, mla.MLASelfAttention)
    )  # patch 10
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
        LocalSpecProvider.core_attention = plain_core_attention
        mla.HAVE_TE = plain_mla_te
        mla.gather_from_tensor_model_parallel_region = plain_mla_gather
        mla.MLASelfAttention.get_query_key_value_tensors = plain_qkv
        if no_te_gemm:
            del moe_utils.te_general_gemm
