"""A cell's last value is a table, a sentence or a folded block (kit.core.show), with nothing cut off."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kit.core.show import fold, show


@dataclass
class _Cfg:
    name: str
    lr: float
    layers: list
    extra: dict


def test_a_config_is_a_table_of_its_fields_with_long_text_whole():
    long = "x" * 300
    t = show(_Cfg(long, 0.000123456, [1, 2], {"a": {"b": 1}}), "settings")
    assert t.rows[:3] == [("name", long), ("lr", "0.0001235"), ("layers", "1, 2")]
    assert t.rows[3][1] == '{\n "a": {\n  "b": 1\n }\n}'
    html = t._repr_html_()
    assert long in html and "<caption" in html and "settings" in html
    assert repr(t).splitlines()[:2] == ["settings", f"name    {long}"]


def test_a_mapping_escapes_html_and_a_path_is_one_sentence():
    t = show({"<script>": "a & b", "none": None, "empty": []})
    assert "&lt;script&gt;" in t._repr_html_() and "a &amp; b" in t._repr_html_()
    assert t.rows[1:] == [("none", "None"), ("empty", "(none)")]
    s = show(Path("/ws/reports/x.json"), "summary")
    assert s._repr_markdown_() == "summary: `/ws/reports/x.json`" and repr(s) == str(s)


def test_fold_keeps_the_text_under_one_line():
    f = fold('{"body": 1}\nline <2>', "the full request")
    assert f._repr_html_().startswith("<details><summary>the full request</summary>")
    assert "line &lt;2&gt;" in f._repr_html_() and repr(f).startswith("the full request\n")
