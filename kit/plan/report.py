"""The planner's answer as a user reads it: one sentence, the chosen plan's memory by term, and the plans that fit
(pandas tables: rendered in a notebook, printed by `python -m kit plan`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional, Union

from kit.core.i18n import t
from kit.errors import MissingInputError
from kit.plan.cards import GIB
from kit.plan.planner import ALLOCATOR_MARGIN, PlanReport, PlanRow

SHOWN = 10  # plans listed


def _gib(n: float) -> float:
    return round(n / GIB, 1)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _largest(row: PlanRow) -> tuple:
    return max(row.memory.terms().items(), key=lambda kv: kv[1])


def verdict(report: PlanReport) -> str:
    """One sentence: does the run's plan fit, and else the largest term and the nearest plan that fits."""
    r = report.inputs
    what = t(
        "plan.what", params=_count(report.counts.total), seq_len=r.seq_len, mbs=r.mbs, dtype=report.dtype
    )
    cards = t("plan.cards", cards=r.cards, card=report.card.name, memory=report.card.memory_gib)
    chosen, fitting = report.chosen(), report.fitting()
    best = fitting[0] if fitting else None
    if chosen is not None and chosen.fits:
        notes = "".join(f" ({n})" for n in chosen.memory.notes)
        return t(
            "plan.fits", layout=chosen.layout, cards=cards, total=_gib(chosen.total), what=what, notes=notes
        )
    if chosen is not None:
        name, size = _largest(chosen)
        tail = t("plan.fastest_fit", layout=best.layout, total=_gib(best.total)) if best else ""
        return t(
            "plan.does_not_fit",
            layout=chosen.layout,
            cards=cards,
            total=_gib(chosen.total),
            what=what,
            term=name,
            size=_gib(size),
            tail=tail,
        )
    if best is not None:
        return t(
            "plan.some_fit",
            count=len(fitting),
            cards=cards,
            what=what,
            layout=best.layout,
            total=_gib(best.total),
        )
    nearest = min(report.rows, key=lambda row: row.total)
    name, size = _largest(nearest)
    return t(
        "plan.none_fit",
        cards=cards,
        what=what,
        layout=nearest.layout,
        total=_gib(nearest.total),
        term=name,
        size=_gib(size),
    )


def memory_table(report: PlanReport, row: Optional[PlanRow] = None):
    """GiB per card by term for `row` (default: the run's plan, else the first listed)."""
    import pandas as pd

    row = row or report.chosen() or report.rows[0]
    terms = {k: _gib(v) for k, v in row.memory.terms().items()}
    terms[f"allocator margin ({ALLOCATOR_MARGIN:.0%} of the tensors)"] = _gib(
        row.memory.tensors * ALLOCATOR_MARGIN
    )
    terms["device runtime"] = report.card.runtime_reserve_gib
    terms["total"] = _gib(row.total)
    terms[f"card ({report.card.name})"] = report.card.memory_gib
    if row.memory.host:
        terms["host memory (offloaded)"] = _gib(row.memory.host)
    frame = pd.DataFrame({"GiB per card": list(terms.values())}, index=list(terms))
    frame.index.name = row.layout
    return frame


def plans_table(report: PlanReport, limit: int = SHOWN):
    """The plans, those that fit first, faster first (at most `limit`, the run's own always among them)."""
    import pandas as pd

    rows = report.rows[:limit]
    chosen = report.chosen()
    if chosen is not None and chosen not in rows:
        rows = rows + [chosen]
    frame = pd.DataFrame([r.row(report.capacity) for r in rows])
    frame.index = range(1, len(frame) + 1)
    return frame


def run_mfu(run_dir: Union[str, Path], report: PlanReport) -> float:
    """The MFU a finished run of this model reached on this card: the median tokens/s/card of its metrics
    (after the first iteration) times the FLOPs per token, over the card's peak."""
    files = sorted(Path(run_dir).glob("**/*metrics.jsonl"))
    if not files:
        raise MissingInputError(f"no *metrics.jsonl under {run_dir}; point at a training run's folder.")
    speeds = []
    for line in files[-1].read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("iteration", 0) > 1 and record.get("tokens_per_s_per_card"):
            speeds.append(float(record["tokens_per_s_per_card"]))
    if not speeds or not report.card.peak_tflops:
        raise MissingInputError(
            f"{files[-1]} has no tokens/s/card after the first iteration, or the card's peak is unknown."
        )
    return statistics.median(speeds) * report.flops_per_token / (report.card.peak_tflops * 1e12)


def will_it_fit(plan, card_name: str = "910B-64G", cards: Optional[int] = None) -> list:
    """Notebook 04's answer for a resolved run (kit.train.resolve.TrainPlan) on `cards` cards of `card_name`
    (default: the run's own count): the verdict, the run's plan by term, and the plans ranked; or, where the
    planner cannot run here, the one sentence that says why."""
    from kit.core.show import show
    from kit.errors import KitError
    from kit.plan.planner import inputs_for, make_plan

    overrides = {"cards": cards} if cards else {}
    try:
        report = make_plan(inputs_for(plan, card_name, **overrides))
    except KitError as exc:
        return [show(f"The planner did not run: {exc}")]
    return [show(verdict(report)), memory_table(report), plans_table(report)]


def does_not_fit(plan, card_name: str, cards: int, memory_gib: Optional[float] = None) -> Optional[str]:
    """The one line that refuses a resolved run (kit.train.resolve.TrainPlan) on `cards` cards of `card_name`
    (`memory_gib`: each card's memory instead of the card's own): its plan, the largest term and the nearest plan
    that fits; None when it fits, or when the planner cannot answer here (no torch >= 2.5, a model it cannot
    build): a launch is not refused on a guess."""
    from kit.errors import KitError
    from kit.plan.planner import inputs_for, make_plan

    try:
        report = make_plan(inputs_for(plan, card_name, cards=cards, card_memory_gib=memory_gib))
    except (KitError, OSError, ValueError):
        return None
    chosen = report.chosen()
    if chosen is None or chosen.fits:
        return None
    return t("plan.will_it_fit", verdict=verdict(report))


def local_refusal(plan) -> Optional[str]:
    """does_not_fit for a launch on this machine's own cards (kit train launch): its device, or on a CPU the host
    memory available now shared by the node's ranks."""
    from kit.system.device import detect

    cfg = plan.cfg
    memory_gib = None
    if detect().kind == "cpu":
        from kit.plan.cards import GIB
        from kit.system.memory import available_memory

        memory_gib = available_memory()[0] / GIB / max(1, cfg.nproc_per_node)
    return does_not_fit(plan, "here", cfg.world_size, memory_gib)
