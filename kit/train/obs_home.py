"""OBS_HOME: a run whose home is an OBS prefix (job nodes without a shared disk), hooked into the trainer.

Layout under OBS_HOME (obs://bucket/prefix): `inputs/<name>/` (DATASET_PATH / MODEL_PATH given as obs:// are
downloaded from wherever they are), `<model_name>/<run>/config.json` and `<model_name>/<run>/checkpoints/iter_N/`.
Every checkpoint is saved locally as before; then each node's local rank 0 uploads the files its node holds in a
background process at the lowest CPU priority (training goes on), and records them in `iter_N/.kit-node-<node>.json`.
Node 0, once every node's record is there, uploads `iter_N/kit_obs_complete.json` last: only a checkpoint with that
marker is complete in OBS, and only such a checkpoint is resumed. `retrain` downloads, on each node, node 0's files
(model, optimizer, trainer state) and its own (its ranks' RNG / optimizer shards) of the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

from kit.errors import KitError, MissingInputError
from kit.storage import obs
from kit.storage.atomic import atomic_write_text
from kit.storage.hashes import crc32_file
from kit.storage.obs_lease import Lease
from kit.system.lifetime import die_with_parent
from kit.train import checkpoint

COMPLETE = (
    "kit_obs_complete.json"  # uploaded last, after every node's files: the checkpoint is complete in OBS
)
NODE_RECORD = ".kit-node-{node}.json"
NODES_WAIT_S = (
    600.0  # node 0 waits this long for the other nodes' uploads, then leaves the checkpoint incomplete
)
FETCH_WAIT_S = 300.0  # the other local ranks wait this long for their node's download


def node_rank(cfg) -> int:
    return int(os.environ.get("GROUP_RANK", cfg.node_rank))  # torchrun's name for this node's index


def run_url(cfg, out: Path) -> str:
    """OBS_HOME/<model_name>/<run folder>: where this run's config and checkpoints go."""
    return obs.join(cfg.obs_home, cfg.model_name, Path(out).name)


INPUTS = "obs_inputs.json"  # beside config.json in OBS: which inputs came from obs:// (a resume fetches them again)


PATH_FIELDS = ("dataset_path", "model_path", "tokenizer_path")


def local_dest(cfg, url: str) -> Path:
    """Where this node keeps the obs:// input folder `url`: <workspace>/obs_inputs/<bucket>/<prefix>."""
    bucket, prefix = obs.split(url)
    return cfg.workspace().root / "obs_inputs" / bucket / prefix


def localize_inputs(cfg, urls: Optional[dict] = None):
    """DATASET_PATH / MODEL_PATH / TOKENIZER_PATH given as obs:// (or `urls`: field -> obs://) are downloaded once
    per node into the workspace (resumably, verified) and replaced by the local folder.

    Returns (the config with local paths, {field: obs:// url})."""
    import dataclasses

    from kit.train.config import replace

    urls = dict(urls or {})
    urls.update({n: getattr(cfg, n) for n in PATH_FIELDS if obs.is_obs(getattr(cfg, n))})
    changes, fetched = {}, set()
    for name, url in sorted(urls.items()):
        dest = local_dest(cfg, url)
        if url not in fetched:
            _once_per_node(dest, lambda u=url, d=dest: obs.download_folder(u, d, timeout_s=FETCH_WAIT_S))
            fetched.add(url)
        changes[name] = str(dest)
    if not changes:
        return cfg, urls
    if cfg.given >= set(changes):
        return replace(cfg, **changes), urls
    return dataclasses.replace(cfg, **changes), urls  # a resolved (saved) config: every field is set anyway


def inputs_of(cfg, urls: dict) -> dict:
    """{field: obs:// url} for every path field of the resolved `cfg` that is a downloaded input folder (resolve()
    may have filled TOKENIZER_PATH from MODEL_PATH): what a resume on another node must fetch again."""
    dests = {local_dest(cfg, u).resolve(): u for u in urls.values()}
    out = {}
    for name in PATH_FIELDS:
        value = getattr(cfg, name)
        if value and not obs.is_obs(value) and Path(value).resolve() in dests:
            out[name] = dests[Path(value).resolve()]
    return out


def saved_inputs(out: Path) -> dict:
    """The {field: obs:// url} a resumed run's inputs came from (fetched by fetch_for_resume), or {}."""
    path = Path(out) / INPUTS
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _once_per_node(dest: Path, work) -> None:
    """Local rank 0 runs `work` and leaves a done-file; the node's other ranks wait for it (bounded)."""
    done = Path(str(dest) + ".kit-fetched")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        done.unlink(missing_ok=True)
        work()
        done.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(done, "ok\n")
        return
    deadline = time.monotonic() + FETCH_WAIT_S
    while not done.is_file():
        if time.monotonic() > deadline:
            raise MissingInputError(
                f"local rank 0 did not finish downloading {dest} in {FETCH_WAIT_S:.0f} s."
            )
        time.sleep(0.5)


