"""Profiling: one capture API (torch_npu.profiler on NPU, torch.profiler elsewhere), one analyzer, slow-op advice.

The stage (notebook 05): `run(cfg, ws, training_run=...)` profiles a few steps of notebook 04's training run.

Names are imported on first use (module `__getattr__`, PEP 562): `python -m kit profile --help` and
`import kit.profiling` load no pandas, torch or matplotlib until a function that needs them is called.
"""

from __future__ import annotations

from kit.system.lazy import lazy_exports

# public name -> module that defines it (no public name equals a submodule's: hence comparison.py, not compare.py)
_EXPORTS = {
    "Advice": "kit.profiling.advice",
    "Capture": "kit.profiling.capture",
    "CaptureError": "kit.profiling.profile_data",
    "Comparison": "kit.profiling.comparison",
    "Finding": "kit.profiling.advisor",
    "ProfileConfig": "kit.profiling.config",
    "ProfileData": "kit.profiling.profile_data",
    "ProfileError": "kit.profiling.profile_data",
    "ProfileResult": "kit.profiling.training_run",
    "Thresholds": "kit.profiling.config",
    "advise": "kit.profiling.advisor",
    "compare": "kit.profiling.comparison",
    "ensure_sample_profile": "kit.profiling.sample",
    "find_profiles": "kit.profiling.loader",
    "load": "kit.profiling.loader",
    "mean_step_us": "kit.profiling.tables",
    "operator_table": "kit.profiling.tables",
    "plot_step_breakdown": "kit.profiling.plots",
    "plot_top_operators": "kit.profiling.plots",
    "profile": "kit.profiling.capture",
    "run": "kit.profiling.training_run",
    "sample_profile_dir": "kit.profiling.sample",
    "step_breakdown": "kit.profiling.tables",
    "write_sample_ascend_profile": "kit.profiling.sample",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
