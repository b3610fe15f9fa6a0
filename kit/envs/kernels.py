"""Jupyter kernels for envs, kept on persistent storage, carrying the CANN environment: a kernel runs no login shell
and the loader reads LD_LIBRARY_PATH at process start, so what set_env.sh exports is captured once with bash and
written, fully expanded, into kernel.json's env."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

from kit.envs.config import get_layout
from kit.envs.prefix import EnvError, check_name, kind_of
from kit.storage.atomic import atomic_dir
from kit.system.cann import find_set_env_scripts  # noqa: F401  (re-exported by kit.envs)

# kernel.json is a plain file on shared storage, so only CANN's own variables go into it (an allowlist): what
# CANN's set_env.sh scripts export (ascend-toolkit / cann: ASCEND_*, TOOLCHAIN_HOME; nnal/atb: ATB_*, and in
# older NNAL releases ASDOPS_* and LCCL_*) and the entries they add to the search paths below. Anything else a
# sourced script exports (an API key, a password, a pip index URL with a login) is reported by name, never copied;
# the kernel still inherits it from the Jupyter server's environment if it is set there.
_CANN_NAME = re.compile(r"^(ASCEND_|ATB_|ASDOPS_|LCCL_)[A-Z0-9_]*$|^TOOLCHAIN_HOME$")
_SEARCH_PATHS = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")
# a CANN-looking name is still refused when it looks like a credential or its value carries a login
_SECRET = re.compile(
    r"(^|_)(AK|SK)(_|$)|SECRET|PASSW|PASSWD|_PASS$|TOKEN|API_?KEY|ACCESS_KEY|PRIVATE|CREDENTIAL|AUTH|COOKIE|SIGNING|SIGNATURE",
    re.IGNORECASE,
)
_LOGIN_IN_VALUE = re.compile(r"[a-z][a-z0-9+.-]*://[^/@\s]+@", re.IGNORECASE)
_NOISE = {"_", "SHLVL", "PWD", "OLDPWD", "KIT_ENV_BEFORE", "KIT_ENV_AFTER", "BASH_EXECUTION_STRING"}


def _read_env0(path: str) -> dict:
    with open(path, "rb") as fh:
        items = fh.read().decode("utf-8", "replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def _search_path(name: str, old: dict, new: dict) -> Optional[str]:
    """The entries sourcing added to a search path, in front of what the process had before; None if none."""
    before = [e for e in old.get(name, "").split(":") if e]
    added = [e for e in new.get(name, "").split(":") if e and e not in before]
    added = list(dict.fromkeys(added))  # a script sourced twice adds its entries twice
    return ":".join(added + before) if added else None


def select_cann(old: dict, new: dict) -> tuple[dict, list]:
    """(CANN variables to copy, names of other changed variables that are not copied) from two environments."""
    keep, refused = {}, []
    for key, value in sorted(new.items()):
        if key in _NOISE or old.get(key) == value:
            continue
        if key in _SEARCH_PATHS:
            merged = _search_path(key, old, new)
            if merged is not None:
                keep[key] = merged
        elif _CANN_NAME.match(key) and not _SECRET.search(key) and not _LOGIN_IN_VALUE.search(value):
            keep[key] = value
        else:
            refused.append(key)
    return keep, refused


def check_scripts(scripts) -> None:
    """EnvError unless `scripts` is a list of existing files (the set_env.sh scripts to capture)."""
    if not isinstance(scripts, (list, tuple)):
        raise EnvError(
            f"set_env.sh scripts {scripts!r}: pass 'auto' or a list of set_env.sh paths ([] for none)."
        )
    for script in scripts:
        if not Path(script).is_file():
            raise EnvError(
                f"set_env.sh {str(script)!r} does not exist; pass the CANN install's set_env.sh "
                f"(e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) or [] to skip."
            )


def capture_cann(
    scripts: Sequence[Union[str, Path]], prefix: Optional[Union[str, Path]] = None
) -> tuple[dict, list]:
    """Source `scripts` in bash (the env's bin/ first on PATH, so scripts probing `python` see the env's) and
    return (CANN variables they set, names of the other variables they set, which are not copied)."""
    check_scripts(scripts)
    with tempfile.TemporaryDirectory(prefix="kit-env-") as tmp:
        before, after = os.path.join(tmp, "before"), os.path.join(tmp, "after")
        sources = "; ".join(f'source "{Path(s).absolute()}"' for s in scripts)
        path_prefix = f'export PATH="{Path(prefix).absolute()}/bin:$PATH"; ' if prefix else ""
        cmd = f'{path_prefix}env -0 > "$KIT_ENV_BEFORE"; {sources}; env -0 > "$KIT_ENV_AFTER"'
        env = dict(os.environ, KIT_ENV_BEFORE=before, KIT_ENV_AFTER=after)
        proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
        if not os.path.exists(after):
            raise EnvError(
                f"sourcing {', '.join(map(str, scripts))} failed (exit {proc.returncode}): "
                f"{proc.stderr.strip()[-600:]}"
            )
        old, new = _read_env0(before), _read_env0(after)
    return select_cann(old, new)


def kernel_env(prefix: Union[str, Path], cann_env: Optional[dict] = None) -> dict:
    """kernel.json env: the CANN variables, PATH with the env's bin/ first, and the env's activation marker."""
    prefix = str(Path(prefix).absolute())
    env = dict(cann_env or {})
    path = env.get("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
    env["PATH"] = ":".join([f"{prefix}/bin"] + [e for e in path.split(":") if e and e != f"{prefix}/bin"])
    env["CONDA_PREFIX" if kind_of(prefix) == "conda" else "VIRTUAL_ENV"] = prefix
    return env


def user_kernels_dir() -> Path:
    """Where `jupyter kernelspec install --user` puts kernels (respects JUPYTER_DATA_DIR)."""
    from jupyter_client.kernelspec import KernelSpecManager

    return Path(KernelSpecManager().user_kernel_dir)


def register_kernel(
    prefix: Union[str, Path],
    name: str,
    display_name: Optional[str] = None,
    set_env_scripts: Union[str, Sequence[Union[str, Path]], None] = "auto",
    envs_root: Optional[Union[str, Path]] = None,
) -> dict:
    """Write a kernelspec for the env at `prefix` to <envs_root>/kernels/<name> and install it for the user, with
    CANN's variables from set_env_scripts ("auto": found, a list, or None); other variables' names: "not_copied"."""
    check_name(name, "kernel name")
    prefix = Path(prefix).expanduser().absolute()
    python = prefix / "bin" / "python"
    if not python.exists():
        raise EnvError(f"{python} does not exist; register a kernel for an env folder that has bin/python.")
    probe = subprocess.run([str(python), "-c", "import ipykernel"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise EnvError(
            f"ipykernel cannot be imported in {prefix} ({probe.stderr.strip()[-300:]}); run "
            f"`{python} -m pip install ipykernel` and register again."
        )
    scripts = find_set_env_scripts() if set_env_scripts == "auto" else list(set_env_scripts or [])
    cann, not_copied = capture_cann(scripts, prefix) if scripts else ({}, [])
    spec = {
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name or f"Python ({name})",
        "language": "python",
        "env": kernel_env(prefix, cann),
        "metadata": {
            "kit": {
                "prefix": str(prefix),
                "set_env_scripts": [str(s) for s in scripts],
                "cann_vars": sorted(cann),
                "not_copied": not_copied,
            }
        },
    }
    store = get_layout(envs_root).kernels / name.lower()  # Jupyter lower-cases kernel names
    with atomic_dir(store, overwrite=True, what="kernelspec") as tmp:
        (tmp / "kernel.json").write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    done = {"name": name.lower(), "display_name": spec["display_name"], "stored": str(store)}
    return dict(done, installed=install_stored(store), **spec["metadata"]["kit"])


def install_stored(store_dir: Union[str, Path]) -> str:
    """Install one stored kernelspec folder for the user with jupyter_client; return where it went."""
    from jupyter_client.kernelspec import KernelSpecManager

    store_dir = Path(store_dir)
    return KernelSpecManager().install_kernel_spec(str(store_dir), store_dir.name, user=True, replace=True)


def stored_kernels(envs_root: Optional[Union[str, Path]] = None) -> dict:
    """{name: kernel.json dict} of the kernelspecs kept under <envs_root>/kernels."""
    specs = sorted(get_layout(envs_root).kernels.glob("*/kernel.json"))  # none while the folder is absent
    return {spec.parent.name: read_json_object(spec) for spec in specs}


def read_json_object(path: Path) -> dict:
    """The JSON object in `path` (a kernel.json, or the envs root's kit-envs.json); EnvError saying how to mend it."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise EnvError(
            f"{path} is not valid JSON ({exc}); delete or fix it (a kernel folder: register the kernel again "
            f"with `python -m kit env kernel`) and run the command again."
        ) from exc
    if not isinstance(spec, dict):
        raise EnvError(f"{path} does not hold a JSON object; delete or fix it (a kernel: register it again).")
    return spec


