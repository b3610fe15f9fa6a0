"""The live view of a training run in a notebook: one display the kernel updates in place as steps finish.

It shows step k/N, elapsed < remaining, the loss raw and smoothed (with its curve), the held-out loss where the run
measures it (EVAL_EVERY; a second series of points on the curve), lr, grad norm, tokens/s/p and device memory (peak allocated on an NPU / CUDA card, the process's RSS on a CPU). Like kit.system.progress's bar it
is an ordinary display (`update_display_data`, at most twice a second and once at the end), not a widget: the live
page and the executed notebook (papermill, `make demo`) both keep its last state. The in-kernel run and a launched
one (kit.train.launch, from its rank 0's log lines) feed it the same metrics records. Stopping is the kernel's
interrupt (the stop button): the run saves a checkpoint after the step it is in (kit.train.trainer).

`smoothed` is the curve TensorBoard draws (an exponential moving average with its start-up bias removed), and
`plot_loss` writes it with the raw loss and the held-out loss to the run's `training_loss.png`.
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


EVAL_COLOR = "#e6550d"  # the held-out loss, in the view and in training_loss.png


def eval_points(records: Sequence[dict]) -> List[tuple]:
    """(iteration, held-out loss) of the records that measured it."""
    return [(r["iteration"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]


def _svg(records: Sequence[dict], width: int = 420, height: int = 120) -> str:
    """The loss curve (thin: raw, thick: smoothed; orange dots and line: held-out) as a small SVG, x by iteration,
    y from the lowest to the highest loss shown."""
    pad = 6
    steps = [r["iteration"] for r in records]
    losses = [r["loss"] for r in records]
    held = eval_points(records)
    values = losses + [v for _, v in held]
    lo, hi = min(values), max(values)
    span = (hi - lo) or max(abs(hi), 1.0) * 0.1
    first, n = steps[0], max(1, steps[-1] - steps[0])

    def xy(step, v):
        return pad + (step - first) * (width - 2 * pad) / n, pad + (hi - v) * (height - 2 * pad) / span

    def points(pairs):
        return " ".join("{:.1f},{:.1f}".format(*xy(i, v)) for i, v in pairs)

    dots = "".join(
        '<circle cx="{:.1f}" cy="{:.1f}" r="3" fill="{}"/>'.format(*xy(i, v), EVAL_COLOR) for i, v in held
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        f'<rect width="{width}" height="{height}" fill="white" stroke="#ccc"/>'
        f'<polyline fill="none" stroke="#9ecae1" stroke-width="1" points="{points(zip(steps, losses))}"/>'
        f'<polyline fill="none" stroke="#08519c" stroke-width="2.5" points="{points(zip(steps, smoothed(losses)))}"/>'
        + (
            f'<polyline fill="none" stroke="{EVAL_COLOR}" stroke-width="1.5" points="{points(held)}"/>{dots}'
            if held
            else ""
        )
        + f'<text x="{width - pad}" y="14" font-size="11" text-anchor="end" fill="#555">{hi:.4g}</text>'
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
        held = eval_points(self.records)
        return (
            f"{self.title}: step {done}/{self.total}, {_clock(elapsed)} elapsed < {_clock(remaining)} remaining, "
            f"loss {last['loss']:.4f} (smoothed {loss:.4f})"
            + (f", held-out loss {held[-1][1]:.4f} (step {held[-1][0]})" if held else "")
        )

    def html(self) -> str:
        head = html.escape(self.final or self.line())
        if not self.records:
            return f"<p><b>{head}</b></p>"
        last = self.records[-1]
        held = eval_points(self.records)
        cells = [
            ("loss", f"{last['loss']:.4f}"),
            ("smoothed", f"{smoothed([r['loss'] for r in self.records])[-1]:.4f}"),
            ("held-out loss", f"{held[-1][1]:.4f} (step {held[-1][0]})" if held else "–"),
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
            svg = base64.b64encode(_svg(self.records).encode()).decode()
            alt = "loss per step (thin: raw, thick: smoothed, orange: held-out)"
            chart = f'<img alt="{alt}" src="data:image/svg+xml;base64,{svg}"/>'
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
        """A step's metrics (the trainer's record, or kit.train.logs.parse_line of a log line; `eval_loss` on the
        steps that measured the held-out loss)."""
        if record.get("loss") is None:
            return
        self.records = [r for r in self.records if r["iteration"] < record["iteration"]] + [record]
        self._show(force=int(record["iteration"]) >= self.total)

    def close(self, final: Optional[str] = None) -> None:
        """The last state, with `final` (the run's status sentence) as its heading."""
        self.final = final
        self._show(force=True)


def plot_loss(records: Sequence[dict], png: Union[str, Path], title: str = "training loss"):
    """The loss per step, raw and smoothed, and the held-out loss where it was measured, saved as `png` (the run's
    training_loss.png; drawn without pyplot, so nothing is shown in a notebook). Returns the figure."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from kit.errors import writing

    steps = [r["iteration"] for r in records]
    losses = [r["loss"] for r in records]
    fig = Figure(figsize=(6, 3.4))
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="#9ecae1", lw=1, label="loss")
    ax.plot(steps, smoothed(losses), color="#08519c", lw=2.5, label=f"smoothed ({SMOOTHING:g})")
    held = eval_points(records)
    if held:
        ax.plot(*zip(*held), color=EVAL_COLOR, lw=1.5, marker="o", label="held-out")
    ax.set(xlabel="iteration", ylabel="lm loss", title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    with writing(png):
        fig.savefig(png, dpi=110)
    return fig