def _complete_iterations(store: obs.Store, prefix: str) -> List[int]:
    found = []
    for key in store.list(prefix + "/checkpoints/"):
        parts = key[len(prefix) + 1 :].split("/")
        if (
            len(parts) == 3
            and parts[2] == COMPLETE
            and parts[1].startswith("iter_")
            and parts[1][5:].isdigit()
        ):
            found.append(int(parts[1][5:]))
    return sorted(found, reverse=True)


def fetch_for_resume(cfg, out: Path) -> List[str]:
    """Before a retrain: bring this node the run's config.json and its part of the newest checkpoint complete in
    OBS, and point the local `latest` markers at it. Returns the files this node needs that OBS lacks."""
    store, prefix = obs.store_for(run_url(cfg, out))
    ckpt_root = Path(out) / "checkpoints"
    missing: List[str] = []

    def work():
        config = store.get_bytes(f"{prefix}/config.json")
        if config is None:
            raise MissingInputError(
                f"RUN_TYPE=retrain: {obs.join(run_url(cfg, out), 'config.json')} is missing, so there is no run "
                f"to resume in OBS_HOME — check OBS_HOME, MODEL_NAME and RESUME_FROM."
            )
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(out) / "config.json", config.decode())
        inputs = store.get_bytes(f"{prefix}/{INPUTS}")
        if inputs is not None:
            atomic_write_text(Path(out) / INPUTS, inputs.decode())
        complete = _complete_iterations(store, prefix)
        if not complete:
            raise MissingInputError(
                f"{run_url(cfg, out)} holds no complete checkpoint (none has {COMPLETE})."
            )
        it = complete[0]
        key = f"{prefix}/checkpoints/{checkpoint.tag_of(it)}"
        nodes = json.loads(store.get_bytes(f"{key}/{COMPLETE}"))["nodes"]
        mine = node_rank(cfg)
        need = dict(nodes["0"])
        need.update(nodes.get(str(mine), {}))
        missing.extend(obs.download_files(store, key, need, ckpt_root / checkpoint.tag_of(it)))
        atomic_write_text(ckpt_root / checkpoint.LATEST, checkpoint.tag_of(it))
        atomic_write_text(ckpt_root / checkpoint.MEGATRON_LATEST, str(it))

    _once_per_node(ckpt_root, work)
    return missing


def missing_line(missing: List[str], folder: Path) -> str:
    return (
        f"this node lacks its part of the checkpoint to resume: {', '.join(missing[:8])} missing in {folder} and in "
        f"OBS; the job stops (restore them to OBS or resume an older checkpoint)."
    )


def _sealed(folder: Path) -> dict:
    """{relative name: {"bytes", "crc32"}} from the checkpoint's checksums.json ({} when it has none)."""
    try:
        return json.loads((Path(folder) / checkpoint.CHECKSUMS).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError):
        return {}


def _lower_priority() -> None:
    """Put the calling process (the uploader child) behind the training on the CPU: nice 19, inherited by the
    threads it starts (a nice-0 training thread gets about 70 times its share of a contended CPU). Not SCHED_IDLE
    (a fifth of that share): uploads must still progress where the training keeps every CPU busy (training on CPU)."""
    try:
        os.nice(19 - os.nice(0))
    except (AttributeError, OSError):
        pass  # not allowed: uploads still run, at the training's priority


