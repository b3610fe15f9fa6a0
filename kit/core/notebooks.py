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

from kit.core.workspace import repo_root
from kit.errors import InputError
from kit.storage.atomic import write_all

NOTEBOOKS = repo_root() / "notebooks"

# Lines a kernel writes to stderr that tell a user nothing: ipykernel's notice at every start over TCP (the kernels
# started here listen on 127.0.0.1 for this process only) and the markers torch's kineto prints at every profiler
# start and stop ("USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start"; notebook 05).
TCP_NOTICE = b"Kernel is running over TCP without encryption"
_KINETO_MARK = re.compile(rb"USDT:.*\] profiler_(start|stop)\s*$")


def _is_noise(line: bytes) -> bool:
    return TCP_NOTICE in line or _KINETO_MARK.match(line) is not None


def numbered_notebooks(folder: Optional[Path] = None) -> list[Path]:
    """notebooks/NN_*.ipynb in order."""
    return sorted(p for p in Path(folder or NOTEBOOKS).glob("[0-9][0-9]_*.ipynb"))


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
    out_dir: Optional[Path] = None, only: Optional[list] = None, parameters: Optional[dict] = None
) -> list[dict]:
    """Run every numbered notebook (or those whose name starts with one of `only`) on its defaults."""
    out = Path(out_dir or repo_root() / "runs" / "demo")
    results = []
    for nb in numbered_notebooks():
        if only and not any(nb.name.startswith(o) for o in only):
            continue
        t0 = time.time()
        params = {k: v for k, v in (parameters or {}).items() if k in parameters_of(nb)}
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
    p.add_argument("--out", default=None, help="folder for executed notebooks (default: runs/demo)")
    p.set_defaults(func=demo)


def demo(args) -> int:
    """Run the notebooks (all, or those `args.only` names) and print what they made and the handover."""
    from kit.core.workspace import default_root

    os.environ.setdefault("KIT_WORKSPACE", str(default_root()))
    results = run_all(Path(args.out) if args.out else None, args.only or None)
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
