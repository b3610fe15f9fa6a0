"""Multiple-choice accuracy through EleutherAI's lm-eval harness (the optional `evaluate` extra), offline.

The checked tasks are written with absolute data paths into the evaluation folder and loaded with lm-eval's
`TaskManager(include_path=...)`; the model already in memory is passed as an `HFLM`, so lm-eval and the kit score
the very same weights. lm-eval reads the local files through `datasets` (json / csv / parquet builders): nothing
is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Dict, List

from kit.errors import MissingInputError
from kit.system.noise import quiet


def available() -> bool:
    """True when lm-eval is installed (`pip install -e .[evaluate]`)."""
    return importlib.util.find_spec("lm_eval") is not None


def require() -> None:
    if not available():
        raise MissingInputError(
            "ENGINE='lm-eval' needs EleutherAI's lm-eval harness: `pip install -e .[evaluate]` (or "
            "`pip install lm-eval==0.4.13`), or use ENGINE='kit' (the same log-likelihood recipe, computed by the kit)."
        )


def run_lm_eval(model, tokenizer, tasks: List[Any], folder: Path, batch_size: int = 4) -> Dict[str, Dict]:
    """{task name: {acc, acc_norm, n, logliks}} from lm-eval's `simple_evaluate` on the given model object."""
    require()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only; never a hub look-up
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from kit.evaluate.tasks import resolved_yaml

    folder = Path(folder)
    for task in tasks:
        resolved_yaml(task, folder)
    # lm-eval warns that a model object (not a hub name) was passed and that num_fewshot is set: both intended
    with quiet(Path(folder) / "lm_eval.log", loggers=("lm_eval",)):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(model.device))
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[t.name for t in tasks],
            task_manager=TaskManager(include_path=str(folder), include_defaults=False),
            num_fewshot=0,
            log_samples=True,
        )
    results = {}
    for task in tasks:
        res = out["results"][task.name]
        samples = sorted(out["samples"][task.name], key=lambda s: s["doc_id"])
        results[task.name] = {
            "acc": float(res["acc,none"]),
            "acc_norm": float(res.get("acc_norm,none", float("nan"))),
            "n": len(samples),
            "logliks": [[float(r[0]) for r in s["filtered_resps"]] for s in samples],
        }
    return results
