"""Virtualenv backend end to end: clone, pack/unpack in every format, bad input, kernels with CANN, restore."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import kit.envs as envs
from kit.errors import OutputError

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
OLD_LAYOUT = FIXTURES / "ascend_toolkit"
NEW_LAYOUT = FIXTURES / "ascend_cann"


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    """Never touch the real user's Jupyter folders or .condarc."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    monkeypatch.delenv("CONDARC", raising=False)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("KIT_ENVS_ROOT", raising=False)
    (tmp_path / "home").mkdir()


@pytest.fixture(scope="module")
def source_env(tmp_path_factory) -> Path:
    """A small venv on top of this test python's packages, with a script and a module that embed its prefix."""
    prefix = envs.create_venv(tmp_path_factory.mktemp("src") / "src-env")
    site = next(prefix.glob("lib/python3*/site-packages"))
    (site / "kitprobe").mkdir()
    (site / "kitprobe" / "__init__.py").write_text(f"BUILT_AT = {str(prefix)!r}\n__version__ = '1.0'\n")
    hello = prefix / "bin" / "hello"
    hello.write_text(f"#!{prefix}/bin/python\nimport sys\nprint(sys.prefix)\n")
    hello.chmod(0o755)
    return prefix


def _run(path: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        [str(path), *args], capture_output=True, text=True, check=True, env=env
    ).stdout.strip()


