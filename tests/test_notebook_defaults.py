"""One source for every default: a notebook parameter shows the default of the config field or kit argument it sets.

Which parameter reaches what is read from the notebook itself: the cell after the parameters cell calls
`bind(SomeConfig, globals(), field=PARAM, ...)`, and `bind` fills each field whose UPPER_SNAKE name is a parameter;
later cells pass parameters to kit functions (`kp.run(cfg, ws, top=TOP)`, `generate(path, PROMPT, MAX_NEW_TOKENS)`),
whose signatures hold defaults too. The demo's values (fewer steps, shorter samples, re-runnable outputs) are not
in the notebooks: data_samples/demo_settings.json holds them and `python -m kit demo`, nbval and the notebook tests
inject them. A notebook that still picks another value for a real user says `(default X)` in the comment, with the
kit's default, so the reader sees both and the test keeps them equal.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import typing

import pytest

from kit.core.notebooks import (
    DEMO_SETTINGS,
    demo_parameters,
    numbered_notebooks,
    parameter_cells,
    parameters_of,
)

# committed notebooks against the kit's own defaults: the same on every stack (and typing.get_type_hints cannot
# evaluate the kit's `X | None` annotations on Python 3.9)
pytestmark = pytest.mark.dev_stack

NOTEBOOKS = numbered_notebooks()

# Parameters that reach neither a config field nor a kit function argument with a default, each with the reason
# (a name here that every notebook binds is an error too).
EXEMPT = {
    "ENVS_ROOT": "None picks a folder from the workspace (kit.envs.default_envs_root), not a config default",
    "TOKENIZER": "None means the demo model's tokenizer folder, which the notebook resolves before binding",
    "SOURCE": "None means the demo model SmolLM2-135M-Instruct, which the notebook resolves before binding",
    "LAUNCH_ITERS": "steps of the torchrun launch notebook 04 demonstrates after its own run",
    "LAUNCH_NPROC": "processes of that launch (a change of the notebook's TrainConfig, which has its own default)",
    "DPO_ITERS": "steps of the DPO run notebook 04 trains from its own run (a change of the notebook's TrainConfig)",
    "PROMPT": "the prompt of notebook 04's before/after generation (kit.train.export.generate: no default)",
}
_DEFAULT_NOTE = re.compile(r"\(default ([^()]+)\)")


def _code_cells(nb_path) -> list:
    """The notebook's code cells after the parameters cell (the second cell first)."""
    cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
    at = cells.index(parameter_cells(nb_path)[0])
    return [ast.parse("".join(c["source"])) for c in cells[at + 1 :] if c["cell_type"] == "code"]


def _imports(trees) -> dict:
    """Local name -> the object a notebook's `from m import x` / `import m as x` lines give it."""
    out = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("kit"):
                for alias in node.names:
                    out[alias.asname or alias.name] = getattr(
                        importlib.import_module(node.module), alias.name
                    )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("kit") and alias.asname:
                        out[alias.asname] = importlib.import_module(alias.name)
    return out


def _field_default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _callee(call: ast.Call, names: dict):
    """The kit function (or method) a call names, if the notebook's imports and assignments say which."""
    func, target = call.func, None
    if isinstance(func, ast.Name):
        target = names.get(func.id)
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        target = getattr(names.get(func.value.id), func.attr, None)
    return target if callable(target) and getattr(target, "__module__", "").startswith("kit") else None


def bound_parameters(nb_path) -> dict:
    """{PARAMETER: [(where, default), ...]}: the config fields the notebook's `bind(...)` calls fill with it, and
    the kit function arguments with a default that it is passed to as `name=PARAMETER`."""
    params, trees = parameters_of(nb_path), _code_cells(nb_path)
    names = _imports(trees)
    out: dict = {}
    for call in ast.walk(trees[0]):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "bind"):
            continue
        cls = names[call.args[0].id]
        given = {kw.arg: kw.value for kw in call.keywords}
        for f in dataclasses.fields(cls):
            value = given.get(f.name)
            if f.name not in given and f.name.upper() in params:
                param = f.name.upper()
            elif isinstance(value, ast.Name) and value.id in params:  # field=PARAM: the parameter, unchanged
                param = value.id
            else:
                continue
            out.setdefault(param, []).append((f"{cls.__name__}.{f.name}", _field_default(cls, f.name)))
    for node in (n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Assign)):
        made = _callee(node.value, names) if isinstance(node.value, ast.Call) else None
        returns = typing.get_type_hints(made).get("return") if inspect.isfunction(made) else None
        if (
            isinstance(returns, type)
            and returns.__module__.startswith("kit")
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            names[node.targets[0].id] = returns  # `result = run(cfg, ws)`: result.verify(...) is resolved too
    for call in (n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Call)):
        target = _callee(call, names)
        if target is None or getattr(call.func, "id", None) == "bind":
            continue
        args = list(inspect.signature(target).parameters.values())
        if isinstance(call.func, ast.Attribute) and isinstance(names.get(call.func.value.id), type):
            args = args[1:]  # a method looked up on the class: self
        passed = [(a, v) for a, v in zip(args, call.args)]
        passed += [(a, kw.value) for a in args for kw in call.keywords if kw.arg == a.name]
        for arg, value in passed:
            if (
                isinstance(value, ast.Name)
                and value.id in params
                and arg.default is not inspect.Parameter.empty
            ):
                where = f"{getattr(target, '__qualname__', target)}({arg.name}=)"
                out.setdefault(value.id, []).append((where, arg.default))
    return out


