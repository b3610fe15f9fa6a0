"""Built-in verification: per-tensor checksums, bit-exact round trips, and a logits check against HF."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from kit.convert import megatron_layout as layout
from kit.convert.config import ConvertConfig
from kit.convert.convert import hf_to_megatron, megatron_to_hf
from kit.convert.families import family_for_config
from kit.convert.hf_io import HFReader
from kit.convert.layerwise import Streamed, logits_check_bytes, transformers_logits
from kit.convert.megatron_io import MegatronReader
from kit.convert.megatron_source import source_spec
from kit.convert.reference import hf_forward, megatron_forward, transformers_ships
from kit.system.memory import available_memory

PathLike = Union[str, Path]


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (dtype and shape are reported beside it)."""
    t = t.detach().contiguous()
    return hashlib.sha256(
        t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
    ).hexdigest()[:16]


def hf_checksums(folder: PathLike) -> Dict[str, dict]:
    """{key: {shape, dtype, sha256}} for every tensor of an HF folder, read one tensor at a time."""
    reader = HFReader(folder)
    out = {}
    for key in sorted(reader.keys()):
        t = reader.read(key)
        out[key] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype).replace("torch.", ""),
            "sha256": tensor_digest(t),
        }
    return out


def megatron_checksums(folder: PathLike) -> Dict[str, dict]:
    """{'mp_rank_XX[_YYY][_ZZZ]/key': {shape, dtype, sha256}} for every tensor of every rank file."""
    mr = MegatronReader(folder)
    out = {}
    for t, p, e in sorted(mr.files):
        flat = layout.flatten(mr.state(t, p, e)["model"])
        for key in sorted(flat):
            v = flat[key]
            if isinstance(v, torch.Tensor):
                out[f"{layout.rank_dir(t, p, mr.pp, e, mr.ep)}/{key}"] = {
                    "shape": list(v.shape),
                    "dtype": str(v.dtype).replace("torch.", ""),
                    "sha256": tensor_digest(v),
                }
    return out


def compare_hf(a: PathLike, b: PathLike, ignore_suffixes: Tuple[str, ...] = ()) -> dict:
    """Tensor-by-tensor comparison of two HF folders: identical / different / missing / extra keys.

    Keys ending in ignore_suffixes (buffers such as rotary inv_freq that the converter drops on purpose) are
    listed under `dropped` instead of `missing`.
    """
    ca, cb = hf_checksums(a), hf_checksums(b)
    common = sorted(set(ca) & set(cb))
    diff = [k for k in common if ca[k] != cb[k]]
    gone = sorted(set(ca) - set(cb))
    dropped = [k for k in gone if ignore_suffixes and k.endswith(ignore_suffixes)]
    missing = [k for k in gone if k not in dropped]
    extra = sorted(set(cb) - set(ca))
    return {
        "tensors": len(ca),
        "identical": len(common) - len(diff),
        "different": diff,
        "missing": missing,
        "extra": extra,
        "dropped": dropped,
        "bit_exact": not diff and not missing and not extra,
    }


def round_trip(
    hf_dir: PathLike,
    work_dir: Optional[PathLike] = None,
    *,
    tp: int = 2,
    pp: int = 1,
    flavor: str = "local",
    progress: bool = False,
    **options,
) -> dict:
    """HF -> Megatron(tp, pp) -> HF into work_dir (a temp folder if None) and compare every tensor."""
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="kit-roundtrip-"))
    meg, back = work / f"megatron_tp{tp}pp{pp}_{flavor}", work / f"hf_from_tp{tp}pp{pp}_{flavor}"
    hf_to_megatron(
        ConvertConfig(str(hf_dir), str(meg), tp=tp, pp=pp, flavor=flavor, overwrite=True, **options),
        progress=progress,
    )
    megatron_to_hf(
        ConvertConfig(str(meg), str(back), direction="megatron_to_hf", overwrite=True), progress=progress
    )
    fam = family_for_config(
        json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8")), options.get("family")
    )
    result = compare_hf(hf_dir, back, fam.ignore_suffixes)
    if fam.read_config(HFReader(hf_dir).config, hf_dir).norm_head and result["different"] == list(
        fam.hf_keys("output")
    ):
        # Baichuan2 NormHead: rows are normalised on the way in (same logits), so lm_head comes back normalised.
        result.update(
            different=[],
            transformed=list(fam.hf_keys("output")),
            bit_exact=not result["missing"] and not result["extra"],
        )
    return dict(result, megatron=str(meg), hf=str(back))


