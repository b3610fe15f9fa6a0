"""The profile stage profiles notebook 04's training run (read from its manifest) and links the capture to it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import kit.profiling as kp
from kit.core.configs import to_jsonable
from kit.core.inputs import outputs
from kit.core.manifest import (
    HF_MODEL,
    MANIFEST_NAME,
    PROFILE_CAPTURE,
    TRAINING_RUN,
    Consumed,
    read_manifest,
    write_manifest,
)
from kit.errors import InputError, MissingInputError
from kit.profiling.training_run import profiled_config, schedule_steps

OPTIONS = dict(device="cpu", wait=0, warmup=1, active=2)


def _prepared(ws, tokenizer: Path) -> Path:
    """Pretraining data made by kit.data from the shipped corpus, with the tiny model's tokenizer."""
    from kit.data import DataConfig, prepare

    cfg = DataConfig(
        kind="pretrain", name="tiny", tokenizer=str(tokenizer), max_length=32, max_records=40, overwrite=True
    )
    return Path(prepare(cfg, ws, progress=False).hf_dir)


def _train_config(ws, model: Path, data: Path, **kw):
    """The resolved config notebook 04 would record for this run (kit.train.resolve)."""
    from kit.train.config import TrainConfig
    from kit.train.resolve import resolve

    base = dict(
        run_type="pretrain",
        model_name=ws.model,
        model_path=str(model),
        dataset_path=str(data),
        work_dir=str(ws.root),
        train_iters=50,
        mbs=2,
        gbs=4,
        lr=3e-3,
        warmup_iters=5,
        seed=7,
        save_interval=10,
    )
    base.update(kw)
    return resolve(TrainConfig(**base), ws).cfg


