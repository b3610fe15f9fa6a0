"""Checkpoint benchmark on CPU: the kit's verified checkpoints against DeepSpeed's own save and load.

The kit's `checkpoint.save` adds to DeepSpeed's `engine.save_checkpoint` the RNG file, a CRC-32 of every file (read
back once from the page cache), an fsync of every file and folder and the `latest` markers; `checkpoint.load` verifies
every CRC before `engine.load_checkpoint`. The save baseline fsyncs DeepSpeed's files too (a checkpoint that a power
cut can empty is not the thing compared); DeepSpeed's bare save time is printed beside it. Same engine (a Llama from transformers' config class, fp32, ZeRO 0 on one
CPU rank, AdamW: model + two moments per parameter), same folder, alternated and best of --repeats.
Each figure prints `train | <figure> | <ratio>x | goal <goal> | MET/MISSED/-` (ratio = DeepSpeed's time / the kit's:
1.0 means no cost) and the baseline's code under it.

Run: .venv/bin/python benchmarks/bench_checkpoint.py [--quick] [--hidden 512 --layers 8 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SAVE_GOAL, LOAD_GOAL = 0.8, 0.8  # the checksums may cost up to a quarter of DeepSpeed's own (durable) time


def engine_for(hidden: int, layers: int):
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kit.system.device import detect
    from kit.train import engine as eng

    eng.init_distributed(detect())
    eng.quiet_deepspeed()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    model = LlamaForCausalLM(cfg)
    conf = {"train_batch_size": 1, "zero_optimization": {"stage": 0}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), optimizer=torch.optim.AdamW, config=conf
    )
    # one step, so the optimizer has its two moments (what a real checkpoint holds)
    ids = torch.randint(0, 32000, (1, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine, sum(p.numel() for p in model.parameters())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model (about 40M parameters)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers = 512, 4
    from kit.train import checkpoint as ck

    engine, params = engine_for(args.hidden, args.layers)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    times = {"ds_bare": [], "ds_save": [], "kit_save": [], "ds_load": [], "kit_load": []}
    try:
        for _ in range(args.repeats):
            shutil.rmtree(root / "ds", ignore_errors=True)
            t = time.perf_counter()
            engine.save_checkpoint(str(root / "ds"), tag="iter_0000001", save_latest=False)
            times["ds_bare"].append(time.perf_counter() - t)
            for p in (root / "ds").rglob("*"):
                if p.is_file():
                    fd = os.open(p, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
            times["ds_save"].append(time.perf_counter() - t)
            shutil.rmtree(root / "kit", ignore_errors=True)  # both write into a fresh folder
            t = time.perf_counter()
            ck.save(engine, root / "kit", 1, {"iteration": 1, "consumed_samples": 1})
            times["kit_save"].append(time.perf_counter() - t)
            t = time.perf_counter()
            engine.load_checkpoint(str(root / "ds"), tag="iter_0000001")
            times["ds_load"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ck.load(engine, root / "kit")
            times["kit_load"].append(time.perf_counter() - t)
        size = sum(p.stat().st_size for p in (root / "kit" / "iter_0000001").rglob("*") if p.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    print(
        f"checkpoint of {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB, in {root.parent}",
        file=sys.stderr,
    )
    for what, goal, base_code in (
        ("save", SAVE_GOAL, "engine.save_checkpoint(dir, tag=tag, save_latest=False); os.fsync each file"),
        ("load", LOAD_GOAL, "engine.load_checkpoint(dir, tag=tag)  # nothing verified"),
    ):
        ratio = best[f"ds_{what}"] / best[f"kit_{what}"]
        verdict = "MET" if ratio >= goal else "MISSED"
        print(f"train | checkpoint {what} with CRC-32 per file | {ratio:.2f}x | goal >= {goal}x | {verdict}")
        bare = f", {best['ds_bare']:.2f} s without the fsync" if what == "save" else ""
        print(
            f"    kit {best[f'kit_{what}']:.2f} s vs DeepSpeed {best[f'ds_{what}']:.2f} s{bare}, "
            f"{size / 2**20:.0f} MiB (best of {args.repeats}; {os.cpu_count()} CPUs)"
        )
        print(f"    baseline: {base_code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
