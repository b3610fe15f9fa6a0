"""Pretraining data preparation: kit.data vs the plain HF recipe and vs the tokenizer alone; peak memory.

Run: .venv/bin/python benchmarks/bench_data.py [--mb 20] [--big-mb 80] [--tokenizer DIR] [--workers 1]
Every figure is printed as a ratio against a baseline measured in the same run:
  (a) the run_clm.py recipe: `load_dataset` + `datasets.map(tokenize)` + `datasets.map(group_texts)`;
  (b) the tokenizer alone: batched `encode` of the same texts, already in memory (the floor).
Peak memory (max RSS of a fresh process) of kit.data at two corpus sizes shows it does not grow with the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A parquet corpus of about `megabytes` MB of text, made by reshuffling the sample corpus' sentences."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kit.samples import pretrain_corpus

    sentences = [
        s.strip() + "." for t in pd.read_parquet(pretrain_corpus())["text"] for s in t.split(".") if s.strip()
    ]
    rng = random.Random(seed)
    target, written = int(megabytes * 1e6), 0
    writer = None
    while written < target:
        docs = [" ".join(rng.choices(sentences, k=rng.randint(3, 40))) for _ in range(2000)]
        written += sum(len(d.encode()) for d in docs)
        table = pa.table({"text": docs})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return written


def _cpu() -> float:
    """CPU seconds of this process (all threads) and of its finished worker processes."""
    import resource

    return sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def _peak_rss_mb() -> float:
    """Peak RSS of this process or of its largest finished worker process, in MB."""
    import resource

    return (
        max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    )


def child_kit(corpus: str, out: str, tokenizer: str, workers: int) -> dict:
    """Run kit.data pretraining prep in this process; report time, tokens and peak RSS."""

    import datasets  # noqa: F401  - imports happen before the clock in every contender
    from transformers import AutoTokenizer  # noqa: F401

    from kit.data import DataConfig, prepare

    t, c = time.perf_counter(), _cpu()
    res = prepare(
        DataConfig(
            kind="pretrain",
            inputs=[corpus],
            name="bench",
            tokenizer=tokenizer,
            max_length=2048,
            out_dir=out,
            num_workers=workers,
            overwrite=True,
        ),
        progress=False,
    )
    seconds = time.perf_counter() - t
    return {
        "seconds": seconds,
        "cpu": _cpu() - c,
        "tokens": res.report.tokens_in,
        "peak_rss_mb": _peak_rss_mb(),
    }


def child_hf_recipe(corpus: str, cache: str, tokenizer: str, workers: int) -> dict:
    """The run_clm.py recipe: tokenize with datasets.map, then group_texts into 2048-token blocks."""

    from datasets import load_dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    block = 2048
    t, c = time.perf_counter(), _cpu()
    raw = load_dataset("parquet", data_files=corpus, split="train", cache_dir=cache)
    tokenized = raw.map(
        lambda ex: tok(ex["text"]),
        batched=True,
        remove_columns=["text"],
        num_proc=workers if workers > 1 else None,
    )

    def group_texts(examples):
        concatenated = {k: sum(examples[k], []) for k in examples}
        total = len(concatenated["input_ids"]) // block * block
        result = {k: [v[i : i + block] for i in range(0, total, block)] for k, v in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    grouped = tokenized.map(group_texts, batched=True, num_proc=workers if workers > 1 else None)
    seconds, cpu = time.perf_counter() - t, _cpu() - c
    tokens = sum(len(x) for x in tokenized["input_ids"])
    return {
        "seconds": seconds,
        "cpu": cpu,
        "tokens": tokens,
        "rows": len(grouped),
        "peak_rss_mb": _peak_rss_mb(),
    }


def child_tokenizer(corpus: str, tokenizer: str) -> dict:
    """The floor: the fast tokenizer's batched encode over texts already in memory (ids as lists)."""
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    texts = pd.read_parquet(corpus)["text"].tolist()
    backend = tok._tokenizer
    t, c = time.perf_counter(), _cpu()
    tokens = 0
    for i in range(0, len(texts), 1000):
        tokens += sum(
            len(e.ids) for e in backend.encode_batch_fast(texts[i : i + 1000], add_special_tokens=False)
        )
    return {"seconds": time.perf_counter() - t, "cpu": _cpu() - c, "tokens": tokens}


