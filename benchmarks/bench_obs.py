"""OBS benchmark against a local S3-compatible server (SeaweedFS on 127.0.0.1, tests/s3_standin.py).

1. Checkpoint upload / download: the kit's OBS_HOME transfer of a real DeepSpeed checkpoint folder (kit.train.obs_home:
   CRC-32 of every file, a node record and the complete marker last; kit.storage.obs.download_files: verified) against the
   OBS SDK's own `uploadFile` / `downloadFile` of the same files with the same part size and threads.
2. Step time while checkpoints upload in the background (the trainer's hook, CheckpointUploads: its uploader child
   process) vs no upload (same engine, same steps, alternated).
Ratios: the SDK's time / the kit's, and the step time without upload / with it (1.0 means no cost). The server runs
on the training's CPUs here, which a real OBS endpoint does not: its CPU is counted, not excluded, and the step time
is measured three times: with the server niced 10 (as the tests run it) and niced 19 (as the uploader), both on
every CPU the training uses (lower bounds with no goal: a host whose CPUs the training saturates), and with the server
and the uploader pinned to a CPU the training does not use (the goal: a remote endpoint, and an Ascend host's idle
cores; a 1-CPU machine keeps the goal on the niced-19 row). A window with uploads lasts until one has finished. Each
prints the uploads finished during the steps and the server's and the uploader's CPU meanwhile.

Run: .venv/bin/python benchmarks/bench_obs.py [--quick] [--hidden 512 --layers 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

TRANSFER_GOAL, STEP_GOAL = 0.9, 0.9


def _steps(engine, n: int, until=None) -> float:
    """Seconds per optimizer step, median of n steps, or of as many as it takes for `until()` to hold (at most
    50 n): a window with uploads must contain a finished one, or it would measure steps beside an idle uploader."""
    import statistics

    import torch

    ids = torch.randint(0, 32000, (1, 64))
    out = []
    while len(out) < n or (until is not None and not until() and len(out) < 50 * n):
        t = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _children_cpu() -> dict:
    """{command name: CPU seconds} of this process's children (Linux /proc; {} elsewhere): the S3 server, the
    uploader process."""
    out: dict = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        comm, rest = raw[raw.index("(") + 1 : raw.rindex(")")], raw[raw.rindex(")") + 2 :].split()
        if int(rest[1]) == os.getpid():  # ppid
            out[comm] = out.get(comm, 0.0) + (int(rest[11]) + int(rest[12])) / tick  # utime + stime
    return out


def _server_nice19() -> None:
    """Every thread of the S3 server (this process's child `weed`) to nice 19; the threads it starts inherit it."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        if (
            raw[raw.index("(") + 1 : raw.rindex(")")] == "weed"
            and int(raw[raw.rindex(")") + 2 :].split()[1]) == os.getpid()
        ):
            for task in (stat.parent / "task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
            return
    raise RuntimeError("no S3 server (weed) among this process's children")


def _threads_of(pid: int) -> list:
    return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]


