"""The layout shows the architecture (docs/architecture.md): stage packages on top, then the machine, storage and the
contracts between stages, `errors.py` at the ground. Every import counts, the ones inside functions too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent / "kit"
STAGES = {
    "doctor",
    "envs",
    "data",
    "convert",
    "adapt",
    "ops",
    "train",
    "plan",
    "profiling",
    "evaluate",
    "serve",
}
# lower number = lower layer; a module may import its own layer and the ones below it
LAYERS = {"errors": 0, "system": 1, "storage": 2, "core": 3, **{s: 4 for s in STAGES}}


def _package(module: str) -> str:
    """kit.train.preflight.run -> kit.train.preflight; kit.errors and kit.__main__ are packages of their own."""
    path = KIT.parent / Path(*module.split("."))
    return module if path.is_dir() or module in ("kit.errors", "kit.__main__") else module.rsplit(".", 1)[0]


def _imports() -> dict:
    """{package: {imported package: "module -> module" (the first such import)}} over every kit module."""
    modules = {
        ".".join(p.relative_to(KIT.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in KIT.rglob("*.py")
    }
    edges: dict = defaultdict(dict)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kit"):
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            target = next((t for t in targets if t in modules), None)
            if target is None:
                continue
            a, b = _package(name), _package(target)
            if a != b and not b.startswith(a + "."):  # a package's subpackages are its own
                edges[a].setdefault(b, f"{name} -> {target}")
    return edges


def test_the_top_level_holds_stages_infrastructure_and_errors_only():
    entries = {p.name for p in KIT.iterdir() if p.name != "__pycache__"}
    allowed = {f"{name}.py" if name == "errors" else name for name in LAYERS} | {"__init__.py", "__main__.py"}
    assert entries - allowed == set(), (
        "new top-level entries: place them in a stage or an infrastructure folder"
    )


def test_no_import_circle_spans_two_packages():
    edges = _imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(edges.get(here, {}))
        return False

    circles = [f"{why} (and back)" for a, out in edges.items() for b, why in out.items() if reaches(b, a)]
    assert circles == []


def test_a_lower_layer_never_imports_a_higher_one():
    def layer(package: str) -> int:
        if package in (
            "kit",
            "kit.__main__",
        ):  # kit/__init__.py holds the version; the command line sits above all
            return 0 if package == "kit" else 5
        return LAYERS[package.split(".")[1]]

    upward = [
        why for a, out in _imports().items() for b, why in out.items() if layer(b) > layer(a) and layer(a) < 4
    ]
    assert upward == []
