"""What a loaded profile holds, whichever profiler wrote it, and the error raised for unusable input."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from kit.errors import InputError, KitError

# Columns of the normalised kernel table; ratio columns (aic_*_ratio / aiv_*_ratio) follow when present.
KERNEL_COLUMNS = ["step", "device", "name", "type", "core", "start_us", "dur_us", "wait_us", "block_dim"]
# Cores whose time counts as computation (the share denominator); communication tasks are left out.
COMMUNICATION_CORES = {"HCCL", "COMMUNICATION", "COMMUNICATION_TASK"}


class ProfileError(InputError):
    """A profile folder or file that cannot be analysed; the message says what is missing and what to do."""


class CaptureError(KitError, RuntimeError):
    """A capture that cannot start or stop (profiler missing, capture not started); the message says what to do."""


@dataclass
class ProfileData:
    """One capture: device kernels (one row per launch), optional op statistics, step breakdown and metadata."""

    kind: str  # "ascend" | "torch"
    path: Path
    kernels: pd.DataFrame
    op_statistic: Optional[pd.DataFrame] = None
    step_trace: Optional[pd.DataFrame] = None  # step, computing_us, communication_us, free_us, total_us
    core_counts: dict = field(default_factory=dict)  # {"AI_CORE": 24, "AI_VECTOR_CORE": 48}
    meta: dict = field(default_factory=dict)  # capture.json of a kit capture, profiler_info.json, ...
    notes: list = field(default_factory=list)  # what was missing or repaired while reading
    files: dict = field(default_factory=dict)  # role -> file read
    warnings: list = field(
        default_factory=list
    )  # damaged files / invalid values: the figures may be incomplete
    rows: dict = field(default_factory=dict)  # file name -> {"read": n, "used": n, "dropped": {reason: n}}
    core_counts_problem: str = ""  # why core_counts is empty although device info files exist (corrupt, ...)

    @property
    def ratio_columns(self) -> list:
        """The unit-utilisation ratio columns present (empty at Level0 or for torch traces)."""
        return [c for c in self.kernels.columns if c.endswith("_ratio")]

    def describe(self) -> str:
        """One line: kind, rows, steps, what is present."""
        steps = (
            self.kernels["step"].nunique()
            if "step" in self.kernels and self.kernels["step"].notna().any()
            else 0
        )
        dropped = sum(sum(r.get("dropped", {}).values()) for r in self.rows.values())
        return (
            f"{self.kind} profile {self.path}: {len(self.kernels)} kernel rows, {steps} steps, "
            f"{len(self.ratio_columns)} ratio columns, step trace {'yes' if self.step_trace is not None else 'no'}"
            + (f", {dropped} row(s) dropped" if dropped else "")
            + (f", {len(self.warnings)} warning(s)" if self.warnings else "")
        )

    def row_summary(self) -> list:
        """'file: read N, used M, dropped K (reason: n, ...)' per file read, for reports."""
        out = []
        for name, r in self.rows.items():
            drops = r.get("dropped", {})
            why = ", ".join(f"{k}: {v}" for k, v in drops.items() if v)
            out.append(
                f"{name}: read {r.get('read', 0)} row(s), used {r.get('used', 0)}, dropped {sum(drops.values())}"
                + (f" ({why})" if why else "")
            )
        return out
