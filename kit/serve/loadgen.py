"""The load generator: streamed /v1/completions requests in a closed loop (N in flight) or an open loop (Poisson).

Written here rather than driving GuideLLM or AIPerf: both would change the dev stack's core packages (GuideLLM 0.8.1
pins click and multidict below ours, AIPerf 0.13.0 pandas, huggingface_hub, rich and pillow; checked with
`pip install --dry-run`). benchmarks/bench_serve.py compares its figures with GuideLLM's on one server.
Each request records timestamps where GuideLLM 0.8.1 takes them (guidellm/backends/openai/http.py,
`_resolve_streaming`): `start` when the request headers are written (httpcore's trace event, as GuideLLM's
`_trace_request_start`), one per streamed line that carries text (taken before the line is parsed), `end` once the
stream is closed; token counts are the server's `usage`. The figures are derived in kit/serve/loadtest.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

_clock = time.perf_counter


@dataclass
class RequestRecord:
    """One request as the client saw it: timestamps (perf_counter seconds) and the server's `usage` counts."""

    ok: bool = False
    start: float = 0.0
    """Request headers written (GuideLLM's `request_start`)."""
    chunk_times: List[float] = field(default_factory=list)
    """Arrival of each streamed line that carried text (GuideLLM's token iterations)."""
    end: float = 0.0
    """Stream closed (GuideLLM's `request_end`)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def first_token(self) -> float:
        return self.chunk_times[0] if self.chunk_times else self.end

    @property
    def last_token(self) -> float:
        return self.chunk_times[-1] if self.chunk_times else self.end

    @property
    def ttft(self) -> float:
        """Headers written -> first text chunk (GuideLLM's time_to_first_token_ms)."""
        return self.first_token - self.start

    @property
    def e2e(self) -> float:
        """Headers written -> stream closed (GuideLLM's request_latency)."""
        return self.end - self.start

    @property
    def itls(self) -> List[float]:
        """Gaps between consecutive text chunks (vLLM's per-chunk ITL)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        """(last text chunk - first) / (output tokens - 1): GuideLLM's inter_token_latency_ms, vLLM's TPOT."""
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.last_token - self.first_token) / (self.output_tokens - 1)


def _trace_headers_sent(rec: RequestRecord):
    """An httpcore trace hook that sets `rec.start` when the request's headers start being written."""
    seen = False

    async def trace(event: str, info: Dict[str, Any]) -> None:
        nonlocal seen
        if seen or not event.endswith(".send_request_headers.started"):
            return
        request = info.get("request")
        if request is not None and request.method == b"CONNECT":  # a proxy tunnel, not our request
            return
        seen = True
        rec.start = _clock()

    return trace


async def send(client, url: str, payload: Dict[str, Any], timeout: float) -> RequestRecord:
    """POST one streamed completion and record its timestamps."""
    rec = RequestRecord()
    rec.start = _clock()  # replaced by the trace hook once the headers go out
    usage = None
    try:
        async with client.stream(
            "POST", url, json=payload, timeout=timeout, extensions={"trace": _trace_headers_sent(rec)}
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
            else:
                async for line in resp.aiter_lines():
                    now = _clock()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        rec.error = str(msg["error"])[:200]
                        break
                    if msg.get("usage"):
                        usage = msg["usage"]
                    text = "".join(c.get("text") or "" for c in msg.get("choices") or [])
                    if text:
                        rec.chunk_times.append(now)
                        rec.text += text
        rec.end = _clock()
    except Exception as exc:  # a failed request is counted, not raised: the load test goes on
        rec.end = _clock()
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        return rec
    if rec.error:
        return rec
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
    else:  # no usage: one token per text chunk, as GuideLLM assumes
        rec.output_tokens = rec.chunks
    rec.ok = rec.chunks > 0
    if not rec.ok:
        rec.error = "no token came back"
    return rec


def span(records: List[RequestRecord]) -> float:
    """Seconds from the first request's start to the last one's end (GuideLLM's benchmark `duration`)."""
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


async def _run(
    url: str,
    payloads: List[dict],
    concurrency: Optional[int],
    rate: Optional[float],
    seed: int,
    timeout: float,
):
    import httpx

    limits = httpx.Limits(
        max_connections=max(len(payloads), 1), max_keepalive_connections=max(len(payloads), 1)
    )
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if rate is None:  # closed loop: `concurrency` workers, each sends its next request when one finishes
            queue: asyncio.Queue = asyncio.Queue()
            for i, p in enumerate(payloads):
                queue.put_nowait((i, p))
            records: List[Optional[RequestRecord]] = [None] * len(payloads)

            async def worker():
                while not queue.empty():
                    i, p = queue.get_nowait()
                    records[i] = await send(client, url, p, timeout)

            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        else:  # open loop: arrivals of a Poisson process, whatever is still in flight
            rng = random.Random(seed)
            tasks = []
            for i, p in enumerate(payloads):
                if i:
                    await asyncio.sleep(rng.expovariate(rate))
                tasks.append(asyncio.ensure_future(send(client, url, p, timeout)))
            records = list(await asyncio.gather(*tasks))
    return records, span(records)


def run_point(
    url: str,
    payloads: List[dict],
    concurrency: Optional[int] = None,
    rate: Optional[float] = None,
    seed: int = 0,
    timeout: float = 300.0,
):
    """(records, duration in s: `span`) of one load point: closed loop at `concurrency` or open loop at `rate` req/s."""
    coro = _run(url, payloads, concurrency, rate, seed, timeout)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # inside a running loop (a Jupyter kernel): the load point gets a loop of its own on a worker thread
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def make_prompts(tokenizer, n: int, length: int, seed: int) -> List[str]:
    """`n` prompts of random ordinary tokens that re-tokenize to about `length` tokens (the server counts them)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids or [])
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    for _ in range(n):
        ids = [rng.choice(vocab) for _ in range(length)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:length]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out
