"""Measured peak tensor memory of real training steps by the kit's trainer on CPU, for the planner's agreement
checks (tests/test_plan_agreement.py, benchmarks/bench_plan.py).

Independent of the planner's tracer: the live bytes between steps are the storages of every tensor Python can
reach (gc), counted at the end of step 1 less those alive before the run that still are (what earlier tests in the
same process left and the run frees does not count); the bytes each step adds on top come from
the PyTorch profiler's allocator events (every allocation and free, with its size) between the end of step 1 and
the end of step 2. The peak is the first plus the most the second reaches.
"""

from __future__ import annotations

import gc
import random
import weakref
from pathlib import Path

import test_train_helpers as H
import torch

MARK = (
    7_777_777  # a marker allocation of MARK + iteration bytes: where each step ends in the profiler's events
)
SEQ, MBS = 128, 2


def _live_storages() -> dict:
    """{data pointer: (bytes, a weak reference to one tensor on it)} for every CPU tensor Python can reach."""
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                storage = obj.untyped_storage()
                if storage.data_ptr() and storage.device.type == "cpu":
                    seen[storage.data_ptr()] = (storage.nbytes(), weakref.ref(obj))
        except Exception:  # tensors without storage (sparse, fake, some subclasses)
            continue
    return seen


def live_tensor_bytes(old: dict | None = None) -> int:
    """Bytes of the storages alive now, less those of `old` (a _live_storages()) still alive: storages freed since
    do not count against the new ones, whatever earlier tests left for the run to free."""
    still = set()
    for _n, ref in (old or {}).values():
        tensor = ref()
        if tensor is not None:
            still.add(tensor.untyped_storage().data_ptr())
    return sum(n for ptr, (n, _ref) in _live_storages().items() if ptr not in still)


def small_llama(folder: Path) -> Path:
    from kit.core.samples import tiny_llama

    if not (folder / "config.json").is_file():
        tiny_llama(folder, hidden_size=256, num_layers=4, intermediate_size=688, num_heads=4, num_kv_heads=2)
    return folder


