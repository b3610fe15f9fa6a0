"""Run the numbered notebooks headless (papermill) and read what they declare and write."""

from __future__ import annotations

import ast
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Optional

from kit.core.i18n import LANGUAGES  # the walkthrough speaks the languages of the kit's own lines
from kit.core.workspace import repo_root
from kit.errors import InputError
from kit.storage.atomic import atomic_write_text, write_all

NOTEBOOKS = repo_root() / "notebooks"
# The demo's values per notebook (fewer steps, shorter samples, re-runnable outputs): `python -m kit demo`, nbval and
# the notebook tests start from them; the notebooks' own parameters are the kit's defaults, for a real model.
DEMO_SETTINGS = repo_root() / "data_samples" / "demo_settings.json"

# Lines a kernel writes to stderr that tell a user nothing: ipykernel's notice at every start over TCP (the kernels
# started here listen on 127.0.0.1 for this process only) and the markers torch's kineto prints at every profiler
# start and stop ("USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start"; notebook 05).
TCP_NOTICE = b"Kernel is running over TCP without encryption"
_KINETO_MARK = re.compile(rb"USDT:.*\] profiler_(start|stop)\s*$")


def _is_noise(line: bytes) -> bool:
    return TCP_NOTICE in line or _KINETO_MARK.match(line) is not None


# The walkthrough's languages: English is the source (notebooks/), each other language is a folder beside it
# (notebooks/zh/) holding the same notebooks with the same cells and code; only the markdown prose differs.
_CJK = re.compile(r"[\u4e00-\u9fff]")


def notebooks_folder(lang: str = "en") -> Path:
    """Where the walkthrough in `lang` lives: notebooks/ for English, notebooks/<lang>/ for a translation."""
    if lang not in LANGUAGES:
        raise InputError(f"unknown notebook language {lang!r}; choose one of {', '.join(LANGUAGES)}.")
    return NOTEBOOKS if lang == "en" else NOTEBOOKS / lang


def numbered_notebooks(folder: Optional[Path] = None, lang: str = "en") -> list[Path]:
    """notebooks/NN_*.ipynb (or the `lang` translation's) in order."""
    return sorted(p for p in Path(folder or notebooks_folder(lang)).glob("[0-9][0-9]_*.ipynb"))


def source_hash(text: str) -> str:
    """A short hash of an English markdown cell: a translation records the one it was made from."""
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def _text(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def _translated_markdown(text: str, depth: int) -> str:
    """Relative links from notebooks/ point one folder further up from notebooks/<lang>/."""
    return re.sub(r"\]\(\.\./", "](" + "../" * (depth + 1), text)


def sync_translation(
    en_path: Path, lang: str, translations: Optional[dict] = None, out_dir: Optional[Path] = None
) -> tuple[Path, list[str]]:
    """Rebuild the `lang` copy of one English notebook: every code cell and the notebook's metadata from English,
    each markdown cell's prose from `translations` (cell id -> text, recorded as made from the current English), else
    from the existing copy's cell translated from the same English text (wherever it now stands), else from the cell
    of the same id (kept, and reported as stale). Returns the copy's path and its problems (`translation_problems`), e.g. cells to
    translate after the English changed."""
    en = json.loads(Path(en_path).read_text(encoding="utf-8"))
    out = Path(out_dir or notebooks_folder(lang)) / Path(en_path).name
    old, by_source = {}, {}
    if out.is_file():
        old = {c["id"]: c for c in json.loads(out.read_text(encoding="utf-8"))["cells"] if "id" in c}
        # a translation follows its English text, not its cell id (nbstripout renumbers ids when cells are added)
        by_source = {
            c["metadata"]["kit"]["translated_from"]: c
            for c in old.values()
            if c["cell_type"] == "markdown" and c.get("metadata", {}).get("kit", {}).get("translated_from")
        }
    cells = []
    for cell in en["cells"]:
        cell = json.loads(json.dumps(cell))
        if cell["cell_type"] == "markdown":
            if translations and cell["id"] in translations:
                text = _translated_markdown(translations[cell["id"]], depth=1)
                made_from = source_hash(_text(cell))
            elif source_hash(_text(cell)) in by_source:
                text, made_from = _text(by_source[source_hash(_text(cell))]), source_hash(_text(cell))
            elif cell["id"] in old and old[cell["id"]]["cell_type"] == "markdown":
                text = _text(old[cell["id"]])
                made_from = old[cell["id"]].get("metadata", {}).get("kit", {}).get("translated_from", "")
            else:  # new English prose: kept in English until translated, and reported
                text, made_from = _text(cell), ""
            cell["source"] = text.splitlines(keepends=True)
            cell.setdefault("metadata", {})["kit"] = {"translated_from": made_from}
        cells.append(cell)
    en["cells"] = cells
    en.setdefault("metadata", {})["kit"] = {"language": lang}
    import nbformat

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, nbformat.writes(nbformat.from_dict(en)))
    return out, translation_problems(en_path, out)