def torch_load_agrees(mr: MegatronReader, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> bool:
    """The installed torch's own loader reads the rank file to the same tensors as the kit's reader. Both sides are
    memory-mapped (torch.load(mmap=True)), so the check holds file pages the kernel can drop, not a copy of the file."""
    import argparse

    path = str(mr.files[(tp_rank, pp_rank, ep_rank)])
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    if allow is not None:
        with allow([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    else:  # torch 2.1-2.4 cannot allowlist Namespace here; the file is the kit's own output
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    ours = layout.flatten(mr.state(tp_rank, pp_rank, ep_rank)["model"])
    theirs = layout.flatten(state["model"])
    return ours.keys() == theirs.keys() and all(
        torch.equal(ours[k], theirs[k]) for k in ours if isinstance(ours[k], torch.Tensor)
    )


def sample_tokens(vocab_size: int, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """A fixed pseudo-random token sequence (deterministic for a seed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (seq_len,), generator=g)


def hf_logits(hf_dir: PathLike, ids: torch.Tensor, spec=None) -> torch.Tensor:
    """fp32 logits [seq, vocab] of the HF model, one decoder layer's weights in memory at a time: transformers' model
    for the families it implements natively (when the installed version knows the model type), the reference
    forward else (remote-code ChatGLM3 / Baichuan2)."""
    reader = HFReader(hf_dir)
    if transformers_ships(reader.config.get("model_type")):
        return transformers_logits(reader, ids)
    spec = spec or family_for_config(reader.config).read_config(reader.config, hf_dir)
    with torch.no_grad():
        return hf_forward(Streamed(reader), spec, ids)


def logits_check(
    hf_dir: PathLike,
    megatron_dir: PathLike,
    *,
    seq_len: int = 16,
    seed: int = 0,
    hf_config_dir: Optional[PathLike] = None,
    tolerance: float = 1e-4,
) -> dict:
    """Run the Megatron shards (TP simulated) and the HF model on the same tokens; report max |diff| of logits.

    Both sides hold one decoder layer in fp32 at a time. When the estimate of that (logits_check_bytes) exceeds the
    memory available, the check is not run: `passed` is None and `skipped` says why in one line."""
    mr = MegatronReader(megatron_dir)
    _, spec, _ = source_spec(mr, hf_config_dir, None)
    need = logits_check_bytes(HFReader(hf_dir), seq_len)
    have, source = available_memory()
    out = {
        "family": spec.family,
        "tp": mr.tp,
        "pp": mr.pp,
        "ep": mr.ep,
        "flavor": mr.flavor,
        "tokens": seq_len,
        "memory_needed": need,
        "memory_available": have,
        "tolerance": tolerance,
    }
    if need > have:
        why = (
            f"logits check skipped: it needs about {need / 2**30:.1f} GiB (a decoder layer at a time, in fp32), "
            f"{have / 2**30:.1f} GiB is available ({source}); run it where more memory is free"
        )
        return dict(out, max_abs_diff=None, argmax_agree=None, passed=None, skipped=why)
    ids = sample_tokens(spec.vocab_size, seq_len, seed)
    with torch.no_grad():
        meg = megatron_forward(mr, spec, ids)
    ref = hf_logits(hf_dir, ids, spec).float()
    diff = float((meg - ref).abs().max())
    return dict(
        out,
        max_abs_diff=diff,
        argmax_agree=float((meg.argmax(-1) == ref.argmax(-1)).float().mean()),
        passed=diff <= tolerance,
    )


def verification_table(checks: List[dict]) -> object:
    """A pandas DataFrame with one row per check: what, measured value, limit, passed."""
    import pandas as pd

    return pd.DataFrame(checks, columns=["check", "value", "limit", "passed"])


def verify_conversion(
    source: PathLike,
    target: PathLike,
    work_dir: Optional[PathLike] = None,
    *,
    logits: bool = True,
    back_to_hf: bool = True,
    seq_len: int = 16,
    tolerance: float = 1e-4,
    keep_round_trip: bool = False,
    progress: bool = False,
) -> dict:
    """Check a finished HF -> Megatron conversion: files, weights_only loading, the way back, and the logits.

    Returns {"table": DataFrame(check, value, limit, passed), "passed": True / False / None (a check skipped, nothing
    failed), "skipped": [one line per skipped check], "details": {...}}.
    """
    mr = MegatronReader(target)
    rows, details = [], {}
    tracker = (Path(target) / layout.TRACKER).read_text().strip()
    rows.append({"check": "tracker file", "value": tracker, "limit": "1", "passed": tracker == "1"})
    rows.append(
        {
            "check": "rank files (TP x PP x EP)",
            "value": f"{len(mr.files)} = {mr.tp} x {mr.pp} x {mr.ep}",
            "limit": "all present",
            "passed": len(mr.files) == mr.tp * mr.pp * mr.ep,
        }
    )
    versions = {float(mr.state(*key)["checkpoint_version"]) for key in mr.files}
    rows.append(
        {
            "check": "checkpoint_version (every record's CRC32 checked)",
            "value": sorted(versions),
            "limit": 3.0,
            "passed": versions == {3.0},
        }
    )
    same = torch_load_agrees(mr, *min(mr.files))
    rows.append(
        {
            "check": f"torch.load (torch {torch.__version__}) reads a rank file, same tensors",
            "value": same,
            "limit": True,
            "passed": same,
        }
    )
    if back_to_hf:
        work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="kit-verify-"))
        back = work / "hf_round_trip"
        megatron_to_hf(
            ConvertConfig(str(target), str(back), direction="megatron_to_hf", overwrite=True),
            progress=progress,
        )
        fam = family_for_config(HFReader(source).config, (mr.meta or {}).get("family"))
        cmp = compare_hf(source, back, fam.ignore_suffixes)
        transformed = []
        if fam.read_config(HFReader(source).config, source).norm_head and cmp["different"] == list(
            fam.hf_keys("output")
        ):
            transformed, cmp["different"] = cmp["different"], []
        exact = not cmp["different"] and not cmp["missing"] and not cmp["extra"]
        n_model = cmp["tensors"] - len(cmp["dropped"])
        rows.append(
            {
                "check": "HF -> Megatron -> HF tensors bit-identical",
                "value": f"{cmp['identical'] - len(transformed)}/{n_model}",
                "limit": f"{n_model}/{n_model}"
                + (f" ({len(transformed)} NormHead row-normalised)" if transformed else ""),
                "passed": exact,
            }
        )
        details["round_trip"] = dict(
            cmp, transformed=transformed, bit_exact=exact, hf=str(back) if keep_round_trip else None
        )
        if not keep_round_trip:  # a full second copy of the model; keep it only when asked
            shutil.rmtree(back, ignore_errors=True)
    if logits:
        lc = logits_check(source, target, seq_len=seq_len, tolerance=tolerance)
        what = f"max |logits - HF| (TP{mr.tp} simulated, {seq_len} tokens, fp32)"
        if lc["passed"] is None:
            print(lc["skipped"])
            rows.append({"check": what, "value": "skipped", "limit": tolerance, "passed": None})
        else:
            rows.append(
                {"check": what, "value": lc["max_abs_diff"], "limit": tolerance, "passed": lc["passed"]}
            )
            rows.append(
                {
                    "check": "same next-token argmax as HF",
                    "value": lc["argmax_agree"],
                    "limit": 1.0,
                    "passed": lc["argmax_agree"] == 1.0,
                }
            )
        details["logits"] = lc
    results = [r["passed"] for r in rows]
    skipped = [lc["skipped"]] if logits and lc["passed"] is None else []
    # None: nothing failed, but a check was skipped (the reason in `skipped`)
    passed = False if False in results else None if None in results else True
    return {"table": verification_table(rows), "passed": passed, "skipped": skipped, "details": details}
