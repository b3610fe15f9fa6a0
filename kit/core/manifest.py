"""Stage outputs describe themselves: one `kit_manifest.json` per output folder, written by the stage that made it.

A manifest says what a folder is (its kind), the settings and shapes the next stage needs (sequence length,
tokenizer, TP/PP, ...), and which other stage outputs it consumed (their folder and the SHA-256 of their
manifest), so a chain of notebooks can be followed back from any output. The next stage reads it with
`read_manifest(folder, expect=KIND)`: a folder without a manifest, or one of another kind, is a one-line error
that names the stage which makes the expected kind.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from kit.core.i18n import t
from kit.errors import InputError, IntegrityError, MissingInputError
from kit.storage.atomic import MANIFEST_NAME
from kit.storage.hashes import sha256_file

SCHEMA_VERSION = 1
PathLike = Union[str, "os.PathLike[str]"]

PREPARED_DATA = "prepared-data"
CONVERTED_CHECKPOINT = "converted-checkpoint"
HF_MODEL = "hf-model"
TRAINING_RUN = "training-run"
PROFILE_CAPTURE = "profile-capture"
EVALUATION = "evaluation"
LOAD_TEST = "load-test"
SERVING_PACKAGE = "serving-package"

# kind -> (which stage makes it, the fields its manifest must hold)
KINDS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    PREPARED_DATA: (
        "notebook 02 / `python -m kit data pretrain|sft`",
        (
            "data_kind",  # pretrain | sft
            "max_length",
            "tokenizer",  # folder path
            "tokenizer_sha256",  # tokenizer_sha256(folder)
            "template",  # chat template name (sft) or None
            "pack",  # packed samples (sft) or one dialog per sample
            "eos_token_id",
            "pad_token_id",
            "vocab_size",
            "hf_path",  # the HF datasets folder (the manifest's own folder)
            "megatron_prefix",  # exactly what Megatron/MindSpeed's --data-path takes, or None
            "megatron_flags",  # flags the Megatron files need, e.g. ["--reset-attention-mask", "--neat-pack"]
            "heldout",  # {"path": <HF folder>, "records": N, "rule": "..."} held out from training, or None
            "counts",  # records read / written / dropped / truncated, tokens
        ),
    ),
    CONVERTED_CHECKPOINT: (
        "notebook 03 / `python -m kit convert`",
        (
            "direction",
            "family",
            "flavor",
            "tp",
            "pp",
            "num_layer_list",
            "padded_vocab_size",
            "dtype",
            "model",  # model facts from the family map: layers, hidden, heads, kv groups, ffn, vocab
            "source",  # the folder converted
            "tokenizer",  # the tokenizer folder kept beside the shards (hf_meta/)
        ),
    ),
    HF_MODEL: (
        "notebook 03 (Megatron -> HF) or notebook 04 (the exported model) / `python -m kit convert|train`",
        ("family", "source"),
    ),
    TRAINING_RUN: (
        "notebook 04 / `python -m kit train run`",
        (
            "run_type",
            "config",  # the resolved TrainConfig as JSON
            "sources",  # field -> where its value came from (explicit / environment KEY / manifest PATH / default)
            "data",  # prepared-data folder trained on
            "model",  # model folder started from
            "checkpoints",  # checkpoint folders written
            "hf",  # exported plain HF folder (hf-model manifest inside) or None
            "metrics",  # metrics.jsonl
            "log",  # the Megatron-style log file
        ),
    ),
    PROFILE_CAPTURE: (
        "notebook 05 / `python -m kit profile`",
        ("device", "options", "training_run"),  # training_run: the training-run folder profiled, or None
    ),
    EVALUATION: (
        "notebook 06 / `python -m kit evaluate`",
        (
            "model",  # HF folder evaluated
            "base_model",  # HF folder compared with, or None
            "data",  # prepared-data folder whose held-out split was scored, or None
            "heldout",  # the split scored ({"path", "records", "rule"}) or None
            "tasks",  # [{"name", "yaml", "data", "data_sha256"}] multiple-choice tasks
            "device",  # {"kind", "device", "name", "dtype"}
            "results",  # results.json (beside it: results.csv, speed.png)
        ),
    ),
    LOAD_TEST: (
        "notebook 07 / `python -m kit serve bench`",
        ("engine", "url", "model", "points", "results"),  # results: results.json (vLLM's keys), results.csv
    ),
    SERVING_PACKAGE: (
        "notebook 07 / `python -m kit serve package`",
        ("engine", "base_image", "port", "model", "model_bytes"),  # model: the HF folder copied into model/
    ),
}


@dataclass(frozen=True)
class Consumed:
    """Another stage's output that this one read: its kind, folder and the SHA-256 of its manifest."""

    kind: str
    path: str
    manifest_sha256: str


@dataclass
class Manifest:
    """A stage output's manifest: its kind, the kind's fields, the outputs it consumed, when and by what."""

    kind: str
    folder: Path
    fields: Dict[str, Any]
    inputs: List[Consumed] = field(default_factory=list)
    created: str = ""
    kit_version: str = ""
    git_commit: Optional[str] = None
    sha256: str = ""

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def as_input(self) -> Consumed:
        """How a later stage records that it consumed this output."""
        return Consumed(self.kind, str(self.folder), self.sha256)

    def consumed(self, kind: str) -> List[Consumed]:
        """The inputs of one kind this output was made from."""
        return [c for c in self.inputs if c.kind == kind]


def made_by(kind: str) -> str:
    """Which notebook / command makes outputs of this kind."""
    return KINDS[kind][0] if kind in KINDS else "no kit stage"


