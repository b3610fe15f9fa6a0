"""Config helpers: help texts, options and notebook parameters all come from the one dataclass declaration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from kit.core.configs import add_config_arguments, bind, explicit_values, field_docs


@dataclass
class Demo:
    """A config documented the kit's way: a string literal under each field (an attribute docstring)."""

    name: str = "corpus"
    """Output name."""
    max_length: int = 2048
    """Tokens per
    sample."""
    layers: Optional[List[int]] = None
    """Uneven pipeline: layers per stage."""
    pack: bool = True  # a comment is not documentation
    columns: dict = field(default_factory=dict)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    add_config_arguments(p, Demo)
    return p


def test_docs_come_from_attribute_docstrings_only():
    docs = field_docs(Demo)
    assert docs == {
        "name": "Output name.",
        "max_length": "Tokens per sample.",
        "layers": "Uneven pipeline: layers per stage.",
    }
    text = " ".join(_parser().format_help().split())
    assert "Tokens per sample. (default: 2048)" in text
    assert "--pack, --no-pack default: True" in text  # no docstring: only the default is shown


STAGE_CONFIGS = [
    "kit.data.config:DataConfig",
    "kit.convert.config:ConvertConfig",
    "kit.train.config:TrainConfig",
    "kit.profiling.config:ProfileConfig",
    "kit.evaluate.config:EvalConfig",
    "kit.envs.config:EnvsConfig",
    "kit.doctor.report:DoctorConfig",
    "kit.serve.config:ServeConfig",
    "kit.serve.config:BenchConfig",
    "kit.serve.config:PackageConfig",
    "kit.train.job.config:JobConfig",
    "kit.train.preflight.run:PreflightConfig",
]


@pytest.mark.parametrize("where", STAGE_CONFIGS)
def test_every_field_of_every_stage_config_has_help(where, monkeypatch):
    """Each field has an attribute docstring, and `--help` shows it beside its option."""
    import importlib

    monkeypatch.setenv("COLUMNS", "10000")  # no line wrapping inside the texts (argparse breaks at hyphens)
    from dataclasses import fields

    module, name = where.split(":")
    cls = getattr(importlib.import_module(module), name)
    docs = field_docs(cls)
    undocumented = [f.name for f in fields(cls) if len(docs.get(f.name, "")) < 8]
    assert undocumented == []
    p = argparse.ArgumentParser(prog=name)
    add_config_arguments(p, cls)
    text = " ".join(p.format_help().split())
    for f in fields(cls):
        assert docs[f.name] in text, f.name


def test_every_config_dataclass_is_listed():
    """A new stage config joins STAGE_CONFIGS (so its help is checked above)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "kit"
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and node.decorator_list:
                found.add(f"{'.'.join(path.relative_to(root.parent).with_suffix('').parts)}:{node.name}")
    assert found == set(STAGE_CONFIGS)


def test_only_typed_options_are_explicit_and_types_are_parsed():
    args = _parser().parse_args(
        ["--max-length", "512", "--no-pack", "--layers", "7,8,8,7", "--columns", '{"a": "b"}']
    )
    assert explicit_values(args, Demo) == {
        "max_length": 512,
        "pack": False,
        "layers": [7, 8, 8, 7],
        "columns": {"a": "b"},
    }
    assert explicit_values(_parser().parse_args([]), Demo) == {}
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-length", "many"])


def test_bind_takes_upper_snake_parameters_of_the_notebook():
    cfg = bind(Demo, {"NAME": "wiki", "MAX_LENGTH": 128, "OTHER": 1, "name": "ignored"}, pack=False)
    assert (cfg.name, cfg.max_length, cfg.pack, cfg.layers) == ("wiki", 128, False, None)
