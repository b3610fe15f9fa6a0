"""`make bench`: every benchmark with --quick, one table of ratios, written to benchmarks/results.md.

benchmarks/README.md is rendered from results.md and the notes in benchmarks/README.template.md after every run;
`--render-only` renders it again from the committed results.md without running anything.

Each benchmark runs in its own process, one after the other (they would disturb each other's timings), and prints
its figures as lines `<stage> | <figure> | <ratio>x | goal <goal> | MET/MISSED/-`, each followed by
`    baseline: <code or command>`. A benchmark that fails, times out or does not know --quick becomes a row with its
error; the others still run. Full logs go to runs/bench/<name>.log.

Run: .venv/bin/python benchmarks/run_all.py [--only train ops] [--timeout 600] [--out benchmarks/results.md]
     .venv/bin/python benchmarks/run_all.py --render-only
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TEMPLATE = HERE / "README.template.md"
RESULTS_MARK = "<!-- results: filled in by run_all.py -->"
BENCHMARKS = [
    "bench_data.py",
    "bench_convert.py",
    "bench_envs.py",
    "bench_train.py",
    "bench_plan.py",
    "bench_checkpoint.py",
    "bench_obs.py",
    "bench_ops.py",
    "bench_profiling.py",
    "bench_evaluate.py",
    "bench_serve.py",
    "bench_engines.py",
]
FIGURE = re.compile(  # the ratio cell is kept as printed (some figures are percentages, e.g. RSS growth)
    r"^\s*(?P<stage>\w[\w .+/-]*?)\s*\|\s*(?P<figure>[^|]+?)\s*\|\s*(?P<ratio>[^|]+?)\s*"
    r"\|\s*goal\b\s*(?P<goal>[^|]*?)\s*\|\s*(?P<status>MET|MISSED|-)\s*(?:\|\s*(?P<extra>.*))?$"
)
BASELINE = re.compile(r"^\s+baseline:\s*(?P<code>.+?)\s*$")


@dataclass
class Row:
    """One figure of the table (or a benchmark's error)."""

    stage: str
    figure: str
    ratio: str
    goal: str
    status: str
    bench: str
    baselines: List[str] = field(default_factory=list)


@dataclass
class Run:
    """One benchmark process: how it ended and what it printed."""

    bench: str
    seconds: float
    returncode: Optional[int]  # None: killed at the timeout
    rows: List[Row]
    error: str = ""


def parse(text: str, bench: str) -> List[Row]:
    """The figure lines of a benchmark's output with their baselines.

    A baseline is either `    baseline: <code>` printed under a figure, or a block printed before it: a line
    starting with `baseline` followed by indented lines (e.g. the source of the recipe it runs).
    """
    rows: List[Row] = []
    block: List[str] = []  # a `baseline ...` block waiting for the figure it introduces
    in_block = False
    for line in text.splitlines():
        m = FIGURE.match(line)
        if m:
            rows.append(Row(m["stage"], m["figure"], m["ratio"], m["goal"] or "-", m["status"], bench))
            if block:
                rows[-1].baselines.append("\n".join(block))
            if m["extra"]:
                rows[-1].baselines.append(re.sub(r"^baseline:\s*", "", m["extra"].strip()))
            block, in_block = [], False
            continue
        b = BASELINE.match(line)
        if b and rows and not in_block:
            rows[-1].baselines.append(b["code"])
        elif re.match(r"^baseline\b", line, re.IGNORECASE):
            block, in_block = [line.strip()], True
        elif in_block and line.startswith((" ", "\t")) and line.strip():
            block.append(line.rstrip())
        else:
            in_block = False
    # a benchmark may print a figure twice (as it goes and in a closing summary): one row, baselines merged
    merged: Dict[tuple, Row] = {}
    for row in rows:
        key = (row.stage, row.figure, row.ratio, row.goal, row.status)
        if key in merged:
            merged[key].baselines.extend(b for b in row.baselines if b not in merged[key].baselines)
        else:
            merged[key] = row
    return list(merged.values())


def last_error_line(text: str) -> str:
    """The most telling line of a failed run's output: the exception or usage error, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^([\w.]+(Error|Exception|Interrupt)\b|error:|.*: error:)", ln):
            return ln
    return lines[-1] if lines else "no output"


def run_one(bench: str, timeout_s: float, log_dir: Path) -> Run:
    """Run `bench --quick` in its own process group (killed whole at the timeout); parse its figure lines."""
    stage = bench.replace("bench_", "").replace(".py", "")
    path = HERE / bench
    if not path.is_file():
        return Run(bench, 0.0, None, [], f"{path} does not exist")
    cmd = [sys.executable, str(path), "--quick"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    seconds = time.perf_counter() - t0
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"{stage}.log").write_text(f"$ {' '.join(cmd)}\n{out}", encoding="utf-8")
    rows = parse(out, bench)
    error = ""
    if code is None:
        error = f"timed out after {timeout_s:.0f} s (--timeout); last line: {last_error_line(out)}"
    elif code != 0:
        error = f"exit {code}: {last_error_line(out)}"
    elif not rows:
        error = "printed no figure lines (`<stage> | <figure> | <ratio>x | goal <goal> | MET/MISSED/-`)"
    return Run(bench, seconds, code, rows, error)


def machine() -> dict:
    """CPU model, cores, RAM, Python, date and git commit of this run."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "?"
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())[1])
        ram = f"{kb / 2**20:.1f} GiB"
    except (OSError, TypeError):
        pass

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=str(ROOT), capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (+ uncommitted changes)"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram": ram,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
    }


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table_rows(runs: List[Run]) -> List[Row]:
    out: List[Row] = []
    for r in runs:
        out.extend(r.rows)
        if r.error:
            stage = r.bench.replace("bench_", "").replace(".py", "")
            out.append(Row(stage, f"{r.bench} --quick: {r.error}", "-", "-", "ERROR", r.bench))
    return out


