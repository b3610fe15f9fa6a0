"""Notebook 02's output as later stages read it: the `prepared-data` manifest, the model-input columns, the Megatron
data names and flags, and `read_prepared` / `load_prepared` (one typed loader, through the manifest).

A prepared folder `<name>_hf/` holds the HF `datasets` rows, `config.json` (the DataConfig), `report.json` (the
accounting) and, written last, `kit_manifest.json` of kind `prepared-data`. Training (notebook 04) and evaluation
(notebook 06) read only the manifest and the rows; a folder without a manifest, or with another stage's manifest,
is a one-line error naming notebook 02.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from kit.core.manifest import MANIFEST_NAME, PREPARED_DATA, Manifest, find_manifest, read_manifest
from kit.errors import InputError, IntegrityError

PathLike = Union[str, Path]

# The columns a model's forward pass takes, in the order the data stage writes them. kit.train imports this
# tuple; it is declared nowhere else.
MODEL_INPUTS: Tuple[str, ...] = ("input_ids", "labels", "attention_mask", "position_ids")
# The columns of each kind's rows: fine-tuning rows also list the lengths of the dialogs packed into them, so the
# attention can stay inside each dialog (varlen / TND).
COLUMNS: Dict[str, Tuple[str, ...]] = {
    "pretrain": MODEL_INPUTS,
    "sft": MODEL_INPUTS + ("seq_lens",),
    # preference pairs: one pair per row, each column as long as its tokens; the prompt is stored once and shared
    # by both answers, and only the answers are learned (kit.data.pairs)
    "dpo": ("prompt_ids", "chosen_ids", "rejected_ids"),
}
# Held-out rows hold one record each, with its length, whatever the kind.
HELDOUT_COLUMNS: Tuple[str, ...] = MODEL_INPUTS + ("seq_lens",)
_CHECK_ROWS = 4096  # rows whose ids are checked at a time (a few MB of temporaries at any max_length)
IGNORE_INDEX = -100  # the label of a token the loss does not count (the HF / PyTorch cross-entropy default)

# MindSpeed-LLM reads a packed fine-tuning set as `<prefix>_packed_<key>_document.bin/.idx` for these keys
# (its preprocess_data.py output names); the attention_mask file holds segment ids 1..k per dialog, 0 on padding.
SFT_MEGATRON_KEYS = ("input_ids", "attention_mask", "labels")
# What a packed fine-tuning set needs at training time: MindSpeed-LLM's `--neat-pack` turns the segment-id
# attention_mask into per-dialog sequence lengths, and its argument check requires `--reset-attention-mask` with it
# (MindSpeed-LLM, training arguments; docs "multi-sample pack finetune"). The kit's trainer adds
# `--finetune --stage sft --is-instruction-dataset` itself for any fine-tuning run.
PACKED_SFT_FLAGS = ("--reset-attention-mask", "--neat-pack")
# MindSpeed-LLM's pairwise set (DPO): its AlpacaStylePairwiseHandler / SharegptStylePairwiseHandler write one int32
# document per pair for each of these keys, `<prefix>_packed_<key>_document.bin/.idx`, labels -100 on the prompt and
# aligned with the ids (not shifted); its trainer reads them with `--is-pairwise-dataset` (MindSpeed-LLM
# mindspeed_llm/tasks/preprocess/data_handler.py and docs/en/pytorch/tools/data_process_dpo_pairwise.md, commit
# c77308a14bfcb1aa7ca61da9c1aa24a893cb1b91).
PAIR_MEGATRON_KEYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def megatron_names(kind: str, out_dir: PathLike, name: str) -> Tuple[str, List[str]]:
    """(what Megatron / MindSpeed-LLM's `--data-path` takes, the file prefixes written for it).

    Pretraining: the full `<name>_text_document` prefix (Megatron's preprocess_data.py output). Fine-tuning: the bare
    `<name>` prefix; MindSpeed-LLM appends `_packed_<key>_document` itself.
    """
    out_dir = Path(out_dir)
    if kind == "pretrain":
        prefix = str(out_dir / f"{name}_text_document")
        return prefix, [prefix]
    prefix = str(out_dir / name)
    keys = PAIR_MEGATRON_KEYS if kind == "dpo" else SFT_MEGATRON_KEYS
    return prefix, [f"{prefix}_packed_{key}_document" for key in keys]


def megatron_flags(kind: str, pack: bool, prompt_type: Optional[str] = None) -> List[str]:
    """The Megatron / MindSpeed-LLM flags the written files need (beyond `--data-path`): the packing flags, and for
    fine-tuning data MindSpeed-LLM's `--prompt-type` of its chat template (what its instruction dataset reads when
    it cuts an over-long sample, and what its chat / evaluation tools wrap prompts in)."""
    flags = list(PACKED_SFT_FLAGS) if kind == "sft" and pack else []
    if kind in ("sft", "dpo") and prompt_type:
        flags += ["--prompt-type", prompt_type]
    return flags


def heldout_dir(out_dir: PathLike, name: str) -> Path:
    """The held-out split's folder: `<name>_heldout_hf/` beside `<name>_hf/`."""
    return Path(out_dir) / f"{name}_heldout_hf"


# manifest field -> the name meta.json used for it (callers written against meta.json keep working through .get)
_META_NAMES = {"kind": "data_kind", "packed": "pack"}


@dataclass(frozen=True)
class PreparedData:
    """A prepared-data folder as its manifest describes it (see the module doc); `.dataset()` loads the rows."""

    manifest: Manifest

    # -- the manifest's facts, typed -----------------------------------------------------------------------------
    @property
    def folder(self) -> Path:
        return self.manifest.folder

    @property
    def kind(self) -> str:
        """'pretrain' or 'sft'."""
        return self.manifest["data_kind"]

    @property
    def max_length(self) -> int:
        """Tokens per row: the SEQ_LEN the data was made for."""
        return int(self.manifest["max_length"])

    @property
    def tokenizer(self) -> str:
        return self.manifest["tokenizer"]

    @property
    def tokenizer_sha256(self) -> Optional[str]:
        return self.manifest["tokenizer_sha256"]

    @property
    def template(self) -> Optional[str]:
        return self.manifest["template"]

    @property
    def prompt_type(self) -> Optional[str]:
        """MindSpeed-LLM's `--prompt-type` for the data's template (None: none, or data made before it was kept)."""
        return self.manifest.get("prompt_type")

    @property
    def pack(self) -> bool:
        return bool(self.manifest["pack"])

    @property
    def eos_token_id(self) -> int:
        return self.manifest["eos_token_id"]

    @property
    def pad_token_id(self) -> int:
        return self.manifest["pad_token_id"]

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def megatron_prefix(self) -> Optional[str]:
        return self.manifest["megatron_prefix"]

    @property
    def megatron_flags(self) -> List[str]:
        return list(self.manifest["megatron_flags"] or [])

    @property
    def megatron_files(self) -> List[str]:
        return list(self.manifest.get("megatron_files") or [])

    @property
    def heldout(self) -> Optional[Dict[str, Any]]:
        """{"path", "records", "rule", ...} of the held-out split, or None."""
        return self.manifest["heldout"]

    @property
    def counts(self) -> Dict[str, Any]:
        return dict(self.manifest["counts"])

    @property
    def num_samples(self) -> int:
        return int(self.manifest.get("num_samples", self.counts.get("samples", 0)))

    @property
    def columns(self) -> Tuple[str, ...]:
        return COLUMNS[self.kind]

    @property
    def held_columns(self) -> Tuple[str, ...]:
        """The held-out rows' columns: a pair per row for preference data, else one record per padded row."""
        return COLUMNS["dpo"] if self.kind == "dpo" else HELDOUT_COLUMNS

    def get(self, key: str, default: Any = None) -> Any:
        """A manifest field by name (meta.json's `kind` and `packed` answer too)."""
        return self.manifest.get(_META_NAMES.get(key, key), default)

    def __getitem__(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def handover(self) -> Dict[str, Any]:
        """What the next notebooks take from this folder, in their own words (for display)."""
        held = self.heldout
        return {
            "DATASET_PATH (notebook 04)": str(self.folder),
            "SEQ_LEN (inherited by notebook 04)": self.max_length,
            "template": self.template,
            "Megatron --data-path": self.megatron_prefix,
            "Megatron flags": " ".join(self.megatron_flags) or None,
            "held out for notebook 06": f"{held['records']} records in {held['path']}" if held else None,
            "held-out rule": held["rule"] if held else None,
        }

    def as_input(self):
        """How a later stage records that it consumed this folder (kit.core.manifest.Consumed)."""
        return self.manifest.as_input()

    # -- the rows ------------------------------------------------------------------------------------------------
    def dataset(self) -> Any:
        """The rows as a `datasets.Dataset`, checked against the manifest (columns, row count, length, ids)."""
        return _load_checked(self.folder, self.kind, COLUMNS[self.kind], self.num_samples, self)

    def heldout_dataset(self) -> Any:
        """The held-out rows (one record per row, padded; same masks as training), or None without a split."""
        if not self.heldout:
            return None
        return _load_checked(
            Path(self.heldout["path"]), self.kind, self.held_columns, int(self.heldout["rows"]), self
        )


_MISSING = object()


def _folder(path: PathLike) -> Path:
    """`<name>_hf` itself, or the folder a Megatron prefix (`<name>`, `<name>_text_document`) belongs to."""
    p = Path(path).expanduser()
    if find_manifest(p) is not None or p.is_dir():
        return p
    for cand in (Path(str(p) + "_hf"), p.with_name(p.name.replace("_text_document", "_hf"))):
        if find_manifest(cand) is not None:
            return cand
    return p


def read_prepared(path: PathLike) -> PreparedData:
    """The prepared-data folder at `path` (or of the Megatron prefix `path`), read through its manifest."""
    folder = _folder(path)
    if find_manifest(folder) is None and (folder / "meta.json").is_file():
        raise InputError(
            f"{str(folder)!r} was prepared before the kit wrote manifests (meta.json, no {MANIFEST_NAME}); prepare "
            f"it again with notebook 02 / `python -m kit data pretrain|sft`."
        )
    return PreparedData(read_manifest(folder, expect=PREPARED_DATA))


def read_meta(path: PathLike) -> Dict[str, Any]:
    """The prepared-data manifest's fields as a dict (what meta.json held, under the manifest's names)."""
    return dict(read_prepared(path).manifest.fields)


def load_prepared(path: PathLike, return_meta: bool = False) -> Any:
    """Load and check a prepared `<name>_hf` folder: a `datasets.Dataset` (and its PreparedData if return_meta)."""
    prepared = read_prepared(path)
    ds = prepared.dataset()
    return (ds, prepared) if return_meta else ds


def _load_checked(folder: Path, kind: str, columns, rows: int, prepared: PreparedData) -> Any:
    from datasets import load_from_disk

    if kind not in COLUMNS:
        raise IntegrityError(
            f"{prepared.folder / MANIFEST_NAME}: data_kind {kind!r} is not one of {sorted(COLUMNS)}; prepare the "
            f"data again with notebook 02."
        )
    try:
        ds = load_from_disk(str(folder))
    except (FileNotFoundError, ValueError) as exc:
        raise IntegrityError(
            f"{folder}: the rows cannot be loaded ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
            f"prepare the data again with notebook 02."
        ) from None
    problems = []
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        problems.append(f"columns {missing} are missing (has {ds.column_names})")
    if len(ds) != rows:
        problems.append(f"{len(ds)} rows but the manifest says {rows}")
    if len(ds) and not missing:
        check_rows = _pair_row_problems if kind == "dpo" else _row_problems
        problems.extend(check_rows(ds, prepared.max_length, prepared.vocab_size))
    if problems:
        raise IntegrityError(
            f"{folder}: " + "; ".join(problems) + ". The folder is damaged or was changed by hand; "
            "prepare the data again."
        )
    return ds


def _first_bad_row(column: Any, bad: Any) -> Optional[int]:
    """The first row of a list column (a pyarrow ChunkedArray) holding a value for which `bad(values)` is True."""
    import numpy as np

    base = 0
    for whole in column.chunks:
        for start in range(0, len(whole), _CHECK_ROWS):  # bounded temporaries whatever the dataset's size
            chunk = whole.slice(start, _CHECK_ROWS)
            hits = np.flatnonzero(bad(chunk.flatten().to_numpy(zero_copy_only=False)))
            if hits.size:
                offsets = chunk.offsets.to_numpy()
                # flatten() starts at the slice's first offset, not at 0
                return base + start + int(np.searchsorted(offsets, hits[0] + offsets[0], side="right")) - 1
        base += len(whole)
    return None


def _row_problems(ds: Any, length: int, vocab_size: int) -> List[str]:
    """Every row checked at numpy speed: each model-input column `length` long, token ids in 0..vocab_size-1,
    labels such an id or IGNORE_INDEX; each problem names the first row that has it."""
    import numpy as np
    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    out = []
    for col in MODEL_INPUTS:
        lengths = pc.list_value_length(table.column(col)).to_numpy(zero_copy_only=False)
        wrong = np.flatnonzero(lengths != length)
        if wrong.size:
            out.append(f"row {int(wrong[0])} is {int(lengths[wrong[0]])} tokens long in {col}, not {length}")
            return out
    top = vocab_size - 1
    row = _first_bad_row(table.column("input_ids"), lambda v: (v < 0) | (v > top))
    if row is not None:
        out.append(f"row {row} has token ids outside 0..{top} in input_ids")
    row = _first_bad_row(table.column("labels"), lambda v: ((v < 0) & (v != IGNORE_INDEX)) | (v > top))
    if row is not None:
        out.append(f"row {row} has labels outside 0..{top} (and {IGNORE_INDEX})")
    return out


def _pair_row_problems(ds: Any, length: int, vocab_size: int) -> List[str]:
    """Every preference pair checked at numpy speed: a prompt and both answers non-empty, prompt + answer at most
    `length` tokens, token ids in 0..vocab_size-1; each problem names the first row that has it."""
    import numpy as np
    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    n = {c: pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in COLUMNS["dpo"]}
    out = []
    for c, m in n.items():
        empty = np.flatnonzero(m < 1)
        if empty.size:
            out.append(f"row {int(empty[0])} has no tokens in {c}")
    for c in ("chosen_ids", "rejected_ids"):
        over = np.flatnonzero(n["prompt_ids"] + n[c] > length)
        if over.size:
            out.append(f"row {int(over[0])}: prompt_ids + {c} are longer than {length} tokens")
    top = vocab_size - 1
    for c in COLUMNS["dpo"]:
        row = _first_bad_row(table.column(c), lambda v: (v < 0) | (v > top))
        if row is not None:
            out.append(f"row {row} has token ids outside 0..{top} in {c}")
    return out
