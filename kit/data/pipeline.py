"""`prepare(config, workspace)`: read, tokenize, pack and write one dataset atomically, with its report and its
`prepared-data` manifest (kit.data.prepared)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from kit.core.configs import check, save_config
from kit.core.manifest import (
    MANIFEST_NAME,
    PREPARED_DATA,
    Manifest,
    read_manifest,
    tokenizer_sha256,
    write_manifest,
)
from kit.data.accounting import COUNT_KEYS, PrepReport, plot_lengths
from kit.data.check import megatron_record
from kit.data.config import DataConfig
from kit.data.dialogs import PARSERS, column_map, detect_format, document_text
from kit.data.heldout import HeldoutPicker, rule_text
from kit.data.hf_rows import ArrowSink
from kit.data.indexed import IndexedWriter, token_dtype
from kit.data.prepared import (
    COLUMNS,
    HELDOUT_COLUMNS,
    IGNORE_INDEX,
    PreparedData,
    heldout_dir,
    megatron_flags,
    megatron_names,
)
from kit.data.readers import DataInputError, TextBlock, iter_records
from kit.data.tokenizing import batched, load_tokenizer, ordered_map
from kit.errors import InputError, MissingInputError, writing
from kit.storage.atomic import atomic_dir, atomic_write_text, refuse_existing
from kit.storage.locks import hold

CHUNK_CHARS = 1 << 18  # characters of text per worker task (~0.1 s of tokenizing): small tail, tiny IPC cost


@dataclass
class PrepResult:
    """What `prepare` made: the prepared folder (read back through its manifest), the Megatron files, the counts."""

    prepared: PreparedData
    report: PrepReport
    histogram_png: Optional[Path] = None
    config: Optional[DataConfig] = field(repr=False, default=None)

    @property
    def hf_dir(self) -> Path:
        """The `<name>_hf` folder (as written, not symlink-resolved)."""
        return Path(self.prepared.manifest["hf_path"])

    @property
    def megatron_prefix(self) -> Optional[str]:
        return self.prepared.megatron_prefix

    @property
    def megatron_files(self) -> List[Path]:
        return [Path(p) for p in self.prepared.megatron_files]

    @property
    def manifest(self) -> Manifest:
        return self.prepared.manifest

    @property
    def meta(self) -> Dict[str, Any]:
        """The manifest's fields (max_length, tokenizer, pad/EOS ids, num_samples, ...)."""
        return dict(self.prepared.manifest.fields)

    def plot_lengths(self) -> Path:
        """The length histogram `<name>_hf/lengths.png` (made by prepare(plot=True), else plotted now); its path."""
        if self.histogram_png is None or not Path(self.histogram_png).is_file():
            png = self.hf_dir / "lengths.png"
            with writing(png):
                self.histogram_png = plot_lengths(self.report, png)
        return self.histogram_png

    def summary(self) -> dict:
        """Key numbers and paths: what was written (folder, manifest hash, Megatron prefix and flags, held-out
        split) and what was counted."""
        r = self.report.as_dict()
        p = self.prepared
        return {
            "data_kind": p.kind,
            "hf_dir": str(self.hf_dir),
            "manifest": str(self.hf_dir / MANIFEST_NAME),
            "manifest_sha256": p.manifest.sha256,
            "max_length": p.max_length,
            "tokenizer": p.tokenizer,
            "tokenizer_sha256": p.tokenizer_sha256,
            "template": p.template,
            "pack": p.pack,
            "inputs": list(self.config.inputs) if self.config else [],
            "megatron_prefix": self.megatron_prefix,
            "megatron_flags": p.megatron_flags,
            "megatron_files": [str(f) for f in self.megatron_files],
            "heldout": p.heldout,
            "histogram_png": str(self.histogram_png) if self.histogram_png else None,
            **{k: r[k] for k in COUNT_KEYS},
            "warnings": list(self.report.warnings),
        }


