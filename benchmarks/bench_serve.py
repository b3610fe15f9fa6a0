"""Serving: the kit's load generator (kit/serve/loadgen.py) against GuideLLM on the same server and prompts.

One `transformers serve` on a seeded random Llama; the same prompt file (random ordinary tokens, ~32 tokens each) is
sent by both clients as streamed /v1/completions with max_tokens 16, closed loop at each concurrency, in alternating
rounds (kit, then GuideLLM; a figure's ratio is the median of the rounds' ratios). Figures compared (kit / GuideLLM),
each defined as GuideLLM 0.8.1 defines it (docs/serve.md, "Definitions"):
- median TTFT: kit `median_ttft_ms` / GuideLLM `time_to_first_token_ms` median;
- median ITL: kit `median_tpot_ms` (vLLM's name for the figure) / GuideLLM `inter_token_latency_ms` median, both
  (last text chunk - first) / (output tokens - 1) per request;
- output tokens/s: kit `output_throughput` / GuideLLM output tokens (`usage`) over its benchmark `duration`, both
  first request's headers -> last request's end.
Goal within 10 %. GuideLLM runs exactly as a user runs it (GUIDELLM_CMD; `--disable-console` only hides its live
table).

The model is sized so that its per-token time dominates client overhead. The kit's 64-wide, 2-layer test model
answers a token every ~1.5 ms on this kind of 2-core machine; there a Python client's own work shows up as 30-50 % of
TTFT and throughput: GuideLLM hands each request between its scheduler and worker processes (~2.5 ms per request in
closed loop, measured from its own timestamps) and its processes take CPU from the server. The 512-wide, 8-layer model
here (~25 M parameters) takes ~10 ms a token and ~30 ms for the prompt, so the server dominates what is measured. The
server runs with one torch thread (OMP_NUM_THREADS=1, for both clients alike), so a client never competes with the
server's second compute thread. Other work on the same cores still moves the server's speed between rounds: read
the figures with the load averages printed before and after.

GuideLLM 0.8.1 would downgrade click and multidict in the dev venv, so it runs from a Python of its own:
GUIDELLM_PYTHON (e.g. a venv layered over the dev venv with `pip install guidellm==0.8.1`); without it the rows say
so. Prints `serve | <figure> | <ratio>x | goal 0.9-1.1x | MET/MISSED`, which benchmarks/run_all.py collects.
Run: GUIDELLM_PYTHON=/path/to/python .venv/bin/python benchmarks/bench_serve.py [--quick] [--requests 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GUIDELLM_CMD = (
    "{py} -m guidellm run --backend kind=openai_http,target={url},model={model},request_format=/v1/completions,"
    "max_tokens={out} --profile kind=concurrent,streams={c} --constraint kind=max_requests,count={n} "
    "--data kind=json_file,path={prompts} --tokenizer kind=hf_auto --output kind=json,path={json}"
)
# a model whose per-token time dominates client overhead (see the docstring)
MODEL = dict(
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    intermediate_size=1408,
    max_shard_size="500MB",
)
OUT_TOKENS = 16
FIGURES = (
    ("median_ttft_ms", "median TTFT"),
    ("median_itl_ms", "median ITL (kit TPOT = GuideLLM inter-token latency)"),
    ("output_throughput", "output tokens/s"),
)


def guidellm_point(
    py: str, url: str, model: str, prompts: Path, c: int, n: int, out: int, folder: Path
) -> dict:
    path = folder / f"guidellm_c{c}.json"
    cmd = GUIDELLM_CMD.format(
        py=py, url=url, model=model, out=out, c=c, n=n, prompts=prompts, json=path
    ).split()
    subprocess.run(cmd + ["--disable-console"], check=True, capture_output=True, text=True, timeout=900)
    b = json.loads(path.read_text())["benchmarks"][0]
    m = b["metrics"]
    ok = m["output_token_count"]["successful"]
    return {
        "completed": ok["count"],
        "output_tokens": ok["total_sum"],
        "median_ttft_ms": m["time_to_first_token_ms"]["successful"]["median"],
        "median_itl_ms": m["inter_token_latency_ms"]["successful"]["median"],
        "output_throughput": ok["total_sum"] / b["duration"],
    }


def kit_point(url: str, model: str, prompts: list, c: int, out: int) -> dict:
    from kit.serve.loadgen import run_point
    from kit.serve.loadtest import completion_payloads, point_metrics

    records, duration = run_point(
        url + "/v1/completions", completion_payloads(model, prompts, out), concurrency=c
    )
    m = point_metrics(records, duration, 1e9, 1e9)
    return {
        "completed": m["completed"],
        "output_tokens": m["total_output_tokens"],
        "median_ttft_ms": m["median_ttft_ms"],
        "median_itl_ms": m["median_tpot_ms"],
        "output_throughput": m["output_throughput"],
    }


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short configuration for make bench")
    ap.add_argument("--requests", type=int, default=None, help="requests per point (default 12, --quick 8)")
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument("--repeats", type=int, default=None, help="alternating rounds per point (default 5)")
    args = ap.parse_args()
    n = args.requests or (8 if args.quick else 12)
    repeats = args.repeats or 5
    levels = [int(x) for x in args.concurrency.split(",")]
    py = os.environ.get("GUIDELLM_PYTHON")
    if not py or subprocess.run([py, "-c", "import guidellm"], capture_output=True).returncode != 0:
        for c in levels:
            print(
                f"serve | load generator vs GuideLLM, concurrency {c} | n/a | goal 0.9-1.1x | - | "
                "GUIDELLM_PYTHON unset or without guidellm (pip install guidellm==0.8.1 in a venv of its own)"
            )
        return 0
    from transformers import AutoTokenizer

    from kit.core.samples import tiny_llama
    from kit.core.workspace import get_workspace
    from kit.serve import ServeConfig, serve
    from kit.serve.loadgen import make_prompts

    print(f"  before: {_load()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tiny_llama(tmp / "model", seed=0, **MODEL)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = make_prompts(tok, n + 2, 32, seed=0)
        prompts_file = tmp / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[2:]))
        # the server's torch gets one thread: the engine inherits the environment of its start, GuideLLM does not
        threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            server = serve(ServeConfig(model_path=str(model_dir)), get_workspace(tmp / "ws", model="bench"))
        finally:
            if threads is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = threads
        with server:
            kit_point(server.url, server.model, prompts[:2], 1, OUT_TOKENS)  # warm-up, not counted
            for c in levels:
                rounds = []
                for _ in range(repeats):
                    kit = kit_point(server.url, server.model, prompts[2:], c, OUT_TOKENS)
                    ref = guidellm_point(py, server.url, server.model, prompts_file, c, n, OUT_TOKENS, tmp)
                    rounds.append((kit, ref))
                    print(f"  concurrency {c}: kit {kit}\n  concurrency {c}: GuideLLM {ref}", flush=True)
                baseline = GUIDELLM_CMD.format(
                    py="python",
                    url="URL",
                    model="MODEL",
                    out=OUT_TOKENS,
                    c=c,
                    n=n,
                    prompts="prompts.jsonl",
                    json="out.json",
                )
                for key, what in FIGURES:
                    # each round's ratio pairs two measurements seconds apart: the load drifts less within a round
                    ratio = statistics.median(k[key] / r[key] if r[key] else float("nan") for k, r in rounds)
                    ok = 0.9 <= ratio <= 1.1
                    print(
                        f"serve | load generator vs GuideLLM, concurrency {c}, {what} ({n} requests, "
                        f"median of {repeats} rounds) | {ratio:.2f}x | goal 0.9-1.1x | {'MET' if ok else 'MISSED'}"
                    )
                    print(f"    baseline: {baseline}")
    print(f"  after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
