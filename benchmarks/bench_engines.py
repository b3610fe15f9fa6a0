"""Serving engines on CPU: vLLM for CPU against `transformers serve` as the kit starts it, on the same served run.

Why `transformers serve` is the kit's CPU default (docs/serve.md), measured: one tiny training run
(tests/fixtures/training_run.py, a seeded random Llama 256 wide, 4 layers, head size 64, which vLLM's CPU attention
has a kernel for) is served by
- `transformers serve` as the kit starts it, the baseline: `ServeConfig(engine="transformers", device="cpu")`, no
  `--continuous-batching` (the kit passes none), torch's default threads, from the dev venv;
- vLLM for CPU from the env `make vllm-env` builds (`kit.serve.engine_env.built_env_python()`), started as
  tests/test_serve_vllm.py starts it: `ServeConfig(engine="vllm", device="cpu", enforce_eager=True,
  cpu_kv_cache_gb=1)`.
Both servers stay up and are measured in alternating rounds by the kit's load generator (kit/serve/loadgen.py, as
benchmarks/bench_serve.py drives it): the same prompts (random ordinary tokens, ~32 tokens each), streamed
/v1/completions with max_tokens 32, closed loop at concurrency 1 and 4. Figures: output tokens/s and median TTFT;
a row's ratio is vLLM-CPU / transformers serve, the median of the rounds' ratios (tokens/s: above 1 vLLM is
faster; TTFT: below 1 vLLM is faster), and its baseline line gives both engines' medians. Start-up is the time from
the engine's start to its first 200 on GET /health. No goal: on a 2-core machine shared with other work this is a
ranking, not a figure to hold either engine to. The engines also use the cores differently: vLLM on CPU cuts torch
to one thread and reserves the other core (its log lines, printed below), while `transformers serve` runs torch's
default threads, whose every step waits for the slowest of them, so another process on a core slows it down.

Without the vLLM env the rows say so (status -). Prints `serve | engines: ... | <ratio>x | goal - | -`, which
benchmarks/run_all.py collects.
Run: .venv/bin/python benchmarks/bench_engines.py [--quick] [--requests 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # fixtures: the served training run

from bench_serve import kit_point  # noqa: E402  (the kit's load generator, as bench_serve drives it)

# head size 64 (256 / 4): vLLM's CPU attention has kernels for it (kit.serve.engines.VLLM_CPU_HEAD_SIZES)
MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512)
VLLM = dict(engine="vllm", device="cpu", enforce_eager=True, cpu_kv_cache_gb=1, startup_timeout=400)
TRANSFORMERS = dict(engine="transformers", device="cpu", startup_timeout=300)
PROMPT_TOKENS = 32
OUT_TOKENS = 32
LEVELS = (1, 4)
FIGURES = (
    ("output_throughput", "output tokens/s", "{:.1f} tokens/s"),
    ("median_ttft_ms", "median TTFT", "{:.1f} ms"),
)
NAME = "engines: vLLM-CPU / transformers serve"


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def _settings(vllm_python: str) -> tuple:
    """How each engine runs, in words: (transformers serve, vLLM-CPU)."""
    import torch
    import transformers

    from kit.serve.engine_env import probe

    vllm = probe(vllm_python, ("vllm",), ("vllm-cpu", "vllm")).versions
    version = vllm.get("vllm-cpu") or vllm.get("vllm") or "?"
    return (
        f"transformers serve as the kit starts it (transformers {transformers.__version__}, "
        f'ServeConfig(engine="transformers", device="cpu"): no --continuous-batching, torch\'s default '
        f"{torch.get_num_threads()} threads)",
        f'vLLM-CPU {version} (ServeConfig(engine="vllm", device="cpu", enforce_eager=True, cpu_kv_cache_gb=1), '
        f"{Path(vllm_python).parent.parent})",
    )


def _cores(server) -> list:
    """The lines of vLLM's log that say which cores and threads its worker took."""
    keep = ("reserved_cpus", "Reducing Torch threads", "OMP threads binding", "auto thread-binding")
    return [ln.strip()[:200] for ln in server.log_tail(400) if any(k in ln for k in keep)]


