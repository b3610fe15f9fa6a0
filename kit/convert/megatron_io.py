"""Reading and writing Megatron per-rank checkpoint files (`iter_0000001/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`).

Rank files are read by the kit's own zip reader (kit/convert/torch_zip.py): every record's CRC32 is checked when a
file is opened, the pickle is loaded without running any class's code, and tensors stay on disk as byte ranges until
used. So damage is an error naming the file, and the same code reads on every torch version the kit supports.
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from kit.convert import megatron_layout as layout
from kit.convert.checks import ConversionError
from kit.convert.file_slices import FileSlice, Scratch, torch_dtype
from kit.convert.hf_io import read_json
from kit.convert.torch_zip import RankFileError, TensorRef, TorchGlobal, ZipIndex, load_refs, ref_bytes_range

PathLike = Union[str, Path]
META_FILE = "kit_convert.json"  # what the kit wrote: family, spec, layout (Megatron ignores it)
HF_META_DIR = "hf_meta"  # the source's config, generation config and tokenizer files, for the way back
_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def save_rank(path: Path, args: argparse.Namespace, model: dict) -> None:
    """One rank's file through torch.save (tests use it to build checkpoints the way training runs write them)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "args": args,
        "checkpoint_version": layout.CHECKPOINT_VERSION,
        "iteration": layout.ITERATION,
        "model": model,
    }
    # Temp name + rename: never a half-written file, and an mmap'd older version of it stays readable.
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    torch.save(state, str(tmp))
    os.replace(tmp, path)


class RankFile:
    """One rank file, opened and CRC-checked: `refs` is its object with TensorRefs (nothing else read yet)."""

    def __init__(self, path: PathLike, verify: bool = True, scratch: Optional[Scratch] = None):
        self.path = Path(path)
        try:
            self.index = ZipIndex(path)
            self.unchecked = self.index.verify(scratch) if verify else 0
            self.refs = load_refs(self.index)
        except (RankFileError, EOFError) as exc:  # damaged: one line naming the file
            raise ConversionError([str(exc)], "Megatron rank file") from None
        if not isinstance(self.refs, dict) or not isinstance(self.refs.get("model"), dict):
            raise ConversionError(
                [f"{self.path}: holds no 'model' dict of weights (keys {sorted(self.refs)[:6]})"]
                if isinstance(self.refs, dict)
                else [f"{self.path}: holds a {type(self.refs).__name__}, not a Megatron checkpoint dict"],
                "Megatron rank file",
            )

    def piece(self, ref: TensorRef) -> FileSlice:
        """The tensor's bytes as a FileSlice (contiguous tensors; others raise)."""
        try:
            offset, _ = ref_bytes_range(self.index, ref)
        except RankFileError as exc:
            raise ConversionError([str(exc)], "Megatron rank file") from None
        return FileSlice(self.index.fd, offset, ref.shape, ref.dtype, 0, str(self.path))

    def tensor(self, ref: TensorRef, mapped: Optional[mmap.mmap] = None):
        """A torch tensor of the ref: viewing `mapped` (lazy, shared pages) or read now."""
        import torch

        rec = self.index.records.get(f"data/{ref.storage.key}")
        dt = torch_dtype(ref.dtype)
        if rec is None:
            raise ConversionError(
                [f"{self.path}: storage data/{ref.storage.key} is missing"], "Megatron rank file"
            )
        if rec.size == 0 or ref.numel() == 0:
            return torch.empty(ref.shape, dtype=dt)
        if mapped is not None:
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=rec.size, offset=rec.offset)
        else:
            flat = torch.empty(rec.size, dtype=torch.uint8)
            from kit.convert.file_slices import pread_into

            pread_into(self.index.fd, memoryview(flat.numpy()).cast("B"), rec.offset, str(self.path))
        return flat.view(dt).as_strided(ref.shape, ref.stride, ref.offset)

    def materialize(self) -> dict:
        """The whole object with torch tensors (memory-mapped, copy-on-write) and torch dtypes in args."""
        mapped = mmap.mmap(self.index.fd, 0, access=mmap.ACCESS_COPY)
        storages: Dict[str, object] = {}

        def conv(x):
            if isinstance(x, TensorRef):
                key = (x.storage.key, x.offset, x.shape, x.stride)
                if key not in storages:
                    storages[key] = self.tensor(x, mapped)
                return storages[key]
            if isinstance(x, TorchGlobal) and x.module == "torch":
                return torch_dtype(x.name)
            if isinstance(x, dict):
                return type(x)((k, conv(v)) for k, v in x.items())
            if isinstance(x, argparse.Namespace):
                return argparse.Namespace(**{k: conv(v) for k, v in vars(x).items()})
            if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
                return type(x)(conv(v) for v in x)
            return x

        return conv(self.refs)

    def close(self) -> None:
        self.index.close()


