"""Weight conversion HF <-> Megatron (TP x PP, mcore local / legacy / TE key names), streaming and verified.

The names below are imported on first use (module `__getattr__`), so `python -m kit convert --help` and
`import kit.convert` stay light; torch itself is imported only by the code that computes on tensors.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FAMILIES": "kit.convert.families",
    "ConversionError": "kit.convert.checks",
    "ConvertConfig": "kit.convert.config",
    "convert": "kit.convert.convert",
    "hf_to_megatron": "kit.convert.convert",
    "megatron_to_hf": "kit.convert.convert",
    "megatron_to_megatron": "kit.convert.convert",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kit.convert' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + list(_EXPORTS))
