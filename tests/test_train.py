"""Kit trainer on CPU with real DeepSpeed: config validation, loss goes down, checkpoints, resume, NaN stop, LoRA."""

from __future__ import annotations

import json
import math

import pytest
import test_train_helpers as H
import torch

from kit.core.configs import ConfigError, check
from kit.train import TrainConfig, Trainer, train
from kit.train.checkpoint import MEGATRON_LATEST, latest_iteration
from kit.train.resolve import input_problems, resolve


@pytest.fixture(scope="module")
def pretrain_data(tmp_path_factory):
    return H.make_pretrain(tmp_path_factory.mktemp("data") / "synthetic_pretrain_hf")


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return H.make_sft(tmp_path_factory.mktemp("data") / "synthetic_sft_hf")


def test_config_lists_every_problem(tmp_path):
    cfg = TrainConfig(
        run_type="finetune",
        model_path=str(tmp_path / "none"),
        dataset_path=str(tmp_path / "nd"),
        gbs=6,
        mbs=4,
        tp=2,
        pp=4,
        nproc_per_node=3,
        nnodes=2,
        node_rank=2,
        master_addr="",
        zero_stage=4,
        lr=-1.0,
    )
    with pytest.raises(ConfigError) as err:
        check(cfg)
    # the settings need no file; the inputs are checked once, by resolve
    text = str(err.value) + "\n".join(input_problems(cfg))
    for needle in (
        "RUN_TYPE='finetune'",
        "NODE_RANK=2",
        "needs MASTER_ADDR",
        "not divisible by TP x PP",
        "GBS=6 is not divisible by MBS x DP",
        "data-parallel only",
        "ZERO_STAGE=4",
        "LR=-1.0",
        "has no config.json",
        "DATASET_PATH: ",
    ):
        assert needle in text, needle
    assert len(err.value.problems) + len(input_problems(cfg)) == 10


def test_dataset_mismatches_are_listed(tmp_path, tiny_llama_dir, sft_data):
    big = H.make_pretrain(tmp_path / "big_hf", num_samples=4, vocab_size=99999)
    # token ids beyond the model's vocabulary, written by "another tokenizer"
    import datasets

    ds = datasets.load_from_disk(str(big)).map(lambda r: {"input_ids": [5000] + r["input_ids"][1:]})
    ds.save_to_disk(str(tmp_path / "oov_hf"))
    (tmp_path / "oov_hf" / "kit_manifest.json").write_text((big / "kit_manifest.json").read_text())
    cfg = H.tiny_config(tiny_llama_dir, tmp_path / "oov_hf", tmp_path / "ws", seq_len=64, run_type="sft")
    problems = "\n".join(input_problems(cfg))
    assert "holds 'pretrain' data but RUN_TYPE=sft" in problems
    assert "SEQ_LEN=64 but the dataset was prepared with max_length=32" in problems
    assert "token id 5000 >= model vocab_size 2522" in problems
    assert input_problems(H.tiny_config(tiny_llama_dir, sft_data, tmp_path / "ws", run_type="sft")) == []


def test_pretrain_loss_decreases_with_logs_checkpoint_and_hf_export(tmp_path, tiny_llama_dir, pretrain_data):
    seen = []
    cfg = H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "ws", train_iters=8, save_hf=True)
    result = train(cfg, step_callbacks=[seen.append], progress=False)
    assert result.status == "completed" and result.iteration == 8 and seen == list(range(1, 9))
    assert result.losses[-1] < result.losses[0] - 0.5, result.losses
    out = tmp_path / "ws" / "saved_dir_for_ma_output" / "tiny" / "pretrain"
    assert result.output_dir == out and json.loads((out / "config.json").read_text())["gbs"] == 4
    assert latest_iteration(out / "checkpoints") == 8
    assert (out / "checkpoints" / MEGATRON_LATEST).read_text() == "8"
    assert not list((out / "checkpoints").glob(".partial-*"))
    # the Megatron-style lines, the metrics file and TensorBoard
    lines = [ln for ln in result.log_path.read_text().splitlines() if "lm loss:" in ln]
    assert len(lines) == 8 and "elapsed time per iteration (ms):" in lines[0] and "grad norm:" in lines[0]
    records = [json.loads(ln) for ln in result.metrics_path.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 9))
    r = records[3]
    assert r["tokens_per_s_per_card"] == pytest.approx(4 * 32 / (1 * r["elapsed_ms"]) * 1000)
    assert r["real_tokens"] == 4 * 32 and r["grad_norm"] > 0
    assert list(
        (tmp_path / "ws" / "saved_dir_for_ma_output" / "tiny" / "logs" / "tensorboard").rglob("events.*")
    )
    # the exported HF folder holds the trained weights
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(result.hf_dir)
    start = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    batch = torch.tensor([list(range(10, 42))])
    with torch.no_grad():
        assert trained(batch, labels=batch).loss < start(batch, labels=batch).loss - 0.5