def summarize(*results: PrepResult) -> Dict[str, Any]:
    """Notebook 02's summary: the settings the results share, each result's `summary()` under its kind, and every
    warning in one list."""
    out: Dict[str, Any] = {}
    for key in ("max_length", "tokenizer"):
        values = {getattr(r.prepared, key) for r in results}
        if len(values) == 1:
            out[key] = values.pop()
    out.update({f"{r.prepared.kind}_hf": str(r.hf_dir) for r in results})
    out.update({r.prepared.kind: r.summary() for r in results})
    out["warnings"] = [w for r in results for w in r.report.warnings]
    return out


def default_inputs(kind: str) -> List[str]:
    """The shipped sample for `kind`."""
    from kit.core.samples import dpo_pairs, pretrain_corpus, sft_alpaca

    return [str({"pretrain": pretrain_corpus, "dpo": dpo_pairs}.get(kind, sft_alpaca)())]


def output_dir(cfg: DataConfig, workspace: Any = None) -> Path:
    """cfg.out_dir, else the workspace's data/pretrain or data/finetune folder."""
    if cfg.out_dir:
        return Path(cfg.out_dir).expanduser()
    if workspace is None:
        from kit.core.workspace import get_workspace

        workspace = get_workspace()
    return workspace.data_pretrain if cfg.kind == "pretrain" else workspace.data_finetune


def _records(cfg: DataConfig, report: PrepReport, text_column: Optional[str] = None) -> Iterator[Any]:
    """The inputs' records (and, with `text_column`, parquet `TextBlock`s) up to max_records; records that
    cannot be parsed are raised or, with on_error='skip', counted."""

    def on_bad(err: DataInputError, whole_file: bool = False) -> None:
        if whole_file:
            report.skip_file(err.reason, str(err))
        else:
            report.records_read += 1  # a record was read, but it cannot be used
            report.drop(err.reason, str(err))

    # parquet: pretraining reads only the text column; dialogs read every column (a partial `columns` mapping
    # names only the renamed ones)
    parquet_cols = [text_column] if text_column else None
    skip = None if cfg.on_error == "raise" else on_bad
    for rec in iter_records(cfg.inputs, parquet_cols, skip, text_column, cfg.max_record_bytes):
        if cfg.max_records is not None and report.records_read >= cfg.max_records:
            break
        yield rec


def _documents(cfg: DataConfig, report: PrepReport) -> Iterator[List[str]]:
    """Usable pretraining texts in pieces: a parquet batch at a time (no per-record objects), else one by one."""
    cols = column_map("text", cfg.columns)
    for rec in _records(cfg, report, cols["text"]):
        if isinstance(rec, TextBlock):
            texts = rec.texts
            if cfg.max_records is not None:
                texts = texts[: cfg.max_records - report.records_read]
            report.records_read += len(texts)
            usable = [t for t in texts if t and not t.isspace()]  # isspace: no copy of large documents
            if len(usable) < len(texts):
                report.drop("empty_text", count=len(texts) - len(usable))
            if usable:
                yield usable
            continue
        report.records_read += 1
        try:
            text = document_text(rec, cols)
        except DataInputError as err:
            if cfg.on_error == "raise":
                raise
            report.drop(err.reason, str(err))
            continue
        if not text or text.isspace():
            report.drop("empty_text")
            continue
        yield [text]


def _dialogs(cfg: DataConfig, report: PrepReport) -> Iterator[tuple]:
    """(Dialog, where) per usable record."""
    fixed: Optional[str] = None if cfg.input_format == "auto" else cfg.input_format
    col_maps: Dict[str, Dict[str, str]] = {}
    for rec in _records(cfg, report):
        report.records_read += 1
        try:
            # per record: merged dialog files mix ShareGPT and OpenAI-messages records
            fmt = fixed or detect_format(rec, cfg.kind, cfg.columns)
            cols = col_maps.get(fmt) or col_maps.setdefault(fmt, column_map(fmt, cfg.columns))
            dialog = PARSERS[fmt](rec, cols)
        except DataInputError as err:
            if cfg.on_error == "raise":
                raise
            report.drop(err.reason, str(err))
            continue
        if any(not a or a.isspace() for _, a in dialog.turns):
            report.drop("empty_answer", f"{rec.where}: an answer is empty (dropped)")
            continue
        if _leaves_out_reasoning(cfg, dialog):
            report.reasoning_left_out += 1
        report.count_format(fmt)
        yield dialog, rec.where


