"""Data preparation interrupted or short of space: SIGTERM cleans up like Ctrl-C, leftovers of killed runs are
reported and removed on request, the length plot is written before the manifest (issue 30, item 5)."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kit.__main__ import main
from kit.data import DataConfig, prepare

ROOT = Path(__file__).resolve().parent.parent


def test_leftovers_of_killed_runs_are_reported_and_removed_with_clean_partial(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    hf_left = out / ".tiny_hf.partial-0123456789ab"  # kit/storage/atomic.py's temporary folder
    hf_left.mkdir()
    (hf_left / "data-00000-of-00001.arrow").write_bytes(b"\0" * 2**20)
    bin_left = out / "tiny_text_document.bin.partial-4242"  # the Megatron writer's temporary file
    bin_left.write_bytes(b"\0" * 2**19)
    other = out / ".other_hf.partial-0123456789ab"  # another dataset's run, perhaps writing right now
    other.mkdir()
    cfg = DataConfig(kind="pretrain", name="tiny", out_dir=str(out), max_length=32, max_records=5)

    res = prepare(cfg, progress=False)
    line = next(w for w in res.report.warnings if "leftover" in w)
    assert line.startswith("2 leftover partial output(s) of interrupted runs (1.5 MiB): ")
    assert str(hf_left) in line and str(bin_left) in line and "--clean-partial" in line
    assert hf_left.exists() and bin_left.exists()  # reported, not removed

    assert main(["data", "pretrain", "--out-dir", str(out), "--name", "tiny", "--max-length", "32",
                 "--max-records", "5", "--clean-partial", "--overwrite"]) == 0  # fmt: skip
    assert not hf_left.exists() and not bin_left.exists()
    assert other.is_dir()  # not this name's: never reported or removed here


def test_a_plot_that_cannot_be_written_leaves_no_complete_output(tmp_path, monkeypatch, capsys):
    import kit.data.pipeline as pipeline

    def disk_full(report, png, title=""):
        raise OSError(errno.ENOSPC, "No space left on device")  # as matplotlib's writer loses the file name

    monkeypatch.setattr(pipeline, "plot_lengths", disk_full)
    out = tmp_path / "o"
    args = [
        "data",
        "pretrain",
        "--out-dir",
        str(out),
        "--name",
        "p",
        "--max-length",
        "32",
        "--max-records",
        "5",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write {str(out / 'p_hf' / 'lengths.png')!r}: the disk is full" in err
    assert sorted(p.name for p in out.iterdir()) == []  # nothing looks complete: a rerun is not refused
    monkeypatch.undo()
    assert main(args) == 0 and (out / "p_hf" / "lengths.png").is_file()


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """~12 MB of JSON lines: long enough that preparation is still writing when the test stops it."""
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda"]
    path = tmp_path_factory.mktemp("corpus") / "big.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(20000):
            fh.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(100))}) + "\n")
    return path


def test_sigterm_during_preparation_cleans_up_like_ctrl_c(tmp_path, big_corpus):
    for attempt in range(3):  # a run that finished before it was stopped proves nothing: try again
        out = tmp_path / f"o{attempt}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "kit", "data", "pretrain", str(big_corpus), "--out-dir", str(out), "--name",
             "big", "--max-length", "64", "--batch-size", "200"],
            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        # the known point: the Megatron file has tokens in it (the temporary _hf folder exists since the start)
        while proc.poll() is None and not any(
            p.stat().st_size for p in out.glob("big_text_document.bin.partial-*")
        ):
            assert time.monotonic() < deadline, "preparation never started writing"
            time.sleep(0.005)
        if proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)  # frozen mid-write: the signal lands there, not after the end
        if proc.poll() is None and not (out / "big_hf").exists():
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)
            _out, err = proc.communicate(timeout=300)
            assert proc.returncode == 130 and err.strip().endswith("error: interrupted"), err
            assert sorted(p.name for p in out.iterdir()) == []  # no temporary folder or .bin/.idx partials
            return
        proc.kill()
        proc.communicate()
    pytest.fail("preparation finished before it could be stopped, three times")
