"""`python -m kit device-check` on CPU: every section runs (torch branch) and one JSON + table come out."""

from __future__ import annotations

import argparse
import json

from kit.doctor import device_check


def test_device_check_on_cpu_writes_one_json_and_a_table(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    device_check.register(parser.add_subparsers(dest="stage"))
    out = tmp_path / "device_check.json"
    args = parser.parse_args(
        ["device-check", "--json", str(out), "--work-dir", str(tmp_path / "work"), "--steps", "3"]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["device"]["kind"] == "cpu"
    rows = {(r["section"], r["name"]): r for r in report["rows"]}
    sections = {r["section"] for r in report["rows"]}
    assert sections == {"ops", "model parity", "data parallel", "adapted training", "profile"}
    ops = [r for r in report["rows"] if r["section"] == "ops"]
    assert len(ops) == 14 and all(
        r["ok"] and "torch on cpu" in r["detail"] for r in ops
    )  # float32 only on CPU
    parity = rows[("model parity", "adapted vs plain logits [float32]")]
    assert parity["ok"] and "2 MLPs" in parity["detail"]
    dp = [r for r in report["rows"] if r["section"] == "data parallel"]
    assert len(dp) == 1 and dp[0]["ok"] is None and "needs 2" in dp[0]["detail"]  # skipped, with the reason
    train = [r for r in report["rows"] if r["section"] == "adapted training"][0]
    first, last = (float(x) for x in train["value"].replace("loss ", "").split(" -> "))
    assert train["ok"] and last < first
    prof = [r for r in report["rows"] if r["section"] == "profile"][0]
    assert prof["ok"] and prof["value"] == "1 trace(s)" and (tmp_path / "work" / "profiles").is_dir()
    assert report["counts"] == {"ok": 14 + 3, "FAIL": 0, "skip": 1}
    text = capsys.readouterr().out
    assert "device check on cpu" in text and "17 ok, 0 failed, 1 skipped" in text


def test_a_broken_section_is_a_failed_row_not_a_crash(tmp_path, monkeypatch):
    from kit.doctor import device_check

    def broken(*args):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(device_check, "_prepare", broken)
    lines = []
    report = device_check.run_device_check(tmp_path / "r.json", tmp_path / "w", echo=lines.append)
    assert not report["ok"]
    failed = [r for r in report["rows"] if r["ok"] is False]
    assert failed == [
        dict(
            section="inputs",
            name="could not run",
            ok=False,
            value="",
            detail="RuntimeError: no kernel for this",
            seconds=failed[0]["seconds"],
        )
    ]
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is False
