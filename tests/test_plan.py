"""The planner (kit.plan): exact parameter counts, the traced peak against a measured plain training step, the
engines' partitioning, real-size plans from a config.json alone, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import plan_measure as M
import pytest
import torch

from kit.plan import PlanInputs, make_plan
from kit.plan.engines import Run, deepspeed_memory
from kit.plan.model import counts, load_config
from kit.plan.trace import TORCH_NEEDED, TraceKey, trace

OLD_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < TORCH_NEEDED
traces = pytest.mark.skipif(
    OLD_TORCH, reason=f"the planner's trace needs torch >= 2.5 (this is {torch.__version__})"
)

QWEN3_32B = {  # Qwen3-32B's config.json values that shape memory (the model card's)
    "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "tie_word_embeddings": False,
}  # fmt: skip
QWEN3_30B_A3B = {  # Qwen3-30B-A3B's
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "norm_topk_prob": True,
}  # fmt: skip


def _config_dir(tmp_path, values: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(values), encoding="utf-8")
    return tmp_path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return M.small_llama(tmp_path_factory.mktemp("plan") / "llama")


def _same_counts(folder) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    c = counts(load_config(folder))
    assert c.total == sum(p.numel() for p in model.parameters())
    assert c.embedding == model.get_input_embeddings().weight.numel()


def test_counts_are_the_models_own(llama):
    _same_counts(llama)


def test_moe_counts_are_the_models_own_with_the_experts_a_token_meets(llama, tmp_path):
    moe = M.small_moe(tmp_path / "moe", llama)
    _same_counts(moe)
    c = counts(load_config(moe))
    assert c.num_experts == 8 and c.top_k == 2 and c.experts_per_layer == 8 * 3 * 64 * 128
    assert c.active == c.total - 3 * c.experts_per_layer * 6 // 8


@traces
def test_traced_peak_equals_a_measured_plain_training_step(llama):
    """Forward, loss, backward and a fused AdamW step of the model in plain torch, measured by the profiler's
    allocator events, against weights + Adam moments + the traced (gradients, transient) peak."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from kit.system.hf_compat import dtype_kw

    model = AutoModelForCausalLM.from_pretrained(llama, **dtype_kw(torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(10, 60, (2, 128), generator=torch.Generator().manual_seed(0))
    weights = sum(p.numel() * 4 for p in model.parameters())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            marker = torch.empty(M.MARK, dtype=torch.uint8)
            del marker
    live, top, after = 0, 0, False
    for _t, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"):  # fmt: skip
        live += n
        after = after or n == M.MARK
        top = max(top, live) if after else top
    moments = 2 * weights
    traced = trace(load_config(llama), TraceKey(128, 2, "float32", adapt=False), use_cache=False)
    transient, grads = traced.peak()
    # the first step's moments are made inside the window: live starts from them at step 2
    assert weights + moments + transient + grads == pytest.approx(weights + top - moments + moments, rel=0.01)


@traces
def test_zero_partitions_states_by_the_engines_rules(llama):
    c = counts(load_config(llama))
    traced = trace(load_config(llama), TraceKey(128, 1, "bfloat16"), use_cache=False)
    run = Run(c, 2, mbs=1, gbs=8)
    z = {s: deepspeed_memory(run, traced, 8, s) for s in range(4)}
    assert z[0].optimizer == 12 * c.total  # fp32 master + moments, whole
    assert z[1].optimizer == z[2].optimizer == z[3].optimizer == 12 * c.total // 8
    assert z[1].weights == z[2].weights == 2 * c.total
    # ZeRO-3 keeps tensors under DeepSpeed's persistence threshold (1e5 elements) whole on every card
    assert 0 < c.small < c.total and z[3].weights == int(2 * (c.total - c.small) / 8 + 2 * c.small)
    assert z[3].gradients == 2 * c.total / 8  # its flat partition buffer of gradient shares
    assert z[1].buffers == 500_000_000 * 2  # DeepSpeed's contiguous-gradient bucket (reduce_bucket_size)


@traces
def test_lora_keeps_moments_of_the_adapters_only(llama):
    full = M.predicted(llama)
    lora = M.predicted(llama, lora_r=8)
    adapters = 8 * 4 * sum(256 + out for out in (256, 128, 128, 256))  # rank 8 on q, k, v, o of 4 layers
    assert lora.weights == full.weights + 4 * adapters and lora.optimizer == 8 * adapters
    assert full.optimizer == 8 * counts(load_config(llama)).total


@traces
@pytest.mark.parametrize("values", [QWEN3_32B, QWEN3_30B_A3B], ids=["qwen3-32b", "qwen3-30b-a3b"])
def test_real_size_plans_from_a_config_alone(tmp_path, values):
    """On 8 x 910B 64 GB full training of either needs 16 bytes of states per parameter, about 60 GiB per card
    before any activation: no plan fits, and the answer names the nearest; on 16 cards some do."""
    from fixtures.convert import families

    from kit.plan.report import verdict

    families.require(values["model_type"])
    folder = str(_config_dir(tmp_path, values))
    eight = make_plan(PlanInputs(folder, seq_len=4096, cards=8, gbs=64))
    assert eight.counts.total == pytest.approx(32.8e9 if values is QWEN3_32B else 30.5e9, rel=0.01)
    assert not eight.fitting() and verdict(eight).startswith("No plan fits on 8 x Ascend 910B")
    sixteen = make_plan(PlanInputs(folder, seq_len=4096, cards=16, gbs=64))
    fitting = sixteen.fitting()
    assert fitting and all(r.total <= 64 * 2**30 for r in fitting)
    assert not next(r for r in sixteen.rows if r.layout == "DeepSpeed ZeRO-0").fits
    if values is QWEN3_30B_A3B:
        assert all(" EP" in r.layout for r in fitting if r.engine == "megatron")
        assert sixteen.counts.active == pytest.approx(3.3e9, rel=0.03)


@traces
def test_cli_answers_in_a_table_and_bad_input_is_one_line(tmp_path, llama):
    run = [sys.executable, "-m", "kit", "plan"]
    ok = subprocess.run(
        [*run, str(llama), "--seq-len", "256", "--cards", "2"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert (
        "fit" in ok.stdout.splitlines()[0]
        and "optimizer states" in ok.stdout
        and "tokens/s/card" in ok.stdout
    )
    bad = subprocess.run(
        [*run, str(tmp_path / "nowhere"), "--seq-len", "256"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "config.json" in bad.stderr


def test_on_an_older_torch_the_planner_says_where_it_runs(monkeypatch, llama):
    monkeypatch.setattr(torch, "__version__", "2.1.0")
    with pytest.raises(Exception, match=r"needs torch >= 2.5 \(this is 2.1.0\).*no weights"):
        make_plan(PlanInputs(str(llama), seq_len=64, cards=1))


@traces
def test_a_job_that_does_not_fit_its_cards_is_refused_in_one_line_unless_forced(
    tmp_path, tiny_llama_dir, monkeypatch
):
    import test_train_helpers as H

    from kit.plan.cards import CARDS, Card
    from kit.train import TrainConfig
    from kit.train.job import JobConfig, build_job
    from kit.train.resolve import resolve

    monkeypatch.setitem(CARDS, "test-1MiB", Card("a 1 MiB test card", 1 / 1024, 100, 0.0))
    data = H.prepared(tmp_path / "sft_tiny_48_hf", tiny_llama_dir)
    cfg = TrainConfig(
        work_dir=str(tmp_path / "ws"),
        model_name="tiny",
        model_path=str(tiny_llama_dir),
        dataset_path=str(data),
    )
    plan = resolve(cfg, environ={})
    job = dict(obs_dir="obs://kit-bucket/x/", nodes=1, pool_id="p", image_url="org/kit:1", card="test-1MiB")
    refused = [p for p in build_job(plan, JobConfig(**job)).problems if p.startswith("Will it fit?")]
    assert len(refused) == 1 and "\n" not in refused[0]
    assert "DeepSpeed ZeRO-0 does not fit on 8 x a 1 MiB test card" in refused[0]
    assert "the largest term is" in refused[0] and refused[0].endswith("FORCE=True sends it anyway.")
    assert not [p for p in build_job(plan, JobConfig(**job, force=True)).problems if "fit" in p]
    assert not [p for p in build_job(plan, JobConfig(**dict(job, card="910B-64G"))).problems if "fit" in p]


@traces
def test_a_launch_that_does_not_fit_this_machine_is_refused_in_one_line_unless_forced(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """On a CPU the node's ranks share the host memory available now: with 8 MiB of it (the one value replaced,
    where the kit reads it), the tiny run's 2 ranks are refused before anything starts; forced, it trains."""
    import test_train_helpers as H

    from kit.errors import InputError
    from kit.system import memory
    from kit.train.launch import launch

    monkeypatch.setattr(memory, "available_memory", lambda *a, **k: (8 * 2**20, "a test's 8 MiB"))
    data = H.make_pretrain(tmp_path / "p_hf", num_samples=8)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", train_iters=1, nproc_per_node=2, mbs=1, gbs=2)
    with pytest.raises(InputError) as refused:
        launch(cfg, progress=False)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("Will it fit? DeepSpeed ZeRO-0 does not fit on 2 x ")
    assert "(0.00390625 GiB)" in line and "the largest term is" in line
    assert line.endswith("--force (force=True) launches it anyway.")
    assert not list((tmp_path / "ws").rglob("*plan*.json")) and not list((tmp_path / "ws").rglob("*.log"))
    result = launch(cfg, progress=False, force=True)
    assert result.ok and result.status == "completed", result.tail


@traces
def test_dpo_counts_its_reference_and_the_doubled_batch(llama):
    """RUN_TYPE=dpo: a micro-batch of MBS pairs is 2 x MBS sequences in the activations; the reference adds nothing
    with LoRA (adapters off), two fp32 log-probabilities per pair when precomputed, a whole copy of the weights
    when a frozen copy is asked; Megatron is not offered (DPO runs on the DeepSpeed trainer)."""
    from kit.errors import InputError

    def plan(**kw):
        values = dict(seq_len=128, mbs=2, gbs=2, cards=1, card="here", dtype="float32", zero_stage=0)
        report = make_plan(PlanInputs(str(llama), **{**values, **kw}))
        return report, report.chosen().memory

    c = counts(load_config(llama))
    _, sft = plan()
    _, doubled = plan(mbs=4, gbs=4)  # the same 4 sequences per micro-batch as 2 pairs
    _, lora_sft = plan(lora_r=8)
    report, precomputed = plan(dpo_reference="precompute", pairs=56)
    _, copy = plan(dpo_reference="copy")
    _, lora = plan(lora_r=8, dpo_reference="adapters_off")
    assert precomputed.reference == 2 * 4 * 56 and "DPO reference" in precomputed.terms()
    assert precomputed.activations == doubled.activations > sft.activations
    assert precomputed.tensors == doubled.tensors + 448
    assert copy.reference == 4 * c.total and copy.tensors == doubled.tensors + 4 * c.total
    assert lora.reference == 0 and lora.weights == lora_sft.weights and lora.optimizer == lora_sft.optimizer
    assert "DPO reference" not in sft.terms() and sft.reference is None
    assert {r.engine for r in report.rows} == {"deepspeed"}
    # the precomputed reference costs no forward per step; the copy and the adapters-off model one each
    assert make_plan(PlanInputs(str(llama), 128, card="here", dpo_reference="copy")).flops_per_token == (
        pytest.approx(report.flops_per_token * 4 / 3)
    )
    assert (
        copy.notes[-1]
        == "DPO: 4 sequences per micro-batch (chosen + rejected); reference: a frozen copy of the weights"
    )
    with pytest.raises(InputError, match="needs LoRA"):
        plan(dpo_reference="adapters_off")


DEEPSEEK_V3 = {  # DeepSeek-V3's config.json values that shape memory (deepseek-ai/DeepSeek-V3 config.json)
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "n_group": 8, "topk_group": 4, "tie_word_embeddings": False,
}  # fmt: skip
GLM45_AIR = {  # GLM-4.5-Air's (zai-org/GLM-4.5-Air config.json)
    "model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 46, "first_k_dense_replace": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151552, "partial_rotary_factor": 0.5, "attention_bias": True, "n_group": 1, "topk_group": 1,
    "tie_word_embeddings": False,
}  # fmt: skip
TINY_LEADING_DENSE = {  # (model_type, first_k_dense_replace, shape)
    "deepseek_v3": dict(
        num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_key_value_heads=4, n_group=2, topk_group=1,
    ),
    "glm4_moe": dict(
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, head_dim=16, partial_rotary_factor=0.5, n_group=1, topk_group=1,
    ),
}  # fmt: skip


def _require(*model_types: str) -> None:
    """Skip unless this transformers has these model types (the compat stacks' older releases do not)."""
    import transformers
    from transformers import CONFIG_MAPPING

    missing = [m for m in model_types if m not in CONFIG_MAPPING]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {missing} models")


@pytest.mark.parametrize("model_type", sorted(TINY_LEADING_DENSE))
def test_moe_counts_with_leading_dense_layers_are_the_models_own(tmp_path, model_type):
    """DeepSeek-V3 and GLM-4.5 start with dense layers (first_k_dense_replace): counted as they are, the experts
    only in the layers that hold them."""
    from fixtures.convert import families

    _require(model_type)
    shape = TINY_LEADING_DENSE[model_type]
    folder = families.tiny_hf(tmp_path / model_type, model_type, 5, **shape)
    _same_counts(folder)
    c = counts(load_config(folder))
    k, layers = shape["first_k_dense_replace"], shape["num_hidden_layers"]
    assert c.dense_layers == k and c.expert_layers == layers - k
    assert c.num_experts == 8 and c.top_k == 2 and c.experts_per_layer == 8 * 3 * 64 * 32
    assert c.active == c.total - (layers - k) * c.experts_per_layer * 6 // 8
    assert c.per_layer * layers + c.embedding + c.head + c.other == pytest.approx(c.total, abs=layers)
    # LoRA on the default targets as a run resolves them (DeepSeek-V3: MLA's q_a/q_b/kv_a/kv_b/o projections)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kit.adapt.lora_targets import resolve_targets

    model = AutoModelForCausalLM.from_pretrained(folder)
    targets = resolve_targets(model, PlanInputs.lora_targets)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    adapters = sum(p.numel() for n, p in peft.named_parameters() if f"layers.{k}." in n and "lora_" in n)
    assert adapters == 4 * c.lora_per_layer and len(targets) == (5 if model_type == "deepseek_v3" else 4)


def test_real_moe_shapes_with_leading_dense_layers_count_their_published_totals(tmp_path):
    """DeepSeek-V3: 671B parameters, 37B activated per token (its model card; the MTP module is not in the HF
    class); GLM-4.5-Air: 106B (its model card)."""
    _require("deepseek_v3", "glm4_moe")
    ds = counts(load_config(_config_dir(tmp_path / "ds", DEEPSEEK_V3)))
    assert ds.total == pytest.approx(671e9, rel=0.001) and ds.active == pytest.approx(37e9, rel=0.02)
    assert ds.dense_layers == 3 and ds.expert_layers == 58
    glm = counts(load_config(_config_dir(tmp_path / "glm", GLM45_AIR)))
    assert glm.total == pytest.approx(106e9, rel=0.01) and glm.dense_layers == 1 and glm.expert_layers == 45
