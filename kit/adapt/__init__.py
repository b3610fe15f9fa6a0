"""Model adaptation for Ascend NPUs: kit attention for transformers models, flash-attn bridge, remote-code fixes."""

from kit.adapt.flash_attn_bridge import install_flash_attn_bridge, remove_flash_attn_bridge
from kit.adapt.hf import ATTENTION_NAME, SUPPORTED_MODEL_TYPES, AdaptReport, adapt_model, register
from kit.adapt.remote_code import KNOWN_FIXES, FixResult, RemoteCodeFixError, fix_remote_code

__all__ = [
    "ATTENTION_NAME",
    "KNOWN_FIXES",
    "SUPPORTED_MODEL_TYPES",
    "AdaptReport",
    "FixResult",
    "RemoteCodeFixError",
    "adapt_model",
    "fix_remote_code",
    "install_flash_attn_bridge",
    "register",
    "remove_flash_attn_bridge",
]
