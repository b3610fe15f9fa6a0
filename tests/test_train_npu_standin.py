"""The trainer's NPU path against stand-ins: HCCL dtypes, one host sync per step, set_device, fused AdamW, dtype."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import test_train_helpers as H
import torch
from npu_standin import install
from npu_standin.hccl import HCCL_DTYPES, HcclDtypeError, install_hccl_check

from kit.train import trainer as trainer_mod
from kit.train.resolve import resolve

HCCL_SITE = Path(__file__).parent / "npu_standin" / "hccl_site"


def test_hccl_check_refuses_float64_and_names_allowed(monkeypatch):
    import torch.distributed as dist

    install_hccl_check(monkeypatch)
    with pytest.raises(HcclDtypeError, match="float64"):
        dist.all_reduce(torch.zeros(2, dtype=torch.float64))
    assert torch.float64 not in HCCL_DTYPES and torch.float32 in HCCL_DTYPES and torch.int64 in HCCL_DTYPES


@pytest.mark.slow
def test_data_parallel_run_passes_the_hccl_dtype_check(tmp_path, tiny_llama_dir, monkeypatch):
    """Two launched ranks (gloo) with every collective checked as HCCL would: no float64 reaches all_reduce."""
    from kit.train.launch import launch
    from kit.train.metrics import read_metrics

    log = tmp_path / "collectives.txt"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HCCL_SITE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("KIT_HCCL_CHECK_LOG", str(log))
    data = H.make_pretrain(tmp_path / "p_hf", num_samples=8)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "two", nproc_per_node=2, train_iters=2, gbs=4, mbs=1)
    res = launch(cfg, progress=False)
    assert res.ok, "\n".join(res.tail)
    lines = log.read_text().split()
    calls = list(zip(lines[1::3], lines[2::3]))
    reduced = {dtype for op, dtype in calls if op == "all_reduce"}
    # the kit's own sums/flags (fp32, int64) and DeepSpeed's (fp32 gradients, uint8 overflow flags): no float64
    assert {"float32", "int64"} <= reduced <= {"float32", "int64", "uint8"}, calls
    records = read_metrics(cfg.log_dir() / "pretrain.metrics.jsonl")
    assert [r["iteration"] for r in records] == [1, 2] and records[0]["real_tokens"] == 4 * 32


def _count_host_syncs(monkeypatch) -> list:
    counter = []
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            # the kit's own syncs only: DeepSpeed's vary by version (0.14 adds one per micro-batch on CPU)
            caller = sys._getframe(1).f_code.co_filename
            if f"{os.sep}kit{os.sep}" in caller:
                counter.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counter


def test_host_syncs_per_step_do_not_grow_with_micro_batches(tmp_path, tiny_llama_dir, monkeypatch):
    """NaN/inf is decided once per optimizer step: 1 or 4 micro-batches cost the same host syncs."""
    data = H.make_pretrain(tmp_path / "p_hf", num_samples=8)
    counts = {}
    for mbs in (4, 1):  # grad accumulation 1 and 4
        trainer = trainer_mod.Trainer(
            resolve(H.tiny_config(tiny_llama_dir, data, tmp_path / f"ws{mbs}", gbs=4, mbs=mbs)),
            progress=False,
        )
        trainer._setup()
        trainer._one_step(0)  # warm-up: DeepSpeed's first step differs
        syncs = _count_host_syncs(monkeypatch)
        metrics = trainer._one_step(1)
        counts[mbs] = len(syncs)
        monkeypatch.undo()
        assert metrics is not None and metrics["real_tokens"] == 4 * 32
        trainer.writer.close()
    assert counts[1] == counts[4], counts


def test_set_device_before_the_process_group(monkeypatch, tmp_path, tiny_llama_dir):
    """On NPU the trainer pins LOCAL_RANK's card through torch.npu before init_distributed runs."""
    from kit.train import engine as eng

    fake = install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    order = []
    original = fake.SET_DEVICE_CALLS

    def stop(info, log=None):
        order.append(("init_distributed", list(original)))
        raise RuntimeError("stop here")

    monkeypatch.setattr(eng, "init_distributed", stop)
    data = H.make_pretrain(tmp_path / "p_hf", num_samples=4)
    trainer = trainer_mod.Trainer(
        resolve(H.tiny_config(tiny_llama_dir, data, tmp_path / "ws")), progress=False
    )
    with pytest.raises(RuntimeError, match="stop here"):
        trainer._setup()
    assert order == [("init_distributed", [3])]


