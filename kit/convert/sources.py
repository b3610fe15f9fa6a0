"""What a conversion's source folder is: its model facts (from the family maps), the manifest it carries, its hash.

`model_facts(folder)` is the one way the kit reads a model's shape: an HF folder's config.json goes through its
family's map (so ChatGLM3's `num_layers` / `multi_query_group_num` and Baichuan2's keys are read right), and a
converted checkpoint answers from its manifest. The Megatron command builder of notebook 04 calls it too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from kit.convert.families import family_for_config
from kit.convert.hf_io import INDEX_NAMES, read_json
from kit.convert.megatron_io import HF_META_DIR, META_FILE
from kit.convert.megatron_layout import TRACKER
from kit.core.i18n import t
from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    HF_MODEL,
    TRAINING_RUN,
    Manifest,
    find_manifest,
    made_by,
    read_manifest,
)
from kit.errors import InputError, IntegrityError, KitError, MissingInputError

PathLike = Union[str, Path]

# The manifest kinds a conversion direction accepts from its source folder (a folder without one is accepted too:
# a downloaded HF model, or a Megatron checkpoint another tool wrote).
SOURCE_KINDS = {
    "hf_to_megatron": (HF_MODEL,),
    "megatron_to_hf": (CONVERTED_CHECKPOINT, TRAINING_RUN),
    "megatron_to_megatron": (CONVERTED_CHECKPOINT, TRAINING_RUN),
}


def facts_from_config(
    config: dict, family: Optional[str] = None, where: str = "config.json", folder: Optional[PathLike] = None
) -> Dict[str, Any]:
    """Model facts of an HF config dict, read through its family's map (`family` overrides config model_type);
    `folder` holds the config and its remote code (Baichuan2's modeling file decides its position encoding)."""
    fam = family_for_config(config, family)
    try:
        spec = fam.read_config(config, folder)
    except KitError:  # the map's own one-line refusal (a rope_scaling type, an unreadable modeling file)
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(
            f"{where} lacks or garbles {exc} that the {fam.name} family map reads; is it this family's config?"
        ) from None
    return spec.facts()


def model_facts(folder: PathLike, family: Optional[str] = None) -> Dict[str, Any]:
    """The model facts (layers, hidden, heads, KV groups, FFN, vocab, rotary, ...) of a model folder.

    Works for an HF folder (its config.json through the family map), a converted checkpoint (its manifest's
    `model`), a kit-made Megatron folder without manifest (its hf_meta/config.json) and a training run (its exported
    hf/ model, else the model it started from). Keys: every ModelSpec field plus `num_kv_groups` and
    `num_attention_heads`; `family` is llama | qwen3 | glm | chatglm | baichuan.
    """
    folder = Path(folder)
    if not folder.exists():
        raise MissingInputError(t("model.folder_absent", folder=str(folder)))
    if find_manifest(folder) is not None:
        man = read_manifest(folder)
        if man.kind == CONVERTED_CHECKPOINT:
            return dict(man["model"])
        if man.kind == TRAINING_RUN:
            inner = man.get("hf") or man.get("model")
            if inner:
                return model_facts(inner, family)
        if man.kind not in (HF_MODEL, TRAINING_RUN):
            raise InputError(
                f"{str(folder)!r} is a {man.kind} folder (made by {made_by(man.kind)}); it holds no model. Give an "
                f"HF model folder or a converted checkpoint."
            )
    for cfg_dir in (folder, folder / HF_META_DIR):
        if (cfg_dir / "config.json").is_file():
            return facts_from_config(
                read_json(cfg_dir / "config.json"), family, str(cfg_dir / "config.json"), cfg_dir
            )
    raise MissingInputError(
        f"{str(folder)!r} has no config.json (nor {HF_META_DIR}/config.json) and no converted-checkpoint manifest; "
        f"give an HF model folder or a folder converted by notebook 03."
    )


def _owner_manifest(folder: Path) -> Optional[Path]:
    """The folder whose manifest describes `folder`: itself, or a training run it is a checkpoint folder of."""
    if find_manifest(folder) is not None:
        return folder
    parent = folder.resolve().parent
    if find_manifest(parent) is not None:
        try:
            man = read_manifest(parent)
        except (InputError, IntegrityError):  # the parent's manifest is not this folder's business
            return None
        if man.kind == TRAINING_RUN and str(folder.resolve()) in {
            str(Path(c).resolve()) for c in (man.get("checkpoints") or [])
        }:
            return parent
    return None


def source_manifest(folder: PathLike, direction: str) -> Optional[Manifest]:
    """The manifest the source carries (None: a folder made by another tool); a wrong kind is a one-line error."""
    owner = _owner_manifest(Path(folder))
    if owner is None:
        return None
    try:
        return read_manifest(owner, expect=SOURCE_KINDS[direction])
    except InputError as exc:
        kind = read_manifest(owner).kind
        raise InputError(f"{exc}{_WRONG_KIND_HINTS.get((kind, direction == 'hf_to_megatron'), '')}") from None


# (kind found, wanted an HF source) -> what the user most likely meant
_WRONG_KIND_HINTS = {
    (
        CONVERTED_CHECKPOINT,
        True,
    ): " It is a Megatron checkpoint: use direction 'megatron_to_hf' or 'megatron_to_megatron'.",
    (TRAINING_RUN, True): " Give its exported hf/ folder (the run manifest's `hf` field) instead.",
    (HF_MODEL, False): " It is an HF model: use direction 'hf_to_megatron'.",
}


def _safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (names, dtypes, shapes, offsets): cheap, changes when tensors do."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        return fh.read(min(size, 100 * 1024**2))


def _zip_directory(path: Path) -> bytes:
    """A torch zip file's record names, sizes and CRC32s (its central directory), without reading the data."""
    from kit.convert.torch_zip import RankFileError, ZipIndex

    try:
        index = ZipIndex(path)
    except RankFileError:  # an old-format (non-zip) torch pickle: its size stands in
        return str(path.stat().st_size).encode()
    try:
        return "".join(f"{r.name}:{r.size}:{r.crc}\n" for r in index.records.values()).encode()
    finally:
        index.close()


def fingerprint(folder: PathLike) -> str:
    """SHA-256 over a model folder's config, weight index and shard headers (HF) or tracker, metadata and rank-file
    directories with their CRC32s (Megatron): notices changed weights without reading them."""
    folder = Path(folder)
    h = hashlib.sha256()

    def add(name: str, data: bytes) -> None:
        h.update(name.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")

    for name in ("config.json", *INDEX_NAMES, TRACKER, META_FILE, f"{HF_META_DIR}/config.json"):
        if (folder / name).is_file():
            add(name, (folder / name).read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        add(path.name, _safetensors_header(path))
    for path in sorted(folder.glob("*.bin")):
        add(path.name, _zip_directory(path) if path.stat().st_size else b"")
    for path in sorted(folder.glob("*/mp_rank_*/model_optim_rng.pt")):
        add(os.path.relpath(path, folder), _zip_directory(path))
    return h.hexdigest()


def source_identity(folder: PathLike, manifest: Optional[Manifest]) -> Tuple[str, str]:
    """(hash, how it was taken): the source manifest's SHA-256 when it has one, else `fingerprint(folder)`."""
    if manifest is not None:
        return manifest.sha256, f"sha256 of {manifest.kind} manifest"
    return fingerprint(folder), "sha256 of config, weight index and shard headers (no manifest)"