def load_rank_file(path: PathLike) -> dict:
    """A rank file's object with torch tensors (memory-mapped until used); CRCs checked, no code run."""
    return RankFile(path).materialize()


def detect_flavor(model: dict) -> str:
    """legacy (nested language_model dict), te (norms fused into linears) or local."""
    if "language_model" in model:
        return "legacy"
    if any("layer_norm_weight" in k for k in model):
        return "te"
    return "local"


def detect_grouped_gemm(model: dict) -> str:
    """The experts' layout of a MoE checkpoint: "" (SequentialMLP local_experts, or no experts), "te"
    (TEGroupedMLP linear_fc1.weight<k>) or "legacy" (GroupedMLP weight1 / weight2)."""
    for k in model:
        if ".mlp.experts.weight1" in k:
            return "legacy"
        if ".mlp.experts.linear_fc1.weight" in k:
            return "te"
    return ""


def arg_dtype(args: argparse.Namespace, default: str = "float32") -> str:
    """args.params_dtype as a name (it may be a torch.dtype, a TorchGlobal or missing)."""
    value = getattr(args, "params_dtype", None)
    return str(value).replace("torch.", "") if value is not None else default


def _rank_key(nums: Tuple[int, ...], second_is_ep: bool) -> Tuple[int, int, int]:
    """(tp, pp, ep) ranks of a rank folder from the numbers in its name."""
    t, rest = nums[0], nums[1:]
    if len(rest) == 2:
        return (t, rest[0], rest[1])
    if not rest:
        return (t, 0, 0)
    return (t, 0, rest[0]) if second_is_ep else (t, rest[0], 0)


