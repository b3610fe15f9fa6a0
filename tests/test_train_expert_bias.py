"""kit.train.expert_bias: DeepSeek's aux-loss-free balancing for HF training, against megatron-core 0.16.1's
get_updated_expert_bias, and its counting of the experts each router chose."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fixtures.convert import routed_moe
from test_families_moe_adapt import tiny_model
from test_moe_sigmoid import hf_block

from kit.system.procs import free_port
from kit.train import expert_bias as eb

routed_moe.skip_module_without_the_families()


@pytest.fixture
def one_rank_world(monkeypatch):
    """A one-rank gloo group: megatron-core's function all-reduces the counts over TP x DP x CP."""
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    # the default (whole-world) group stands for megatron's TP x DP x CP group of one rank
    monkeypatch.setattr(parallel_state, "get_tensor_and_data_parallel_group", lambda **kw: None)
    yield
    if created:
        dist.destroy_process_group()


def test_update_equals_megatron_core_on_the_same_counts(one_rank_world):
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (3, 16), generator=gen).float()  # 3 layers x 16 experts
    counts[1] = 7.0  # a perfectly even layer: sign(0) leaves its biases alone
    bias = torch.randn(3, 16, generator=gen)
    want = get_updated_expert_bias(counts.clone(), bias.clone(), 1e-3)
    got = eb.updated_bias(counts, bias, 1e-3)
    assert torch.equal(got, want)
    assert torch.equal(got[1], bias[1]) and not torch.equal(got[0], bias[0])
    # under-used experts rise, over-used ones fall
    low, high = int(counts[0].argmin()), int(counts[0].argmax())
    assert got[0, low] == bias[0, low] + 1e-3 and got[0, high] == bias[0, high] - 1e-3


def test_transformers_keeps_the_bias_as_a_buffer_without_gradient():
    """What plain HF training does with it: nothing (a buffer, not a parameter)."""
    block = hf_block("deepseek_v3")
    names = dict(block.named_parameters())
    assert "gate.e_score_correction_bias" not in names
    assert "gate.e_score_correction_bias" in dict(block.named_buffers())
    assert "gate.e_score_correction_bias" in block.state_dict()  # saved and loaded with the checkpoint


def test_counts_the_chosen_experts_in_training_forwards_and_moves_the_biases(one_rank_world):
    model = tiny_model("deepseek_v3")
    loaded = model.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    update = eb.attach(model)
    assert update is not None and len(update.routers) == 1  # layer 0 is dense
    router = update.routers[0]
    model.bfloat16()  # what a bf16 engine does to the model: every buffer cast
    assert router.e_score_correction_bias.dtype == torch.bfloat16
    update.restore()  # kept in fp32 (as megatron-core keeps it), the values as loaded
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, loaded) and not torch.equal(
        loaded.bfloat16().float(), loaded
    )
    chosen = []
    router.register_forward_hook(lambda m, i, o: chosen.append(o[2].reshape(-1)))
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)  # evaluation: not counted
    assert float(update.counts.sum()) == 0.0
    model(input_ids=ids)
    model(input_ids=ids[:, :5])  # a second micro-batch of the step
    want = torch.bincount(torch.cat(chosen[1:]), minlength=16).float()
    assert torch.equal(update.counts[0], want) and float(want.sum()) == (24 + 10) * 4
    before = router.e_score_correction_bias.clone()
    update.step()
    assert torch.equal(router.e_score_correction_bias, eb.updated_bias(want, before, eb.UPDATE_RATE))
    assert float(update.counts.sum()) == 0.0  # the next step counts afresh
    update.remove()


def test_models_without_score_correction_bias_get_no_update():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    assert eb.attach(Qwen3MoeForCausalLM(cfg)) is None


