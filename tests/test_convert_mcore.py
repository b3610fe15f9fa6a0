"""megatron-core 0.16.1 (CPU, gloo, local layer spec) loads the kit's shards strictly and matches HF logits."""

from __future__ import annotations

import socket

import pytest
import torch
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
def cpu_patches():
    """kit.train.preflight.cpu_patches, the preflight ranks' CPU patches of megatron-core's CUDA assumptions, for one test."""
    from kit.train.preflight.cpu_patches import cpu_patched

    with cpu_patched():
        yield


def build_gpt(args):
    """The preflight's GPTModel (kit.train.preflight.ranks.build_model) from the checkpoint's own `args`, one stage; MoE
    models with the checkpoint's EP and token dispatcher."""
    from kit.train.preflight.ranks import build_model

    tp = args.tensor_model_parallel_size
    job = {
        "tp": tp,
        "pp": 1,
        "layer_list": [args.num_layers],
        "ep": getattr(args, "expert_model_parallel_size", 1) or 1,
        "etp": tp,
        "moe": {"dispatcher": getattr(args, "moe_token_dispatcher_type", None) or "alltoall"},
    }
    return build_model(args, job)[0].eval()


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
    from megatron.core import parallel_state

    from kit.train.preflight.cpu_patches import cpu_patched

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(world // ep, 1, expert_model_parallel_size=ep)
    try:  # the rank file of this process's TP and EP ranks (megatron-core's rank order, not the kit's)
        with cpu_patched():  # the preflight ranks' patches, in this child process
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