def run_child(*args: str) -> dict:
    """Each measurement in a fresh interpreter, so peak RSS and caches belong to it alone."""
    env = dict(os.environ)
    env.pop("TOKENIZERS_PARALLELISM", None)  # every contender may use the tokenizer's own threads
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=20.0, help="corpus size for the throughput comparison (MB)")
    p.add_argument("--big-mb", type=float, default=80.0, help="second corpus size for the memory check (MB)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the sample tokenizer)")
    p.add_argument("--workers", type=int, default=1, help="worker processes for kit and datasets.map")
    p.add_argument("--repeat", type=int, default=2, help="runs per contender (best is kept)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        what, *rest = args.child
        fn = {"kit": child_kit, "hf": child_hf_recipe, "tok": child_tokenizer}[what]
        conv = [int(x) if x.isdigit() else x for x in rest]
        print(json.dumps(fn(*conv)))
        return 0

    from kit.samples import sample_tokenizer_dir

    tokenizer = args.tokenizer or str(sample_tokenizer_dir())
    w = str(args.workers)
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        tmp = Path(tmp)
        small, big = tmp / "small.parquet", tmp / "big.parquet"
        mb_small = make_corpus(small, args.mb) / 1e6
        mb_big = make_corpus(big, args.big_mb, seed=1) / 1e6
        print(
            f"corpus: {mb_small:.1f} MB and {mb_big:.1f} MB of text; tokenizer {tokenizer}; "
            f"workers {args.workers}; {os.cpu_count()} CPUs"
        )
        # the machine is shared: run the contenders alternately and keep each one's best of `--repeat`
        runs = {"floor": [], "recipe": [], "kit": []}
        for i in range(args.repeat):
            runs["floor"].append(run_child("tok", str(small), tokenizer))
            runs["recipe"].append(run_child("hf", str(small), str(tmp / f"hf_cache{i}"), tokenizer, w))
            runs["kit"].append(run_child("kit", str(small), str(tmp / "out_small"), tokenizer, w))
        # best wall time and best CPU time of each contender, taken separately
        floor, recipe, kit_small = (
            {**min(runs[k], key=lambda r: r["seconds"]), "cpu": min(r["cpu"] for r in runs[k])}
            for k in ("floor", "recipe", "kit")
        )
        print(f"uptime load during the runs: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        kit_big = run_child("kit", str(big), str(tmp / "out_big"), tokenizer, w)

    def rate(r, key="seconds"):
        return r["tokens"] / r[key]

    print(
        f"\n{'contender':44s} {'tokens':>10s} {'wall s':>7s} {'cpu s':>7s} {'tokens/s':>10s} {'tok/cpu-s':>10s}"
    )
    for name, r in (
        ("tokenizer alone (floor, b)", floor),
        ("HF recipe: map + group_texts (a)", recipe),
        ("kit.data prepare (HF + Megatron files)", kit_small),
        (f"kit.data prepare at {mb_big:.0f} MB", kit_big),
    ):
        print(
            f"{name:44s} {r['tokens']:10d} {r['seconds']:7.2f} {r['cpu']:7.2f} {rate(r):10.0f} "
            f"{rate(r, 'cpu'):10.0f}"
        )
    print("\nratios of tokens/s (wall clock; the machine may be shared) and of tokens per CPU-second:")
    for name, base, goal in (("HF recipe (a)", recipe, 1.5), ("tokenizer alone (b)", floor, 0.8)):
        print(
            f"  kit.data vs {name:22s} wall {rate(kit_small) / rate(base):5.2f}x   "
            f"cpu {rate(kit_small, 'cpu') / rate(base, 'cpu'):5.2f}x   (goal >= {goal}x)"
        )
    print(
        f"  kit.data at {mb_big:.0f} MB vs tokenizer alone at {mb_small:.0f} MB: "
        f"wall {rate(kit_big) / rate(floor):5.2f}x   cpu {rate(kit_big, 'cpu') / rate(floor, 'cpu'):5.2f}x "
        f"(fixed costs amortised)"
    )
    print(
        f"\npeak RSS kit.data: {kit_small['peak_rss_mb']:.0f} MB at {mb_small:.0f} MB of text, "
        f"{kit_big['peak_rss_mb']:.0f} MB at {mb_big:.0f} MB of text "
        f"(ratio {kit_big['peak_rss_mb'] / kit_small['peak_rss_mb']:.2f}x for {mb_big / mb_small:.1f}x the text)"
    )
    print(
        f"peak RSS HF recipe at {mb_small:.0f} MB: {recipe['peak_rss_mb']:.0f} MB "
        f"({recipe['peak_rss_mb'] / kit_small['peak_rss_mb']:.2f}x kit.data)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
