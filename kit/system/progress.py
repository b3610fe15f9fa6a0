"""Progress bars that end on their final frame in a saved notebook; tqdm's own bar in a terminal.

In a Jupyter kernel tqdm's widget bar is saved with the notebook as its first frame ("0%"), since the widget's later
states live only in the browser. Here a kernel gets the bar as text in a display the kernel updates in place
(`update_display_data`, at most twice a second and once at the end): the live page and the executed notebook both
show where it got to. transformers' own bars (loading and writing weights) take the same class through its tqdm
hook (transformers 5); older transformers show none in a kernel.
"""

from __future__ import annotations

import io
import sys
from typing import Any


def in_kernel() -> bool:
    """True inside a Jupyter kernel (a notebook cell, papermill); False in a terminal or a plain script."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return bool(shell) and hasattr(shell, "kernel")


def _display_bar_class():
    from tqdm.std import tqdm

    class DisplayBar(tqdm):
        """tqdm drawn as text into one display of the cell, updated in place."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._handle = None
            kwargs.update(file=io.StringIO(), mininterval=max(0.5, kwargs.get("mininterval") or 0.0))
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None) -> bool:
            from IPython.display import display

            data = {"text/plain": self.__str__() if msg is None else msg}
            if self._handle is None:
                self._handle = display(data, raw=True, display_id=True)
            else:
                self._handle.update(data, raw=True)
            return True

    return DisplayBar


def bar(*args: Any, **kwargs: Any) -> Any:
    """A progress bar with tqdm's arguments: the display bar in a kernel, tqdm.auto's elsewhere."""
    if in_kernel():
        return _display_bar_class()(*args, **kwargs)
    from tqdm.auto import tqdm

    return tqdm(*args, **kwargs)


def hf_bars() -> None:
    """In a kernel, transformers' bars become display bars (or, before transformers 5's hook, are switched off)."""
    if not in_kernel():
        return
    from transformers.utils import logging

    if hasattr(logging, "set_tqdm_hook"):

        def hook(factory, args, kwargs):
            return factory(*args, **kwargs) if factory is logging.EmptyTqdm else bar(*args, **kwargs)

        logging.set_tqdm_hook(hook)
    else:
        logging.disable_progress_bar()
