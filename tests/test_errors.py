"""One error hierarchy: every exception class the kit defines derives from kit.errors.KitError."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kit
from kit.errors import InputError, IntegrityError, KitError, MissingInputError

KIT = Path(kit.__file__).parent


def _exception_classes():
    """(module, class name) of every class in kit/ whose name says it is an error."""
    for path in sorted(KIT.rglob("*.py")):
        module = ".".join(path.relative_to(KIT.parent).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Exception")):
                yield module, node.name


def test_every_kit_error_is_a_kit_error():
    classes = list(_exception_classes())
    assert len(classes) > 15  # the scan finds the kit's errors (kit.errors itself has 7)
    outside = [
        f"{m}.{n}" for m, n in classes if not issubclass(getattr(importlib.import_module(m), n), KitError)
    ]
    assert outside == []


def test_stage_errors_sit_under_the_shared_kinds():
    """Stage errors refine the kinds of kit.errors, so `except InputError` catches every bad-input error."""
    from kit.configs import ConfigError
    from kit.convert.torch_zip import RankFileError
    from kit.data.readers import DataInputError, DataPathError
    from kit.profiling.profile_data import ProfileError

    assert issubclass(RankFileError, IntegrityError) and issubclass(RankFileError, ValueError)
    assert all(issubclass(c, InputError) for c in (ConfigError, DataInputError, ProfileError))
    assert issubclass(DataPathError, MissingInputError) and issubclass(DataPathError, FileNotFoundError)
