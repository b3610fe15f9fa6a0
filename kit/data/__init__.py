"""Data preparation: pretraining and fine-tuning data, packed and loss-masked, in HF and Megatron formats.

The names below are imported on first use (PEP 562 module `__getattr__`), so `python -m kit data --help` and
`import kit.data.cli` load neither numpy-heavy modules nor pandas, datasets, transformers or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kit.system.lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "TEMPLATES": "kit.data.templates",
    "Template": "kit.data.templates",
    "DataConfig": "kit.data.config",
    "DataInputError": "kit.data.readers",
    "DataPathError": "kit.data.readers",
    "IndexedReader": "kit.data.indexed",
    "IndexedWriter": "kit.data.indexed",
    "MODEL_INPUTS": "kit.data.prepared",
    "PreparedData": "kit.data.prepared",
    "read_prepared": "kit.data.prepared",
    "summarize": "kit.data.pipeline",
    "PrepReport": "kit.data.accounting",
    "PrepResult": "kit.data.pipeline",
    "explain_sample": "kit.data.explain",
    "load_prepared": "kit.data.prepared",
    "prepare": "kit.data.pipeline",
    "read_meta": "kit.data.prepared",
}

__all__ = [
    "MODEL_INPUTS",
    "TEMPLATES",
    "DataConfig",
    "DataInputError",
    "DataPathError",
    "IndexedReader",
    "IndexedWriter",
    "PrepReport",
    "PrepResult",
    "PreparedData",
    "Template",
    "explain_sample",
    "load_prepared",
    "prepare",
    "read_meta",
    "read_prepared",
    "summarize",
]

if TYPE_CHECKING:  # for type checkers and IDEs only
    from kit.data.accounting import PrepReport
    from kit.data.config import DataConfig
    from kit.data.explain import explain_sample
    from kit.data.indexed import IndexedReader, IndexedWriter
    from kit.data.pipeline import PrepResult, prepare, summarize
    from kit.data.prepared import MODEL_INPUTS, PreparedData, load_prepared, read_meta, read_prepared
    from kit.data.readers import DataInputError, DataPathError
    from kit.data.templates import TEMPLATES, Template


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
