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
t = time.perf_counter()
if what == "pandas":
    n = len(pd.read_csv(path, low_memory=False))
elif what == "reader":
    n = len(read_kernel_details(path))
else:
    advice = kp.advise(kp.load(path))
    n = len(advice.data.kernels)
    assert advice.problems == ["cast", "aicpu", "low_ratio", "block_dim"], advice.problems
print(json.dumps({{"seconds": time.perf_counter() - t, "rows": n,
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
    out = subprocess.run([sys.executable, "-c", code, what, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_reading(rows: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_prof_"))
    try:
        t = time.perf_counter()
        pt = big_profile(tmp, rows)
        kd = pt / "ASCEND_PROFILER_OUTPUT" / "kernel_details.csv"
        print(f"synthetic kernel_details.csv: {kd.stat().st_size / 2**20:.0f} MiB, written in "
              f"{time.perf_counter() - t:.1f} s")
        base = child("pandas", kd)
        reader = child("reader", kd)
        full = child("advise", pt)
        print(f"{'':28s}{'rows':>10s}{'seconds':>9s}{'rows/s':>12s}{'peak MB':>9s}{'time x':>8s}{'mem x':>7s}")
        for name, r in (("pandas.read_csv (floor)", base), ("kit read_kernel_details", reader),
                        ("kit load + advise", full)):
            print(f"{name:28s}{r['rows']:>10d}{r['seconds']:>9.2f}{r['rows'] / r['seconds']:>12,.0f}"
                  f"{r['peak_rss_mb']:>9.0f}{r['seconds'] / base['seconds']:>8.2f}"
                  f"{r['peak_rss_mb'] / base['peak_rss_mb']:>7.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_overhead(steps: int) -> None:
    import torch

    import kit.profiling as kp
    from kit.profiling.demo import load_model, run_steps, sample_batches
    from kit.samples import tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="bench_prof_"))
    try:
        torch.manual_seed(0)
        model_dir = tiny_llama(tmp / "tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
        model, tok = load_model(model_dir, device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = sample_batches(tok, steps + 2, batch_size=2, seq_len=128)
        run_steps(model, opt, batches[:2])  # first steps allocate; not measured
        off = run_steps(model, opt, batches[2:])
        t = time.perf_counter()
        with kp.profile(tmp / "caps", device="cpu", wait=0, warmup=1, active=steps, record_shapes=True) as cap:
            on = run_steps(model, opt, batches[1:], callbacks=[cap])[1:]
        wall = time.perf_counter() - t
        med_off, med_on = statistics.median(off), statistics.median(on)
        print(f"step time without profiler (median of {len(off)}): {med_off * 1000:.1f} ms")
        print(f"step time while recording  (median of {len(on)}): {med_on * 1000:.1f} ms  -> "
              f"overhead ratio {med_on / med_off:.2f}x")
        print(f"whole capture incl. warmup step and trace export: {wall:.2f} s = "
              f"{wall / (med_off * (steps + 1)):.2f}x the same steps unprofiled")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_trainer_overhead(steps: int) -> None:
    """The same figure on the kit trainer (DeepSpeed, CPU): iteration times from its metrics.jsonl."""
    from kit.data import DataConfig, prepare
    from kit.profiling.demo import profile_trainer
    from kit.samples import sample_tokenizer_dir, tiny_llama
    from kit.train import TrainConfig, train

    tmp = Path(tempfile.mkdtemp(prefix="bench_prof_"))
    try:
        model_dir = tiny_llama(tmp / "tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
        data = prepare(DataConfig(kind="pretrain", name="bench", tokenizer=str(sample_tokenizer_dir()),
                                  max_length=128, max_records=300, megatron=False, out_dir=str(tmp / "data")),
                       progress=False).hf_dir
        iters = steps + 2

        def cfg(run: str) -> TrainConfig:
            return TrainConfig(run_type="pretrain", model_type=run, model_path=str(model_dir),
                               dataset_path=str(data), work_dir=str(tmp / "ws"), train_iters=iters, mbs=2, gbs=2,
                               save_hf=False, seed=0)

        def times(result) -> list:
            rows = [json.loads(ln) for ln in result.metrics_path.read_text().splitlines() if ln.strip()]
            return [r["elapsed_ms"] for r in rows]

        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's per-iteration log lines
            off = times(train(cfg("off"), progress=False))[2:]
            cap, result = profile_trainer(cfg("on"), out_dir=tmp / "caps", device="cpu", wait=0, warmup=2,
                                          active=steps)
        on = times(result)[2:]
        print(f"kit trainer iteration (median of {len(off)}): {statistics.median(off):.1f} ms without, "
              f"{statistics.median(on):.1f} ms recording -> overhead ratio "
              f"{statistics.median(on) / statistics.median(off):.2f}x")
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
