"""Data preparation: pretraining and fine-tuning data, packed and loss-masked, in HF and Megatron formats."""

from kit.data.config import DataConfig
from kit.data.explain import explain_sample
from kit.data.indexed import IndexedReader, IndexedWriter
from kit.data.output import load_prepared, read_meta
from kit.data.pipeline import PrepResult, prepare
from kit.data.readers import DataInputError
from kit.data.report import PrepReport
from kit.data.templates import TEMPLATES, Template

__all__ = [
    "TEMPLATES",
    "DataConfig",
    "DataInputError",
    "IndexedReader",
    "IndexedWriter",
    "PrepReport",
    "PrepResult",
    "Template",
    "explain_sample",
    "load_prepared",
    "prepare",
    "read_meta",
]
