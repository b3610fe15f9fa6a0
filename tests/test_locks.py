"""One writer per output (kit/storage/locks.py, kit/storage/atomic.py): a second writer is refused naming the holder, stale locks
of gone processes are broken and live or foreign ones never, a publish never replaces what appeared meanwhile, the
data stage's files are published as one unit. Races are made deterministic with events at known points."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pandas as pd
import pytest

from kit.storage import atomic, locks
from kit.storage.locks import LockedError


@contextlib.contextmanager
def held_elsewhere(target):
    """Another process holding the lock of `target` until the block ends (it waits on its stdin, no sleep)."""
    code = (
        "import sys; from kit.storage.locks import acquire, release; acquire(sys.argv[1], 'other run'); "
        "print('held', flush=True); sys.stdin.readline(); release(sys.argv[1])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


class Paused(threading.Thread):
    """Run `fn` in a thread that stops where `pause()` is called from it, until `resume()`."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.error, self.result = fn, None, None
        self.reached, self.go = threading.Event(), threading.Event()

    def pause(self):
        if threading.current_thread() is self:
            self.reached.set()
            assert self.go.wait(300)

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def start_and_wait(self):
        self.start()
        assert self.reached.wait(300), self.error
        return self

    def finish(self):
        self.go.set()
        self.join(300)
        if self.error:
            raise self.error
        return self.result


# ---- the lock itself --------------------------------------------------------------------------------------------
def test_a_live_holder_is_named_and_never_broken(tmp_path):
    target = tmp_path / "out"
    with held_elsewhere(target) as other:
        with pytest.raises(LockedError) as err:
            locks.acquire(target, "data pretrain")
        msg = str(err.value)
        assert f"PID {other.pid} on {socket.gethostname()} since 20" in msg and "(other run)" in msg
        assert str(target) in msg
        assert locks.read_holder(locks.lock_path(target))["pid"] == other.pid  # still there
    assert not locks.lock_path(target).exists()  # released by its holder
    locks.acquire(target)
    locks.release(target)
    assert not os.listdir(tmp_path)  # no lock, no unique files left behind


def _plant(target, **changes):
    info = dict(locks.identity(), token="t" * 16, since="2026-01-01T00:00:00Z", what="planted")
    info.update(changes)
    locks.lock_path(target).write_text(json.dumps(info))
    return info


def _gone_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: no such process (the kernel reuses PIDs only after a wrap-around)


def test_a_stale_lock_of_this_host_is_broken(tmp_path):
    target = tmp_path / "out"
    _plant(target, pid=_gone_pid())
    locks.acquire(target)  # a SIGKILLed run on this host: its lock is taken over
    assert locks.read_holder(locks.lock_path(target))["pid"] == os.getpid()
    locks.release(target)
    # a PID that was reused by a later process (its start time differs) is as good as gone
    _plant(target, pid=os.getppid(), started=1)
    locks.acquire(target)
    locks.release(target)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("other", [{"host": "node-7"}, {"boot_id": "another-boot"}, {}])
def test_a_lock_of_another_host_or_a_damaged_one_is_never_broken(tmp_path, other):
    target = tmp_path / "out"
    if other:
        _plant(target, pid=_gone_pid(), **other)  # dead here, but that PID means nothing on another host
    else:
        locks.lock_path(target).write_text("")  # empty or damaged: its holder is unknown
    with pytest.raises(LockedError) as err:
        locks.acquire(target)
    assert f"delete {str(locks.lock_path(target))!r}" in str(err.value)
    assert locks.lock_path(target).exists()


