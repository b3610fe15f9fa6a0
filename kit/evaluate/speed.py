"""Inference speed: time to first token and decode tokens/s per batch size and prompt length, with memory.

One measurement is a prefill of `batch x prompt_len` tokens (time to first token: the forward pass that yields
the first new token, greedy) and then `decode_tokens` single-token steps with the KV cache (decode tokens/s =
batch x steps / their time). The device is synchronized around each timed region (an accelerator runs
asynchronously). Memory: on NPU / CUDA the peak allocated by torch during the measurement; on CPU the process's
resident set size after it (CPU tensors have no allocator statistics).

Noise: each point is measured REPEATS times; the spread of those repeats (max / min of the timings, max - min of the
memory) is the noise a base-vs-trained difference is judged against (`compare`), in the sentence under the table
(`noise_note`) and on the bars of `speed.png` (`plot`): "within noise", or the change where it is larger.
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
            speeds = [r["decode_tokens_per_s"] for r in runs]
            mems = [r["memory_mb"] for r in runs]
            one = len(runs) == 1  # repeat to repeat: nothing measured from one run
            best["ttft_spread"] = float("nan") if one else max(ttfts) / min(ttfts)
            best["decode_spread"] = float("nan") if one else max(speeds) / min(speeds)
            best["memory_spread_mb"] = float("nan") if one else max(mems) - min(mems)
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


# (column, its noise column, how the noise is measured, y label)
PANELS = (
    ("ttft_ms", "ttft_spread", "ratio", "time to first token (ms)"),
    ("decode_tokens_per_s", "decode_spread", "ratio", "decode tokens/s"),
    ("memory_mb", "memory_spread_mb", "difference", "memory (MiB)"),
)
COLORS = {"base": "#9ecae1", "trained": "#08519c"}


def compare(table) -> list:
    """Per speed point and figure, trained against base: both values, the change, the repeats' noise and whether
    the change is within it (`within`: None when one repeat measured no noise). Timings are judged as ratios
    (trained / base against the larger max / min of the repeats), memory as a difference in MiB."""
    import math

    if table.empty or set(table["model"]) != {"base", "trained"}:
        return []
    keys = ["prompt_len", "batch"]
    base = table[table["model"] == "base"].set_index(keys)
    trained = table[table["model"] == "trained"].set_index(keys)
    out = []
    for point in base.index.intersection(trained.index):
        for col, noise_col, how, _ in PANELS:
            if col not in table or noise_col not in table:
                continue
            b, t = float(base.loc[point, col]), float(trained.loc[point, col])
            noise = max(float(base.loc[point, noise_col]), float(trained.loc[point, noise_col]))
            if how == "ratio":
                change = t / b if b else math.nan
                within = None if math.isnan(noise) else abs(change - 1) <= noise - 1
            else:
                change = t - b
                within = None if math.isnan(noise) else abs(change) <= noise
            row = {"prompt_len": point[0], "batch": point[1], "metric": col, "base": b, "trained": t}
            out.append(dict(row, change=change, noise=noise, within=within))
    return out


def _number(v: float) -> str:
    return "" if v != v else f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _flag(row: dict) -> str:
    if row["within"] is None:
        return "1 repeat: noise not measured"
    if row["within"]:
        return "within noise"
    if row["metric"] == "memory_mb":
        return f"{row['change']:+.3g} MiB"
    return f"trained {row['change']:.3g}x"


def speed_figure(table, title: str = ""):
    """TTFT, decode tokens/s and memory as bars, base beside trained at each (prompt length, batch size), every
    bar labelled with its value, y from zero; each pair flagged "within noise" or with its change (`compare`)."""
    from matplotlib.figure import Figure

    points = sorted(set(zip(table["prompt_len"], table["batch"])))
    models = [m for m in ("base", "trained") if m in set(table["model"])] or sorted(set(table["model"]))
    flags = {(r["prompt_len"], r["batch"], r["metric"]): _flag(r) for r in compare(table)}
    fig = Figure(figsize=(max(6.0, 1.6 * len(points)), 3.0 * len(PANELS)))
    axes = fig.subplots(len(PANELS), 1, squeeze=False)[:, 0]
    width = 0.8 / len(models)
    kind = table["memory_kind"].iloc[0] if "memory_kind" in table and len(table) else ""
    for ax, (col, _, _, ylabel) in zip(axes, PANELS):
        top = 0.0
        for k, model in enumerate(models):
            part = table[table["model"] == model].set_index(["prompt_len", "batch"])
            values = [float(part.loc[p, col]) if p in part.index else float("nan") for p in points]
            x = [i + (k - (len(models) - 1) / 2) * width for i in range(len(points))]
            bars = ax.bar(x, values, width, label=model, color=COLORS.get(model))
            ax.bar_label(bars, labels=[_number(v) for v in values], fontsize=7)
            top = max([top] + [v for v in values if v == v])
        for i, p in enumerate(points):
            if (p[0], p[1], col) in flags:
                ax.annotate(flags[(p[0], p[1], col)], (i, top * 1.12), ha="center", fontsize=7, color="#555")
        ax.set_xticks(range(len(points)), [f"prompt {n}\nbatch {b}" for n, b in points])
        ax.set_ylim(0, top * 1.25 or 1.0)  # from zero: 0.01 MiB between models is not drawn as a gap
        ax.set_ylabel(ylabel.replace(")", f", {kind})") if col == "memory_mb" and kind else ylabel)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(table, path: Path, title: str = ""):
    """`speed_figure(table, title)` saved as PNG (drawn without pyplot: nothing is shown or left open). Returns the
    figure."""
    from kit.errors import writing

    fig = speed_figure(table, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path):  # a failed write inside savefig names no file
        fig.savefig(path, dpi=100)
    return fig