def _names(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def test_create_venv_inherits_parent_packages(source_env):
    report = envs.verify(source_env, ["ipykernel", "kitprobe", "surely_absent_pkg"])
    assert report["prefix"] == str(source_env)
    assert report["imports"]["ipykernel"].startswith("ok")
    assert report["imports"]["kitprobe"] == "ok 1.0"
    assert report["imports"]["surely_absent_pkg"] == "absent"
    assert report["ok"] is True


def test_clone_venv_relocates_and_verifies(source_env, tmp_path):
    result = envs.clone(
        source_env, name="clone-a", envs_root=tmp_path / "envs", verify_imports=["kitprobe", "ipykernel"]
    )
    target = tmp_path / "envs" / "venvs" / "clone-a"
    assert result["target"] == str(target) and result["kind"] == "venv" and result["method"] == "copy"
    assert result["verify"]["prefix"] == str(target)
    assert result["verify"]["imports"]["kitprobe"] == "ok 1.0"
    assert result["rewritten"] >= 3  # activate scripts, hello, kitprobe
    assert _run(target / "bin" / "hello") == str(target)
    assert str(source_env) not in (target / "bin" / "activate").read_text()
    assert (
        f"BUILT_AT = {str(target)!r}"
        in next(target.glob("lib/python3*/site-packages/kitprobe/__init__.py")).read_text()
    )
    assert _run(source_env / "bin" / "hello") == str(source_env)  # source untouched
    assert _names(target) == _names(source_env)
    assert [p.name for p in target.parent.iterdir()] == ["clone-a"]  # no temporary folders left
    assert [e.name for e in envs.list_envs(tmp_path / "envs", include_conda=False)] == ["clone-a"]


def test_clone_refuses_bad_input_and_leaves_nothing(source_env, tmp_path, monkeypatch):
    root = tmp_path / "envs"
    for bad in ("a/b", "x;rm -rf ~", "", "..", "-lead", "sp ace", "$(id)"):
        with pytest.raises(envs.EnvError, match="not allowed"):
            envs.clone(source_env, name=bad, envs_root=root, verify_imports=None)
    with pytest.raises(envs.EnvError, match="not found"):
        envs.clone("no-such-env", name="x", envs_root=root, verify_imports=None)
    with pytest.raises(envs.EnvError, match="does not exist"):
        envs.clone(tmp_path / "missing" / "env", name="x", envs_root=root, verify_imports=None)
    with pytest.raises(envs.EnvError, match="not an environment"):
        envs.clone(tmp_path, name="x", envs_root=root, verify_imports=None)
    monkeypatch.setattr("kit.envs.manage.free_bytes", lambda path: 10 << 20)  # a nearly full disk
    with pytest.raises(OutputError, match="not enough space"):
        envs.clone(source_env, name="full", envs_root=root, verify_imports=None)
    monkeypatch.undo()
    assert not (root / "venvs").exists() or list((root / "venvs").iterdir()) == []


def test_clone_refuses_existing_unless_overwrite(source_env, tmp_path):
    root = tmp_path / "envs"
    envs.clone(source_env, name="twice", envs_root=root, verify_imports=None)
    marker = root / "venvs" / "twice" / "marker"
    marker.write_text("old")
    with pytest.raises(FileExistsError, match="already exists"):
        envs.clone(source_env, name="twice", envs_root=root, verify_imports=None)
    assert marker.exists()
    envs.clone(source_env, name="twice", envs_root=root, verify_imports=None, overwrite=True)
    assert not marker.exists() and sorted(p.name for p in (root / "venvs").iterdir()) == ["twice"]


@pytest.mark.parametrize("fmt,threads", [("tar.zst", 0), ("tar.gz", 2), ("tar.gz", 1), ("tar", 1)])
def test_pack_unpack_roundtrip(source_env, tmp_path, fmt, threads):
    out = tmp_path / f"src.{fmt}"
    packed = envs.pack(source_env, out, threads=threads)
    assert packed["format"] == fmt and out.is_file() and packed["prefix_files"] >= 3
    sidecar = json.loads(Path(f"{out}.json").read_text())
    assert (
        sidecar["bytes"] == packed["bytes"] and sidecar["kind"] == "venv" and sidecar["archive"] == str(out)
    )
    if fmt == "tar.gz":  # a standard gzip stream: the system tar lists it
        listing = subprocess.run(["tar", "-tzf", str(out)], capture_output=True, text=True, check=True).stdout
        assert "bin/hello" in listing and ".kit-env.json" in listing
    target = tmp_path / "restored" / f"env-{fmt.replace('.', '-')}-{threads}"
    result = envs.unpack(out, target, verify_imports=["kitprobe"])
    assert result["verify"]["prefix"] == str(target) and result["verify"]["imports"]["kitprobe"] == "ok 1.0"
    assert _run(target / "bin" / "hello") == str(target)
    assert os.readlink(
        target / "bin" / "python3.11"
        if (target / "bin" / "python3.11").is_symlink()
        else target / "bin" / "python"
    ) == os.readlink(
        source_env / "bin" / ("python3.11" if (source_env / "bin" / "python3.11").is_symlink() else "python")
    )
    assert _names(target) == _names(source_env)
    assert not (target / ".kit-env.json").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_zstd_level_and_threads_are_applied(source_env, tmp_path):
    fast = envs.pack(source_env, tmp_path / "l1.tar.zst", level=1, threads=2)
    small = envs.pack(source_env, tmp_path / "l19.tar.zst", level=19, threads=1)
    assert small["archive_bytes"] < fast["archive_bytes"]
    with pytest.raises(FileExistsError):
        envs.pack(source_env, tmp_path / "l1.tar.zst")
    with pytest.raises(envs.EnvArchiveError, match="no known suffix"):
        envs.pack(source_env, tmp_path / "env.rar")


def test_pack_refuses_editable_installs_unless_asked(source_env, tmp_path):
    env = envs.clone(source_env, name="editable", envs_root=tmp_path / "envs", verify_imports=None)["target"]
    dist = next(Path(env).glob("lib/python3*/site-packages")) / "mypkg-0.1.dist-info"
    dist.mkdir()
    (dist / "direct_url.json").write_text(
        json.dumps({"url": "file:///src/mypkg", "dir_info": {"editable": True}})
    )
    with pytest.raises(envs.EnvError, match="editable installs \\(mypkg\\)"):
        envs.pack(env, tmp_path / "e.tar.zst")
    assert not (tmp_path / "e.tar.zst").exists()
    assert envs.pack(env, tmp_path / "e.tar.zst", ignore_editable=True)["editable_not_shipped"] == ["mypkg"]


def test_unpack_corrupt_or_truncated_archive_leaves_nothing(source_env, tmp_path):
    good = tmp_path / "good.tar.zst"
    envs.pack(source_env, good)
    data = good.read_bytes()
    cases = {
        "truncated.tar.zst": data[: len(data) // 2],
        "garbage.tar.gz": b"\x1f\x8b" + os.urandom(4000),
        "random.tar": os.urandom(5000),
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        target = tmp_path / "out" / name.split(".")[0]
        with pytest.raises(envs.EnvArchiveError, match="corrupt|holds no environment"):
            envs.unpack(tmp_path / name, target, verify_imports=None)
        assert not target.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    with pytest.raises(envs.EnvError, match="does not exist"):
        envs.unpack(tmp_path / "nope.tar.zst", tmp_path / "out" / "x")


def _edit_member_list(archive: Path, out: Path, edit) -> Path:
    """Copy a plain .tar archive with its member list (the last member) changed by edit(dict)."""
    with tarfile.open(archive) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isreg() else None
            if m.name == ".kit-env-members.json":
                trailer = json.loads(data)
                edit(trailer)
                data = json.dumps(trailer).encode()
                m.size = len(data)
            dst.addfile(m, None if data is None else io.BytesIO(data))
    return out


def test_unpack_venv_needs_its_base_interpreter(source_env, tmp_path):
    out = tmp_path / "env.tar"
    envs.pack(source_env, out)

    def elsewhere(trailer):
        trailer["abs_links"] = {k: "/nonexistent/python3.11" for k in trailer["abs_links"]}

    moved = _edit_member_list(out, tmp_path / "moved.tar", elsewhere)
    with pytest.raises(envs.EnvError, match="base interpreter at /nonexistent/python3.11"):
        envs.unpack(moved, tmp_path / "u" / "env", verify_imports=None)
    assert not (tmp_path / "u" / "env").exists()


def test_find_and_capture_both_cann_layouts():
    old = envs.find_set_env_scripts([OLD_LAYOUT])
    assert old == [OLD_LAYOUT / "ascend-toolkit" / "set_env.sh"]
    new = envs.find_set_env_scripts([NEW_LAYOUT])
    assert new == [NEW_LAYOUT / "cann" / "set_env.sh", NEW_LAYOUT / "nnal" / "atb" / "set_env.sh"]
    assert envs.find_set_env_scripts([FIXTURES / "nothing-here"]) == []
    captured = envs.capture_cann(new)[0]
    home = str((NEW_LAYOUT / "cann" / "latest").resolve())
    assert captured["ASCEND_HOME_PATH"] == home and captured["ASCEND_OPP_PATH"] == home + "/opp"
    assert captured["ATB_HOME_PATH"].endswith("nnal/atb/latest/atb/cxx_abi_0")
    assert captured["LD_LIBRARY_PATH"].split(":")[:2] == [captured["ATB_HOME_PATH"] + "/lib", home + "/lib64"]
    assert "" not in captured["LD_LIBRARY_PATH"].split(
        ":"
    )  # no empty entry (it would mean the current folder)
    assert "_kit_fixture_root" not in captured and "SHLVL" not in captured and "HOME" not in captured
    arch = subprocess.run(["arch"], capture_output=True, text=True).stdout.strip()
    old_vars = envs.capture_cann(old)[0]
    assert f"op_tiling/lib/linux/{arch}:" in old_vars["LD_LIBRARY_PATH"]  # $(arch) expanded by bash
    with pytest.raises(envs.EnvError, match="does not exist"):
        envs.capture_cann([FIXTURES / "missing_set_env.sh"])


def test_verification_gets_the_cann_env_found_from_ascend_home_path(source_env, tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_HOME_PATH", str(OLD_LAYOUT / "ascend-toolkit" / "latest"))
    result = envs.clone(
        source_env,
        name="npu-check",
        envs_root=tmp_path / "envs",
        verify_imports=["torch_npu", "kit_fake_cann"],
    )
    assert result["verify"]["imports"] == {"torch_npu": "absent", "kit_fake_cann": "ok "}
    without = envs.verify(result["target"], ["kit_fake_cann"])
    assert without["imports"]["kit_fake_cann"] == "absent"  # only the captured PYTHONPATH made it importable


def test_kernel_with_cann_env_runs_in_the_clone_and_restores(source_env, tmp_path, capfd):
    root = tmp_path / "envs"
    target = Path(envs.clone(source_env, name="npu-env", envs_root=root, verify_imports=None)["target"])
    reg = envs.register_kernel(
        target,
        "npu-env",
        "Python (npu-env)",
        set_env_scripts=[OLD_LAYOUT / "ascend-toolkit" / "set_env.sh"],
        envs_root=root,
    )
    user_dir = tmp_path / "jupyter-data" / "kernels" / "npu-env"
    assert Path(reg["installed"]) == user_dir and Path(reg["stored"]) == root / "kernels" / "npu-env"
    spec = json.loads((user_dir / "kernel.json").read_text())
    assert spec == json.loads((root / "kernels" / "npu-env" / "kernel.json").read_text())
    assert spec["argv"][0] == str(target / "bin" / "python")
    assert spec["env"]["PATH"].startswith(f"{target}/bin:")
    assert spec["env"]["VIRTUAL_ENV"] == str(target)
    assert "ASCEND_OPP_PATH" in reg["cann_vars"] and "LD_LIBRARY_PATH" in reg["cann_vars"]

    home = str((OLD_LAYOUT / "ascend-toolkit" / "latest").resolve())
    ran = envs.check_kernel(
        "npu-env",
        variables=("ASCEND_HOME_PATH", "LD_LIBRARY_PATH", "PATH"),
        code="import kit_fake_cann, subprocess\n"
        "assert kit_fake_cann.ASCEND_HOME_PATH.endswith('latest')\n"
        "assert subprocess.run(['msprof'], capture_output=True).returncode == 0",
    )
    assert ran["error"] is None
    assert "without encryption" not in capfd.readouterr().err  # ipykernel's TCP notice is filtered out
    assert ran["prefix"] == str(target)
    assert ran["env"]["ASCEND_HOME_PATH"] == home
    assert ran["env"]["LD_LIBRARY_PATH"].startswith(f"{home}/lib64:")
    assert ran["env"]["PATH"].split(":")[0] == f"{target}/bin"

    # a second kernel whose env is then deleted: restore must skip it, saying why
    other = Path(envs.clone(source_env, name="gone", envs_root=root, verify_imports=None)["target"])
    envs.register_kernel(other, "gone", set_env_scripts=[], envs_root=root)
    subprocess.run(["rm", "-rf", str(other)], check=True)
    subprocess.run(["rm", "-rf", str(tmp_path / "jupyter-data")], check=True)  # what a restart does
    first = envs.restore(root)
    assert first["installed"] == ["npu-env"] and "gone" in first["skipped"] and first["unchanged"] == []
    assert json.loads((user_dir / "kernel.json").read_text()) == spec
    second = envs.restore(root)
    assert second["installed"] == [] and second["unchanged"] == ["npu-env"]

    removed = envs.remove(target, root)
    assert removed["kernels"] == ["npu-env"] and not target.exists() and not user_dir.exists()


def test_register_kernel_refuses_env_without_ipykernel(tmp_path):
    bare = envs.create_venv(tmp_path / "bare", inherit=False)
    with pytest.raises(envs.EnvError, match="ipykernel cannot be imported"):
        envs.register_kernel(bare, "bare", set_env_scripts=[], envs_root=tmp_path / "envs")
    with pytest.raises(envs.EnvError, match="not allowed"):
        envs.register_kernel(bare, "bad/name", set_env_scripts=[], envs_root=tmp_path / "envs")
    assert (
        not (tmp_path / "envs" / "kernels").exists() or list((tmp_path / "envs" / "kernels").iterdir()) == []
    )


def test_cli_clone_pack_unpack_kernel_restore(source_env, tmp_path, capsys):
    import argparse

    from kit.envs import cli as env_cli

    # only this stage's sub-command: the other stages' modules are not this test's business
    parser = argparse.ArgumentParser(prog="python -m kit")
    env_cli.register(parser.add_subparsers(dest="stage", required=True))

    def main(argv):
        args = parser.parse_args(argv)
        return args.func(args)

    root = str(tmp_path / "envs")

    def cli(*argv):
        assert main(["env", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    cloned = cli(
        "clone", str(source_env), "--name", "cli-env", "--envs-root", root, "--verify-imports", "kitprobe"
    )
    assert cloned["target"] == f"{root}/venvs/cli-env" and cloned["verify"]["imports"]["kitprobe"] == "ok 1.0"
    assert [e["name"] for e in cli("list", "--envs-root", root)] == ["cli-env"]
    packed = cli("pack", "cli-env", "--envs-root", root, "--pack-format", "tar.gz", "--threads", "2")
    assert packed["archive"] == f"{root}/packs/cli-env.tar.gz"
    unpacked = cli(
        "unpack", packed["archive"], str(tmp_path / "u" / "cli-env"), "--verify-imports", "kitprobe"
    )
    assert unpacked["verify"]["prefix"] == str(tmp_path / "u" / "cli-env")
    kernel = cli(
        "kernel",
        cloned["target"],
        "--kernel-name",
        "cli-env",
        "--set-env-scripts",
        "none",
        "--envs-root",
        root,
    )
    assert kernel["cann_vars"] == [] and Path(kernel["installed"]).is_dir()
    assert cli("restore", "--envs-root", root)["unchanged"] == ["cli-env"]
    assert cli("remove", cloned["target"], "--envs-root", root)["kernels"] == ["cli-env"]
    with pytest.raises(SystemExit):
        main(["env", "pack"])  # missing argument: argparse usage error


def test_unpack_over_an_existing_env_only_with_overwrite(source_env, tmp_path):
    archive = tmp_path / "env.tar.zst"
    envs.pack(source_env, archive)
    target = tmp_path / "restored" / "env"
    envs.unpack(archive, target, verify_imports=None)
    (target / "marker").write_text("old")
    with pytest.raises(FileExistsError, match="already exists"):
        envs.unpack(archive, target, verify_imports=None)
    assert (target / "marker").exists()
    envs.unpack(archive, target, overwrite=True, verify_imports=None)
    assert not (target / "marker").exists() and _run(target / "bin" / "hello") == str(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["env"]


@pytest.fixture
def bars(monkeypatch):
    """The progress bars kit.envs opens (real tqdm objects), to check they end complete (not red in Jupyter)."""
    from kit.envs import manage

    made, real = [], manage._bar

    def recording(*args, **kwargs):
        bar = real(*args, **kwargs)
        made.append(bar)
        return bar

    monkeypatch.setattr(manage, "_bar", recording)
    return made


def test_progress_bars_end_complete(source_env, tmp_path, bars):
    target = envs.clone(source_env, name="bars", envs_root=tmp_path / "envs", verify_imports=None)["target"]
    archive = envs.pack(target, tmp_path / "bars.tar.zst")["archive"]
    (Path(archive + ".json")).unlink()  # no sidecar: the unpack total is only a guess
    envs.unpack(archive, tmp_path / "u" / "bars", verify_imports=None)
    assert [b.desc for b in bars] == ["clone", "pack tar.zst", "unpack bars.tar.zst"]
    assert all(b.n == b.total and b.total > 0 for b in bars), [(b.desc, b.n, b.total) for b in bars]


# Values that cannot turn up in a kernel.json by chance (a short one like "t-12" did: inside "pytest-120/...").
CREDENTIALS = {
    "API_KEY": "kitsecret-k-1",
    "OPENAI_API_KEY": "kitsecret-sk-2",
    "DB_PASS": "kitsecret-p-3",
    "GITHUB_PAT": "kitsecret-ghp-4",
    "HUAWEI_AK_ID": "kitsecret-ak-5",
    "MA_SK_VALUE": "kitsecret-sk-6",
    "AUTH_HEADER": "Bearer kitsecret-7",
    "SESSION_COOKIE": "kitsecret-c-8",
    "SIGNING_KEY": "kitsecret-s-9",
    "PIP_INDEX_URL": "https://user:kitsecret-pass@mirror.example/simple",
    "HUAWEICLOUD_SDK_AK": "kitsecret-ak-10",
    "OBS_SECRET_ACCESS_KEY": "kitsecret-sk-11",
    "MY_TOKEN": "kitsecret-t-12",
    "ASCEND_API_KEY": "kitsecret-k-13",  # a CANN-looking name that is a credential all the same
    "ASCEND_MIRROR": "https://u:kitsecret-pw@mirror.example/cann",  # a login in the value
}


def test_kernel_env_is_an_allowlist_of_cann_variables(source_env, tmp_path, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/already/there")
    script = tmp_path / "set_env.sh"
    script.write_text(
        "export ASCEND_HOME_PATH=/opt/cann\nexport ASCEND_OPP_PATH=/opt/cann/opp\nexport TOOLCHAIN_HOME=/opt/cann/tk\n"
        "export ATB_HOME_PATH=/opt/atb\nexport LCCL_PARALLEL=0\nexport ASDOPS_LOG_LEVEL=ERROR\n"
        "export LD_LIBRARY_PATH=/opt/cann/lib64:$LD_LIBRARY_PATH\nexport PATH=/opt/cann/bin:$PATH\n"
        "export PYTHONPATH=/opt/cann/python/site-packages:$PYTHONPATH\nexport OMP_NUM_THREADS=4\n"
        + "".join(f"export {k}='{v}'\n" for k, v in CREDENTIALS.items())
    )
    captured, not_copied = envs.capture_cann([script])
    assert sorted(not_copied) == sorted([*CREDENTIALS, "OMP_NUM_THREADS"])
    assert {k: v for k, v in captured.items() if k not in ("PATH", "PYTHONPATH")} == {
        "ASCEND_HOME_PATH": "/opt/cann",
        "ASCEND_OPP_PATH": "/opt/cann/opp",
        "TOOLCHAIN_HOME": "/opt/cann/tk",
        "ATB_HOME_PATH": "/opt/atb",
        "LCCL_PARALLEL": "0",
        "ASDOPS_LOG_LEVEL": "ERROR",
        "LD_LIBRARY_PATH": "/opt/cann/lib64:/already/there",  # the added entry, in front of what was there
    }
    assert captured["PATH"].split(":")[0] == "/opt/cann/bin"
    assert captured["PYTHONPATH"].split(":")[0] == "/opt/cann/python/site-packages"

    reg = envs.register_kernel(source_env, "allow", set_env_scripts=[script], envs_root=tmp_path / "envs")
    text = (tmp_path / "envs" / "kernels" / "allow" / "kernel.json").read_text()
    spec = json.loads(text)
    for name, value in CREDENTIALS.items():
        assert value not in text and name not in spec["env"]
    assert reg["not_copied"] == sorted([*CREDENTIALS, "OMP_NUM_THREADS"])
    assert spec["metadata"]["kit"]["not_copied"] == reg["not_copied"]
    assert spec["env"]["PATH"].split(":")[:2] == [f"{source_env}/bin", "/opt/cann/bin"]
    assert spec["env"]["PATH"].count(f"{source_env}/bin") == 1


def test_clone_into_a_folder_inside_the_source_is_refused(source_env, tmp_path):
    before = _names(source_env)
    for inside in (source_env / "inner", source_env / "lib" / "nested"):
        with pytest.raises(envs.EnvError, match="inside the source env"):
            envs.clone(source_env, target=inside, verify_imports=None)
    assert _names(source_env) == before


def _kit(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KIT_DEBUG", "VIRTUAL_ENV")}
    env["TQDM_DISABLE"] = "1"  # progress bars also write to stderr; the error line is what is checked here
    return subprocess.run(
        [sys.executable, "-m", "kit", "env", *args], capture_output=True, text=True, env=env, cwd=cwd
    )


def test_every_env_command_error_is_one_line_and_exit_2(source_env, tmp_path):
    good = envs.pack(source_env, tmp_path / "good.tar")["archive"]
    data = Path(good).read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2 // 512 * 512])
    (tmp_path / "bad-json.tar").write_bytes(
        data.replace(b'{"created"', b'{"created" garbage', 1)[: len(data)]
    )
    kernels = tmp_path / "jupyter-data" / "kernels"
    kernels.mkdir(parents=True)
    long_parent = tmp_path / ("x" * 300) / "env"
    cases = {
        "level": ["pack", str(source_env), "-o", str(tmp_path / "a.tar.zst"), "--level", "99"],
        "format": ["pack", str(source_env), "-o", str(tmp_path / "a.tar.zst"), "--pack-format", "tar.gz"],
        "suffix": ["pack", str(source_env), "-o", str(tmp_path / "a.rar")],
        "cut": ["unpack", str(tmp_path / "cut.tar"), str(tmp_path / "u1"), "--verify-imports", ""],
        "bad-json": ["unpack", str(tmp_path / "bad-json.tar"), str(tmp_path / "u2"), "--verify-imports", ""],
        "missing-archive": ["unpack", str(tmp_path / "none.tar.zst"), str(tmp_path / "u3")],
        "name-too-long": ["unpack", good, str(long_parent), "--verify-imports", ""],
        "no-source": ["clone", "no-such-env", "--envs-root", str(tmp_path / "envs")],
        "inside": ["clone", str(source_env), "--target", str(source_env / "inner"), "--verify-imports", ""],
        "method": ["clone", str(source_env), "--method", "rsync", "--envs-root", str(tmp_path / "envs")],
        "not-env": ["remove", str(tmp_path)],
        "set-env": [
            "kernel",
            str(source_env),
            "--kernel-name",
            "k",
            "--set-env-scripts",
            str(tmp_path / "none.sh"),
        ],
        "no-kernel": ["check-kernel", "no-such-kernel"],
    }
    for case, argv in cases.items():
        proc = _kit(*argv)
        assert proc.returncode == 2, (case, proc.returncode, proc.stderr[-2000:])
        assert proc.stderr.startswith("error: ") and proc.stderr.strip().count("\n") == 0, (case, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "a.tar.zst").exists() and not (tmp_path / "a.rar").exists()
    assert not any((tmp_path / u).exists() for u in ("u1", "u2", "u3"))


def test_env_help_imports_only_the_light_modules():
    code = (
        "import sys, runpy; sys.argv = ['kit', 'env', '--help']\n"
        "try:\n    runpy.run_module('kit', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "heavy = ['zstandard', 'conda_pack', 'jupyter_client', 'tqdm', 'yaml', 'pandas', 'numpy', 'torch',"
        " 'xxhash', 'kit.data', 'kit.convert', 'kit.train', 'kit.profiling']\n"
        "print('LOADED', [m for m in heavy if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "usage: python -m kit env" in proc.stdout
    assert "LOADED []" in proc.stdout, proc.stdout[-500:]


def _wait_for(predicate, what: str, ceiling: float = 300.0):
    """Poll until predicate() is true; the ceiling is generous (a loaded machine), never a timing assertion."""
    import time

    deadline = time.monotonic() + ceiling
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


@pytest.fixture(scope="module")
def many_files_env(tmp_path_factory) -> Path:
    """A venv with 3000 small files, so a clone is still running when the test stops it."""
    prefix = envs.create_venv(tmp_path_factory.mktemp("many") / "many-env", inherit=False)
    site = next(prefix.glob("lib/python3*/site-packages"))
    for d in range(30):
        (site / f"pkg{d}").mkdir()
        for f in range(100):
            (site / f"pkg{d}" / f"m{f}.py").write_text(f"X = {d * 100 + f}\n")
    return prefix


# in the clone's process: hold once the copy into the temporary folder is done, until a signal ends the process (a
# known point: a clone that is fast on a quiet machine can no longer finish before the test's signal lands)
HOLD_AFTER_COPY = """
import importlib.machinery, os, sys, time


class HoldAfterCopy:
    def find_spec(self, name, path=None, target=None):
        if name != "kit.envs.prefix":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            copy = module.copy_tree

            def held(*args, **kwargs):
                out = copy(*args, **kwargs)
                open(os.environ["KIT_TEST_HELD"], "w").close()
                while True:
                    time.sleep(0.05)
                return out

            module.copy_tree = held

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, HoldAfterCopy())
"""


def _held_mid_clone(source: Path, root: Path, tmp: Path) -> subprocess.Popen:
    """Start a CLI clone that holds (HOLD_AFTER_COPY) once its temporary folder holds the copied files."""
    hook = tmp / "hold_after_copy"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOLD_AFTER_COPY)
    held = tmp / "held"
    held.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "KIT_DEBUG"}
    env.update(
        KIT_TEST_HELD=str(held), PYTHONPATH=os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kit", "env", "clone", str(source), "--name", "c", "--envs-root", str(root)]
        + ["--verify-imports", ""],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _wait_for(held.exists, "the clone to finish copying into its temporary folder")
    return proc


def test_sigterm_cleans_up_like_ctrl_c_and_leftovers_are_reported(many_files_env, tmp_path):
    import signal

    root = tmp_path / "envs"
    proc = _held_mid_clone(many_files_env, root, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and err.strip().endswith("error: interrupted")
    assert list((root / "venvs").iterdir()) == []  # the temporary folder went away, nothing looks finished

    proc = _held_mid_clone(many_files_env, root, tmp_path)
    proc.send_signal(signal.SIGKILL)  # what nothing can clean up after: the next run reports it
    proc.communicate(timeout=300)
    lock, left = sorted((root / "venvs").iterdir())  # the killed run's lock and its temporary folder
    assert lock.name == ".c.lock" and left.name.startswith(".c.partial-")
    size = sum(p.lstat().st_size for p in left.rglob("*"))
    report = _kit(
        "clone", str(many_files_env), "--name", "d", "--envs-root", str(root), "--verify-imports", ""
    )
    assert (
        report.returncode == 0
        and "leftover partial output" in report.stderr
        and "--clean-partial" in report.stderr
    )
    result = json.loads(report.stdout)
    assert (
        result["partial_leftovers"]
        == [{"path": str(lock), "bytes": lock.stat().st_size}, {"path": str(left), "bytes": size}]
        and result["partial_removed"] == []
    )
    assert left.exists()
    cleaned = envs.clone(many_files_env, name="e", envs_root=root, verify_imports=None, clean_partial=True)
    assert cleaned["partial_removed"] == [str(lock), str(left)] and not left.exists() and not lock.exists()
    assert sorted(p.name for p in (root / "venvs").iterdir()) == ["d", "e"]


def test_cli_options_come_from_envs_config():
    import argparse
    import dataclasses

    from kit.core.configs import field_docs
    from kit.envs import cli as env_cli

    parser = argparse.ArgumentParser(prog="python -m kit")
    env_cli.register(parser.add_subparsers(dest="stage", required=True))

    def values(*argv):
        return env_cli._values(parser.parse_args(["env", *argv]))

    # the options come from the dataclass; defaults are the dataclass's
    given = values("pack", "e", "--pack-format", "tar.gz", "--threads", "2")
    assert (given["pack_format"], given["threads"]) == ("tar.gz", 2)
    assert values("pack", "e") == {
        "source": "e",
        "pack_format": None,  # not given: from --output's suffix, else tar.zst
        "level": envs.EnvsConfig.level,
        "threads": envs.EnvsConfig.threads,
        "overwrite": False,
        "envs_root": None,
    }
    assert values("clone", "e", "--verify-imports", "a,b")["verify_imports"] == ["a", "b"]
    assert values("clone", "e", "--verify-imports", "a,b", "--no-overwrite")["verify_imports"] == ["a", "b"]
    assert values("unpack", "x.tar", "t")["verify_imports"] == list(envs.EnvsConfig().verify_imports)
    kernel = values("kernel", "/some/where/my-env", "--set-env-scripts", "none")
    assert kernel["kernel_name"] == "my-env" and kernel["set_env_scripts"] == []
    assert values("kernel", "p", "--kernel-name", "k", "--set-env-scripts", "[]")["set_env_scripts"] == []
    # every field a sub-command takes has its dataclass docstring as --help
    docs = field_docs(envs.EnvsConfig)
    used = {f for fields in env_cli._FIELDS.values() for f in fields}
    assert used <= {f.name for f in dataclasses.fields(envs.EnvsConfig)}
    pack_help = (
        parser._subparsers._group_actions[0].choices["env"]._subparsers._group_actions[0].choices["pack"]
    )
    assert " ".join(docs["level"].split()[:3]) in " ".join(pack_help.format_help().split())


def test_copy_rewrites_text_and_copies_binaries_byte_for_byte(tmp_path):
    """Text (no NUL in the first 8 KiB) has the prefix rewritten wherever it is, also past 8 KiB; a binary (a NUL
    there) is copied byte for byte (its rest by the kernel), prefix included, at every size around 8 KiB."""
    from kit.envs.prefix import SCAN_LIMIT, copy_tree

    src = tmp_path / "src"
    src.mkdir()
    old = str(src).encode()
    cases = {}
    for size in (10, 8191, 8192, 8193, 100_000, SCAN_LIMIT):
        text = (b"x" * (size - len(old)) + old)[:size] if size > len(old) else b"y" * size
        binary = (
            b"\0" + (b"z" * (size - 1 - len(old)) + old)[: size - 1] if size > len(old) + 1 else b"\0" * size
        )
        for kind, data in (("text", text), ("bin", binary)):
            name = f"{kind}{size}"
            (src / name).write_bytes(data)
            cases[name] = data
    out = tmp_path / "out"
    out.mkdir()
    counts = copy_tree(src, out, "/new/prefix")
    for name, data in cases.items():
        got = (out / name).read_bytes()
        if name.startswith("text") and old in data:
            assert got == data.replace(old, b"/new/prefix"), name
        else:
            assert got == data, name
    assert counts["rewritten"] == sum(1 for n, d in cases.items() if n.startswith("text") and old in d) >= 5
    assert counts["bytes"] == sum(map(len, cases.values())) - counts["rewritten"] * (
        len(old) - len("/new/prefix")
    )


@pytest.mark.parametrize(
    "size", [100, 8192 + 100, 3 << 20]
)  # text read whole, binary rest by the kernel, big
@pytest.mark.parametrize("change", ["shrunk", "grown", "removed"])
def test_a_file_that_changed_since_the_scan_stops_the_copy(tmp_path, size, change):
    """A file written while an env is cloned (a pip install in it) would be copied cut or as a mix of two
    versions; the copy compares every file with the size the scan saw and names the one that changed."""
    from kit.envs.prefix import EnvError, copy_tree, scan_tree

    src = tmp_path / "src"
    (src / "lib").mkdir(parents=True)
    for i in range(3):
        (src / "lib" / f"same{i}.py").write_text("x = 1\n")
    body = (b"\0" if size > 8192 else b"") + b"a" * (size - (size > 8192))
    victim = src / "lib" / "victim.bin"
    victim.write_bytes(body)
    entries = scan_tree(src)  # what clone() scans first (and checks free space for)
    if change == "removed":
        victim.unlink()
    else:
        victim.write_bytes(body[: size // 2] if change == "shrunk" else body + b"more")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(EnvError) as err:
        copy_tree(src, out, str(out), entries=entries)
    now = {"shrunk": f"{size // 2} now", "grown": f"{size + 4} now", "removed": "gone now"}[change]
    assert f"{victim} changed while it was copied ({size} bytes when the env was scanned, {now})" in str(
        err.value
    )
    # the same files unchanged since their scan copy cleanly
    out2 = tmp_path / "out2"
    out2.mkdir()
    assert copy_tree(src, out2, str(out2))["files"] == 3 + (change != "removed")


def test_copy_tree_relocates_links_modes_and_prefixes(source_env, tmp_path):
    """GNU cp with the kit's fix-ups: names, types, modes, contents, times and link targets kept, absolute links
    into the source re-pointed, the prefix rewritten in text (also past 8 KiB), folders made owner-writable."""
    from kit.envs.prefix import copy_tree

    src = tmp_path / "src"
    shutil.copytree(source_env, src, symlinks=True)
    (src / "share").mkdir()
    (src / "share" / "abs-inside").symlink_to(src / "bin" / "hello")  # absolute, into the source: re-pointed
    (src / "share" / "rel").symlink_to("../bin/hello")
    (src / "locked").mkdir()
    (src / "locked" / "f.txt").write_text(f"prefix {src} here\n")
    (src / "share" / "long.cfg").write_text("x = 1\n" * 3000 + f"home = {src}\n")  # the prefix past 8 KiB
    os.chmod(src / "locked", 0o555)
    os.utime(src / "share" / "rel", (1, 2), follow_symlinks=False)

    def tree(root: Path) -> dict:
        out = {}
        for p in sorted(root.rglob("*")):
            st, rel = p.lstat(), str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("l", os.readlink(p).replace(str(root), "<root>"))
            elif p.is_dir():
                out[rel] = ("d", st.st_mode & 0o7777)
            else:
                data = p.read_bytes().replace(str(root).encode(), b"<root>")
                out[rel] = ("f", st.st_mode & 0o7777, data, st.st_mtime_ns)
        return out

    before = tree(src)
    out = tmp_path / "out"
    out.mkdir()
    result = copy_tree(src, out, str(out))
    os.chmod(src / "locked", 0o755)
    after = tree(out)
    assert result["rewritten"] == 2 and result["files"] == sum(v[0] == "f" for v in before.values())
    assert after == dict(before, locked=("d", 0o755))
    assert after["share/abs-inside"] == ("l", "<root>/bin/hello") and after["share/rel"] == (
        "l",
        "../bin/hello",
    )
    assert after["locked/f.txt"][2] == b"prefix <root> here\n"


def test_without_gnu_cp_clone_says_to_install_it(source_env, tmp_path, monkeypatch):
    import kit.envs.prefix as prefix_mod

    monkeypatch.setattr(prefix_mod, "gnu_program", lambda name: None)
    with pytest.raises(envs.EnvError, match=r"GNU cp is needed .*apt-get install coreutils"):
        envs.clone(source_env, name="nocp", envs_root=tmp_path / "envs", verify_imports=None)
    assert list((tmp_path / "envs" / "venvs").iterdir()) == []


def test_a_failing_cp_is_one_clear_error_and_no_env(source_env, tmp_path, monkeypatch):
    import kit.envs.prefix as prefix_mod
    from kit.errors import user_message

    fake = tmp_path / "cp"
    fake.write_text("#!/bin/sh\necho 'cp: cannot create regular file: No space left on device' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(prefix_mod, "gnu_program", lambda name: str(fake))
    with pytest.raises(OSError) as info:
        envs.clone(source_env, name="full", envs_root=tmp_path / "envs", verify_imports=None)
    assert "disk is full" in user_message(info.value) and "\n" not in user_message(info.value)
    assert list((tmp_path / "envs" / "venvs").iterdir()) == []


def test_envs_config_checks_levels_with_the_archive_ranges():
    """The notebook's LEVEL is checked against the same ranges pack() enforces (plain tar has no level)."""
    ok = [envs.EnvsConfig(pack_format=f, level=n) for f, n in (("tar.zst", 19), ("tar.gz", 9), ("tar", 22))]
    assert [c.problems() for c in ok] == [[], [], []]
    (gz,) = envs.EnvsConfig(pack_format="tar.gz", level=10).problems()
    assert gz.startswith("LEVEL: compression level 10 is outside 1..9 for tar.gz")
    (zst,) = envs.EnvsConfig(level=0).problems()
    assert "outside 1..19 for tar.zst" in zst