def _comments(nb_path) -> dict:
    lines = "".join(parameter_cells(nb_path)[0]["source"]).splitlines()
    return {ln.split("=", 1)[0].strip(): ln.split("  # ", 1)[-1] for ln in lines if "  # " in ln}


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_parameters_show_the_kit_defaults(nb_path):
    params, bound, comments = parameters_of(nb_path), bound_parameters(nb_path), _comments(nb_path)
    problems = []
    for name, value in params.items():
        if name not in bound:
            if name not in EXEMPT:
                problems.append(
                    f"{name} fills no config field nor a kit argument with a default: bind it, or list it in EXEMPT with why"
                )
            continue
        for where, default in bound[name]:
            note = _DEFAULT_NOTE.search(comments.get(name, ""))
            if value == default and type(value) is type(default):
                if note:
                    problems.append(f"{name} = {value!r} is the default; drop its '(default ...)' note")
            elif note is None:
                problems.append(
                    f"{name} = {value!r} but {where} defaults to {default!r}: use the default, "
                    f"or say '(default {default!r})' in its comment"
                )
            elif ast.literal_eval(note.group(1)) != default:
                problems.append(
                    f"{name}: its comment says (default {note.group(1)}), {where} says {default!r}"
                )
    assert list(dict.fromkeys(problems)) == []


def test_every_exemption_is_needed():
    """An EXEMPT name is a parameter that some notebook does not bind (else it is checked, not exempt)."""
    unbound = {n for p in NOTEBOOKS for n in set(parameters_of(p)) - set(bound_parameters(p))}
    assert sorted(set(EXEMPT) - unbound) == []


def test_bindings_are_read_from_the_notebooks():
    """The mapping is derived, not listed: spot checks of each way a parameter reaches a field."""
    by_nb = {p.name[:2]: bound_parameters(p) for p in NOTEBOOKS}
    from kit.data.config import DataConfig

    assert (
        by_nb["02"]["TEMPLATE"] == [("DataConfig.template", DataConfig.template)] * 3
    )  # the three binds (pretrain, sft, dpo), by name
    assert by_nb["02"]["SFT_NAME"] == [("DataConfig.name", None)]  # given as name=SFT_NAME
    # get_workspace(WORKSPACE, model=MODEL); None: the project's (TrainConfig.model_name is ws.model)
    assert by_nb["04"]["MODEL"] == [("get_workspace(model=)", None)]
    assert ("run(top=)", 10) in by_nb["05"][
        "TOP"
    ]  # kp.run(..., top=TOP), kp from `import kit.profiling as kp`
    assert by_nb["00"]["WORKSPACE"] == [
        ("set_project(workspace=)", None)
    ]  # positional: set_project(WORKSPACE, MODEL)
    assert by_nb["01"]["WORKSPACE"] == [
        ("get_workspace(root=)", None)
    ]  # positional: get_workspace(WORKSPACE, ...)
    assert by_nb["03"]["LOGITS_TOKENS"] == [
        ("ConversionResult.verify(seq_len=)", 16)
    ]  # result = run(cfg, ws)
    assert "TOKENIZER" not in by_nb["02"] and "SOURCE" not in by_nb["03"]  # resolved before binding: exempt
    assert all(set(b) <= set(parameters_of(p)) for p, b in zip(NOTEBOOKS, by_nb.values()))


def test_demo_settings_change_only_parameters_the_notebooks_have():
    """Each demo value names a parameter of its notebook and differs from the notebook's own (the kit's default)."""
    numbers = {k for k in json.loads(DEMO_SETTINGS.read_text(encoding="utf-8")) if not k.startswith("_")}
    assert numbers <= {p.name[:2] for p in NOTEBOOKS}
    for nb in NOTEBOOKS:
        own = parameters_of(nb)
        same = {k: v for k, v in demo_parameters(nb).items() if own[k] == v}
        assert same == {}, f"{nb.name}: the demo sets {same}, which the notebook already has"
    assert demo_parameters(NOTEBOOKS[[p.name[:2] for p in NOTEBOOKS].index("04")])["TRAIN_ITERS"] < 10
