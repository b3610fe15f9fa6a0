"""Human-readable views of prepared samples: which text the loss learns, dialog by dialog."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from kit.data.packing import IGNORE


def explain_sample(path: Union[str, Path], index: int = 0, tokenizer: Any = None) -> Any:
    """A table of sample `index` of a prepared folder: one row per packed dialog, prompt and learned text apart; for
    preference pairs one row each for the shared prompt (read, no loss), the chosen and the rejected answer."""
    import pandas as pd

    from kit.data.prepared import load_prepared
    from kit.data.tokenizing import load_tokenizer

    ds, meta = load_prepared(path, return_meta=True)
    if not 0 <= index < len(ds):
        raise IndexError(f"sample {index} does not exist; the dataset has {len(ds)} samples.")
    tok = tokenizer or load_tokenizer(meta["tokenizer"])
    row = ds[index]
    if meta.kind == "dpo":
        return _pair_table(row, tok, meta.max_length)
    lens = row["seq_lens"] if "seq_lens" in row else [meta["max_length"]]
    rows, at = [], 0
    for n, m in enumerate(lens):
        ids, labels = row["input_ids"][at : at + m], row["labels"][at : at + m]
        learned = [t for t, lab in zip(ids, labels) if lab != IGNORE]
        context = [t for t, lab in zip(ids, labels) if lab == IGNORE]
        rows.append(
            {
                "dialog": n,
                "tokens": m,
                "learned_tokens": len(learned),
                "context (no loss)": tok.decode(context),
                "learned (loss)": tok.decode(learned),
            }
        )
        at += m
    pad = meta["max_length"] - at
    rows.append(
        {
            "dialog": "padding",
            "tokens": pad,
            "learned_tokens": 0,
            "context (no loss)": "",
            "learned (loss)": "",
        }
    )
    return pd.DataFrame(rows).set_index("dialog")


def _pair_table(row: dict, tok: Any, max_length: int) -> Any:
    """One preference pair: the prompt both answers share (context), then each answer (what the loss compares)."""
    import pandas as pd

    prompt = len(row["prompt_ids"])
    rows = [
        {
            "part": part,
            "tokens": len(row[col]),
            "learned_tokens": 0 if part == "prompt" else len(row[col]),
            "sequence": "-"
            if part == "prompt"
            else f"prompt + {part}: {prompt + len(row[col])} of {max_length}",
            "text": tok.decode(row[col]),
        }
        for part, col in (("prompt", "prompt_ids"), ("chosen", "chosen_ids"), ("rejected", "rejected_ids"))
    ]
    return pd.DataFrame(rows).set_index("part")
