"""06's speed plot (kit.evaluate.speed): base and trained as bars from zero, each pair judged against the repeats'
noise; checked on the figure's own data."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kit.evaluate.speed import benchmark, compare, speed_figure


def _table(ttft_trained=(105.0, 300.0), memory_trained=700.01, memory_spread=0.5, spread=1.1):
    rows = []
    for model in ("base", "trained"):
        for k, batch in enumerate((1, 2)):
            rows.append(
                {
                    "model": model,
                    "prompt_len": 16,
                    "batch": batch,
                    "ttft_ms": ttft_trained[k] if model == "trained" else 100.0 * batch,
                    "decode_tokens_per_s": 50.0 * batch,
                    "memory_mb": memory_trained if model == "trained" else 700.0,
                    "memory_kind": "RSS",
                    "ttft_spread": spread,
                    "decode_spread": spread,
                    "memory_spread_mb": memory_spread,
                }
            )
    return pd.DataFrame(rows)


def test_each_difference_is_judged_against_the_repeats_noise():
    rows = {(r["batch"], r["metric"]): r for r in compare(_table())}
    assert rows[(1, "ttft_ms")]["change"] == pytest.approx(1.05) and rows[(1, "ttft_ms")]["within"]
    assert rows[(2, "ttft_ms")]["change"] == pytest.approx(1.5) and rows[(2, "ttft_ms")]["within"] is False
    assert rows[(1, "decode_tokens_per_s")]["within"]
    mem = rows[(1, "memory_mb")]
    assert mem["change"] == pytest.approx(0.01) and mem["noise"] == 0.5 and mem["within"]
    one = compare(_table(spread=math.nan, memory_spread=math.nan))
    assert {r["within"] for r in one} == {None}  # one repeat: no noise to judge against
    assert compare(_table()[lambda t: t["model"] == "base"]) == []


def _value_labels(ax, container):
    """The value labels bar_label put on `container`'s bars (texts placed at the bars' x)."""
    xs = [b.get_x() + b.get_width() / 2 for b in container]
    return [t for t in ax.texts if any(abs(t.xy[0] - x) < 1e-9 for x in xs)]


def test_bars_from_zero_with_values_and_noise_flags():
    fig = speed_figure(_table(memory_spread=0.0), "t")
    ttft, decode, memory = fig.axes[:3]
    heights = [[b.get_height() for b in c] for c in ttft.containers]
    assert heights == [[100.0, 200.0], [105.0, 300.0]]  # base, trained
    assert [c.get_label() for c in ttft.containers] == ["base", "trained"]
    flags = [t.get_text() for t in ttft.texts if t.get_text() in ("within noise", "trained 1.5x")]
    assert flags == ["within noise", "trained 1.5x"]
    # 0.01 MiB apart on an axis from zero: the bars look equal; the flag says the difference
    assert memory.get_ylim()[0] == 0 and memory.get_ylim()[1] == pytest.approx(700.01 * 1.25)
    assert "+0.01 MiB" in [t.get_text() for t in memory.texts]
    assert memory.get_ylabel() == "memory (MiB, RSS)"
    for ax in (ttft, decode, memory):
        assert ax.get_ylim()[0] == 0
    labels = [t.get_text() for c in decode.containers for t in _value_labels(decode, c)]
    assert labels == ["50", "100", "50", "100"]


def test_benchmark_measures_the_noise_of_every_figure(tiny_llama_dir):
    from kit.system.hf_compat import load_causal_lm

    model = load_causal_lm(tiny_llama_dir).eval()
    vocab = model.config.vocab_size
    (two,) = benchmark(model, [1], [8], decode_tokens=2, vocab=vocab, repeats=2)
    assert two["ttft_spread"] >= 1 and two["decode_spread"] >= 1 and two["memory_spread_mb"] >= 0
    (one,) = benchmark(model, [1], [8], decode_tokens=2, vocab=vocab, repeats=1)
    assert (
        math.isnan(one["ttft_spread"])
        and math.isnan(one["decode_spread"])
        and math.isnan(one["memory_spread_mb"])
    )
