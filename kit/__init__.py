"""Ascend notebook kit: environments, data, weight conversion, NPU-adapted training and profiling."""

__version__ = "0.1.0"
