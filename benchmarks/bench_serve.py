"""Serving: the kit's load generator (kit/serve/loadgen.py) against GuideLLM on the same server and prompts.

One `transformers serve` on a tiny seeded model; the same prompt file (random ordinary tokens, ~32 tokens each) is
sent by both clients as streamed /v1/completions with max_tokens 16, closed loop at each concurrency. Figures
compared (kit / GuideLLM): median TTFT, median ITL and output throughput (output tokens / wall time of the point),
goal within 10 %. GuideLLM 0.8.1 would downgrade click and multidict in the dev venv, so it runs from a Python of
its own: GUIDELLM_PYTHON (e.g. a venv layered over the dev venv with `pip install guidellm==0.8.1`); without it the
rows say so.

Prints `serve | <figure> | <ratio>x | goal 0.9-1.1x | MET/MISSED`, which benchmarks/run_all.py collects.
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
        "median_ttft_ms": m["time_to_first_token_ms"]["successful"]["median"],
        "median_itl_ms": m["inter_token_latency_ms"]["successful"]["median"],
        "output_throughput": ok["total_sum"] / b["duration"],
    }


def kit_point(url: str, model: str, prompts: list, c: int, out: int) -> dict:
    from kit.serve.loadgen import run_point
    from kit.serve.loadtest import point_metrics

    payloads = [
        {"model": model, "prompt": p, "max_tokens": out, "temperature": 0.0, "stream": True} for p in prompts
    ]
    records, duration = run_point(url + "/v1/completions", payloads, concurrency=c)
    m = point_metrics(records, duration, 1e9, 1e9)
    return {k: m[k] for k in ("completed", "median_ttft_ms", "median_itl_ms", "output_throughput")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short configuration for make bench")
    ap.add_argument("--requests", type=int, default=None, help="requests per point (default 12, --quick 8)")
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument(
        "--repeats", type=int, default=None, help="alternating rounds per point (default 3, --quick 2)"
    )
    args = ap.parse_args()
    n = args.requests or (8 if args.quick else 12)
    repeats = args.repeats or (2 if args.quick else 3)
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

    from kit.samples import tiny_llama
    from kit.serve import ServeConfig, serve
    from kit.serve.loadgen import make_prompts
    from kit.workspace import get_workspace

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = tiny_llama(tmp / "tiny", seed=0)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = make_prompts(tok, n + 2, 32, seed=0)
        prompts_file = tmp / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[2:]))
        with serve(
            ServeConfig(model_path=str(model_dir)), get_workspace(tmp / "ws", model="bench")
        ) as server:
            kit_point(server.url, server.model, prompts[:2], 1, 16)  # warm-up, not counted
            for c in levels:
                # alternating rounds, the median of each figure: the machine's load drifts between runs
                rounds = []
                for _ in range(repeats):
                    rounds.append(
                        (
                            kit_point(server.url, server.model, prompts[2:], c, 16),
                            guidellm_point(py, server.url, server.model, prompts_file, c, n, 16, tmp),
                        )
                    )
                    print(
                        f"  concurrency {c}: kit {rounds[-1][0]}\n  concurrency {c}: GuideLLM {rounds[-1][1]}"
                    )
                kit = {k: statistics.median(r[0][k] for r in rounds) for k in rounds[0][0]}
                ref = {k: statistics.median(r[1][k] for r in rounds) for k in rounds[0][1]}
                for key, what in (
                    ("median_ttft_ms", "median TTFT"),
                    ("median_itl_ms", "median ITL"),
                    ("output_throughput", "output tokens/s"),
                ):
                    ratio = kit[key] / ref[key] if ref[key] else float("nan")
                    ok = 0.9 <= ratio <= 1.1
                    print(
                        f"serve | load generator vs GuideLLM, concurrency {c}, {what} ({n} requests, "
                        f"median of {repeats}) | "
                        f"{ratio:.2f}x | goal 0.9-1.1x | {'MET' if ok else 'MISSED'}"
                    )
                    print(
                        "    baseline: "
                        + GUIDELLM_CMD.format(
                            py="python",
                            url="URL",
                            model="MODEL",
                            out=16,
                            c=c,
                            n=n,
                            prompts="prompts.jsonl",
                            json="out.json",
                        )
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
