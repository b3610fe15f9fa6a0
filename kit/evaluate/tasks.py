"""Multiple-choice tasks: lm-eval task YAML files that read local question files, checked line by line.

A task is a YAML file in the format of EleutherAI's lm-evaluation-harness (lm-eval 0.4, `output_type:
multiple_choice`): `dataset_path` json | csv | parquet, `dataset_kwargs.data_files` naming local files (relative
paths are taken relative to the YAML file), `doc_to_text` / `doc_to_choice` / `doc_to_target` as Jinja templates,
exactly like lm-eval's own `mmlu` and `ceval-valid` tasks. The kit reads the same file to check every question
before anything runs (a missing field or an answer key out of range is an error naming file and line), renders
the prompts the way lm-eval does (same Jinja settings, target delimiter, description), and writes a copy with
absolute paths that lm-eval itself can load (`resolved_yaml`).
"""

from __future__ import annotations

import ast
import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from kit.core.samples.paths import DATA_SAMPLES
from kit.errors import InputError, MissingInputError

PathLike = Union[str, Path]
SAMPLE_TASKS_DIR = DATA_SAMPLES / "eval"
SAMPLE_TASKS = ("kit_mc_en", "kit_mc_zh")
REQUIRED_KEYS = ("task", "dataset_path", "dataset_kwargs", "output_type", "doc_to_text", "doc_to_choice")
LOCAL_FORMATS = ("json", "csv", "parquet")


@dataclass
class Question:
    """One rendered question: where it came from, the prompt, the choices and the index of the right one."""

    line: int  # line of the file (1-based; parquet: row number)
    context: str
    choices: List[str]
    gold: int


@dataclass
class MCTask:
    """A checked multiple-choice task: its YAML, the questions of its evaluation split, rendered."""

    name: str
    yaml_path: Path
    spec: Dict[str, Any]
    data_file: Path
    questions: List[Question] = field(default_factory=list)

    @property
    def target_delimiter(self) -> str:
        return str(self.spec.get("target_delimiter", " "))


def task_path(name_or_path: PathLike) -> Path:
    """A shipped task name (kit_mc_en, kit_mc_zh) or a YAML path -> the YAML file."""
    p = Path(str(name_or_path)).expanduser()
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise MissingInputError(f"task file {str(p)!r} does not exist; give an lm-eval task YAML file.")
        return p
    shipped = SAMPLE_TASKS_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise MissingInputError(
        f"task {str(name_or_path)!r} is neither a YAML file nor a shipped task ({', '.join(SAMPLE_TASKS)}); "
        f"give the path of an lm-eval task YAML (see data_samples/eval/README.md)."
    )


def _jinja_env():
    import jinja2

    # The settings lm-eval 0.4 renders its templates with (lm_eval/utils.py `env`): missing names are errors.
    return jinja2.Environment(
        loader=jinja2.BaseLoader(), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )


def _load_yaml(path: Path) -> Tuple[Dict[str, Any], Dict[str, int]]:
    """The YAML mapping and the line of each top-level key (for errors)."""
    import yaml

    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "?"
        raise InputError(f"{path}: {where}: not valid YAML ({getattr(exc, 'problem', exc)}).") from None
    if not isinstance(data, dict) or node is None:
        raise InputError(f"{path}: line 1: a task file must be a YAML mapping (task:, dataset_path:, ...).")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if hasattr(k, "value")}
    return data, lines


def _data_file(path: Path, spec: Dict[str, Any], lines: Dict[str, int]) -> Tuple[Path, str]:
    """The local file of the evaluation split (test_split, else validation_split, else the only one)."""
    files = (spec.get("dataset_kwargs") or {}).get("data_files")
    line = lines.get("dataset_kwargs", 1)
    if files is None:
        raise InputError(
            f"{path}: line {line}: dataset_kwargs has no data_files; name the local question file."
        )
    split = spec.get("test_split") or spec.get("validation_split") or "test"
    if isinstance(files, dict):
        chosen = files.get(split)
        if chosen is None:
            raise InputError(
                f"{path}: line {line}: data_files has no split {split!r} (has {sorted(files)}); "
                f"set test_split to one of them."
            )
    else:
        chosen = files
    if isinstance(chosen, list):
        if len(chosen) != 1:
            raise InputError(f"{path}: line {line}: give one file per split (got {len(chosen)}).")
        chosen = chosen[0]
    file = Path(str(chosen)).expanduser()
    if not file.is_absolute():
        file = path.parent / file
    if not file.is_file():
        raise MissingInputError(f"{path}: line {line}: data file {str(file)!r} does not exist.")
    return file.resolve(), split


def _rows(file: Path, fmt: str, column_names: Optional[List[str]]):
    """(line, record) of a jsonl / csv / parquet question file."""
    if fmt == "json":
        with open(file, encoding="utf-8") as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError as exc:
                    raise InputError(f"{file}: line {n}: not valid JSON ({exc}).") from None
                if not isinstance(rec, dict):
                    raise InputError(f"{file}: line {n}: a question must be a JSON object.")
                yield n, rec
    elif fmt == "csv":
        with open(file, encoding="utf-8-sig", newline="") as fh:
            reader = csv.reader(fh)
            header = list(column_names) if column_names else next(reader, None)
            if not header:
                return
            for row in reader:
                if not any(c.strip() for c in row):
                    continue
                rec = {h: row[i] for i, h in enumerate(header) if i < len(row) and h}
                yield reader.line_num, rec
    else:
        import pyarrow.parquet as pq

        for n, rec in enumerate(pq.read_table(str(file)).to_pylist(), 1):
            yield n, rec


