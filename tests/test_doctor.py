"""The doctor's report on this machine and on simulated Ascend layouts."""

from __future__ import annotations

import json

from kit.doctor import report as doctor
from kit.system import versions


def test_report_on_this_cpu_machine(tmp_path):
    report = doctor.diagnose(roots=[str(tmp_path / "noascend")], npu_smi="npu-smi-absent")
    assert report.ok, str(report)
    assert report.get("torch_npu").status == "info"
    assert report.get("CANN").status == "info"
    assert report.get("driver").status == "info"
    assert report.device["kind"] == "cpu" and report.device["backend"] == "gloo"
    assert "no accelerator" in report.get("device").detail
    assert report.get("dtype").detail.startswith("float32")
    assert report.get("deepspeed").status == "pass" and "'cpu'" in report.get("deepspeed").detail
    data = json.loads(report.to_json(tmp_path / "r.json").read_text())
    assert data["device"]["kind"] == "cpu" and data["counts"]["fail"] == 0
    assert "<table" in report._repr_html_() and list(report.table().columns) == [
        "status",
        "check",
        "detail",
        "fix",
    ]


def _fake_ascend(tmp_path, version="8.0.RC1"):
    root = tmp_path / "Ascend"
    tk = root / "ascend-toolkit"
    (tk / "latest" / "x86_64-linux").mkdir(parents=True)
    (tk / "set_env.sh").write_text("export ASCEND_HOME_PATH=/x\n")
    (tk / "latest" / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
        f"package_name=x\nversion={version}\n"
    )
    return root


def test_kernel_without_cann_environment_fails_with_fix(tmp_path):
    root = _fake_ascend(tmp_path)
    report = doctor.diagnose(
        env={"PATH": "/usr/bin"}, roots=[str(root)], npu_smi="npu-smi-absent", deepspeed=False
    )
    cann, env = report.get("CANN"), report.get("CANN env")
    assert cann.status == "pass" and "8.0.RC1" in cann.detail
    assert env.status == "fail" and "ASCEND_HOME_PATH" in env.detail and "set_env.sh" in env.fix
    # torch_npu is not installed on a machine that has CANN: that is a failure with the install hint
    assert report.get("torch_npu").status == "fail"
    assert not report.ok


def test_kernel_with_cann_environment_passes(tmp_path):
    root = _fake_ascend(tmp_path)
    env = {
        "ASCEND_HOME_PATH": str(root / "ascend-toolkit/latest"),
        "ASCEND_OPP_PATH": str(root / "opp"),
        "LD_LIBRARY_PATH": f"{root}/ascend-toolkit/latest/lib64:/usr/lib",
    }
    report = doctor.diagnose(env=env, roots=[str(root)], npu_smi="npu-smi-absent", deepspeed=False)
    assert report.get("CANN env").status == "pass"


def test_version_pairing_rules():
    assert versions.torch_npu_pairs("2.1.0+cpu", "2.1.0.post12")
    assert not versions.torch_npu_pairs("2.5.1", "2.1.0.post12")
    assert versions.cann_matches("8.1.RC1", "2.1.0.post12") is True
    assert versions.cann_matches("8.0.RC1.alpha002", "2.1.0.post4") is True
    assert versions.cann_matches("8.2.RC1", "2.4.0.post4") is False
    assert versions.cann_matches("9.1.3", "2.9.0.post8") is True  # the "9.1.X" row
    assert versions.cann_matches("9.9.9", "2.99.0") is None
    assert versions.python_supported("2.6.0", "3.12") is False
    assert versions.python_supported("2.1.0", "3.9.18") is True


def test_versions_below_a_stages_needs_warn_and_name_the_stage(tmp_path):
    report = doctor.diagnose(
        roots=[str(tmp_path / "noascend")],
        npu_smi="npu-smi-absent",
        installed={
            "transformers": "4.40.2",
            "peft": "0.10.0",
            "deepspeed": "0.13.1",
            "torch": "2.0.1",
            "pyarrow": None,
        },
    )
    tf = report.get("transformers")
    assert tf.status == "warn" and "4.40.2 is older than 4.44" in tf.detail
    assert all(
        s in tf.detail for s in ("02 data prep", "03 weight conversion", "04 training", "05 profiling")
    )
    assert "transformers>=4.44" in tf.fix
    peft = report.get("peft")
    assert peft.status == "warn" and "04 training" in peft.detail and "02 data prep" not in peft.detail
    assert report.get("pyarrow").status == "warn" and "not installed" in report.get("pyarrow").detail
    assert report.get("torch").status == "warn" and "older than 2.1" in report.get("torch").detail
    assert report.get("deepspeed").status == "warn" and "older than 0.14.4" in report.get("deepspeed").detail
    assert report.get("datasets").status == "pass" and report.ok  # warnings, not failures


def test_stage_needs_are_the_pyproject_floors_and_the_oldest_tested_stack():
    """One set of numbers: STAGE_NEEDS, pyproject.toml's floors and envs/compat/py39-torch21.txt agree."""
    import re

    from kit.core.workspace import repo_root

    root = repo_root()
    pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    floors = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)', pyproject))
    pins = dict(
        re.findall(
            r"^([A-Za-z0-9_.-]+)==([0-9.]+)", (root / "envs/compat/py39-torch21.txt").read_text(), re.M
        )
    )
    for pkg in versions.needed_packages():
        need = max((n[pkg] for n in versions.STAGE_NEEDS.values() if pkg in n), key=versions._key)
        assert versions._key(floors[pkg]) == versions._key(need), pkg
        assert versions._key(pins[pkg]) >= versions._key(need), pkg
        assert versions.below_needs(pkg, pins[pkg]) == (None, ())
    assert versions.below_needs("peft", "0.11.1") == ("0.12", ("04 training",))
    assert versions.below_needs("transformers", "4.44.2") == (None, ())


def test_summary_and_cli_options_from_doctor_config(tmp_path, capsys):
    import argparse

    report = doctor.diagnose(roots=[str(tmp_path / "noascend")], npu_smi="npu-smi-absent", deepspeed=False)
    assert report.summary()["report"] is None  # not written yet
    path = report.to_json(tmp_path / "doctor.json")
    summary = report.summary()
    assert summary == {
        "ok": report.ok,
        "counts": report.counts,
        "device": report.device["kind"],
        "backend": report.device["backend"],
        "report": str(path),
    }
    parser = argparse.ArgumentParser()
    doctor.register(parser.add_subparsers(dest="stage"))
    args = parser.parse_args(["doctor", "--no-check-deepspeed", "--explain", "x"])
    assert args.check_deepspeed is False and args.explain_error == "x"
    assert not hasattr(parser.parse_args(["doctor"]), "check_deepspeed")  # absent unless typed