def test_sft_loss_decreases_on_answer_tokens(tmp_path, tiny_llama_dir, sft_data):
    cfg = H.tiny_config(
        tiny_llama_dir, sft_data, tmp_path / "ws", run_type="sft", train_iters=8, gbs=8, mbs=4
    )
    result = train(cfg, progress=False)
    assert result.status == "completed"
    assert result.losses[-1] < result.losses[0] - 0.5, result.losses
    rec = json.loads(result.metrics_path.read_text().splitlines()[0])
    assert rec["real_tokens"] < 8 * 48  # padding is not counted as useful tokens


def test_resume_reproduces_the_uninterrupted_loss_curve(tmp_path, tiny_llama_dir, pretrain_data):
    full = train(H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "a", train_iters=6), progress=False)
    first = Trainer(
        resolve(H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "b", train_iters=6)), progress=False
    )
    first.step_callbacks.append(lambda it: first.request_stop("test") if it == 3 else None)
    stopped = first.train()
    assert stopped.status == "preempted" and stopped.iteration == 3
    assert stopped.losses == full.losses[:3]
    resumed = train(
        TrainConfig(run_type="retrain", model_name="tiny", work_dir=str(tmp_path / "b"), train_iters=6),
        progress=False,
    )
    assert resumed.status == "completed" and resumed.iteration == 6
    assert (
        resumed.losses == full.losses[3:]
    )  # bit-exact: weights, Adam moments, LR schedule and data position
    rows = [json.loads(ln) for ln in resumed.metrics_path.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]


