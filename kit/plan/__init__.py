"""Will it fit, and how fast: a memory and throughput planner for a model, sequence length and set of cards."""

from kit.plan.planner import ALLOCATOR_MARGIN, DEFAULT_MFU, PlanInputs, PlanReport, inputs_for, make_plan

__all__ = ["ALLOCATOR_MARGIN", "DEFAULT_MFU", "PlanInputs", "PlanReport", "inputs_for", "make_plan"]
