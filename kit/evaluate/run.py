"""`run(cfg, ws) -> EvalResult`: base vs trained (or base, SFT and DPO) on held-out loss, preference accuracy on
held-out pairs, multiple choice, answers and speed.

Each model is loaded once, on the chosen device (kit.system.device; adapted with kit ops on NPU), scored on every part,
then released before the next is loaded. The results folder is written under a temporary name and renamed when
complete (kit.storage.atomic); its `evaluation` manifest, written last, names the models, the data split, the tasks and
the device.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from kit.core.configs import check, save_config, to_jsonable
from kit.core.manifest import EVALUATION, write_manifest
from kit.evaluate.config import EvalConfig
from kit.evaluate.inputs import EvalInputs, load_split, resolve
from kit.evaluate.table import invalid_scores, results_table
from kit.storage.hashes import sha256_file

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
SPEED_PNG = "speed.png"


@dataclass
class EvalResult:
    """What one evaluation found: the table (metric x model), the raw results and the files written."""

    config: EvalConfig
    folder: Path
    results: Dict[str, Any]
    inputs: EvalInputs
    manifest_sha256: str = ""
    notes: List[str] = field(default_factory=list)

    @property
    def table(self):
        """One row per metric, one column per model (and the change trained - base, or sft - base and dpo - sft)."""
        import pandas as pd

        return pd.read_csv(self.folder / RESULTS_CSV, index_col=0)

    @property
    def preference(self):
        """Did alignment help: one row per model, preference accuracy and margin on the held-out pairs (with DPO's
        implicit reward against its reference) next to held-out loss and multiple-choice accuracy; None without
        pairs (preference_note says why)."""
        from kit.evaluate.preference import side_by_side

        return side_by_side(self.results, self.table)

    @property
    def preference_note(self) -> str:
        """The preference result in one sentence, or why there is none."""
        from kit.evaluate.preference import note

        return note(self.results)

    @property
    def speed(self):
        import pandas as pd

        return pd.DataFrame(self.results.get("speed", []))

    @property
    def speed_note(self) -> str:
        """Whether trained and base differ in speed beyond the measured noise, in one sentence (kit.evaluate.speed)."""
        from kit.evaluate.speed import noise_note

        return noise_note(self.speed)

    def speed_plot(self):
        """speed.png as an image for the notebook, or one sentence when the speed was not measured."""
        from kit.core.show import Sentence

        path = self.folder / SPEED_PNG
        if not path.is_file():
            return Sentence("The speed was not measured ('speed' is not in PARTS).")
        from IPython.display import Image

        return Image(filename=str(path))

    @property
    def generations(self):
        import pandas as pd

        gens = self.results.get("generations") or {}
        if not gens:
            return pd.DataFrame()
        return pd.DataFrame({"prompt": self.results["prompts"], **gens})

    def summary(self) -> Dict[str, Any]:
        """Scalars and paths for the notebook's summary.json (and `make demo`)."""
        out: Dict[str, Any] = {
            "folder": str(self.folder),
            "results_json": str(self.folder / RESULTS_JSON),
            "results_csv": str(self.folder / RESULTS_CSV),
            "speed_plot": str(self.folder / SPEED_PNG) if (self.folder / SPEED_PNG).is_file() else None,
            "manifest_sha256": self.manifest_sha256,
            "model": str(self.inputs.model),
            "base_model": str(self.inputs.base) if self.inputs.base else None,
            "models": dict(self.results["paths"]),
            "data": str(self.inputs.data) if self.inputs.data else None,
            "heldout": self.inputs.heldout,
            "sft_run": str(self.inputs.sft_run) if self.inputs.sft_run else None,
            "dpo_run": str(self.inputs.dpo_run) if self.inputs.dpo_run else None,
            "pairs": str(self.inputs.pairs) if self.inputs.pairs else None,
            "pairs_heldout": (self.results.get("preference") or {}).get("heldout"),
            "device": self.results["device"]["device"],
            "engine": self.results.get("engine"),
            "consumed": [to_jsonable(c.__dict__) for c in self.inputs.consumed],
            "notes": list(self.notes),
        }
        for label, scores in self.results["models"].items():
            for key, value in scores.items():
                if isinstance(value, (int, float)) or value is None:
                    out[f"{label}_{key}"] = value
        return out


def _device(cfg: EvalConfig):
    from kit.system.device import detect

    return detect(cfg.device)


def _load(path: Path, info, adapt: bool, notes: List[str]):
    import torch
    from transformers import AutoTokenizer

    from kit.convert.weights_check import check_hf_weights
    from kit.system.hf_compat import load_causal_lm

    check_hf_weights(path)  # a damaged shard or NaN / inf weights: one line naming the file, before any score
    tok = AutoTokenizer.from_pretrained(str(path))
    model = load_causal_lm(path, info.torch_dtype).eval()
    model.to(torch.device(info.device))
    if info.kind == "npu" and adapt:
        from kit.adapt import adapt_model

        try:
            adapt_model(model)
        except ValueError as exc:  # a model type kit.adapt was not checked on: run it as transformers has it
            notes.append(f"{path.name}: not adapted ({exc})")
    return model, tok