def test_a_router_aux_loss_for_bias_balanced_routing_is_refused_with_the_reason():
    from kit.errors import InputError
    from kit.train import TrainConfig
    from kit.train.engine import _router_aux_loss

    model = tiny_model("glm4_moe")
    from kit.adapt.moe import is_moe_model

    assert not is_moe_model(model)  # no aux loss in HF's forward: the kit adds none
    _router_aux_loss(model, TrainConfig(model_path="/models/glm45"))  # None: nothing to do
    with pytest.raises(InputError, match="score-correction bias"):
        _router_aux_loss(model, TrainConfig(model_path="/models/glm45", router_aux_loss_coef=0.01))


def _model_dir(out):
    """The tiny DeepSeek-V3 saved with the sample tokenizer (what kit.train loads)."""
    import shutil

    from kit.core.samples.paths import sample_tokenizer_dir

    tiny_model("deepseek_v3", vocab_size=2522, bos_token_id=1, eos_token_id=2).save_pretrained(out)
    for f in sorted(sample_tokenizer_dir().iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def _exported(hf_dir) -> dict:
    from safetensors.torch import load_file

    tensors: dict = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize(
    "run_type, dtype", [("pretrain", "float32"), ("pretrain", "bfloat16"), ("lora", "float32")]
)  # lora: on SFT rows; bf16: the biases stay fp32 (an engine that casts buffers too: the test above)
def test_the_trainer_moves_the_biases_once_per_optimizer_step(run_type, dtype, tmp_path):
    """Three steps of kit.train on a tiny DeepSeek-V3 (kit.adapt on): the exported biases moved by one update rate
    per step. LoRA keeps them (the base model is frozen); its adapters take the default targets, MLA's names."""
    import test_train_helpers as H
    from transformers import AutoModelForCausalLM

    from kit.train import train

    src = _model_dir(tmp_path / "model")
    lora = run_type == "lora"
    data = H.make_sft(tmp_path / "data") if lora else H.make_pretrain(tmp_path / "data")
    cfg = H.tiny_config(
        src, data, tmp_path / "ws", run_type=run_type, train_iters=3, save_hf=True, lr=1e-2, dtype=dtype
    )
    result = train(cfg, progress=False)
    assert result.status == "completed"
    if lora:  # the default targets, under MLA's names
        from safetensors import safe_open

        with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as fh:
            kinds = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in fh.keys() if "lora_" in k}
        assert kinds == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    elif dtype == "float32":
        assert result.losses[-1] < result.losses[0], result.losses
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    before = AutoModelForCausalLM.from_pretrained(src).state_dict()[key]
    exported = _exported(result.hf_dir)
    moved = (exported[key].float() - before) / eb.UPDATE_RATE
    assert exported[key].dtype == torch.float32
    torch.testing.assert_close(moved, moved.round(), atol=1e-3, rtol=0)  # whole steps of the rate
    if lora:
        assert float(moved.abs().max()) == 0.0
    else:  # 3 steps, one each way or the other
        assert float(moved.round().abs().max()) == 3 and float(moved.abs().sum()) > 0


@pytest.mark.slow
def test_a_resumed_run_continues_from_the_checkpoints_biases(tmp_path):
    """Resume at iteration 2 of 3: the biases come back from the checkpoint (fp32) and end where the straight run
    ended, bit for bit."""
    import shutil

    import test_train_helpers as H

    from kit.train import TrainConfig, train

    src, data = _model_dir(tmp_path / "model"), H.make_pretrain(tmp_path / "data")
    cfg = H.tiny_config(src, data, tmp_path / "ws", train_iters=3, save_interval=1, save_hf=True)
    straight = train(cfg, progress=False)
    key = "model.layers.1.mlp.gate.e_score_correction_bias"
    want = _exported(straight.hf_dir)[key]
    shutil.rmtree(straight.output_dir / "checkpoints" / "iter_0000003")
    resumed = train(
        TrainConfig(run_type="retrain", model_name="tiny", work_dir=str(tmp_path / "ws"), train_iters=3),
        progress=False,
    )
    assert resumed.status == "completed" and resumed.losses == straight.losses[2:]
    got = _exported(resumed.hf_dir)[key]
    assert got.dtype == torch.float32 and torch.equal(got, want)
