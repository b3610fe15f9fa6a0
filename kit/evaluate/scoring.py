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
from typing import Any, Dict, List, Optional, Tuple

IGNORE = -100  # label of a token the loss skips (prompt, padding), as in training and HF's loss
# Tokens per forward pass when the caller gives none. On CPU small batches stay in cache: the held-out loss of the
# demo model (SmolLM2-135M, 32 Alpaca dialogs) took 2.6 s at 512 tokens a batch against 4.5 s at 4096 (2 cores);
# an accelerator keeps its matrix units busy with the larger batch. Same scores either way (tested).
BATCH_TOKENS = {"cpu": 512}
DEFAULT_BATCH_TOKENS = 4096


def batch_tokens_for(device) -> int:
    return BATCH_TOKENS.get(getattr(device, "type", str(device)), DEFAULT_BATCH_TOKENS)


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


def heldout_loss(model, rows, device=None, batch_tokens: Optional[int] = None) -> HeldoutScore:
    """Token-mean cross-entropy of `model` over prepared rows, with the training's loss mask.

    Labels of -100 are skipped and each label is predicted from the tokens before it (HF's shifted loss, the
    one the trainer optimizes). Packed rows are split into their dialogs, each evaluated on its own: in training
    kit attention keeps packed dialogs apart (varlen), and a separate forward pass is the same computation.
    Dialogs of similar length are batched up to `batch_tokens` tokens (by default batch_tokens_for the device);
    where the model's forward takes positions (`logits_to_keep`, transformers >= 4.50) the LM head runs only at
    the positions a target follows in some row of the batch (an SFT prompt's positions predict nothing that
    counts), and the cross-entropy is taken in float32 over the targets alone.
    """
    import torch

    from kit.system.hf_compat import takes_logit_positions

    device = device or next(model.parameters()).device
    batch_tokens = batch_tokens or batch_tokens_for(device)
    pieces: List[Tuple[List[int], List[int]]] = []
    nrows = 0
    for row in rows:
        nrows += 1
        for a, b in segments_of(row):
            pieces.append((list(row["input_ids"][a:b]), list(row["labels"][a:b])))
    pieces.sort(key=lambda p: -len(p[0]))  # similar lengths together: little padding
    select = takes_logit_positions(model)
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
            targets = labels[:, 1:]  # position p predicts the label at p + 1
            scored = targets != IGNORE
            if not bool(scored.any()):
                continue
            inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
            if select:
                keep = scored.any(dim=0).nonzero().squeeze(1)
                logits = model(**inputs, logits_to_keep=keep.to(device)).logits
                targets = targets[:, keep]
            else:
                logits = model(**inputs).logits[:, :-1]
            targets = targets.to(logits.device)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                targets.reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            )
            total += float(loss)
            count += int((targets != IGNORE).sum())
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


def _rows_of(tokenizer, questions, delimiter: str, max_len: int) -> List[Tuple[List[int], list]]:
    """Forward rows, each with its targets (question, choice, position, token): one row for a question whose
    choices are one token each after the same context tokens (all scored at the row's last position, as
    lm-eval's one-token-continuation cache does), else one row per choice."""
    rows = []
    for qi, (context, choices) in enumerate(questions):
        seqs, conts = [], []
        for choice in choices:
            ctx, cont = encode_pair(tokenizer, context, delimiter + choice)
            if not ctx:  # an empty context: lm-eval conditions on the prefix token (EOS/BOS)
                ctx = [
                    tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
                ]
            seqs.append((ctx + cont)[-(max_len + 1) :][:-1])
            conts.append(cont)
        if all(len(c) == 1 for c in conts) and all(s == seqs[0] for s in seqs):
            last = len(seqs[0]) - 1
            rows.append((seqs[0], [(qi, ci, last, c[0]) for ci, c in enumerate(conts)]))
            continue
        for ci, (seq, cont) in enumerate(zip(seqs, conts)):
            # the last len(cont) positions of the input predict the continuation's tokens
            first = len(seq) - len(cont)
            rows.append((seq, [(qi, ci, first + k, t) for k, t in enumerate(cont)]))
    return rows


def task_logliks(
    model,
    tokenizer,
    questions,
    delimiter: str = " ",
    batch_tokens: Optional[int] = None,
    progress: bool = False,
) -> List[List[float]]:
    """Summed log-probability of each `delimiter + choice` after its context, for (context, choices) pairs.

    The forward rows (see _rows_of) are sorted by length and scored in batches of up to `batch_tokens` tokens,
    padded on the right with no attention mask, as lm-eval's loglikelihood batches are: under the causal mask a
    position never sees the padding after it. Log-probabilities are taken in float32 only at the positions that
    score a choice, and where the model's forward takes positions (`logits_to_keep`, transformers >= 4.50) the LM
    head runs only there: a long few-shot prompt needs the head at its last position alone.
    """
    import torch

    from kit.system.hf_compat import takes_logit_positions
    from kit.system.progress import bar as progress_bar

    device = next(model.parameters()).device
    batch_tokens = batch_tokens or batch_tokens_for(device)
    max_len = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    rows = sorted(_rows_of(tokenizer, questions, delimiter, max_len), key=lambda r: -len(r[0]))
    select = takes_logit_positions(model)
    out = [[0.0] * len(choices) for _, choices in questions]
    batches, i = [], 0
    while i < len(rows):
        n = max(1, batch_tokens // max(len(rows[i][0]), 1))
        batches.append(rows[i : i + n])
        i += n
    with torch.no_grad():
        for batch in progress_bar(batches, desc="multiple choice", disable=not progress, leave=False):
            width = len(batch[0][0])
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            for r, (seq, _) in enumerate(batch):
                ids[r, : len(seq)] = torch.tensor(seq)
            targets = [(r, *t) for r, (_, ts) in enumerate(batch) for t in ts]
            if select:
                keep = sorted({t[3] for t in targets})
                where = {p: k for k, p in enumerate(keep)}
                logits = model(
                    input_ids=ids.to(device), logits_to_keep=torch.tensor(keep, device=device)
                ).logits
                at = torch.tensor([[t[0], where[t[3]]] for t in targets], device=logits.device)
            else:
                logits = model(input_ids=ids.to(device)).logits
                at = torch.tensor([[t[0], t[3]] for t in targets], device=logits.device)
            logp = torch.log_softmax(logits[at[:, 0], at[:, 1]].float(), dim=-1)
            picked = logp[
                torch.arange(len(targets), device=logp.device), torch.tensor([t[4] for t in targets])
            ]
            for (_, qi, ci, _, _), value in zip(targets, picked.tolist()):
                out[qi][ci] += value
    return out


def score_task(model, tokenizer, task, progress: bool = False) -> Dict[str, Any]:
    """acc / acc_norm of one checked MCTask, with each question's scores (for the per-question table)."""
    every = task_logliks(
        model,
        tokenizer,
        [(q.context, q.choices) for q in task.questions],
        task.target_delimiter,
        progress=progress,
    )
    details = []
    hits = hits_norm = 0
    for q, lls in zip(task.questions, every):
        pred = max(range(len(lls)), key=lambda i: lls[i])
        norm = [ll / len(c) for ll, c in zip(lls, q.choices)]
        pred_norm = max(range(len(norm)), key=lambda i: norm[i])
        hits += pred == q.gold
        hits_norm += pred_norm == q.gold
        details.append({"line": q.line, "gold": q.gold, "pred": pred, "logliks": lls})
    n = len(task.questions)
    return {"acc": hits / n, "acc_norm": hits_norm / n, "n": n, "details": details}