def test_retrain_without_checkpoint_is_a_config_problem(tmp_path):
    cfg = TrainConfig(run_type="retrain", model_name="tiny", work_dir=str(tmp_path / "ws"))
    assert any("holds no checkpoint" in p for p in input_problems(cfg))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, tiny_llama_dir, pretrain_data):
    trainer = Trainer(
        resolve(
            H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "ws", train_iters=8, save_interval=2)
        ),
        progress=False,
    )

    def poison(iteration):
        if iteration == 3:  # weights go bad after step 3; step 4's loss is NaN
            with torch.no_grad():
                next(trainer.engine.module.parameters()).fill_(float("nan"))

    trainer.step_callbacks.append(poison)
    result = trainer.train()
    assert result.status == "nan" and result.iteration == 3
    assert result.checkpoint.name == "iter_0000002" and "iteration 4" in result.message
    assert "iter_0000002" in result.message
    assert latest_iteration(result.output_dir / "checkpoints") == 2
    states = torch.load(result.checkpoint / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert all(torch.isfinite(t).all() for t in states.values())
    assert all(math.isfinite(x) for x in result.losses)


def test_lora_trains_and_merge_reproduces_adapted_logits(tmp_path, tiny_llama_dir, sft_data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = H.tiny_config(
        tiny_llama_dir,
        sft_data,
        tmp_path / "ws",
        run_type="lora",
        train_iters=8,
        gbs=8,
        mbs=4,
        lr=1e-2,
        save_hf=True,
        lora_r=8,
        lora_alpha=32,
        lora_targets=["q_proj", "v_proj", "down_proj", "lm_head"],
    )  # tiny lm_head caps logits
    result = train(cfg, progress=False)
    assert result.status == "completed" and result.losses[-1] < result.losses[0] - 0.3, result.losses
    assert result.adapter_dir.name == "adapter" and (result.adapter_dir / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    adapted = PeftModel.from_pretrained(base, result.adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(result.hf_dir).eval()
    ids = torch.tensor([[5, 101, 120, 133, 6, 133, 120, 101, 2]])
    with torch.no_grad():
        a, m = adapted(ids).logits, merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)(ids).logits
    torch.testing.assert_close(m, a, atol=1e-4, rtol=1e-4)
    assert (m - plain).abs().max() > 1e-2  # the adapter changed something
    assert not any("lora" in k for k in merged.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage",
    [
        2,
        pytest.param(
            3,
            marks=pytest.mark.skipif(
                torch.__version__ < "2.2", reason="torch 2.1's gloo lacks the all-gather ZeRO-3 needs on CPU"
            ),
        ),
    ],
)
def test_zero_stages_train_and_export_the_same_model(tmp_path, tiny_llama_dir, pretrain_data, stage):
    from transformers import AutoModelForCausalLM

    common = dict(train_iters=3, save_hf=True)
    ref = train(H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "z0", **common), progress=False)
    res = train(
        H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / f"z{stage}", zero_stage=stage, **common),
        progress=False,
    )
    assert res.status == "completed"
    assert res.losses == pytest.approx(ref.losses, rel=1e-4)
    a = AutoModelForCausalLM.from_pretrained(ref.hf_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(res.hf_dir).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("run_type, data", [("pretrain", "pretrain_data"), ("lora", "sft_data")])
def test_recompute_trains_to_the_same_losses(tmp_path, tiny_llama_dir, request, run_type, data):
    """RECOMPUTE runs every layer's forward again in the backward: the same math, so the same losses (LoRA too:
    the non-reentrant checkpoint needs no gradient on the frozen inputs)."""
    folder = request.getfixturevalue(data)
    kw = dict(train_iters=3, run_type=run_type)
    ref = train(H.tiny_config(tiny_llama_dir, folder, tmp_path / "plain", **kw), progress=False)
    res = train(H.tiny_config(tiny_llama_dir, folder, tmp_path / "rc", recompute=True, **kw), progress=False)
    assert res.status == "completed" and res.losses == pytest.approx(ref.losses, rel=1e-5)
    assert res.losses[-1] != res.losses[0]
    # and it was on (the memory it saves: tests/test_plan_agreement.py's recompute case)
    from kit.train.engine import build_model

    model, _ = build_model(H.tiny_config(tiny_llama_dir, folder, tmp_path / "m", recompute=True, **kw))
    base = model.get_base_model() if run_type == "lora" else model
    assert (
        getattr(base, "is_activation_checkpointing", None) or base.is_gradient_checkpointing
    )  # (transformers 5 name)


def test_deepspeed_clips_everywhere_and_fp32_zero0_logs_the_norm_deepspeed_reports_elsewhere(
    tmp_path, tiny_llama_dir, pretrain_data
):
    """One step for every configuration: DeepSpeed clips; where it reports no norm (fp32 ZeRO 0) the trainer takes
    the same pre-clip norm itself, so ZeRO 0 and ZeRO 1 log the same grad norms and losses."""
    from kit.train import engine as eng
    from kit.train.metrics import read_metrics
    from kit.train.trainer import Trainer

    runs = {}
    for stage in (0, 1):
        cfg = H.tiny_config(
            tiny_llama_dir,
            pretrain_data,
            tmp_path / f"z{stage}",
            zero_stage=stage,
            train_iters=3,
            clip_grad=0.05,
        )
        trainer = Trainer(resolve(cfg), progress=False)
        res = trainer.train()
        assert res.status == "completed"
        assert trainer.engine.gradient_clipping() == 0.05  # DeepSpeed clips at every stage
        assert trainer.norm_from_deepspeed is (stage == 1) is eng.reports_grad_norm(trainer.engine)
        runs[stage] = res.losses, [r["grad_norm"] for r in read_metrics(res.metrics_path)]
    assert min(runs[0][1]) > 0.05  # clipping scaled every step's gradients
    assert runs[0][1] == pytest.approx(runs[1][1], rel=1e-4)
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5)


def test_padded_rows_train_padding_free_with_the_same_losses(tmp_path, tiny_llama_dir, sft_data, monkeypatch):
    """Kit attention: a padded micro-batch goes as one row of its real tokens; the loss curve is the row layout's."""
    import kit.train.trainer as trainer_mod

    rows = {
        "input_ids": torch.tensor([[5, 7, 8, 0, 0], [5, 9, 6, 4, 0]]),
        "labels": torch.tensor([[-100, 7, 8, -100, -100], [9, 9, 6, 4, -100]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0], [0, 1, 0, 1, 0]]),
    }
    flat = trainer_mod.flatten_padded_rows(rows)
    assert flat["input_ids"].tolist() == [[5, 7, 8, 5, 9, 6, 4]]
    assert flat["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert flat["labels"].tolist() == [[-100, 7, 8, -100, 9, 6, 4]]  # row 2's first label: never a target
    assert flat["attention_mask"].tolist() == [[1] * 7]
    cfg = dict(run_type="sft", train_iters=4, gbs=8, mbs=4)
    calls, real = [], trainer_mod.flatten_padded_rows
    monkeypatch.setattr(trainer_mod, "flatten_padded_rows", lambda batch: calls.append(1) or real(batch))
    flat_run = train(H.tiny_config(tiny_llama_dir, sft_data, tmp_path / "flat", **cfg), progress=False)
    assert len(calls) == 4 * 2  # every micro-batch of the run went flat
    monkeypatch.setattr(trainer_mod, "flatten_padded_rows", lambda batch: batch)
    rows_run = train(H.tiny_config(tiny_llama_dir, sft_data, tmp_path / "rows", **cfg), progress=False)
    assert flat_run.losses == pytest.approx(rows_run.losses, rel=1e-5)


def test_the_lm_head_runs_only_where_a_target_follows_with_the_same_loss_and_gradients(tiny_llama_dir):
    """A flattened SFT row: logits only at the positions before a target; loss and every gradient as HF computes."""
    from transformers import AutoModelForCausalLM

    import kit.train.trainer as trainer_mod

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).float()
    if not trainer_mod.takes_logit_positions(model):  # older stacks: the trainer keeps the plain path
        import transformers
        from packaging.version import Version

        assert Version(transformers.__version__) < Version("4.50")
        pytest.skip(f"transformers {transformers.__version__} models take no logits_to_keep positions")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=gen)
    labels = ids.clone()
    labels[0, :9] = -100  # a prompt, a second dialog's prompt, and a row start: no targets there
    labels[0, 20:26] = -100
    batch = {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.cat([torch.arange(20), torch.arange(20)]).unsqueeze(0),
    }
    keep = trainer_mod.logit_positions(labels)
    assert keep.tolist() == [i for i in range(39) if labels[0, i + 1] != -100]  # 8..18 and 25..38
    grads = []
    for positions in (None, keep):
        model.zero_grad()
        loss = trainer_mod.causal_lm_loss(model, batch, positions)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # rows where every position predicts a target (pretraining) and several rows keep the plain path
    assert trainer_mod.logit_positions(ids) is None
    assert trainer_mod.logit_positions(torch.cat([labels, labels])) is None


