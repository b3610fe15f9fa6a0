"""Tokenizer loading and ordered, memory-bounded batch tokenization over worker processes."""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

_STATE: Dict[str, Any] = {}


def load_tokenizer(path: Optional[str] = None, trust_remote_code: bool = False) -> Any:
    """A local HF tokenizer (the sample tokenizer when `path` is None), with a pad id (EOS if it has none)."""
    from transformers import AutoTokenizer

    from kit.samples import sample_tokenizer_dir

    folder = Path(path).expanduser() if path else sample_tokenizer_dir()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"tokenizer folder {folder} does not exist; give a local HF tokenizer or model "
            f"folder (with tokenizer.json or tokenizer.model)."
        )
    has_code = any(folder.glob("tokenization_*.py"))
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as exc:
        hint = (
            " This folder ships its own tokenizer code: if you trust it, set trust_remote_code=True "
            "(TRUST_REMOTE_CODE in the notebook, --trust-remote-code on the command line)."
            if has_code and not trust_remote_code
            else ""
        )
        raise ValueError(f"cannot load a tokenizer from {folder}: {exc}.{hint}") from exc
    if tok.eos_token_id is None:
        raise ValueError(
            f"tokenizer {folder} has no EOS token; documents and dialogs need one as an end marker. "
            f"Set eos_token in its tokenizer_config.json."
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # usual choice; padding is masked out of loss and attention anyway
    tok.kit_path = str(folder)
    return tok


def encode_texts(tok: Any, texts: List[str]) -> List[List[int]]:
    """Token ids of each text without added special tokens; the Rust batch path when there is one."""
    backend = getattr(tok, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def init_worker(
    tokenizer_path: Optional[str], trust_remote_code: bool, settings: dict, tok: Any = None
) -> None:
    """Load the tokenizer into this process (or adopt `tok`, already loaded from that path) for `worker_state()`."""
    _STATE["settings"] = settings
    if tok is None and _STATE.get("key") == (tokenizer_path, trust_remote_code):
        return
    _STATE["tok"] = tok if tok is not None else load_tokenizer(tokenizer_path, trust_remote_code)
    _STATE["key"] = (tokenizer_path, trust_remote_code)


def worker_state() -> Dict[str, Any]:
    """The tokenizer and settings of this process (set by `init_worker`)."""
    return _STATE


def _pool_init(tokenizer_path, trust_remote_code, settings) -> None:
    # one tokenizer thread per process: the processes are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    init_worker(tokenizer_path, trust_remote_code, settings)


def ordered_map(
    fn: Callable, chunks: Iterable, num_workers: int, initargs: tuple, tok: Any = None
) -> Iterator:
    """`fn` over `chunks`, results in order; with several workers at most 2 chunks per worker are in flight."""
    if num_workers <= 1:
        # in this process: the fast tokenizers measured here hold the GIL, so a helper thread would gain nothing
        init_worker(*initargs, tok=tok)
        for chunk in chunks:
            yield fn(chunk)
        return
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    ctx = mp.get_context(method)
    with ctx.Pool(num_workers, initializer=_pool_init, initargs=initargs) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(fn, (chunk,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of up to `size` consecutive items."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
