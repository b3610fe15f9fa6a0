"""Each numbered notebook, opened in JupyterLab in a real browser and run with Run All, shows its key outputs."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from e2e_cases import EXPECT, KNOWN_PROBLEMS, TINY
from e2e_ui import full_screenshot, missing_outputs, open_notebook, read_cells, run_all, save, visible_errors

from kit.core.notebooks import numbered_notebooks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NOTEBOOKS = [nb.name for nb in numbered_notebooks()]


def test_every_numbered_notebook_has_expectations():
    """A new notebook must get rows in e2e_cases.TINY and EXPECT, or the browser test would check nothing."""
    assert NOTEBOOKS, "no notebooks/NN_*.ipynb found"
    missing = [n for n in NOTEBOOKS if n[:2] not in EXPECT or n[:2] not in TINY]
    assert not missing, f"add {missing} to TINY and EXPECT in tests/e2e/e2e_cases.py"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab(name, lab, page, e2e_root, screenshots):
    kernel = open_notebook(page, lab.url(name))
    assert "Python 3" in kernel, kernel
    try:
        seconds = run_all(page, timeout=600)  # generous: a fresh machine JIT-builds a DeepSpeed op in 04
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


ZH_NOTEBOOK = "zh/" + numbered_notebooks(lang="zh")[0].name


def test_chinese_notebook_runs_in_jupyterlab(lab, page, e2e_root, screenshots):
    """The Chinese walkthrough's first notebook: Chinese prose, the same outputs as the English one, no error box."""
    kernel = open_notebook(page, lab.url(ZH_NOTEBOOK))
    assert "Python 3" in kernel, kernel
    run_all(page, timeout=600)
    cells = read_cells(page)
    shot = full_screenshot(page, screenshots / "zh_00_check_environment.png")
    prose = "\n".join(
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-RenderedMarkdown").all_inner_texts()
    )
    assert re.search(r"[\u4e00-\u9fff]{4}", prose), f"no Chinese prose on the page (screenshot {shot})"
    assert not visible_errors(cells), f"{ZH_NOTEBOOK} (screenshot {shot}):\n" + "\n\n".join(
        visible_errors(cells)
    )
    assert not missing_outputs(cells, EXPECT["00"]), shot
