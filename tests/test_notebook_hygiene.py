"""Every notebook: outputs stripped, exactly one literal parameters cell with commented UPPER_SNAKE names, no defs,
no copied benchmark figures."""

from __future__ import annotations

import ast
import json
import re

import pytest

from kit.core.notebooks import numbered_notebooks, parameter_cells, parameters_of

NOTEBOOKS = numbered_notebooks()


def test_there_are_numbered_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_check_environment.ipynb"]


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_hygiene(nb_path):
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), (
        "strip outputs (nbstripout)"
    )
    assert len(parameter_cells(nb_path)) == 1
    params = parameters_of(nb_path)
    assert "WORKSPACE" in params
    lines = [ln for ln in "".join(parameter_cells(nb_path)[0]["source"]).splitlines() if ln.strip()]
    for line in lines:
        assert re.match(r"^[A-Z][A-Z0-9_]* = .+  # \S", line), (
            f"parameter line needs UPPER_SNAKE and a comment: {line}"
        )
    for cell in code:
        tree = ast.parse("".join(cell["source"]))
        defs = [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        ]
        assert not defs, f"{nb_path.name}: move def/class into kit/"
    src = "".join("".join(c["source"]) for c in code)
    assert re.search(rf'write_summary\(\s*"{nb_path.stem}"', src), "the notebook must write its summary.json"
    assert nb["cells"][0]["cell_type"] == "markdown"


@pytest.mark.dev_stack  # the committed file is the same on every stack
def test_nbstripout_verify():
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "nbstripout", "--verify", *map(str, NOTEBOOKS)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


# A speed ratio written as a figure: "1.37×", "0.96x", "2 x". Figures live in benchmarks/results.md, where `make bench`
# rewrites them; a notebook links to benchmarks/README.md or renders results.md, so it never quotes a stale one.
RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?[×xX](?![\w])")


def test_ratio_pattern():
    found = [
        m.group(0) for m in RATIO.finditer("a 1.37× b 0.96x c 2 x d TP3 × PP2 e 0x1F f 3x3 g GBS × 1000")
    ]
    assert found == ["1.37×", "0.96x", "2 x"]


WITH_TRANSLATIONS = NOTEBOOKS + numbered_notebooks(lang="zh")


@pytest.mark.parametrize(
    "nb_path", WITH_TRANSLATIONS, ids=[f"{p.parent.name}/{p.stem}" for p in WITH_TRANSLATIONS]
)
def test_notebook_copies_no_benchmark_figure(nb_path):
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    found = [m.group(0) for c in nb["cells"] for m in RATIO.finditer("".join(c["source"]))]
    assert found == [], (
        f"{nb_path.name} quotes ratio figures {found}: link to ../benchmarks/README.md instead"
    )