@pytest.mark.parametrize(
    "device_type, release, fused",
    [
        ("cuda", "2.1.0", True),
        ("cpu", "2.1.0", False),  # torch 2.1 has no CPU kernel (its constructor refuses fused=True there)
        ("cpu", "2.4.0", True),
        ("cpu", "2.13.0+cpu", True),
        ("npu", "2.1.0", False),
        ("npu", "2.5.1", True),  # torch_npu's `_fused_adamw_`
        ("mps", "2.5.1", False),
    ],
)
def test_fused_adamw_by_device_and_torch_release(device_type, release, fused):
    from kit.train.engine import fused_adamw

    assert fused_adamw(device_type, release) is fused


def test_the_trainers_adamw_is_fused_where_torch_runs_it_and_updates_like_foreach(monkeypatch):
    from types import SimpleNamespace

    from kit.train.engine import adamw, fused_adamw

    cfg = SimpleNamespace(lr=0.1, weight_decay=0.01)
    lin = torch.nn.Linear(4, 3)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(lin.state_dict())
    opt = adamw(lin.parameters(), cfg)
    fused = fused_adamw("cpu")
    assert [bool(g["fused"]) for g in opt.param_groups] == [fused]
    if not fused:  # the table agrees with this torch's own constructor check
        with pytest.raises(RuntimeError, match="fused"):
            torch.optim.AdamW(ref.parameters(), fused=True)
        return
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.01, foreach=True)
    called = []
    original = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: called.append(1) or original(*a, **k))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    for model, optimizer in ((lin, opt), (ref, ref_opt)):
        model(x).square().sum().backward()
        optimizer.step()
    assert called  # what ran was the fused kernel
    for a, b in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bf16, flag, absent", [(True, "--bf16", "--fp16"), (False, "--fp16", "--bf16")])
def test_megatron_auto_dtype_follows_the_card(tmp_path, tiny_llama_dir, monkeypatch, bf16, flag, absent):
    """DTYPE=auto gives --bf16 only where the card has bf16 (Atlas A2/A3), --fp16 on a 910A."""
    from kit.train import TrainConfig
    from kit.train.megatron import build

    install(monkeypatch, bf16=bf16)
    cfg = TrainConfig(
        engine="megatron",
        run_type="pretrain",
        model_name="tiny",
        model_path=str(tiny_llama_dir),
        dataset_path=str(H.prepared(tmp_path / "corpus_hf", tiny_llama_dir, kind="pretrain")),
        work_dir=str(tmp_path / "ws"),
    )
    argv = build(resolve(cfg)).argv
    assert flag in argv and absent not in argv


def test_megatron_auto_dtype_on_cpu_adds_no_half_precision(tmp_path, tiny_llama_dir):
    from kit.train import TrainConfig
    from kit.train.megatron import build

    cfg = TrainConfig(
        engine="megatron",
        run_type="pretrain",
        model_name="tiny",
        model_path=str(tiny_llama_dir),
        dataset_path=str(H.prepared(tmp_path / "corpus_hf", tiny_llama_dir, kind="pretrain")),
        work_dir=str(tmp_path / "ws"),
    )
    argv = build(resolve(cfg)).argv
    assert "--bf16" not in argv and "--fp16" not in argv


def test_packed_sft_without_kit_attention_is_refused(tmp_path, tiny_llama_dir):
    """Without ADAPT, HF attention would let packed dialogs see each other: the trainer says so and stops."""
    from kit.errors import InputError

    sft = H.make_sft(tmp_path / "s_hf", num_samples=8)
    trainer = trainer_mod.Trainer(
        resolve(H.tiny_config(tiny_llama_dir, sft, tmp_path / "ws", run_type="sft", adapt=False)),
        progress=False,
    )
    with pytest.raises(InputError, match="ADAPT=True.*PACK=False"):
        trainer._setup()
    report = type("R", (), {"attention": "kit"})()
    trainer_mod.check_packing({"kind": "sft", "packed": True}, report, "x")  # kit attention: fine
    trainer_mod.check_packing({"kind": "sft", "packed": False}, None, "x")  # one dialog per row: fine
    trainer_mod.check_packing({"kind": "pretrain", "packed": True}, None, "x")  # documents: as usual
