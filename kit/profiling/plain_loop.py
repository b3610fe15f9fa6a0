"""A plain forward / backward / AdamW loop over a Hugging Face causal LM, under kit.profiling.profile.

For your own loops and the profiling benchmark. The profile stage (notebook 05) profiles the kit trainer's run
instead: kit.profiling.training_run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from kit.profiling.capture import Capture, profile
from kit.profiling.config import ProfileConfig
from kit.profiling.profile_data import ProfileError

PathLike = Union[str, Path]


def sample_batches(tokenizer: Any, n: int, batch_size: int = 2, seq_len: int = 64) -> list:
    """`n` batches of `seq_len` tokens cut from the shipped pretraining corpus (input_ids = labels)."""
    import pandas as pd
    import torch

    from kit.samples import pretrain_corpus

    need = n * batch_size * seq_len
    ids: list = []
    for text in pd.read_parquet(pretrain_corpus())["text"]:
        ids += tokenizer(text)["input_ids"]
        if len(ids) >= need:
            break
    if len(ids) < need:  # a tiny corpus or huge request: repeat what there is
        ids = (ids * (need // max(len(ids), 1) + 1))[:need]
    t = torch.tensor(ids[:need], dtype=torch.long).view(n, batch_size, seq_len)
    return [{"input_ids": b, "labels": b.clone(), "attention_mask": torch.ones_like(b)} for b in t]


def run_steps(
    model: Any, optimizer: Any, batches: Sequence[dict], callbacks: Sequence[Callable] = ()
) -> list:
    """One optimizer step per batch; each callback(step) after it; returns each step's wall time in seconds."""
    from kit.device import synchronize

    device = next(model.parameters()).device
    times = []
    for step, batch in enumerate(batches, start=1):
        t0 = time.perf_counter()
        out = model(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        for cb in callbacks:
            cb(step)
    return times


def load_model(model_dir: Optional[PathLike] = None, device: Optional[str] = None) -> tuple:
    """(model, tokenizer) from an HF folder (default: the demo model), in fp32 on the kit's device."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit.device import get_device
    from kit.hf_compat import dtype_kw

    if model_dir is None:
        from kit.samples import demo_model_dir

        model_dir = demo_model_dir()
    if not Path(model_dir).is_dir():
        raise ProfileError(
            f"model folder {model_dir} does not exist; pass an HF folder (notebook 03/04 "
            f"output) or None for the demo model."
        )
    dev = torch.device(device) if device else get_device()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **dtype_kw(torch.float32)).to(dev)
    model.train()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def profile_training(
    model_dir: Optional[PathLike] = None,
    steps: Optional[int] = None,
    batch_size: int = 2,
    seq_len: int = 64,
    lr: float = 1e-4,
    out_dir: Optional[PathLike] = None,
    config: Optional[ProfileConfig] = None,
    workspace: Any = None,
    rng_seed: int = 0,
    **options: Any,
) -> Capture:
    """Train `steps` steps (default: what the schedule needs) under kit.profiling.profile; return the capture."""
    import torch

    torch.manual_seed(rng_seed)
    cfg = config or ProfileConfig()
    cap = profile(out_dir=out_dir, config=cfg, workspace=workspace, **options)
    model, tok = load_model(model_dir, device="cpu" if cap.kind == "cpu" else None)
    n = steps or cap.config.steps_needed
    batches = sample_batches(tok, n, batch_size, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    with cap:
        cap.step_times = run_steps(model, optimizer, batches, callbacks=[cap])
    return cap
