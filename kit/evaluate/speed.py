"""Inference speed: time to first token and decode tokens/s per batch size and prompt length, with memory.

One measurement is a prefill of `batch x prompt_len` tokens (time to first token: the forward pass that yields
the first new token, greedy) and then `decode_tokens` single-token steps with the KV cache (decode tokens/s =
batch x steps / their time). The device is synchronized around each timed region (an accelerator runs
asynchronously). Memory: on NPU / CUDA the peak allocated by torch during the measurement; on CPU the process's
resident set size after it (CPU tensors have no allocator statistics).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

from kit.system.device import synchronize
from kit.system.hf_compat import last_logits_only


def _accelerator(device):
    """torch.cuda or torch.npu (the same memory and synchronize API) for an accelerator device; None on the CPU."""
    import torch

    kind = getattr(device, "type", str(device))
    return getattr(torch, kind) if kind in ("cuda", "npu") else None


def _memory_mb(device) -> tuple:
    from kit.system.memory import peak_memory

    used, what = peak_memory(device)
    return used / 2**20, what


def _cache_names(model) -> tuple:
    """(forward keyword, output attribute) of the KV cache: `cache` from transformers 5.x, `past_key_values` before."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return ("cache", "cache") if "cache" in params else ("past_key_values", "past_key_values")


def prompt_ids(batch: int, prompt_len: int, vocab: int, seed: int = 0):
    """The random prompt measure() times: ids from the lower vocabulary half (real tokens, never special ids such as
    EOS at the end of a vocabulary), on the CPU."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(2, vocab // 2), (batch, prompt_len), generator=gen)


def measure(
    model, batch: int, prompt_len: int, decode_tokens: int, vocab: int, seed: int = 0
) -> Dict[str, Any]:
    """One measurement of prefill + cached greedy decode on random prompt tokens (no early stop)."""
    import torch

    device = next(model.parameters()).device
    kw, attr = _cache_names(model)
    # the LM head at the last position only, as generate() does: [batch, prompt, vocabulary] logits thrown away
    # would inflate the time to first token and the memory (1.6 GB of fp32 at batch 8, prompt 1024, 49k vocab)
    last = last_logits_only(model)
    ids = prompt_ids(batch, prompt_len, vocab, seed).to(device)
    acc = _accelerator(device)
    if acc is not None:
        acc.reset_peak_memory_stats(device)
    with torch.no_grad():
        synchronize(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, **last)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        ttft = time.perf_counter() - t0
        past = getattr(out, attr)
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(input_ids=nxt, use_cache=True, **{kw: past}, **last)
            past = getattr(out, attr)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        decode_s = time.perf_counter() - t1
    mem, mem_kind = _memory_mb(device)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "ttft_ms": ttft * 1000.0,
        "decode_tokens_per_s": batch * decode_tokens / decode_s if decode_s > 0 else float("inf"),
        "memory_mb": mem,
        "memory_kind": mem_kind,
    }


def benchmark(
    model,
    batch_sizes: Sequence[int],
    prompt_lengths: Sequence[int],
    decode_tokens: int,
    vocab: int,
    repeats: int = 1,
) -> List[Dict[str, Any]]:
    """Every (prompt length, batch size); one warm-up first; the best of `repeats` timings kept per point."""
    measure(model, 1, min(prompt_lengths), 2, vocab)  # warm-up: kernels, allocator, lazy init
    rows = []
    for length in prompt_lengths:
        for b in batch_sizes:
            runs = [measure(model, b, length, decode_tokens, vocab, seed=i) for i in range(max(1, repeats))]
            best = min(runs, key=lambda r: r["ttft_ms"])
            best["decode_tokens_per_s"] = max(r["decode_tokens_per_s"] for r in runs)
            best["memory_mb"] = max(r["memory_mb"] for r in runs)
            ttfts = [r["ttft_ms"] for r in runs]
            best["ttft_spread"] = (
                max(ttfts) / min(ttfts) if len(runs) > 1 else float("nan")
            )  # repeat to repeat
            rows.append(best)
    return rows


def noise_note(table) -> str:
    """One sentence per model against the base: does it differ in time to first token beyond the repeat-to-repeat
    spread?"""
    models = list(dict.fromkeys(table["model"])) if not table.empty else []
    if "base" not in models or len(models) < 2:
        return ""
    return " ".join(_noise_note(table, other) for other in models if other != "base")


def _noise_note(table, other: str) -> str:
    keys = ["prompt_len", "batch"]
    base = table[table["model"] == "base"].set_index(keys)
    trained = table[table["model"] == other].set_index(keys)
    ratio = trained["ttft_ms"] / base["ttft_ms"]
    spread = base["ttft_spread"].combine(trained["ttft_spread"], max)
    if spread.isna().all():
        return (
            f"{other} / base time to first token: {ratio.min():.2f}-{ratio.max():.2f}x from one timing per point "
            "(REPEATS = 1): not compared with the noise; REPEATS = 3 measures it."
        )
    beyond = ((ratio - 1).abs() > spread - 1).sum()
    return (
        f"{other} / base time to first token: {ratio.min():.2f}-{ratio.max():.2f}x; the repeats of one point differ "
        f"by up to {spread.max() - 1:.0%}, so {len(ratio) - beyond} of {len(ratio)} points show no difference beyond "
        "that noise"
        + ("." if not beyond else f" and {beyond} do (same architecture: look again on a quiet machine).")
    )


def plot(table, path: Path, title: str = ""):
    """TTFT, decode tokens/s and memory against batch size, one line per (model, prompt length); saved as PNG."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for (model, length), part in table.groupby(["model", "prompt_len"], sort=False):
        label = f"{model}, prompt {length}"
        part = part.sort_values("batch")
        axes[0].plot(part["batch"], part["ttft_ms"], marker="o", label=label)
        axes[1].plot(part["batch"], part["decode_tokens_per_s"], marker="o", label=label)
        axes[2].plot(part["batch"], part["memory_mb"], marker="o", label=label)
    kind = table["memory_kind"].iloc[0] if len(table) else ""
    for ax, ylabel in zip(axes, ("time to first token (ms)", "decode tokens/s", f"memory MiB ({kind})")):
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)  # from zero: 0.01 MiB between models is not drawn as a gap
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from kit.errors import writing

    with writing(path):  # a failed write inside savefig names no file
        fig.savefig(path, dpi=100)
    return fig
