"""What a notebook cell ends with: a kit value as a table, a sentence or a folded block, never a raw repr.

`show(value, title)`: a config dataclass or a mapping becomes a two-column table (nothing cut off: long text wraps);
a path becomes one sentence. `fold(text, title)`: a long text (a request body, a log) folded under one line.
Each renders as HTML in Jupyter and as aligned plain text elsewhere.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path
from typing import Any, List, Tuple

from kit.core.i18n import t


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, Path)) for v in value):
        return ", ".join(_text(v) for v in value) if value else t("show.none")
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, indent=1, ensure_ascii=False, default=str)
    return str(value)


class Table:
    """Rows of (name, value) under an optional title."""

    def __init__(self, rows: List[Tuple[str, str]], title: str = "") -> None:
        self.rows, self.title = rows, title

    def _repr_html_(self) -> str:
        cap = (
            f"<caption style='text-align:left'><b>{html.escape(self.title)}</b></caption>"
            if self.title
            else ""
        )
        body = "".join(
            f"<tr><th style='text-align:left;vertical-align:top'>{html.escape(k)}</th>"
            f"<td style='text-align:left;white-space:pre-wrap'>{html.escape(v)}</td></tr>"
            for k, v in self.rows
        )
        return f"<table>{cap}{body}</table>"

    def __repr__(self) -> str:
        width = max((len(k) for k, _ in self.rows), default=0)
        lines = [self.title] if self.title else []
        for k, v in self.rows:
            pad = "\n" + " " * (width + 2)
            lines.append(f"{k.ljust(width)}  {v.replace(chr(10), pad)}")
        return "\n".join(lines)


class Sentence(str):
    """One sentence, shown as Markdown in Jupyter."""

    def _repr_markdown_(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return str(self)


class Folded:
    """A long text under one line that opens it (an HTML <details> block)."""

    def __init__(self, text: str, title: str) -> None:
        self.text, self.title = text, title

    def _repr_html_(self) -> str:
        return (
            f"<details><summary>{html.escape(self.title)}</summary>"
            f"<pre style='white-space:pre-wrap'>{html.escape(self.text)}</pre></details>"
        )

    def __repr__(self) -> str:
        return f"{self.title}\n{self.text}"


def show(value: Any, title: str = "") -> Any:
    """A dataclass or mapping as a Table, a path or a text as a Sentence (`title` in front); see the module doc."""
    if isinstance(value, Path):
        return Sentence(f"{title}: `{value}`" if title else f"`{value}`")
    if isinstance(value, str):
        return Sentence(f"{title}: {value}" if title else value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return Table([(str(k), _text(v)) for k, v in dict(value).items()], title)


def fold(text: str, title: str) -> Folded:
    """`text` folded under the line `title`."""
    return Folded(text, title)
