"""megatron-core 0.16.1 runs the kit's GLM-4.5 and DeepSeek-V3 rank files (CPU, gloo, local spec, inside the
preflight's CPU patches, whose patch 9 lets the local spec build MLA): strict load at TP1 with the MTP block, real
expert parallelism (EP2) against transformers' logits, and MLA's gradient at TP2."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.convert import routed_moe

from kit.convert import ConvertConfig, hf_to_megatron
from kit.convert.megatron_io import MegatronReader
from kit.convert.verify import hf_logits, sample_tokens

pytest.importorskip(
    "megatron.core", reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)"
)
import test_convert_mcore as mc  # noqa: E402  (after the skip: it needs megatron-core)

mcore_world, cpu_patches = (
    mc.mcore_world,
    mc.cpu_patches,
)  # shared fixtures (one gloo process group per module)
tiny_glm45_dir = routed_moe.tiny_glm45_dir  # shared session fixtures
tiny_deepseek3_dir = routed_moe.tiny_deepseek3_dir
tiny_deepseek3_yarn_dir = routed_moe.tiny_deepseek3_yarn_dir
TOL = 1e-4


def main_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[seq, vocab columns of this rank] of the main head. With an MTP block GPTModel wants labels and returns the
    loss (its cross entropy works on the logits in place: copied here); the output layer runs for the MTP layer
    first and for the model last, so its last output is the logits."""
    s = ids.numel()
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True = masked (Megatron)
    outputs = []
    hook = model.output_layer.register_forward_hook(lambda m, a, out: outputs.append(out[0].clone()))
    try:
        with torch.no_grad():
            model(ids[None], torch.arange(s)[None], mask, labels=ids[None])
    finally:
        hook.remove()
    assert len(outputs) == 2  # the MTP layer ran, then the head
    return outputs[-1][:, 0]


def _ep_worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    """One EP rank (TP1): megatron-core loads its own rank file strictly and writes the logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from kit.train.preflight.cpu_patches import cpu_patched

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        with cpu_patched():
            state = MegatronReader(ckpt).state(0, 0, parallel_state.get_expert_model_parallel_rank())
            model = mc.build_gpt(state["args"])
            model.load_state_dict(state["model"], strict=True)
            logits = main_logits(model, sample_tokens(2522, 12))
        torch.save(logits, f"{out}/logits_{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["glm45", "q_lora", "no_q_lora", "yarn"])
def test_megatron_core_strict_load_and_logits_tp1(case, tmp_path, mcore_world, cpu_patches, request):
    """megatron-core's GPTModel of the checkpoint's own args (sigmoid router with expert_bias, grouped top-k, shared
    expert, dense first layers, the MTP block) loads the TP1 rank file strictly, every tensor the file's, and gives
    transformers' logits. GLM-4.5; DeepSeek-V3 through MLATransformerConfig (local spec: column-parallel MLA
    projections, q / kv latent norms), also without a query latent (q_lora_rank None, DeepSeek-V2-Lite's layout)
    through linear_q_proj, and with the published yarn rope_scaling through megatron-core's own YarnRotaryEmbedding
    and MLA softmax scale (rope_type yarn), over 64 tokens."""
    src = {
        "glm45": lambda: request.getfixturevalue("tiny_glm45_dir"),
        "q_lora": lambda: request.getfixturevalue("tiny_deepseek3_dir"),
        "no_q_lora": lambda: routed_moe.tiny_deepseek3(tmp_path / "nolora", q_lora_rank=None),
        "yarn": lambda: request.getfixturevalue("tiny_deepseek3_yarn_dir"),
    }[case]()
    out = tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(src), str(out)), progress=False)
    state = MegatronReader(out).state(0, 0)
    model = mc.build_gpt(state["args"])
    result = model.load_state_dict(state["model"], strict=True)
    assert not result.missing_keys and not [k for k in result.unexpected_keys if "_extra_state" not in k]
    own = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    assert set(own) == set(state["model"]) and any(k.startswith("mtp.layers.0.") for k in own)
    assert ("decoder.layers.0.self_attention.linear_q_down_proj.weight" in own) is (
        case in ("q_lora", "yarn")
    )
    for k, v in own.items():  # every tensor of the model is the file's (none left at random init)
        assert torch.equal(v, state["model"][k]), k
    ids = sample_tokens(2522, 64 if case == "yarn" else 12)
    ref = hf_logits(src, ids)
    assert float((main_logits(model, ids)[:, : ref.shape[-1]] - ref).abs().max()) <= TOL
    if case == "yarn":
        attention = model.decoder.layers[0].self_attention
        assert type(attention.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
        assert attention.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(24))


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_glm45_dir", "tiny_deepseek3_dir"])
def test_megatron_core_expert_parallel_ranks_match_hf(fixture, tmp_path, request):
    """Real megatron-core EP2 (two gloo processes): each EP rank loads its own file strictly (its four experts as
    local 0-3) and the tokens routed to the other rank's experts come back through the all-to-all."""
    import torch.multiprocessing as mp

    src, ckpt = request.getfixturevalue(fixture), tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(src), str(ckpt), ep=2), progress=False)
    mp.spawn(_ep_worker, args=(2, mc._free_port(), str(ckpt), str(tmp_path)), nprocs=2, join=True)
    ref = hf_logits(src, sample_tokens(2522, 12))
    for r in range(2):
        logits = torch.load(tmp_path / f"logits_{r}.pt")
        assert float((logits[:, : ref.shape[-1]] - ref).abs().max()) <= TOL


