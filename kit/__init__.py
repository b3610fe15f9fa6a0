"""Ascend notebook kit: environments, data, weight conversion, NPU-adapted training and profiling."""

from kit.errors import install_notebook_handler as _install_notebook_handler

__version__ = "0.1.0"

_install_notebook_handler()  # in a notebook: OSErrors a user can act on (disk full, ...) read as one line
