"""Profiling stage benchmark: analyzer throughput on a big kernel_details.csv, profiler overhead, CLI start-up.

Run: .venv/bin/python benchmarks/bench_profiling.py [--quick] [--rows 1000000] [--steps 8] [--repeats 3]
Every figure is a ratio against a baseline measured in the same run, printed as one line
`profiling | <figure> vs <baseline> | <ratio>x | goal <goal or -> | <MET/MISSED/->` (after the detail lines):
- reading: kit's kernel_details reader and the whole analyzer (load + advise) vs a bare `pandas.read_csv` of the
  same file (what users run), each in a fresh subprocess so that CPU time and peak RSS are its own; ratios are
  pandas CPU s / kit CPU s (> 1: the kit is faster) and kit peak RSS / pandas peak RSS (< 1: the kit uses less);
  minimum of the alternated repeats;
- overhead: steps/s of a tiny Llama with torch.profiler recording vs without (CPU), in a plain loop and in the
  kit trainer (ratio < 1: the cost of profiling);
- start-up: `python -m kit profile --help` (wall, peak RSS) vs a bare `python -c pass`; goal < 1.5 s, < 150 MB.
--quick (for `make bench`, about 2 minutes here): 200k rows, 4 steps, 2 reading repeats, one overhead round.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # fixtures: the test assets

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
what, path = sys.argv[1], sys.argv[2]
import pandas as pd
from kit.profiling import advise, load  # every child imports the same modules: RSS and time exclude imports
from kit.profiling.ascend import read_kernel_details
t, c = time.perf_counter(), time.process_time()
if what == "pandas":
    n = len(pd.read_csv(path, low_memory=False))
elif what == "reader":
    n = len(read_kernel_details(path))
else:
    advice = advise(load(path))
    n = len(advice.data.kernels)
    assert advice.problems == ["cast", "aicpu", "low_ratio", "block_dim"], advice.problems
print(json.dumps({{"seconds": time.perf_counter() - t, "rows": n, "cpu_s": time.process_time() - c,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def big_profile(tmp: Path, rows: int) -> Path:
    """The planted sample with its kernel_details.csv body repeated until it has >= `rows` rows."""
    from kit.profiling import write_sample_ascend_profile

    pt = write_sample_ascend_profile(tmp)
    kd = pt / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"
    head, body = kd.read_text(encoding="utf-8").split("\n", 1)
    n_body = body.count("\n")
    reps = -(-rows // n_body)
    with open(kd, "w", encoding="utf-8") as fh:
        fh.write(head + "\n")
        for _ in range(reps):
            fh.write(body)
    return pt


def child(what: str, path: Path) -> dict:
    code = CHILD.format(root=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code, what, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def line(figure: str, ratio: float, goal: str = "-", met=None) -> None:
    """One figure in the format `make bench` collects."""
    status = "-" if met is None else ("MET" if met else "MISSED")
    print(f"profiling | {figure} | {ratio:.2f}x | goal {goal} | {status}", flush=True)


READ_BASELINE = "pd.read_csv(kernel_details.csv, low_memory=False)"


def bench_reading(rows: int, repeats: int) -> list:
    """Alternated repeats of pandas / kit reader / kit load+advise on one synthetic file; figure lines to print."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_prof_"))
    try:
        t = time.perf_counter()
        pt = big_profile(tmp, rows)
        kd = pt / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"
        print(
            f"synthetic kernel_details.csv: {kd.stat().st_size / 2**20:.0f} MiB, written in "
            f"{time.perf_counter() - t:.1f} s; min of {repeats} alternated repeats, each in a fresh process",
            flush=True,
        )
        runs: dict = {"pandas": [], "reader": [], "advise": []}
        for r in range(repeats):
            order = ["pandas", "reader", "advise"] if r % 2 == 0 else ["advise", "reader", "pandas"]
            for what in order:
                runs[what].append(child(what, pt if what == "advise" else kd))
        best = {
            k: {m: min(x[m] for x in v) for m in ("seconds", "cpu_s", "peak_rss_mb")} for k, v in runs.items()
        }
        n = runs["pandas"][0]["rows"]
        print(f"{'':26s}{'rows':>9s}{'wall s':>8s}{'CPU s':>7s}{'rows/CPU s':>12s}{'peak MB':>9s}")
        for name, key in (
            ("pandas.read_csv (users)", "pandas"),
            ("kit read_kernel_details", "reader"),
            ("kit load + advise", "advise"),
        ):
            b = best[key]
            print(
                f"{name:26s}{runs[key][0]['rows']:>9d}{b['seconds']:>8.2f}{b['cpu_s']:>7.2f}"
                f"{n / b['cpu_s']:>12,.0f}{b['peak_rss_mb']:>9.0f}"
            )
        base = best["pandas"]
        out = []
        for key, what in (("reader", "kit kernel_details reader"), ("advise", "kit load + advise")):
            out.append(
                (f"{what} CPU speed ({n:,} rows) vs `{READ_BASELINE}`", base["cpu_s"] / best[key]["cpu_s"])
            )
            out.append(
                (f"{what} peak RSS vs `{READ_BASELINE}`", best[key]["peak_rss_mb"] / base["peak_rss_mb"])
            )
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_measured(argv: list) -> tuple:
    """(wall s, peak RSS MB) of one command, measured by /usr/bin/time -v.

    Not os.wait4 on our own child: Linux carries the forking process's peak RSS across fork and exec into the
    child's ru_maxrss, so a child of this (torch-loaded) process would report this process's peak.
    """
    timer = shutil.which("time") or "/usr/bin/time"
    t = time.perf_counter()
    res = subprocess.run([timer, "-v", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    if res.returncode:
        raise RuntimeError(f"{argv} exited with {res.returncode}: {res.stderr[-500:]}")
    rss_kb = next(
        int(ln.split(":")[1]) for ln in res.stderr.splitlines() if "Maximum resident set size" in ln
    )
    elapsed = next(ln.rsplit(" ", 1)[1] for ln in res.stderr.splitlines() if "Elapsed (wall clock)" in ln)
    m, sec = elapsed.split(":")[-2:]
    return min(wall, 60 * float(m) + float(sec)), rss_kb / 1024


def bench_startup(repeats: int) -> list:
    """`python -m kit profile --help` vs a bare interpreter, min of alternated repeats."""
    if not (shutil.which("time") or os.path.exists("/usr/bin/time")):
        print("start-up: skipped, GNU time (/usr/bin/time) is not installed (apt-get install time)")
        return []
    kit_cmd = [sys.executable, "-m", "kit", "profile", "--help"]
    bare = [sys.executable, "-c", "pass"]
    k, b = [], []
    for r in range(max(3, repeats)):
        for which, cmd in ((k, kit_cmd), (b, bare)) if r % 2 == 0 else ((b, bare), (k, kit_cmd)):
            which.append(_run_measured(cmd))
    wall, rss = min(w for w, _ in k), min(m for _, m in k)
    bwall, brss = min(w for w, _ in b), min(m for _, m in b)
    print(
        f"start-up: `python -m kit profile --help` {wall:.2f} s, {rss:.0f} MB; `python -c pass` {bwall:.2f} s, {brss:.0f} MB"
    )
    return [
        (
            f"`python -m kit profile --help` wall ({wall:.2f} s, {rss:.0f} MB peak RSS) vs `python -c pass`",
            wall / bwall,
            "< 1.5 s and < 150 MB",
            wall < 1.5 and rss < 150,
        )
    ]


class StepMarks:
    """A step callback recording wall and process CPU time after each step (CPU time is steadier on a busy box)."""

    def __init__(self):
        self.marks = [(time.perf_counter(), time.process_time())]

    def __call__(self, step: int) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))

    def steps(self, skip: int) -> tuple:
        """(wall seconds, cpu seconds) per step, after the first `skip` steps."""
        d = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(self.marks, self.marks[1:])][skip:]
        return [w for w, _ in d], [c for _, c in d]


