"""The live view of a training run in a notebook: one display the kernel updates in place as steps finish.

It shows step k/N, elapsed < remaining, the loss raw and smoothed (with its curve), lr, grad norm, tokens/s/p and
device memory (peak allocated on an NPU / CUDA card, the process's RSS on a CPU). Like kit.system.progress's bar it
is an ordinary display (`update_display_data`, at most twice a second and once at the end), not a widget: the live
page and the executed notebook (papermill, `make demo`) both keep its last state. The in-kernel run and a launched
one (kit.train.launch, from its rank 0's log lines) feed it the same metrics records. Stopping is the kernel's
interrupt (the stop button): the run saves a checkpoint after the step it is in (kit.train.trainer).

`smoothed` is the curve TensorBoard draws (an exponential moving average with its start-up bias removed), and
`plot_loss` writes it with the raw loss to the run's `training_loss.png`.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path
from typing import List, Optional, Sequence, Union

SMOOTHING = 0.9
"""Weight of the past in the smoothed loss (TensorBoard's default slider value)."""
REFRESH_S = 0.5


def smoothed(values: Sequence[float], weight: float = SMOOTHING) -> List[float]:
    """The exponential moving average of `values` with the start-up bias removed (the first point is itself)."""
    out, avg = [], 0.0
    for n, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * float(v)
        out.append(avg / (1 - weight**n))
    return out


def _clock(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _svg(losses: Sequence[float], width: int = 420, height: int = 120) -> str:
    """The loss curve (thin: raw, thick: smoothed) as a small SVG, y from the lowest to the highest loss shown."""
    pad = 6
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or max(abs(hi), 1.0) * 0.1
    n = max(1, len(losses) - 1)

    def points(vals):
        return " ".join(
            f"{pad + i * (width - 2 * pad) / n:.1f},{pad + (hi - v) * (height - 2 * pad) / span:.1f}"
            for i, v in enumerate(vals)
        )

    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<rect width="{width}" height="{height}" fill="white" stroke="#ccc"/>'
        f'<polyline fill="none" stroke="#9ecae1" stroke-width="1" points="{points(losses)}"/>'
        f'<polyline fill="none" stroke="#08519c" stroke-width="2.5" points="{points(smoothed(losses))}"/>'
        f'<text x="{width - pad}" y="14" font-size="11" text-anchor="end" fill="#555">{hi:.4g}</text>'
        f'<text x="{width - pad}" y="{height - pad}" font-size="11" text-anchor="end" fill="#555">{lo:.4g}</text>'
        "</svg>"
    )


class RunView:
    """One training run's live display (in a kernel; elsewhere nothing is shown): `update(record)` per step,
    `close(line)` at the end."""

    def __init__(self, total: int, start: int = 0, title: str = "training", refresh_s: float = REFRESH_S):
        self.total, self.start, self.title, self.refresh_s = total, start, title, refresh_s
        self.records: List[dict] = []
        self.t0 = time.monotonic()
        self._shown_at = 0.0
        self._handle = None
        self.final: Optional[str] = None

    # ---- what it shows --------------------------------------------------------------------------------------
    def line(self) -> str:
        """One sentence: where the run is (also the display's plain-text form)."""
        if not self.records:
            return f"{self.title}: starting ({self.total - self.start} steps to go)"
        last = self.records[-1]
        done = int(last["iteration"])
        elapsed = time.monotonic() - self.t0
        steps = max(1, len(self.records))
        remaining = elapsed / steps * max(0, self.total - done)
        loss = smoothed([r["loss"] for r in self.records])[-1]
        return (
            f"{self.title}: step {done}/{self.total}, {_clock(elapsed)} elapsed < {_clock(remaining)} remaining, "
            f"loss {last['loss']:.4f} (smoothed {loss:.4f})"
        )

    def html(self) -> str:
        head = html.escape(self.final or self.line())
        if not self.records:
            return f"<p><b>{head}</b></p>"
        last = self.records[-1]
        cells = [
            ("loss", f"{last['loss']:.4f}"),
            ("smoothed", f"{smoothed([r['loss'] for r in self.records])[-1]:.4f}"),
            ("lr", f"{last['lr']:.3g}" if last.get("lr") is not None else "–"),
            ("grad norm", f"{last['grad_norm']:.3f}" if last.get("grad_norm") is not None else "–"),
            (
                "tokens/s/p",
                f"{last['tokens_per_s_per_card']:.1f}" if "tokens_per_s_per_card" in last else "–",
            ),
            ("memory (GiB)", f"{last['memory_gib']:.2f}" if last.get("memory_gib") is not None else "–"),
        ]
        table = (
            "<table><tr>"
            + "".join(f"<th>{k}</th>" for k, _ in cells)
            + "</tr><tr>"
            + "".join(f"<td>{v}</td>" for _, v in cells)
            + "</tr></table>"
        )
        chart = ""
        if len(self.records) > 1:
            svg = base64.b64encode(_svg([r["loss"] for r in self.records]).encode()).decode()
            chart = f'<img alt="loss per step (thin: raw, thick: smoothed)" src="data:image/svg+xml;base64,{svg}"/>'
        return f"<p><b>{head}</b></p>{table}{chart}"

    # ---- updates ---------------------------------------------------------------------------------------------
    def _show(self, force: bool = False) -> None:
        from kit.system.progress import in_kernel

        now = time.monotonic()
        if not in_kernel() or (not force and now - self._shown_at < self.refresh_s):
            return
        self._shown_at = now
        data = {"text/html": self.html(), "text/plain": self.final or self.line()}
        from IPython.display import display

        if self._handle is None:
            self._handle = display(data, raw=True, display_id=True)
        else:
            self._handle.update(data, raw=True)

    def update(self, record: dict) -> None:
        """A step's metrics (the trainer's record, or kit.train.logs.parse_line of a log line)."""
        if record.get("loss") is None:
            return
        self.records = [r for r in self.records if r["iteration"] < record["iteration"]] + [record]
        self._show(force=int(record["iteration"]) >= self.total)

    def close(self, final: Optional[str] = None) -> None:
        """The last state, with `final` (the run's status sentence) as its heading."""
        self.final = final
        self._show(force=True)


def plot_loss(records: Sequence[dict], png: Union[str, Path], title: str = "training loss"):
    """The loss per step, raw and smoothed, saved as `png` (the run's training_loss.png; drawn without pyplot, so
    nothing is shown in a notebook). Returns the figure."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from kit.errors import writing

    steps = [r["iteration"] for r in records]
    losses = [r["loss"] for r in records]
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="#9ecae1", lw=1, label="loss")
    ax.plot(steps, smoothed(losses), color="#08519c", lw=2.5, label=f"smoothed ({SMOOTHING:g})")
    ax.set(xlabel="iteration", ylabel="lm loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    with writing(png):
        fig.savefig(png, dpi=110)
    return fig
