"""The advisor's result: findings as a DataFrame, a Markdown or HTML summary, JSON, and files on disk."""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import pandas as pd

from kit.profiling.moe import moe_operators
from kit.profiling.profile_data import ProfileData
from kit.profiling.tables import step_breakdown

SEVERITY_ORDER = {"warning": 0, "problem": 1, "skipped": 2, "info": 3}


def markdown_table(df: pd.DataFrame, floatfmt: str = "{:.1f}") -> str:
    """A GitHub Markdown table (pandas' to_markdown needs the optional tabulate package)."""

    def cell(v) -> str:
        s = floatfmt.format(v) if isinstance(v, float) else str(v)
        return s.replace("|", "\\|").replace("\n", " ")

    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "---|" * len(df.columns)
    rows = ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join([head, sep, *rows])


@dataclass
class Advice:
    """Findings of kit.profiling.advise plus the operator table they were computed from."""

    data: ProfileData
    findings: list
    operators: pd.DataFrame
    thresholds: object

    @property
    def problems(self) -> list:
        """The rules that found a problem, in report order."""
        return [f.rule for f in self.findings if f.severity == "problem"]

    def to_frame(self) -> pd.DataFrame:
        """One row per finding: severity, rule, title, evidence, fix, operators."""
        rows = [asdict(f) for f in sorted(self.findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 9))]
        cols = ["severity", "rule", "title", "evidence", "fix", "operators"]
        return pd.DataFrame(rows, columns=cols + ["numbers"])[cols]

    def to_markdown(self, top: int = 10) -> str:
        """A readable summary: findings, notes, top operators, step breakdown."""
        lines = [f"# Profile advice: {self.data.path.name}", "", f"{self.data.describe()}", ""]
        capture = self.data.meta.get("capture") or {}
        if capture.get("git_commit"):
            lines += [
                f"Captured at git commit `{capture['git_commit']}` on {capture.get('device', {}).get('kind')}.",
                "",
            ]
        lines += ["## Findings", ""]
        if not self.findings:
            lines.append("No findings.")
        for f in sorted(self.findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 9)):
            lines.append(f"- **{f.severity.upper()} - {f.title}** (`{f.rule}`): {f.evidence}")
            if f.fix:
                lines.append(f"  - Fix: {f.fix}")
        if self.data.warnings:
            lines += ["", "## Damaged or invalid input", ""] + [f"- {w}" for w in self.data.warnings]
        if self.data.rows:
            lines += ["", "## Rows read", ""] + [f"- {r}" for r in self.data.row_summary()]
        if self.data.notes:
            lines += ["", "## Notes while reading", ""] + [f"- {n}" for n in self.data.notes]
        lines += ["", f"## Top {top} operators by total time", "", markdown_table(self.operators.head(top))]
        moe = moe_operators(self.data)
        if len(moe):
            lines += ["", "## MoE operators", "", markdown_table(moe)]
        st = step_breakdown(self.data)
        if len(st):
            lines += ["", "## Steps", "", markdown_table(st)]
        return "\n".join(lines) + "\n"

    def to_html(self, top: int = 10) -> str:
        """The same summary as a standalone HTML page (tables via pandas)."""
        items = "".join(
            f"<li><b>{html.escape(f.severity.upper())} - {html.escape(f.title)}</b> "
            f"(<code>{html.escape(f.rule)}</code>): {html.escape(f.evidence)}"
            + (f"<br><i>Fix:</i> {html.escape(f.fix)}" if f.fix else "")
            + "</li>"
            for f in sorted(self.findings, key=lambda f: SEVERITY_ORDER.get(f.severity, 9))
        )
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.data.notes)
        moe = moe_operators(self.data)
        warns = "".join(f"<li>{html.escape(w)}</li>" for w in self.data.warnings + self.data.row_summary())
        return (
            f"<html><head><meta charset='utf-8'><title>Profile advice</title></head><body>"
            f"<h1>Profile advice: {html.escape(self.data.path.name)}</h1><p>{html.escape(self.data.describe())}</p>"
            f"<h2>Findings</h2><ul>{items or '<li>No findings.</li>'}</ul>"
            + (f"<h2>Damaged or invalid input</h2><ul>{warns}</ul>" if self.data.warnings else "")
            + (f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "")
            + f"<h2>Top {top} operators</h2>{self.operators.head(top).to_html(index=False, float_format='%.1f')}"
            + (f"<h2>MoE operators</h2>{moe.to_html(index=False, float_format='%.1f')}" if len(moe) else "")
            + "</body></html>"
        )

    def summary(self, files: Optional[dict] = None) -> dict:
        """Scalars and paths for a notebook summary: the profile, its problems and their operators, files."""
        return {
            "profile": str(self.data.path),
            "problems": self.problems,
            "problem_operators": {f.rule: f.operators for f in self.findings if f.severity == "problem"},
            "warnings": len(self.data.warnings),
            **{f"{role}_file": str(path) for role, path in (files or {}).items()},
        }

    def to_json(self) -> dict:
        """Everything as plain JSON values."""
        return {
            "profile": str(self.data.path),
            "kind": self.data.kind,
            "problems": self.problems,
            "thresholds": asdict(self.thresholds),
            "findings": [asdict(f) for f in self.findings],
            "warnings": list(self.data.warnings),
            "rows": self.data.rows,
            "notes": list(self.data.notes),
            "capture": self.data.meta.get("capture", {}),
            "top_operators": json.loads(self.operators.head(20).to_json(orient="records")),
            "steps": json.loads(step_breakdown(self.data).to_json(orient="records")),
            "moe_operators": json.loads(moe_operators(self.data).to_json(orient="records")),
        }

    def save(self, folder: Union[str, Path], overwrite: bool = False) -> dict:
        """Write advice.md, advice.html, advice.json and operators.csv into `folder`; return their paths."""
        from kit.storage.atomic import atomic_write_text, refuse_existing

        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            from kit.profiling.profile_data import ProfileError

            raise ProfileError(
                f"{folder} is a file; advice files go into a folder: pass a folder path (new or existing)."
            )
        paths = {
            "markdown": folder / "advice.md",
            "html": folder / "advice.html",
            "json": folder / "advice.json",
            "operators": folder / "operators.csv",
        }
        for p in paths.values():
            refuse_existing(p, overwrite, "advice file")
        atomic_write_text(paths["markdown"], self.to_markdown())
        atomic_write_text(paths["html"], self.to_html())
        atomic_write_text(paths["json"], json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n")
        atomic_write_text(paths["operators"], self.operators.to_csv(index=False))
        return paths
