"""Weight conversion HF <-> Megatron (TP x PP x EP, mcore local / legacy / TE key names), streaming and verified.

Importing the package is light: the conversion moves bytes in plain Python, and torch is imported only inside the
functions that compute on tensors (a dtype cast, Baichuan2's NormHead, re-sharding, the verification). The tables
and verification helpers (pandas, matplotlib, transformers) stay in their own modules, imported on use.
"""

from __future__ import annotations

from kit.convert.checks import ConversionError
from kit.convert.config import ConvertConfig
from kit.convert.convert import convert, hf_to_megatron, megatron_to_hf, megatron_to_megatron
from kit.convert.families import FAMILIES
from kit.convert.manifests import architecture_flags
from kit.convert.result import ConversionResult, run
from kit.convert.sources import model_facts

__all__ = [
    "FAMILIES",
    "ConversionError",
    "ConversionResult",
    "ConvertConfig",
    "architecture_flags",
    "convert",
    "hf_to_megatron",
    "megatron_to_hf",
    "megatron_to_megatron",
    "model_facts",
    "run",
]
