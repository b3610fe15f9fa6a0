"""Read training logs: the kit's and Megatron/MindSpeed's per-iteration lines, HF `train metrics` blocks; compare, plot."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping, Optional, Union

from kit.train.metrics import tokens_per_second_per_card

_ITER = re.compile(r"iteration\s+(\d+)\s*/\s*(\d+)")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf|-inf"
_FIELD = re.compile(r"\|\s*([A-Za-z][^|:]*?):\s*(" + _NUMBER + r")\s*(?=\|)")
# Megatron's field names -> column names (other fields keep a snake_case version of their own name).
COLUMNS = {
    "consumed samples": "consumed_samples",
    "elapsed time per iteration (ms)": "elapsed_ms",
    "learning rate": "lr",
    "global batch size": "gbs",
    "lm loss": "loss",
    "eval loss": "eval_loss",  # the kit's held-out loss, on the steps that measure it (EVAL_EVERY)
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_card",
    "tokens/s/p": "tokens_per_s_per_card",
    "samples/s": "samples_per_s",
    "memory (GiB)": "memory_gib",  # the kit's: peak allocated on the card (NPU / CUDA), the process's RSS on a CPU
}
_HF_METRIC = re.compile(r"(\w+)\s*=\s*([\d:.]+)")


def _snake(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def parse_line(line: str) -> Optional[dict]:
    """The fields of one per-iteration line (kit or Megatron/MindSpeed), or None if it is not one."""
    m = _ITER.search(line)
    if not m:
        return None
    rec = {"iteration": int(m.group(1)), "train_iters": int(m.group(2))}
    for key, value in _FIELD.findall(line[m.end() :] + "|"):
        rec[COLUMNS.get(key.strip(), _snake(key))] = float(value)
    return rec


def _text(source: Union[str, Path]) -> str:
    if isinstance(source, Path) or ("\n" not in str(source) and Path(str(source)).is_file()):
        return Path(source).read_text(encoding="utf-8", errors="replace")
    return str(source)


def parse_log(source: Union[str, Path], seq_len: Optional[int] = None, cards: Optional[int] = None):
    """A DataFrame with one row per iteration (a restarted run's later line for an iteration wins).

    For Megatron logs, which print no tokens/s/p, give SEQ_LEN and the number of cards to get the manual's
    tokens/s/p = GBS * SEQ_LEN / (cards * elapsed ms) * 1000.
    """
    import pandas as pd

    rows = {}
    for line in _text(source).splitlines():
        rec = parse_line(line)
        if rec is not None and "loss" in rec:
            rows[rec["iteration"]] = rec
    df = pd.DataFrame([rows[k] for k in sorted(rows)])
    if df.empty:
        return df
    if seq_len and cards and "elapsed_ms" in df and "gbs" in df:
        computed = [
            tokens_per_second_per_card(int(g), seq_len, cards, e) for g, e in zip(df["gbs"], df["elapsed_ms"])
        ]
        if "tokens_per_s_per_card" not in df:
            df["tokens_per_s_per_card"] = computed
    if "samples_per_s" not in df and "elapsed_ms" in df and "gbs" in df:
        df["samples_per_s"] = df["gbs"] / (df["elapsed_ms"] / 1000.0)
    for col in ("gbs", "consumed_samples", "skipped", "nan"):
        if col in df:
            df[col] = df[col].astype(int)
    return df


def parse_train_metrics(source: Union[str, Path]) -> dict:
    """The HF Trainer `***** train metrics *****` block (as in the manual's before/after table, section "查看性能"); times in seconds."""
    text = _text(source)
    start = text.rfind("train metrics")
    out = {}
    for key, value in _HF_METRIC.findall(text[start:] if start >= 0 else text):
        if ":" in value:
            seconds = 0.0
            for part in value.split(":"):
                seconds = seconds * 60 + float(part)
            out[key] = seconds
        else:
            out[key] = float(value)
    return out


def summarize(df, skip_first: int = 1) -> dict:
    """Key numbers of a run: final loss, mean step time and throughput (first steps skipped: warm-up/compile)."""
    if df is None or len(df) == 0:
        return {"iterations": 0}
    steady = df.iloc[skip_first:] if len(df) > skip_first else df
    tail = df.iloc[-max(1, len(df) // 10) :]
    out = {
        "iterations": int(df["iteration"].iloc[-1]),
        "first_loss": float(df["loss"].iloc[0]),
        "final_loss": float(tail["loss"].mean()),
        "train_runtime_s": float(df["elapsed_ms"].sum() / 1000.0) if "elapsed_ms" in df else None,
        "elapsed_ms_mean": float(steady["elapsed_ms"].mean()) if "elapsed_ms" in df else None,
    }
    for col in ("tokens_per_s_per_card", "samples_per_s", "useful_tokens_per_s"):
        if col in steady:
            out[col] = float(steady[col].mean())
    return out


def compare_runs(runs: Mapping[str, object], skip_first: int = 1):
    """Side-by-side table of runs (like the ModelArts manual's 性能基线 vs 算子调优后 table): samples/s, runtime, loss, tokens/s/p."""
    import pandas as pd

    table = pd.DataFrame({name: summarize(df, skip_first) for name, df in runs.items()}).T
    first = next(iter(runs))
    if "samples_per_s" in table and len(table) > 1:
        table["speed_vs_" + first] = table["samples_per_s"] / table.loc[first, "samples_per_s"]
    return table


def plot_runs(runs: Mapping[str, object], png: Optional[Union[str, Path]] = None):
    """Loss and tokens/s/p per iteration for each run; saved as PNG when `png` is given. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_tp) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, df in runs.items():
        ax_loss.plot(df["iteration"], df["loss"], marker=".", label=name)
        if "tokens_per_s_per_card" in df:
            ax_tp.plot(df["iteration"], df["tokens_per_s_per_card"], marker=".", label=name)
    ax_loss.set(xlabel="iteration", ylabel="lm loss", title="loss")
    ax_tp.set(xlabel="iteration", ylabel="tokens/s/p", title="throughput per card")
    for ax in (ax_loss, ax_tp):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    if png is not None:
        from kit.errors import writing

        Path(png).parent.mkdir(parents=True, exist_ok=True)
        with writing(png):  # matplotlib's writer loses the file name of a failed write
            fig.savefig(png, dpi=110)
    return fig


def preference_table(metrics: Union[str, Path]):
    """A DPO run's steps as a table: the loss and TRL's metrics (kit.train.dpo.METRICS) of each step, from its
    metrics.jsonl."""
    import pandas as pd

    from kit.train.dpo import METRICS
    from kit.train.metrics import read_metrics

    rows = [
        {"step": r["iteration"], "loss": r["loss"], **{k: r.get(k) for k in METRICS}}
        for r in read_metrics(metrics)
    ]
    return pd.DataFrame(rows, columns=["step", "loss", *METRICS]).set_index("step")


def preference_report(result) -> list:
    """Notebook 04's view of a finished DPO run (kit.train.trainer.TrainResult): one sentence (the run it started
    from, read through the manifests, and where its last step stands) and the per-step table (preference_table)."""
    from kit.core.inputs import consumed
    from kit.core.manifest import HF_MODEL, TRAINING_RUN
    from kit.core.show import show

    table = preference_table(result.metrics_path)
    start = consumed(result.manifest, HF_MODEL) if result.manifest is not None else None
    sft = consumed(start, TRAINING_RUN) if start is not None else None
    origin = f"the {sft['run_type']} run {sft.folder}" if sft is not None else str(result.config.model_path)
    if table.empty:
        return [show(f"The DPO run from {origin} ended {result.status} before its first step."), table]
    last = table.iloc[-1]
    reference = (result.dpo or {}).get("reference", "?")
    sentence = (
        f"DPO from {origin} ({reference} reference), {len(table)} steps, {result.status}: step 1 compares the model "
        f"with itself (loss {table['loss'].iloc[0]:.3f}, margin {table['rewards/margins'].iloc[0]:+.3f}); step {table.index[-1]}: loss "
        f"{last['loss']:.3f}, rewards/accuracies {last['rewards/accuracies']:.2f}, rewards/margins "
        f"{last['rewards/margins']:+.3f} (chosen {last['rewards/chosen']:+.3f}, rejected "
        f"{last['rewards/rejected']:+.3f})."
    )
    return [show(sentence), table]
