"""Find and load a profile from whatever path a user has: capture folder, `*_ascend_pt`, output dir, trace file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from kit.profiling.ascend import OUTPUT_DIR, load_ascend
from kit.profiling.kineto import load_kineto
from kit.profiling.profile_data import ProfileData, ProfileError

PathLike = Union[str, Path]
CAPTURE_FILE = "capture.json"  # written by kit.profiling.profile beside the trace


def find_profiles(root: PathLike, max_depth: int = 4) -> list:
    """`*_ascend_pt` folders and `*.pt.trace.json[.gz]` files under `root`, oldest name first."""
    root = Path(root)
    found = []
    for depth in range(max_depth + 1):
        pattern = "/".join(["*"] * depth) if depth else "."
        for p in root.glob(pattern) if depth else [root]:
            if any(part.startswith(".") for part in p.relative_to(root).parts):
                continue  # unfinished captures (.name.partial-*) and other hidden folders
            if p.is_dir() and p.name.endswith(("_ascend_pt", "_ascend_ms")):
                found.append(p)
            elif p.is_file() and p.name.endswith((".pt.trace.json", ".pt.trace.json.gz")):
                found.append(p)
    # an *_ascend_pt nested in another one (should not happen) is listed once
    return sorted(set(found), key=lambda p: (p.name, str(p)))


def load(path: PathLike, allow_unfinished: bool = False) -> ProfileData:
    """Load one profile; a folder holding several loads the newest and says so in `notes`."""
    path = Path(path)
    if not path.exists():
        raise ProfileError(
            f"{path} does not exist. Pass a kit capture folder (kit.profiling.profile), a "
            f"*_ascend_pt folder, its {OUTPUT_DIR}/, or a *.pt.trace.json[.gz] file."
        )
    if path.is_file():
        if path.parent.name == OUTPUT_DIR and path.name.endswith((".json", ".csv")):
            # one file of a torch_npu output folder (trace_view.json, kernel_details.csv, ...): load its profile
            return load_ascend(path.parent.parent, allow_unfinished)
        if path.name.endswith((".json", ".json.gz")):
            return load_kineto(path)
        raise ProfileError(
            f"{path} is neither a torch.profiler trace (*.pt.trace.json[.gz]) nor a profile folder."
        )
    if path.name == OUTPUT_DIR:
        return load_ascend(path.parent, allow_unfinished)
    if path.name.endswith(("_ascend_pt", "_ascend_ms")):
        data = load_ascend(path, allow_unfinished)
    else:
        found = find_profiles(path)
        if not found:
            partial = sorted(p.name for p in path.glob(".*.partial*"))
            hint = f" Unfinished captures here: {partial}." if partial else ""
            raise ProfileError(
                f"no profile in {path}: expected a *_ascend_pt folder (torch_npu) or a *.pt.trace.json[.gz] file "
                f"(torch.profiler) at most 4 levels down.{hint} Capture one with kit.profiling.profile(...) around "
                f"a few training steps (notebook 05) and make sure the loop ran wait+warmup+active steps."
            )
        target = found[-1]
        data = load_ascend(target, allow_unfinished) if target.is_dir() else load_kineto(target)
        if len(found) > 1:
            data.notes.append(
                f"{len(found)} profiles under {path}; loaded the newest, {target.name}. "
                f"Pass one of them to load another: {[p.name for p in found]}"
            )
    capture = _capture_meta(path, data.path)
    if capture:
        data.meta["capture"] = capture
        if "error" in capture:
            data.warnings.append(capture["error"] + "; the capture's commit and settings are unknown")
    return data


def _capture_meta(root: Path, profile_path: Path) -> dict:
    """capture.json of the kit capture folder holding this profile, if any (git commit, config, device)."""
    for d in [profile_path.parent if profile_path.is_file() else profile_path, *profile_path.parents]:
        f = d / CAPTURE_FILE
        if f.exists():
            try:
                return json.loads(f.read_text(encoding="utf-8"))
            except (ValueError, OSError) as exc:
                return {"error": f"{f} is corrupt ({type(exc).__name__}: {str(exc)[:80]})"}
        if d == root or d == root.parent:
            break
    return {}
