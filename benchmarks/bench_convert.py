"""Benchmark the HF -> Megatron conversion against its physical floor and against loading the whole model.

1. Throughput: converting a synthetic Llama checkpoint to TP2 x PP2 vs `shutil.copyfile` of its shards on the same
   disk (the floor: every byte read once and written once). Goal: conversion <= 2x the copy time.
2. Peak memory (ru_maxrss of a fresh process) at two model sizes, for the kit and for what today's converters do
   (transformers from_pretrained of the whole model, then save). Goal: the kit's peak grows by < 10% of the model
   growth. Each figure is printed as a ratio against its baseline measured in this run.

Usage: .venv/bin/python benchmarks/bench_convert.py [--small-gb 0.5] [--large-gb 2] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN, FFN, HEADS, GROUPS, VOCAB = 1024, 2816, 16, 4, 32000
PER_LAYER = HIDDEN * (HIDDEN + 2 * HIDDEN // HEADS * GROUPS) + HIDDEN * HIDDEN + 3 * FFN * HIDDEN + 2 * HIDDEN
FIXED = 2 * VOCAB * HIDDEN + HIDDEN

CHILD = {
    "import-kit": "import torch, kit.convert",
    "import-transformers": "import torch, transformers",
    "kit": (
        "import torch, kit.convert\n"
        "from kit.convert import ConvertConfig, hf_to_megatron\n"
        "hf_to_megatron(ConvertConfig({src!r}, {out!r}, tp=2, pp=2, overwrite=True), progress=False)"
    ),
    "transformers": (
        "import torch, transformers\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained({src!r}, dtype=torch.bfloat16)\n"
        "m.save_pretrained({out!r}, max_shard_size='500MB')"
    ),
}


def make_model(folder: Path, gb: float) -> Path:
    from kit.convert.synthetic import synthetic_checkpoint

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


def weights(folder: Path) -> list:
    return sorted(folder.glob("*.safetensors"))


def peak_rss_mb(kind: str, src: Path, out: Path) -> float:
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent (this process) across exec.
    code = CHILD[kind].format(src=str(src), out=str(out)) + (
        "\nimport re; print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT))
    if res.returncode:
        raise RuntimeError(f"{kind} child failed:\n{res.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return int(res.stdout.strip().splitlines()[-1]) / 1024  # kB


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small-gb", type=float, default=0.5)
    ap.add_argument("--large-gb", type=float, default=2.0)
    ap.add_argument(
        "--dir", default=None, help="work folder (default: a temp folder on the same disk as /tmp)"
    )
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    from kit.convert import ConvertConfig, hf_to_megatron

    work = Path(a.dir or tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        small, large = make_model(work / "small", a.small_gb), make_model(work / "large", a.large_gb)
        size = {
            k: sum(p.stat().st_size for p in weights(f)) / 1024**2
            for k, f in (("small", small), ("large", large))
        }
        print(
            f"synthetic Llama bf16 checkpoints: {size['small']:.0f} MiB and {size['large']:.0f} MiB "
            f"(made in {time.perf_counter() - t:.0f} s)"
        )

        print("\n== throughput: HF -> Megatron TP2 PP2 vs copying the shards (same disk, warm page cache) ==")
        for name, src in (("small", small), ("large", large)):
            times = {"copy": [], "convert": []}
            for _ in range(2):  # first round warms the page cache for both
                t = time.perf_counter()
                (work / "copy").mkdir(exist_ok=True)
                for f in weights(src):
                    shutil.copyfile(f, work / "copy" / f.name)
                times["copy"].append(time.perf_counter() - t)
                shutil.rmtree(work / "copy")
                t = time.perf_counter()
                hf_to_megatron(
                    ConvertConfig(str(src), str(work / "mg"), tp=2, pp=2, overwrite=True), progress=False
                )
                times["convert"].append(time.perf_counter() - t)
                shutil.rmtree(work / "mg")
            c, v = min(times["copy"]), min(times["convert"])
            print(
                f"{name:5s} {size[name]:7.0f} MiB  copy {c:6.2f} s ({size[name] / c:6.0f} MiB/s)  "
                f"convert {v:6.2f} s ({size[name] / v:6.0f} MiB/s)  ratio convert/copy = {v / c:.2f}x "
                f"(goal <= 2x)"
            )

        print("\n== peak RSS of a fresh process (MiB) ==")
        base = {k: peak_rss_mb(f"import-{k}", small, work / "none") for k in ("kit", "transformers")}
        rss = {
            (k, n): peak_rss_mb(k, src, work / f"out-{k}-{n}")
            for k in ("kit", "transformers")
            for n, src in (("small", small), ("large", large))
        }
        growth = size["large"] - size["small"]
        for k in ("kit", "transformers"):
            g = rss[(k, "large")] - rss[(k, "small")]
            print(
                f"{k:12s} imports only {base[k]:6.0f}  small {rss[(k, 'small')]:6.0f}  large "
                f"{rss[(k, 'large')]:6.0f}  above imports: small {rss[(k, 'small')] - base[k]:6.0f} large "
                f"{rss[(k, 'large')] - base[k]:6.0f}  growth {g:6.0f} = {100 * g / growth:5.1f}% of the model "
                f"growth ({growth:.0f} MiB)"
            )
        kit_above = rss[("kit", "large")] - base["kit"]
        tf_above = rss[("transformers", "large")] - base["transformers"]
        print(
            f"kit / transformers peak above imports, large model: {kit_above:.0f} / {tf_above:.0f} MiB = "
            f"{kit_above / max(tf_above, 1):.2f}x"
        )
        g = (rss[("kit", "large")] - rss[("kit", "small")]) / growth
        print(
            f"goal: kit peak growth < 10% of model growth -> {100 * g:.1f}% ({'met' if g < 0.10 else 'NOT met'})"
        )
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
