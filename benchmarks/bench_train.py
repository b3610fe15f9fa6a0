"""Training benchmark (CPU-sized, ratios from one run).

1. Kit trainer step time vs a plain DeepSpeed loop over the same model, config and batches (goal: >= 0.95x).
2. Adapted (kit ops) vs unadapted model in the same trainer (on CPU this shows the overhead of the kit ops'
   torch fallbacks; on NPU the fused ops are where the speed-up lives).
3. Packed SFT vs padded-per-dialog SFT on the shipped Alpaca sample: useful (non-padding) tokens/s (goal >= 1.5x).

Every figure is the median over steps after warm-up, best of REPEATS runs interleaved A/B/A/B, because the
machine may be shared. Run: .venv/bin/python benchmarks/bench_train.py [--steps 12 --seq-len 128 --repeats 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path


def median_after_warmup(times: list, warmup: int = 2) -> float:
    return statistics.median(times[warmup:] if len(times) > warmup + 1 else times)


def kit_step_ms(cfg) -> tuple:
    """(median wall ms per step incl. all trainer overhead, median useful tokens/s) of one kit trainer run."""
    from kit.train import Trainer
    from kit.train.metrics import read_metrics

    stamps = []
    trainer = Trainer(
        dataclasses.replace(cfg, overwrite=True),
        step_callbacks=[lambda it: stamps.append(time.perf_counter())],
        progress=False,
        echo=False,
    )
    result = trainer.train()
    steps = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    useful = [r["useful_tokens_per_s"] for r in read_metrics(result.metrics_path)][-cfg.train_iters :]
    return median_after_warmup(steps, 1), median_after_warmup(useful, 1)


def plain_step_ms(cfg) -> float:
    """Median ms per step of a bare DeepSpeed loop: same model, ds_config, optimizer, schedule and batches."""
    import torch

    from kit.device import detect
    from kit.train import engine as eng
    from kit.train.data import load_dataset, micro_batches

    eng.init_distributed(detect())
    ds, _ = load_dataset(cfg.dataset_path)
    model, _ = eng.build_model(cfg)
    engine = eng.build_engine(cfg, model, "float32")
    times = []
    for it in range(cfg.train_iters):
        t0 = time.perf_counter()
        for batch in micro_batches(ds, it, cfg, 0):
            loss = engine(**{k: v.to(torch.long) for k, v in batch.items()}).loss
            engine.backward(loss)
            engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    return median_after_warmup(times, 2)


def best(fn, cfgs: dict, repeats: int) -> dict:
    """Run each config `repeats` times, interleaved, and keep each one's best (lowest) step time."""
    out = {name: [] for name in cfgs}
    for _ in range(repeats):
        for name, cfg in cfgs.items():
            out[name].append(fn(cfg))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()

    import logging

    from kit.data import DataConfig, prepare
    from kit.samples import tiny_llama
    from kit.train import TrainConfig
    from kit.workspace import get_workspace

    logging.getLogger("transformers").setLevel(logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    ws = get_workspace(tmp / "ws", model="bench")
    model = tiny_llama(
        tmp / "model", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688
    )
    seq = args.seq_len

    def data(kind: str, pack: bool = True) -> str:
        cfg = DataConfig(
            kind=kind,
            name=f"{kind}_{'packed' if pack else 'padded'}",
            tokenizer=str(model),
            max_length=seq,
            template="tokenizer",
            pack=pack,
            megatron=False,
        )
        return str(prepare(cfg, ws, progress=False).hf_dir)

    pretrain, sft_packed, sft_padded = data("pretrain"), data("sft", True), data("sft", False)
    base = TrainConfig(
        run_type="pretrain",
        model_type="bench",
        model_path=str(model),
        dataset_path=pretrain,
        work_dir=str(ws.root),
        train_iters=args.steps,
        mbs=2,
        gbs=4,
        lr=1e-3,
        save_hf=False,
        adapt=False,
    )

    print(
        f"model: tiny Llama hidden 256, 4 layers, GQA 8/4 heads; SEQ_LEN={seq}, MBS=2, GBS=4, "
        f"{args.steps} steps, best of {args.repeats} interleaved runs; CPU fp32, ZeRO 0\n"
    )

    # 1. kit trainer vs plain DeepSpeed loop
    kit_ms, plain_ms = [], []
    for _ in range(args.repeats):
        kit_ms.append(kit_step_ms(base)[0])
        plain_ms.append(plain_step_ms(base))
    k, p = min(kit_ms), min(plain_ms)
    print(
        f"1. step time: plain DeepSpeed loop {p:.1f} ms, kit trainer {k:.1f} ms "
        f"-> kit throughput = {p / k:.3f}x the plain loop (goal >= 0.95x)"
    )

    # 2. adapted vs unadapted
    runs = best(
        lambda c: kit_step_ms(c)[0],
        {"plain HF": base, "adapted": dataclasses.replace(base, adapt=True)},
        args.repeats,
    )
    u, a = min(runs["plain HF"]), min(runs["adapted"])
    print(
        f"2. step time: unadapted {u:.1f} ms, adapted (kit ops) {a:.1f} ms "
        f"-> adapted throughput = {u / a:.3f}x unadapted (CPU: kit ops' torch fallbacks)"
    )

    # 3. packed vs padded SFT, useful tokens/s
    sft = dataclasses.replace(base, run_type="sft", adapt=True)
    useful = best(
        lambda c: kit_step_ms(c)[1],
        {
            "padded": dataclasses.replace(sft, dataset_path=sft_padded),
            "packed": dataclasses.replace(sft, dataset_path=sft_packed),
        },
        args.repeats,
    )
    pad, pack = max(useful["padded"]), max(useful["packed"])
    print(
        f"3. useful tokens/s: padded per dialog {pad:.0f}, packed {pack:.0f} "
        f"-> packed = {pack / pad:.2f}x padded (goal >= 1.5x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
