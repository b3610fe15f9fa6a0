"""`python -m kit evaluate`: base vs trained model on held-out loss, multiple choice, answers and speed."""

from __future__ import annotations

import argparse

from kit.core.configs import add_config_arguments, explicit_values
from kit.evaluate.config import EvalConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="compare a trained model with its base (after DPO: base, SFT and DPO): held-out loss/perplexity, "
        "preference accuracy on held-out pairs, multiple-choice accuracy (lm-eval), answers side by side, time to "
        "first token and decode tokens/s",
        description="Reads notebook 04's training-run manifest (default: the named run: notebook 04's, else the last one finished) or a model "
        "folder; writes results.csv / results.json / speed.png and an evaluation manifest.",
    )
    add_config_arguments(p, EvalConfig)  # one option per EvalConfig field, help from its field docstring
    from kit.core.project import add_workspace_arguments

    add_workspace_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Expected failures raise KitErrors: `python -m kit` prints `error: ...` and exits 2."""
    from kit.core.workspace import get_workspace
    from kit.evaluate.run import run as evaluate
    from kit.storage.partial import sigterm_as_interrupt

    cfg = EvalConfig(**explicit_values(args, EvalConfig))
    with sigterm_as_interrupt():  # SIGTERM removes the unfinished evaluation folder like Ctrl-C
        result = evaluate(cfg, get_workspace(args.workspace, model=args.workspace_model), progress=False)
    print(result.table.to_string())
    if result.preference is not None:  # without pairs, the line saying why was printed already
        print(result.preference_note)
    print(f"results: {result.folder}")
    return 0