def translation_problems(en_path: Path, tr_path: Path) -> list[str]:
    """What keeps a translated notebook from being the English one in another language: a missing copy, other cells
    or code, prose made from an older English text, or prose left in English."""
    en_path, tr_path = Path(en_path), Path(tr_path)
    if not tr_path.is_file():
        return [f"{tr_path}: missing; run `python -m kit demo --sync-translations`"]
    en = json.loads(en_path.read_text(encoding="utf-8"))["cells"]
    tr = json.loads(tr_path.read_text(encoding="utf-8"))["cells"]
    shape = [(c.get("id"), c["cell_type"]) for c in en]
    if shape != [(c.get("id"), c["cell_type"]) for c in tr]:
        return [f"{tr_path.name}: its cells (ids, kinds, order) differ from {en_path.name}'s; sync it"]
    problems = []
    for e, t in zip(en, tr):
        where = f"{tr_path.name} cell {e['id']}"
        if e["cell_type"] != "markdown":
            if _text(e) != _text(t) or e.get("metadata", {}) != t.get("metadata", {}):
                problems.append(f"{where}: code differs from the English notebook; sync it")
        elif t.get("metadata", {}).get("kit", {}).get("translated_from") != source_hash(_text(e)):
            problems.append(f"{where}: the English text changed since it was translated (or it never was)")
        elif not _CJK.search(_text(t)):
            problems.append(f"{where}: not translated")
    return problems


def parameter_cells(nb_path: Path) -> list[dict]:
    """The code cells tagged `parameters`."""
    nb = json.loads(Path(nb_path).read_text(encoding="utf-8"))
    return [
        c
        for c in nb["cells"]
        if c["cell_type"] == "code" and "parameters" in c.get("metadata", {}).get("tags", [])
    ]