def _pairs(cfg: DataConfig, report: PrepReport) -> Iterator[tuple]:
    """(Pair, where) per usable preference record (kit.data.pairs); unusable pairs are counted."""
    from kit.data.pairs import PAIR_COLUMNS, detect_pair_format, parse_pair, why_unusable

    fixed: Optional[str] = None if cfg.input_format == "auto" else cfg.input_format
    for rec in _records(cfg, report):
        report.records_read += 1
        try:
            fmt = fixed or detect_pair_format(rec, cfg.columns)
            cols = {**PAIR_COLUMNS[fmt], **{k: v for k, v in cfg.columns.items() if k in PAIR_COLUMNS[fmt]}}
            pair = parse_pair(rec, fmt, cols)
        except DataInputError as err:
            if cfg.on_error == "raise":
                raise
            report.drop(err.reason, str(err))
            continue
        reason = why_unusable(pair)
        if reason:
            report.drop(reason, f"{rec.where}: {reason.replace('_', ' ')} (dropped)")
            continue
        report.count_format(fmt)
        yield pair, rec.where


def _leaves_out_reasoning(cfg: DataConfig, dialog: Any) -> bool:
    """Whether the configured template drops reasoning this dialog carries: a reasoning template with
    enable_thinking=False drops it (field or `<think>` in the text), another kit template drops the reasoning field
    (`<think>` in the text stays text); the tokenizer's own template gets the field and decides itself."""
    from kit.data.templates import TEMPLATES

    if cfg.template == "tokenizer":
        return False
    if TEMPLATES[cfg.template].think:
        return not cfg.enable_thinking and dialog.has_reasoning
    return any(r for r in dialog.reasoning)


def prompt_type(cfg: DataConfig) -> Optional[str]:
    """MindSpeed-LLM's `--prompt-type` for the data's template (None: pretraining, the tokenizer's own template, or
    a format MindSpeed-LLM has no template for)."""
    from kit.data.templates import TEMPLATES

    if cfg.kind == "pretrain" or cfg.template not in TEMPLATES:
        return None
    return TEMPLATES[cfg.template].prompt_type


def _text_chunks(pieces: Iterator[List[str]], max_records: int, max_chars: float) -> Iterator[List[str]]:
    """Lists of up to `max_records` texts and about `max_chars` characters (the output does not depend on it)."""
    chunk: List[str] = []
    chars = 0
    for piece in pieces:
        for text in piece:
            chunk.append(text)
            chars += len(text)
            if len(chunk) >= max_records or chars >= max_chars:
                yield chunk
                chunk, chars = [], 0
    if chunk:
        yield chunk


def _inputs_named(cfg: DataConfig) -> str:
    return cfg.inputs[0] + (f" and {len(cfg.inputs) - 1} more" if len(cfg.inputs) > 1 else "")


def _nothing_usable(cfg: DataConfig, report: PrepReport) -> DataInputError:
    """The error for a run in which no record could be used (nothing is written then)."""
    rep = report.as_dict()
    why = ", ".join(f"{k} {v}" for k, v in {**rep["dropped"], **rep["files_skipped"]}.items()) or "none"
    # the first problem's position and what is wrong (its own fix would suggest skipping, which led here)
    first = f"; first problem: {report.problems[0].split('. Fix: ')[0]}" if report.problems else ""
    return DataInputError(
        _inputs_named(cfg),
        0,
        f"no usable record ({report.records_read} read, dropped or skipped: {why}){first}",
        "repair the inputs (the first problem is shown) or point inputs at other files; nothing was written",
        "nothing_usable",
        skippable=False,
    )


def prepare(cfg: DataConfig, workspace: Any = None, progress: bool = True, plot: bool = False) -> PrepResult:
    """Prepare `cfg.kind` data: the `<name>_hf` folder (rows, config.json, report.json, with `plot` the length
    histogram lengths.png, and its `prepared-data` manifest written last), the held-out split `<name>_heldout_hf` if
    asked for, and the Megatron files. Leftovers of killed runs in the output folder are reported in the report's
    warnings (removed with cfg.clean_partial)."""
    cfg = replace(cfg, inputs=list(cfg.inputs) or default_inputs(cfg.kind), name=cfg.output_name)
    check(cfg, "DataConfig")
    out = Path(os.path.abspath(output_dir(cfg, workspace)))
    # one writer per name, from before any work to the last rename (kit/storage/locks.py)
    with hold(out / f"{cfg.output_name}_hf", "prepared data"):
        return _prepare(cfg, out, progress, plot)


