"""The docs stay in layers: a short README, the reference in docs/, figures only in benchmarks/.

- README.md holds at most 250 lines.
- Every relative link in README.md, docs/*.md and benchmarks/README.md points to a file or folder that exists, and
  a `#anchor` (alone or after a Markdown file) to a heading of that file, slugged as GitHub does. Links inside code
  (fenced blocks, `inline code`) are not links and are not checked.
- README.md and docs/*.md hold no ratio figure, and neither does benchmarks/README.template.md (its prose must not
  copy what results.md says). A ratio figure is a number written with a times sign, `×` or `x`, right after it
  (`1.37×`, `0.95x`, `5×`; one space before `×` allowed), that is not part of a longer token: no letter, digit or
  dot just before the number, no letter or digit just after the sign (so `2048×2048`, `0x1f`, `TP2` are not
  figures). A figure right after a comparison (`≥`, `≤`, `>=`, `<=`, `>`, `<`) is a goal, not a result, and is
  allowed (`≥ 0.8×`). Any other figure belongs in benchmarks/results.md, whose table benchmarks/README.md renders.
- benchmarks/README.md is what `benchmarks/run_all.py --render-only` makes of results.md and the template.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BENCH = ROOT / "benchmarks"
MAX_README_LINES = 250
STAGE_DOCS = (
    "doctor.md",
    "envs.md",
    "data.md",
    "convert.md",
    "adapt.md",
    "train.md",
    "profiling.md",
    "evaluate.md",
)

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:x| ?×)(?![^\W_])")
GOAL_BEFORE = re.compile(r"(≥|≤|>=|<=|>|<)\s*$")


def without_code(text: str) -> str:
    """The text with fenced code blocks and inline code blanked (same line count)."""
    return INLINE_CODE.sub("", without_code_keep_headings(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def without_code_keep_headings(text: str) -> str:
    """Fenced blocks blanked (a `# comment` in a shell block is no heading); inline code kept for the slug."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def anchors(path: Path) -> Set[str]:
    """Every anchor GitHub gives the headings of a Markdown file (duplicates get -1, -2, ...)."""
    seen: dict = {}
    out = set()
    for m in HEADING.finditer(without_code_keep_headings(path.read_text(encoding="utf-8"))):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> List[str]:
    """The relative links of a Markdown file whose target or anchor does not exist."""
    problems = []
    for target in LINK.findall(without_code(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def ratio_figures(text: str) -> List[str]:
    """The ratio figures of a text that are not goals (see the module docstring for the rule)."""
    found = []
    for m in RATIO.finditer(text):
        if not GOAL_BEFORE.search(text[max(0, m.start() - 4) : m.start()]):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"line {line}: {m.group(0)}")
    return found


def run_all_module():
    """benchmarks/run_all.py imported by path (benchmarks/ is no package); dataclasses need it in sys.modules."""
    name = "benchmarks_run_all"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / "run_all.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move reference into docs/"


def test_docs_folder_has_the_stage_references():
    names = {p.name for p in DOCS}
    stages = set(STAGE_DOCS)
    assert stages <= names, f"missing: {sorted(stages - names)}"
    readme = README.read_text(encoding="utf-8")
    assert all(f"(docs/{name})" in readme for name in stages), (
        "every stage's reference is one link from README"
    )


@pytest.mark.parametrize("path", [README, *DOCS, BENCH / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


@pytest.mark.parametrize(
    "path", [README, *DOCS, BENCH / "README.template.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_ratio_figure_outside_results(path):
    figures = ratio_figures(path.read_text(encoding="utf-8"))
    assert figures == [], (
        f"{path.name} copies benchmark figures (link benchmarks/README.md instead): {figures}"
    )


def test_benchmarks_readme_is_rendered_from_results():
    run_all = run_all_module()
    expected = run_all.render_readme(
        (BENCH / "results.md").read_text(encoding="utf-8"),
        (BENCH / "README.template.md").read_text(encoding="utf-8"),
    )
    assert (BENCH / "README.md").read_text(encoding="utf-8") == expected, (
        "benchmarks/README.md is stale: run `python benchmarks/run_all.py --render-only`"
    )


def test_rendered_readme_carries_every_row_of_results(tmp_path):
    run_all = run_all_module()
    results = tmp_path / "results.md"
    results.write_text(
        "# Benchmark results\n\n- machine: test box, 2 cores\n- date: today\n\n"
        "| stage | figure | ratio | goal | status |\n|---|---|---|---|---|\n"
        "| data | kit vs recipe | 1.72x | >= 1.6x | MET |\n| envs | pack vs tar | 0.93x | >= 0.8x | MET |\n\n"
        "## Baselines\n\n| not | this |\n",
        encoding="utf-8",
    )
    readme = tmp_path / "README.md"
    run_all.write_readme(results, readme)
    text = readme.read_text(encoding="utf-8")
    assert "| data | kit vs recipe | 1.72x | >= 1.6x | MET |" in text
    assert "| envs | pack vs tar | 0.93x | >= 0.8x | MET |" in text
    assert "- machine: test box, 2 cores" in text
    assert "| not | this |" not in text  # only the table of ratios, not the later tables
    assert run_all.RESULTS_MARK not in text


def test_render_only_refuses_a_results_file_without_its_table(tmp_path):
    run_all = run_all_module()
    results = tmp_path / "results.md"
    results.write_text("# nothing here\n", encoding="utf-8")
    with pytest.raises(run_all.RenderError, match="no table of ratios"):
        run_all.write_readme(results, tmp_path / "README.md")
    assert not (tmp_path / "README.md").exists()


@pytest.mark.parametrize(
    "text, figures",
    [
        ("packed SFT 1.37× faster", ["1.37×"]),
        ("clone 0.95x of cp", ["0.95x"]),
        ("about 5× less", ["5×"]),
        ("a range 1.32–1.56×", ["1.56×"]),
        ("spaced 1.7 × lm-eval", ["1.7 ×"]),
        ("goal ≥ 0.8× and <= 1.5x", []),
        ("mask 2048×2048, shape 8x256x512, TP2 x PP2, 0x1f", []),
        ("`x * sigmoid(1.702 * x)` and x2", []),
    ],
)
def test_ratio_rule(text, figures):
    assert [f.split(": ", 1)[1] for f in ratio_figures(text)] == figures


def test_link_and_anchor_check(tmp_path):
    (tmp_path / "b.md").write_text(
        "# Stage 3: weight conversion HF ⇄ Megatron (`kit.convert`)\n## TP / PP rules\n", encoding="utf-8"
    )
    a = tmp_path / "a.md"
    a.write_text(
        "[ok](b.md) [ok](b.md#tp--pp-rules) [ok](b.md#stage-3-weight-conversion-hf--megatron-kitconvert) "
        "[web](https://example.com/x) `[code](missing.md)`\n"
        "[gone](missing.md) [bad anchor](b.md#nope) [self](#nowhere)\n",
        encoding="utf-8",
    )
    problems = broken_links(a)
    assert [p.split(":", 1)[0] for p in problems] == ["missing.md", "b.md#nope", "#nowhere"]
