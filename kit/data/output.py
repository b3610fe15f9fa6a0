"""Old home of the data stage's output helpers; they live in `kit.data.prepared` (manifest, columns, loader) and
`kit.data.hf_rows` (the Arrow writer) now. Kept so that imports written before the move keep working."""

from __future__ import annotations

from kit.data.hf_rows import DATA_FILE, ArrowSink
from kit.data.prepared import COLUMNS, MODEL_INPUTS, load_prepared, megatron_names, read_meta

FIXED_COLUMNS = MODEL_INPUTS  # the old name of kit.data.prepared.MODEL_INPUTS

__all__ = [
    "COLUMNS",
    "DATA_FILE",
    "FIXED_COLUMNS",
    "MODEL_INPUTS",
    "ArrowSink",
    "load_prepared",
    "megatron_names",
    "read_meta",
]