def _prepare(cfg: DataConfig, out: Path, progress: bool, plot: bool) -> PrepResult:
    """prepare() with the output's lock held."""
    from kit.data.templates import TEMPLATES, missing_special_tokens

    name = cfg.output_name
    tok = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
    vocab_size = len(tok)
    hf_dir = out / f"{name}_hf"
    held_dir = heldout_dir(out, name)
    mg_prefix, mg_prefixes = megatron_names(cfg.kind, out, name)
    megatron = cfg.megatron
    mg_files = [Path(p + ext) for p in mg_prefixes for ext in (".bin", ".idx")] if megatron else []
    for p in [hf_dir, *mg_files, *([held_dir] if cfg.heldout_records else [])]:
        refuse_existing(p, cfg.overwrite, "prepared data")
    out.mkdir(parents=True, exist_ok=True)

    report = PrepReport(cfg.kind, cfg.max_length)
    report.warnings.extend(_leftovers(out, name, cfg.clean_partial))
    if cfg.kind != "pretrain" and cfg.template != "tokenizer":
        missing = missing_special_tokens(TEMPLATES[cfg.template], tok)
        if missing:
            report.warnings.append(
                f"template {cfg.template!r}: {missing} are not single tokens of this tokenizer "
                f"(the model sees them spelled out); pick the model's own template "
                f"(template='tokenizer' or its family) unless that is intended"
            )
    if cfg.kind != "pretrain" and cfg.template == "tokenizer" and not getattr(tok, "chat_template", None):
        raise InputError(
            f"template='tokenizer' but {tok.kit_path} has no chat_template; choose one of "
            f"{sorted(TEMPLATES)}."
        )
    from kit.data.pairs import PairPicker

    picker_class = PairPicker if cfg.kind == "dpo" else HeldoutPicker
    picker = (
        picker_class(cfg.heldout_records, cfg.heldout_every, cfg.max_length) if cfg.heldout_records else None
    )
    suffix = f".partial-{os.getpid()}"
    writers: List[IndexedWriter] = []
    heldout: Optional[Dict[str, Any]] = None

    def companions() -> None:
        # the rest of the unit, once the old `<name>_hf` (and its manifest) is aside and before the new one is
        # renamed in: a manifest at the final name is never beside another run's files
        for w in writers:
            w.commit()
        if heldout:
            with atomic_dir(held_dir, overwrite=cfg.overwrite, what="held-out data") as held_tmp:
                picker.write(held_tmp, tok.pad_token_id)
        elif cfg.overwrite and held_dir.is_dir():
            # the split of an earlier run under this name; the new manifest names none, so nothing may use it
            shutil.rmtree(held_dir)

    try:
        # a write error without a file name (a full disk inside a library's writer) names the output folder
        unit = atomic_dir(hf_dir, overwrite=cfg.overwrite, what="prepared data", before_rename=companions)
        with writing(hf_dir), unit as tmp:
            if megatron:
                # fine-tuning and pairs: int32 (labels hold -100), as MindSpeed-LLM's preprocess_data.py writes them
                dtypes = (
                    [token_dtype(vocab_size)] if cfg.kind == "pretrain" else [np.int32] * len(mg_prefixes)
                )
                writers = [IndexedWriter(p, d, suffix) for p, d in zip(mg_prefixes, dtypes)]
            if cfg.kind == "dpo":
                from kit.data.hf_rows import RaggedSink

                sink = RaggedSink(tmp, cfg.kind)
            else:
                sink = ArrowSink(tmp, cfg.kind, cfg.max_length)
            _stream(cfg, tok, sink, writers, report, progress, picker)
            if report.records_written == 0:
                raise _nothing_usable(cfg, report)
            if report.samples == 0:  # records, but too few tokens for one row: a dataset of nothing
                raise DataInputError(
                    _inputs_named(cfg),
                    0,
                    f"no sample: {report.tokens_in} tokens in {report.records_written} records are not enough for "
                    f"one sample of max_length={cfg.max_length}",
                    "lower max_length or add text; nothing was written",
                    "no_sample",
                    skippable=False,
                )
            for w in writers:
                w.finalize()
            heldout = _heldout_fields(cfg, picker, held_dir, report)
            rep = report.as_dict()
            fields = _manifest_fields(
                cfg,
                tok,
                report,
                hf_dir,
                (mg_prefix, [str(f) for f in mg_files], str(writers[0].dtype)) if writers else None,
                heldout,
            )
            fields["megatron_checks"] = megatron_record(writers)  # sizes, hashes, counts for `data check`
            sink.finalize({"manifest": fields, "report": rep})
            save_config(cfg, tmp)
            atomic_write_text(tmp / "report.json", json.dumps(rep, indent=2, ensure_ascii=False) + "\n")
            if plot:  # before the manifest: a plot that cannot be written fails the run, never follows a complete one
                with writing(hf_dir / "lengths.png"):
                    plot_lengths(report, tmp / "lengths.png")
            write_manifest(tmp, PREPARED_DATA, fields)  # last: a folder with a manifest is complete
    except BaseException:
        for w in writers:
            w.abort()
        raise
    prepared = PreparedData(read_manifest(hf_dir, expect=PREPARED_DATA))
    result = PrepResult(prepared, report, config=cfg)
    if plot:
        result.histogram_png = hf_dir / "lengths.png"
    return result


