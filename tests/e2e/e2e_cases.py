"""Per notebook: the tiny parameters the browser run uses (same as its papermill test) and what must be visible."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Expect:
    """Key outputs a user must see after Run All (counted over all cells; texts must all appear somewhere)."""

    tables: int = 0
    images: int = 0
    progress: int = 0
    texts: tuple = field(default_factory=tuple)


def tiny_parameters(prefix: str, root: Path) -> dict:
    """Parameter overrides for notebook `prefix` (e.g. "02"), with WORKSPACE inside the temporary lab root."""
    params = dict(TINY.get(prefix, {}))
    params["WORKSPACE"] = str(root / "ws")
    return params


# From each notebook's own test (tests/test_nbNN_*.py, its run_notebook(...) call).
TINY = {
    "00": {"CHECK_DEEPSPEED": False, "EXPLAIN_ERROR": "EJ0001: Failed to initialize the HCCP process."},
}

EXPECT = {
    # the doctor's report table (PASS/WARN/FAIL lines), the device table, the explained error
    "00": Expect(tables=2, texts=("torch_npu", "CANN", "PASS", "gloo", "leftover_process")),
}

# A parameter a user could get wrong, and the words of the kit's error that must be visible in the cell output.
BROKEN = {
    "00": ({"MODEL": "my model/v1"}, "is not a plain folder name"),
}
