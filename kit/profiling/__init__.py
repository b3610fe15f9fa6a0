"""Profiling: one capture API (torch_npu.profiler on NPU, torch.profiler elsewhere), one analyzer, slow-op advice."""

from kit.profiling.advisor import Finding, Thresholds, advise
from kit.profiling.capture import Capture, profile
from kit.profiling.compare import Comparison, compare
from kit.profiling.config import ProfileConfig
from kit.profiling.data import ProfileData, ProfileError
from kit.profiling.loader import find_profiles, load
from kit.profiling.plots import plot_step_breakdown, plot_top_operators
from kit.profiling.report import Advice
from kit.profiling.sample import ensure_sample_profile, sample_profile_dir, write_sample_ascend_profile
from kit.profiling.tables import mean_step_us, operator_table, step_breakdown

__all__ = [
    "Advice",
    "Capture",
    "Comparison",
    "Finding",
    "ProfileConfig",
    "ProfileData",
    "ProfileError",
    "Thresholds",
    "advise",
    "compare",
    "ensure_sample_profile",
    "find_profiles",
    "load",
    "mean_step_us",
    "operator_table",
    "plot_step_breakdown",
    "plot_top_operators",
    "profile",
    "sample_profile_dir",
    "step_breakdown",
    "write_sample_ascend_profile",
]