def restore(envs_root: Optional[Union[str, Path]] = None, condarc: Optional[Union[str, Path]] = None) -> dict:
    """After a restart: reinstall every stored kernelspec whose env still exists (one installed with the same
    content is left alone: 'unchanged'), re-register envs_dirs."""
    from kit.envs.conda import register_envs_dir

    layout = get_layout(envs_root)
    report = {"installed": [], "unchanged": [], "skipped": {}, "envs_dirs_added": [], "condarc": None}
    target_root = user_kernels_dir()
    for name, spec in stored_kernels(layout.root).items():
        python = Path(spec.get("argv", [""])[0])
        if not python.exists():
            report["skipped"][name] = f"env python {python} is missing (env removed or not unpacked yet)"
            continue
        try:  # a missing or damaged installed copy is replaced by the stored one
            if read_json_object(target_root / name / "kernel.json") == spec:
                report["unchanged"].append(name)
                continue
        except (OSError, EnvError):
            pass
        install_stored(layout.kernels / name)
        report["installed"].append(name)
    if layout.state.exists():
        for folder in read_json_object(layout.state).get("envs_dirs", []):
            result = register_envs_dir(folder, condarc)
            report["condarc"] = result["condarc"]
            if result["added"]:
                report["envs_dirs_added"].append(folder)
    return report


