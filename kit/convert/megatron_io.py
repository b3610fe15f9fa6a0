"""Reading and writing Megatron per-rank checkpoint files (`iter_0000001/mp_rank_XX[_YYY]/model_optim_rng.pt`)."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from kit.convert import layout

PathLike = Union[str, Path]
META_FILE = "kit_convert.json"  # what the kit wrote: family, spec, layout (Megatron ignores it)
HF_META_DIR = "hf_meta"  # the source's config, generation config and tokenizer files, for the way back
_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def save_rank(path: Path, args: argparse.Namespace, model: dict) -> None:
    """One rank's file: exactly the four entries a converter writes (MindSpeed-LLM v2 writes the same)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "args": args,
        "checkpoint_version": layout.CHECKPOINT_VERSION,
        "iteration": layout.ITERATION,
        "model": model,
    }
    # Default pickle protocol 2: torch's weights_only unpickler rejects protocol-4 FRAME opcodes.
    # Temp name + rename: never a half-written file, and an mmap'd older version of it stays readable.
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    torch.save(state, str(tmp))
    os.replace(tmp, path)


def load_rank_file(path: PathLike) -> dict:
    """torch.load with weights_only=True and mmap, so tensors stay on disk until used."""
    # Namespace (`args`) and BytesIO (TE `_extra_state`) are what converter-written files hold; megatron.core
    # allowlists them too.
    with torch.serialization.safe_globals([argparse.Namespace, io.BytesIO]):
        try:
            return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError as first:
            try:  # a training checkpoint (optimizer, numpy RNG state): megatron.core registers those classes
                import megatron.core  # noqa: F401
            except ImportError:
                raise pickle.UnpicklingError(
                    f"{path}: {first}\nInstall megatron-core (it allowlists the classes "
                    f"training checkpoints hold) or save the model weights alone."
                ) from None
            return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)


def detect_flavor(model: dict) -> str:
    """legacy (nested language_model dict), te (norms fused into linears) or local."""
    if "language_model" in model:
        return "legacy"
    if any("layer_norm_weight" in k for k in model):
        return "te"
    return "local"


class MegatronReader:
    """A Megatron checkpoint folder: tracker, iteration folder, TP x PP rank files opened lazily (mmap)."""

    def __init__(self, folder: PathLike):
        self.folder = Path(folder)
        tracker = self.folder / layout.TRACKER
        if not tracker.is_file():
            raise FileNotFoundError(
                f"{self.folder} has no {layout.TRACKER}: not a Megatron checkpoint, or a "
                f"conversion/training save that did not finish. Point at the folder holding "
                f"the tracker file."
            )
        text = tracker.read_text().strip()
        self.iter_dir = self.folder / ("release" if text == "release" else f"iter_{int(text):07d}")
        found: Dict[Tuple[int, int], Path] = {}
        for p in sorted(self.iter_dir.iterdir()) if self.iter_dir.is_dir() else []:
            m = _RANK.match(p.name)
            if m and (p / "model_optim_rng.pt").is_file():
                found[(int(m.group(1)), int(m.group(2) or 0))] = p / "model_optim_rng.pt"
        if not found:
            raise FileNotFoundError(f"{self.iter_dir} holds no mp_rank_*/model_optim_rng.pt files.")
        self.tp = 1 + max(t for t, _ in found)
        self.pp = 1 + max(p for _, p in found)
        missing = [(t, p) for t in range(self.tp) for p in range(self.pp) if (t, p) not in found]
        if missing:
            raise FileNotFoundError(
                f"{self.iter_dir}: rank files missing for (tp, pp) {missing}; copy them again."
            )
        self.files = found
        self._cache: Dict[Tuple[int, int], dict] = {}
        first = self.state(0, 0)
        self.args: argparse.Namespace = first["args"]
        self.flavor = detect_flavor(first["model"])
        meta = self.folder / META_FILE
        self.meta: Optional[dict] = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else None

    def state(self, tp_rank: int, pp_rank: int) -> dict:
        key = (tp_rank, pp_rank)
        if key not in self._cache:
            if len(self._cache) > 4 * self.tp:  # keep a few stages open, not the whole model
                self._cache.clear()
            self._cache[key] = load_rank_file(self.files[key])
        return self._cache[key]

    def layer_list(self, num_layers: int) -> List[int]:
        """Layers per stage: the kit's metadata, args.num_layer_list, or an even split."""
        if self.meta:
            return list(self.meta["num_layer_list"])
        lst = getattr(self.args, "num_layer_list", None)
        if lst:
            return [int(x) for x in str(lst).split(",")]
        return [num_layers // self.pp] * self.pp

    def parts(self, path: Tuple[str, ...], pp_rank: int) -> List[torch.Tensor]:
        """The TP ranks' tensors at one key path of one stage."""
        out = []
        for r in range(self.tp):
            try:
                out.append(layout.get(self.state(r, pp_rank)["model"], path))
            except KeyError:
                have = sorted(layout.flatten(self.state(r, pp_rank)["model"]))[:8]
                raise KeyError(
                    f"{self.files[(r, pp_rank)]} has no tensor {'.'.join(path)} (flavor "
                    f"{self.flavor}); first keys there: {have}"
                ) from None
        return out

    def all_keys(self, tp_rank: int, pp_rank: int) -> List[str]:
        return sorted(layout.flatten(self.state(tp_rank, pp_rank)["model"]))
