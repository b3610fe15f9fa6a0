"""Profiling stage benchmark: analyzer throughput on a >= 1M-row kernel_details.csv, and profiler overhead.

Run: .venv/bin/python benchmarks/bench_profiling.py [--rows 1000000] [--steps 8]
Every figure is printed as a ratio against a baseline measured in the same run:
- reading: kit's kernel_details reader and the whole analyzer (load + advise) vs a plain pandas.read_csv of the
  same file (the floor), each in a fresh subprocess so that peak RSS is its own;
- overhead: median step time of a tiny Llama with the profiler recording vs without it (torch.profiler on CPU),
  in a plain loop and in the kit trainer (iteration times from its metrics.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
what, path = sys.argv[1], sys.argv[2]
import pandas as pd
import kit.profiling as kp
from kit.profiling.ascend import read_kernel_details
t, c = time.perf_counter(), time.process_time()
if what == "pandas":
    n = len(pd.read_csv(path, low_memory=False))
elif what == "reader":
    n = len(read_kernel_details(path))
else:
    advice = kp.advise(kp.load(path))
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


def bench_reading(rows: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_prof_"))
    try:
        t = time.perf_counter()
        pt = big_profile(tmp, rows)
        kd = pt / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"
        print(
            f"synthetic kernel_details.csv: {kd.stat().st_size / 2**20:.0f} MiB, written in "
            f"{time.perf_counter() - t:.1f} s"
        )
        base = child("pandas", kd)
        reader = child("reader", kd)
        full = child("advise", pt)
        print(
            f"{'':26s}{'rows':>9s}{'wall s':>8s}{'CPU s':>7s}{'rows/CPU s':>12s}{'peak MB':>9s}{'wall x':>8s}"
            f"{'CPU x':>7s}{'mem x':>7s}"
        )
        for name, r in (
            ("pandas.read_csv (floor)", base),
            ("kit read_kernel_details", reader),
            ("kit load + advise", full),
        ):
            print(
                f"{name:26s}{r['rows']:>9d}{r['seconds']:>8.2f}{r['cpu_s']:>7.2f}{r['rows'] / r['cpu_s']:>12,.0f}"
                f"{r['peak_rss_mb']:>9.0f}{r['seconds'] / base['seconds']:>8.2f}{r['cpu_s'] / base['cpu_s']:>7.2f}"
                f"{r['peak_rss_mb'] / base['peak_rss_mb']:>7.2f}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def report_values(label: str, w0: list, c0: list, w1: list, c1: list) -> None:
    mw0, mw1, mc0, mc1 = (statistics.median(x) for x in (w0, w1, c0, c1))
    print(
        f"{label}: median of {len(w0)}/{len(w1)} steps, wall {mw0 * 1000:.0f} -> {mw1 * 1000:.0f} ms "
        f"(overhead ratio {mw1 / mw0:.2f}x), CPU {mc0 * 1000:.0f} -> {mc1 * 1000:.0f} ms (ratio {mc1 / mc0:.2f}x)"
    )


def bench_overhead(steps: int) -> None:
    """Plain forward/backward/AdamW loop of a tiny Llama, without and with torch.profiler recording."""
    import torch

    import kit.profiling as kp
    from kit.profiling.demo import load_model, run_steps, sample_batches
    from kit.samples import tiny_llama

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
        for rnd in range(2):  # alternate off/on so that a slow phase of a busy machine hits both
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
        report_values("plain loop", w_off, c_off, w_on, c_on)
        print(
            f"whole capture incl. warmup step and trace export: {statistics.median(walls):.2f} s = "
            f"{statistics.median(walls) / (statistics.median(w_off) * per):.2f}x the same steps unprofiled"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_trainer_overhead(steps: int) -> None:
    """The same on the kit trainer (DeepSpeed, CPU), the capture passed in its step_callbacks."""
    import torch

    import kit.profiling as kp
    from kit.data import DataConfig, prepare
    from kit.samples import sample_tokenizer_dir, tiny_llama
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
        for rnd in range(2):  # alternate, as above
            off, on = StepMarks(), StepMarks()
            with contextlib.redirect_stdout(io.StringIO()):  # the trainer's per-iteration log lines
                train(cfg(f"off{rnd}"), step_callbacks=[off], progress=False)
                with kp.profile(
                    tmp / "caps", device="cpu", wait=0, warmup=3, active=steps, tag=f"r{rnd}"
                ) as cap:
                    train(cfg(f"on{rnd}"), step_callbacks=[cap, on], progress=False)
            (w0, c0), (w1, c1) = off.steps(3), on.steps(3)  # skip DeepSpeed's first steps and the warmup
            w_off, c_off, w_on, c_on = w_off + w0, c_off + c0, w_on + w1[:-1], c_on + c1[:-1]
        report_values("kit trainer", w_off, c_off, w_on, c_on)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    print("== analyzer throughput")
    bench_reading(args.rows)
    print("== profiler overhead (torch.profiler, CPU, tiny Llama 4x128)")
    bench_overhead(args.steps)
    bench_trainer_overhead(args.steps)


if __name__ == "__main__":
    main()
