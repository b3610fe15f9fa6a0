"""kit.profiling.profile: a real torch.profiler capture of a tiny model, and the NPU mapping on the stand-in."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.plain_loop import profile_training

import kit.profiling as kp
from kit.system.device import torch_npu_import


def _loop(cap, steps: int, rng_seed: int = 0) -> None:
    torch.manual_seed(rng_seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(8, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        cap.step()


@pytest.fixture
def npu_profiler(monkeypatch):
    from npu_standin.profiler import install_profiler

    yield install_profiler(monkeypatch)
    torch_npu_import.cache_clear()  # forget the stand-in once monkeypatch has removed it


def test_torch_capture_matches_key_averages(tmp_path):
    with kp.profile(tmp_path, device="cpu", wait=1, warmup=1, active=2, tag="mlp") as cap:
        _loop(cap, 5)
    assert cap.folder.name.endswith("-cpu-mlp") and cap.folder.is_dir()
    assert not list(tmp_path.glob(".*partial*"))
    meta = json.loads((cap.folder / "capture.json").read_text(encoding="utf-8"))
    assert meta["profiler"] == "torch.profiler" and meta["steps"] == 5 and meta["device"]["kind"] == "cpu"
    assert meta["config"]["active"] == 2 and len(meta["git_commit"] or "x" * 40) == 40
    assert len(meta["traces"]) == 1 and meta["traces"][0].endswith(".pt.trace.json")

    data = cap.load()
    assert data.kind == "torch" and data.meta["capture"]["steps"] == 5
    # the two active steps, consecutive (ProfilerStep#N counts from 0 on torch >= 2.2, the numbering is shifted
    # by one on torch 2.1: compare the pattern, not the numbers)
    steps = sorted(data.kernels["step"].dropna().unique())
    assert len(steps) == 2 and steps[1] == steps[0] + 1 and steps[1] in (2, 3), steps
    table = kp.operator_table(data).set_index("type")
    ref = {e.key: e for e in cap.profiler.key_averages()}
    for op in ("aten::addmm", "aten::gelu", "aten::mm", "aten::gelu_backward"):
        assert table.loc[op, "calls"] == ref[op].count, op
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 2):
        # torch 2.1's trace attributes self time of nested ops (as_strided, copy_, to, autograd nodes) differently
        # from its own key_averages(); the call counts above are what that version lets us compare
        return
    # self times from the trace equal the profiler's own self_cpu_time_total, for every operator of the table
    # (all of them, not the slowest few: which ones are slowest depends on the machine's load)
    checked = [e for e in ref.values() if e.key in table.index]
    assert len(checked) >= 20
    for e in checked:
        assert table.loc[e.key, "total_us"] == pytest.approx(e.self_cpu_time_total, rel=0.05, abs=5.0), e.key
    advice = kp.advise(data)
    assert advice.problems == [] and advice.findings[-1].rule == "top_operators"
    assert kp.mean_step_us(data) > 0


def test_too_few_steps_is_reported(tmp_path):
    with kp.profile(tmp_path, device="cpu", wait=2, warmup=1, active=3) as cap:
        _loop(cap, 2)
    assert any("schedule needs 6" in n for n in cap.notes)


def test_failed_loop_leaves_only_a_partial_folder(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with kp.profile(tmp_path, device="cpu") as cap:
            _loop(cap, 1)
            raise RuntimeError("boom")
    assert not cap.folder.exists()
    partial = list(tmp_path.glob(".*.partial-*"))
    assert len(partial) == 1 and json.loads((partial[0] / "capture.json").read_text())["failed"] is True


def test_bad_options_are_listed_together():
    with pytest.raises(ValueError) as err:
        kp.profile("/tmp/x", wait=-1, level="Level3", aic_metrics="Cube", device="tpu")
    msg = str(err.value)
    assert "4 problem(s)" in msg and "Level3" in msg and "'Cube'" in msg and "tpu" in msg


def test_npu_mapping_on_the_standin(npu_profiler, tmp_path):
    with kp.profile(
        tmp_path,
        device="npu",
        wait=1,
        warmup=1,
        active=2,
        skip_first=1,
        level="Level1",
        record_shapes=True,
        with_stack=True,
    ) as cap:
        _loop(cap, 5)
    prof = npu_profiler.CREATED[-1]
    assert prof.activities == {npu_profiler.ProfilerActivity.CPU, npu_profiler.ProfilerActivity.NPU}
    s = prof.schedule
    assert (s.wait, s.warmup, s.active, s.repeat, s.skip_first) == (1, 1, 2, 1, 1)
    exp = prof.experimental_config
    assert exp.profiler_level == "Level1" and exp.aic_metrics == "ACL_AICORE_PIPE_UTILIZATION"
    assert exp.warnings == [] and prof.warnings == [] and prof.record_shapes and prof.with_stack
    assert prof.on_trace_ready.analyse_flag is True
    meta = json.loads((cap.folder / "capture.json").read_text(encoding="utf-8"))
    assert meta["profiler"] == "torch_npu.profiler" and meta["device"]["kind"] == "npu"
    data = cap.load()
    assert data.kind == "ascend" and data.path.parent == cap.folder and data.ratio_columns
    assert kp.advise(data).problems == []


def test_npu_level0_drops_aic_metrics_without_the_reset_warning(npu_profiler, tmp_path):
    with kp.profile(
        tmp_path, device="npu", level="Level0", aic_metrics="PipeUtilization", analyse=False
    ) as cap:
        _loop(cap, 5)
    exp = npu_profiler.CREATED[-1].experimental_config
    assert exp.aic_metrics == "ACL_AICORE_NONE" and exp.warnings == []
    assert any("aic_metrics=PipeUtilization dropped" in n for n in cap.notes)
    with pytest.raises(kp.ProfileError, match="analyse"):  # analyse=False: raw data only, parse later
        cap.load()


def test_npu_requested_without_torch_npu_says_what_to_do(tmp_path):
    torch_npu_import.cache_clear()
    if torch_npu_import()[0] is not None:
        pytest.skip("torch_npu is importable here")
    with pytest.raises(RuntimeError, match="torch_npu cannot be imported"):
        kp.profile(tmp_path, device="npu").start()


def _assert_linear_layers_captured(data, active: int) -> None:
    """What a capture of a Llama must hold whatever the machine's load: the matmuls of its linear layers, the
    same operator calls in every recorded step, a table sorted by total time (never an operator's rank)."""
    table = kp.operator_table(data)
    assert table["total_us"].is_monotonic_decreasing and (table["total_us"] >= 0).all()
    assert "aten::mm" in set(table["type"])
    steps = sorted(data.kernels["step"].dropna().unique())
    assert len(steps) == active
    per_step = data.kernels.groupby(["step", "type"]).size().unstack(fill_value=0)
    for s in steps[1:]:
        assert (per_step.loc[s] == per_step.loc[steps[0]]).all(), s
    assert table.set_index("type").loc["aten::mm", "calls"] == active * per_step.loc[steps[0], "aten::mm"] > 0


@pytest.mark.slow
def test_profile_training_of_a_tiny_llama(tiny_llama_dir, tmp_path):
    cap = profile_training(tiny_llama_dir, out_dir=tmp_path, device="cpu", wait=1, warmup=1, active=2)
    assert len(cap.step_times) == 4
    _assert_linear_layers_captured(cap.load(), active=2)


@pytest.mark.slow
def test_capture_hooks_the_kit_trainer(tiny_llama_dir, tmp_path):
    import test_train_helpers as H  # the trainer's synthetic prepared-dataset helpers

    from kit.profiling.training_run import profile_trainer

    data = H.make_pretrain(tmp_path / "pre_hf", num_samples=16)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", train_iters=4)
    cap, result = profile_trainer(
        cfg, out_dir=tmp_path / "profiles", device="cpu", wait=1, warmup=1, active=2
    )
    assert result.status == "completed" and cap.steps == 4
    assert cap.folder.name.endswith("-cpu-pretrain")
    _assert_linear_layers_captured(cap.load(), active=2)
    with pytest.raises(ValueError, match="TRAIN_ITERS=4"):
        profile_trainer(cfg, out_dir=tmp_path / "profiles", device="cpu", wait=2, warmup=1, active=2)


def test_captures_in_the_same_second_get_their_own_folders_and_load_picks_the_newest(tmp_path):
    caps = []
    for _ in range(2):
        with kp.profile(tmp_path, device="cpu", wait=0, warmup=1, active=1, tag="same") as cap:
            _loop(cap, 2)
        caps.append(cap)
    (tmp_path / ".20991231-000000-cpu.partial-1").mkdir()  # an interrupted capture is never picked
    assert caps[0].folder != caps[1].folder and all(c.folder.is_dir() for c in caps)
    data = kp.load(tmp_path)
    assert data.path.parent == max(c.folder for c in caps)
    assert any("2 profiles under" in n for n in data.notes)