def upload_checkpoint(job: dict, sent: Callable[[str], None] = lambda rel: None) -> None:
    """One checkpoint's upload (what the uploader child runs): this node's files (`sent` is told each), its node
    record, and on node 0, once every node's record is there, the complete marker last, if the run's writer lease is
    still node 0's. `job`: url, out, node, nnodes, inputs, folder, iteration, lease (plain values: it crosses a pipe)."""
    store, prefix = obs.store_for(job["url"])
    node, nnodes, iteration, folder = job["node"], job["nnodes"], job["iteration"], Path(job["folder"])
    key = f"{prefix}/checkpoints/{checkpoint.tag_of(iteration)}"
    lease = Lease(store, prefix, "training run", **job.get("lease", {})) if node == 0 else None
    if lease is not None:
        lease.check()  # another writer took the run's prefix over: touch nothing there
    for stale in (COMPLETE, NODE_RECORD.format(node=node)):
        if node == 0 or stale != COMPLETE:
            store.delete(f"{key}/{stale}")  # a re-save of the same iteration is incomplete until done
    if node == 0:
        store.put_file(f"{prefix}/config.json", Path(job["out"]) / "config.json")
        store.put_bytes(f"{prefix}/{INPUTS}", json.dumps(job["inputs"], indent=1).encode())
    files = {}
    sealed = _sealed(folder)  # the CRCs checkpoint.save computed: no second read of the files
    for rel in obs.local_files(folder):
        files[rel] = sealed.get(rel) or crc32_file(folder / rel)
        store.put_file(f"{key}/{rel}", folder / rel)
        sent(rel)
    record = json.dumps({"node": node, "files": files}, indent=1).encode()
    store.put_bytes(f"{key}/{NODE_RECORD.format(node=node)}", record)
    if node != 0:
        return
    nodes = {"0": files}
    deadline = time.monotonic() + NODES_WAIT_S
    for other in range(1, nnodes):
        raw = store.get_bytes(f"{key}/{NODE_RECORD.format(node=other)}")
        while raw is None:
            if time.monotonic() > deadline:
                raise MissingInputError(
                    f"node {other} did not upload its part of {checkpoint.tag_of(iteration)} within "
                    f"{NODES_WAIT_S:.0f} s; that checkpoint stays incomplete in OBS"
                )
            time.sleep(1.0)
            raw = store.get_bytes(f"{key}/{NODE_RECORD.format(node=other)}")
        nodes[str(other)] = json.loads(raw)["files"]
    marker = {"iteration": iteration, "nnodes": nnodes, "nodes": nodes}
    lease.check()
    store.put_bytes(f"{key}/{COMPLETE}", json.dumps(marker, indent=1).encode())


