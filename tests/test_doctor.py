"""The doctor's report on this machine and on simulated Ascend layouts."""

from __future__ import annotations

import json

from kit import doctor, versions


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
