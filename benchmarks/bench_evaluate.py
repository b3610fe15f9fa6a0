"""Evaluation (notebook 06) against what users run instead, on the demo model (SmolLM2-135M-Instruct, fp32, CPU).

Baselines, measured in this process on the same loaded model and inputs, alternating with the kit, best of >= 3
repeats (the model is loaded once: loading is not timed on either side):
- multiple choice, the shipped tasks kit_mc_en + kit_mc_zh: EleutherAI lm-eval
  `lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, batch_size=B), tasks=[...])` (task building
  from the YAML included, as users run it) at batch size 1 (lm-eval's default) and 8, the faster of the two counted,
  vs `kit.evaluate.load_task` + `kit.evaluate.scoring.score_task` per task; both must give the same accuracy.
- held-out loss: HF `Trainer(model, TrainingArguments(per_device_eval_batch_size=B), eval_dataset=rows,
  data_collator=DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8)).evaluate()` (what LLaMA-Factory's
  `do_eval` runs; rows unpadded, padded per batch to the longest) at B = 8 (its default) and 2 (faster on this
  CPU), the faster counted, vs `kit.evaluate.scoring.heldout_loss` on the held-out split kit.data writes from the
  shipped Alpaca sample.
- speed (TTFT and decode tokens/s, `kit.evaluate.speed.measure`): HF `model.generate(ids, max_new_tokens=N+1,
  min_new_tokens=N+1, do_sample=False)` on the same random prompt (batch 4, 128 tokens, N = 32 decode steps): the
  kit's TTFT + N steps at its decode rate should be what generate() takes for the same tokens, neither more (the
  kit would understate the model's speed) nor less (it would promise what generate() does not deliver).
Ratio = baseline seconds / kit seconds (above 1: the kit is faster). Each figure prints one line
`evaluate | <figure> | <ratio>x | goal <goal> | MET/MISSED`, which benchmarks/run_all.py collects, and the
baseline's code under it.
Run: .venv/bin/python benchmarks/bench_evaluate.py [--quick] [--repeats 3] [--heldout 32]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TASKS = ("kit_mc_en", "kit_mc_zh")
LM_EVAL_CODE = (
    "lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok, batch_size={b}), tasks={tasks}, "
    "task_manager=TaskManager(include_path=<the tasks' YAML>))"
)
GENERATE_CODE = (
    "model.generate(ids, attention_mask=ones, max_new_tokens={n1}, min_new_tokens={n1}, do_sample=False)"
    "  # ids: {b} x {p} random tokens, as speed.measure draws them"
)
SPEED = (4, 128, 32)  # batch, prompt tokens, decode steps
HF_EVAL_CODE = (
    "Trainer(model, TrainingArguments(per_device_eval_batch_size={b}, use_cpu=True, report_to='none'), "
    "eval_dataset=rows, data_collator=DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8)).evaluate()"
)


def heldout_rows(model_dir: Path, work: Path, n: int):
    """The held-out split kit.data writes for the Alpaca sample (every 2nd record until n are held out)."""
    from datasets import load_from_disk

    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare

    cfg = DataConfig(
        kind="sft",
        name="bench_eval",
        tokenizer=str(model_dir),
        max_length=512,
        template="tokenizer",
        pack=False,
        megatron=False,
        heldout_records=n,
        heldout_every=2,
    )
    prepared = prepare(cfg, get_workspace(work / "ws", model="bench"), progress=False).prepared
    return load_from_disk(str(prepared.heldout["path"]))


def hf_eval_dataset(rows):
    """The rows as LLaMA-Factory hands them to Trainer: unpadded input_ids / attention_mask / labels."""
    from datasets import Dataset

    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for row in rows:
        n = int(sum(row["attention_mask"]))
        out["input_ids"].append(list(row["input_ids"][:n]))
        out["attention_mask"].append([1] * n)
        out["labels"].append(list(row["labels"][:n]))
    return Dataset.from_dict(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="short configuration for make bench (same work, 3 repeats)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="alternated repeats; the minimum counts (>= 3)")
    ap.add_argument("--heldout", type=int, default=32, help="held-out Alpaca records scored for the loss")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # lm-eval and Trainer log every call; the figures are the output

    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from kit.core.samples import demo_model_dir
    from kit.evaluate import load_task
    from kit.evaluate.scoring import heldout_loss, score_task
    from kit.evaluate.tasks import resolved_yaml
    from kit.system.hf_compat import load_causal_lm

    transformers.logging.set_verbosity_error()
    model_dir = demo_model_dir()
    work = Path(tempfile.mkdtemp(prefix="bench-evaluate-"))
    model = load_causal_lm(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tasks = [load_task(name) for name in TASKS]
    for task in tasks:
        resolved_yaml(task, work / "tasks")
    rows = heldout_rows(model_dir, work, args.heldout)
    hf_rows = hf_eval_dataset(rows)
    tokens = sum(int(sum(r["attention_mask"])) for r in rows)
    questions = sum(len(t.questions) for t in tasks)
    print(
        f"model: SmolLM2-135M-Instruct fp32 on CPU, {torch.get_num_threads()} torch threads; tasks {', '.join(TASKS)} "
        f"({questions} questions); held-out: {len(rows)} Alpaca rows, {tokens} tokens; best of {args.repeats} "
        f"alternated repeats; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"lm-eval {lm_eval.__version__}",
        flush=True,
    )

    found: dict = {}

    def kit_mc():  # the tasks read from their YAML inside the clock, as lm-eval builds its own
        found["kit"] = {t.name: score_task(model, tok, t)["acc"] for t in map(load_task, TASKS)}

    def lm_eval_mc(batch: int):
        def run():
            res = lm_eval.simple_evaluate(
                model=HFLM(pretrained=model, tokenizer=tok, batch_size=batch),
                tasks=[t.name for t in tasks],
                task_manager=TaskManager(include_path=str(work / "tasks"), include_defaults=False),
                verbosity="ERROR",
            )
            found[f"lm_eval_{batch}"] = {t.name: res["results"][t.name]["acc,none"] for t in tasks}

        return run

    from kit.evaluate import speed

    sb, sp, sn = SPEED
    vocab = model.config.vocab_size
    speed.measure(model, 1, 16, 2, vocab)  # warm-up, as speed.benchmark does
    speed_ids = speed.prompt_ids(sb, sp, vocab, seed=0)

    def kit_speed():
        r = speed.measure(model, sb, sp, sn, vocab, seed=0)
        # what the reported figures say the prompt and N+1 new tokens take
        found.setdefault("kit_speed", []).append(r["ttft_ms"] / 1000.0 + sb * sn / r["decode_tokens_per_s"])

    def hf_generate():
        out = model.generate(
            speed_ids,
            attention_mask=torch.ones_like(speed_ids),
            max_new_tokens=sn + 1,
            min_new_tokens=sn + 1,
            do_sample=False,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
        if out.shape != (sb, sp + sn + 1):
            raise SystemExit(f"generate() returned {tuple(out.shape)}, not {(sb, sp + sn + 1)}")

    def kit_loss():
        found["kit_loss"] = heldout_loss(model, rows).loss

    def hf_loss(batch: int):
        def run():
            trainer = Trainer(
                model=model,
                args=TrainingArguments(
                    output_dir=str(work / "hf"),
                    per_device_eval_batch_size=batch,
                    use_cpu=True,
                    report_to="none",
                ),
                eval_dataset=hf_rows,
                data_collator=DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8),
            )
            found[f"hf_loss_{batch}"] = trainer.evaluate()["eval_loss"]

        return run

    contenders = {
        "kit_mc": kit_mc,
        "lm_eval_1": lm_eval_mc(1),
        "lm_eval_8": lm_eval_mc(8),
        "kit_loss": kit_loss,
        "hf_loss_8": hf_loss(8),
        "hf_loss_2": hf_loss(2),
        "kit_speed": kit_speed,
        "hf_generate": hf_generate,
    }
    times: dict = {name: [] for name in contenders}
    with torch.no_grad():
        for r in range(max(1, args.repeats)):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in order:
                start = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - start)
            print(f"  [{r + 1}] " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in contenders), flush=True)

    for side in ("lm_eval_1", "lm_eval_8"):
        if found[side] != found["kit"]:
            raise SystemExit(f"accuracy differs: kit {found['kit']} vs {side} {found[side]}")
    best = {name: min(ts) for name, ts in times.items()}
    base_b = 1 if best["lm_eval_1"] <= best["lm_eval_8"] else 8
    mc_ratio = best[f"lm_eval_{base_b}"] / best["kit_mc"]
    hf_b = 8 if best["hf_loss_8"] <= best["hf_loss_2"] else 2
    loss_ratio = best[f"hf_loss_{hf_b}"] / best["kit_loss"]
    print(
        f"\nmultiple choice: kit {best['kit_mc']:.2f} s, lm-eval {best['lm_eval_1']:.2f} s (batch 1) / "
        f"{best['lm_eval_8']:.2f} s (batch 8); accuracy {found['kit']} on both\n"
        f"held-out loss: kit {best['kit_loss']:.2f} s ({tokens / best['kit_loss']:.0f} tokens/s, token-mean loss "
        f"{found['kit_loss']:.4f}), HF Trainer.evaluate {best['hf_loss_8']:.2f} s (batch 8) / {best['hf_loss_2']:.2f} s "
        f"(batch 2) (eval_loss {found['hf_loss_8']:.4f}: the mean of per-batch means)\n"
    )
    print(
        f"evaluate | multiple choice ({questions} questions) vs lm-eval (batch {base_b}, the faster), wall | "
        f"{mc_ratio:.2f}x | goal >= 1.0x | {'MET' if mc_ratio >= 1.0 else 'MISSED'}"
    )
    print("    baseline: " + LM_EVAL_CODE.format(b=base_b, tasks=list(TASKS)))
    print(
        f"evaluate | held-out loss ({tokens} tokens) vs HF Trainer.evaluate (batch {hf_b}, the faster), wall | "
        f"{loss_ratio:.2f}x | "
        f"goal >= 1.0x | {'MET' if loss_ratio >= 1.0 else 'MISSED'}"
    )
    print("    baseline: " + HF_EVAL_CODE.format(b=hf_b))
    # the kit's figures against the time they describe: the minimum predicted time (the kit's clock inside
    # measure) against generate()'s wall for the same work; within 10% either way
    speed_ratio = best["hf_generate"] / min(found["kit_speed"])
    print(
        f"evaluate | speed: TTFT + {sn} steps at the measured decode rate vs generate() of the same tokens "
        f"(batch {sb}, prompt {sp}), wall | {speed_ratio:.2f}x | goal 0.9-1.1x | "
        f"{'MET' if 0.9 <= speed_ratio <= 1.1 else 'MISSED'}"
    )
    print("    baseline: " + GENERATE_CODE.format(n1=sn + 1, b=sb, p=sp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
