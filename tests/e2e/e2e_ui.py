"""What a user does and sees in JupyterLab, through Playwright: open, Run All, read the cells, screenshot."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

# Chromium from Debian, started the way that works on a machine without network or GPU (see README, make e2e)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
VIEWPORT = {"width": 1400, "height": 900}

# One JS pass over the rendered notebook: per cell its prompt and, per output, what kind of thing is visible.
_READ_CELLS = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell'))
  .map(c => ({
    kind: c.classList.contains('jp-CodeCell') ? 'code' : (c.classList.contains('jp-MarkdownCell') ? 'markdown' : 'raw'),
    prompt: ((c.querySelector('.jp-InputPrompt') || {}).textContent || '').trim(),
    source: ((c.querySelector('.jp-InputArea-editor') || {}).innerText || '').slice(0, 300),
    outputs: Array.from(c.querySelectorAll('.jp-OutputArea-output')).map(o => ({
      mime: o.getAttribute('data-mime-type') || '',
      text: o.innerText || '',
      images: Array.from(o.querySelectorAll('img')).filter(i => i.naturalWidth > 0).length,
      tables: o.querySelectorAll('table').length,
      progress: o.querySelectorAll('.widget-progress, .widget-hprogress, progress').length,
      widgets: o.querySelectorAll('.jupyter-widgets').length,
      widgetErrors: o.querySelectorAll('.jupyter-widgets-error-widget, .jp-Widget-error').length,
      // tqdm.notebook turns a bar red (bar_style "danger") when it is closed before reaching its total
      redBars: o.querySelectorAll('.progress-bar-danger').length,
    })),
  }))"""

_BUSY = """() => {
  const prompts = Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-InputPrompt'));
  const status = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
  return prompts.some(p => p.textContent.includes('*')) || !status || status.getAttribute('data-status') !== 'idle';
}"""

_STARTED = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-InputPrompt'))
  .some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))"""

# IPython's rendering of an exception: its header line, the plain traceback banner, or a kit error's one line
# (kit.errors.KitError renders as "error: <message>" instead of a traceback)
_TRACEBACK = re.compile(
    r"Traceback \(most recent call last\)|^-{20,}\s*$\n^\w+(Error|Exception)\b|^error: \S", re.M
)


@dataclass
class Cell:
    """One cell as rendered: kind, prompt ("[3]:", "[ ]:", "[*]:"), a bit of source, and its outputs."""

    kind: str
    prompt: str
    source: str
    outputs: list = field(default_factory=list)

    @property
    def executed(self) -> bool:
        return bool(re.fullmatch(r"\[\d+\]:", self.prompt))

    @property
    def text(self) -> str:
        return "\n".join(o["text"] for o in self.outputs)


def open_notebook(page, url: str, timeout: float = 90.0) -> str:
    """Open a notebook and wait until its kernel is started and idle; return the status bar's kernel text."""
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout * 1000)
    # the status bar says "<kernel display name> | Idle" once the kernel is really connected
    status = page.locator("#jp-main-statusbar").get_by_text(re.compile(r"^.+ \| Idle$"))
    status.first.wait_for(timeout=timeout * 1000)
    return status.first.inner_text()


def run_all(page, timeout: float = 300.0) -> float:
    """Run > Run All Cells from the menu bar, then wait until no cell is queued and the kernel is idle."""
    t0 = time.monotonic()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    # Run All marks every code cell [*] at once; it is over when none is left and the kernel is idle
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.wait_for_function(_STARTED, timeout=20_000)
    try:
        page.wait_for_function(f"() => !({_BUSY})()", timeout=timeout * 1000, polling=250)
        time.sleep(0.5)  # let the last display messages (images, widget views) reach the DOM
        page.wait_for_function(f"() => !({_BUSY})()", timeout=timeout * 1000, polling=250)
    except PlaywrightTimeout:
        busy = [(i, c) for i, c in enumerate(read_cells(page, settle=0.1, timeout=1)) if "*" in c.prompt]
        where = (
            f"cell {busy[0][0]} ({busy[0][1].source[:80]!r}), last output: {busy[0][1].text[-600:]!r}"
            if busy
            else "?"
        )
        raise AssertionError(f"Run All still busy after {timeout:.0f} s at {where}") from None
    return time.monotonic() - t0


