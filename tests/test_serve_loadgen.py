"""The load generator's figures follow GuideLLM 0.8.1's definitions, asserted on recorded timestamps (no timing).

The references are GuideLLM's guidellm/backends/openai/http.py (where timestamps are taken),
guidellm/schemas/base/request_stats.py (per-request figures), guidellm/benchmark/schemas/metrics.py (which
distribution, which weights) and guidellm/schemas/base/statistics.py (percentiles). No engine is needed: a stub SSE
server on 127.0.0.1 stands in for one where the client itself is tested.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import pytest

from kit.serve.loadgen import RequestRecord, send, span
from kit.serve.loadtest import point_metrics, stats


def _rec(start, chunks, end, out, prompt=10):
    return RequestRecord(
        ok=True, start=start, chunk_times=list(chunks), end=end, output_tokens=out, prompt_tokens=prompt
    )


def test_percentiles_are_the_smallest_value_whose_share_reaches_them():
    s = stats([x / 1000 for x in range(1, 9)], "x")  # 1..8 ms, equal weights
    assert s["median_x_ms"] == pytest.approx(4.0)  # not numpy's 4.5: GuideLLM takes the 4th of 8
    assert s["p90_x_ms"] == pytest.approx(8.0) and s["p99_x_ms"] == pytest.approx(8.0)
    assert s["mean_x_ms"] == pytest.approx(4.5) and s["max_x_ms"] == pytest.approx(8.0)
    s = stats([x / 1000 for x in range(1, 11)], "x")
    # GuideLLM 0.8.1's DistributionSummary.from_values gives 5 and 10 here too: nine shares of 0.1 sum below 0.9
    assert (s["median_x_ms"], s["p90_x_ms"]) == (pytest.approx(5.0), pytest.approx(10.0))
    # weights: one value with 10 of 12 shares is the median, and a weight 0 drops a value
    w = stats([0.010, 0.020, 0.030, 0.500], "w", [1, 1, 10, 0])
    assert w["median_w_ms"] == pytest.approx(30.0) and w["max_w_ms"] == pytest.approx(30.0)
    assert w["mean_w_ms"] == pytest.approx((10 + 20 + 300) / 12)


def test_point_figures_are_guidellms_on_recorded_timestamps():
    # start = headers written, chunk_times = text chunks, end = stream closed (seconds)
    records = [
        _rec(0.0, [0.1, 0.2, 0.3], 0.35, out=3),  # TTFT 100 ms, TPOT (0.3-0.1)/2 = 100 ms
        _rec(0.4, [0.45, 0.46], 0.5, out=2),  # TTFT 50 ms, TPOT 10 ms
        _rec(0.5, [0.52] + [0.52 + 0.02 * i for i in range(1, 11)], 0.8, out=11),  # TTFT 20, TPOT 20 ms x 10
        RequestRecord(ok=False, start=0.6, end=1.0, error="HTTP 500: boom"),
    ]
    m = point_metrics(records, span(records), 1e9, 1e9)
    assert m["duration"] == pytest.approx(
        1.0
    )  # first request's start -> last request's end, the failed one too
    assert m["completed"] == 3 and m["failed"] == 1 and m["errors"] == ["HTTP 500: boom"]
    assert m["total_output_tokens"] == 16 and m["output_throughput"] == pytest.approx(16.0)
    assert m["total_input_tokens"] == 30 and m["total_token_throughput"] == pytest.approx(46.0)
    assert m["ttfts"] == pytest.approx([0.1, 0.05, 0.02]) and m["e2els"] == pytest.approx([0.35, 0.1, 0.3])
    assert m["median_ttft_ms"] == pytest.approx(50.0) and m["median_e2el_ms"] == pytest.approx(300.0)
    # TPOT is per request, weighted by its tokens after the first (2, 1, 10 shares): the median is 20 ms, not 100
    assert m["median_tpot_ms"] == pytest.approx(20.0) and m["max_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx((2 * 100 + 1 * 10 + 10 * 20) / 13)
    # ITL: every gap between text chunks, one value each (2 + 1 + 10 gaps)
    assert m["median_itl_ms"] == pytest.approx(20.0) and m["max_itl_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx((100 + 100 + 10 + 10 * 20) / 13)
    # goodput: TTFT <= 60 ms and TPOT <= 50 ms leaves the 2nd and 3rd requests
    assert point_metrics(records, 1.0, 60.0, 50.0)["request_goodput"] == pytest.approx(2.0)


def test_a_point_where_no_request_completed_is_invalid_not_zero():
    failed = [RequestRecord(ok=False, start=0.0, end=0.5, error="HTTP 404: no model")] * 3
    m = point_metrics(failed, span(failed), 1e9, 1e9)
    assert m["valid"] is False and (m["completed"], m["failed"]) == (0, 3)
    figures = [k for k in m if k.endswith("_ms") or k.endswith("put")]
    assert len(figures) == 4 * 6 + 4 and all(math.isnan(m[k]) for k in figures)
    ok = point_metrics([_rec(0.0, [0.1], 0.2, out=1)], 0.2, 1e9, 1e9)
    assert ok["valid"] is True and ok["output_throughput"] == pytest.approx(5.0)
    assert math.isnan(ok["median_tpot_ms"])  # one token: no time per output token was measured


def test_one_chunk_has_no_tpot_and_usage_wins_over_the_chunk_count():
    one = _rec(0.0, [0.2], 0.25, out=1)
    assert one.tpot is None and one.itls == [] and one.ttft == pytest.approx(0.2)
    bunched = _rec(
        0.0, [0.1, 0.4], 0.5, out=4
    )  # 4 tokens in 2 chunks (the engine held back a partial character)
    assert bunched.tpot == pytest.approx(0.1) and bunched.itls == pytest.approx([0.3])


def _events():
    def chunk(text, **extra):
        return {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text, **extra}]}

    yield chunk("")  # no text: not a token
    yield chunk("Hel")
    yield chunk("lo")
    yield chunk(" you")
    yield {**chunk("", finish_reason="length"), "usage": {"prompt_tokens": 7, "completion_tokens": 4}}


async def _sse_server(events):
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
        )
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        for ev in events:
            writer.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await writer.drain()
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _send(url, monkeypatch):
    import httpx

    import kit.serve.loadgen as lg

    ticks = itertools.count(1)
    monkeypatch.setattr(lg, "_clock", lambda: float(next(ticks)))  # each timestamp is the next integer

    async def go():
        server = await _sse_server(list(_events()))
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient() as client:
            return await send(client, url.format(port=port), {"prompt": "hi", "stream": True}, 30.0)

    return asyncio.run(go())


def test_the_client_records_where_guidellm_takes_its_timestamps(monkeypatch):
    pytest.importorskip("httpx")
    rec = _send("http://127.0.0.1:{port}/v1/completions", monkeypatch)
    assert rec.ok and rec.error == "" and rec.text == "Hello you"
    # tick 1 is the fallback start before the request is built; the trace hook replaced it when the headers went out
    assert rec.start == 2.0
    # one timestamp per text chunk, taken as each line arrives: the empty and the usage-only chunks are not tokens
    assert rec.chunks == 3 and rec.chunk_times == sorted(rec.chunk_times) and rec.chunk_times[0] > rec.start
    assert rec.end > rec.chunk_times[-1]  # after the stream is closed
    assert (rec.prompt_tokens, rec.output_tokens) == (7, 4)  # the server's usage, not the 3 chunks
    assert rec.ttft == rec.chunk_times[0] - rec.start and rec.e2e == rec.end - rec.start
    assert rec.tpot == (rec.chunk_times[-1] - rec.chunk_times[0]) / 3


def test_a_request_that_cannot_connect_is_a_failed_record(monkeypatch):
    pytest.importorskip("httpx")
    from kit.system.procs import free_port

    rec = _send(f"http://127.0.0.1:{free_port()}/v1/completions", monkeypatch)
    assert not rec.ok and rec.error.startswith("ConnectError") and rec.chunks == 0
    assert rec.start == 1.0 and rec.end > rec.start  # no headers went out: the fallback start stays
