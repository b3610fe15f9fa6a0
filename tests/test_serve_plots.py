"""The load test's figure (kit.serve.plots): latency percentiles against concurrency and request rate, from zero,
every point labelled with its value; checked on the figure's own data."""

from __future__ import annotations

import pytest

from kit.serve.plots import load_figure, plot_load


def _point(load, x, base, valid=True, n_in=32, n_out=8):
    conc, rate = (x, None) if load == "concurrency" else (None, x)
    p = {"load": load, "max_concurrency": conc, "request_rate": rate, "input_len": n_in, "output_len": n_out}
    p["valid"] = valid
    for k, stat in enumerate(("median", "p90", "p99")):
        p[f"{stat}_ttft_ms"] = base + k
        p[f"{stat}_e2el_ms"] = 10 * base + k
    p["output_throughput"] = 100.0 / base
    return p


POINTS = [
    _point("concurrency", 2, 200.0),  # out of order: plotted by increasing load
    _point("concurrency", 1, 100.0),
    _point("poisson", 4.0, 300.0),
    _point("poisson", 1.5, 150.0),
    _point("poisson", 8.0, float("nan"), valid=False),  # no request completed: not drawn
]


def _lines(ax):
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}


def test_latency_percentiles_against_concurrency_and_request_rate():
    fig = load_figure(POINTS, "t")
    axes = fig.axes
    assert len(axes) == 6  # rows TTFT, E2E, throughput x columns concurrency, rate
    ttft_c, ttft_r, e2e_c, e2e_r, tput_c, tput_r = axes
    assert _lines(ttft_c) == {"p50": ([1, 2], [100.0, 200.0]), "p90": ([1, 2], [101.0, 201.0]),
                              "p99": ([1, 2], [102.0, 202.0])}  # fmt: skip
    assert _lines(e2e_r)["p99"] == ([1.5, 4.0], [1502.0, 3002.0])
    assert _lines(tput_c) == {"output tokens/s": ([1, 2], [1.0, 0.5])}
    assert ttft_c.get_xlabel().startswith("requests in flight") and ttft_r.get_xlabel().startswith(
        "request rate"
    )
    assert e2e_c.get_ylabel() == "end-to-end latency (ms)"
    for ax in axes:  # both axes from zero: small differences are not blown up
        assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0
    # the ticks are the loads measured (the invalid rate included: it was asked for), each point says its value
    assert [t.get_text() for t in ttft_r.get_xticklabels()] == ["0", "1.5", "4", "8"]
    assert sorted(t.get_text() for t in ttft_c.texts) == ["100", "101", "102", "200", "201", "202"]
    assert sorted(t.get_text() for t in tput_c.texts) == ["0.5", "1.0"]
    # equal percentiles of a point (few requests) are labelled once
    same = dict(POINTS[1], p90_ttft_ms=102.0)
    assert sorted(t.get_text() for t in load_figure([same]).axes[0].texts) == ["100", "102"]


def test_only_the_loads_that_ran_get_a_column_and_several_lengths_a_legend_each(tmp_path):
    points = [_point("concurrency", 1, 50.0), _point("concurrency", 1, 80.0, n_in=64)]
    fig = load_figure(points)
    assert len(fig.axes) == 3
    assert sorted(_lines(fig.axes[0])) == sorted(
        f"{p}, {n} in / 8 out" for p in ("p50", "p90", "p99") for n in (32, 64)
    )
    png = plot_load(points, tmp_path / "load.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        load_figure([])
