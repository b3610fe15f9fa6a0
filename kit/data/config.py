"""The data-preparation config: one dataclass, every problem listed at once by `problems()`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from kit.core.i18n import t

KINDS = ("pretrain", "sft", "dpo")
DEFAULT_NAMES = {"pretrain": "corpus", "sft": "alpaca", "dpo": "pairs"}  # the output name when `name` is None
INPUT_FORMATS = ("auto", "text", "alpaca", "sharegpt", "openai", "trl", "hh")
PAIR_INPUT_FORMATS = ("auto", "trl", "alpaca", "sharegpt", "hh")  # kit.data.pairs
OVERLONG = ("truncate", "drop")
ON_ERROR = ("raise", "skip")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class DataConfig:
    """What to read, how to tokenize and template it, and where to write it."""

    kind: str = "sft"
    """'pretrain' (plain text, packed to max_length, loss on all tokens), 'sft' (dialogs, loss on answers) or 'dpo'
    (preference pairs: a prompt, a chosen and a rejected answer)."""
    inputs: List[str] = field(default_factory=list)
    """Files or folders to read (.jsonl .json .parquet .csv .txt); default: the shipped sample for `kind`."""
    name: Optional[str] = None
    """Output name: `<name>_hf/`, `<name>_text_document` / `<name>_packed_*_document`; None: corpus / alpaca."""
    tokenizer: Optional[str] = None
    """A local HF tokenizer folder (or a model folder holding one); None: the sample tokenizer."""
    trust_remote_code: bool = False
    """Allow a tokenizer folder's own Python code (ChatGLM / Baichuan folders need it); off unless you trust it."""
    max_length: int = 2048
    """Tokens per sample (the training SEQ_LEN)."""
    out_dir: Optional[str] = None
    """Output folder; None: the workspace's data/pretrain or data/finetune."""
    input_format: str = "auto"
    """'text' (pretrain), 'alpaca', 'sharegpt', 'openai' (messages); for dpo 'trl', 'alpaca', 'sharegpt' (LLaMA-Factory
    ranking) or 'hh' (whole dialogs); 'auto': detected per record."""
    columns: Dict[str, str] = field(default_factory=dict)
    """Field mapping kit name -> your column, e.g. {'text': 'content'} or {'output': 'response'}."""
    template: str = "tokenizer"
    """Chat template for sft: "tokenizer" (the tokenizer's own chat_template, what an instruct model was tuned
    with), or a kit template: qwen3 qwen2_5 qwen chatml llama3 llama2 mistral glm4_5 glm4 chatglm3 deepseek3_1
    deepseek3 intern2 baichuan2 telechat2 telechat alpaca (`python -m kit data templates`; docs/data.md)."""
    enable_thinking: bool = True
    """Reasoning templates (qwen3, glm4_5, deepseek3_1): True learns each answer's think block (its reasoning, or
    the empty block) as thinking mode generates it; False ends the prompt as the model's non-thinking prompt does
    (Qwen3, GLM-4.5: the empty block; DeepSeek-V3.1: `</think>`) and leaves reasoning in the data out (counted)."""
    system: Optional[str] = None
    """System prompt used when a dialog has none (None: the template's default, if any)."""
    train_on_prompt: bool = False
    """Also learn prompt, system and role tokens (padding is never learned)."""
    mask_history: bool = False
    """Learn only the last answer of each dialog (earlier answers become context)."""
    overlong: str = "truncate"
    """Dialogs longer than max_length (dpo: prompt + an answer): 'truncate' (cut the tail, counted) or 'drop'
    (counted). A pair whose prompt alone fills max_length is always dropped."""
    pack: bool = True
    """Pack several whole dialogs per sample (sft); False: one dialog per sample, padded."""
    pack_window: int = 20000
    """Dialogs packed together at a time (bounds memory; larger packs slightly tighter)."""
    add_bos: bool = False
    """Pretrain: put the tokenizer's BOS token before each document (EOS is always appended)."""
    keep_special_tokens: bool = False
    """Pretrain: special-token strings in the text ('<|endoftext|>') become control tokens; False: plain text."""
    on_error: str = "raise"
    """Malformed records: 'raise' (stop with file and line) or 'skip' (count them in the report)."""
    max_record_bytes: int = 16 * 1024 * 1024
    """Largest record, in bytes (a .jsonl/.txt/.csv line, a .json array item, a parquet row's text); a larger one is
    an error with its position or, with on_error='skip', a counted drop, and is never tokenized (tokenizing
    takes ~170x the record's size: 16 MiB needs ~3 GiB). Lines of .jsonl/.txt/.csv are not even read whole."""
    num_workers: int = 1
    """Tokenizer processes; 1 tokenizes in this process with the tokenizer's own threads."""
    batch_size: int = 1000
    """Records per tokenization batch."""
    max_records: Optional[int] = None
    """Read at most this many records (None: all); for quick trials."""
    megatron: bool = True
    """Also write the Megatron / MindSpeed-LLM .bin/.idx files."""
    heldout_records: int = 0
    """Records held out of training for evaluation (notebook 06), written to `<name>_heldout_hf/`; 0: none."""
    heldout_every: int = 10
    """Hold out every k-th usable record, in input order, until heldout_records are held out."""
    overwrite: bool = False
    """Replace existing outputs of the same name."""
    clean_partial: bool = False
    """Delete leftovers of killed runs (.NAME_hf.partial-*, NAME.bin.partial-PID) in the output folder (else only
    reported)."""

    @property
    def output_name(self) -> str:
        """`name`, or the kind's default name."""
        return self.name or DEFAULT_NAMES.get(self.kind, "data")

    def problems(self) -> List[str]:
        """Every problem with this config, each saying what to change."""
        from kit.data.templates import TEMPLATES

        out = []
        if self.kind not in KINDS:
            out.append(f"kind={self.kind!r}: use one of {KINDS}.")
        if self.name is not None and not _NAME.match(self.name):
            out.append(f"name={self.name!r}: use a plain file name of letters, digits, '.', '_' or '-'.")
        if not isinstance(self.max_length, int) or self.max_length < 8:
            out.append(f"max_length={self.max_length!r}: use an integer of at least 8 (e.g. 2048, 4096).")
        if self.input_format not in INPUT_FORMATS:
            out.append(f"input_format={self.input_format!r}: use one of {INPUT_FORMATS}.")
        elif self.kind == "dpo" and self.input_format not in PAIR_INPUT_FORMATS:
            out.append(
                f"input_format={self.input_format!r} holds no preference pairs; use one of {PAIR_INPUT_FORMATS}."
            )
        elif self.kind != "dpo" and self.input_format in ("trl", "hh"):
            out.append(f"input_format={self.input_format!r} is a preference-pair format; use kind='dpo'.")
        elif self.kind == "sft" and self.input_format == "text":
            out.append(
                "input_format='text' holds no dialogs; use kind='pretrain' or an alpaca/sharegpt/openai file."
            )
        if self.template not in TEMPLATES and self.template != "tokenizer":
            out.append(
                t("template.problem", template=self.template, choices=sorted(TEMPLATES) + ["tokenizer"])
            )
        if self.overlong not in OVERLONG:
            out.append(f"overlong={self.overlong!r}: use one of {OVERLONG}.")
        if self.on_error not in ON_ERROR:
            out.append(f"on_error={self.on_error!r}: use one of {ON_ERROR}.")
        if not isinstance(self.enable_thinking, bool):
            out.append(f"enable_thinking={self.enable_thinking!r}: use True or False.")
        if self.train_on_prompt and self.mask_history:
            out.append("train_on_prompt and mask_history exclude each other; set one of them to False.")
        for attr, low in (
            ("num_workers", 1),
            ("batch_size", 1),
            ("pack_window", 1),
            ("heldout_records", 0),
            ("heldout_every", 1),
            ("max_record_bytes", 1024),
        ):
            v = getattr(self, attr)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                out.append(f"{attr}={v!r}: use an integer >= {low}.")
        if self.max_records is not None and (not isinstance(self.max_records, int) or self.max_records < 1):
            out.append(f"max_records={self.max_records!r}: use None or a positive integer.")
        if not isinstance(self.columns, dict) or not all(isinstance(v, str) for v in self.columns.values()):
            out.append(f"columns={self.columns!r}: use a dict like {{'text': 'content'}}.")
        else:
            from kit.data.dialogs import DEFAULT_COLUMNS
            from kit.data.pairs import PAIR_COLUMNS

            table = PAIR_COLUMNS if self.kind == "dpo" else DEFAULT_COLUMNS
            fmts = (
                [self.input_format]
                if self.input_format in table
                else (["text"] if self.kind == "pretrain" else [f for f in table if f != "text"])
            )
            known = sorted({k for f in fmts for k in table[f]})
            unknown = sorted(set(self.columns) - set(known))
            if unknown:
                out.append(
                    f"columns keys {unknown} are not kit fields here; keys are kit names ({known}) and "
                    f"values your column names, e.g. {{'{known[0]}': '<your column>'}}."
                )
        for p in self.inputs:
            if not Path(p).expanduser().exists():
                out.append(
                    f"input {str(p)!r} does not exist; check the path (files or folders are accepted)."
                )
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            out.append(
                f"tokenizer={self.tokenizer!r} is not a folder; give a local HF tokenizer or model folder."
            )
        return out
