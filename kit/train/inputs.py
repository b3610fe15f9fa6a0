"""Notebook 04's inputs: the prepared data (notebook 02's folder, read through its manifest) and the model folder.

With no DATASET_PATH the run trains on what notebook 02 wrote into the workspace (kit.core.inputs.newest: the newest
prepared-data folder of the run's kind made with the model's tokenizer, whatever its length: the length is inherited
from it). Only when there is none is the shipped sample prepared now, and one line says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Tuple, Union

from kit.core.inputs import Found, Input, newest
from kit.core.manifest import CONVERTED_CHECKPOINT, PREPARED_DATA, Manifest
from kit.errors import MissingInputError

PathLike = Union[str, Path]
DATA_KIND_FOR_RUN = {"pretrain": "pretrain", "sft": "sft", "lora": "sft", "dpo": "dpo", "retrain": None}
SAMPLE_MAX_LENGTH = 256  # notebook 02's MAX_LENGTH default, so 04 alone prepares what 02 would have
# notebook 04's inputs, each found in the workspace when its setting is not given (the rest follow their manifests)
DATA = Input("DATASET_PATH", PREPARED_DATA, "of the run's kind made with the model's tokenizer")
CHECKPOINT = Input("MODEL_PATH", CONVERTED_CHECKPOINT, "(ENGINE='megatron': notebook 03's output)")


def _tokenizer_id(folder: PathLike) -> str:
    """The tokenizer's hash (kit.core.manifest.tokenizer_sha256), or its resolved path for folders without files."""
    from kit.core.manifest import tokenizer_sha256

    try:
        return tokenizer_sha256(folder)
    except MissingInputError:
        return str(Path(folder).resolve())


def find_prepared(ws: Any, kind: str, tokenizer: PathLike) -> Optional[Found]:
    """The workspace's newest prepared-data output of this kind made with this tokenizer (kit.core.inputs), or None."""
    want = _tokenizer_id(tokenizer)

    def fits(man: Manifest) -> bool:
        theirs = man.get("tokenizer_sha256") or (man.get("tokenizer") and _tokenizer_id(man["tokenizer"]))
        return man.get("data_kind") == kind and theirs == want

    return newest(
        ws,
        Input(DATA.setting, DATA.kind, f"of kind {kind} made with {Path(tokenizer).name}'s tokenizer"),
        fits,
    )


def default_model() -> Path:
    """The demo model (SmolLM2-135M-Instruct), the model every notebook uses by default."""
    from kit.core.samples import demo_model_dir

    return Path(demo_model_dir())


def default_data(
    ws: Any, kind: str, tokenizer: PathLike, seq_len: Optional[int] = None, max_records: Optional[int] = None
) -> Tuple[Path, str]:
    """(data folder, where it came from): notebook 02's output in the workspace, else the sample prepared now."""
    found = find_prepared(ws, kind, tokenizer)
    if found is not None:
        return found.folder, f"workspace {found.folder}: {found.why}"
    from kit.data import DataConfig, prepare

    length = int(seq_len or SAMPLE_MAX_LENGTH)
    name = f"{kind}_sample_{Path(tokenizer).name}_{length}".replace(".", "_")
    print(
        f"no prepared {kind} data for this tokenizer in {ws.model_input} (notebook 02 makes it): preparing the "
        f"shipped sample now as {name}_hf, max_length {length}"
    )
    cfg = DataConfig(
        kind=kind,
        name=name,
        tokenizer=str(tokenizer),
        max_length=length,
        template="tokenizer",
        max_records=max_records,
        overwrite=True,
    )
    return Path(prepare(cfg, ws, progress=False).hf_dir), f"prepared now from the shipped {kind} sample"
