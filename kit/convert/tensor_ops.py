"""Small pure functions that split, merge and regroup tensors between HF and Megatron tensor-parallel layouts.

Facts (Megatron-LM core_v0.16 megatron/core/transformer/attention.py and mlp.py, megatron/training/tokenizer/tokenizer.py): QKV rows are grouped per query group `[q heads of g; k_g; v_g]` and a TP rank
holds a contiguous run of groups; SwiGLU fc1 on rank r is `[gate_r; up_r]`; row-parallel tensors split dim 1;
embedding/output split dim 0 after padding the vocabulary; norms are replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Sequence, Tuple

from kit.convert.file_slices import ColumnConcat, FileSlice, Rows, Zeros, as_tensor, piece_info

if TYPE_CHECKING:  # torch is imported by the functions that compute; byte moves never need it
    import torch

Reader = Callable[
    ..., "torch.Tensor"
]  # read(key, rows=(a, b) | None, cols=(a, b) | None, copy=True) -> tensor
__all__ = [
    "Rows",
    "as_tensor",
    "read_rank",
    "hf_parts",
    "split_tp",
    "merge_tp",
    "full_to_parts",
    "grouped_weight",
    "grouped_block",
]


def part_offsets(keys: Sequence[str], rows: Sequence[int]) -> List[int]:
    """Row offset of each part inside its HF tensor (parts sharing a key are stacked in order)."""
    seen: dict = {}
    offsets = []
    for key, n in zip(keys, rows):
        offsets.append(seen.get(key, 0))
        seen[key] = offsets[-1] + n
    return offsets


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[Q; K; V] (HF) -> per group [q heads of g; k_g; v_g] (Megatron), for weights and biases alike."""
    import torch

    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def deinterleave_qkv(w: torch.Tensor, groups: int, heads_per_group: int, head_dim: int) -> List[torch.Tensor]:
    """Inverse of interleave_qkv: Megatron grouped rows -> [q, k, v]."""
    rest = w.shape[1:]
    x = w.reshape(groups, (heads_per_group + 2) * head_dim, *rest)
    nq = heads_per_group * head_dim
    q, k, v = x[:, :nq], x[:, nq : nq + head_dim], x[:, nq + head_dim :]
    return [t.reshape(-1, *rest) for t in (q, k, v)]


def glu_rank(gate: torch.Tensor, up: torch.Tensor, tp: int) -> List[torch.Tensor]:
    """Per-rank fc1 = cat(gate_r, up_r), NOT a chunk of cat(gate, up) (mcore chunks each rank's output in two)."""
    import torch

    return [torch.cat([g, u]) for g, u in zip(torch.chunk(gate, tp), torch.chunk(up, tp))]


def glu_merge(parts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Inverse of glu_rank: [gate, up] of the whole layer."""
    import torch

    halves = [torch.chunk(p, 2) for p in parts]
    return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]


def pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows` (Megatron's padded vocabulary; padded ids never occur in data)."""
    import torch

    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros((rows - w.shape[0], *w.shape[1:]))])


def split_tp(kind: str, full: torch.Tensor, tp: int, padded_vocab: int = 0) -> List[torch.Tensor]:
    """A full Megatron tensor (canonical layout) -> the TP ranks' parts."""
    import torch

    if kind == "replicated":
        return [full] * tp
    if kind == "row":
        return list(torch.chunk(full, tp, dim=1))
    if kind == "vocab":
        return list(torch.chunk(pad_rows(full, padded_vocab), tp))
    if kind in ("qkv", "column"):
        return list(torch.chunk(full, tp))
    if kind == "glu":
        return glu_rank(*torch.chunk(full, 2), tp)
    raise ValueError(f"unknown split kind {kind!r}")


def merge_tp(kind: str, parts: Sequence[torch.Tensor], what: str = "tensor") -> torch.Tensor:
    """TP ranks' parts -> the full Megatron tensor (vocab stays padded); replicas must agree."""
    import torch

    if kind == "replicated":
        for r, p in enumerate(parts[1:], 1):
            if not torch.equal(p, parts[0]):
                raise ValueError(
                    f"{what}: replicated tensor differs between TP rank 0 and rank {r}; "
                    f"the checkpoint is inconsistent (mixed runs?)."
                )
        return parts[0]
    if kind == "row":
        return torch.cat(list(parts), dim=1)
    if kind in ("vocab", "qkv", "column"):
        return torch.cat(list(parts))
    if kind == "glu":
        return torch.cat(glu_merge(parts))
    raise ValueError(f"unknown merge kind {kind!r}")


def full_to_parts(
    kind: str, full: torch.Tensor, groups: int, heads_per_group: int, head_dim: int, vocab: int
) -> List[torch.Tensor]:
    """A full Megatron tensor -> the HF parts of its role (q, k, v / gate, up / the unpadded table / itself)."""
    import torch

    if kind == "qkv":
        return deinterleave_qkv(full, groups, heads_per_group, head_dim)
    if kind == "glu":
        return list(torch.chunk(full, 2))
    if kind == "vocab":
        return [full[:vocab]]
    return [full]