def test_a_copy_of_a_live_lock_locks_nothing_and_the_original_still_holds(tmp_path):
    """A folder copied (cp -a) while a run writes in it carries that run's lock: the copy is another file, so its
    outputs are free, while the original output stays locked by its live holder."""
    target = tmp_path / "sft" / "run"
    target.mkdir(parents=True)
    with held_elsewhere(target) as other:
        shutil.copytree(tmp_path / "sft", tmp_path / "copy", symlinks=True)
        copy = tmp_path / "copy" / "run"
        assert locks.read_holder(locks.lock_path(copy))["pid"] == other.pid  # the live run's, copied
        assert locks.live_holder(copy) is None and locks.live_holder(target)["pid"] == other.pid
        with locks.hold(copy, "training run"):
            assert locks.read_holder(locks.lock_path(copy))["pid"] == os.getpid()
        with pytest.raises(LockedError, match=f"PID {other.pid}"):
            locks.acquire(target)
    assert not locks.lock_path(copy).exists()


def test_the_lock_is_reentrant_in_one_thread_and_refused_to_another(tmp_path):
    target = tmp_path / "out"
    with locks.hold(target):
        with locks.hold(target):
            assert locks.holds(target)
        with locks.hold(target / "hf"):  # inside a folder this thread holds: covered, no lock of its own
            assert not locks.lock_path(target / "hf").exists()
        assert locks.lock_path(target).exists()
        other = Paused(lambda: locks.acquire(target))
        other.start()
        other.join(60)
        assert isinstance(other.error, LockedError)
    assert not locks.lock_path(target).exists()


# ---- the publish ------------------------------------------------------------------------------------------------
def test_an_output_that_appeared_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    final = tmp_path / "out"

    def intruder(path):  # a writer that takes no lock publishes while this one works
        (path).mkdir()
        (path / "theirs").write_text("kept")

    monkeypatch.setattr(atomic, "_before_publish", intruder, raising=False)
    with pytest.raises(atomic.OutputExistsError, match="appeared while this run was writing"):
        with atomic.atomic_dir(final, lock=False) as tmp:
            (tmp / "mine").write_text("new")
    assert sorted(os.listdir(final)) == ["theirs"]
    assert [p for p in os.listdir(tmp_path) if p != "out"] == []  # the temporary folder is gone


def test_overwrite_keeps_the_old_output_until_the_new_one_is_complete(tmp_path):
    final = tmp_path / "out"
    with atomic.atomic_dir(final) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_dir(final, overwrite=True) as tmp:
            (tmp / "v").write_text("2")
            raise KeyboardInterrupt
    assert (final / "v").read_text() == "1"
    assert sorted(os.listdir(tmp_path)) == ["out"]


# ---- data: two writers of one name, and the unit of `<name>_hf/` + `.bin/.idx` ---------------------------------
@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    from kit.core.samples import pretrain_corpus

    df = pd.read_parquet(pretrain_corpus())[["text"]]
    folder = tmp_path_factory.mktemp("corpora")
    df.head(30).to_parquet(folder / "a.parquet")
    df.iloc[30:40].to_parquet(folder / "b.parquet")
    return folder / "a.parquet", folder / "b.parquet"


def _data(out, corpus, **kw):
    from kit.data import DataConfig

    return DataConfig(
        kind="pretrain", inputs=[str(corpus)], name="same", max_length=32, out_dir=str(out), **kw
    )


def _consistent(out):
    """The manifest at `same_hf` and the Megatron files beside it come from one run."""
    from kit.data import IndexedReader, read_meta

    meta = read_meta(out / "same_hf")
    reader = IndexedReader(meta["megatron_prefix"])
    return meta["counts"]["records_written"], len(reader.doc_index) - 1


def test_two_data_runs_of_one_name_the_second_is_refused(tmp_path, corpora, monkeypatch):
    from kit.data import pipeline, prepare

    first = Paused(lambda: prepare(_data(tmp_path, corpora[0]), progress=False))
    real = pipeline.save_config
    monkeypatch.setattr(pipeline, "save_config", lambda *a, **k: (first.pause(), real(*a, **k))[1])
    first.start_and_wait()  # inside its work, nothing published yet
    with pytest.raises(LockedError, match=f"PID {os.getpid()} on "):
        prepare(_data(tmp_path, corpora[1]), progress=False)
    res = first.finish()
    assert res.report.records_written == 30
    assert _consistent(tmp_path) == (30, 30)