def small_moe(folder: Path, tokenizer_from: Path) -> Path:
    """A Qwen3-MoE (3 layers, 8 experts, top 2) with the small Llama's tokenizer (skips where transformers has
    no Qwen3-MoE)."""
    import shutil

    from fixtures.convert import families

    families.require("qwen3_moe")
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if not (folder / "config.json").is_file():
        config = Qwen3MoeConfig(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=2522,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for f in tokenizer_from.iterdir():
            if "token" in f.name or f.name.endswith(".jinja"):
                shutil.copy(f, folder / f.name)
    return folder


def full_target_sft(folder: Path) -> Path:
    """SFT rows whose every token is a target, without padding: the layout the planner traces (its upper bound)."""
    if (folder / "dataset_info.json").is_file():
        return folder
    rng = random.Random(0)
    rows = {"input_ids": [], "labels": [], "attention_mask": [], "position_ids": [], "seq_lens": []}
    for _ in range(8):
        ids = [rng.randrange(10, 60) for _ in range(SEQ)]
        rows["input_ids"].append(ids)
        rows["labels"].append(list(ids))
        rows["attention_mask"].append([1] * SEQ)
        rows["position_ids"].append(list(range(SEQ)))
        rows["seq_lens"].append([SEQ])
    meta = {"kind": "sft", "max_length": SEQ, "tokenizer": "synthetic", "vocab_size": 2522}
    return H._save(rows, folder, dict(meta, pad_token_id=0, eos_token_id=2, num_samples=8))


def full_length_pairs(folder: Path) -> Path:
    """Preference pairs whose prompt + answer is SEQ tokens on both sides (one prompt token: every other position
    is an answer token), the longest sequences a DPO micro-batch of SEQ holds."""
    if (folder / "dataset_info.json").is_file():
        return folder
    rng = random.Random(0)
    rows = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for _ in range(8):
        rows["prompt_ids"].append([rng.randrange(10, 60)])
        rows["chosen_ids"].append([rng.randrange(10, 60) for _ in range(SEQ - 1)])
        rows["rejected_ids"].append([rng.randrange(10, 60) for _ in range(SEQ - 1)])
    meta = {"kind": "dpo", "max_length": SEQ, "tokenizer": "synthetic", "vocab_size": 2522}
    return H._save(rows, folder, dict(meta, pad_token_id=0, eos_token_id=2, num_samples=8))


def pretrain(folder: Path) -> Path:
    if not (folder / "dataset_info.json").is_file():
        H.make_pretrain(folder, num_samples=8, max_length=SEQ)
    return folder


def measured_peak(
    model: Path,
    data: Path,
    work: Path,
    zero: int = 0,
    lora: bool = False,
    cards: int = 1,
    recompute: bool = False,
    dpo: bool = False,
) -> int:
    """Peak live tensor bytes of step 2 of a kit training run (see the module); under a launcher, this rank's.
    `dpo`: RUN_TYPE=dpo on pairs (full training, precomputed reference)."""
    from torch.profiler import ProfilerActivity, profile

    from kit.train import train

    cfg = H.tiny_config(
        model,
        data,
        work,
        run_type="dpo" if dpo else "lora" if lora else "pretrain",
        zero_stage=zero,
        train_iters=2,
        mbs=MBS,
        gbs=MBS * cards,
        dtype="float32",
        nproc_per_node=cards,
        recompute=recompute,
    )
    steady = {}

    def at_step_end(iteration: int) -> None:
        if iteration == 1:
            steady["bytes"] = live_tensor_bytes(before)
        marker = torch.empty(MARK + iteration, dtype=torch.uint8)
        del marker

    gc.collect()
    before = _live_storages()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train(cfg, step_callbacks=[at_step_end], progress=False)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live, start, top, inside = 0, 0, 0, False
    for _t, n in events:
        live += n
        if n == MARK + 1:
            inside, start, top = True, live - n, live - n
        elif n == MARK + 2:
            break
        elif inside:
            top = max(top, live)
    assert inside, "the profiler saw no end of step 1"
    return steady["bytes"] + (top - start)


def two_rank_peak(model: Path, data: Path, work: Path, zero: int) -> int:
    """measured_peak of each of 2 gloo ranks under torchrun (this file as their script); the larger."""
    import json
    import os
    import subprocess
    import sys

    from kit.system.procs import free_port

    root = Path(__file__).resolve().parents[1]
    out = work / "peak"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "tests"), str(root)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, str(model), str(data), str(work / "ws"), str(zero), str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=env, timeout=900, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return max(json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1))


def predicted(
    model: Path,
    zero: int = 0,
    lora_r: int = 0,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    cards: int = 1,
    recompute: bool = False,
    dpo_reference: str = "",
    pairs: int = 0,
):
    """The planner's tensors per CPU "card" for the same run."""
    from kit.plan import PlanInputs, make_plan

    report = make_plan(
        PlanInputs(
            str(model),
            seq_len=SEQ,
            mbs=MBS,
            gbs=MBS * cards,
            cards=cards,
            card="here",
            dtype="float32",
            lora_r=lora_r,
            lora_targets=tuple(lora_targets),
            engines=("deepspeed",),
            zero_stage=zero,
            recompute=recompute,
            dpo_reference=dpo_reference,
            pairs=pairs,
        )
    )
    return report.chosen().memory


if (
    __name__ == "__main__"
):  # one rank of a launched run: torchrun ... plan_measure.py MODEL DATA WORK ZERO OUT
    import json
    import os
    import sys

    model, data, work, zero, out = sys.argv[1:6]
    world = int(os.environ["WORLD_SIZE"])
    peak = measured_peak(Path(model), Path(data), Path(work), zero=int(zero), cards=world)
    Path(f"{out}.rank{os.environ['RANK']}").write_text(json.dumps(peak), encoding="utf-8")