def markdown(info: dict, runs: List[Run], load_before: str, load_after: str, total_s: float) -> str:
    rows = table_rows(runs)
    lines = [
        "# Benchmark results (`make bench`)",
        "",
        "Written by `benchmarks/run_all.py`: every benchmark with `--quick`, each in its own process, one after the",
        "other. Every ratio compares the kit with the baseline listed below, both measured in the same run (best",
        "of alternated repeats); the goal column says which way is good (`>=`: the kit should be at least that",
        "fast, `<=`/`<`: at most that slow or that large). Quick configurations are small: they show where the kit",
        "stands on this machine, not its limits; run a benchmark without `--quick` for its full figure.",
        "",
        f"- machine: {info['cpu']}, {info['cores']} cores, {info['ram']} RAM; Python {info['python']}",
        f"- date: {info['date']}; commit {info['commit']}",
        f"- load average (1/5/15 min): before {load_before}, after {load_after}",
        f"- total wall time: {total_s / 60:.1f} min",
    ]
    busiest = max(float(x.split(" / ")[0]) for x in (load_before, load_after))
    if busiest > (info["cores"] or 1):
        lines.append(
            f"- **note:** 1-minute load average up to {busiest:.1f} on {info['cores']} cores: other processes shared "
            "the machine, so wall-clock ratios are disturbed; rerun `make bench` on a quiet machine"
        )
    lines += [
        "",
        "| stage | figure | ratio | goal | status |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {cell(r.stage)} | {cell(r.figure)} | {r.ratio} | {cell(r.goal)} | {r.status} |")
    lines += ["", "## Baselines (the code or command each ratio is measured against)", ""]
    for r in rows:
        if r.baselines:
            lines.append(f"- **{cell(r.stage)} — {cell(r.figure)}**")
            for b in r.baselines:
                if "\n" in b:  # a block of code: fenced, as printed
                    lines += ["", "  ```", *(f"  {ln}" for ln in b.splitlines()), "  ```", ""]
                else:
                    lines.append(f"  - `{b.replace('`', chr(39))}`")
    lines += ["", "## Runs", "", "| benchmark | wall s | exit | figures |", "|---|---|---|---|"]
    for r in runs:
        code = "timeout" if r.returncode is None and r.error.startswith("timed out") else r.returncode
        lines.append(f"| {r.bench} --quick | {r.seconds:.0f} | {code} | {len(r.rows)} |")
    lines += ["", "Full outputs: `runs/bench/<stage>.log` (not committed).", ""]
    return "\n".join(lines)


class RenderError(Exception):
    """results.md or the template is missing or not in the shape run_all.py writes."""


