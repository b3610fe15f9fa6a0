"""Damaged and hostile profile input: every case is reported (warning + row counts) or a one-line error, and no
figure the advisor prints is impossible (negative ratios, shares above 100%)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kit.profiling as kp
from kit.__main__ import main

OUT = "ASCEND_PROFILER_OUTPUT"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    return kp.write_sample_ascend_profile(tmp_path_factory.mktemp("planted"))


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst / src.name))


def _rows(path: Path) -> list:
    return path.read_text(encoding="utf-8").split("\n")


def _set_column(path: Path, column: str, fn) -> None:
    """Rewrite one column of a profiler CSV: cell -> fn(row_index, cell)."""
    import csv
    import io

    rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
    i = rows[0].index(column)
    for n, row in enumerate(rows[1:]):
        row[i] = fn(n, row[i])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    path.write_text(buf.getvalue(), encoding="utf-8")


def _sane(advice) -> None:
    """No finding carries an impossible number."""
    for f in advice.findings:
        for key, v in f.numbers.items():
            if key.endswith("_pct"):
                assert 0.0 <= v <= 100.0, (f.rule, key, v)
            if key.endswith("ratio"):
                assert 0.0 <= v <= 1.0, (f.rule, key, v)
    t = advice.operators
    assert (t["total_us"] >= 0).all() and t["share_pct"].between(0, 100).all()


def test_kernel_details_cut_mid_row_is_reported_with_counts(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    kd = pt / OUT / "kernel_details.csv"
    text = kd.read_text(encoding="utf-8")
    n_rows = text.count("\n") - 1  # 225 kernels
    kd.write_text(
        text[: text.rindex("\n", 0, len(text) - 1) + 40], encoding="utf-8"
    )  # the last row cut short
    data = kp.load(pt)
    assert any("ends in the middle of a row" in w and "truncated" in w for w in data.warnings)
    assert data.rows["kernel_details.csv"] == {
        "read": n_rows,
        "used": n_rows - 1,
        "dropped": {"cut off at the end of the file": 1},
    }
    assert len(data.kernels) == n_rows - 1
    advice = kp.advise(data)
    assert advice.findings[0].rule == "input" and advice.findings[0].severity == "warning"
    assert advice.problems == ["cast", "aicpu", "low_ratio", "block_dim"]  # the rest still analysed
    md = advice.to_markdown()
    assert "## Damaged or invalid input" in md and f"read {n_rows} row(s), used {n_rows - 1}, dropped 1" in md
    doc = advice.to_json()
    assert doc["rows"]["kernel_details.csv"]["dropped"] == {"cut off at the end of the file": 1}
    assert doc["warnings"] == data.warnings


def test_cut_inside_a_quoted_cell_is_read_up_to_the_last_complete_row(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    kd = pt / OUT / "kernel_details.csv"
    text = kd.read_text(encoding="utf-8")
    last = text.rindex("\n", 0, len(text) - 1) + 1
    kd.write_text(text[: text.index('"4,128', last) + 4], encoding="utf-8")  # inside "4,128,576"
    data = kp.load(pt)
    assert any("ends in the middle of a row" in w for w in data.warnings)
    assert data.rows["kernel_details.csv"]["used"] == text.count("\n") - 2


def test_kernel_details_cut_at_a_row_boundary_is_caught_by_cross_checks(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    kd = pt / OUT / "kernel_details.csv"
    lines = _rows(kd)
    kd.write_text("\n".join(lines[:101]) + "\n", encoding="utf-8")  # header + 100 of 225 rows: steps 3-5 lost
    data = kp.load(pt)
    assert any("op_statistic.csv counts 225" in w and "125 are missing" in w for w in data.warnings)
    assert any("lists step(s) [4, 5]" in w for w in data.warnings)
    assert kp.advise(data).findings[0].rule == "input"


def test_header_cut_short_is_an_error_naming_the_file(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    kd = pt / OUT / "kernel_details.csv"
    kd.write_text("Step Id,Device_id,Mod", encoding="utf-8")
    with pytest.raises(kp.ProfileError, match="kernel_details.csv is cut inside its header"):
        kp.load(pt)


def test_negative_durations_are_dropped_never_give_impossible_ratios(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    kd = pt / OUT / "kernel_details.csv"
    types = [
        r.split(",")[6] for r in _rows(kd)[1:] if r
    ]  # Step Id, Device_id, Model ID, Task ID, Stream ID, Name, Type
    assert types.count("BatchMatMulV2") == 10
    hit = [n for n, t in enumerate(types) if t == "BatchMatMulV2"][:9]  # 9 of its 10 launches: their sum < 0
    _set_column(kd, "Duration(us)", lambda n, c: "-" + c if n in hit else c)
    data = kp.load(pt)
    assert data.rows["kernel_details.csv"]["dropped"] == {"negative duration": 9}
    assert (data.kernels["dur_us"] >= 0).all()
    assert any("9 negative duration" in w for w in data.warnings)
    advice = kp.advise(data)
    _sane(advice)


def test_non_numeric_step_trace_cells_never_make_a_free_share_problem(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    st = pt / OUT / "step_trace_time.csv"
    _set_column(st, "Computing", lambda n, c: "abc" if n < 3 else c)
    data = kp.load(pt)
    assert list(data.step_trace["step"]) == [4, 5]
    assert data.rows["step_trace_time.csv"]["dropped"] == {"missing or non-numeric Computing/Free": 3}
    assert any("3 of 5 step row(s) dropped" in w for w in data.warnings)
    advice = kp.advise(data)
    assert "free" not in advice.problems
    br = next(f for f in advice.findings if f.rule == "step_breakdown").numbers
    assert sum(br.values()) == pytest.approx(100.0) and br["free_pct"] < 5
    _sane(advice)


def test_na_cells_are_counted_and_reported(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    _set_column(pt / OUT / "kernel_details.csv", "Duration(us)", lambda n, c: "N/A" if n % 50 == 0 else c)
    _set_column(pt / OUT / "step_trace_time.csv", "Communication(Not Overlapped)", lambda n, c: "N/A")
    data = kp.load(pt)
    assert data.rows["kernel_details.csv"]["dropped"] == {"no duration (N/A or empty)": 5}
    assert any("5 of 225 row(s) dropped: 5 no duration" in w for w in data.warnings)
    assert any("N/A or not a number on 5 step row(s), read as 0" in w for w in data.warnings)
    assert len(data.step_trace) == 5


def test_out_of_range_ratios_and_block_dims_are_read_as_missing(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    _set_column(pt / OUT / "kernel_details.csv", "aic_mac_ratio", lambda n, c: "7.5" if n < 4 else c)
    _set_column(pt / OUT / "kernel_details.csv", "Block Num", lambda n, c: "-3" if n < 2 else c)
    data = kp.load(pt)
    assert data.kernels["aic_mac_ratio"].max() <= 1.0 and data.kernels["block_dim"].min() >= 0
    assert any("aic_mac_ratio 4 cell(s)" in w and "block_dim 2 cell(s)" in w for w in data.warnings)


def test_nothing_usable_is_an_error_with_counts(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    _set_column(pt / OUT / "kernel_details.csv", "Duration(us)", lambda n, c: "-1")
    with pytest.raises(
        kp.ProfileError, match=r"no usable kernel row: read 225, dropped 225 \(negative duration\)"
    ):
        kp.load(pt)


def test_corrupt_device_info_is_reported_as_corrupt_not_missing(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    info = next(pt.glob("PROF_*/device_*/info.json*"))
    info.write_text('{"DeviceInfo": [{"id": 0, "ai_core_num": 2', encoding="utf-8")
    data = kp.load(pt)
    assert data.core_counts == {}
    assert any("info.json.0 is corrupt" in w for w in data.warnings)
    skipped = next(f for f in kp.advise(data).findings if f.rule == "block_dim")
    assert skipped.severity == "skipped" and "info.json.0 is corrupt" in skipped.evidence
    assert "missing" not in skipped.evidence


def test_corrupt_profiler_info_is_a_warning_naming_the_file(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    (pt / "profiler_info.json").write_bytes(b"\x00\x01{")
    data = kp.load(pt)
    assert any("profiler_info.json is corrupt" in w for w in data.warnings)


def test_corrupt_capture_json_is_a_warning(planted, tmp_path):
    folder = tmp_path / "20260101-120000-npu"
    pt = _copy(planted, folder)
    (folder / "capture.json").write_text('{"kit_capture": 1, "git_com', encoding="utf-8")
    data = kp.load(folder)
    assert data.path == pt and any("capture.json is corrupt" in w for w in data.warnings)


def test_a_file_of_the_output_folder_loads_its_profile(planted):
    assert kp.load(planted / OUT / "kernel_details.csv").path == planted


@pytest.mark.parametrize("label", ["AICPU", "ai_cpu", "KERNEL_AICPU", "AI CPU"])
def test_ai_cpu_spellings_are_recognised(planted, tmp_path, label):
    pt = _copy(planted, tmp_path)
    for f in ("kernel_details.csv", "op_statistic.csv"):
        p = pt / OUT / f
        p.write_text(p.read_text(encoding="utf-8").replace(",AI_CPU,", f",{label},"), encoding="utf-8")
    data = kp.load(pt)
    assert set(data.kernels["core"].astype(str)) >= {"AI_CPU", "AI_CORE", "AI_VECTOR_CORE"}
    assert set(data.op_statistic["core"]) >= {"AI_CPU"}
    advice = kp.advise(data)
    assert "aicpu" in advice.problems
    assert next(f for f in advice.findings if f.rule == "aicpu").operators == ["NonZero"]
    assert not any("not recognised" in n for n in data.notes)


def test_core_label_normalisation():
    from kit.profiling.ascend import normalize_core, unknown_cores

    assert normalize_core(" AIcore ") == "AI_CORE" and normalize_core("KERNEL_MIX_AIV") == "MIX_AIV"
    assert normalize_core("AIV") == "AI_VECTOR_CORE" and normalize_core("n/a") == "N/A"
    assert unknown_cores(["AI_CPU", "FFTS_PLUS", "DSP_X"]) == ["DSP_X"]


def test_unknown_core_label_is_noted(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    p = pt / OUT / "kernel_details.csv"
    p.write_text(p.read_text(encoding="utf-8").replace(",AI_CPU,", ",DSP_X,"), encoding="utf-8")
    data = kp.load(pt)
    assert any("not recognised: DSP_X (5 rows)" in n for n in data.notes)


def test_kineto_events_with_negative_or_missing_durations_are_dropped_and_counted(tmp_path):
    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 20.0, "dur": -4e11},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": "x", "dur": 1.0},
    ]
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": ev}), encoding="utf-8")
    data = kp.load(path)
    assert list(data.kernels["type"]) == ["aten::mm"]
    assert data.rows["t.pt.trace.json"] == {"read": 3, "used": 1, "dropped": {"invalid ts or dur": 2}}
    assert any("2 of 3 complete event(s) dropped" in w for w in data.warnings)


# ---- command line: one line, exit 2


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cli_bad_threshold_fails_before_reading(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    assert main(["profile", "analyze", str(tmp_path / "nowhere"), "--unit-ratio", "1.5"]) == 2
    err = _one_error_line(capsys)
    assert "unit_ratio=1.5 must be in (0, 1]" in err and "does not exist" not in err


def test_cli_folder_where_a_csv_belongs(planted, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    pt = _copy(planted, tmp_path)
    (pt / OUT / "kernel_details.csv").unlink()
    (pt / OUT / "kernel_details.csv").mkdir()
    assert main(["profile", "analyze", str(pt)]) == 2
    err = _one_error_line(capsys)
    assert "kernel_details.csv is a folder, but a CSV file belongs here" in err
    with pytest.raises(kp.ProfileError, match="is a folder"):
        kp.load(pt)


def test_cli_output_paths_of_the_wrong_kind(planted, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    afile = tmp_path / "afile"
    afile.write_text("x", encoding="utf-8")
    assert main(["profile", "analyze", str(planted), "--out", str(afile)]) == 2
    assert "--out" in _one_error_line(capsys) and afile.read_text(encoding="utf-8") == "x"
    assert main(["profile", "compare", str(planted), str(planted), "--csv", str(tmp_path)]) == 2
    assert "is a folder; give a file name" in _one_error_line(capsys)


def test_cli_prints_warnings_for_damaged_input(planted, tmp_path, capsys):
    pt = _copy(planted, tmp_path)
    kd = pt / OUT / "kernel_details.csv"
    text = kd.read_text(encoding="utf-8")
    kd.write_text(text[:-20], encoding="utf-8")
    assert main(["profile", "analyze", str(pt), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rows"]["kernel_details.csv"]["dropped"] == {
        "cut off at the end of the file": 1
    }
    assert "warning: kernel_details.csv ends in the middle of a row" in captured.err


# ---- start-up: `python -m kit profile --help` loads only the light modules


@pytest.mark.parametrize("argv", [["profile", "--help"], ["profile", "analyze", "--help"]])
def test_profile_help_imports_no_heavy_module(argv):
    code = (
        "import sys\n"
        "from kit.__main__ import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('pandas', 'numpy', 'torch', 'matplotlib', 'transformers')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: python -m kit profile" in out
    assert out.strip().splitlines()[-1] == "HEAVY []"


def test_lazy_package_exports_resolve_to_the_objects():
    import types

    code = "import sys, kit.profiling as kp; print('pandas' in sys.modules, sorted(kp.__all__) == kp.__all__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]
    import kit.profiling.comparison  # noqa: F401  importing a submodule must not shadow a public name

    for name in kp.__all__:
        obj = getattr(kp, name)
        assert not isinstance(obj, types.ModuleType), name
    assert callable(kp.compare) and kp.compare.__module__ == "kit.profiling.comparison"
    with pytest.raises(AttributeError):
        kp.no_such_name  # noqa: B018
