"""`python -m kit profile ...` end to end, and msprof-analyze's AI_CPU verdict on the same sample."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kit.__main__ import main


def test_sample_analyze_compare(tmp_path, capsys):
    assert main(["profile", "sample", str(tmp_path / "planted")]) == 0
    assert main(["profile", "sample", str(tmp_path / "clean"), "--clean", "--level", "Level0"]) == 0
    planted, clean = (next((tmp_path / n).glob("*_ascend_pt")) for n in ("planted", "clean"))
    capsys.readouterr()

    assert main(["profile", "analyze", str(planted), "--json", "--out", str(tmp_path / "advice")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["problems"] == ["cast", "aicpu", "low_ratio", "block_dim"]
    assert json.loads((tmp_path / "advice" / "advice.json").read_text())["problems"] == doc["problems"]
    assert main(["profile", "analyze", str(planted), "--fail-on-problems"]) == 1
    assert "PROBLEM - Operators run on the AI CPU" in capsys.readouterr().out
    # thresholds from the command line: a looser AI_CPU rule no longer fires
    assert (
        main(
            [
                "profile",
                "analyze",
                str(planted),
                "--json",
                "--aicpu-max-us",
                "2000",
                "--aicpu-share-pct",
                "50",
            ]
        )
        == 0
    )
    assert "aicpu" not in json.loads(capsys.readouterr().out)["problems"]
    assert main(["profile", "analyze", str(clean), "--fail-on-problems"]) == 0
    assert "SKIPPED - Unit utilisation not collected" in capsys.readouterr().out  # a Level0 sample

    assert main(["profile", "compare", str(planted), str(clean), "--csv", str(tmp_path / "cmp.csv")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mean step: before") and "NonZero" in out
    assert (tmp_path / "cmp.csv").read_text().startswith("type,calls_a")


def test_bad_path_exits_2_with_a_message(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["profile", "analyze", str(tmp_path / "empty")]) == 2
    assert "no profile in" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("msprof-analyze") is None
    and not (__import__("pathlib").Path(sys.executable).parent / "msprof-analyze").exists(),
    reason="msprof-analyze (PyPI) not installed",
)
@pytest.mark.parametrize("clean", [False, True])
def test_msprof_analyze_agrees_on_ai_cpu(tmp_path, clean):
    from kit.profiling import advise, load, write_sample_ascend_profile

    pt = write_sample_ascend_profile(tmp_path / "p", clean=clean)
    exe = shutil.which("msprof-analyze") or str(
        __import__("pathlib").Path(sys.executable).parent / "msprof-analyze"
    )
    res = subprocess.run(
        [exe, "advisor", "computation", "-d", str(pt), "-l", "en", "-o", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = "AICPU Issues" in res.stdout
    ours = "aicpu" in advise(load(pt)).problems
    assert theirs == ours == (not clean)
    if not clean:
        assert "NonZero" in res.stdout.split("AICPU Issues", 1)[1][:800]


@pytest.mark.slow
def test_demo_capture_from_the_command_line(tiny_llama_dir, tmp_path, capsys):
    """A workspace without a training run: the CLI configures one from notebook 04's defaults and says so."""
    from kit.core.manifest import PREPARED_DATA, PROFILE_CAPTURE, read_manifest
    from kit.core.workspace import get_workspace

    ws = get_workspace(tmp_path / "ws", model="tiny")
    argv = [
        "profile",
        "demo",
        "--workspace",
        str(ws.root),
        "--model",
        "tiny",
        "--model-path",
        str(tiny_llama_dir),
    ]
    argv += [
        "--device",
        "cpu",
        "--wait",
        "0",
        "--warmup",
        "1",
        "--active",
        "1",
        "--seq-len",
        "32",
        "--tag",
        "cli",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    folder = Path(out[-1])
    assert folder.parent == ws.profiles and folder.name.endswith("-cpu-cli")
    said = [line for line in out if line.startswith("no training run named in")]
    assert len(said) == 1 and str(ws.model_output) in said[0]
    meta = json.loads((folder / "capture.json").read_text())
    assert meta["steps"] == 2 and meta["traces"] and meta["config"]["tag"] == "cli"
    m = read_manifest(folder, expect=PROFILE_CAPTURE)
    assert m["training_run"] is None and m["configured_here"] == said[0]
    data = m["profiled_config"]["dataset_path"]  # prepared here from the sample: its manifest is the input
    assert [(c.kind, c.path) for c in m.inputs] == [(PREPARED_DATA, str(Path(data).resolve()))]
    assert m["profiled_config"]["model_path"] == str(tiny_llama_dir) and m["profiled_config"]["seq_len"] == 32
    assert m["options"]["active"] == 1 and m["steps"] == 2