KV_DOWN = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"


def _kv_down_grad(model, ids: torch.Tensor) -> torch.Tensor:
    """The first layer's kv down projection gradient (this rank's rows) of the summed token losses."""
    s = ids.numel()
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    model(ids[None], torch.arange(s)[None], mask, labels=ids[None]).sum().backward()
    return dict(model.named_parameters())[KV_DOWN].grad.clone()


def _tp_grad_worker(rank: int, world: int, port: int, ckpt: str, out: str, summed: bool) -> None:
    """One TP rank (sequence parallel, as the MoE layers need): the kv down projection's gradient, with patch 10
    (summed) or with megatron-core's local-spec gather as it is."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_latent_attention as mla

    from kit.train.preflight.cpu_patches import cpu_patched

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(world, 1)
    try:
        with cpu_patched():
            if not summed:
                mla.gather_from_tensor_model_parallel_region = (
                    mla.tensor_parallel.gather_from_tensor_model_parallel_region
                )
            state = MegatronReader(ckpt).state(rank, 0)
            model = mc.build_gpt(state["args"])
            model.load_state_dict(state["model"], strict=True)
            torch.save(_kv_down_grad(model, sample_tokens(2522, 12)), f"{out}/grad_{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_deepseek3_tp2_kv_down_gradient_is_the_tp1_one_with_patch_10(tmp_path, mcore_world, cpu_patches):
    """At TP2 the local spec's MLA gathers the column-parallel kv down projection's output and its backward only
    splits the gradient: the rope columns (rows 16-23 of 24) lose the other rank's heads' part. With the preflight's
    patch 10 the TP2 gradient is TP1's; without it every rope row differs, the most."""
    import torch.multiprocessing as mp

    src = routed_moe.tiny_deepseek3(tmp_path / "ds3", num_nextn_predict_layers=0)
    hf_to_megatron(ConvertConfig(str(src), str(tmp_path / "tp1")), progress=False)
    state = MegatronReader(tmp_path / "tp1").state(0, 0)
    model = mc.build_gpt(state["args"])
    model.load_state_dict(state["model"], strict=True)
    want = _kv_down_grad(model.train(), sample_tokens(2522, 12))
    hf_to_megatron(ConvertConfig(str(src), str(tmp_path / "tp2"), tp=2), progress=False)
    diffs = {}
    for summed in (True, False):
        mp.spawn(
            _tp_grad_worker, args=(2, mc._free_port(), str(tmp_path / "tp2"), str(tmp_path), summed), nprocs=2
        )
        got = torch.cat([torch.load(tmp_path / f"grad_{r}.pt") for r in range(2)])
        diffs[summed] = (got - want).abs().amax(dim=1)
    scale = float(want.abs().max())
    assert float(diffs[True].max()) <= 1e-5 * scale
    assert float(diffs[False][16:].min()) > 1e-3 * scale  # every rope row is off
    # the latent rows too (the later layers' lost rope gradient reaches layer 0 through the hidden state), less
    assert float(diffs[False][:16].max()) < float(diffs[False][16:].max())
