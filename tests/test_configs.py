"""Config helpers: help texts, options and notebook parameters all come from the one dataclass declaration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from kit.configs import add_config_arguments, bind, explicit_values, field_docs


@dataclass
class Demo:
    """A config with both documentation styles."""

    name: str = "corpus"  # output name
    max_length: int = 2048
    """Tokens per sample."""
    layers: Optional[List[int]] = None  # uneven pipeline, layers per stage
    pack: bool = True  # pack dialogs
    columns: dict = field(default_factory=dict)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    add_config_arguments(p, Demo)
    return p


def test_docs_come_from_comments_and_attribute_docstrings():
    docs = field_docs(Demo)
    assert docs == {
        "name": "output name",
        "max_length": "Tokens per sample.",
        "layers": "uneven pipeline, layers per stage",
        "pack": "pack dialogs",
    }
    assert "Tokens per sample. (default: 2048)" in " ".join(_parser().format_help().split())


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