def read_cells(page, settle: float = 1.0, timeout: float = 20.0) -> list:
    """Every cell of the visible notebook, as the user sees it, once two looks `settle` s apart agree.

    Widget views (progress bars) and images attach to their output area a moment after the kernel is idle.
    """
    deadline, previous = time.monotonic() + timeout, None
    while True:
        cells = page.evaluate(_READ_CELLS)
        if cells == previous or time.monotonic() > deadline:
            return [Cell(**c) for c in cells]
        previous = cells
        time.sleep(settle)


def error_output(cell) -> str:
    """The text of the error a code cell shows ("" when none): a traceback or a kit error line."""
    for o in cell.outputs:
        if o["mime"] == "application/vnd.jupyter.stderr" and _TRACEBACK.search(o["text"]):
            return o["text"]
    return ""


def visible_errors(cells: list) -> list:
    """Problems a user would see: tracebacks or other stderr boxes in outputs, broken widgets, code cells Run All
    never reached."""
    problems = []
    for i, c in enumerate(cells):
        if c.kind != "code":
            continue
        for o in c.outputs:
            if o["mime"] == "application/vnd.jupyter.stderr" and _TRACEBACK.search(o["text"]):
                problems.append(f"cell {i} shows an error:\n{o['text'][-1500:]}")
            elif o["mime"] == "application/vnd.jupyter.stderr" and o["text"].strip():
                # a red box on a cell that succeeded: third-party noise belongs in the run's log (kit.system.noise)
                problems.append(f"cell {i} shows a stderr box: {o['text'].strip()[-600:]!r}")
            if o["widgetErrors"]:
                problems.append(f"cell {i} shows a widget that failed to render")
            if o["redBars"]:
                problems.append(
                    f"cell {i} shows a red progress bar (stopped before its total): {o['text'].strip()!r}"
                )
        if not c.executed and c.source.strip():
            problems.append(f"cell {i} was not executed (prompt {c.prompt!r}): {c.source[:80]!r}")
    return problems


def save(page) -> None:
    """File > Save (Ctrl+S), and wait until the tab no longer shows unsaved changes."""
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    page.wait_for_function(
        "() => !document.querySelector('.lm-TabBar-tab.lm-mod-current.jp-mod-dirty')", timeout=20_000
    )


def full_screenshot(page, path: Path, max_height: int = 20_000) -> Path:
    """A PNG of the whole notebook: left panel closed, window made as tall as the notebook, then restored."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if page.locator("#jp-left-stack:not(.lm-mod-hidden)").count():
        page.keyboard.press("Control+b")  # View > Show Left Sidebar (toggle)
    scroller = "document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer')"
    # bottom of the last cell (the notebook's scroll area has a screen of empty padding below it)
    height = page.evaluate(
        f"() => {{ const s = {scroller}; const cells = s ? s.querySelectorAll('.jp-Cell') : [];"
        " return cells.length ? cells[cells.length - 1].getBoundingClientRect().bottom - s.getBoundingClientRect().top"
        " + s.scrollTop + 40 : document.body.scrollHeight; }"
    )
    page.set_viewport_size(
        {"width": VIEWPORT["width"], "height": max(VIEWPORT["height"], min(int(height) + 200, max_height))}
    )
    time.sleep(0.5)  # relayout
    page.evaluate(f"() => {{ const s = {scroller}; if (s) s.scrollTop = 0; }}")
    time.sleep(0.2)
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(VIEWPORT)
    return path


def missing_outputs(cells: list, expect) -> list:
    """What the user should see but does not (empty when every key output is there)."""
    outs = [o for c in cells for o in c.outputs]
    text = "\n".join(o["text"] for o in outs)
    seen = {
        "tables": sum(o["tables"] for o in outs),
        "images": sum(o["images"] for o in outs),
        "progress": sum(o["progress"] for o in outs),
    }
    problems = [
        f"{k}: {seen[k]} visible, expected at least {getattr(expect, k)}"
        for k in seen
        if seen[k] < getattr(expect, k)
    ]
    problems += [f"text {t!r} not visible in any output" for t in expect.texts if t not in text]
    return problems
