"""parity_report: every op's NPU branch (stand-in) agrees with float64; the `adapt` CLI runs both commands."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from npu_standin import install, ops

from kit.adapt import cli
from kit.ops.parity import parity_report


def _parse(*argv):
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="stage"))
    return parser.parse_args(["adapt", *argv])


def test_parity_report_on_npu_branch_calls_every_kernel(monkeypatch):
    install(monkeypatch)
    rows = parity_report(device="cpu", dtype=torch.float32, backend="npu")
    assert len(rows) == 14 and all(r["backend"] == "npu" for r in rows)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    called = {name for name, _ in ops.CALLS}
    assert called == {
        "npu_fusion_attention",
        "npu_rms_norm",
        "npu_rotary_mul",
        "npu_swiglu",
        "npu_fast_gelu",
        "npu_scaled_masked_softmax",
    }
    attention = [args for name, args in ops.CALLS if name == "npu_fusion_attention"]
    assert any(
        a["sparse_mode"] == 4 and a["next_tockens"] == -2 and a["inner_precise"] == 2 for a in attention
    )
    # explicit masks (2 cases) always get 2: whether a row is fully masked is not known without a host sync
    assert sum(a["inner_precise"] == 2 for a in attention) == 3
    rotary = {args["rotary_mode"] for name, args in ops.CALLS if name == "npu_rotary_mul"}
    assert rotary == {"half", "interleave"}


def test_parity_report_bf16_portable():
    rows = parity_report(device="cpu", dtype=torch.bfloat16)
    assert all(r["ok"] and r["backend"] == "torch" and r["max_rel_err"] > 0 for r in rows)


def test_cli_parity_writes_json(tmp_path, capsys):
    args = _parse("parity", "--json", str(tmp_path / "parity.json"))
    assert args.func(args) == 0
    rows = json.loads((tmp_path / "parity.json").read_text())
    assert len(rows) == 14 and "attention TND varlen causal" in capsys.readouterr().out


def test_cli_fix_remote_code(tmp_path, capsys):
    folder = shutil.copytree(
        Path(__file__).parent / "fixtures" / "remote_code" / "baichuan_tokenizer", tmp_path / "bc"
    )
    args = _parse("fix-remote-code", str(folder), "--dry-run")
    assert args.func(args) == 0 and "would apply" in capsys.readouterr().out
    args = _parse("fix-remote-code", str(folder))
    assert args.func(args) == 0 and "applied" in capsys.readouterr().out
    assert (Path(folder) / "tokenization_baichuan.py.kit-orig").exists()
