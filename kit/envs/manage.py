"""One API over conda envs and virtualenvs: list, clone, pack, unpack, remove."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

from kit.envs import conda as conda_backend
from kit.envs import venv as venv_backend
from kit.envs.archive import FORMATS, EarlyWriteback, archive_writer, check_level, format_of, suffix_format
from kit.envs.conda import clone_command, conda_envs, run_conda
from kit.envs.config import get_layout
from kit.envs.extraction import extract
from kit.envs.prefix import (
    DEFAULT_IMPORTS,
    EDITABLE_HINT,
    EnvArchiveError,
    EnvError,
    EnvInfo,
    check_choice,
    check_name,
    copy_tree,
    env_info,
    find_editable,
    kind_of,
    scan_tree,
    tree_totals,
    verify,
)
from kit.storage.atomic import (
    aside_name,
    atomic_dir,
    atomic_file,
    atomic_write_text,
    check_space,
    free_bytes,
    refuse_existing,
)
from kit.storage.locks import hold
from kit.storage.partial import handle_partials

PathLike = Union[str, "os.PathLike[str]"]
CLONE_METHODS = ("auto", "copy", "conda-pack", "conda-clone")


def _bar(total: int, desc: str, unit: str = "file"):
    from kit.system.progress import bar

    return bar(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False, mininterval=0.5)


def list_envs(envs_root: Optional[PathLike] = None, include_conda: bool = True) -> list[EnvInfo]:
    """Envs in the persistent root (venvs/, user_conda/) plus those conda knows (when conda exists)."""
    layout = get_layout(envs_root)
    found: dict[str, EnvInfo] = {}
    for folder in (layout.venvs, layout.conda):
        for child in sorted(folder.iterdir()) if folder.is_dir() else []:
            if not child.name.startswith(".") and kind_of(child):
                found[str(child)] = env_info(child)
    if include_conda:
        for name, prefix in conda_envs().items():
            if kind_of(prefix) and prefix not in found:
                found[prefix] = env_info(prefix, name)
    return list(found.values())


def resolve_env(source: PathLike, envs_root: Optional[PathLike] = None) -> EnvInfo:
    """An env from a folder path, or a name in the envs root, or a conda env name; EnvError if none matches."""
    text = str(source)
    if os.sep in text or text.startswith((".", "~")) or Path(text).exists():
        path = Path(text).expanduser()
        if not path.exists():
            raise EnvError(
                f"source env {text!r} does not exist; pass an existing env folder or one of: "
                f"{', '.join(e.name for e in list_envs(envs_root)) or '(none found)'}."
            )
        return env_info(path)
    known = list_envs(envs_root)
    for env in known:
        if env.name == text:
            return env
    raise EnvError(
        f"source env {text!r} not found; known envs: "
        f"{', '.join(e.name for e in known) or '(none)'} (or pass a folder path)."
    )


def clone(
    source: PathLike,
    name: Optional[str] = None,
    target: Optional[PathLike] = None,
    envs_root: Optional[PathLike] = None,
    method: str = "auto",
    overwrite: bool = False,
    ignore_editable: bool = False,
    verify_imports: Optional[Sequence[str]] = DEFAULT_IMPORTS,
    clean_partial: bool = False,
) -> dict:
    """Clone an env to `target` (default <envs_root>/{venvs,user_conda}/<name>), ready to use at its new path and
    verified by running its python; method: 'auto' (conda-pack for conda envs, copy for venvs), 'copy', 'conda-pack'
    (offline, relocates prefixes), 'conda-clone' (`conda create --clone`: needs conda and its package cache)."""
    check_choice(method, CLONE_METHODS, "clone method")
    src = resolve_env(source, envs_root)
    if target is not None:
        dest = Path(target).expanduser().absolute()
        check_name(dest.name, "target folder name")
    else:
        dest = get_layout(envs_root).folder_for(src.kind) / check_name(src.name if name is None else name)
    source_real, dest_real = os.path.realpath(src.prefix), os.path.realpath(dest)
    if dest_real == source_real:
        raise EnvError(f"target {dest} is the source env itself; choose another name or folder.")
    if dest_real.startswith(source_real + os.sep):
        raise EnvError(
            f"target {dest} is inside the source env {src.prefix}; the clone would copy itself and the source "
            f"would gain a folder. Choose a target outside it (e.g. under {get_layout(envs_root).root})."
        )
    refuse_existing(dest, overwrite, "target env")
    if method == "auto":
        method = "conda-pack" if src.kind == "conda" else "copy"
    if method.startswith("conda") and src.kind != "conda":
        raise EnvError(f"method {method!r} needs a conda env, but {src.prefix} is a {src.kind}; use 'copy'.")
    partial = handle_partials(dest.parent, clean_partial)
    free, totals = free_bytes(dest.parent), []  # measured before cp, which copies beside the scan

    def scanned(entries: list, bar=None) -> None:  # sizes summed, space checked
        totals[:] = tree_totals(entries)
        check_space(dest.parent, totals[1], f"a clone of {src.prefix}", free)
        if bar is not None:
            bar.total = totals[0]
            bar.refresh()

    start = time.perf_counter()
    if method == "conda-clone":  # conda writes into the target itself: no temporary name, the target's lock
        scanned(scan_tree(src.prefix))
        with hold(dest, "target env"):
            counts = _conda_create_clone(src.prefix, dest, overwrite)
    else:
        with atomic_dir(dest, overwrite=overwrite, what="target env") as tmp, _bar(None, "clone") as bar:
            if method == "copy":  # the scan runs beside GNU cp's copy
                counts = copy_tree(
                    src.prefix, tmp, str(dest), bar.update, on_scanned=lambda e: scanned(e, bar)
                )
            else:  # conda-pack's packer sets the bar's total
                scanned(scan_tree(src.prefix))
                counts = conda_backend.clone_conda(src.prefix, tmp, dest, ignore_editable, bar)
    n_files, size = totals
    seconds = time.perf_counter() - start
    report = _verify(dest, verify_imports)
    return {
        "source": str(src.prefix),
        "target": str(dest),
        "kind": src.kind,
        "method": method,
        "files": n_files,
        "bytes": size,
        "seconds": round(seconds, 3),
        "verify": report,
        **counts,
        **_partial_report(partial),
    }


def _partial_report(report: dict) -> dict:
    return {"partial_leftovers": report["found"], "partial_removed": report["removed"]}


def _conda_create_clone(source: Path, dest: Path, overwrite: bool) -> dict:
    """`conda create --clone` straight into `dest` (conda writes the prefix into binaries, so no temporary
    name); whatever it leaves after a failure is removed, and an old env is only replaced on success."""
    old = None
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(dest) and overwrite:
        old = aside_name(dest)  # a `.partial-` name: a killed run's leftover is reported
        os.replace(dest, old)
    try:
        run_conda(clone_command(str(source), str(dest)))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        if old is not None:
            os.replace(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return {"files_after": tree_totals(scan_tree(dest))[0]}


def pack(
    source: PathLike,
    output: Optional[PathLike] = None,
    fmt: Optional[str] = None,
    level: int = 3,
    threads: int = 0,
    envs_root: Optional[PathLike] = None,
    ignore_editable: bool = False,
    overwrite: bool = False,
    clean_partial: bool = False,
) -> dict:
    """Pack an env into one archive (default <envs_root>/packs/<name>.<fmt>) that unpack() checks member by member;
    fmt: 'tar.zst' (default), 'tar.gz' (gzip on a thread pool) or 'tar', as the suffix says; 0 threads: all."""
    if fmt is not None:
        check_choice(fmt, FORMATS, "archive format")
    src = resolve_env(source, envs_root)
    output = (
        Path(output or get_layout(envs_root).packs / f"{src.name}.{fmt or 'tar.zst'}").expanduser().absolute()
    )
    named = suffix_format(output) if fmt else format_of(output)  # format_of: a known suffix or an error
    if fmt and named != fmt:
        raise EnvArchiveError(
            f"archive name {output.name!r} does not end in .{fmt}, the format asked for; name it "
            f"{output.name.split('.')[0]}.{fmt} or choose the format its name says"
            f"{f' ({named})' if named else ''}: format and extension must agree."
        )
    fmt = named
    check_level(fmt, level)
    refuse_existing(output, overwrite, "archive")
    editable = find_editable(src.prefix)
    if editable and not ignore_editable and src.kind == "venv":
        raise EnvError(
            f"cannot pack {src.prefix}: it has editable installs ({', '.join(editable)}); {EDITABLE_HINT}"
        )
    partial = handle_partials(output.parent, clean_partial)
    entries = scan_tree(src.prefix)
    n_files, size = tree_totals(entries)
    check_space(output.parent, size if fmt == "tar" else size // 2, f"an archive of {src.prefix}")
    manifest = {"kind": src.kind, "name": src.name, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    prefix = os.path.abspath(src.prefix)
    head = dict(manifest, prefix=prefix)
    scan = None if src.kind == "conda" else prefix.encode()  # conda-pack finds a conda env's prefixes itself
    start = time.perf_counter()
    with (
        atomic_file(output, "wb", overwrite=overwrite) as final,
        _bar(n_files, f"pack {fmt}") as bar,
        archive_writer(EarlyWriteback(final), fmt, level, threads, head, prefix, scan) as writer,
    ):
        if src.kind == "conda":
            counts = conda_backend.pack_conda(prefix, writer, ignore_editable, bar)
        else:
            counts = venv_backend.pack_tree(prefix, writer, entries, bar.update)
    seconds = time.perf_counter() - start
    result = {
        "source": str(src.prefix),
        "archive": str(output),
        "format": fmt,
        "kind": src.kind,
        "files": n_files,
        "bytes": size,
        "archive_bytes": output.stat().st_size,
        "ratio": round(output.stat().st_size / max(size, 1), 4),
        "seconds": round(seconds, 3),
        "editable_not_shipped": editable,
        **counts,
        **_partial_report(partial),
    }
    atomic_write_text(_sidecar(output), json.dumps(dict(result, **manifest), indent=1) + "\n")
    return result


def unpack(
    archive: PathLike,
    target: PathLike,
    overwrite: bool = False,
    verify_imports: Optional[Sequence[str]] = DEFAULT_IMPORTS,
    clean_partial: bool = False,
) -> dict:
    """Extract an env archive (kit or `conda pack` made) into `target`, every member checked (extract()), then
    fix its prefixes; nothing is left at `target` unless all succeeded (verify_imports=None skips only the
    import check)."""
    archive = Path(archive).expanduser().absolute()
    if not archive.is_file():
        raise EnvError(
            f"archive {str(archive)!r} does not exist; make one with kit.envs.pack "
            f"(`python -m kit env pack`)."
        )
    dest = Path(target).expanduser().absolute()
    check_name(dest.name, "target folder name")
    refuse_existing(dest, overwrite, "target env")
    partial = handle_partials(dest.parent, clean_partial)
    expected = _expected_bytes(archive)
    check_space(dest.parent, expected, f"unpacking {archive.name}")
    start = time.perf_counter()
    with (
        atomic_dir(dest, overwrite=overwrite, what="target env") as tmp,
        _bar(expected, f"unpack {archive.name}", "B") as bar,
    ):
        counts, manifest = extract(archive, tmp, bar.update)
        bar.total = bar.n  # the total was an estimate (sidecar or compression guess); end the bar complete
        bar.refresh()
        # Prefixes are rewritten to the final path before the rename, with the files at the temporary one.
        with _staged(tmp, dest):
            if manifest and manifest.get("kind") == "venv":
                counts.update(venv_backend.finish_unpack(dest, manifest))
            elif (dest / "conda-meta").is_dir() or (dest / "bin" / "conda-unpack").exists():
                counts.update(conda_backend.finish_unpack(dest))
            elif kind_of(dest) is None:
                raise EnvArchiveError(
                    f"archive {archive.name} holds no environment (no conda-meta/, no "
                    f"pyvenv.cfg at its top level); nothing was unpacked."
                )
    seconds = time.perf_counter() - start
    report = _verify(dest, verify_imports)
    return {
        "archive": str(archive),
        "target": str(dest),
        "kind": kind_of(dest),
        "seconds": round(seconds, 3),
        "verify": report,
        "members_verified": bool(manifest and manifest.get("kit_archive")),
        **counts,
        **_partial_report(partial),
    }


def _sidecar(archive: Path) -> Path:
    return archive.with_name(archive.name + ".json")


def _expected_bytes(archive: Path) -> int:
    """Unpacked size: from the sidecar pack() writes, else a guess (envs compress about 4x with zstd)."""
    side = _sidecar(archive)
    if side.is_file():
        try:
            return int(json.loads(side.read_text(encoding="utf-8"))["bytes"])
        except (ValueError, KeyError, TypeError):
            pass
    size = archive.stat().st_size
    return size if str(archive).endswith(".tar") else size * 5


def _verify(prefix: Path, imports: Optional[Sequence[str]]) -> Optional[dict]:
    """verify() with the CANN variables when a CANN install is found, so torch_npu can import."""
    if imports is None:
        return None
    from kit.envs.kernels import capture_cann, find_set_env_scripts

    scripts = find_set_env_scripts() if "torch_npu" in imports else []
    return verify(prefix, imports, capture_cann(scripts, prefix)[0] if scripts else {})


@contextlib.contextmanager
def _staged(tmp: Path, final: Path) -> Iterator[None]:
    """`final` points at the staging folder meanwhile, so that fix-up scripts that derive the prefix from their
    own location (conda-unpack) write the final path."""
    moved = aside_name(final) if os.path.lexists(final) else None  # overwrite=True: the old env waits there
    if moved is not None:
        os.replace(final, moved)
    os.symlink(tmp, final)
    try:
        yield
    finally:
        os.unlink(final)
        if moved is not None:
            os.replace(moved, final)


def remove(target: PathLike, envs_root: Optional[PathLike] = None) -> dict:
    """Delete an env folder (only a real env: conda-meta/ or pyvenv.cfg) and the kernels that use it."""
    from kit.envs.kernels import stored_kernels, unregister_kernel

    info = env_info(target)
    if info.prefix.resolve() == Path(sys.prefix).resolve():
        raise EnvError(f"{info.prefix} is the environment this python runs in; remove it from another one.")
    kernels = [
        n
        for n, spec in stored_kernels(envs_root).items()
        if spec.get("metadata", {}).get("kit", {}).get("prefix") == str(info.prefix)
    ]
    for name in kernels:
        unregister_kernel(name, envs_root)
    shutil.rmtree(info.prefix)
    return {"removed": str(info.prefix), "kernels": kernels}