def parameters_of(nb_path: Path) -> dict:
    """Names and literal default values of the `parameters` cell (it must hold only literal assignments)."""
    cells = parameter_cells(nb_path)
    if len(cells) != 1:
        raise InputError(f"{nb_path.name} has {len(cells)} cells tagged 'parameters'; it needs exactly one.")
    tree = ast.parse("".join(cells[0]["source"]))
    params = {}
    for node in tree.body:
        if not (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            raise InputError(f"{nb_path.name}: the parameters cell may hold only `NAME = literal` lines.")
        params[node.targets[0].id] = ast.literal_eval(node.value)
    return params


def _pass_stderr(read_fd: int) -> None:
    """Copy a kernel's stderr to ours, line by line, leaving out the lines _is_noise names."""
    with os.fdopen(read_fd, "rb") as pipe:
        for line in pipe:
            if not _is_noise(line):  # fd 2: where the kernel's stderr would have gone
                write_all(2, line, "<stderr>")


def quiet_kernel_manager(base: Optional[type] = None) -> type:
    """`base` (jupyter_client's AsyncKernelManager by default) whose kernels' stderr reaches ours without the
    TCP notice; everything else the kernel writes there is passed on as it comes. A kernel started from a process
    that trained in-process does not inherit that training's rendezvous (kit.train.engine)."""
    if base is None:
        from jupyter_client import AsyncKernelManager as base

    class QuietKernelManager(base):
        copiers: list = []  # the threads copying stderr, to wait for once the kernels are gone

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            from kit.system.procs import without_in_process_rendezvous

            kw["env"] = without_in_process_rendezvous(kw.get("env") or dict(os.environ))
            if kw.get("stderr") is not None:  # the caller chose where it goes
                return await super()._async_launch_kernel(kernel_cmd, **kw)
            read_fd, write_fd = os.pipe()
            try:
                await super()._async_launch_kernel(kernel_cmd, **dict(kw, stderr=write_fd))
            except BaseException:
                os.close(read_fd)
                raise
            finally:
                os.close(write_fd)  # the kernel holds its own copy; the pipe ends when the kernel does
            copier = threading.Thread(target=_pass_stderr, args=(read_fd,), name="kernel-stderr", daemon=True)
            copier.start()
            self.copiers.append(copier)

    QuietKernelManager.__name__ = QuietKernelManager.__qualname__ = f"Quiet{base.__name__}"
    return QuietKernelManager


def demo_parameters(nb_path: Path) -> dict:
    """The demo's values for the parameters of notebook `nb_path` (data_samples/demo_settings.json, by number)."""
    settings = json.loads(DEMO_SETTINGS.read_text(encoding="utf-8"))
    mine = settings.get(Path(nb_path).name[:2], {})
    unknown = sorted(set(mine) - set(parameters_of(nb_path)))
    if unknown:
        raise InputError(f"{DEMO_SETTINGS.name} sets {unknown}, which {Path(nb_path).name} does not have.")
    return dict(mine)


def prepare(nb_path: Path, out_path: Path, parameters: Optional[dict] = None) -> Path:
    """A copy of the notebook with `parameters` injected after its parameters cell, as papermill would run it."""
    import papermill as pm

    out_path.parent.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(
        str(nb_path), str(out_path), parameters=dict(parameters or {}), prepare_only=True, progress_bar=False
    )
    return out_path


def execute(nb_path: Path, out_path: Path, parameters: Optional[dict] = None, timeout: int = 1800) -> Path:
    """Execute one notebook with papermill (in the notebooks folder, this interpreter's kernel)."""
    import papermill as pm

    parameters = dict(parameters or {})
    unknown = sorted(set(parameters) - set(parameters_of(nb_path)))
    if unknown:
        raise InputError(f"{nb_path.name} has no parameter(s) {unknown}; see its parameters cell.")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    manager = quiet_kernel_manager()
    try:
        pm.execute_notebook(
            str(nb_path),
            str(out_path),
            parameters=parameters,
            cwd=str(nb_path.parent),
            kernel_name="python3",
            progress_bar=False,
            execution_timeout=timeout,
            start_timeout=600,  # a kernel starting on a busy 2-core machine can take more than papermill's 60 s
            log_output=False,
            kernel_manager_class=manager,
        )
    finally:
        for copier in manager.copiers:  # the kernel has exited: what it wrote last is still to be copied
            copier.join(timeout=10)
    return out_path


def run_all(
    out_dir: Optional[Path] = None,
    only: Optional[list] = None,
    parameters: Optional[dict] = None,
    lang: str = "en",
    prepare_only: bool = False,
) -> list[dict]:
    """Run every numbered notebook (or those whose name starts with one of `only`) on the demo's values, in `lang`:
    the translated notebooks, with the kit's own lines in that language too (KIT_LANG, which the kernels inherit).
    `prepare_only` writes the notebooks with the values injected and runs nothing (nbval runs those)."""
    out = Path(out_dir or repo_root() / "runs" / ("demo" if lang == "en" else f"demo-{lang}"))
    if lang != "en":
        os.environ["KIT_LANG"] = lang
    results = []
    for nb in numbered_notebooks(lang=lang):
        if only and not any(nb.name.startswith(o) for o in only):
            continue
        t0 = time.time()
        params = {
            **demo_parameters(nb),
            **{k: v for k, v in (parameters or {}).items() if k in parameters_of(nb)},
        }
        if prepare_only:
            prepare(nb, out / nb.name, params)
            results.append({"notebook": nb.name, "executed": str(out / nb.name), "seconds": 0.0})
            continue
        print(f"running {nb.name} ...", flush=True)
        execute(nb, out / nb.name, params)
        results.append(
            {"notebook": nb.name, "executed": str(out / nb.name), "seconds": round(time.time() - t0, 1)}
        )
    return results


def summary_line(summary: dict, width: int = 160) -> str:
    """The scalar entries of a notebook summary on one line (nested tables and long lists are left out)."""
    items = [
        f"{k}={v}" for k, v in summary.items() if isinstance(v, (int, float, bool, str)) and len(str(v)) < 80
    ]
    line = ", ".join(items)
    return line if len(line) <= width else line[: width - 3] + "..."


def table_lines(rows) -> list[str]:
    """A summary's `table` (a list of flat dicts) as aligned text lines; [] when there is none."""
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        return []
    cols = list(rows[0])

    def text(v) -> str:
        if v is None or (isinstance(v, float) and v != v):  # None / NaN: an empty cell
            return ""
        return f"{v:g}" if isinstance(v, float) else str(v)

    cells = [[str(c) for c in cols]] + [[text(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]


def register(sub) -> None:
    """`python -m kit demo [--out DIR] [NN ...]`: the headless demo (make demo)."""
    p = sub.add_parser(
        "demo", help="run the numbered notebooks headless on the embedded defaults (make demo)"
    )
    p.add_argument("only", nargs="*", help="notebook number prefixes, e.g. 00 02 (default: all)")
    p.add_argument("--out", default=None, help="folder for executed notebooks (default: runs/demo[-LANG])")
    p.add_argument(
        "--lang", default="en", choices=LANGUAGES, help="the walkthrough's language (zh: notebooks/zh/)"
    )
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="write the notebooks with the demo's values injected into --out, run nothing (make nbval)",
    )
    p.add_argument(
        "--sync-translations",
        action="store_true",
        help="for maintainers: copy the English notebooks' code into every translation, list the prose to translate",
    )
    p.set_defaults(func=demo)


def sync_translations() -> int:
    """Every translation gets the English notebooks' cells and code; prints the prose left to translate."""
    problems = []
    for lang in LANGUAGES[1:]:
        for en in numbered_notebooks():
            problems += sync_translation(en, lang)[1]
    for line in problems:
        print(line)
    print(
        f"{len(problems)} cell(s) to translate"
        if problems
        else "every translation matches the English notebooks"
    )
    return 0


def demo(args) -> int:
    """Run the notebooks (all, or those `args.only` names) and print what they made and the handover."""
    from kit.core.workspace import default_root

    if args.sync_translations:
        return sync_translations()
    os.environ.setdefault("KIT_WORKSPACE", str(default_root()))
    out = Path(args.out) if args.out else None
    if args.prepare_only:
        results = run_all(out, args.only or None, lang=args.lang, prepare_only=True)
        print(f"{len(results)} notebook(s) with the demo's values in {Path(results[0]['executed']).parent}")
        return 0
    results = run_all(out, args.only or None, lang=args.lang)
    ws = Path(os.environ["KIT_WORKSPACE"])
    print("\nexecuted notebooks:")
    for r in results:
        print(f"  {r['executed']}  ({r['seconds']} s)")
    print(f"workspace (data, checkpoints, logs, reports): {ws}")
    for summary in sorted((ws / "reports").glob("*.summary.json")):
        data = json.loads(summary.read_text())
        print(f"  {summary.name.replace('.summary.json', '')}: {summary_line(data)}")
        for line in table_lines(data.get("table")):  # e.g. 07's TTFT / TPOT percentiles per load point
            print(f"      {line}")
    from kit.core.manifest import handover_lines

    print("\nhandover (each output <- the stage outputs it consumed, with their manifest hashes):")
    for line in handover_lines(ws):
        print(f"  {line}")
    return 0
