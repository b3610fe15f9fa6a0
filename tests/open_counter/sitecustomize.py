"""Test helper: with KIT_TEST_OPEN_LOG set, every datasets.load_from_disk call appends this process's id to that file.

On PYTHONPATH it is imported at the start of every process a launch starts (torchrun, its ranks), so a test counts
how often a launched run opens its dataset without any hook in kit itself.
"""

import importlib.abc
import importlib.machinery
import os
import sys

LOG = os.environ.get("KIT_TEST_OPEN_LOG")


def counted(load_from_disk):
    """`load_from_disk` that first records the call in LOG."""

    def load(*args, **kwargs):
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
        return load_from_disk(*args, **kwargs)

    return load


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps datasets.load_from_disk once `datasets` is imported (importing it here would slow every process)."""

    def find_spec(self, name, path=None, target=None):
        # every lookup of `datasets` gets the wrapping spec, not only the first: transformers 4.x looks it up
        # (importlib.util.find_spec) to see whether it is installed long before anything imports it
        if name != "datasets" or name in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.load_from_disk = counted(module.load_from_disk)

        spec.loader.exec_module = exec_module
        return spec


if LOG:
    sys.meta_path.insert(0, _WrapOnImport())