def _pin_server_apart() -> None:
    """The S3 server's and the uploader's threads on the last CPU, this process's (the training) on the rest: the
    server then takes no CPU from the training, as a remote OBS endpoint takes none, and the uploader runs on a CPU
    the training leaves idle, as on an Ascend host (tens of CPU cores per card). What the training still shares is
    the process boundary, memory bandwidth and the page cache. Both arms of the comparison run pinned."""
    cpus = sorted(os.sched_getaffinity(0))
    server, rest = {cpus[-1]}, set(cpus[:-1])
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat.read_text()
        except OSError:
            continue
        if int(raw[raw.rindex(")") + 2 :].split()[1]) == os.getpid():  # ppid: the server or the uploader
            for tid in _threads_of(int(stat.parent.name)):
                os.sched_setaffinity(tid, server)  # the uploader's later threads inherit its affinity
    for tid in _threads_of(os.getpid()):
        os.sched_setaffinity(tid, rest)
    import torch

    torch.set_num_threads(
        len(rest)
    )  # torch's threads on fewer CPUs than threads would spin against each other


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model (about 10M parameters), fewer steps")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.repeats, args.steps = 256, 2, 2, 10
    import s3_standin
    from bench_checkpoint import engine_for

    from kit.storage import obs
    from kit.storage.hashes import crc32_file
    from kit.train import checkpoint as ck
    from kit.train.obs_home import CheckpointUploads

    engine, params = engine_for(args.hidden, args.layers)
    root = Path(tempfile.mkdtemp(prefix="bench-obs-"))
    try:
        # 64 volumes (16 GiB): a deleted object frees no space, and every upload of the step-time loop stores 210 MiB
        with s3_standin.seaweed(root / "server", "bench-" + secrets.token_hex(8), volumes=64) as env:
            os.environ.update(env)
            folder = ck.save(engine, root / "run" / "checkpoints", 1, {"iteration": 1, "consumed_samples": 1})
            (root / "run" / "config.json").write_text("{}")
            files = obs.local_files(folder)
            size = sum((folder / f).stat().st_size for f in files)
            store = obs.Store(s3_standin.BUCKET)
            client, part, threads = store.client, store.part_size, store.threads

            class Cfg:  # the fields CheckpointUploads reads
                obs_home, model_name, node_rank, nnodes = f"obs://{s3_standin.BUCKET}/bench", "m", 0, 1

            times = {"sdk_up": [], "kit_up": [], "sdk_down": [], "kit_down": []}
            listing = {f: crc32_file(folder / f) for f in files}

            def sdk_up(r):
                for f in files:
                    resp = client.uploadFile(
                        store.bucket,
                        f"sdk{r}/{f}",
                        str(folder / f),
                        partSize=part,
                        taskNum=threads,
                        enableCheckpoint=True,
                    )
                    assert resp.status < 300, resp.errorCode

            def kit_up(r):
                home = type("Cfg", (Cfg,), {"obs_home": f"obs://{s3_standin.BUCKET}/bench/kit{r}"})
                up = CheckpointUploads(home, root / "run")  # it takes the prefix's writer lease
                up._upload(folder, 1)  # what the uploader child runs for one checkpoint
                up.finish()

            def sdk_down(r):
                for f in files:
                    (root / f"sdk-down{r}" / f).parent.mkdir(parents=True, exist_ok=True)
                    resp = client.downloadFile(
                        store.bucket,
                        f"sdk{r}/{f}",
                        str(root / f"sdk-down{r}" / f),
                        partSize=part,
                        taskNum=threads,
                        enableCheckpoint=True,
                    )
                    assert resp.status < 300, resp.errorCode

            def kit_down(r):
                prefix = f"bench/kit{r}/m/run/checkpoints/iter_0000001"
                assert not obs.download_files(store, prefix, listing, root / f"kit-down{r}")

            jobs = {"sdk_up": sdk_up, "kit_up": kit_up, "sdk_down": sdk_down, "kit_down": kit_down}
            for r in range(args.repeats):
                for pair in (("sdk_up", "kit_up"), ("sdk_down", "kit_down")):
                    for name in pair if r % 2 == 0 else pair[::-1]:  # alternated: neither always goes first
                        t = time.perf_counter()
                        jobs[name](r)
                        times[name].append(time.perf_counter() - t)
                shutil.rmtree(root / f"sdk-down{r}"), shutil.rmtree(root / f"kit-down{r}")
            best = {k: min(v) for k, v in times.items()}
            # step time with checkpoint uploads running in the background, through the trainer's own hook
            # (CheckpointUploads: its uploader child process), one after another until the steps end
            stop = threading.Event()

            def uploading(up, done):
                n = len(done)
                while not stop.is_set():
                    n += 1
                    up.after_save(folder, n)
                    while len(up.uploaded) + len(up.errors) < n:
                        time.sleep(0.05)
                    assert not up.errors, up.errors
                    done.append(n)

            def measure():
                """(step times without, with uploads running, CPU shares of the children meanwhile)."""
                quiet, busy, cpu = [], [], {}
                for _ in range(args.repeats):
                    quiet.append(_steps(engine, args.steps))
                    stop.clear()
                    th = threading.Thread(target=uploading, args=(up, done), daemon=True)
                    th.start()
                    time.sleep(0.2)
                    before, t, n0 = _children_cpu(), time.perf_counter(), len(done)
                    busy.append(_steps(engine, args.steps, until=lambda n0=n0: len(done) > n0))
                    after, seconds, n1 = _children_cpu(), time.perf_counter() - t, len(done)
                    stop.set()
                    th.join()
                    for key in store.list("bench/m/run/checkpoints/"):  # keep the server's disk small
                        store.delete(key)
                    for k in after:  # summed over the windows, shares of the summed window time below
                        cpu[k] = cpu.get(k, 0.0) + after.get(k, 0.0) - before.get(k, 0.0)
                    cpu["uploads"] = cpu.get("uploads", 0) + n1 - n0
                    cpu["seconds"] = cpu.get("seconds", 0.0) + seconds
                return quiet, busy, cpu

            up, done = CheckpointUploads(Cfg, root / "run"), []
            _steps(engine, 3)  # warm-up
            steps = {"niced 10": measure()}  # the server as the tests run it
            _server_nice19()  # as close to a remote OBS as one host allows: it yields as the uploader does
            steps["niced 19"] = measure()
            if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
                _pin_server_apart()
                steps["and uploader on a CPU of their own"] = measure()
            up.finish()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"checkpoint of {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB in {len(files)} files",
        file=sys.stderr,
    )
    for what, kit_key, sdk_key, code in (
        (
            "upload",
            "kit_up",
            "sdk_up",
            "for f in files: client.uploadFile(bucket, key, f, partSize, taskNum, enableCheckpoint=True)",
        ),
        (
            "download",
            "kit_down",
            "sdk_down",
            "for f in files: client.downloadFile(bucket, key, f, partSize, taskNum, enableCheckpoint=True)",
        ),
    ):
        ratio = best[sdk_key] / best[kit_key]
        verdict = "MET" if ratio >= TRANSFER_GOAL else "MISSED"
        print(
            f"train | OBS checkpoint {what} (verified, marker last) | {ratio:.2f}x | goal >= {TRANSFER_GOAL}x | {verdict}"
        )
        print(
            f"    kit {best[kit_key]:.2f} s vs OBS SDK {best[sdk_key]:.2f} s, {size / 2**20:.0f} MiB, part "
            f"{part >> 20} MiB x {threads} threads, local SeaweedFS (best of {args.repeats})"
        )
        print(f"    baseline: {code}")
    for how, (quiet, busy, cpu) in steps.items():
        # the median window, not the fastest: a window in which the upload happened to move little would flatter
        ratio = statistics.median(quiet) / statistics.median(busy)
        share = {k: cpu.get(k, 0.0) / max(cpu.get("seconds", 0.0), 1e-9) for k in ("weed", "python")}
        goal, verdict = ("-", "-")  # the server as the tests run it: a lower bound, no goal
        where = f"{how} on the same CPUs" if how.startswith("niced") else how
        if how.startswith("and uploader") or (how == "niced 19" and len(steps) == 2):
            goal, verdict = f">= {STEP_GOAL}x", "MET" if ratio >= STEP_GOAL else "MISSED"
        print(
            f"train | step time while a checkpoint uploads, S3 server {where} | {ratio:.2f}x | "
            f"goal {goal} | {verdict}"
        )
        print(
            f"    {statistics.median(busy) * 1000:.0f} ms with a background upload vs "
            f"{statistics.median(quiet) * 1000:.0f} ms without (median of {args.steps} steps or more, median of "
            f"{args.repeats} windows); meanwhile {cpu.get('uploads', 0)} upload(s) of {size / 2**20:.0f} MiB finished "
            f"and of {os.cpu_count()} CPUs the S3 server used {share['weed']:.2f}, the uploader process "
            f"{share['python']:.2f} (counted)"
        )
    print(f"    {len(done)} checkpoint uploads in all; baseline: the same steps with no upload running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
