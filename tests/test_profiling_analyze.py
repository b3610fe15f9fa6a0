"""Ascend profile readers, drift tolerance, the advisor's rules, bad input and comparison, on generated samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

import kit.profiling as kp
from kit.profiling.sample import PLANTED

OUT = "ASCEND_PROFILER_OUTPUT"


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    return kp.write_sample_ascend_profile(tmp_path_factory.mktemp("planted"))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return kp.write_sample_ascend_profile(tmp_path_factory.mktemp("clean"), clean=True)


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst / src.name))


def _edit_csv(path: Path, fn) -> None:
    path.write_text(fn(path.read_text(encoding="utf-8")), encoding="utf-8")


def test_shipped_sample_matches_the_generator(tmp_path):
    shipped = kp.sample_profile_dir()
    assert shipped is not None, (
        "data_samples/ascend_profile_sample is missing; run `python -m kit profile sample`"
    )
    fresh = kp.write_sample_ascend_profile(tmp_path)
    for f in ("kernel_details.csv", "op_statistic.csv", "step_trace_time.csv", "trace_view.json"):
        assert (shipped / OUT / f).read_bytes() == (fresh / OUT / f).read_bytes(), f


def test_sample_finds_exactly_the_planted_problems(planted):
    advice = kp.advise(kp.load(planted))
    assert advice.problems == ["cast", "aicpu", "low_ratio", "block_dim"]
    by_rule = {f.rule: f for f in advice.findings}
    for rule, ops in PLANTED.items():
        assert by_rule[rule].operators == ops, rule
    cast = by_rule["cast"].numbers
    assert 44 < cast["max_us"] < 47 and cast["share_pct"] > 1.0
    assert by_rule["aicpu"].numbers["max_us"] > 1000
    assert by_rule["low_ratio"].numbers["worst_ratio"] < 0.45
    assert by_rule["block_dim"].numbers["min_block_dim"] == 8
    assert {"step_breakdown", "top_operators"} <= set(by_rule)
    assert by_rule["top_operators"].operators[0] == "NonZero"


def test_clean_sample_has_no_problems(clean):
    advice = kp.advise(kp.load(clean))
    assert advice.problems == []
    assert [f.rule for f in advice.findings] == ["step_breakdown", "top_operators"]


def test_operator_table_agrees_with_op_statistic(planted):
    data = kp.load(planted)
    ours = kp.operator_table(data).set_index("type")
    theirs = data.op_statistic.set_index("type")
    assert sorted(ours.index) == sorted(theirs.index)
    assert (ours.loc[theirs.index, "calls"] == theirs["calls"]).all()
    pd.testing.assert_series_equal(
        ours.loc[theirs.index, "total_us"], theirs["total_us"], atol=0.01, check_names=False
    )
    pd.testing.assert_series_equal(
        ours.loc[theirs.index, "share_pct"], theirs["share_pct"], atol=0.01, check_names=False
    )
    by_name = kp.operator_table(data, by="name", sort="max_us")
    assert by_name.iloc[0]["type"] == "NonZero" and by_name.iloc[0]["core"] == "AI_CPU"


def test_thresholds_change_the_verdict(planted):
    data = kp.load(planted)
    loose = kp.Thresholds(
        cast_max_us=100,
        cast_share_pct=10,
        aicpu_max_us=5000,
        aicpu_share_pct=50,
        unit_ratio=0.4,
        min_op_share_pct=5,
    )
    assert kp.advise(data, loose).problems == []
    with pytest.raises(ValueError, match="unit_ratio=1.5"):
        kp.advise(data, kp.Thresholds(unit_ratio=1.5))


def test_legacy_headers_give_the_same_findings(tmp_path):
    legacy = kp.write_sample_ascend_profile(tmp_path, legacy_headers=True)
    header = (legacy / OUT / "kernel_details.csv").read_text(encoding="utf-8").splitlines()[0]
    assert "Block Dim" in header and "Block Num" not in header and not header.startswith("Step Id")
    data = kp.load(legacy)
    assert data.kernels["block_dim"].notna().all() and data.kernels["step"].isna().all()
    assert kp.advise(data).problems == ["cast", "aicpu", "low_ratio", "block_dim"]


def test_cann_op_summary_names_renamed_ratios_and_trailing_tabs(planted, tmp_path):
    pt = _copy(planted, tmp_path)

    def drift(text: str) -> str:
        head, body = text.split("\n", 1)
        head = (
            head.replace("Name,Type,", "Op Name,OP Type,")
            .replace("Accelerator Core", "Task Type")
            .replace("Duration(us)", "Task Duration(us)")
            .replace("aic_mac_ratio", "aic_cube_ratio")
        )
        # every duration cell gets a trailing tab, as msprof writes numbers for Excel
        rows = [r.split(",") for r in body.strip().split("\n")]
        i = head.split(",").index("Task Duration(us)")
        return head + "\n" + "\n".join(",".join(r[:i] + [r[i] + "\t"] + r[i + 1 :]) for r in rows) + "\n"

    _edit_csv(pt / OUT / "kernel_details.csv", drift)
    data = kp.load(pt)
    assert "aic_cube_ratio" in data.ratio_columns and "aic_mac_ratio" not in data.ratio_columns
    assert data.kernels["dur_us"].dtype == "float64" and data.kernels["dur_us"].notna().all()
    assert kp.advise(data).problems == ["cast", "aicpu", "low_ratio", "block_dim"]


def test_level0_capture_explains_missing_ratios(tmp_path):
    pt = kp.write_sample_ascend_profile(tmp_path, level="Level0")
    assert not (pt / OUT / "op_statistic.csv").exists()
    advice = kp.advise(kp.load(pt))
    assert advice.problems == ["cast", "aicpu", "block_dim"]
    skipped = [f for f in advice.findings if f.severity == "skipped"]
    assert [f.rule for f in skipped] == ["low_ratio"]
    assert "level='Level1'" in skipped[0].fix and "PipeUtilization" in skipped[0].fix


def test_without_core_counts_block_dim_is_skipped_unless_given(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    shutil.rmtree(next(pt.glob("PROF_*")))
    advice = kp.advise(kp.load(pt))
    assert "block_dim" not in advice.problems
    assert any(f.rule == "block_dim" and f.severity == "skipped" for f in advice.findings)
    assert "block_dim" in kp.advise(kp.load(pt), kp.Thresholds(ai_core_num=24, aiv_num=48)).problems


def test_na_cells_and_non_numeric_values_are_counted(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    _edit_csv(pt / OUT / "kernel_details.csv", lambda t: t.replace(",24,0,NO,", ",oops,0,NO,", 3))
    data = kp.load(pt)
    assert any("3 non-numeric value(s) in column 'block_dim'" in n for n in data.notes)
    assert data.kernels["block_dim"].isna().sum() == 3


@pytest.mark.parametrize(
    "case",
    [
        "empty_dir",
        "unparsed",
        "unfinished",
        "no_kernel_files",
        "empty_csv",
        "binary_csv",
        "missing_columns",
        "truncated_trace",
        "list_trace",
    ],
)
def test_bad_input_gives_a_clear_message(planted, tmp_path, case):
    pt = _copy(planted, tmp_path)
    kd = pt / OUT / "kernel_details.csv"
    target, expect = pt, None
    if case == "empty_dir":
        target, expect = tmp_path / "empty", "no profile in"
        target.mkdir()
    elif case == "unparsed":
        shutil.rmtree(pt / OUT)
        expect = "analyse("
    elif case == "unfinished":
        (pt / OUT / "analyse.done").unlink()
        expect = "no analyse.done"
    elif case == "no_kernel_files":
        kd.unlink()
        (pt / OUT / "op_statistic.csv").unlink()
        expect = "msprof"
    elif case == "empty_csv":
        kd.write_text("", encoding="utf-8")
        expect = "is empty"
    elif case == "binary_csv":
        kd.write_bytes(b"\x00\xff\xfe" * 50 + b"\n\x00,\x01\n")
        expect = "kernel_details.csv"
    elif case == "missing_columns":
        kd.write_text("Name,Start Time(us)\nfoo,1.0\n", encoding="utf-8")
        expect = "lacks column(s) ['type', 'core', 'dur_us']"
    elif case == "truncated_trace":
        target = tmp_path / "x.pt.trace.json"
        target.write_text('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1', encoding="utf-8")
        expect = "not a complete JSON trace"
    elif case == "list_trace":
        target = tmp_path / "y.pt.trace.json"
        target.write_text("[]", encoding="utf-8")
        expect = "Ascend trace_view.json"
    with pytest.raises(kp.ProfileError) as err:
        kp.load(target)
    assert expect in str(err.value)


def test_unfinished_can_be_read_on_request_and_truncated_rows_are_reported(planted, tmp_path):
    pt = _copy(planted, tmp_path)
    (pt / OUT / "analyse.done").unlink()
    kd = pt / OUT / "kernel_details.csv"
    text = kd.read_text(encoding="utf-8")
    kd.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 40], encoding="utf-8")  # last row cut short
    data = kp.load(pt, allow_unfinished=True)
    assert any("analyse.done" in n for n in data.notes)
    assert any("ends in the middle of a row" in w for w in data.warnings)
    assert len(data.kernels) == text.count("\n") - 2  # header and the cut row are not kernels
    assert data.rows["kernel_details.csv"]["dropped"] == {"cut off at the end of the file": 1}


def test_load_accepts_every_path_form(planted):
    for p in (planted, planted.parent, planted / OUT, planted / OUT / "trace_view.json"):
        assert kp.load(p).path == planted


def test_advice_saved_as_markdown_html_json(planted, tmp_path):
    advice = kp.advise(kp.load(planted))
    paths = advice.save(tmp_path / "advice")
    doc = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert doc["problems"] == ["cast", "aicpu", "low_ratio", "block_dim"]
    assert doc["top_operators"][0]["type"] == "NonZero"
    assert "PROBLEM - Cast operators" in paths["markdown"].read_text(encoding="utf-8")
    assert "<li><b>PROBLEM" in paths["html"].read_text(encoding="utf-8")
    assert pd.read_csv(paths["operators"])["type"].iloc[0] == "NonZero"
    with pytest.raises(FileExistsError):
        advice.save(tmp_path / "advice")


def test_compare_reports_operator_deltas_and_step_change(planted, clean):
    cmp = kp.compare(planted, clean)
    ops = cmp.operators.set_index("type")
    assert cmp.operators.iloc[0]["type"] == "NonZero"
    assert ops.loc["NonZero", "calls_b"] == 0 and ops.loc["NonZero", "delta_pct"] == -100
    assert ops.loc["Cast", "calls_a"] == 20 and ops.loc["Cast", "calls_b"] == 10
    assert abs(ops.loc["MatMulV2", "delta_pct"]) < 2
    assert -60 < cmp.step_us["change_pct"] < -45
    assert "NonZero" in cmp.summary()


def test_kineto_gpu_kernels_are_grouped_by_launching_op(tmp_path):
    """A CUDA-style trace (built by hand: no GPU here): kernels take the type of the op that launched them."""
    ev = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": f"ProfilerStep#{s}",
            "pid": 1,
            "tid": 1,
            "ts": 1000.0 * s,
            "dur": 900.0,
        }
        for s in (5, 6)
    ]
    for s in (5, 6):
        base = 1000.0 * s
        ev += [
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::mm",
                "pid": 1,
                "tid": 1,
                "ts": base + 10,
                "dur": 50,
                "args": {"External id": s * 10},
            },
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::add",
                "pid": 1,
                "tid": 1,
                "ts": base + 100,
                "dur": 20,
                "args": {"External id": s * 10 + 1},
            },
            # kernels start after the host step ended (asynchronous launch)
            {
                "ph": "X",
                "cat": "kernel",
                "name": "sm90_xmma_gemm",
                "pid": 0,
                "tid": 7,
                "ts": base + 950,
                "dur": 300.0,
                "args": {"External id": s * 10, "device": 0},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "vectorized_elementwise_kernel",
                "pid": 0,
                "tid": 7,
                "ts": base + 1250,
                "dur": 5.0,
                "args": {"External id": s * 10 + 1, "device": 0},
            },
        ]
    path = tmp_path / "gpu.pt.trace.json.gz"
    import gzip

    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": ev}).encode()))
    data = kp.load(path)
    assert set(data.kernels["core"]) == {"GPU"} and sorted(data.kernels["step"].unique()) == [5, 6]
    table = kp.operator_table(data).set_index("type")
    assert list(table.index) == ["aten::mm", "aten::add"]
    assert table.loc["aten::mm", "calls"] == 2 and table.loc["aten::mm", "total_us"] == 600.0
    assert table.loc["aten::mm", "name"] == "sm90_xmma_gemm"
    assert kp.mean_step_us(data) == 900.0


def test_na_operator_types_are_explained(planted, tmp_path):
    pt = _copy(planted, tmp_path)

    def blank_types(text: str) -> str:
        lines = text.split("\n")
        i = lines[0].split(",").index("Type")
        out = [lines[0]]
        for ln in lines[1:]:
            cells = ln.split(",")
            if len(cells) > i:
                cells[i] = "N/A"
            out.append(",".join(cells))
        return "\n".join(out)

    _edit_csv(pt / OUT / "kernel_details.csv", blank_types)
    data = kp.load(pt)
    assert any("Type is N/A on 100% of the rows" in n for n in data.notes)
    assert "cast" not in kp.advise(data).problems  # nothing is named Cast any more, and the note says why
