"""Conversion against its physical floor: HF -> Megatron through the CLI vs copying the same bytes, and the memory of
Megatron -> HF as the model grows.

1. Wall time: `python -m kit convert --source HF --target OUT --tp 2 --pp 2` (a fresh process: start-up, imports,
   checks, rank files with CRC32s) vs `shutil.copyfile` of the checkpoint's shards on the same disk (the floor:
   every byte read once and written once), at both model sizes. Min of >= 3 alternated repeats, warm page cache
   for both; the kit's modules byte-compiled first, as an installed package has them. Goal: CLI wall <= 1.5x the
   copy. The CLI writes the rank files on one thread per core (`--workers`); `cp` uses one.
   The NaN / inf weights check inside it (kit.convert.weights_check.StreamCheck, run on the bytes as the writers pass
   them): the seconds the CLI reports spending in it (`weights_check_seconds`, summed over its writer threads, so
   at least its share of the wall time), goal <= 10% of the CLI's wall time. The file check that evaluate and
   serve run (`check_hf_weights`, a read of every shard) is timed alone for reference.
2. Memory: peak RSS (VmHWM) of `python -m kit convert --direction megatron_to_hf` above the same process after its
   imports, at two model sizes. Goal: < 10% of the model and flat with size (growth < 10% of the model growth).

Usage: .venv/bin/python benchmarks/bench_convert.py [--quick] [--small-gb 0.5] [--large-gb 1.5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import compileall
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # fixtures: the test assets

HIDDEN, FFN, HEADS, GROUPS, VOCAB = 1024, 2816, 16, 4, 32000
PER_LAYER = HIDDEN * (HIDDEN + 2 * HIDDEN // HEADS * GROUPS) + HIDDEN * HIDDEN + 3 * FFN * HIDDEN + 2 * HIDDEN
FIXED = 2 * VOCAB * HIDDEN + HIDDEN
COPY_CODE = "for f in shards: shutil.copyfile(f, dst / f.name)"
# The CLI in a child that records its peak RSS after the imports the CLI needs and again at the end.
RSS_CHILD = (
    "import re, sys\n"
    "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
    "import kit.__main__, kit.convert.cli, kit.convert.convert\n"
    "before = hwm()\n"
    "rc = kit.__main__.main(sys.argv[1:])\n"
    "print('RSS', before, hwm(), rc)\n"
)


def make_model(folder: Path, gb: float) -> Path:
    from fixtures.convert.synthetic import synthetic_checkpoint

    layers = max(2, 2 * round((gb * 1024**3 / 2 - FIXED) / PER_LAYER / 2))  # even, for PP2
    return synthetic_checkpoint(
        folder,
        "llama",
        hidden_size=HIDDEN,
        num_layers=layers,
        num_heads=HEADS,
        num_groups=GROUPS,
        ffn_hidden_size=FFN,
        vocab_size=VOCAB,
        dtype="bfloat16",
        max_shard_mb=500,
        with_tokenizer=False,
        overwrite=True,
    )


def shards(folder: Path) -> list:
    return sorted(folder.glob("*.safetensors"))


def cli(*args: str) -> list:
    return [sys.executable, "-m", "kit", "convert", *args, "--no-progress"]


def timed_cli(args: list) -> tuple:
    """(wall seconds, the CLI's JSON summary, CPU seconds of all its threads) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run(args, capture_output=True, text=True, cwd=str(ROOT))
    dt = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{res.stderr[-3000:]}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return dt, json.loads(res.stdout), cpu


def timed_copy(src: Path, dst: Path) -> float:
    dst.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for f in shards(src):
        shutil.copyfile(f, dst / f.name)
    dt = time.perf_counter() - t
    shutil.rmtree(dst)
    return dt


def timed_check(src: Path) -> float:
    """Seconds of kit.convert.weights_check.check_hf_weights over the folder (every float tensor's exponent bits, read
    from the files: what evaluate and serve run; the converter checks in its writers instead)."""
    from kit.convert.weights_check import check_hf_weights

    t = time.perf_counter()
    check_hf_weights(src)
    return time.perf_counter() - t


def rss_above_imports(mg: Path, out: Path) -> float:
    """MiB the Megatron -> HF CLI adds to its peak RSS after its imports."""
    args = [
        "convert",
        "--direction",
        "megatron_to_hf",
        "--source",
        str(mg),
        "--target",
        str(out),
        "--no-progress",
    ]
    res = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, *args], capture_output=True, text=True, cwd=str(ROOT)
    )
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RSS ")]
    if res.returncode or not line or line[-1].split()[3] != "0":
        raise RuntimeError(f"megatron_to_hf child failed:\n{res.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    _, before, after, _ = line[-1].split()
    return (int(after) - int(before)) / 1024


def row(figure: str, ratio: float, goal: str, met: bool, baseline: str) -> None:
    print(f"convert | {figure} | {ratio:.2f}x | goal {goal} | {'MET' if met else 'MISSED'}")
    print(f"        baseline: {baseline}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="short run for `make bench` (0.5 and 1 GB, 5 repeats)"
    )
    ap.add_argument("--small-gb", type=float, default=0.5)
    ap.add_argument("--large-gb", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="work folder (default: a temp folder under /tmp)")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.small_gb, a.large_gb, a.repeats = 0.5, 1.0, 5
    # An installed kit runs from byte-compiled modules (pip compiles them at install time); an editable checkout
    # under PYTHONDONTWRITEBYTECODE would recompile every module in every CLI run and time the compiler.
    compileall.compile_dir(str(ROOT / "kit"), quiet=1)
    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        small, large = make_model(work / "small", a.small_gb), make_model(work / "large", a.large_gb)
        size = {
            k: sum(p.stat().st_size for p in shards(f)) / 1024**2
            for k, f in (("small", small), ("large", large))
        }
        print(
            f"synthetic Llama bf16 checkpoints: {size['small']:.0f} MiB and {size['large']:.0f} MiB "
            f"(made in {time.perf_counter() - t:.0f} s); repeats {a.repeats}, min of each"
        )

        # 1. HF -> Megatron TP2 PP2 through the CLI vs copying the shards, alternated, at both sizes.
        checks, in_cli, cli_s, cli_cpu = {}, {}, {}, {}
        for name, src in (("small", small), ("large", large)):
            times = {"copy": [], "cli": [], "check": [], "cpu": []}
            convert_args = cli("--source", str(src), "--target", str(work / "mg"), "--tp", "2", "--pp", "2")
            timed_copy(src, work / "copy")  # warm the page cache for both
            for _ in range(a.repeats):
                times["copy"].append(timed_copy(src, work / "copy"))
                wall, summary, cpu = timed_cli(convert_args)
                times["cli"].append(wall)
                times["cpu"].append(cpu)
                times["check"].append(summary["weights_check_seconds"])
                shutil.rmtree(work / "mg")
            c, v = min(times["copy"]), min(times["cli"])
            in_cli[name] = min(times["check"])
            cli_cpu[name] = min(times["cpu"])
            checks[name] = min(timed_check(src) for _ in range(a.repeats))
            print(
                f"HF -> Megatron TP2 PP2, {size[name]:.0f} MiB: copy {c:.2f} s ({size[name] / c:.0f} MiB/s), "
                f"CLI {v:.2f} s incl. start-up (all runs: copy {[round(x, 2) for x in times['copy']]}, "
                f"CLI {[round(x, 2) for x in times['cli']]})"
            )
            row(
                f"HF->Megatron TP2PP2 CLI wall / copy ({size[name]:.0f} MiB)",
                v / c,
                "<= 1.5x",
                v / c <= 1.5,
                f"shutil.copyfile of the same shards: {COPY_CODE}",
            )

            cli_s[name] = v
        # 1b. The NaN / inf weights check inside the CLI (in its writer threads), as the CLI reports it.
        for name in ("small", "large"):
            share = in_cli[name] / cli_s[name]
            print(
                f"NaN/inf weights check, {size[name]:.0f} MiB: {in_cli[name]:.3f} s (summed over the writer "
                f"threads) of the CLI's {cli_s[name]:.2f} s wall, {cli_cpu[name]:.2f} s CPU (all threads); the file "
                f"check alone (check_hf_weights, what evaluate and serve run): {checks[name]:.2f} s"
            )
            row(
                f"weights check / HF->Megatron CLI wall ({size[name]:.0f} MiB)",
                share,
                "<= 0.10x",
                share <= 0.10,
                "the whole conversion through the CLI (which includes the check)",
            )

        # 2. Megatron -> HF peak RSS above imports at two sizes.
        above = {}
        for name, src in (("small", small), ("large", large)):
            mg = work / f"mg-{name}"
            timed_cli(
                cli("--source", str(src), "--target", str(mg), "--tp", "2", "--pp", "2")
            )  # (wall, summary)
            runs = [rss_above_imports(mg, work / "hf") for _ in range(a.repeats)]
            above[name] = min(runs)
            print(
                f"Megatron TP2 PP2 -> HF, {size[name]:.0f} MiB model: peak RSS above imports {above[name]:.0f} MiB "
                f"(runs {[round(x) for x in runs]})"
            )
            shutil.rmtree(mg)
        for name in ("small", "large"):
            frac = above[name] / size[name]
            row(
                f"Megatron->HF peak RSS above imports / model ({size[name]:.0f} MiB)",
                frac,
                "< 0.10x",
                frac < 0.10,
                "the model's size (a whole-model converter holds >= 1x)",
            )
        growth = (above["large"] - above["small"]) / (size["large"] - size["small"])
        row(
            "Megatron->HF peak RSS growth / model growth",
            max(growth, 0.0),
            "< 0.10x (flat)",
            growth < 0.10,
            f"model growth {size['large'] - size['small']:.0f} MiB",
        )
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
