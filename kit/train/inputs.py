"""Notebook 04's inputs: the prepared data (notebook 02's folder, read through its manifest) and the model folder.

With no DATASET_PATH the run trains on what notebook 02 wrote into the workspace (the newest prepared-data folder
of the run's kind made with the model's tokenizer, whatever its length: the length is inherited from it). Only
when there is none is the shipped sample prepared now, and one line says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from kit.errors import MissingInputError
from kit.manifest import MANIFEST_NAME, Manifest

PathLike = Union[str, Path]
DATA_KIND_FOR_RUN = {"pretrain": "pretrain", "sft": "sft", "lora": "sft", "retrain": None}
SAMPLE_MAX_LENGTH = 256  # notebook 02's MAX_LENGTH default, so 04 alone prepares what 02 would have


def data_facts(folder: PathLike) -> Tuple[Dict[str, Any], Manifest]:
    """(prepared-data manifest fields, the Manifest) of notebook 02's folder.

    `folder` may also be the Megatron prefix beside it (`<name>_text_document`, `<name>`), as the manual's
    DATASET_PATH names it. A folder without a manifest (including data prepared before kit.data wrote manifests),
    or with another stage's manifest, is a one-line error naming notebook 02.
    """
    from kit.data.prepared import read_prepared  # the data stage's one loader (also takes a Megatron prefix)

    man = read_prepared(folder).manifest
    return dict(man.fields), man


def _tokenizer_id(folder: PathLike) -> str:
    """The tokenizer's hash (kit.manifest.tokenizer_sha256), or its resolved path for folders without files."""
    from kit.manifest import tokenizer_sha256

    try:
        return tokenizer_sha256(folder)
    except MissingInputError:
        return str(Path(folder).resolve())


def _same_tokenizer(facts: Dict[str, Any], tokenizer: PathLike) -> bool:
    want = _tokenizer_id(tokenizer)
    if facts.get("tokenizer_sha256"):
        return facts["tokenizer_sha256"] == want
    return bool(facts.get("tokenizer")) and _tokenizer_id(facts["tokenizer"]) == want


def find_prepared(ws: Any, kind: str, tokenizer: PathLike) -> Optional[Path]:
    """The newest prepared-data folder of the workspace of this kind made with this tokenizer, or None."""
    root = Path(ws.data_finetune if kind == "sft" else ws.data_pretrain)
    found = []
    for folder in root.glob("*_hf"):
        if folder.name.startswith(".") or not (folder / MANIFEST_NAME).is_file():
            continue
        try:
            facts, _ = data_facts(folder)
        except (
            Exception
        ):  # a damaged or foreign folder is not a candidate; naming it is the explicit path's job
            continue
        if facts.get("data_kind") == kind and _same_tokenizer(facts, tokenizer):
            found.append(folder)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def find_converted(ws: Any) -> Optional[Path]:
    """The newest converted-checkpoint folder (notebook 03's output) under the workspace's converted_weights/."""
    from kit.manifest import CONVERTED_CHECKPOINT, is_kind

    root = Path(ws.converted_weights)
    found = [
        p.parent
        for depth in ("*", "*/*")
        for p in root.glob(f"{depth}/{MANIFEST_NAME}")
        if not any(part.startswith(".") for part in p.parent.relative_to(root).parts)
        and is_kind(p.parent, CONVERTED_CHECKPOINT)
    ]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def default_model() -> Path:
    """The demo model (SmolLM2-135M-Instruct), the model every notebook uses by default."""
    from kit.samples import demo_model_dir

    return Path(demo_model_dir())


def default_data(
    ws: Any, kind: str, tokenizer: PathLike, seq_len: Optional[int] = None, max_records: Optional[int] = None
) -> Tuple[Path, str]:
    """(data folder, where it came from): notebook 02's output in the workspace, else the sample prepared now."""
    found = find_prepared(ws, kind, tokenizer)
    if found is not None:
        return found, f"workspace {found}"
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


def prepare_inputs(
    ws: Any,
    model_path: Optional[PathLike] = None,
    dataset_path: Optional[PathLike] = None,
    seq_len: Optional[int] = None,
    kind: str = "sft",
    max_records: Optional[int] = None,
) -> Tuple[Path, Path]:
    """(model folder, prepared data folder): given ones are kept; missing ones as `resolve` finds them."""
    model = Path(model_path) if model_path else default_model()
    if not (model / "config.json").is_file():
        raise MissingInputError(
            f"MODEL_PATH={str(model)!r} has no config.json; give an HF model folder (notebook 03's output) or "
            f"None for the demo model."
        )
    if dataset_path:
        return model, Path(dataset_path)
    return model, default_data(ws, kind, model, seq_len, max_records)[0]