def results_section(results_md: str) -> str:
    """The run facts (machine, date, load) and the table of ratios of a results.md, as Markdown lines."""
    lines = results_md.splitlines()
    facts = [
        ln
        for ln in lines
        if ln.startswith(("- machine:", "- date:", "- load average", "- total wall", "- **note:**"))
    ]
    try:
        start = lines.index("| stage | figure | ratio | goal | status |")
    except ValueError:
        raise RenderError("holds no table of ratios (`| stage | figure | ratio | goal | status |`)") from None
    table = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        table.append(ln)
    return "\n".join(["From [`results.md`](results.md):", "", *facts, "", *table])


def render_readme(results_md: str, template: str) -> str:
    """benchmarks/README.md: the template's notes with the results table of `results_md` at the template's marker."""
    if template.count(RESULTS_MARK) != 1:
        raise RenderError(f"must hold the line {RESULTS_MARK!r} exactly once")
    return template.replace(RESULTS_MARK, results_section(results_md)).rstrip("\n") + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file


def write_readme(results: Path, readme: Path, template: Path = TEMPLATE) -> None:
    """Render `readme` from `results` and `template`; a missing or malformed input is a RenderError naming it."""
    texts = []
    for path, hint in ((results, "`make bench` writes it"), (template, "restore it from git")):
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise RenderError(f"{path}: cannot be read ({e.strerror}); {hint}") from None
    if texts[1].count(RESULTS_MARK) != 1:
        raise RenderError(f"{template}: must hold the line {RESULTS_MARK!r} exactly once")
    try:
        text = render_readme(*texts)
    except RenderError as e:
        raise RenderError(f"{results}: {e}") from None
    write_atomic(readme, text)


def print_table(rows: List[Row]) -> None:
    w_stage = max([5] + [len(r.stage) for r in rows])
    w_fig = min(100, max([6] + [len(r.figure) for r in rows]))
    print(f"\n{'stage':<{w_stage}}  {'figure':<{w_fig}}  {'ratio':>8}  {'goal':<9}  status")
    for r in rows:
        fig = r.figure if len(r.figure) <= w_fig else r.figure[: w_fig - 1] + "…"
        print(f"{r.stage:<{w_stage}}  {fig:<{w_fig}}  {r.ratio:>8}  {r.goal:<9}  {r.status}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only", nargs="+", help="stages to run (data convert envs train plan ops profiling evaluate)"
    )
    ap.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one benchmark may take (a hang guard)"
    )
    ap.add_argument("--out", default=str(HERE / "results.md"), help="the Markdown file to write")
    ap.add_argument("--logs", default=str(ROOT / "runs" / "bench"), help="folder for each benchmark's log")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a benchmark errors")
    ap.add_argument("--readme", default=str(HERE / "README.md"), help="the README rendered from --out")
    ap.add_argument(
        "--render-only", action="store_true", help="only render --readme from the existing --out; run nothing"
    )
    args = ap.parse_args()
    if args.render_only:
        try:
            write_readme(Path(args.out), Path(args.readme))
        except RenderError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.readme}")
        return 0
    benches = [b for b in BENCHMARKS if not args.only or b[len("bench_") : -3] in args.only]
    info = machine()
    load_before = load()
    print(
        f"{info['cpu']}, {info['cores']} cores, {info['ram']} RAM; {info['date']}; commit {info['commit']}; "
        f"load {load_before}",
        flush=True,
    )
    t0 = time.perf_counter()
    runs = []
    for bench in benches:
        print(f"running {bench} --quick ...", flush=True)
        run = run_one(bench, args.timeout, Path(args.logs))
        status = f"ERROR: {run.error}" if run.error else f"{len(run.rows)} figures"
        print(f"  {run.seconds:.0f} s, {status}", flush=True)
        runs.append(run)
    total = time.perf_counter() - t0
    load_after = load()
    print_table(table_rows(runs))
    print(f"\nload average before {load_before}, after {load_after}; total {total / 60:.1f} min")
    out = Path(args.out)
    write_atomic(out, markdown(info, runs, load_before, load_after, total))
    print(f"wrote {out}")
    try:
        write_readme(out, Path(args.readme))
    except RenderError as e:  # the figures are written; only the README could not be rendered
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.readme}")
    return 1 if args.strict and any(r.error for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