def read_rank(
    kind: str,
    read: Reader,
    keys: Sequence[str],
    rows: Sequence[int],
    tp: int,
    r: int,
    *,
    full_shape: Tuple[int, ...],
    groups: int = 1,
    heads_per_group: int = 1,
    head_dim: int = 1,
    padded_vocab: int = 0,
):
    """TP rank r's part of a role, reading only the rows/columns it needs from the HF parts.

    Returns a tensor or a Rows list (to be stacked along dim 0); either may view the mapped source file, so use it
    (e.g. stream it to disk) before closing the reader. `as_tensor` makes one tensor of it.
    """
    offs = part_offsets(keys, rows)
    if kind == "replicated":
        return read(keys[0], rows=(offs[0], offs[0] + rows[0]), copy=False)
    if kind == "row":
        n = full_shape[1] // tp
        return read(keys[0], rows=(offs[0], offs[0] + rows[0]), cols=(r * n, (r + 1) * n), copy=False)
    if kind == "column":  # rows r*n:(r+1)*n (a column-parallel linear's output features)
        n = full_shape[0] // tp
        return read(keys[0], rows=(offs[0] + r * n, offs[0] + (r + 1) * n), copy=False)
    if kind == "vocab":
        per, vocab = padded_vocab // tp, full_shape[0]
        a, b = r * per, min((r + 1) * per, vocab)
        dtype = piece_info(read(keys[0], rows=(0, 1), copy=False))[1]
        if a >= vocab:
            return Zeros((per, *full_shape[1:]), dtype)
        real = read(keys[0], rows=(offs[0] + a, offs[0] + b), copy=False)
        if b - a == per:
            return real
        return Rows([real, Zeros((per - (b - a), *full_shape[1:]), dtype)])  # rows past vocab
    if (
        kind == "qkv" and groups % tp
    ):  # fewer KV groups than ranks (mcore >= 0.16): a chunk of the whole matrix
        import torch

        parts = [read(k, rows=(o, o + n)) for k, o, n in zip(keys, offs, rows)]
        return torch.chunk(interleave_qkv(*parts, groups), tp)[r].clone()
    if kind == "qkv":  # this rank's groups, each [its q heads; k; v], as row slices of the sources
        gp, nq = groups // tp, heads_per_group * head_dim
        out = Rows()
        for g in range(r * gp, (r + 1) * gp):
            out += [
                read(keys[0], rows=(offs[0] + g * nq, offs[0] + (g + 1) * nq), copy=False),
                read(keys[1], rows=(offs[1] + g * head_dim, offs[1] + (g + 1) * head_dim), copy=False),
                read(keys[2], rows=(offs[2] + g * head_dim, offs[2] + (g + 1) * head_dim), copy=False),
            ]
        return out
    if kind == "glu":  # [gate_r; up_r]
        n = rows[0] // tp
        return Rows(
            [
                read(keys[0], rows=(offs[0] + r * n, offs[0] + (r + 1) * n), copy=False),
                read(keys[1], rows=(offs[1] + r * n, offs[1] + (r + 1) * n), copy=False),
            ]
        )
    raise ValueError(f"unknown split kind {kind!r}")


def _span(parts: Sequence[FileSlice], a: int, b: int) -> Rows:
    """Rows [a, b) of the parts stacked along dim 0, as slices of the parts (nothing read)."""
    out, base = Rows(), 0
    for p in parts:
        n = p.shape[0]
        lo, hi = max(a, base), min(b, base + n)
        if lo < hi:
            out.append(p.rows(lo - base, hi - base))
        base += n
    return out


def hf_parts(
    kind: str, parts: Sequence[FileSlice], groups: int, heads_per_group: int, head_dim: int, vocab: int
) -> list:
    """TP ranks' pieces -> the HF parts of the role, as byte ranges (what merge_tp + full_to_parts compute)."""
    if kind == "replicated":
        return [parts[0]]
    if kind == "vocab":
        return [_span(parts, 0, vocab)]
    if kind == "column":
        return [_span(parts, 0, sum(p.shape[0] for p in parts))]
    if kind == "row":
        return [parts[0] if len(parts) == 1 else ColumnConcat(list(parts))]
    if kind == "glu":  # rank r holds [gate_r; up_r]
        half = [p.shape[0] // 2 for p in parts]
        return [
            Rows(p.rows(0, h) for p, h in zip(parts, half)),
            Rows(p.rows(h, 2 * h) for p, h in zip(parts, half)),
        ]
    if kind == "qkv":  # the groups in order across ranks, each [its q heads; k; v]
        q, k, v = Rows(), Rows(), Rows()
        nq, per = heads_per_group * head_dim, (heads_per_group + 2) * head_dim
        for g in range(groups):
            base = g * per
            q += _span(parts, base, base + nq)
            k += _span(parts, base + nq, base + nq + head_dim)
            v += _span(parts, base + nq + head_dim, base + per)
        return [q, k, v]
    raise ValueError(f"unknown merge kind {kind!r}")


def grouped_weight(role: str, parts: Sequence) -> torch.Tensor:
    """GroupedMLP's weight1 / weight2 of one TP rank from its experts' fc1 [2f, h] / fc2 [h, f] parts, in order:
    each transposed, stacked, and the bytes read as [h, n x 2f] / [n x f, h] (megatron-core experts.py)."""
    import torch

    blocks = torch.stack([as_tensor(p).T for p in parts])  # [n, h, 2f] or [n, f, h], contiguous
    h = blocks.shape[1] if role == "fc1.weight" else blocks.shape[2]
    return blocks.reshape(h, -1) if role == "fc1.weight" else blocks.reshape(-1, h)


def grouped_block(role: str, whole: FileSlice, local: int, count: int) -> torch.Tensor:
    """Local expert `local`'s fc1 [2f, h] / fc2 [h, f] (this TP rank's part) out of GroupedMLP's weight1 / weight2
    on disk, reading only that expert's bytes (its block is contiguous in both)."""
    if role == "fc1.weight":
        h, width = whole.shape[0], whole.shape[1] // count
        size = h * width * (whole.nbytes // (whole.shape[0] * whole.shape[1]))
        blk = FileSlice(whole.fd, whole.offset + local * size, (h, width), whole.dtype, 0, whole.what)
    else:
        rows = whole.shape[0] // count
        blk = whole.rows(local * rows, (local + 1) * rows)
    return blk.tensor().T.contiguous()
