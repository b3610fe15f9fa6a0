"""The verification fits the host: the logits check holds one decoder layer at a time and is skipped, in one line,
where its estimate exceeds the memory available; the rank-file check is memory-mapped; the summary says where
the verification is while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.convert.synthetic import synthetic_checkpoint

import kit.convert.verify as verify
from kit.convert import ConvertConfig, hf_to_megatron
from kit.convert.checks import ConversionError
from kit.convert.hf_io import HFReader
from kit.convert.result import run
from kit.core.workspace import repo_root

MiB = 1 << 20


def _short_of_memory(monkeypatch, seen=None):
    def tiny(*_):
        if seen is not None:
            seen.append(json.loads(seen[0].read_text())["verification"])
        return MiB, "a test's limit"

    monkeypatch.setattr(verify, "available_memory", tiny)


def test_a_logits_check_that_does_not_fit_is_skipped_in_one_line(
    tiny_llama_dir, workspace, monkeypatch, capsys
):
    result = run(ConvertConfig(str(tiny_llama_dir), tp=2), workspace, progress=False)
    summary_file = workspace.reports / "03_weight_conversion.summary.json"
    seen = [summary_file]
    _short_of_memory(monkeypatch, seen)
    v = result.verify(workspace.converted_weights / ".verify", back_to_hf=False)
    line = v["skipped"][0]
    assert (
        line.startswith("logits check skipped: it needs about ")
        and "0.0 GiB is available (a test's limit)" in line
    )
    assert capsys.readouterr().out.count("logits check skipped") == 1
    rows = v["table"].to_dict("records")
    assert rows[-1]["value"] == "skipped" and rows[-1]["passed"] is None
    assert v["passed"] is None and all(r["passed"] for r in rows[:-1])  # nothing failed, one check skipped
    assert v["details"]["logits"]["memory_needed"] > MiB
    assert seen[1] == "verifying"  # the summary was written before the checks started...
    summary = json.loads(summary_file.read_text())
    assert summary["verification"] == "done" and summary["verified"] is None  # ...and after
    assert summary["checks_skipped"] == [line]


def test_a_verification_that_stops_leaves_a_summary_saying_so(tiny_llama_dir, workspace, monkeypatch):
    result = run(ConvertConfig(str(tiny_llama_dir)), workspace, progress=False)

    def broken(*_, **__):
        raise ConversionError(["mp_rank_00/model_optim_rng.pt: CRC mismatch"], "Megatron rank file")

    monkeypatch.setattr(verify, "logits_check", broken)
    with pytest.raises(ConversionError):
        result.verify(workspace.converted_weights / ".verify", back_to_hf=False)
    summary = json.loads((workspace.reports / "03_weight_conversion.summary.json").read_text())
    assert summary["verification"].startswith("stopped: ") and "CRC mismatch" in summary["verification"]
    assert "verified" not in summary


def test_cli_verify_says_why_it_skipped_and_exits_0(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from kit.__main__ import main

    args = ["convert", "--source", str(tiny_llama_dir), "--verify", "--no-progress"]
    assert main([*args, "--target", str(tmp_path / "a")]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["logits_check"]["passed"] is True
    assert "now the logits check" in out.err
    _short_of_memory(monkeypatch)
    assert main([*args, "--target", str(tmp_path / "b")]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["logits_check"]["passed"] is None
    assert [ln for ln in out.err.splitlines() if ln.startswith("logits check skipped: ")]


# ---- under real memory limits, on a model whose fp32 copy is far larger than one layer ---------------------------

# The child imports what the check imports before measuring, so the figures are the check's own; it moves itself
# into the memory cgroup (when given) after that, so the limit applies to the check alone.
_CHILD = """
import json, os, re, sys
from pathlib import Path
import pandas, torch, transformers.models.llama.modeling_llama  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
from kit.convert import verify

