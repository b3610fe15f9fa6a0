"""One lm-eval task through the served endpoint and the same task in-process on the same folder, answer by answer.

Where the engine returns prompt log-probabilities (vLLM: /v1/completions with echo + logprobs) notebook 06's
multiple choice runs through lm-eval's `local-completions`; `transformers serve` returns none, so a short greedy
generation task (the same questions, the answer letter generated) runs through `local-chat-completions`, and
in-process through lm-eval's `hf` model with the tokenizer's chat template: the answers must be equal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from kit.system.noise import quiet

GEN_TASK = "kit_gen_en"
GEN_YAML = """# A short greedy generation task over notebook 06's English questions (written by kit.serve.lmeval).
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{A}}}}\\nB. {{{{B}}}}\\nC. {{{{C}}}}\\nD. {{{{D}}}}\\nAnswer with one letter."
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "^\\\\s*(.*?)\\\\s*$"
      - function: take_first
metadata:
  version: 1.0
"""


def write_generation_task(folder: Path, max_tokens: int = 4, data: Optional[Path] = None) -> Path:
    """The generation task's YAML in `folder`, reading data_samples/eval/mc_en.jsonl (absolute path)."""
    from kit.core.workspace import repo_root

    data = Path(data or repo_root() / "data_samples" / "eval" / "mc_en.jsonl").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{GEN_TASK}.yaml"
    path.write_text(GEN_YAML.format(task=GEN_TASK, data=str(data), max_tokens=max_tokens), encoding="utf-8")
    return path


def _evaluate(model, model_args, folder: Path, task: str, limit: Optional[int], chat: bool) -> Dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from kit.system.progress import hf_bars

    hf_bars()  # the local model's loading bar ends on its last frame in a notebook, as the kit's own loads do

    with quiet(Path(folder) / "lm_eval.log", loggers=("lm_eval",)):
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[task],
            task_manager=TaskManager(include_path=str(folder), include_defaults=False),
            num_fewshot=0,
            limit=limit,
            log_samples=True,
            apply_chat_template=chat,
            batch_size=1,
        )
    res = out["results"][task]
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    metric = "exact_match" if any(k.startswith("exact_match") for k in res) else "acc"
    value = next(v for k, v in res.items() if k.startswith(metric + ",") and not k.endswith("_stderr"))
    return {
        "metric": metric,
        "value": float(value),
        "n": len(samples),
        "answers": [s["filtered_resps"][0] if metric == "exact_match" else None for s in samples],
        "logliks": [[float(r[0]) for r in s["filtered_resps"]] for s in samples] if metric == "acc" else None,
    }


def compare(server, folder, limit: Optional[int] = 3, max_tokens: int = 4) -> Dict[str, Any]:
    """{model_type, task, endpoint, in_process, equal, max_abs_diff}: the task through the server and in-process.

    max_abs_diff: the largest |served - in-process| log-likelihood (None for the generation task). Both sides run the
    weights in the dtype they were saved in (the kit passes vLLM that dtype: `auto` would serve float32 as bfloat16).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only
    folder = Path(folder)
    path = server.info.get("model_path") or server.model
    if server.info.get("prompt_logprobs"):
        from kit.evaluate.tasks import load_task, resolved_yaml

        task = load_task("kit_mc_en", limit)
        resolved_yaml(task, folder)
        name, model_type, chat = task.name, "local-completions", False
        args = {
            "model": server.model,
            "base_url": server.base_url + "/completions",
            "tokenizer": path,
            "tokenizer_backend": "huggingface",
            "num_concurrent": 1,
            "max_retries": 1,
        }
    else:
        write_generation_task(folder, max_tokens)
        name, model_type, chat = GEN_TASK, "local-chat-completions", True
        args = {
            "model": server.model,
            "base_url": server.base_url + "/chat/completions",
            "tokenizer_backend": None,
            "num_concurrent": 1,
            "max_retries": 1,
            "max_gen_toks": max_tokens,
        }
    served = _evaluate(model_type, args, folder, name, limit, chat)
    local = _evaluate("hf", {"pretrained": path, "device": "cpu", "dtype": "auto"}, folder, name, limit, chat)
    diff = None
    if served["metric"] == "exact_match":
        equal = [a.strip() for a in served["answers"]] == [a.strip() for a in local["answers"]]
    else:
        pairs = [(x, y) for a, b in zip(served["logliks"], local["logliks"]) for x, y in zip(a, b)]
        diff = max((abs(x - y) for x, y in pairs), default=0.0)
        equal = diff < 1e-3
    return {
        "model_type": model_type,
        "task": name,
        "endpoint": served,
        "in_process": local,
        "equal": equal,
        "max_abs_diff": diff,
    }


def table(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Rows for a notebook: one per question, the served and the in-process answer."""
    s, loc = result["endpoint"], result["in_process"]
    if s["metric"] != "exact_match":
        return [
            {"question": i, "served_logliks": a, "in_process_logliks": b}
            for i, (a, b) in enumerate(zip(s["logliks"], loc["logliks"]))
        ]
    return [
        {"question": i, "served": a, "in_process": b}
        for i, (a, b) in enumerate(zip(s["answers"], loc["answers"]))
    ]