def _leftovers(out: Path, name: str, clean: bool) -> List[str]:
    """Lines about what killed runs of `name` left in the output folder (removed when `clean`). Only this name's:
    the folder is shared by every dataset of the kind, and another name's run may be writing there right now."""
    from kit.storage.partial import describe, find_partials, remove_partials

    found = [x for x in find_partials(out) if os.path.basename(x["path"]).lstrip(".").startswith(f"{name}_")]
    report = {"found": found, "removed": remove_partials(found) if clean else []}
    lines = [f"removed leftover partial output {p}" for p in report["removed"]]
    line = describe(report)
    return lines + ([line] if line else [])


def _heldout_fields(
    cfg: DataConfig, picker: Optional[HeldoutPicker], folder: Path, report: PrepReport
) -> Optional[Dict[str, Any]]:
    """The manifest's `heldout` entry (None when nothing is held out); a short split is a warning."""
    if picker is None:
        return None
    stats = picker.stats()
    if stats["records"] < cfg.heldout_records:
        report.warnings.append(
            f"heldout_records={cfg.heldout_records} but only {stats['records']} of the usable records could be "
            f"held out (every {cfg.heldout_every}th); lower heldout_every or add data"
        )
    if not stats["records"]:
        return None
    return {
        "path": str(folder),
        "rule": rule_text(cfg.kind, cfg.heldout_records, cfg.heldout_every),
        "layout": "one pair per row, unpadded, as the training rows"
        if cfg.kind == "dpo"
        else "one record per row, padded to max_length; seq_lens = [its length]; never packed with training rows",
        "columns": list(COLUMNS["dpo"] if cfg.kind == "dpo" else HELDOUT_COLUMNS),
        **stats,
    }


