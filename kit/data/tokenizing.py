"""Tokenizer loading and ordered, memory-bounded batch tokenization over worker processes."""

from __future__ import annotations

import collections
import itertools
import multiprocessing as mp
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

from kit.data.readers import DataPathError
from kit.errors import InputError

_STATE: Dict[str, Any] = {}


def _from_folder(folder: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):
        # transformers < 4.4x needs a `tokenizer_class` or a model config.json to pick the class; a bare
        # tokenizer.json (what `tokenizers` saves) is a fast tokenizer whatever the model
        if not (folder / "tokenizer.json").is_file() or any(folder.glob("tokenization_*.py")):
            raise
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))


def load_tokenizer(path: Optional[str] = None, trust_remote_code: bool = False) -> Any:
    """A local HF tokenizer (the sample tokenizer when `path` is None), with a pad id (EOS if it has none)."""
    from kit.core.samples import sample_tokenizer_dir

    folder = Path(path).expanduser() if path else sample_tokenizer_dir()
    if not folder.is_dir():
        raise DataPathError(
            f"tokenizer folder {folder} does not exist; give a local HF tokenizer or model "
            f"folder (with tokenizer.json or tokenizer.model)."
        )
    has_code = any(folder.glob("tokenization_*.py"))
    try:
        tok = _from_folder(folder, trust_remote_code)
    except Exception as exc:
        hint = (
            " This folder ships its own tokenizer code: if you trust it, set trust_remote_code=True "
            "(TRUST_REMOTE_CODE in the notebook, --trust-remote-code on the command line)."
            if has_code and not trust_remote_code
            else ""
        )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot load a tokenizer from {folder}: {first}.{hint}") from exc
    if tok.eos_token_id is None:
        raise InputError(
            f"tokenizer {folder} has no EOS token; documents and dialogs need one as an end marker. "
            f"Set eos_token in its tokenizer_config.json."
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # usual choice; padding is masked out of loss and attention anyway
    tok.kit_path = str(folder)
    return tok


def encode_texts(tok: Any, texts: List[str], specials_as_text: bool = False) -> List[List[int]]:
    """Token ids of each text without added special tokens; the Rust batch path when there is one.

    `specials_as_text`: a literal special-token string in the text ('<|endoftext|>') is tokenized like any
    other text instead of becoming that control token (tokenizers' `encode_special_tokens`, transformers'
    `split_special_tokens`)."""
    backend = getattr(tok, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        if not specials_as_text:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        if not hasattr(backend, "encode_special_tokens"):
            raise InputError(
                "this `tokenizers` version cannot tokenize special-token strings as plain text; upgrade it "
                "(pip install 'tokenizers>=0.15') or set keep_special_tokens=True."
            )
        before = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        finally:
            backend.encode_special_tokens = before
    return tok(texts, add_special_tokens=False, split_special_tokens=specials_as_text)["input_ids"]


def special_strings(tok: Any) -> List[str]:
    """The strings a tokenizer turns into special tokens when they appear in text (longest first)."""
    decoder = getattr(tok, "added_tokens_decoder", None) or {}
    found = {t.content for t in decoder.values() if getattr(t, "special", False)}
    found.update(getattr(tok, "all_special_tokens", []) or [])
    return sorted((s for s in found if s), key=lambda s: (-len(s), s))


def special_string_counter(tok: Any) -> Callable[[List[str]], Dict[str, int]]:
    """A function counting the special-token strings in a batch of texts (leftmost-longest matches)."""
    strings = special_strings(tok)
    if not strings:
        return lambda texts: {}
    by_first: Dict[str, List[str]] = {}
    for s in strings:  # longest first within each group too
        by_first.setdefault(s[0], []).append(s)
    patterns: Dict[tuple, Any] = {}

    def count(texts: List[str]) -> Dict[str, int]:
        # NUL joins the batch: no special-token string contains it, so no match spans two texts
        joined = "\x00".join(texts)
        # Only the strings whose first character occurs at all can match: one C scan per first character
        # (most text has no '<' or '['), then one regex pass over what is left; dropping alternatives that
        # cannot match leaves the leftmost-longest matches of the others as they were.
        present = tuple(s for c, group in by_first.items() if c in joined for s in group)
        if not present:
            return {}
        if len(present) == 1:
            n = joined.count(present[0])
            return {present[0]: n} if n else {}
        pattern = patterns.get(present)
        if pattern is None:
            pattern = patterns[present] = re.compile("|".join(re.escape(s) for s in present))
        return dict(collections.Counter(pattern.findall(joined)))

    return count


def init_worker(
    tokenizer_path: Optional[str], trust_remote_code: bool, settings: dict, tok: Any = None
) -> None:
    """Load the tokenizer into this process (or adopt `tok`, already loaded from that path) for `worker_state()`."""
    _STATE["settings"] = settings
    if tok is None and _STATE.get("key") == (tokenizer_path, trust_remote_code):
        return
    _STATE["tok"] = tok if tok is not None else load_tokenizer(tokenizer_path, trust_remote_code)
    _STATE["key"] = (tokenizer_path, trust_remote_code)
    _STATE["count_specials"] = special_string_counter(_STATE["tok"])


def worker_state() -> Dict[str, Any]:
    """The tokenizer and settings of this process (set by `init_worker`)."""
    return _STATE


def _pool_init(tokenizer_path, trust_remote_code, settings) -> None:
    # one tokenizer thread per process: the processes are the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # a forked worker must not inherit the parent's SIGTERM-as-Ctrl-C (kit.storage.partial): Pool.terminate() ends it so
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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
    if method == "fork" and tok is not None:
        init_worker(
            *initargs, tok=tok
        )  # forked workers inherit the loaded tokenizer instead of loading it again
    # the workers must run single-threaded; set before the fork so `tokenizers` does not warn about it
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(num_workers, initializer=_pool_init, initargs=initargs)
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    with pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(fn, (chunk,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of up to `size` consecutive items (itertools.batched of Python 3.12, as lists)."""
    it = iter(items)
    return iter(lambda: list(itertools.islice(it, size)), [])