def _serve() -> None:
    """The uploader child's loop: one JSON job a line on stdin, one JSON reply a line on the original stdout (the
    SDK's and anyone's prints go to stderr); ends on EOF. SIGTERM/SIGINT (a launcher's, to the process group) are
    the trainer's to handle: it checkpoints, then waits here for the uploads."""
    import signal
    import sys

    die_with_parent()  # SIGKILL: a killed trainer leaves no uploader behind; a cut upload never gets its marker
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _lower_priority()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def sent(rel: str) -> None:  # progress: what a cut upload (the grace period's end) did send
        replies.write(json.dumps({"sent": rel}) + "\n")
        replies.flush()

    for line in sys.stdin:
        try:
            upload_checkpoint(json.loads(line), sent)
            reply = {"ok": True}
        except Exception as exc:  # reported to the trainer, which warns; this checkpoint stays incomplete
            reply = {"ok": False, "error": str(exc) or type(exc).__name__}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class CheckpointUploads:
    """The trainer's OBS checkpoint hook: after_save() queues a saved checkpoint for upload, finish() waits for them
    (up to a deadline: a preempted job's grace period), close() stops them when the run fails. On node 0 it holds the
    run's writer lease (kit.storage.obs_lease) from its start to finish(): a second run into the same prefix stops.

    The uploads run in a child process at the lowest CPU priority (nice 19): in a thread of the trainer they
    took the GIL and the CPU from the training steps (benchmarks/bench_obs.py)."""

    def __init__(self, cfg, out: Path, inputs: Optional[dict] = None):
        self.url = run_url(cfg, out)
        self.inputs = dict(inputs or {})
        self.store, self.prefix = obs.store_for(self.url)  # no credentials or no SDK: fails here, in one line
        self.out, self.node, self.nnodes = Path(out), node_rank(cfg), max(1, int(cfg.nnodes))
        self.enabled = int(os.environ.get("LOCAL_RANK", "0")) == 0  # one uploader per node
        self.queue: queue.Queue[Optional[tuple]] = queue.Queue()
        self.errors: List[str] = []  # what did not reach OBS, one line each: the run does not end "completed"
        self.uploaded: List[int] = []
        self.child = None  # the uploader process (subprocess.Popen), once the first checkpoint is queued
        self.current: Optional[tuple] = None  # the checkpoint being uploaded; `sent`: its files sent so far
        self.sent: set = set()
        self.cut = False  # finish()'s deadline passed: no further upload starts
        self._lock = threading.Lock()
        self.lease: Optional[Lease] = None
        if self.enabled and self.node == 0:
            lease = Lease(self.store, self.prefix, "training run")
            # an earlier attempt of this run that was killed holds the prefix for at most one lease term
            self.lease = lease.take(wait_s=lease.term * 1.25, note=lambda line: print(line, flush=True))
        self.thread = threading.Thread(target=self._work, name="kit-obs-upload", daemon=True)
        if self.enabled:
            self.thread.start()

    def after_save(self, folder: Path, iteration: int) -> None:
        if self.enabled:
            folder = Path(folder)
            if not folder.is_dir():  # another node's rank 0 renamed it: here it is still the partial name
                folder = folder.parent / f".partial-{folder.name}"
            self.queue.put((folder, iteration))

    def _job(self, folder: Path, iteration: int) -> dict:
        return {
            "url": self.url,
            "out": str(self.out),
            "node": self.node,
            "nnodes": self.nnodes,
            "inputs": self.inputs,
            "folder": str(folder),
            "iteration": iteration,
            "lease": self.lease.ref() if self.lease else {},
        }

    def _upload(self, folder: Path, iteration: int) -> None:
        """One checkpoint's upload in this process (what the child runs for each queued one)."""
        upload_checkpoint(self._job(folder, iteration))

    def _child(self):
        """The uploader process (started by this thread: it dies with it), or None where it cannot start."""
        import subprocess
        import sys

        import kit

        env = dict(os.environ)  # credentials pass in memory, as the trainer got them
        root = str(Path(kit.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        code = "from kit.train.obs_home import _serve; _serve()"
        from kit.system.procs import Proc

        # dies with this thread (the parent-death signal), as the uploads it serves do
        return Proc([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stderr=None)

    def _reply(self, child) -> dict:
        """The child's reply to the job it was given, noting the files it reports sent on the way."""
        while True:
            line = child.stdout.readline()
            if not line:
                return {"ok": False, "error": "the uploader process died"}
            msg = json.loads(line)
            if "sent" not in msg:
                return msg
            self.sent.add(msg["sent"])

    def _work(self) -> None:
        child = None
        try:
            while True:
                item = self.queue.get()
                try:
                    with self._lock:  # a cut starts no further upload
                        if item is None or self.cut:
                            return
                        self.current, self.sent = item, set()
                        if child is None or child.poll() is not None:
                            child = self.child = self._child()  # the first, or one after the last died
                        child.stdin.write(json.dumps(self._job(*item)) + "\n")
                        child.stdin.flush()
                    reply = self._reply(child)
                    if not reply["ok"]:
                        raise RuntimeError(reply["error"])
                    self.uploaded.append(item[1])
                except Exception as exc:  # reported by finish(); the training goes on
                    if not self.cut:  # a cut is reported as a whole
                        self.errors.append(f"upload of checkpoint {item[1]} to {self.url} failed: {exc}")
                finally:
                    with self._lock:
                        self.current = None
        finally:
            if child is not None:
                with contextlib.suppress(OSError):
                    child.stdin.close()
                child.wait()

    def _cut(self, why: str) -> str:
        """Stop the uploads where they are (kill the uploader: what it was sending stays without its marker) and
        say what did not reach OBS."""
        with self._lock:
            self.cut = True
            current = self.current
            pending = [current] if current else []
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self.queue.get_nowait()
                    if item is not None:
                        pending.append(item)
            self.queue.put(None)
            if self.child is not None and self.child.poll() is None:
                self.child.kill()
        self.thread.join(30.0)  # the killed child's pipe ends at once
        files, size, parts = 0, 0, []
        for folder, iteration in (p for p in pending if p[1] not in self.uploaded):
            sent = self.sent if (folder, iteration) == current else set()
            names = [rel for rel in obs.local_files(folder) if rel not in sent]
            files += len(names)
            size += sum((Path(folder) / rel).stat().st_size for rel in names)
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{checkpoint.tag_of(iteration)}: {', '.join(names[:3]) or 'its records'}{more}")
        return (
            f"the OBS upload was cut at {why}: {files} file(s), {size} bytes not uploaded ({'; '.join(parts)}); "
            f"in {self.url}/checkpoints they stay incomplete (no {COMPLETE}: a resume takes the newest complete "
            f"checkpoint), and the local checkpoints are whole"
        )

    def finish(self, deadline: Optional[float] = None, why: str = "the deadline") -> List[str]:
        """Wait for the queued uploads (the job must not end before them), until `deadline` (time.monotonic()) if
        given, then cut them (`why`: which deadline); give the writer lease back. The lines for the run's log: what
        failed or was not uploaded, then what was uploaded."""
        if self.enabled and self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self.thread.is_alive():
                self.errors.append(self._cut(why))
        if self.lease is not None:
            with contextlib.suppress(KitError):  # OBS unreachable: the lease expires by itself
                self.lease.release()
            self.lease = None
        done = [f"uploaded checkpoint(s) {self.uploaded} to {self.url}"] if self.uploaded else []
        return [f"warning: {e}" for e in self.errors] + done

    def close(self) -> None:
        """The run failed: stop the uploads where they are and give the lease back (no process left writing)."""
        self.finish(deadline=time.monotonic(), why="the run's failure")


def checkpoint_hooks(plan) -> list:
    """The trainer's checkpoint hooks for `plan` (a kit.train.resolve.TrainPlan): with OBS_HOME, the uploads."""
    if not plan.cfg.obs_home:
        return []
    return [CheckpointUploads(plan.cfg, plan.folder, plan.obs_inputs)]