class MegatronReader:
    """A Megatron checkpoint folder: tracker, iteration folder, TP x PP rank files opened lazily."""

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
        if text != "release" and not text.isdigit():
            raise ConversionError(
                [f"{tracker} holds {text[:40]!r}, not an iteration number"], "Megatron checkpoint"
            )
        self.iter_dir = self.folder / ("release" if text == "release" else f"iter_{int(text):07d}")
        named: Dict[Tuple[int, ...], Path] = {}  # the numbers in each rank folder's name
        for p in sorted(self.iter_dir.iterdir()) if self.iter_dir.is_dir() else []:
            m = _RANK.match(p.name)
            if m:
                named[tuple(int(g) for g in m.groups() if g is not None)] = p
        if not any((p / "model_optim_rng.pt").is_file() for p in named.values()):
            raise FileNotFoundError(f"{self.iter_dir} holds no mp_rank_*/model_optim_rng.pt files.")
        self._cache: Dict[Tuple[int, int, int], RankFile] = {}
        self.tp = self.pp = self.ep = 1
        self._states: Dict[Tuple[int, int, int], dict] = {}
        self.scratch = Scratch()
        first_dir = min(p for p in named.values() if (p / "model_optim_rng.pt").is_file())
        first = RankFile(first_dir / "model_optim_rng.pt", scratch=self.scratch)
        self.args: argparse.Namespace = first.refs.get("args") or argparse.Namespace()
        meta = self.folder / META_FILE
        self.meta: Optional[dict] = read_json(meta) if meta.is_file() else None
        # The layout the checkpoint says it has (its args, the kit's metadata), not just the folders present:
        # a missing rank is then named instead of surfacing later as a wrong-looking tensor.
        said = {
            dim: int(getattr(self.args, arg, 0) or (self.meta or {}).get(dim) or 0)
            for dim, arg in (
                ("tp", "tensor_model_parallel_size"),
                ("pp", "pipeline_model_parallel_size"),
                ("ep", "expert_model_parallel_size"),
            )
        }
        # `mp_rank_TT_NNN` is a PP stage, or an EP rank when the checkpoint has EP and no PP (get_checkpoint_name)
        second_is_ep = said["pp"] <= 1 and said["ep"] > 1
        found: Dict[Tuple[int, int, int], Path] = {}
        folders = set()
        for nums, p in named.items():
            key = _rank_key(nums, second_is_ep)
            folders.add(key)
            if (p / "model_optim_rng.pt").is_file():
                found[key] = p / "model_optim_rng.pt"
        self.files = found
        self.tp = max([said["tp"]] + [t + 1 for t, _, _ in folders])
        self.pp = max([said["pp"]] + [p + 1 for _, p, _ in folders])
        self.ep = max([said["ep"]] + [e + 1 for _, _, e in folders])
        first_key = next(k for k, v in found.items() if v.parent == first_dir)
        self._cache[first_key] = first
        missing = [
            (t, p, e)
            for t in range(self.tp)
            for p in range(self.pp)
            for e in range(self.ep)
            if (t, p, e) not in found
        ]
        if missing:
            names = [
                layout.rank_dir(t, p, self.pp, e, self.ep) + "/model_optim_rng.pt" for t, p, e in missing
            ]
            ep_text = f" x EP{self.ep}" if self.ep > 1 else ""
            raise ConversionError(
                [
                    f"{len(missing)} of {self.tp * self.pp * self.ep} rank files missing in {self.iter_dir} (the "
                    f"checkpoint is TP{self.tp} x PP{self.pp}{ep_text}): {', '.join(names[:8])}"
                    f"{' ...' if len(names) > 8 else ''}; copy them again"
                ],
                "Megatron checkpoint",
            )
        self.flavor = detect_flavor(first.refs["model"])
        self.grouped_gemm = detect_grouped_gemm(first.refs["model"])

    def rank_file(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> RankFile:
        """The opened (CRC-checked) rank file."""
        key = (tp_rank, pp_rank, ep_rank)
        if (
            key not in self._cache
        ):  # open files are an fd and an index each; pieces may point into any of them
            self._cache[key] = RankFile(self.files[key], scratch=self.scratch)
        return self._cache[key]

    def refs(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict:
        """The rank's model dict with TensorRefs (shapes, dtypes, byte ranges; no data read)."""
        return self.rank_file(tp_rank, pp_rank, ep_rank).refs["model"]

    def state(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> dict:
        """The rank's whole object with torch tensors (memory-mapped)."""
        key = (tp_rank, pp_rank, ep_rank)
        rf = self.rank_file(*key)
        if key not in self._states:
            if len(self._states) >= 2 * self.tp:  # a few stages mapped, not the whole model
                self._states.clear()
            self._states[key] = rf.materialize()
        return self._states[key]

    def layer_list(self, num_layers: int) -> List[int]:
        """Layers per stage: the kit's metadata, args.num_layer_list, or an even split."""
        if self.meta:
            return list(self.meta["num_layer_list"])
        lst = getattr(self.args, "num_layer_list", None)
        if lst:
            return [int(x) for x in str(lst).split(",")]
        return [num_layers // self.pp] * self.pp

    def _ref(self, path: Tuple[str, ...], tp_rank: int, pp_rank: int, ep_rank: int = 0) -> TensorRef:
        key = (tp_rank, pp_rank, ep_rank)
        try:
            ref = layout.get(self.refs(*key), path)
        except KeyError:
            have = sorted(layout.flatten(self.refs(*key)))[:8]
            raise ConversionError(
                [
                    f"{self.files[key]} has no tensor {'.'.join(path)} (flavor {self.flavor}); "
                    f"first keys there: {have}"
                ],
                "Megatron checkpoint",
            ) from None
        if not isinstance(ref, TensorRef):
            raise ConversionError(
                [f"{self.files[key]}: {'.'.join(path)} is a {type(ref).__name__}, not a tensor"],
                "Megatron checkpoint",
            )
        return ref

    def pieces(self, path: Tuple[str, ...], pp_rank: int, ep_rank: int = 0) -> List[FileSlice]:
        """The TP ranks' tensors at one key path of one stage (and EP rank), as byte ranges on disk."""
        out = []
        for r in range(self.tp):
            ref = self._ref(path, r, pp_rank, ep_rank)
            rf = self.rank_file(r, pp_rank, ep_rank)
            if not ref.is_contiguous():  # not written by a converter; read it whole (rare, small)
                from kit.convert.file_slices import Rows

                out.append(Rows([rf.tensor(ref).contiguous()]))
                continue
            out.append(rf.piece(ref))
        return out

    def parts(self, path: Tuple[str, ...], pp_rank: int, ep_rank: int = 0) -> list:
        """The TP ranks' tensors at one key path of one stage (and EP rank), as torch tensors (read now)."""
        return [
            self.rank_file(r, pp_rank, ep_rank).tensor(self._ref(path, r, pp_rank, ep_rank))
            for r in range(self.tp)
        ]

    def all_keys(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> List[str]:
        return sorted(layout.flatten(self.refs(tp_rank, pp_rank, ep_rank)))

    def close(self) -> None:
        for rf in self._cache.values():
            rf.close()
        self._cache.clear()
        self._states.clear()

    def unchecked_files(self) -> List[str]:
        """Rank files opened so far whose records carry no CRC (older writers): not verifiable."""
        return [str(rf.path) for rf in self._cache.values() if rf.unchecked]
