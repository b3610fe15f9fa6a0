"""Training benchmark on CPU: the kit trainer against what users run instead, same model, data, batch, fp32.

Baselines, measured in this run on the same tiny Llama (GQA), the shipped Alpaca sample and the same dialogs in the
same order (the kit's seeded order, fed to HF with its sequential sampler):
- HF `transformers.Trainer` (the engine under LLaMA-Factory): padded SFT with `DataCollatorForSeq2Seq` (pad to the
  longest in the batch, as LLaMA-Factory does); packed SFT with HF's own padding-free packing
  `DataCollatorWithFlattening` (as many dialogs per micro-batch as the kit's MBS packed rows hold, so both see the
  same tokens per step); fixed-length pretraining rows (identical batches: trainer overhead only);
- a plain DeepSpeed loop (engine(**batch); backward; step) over the kit's own config and batches.

Throughput = real (non-padding) tokens of the timed steps / their CPU time, each step timed from the end of the
previous one (data loading, logging and callbacks included, on both sides). Each side trains on one torch thread
(--threads), so tokens per CPU-second is tokens/s on an idle core, which other processes on a shared machine do not
move; the wall-clock ratio is printed beside it. The kit and HF run in two long-lived worker processes of their own
(HF Trainer in a process where torch.distributed is initialised wraps the model in DDP, which would slow the
baseline down), driven alternately (A B C ... A B C ...) >= 3 times, the identical-batch runs 2 times more (see
OVERHEAD_RUNS); every repeat trains the same batches, so each step keeps its fastest repeat (load bursts hit different
steps each time).
Each figure prints `train | <figure> | <ratio>x | goal <goal> | MET/MISSED/-` and the baseline's code under it.

Run: .venv/bin/python benchmarks/bench_train.py [--quick] [--steps 16 --seq-len 256 --repeats 3 --threads 1]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import logging
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 2  # steps not timed: first-step allocations, lazy imports, the optimizer's state creation
RESULT = (
    "@@bench-result "  # prefix of a worker's answer on stdout (HF Trainer prints its own lines there too)
)

HF_ARGS = (
    "TrainingArguments(per_device_train_batch_size={b}, gradient_accumulation_steps={ga}, max_steps={steps}, "
    "learning_rate={lr}, lr_scheduler_type='cosine', adam_beta2=0.95, max_grad_norm=1.0, use_cpu=True, "
    "save_strategy='no', report_to='none', train_sampling_strategy='sequential')"
)
HF_MODEL = "Trainer(AutoModelForCausalLM.from_pretrained(model), " + HF_ARGS
BASELINES = {
    "hf_flat": HF_MODEL + ", train_dataset=dialogs, data_collator=DataCollatorWithFlattening()).train()"
    "  # HF's padding-free packing; sdpa gets a block-causal mask from the restarting position_ids",
    "hf_padded": HF_MODEL + ", train_dataset=dialogs, "
    "data_collator=DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8)).train()",
    "hf_pretrain": HF_MODEL + ", train_dataset=rows, data_collator=default_data_collator).train()"
    "  # the kit's rows in the kit's order",
    "plain": "engine = deepspeed.initialize(model, AdamW, LambdaLR, <kit ds_config>)[0]; per micro-batch: "
    "engine.backward(engine(**batch).loss); engine.step()",
    "kit_padded": "kit.train.train(TrainConfig(run_type='sft', dataset_path=<kit.data pack=False>, "
    "mbs={mbs}, gbs={gbs}))",
    "kit_unadapted": "kit.train.train(TrainConfig(run_type='sft', adapt=False, ...))  # the plain HF model",
}
KIT_RUNS = ("kit_packed", "kit_padded", "kit_pretrain", "plain", "kit_unadapted")
HF_RUNS = ("hf_flat", "hf_padded", "hf_pretrain")
# The identical-batch runs measure the trainers' overhead (about 1% of a step) against a goal 5% below parity. Their
# noise comes in whole runs: a run that falls in a quieter stretch of the shared machine is faster at every step, so
# longer runs do not average it out and more alternated repeats do. Resampled from 8 alternated kit/plain runs of 16
# steps (load 3-6): the ratio's standard deviation is 0.054 with 3 repeats of 5 timed steps, 0.043 with 3 of 13,
# 0.035 with 5 of 5. They are short runs, so they get the extra repeats.
OVERHEAD_RUNS = ("kit_pretrain", "hf_pretrain", "plain")
OVERHEAD_EXTRA_REPEATS = 2


def stamp() -> tuple:
    """(wall, CPU) seconds now; CPU time counts every thread of the process (TensorBoard's writer included)."""
    return time.perf_counter(), time.process_time()


def per_step(stamps: list, tokens: list) -> dict:
    """Wall and CPU seconds and real tokens of each timed step (WARMUP+1..N) from step-end stamps."""
    n = len(stamps)
    if n < WARMUP + 2 or len(tokens) < n:
        raise RuntimeError(f"need at least {WARMUP + 2} steps to time (got {n} stamps, {len(tokens)} counts)")
    steps = range(WARMUP + 1, n)
    return {
        "wall": [stamps[i][0] - stamps[i - 1][0] for i in steps],
        "cpu": [stamps[i][1] - stamps[i - 1][1] for i in steps],
        "tokens": [int(tokens[i]) for i in steps],
    }


def best_of(runs: list) -> dict:
    """Combine repeats of one run: each step's fastest repeat (load bursts hit different steps in each repeat).

    The repeats train the same batches in the same order, so step i of every repeat does the same work.
    """
    tokens = runs[0]["tokens"]
    if any(r["tokens"] != tokens for r in runs):
        raise RuntimeError("repeats of one run saw different batches; the comparison would be meaningless")
    wall = sum(min(r["wall"][i] for r in runs) for i in range(len(tokens)))
    cpu = sum(min(r["cpu"][i] for r in runs) for i in range(len(tokens)))
    return {
        "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / wall,
        "tokens_per_cpu_s": sum(tokens) / cpu,
        "step_ms": wall / len(tokens) * 1000.0,
        "cpu_step_ms": cpu / len(tokens) * 1000.0,
    }


def summary(run: dict) -> dict:
    """One repeat's totals, for the progress lines."""
    return best_of([run])


# ---- the kit worker --------------------------------------------------------------------------------------------
def kit_config(spec: dict, name: str):
    from kit.train import TrainConfig

    base = TrainConfig(
        run_type="pretrain",
        model_name="bench",
        model_path=spec["model"],
        dataset_path=spec["pretrain"],
        work_dir=spec["work_dir"],
        train_iters=spec["steps"],
        mbs=spec["mbs"],
        gbs=spec["gbs"],
        lr=spec["lr"],
        seed=spec["seed"],
        save_hf=False,
        adapt=False,
        overwrite=True,
    )
    sft = dataclasses.replace(
        base, run_type="sft", adapt=True
    )  # the kit's default SFT: kit ops, varlen attention
    return {
        "kit_packed": dataclasses.replace(sft, dataset_path=spec["sft_packed"]),
        "kit_padded": dataclasses.replace(sft, dataset_path=spec["sft_padded"]),
        "kit_unadapted": dataclasses.replace(sft, dataset_path=spec["sft_padded"], adapt=False),
        "kit_pretrain": base,
        "plain": base,
    }[name]


def kit_run(cfg, profile: bool = False) -> dict:
    """One kit trainer run in this process, as a notebook cell runs it; optionally under cProfile."""
    from kit.train import Trainer
    from kit.train.metrics import read_metrics
    from kit.train.resolve import resolve

    stamps = []
    trainer = Trainer(
        resolve(cfg), step_callbacks=[lambda it: stamps.append(stamp())], progress=False, echo=False
    )
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    result = trainer.train()
    if prof:
        prof.disable()
    tokens = [r["real_tokens"] for r in read_metrics(result.metrics_path)][-cfg.train_iters :]
    out = per_step(stamps, tokens)
    if prof:
        for key in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(18)
            out[f"profile_{key}"] = text.getvalue()
    return out


def plain_run(cfg) -> dict:
    """A bare DeepSpeed loop: same model, ds_config, optimizer, schedule and micro-batches as the kit trainer."""
    import torch

    from kit.system.device import detect
    from kit.train import engine as eng
    from kit.train.batches import load_dataset, micro_batches, tokens_in

    eng.init_distributed(detect())
    ds, _ = load_dataset(cfg.dataset_path)
    model, _ = eng.build_model(cfg)
    engine = eng.build_engine(cfg, model, "float32")  # the trainer's engine: same AdamW kernel, same clipping
    stamps, tokens = [], []
    for it in range(cfg.train_iters):
        n = 0
        for batch in micro_batches(ds, it, cfg, 0):
            batch = {k: v.to(torch.long) for k, v in batch.items()}
            engine.backward(engine(**batch).loss)
            engine.step()
            n += tokens_in(batch)
        stamps.append(stamp())
        tokens.append(n)
    return per_step(stamps, tokens)


def kit_worker(spec: dict):
    from kit.train.engine import quiet_deepspeed

    quiet_deepspeed()

    def run(name: str, profile: bool = False) -> dict:
        cfg = kit_config(spec, name)
        return plain_run(cfg) if name == "plain" else kit_run(cfg, profile)

    return run


# ---- the HF Trainer worker -------------------------------------------------------------------------------------
def kit_order(n: int, steps: int, per_step: int, seed: int) -> list:
    """Sample indices in the kit's order (seeded permutation per epoch), `per_step` samples per optimizer step."""
    from kit.train.batches import global_batch_indices

    return [i for it in range(steps) for i in global_batch_indices(it, per_step, n, seed)]


def unpadded_dialogs(padded_dir: str) -> list:
    """The kit's one-dialog-per-row SFT rows without their padding: the same token ids and labels per dialog."""
    import datasets

    ds = datasets.load_from_disk(padded_dir).with_format(
        None
    )  # the HF side reads the Arrow folder as HF would
    out = []
    for ids, labels, mask in zip(ds["input_ids"], ds["labels"], ds["attention_mask"]):
        n = sum(mask)
        out.append({"input_ids": list(ids[:n]), "labels": list(labels[:n])})
    return out


def hf_run(spec: dict, examples: list, collator, b: int) -> dict:
    """HF Trainer over `examples` in the given order (sequential sampler), timed by a step-end callback."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    stamps, counts, ga = [], [], spec["gbs"] // spec["mbs"]

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(stamp())

    def counting(features):
        batch = collator(features)
        mask = batch.get("attention_mask")
        counts.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.config.use_cache = False
    with tempfile.TemporaryDirectory(prefix="hf_trainer_") as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=b,
            gradient_accumulation_steps=ga,
            max_steps=spec["steps"],
            learning_rate=spec["lr"],
            lr_scheduler_type="cosine",
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_epsilon=1e-8,
            weight_decay=0.0,
            max_grad_norm=1.0,
            use_cpu=True,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=spec["seed"],
            train_sampling_strategy="sequential",
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(examples),
            data_collator=counting,
            callbacks=[Stamp()],
        )
        trainer.train()
    # micro-batches arrive in order (accelerate may fetch one ahead: only the prefix is used)
    tokens = [sum(counts[s * ga : (s + 1) * ga]) for s in range(len(stamps))]
    return per_step(stamps, tokens)


def hf_worker(spec: dict):
    import datasets
    from transformers import (
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        default_data_collator,
    )

    steps, gbs, seed = spec["steps"], spec["gbs"], spec["seed"]
    dialogs = unpadded_dialogs(spec["sft_padded"])
    rows = datasets.load_from_disk(spec["pretrain"]).with_format(None)
    keep = ("input_ids", "labels", "attention_mask")
    pre_rows = [{k: rows[i][k] for k in keep} for i in kit_order(len(rows), steps, gbs, seed)]
    flat_b = spec["flat_b"]
    ga = gbs // spec["mbs"]
    flat = [dialogs[i] for i in kit_order(len(dialogs), steps, flat_b * ga, seed)]
    padded = [dialogs[i] for i in kit_order(len(dialogs), steps, gbs, seed)]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    seq2seq = DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8, label_pad_token_id=-100)
    runs = {
        "hf_flat": lambda: hf_run(spec, flat, DataCollatorWithFlattening(), flat_b),
        "hf_padded": lambda: hf_run(spec, padded, seq2seq, spec["mbs"]),
        "hf_pretrain": lambda: hf_run(spec, pre_rows, default_data_collator, spec["mbs"]),
    }
    return lambda name, profile=False: runs[name]()


def worker_main(kind: str, spec_path: str) -> int:
    """Serve run requests (one JSON line each on stdin) until stdin closes; answer on stdout."""
    import torch
    import transformers

    for name in ("transformers", "accelerate", "DeepSpeed", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    run = kit_worker(spec) if kind == "kit" else hf_worker(spec)
    print(RESULT + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = run(req["run"], req.get("profile", False))
            out["threads"] = torch.get_num_threads()  # accelerate may change it: report what the run had
        except Exception as exc:  # the orchestrator reports it and stops; the traceback goes to stderr
            import traceback

            traceback.print_exc()
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(RESULT + json.dumps(out), flush=True)
    return 0


class Worker:
    """A long-lived `bench_train.py --worker KIND` process."""

    def __init__(self, kind: str, spec_path: Path, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.kind = kind
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--spec", str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                out = json.loads(line[len(RESULT) :])
                if "error" in out:
                    raise RuntimeError(f"{self.kind} worker: {out['error']}")
                return out
        raise RuntimeError(f"the {self.kind} worker exited ({self.proc.wait()}); its traceback is above")

    def run(self, name: str, profile: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"run": name, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


# ---- the orchestrator ------------------------------------------------------------------------------------------
def prepare_inputs(tmp: Path, seq: int) -> dict:
    """The tiny model and the three prepared datasets (kit.data), in a temporary workspace."""
    import datasets

    from kit.core.samples import tiny_llama
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare

    ws = get_workspace(tmp / "ws", model="bench")
    model = tiny_llama(
        tmp / "model", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688
    )

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

    spec = {
        "model": str(model),
        "work_dir": str(ws.root),
        "pretrain": data("pretrain"),
        "sft_packed": data("sft", True),
        "sft_padded": data("sft", False),
    }
    spec["dialogs"] = len(datasets.load_from_disk(spec["sft_padded"]))
    spec["packed_rows"] = len(datasets.load_from_disk(spec["sft_packed"]))
    return spec


def figure(name: str, kit: dict, base: dict, goal, baseline: str, key: str = "tokens") -> float:
    """Print one figure line (kit / baseline, higher is better) and the baseline's code under it.

    The ratio is of CPU time: each side trains on one torch thread, so tokens per CPU-second is tokens/s on an idle
    core, and other processes on a shared machine do not move it (wall-clock ratios under a load average of 10 on
    2 cores scatter by +-40%). The wall-clock ratio is printed beside it.
    """
    if key == "step":
        ratio, wall_ratio = base["cpu_step_ms"] / kit["cpu_step_ms"], base["step_ms"] / kit["step_ms"]
        detail = (
            f"kit {kit['cpu_step_ms']:.1f} CPU-ms/step, baseline {base['cpu_step_ms']:.1f} CPU-ms/step; "
            f"wall {kit['step_ms']:.1f} vs {base['step_ms']:.1f} ms/step = {wall_ratio:.2f}x"
        )
    else:
        ratio = kit["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
        wall_ratio = kit["tokens_per_s"] / base["tokens_per_s"]
        detail = (
            f"kit {kit['tokens_per_cpu_s']:.0f}, baseline {base['tokens_per_cpu_s']:.0f} real tokens/CPU-s; "
            f"wall {kit['tokens_per_s']:.0f} vs {base['tokens_per_s']:.0f} real tokens/s = {wall_ratio:.2f}x"
        )
    verdict = "-" if goal is None else ("MET" if ratio >= goal else "MISSED")
    print(f"train | {name} | {ratio:.2f}x | goal {'-' if goal is None else f'>= {goal}x'} | {verdict}")
    print(f"    {detail}")
    print(f"    baseline: {baseline}")
    if goal is not None:  # the wall-clock ratio too, in the table: waits off the CPU are a real cost
        print(
            f"train | same, wall clock (disturbed by other processes' load) | {wall_ratio:.2f}x | goal - | -"
        )
        print(f"    baseline: {baseline}")
    return ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="short configuration: 8 steps (about 2 minutes on 2 cores)"
    )
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 16; --quick 8)")
    ap.add_argument(
        "--seq-len", type=int, default=None, help="SEQ_LEN of the prepared data (256, also with --quick)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternated repeats per run, >= 3 (the best counts; +2 for the identical-batch runs)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of both sides (1: ratios least disturbed by load)",
    )
    ap.add_argument("--profile", action="store_true", help="always cProfile one kit packed-SFT run")
    ap.add_argument("--worker", choices=["kit", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker, args.spec)
    steps = args.steps or (8 if args.quick else 16)
    # --quick keeps SEQ_LEN 256: at 128 a packed row holds 3.7 dialogs instead of 7.2, and packing's gain over the
    # kit's padded rows (also trained padding-free, so only the per-step cost is shared by fewer tokens) shrinks
    seq = args.seq_len or 256
    if steps < WARMUP + 3:
        ap.error(f"--steps must be at least {WARMUP + 3}")
    repeats = max(3, args.repeats)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    spec = prepare_inputs(tmp, seq)
    mbs, gbs = 2, 4
    per_row = spec["dialogs"] / spec["packed_rows"]
    spec.update(
        steps=steps,
        mbs=mbs,
        gbs=gbs,
        lr=1e-3,
        seed=1234,
        threads=args.threads,
        # HF flattening: as many dialogs per micro-batch as MBS packed rows of the kit hold (same tokens per step)
        flat_b=max(1, round(mbs * per_row)),
    )
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    import torch
    import transformers

    print(
        f"model: tiny Llama hidden 256, 4 layers, GQA 8/4 heads; SEQ_LEN={seq}, MBS={mbs}, GBS={gbs}, {steps} steps "
        f"({WARMUP} untimed), best of {repeats} alternated repeats ({repeats + OVERHEAD_EXTRA_REPEATS} for "
        f"{', '.join(OVERHEAD_RUNS)}); CPU fp32, ZeRO 0, {args.threads} torch "
        f"thread(s) per side; torch {torch.__version__}, transformers {transformers.__version__}"
    )
    print(
        f"data: {spec['dialogs']} Alpaca dialogs -> {spec['packed_rows']} packed rows ({per_row:.2f} dialogs/row); "
        f"HF flattening takes {spec['flat_b']} dialogs per micro-batch (the tokens of {mbs} packed rows)\n",
        flush=True,
    )

    names = ["kit_packed", "hf_flat", "kit_padded", "hf_padded", "kit_pretrain", "hf_pretrain", "plain"]
    if not args.quick:
        names.append("kit_unadapted")
    workers = {"kit": Worker("kit", spec_path, args.threads), "hf": Worker("hf", spec_path, args.threads)}
    got = {n: [] for n in names}
    runs = {n: repeats + (OVERHEAD_EXTRA_REPEATS if n in OVERHEAD_RUNS else 0) for n in names}
    try:
        for rep in range(max(runs.values())):
            for name in (n for n in names if rep < runs[n]):
                t0 = time.perf_counter()
                got[name].append(workers["kit" if name in KIT_RUNS else "hf"].run(name))
                r = dict(summary(got[name][-1]), threads=got[name][-1]["threads"])
                print(
                    f"  [{rep + 1}/{runs[name]}] {name:<14} {r['tokens_per_s']:8.0f} tokens/s {r['step_ms']:8.1f} "
                    f"ms/step  (run {time.perf_counter() - t0:.1f} s, {r['threads']} thread(s))",
                    file=sys.stderr,
                    flush=True,
                )
        best = {n: best_of(rs) for n, rs in got.items()}
        fmt = dict(b=spec["flat_b"], ga=gbs // mbs, steps=steps, lr=spec["lr"], mbs=mbs, gbs=gbs)
        fmt_mbs = dict(fmt, b=mbs)
        for n, r in best.items():
            print(
                f"  {n:<14} {r['tokens_per_s']:9.0f} tokens/s {r['step_ms']:8.1f} ms/step   "
                f"{r['tokens_per_cpu_s']:9.0f} tokens/CPU-s {r['cpu_step_ms']:8.1f} CPU-ms/step  ({r['tokens']} timed)"
            )
        print()
        vs_hf = [
            figure(
                "kit SFT packed vs HF Trainer packed (DataCollatorWithFlattening), real tokens per CPU-s",
                best["kit_packed"],
                best["hf_flat"],
                1.0,
                BASELINES["hf_flat"].format(**fmt),
            ),
            figure(
                "kit SFT packed vs HF Trainer padded SFT (pad to longest), real tokens per CPU-s",
                best["kit_packed"],
                best["hf_padded"],
                1.0,
                BASELINES["hf_padded"].format(**fmt_mbs),
            ),
        ]
        # Same model, rows, order and optimizer on both sides: only what each trainer adds around forward, backward
        # and AdamW differs (the kit: DeepSpeed's engine step, about 1 ms a step here), so this is an overhead check
        # with the same goal as the plain DeepSpeed loop's; per-repeat ratios scatter 0.91-1.08x on this machine.
        figure(
            "kit trainer vs HF Trainer, identical pretraining batches (trainer overhead), tokens per CPU-s",
            best["kit_pretrain"],
            best["hf_pretrain"],
            0.95,
            BASELINES["hf_pretrain"].format(**fmt_mbs),
        )
        figure(
            "kit SFT packed vs kit SFT padded (one dialog per row), real tokens per CPU-s",
            best["kit_packed"],
            best["kit_padded"],
            1.5,
            BASELINES["kit_padded"].format(**fmt),
        )
        figure(
            "kit SFT padded (rows padded to SEQ_LEN, trained padding-free) vs HF Trainer padded SFT (pad to longest), real tokens per CPU-s",
            best["kit_padded"],
            best["hf_padded"],
            None,
            BASELINES["hf_padded"].format(**fmt_mbs),
        )
        figure(
            "kit trainer vs plain DeepSpeed loop, identical batches, CPU time per step",
            best["kit_pretrain"],
            best["plain"],
            0.95,
            BASELINES["plain"],
            key="step",
        )
        if "kit_unadapted" in best:
            figure(
                "kit SFT padded, adapted (kit ops) vs unadapted, real tokens per CPU-s (the ops' torch fallbacks)",
                best["kit_padded"],
                best["kit_unadapted"],
                None,
                BASELINES["kit_unadapted"],
            )
        if args.profile or min(vs_hf) < 1.0:
            prof = workers["kit"].run("kit_packed", profile=True)
            print(
                "\nwhere a kit packed-SFT run spends its time (cProfile; set-up and checkpoint save included):"
            )
            print(prof["profile_tottime"])
            print(prof["profile_cumulative"])
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)  # the prepared data and the workers' outputs (~35 MB)
    print(f"bench_train: {time.perf_counter() - t_start:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
