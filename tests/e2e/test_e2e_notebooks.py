"""Each numbered notebook, opened in JupyterLab in a real browser and run with Run All, shows its key outputs."""

from __future__ import annotations

import json
import warnings

import pytest
from e2e_cases import EXPECT, KNOWN_PROBLEMS, Expect
from e2e_ui import full_screenshot, open_notebook, read_cells, run_all, save, visible_errors

from kit.notebooks import numbered_notebooks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NOTEBOOKS = [nb.name for nb in numbered_notebooks()]


def missing_outputs(cells: list, expect: Expect) -> list:
    """What the user should see but does not (empty when every key output is there)."""
    outs = [o for c in cells for o in c.outputs]
    text = "\n".join(o["text"] for o in outs)
    seen = {"tables": sum(o["tables"] for o in outs), "images": sum(o["images"] for o in outs),
            "progress": sum(o["progress"] for o in outs)}
    problems = [f"{k}: {seen[k]} visible, expected at least {getattr(expect, k)}"
                for k in seen if seen[k] < getattr(expect, k)]
    problems += [f"text {t!r} not visible in any output" for t in expect.texts if t not in text]
    return problems


def test_every_numbered_notebook_has_expectations():
    """A new notebook must get a row in e2e_cases.EXPECT (and TINY), or the browser test would check nothing."""
    assert NOTEBOOKS, "no notebooks/NN_*.ipynb found"
    assert not [n for n in NOTEBOOKS if n[:2] not in EXPECT], "add these notebooks to tests/e2e/e2e_cases.py"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab(name, lab, page, e2e_root, screenshots):
    kernel = open_notebook(page, lab.url(name))
    assert "Python 3" in kernel, kernel
    try:
        seconds = run_all(page, timeout=300)
    except AssertionError:
        full_screenshot(page, screenshots / f"{name[:-6]}.png")
        raise
    cells = read_cells(page)
    save(page)
    shot = full_screenshot(page, screenshots / f"{name[:-6]}.png")
    # the notebook as JupyterLab saved it, outputs included, beside its screenshot (to read after a failure)
    (screenshots / name).write_text((e2e_root / name).read_text(encoding="utf-8"), encoding="utf-8")
    errors = visible_errors(cells)
    known = [e for e in errors if any(k in e for k in KNOWN_PROBLEMS.get(name[:2], ()))]
    for e in known:
        warnings.warn(f"{name}: known problem (tests/e2e/e2e_cases.py KNOWN_PROBLEMS): {e}", stacklevel=1)
    errors = [e for e in errors if e not in known]
    assert not errors, f"{name} (screenshot {shot}):\n" + "\n\n".join(errors)
    missing = missing_outputs(cells, EXPECT[name[:2]])
    assert not missing, f"{name} after {seconds:.0f} s (screenshot {shot}):\n" + "\n".join(missing)
    # the notebook as JupyterLab saved it: no error outputs, and it wrote its summary like under papermill
    saved = json.loads((e2e_root / name).read_text(encoding="utf-8"))
    assert not [o for c in saved["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert (e2e_root / "ws" / "reports" / f"{name[:-6]}.summary.json").is_file()
