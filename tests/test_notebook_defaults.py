"""One source for every default: a notebook parameter bound to a config field shows that field's default.

Which parameter fills which field is read from the notebook itself: the cell after the parameters cell calls
`bind(SomeConfig, globals(), field=PARAM, ...)`, and `bind` fills each field whose UPPER_SNAKE name is a parameter.
A notebook may pick another value for its CPU demo (fewer steps, shorter samples, re-runnable outputs), but then
the parameter's comment says `(default X)` with the config's default, so the reader sees both and they cannot drift.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re

import pytest

from kit.notebooks import numbered_notebooks, parameter_cells, parameters_of

NOTEBOOKS = numbered_notebooks()

# Parameters that fill no config field, each with the reason. A name here that a notebook binds is an error too.
NOT_CONFIG = {
    "WORKSPACE": "the workspace folder every notebook opens (kit.workspace.get_workspace)",
    "MODEL": "the workspace's model folder (notebook 04 passes it as TrainConfig.model_name, checked there)",
    "ENVS_ROOT": "None picks a folder from the workspace (kit.envs.default_envs_root), not a config default",
    "KERNEL_CODE": "code run in the new Jupyter kernel to show it works; notebook 01 only",
    "TOKENIZER": "None means the demo model's tokenizer folder, which the notebook resolves before binding",
    "SOURCE": "None means the demo model SmolLM2-135M-Instruct, which the notebook resolves before binding",
    "CHECK_LOGITS": "an argument of kit.convert.verify (the checks after a conversion), not of ConvertConfig",
    "BACK_TO_HF": "an argument of kit.convert.verify, not of ConvertConfig",
    "LOGITS_TOKENS": "an argument of kit.convert.verify, not of ConvertConfig",
    "LAUNCH_ITERS": "steps of the torchrun launch notebook 04 demonstrates after its own run",
    "LAUNCH_NPROC": "processes of that launch",
    "PROMPT": "the prompt of notebook 04's before/after generation",
    "MAX_NEW_TOKENS": "tokens of notebook 04's before/after generation (EvalConfig has its own, checked in 06)",
    "RUN": "notebook 05: an argument of kit.profiling.run (which training run to profile)",
    "MODEL_PATH": "notebook 05: an argument of kit.profiling.run (only without a training run)",
    "SEQ_LEN": "notebook 05: an argument of kit.profiling.run (only without a training run)",
    "SAMPLE_PROFILE": "notebook 05: which Ascend profile folder the analysis part reads",
    "TOP": "notebook 05: how many operators its tables and charts show",
}
_DEFAULT_NOTE = re.compile(r"\(default ([^()]+)\)")


def _second_cell(nb_path) -> str:
    cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
    at = cells.index(parameter_cells(nb_path)[0])
    return next("".join(c["source"]) for c in cells[at + 1 :] if c["cell_type"] == "code")


def bound_parameters(nb_path) -> dict:
    """{PARAMETER: [(config class, field name), ...]} as the notebook's `bind(...)` calls fill them."""
    params = parameters_of(nb_path)
    tree = ast.parse(_second_cell(nb_path))
    imported = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    out: dict = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "bind"):
            continue
        module, name = imported[call.args[0].id]
        cls = getattr(importlib.import_module(module), name)
        given = {kw.arg: kw.value for kw in call.keywords}
        for f in dataclasses.fields(cls):
            value = given.get(f.name)
            if f.name not in given and f.name.upper() in params:
                out.setdefault(f.name.upper(), []).append((cls, f.name))
            elif isinstance(value, ast.Name) and value.id in params:  # field=PARAM: the parameter, unchanged
                out.setdefault(value.id, []).append((cls, f.name))
    return out


def _default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _comments(nb_path) -> dict:
    lines = "".join(parameter_cells(nb_path)[0]["source"]).splitlines()
    return {ln.split("=", 1)[0].strip(): ln.split("  # ", 1)[-1] for ln in lines if "  # " in ln}


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_parameters_show_the_config_defaults(nb_path):
    params, bound, comments = parameters_of(nb_path), bound_parameters(nb_path), _comments(nb_path)
    problems = []
    for name, value in params.items():
        if name not in bound:
            if name not in NOT_CONFIG:
                problems.append(f"{name} fills no config field: bind it, or list it in NOT_CONFIG with why")
            continue
        for cls, field in bound[name]:
            default = _default(cls, field)
            note = _DEFAULT_NOTE.search(comments.get(name, ""))
            if value == default and type(value) is type(default):
                if note:
                    problems.append(f"{name} = {value!r} is the default; drop its '(default ...)' note")
            elif note is None:
                problems.append(
                    f"{name} = {value!r} but {cls.__name__}.{field} defaults to {default!r}: use the default, "
                    f"or say '(default {default!r})' in its comment"
                )
            elif ast.literal_eval(note.group(1)) != default:
                problems.append(
                    f"{name}: its comment says (default {note.group(1)}), the config says {default!r}"
                )
    assert problems == []


def test_every_exemption_is_needed():
    """A NOT_CONFIG name is a parameter that some notebook does not bind (else it is checked, not exempt)."""
    unbound = {n for p in NOTEBOOKS for n in set(parameters_of(p)) - set(bound_parameters(p))}
    assert sorted(set(NOT_CONFIG) - unbound) == []


def test_bindings_are_read_from_the_notebooks():
    """The mapping is derived, not listed: spot checks of each way a parameter reaches a field."""
    by_nb = {p.name[:2]: bound_parameters(p) for p in NOTEBOOKS}
    from kit.data.config import DataConfig
    from kit.train.config import TrainConfig

    assert by_nb["02"]["TEMPLATE"] == [(DataConfig, "template")] * 2  # both bind calls, by its name
    assert by_nb["02"]["SFT_NAME"] == [(DataConfig, "name")]  # given as name=SFT_NAME
    assert by_nb["04"]["MODEL"] == [(TrainConfig, "model_name")]
    assert "TOKENIZER" not in by_nb["02"] and "SOURCE" not in by_nb["03"]  # resolved before binding: exempt
    assert all(set(b) <= set(parameters_of(p)) for p, b in zip(NOTEBOOKS, by_nb.values()))