# the files that define a tokenizer (HF fast / slow / sentencepiece); weights and configs of a model are not hashed
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def tokenizer_sha256(folder: PathLike) -> str:
    """One hash over a tokenizer folder's defining files (name + bytes), so a changed tokenizer is noticed."""
    h = hashlib.sha256()
    folder = Path(folder)
    found = False
    for name in _TOKENIZER_FILES:
        p = folder / name
        if p.is_file():
            found = True
            h.update(name.encode() + b"\0" + sha256_file(p).encode() + b"\n")
    if not found:
        raise MissingInputError(
            f"{str(folder)!r} holds no tokenizer files (tokenizer.json, tokenizer.model, ...)"
        )
    return h.hexdigest()


def _git_commit() -> Optional[str]:
    head = Path(__file__).resolve().parents[2] / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (head.parent / ref[5:]).read_text().strip()
        return ref
    except OSError:
        return None


def render_manifest(kind: str, fields: Dict[str, Any], inputs: Iterable[Consumed] = ()) -> str:
    """The text of a manifest (what write_manifest writes): lets a stage know its SHA-256 before writing it."""
    from kit import __version__
    from kit.core.configs import to_jsonable

    if kind not in KINDS:
        raise ValueError(f"unknown manifest kind {kind!r}; known: {sorted(KINDS)}")
    missing = [k for k in KINDS[kind][1] if k not in fields]
    assert not missing, f"a {kind} manifest needs {missing}"  # a bug in the stage that writes it
    record = {
        "schema": SCHEMA_VERSION,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),  # ISO 8601, UTC
        "kit_version": __version__,
        "git_commit": _git_commit(),
        "inputs": [to_jsonable(c.__dict__) for c in inputs],
        "fields": to_jsonable(fields),
    }
    return json.dumps(record, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def write_manifest(
    folder: PathLike,
    kind: str,
    fields: Dict[str, Any],
    inputs: Iterable[Consumed] = (),
    text: Optional[str] = None,
) -> Manifest:
    """Write `folder/kit_manifest.json` atomically (call it last, inside the stage's temporary folder); `text`: what
    render_manifest() made for it earlier."""
    from kit.errors import writing
    from kit.storage.atomic import atomic_write_text

    path = Path(folder) / MANIFEST_NAME
    with writing(path):
        atomic_write_text(path, render_manifest(kind, fields, inputs) if text is None else text)
    return read_manifest(folder, expect=kind)


def find_manifest(folder: PathLike) -> Optional[Path]:
    """The manifest file of a folder, or None."""
    path = Path(folder) / MANIFEST_NAME
    return path if path.is_file() else None


def _wanted(kinds: Sequence[str]) -> str:
    """What a refusal says was expected (made only when refusing: it reads the language setting)."""
    made = [t("manifest.want_kind", kind=k, by=made_by(k)) for k in kinds]
    return t("manifest.or").join(made) or t("manifest.want_any")


def read_manifest(folder: PathLike, expect: Union[None, str, Sequence[str]] = None) -> Manifest:
    """Read a stage output's manifest; check its kind against `expect` (one kind or several)."""
    folder = Path(folder)
    wanted = (expect,) if isinstance(expect, str) else tuple(expect or ())
    if not folder.exists():
        raise MissingInputError(t("manifest.absent", folder=str(folder), want=_wanted(wanted)))
    if not folder.is_dir():
        raise InputError(t("manifest.is_file", folder=str(folder), want=_wanted(wanted)))
    path = find_manifest(folder)
    if path is None:
        raise InputError(t("manifest.none", folder=str(folder), manifest=MANIFEST_NAME, want=_wanted(wanted)))
    raw = path.read_bytes()
    try:
        record = json.loads(raw.decode("utf-8"))
        kind = record["kind"]
        fields = dict(record["fields"])
        inputs = [Consumed(**c) for c in record.get("inputs", [])]
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(
            f"{path} is damaged ({type(exc).__name__}: {exc}); remake the folder with the stage that made it."
        ) from exc
    if wanted and kind not in wanted:
        raise InputError(
            t("manifest.wrong_kind", folder=str(folder), kind=kind, by=made_by(kind), want=_wanted(wanted))
        )
    missing = [k for k in KINDS.get(kind, ("", ()))[1] if k not in fields]
    if missing:
        raise IntegrityError(f"{path} lacks {missing}; remake the folder with {made_by(kind)}.")
    return Manifest(
        kind=kind,
        folder=folder.resolve(),
        fields=fields,
        inputs=inputs,
        created=record.get("created", ""),
        kit_version=record.get("kit_version", ""),
        git_commit=record.get("git_commit"),
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def find_manifests(root: PathLike) -> List[Manifest]:
    """Every readable stage manifest under `root` (temporary `.partial` folders skipped), oldest first."""
    found = []
    for path in Path(root).rglob(MANIFEST_NAME):
        if any(part.startswith(".") for part in path.relative_to(root).parts[:-1]):
            continue  # a temporary or hidden folder: not a finished output
        try:
            found.append(read_manifest(path.parent))
        except (InputError, IntegrityError):
            continue
    return sorted(found, key=lambda m: (m.created, str(m.folder)))


def handover_lines(root: PathLike) -> List[str]:
    """One line per stage output under `root`: its kind and folder, and the outputs it consumed."""
    root = Path(root).resolve()

    def short(path: Union[str, Path]) -> str:
        p = Path(path)
        try:
            return str(p.resolve().relative_to(root))
        except ValueError:
            return str(p)

    lines = []
    for m in find_manifests(root):
        used = ", ".join(f"{c.kind} {short(c.path)} ({c.manifest_sha256[:8]})" for c in m.inputs) or "-"
        lines.append(f"{m.kind:<21} {short(m.folder)}  <- {used}")
    return lines