def _manifest_fields(
    cfg: DataConfig,
    tok: Any,
    report: PrepReport,
    hf_dir: Path,
    megatron: Optional[tuple],
    heldout: Optional[Dict[str, Any]],
) -> Dict[str, Any]:
    """The `prepared-data` manifest: what training and evaluation need without the config (kit.core.manifest.KINDS)."""
    rep = report.as_dict()
    tok_dir = os.path.abspath(tok.kit_path)
    try:
        tok_hash: Optional[str] = tokenizer_sha256(tok_dir)
    except MissingInputError:  # a tokenizer made only by its own code: nothing to hash
        tok_hash = None
    prefix, files, dtype = megatron if megatron else (None, [], None)
    return {
        "data_kind": cfg.kind,
        "max_length": cfg.max_length,
        "tokenizer": tok_dir,
        "tokenizer_sha256": tok_hash,
        "template": cfg.template if cfg.kind != "pretrain" else None,
        "prompt_type": prompt_type(cfg),  # MindSpeed-LLM's name for the template (its --prompt-type), or None
        "enable_thinking": cfg.enable_thinking if cfg.kind != "pretrain" else None,
        # pretraining rows are always packed (documents back to back); fine-tuning rows as cfg.pack says; preference
        # pairs are stored one per row, unpadded (the trainer lays them out)
        "pack": {"pretrain": True, "dpo": False}.get(cfg.kind, bool(cfg.pack)),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "vocab_size": len(tok),
        "hf_path": str(hf_dir),
        "columns": list(COLUMNS[cfg.kind]),
        "ignore_index": IGNORE_INDEX,
        "labels_shifted": False,  # labels = input_ids at the same position; the model shifts them
        "num_samples": report.samples,
        "num_tokens": report.tokens_out,
        "megatron_prefix": prefix,
        "megatron_files": files,
        "megatron_flags": megatron_flags(cfg.kind, cfg.pack, prompt_type(cfg)) if prefix else [],
        "megatron_dtype": dtype,
        "heldout": heldout,
        "counts": {k: rep[k] for k in COUNT_KEYS},
        "inputs": [os.path.abspath(p) for p in cfg.inputs],
        "config": "config.json",
        "report": "report.json",
    }


def _stream(
    cfg: DataConfig,
    tok: Any,
    sink: ArrowSink,
    writers: List[IndexedWriter],
    report: PrepReport,
    progress: bool,
    heldout: Optional[HeldoutPicker] = None,
) -> None:
    """Read, tokenize (in order, over cfg.num_workers) and hand every batch to the kind's assembler."""
    from kit.data.pretrain import PretrainAssembler, pretrain_job
    from kit.data.sft import SftAssembler, sft_job
    from kit.system.progress import bar as progress_bar

    settings = {
        "add_bos": cfg.add_bos,
        "keep_special_tokens": cfg.keep_special_tokens,
        "template": cfg.template,
        "enable_thinking": cfg.enable_thinking,
        "system": cfg.system,
        "train_on_prompt": cfg.train_on_prompt,
        "mask_history": cfg.mask_history,
    }
    initargs = (cfg.tokenizer, cfg.trust_remote_code, settings)
    with progress_bar(desc=f"{cfg.kind} {cfg.output_name}", unit=" records", disable=not progress) as bar:
        if cfg.kind == "dpo":
            from kit.data.pairs import PairAssembler, pair_job

            pair_wheres: List[List[str]] = []

            def pair_payloads():
                for chunk in batched(_pairs(cfg, report), cfg.batch_size):
                    pair_wheres.append([w for _, w in chunk])
                    yield [item for item, _ in chunk]

            asm = PairAssembler(sink, report, cfg.overlong, heldout, writers or None)
            for result in ordered_map(pair_job, pair_payloads(), cfg.num_workers, initargs, tok):
                asm.add(result, pair_wheres.pop(0))
                bar.update(len(result))
        elif cfg.kind == "pretrain":
            # several workers: chunks of ~CHUNK_CHARS keep them evenly busy to the end (the last chunk is
            # the only one a worker can wait for); one process: batches of batch_size for the tokenizer's threads
            max_chars = CHUNK_CHARS if cfg.num_workers > 1 else float("inf")
            chunks = _text_chunks(_documents(cfg, report), cfg.batch_size, max_chars)
            asm = PretrainAssembler(
                sink, writers[0] if writers else None, report, cfg.keep_special_tokens, heldout
            )
            for result in ordered_map(pretrain_job, chunks, cfg.num_workers, initargs, tok):
                asm.add(result)
                bar.update(int(result[1].size))
        else:
            wheres: List[List[str]] = []

            def payloads():
                for chunk in batched(_dialogs(cfg, report), cfg.batch_size):
                    wheres.append([w for _, w in chunk])
                    yield [item for item, _ in chunk]

            asm = SftAssembler(
                sink,
                writers or None,
                report,
                tok.pad_token_id,
                cfg.overlong,
                cfg.pack,
                cfg.pack_window,
                heldout,
            )
            for result in ordered_map(sft_job, payloads(), cfg.num_workers, initargs, tok):
                asm.add(result, wheres.pop(0))
                bar.update(len(result))
    asm.finish()