def test_an_overwrite_publishes_the_data_as_one_unit(tmp_path, corpora, monkeypatch):
    from kit.core.manifest import find_manifest
    from kit.data import indexed, prepare

    prepare(_data(tmp_path, corpora[1]), progress=False)
    assert _consistent(tmp_path) == (10, 10)
    real = indexed.IndexedWriter.commit
    second = Paused(lambda: prepare(_data(tmp_path, corpora[0], overwrite=True), progress=False))
    monkeypatch.setattr(indexed.IndexedWriter, "commit", lambda self: (second.pause(), real(self))[1])
    second.start_and_wait()  # between the manifest's folder and the Megatron files
    # no manifest is at the final name while the files change: no reader can pair one run's with another's
    assert find_manifest(tmp_path / "same_hf") is None
    with pytest.raises(LockedError):
        prepare(_data(tmp_path, corpora[1], overwrite=True), progress=False)
    second.finish()
    assert _consistent(tmp_path) == (30, 30)
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p or p.endswith(".lock")]


# ---- convert and train: a second writer of one target -----------------------------------------------------------
def test_two_converts_into_one_target_the_second_is_refused(tmp_path, tiny_llama_dir):
    from kit.convert import ConvertConfig, convert

    target = tmp_path / "m"
    with held_elsewhere(target) as other:
        with pytest.raises(LockedError, match=f"PID {other.pid} "):
            convert(ConvertConfig(str(tiny_llama_dir), str(target)), progress=False)
    assert not target.exists()
    convert(ConvertConfig(str(tiny_llama_dir), str(target)), progress=False)
    assert (target / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_without_hard_links_the_lock_falls_back_to_o_excl(tmp_path, monkeypatch):
    import errno

    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")  # what FUSE object-store mounts answer

    monkeypatch.setattr(locks.os, "link", no_link)
    target = tmp_path / "out"
    with locks.hold(target, "convert"):
        assert locks.read_holder(locks.lock_path(target))["what"] == "convert"
    assert not os.listdir(tmp_path)
    with held_elsewhere(target) as other:
        with pytest.raises(LockedError, match=f"PID {other.pid} "):
            locks.acquire(target)


def test_a_late_breaker_of_a_stale_lock_leaves_the_new_holder_alone(tmp_path):
    target = tmp_path / "out"
    stale = _plant(target, pid=_gone_pid())
    # two runs found that lock stale; the first broke it and another run took the output since
    locks.lock_path(target).unlink()
    with held_elsewhere(target) as other:
        locks._break(locks.lock_path(target), stale, locks.identity())  # the second one, late
        assert locks.read_holder(locks.lock_path(target))["pid"] == other.pid
        with pytest.raises(LockedError):
            locks.acquire(target)
    assert not os.listdir(tmp_path)


def test_live_holder_tells_a_cleaner_which_outputs_are_being_written(tmp_path):
    assert locks.live_holder(tmp_path / "a") is None
    _plant(tmp_path / "b", pid=_gone_pid())
    assert locks.live_holder(tmp_path / "b") is None  # gone: its leftovers may go
    with held_elsewhere(tmp_path / "c") as other:
        assert locks.live_holder(tmp_path / "c")["pid"] == other.pid


def test_clean_partial_spares_a_live_runs_temporary_and_removes_a_killed_runs_lock(tmp_path):
    from kit.storage.partial import handle_partials

    for name in ("live", "killed"):
        (tmp_path / f".{name}.partial-0123").mkdir()
    _plant(tmp_path / "killed", pid=_gone_pid())  # the lock a SIGKILLed run left
    with held_elsewhere(tmp_path / "live"):
        report = handle_partials(tmp_path, clean=True)
        assert report["removed"] == [str(tmp_path / ".killed.lock"), str(tmp_path / ".killed.partial-0123")]
        assert sorted(os.listdir(tmp_path)) == [".live.lock", ".live.partial-0123"]