def report_values(label: str, w0: list, c0: list, w1: list, c1: list) -> float:
    """Print the medians; return the speed ratio with / without the profiler (wall)."""
    mw0, mw1, mc0, mc1 = (statistics.median(x) for x in (w0, w1, c0, c1))
    print(
        f"{label}: median of {len(w0)}/{len(w1)} steps, wall {mw0 * 1000:.0f} -> {mw1 * 1000:.0f} ms "
        f"(overhead ratio {mw1 / mw0:.2f}x), CPU {mc0 * 1000:.0f} -> {mc1 * 1000:.0f} ms (ratio {mc1 / mc0:.2f}x)"
    )
    return mw0 / mw1


def bench_overhead(steps: int, rounds: int) -> list:
    """Plain forward/backward/AdamW loop of a tiny Llama, without and with torch.profiler recording."""
    import torch
    from fixtures.plain_loop import load_model, run_steps, sample_batches

    import kit.profiling as kp
    from kit.core.samples import tiny_llama

    torch.set_num_threads(1)  # one thread: the figure is about the profiler, not about thread contention
    tmp = Path(tempfile.mkdtemp(prefix="bench_prof_"))
    try:
        torch.manual_seed(0)
        model_dir = tiny_llama(tmp / "tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
        model, tok = load_model(model_dir, device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = sample_batches(tok, steps + 2, batch_size=2, seq_len=128)
        run_steps(model, opt, batches[:2])  # first steps allocate; not measured
        w_off, c_off, w_on, c_on, walls = [], [], [], [], []
        for rnd in range(rounds):  # alternate off/on so that a slow phase of a busy machine hits both
            off, on = StepMarks(), StepMarks()
            run_steps(model, opt, batches[2:], callbacks=[off])
            t = time.perf_counter()
            with kp.profile(tmp / "caps", device="cpu", wait=0, warmup=1, active=steps, tag=f"r{rnd}") as cap:
                run_steps(model, opt, batches[1:], callbacks=[cap, on])
            walls.append(time.perf_counter() - t)
            (w0, c0), (w1, c1) = off.steps(0), on.steps(1)  # on: skip the warmup step
            w_off += w0
            c_off += c0
            w_on += w1[:-1]  # the last active step's callback also exports the trace
            c_on += c1[:-1]
        per = steps + 1
        ratio = report_values("plain loop", w_off, c_off, w_on, c_on)
        print(
            f"whole capture incl. warmup step and trace export: {statistics.median(walls):.2f} s = "
            f"{statistics.median(walls) / (statistics.median(w_off) * per):.2f}x the same steps unprofiled"
        )
        return [
            (
                "plain training loop steps/s with kit.profiling.profile (torch.profiler, CPU) recording vs "
                "`run_steps(model, opt, batches)` unprofiled",
                ratio,
            )
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_trainer_overhead(steps: int, rounds: int) -> list:
    """The same on the kit trainer (DeepSpeed, CPU), the capture passed in its step_callbacks."""
    import torch

    import kit.profiling as kp
    from kit.core.samples import sample_tokenizer_dir, tiny_llama
    from kit.data import DataConfig, prepare
    from kit.train import TrainConfig, train

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_prof_"))
    try:
        model_dir = tiny_llama(tmp / "tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
        data = prepare(
            DataConfig(
                kind="pretrain",
                name="bench",
                tokenizer=str(sample_tokenizer_dir()),
                max_length=128,
                max_records=300,
                megatron=False,
                out_dir=str(tmp / "data"),
            ),
            progress=False,
        ).hf_dir

        def cfg(run: str) -> TrainConfig:
            return TrainConfig(
                run_type="pretrain",
                model_type=run,
                model_path=str(model_dir),
                dataset_path=str(data),
                work_dir=str(tmp / "ws"),
                train_iters=steps + 3,
                mbs=2,
                gbs=2,
                save_hf=False,
                seed=0,
            )

        w_off, c_off, w_on, c_on = [], [], [], []
        for rnd in range(rounds):  # alternate, as above
            off, on = StepMarks(), StepMarks()
            with contextlib.redirect_stdout(io.StringIO()):  # the trainer's per-iteration log lines
                train(cfg(f"off{rnd}"), step_callbacks=[off], progress=False)
                with kp.profile(
                    tmp / "caps", device="cpu", wait=0, warmup=3, active=steps, tag=f"r{rnd}"
                ) as cap:
                    train(cfg(f"on{rnd}"), step_callbacks=[cap, on], progress=False)
            (w0, c0), (w1, c1) = off.steps(3), on.steps(3)  # skip DeepSpeed's first steps and the warmup
            w_off, c_off, w_on, c_on = w_off + w0, c_off + c0, w_on + w1[:-1], c_on + c1[:-1]
        ratio = report_values("kit trainer", w_off, c_off, w_on, c_on)
        return [
            (
                "kit trainer steps/s with a capture in step_callbacks vs `kit.train.train(cfg)` unprofiled",
                ratio,
            )
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="short configuration for make bench (about 2 minutes)"
    )
    ap.add_argument("--rows", type=int, default=None, help="kernel rows (default 1,000,000; --quick 200,000)")
    ap.add_argument("--steps", type=int, default=None, help="recorded steps (default 8; --quick 4)")
    ap.add_argument(
        "--repeats", type=int, default=None, help="alternated reading repeats (default 3; --quick 2)"
    )
    args = ap.parse_args()
    rows = args.rows or (200_000 if args.quick else 1_000_000)
    steps = args.steps or (4 if args.quick else 8)
    repeats = args.repeats or (2 if args.quick else 3)
    rounds = 1 if args.quick else 2
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)
    figures: list = []
    print("== start-up", flush=True)
    figures += bench_startup(repeats)
    print("== analyzer throughput", flush=True)
    figures += bench_reading(rows, repeats)
    print("== profiler overhead (torch.profiler, CPU, tiny Llama 4x128)", flush=True)
    figures += bench_overhead(steps, rounds)
    figures += bench_trainer_overhead(steps, rounds)
    print()
    for fig in figures:
        line(*fig)


if __name__ == "__main__":
    main()
