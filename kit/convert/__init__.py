"""Weight conversion HF <-> Megatron (TP x PP, mcore local / legacy / TE key names), streaming and verified."""

from __future__ import annotations

from kit.convert.checks import ConversionError
from kit.convert.config import ConvertConfig
from kit.convert.convert import convert, hf_to_megatron, megatron_to_hf, megatron_to_megatron
from kit.convert.families import FAMILIES

__all__ = [
    "FAMILIES",
    "ConversionError",
    "ConvertConfig",
    "convert",
    "hf_to_megatron",
    "megatron_to_hf",
    "megatron_to_megatron",
]
