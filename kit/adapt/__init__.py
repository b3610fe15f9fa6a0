"""Model adaptation for Ascend NPUs: kit attention for transformers models, flash-attn bridge, remote-code fixes."""

from kit.adapt.hf import ATTENTION_NAME, SUPPORTED_MODEL_TYPES, AdaptReport, adapt_model, register

__all__ = ["ATTENTION_NAME", "SUPPORTED_MODEL_TYPES", "AdaptReport", "adapt_model", "register"]
