"""megatron-core 0.16.1 (CPU, gloo, local layer spec) loads the kit's shards strictly and matches HF logits."""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch
import torch.nn.functional as F
from fixtures.convert import families as fam_models
from fixtures.convert import models as convert_models

from kit.convert import ConvertConfig, hf_to_megatron
from kit.convert.megatron_io import MegatronReader
from kit.convert.verify import hf_logits, sample_tokens

tiny_glm_dir = convert_models.tiny_glm_dir  # shared session fixtures
tiny_qwen3_moe_dir = fam_models.tiny_qwen3_moe_dir

mcore = pytest.importorskip(
    "megatron.core", reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcore_world():
    """One gloo process, TP=PP=1 (megatron-core needs torch.distributed even on one CPU rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    # a kit.train run earlier in this process (tests/test_families_*.py, test_train.py) leaves its one-rank gloo
    # group up: use it, and leave it to its owner
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


@pytest.fixture
def cpu_patches(monkeypatch):
    """The two CPU patches of ckpt_data_formats.md 5.1: RoPE asks torch.cuda for a device; attention forks the
    CUDA RNG tracker (dropout is 0 here, so no RNG state is used); and one for MoE without TransformerEngine."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    # megatron-core 0.16.1's router gating reads te_general_gemm, defined only when TransformerEngine imports
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    monkeypatch.setattr(tracker, "fork", lambda *a, **k: contextlib.nullcontext())


def build_gpt(args):
    """A GPTModel from the checkpoint's own `args` (what a Megatron training run would be started with)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = getattr(args, "num_experts", None)
    moe = {}
    if experts:  # the MoE arguments the checkpoint states (Megatron-LM's names -> TransformerConfig's)
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_layer_freq=args.moe_layer_freq,
            moe_grouped_gemm=args.moe_grouped_gemm,
            # the args' alltoall dispatcher makes a CUDA stream when built; allgather routes the same on one CPU rank
            moe_token_dispatcher_type="allgather",
        )
    cfg = TransformerConfig(
        **moe,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        layernorm_epsilon=args.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=args.swiglu,
        activation_func=F.silu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        rotary_interleaved=args.rotary_interleaved,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=experts,
            moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
            normalization="RMSNorm",
            qk_layernorm=getattr(args, "qk_layernorm", False),
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_percent=args.rotary_percent,
        rotary_base=int(args.rotary_base),
        rope_scaling=getattr(args, "use_rope_scaling", False),  # llama3 (mcore: factor only, 1 / 4 / 8192)
        rope_scaling_factor=getattr(args, "rotary_scaling_factor", 8.0),
    ).eval()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama_gqa", "llama_tied_mha", "chatglm3", "qwen3_moe"])
def test_gptmodel_strict_load_and_logits(
    which, tiny_llama_dir, tiny_llama_tied_dir, tiny_glm_dir, request, tmp_path, mcore_world, cpu_patches
):
    """The kit's TP1 rank file loads strictly into the GPTModel its own args describe (for Qwen3-MoE: the local
    spec's MoE layer, router + SequentialMLP experts) and gives HF's logits."""
    src = {"llama_gqa": tiny_llama_dir, "llama_tied_mha": tiny_llama_tied_dir, "chatglm3": tiny_glm_dir}.get(
        which
    ) or request.getfixturevalue("tiny_qwen3_moe_dir")
    out = tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(src), str(out), tp=1, pp=1, flavor="local"), progress=False)
    mr = MegatronReader(out)
    state = mr.state(0, 0)
    model = build_gpt(state["args"])
    result = model.load_state_dict(state["model"], strict=True)  # raises on any missing or unexpected key
    assert not result.missing_keys and not [k for k in result.unexpected_keys if "_extra_state" not in k]
    own = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    assert set(own) == set(state["model"])
    for k, v in own.items():  # every tensor of the model equals the file (no silent fallback to random init)
        assert torch.equal(v, state["model"][k]), k

    spec_vocab = state["args"].padded_vocab_size
    ids = sample_tokens(min(spec_vocab, 2522), 12)
    s = ids.numel()
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[
        None, None
    ]  # True = masked (Megatron convention)
    with torch.no_grad():
        logits = model(ids[None], torch.arange(s)[None], mask)[0]
    ref = hf_logits(src, ids)
    diff = float((logits[:, : ref.shape[-1]] - ref).abs().max())
    assert diff <= 1e-4, diff


@pytest.mark.slow
def test_gptmodel_logits_catch_a_wrong_qkv_layout(tiny_llama_dir, tmp_path, mcore_world, cpu_patches):
    """Negative control: plain [Q; K; V] rows load (shapes agree) but the logits are wrong."""
    from kit.convert.hf_io import HFReader

    out = tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(tiny_llama_dir), str(out)), progress=False)
    state = MegatronReader(out).state(0, 0)
    hf = HFReader(tiny_llama_dir)
    model_sd = dict(state["model"])
    for i in range(2):
        model_sd[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.cat(
            [hf.read(f"model.layers.{i}.self_attn.{n}_proj.weight") for n in "qkv"]
        )
    model = build_gpt(state["args"])
    model.load_state_dict(model_sd, strict=True)
    ids = sample_tokens(2522, 12)
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        logits = model(ids[None], torch.arange(12)[None], mask)[0]
    assert float((logits[:, :2522] - hf_logits(tiny_llama_dir, ids)).abs().max()) > 1e-2


def _tp_worker(rank: int, world: int, port: int, ckpt: str, out: str, ep: int = 1) -> None:
    """One TP (x EP) rank: megatron-core loads its own rank file strictly and writes its vocab slice of the logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"  # the CPU patches (see cpu_patches), in this child process
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(world // ep, 1, expert_model_parallel_size=ep)
    try:  # the rank file of this process's TP and EP ranks (megatron-core's rank order, not the kit's)
        t, e = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_rank(),
        )
        state = MegatronReader(ckpt).state(t, 0, e)
        model = build_gpt(state["args"])
        model.load_state_dict(state["model"], strict=True)
        ids = sample_tokens(2522, 12)
        mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
        with torch.no_grad():
            logits = model(ids[None], torch.arange(12)[None], mask)[0]  # this rank's vocab columns
        torch.save(logits, f"{out}/logits_{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "which,tp,ep", [("llama_gqa", 2, 1), ("llama_gqa", 4, 1), ("chatglm3", 2, 1), ("qwen3_moe", 1, 2)]
)
def test_gptmodel_tensor_parallel_ranks_match_hf(
    which, tp, ep, tiny_llama_dir, tiny_glm_dir, request, tmp_path
):
    """Real megatron-core TP (gloo processes) on the kit's rank files; TP4 with 2 KV groups uses mcore 0.16's
    split-group path, so this also checks the on-disk layout the kit writes for that case. Qwen3-MoE at EP2: each
    EP rank loads its own file (its two experts as local 0 and 1) and the tokens go to the other rank's experts."""
    import torch.multiprocessing as mp

    src = {"llama_gqa": tiny_llama_dir, "chatglm3": tiny_glm_dir}.get(which) or request.getfixturevalue(
        "tiny_qwen3_moe_dir"
    )
    ckpt = tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(src), str(ckpt), tp=tp, pp=1, ep=ep), progress=False)
    world = tp * ep
    mp.spawn(_tp_worker, args=(world, _free_port(), str(ckpt), str(tmp_path), ep), nprocs=world, join=True)
    logits = torch.cat([torch.load(tmp_path / f"logits_{r}.pt") for r in range(tp)], dim=-1)
    ref = hf_logits(src, sample_tokens(2522, 12))
    assert float((logits[:, : ref.shape[-1]] - ref).abs().max()) <= 1e-4