def unregister_kernel(name: str, envs_root: Optional[Union[str, Path]] = None) -> list[str]:
    """Remove a kernel from the store and from the user's Jupyter; return the folders removed."""
    removed = []
    for folder in (get_layout(envs_root).kernels / name, user_kernels_dir() / name):
        if folder.is_dir():
            shutil.rmtree(folder)
            removed.append(str(folder))
    return removed


_PROBE = (
    "import json, os, sys; print('KIT-KERNEL ' + json.dumps({'prefix': sys.prefix, "
    "'executable': sys.executable, 'env': {k: os.environ.get(k) for k in %r}}))"
)


def check_kernel(
    name: str,
    variables: Sequence[str] = ("PATH", "LD_LIBRARY_PATH", "ASCEND_HOME_PATH"),
    code: str = "",
    timeout: float = 120,
) -> dict:
    """Start the installed kernel `name`, run `code` in it (e.g. "import torch_npu"; its error under "error"),
    return its sys.prefix and `variables`."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import NoSuchKernel

    from kit.core.notebooks import quiet_kernel_manager

    km = quiet_kernel_manager(KernelManager)(kernel_name=name)  # without ipykernel's TCP notice on our stderr
    try:
        km.start_kernel()
    except NoSuchKernel as exc:
        raise EnvError(
            f"no Jupyter kernel named {name!r} is installed; register it with `python -m kit env kernel ENV "
            f"--kernel-name {name}` (or run `python -m kit env restore` after a restart)."
        ) from exc
    kc = km.client()
    out: dict = {"error": None}
    chunks: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            chunks.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out["error"] = f"{msg['content']['ename']}: {msg['content']['evalue']}"

    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=timeout)
        if code:
            kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        kc.execute_interactive(_PROBE % (tuple(variables),), output_hook=hook, timeout=timeout)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    line = next((x for x in "".join(chunks).splitlines() if x.startswith("KIT-KERNEL ")), None)
    if line is None:
        raise EnvError(f"kernel {name!r} ran but printed nothing ({out['error']}).")
    out.update(json.loads(line[len("KIT-KERNEL ") :]))
    return out
