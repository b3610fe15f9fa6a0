"""Scores computed by the kit itself: held-out loss / perplexity and multiple-choice log-likelihood accuracy.

Multiple choice follows lm-eval 0.4's `multiple_choice` recipe exactly, so the numbers can be compared with it:
each choice is the continuation `target_delimiter + choice` of the prompt; trailing spaces of the prompt move into
the continuation; prompt + continuation are encoded together and split at the prompt's length (lm-eval
`TemplateLM._encode_pair`); a choice's score is the summed log-probability of its tokens; `acc` takes the best
score, `acc_norm` the best score per character of the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

IGNORE = -100  # label of a token the loss skips (prompt, padding), as in training and HF's loss


@dataclass
class HeldoutScore:
    """Summed token loss over the held-out rows, the number of tokens it covers, and what follows from them."""

    loss_sum: float
    tokens: int
    rows: int
    segments: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.tokens else float("nan")


def segments_of(row: Dict[str, Any]) -> List[Tuple[int, int]]:
    """(start, end) of each dialog in a prepared row: packed SFT rows by `seq_lens`, else the unpadded row."""
    if row.get("seq_lens"):
        out, at = [], 0
        for n in row["seq_lens"]:
            out.append((at, at + int(n)))
            at += int(n)
        return out
    mask = row.get("attention_mask")
    end = int(sum(mask)) if mask is not None else len(row["input_ids"])
    return [(0, end)] if end else []


def heldout_loss(model, rows, device=None, batch_tokens: int = 4096) -> HeldoutScore:
    """Token-mean cross-entropy of `model` over prepared rows, with the training's loss mask.

    Labels of -100 are skipped and each label is predicted from the tokens before it (HF's shifted loss, the
    one the trainer optimizes). Packed rows are split into their dialogs, each evaluated on its own: in training
    kit attention keeps packed dialogs apart (varlen), and a separate forward pass is the same computation.
    """
    import torch

    device = device or next(model.parameters()).device
    pieces: List[Tuple[List[int], List[int]]] = []
    nrows = 0
    for row in rows:
        nrows += 1
        for a, b in segments_of(row):
            pieces.append((list(row["input_ids"][a:b]), list(row["labels"][a:b])))
    pieces.sort(key=lambda p: -len(p[0]))  # similar lengths together: little padding
    total, count = 0.0, 0
    i = 0
    with torch.no_grad():
        while i < len(pieces):
            width = len(pieces[i][0])
            n = max(1, batch_tokens // max(width, 1))
            chunk = pieces[i : i + n]
            i += n
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            labels = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (x, y) in enumerate(chunk):
                ids[r, : len(x)] = torch.tensor(x)
                labels[r, : len(y)] = torch.tensor(y)
                mask[r, : len(x)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            shift_logits, shift_labels = logits[:, :-1], labels[:, 1:].to(logits.device)
            loss = torch.nn.functional.cross_entropy(
                shift_logits.reshape(-1, shift_logits.shape[-1]),
                shift_labels.reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            )
            total += float(loss)
            count += int((shift_labels != IGNORE).sum())
    return HeldoutScore(loss_sum=total, tokens=count, rows=nrows, segments=len(pieces))


def _encode(tokenizer, text: str) -> List[int]:
    # lm-eval HFLM.tok_encode: the tokenizer's default special tokens, none when the text already starts with BOS
    bos = tokenizer.bos_token
    if bos and text.startswith(bos):
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def encode_pair(tokenizer, context: str, continuation: str) -> Tuple[List[int], List[int]]:
    """(context ids, continuation ids) split the way lm-eval splits them."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = _encode(tokenizer, context + continuation)
    ctx = _encode(tokenizer, context)
    return ctx, whole[len(ctx) :]


def choice_logliks(
    model, tokenizer, context: str, choices: Sequence[str], delimiter: str = " "
) -> List[float]:
    """Summed log-probability of each `delimiter + choice` after `context`.

    When every choice is one token after the same context tokens (" A" .. " D" in C-Eval / MMLU prompts), one
    forward pass over the context gives all the scores, as lm-eval's one-token-continuation cache does; otherwise
    the choices go through one padded forward pass together.
    """
    import torch

    device = next(model.parameters()).device
    max_len = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    seqs, conts = [], []
    for choice in choices:
        ctx, cont = encode_pair(tokenizer, context, delimiter + choice)
        if not ctx:  # an empty context: lm-eval conditions on the prefix token (EOS/BOS)
            ctx = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id]
        full = (ctx + cont)[-(max_len + 1) :][:-1]
        seqs.append(full)
        conts.append(cont)
    if all(len(c) == 1 for c in conts) and all(s == seqs[0] for s in seqs):
        with torch.no_grad():
            ids = torch.tensor([seqs[0]], device=device)
            logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)
        return [float(logp[c[0]]) for c in conts]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    with torch.no_grad():
        logp = torch.log_softmax(
            model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(), dim=-1
        )
    out = []
    for r, (s, cont) in enumerate(zip(seqs, conts)):
        # the last len(cont) positions of the input predict the continuation's tokens
        pos = torch.arange(len(s) - len(cont), len(s), device=logp.device)
        target = torch.tensor(cont, device=logp.device)
        out.append(float(logp[r, pos, target].sum()))
    return out


def score_task(model, tokenizer, task, progress: bool = False) -> Dict[str, Any]:
    """acc / acc_norm of one checked MCTask, with each question's scores (for the per-question table)."""
    from tqdm.auto import tqdm

    details = []
    hits = hits_norm = 0
    for q in tqdm(task.questions, desc=task.name, disable=not progress, leave=False):
        lls = choice_logliks(model, tokenizer, q.context, q.choices, task.target_delimiter)
        pred = max(range(len(lls)), key=lambda i: lls[i])
        norm = [ll / len(c) for ll, c in zip(lls, q.choices)]
        pred_norm = max(range(len(norm)), key=lambda i: norm[i])
        hits += pred == q.gold
        hits_norm += pred_norm == q.gold
        details.append({"line": q.line, "gold": q.gold, "pred": pred, "logliks": lls})
    n = len(task.questions)
    return {"acc": hits / n, "acc_norm": hits_norm / n, "n": n, "details": details}