def test_a_flattened_row_whose_attention_lost_position_ids_is_refused():
    """Padding-free rows keep sequences apart only through position_ids: an attention call without them stops."""
    from kit.adapt.attention import AdaptError, _bsnd_attention, flattened_rows

    q = torch.randn(1, 6, 2, 8)
    args = dict(causal=True, pre=1 << 20, scale=8**-0.5, keep_prob=1.0)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    plain = _bsnd_attention(q, q, q, None, position_ids=None, **args)  # outside: one causal sequence
    with flattened_rows():
        with pytest.raises(AdaptError, match="position_ids"):
            _bsnd_attention(q, q, q, None, position_ids=None, **args)
        split = _bsnd_attention(q, q, q, None, position_ids=position_ids, **args)
    torch.testing.assert_close(split[:, :3], plain[:, :3])  # the first sequence sees the same keys
    assert not torch.allclose(split[:, 3:], plain[:, 3:])  # the second no longer sees the first


@pytest.mark.parametrize("what", ["run", "launch"])
def test_a_model_with_a_nan_weight_is_refused_before_anything_trains(
    tmp_path, tiny_llama_dir, pretrain_data, capsys, what
):
    """resolve checks the model's weights once (kit.convert.weights_check): one line naming the shard and the tensor,
    exit 2, no rank started, nothing written under the work folder."""
    import shutil

    from safetensors.torch import load_file, save_file

    from kit.__main__ import main

    bad = tmp_path / "nan_model"
    shutil.copytree(tiny_llama_dir, bad)
    shard = sorted(bad.glob("*.safetensors"))[-1]  # sharded: damage the last shard
    state = load_file(str(shard))
    name = sorted(state)[0]
    state[name].view(-1)[3] = float("nan")
    save_file(state, str(shard), metadata={"format": "pt"})
    work = tmp_path / "ws"
    argv = ["train", what, "--run-type", "pretrain", "--model-name", "tiny", "--model-path", str(bad),
            "--dataset-path", str(pretrain_data), "--work-dir", str(work), "--train-iters", "2", "--mbs", "2",
            "--gbs", "4", "--no-save-hf"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"MODEL_PATH: {shard}: tensor {name!r} holds 1 NaN/inf value(s)" in err
    assert not work.exists() or not [p for p in work.rglob("*") if p.is_file()]
