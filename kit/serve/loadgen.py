"""The load generator: streamed /v1/completions requests in a closed loop (N in flight) or an open loop (Poisson).

Written here rather than driving GuideLLM or AIPerf: both would change the dev stack's core packages (GuideLLM 0.8.1
pins click and multidict below ours, AIPerf 0.13.0 pandas, huggingface_hub, rich and pillow; checked with
`pip install --dry-run`), and this client reports the server's own token
counts per request. benchmarks/bench_serve.py compares its figures with GuideLLM's on one server.
Timing as vLLM's `benchmark_serving` defines it: TTFT = send -> first streamed token, ITL = gaps between streamed
chunks, TPOT = (E2E - TTFT) / (output tokens - 1), E2E = send -> last byte.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class RequestRecord:
    """One request as the client saw it; token counts are the server's `usage`."""

    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itls: List[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def send(client, url: str, payload: Dict[str, Any], timeout: float) -> RequestRecord:
    """POST one streamed completion and time it."""
    rec = RequestRecord()
    t0 = time.perf_counter()
    last = t0
    usage = None
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    rec.error = str(msg["error"])[:200]
                    return rec
                if msg.get("usage"):
                    usage = msg["usage"]
                text = "".join(c.get("text") or "" for c in msg.get("choices") or [])
                if text:
                    now = time.perf_counter()
                    if rec.chunks == 0:
                        rec.ttft = now - t0
                    else:
                        rec.itls.append(now - last)
                    last = now
                    rec.chunks += 1
                    rec.text += text
        rec.e2e = time.perf_counter() - t0
    except Exception as exc:  # a failed request is counted, not raised: the load test goes on
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        return rec
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
    else:
        rec.output_tokens = rec.chunks
    rec.ok = rec.chunks > 0
    if not rec.ok:
        rec.error = "no token came back"
    return rec


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
        t0 = time.perf_counter()
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
        duration = time.perf_counter() - t0
    return records, duration


def run_point(
    url: str,
    payloads: List[dict],
    concurrency: Optional[int] = None,
    rate: Optional[float] = None,
    seed: int = 0,
    timeout: float = 300.0,
):
    """(records, duration in s) of one load point: closed loop at `concurrency` or open loop at `rate` req/s."""
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
