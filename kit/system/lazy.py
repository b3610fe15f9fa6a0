"""A package's public names imported on first use (PEP 562 module `__getattr__`), so importing it stays light."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], list]]:
    """`__getattr__` and `__dir__` for `package`: `exports` maps each public name to the module that defines it.

    No public name may equal a submodule's name: importing that submodule would rebind the package attribute to
    the module. Use: `__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)`.
    """
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