def _point(p: dict) -> str:
    return (
        f"{p['output_throughput']:.1f} tokens/s, median TTFT {p['median_ttft_ms']:.1f} ms, "
        f"{p['completed']} completed"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short configuration for make bench")
    ap.add_argument("--requests", type=int, default=None, help="requests per point (default 16, --quick 8)")
    ap.add_argument("--repeats", type=int, default=None, help="alternating rounds (default 7, --quick 5)")
    args = ap.parse_args()
    n = args.requests or (8 if args.quick else 16)
    repeats = args.repeats or (5 if args.quick else 7)

    from kit.serve.engine_env import built_env_python

    vllm_python = built_env_python()
    if vllm_python is None:
        for c in LEVELS:
            for _, what, _ in FIGURES:
                print(
                    f"serve | {NAME}, {what}, concurrency {c} | n/a | goal - | - | "
                    "no vLLM CPU env (.venv-vllm-cpu or ~/.cache/ascend-kit/serve/vllm-cpu): `make vllm-env` builds it"
                )
        return 0

    from fixtures.training_run import tiny_training_run
    from transformers import AutoTokenizer

    from kit.core.samples import tiny_llama
    from kit.core.workspace import get_workspace
    from kit.serve import ServeConfig, serve
    from kit.serve.loadgen import make_prompts
    from kit.storage.partial import sigterm_as_interrupt

    print(f"  before: {_load()}", flush=True)
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory() as tmp, ExitStack() as servers:
        tmp = Path(tmp)
        base = tiny_llama(tmp / "base", seed=0, **MODEL)
        tiny_training_run(tmp / "ws", base, tmp / "trained", **MODEL)
        ws = get_workspace(tmp / "ws", model="tiny")
        tok = AutoTokenizer.from_pretrained(str(tmp / "trained"))
        prompts = make_prompts(tok, n + 4, PROMPT_TOKENS, seed=0)
        warm, prompts = prompts[:4], prompts[4:]

        engines = {}  # label -> running Server; each is stopped (its process group) when the block is left
        startup = {}
        for label, cfg in (("transformers serve", TRANSFORMERS), ("vLLM-CPU", VLLM)):
            t0 = time.monotonic()
            server = servers.enter_context(serve(ServeConfig(**cfg), ws))
            startup[label] = (server.info["startup_s"], time.monotonic() - t0)
            engines[label] = server
            kit_point(server.url, server.model, warm, len(warm), OUT_TOKENS)  # warm-up, not counted
        for label, (health_s, total_s) in startup.items():
            print(
                f"  start-up: {label} {health_s:.1f} s to GET /health ({total_s:.1f} s in serve())",
                flush=True,
            )
        for line in _cores(engines["vLLM-CPU"]):
            print(f"  vLLM log: {line}")
        base_settings, vllm_settings = _settings(vllm_python)

        rounds = {c: [] for c in LEVELS}  # c -> [{label: point}] per round
        for r in range(repeats):
            for c in LEVELS:
                got = {}
                for label, server in engines.items():
                    got[label] = kit_point(server.url, server.model, prompts, c, OUT_TOKENS)
                    print(f"  round {r + 1}, concurrency {c}: {label}: {_point(got[label])}", flush=True)
                    if got[label]["completed"] < n:
                        raise RuntimeError(
                            f"{label}: {n - got[label]['completed']} of {n} requests failed; log: "
                            f"{server.log_path}"
                        )
                rounds[c].append(got)

        base_label, other = "transformers serve", "vLLM-CPU"
        for c in LEVELS:
            for key, what, fmt in FIGURES:
                ratio = statistics.median(g[other][key] / g[base_label][key] for g in rounds[c])
                ref = statistics.median(g[base_label][key] for g in rounds[c])
                val = statistics.median(g[other][key] for g in rounds[c])
                print(
                    f"serve | {NAME}, {what}, concurrency {c} ({n} requests of {PROMPT_TOKENS} -> {OUT_TOKENS} "
                    f"tokens, median of {repeats} rounds) | {ratio:.2f}x | goal - | -"
                )
                print(f"    baseline: {base_settings}: {fmt.format(ref)}; {vllm_settings}: {fmt.format(val)}")
        (t_health, _), (v_health, _) = startup[base_label], startup[other]
        print(f"serve | {NAME}, start-up to GET /health | {v_health / t_health:.2f}x | goal - | -")
        print(f"    baseline: {base_settings}: {t_health:.1f} s; {vllm_settings}: {v_health:.1f} s")
    print(f"  after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
