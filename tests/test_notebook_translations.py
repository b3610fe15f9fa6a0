"""The Chinese walkthrough (notebooks/zh/) is the English one in another language: the same cells in the same order,
the same code, and every markdown cell translated from the English text as it is now."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kit.core.notebooks import (
    LANGUAGES,
    numbered_notebooks,
    source_hash,
    sync_translation,
    translation_problems,
)

EN = numbered_notebooks()


@pytest.mark.parametrize("lang", LANGUAGES[1:])
def test_every_notebook_has_a_translation_and_no_other(lang):
    assert [p.name for p in numbered_notebooks(lang=lang)] == [p.name for p in EN]


@pytest.mark.parametrize("lang", LANGUAGES[1:])
@pytest.mark.parametrize("en", EN, ids=[p.stem for p in EN])
def test_translation_matches_the_english_notebook(en, lang):
    tr = numbered_notebooks(lang=lang)[[p.name for p in EN].index(en.name)]
    problems = translation_problems(en, tr)
    assert not problems, (
        "\n".join(problems)
        + "\n(run `python -m kit demo --sync-translations`, then translate the cells listed)"
    )


def _cells(path):
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def test_problems_catch_changed_code_changed_english_and_untranslated_prose(tmp_path):
    en = tmp_path / "00_a.ipynb"
    shutil.copy(EN[0], en)
    cells = _cells(en)
    md = [c["id"] for c in cells if c["cell_type"] == "markdown"]
    out, problems = sync_translation(en, "zh", {i: f"中文 {i}" for i in md}, out_dir=tmp_path / "zh")
    assert problems == []
    assert [c["id"] for c in _cells(out)] == [c["id"] for c in cells]

    # the English prose of one cell changes: that cell is stale, the rest still match
    nb = json.loads(en.read_text(encoding="utf-8"))
    nb["cells"][0]["source"] = "# changed\n"
    en.write_text(json.dumps(nb), encoding="utf-8")
    assert translation_problems(en, out) == [
        f"{out.name} cell {md[0]}: the English text changed since it was translated (or it never was)"
    ]
    # a sync keeps the stale prose (a translator still has it) and keeps reporting it; a translation clears it
    assert len(sync_translation(en, "zh", out_dir=tmp_path / "zh")[1]) == 1
    assert sync_translation(en, "zh", {md[0]: "# 已改"}, out_dir=tmp_path / "zh")[1] == []
    md0 = next(c for c in _cells(out) if c["id"] == md[0])
    assert md0["metadata"]["kit"]["translated_from"] == source_hash("# changed\n")

    # code edited in the translation only
    tr = json.loads(out.read_text(encoding="utf-8"))
    code = next(c for c in tr["cells"] if c["cell_type"] == "code")
    code["source"] = "print('only here')\n"
    out.write_text(json.dumps(tr), encoding="utf-8")
    assert translation_problems(en, out) == [
        f"{out.name} cell {code['id']}: code differs from the English notebook; sync it"
    ]

    # prose marked as translated but still English
    out2, _ = sync_translation(en, "zh", {i: "still English" for i in md}, out_dir=tmp_path / "zh2")
    assert len(translation_problems(en, out2)) == len(md)
    assert all(p.endswith("not translated") for p in translation_problems(en, out2))

    # a cell added to the English notebook: the copy no longer matches until synced; the sync keeps every
    # translation with its English text even where the ids were renumbered, and reports only the new cell
    nb = json.loads(en.read_text(encoding="utf-8"))
    nb["cells"].insert(1, {"cell_type": "markdown", "id": "new", "metadata": {}, "source": "new"})
    for i, c in enumerate(nb["cells"]):
        c["id"] = str(i)  # as nbstripout numbers them
    en.write_text(json.dumps(nb), encoding="utf-8")
    assert "differ" in translation_problems(en, out)[0]
    out, problems = sync_translation(en, "zh", out_dir=tmp_path / "zh")
    assert problems == [
        f"{out.name} cell 1: the English text changed since it was translated (or it never was)"
    ]
    moved = next(c for c in _cells(out) if c["id"] == str(int(md[1]) + 1))  # one further down now
    assert "".join(moved["source"]) == f"中文 {md[1]}"


def test_relative_links_point_one_folder_further_up(tmp_path):
    en = tmp_path / "00_a.ipynb"
    shutil.copy(EN[0], en)
    md = next(c["id"] for c in _cells(en) if c["cell_type"] == "markdown")
    out, _ = sync_translation(en, "zh", {md: "见 [文档](../docs/train.md)。"}, out_dir=tmp_path / "zh")
    text = "".join(next(c for c in _cells(out) if c["id"] == md)["source"])
    assert text == "见 [文档](../../docs/train.md)。"


def test_translations_are_stripped():
    res = subprocess.run(
        [sys.executable, "-m", "nbstripout", "--verify", *map(str, numbered_notebooks(lang="zh"))],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("lang", LANGUAGES)
def test_prose_renders_without_stray_markers(lang):
    """CommonMark closes `**` after punctuation only before a space or punctuation: `**内核（kernel）**能` shows its
    asterisks. Every markdown cell, rendered, keeps no `*` outside code."""
    import re

    MarkdownIt = pytest.importorskip("markdown_it").MarkdownIt  # JupyterLab's renderer follows the same rules
    md = MarkdownIt("commonmark").enable("table")
    stray = []
    for nb in numbered_notebooks(lang=lang):
        for cell in _cells(nb):
            if cell["cell_type"] == "markdown":
                html = re.sub(r"<code>.*?</code>", "", md.render("".join(cell["source"])), flags=re.S)
                stray += [
                    f"{nb.name} cell {cell['id']}: {m.group(0)!r}"
                    for m in re.finditer(r".{0,20}\*+.{0,10}", html)
                ]
    assert stray == []
