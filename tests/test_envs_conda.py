"""Conda backend on real conda prefixes (installed by py-rattler from locally built packages), the conda CLI
adapter against recorded conda output, and .condarc registration."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import kit.envs as envs
from kit.envs import conda as conda_cli

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
# conda-build's long placeholder shape: binary files can only be relocated to shorter prefixes.
PLACEHOLDER = "/opt/conda-build/_h_env" + "_placehold" * 20


def _package(
    channel: Path, name: str, version: str, files: list, depends: tuple = (), placeholder: str = PLACEHOLDER
) -> None:
    """Write a conda .tar.bz2 package: rows (path, bytes or None for a link, file_mode or None, link target)."""
    paths, buf = [], io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:bz2") as tar:
        for path, data, file_mode, link in files:
            info = tarfile.TarInfo(path)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
                paths.append(
                    {
                        "_path": path,
                        "path_type": "softlink",
                        "size_in_bytes": 0,
                        "sha256": hashlib.sha256(b"").hexdigest(),
                    }
                )
                continue
            info.size, info.mode = len(data), 0o755 if path.startswith("bin/") else 0o644
            tar.addfile(info, io.BytesIO(data))
            entry = {
                "_path": path,
                "path_type": "hardlink",
                "size_in_bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            if file_mode:
                entry.update(file_mode=file_mode, prefix_placeholder=placeholder)
            paths.append(entry)
        index = {
            "name": name,
            "version": version,
            "build": "h0_0",
            "build_number": 0,
            "depends": list(depends),
            "subdir": "linux-64",
            "arch": "x86_64",
            "platform": "linux",
            "license": "MIT",
            "timestamp": 1700000000000,
        }
        for member, text in (
            ("info/index.json", json.dumps(index)),
            ("info/paths.json", json.dumps({"paths": paths, "paths_version": 1})),
            ("info/files", "".join(p["_path"] + "\n" for p in paths)),
        ):
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = channel / "linux-64" / f"{name}-{version}-h0_0.tar.bz2"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(buf.getvalue())


def _run_async(coro):
    """Run a coroutine to completion on a thread of its own: asyncio.run() refuses to run where an event loop
    is already running in this thread, which is the case after any test that started one and left it running
    (the browser tests' session-wide sync Playwright does), so these fixtures must not depend on test order."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _install(base: Path, channel: Path, spec: str) -> Path:
    """Index the local channel and install `spec` from it with rattler into base/env-src (cache base/pkgs)."""
    rattler = pytest.importorskip(
        "rattler", reason="py-rattler builds the real conda prefixes of these tests"
    )
    from rattler.index import index_fs

    (channel / "noarch").mkdir(parents=True, exist_ok=True)
    _run_async(index_fs(channel, write_zst=False, write_shards=False))

    async def install():
        records = await rattler.solve(
            [rattler.Channel(str(channel))], [spec], platforms=["linux-64", "noarch"], virtual_packages=[]
        )
        await rattler.install(
            records, target_prefix=str(base / "env-src"), cache_dir=base / "pkgs", show_progress=False
        )

    _run_async(install())
    return base / "env-src"


@pytest.fixture(scope="module")
def conda_prefix(tmp_path_factory) -> Path:
    """A conda env with a python (a wrapper of this one), a text script, a binary file and a library link,
    all holding the build placeholder in the package cache, installed from a local channel by rattler."""
    base = tmp_path_factory.mktemp("conda")
    channel = base / "channel"
    real_python = os.path.realpath(sys.executable)
    words = " ".join(
        random.Random(0).choice(["npu", "cann", "torch", "kernel", "env", "pack"]) for _ in range(40000)
    )
    _package(
        channel,
        "python",
        "3.11.7",
        [
            (
                "bin/python",
                f'#!/bin/sh\n# prefix {PLACEHOLDER}\nexec {real_python} "$@"\n'.encode(),
                "text",
                None,
            ),
            ("lib/python3.11/site-packages/condaprobe.py", b"__version__ = '2.0'\n", None, None),
        ],
    )
    _package(
        channel,
        "hello",
        "1.0",
        [
            ("bin/hello", f"#!/bin/sh\necho {PLACEHOLDER}/share/hello\n".encode(), "text", None),
            ("share/hello/data.bin", b"\x00\x01BIN" + PLACEHOLDER.encode() + b"/etc\x00tail", "binary", None),
            ("share/hello/words.txt", words.encode(), None, None),
            ("lib/libhello.so.1", b"\x7fELF fake library", None, None),
            ("lib/libhello.so", None, None, "libhello.so.1"),
        ],
        depends=("python",),
    )
    return _install(base, channel, "hello")


def _hello(prefix: Path) -> str:
    return subprocess.run(
        [str(prefix / "bin" / "hello")], capture_output=True, text=True, check=True
    ).stdout.strip()


def _data(prefix: Path) -> bytes:
    return (prefix / "share" / "hello" / "data.bin").read_bytes()


def test_conda_prefixes_build_while_an_event_loop_runs(tmp_path):
    # `pytest -k "env or kernel"` ran the browser tests first; their Playwright loop kept running in the main
    # thread and the conda fixture failed with "asyncio.run() cannot be called from a running event loop".
    channel = tmp_path / "ch"
    _package(channel, "tiny", "1.0", [("share/tiny.txt", b"tiny\n", None, None)])

    async def inside_a_running_loop():
        return _install(tmp_path, channel, "tiny")

    prefix = asyncio.run(inside_a_running_loop())
    assert (prefix / "share" / "tiny.txt").read_bytes() == b"tiny\n"
    assert envs.resolve_env(prefix).kind == "conda"


def test_prefix_is_a_genuine_conda_env(conda_prefix):
    record = json.loads(next((conda_prefix / "conda-meta").glob("hello-1.0-*.json")).read_text())
    assert record["link"]["source"].endswith("pkgs/hello-1.0-h0_0") and "paths_data" in record
    assert _hello(conda_prefix) == f"{conda_prefix}/share/hello"
    assert envs.resolve_env(conda_prefix).kind == "conda"


def test_conda_clone_relocates_offline_without_sharing_inodes(conda_prefix, tmp_path):
    root = tmp_path / "envs"
    result = envs.clone(conda_prefix, name="cloned", envs_root=root, verify_imports=["condaprobe"])
    target = root / "user_conda" / "cloned"
    assert result["method"] == "conda-pack" and result["target"] == str(target)
    assert result["verify"]["imports"]["condaprobe"] == "absent" or result["verify"]["ok"]
    assert _hello(target) == f"{target}/share/hello"
    data = _data(target)
    assert len(data) == len(_data(conda_prefix)) and data.startswith(
        b"\x00\x01BIN" + f"{target}/etc".encode() + b"\x00"
    )
    assert os.readlink(target / "lib" / "libhello.so") == "libhello.so.1"
    record = json.loads(next((target / "conda-meta").glob("hello-1.0-*.json")).read_text())
    assert record["link"]["source"] == ""  # no pointer back into the machine's package cache
    assert not (target / "bin" / "conda-unpack").exists()  # prefixes already final
    for rel in ("bin/hello", "lib/libhello.so.1", "share/hello/words.txt"):
        assert os.stat(target / rel).st_ino != os.stat(conda_prefix / rel).st_ino
    assert _hello(conda_prefix) == f"{conda_prefix}/share/hello"
    assert set(envs.activation_commands(target)) == {"full path", "by name", "own python"}


@pytest.mark.parametrize("fmt", ["tar.zst", "tar.gz"])
def test_conda_pack_unpack_runs_conda_unpack(conda_prefix, tmp_path, fmt):
    archive = tmp_path / f"env.{fmt}"
    packed = envs.pack(conda_prefix, archive, threads=2)
    assert packed["kind"] == "conda" and packed["prefix_records"] >= 2
    target = tmp_path / "unpacked" / "env"
    result = envs.unpack(archive, target, verify_imports=None)
    assert result["conda_unpack"] is True and result["kind"] == "conda"
    assert _hello(target) == f"{target}/share/hello"
    assert _data(target).startswith(b"\x00\x01BIN" + f"{target}/etc".encode() + b"\x00")
    assert (target / "bin" / "activate").exists() and not (target / ".kit-env.json").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["env"]


def test_unpack_of_an_archive_made_by_conda_pack_itself(conda_prefix, tmp_path):
    import conda_pack

    archive = tmp_path / "plain.tar.gz"
    conda_pack.pack(prefix=str(conda_prefix), output=str(archive))
    target = tmp_path / "from-plain"
    envs.unpack(archive, target, verify_imports=None)
    assert _hello(target) == f"{target}/share/hello"


def test_conda_pack_tar_zst_ignores_level_but_kit_does_not(conda_prefix, tmp_path):
    import conda_pack

    theirs = [tmp_path / f"cp{level}.tar.zst" for level in (1, 19)]
    for path, level in zip(theirs, (1, 19)):
        conda_pack.pack(prefix=str(conda_prefix), output=str(path), compress_level=level, n_threads=2)
    ours = [
        envs.pack(conda_prefix, tmp_path / f"kit{level}.tar.zst", level=level)["archive_bytes"]
        for level in (1, 19)
    ]
    # reference B6: conda-pack always uses level 9 (sizes differ only by member mtimes of its temp scripts)
    assert abs(theirs[0].stat().st_size - theirs[1].stat().st_size) < 64
    assert ours[0] - ours[1] > 1000


@pytest.mark.filterwarnings("ignore::UserWarning")  # conda-pack: a clone's packages are not in the cache
def test_conda_pack_refuses_editable_and_missing_files(conda_prefix, tmp_path):
    env = Path(
        envs.clone(conda_prefix, name="edit", envs_root=tmp_path / "envs", verify_imports=None)["target"]
    )
    dist = env / "lib" / "python3.11" / "site-packages" / "mine-0.1.dist-info"
    dist.mkdir()
    (dist / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": True}}))
    with pytest.raises(envs.EnvError, match="ignore_editable=True"):
        envs.pack(env, tmp_path / "e.tar.zst")
    assert not (tmp_path / "e.tar.zst").exists()
    assert envs.pack(env, tmp_path / "e.tar.zst", ignore_editable=True)["archive_bytes"] > 0
    (env / "share" / "hello" / "words.txt").unlink()  # what a `pip` clobbering conda files looks like
    with pytest.raises(envs.EnvError, match="deleted/overwritten|missing"):
        envs.clone(env, name="broken", envs_root=tmp_path / "envs", verify_imports=None, ignore_editable=True)
    assert sorted(p.name for p in (tmp_path / "envs" / "user_conda").iterdir()) == ["edit"]


def test_clone_refuses_binary_prefix_that_cannot_grow(tmp_path):
    import shutil
    import tempfile

    old = "/opt/anaconda1anaconda2anaconda3"  # the short placeholder of old packages: only short prefixes fit
    base = Path(tempfile.mkdtemp(prefix="k", dir="/tmp"))
    try:
        _package(
            base / "ch",
            "oldbin",
            "1.0",
            [("lib/old.so", b"\x00ELF" + old.encode() + b"/lib\x00", "binary", None)],
            placeholder=old,
        )
        prefix = _install(base, base / "ch", "oldbin")
        with pytest.raises(
            envs.EnvError, match="lib/old.so is a binary file .* shorter than the target path"
        ):
            envs.clone(
                prefix, name="long-enough-to-overflow", envs_root=tmp_path / "envs", verify_imports=None
            )
        assert list((tmp_path / "envs" / "user_conda").iterdir()) == []
        short = envs.clone(prefix, target=base / "c", verify_imports=None)["target"]
        assert (
            (Path(short) / "lib" / "old.so")
            .read_bytes()
            .startswith(b"\x00ELF" + short.encode() + b"/lib\x00")
        )
    finally:
        shutil.rmtree(base)


def test_conda_clone_method_needs_conda(conda_prefix, tmp_path, monkeypatch):
    monkeypatch.delenv("CONDA_EXE", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(conda_cli, "KNOWN_CONDAS", ())
    with pytest.raises(envs.EnvError, match="conda is not installed here"):
        envs.clone(
            conda_prefix, name="cc", envs_root=tmp_path / "envs", method="conda-clone", verify_imports=None
        )
    assert not (tmp_path / "envs" / "user_conda" / "cc").exists()
    with pytest.raises(envs.EnvError, match="needs a conda env"):
        envs.clone(
            envs.create_venv(tmp_path / "v"), name="x", envs_root=tmp_path / "envs", method="conda-pack"
        )


def test_failed_conda_create_clone_leaves_nothing_and_keeps_the_old_env(conda_prefix, tmp_path, monkeypatch):
    # a `conda` that fails half-way the way a clone without network or package cache does
    exe = tmp_path / "conda"
    exe.write_text(
        '#!/bin/sh\nmkdir -p "$3/lib" && touch "$3/lib/half.so"\n'
        'echo "PackagesNotFoundError: The following packages are not available" >&2\nexit 1\n'
    )
    exe.chmod(0o755)
    monkeypatch.setenv("CONDA_EXE", str(exe))
    root = tmp_path / "envs"
    with pytest.raises(envs.EnvError, match="PackagesNotFoundError"):
        envs.clone(conda_prefix, name="cc", envs_root=root, method="conda-clone", verify_imports=None)
    assert list((root / "user_conda").iterdir()) == []
    (root / "user_conda" / "cc").mkdir()
    (root / "user_conda" / "cc" / "mine").write_text("keep")
    with pytest.raises(envs.EnvError, match="PackagesNotFoundError"):
        envs.clone(
            conda_prefix, name="cc", envs_root=root, method="conda-clone", verify_imports=None, overwrite=True
        )
    assert [p.name for p in (root / "user_conda").iterdir()] == ["cc"]
    assert (root / "user_conda" / "cc" / "mine").read_text() == "keep"


# ---- the conda CLI adapter, against recorded real output ----


def test_parse_recorded_env_list_json():
    text = (FIXTURES / "conda_env_list_json_4.4.txt").read_text()
    assert conda_cli.parse_env_list_json(text) == {
        "custom-env-1": "/Users/user/anaconda/envs/custom-env-1",
        "custom-env-2": "/Users/user/anaconda/envs/custom-env-2",
    }
    noisy = "==> WARNING: A newer version of conda exists. <==\n" + text
    assert len(conda_cli.parse_env_list_json(noisy)) == 2
    with pytest.raises(envs.EnvError, match="no JSON"):
        conda_cli.parse_env_list_json("CondaError: something went wrong")


def test_conda_envs_runs_conda_and_lists_its_envs(conda_prefix, tmp_path, monkeypatch):
    # a `conda` that replays recorded output shape, listing the real prefix built above
    recorded = json.loads((FIXTURES / "conda_env_list_json_4.4.txt").read_text())
    recorded["envs"].append(str(conda_prefix))
    exe = tmp_path / "conda"
    exe.write_text(
        f"#!/bin/sh\n[ \"$1 $2 $3\" = 'env list --json' ] || exit 2\ncat <<'EOF'\n{json.dumps(recorded)}\nEOF\n"
    )
    exe.chmod(0o755)
    monkeypatch.setenv("CONDA_EXE", str(exe))
    assert conda_cli.conda_executable() == str(exe)
    assert conda_cli.conda_envs()["env-src"] == str(conda_prefix)
    listed = envs.list_envs(tmp_path / "envs")
    assert [(e.name, e.kind) for e in listed] == [("env-src", "conda")]  # the missing 4.4 paths are skipped
    assert envs.resolve_env("env-src", tmp_path / "envs").prefix == conda_prefix
    assert conda_cli.clone_command("PyTorch-1.8", "/home/ma-user/work/envs/user_conda/x") == [
        "create",
        "--prefix",
        "/home/ma-user/work/envs/user_conda/x",
        "--clone",
        "PyTorch-1.8",
        "--yes",
        "--quiet",
        "--offline",
    ]


# ---- .condarc ----


def test_register_envs_dir_keeps_settings_and_comments(tmp_path):
    rc = tmp_path / ".condarc"
    rc.write_text(
        "# my mirror\nchannels:\n  - https://mirror.example/conda\nenvs_dirs:\n  - /home/ma-user/anaconda3/envs\n"
        "show_channel_urls: true  # keep\n"
    )
    first = envs.register_envs_dir("/home/ma-user/work/envs/user_conda", rc)
    assert first["added"] is True
    assert first["envs_dirs"] == ["/home/ma-user/anaconda3/envs", "/home/ma-user/work/envs/user_conda"]
    text = rc.read_text()
    assert "# my mirror" in text and "show_channel_urls: true  # keep" in text
    import yaml

    assert yaml.safe_load(text)["channels"] == ["https://mirror.example/conda"]
    second = envs.register_envs_dir("/home/ma-user/work/envs/user_conda", rc)
    assert second["added"] is False and rc.read_text() == text


@pytest.mark.parametrize(
    "before", ["", "envs_dirs: [/a, /b]\nauto_activate_base: false\n", "envs_dirs:\n- /a\n"]
)
def test_register_envs_dir_other_shapes(tmp_path, before):
    import yaml

    rc = tmp_path / "sub" / "condarc"
    if before:
        rc.parent.mkdir()
        rc.write_text(before)
    old = yaml.safe_load(before) or {}
    result = envs.register_envs_dir(tmp_path / "persist", rc)
    after = yaml.safe_load(rc.read_text())
    assert after["envs_dirs"] == [*old.get("envs_dirs", []), str(tmp_path / "persist")] == result["envs_dirs"]
    assert {k: v for k, v in after.items() if k != "envs_dirs"} == {
        k: v for k, v in old.items() if k != "envs_dirs"
    }


def test_register_envs_dir_refuses_broken_yaml(tmp_path):
    rc = tmp_path / ".condarc"
    rc.write_text("channels: [unclosed\n")
    with pytest.raises(envs.EnvError, match="not valid YAML"):
        envs.register_envs_dir("/x", rc)
    assert rc.read_text() == "channels: [unclosed\n"


def test_register_envs_root_is_restored_after_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jd"))
    monkeypatch.delenv("CONDARC", raising=False)
    root = tmp_path / "work" / "envs"
    (tmp_path / "home").mkdir()
    envs.register_envs_root(root)
    rc = tmp_path / "home" / ".condarc"
    assert str(root / "user_conda") in rc.read_text()
    rc.unlink()  # a restart wipes ~/.condarc, not /home/ma-user/work
    report = envs.restore(root)
    assert report["envs_dirs_added"] == [str(root / "user_conda")] and report["condarc"] == str(rc)
    assert envs.restore(root)["envs_dirs_added"] == []


def test_a_damaged_envs_state_file_is_one_clear_error(tmp_path):
    root = tmp_path / "envs"
    root.mkdir()
    (root / "kit-envs.json").write_text("{not json")
    with pytest.raises(envs.EnvError, match=r"kit-envs.json is not valid JSON .*delete or fix it"):
        envs.register_envs_root(root, tmp_path / ".condarc")
    assert not (tmp_path / ".condarc").exists()


def test_progress_bars_end_complete_for_conda(conda_prefix, tmp_path, monkeypatch):
    from kit.envs import manage

    made, real = [], manage._bar
    monkeypatch.setattr(manage, "_bar", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    target = envs.clone(conda_prefix, name="bars", envs_root=tmp_path / "envs", verify_imports=None)["target"]
    envs.pack(conda_prefix, tmp_path / "bars.tar.gz", threads=2)
    envs.unpack(tmp_path / "bars.tar.gz", tmp_path / "u" / "bars", verify_imports=None)
    assert Path(target).is_dir() and len(made) == 3
    assert all(b.n == b.total and b.total > 0 for b in made), [(b.desc, b.n, b.total) for b in made]