def status(field):
    return int(re.search(field + r":\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) * 1024

hf, meg, what, procs = sys.argv[1:5]
if procs:
    Path(procs).write_text(str(os.getpid()))
Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
before = status("VmRSS")
if what == "logits":
    r = verify.logits_check(hf, meg)
    out = {k: r[k] for k in ("passed", "memory_needed", "max_abs_diff")}
else:
    v = verify.verify_conversion(hf, meg, back_to_hf=False)
    out = {"passed": v["passed"], "skipped": v["skipped"], "checks": v["table"].to_dict("records")}
out["added"] = status("VmHWM") - before
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def layered_model(tmp_path_factory):
    """A 64-layer bf16 Llama (442 MB; 886 MB in fp32, 12 MB a layer) converted to TP2: (hf, megatron, fp32 bytes)."""
    root = tmp_path_factory.mktemp("layered")
    hf = synthetic_checkpoint(
        root / "hf", "llama", hidden_size=512, num_layers=64, num_heads=8, num_groups=4, ffn_hidden_size=1408,
        vocab_size=32000, dtype="bfloat16", max_shard_mb=256, with_tokenizer=False,
    )  # fmt: skip
    hf_to_megatron(ConvertConfig(str(hf), str(root / "meg"), tp=2), progress=False)
    reader = HFReader(hf)
    fp32 = sum(4 * _numel(reader.shape(k)) for k in reader.keys())
    return hf, root / "meg", fp32


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _child(model, what: str, procs: str = "") -> subprocess.CompletedProcess:
    hf, meg, _ = model
    env = dict(os.environ, PYTHONPATH=str(repo_root()))
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(hf), str(meg), what, procs],
        capture_output=True, text=True, env=env, cwd=repo_root(), timeout=600,
    )  # fmt: skip


@pytest.fixture
def memory_cgroup():
    """make(limit_bytes) -> the cgroup.procs file of a fresh memory cgroup (v2 or v1) under this process's own, with
    that limit; removed after. Skipped with the reason where this machine does not let the test make one."""
    made = []

    def make(limit: int) -> str:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = [ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":")[1].split(",")]
        base, limit_file = (
            (Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/"), "memory.limit_in_bytes")
            if v1
            else (Path("/sys/fs/cgroup") / lines[-1].split(":", 2)[2].lstrip("/"), "memory.max")
        )
        folder = base / f"kit-test-{os.getpid()}-{len(made)}"
        try:
            folder.mkdir()
            made.append(folder)
            (folder / limit_file).write_text(str(limit))
        except OSError as exc:
            pytest.skip(f"cannot make a memory cgroup under {base}: {exc}")
        return str(folder / "cgroup.procs")

    yield make
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            pass


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"  # -9: killed by the limit
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
def test_logits_check_peak_memory_is_a_layer_not_the_model(layered_model):
    """Peak RSS the check adds stays within its own estimate and far below the model in fp32 (which
    from_pretrained(fp32) held: 1.2 GB added for this model before)."""
    r = _result(_child(layered_model, "logits"))
    fp32 = layered_model[2]
    assert r["passed"] and r["max_abs_diff"] <= 1e-4
    assert r["added"] <= r["memory_needed"] < fp32
    assert r["added"] < fp32 / 3, (r["added"] / MiB, fp32 / MiB)


@pytest.mark.slow
def test_verification_under_a_memory_limit_completes_or_skips_in_one_line(layered_model, memory_cgroup):
    """In a memory cgroup below the model's fp32 size (and below its bf16 rank files, mapped twice) but above the
    check's estimate, every check runs and passes; below the estimate the logits check is skipped with one line,
    and the rank-file check still passes. Never killed."""
    fp32 = layered_model[2]
    limit = 600 * MiB
    assert limit < 0.75 * fp32
    r = _result(_child(layered_model, "verify", memory_cgroup(limit)))
    assert r["passed"] is True and r["skipped"] == [], r
    assert r["checks"][-2]["value"] <= 1e-4  # max |logits - HF|
    low = _child(layered_model, "verify", memory_cgroup(300 * MiB))
    r = _result(low)
    assert r["passed"] is None and len(r["skipped"]) == 1, r
    assert (
        low.stdout.splitlines()[0] == r["skipped"][0] and "memory limit 0.3 GiB of cgroup" in r["skipped"][0]
    )
    assert [c["passed"] for c in r["checks"]] == [True, True, True, True, None]
