"""Checks made before any byte is written: tensors vs config, TP/PP vs the model, free disk space."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from kit.convert.families import ROLE_KIND, Family
from kit.convert.layout import layout_problems
from kit.convert.spec import ModelSpec
from kit.convert.tensor_ops import part_offsets
from kit.errors import KitError


class ConversionError(KitError, ValueError):
    """A checkpoint or a requested layout that cannot be converted; lists every problem found."""

    def __init__(self, problems: Iterable[str], where: str = "conversion"):
        self.problems = list(problems)
        shown = self.problems[:25]
        more = len(self.problems) - len(shown)
        lines = "\n".join(f"  - {p}" for p in shown) + (f"\n  - ... and {more} more" if more > 0 else "")
        super().__init__(f"{len(self.problems)} problem(s) in {where}:\n{lines}")


def expected_hf_shapes(fam: Family, spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """Every HF key the family map expects for this spec, with its shape."""
    out: Dict[str, Tuple[int, ...]] = {}
    glob, layer_roles = fam.roles(spec)
    items = [(r, -1) for r in glob] + [(r, i) for i in range(spec.num_layers) for r in layer_roles]
    for role, i in items:
        keys, rows = fam.hf_keys(role, i), fam.part_rows(spec, role)
        rest = spec.full_shape(role)[1:]
        for key, off, n in zip(keys, part_offsets(keys, rows), rows):
            prev = out.get(key, (0,))
            out[key] = (max(prev[0], off + n), *rest)
    return out


def hf_problems(fam: Family, spec: ModelSpec, shapes: Dict[str, Tuple[int, ...]]) -> List[str]:
    """Missing keys, unknown keys (never dropped silently) and shapes that contradict config.json."""
    expected = expected_hf_shapes(fam, spec)
    problems = []
    ignorable = set()
    if spec.tied:  # some tied checkpoints still store lm_head; it is the embedding, so it may go
        ignorable.update(fam.hf_keys("output"))
    for key in sorted(set(expected) - set(shapes)):
        problems.append(f"tensor {key!r} (shape {list(expected[key])}) is missing from the checkpoint.")
    for key in sorted(set(shapes) - set(expected)):
        if key in ignorable or key.endswith(fam.ignore_suffixes):
            continue
        problems.append(
            f"tensor {key!r} is not in the {fam.name} key map; it would be dropped. Check the family "
            f"(config model_type) or remove the tensor if it is not a model weight."
        )
    for key in sorted(set(expected) & set(shapes)):
        if tuple(shapes[key]) != tuple(expected[key]):
            problems.append(
                f"tensor {key!r} has shape {list(shapes[key])} but config.json implies "
                f"{list(expected[key])} (hidden {spec.hidden_size}, heads {spec.num_heads}, groups "
                f"{spec.num_groups}, head_dim {spec.head_dim}, ffn {spec.ffn_hidden_size}, vocab "
                f"{spec.vocab_size}); config and weights do not belong together."
            )
    return problems


def layout_plan_problems(
    spec: ModelSpec,
    tp: int,
    pp: int,
    layer_list: Optional[Sequence[int]],
    padded_vocab: int,
    flavor: str = "local",
) -> List[str]:
    """Why a TP x PP layout does not fit this model, if it does not."""
    problems = []
    if tp < 1:
        problems.append(f"tensor parallel size {tp} must be >= 1.")
        return problems
    for what, n in (("attention heads", spec.num_heads), ("FFN hidden size", spec.ffn_hidden_size)):
        if n % tp:
            problems.append(f"tensor parallel size {tp} does not divide the {n} {what}.")
    ng = spec.num_groups
    if not _groups_fit(ng, tp, flavor):
        # megatron-core >= 0.16 accepts TP a multiple of the KV groups (each group's rows split across ranks);
        # legacy Megatron and older mcore need the groups divisible by TP.
        problems.append(
            f"tensor parallel size {tp} does not fit the {ng} KV groups (num_key_value_heads) for flavor {flavor!r}."
        )
    if problems:  # the sizes that pass every rule at once, not one rule at a time
        problems.append(f"TP sizes that fit this model (every rule at once): {tp_candidates(spec, flavor)}.")
    if padded_vocab < spec.vocab_size:
        problems.append(f"padded vocabulary {padded_vocab} is smaller than the vocabulary {spec.vocab_size}.")
    elif padded_vocab % tp:
        problems.append(f"padded vocabulary {padded_vocab} is not divisible by tensor parallel size {tp}.")
    problems += layout_problems(spec.num_layers, pp, layer_list)
    return problems


def _groups_fit(groups: int, tp: int, flavor: str) -> bool:
    return groups % tp == 0 or (flavor != "legacy" and tp % groups == 0)


def tp_candidates(spec: ModelSpec, flavor: str = "local") -> List[int]:
    """Every TP size that divides the heads and the FFN and fits the KV groups."""
    return [
        d
        for d in range(1, spec.num_heads + 1)
        if spec.num_heads % d == 0
        and spec.ffn_hidden_size % d == 0
        and _groups_fit(spec.num_groups, d, flavor)
    ]


def check_disk(target: Path, need_bytes: int) -> None:
    """Refuse to start when the target's file system has less free space than the output needs."""
    probe = Path(target).resolve()
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes * 1.02 + 64 * 1024**2:
        raise ConversionError(
            [
                f"the output needs about {need_bytes / 1024**3:.2f} GiB but {probe} has only "
                f"{free / 1024**3:.2f} GiB free; free space or choose another target folder."
            ],
            "disk space check",
        )


def role_kind(role: str) -> str:
    return ROLE_KIND["embedding" if role == "tied_head" else role]