def _heldout_rows(inputs: EvalInputs, limit: int):
    fix = "prepare the data again with notebook 02."
    return load_split(inputs.heldout["path"], ("input_ids", "labels"), limit, fix)


def run(cfg: EvalConfig, ws, progress: bool = True) -> EvalResult:
    """Evaluate the trained model (and its base) as `cfg` says; write the results folder; see the module doc."""
    import pandas as pd

    from kit.evaluate import harness, speed
    from kit.evaluate.generation import chat_prompt, generate_answers, read_prompts
    from kit.evaluate.preference import load_pairs, score_pairs
    from kit.evaluate.scoring import heldout_loss, score_task
    from kit.evaluate.tasks import load_task
    from kit.storage.atomic import atomic_dir

    check(cfg)
    parts = list(cfg.parts)
    evaluations = Path(ws.model_output) / "evaluations"
    # check everything the user handed in before any model is loaded
    prompts = read_prompts(cfg.prompts, cfg.prompts_file) if "generation" in parts else []
    tasks = [load_task(t, cfg.task_limit or None) for t in cfg.tasks] if "accuracy" in parts else []
    engine = None
    if tasks:
        engine = cfg.engine if cfg.engine != "auto" else ("lm-eval" if harness.available() else "kit")
        if engine == "lm-eval":
            harness.require()
    inputs = resolve(cfg, ws, evaluations)
    notes = list(inputs.notes)
    for note in _skipped(parts, inputs):
        print(note)
        notes.append(note)
    info = _device(cfg)
    if cfg.out_dir:
        folder = Path(cfg.out_dir).expanduser()
    elif inputs.run is not None:
        folder = inputs.run / "evaluation" / cfg.name
    else:
        folder = evaluations / cfg.name
    models = inputs.models()
    results: Dict[str, Any] = {
        "device": {"kind": info.kind, "device": info.device, "name": info.name, "dtype": info.dtype},
        "engine": engine,
        "models": {},
        "paths": {label: str(path) for label, path in models},
        "tasks": {},
        "preference": None,
        "prompts": prompts,
        "generations": {},
        "speed": [],
        "seconds": {},  # wall time of each part per model (not a benchmark: shows where the time went)
    }
    heldout = _heldout_rows(inputs, cfg.heldout_rows) if "heldout" in parts else None
    pairs = load_pairs(inputs.pairs_heldout, cfg.heldout_rows) if "preference" in parts else None
    roles = inputs.reward_roles if pairs is not None and inputs.beta is not None else None
    scored: Dict[str, Any] = {}  # label -> PairScores, for the DPO model's reward against its reference
    if pairs is not None:
        results["preference"] = {
            "data": str(inputs.pairs),
            "heldout": inputs.pairs_heldout,
            "pairs": len(pairs),
            "beta": inputs.beta,
            "policy": roles[0] if roles else None,
            "reference": roles[1] if roles else None,
            "models": {},
        }
    from kit.errors import writing

    # a failed write that names no file (a library's writer on a full disk) names the evaluation folder
    with writing(folder), atomic_dir(folder, overwrite=cfg.overwrite, what="evaluation folder") as tmp:
        for label, path in models:
            print(f"{label}: {path}")
            model, tok = _load(path, info, cfg.adapt, notes)
            scores: Dict[str, Any] = {}
            clock = results["seconds"].setdefault(label, {})
            t0 = time.perf_counter()
            if heldout is not None:
                h = heldout_loss(model, heldout)
                scores.update(heldout_loss=h.loss, heldout_perplexity=h.perplexity, heldout_tokens=h.tokens)
                t0 = _lap(clock, "heldout", t0)
            if pairs is not None:
                pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
                p = scored[label] = score_pairs(model, pairs, pad)
                results["preference"]["models"][label] = p.as_dict()
                scores.update(
                    preference_accuracy=p.accuracy, preference_margin=p.margin, preference_pairs=p.pairs
                )
                if roles and label == roles[0] and roles[1] in scored:
                    scores.update(p.rewards(scored[roles[1]], inputs.beta))
                t0 = _lap(clock, "preference", t0)
            if tasks:
                if engine == "lm-eval":
                    found = harness.run_lm_eval(model, tok, tasks, tmp / "tasks")
                else:
                    found = {t.name: score_task(model, tok, t, progress=progress) for t in tasks}
                for t in tasks:
                    r = found[t.name]
                    scores[f"{t.name}_acc"] = r["acc"]
                    scores[f"{t.name}_acc_norm"] = r["acc_norm"]
                    results["tasks"].setdefault(
                        t.name,
                        {
                            "yaml": str(t.yaml_path),
                            "data": str(t.data_file),
                            "questions": r["n"],
                            "models": {},
                        },
                    )
                    results["tasks"][t.name]["models"][label] = {
                        k: v for k, v in r.items() if k in ("acc", "acc_norm", "n", "logliks", "details")
                    }
                t0 = _lap(clock, "accuracy", t0)
            if prompts:
                ids = [
                    chat_prompt(tok, p, inputs.template, str(path), inputs.enable_thinking) for p in prompts
                ]
                results["generations"][label] = generate_answers(model, tok, ids, cfg.max_new_tokens)
                t0 = _lap(clock, "generation", t0)
            if "speed" in parts:
                rows = speed.benchmark(
                    model, cfg.batch_sizes, cfg.prompt_lengths, cfg.decode_tokens, len(tok), cfg.repeats
                )
                for row in rows:
                    row["model"] = label
                results["speed"].extend(rows)
                first = rows[0]
                scores["ttft_ms"] = first["ttft_ms"]
                scores["decode_tokens_per_s"] = first["decode_tokens_per_s"]
                scores["decode_tokens_per_s_max"] = max(r["decode_tokens_per_s"] for r in rows)
                _lap(clock, "speed", t0)
            results["models"][label] = scores
            bad = invalid_scores(scores, results["tasks"], label)
            if bad:
                results.setdefault("invalid", {})[label] = bad
                note = (
                    f"{label}: {', '.join(bad)} invalid: the model's scores are NaN or infinite, so no number is "
                    f"reported (check its weights and the dtype: fp16 overflows where bf16 does not)"
                )
                print(note)
                notes.append(note)
            del model
            gc.collect()
        table = results_table(results, [label for label, _ in models])
        table.to_csv(tmp / RESULTS_CSV)
        if results["speed"]:
            import matplotlib.pyplot as plt

            fig = speed.plot(
                pd.DataFrame(results["speed"]), tmp / SPEED_PNG, title=f"inference on {info.device}"
            )
            plt.close(fig)
        results["notes"] = notes
        (tmp / RESULTS_JSON).write_text(
            json.dumps(to_jsonable(results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        save_config(cfg, tmp)
        man = write_manifest(
            tmp,
            EVALUATION,
            {
                "model": str(inputs.model),
                "base_model": str(inputs.base) if inputs.base else None,
                "data": str(inputs.data) if inputs.data else None,
                "heldout": inputs.heldout if heldout is not None else None,
                "models": results["paths"],
                "pairs": str(inputs.pairs) if pairs is not None else None,
                "pairs_heldout": inputs.pairs_heldout if pairs is not None else None,
                "sft_run": str(inputs.sft_run) if inputs.sft_run else None,
                "dpo_run": str(inputs.dpo_run) if inputs.dpo_run else None,
                "tasks": [
                    {
                        "name": t.name,
                        "yaml": str(t.yaml_path),
                        "data": str(t.data_file),
                        "data_sha256": sha256_file(t.data_file),
                    }
                    for t in tasks
                ],
                "engine": engine,
                "device": results["device"],
                "parts": parts,
                "results": RESULTS_JSON,
                "table": RESULTS_CSV,
                "training_run": str(inputs.run) if inputs.run else None,
            },
            inputs=inputs.consumed,
        )
        sha = man.sha256
    return EvalResult(
        config=cfg, folder=folder.resolve(), results=results, inputs=inputs, manifest_sha256=sha, notes=notes
    )


def _skipped(parts: List[str], inputs: EvalInputs) -> List[str]:
    """Take out of `parts` what the inputs leave nothing to score for; one sentence each that says why."""
    out = []
    if "heldout" in parts and not inputs.heldout:
        if inputs.data:
            why = f"the data {inputs.data} names no held-out split (notebook 02 holds one out)"
        elif inputs.pairs:
            why = "the run trained on preference pairs, scored as preference accuracy (DATA names SFT data to score)"
        else:
            why = "no prepared data given (DATA) or recorded by the run"
        out.append(f"held-out loss skipped: {why}")
        parts.remove("heldout")
    if "preference" in parts and not inputs.pairs_heldout:
        if inputs.pairs:
            why = f"the pairs {inputs.pairs} hold none out (notebook 02 holds pairs out with HELDOUT_RECORDS > 0)"
        else:
            why = inputs.no_pairs or "no preference pairs given (PAIRS) or recorded by a DPO run"
        out.append(f"preference accuracy skipped: {why}.")
        parts.remove("preference")
    return out


def _lap(clock: Dict[str, float], part: str, start: float) -> float:
    now = time.perf_counter()
    clock[part] = round(now - start, 3)
    return now
