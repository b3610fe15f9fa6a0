"""Old name of kit.profiling.advice (the advisor's result), kept so existing imports work."""

from kit.profiling.advice import SEVERITY_ORDER, Advice, markdown_table  # noqa: F401
