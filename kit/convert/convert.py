"""HF -> Megatron, Megatron -> HF and Megatron -> Megatron, streaming one rank file or one layer at a time."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

from kit.convert import megatron_layout as layout
from kit.convert.checks import (
    ConversionError,
    expected_hf_shapes,
    hf_problems,
    layout_plan_problems,
    role_kind,
)
from kit.convert.config import ConvertConfig
from kit.convert.families import KEEP_DTYPE, Family, family_for_config
from kit.convert.file_slices import (
    FileSlice,
    Rows,
    Scratch,
    as_tensor,
    itemsize,
    piece_info,
    reserve,
    torch_dtype,
)
from kit.convert.hf_io import HFReader, HFWriter, copy_side_files
from kit.convert.manifests import write_converted_manifest, write_hf_manifest
from kit.convert.megatron_io import HF_META_DIR, META_FILE, MegatronReader, arg_dtype
from kit.convert.megatron_source import (
    TENSOR_FRAMING,
    check_megatron_keys,
    layout_bytes,
    merged_tensor_fn,
    rank_entries,
    role_pieces,
    same_bytes,
    source_spec,
    stages_of,
)
from kit.convert.sources import source_identity, source_manifest
from kit.convert.spec import ModelSpec, expert_role, megatron_args, split_group
from kit.convert.tensor_ops import full_to_parts, grouped_weight, hf_parts, merge_tp, read_rank, split_tp
from kit.convert.torch_zip import StreamingTorchFile
from kit.convert.weights_check import StreamCheck, check_hf_weights
from kit.core.configs import check, save_config
from kit.core.parallel import padded_vocab_size, stage_layers
from kit.storage.atomic import atomic_dir, check_space

PathLike = Union[str, Path]
RankFn = Callable[[str, Optional[int], int], object]  # (role, global layer | None, tp rank) -> tensor or Rows
# torch is imported only where numbers are computed (a dtype cast, Baichuan's NormHead, re-sharding); plain
# HF <-> Megatron conversion moves bytes and starts in a fraction of torch's import time.


def _progress(total: int, desc: str, disable: bool):
    if disable:
        return _NoBar()
    from kit.system.progress import bar

    return bar(total=total, desc=desc, unit="layer")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _workers(cfg: ConvertConfig, files: int) -> int:
    """Threads for the rank files: each file is pread -> CRC32 -> write, all of which release the GIL, so files
    written side by side use as many cores as there are (one per core; more would only share them)."""
    if cfg.workers:
        return max(1, min(cfg.workers, files))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8, files))


def _write_rank_file(tmp: Path, s: int, r: int, e: int, ctx: dict) -> int:
    """One rank file, streamed tensor by tensor (memory holds about one tensor and its source slices); its size."""
    pp, ep, bar, stop = len(ctx["stages"]), ctx["ep"], ctx["bar"], ctx["stop"]
    path = tmp / layout.ITER_DIR / layout.rank_dir(r, s, pp, e, ep) / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.partial")
    check = StreamCheck(str(path.relative_to(tmp)))  # NaN / inf counted as the bytes are written
    out, model = StreamingTorchFile(part, ctx["scratch"](), check), {}
    entries = rank_entries(ctx["fam"], ctx["spec"], ctx["flavor"], ctx["stages"], s, e, ep, ctx["grouped"])
    done = None
    try:
        for key_path, role, layer in entries:
            if stop.is_set():  # another file failed: stop early, the temporary folder is removed
                return 0
            if layer != done and done is not None:
                bar.update(1)
            done = layer
            group = split_group(role)
            if group is None:
                value = ctx["rank_fn"](role, layer, r)
            else:  # GroupedMLP: this rank's experts in one tensor
                which, experts = group
                value = grouped_weight(
                    which, [ctx["rank_fn"](expert_role(x, which), layer, r) for x in experts]
                )
            layout.put(model, key_path, out.store(value, ".".join(key_path)))
            if check.bad:
                raise ctx["nonfinite"](check, check.file)
        if done is not None:
            bar.update(1)
    finally:
        ctx["check_seconds"].append(check.seconds)
    out.finish(
        {
            "args": ctx["args"],
            "checkpoint_version": layout.CHECKPOINT_VERSION,
            "iteration": layout.ITERATION,
            "model": model,
        }
    )
    os.replace(part, path)
    return path.stat().st_size


def _write_megatron(
    tmp: Path,
    fam: Family,
    spec: ModelSpec,
    tp: int,
    stages: List[List[int]],
    flavor: str,
    args,
    rank_fn: RankFn,
    progress: bool,
    workers: int = 1,
    ep: int = 1,
    grouped_gemm: bool = False,
    nonfinite: Optional[Callable] = None,
    check_seconds: Optional[list] = None,
) -> int:
    """Write every rank file of the layout (TP x PP x EP), `workers` files at a time (rank_fn must then be
    thread-safe); returns bytes written. The first error stops the other files and is raised: NaN / inf in a tensor
    raise `nonfinite(check, rank file)` (default: the check's own error naming the Megatron tensor). The seconds
    spent checking are appended to `check_seconds`, one entry per file."""
    import threading

    pp = len(stages)
    name = f"->Megatron TP{tp} PP{pp}" + (f" EP{ep}" if ep > 1 else "")
    bar = _LockedBar(_progress(tp * ep * spec.num_layers, name, not progress))
    ctx = dict(stages=stages, fam=fam, spec=spec, flavor=flavor, args=args, rank_fn=rank_fn, ep=ep)
    ctx["grouped"] = ("te" if flavor == "te" else "legacy") if grouped_gemm and spec.num_experts else ""
    nonfinite = nonfinite or (lambda check, rank_file: check.error(f"{tmp.name}, written"))
    check_seconds = [] if check_seconds is None else check_seconds
    ctx.update(nonfinite=nonfinite, check_seconds=check_seconds)
    local = threading.local()  # one set of copy buffers per thread, reused file after file

    def scratch() -> Scratch:
        if not hasattr(local, "scratch"):
            local.scratch = Scratch()
        return local.scratch

    ctx.update(bar=bar, stop=threading.Event(), scratch=scratch)
    reserve(-1, 0, 0)  # look fallocate up once, before the threads
    # the first and last stages first: they hold the embedding and the output layer, the largest files
    jobs = sorted(
        ((s, r, e) for s in range(pp) for e in range(ep) for r in range(tp)),
        key=lambda j: j[0] not in (0, pp - 1),
    )
    try:
        if workers <= 1:
            return sum(_write_rank_file(tmp, s, r, e, ctx) for s, r, e in jobs)
        todo, sizes, errors, lock = list(jobs), [], [], threading.Lock()

        def worker() -> None:
            while not ctx["stop"].is_set():
                with lock:
                    if not todo:
                        return
                    s, r, e = todo.pop(0)
                try:
                    sizes.append(_write_rank_file(tmp, s, r, e, ctx))
                except BaseException as exc:  # the first error stops the other files; raised below
                    errors.append(exc)
                    ctx["stop"].set()
                    return

        threads = [
            threading.Thread(target=worker, name=f"kit-convert-{i}", daemon=True) for i in range(workers)
        ]
        try:  # started inside: a Ctrl-C while the second thread starts must still stop and join the first
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)  # in slices: Ctrl-C (and SIGTERM, see kit.storage.partial) reach this thread
        finally:  # on an error or Ctrl-C: no new files, running ones stop at their next tensor
            ctx["stop"].set()
            for t in threads:
                if t.ident is not None:  # started
                    t.join()
        if errors:
            raise errors[0]
        return sum(sizes)
    finally:
        bar.close()


class _LockedBar:
    """A progress bar several writer threads update."""

    def __init__(self, bar):
        import threading

        self.bar, self.lock = bar, threading.Lock()

    def update(self, n: int = 1) -> None:
        with self.lock:
            self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _finish(
    tmp: Path, meta: dict, cfg: ConvertConfig, side_from: Optional[Path], spec: ModelSpec, source
) -> None:
    """Side files, metadata, config, the tracker file, and last the manifest: a partial folder never looks complete.

    `source` is (source manifest or None, (hash, rule)) from kit.convert.sources."""
    if side_from is not None and side_from.is_dir():
        copy_side_files(side_from, tmp / HF_META_DIR)
    # plain writes: `tmp` is the run's private folder, renamed into place only once the manifest is in it (a file
    # of its own fsynced here would not make the unsynced rank files beside it any safer)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    save_config(cfg, tmp, "convert_config.json")
    (tmp / layout.TRACKER).write_text(str(layout.ITERATION), encoding="utf-8")
    write_converted_manifest(tmp, cfg.target, meta, spec, *source)


def _plan(spec: ModelSpec, cfg: ConvertConfig) -> tuple:
    """Padded vocabulary and layers per pipeline stage for the target layout; every problem raised at once."""
    tp, pp, ep = cfg.tp, cfg.pp, cfg.ep
    padded = padded_vocab_size(spec.vocab_size, tp, cfg.make_vocab_size_divisible_by, cfg.padded_vocab_size)
    problems = layout_plan_problems(
        spec, tp, pp, cfg.num_layer_list, padded, cfg.flavor, ep=ep, grouped_gemm=cfg.moe_grouped_gemm
    )
    if problems:
        where = f"TP{tp} PP{pp}" + (f" EP{ep}" if ep > 1 else "")
        raise ConversionError(problems, f"target layout {where} for this {spec.family} model")
    return padded, stage_layers(spec.num_layers, pp, cfg.num_layer_list)


def _layout_bytes(cfg: ConvertConfig, fam, spec: ModelSpec, stages, padded: int, dtype) -> int:
    """What the target layout's rank files will take (kit.convert.megatron_source.layout_bytes)."""
    grouped = ("te" if cfg.flavor == "te" else "legacy") if cfg.moe_grouped_gemm and spec.num_experts else ""
    return layout_bytes(fam, spec, cfg.flavor, stages, cfg.tp, cfg.ep, padded, itemsize(dtype), grouped)


def _hf_bytes(fam, spec: ModelSpec, dtype) -> int:
    """What the HF folder's weights will take: each tensor once, however many rank files repeat it."""
    shapes = expected_hf_shapes(fam, spec).values()
    return sum(math.prod(s) * itemsize(dtype) + TENSOR_FRAMING for s in shapes)


def _meta(
    direction: str,
    source: PathLike,
    spec: ModelSpec,
    tp: int,
    stages,
    flavor: str,
    padded: int,
    divisible_by: int,
    dtype: Optional[str],
    ep: int = 1,
    grouped_gemm: bool = False,
) -> dict:
    return {
        "direction": direction,
        "source": str(source),
        "family": spec.family,
        "flavor": flavor,
        "tp": tp,
        "pp": len(stages),
        "ep": ep,
        "expert_tensor_parallel_size": tp if spec.num_experts else None,
        "moe_grouped_gemm": bool(grouped_gemm),
        "num_layer_list": [len(s) for s in stages],
        "padded_vocab_size": padded,
        "make_vocab_size_divisible_by": divisible_by,
        "dtype": dtype,
        "spec": spec.to_dict(),
    }


def _save_megatron(
    cfg: ConvertConfig,
    direction: str,
    fam,
    spec: ModelSpec,
    stages,
    padded: int,
    dtype,
    rank_fn,
    progress: bool,
    side_from,
    what: str,
    source: tuple,
    workers: int = 1,
    nonfinite=None,
    check_seconds: Optional[list] = None,
) -> tuple:
    """Write a whole Megatron folder atomically (rank files, metadata, tracker last); returns (meta, bytes written).
    `nonfinite` and `check_seconds`: as in _write_megatron."""
    num_layer_list = [len(s) for s in stages]
    args = megatron_args(
        spec,
        cfg.tp,
        cfg.pp,
        num_layer_list,
        padded,
        cfg.make_vocab_size_divisible_by,
        dtype,
        cfg.flavor,
        ep=cfg.ep,
        grouped_gemm=cfg.moe_grouped_gemm,
    )
    with atomic_dir(cfg.target, overwrite=cfg.overwrite, what=what) as tmp:
        written = _write_megatron(
            tmp,
            fam,
            spec,
            cfg.tp,
            stages,
            cfg.flavor,
            args,
            rank_fn,
            progress,
            workers,
            ep=cfg.ep,
            grouped_gemm=cfg.moe_grouped_gemm,
            nonfinite=nonfinite,
            check_seconds=check_seconds,
        )
        meta = _meta(
            direction,
            cfg.source,
            spec,
            cfg.tp,
            stages,
            cfg.flavor,
            padded,
            cfg.make_vocab_size_divisible_by,
            str(dtype).replace("torch.", ""),
            ep=cfg.ep,
            grouped_gemm=cfg.moe_grouped_gemm,
        )
        _finish(tmp, meta, cfg, side_from, spec, source)
    return meta, written


def hf_to_megatron(cfg: ConvertConfig, progress: bool = True) -> dict:
    """Convert an HF folder into Megatron rank files for cfg.tp x cfg.pp; returns a summary dict."""
    t0 = time.perf_counter()
    check(cfg)
    src_man = source_manifest(cfg.source, "hf_to_megatron")
    src_hash = source_identity(cfg.source, src_man)
    reader = HFReader(cfg.source)
    fam = family_for_config(reader.config, cfg.family)
    spec = fam.read_config(reader.config, reader.folder)
    problems = hf_problems(fam, spec, {k: reader.shape(k) for k in reader.keys()})
    if problems:
        raise ConversionError(problems, f"HF checkpoint {cfg.source}")
    # NaN / inf weights: nothing converted from them is usable. The tensors converted are checked as their bytes
    # are written (StreamCheck, in the writer threads); the others (a tied model's lm_head copy, rotary buffers,
    # tensors the index does not list) here.
    check_hf_weights(cfg.source, skip=set(expected_hf_shapes(fam, spec)))
    check_seconds: List[float] = []

    def nonfinite(stream, rank_file: Path):
        check_hf_weights(cfg.source)  # in the source (the usual case): named there, tensor and shard
        # else this conversion made them: a cast that overflows (float16 ends at 65504)
        how = (
            f"casting to {cfg.dtype} overflows; convert without --dtype, or to bfloat16" if cfg.dtype else ""
        )
        return stream.error(
            f"{cfg.source} converted to {rank_file}",
            f"The source's weights are finite: {how or 'the conversion made them; please report it'}.",
        )

    padded, stages = _plan(spec, cfg)
    cast = cfg.dtype
    src_dtype = reader.dtype(fam.hf_keys("embedding")[0])
    check_space(
        cfg.target,
        _layout_bytes(cfg, fam, spec, stages, padded, cast or src_dtype),
        "the converted checkpoint",
    )

    def rank_fn(role: str, layer: Optional[int], r: int):
        kind = role_kind(role)
        t = read_rank(
            kind,
            reader.read,
            fam.hf_keys(role, -1 if layer is None else layer),
            fam.part_rows(spec, role),
            cfg.tp,
            r,
            full_shape=spec.full_shape(role),
            groups=spec.num_groups,
            heads_per_group=spec.heads_per_group,
            head_dim=spec.head_dim,
            padded_vocab=padded,
        )
        if role == "output" and spec.norm_head:  # Baichuan2 NormHead: a plain output layer needs unit rows
            import torch

            t = as_tensor(t)
            t = torch.nn.functional.normalize(t.float(), dim=-1).to(t.dtype)
        if cast is not None and piece_info(t)[1] != cast and role not in KEEP_DTYPE:
            t = as_tensor(t).to(torch_dtype(cast))
        return t

    try:
        meta, written = _save_megatron(
            cfg,
            "hf_to_megatron",
            fam,
            spec,
            stages,
            padded,
            cast or src_dtype,
            rank_fn,
            progress,
            Path(cfg.source),
            "converted weights folder",
            (src_man, src_hash),
            # rank_fn only reads (pread, or slices of a mapped .bin), so it is thread-safe
            _workers(cfg, cfg.tp * cfg.pp * cfg.ep),
            nonfinite,
            check_seconds,
        )
    finally:
        reader.close()
    return dict(
        meta,
        target=str(cfg.target),
        bytes_read=reader.weight_bytes(),
        bytes_written=written,
        rank_files=cfg.tp * cfg.pp * cfg.ep,
        seconds=round(time.perf_counter() - t0, 3),
        weights_check_seconds=round(sum(check_seconds), 4),
        **_provenance(src_man, src_hash),
    )


def megatron_to_hf(cfg: ConvertConfig, progress: bool = True) -> dict:
    """Merge a Megatron checkpoint (any TP x PP) into one HF folder that loads with from_pretrained.

    Streaming: every HF tensor is a list of byte ranges of the rank files, copied through one small buffer when its
    shard is written, so memory stays a few MB whatever the model size (and torch is not needed)."""
    t0 = time.perf_counter()
    check(cfg)
    src_man = source_manifest(cfg.source, "megatron_to_hf")
    src_hash = source_identity(cfg.source, src_man)
    mr = MegatronReader(cfg.source)
    fam, spec, cfg_dir = source_spec(mr, cfg.hf_config_dir, cfg.family)
    stages = stages_of(mr, spec)
    check_megatron_keys(mr, fam, spec, stages)
    glob, _ = fam.roles(spec)
    check_space(cfg.target, _hf_bytes(fam, spec, cfg.dtype or arg_dtype(mr.args)), "the converted checkpoint")

    def emit(writer: HFWriter, role: str, layer: int) -> None:
        kind = role_kind(role)
        s, path, e, parts = role_pieces(mr, stages, role, layer, spec)
        what = f"{layout.rank_dir(0, s, mr.pp, e, mr.ep)}: {'.'.join(path)}"
        if not all(
            isinstance(p, FileSlice) for p in parts
        ):  # a tensor not stored contiguously: merge in memory
            full = merge_tp(kind, [as_tensor(p) for p in parts], what=what)
            hparts = full_to_parts(
                kind, full, spec.num_groups, spec.heads_per_group, spec.head_dim, spec.vocab_size
            )
            hparts = [p.clone() for p in hparts]
        else:
            if kind == "replicated" and not same_bytes(parts):
                raise ConversionError(
                    [
                        f"{what}: replicated tensor differs between TP ranks; the checkpoint is inconsistent "
                        f"(files from different runs?)"
                    ],
                    f"Megatron checkpoint {mr.folder}",
                )
            if kind == "vocab" and sum(p.shape[0] for p in parts) < spec.vocab_size:
                raise ConversionError(
                    [
                        f"{what} has {sum(p.shape[0] for p in parts)} rows over {mr.tp} TP rank(s), fewer than the "
                        f"vocabulary {spec.vocab_size} of config.json"
                    ],
                    f"Megatron checkpoint {mr.folder}",
                )
            hparts = hf_parts(
                kind, parts, spec.num_groups, spec.heads_per_group, spec.head_dim, spec.vocab_size
            )
        grouped: Dict[str, list] = {}
        for key, part in zip(fam.hf_keys(role, layer), hparts):
            grouped.setdefault(key, []).append(part)
        for key, ps in grouped.items():
            writer.add(key, Rows(ps) if len(ps) > 1 else ps[0])

    with atomic_dir(cfg.target, overwrite=cfg.overwrite, what="HF output folder") as tmp:
        writer = HFWriter(tmp, cfg.max_shard_mb * 1024**2, check=StreamCheck())
        emit(writer, "embedding", -1)
        bar = _progress(spec.num_layers, f"Megatron TP{mr.tp} PP{mr.pp} EP{mr.ep}->HF", not progress)
        for g in range(spec.all_layers):  # the decoder's layers, then the MTP layers
            for role in fam.layer_roles(spec, g):
                emit(writer, role, g)
            bar.update(1)
        bar.close()
        for role in glob[1:]:
            emit(writer, role, -1)
        writer.close()
        if writer.check.bad:  # NaN / inf weights are not published (counted as the shards were written)
            raise writer.check.error(f"{cfg.source}, converted")
        copy_side_files(cfg_dir, tmp)
        save_config(cfg, tmp, "convert_config.json")
        source_layout = {"tp": mr.tp, "pp": mr.pp, "ep": mr.ep, "flavor": mr.flavor}
        write_hf_manifest(tmp, cfg.target, cfg.source, spec, source_layout, src_man, src_hash)
    unverified = mr.unchecked_files()
    mr.close()
    return {
        "direction": "megatron_to_hf",
        "source": str(cfg.source),
        "target": str(cfg.target),
        "family": spec.family,
        "tp": mr.tp,
        "pp": mr.pp,
        "ep": mr.ep,
        "flavor": mr.flavor,
        "bytes_written": writer.total_bytes,
        "crc_unverified": unverified,
        "seconds": round(time.perf_counter() - t0, 3),
        "weights_check_seconds": round(writer.check.seconds, 4),
        **_provenance(src_man, src_hash),
    }


def megatron_to_megatron(cfg: ConvertConfig, progress: bool = True) -> dict:
    """Re-shard a Megatron checkpoint to cfg.tp x cfg.pp (and cfg.flavor) without an HF round trip."""
    t0 = time.perf_counter()
    check(cfg)
    src_man = source_manifest(cfg.source, "megatron_to_megatron")
    src_hash = source_identity(cfg.source, src_man)
    mr = MegatronReader(cfg.source)
    fam, spec, cfg_dir = source_spec(mr, cfg.hf_config_dir, cfg.family)
    padded, stages = _plan(spec, cfg)
    full = merged_tensor_fn(mr, spec, fam)
    cast = cfg.dtype
    dtype = cast or arg_dtype(mr.args)
    check_space(cfg.target, _layout_bytes(cfg, fam, spec, stages, padded, dtype), "the converted checkpoint")

    def rank_fn(role: str, layer: Optional[int], r: int):
        kind = role_kind(role)
        t = full(role, layer)
        if kind == "vocab":
            t = t[: spec.vocab_size]
        t = split_tp(kind, t, cfg.tp, padded)[r].clone()
        return t.to(torch_dtype(cast)) if cast is not None and role not in KEEP_DTYPE else t

    meta, written = _save_megatron(
        cfg,
        "megatron_to_megatron",
        fam,
        spec,
        stages,
        padded,
        dtype,
        rank_fn,
        progress,
        cfg_dir,
        "re-sharded weights folder",
        (src_man, src_hash),
        nonfinite=lambda check, rank_file: check.error(f"{cfg.source} re-sharded"),
    )
    mr.close()
    return dict(
        meta,
        target=str(cfg.target),
        bytes_written=written,
        rank_files=cfg.tp * cfg.pp * cfg.ep,
        seconds=round(time.perf_counter() - t0, 3),
        **_provenance(src_man, src_hash),
    )


def _provenance(src_man, src_hash: tuple) -> dict:
    """Summary keys saying what the source was: its manifest (kind, hash) or that it had none."""
    return {
        "source_kind": src_man.kind if src_man is not None else None,
        "source_sha256": src_hash[0],
        "source_note": None
        if src_man is not None
        else "the source has no kit manifest (made by another tool); accepted, checked against its own "
        "config/args, and identified by a hash of its config and shard headers",
    }


def convert(cfg: ConvertConfig, progress: bool = True) -> dict:
    """Run the conversion cfg.direction names; returns its summary."""
    check(cfg)
    fn = {
        "hf_to_megatron": hf_to_megatron,
        "megatron_to_hf": megatron_to_hf,
        "megatron_to_megatron": megatron_to_megatron,
    }[cfg.direction]
    from kit.storage.locks import hold
    from kit.storage.partial import handle_partials

    target = Path(cfg.target)
    # one writer per target, from before the first read to the rename (kit/storage/locks.py); under the lock, the
    # leftovers found are no other run's work in progress
    with hold(target, "conversion target"):
        left = handle_partials(target.parent, clean=cfg.clean_partial, name=target.name)
        summary = fn(cfg, progress=progress)
    summary["leftover_partials"] = [
        {"path": x["path"], "mib": round(x["bytes"] / 1024**2, 1), "removed": x["path"] in left["removed"]}
        for x in left["found"]
    ]
    return summary