def _render(env, template: Any, doc: Dict[str, Any]) -> Any:
    """lm-eval's rule: a field name is that field's value, anything else a Jinja template."""
    if isinstance(template, str) and template in doc:
        return doc[template]
    if isinstance(template, str):
        return env.from_string(template).render(**doc)
    return template


def _choices(env, spec, doc) -> List[str]:
    raw = _render(env, spec["doc_to_choice"], doc)
    if isinstance(raw, str):
        raw = ast.literal_eval(raw)
    return [str(c) for c in raw]


def _target(env, spec, doc, choices: List[str]) -> Any:
    raw = _render(env, spec.get("doc_to_target", "answer"), doc)
    if isinstance(raw, str):
        text = raw.strip()
        if text.isdigit():
            return int(text)
        if text in choices:
            return choices.index(text)
        return text
    return raw


def load_task(name_or_path: PathLike, limit: Optional[int] = None) -> MCTask:
    """Read and check a multiple-choice task YAML and its question file; every error names file and line."""
    import jinja2
    import jinja2.meta

    path = task_path(name_or_path).resolve()
    spec, lines = _load_yaml(path)
    missing = [k for k in REQUIRED_KEYS if k not in spec]
    if missing:
        raise InputError(
            f"{path}: line 1: the task lacks {', '.join(repr(k) for k in missing)}; a multiple-choice task "
            f"needs {', '.join(REQUIRED_KEYS)} (see data_samples/eval/kit_mc_en.yaml)."
        )
    if spec["output_type"] != "multiple_choice":
        raise InputError(
            f"{path}: line {lines['output_type']}: output_type {spec['output_type']!r}; the kit evaluates "
            f"multiple_choice tasks (run other lm-eval tasks with lm-eval itself)."
        )
    fmt = spec["dataset_path"]
    if fmt not in LOCAL_FORMATS:
        raise InputError(
            f"{path}: line {lines['dataset_path']}: dataset_path {fmt!r} is not a local format; use one of "
            f"{', '.join(LOCAL_FORMATS)} with dataset_kwargs.data_files naming the downloaded file."
        )
    if int(spec.get("num_fewshot") or 0) > 0:
        raise InputError(
            f"{path}: line {lines['num_fewshot']}: num_fewshot {spec['num_fewshot']}: the kit compares models "
            f"zero-shot; remove it (or run lm-eval directly for few-shot numbers)."
        )
    data_file, _ = _data_file(path, spec, lines)
    env = _jinja_env()
    needed = set()
    for key in ("doc_to_text", "doc_to_choice", "doc_to_target", "description"):
        tpl = spec.get(key)
        if isinstance(tpl, str):
            try:
                needed |= jinja2.meta.find_undeclared_variables(env.parse(tpl))
            except jinja2.TemplateSyntaxError as exc:
                raise InputError(
                    f"{path}: line {lines.get(key, 1)}: {key} is not a valid Jinja template ({exc.message})."
                ) from None
    task = MCTask(name=str(spec["task"]), yaml_path=path, spec=spec, data_file=data_file)
    column_names = (spec.get("dataset_kwargs") or {}).get("column_names")
    for line, doc in _rows(data_file, fmt, column_names):
        if limit is not None and len(task.questions) >= limit:
            break
        absent = sorted(
            n for n in needed if n not in doc or doc[n] is None or (isinstance(doc[n], str) and not doc[n])
        )
        # a template may name a field that is plainly not in any row only when the task is broken itself
        if absent:
            raise InputError(
                f"{data_file}: line {line}: missing field(s) {', '.join(map(repr, absent))} that the task "
                f"{path.name} uses; every question needs {', '.join(sorted(needed))}."
            )
        try:
            context = str(_render(env, spec["doc_to_text"], doc))
            if spec.get("description"):
                context = str(_render(env, spec["description"], doc)) + context
            choices = _choices(env, spec, doc)
            gold = _target(env, spec, doc, choices)
        except (jinja2.TemplateError, ValueError, SyntaxError, TypeError, IndexError) as exc:
            shown = {k: doc[k] for k in sorted(needed) if k in doc and k not in ("question",)}
            raise InputError(
                f"{data_file}: line {line}: cannot read this question ({type(exc).__name__}: {exc}); "
                f"its fields {shown} do not fit {path.name} (an answer key out of range?)."
            ) from None
        if not isinstance(gold, int) or not 0 <= gold < len(choices):
            shown = {k: doc[k] for k in sorted(needed) if k in doc and k != "question"}
            raise InputError(
                f"{data_file}: line {line}: answer key {gold!r} is out of range for choices "
                f"{choices} ({shown})."
            )
        task.questions.append(Question(line=line, context=context, choices=choices, gold=gold))
    if not task.questions:
        raise InputError(f"{data_file}: line 1: the file holds no questions.")
    return task


def resolved_yaml(task: MCTask, folder: PathLike) -> Path:
    """Write the task YAML with its data file as an absolute path into `folder` (for lm-eval's TaskManager)."""
    import yaml

    from kit.storage.atomic import atomic_write_text

    spec = json.loads(json.dumps(task.spec, default=str))
    kwargs = dict(spec.get("dataset_kwargs") or {})
    split = spec.get("test_split") or spec.get("validation_split") or "test"
    kwargs["data_files"] = {split: str(task.data_file)}
    spec["dataset_kwargs"] = kwargs
    if not spec.get("test_split") and not spec.get("validation_split"):
        spec["test_split"] = split
    out = Path(folder) / f"{task.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, yaml.safe_dump(spec, allow_unicode=True, sort_keys=False))
    return out