def _training_run(folder: Path, cfg, created: str = "") -> Path:
    """A training-run manifest as notebook 04 writes it (fields per kit.core.manifest.KINDS)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_manifest(
        folder,
        TRAINING_RUN,
        {
            "run_type": cfg.run_type,
            "config": to_jsonable(cfg),
            "sources": {},
            "data": cfg.dataset_path,
            "model": cfg.model_path,
            "checkpoints": [],
            "hf": None,
            "metrics": str(folder / "metrics.jsonl"),
            "log": str(folder / "train.log"),
        },
    )
    if created:  # an older run: its manifest says so
        path = folder / MANIFEST_NAME
        record = json.loads(path.read_text(encoding="utf-8"))
        record["created"] = created
        path.write_text(json.dumps(record), encoding="utf-8")
    return folder


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_capture_profiles_the_named_training_run_and_links_it(workspace, tiny_llama_dir):
    data = _prepared(workspace, tiny_llama_dir)
    cfg = _train_config(workspace, tiny_llama_dir, data)
    run_dir = _training_run(workspace.output("pretrain"), cfg)
    # distractors: an older run, an hf-model folder inside the run, a training-run manifest under profiles/
    _training_run(
        workspace.output("sft"), dataclasses.replace(cfg, lr=1.0), created="2020-01-01T00:00:00+00:00"
    )
    (run_dir / "hf").mkdir()
    write_manifest(run_dir / "hf", HF_MODEL, {"family": "llama", "source": str(run_dir)})
    _training_run(workspace.profiles / "old-capture" / "x", dataclasses.replace(cfg, lr=2.0))
    assert [m.folder for m in outputs(workspace, TRAINING_RUN)] == [
        run_dir.resolve(),
        workspace.output("sft").resolve(),
    ]
    from kit.core.inputs import name_run

    name_run(workspace, run_dir, "notebook 04")  # the run 05 takes; the sft run is never guessed
    before, logs_before = _files(run_dir), _files(workspace.logs)

    result = kp.run(kp.ProfileConfig(**OPTIONS), workspace)

    run_m = read_manifest(run_dir, expect=TRAINING_RUN)
    summary = result.summary()
    assert summary["training_run"] == str(run_dir.resolve())
    assert summary["training_run_manifest_sha256"] == run_m.sha256 and summary["configured_here"] == ""
    cap_m = read_manifest(summary["capture_folder"], expect=PROFILE_CAPTURE)
    assert cap_m.sha256 == summary["capture_manifest_sha256"]
    assert cap_m["training_run"] == str(run_dir.resolve())
    assert cap_m.inputs == [Consumed(TRAINING_RUN, str(run_dir.resolve()), run_m.sha256)]
    assert summary["inputs"] == [dataclasses.asdict(cap_m.inputs[0])]
    assert cap_m["options"]["active"] == 2 and cap_m["device"]["kind"] == "cpu" and cap_m["steps"] == 3

    # THAT training: the run's settings, only the step count and where outputs go changed
    profiled = cap_m["profiled_config"]
    changed = {k for k, v in to_jsonable(cfg).items() if profiled[k] != v and k != "sources"}
    assert changed == {"train_iters", "warmup_iters", "save_interval", "save_hf", "overwrite", "work_dir"}
    assert profiled["seq_len"] == 32 and profiled["sources"]["seq_len"] == cfg.sources["seq_len"]  # inherited
    assert profiled["train_iters"] == 3 and profiled["warmup_iters"] == 3 and profiled["lr"] == 3e-3
    assert profiled["model_path"] == str(tiny_llama_dir) and profiled["dataset_path"] == str(data)
    folder = Path(summary["capture_folder"])
    assert folder.parent == workspace.profiles and folder.name.endswith("-cpu-pretrain")
    assert profiled["work_dir"] == str(folder / "training") == summary["profiled_training"]

    # the steps ran in the capture folder, never over the run's checkpoints or logs
    assert _files(run_dir) == before and _files(workspace.logs) == logs_before
    metrics = list((folder / "training").rglob("metrics*.jsonl")) or list(
        (folder / "training").rglob("*.jsonl")
    )
    assert len(metrics) == 1
    rows = [json.loads(x) for x in metrics[0].read_text(encoding="utf-8").splitlines() if x.strip()]
    assert [r["iteration"] for r in rows if "iteration" in r] == [1, 2, 3]
    assert not list((folder / "training").rglob("checkpoints"))  # measured, not kept
    # the profiled steps' own training-run manifest lists what is left, under the published folder's paths
    (nested,) = [p.parent for p in (folder / "training").rglob(MANIFEST_NAME)]
    nested_m = read_manifest(nested, expect=TRAINING_RUN)
    assert nested_m["checkpoints"] == [] and nested_m["profiled_by"] == str(folder)
    assert nested_m["metrics"] == str(metrics[0]) and ".partial" not in json.dumps(nested_m.fields)
    assert ".partial" not in json.dumps(cap_m.fields)
    assert [m.folder for m in outputs(workspace, TRAINING_RUN)][0] == run_dir.resolve()  # profiles/ skipped
    assert summary["train_status"] == "completed" and len(summary["train_losses"]) == 3

    # what was recorded: the two active steps of the tiny Llama's training
    data_p = kp.load(folder)
    assert sorted(data_p.kernels["step"].dropna().unique()).__len__() == 2
    assert {"aten::mm", "aten::addmm"} & set(kp.operator_table(data_p)["type"])
    assert len(summary["capture_traces"]) == 1 and Path(summary["capture_traces"][0]).is_file()
    assert Path(summary["capture_plot"]).read_bytes()[:4] == b"\x89PNG"
    assert json.loads(Path(summary["capture_advice"]).read_text(encoding="utf-8"))["problems"] == []
    assert not list(workspace.profiles.glob(".*partial*"))


def _one_line_error(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def test_wrong_kind_folder_as_run_is_a_one_line_error(workspace, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    write_manifest(hf, HF_MODEL, {"family": "llama", "source": "x"})
    with pytest.raises(InputError) as exc:
        kp.run(kp.ProfileConfig(**OPTIONS), workspace, training_run=hf)
    text = _one_line_error(exc)
    assert "is a hf-model folder" in text and "expected a training-run folder (made by notebook 04" in text
    assert not workspace.profiles.exists() or not list(workspace.profiles.iterdir())  # nothing recorded

    from kit.__main__ import main

    code = main(
        ["profile", "demo", "--workspace", str(workspace.root), "--model", workspace.model]
        + ["--training-run", str(hf), "--device", "cpu"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "is a hf-model folder" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_missing_manifest_and_missing_folder(workspace, tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(InputError) as exc:
        kp.run(kp.ProfileConfig(**OPTIONS), workspace, training_run=tmp_path / "plain")
    assert f"has no {MANIFEST_NAME}" in _one_line_error(exc) and "training-run" in str(exc.value)
    with pytest.raises(MissingInputError) as exc:
        kp.run(kp.ProfileConfig(**OPTIONS), workspace, training_run=tmp_path / "nowhere")
    assert "does not exist" in _one_line_error(exc)


def test_damaged_config_in_the_run_manifest(workspace, tmp_path):
    from kit.errors import KitError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_manifest(
        run_dir,
        TRAINING_RUN,
        {
            **{k: None for k in ("sources", "data", "model", "checkpoints", "hf", "metrics", "log")},
            "run_type": "sft",
            "config": {"run_type": "sft", "no_such_setting": 3},
        },
    )
    with pytest.raises(KitError) as exc:
        kp.run(kp.ProfileConfig(**OPTIONS), workspace, training_run=run_dir)
    assert "['no_such_setting']" in _one_line_error(exc)


def test_profiled_config_keeps_the_run_and_says_what_changed(tmp_path):
    from kit.train.config import TrainConfig

    run = TrainConfig(
        run_type="retrain", resume_from="sft", nproc_per_node=4, mbs=2, gbs=64, warmup_iters=10, lr=5e-4
    )
    cfg, notes = profiled_config(run, tmp_path / "t", 5)
    assert (cfg.run_type, cfg.train_iters, cfg.warmup_iters, cfg.lr) == ("sft", 5, 5, 5e-4)
    assert (cfg.world_size, cfg.mbs, cfg.gbs, cfg.grad_accum) == (1, 2, 16, 8)  # one card's work per step
    assert cfg.grad_accum == run.grad_accum and cfg.work_dir == str(tmp_path / "t")
    assert cfg.save_hf is False and cfg.save_interval == 0 and cfg.overwrite is True
    assert len(notes) == 2 and "GBS=16" in notes[1] and "profiled as sft" in notes[0]
    with pytest.raises(kp.ProfileError, match="ENGINE='megatron'"):
        profiled_config(dataclasses.replace(run, engine="megatron"), tmp_path, 5)


def test_schedule_steps():
    assert schedule_steps(kp.ProfileConfig(wait=1, warmup=1, active=3)) == 5
    assert schedule_steps(kp.ProfileConfig(wait=0, warmup=1, active=2, repeat=2, skip_first=1)) == 7
    assert schedule_steps(kp.ProfileConfig(repeat=0)) == kp.ProfileConfig().steps_needed


@pytest.mark.slow
def test_profiles_a_real_tiny_training_run(workspace, tiny_llama_dir):
    """kit.train.train writes the training-run manifest; the stage profiles that run with the same settings."""
    from kit.train import train

    data = _prepared(workspace, tiny_llama_dir)
    trained = train(
        _train_config(workspace, tiny_llama_dir, data, train_iters=2, warmup_iters=1, save_interval=0),
        workspace,
    )
    assert trained.status == "completed" and trained.manifest is not None
    run_m = read_manifest(trained.output_dir, expect=TRAINING_RUN)
    before = _files(trained.output_dir)

    result = kp.run(kp.ProfileConfig(**OPTIONS), workspace)

    assert result.training_run.folder == run_m.folder and result.training_run.sha256 == run_m.sha256
    assert result.manifest.inputs == [run_m.as_input()] and result.manifest["training_run"] == str(
        run_m.folder
    )
    ran, theirs = result.train_config, run_m["config"]
    for name in (
        "model_path",
        "dataset_path",
        "tokenizer_path",
        "seq_len",
        "mbs",
        "gbs",
        "lr",
        "seed",
        "dtype",
    ):
        assert getattr(ran, name) == theirs[name], name
    assert ran.train_iters == 3 and Path(ran.work_dir) == result.folder / "training"
    assert _files(trained.output_dir) == before  # the run's checkpoints, HF export and manifest untouched
    assert result.train_result.status == "completed" and result.capture.steps == 3


def test_newest_run_search_skips_damaged_and_other_kinds(workspace, tmp_path):
    from kit.train.config import TrainConfig

    cfg = TrainConfig(model_name=workspace.model, model_path="m", dataset_path="d")
    good = _training_run(workspace.output("sft"), cfg)
    damaged = workspace.output("pretrain")
    damaged.mkdir(parents=True, exist_ok=True)
    (damaged / MANIFEST_NAME).write_text('{"kind": "training-run", "fie', encoding="utf-8")
    hf = workspace.model_output / "exported"
    hf.mkdir()
    write_manifest(hf, HF_MODEL, {"family": "llama", "source": str(good)})
    assert [m.folder for m in outputs(workspace, TRAINING_RUN)] == [good.resolve()]


@pytest.mark.slow
def test_a_sigtermed_capture_is_not_published_as_complete(workspace, tiny_llama_dir, monkeypatch):
    """SIGTERM at step 1 of 3 (sent from the profiler's step hook, a known point): an error, no finished capture."""
    import os
    import signal

    from kit.profiling.capture import Capture
    from kit.profiling.profile_data import CaptureError

    data = _prepared(workspace, tiny_llama_dir)
    _training_run(workspace.output("pretrain"), _train_config(workspace, tiny_llama_dir, data))
    step = Capture.step

    def step_then_sigterm(self):
        step(self)
        if self.steps == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # what ModelArts sends; the trainer checkpoints and stops

    monkeypatch.setattr(Capture, "step", step_then_sigterm)
    with pytest.raises(
        CaptureError, match=r"stopped at step 1 of 3 \(preempted\); the capture was not published"
    ):
        kp.run(kp.ProfileConfig(**OPTIONS), workspace)
    left = list(workspace.profiles.iterdir())
    assert len(left) == 1 and ".partial-" in left[0].name  # unfinished, never under a capture's final name
    assert outputs(workspace, TRAINING_RUN)[0].folder == workspace.output("pretrain").resolve()


def test_an_interruption_before_the_first_profiled_step_leaves_nothing(
    workspace, tiny_llama_dir, monkeypatch
):
    """Ctrl-C while the profiled run loads its model (after its folder was made, before the profiler's first step):
    no folder is left in profiles/, neither under a capture's name nor as a temporary one."""
    import kit.train

    data = _prepared(workspace, tiny_llama_dir)
    _training_run(workspace.output("pretrain"), _train_config(workspace, tiny_llama_dir, data))

    def interrupted(plan, *args, **kwargs):
        plan.folder.mkdir(parents=True, exist_ok=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(kit.train, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        kp.run(kp.ProfileConfig(**OPTIONS), workspace)
    assert not workspace.profiles.exists() or list(workspace.profiles.iterdir()) == []
