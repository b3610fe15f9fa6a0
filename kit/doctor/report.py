"""Environment check: Python, torch, torch_npu (and whether they pair), CANN, driver, devices, DeepSpeed.

Each line is pass / warn / fail / info with a fix. `python -m kit doctor [--json FILE]` prints the same report.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from kit.core.i18n import t
from kit.core.known_errors import SET_ENV_HINT, explain
from kit.system import versions
from kit.system.cann import ASCEND_ROOTS, cann_version_from_disk, find_set_env_scripts

STATUSES = ("pass", "warn", "fail", "info")
# what a reader sees for each status and each fixed check name, in the kit's language (kit.core.messages); a check
# named for a library (transformers, peft, ...) is shown by its name
STATUS_KEYS = {
    "pass": "doctor.status.pass",
    "warn": "doctor.status.warn",
    "fail": "doctor.status.fail",
    "info": "doctor.status.info",
}
LABEL_KEYS = {
    "python": "doctor.check.python",
    "torch": "doctor.check.torch",
    "torch_npu": "doctor.check.torch_npu",
    "torch pairing": "doctor.check.torch_pairing",
    "CANN": "doctor.check.cann",
    "CANN env": "doctor.check.cann_env",
    "CANN pairing": "doctor.check.cann_pairing",
    "driver": "doctor.check.driver",
    "device": "doctor.check.device",
    "dtype": "doctor.check.dtype",
    "visible devices": "doctor.check.visible_devices",
    "deepspeed": "doctor.check.deepspeed",
    "task queue": "doctor.check.task_queue",
}
COLUMN_KEYS = ("doctor.col.status", "doctor.col.check", "doctor.col.detail", "doctor.col.fix")


def _pad(text: str, width: int) -> str:
    """`text` padded to `width` terminal columns (a Chinese character takes two)."""
    import unicodedata

    used = sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
    return text + " " * max(0, width - used)


def label(name: str) -> str:
    """A check's name as the reader sees it."""
    return t(LABEL_KEYS[name]) if name in LABEL_KEYS else name


@dataclass
class DoctorConfig:
    """What notebook 00 and `python -m kit doctor` do."""

    check_deepspeed: bool = True
    """Also import DeepSpeed and ask which accelerator it picked (takes a few seconds)."""
    explain_error: Optional[str] = None
    """An error message to explain (cause and fix); on the command line, explaining it replaces the checks."""

    def problems(self) -> list:
        return []


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Report:
    """All checks plus the device choice; renders as a table in notebooks and as JSON."""

    checks: list = field(default_factory=list)
    device: dict = field(default_factory=dict)
    json_path: Optional[str] = None  # where to_json() last wrote the report

    def add(self, name: str, status: str, detail: str, fix: str = "") -> None:
        assert status in STATUSES, status
        self.checks.append(Check(name, status, detail, fix))

    def get(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; have {[c.name for c in self.checks]}")

    @property
    def counts(self) -> dict:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    @property
    def ok(self) -> bool:
        return self.counts["fail"] == 0

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "counts": self.counts,
            "device": self.device,
            "checks": [asdict(c) for c in self.checks],
        }

    def to_json(self, path) -> Path:
        from kit.storage.atomic import atomic_write_text

        out = atomic_write_text(path, json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")
        self.json_path = str(out)
        return out

    def summary(self) -> dict:
        """Scalars for the workspace summary: ok, counts, device kind and backend, the JSON report's path."""
        return {
            "ok": self.ok,
            "counts": self.counts,
            "device": self.device.get("kind"),
            "backend": self.device.get("backend"),
            "report": self.json_path,
        }

    def sentence(self) -> str:
        """One sentence: how many checks passed, warned, failed, informed, and whether the kit can run here."""
        c = self.counts
        key = "doctor.summary.ok" if self.ok else "doctor.summary.failed"
        return t(
            key,
            total=len(self.checks),
            passed=c["pass"],
            warned=c["warn"],
            failed=c["fail"],
            infos=c["info"],
            device=self.device.get("kind", "?"),
            backend=self.device.get("backend", "?"),
        )

    def table(self):
        """The checks as a pandas DataFrame (status, check, detail, fix: headers in the kit's language)."""
        import pandas as pd

        columns = [t(k) for k in COLUMN_KEYS]
        return pd.DataFrame(
            [[t(STATUS_KEYS[c.status]), label(c.name), c.detail, c.fix] for c in self.checks], columns=columns
        )

    def __str__(self) -> str:
        lines = [
            f"{_pad(t(STATUS_KEYS[c.status]), 4)}  {_pad(label(c.name), 18)} {c.detail}"
            + (f"\n      {t('doctor.fix', fix=c.fix)}" if c.fix else "")
            for c in self.checks
        ]
        return "\n".join(lines + ["", self.sentence()])

    def _repr_html_(self) -> str:
        import html

        colours = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e", "info": "#57606a"}
        rows = "".join(
            f"<tr><td style='color:{colours[c.status]};font-weight:bold'>{html.escape(t(STATUS_KEYS[c.status]))}</td>"
            f"<td>{html.escape(label(c.name))}</td><td style='text-align:left'>{html.escape(c.detail)}</td>"
            f"<td style='text-align:left'>{html.escape(c.fix)}</td></tr>"
            for c in self.checks
        )
        status, check, detail, fix = (html.escape(t(k)) for k in COLUMN_KEYS)
        return (
            f"<table class='kit-doctor'><thead><tr><th>{status}</th><th>{check}</th>"
            f"<th style='text-align:left'>{detail}</th><th style='text-align:left'>{fix}</th>"
            f"</tr></thead><tbody>{rows}</tbody></table><p>{html.escape(self.sentence())}</p>"
        )


def _dist_version(name: str) -> Optional[str]:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _check_python(r: Report, torch_version: Optional[str]) -> None:
    pyv = platform.python_version()
    ok = versions.python_supported(torch_version, pyv) if torch_version else None
    if ok is False:
        r.add(
            "python",
            "warn",
            f"Python {pyv} is outside the range torch {torch_version} supports",
            "use a Python in the range of envs/README.md's table (ModelArts images: 3.9/3.10)",
        )
    else:
        r.add("python", "pass", f"Python {pyv} ({sys.executable})")


def _check_torch_npu(
    r: Report, torch_version: Optional[str], npu_error: Optional[str], on_ascend: bool
) -> None:
    npu_ver = _dist_version("torch-npu") or _dist_version("torch_npu")
    if npu_ver is None:
        if on_ascend:
            r.add(
                "torch_npu",
                "fail",
                "torch_npu is not installed but this machine has CANN",
                "pip install the torch_npu release matching your torch and CANN (envs/README.md)",
            )
        else:
            r.add("torch_npu", "info", "not installed: not an Ascend machine, the CUDA/CPU path is used")
        return
    if npu_error:
        why = explain(npu_error)
        r.add(
            "torch_npu",
            "fail",
            f"torch_npu {npu_ver} installed but does not import: {npu_error[:300]}",
            why.fix if why else SET_ENV_HINT,
        )
    else:
        r.add("torch_npu", "pass", f"torch_npu {npu_ver} imports")
    if torch_version:
        if versions.torch_npu_pairs(torch_version, npu_ver):
            r.add("torch pairing", "pass", f"torch {torch_version} pairs with torch_npu {npu_ver}")
        else:
            r.add(
                "torch pairing",
                "fail",
                f"torch {torch_version} does not pair with torch_npu {npu_ver}",
                f"install torch=={versions.base_version(npu_ver)} (CPU build) or the torch_npu release for "
                f"torch {versions.base_version(torch_version)}",
            )


def _check_cann(r: Report, env: Mapping[str, str], roots: Sequence[str], cann: Optional[str]) -> bool:
    scripts = find_set_env_scripts(roots, env)
    home = env.get("ASCEND_HOME_PATH")
    if not scripts and not home:
        r.add("CANN", "info", "no CANN installation found (no set_env.sh under " + ", ".join(roots) + ")")
        return False
    r.add(
        "CANN",
        "pass" if cann else "warn",
        f"CANN {cann or 'version unknown'}; set_env.sh: " + (", ".join(map(str, scripts)) or "not found"),
        "" if cann else "check ASCEND_HOME_PATH/version.cfg",
    )
    libs = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if "Ascend" in p or "ascend" in p]
    missing = [v for v in ("ASCEND_HOME_PATH", "ASCEND_OPP_PATH") if not env.get(v)]
    if missing or not libs:
        r.add(
            "CANN env",
            "fail",
            f"this kernel/process was started without the CANN environment (missing: "
            f"{', '.join(missing + ([] if libs else ['Ascend entries in LD_LIBRARY_PATH']))})",
            SET_ENV_HINT,
        )
    else:
        r.add("CANN env", "pass", f"ASCEND_HOME_PATH={home}; {len(libs)} Ascend entries in LD_LIBRARY_PATH")
    npu_ver = _dist_version("torch-npu")
    if cann and npu_ver:
        match = versions.cann_matches(cann, npu_ver)
        if match is False:
            r.add(
                "CANN pairing",
                "warn",
                f"torch_npu {npu_ver} was released for CANN "
                f"{', '.join(versions.cann_for(npu_ver))}, this is CANN {cann}",
                "use the torch_npu release listed for your CANN in envs/README.md",
            )
    return True


def _check_driver(r: Report, npu_smi: str) -> None:
    exe = shutil.which(npu_smi)
    if exe is None:
        r.add("driver", "info", "npu-smi not found (no Ascend driver on this machine)")
        return
    try:
        out = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        r.add(
            "driver",
            "fail",
            f"npu-smi info failed: {exc}",
            "check the driver with `npu-smi info` in a terminal",
        )
        return
    m = re.search(r"Version:\s*([\w.]+)", out)
    r.add("driver", "pass", f"npu-smi {m.group(1) if m else 'ok'}")


def _check_device(r: Report, env: Mapping[str, str]):
    from kit.system.device import detect

    info = detect()
    r.device = info.to_dict()
    r.add(
        "device",
        "pass",
        f"{info.kind} x{info.count} ({info.name}); backend {info.backend}; "
        f"reasons: {'; '.join(info.reasons)}",
    )
    r.add("dtype", "pass", f"{info.dtype}: {info.dtype_reason}")
    if (
        info.kind == "npu"
        and env.get("CUDA_VISIBLE_DEVICES") is not None
        and not env.get("ASCEND_RT_VISIBLE_DEVICES")
    ):
        why = explain("", env=env, on_npu=True)
        r.add("visible devices", "warn", why.cause, why.fix)
    elif info.visible_devices_env:
        r.add(
            "visible devices",
            "pass",
            f"{info.visible_devices_env}={env.get(info.visible_devices_env, '(all)')}",
        )
    return info


def _check_deepspeed(r: Report, kind: str, env: Mapping[str, str]) -> None:
    ver = _dist_version("deepspeed")
    if ver is None:
        r.add("deepspeed", "warn", "not installed", "pip install deepspeed (needed by notebook 04)")
        return
    if kind == "npu" and not env.get("ASCEND_HOME_PATH"):
        r.add(
            "deepspeed",
            "fail",
            f"deepspeed {ver}: ASCEND_HOME_PATH unset, its NPU op builders will raise "
            "KeyError: 'ASCEND_HOME_PATH'",
            SET_ENV_HINT,
        )
        return
    try:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()._name
    except Exception as exc:  # deepspeed prints and raises many kinds of errors on broken setups
        r.add(
            "deepspeed",
            "fail",
            f"deepspeed {ver} failed to pick an accelerator: {exc}",
            (explain(exc).fix if explain(exc) else "run `ds_report` in a terminal"),
        )
        return
    status = "pass" if acc == kind else "warn"
    r.add(
        "deepspeed",
        status,
        f"deepspeed {ver}, accelerator {acc!r}" + ("" if acc == kind else f" but kit chose {kind!r}"),
        "" if status == "pass" else f"set DS_ACCELERATOR={kind} before importing deepspeed",
    )


def _stage_line(pkg: str, ver: Optional[str]) -> tuple:
    """(status, detail, fix) of one library against what the stages need (kit.system.versions.STAGE_NEEDS)."""
    need, stages = versions.below_needs(pkg, ver)
    if not stages:
        return "pass", f"{pkg} {ver}", ""
    what = "not installed" if ver is None else f"{pkg} {ver} is older than {need}"
    return (
        "warn",
        f"{what}: stage {', '.join(stages)} needs {pkg}>={need}",
        f"pip install '{pkg}>={need}' (README: tested stacks)",
    )


def _check_stage_versions(r: Report, have: Mapping[str, Optional[str]]) -> None:
    for pkg in versions.needed_packages():
        if pkg in ("torch", "deepspeed"):
            continue  # their own lines say it (see _versioned)
        r.add(pkg, *_stage_line(pkg, have.get(pkg)))


def _versioned(r: Report, name: str, have: Mapping[str, Optional[str]]) -> None:
    """Turn the line `name` into a warning when the installed version is below a stage's needs."""
    status, detail, fix = _stage_line(name, have.get(name))
    line = r.get(name)
    if status == "warn" and line.status == "pass":
        line.status, line.detail, line.fix = "warn", f"{line.detail}; {detail}", fix


def diagnose(
    env: Optional[Mapping[str, str]] = None,
    roots: Sequence[str] = ASCEND_ROOTS,
    npu_smi: str = "npu-smi",
    deepspeed: bool = True,
    installed: Optional[Mapping[str, Optional[str]]] = None,
) -> Report:
    """Run every check and return the report (env, roots and installed versions can simulate other machines)."""
    env = dict(os.environ if env is None else env)
    have = {pkg: _dist_version(pkg) for pkg in versions.needed_packages()}
    have.update(installed or {})
    r = Report()
    torch_version = _dist_version("torch")
    _check_python(r, torch_version)
    if torch_version is None:
        r.add(
            "torch",
            "fail",
            "torch is not installed",
            "on ModelArts pick a kernel whose image brings torch + torch_npu; elsewhere `pip install torch`",
        )
        return r
    import torch

    build = "CUDA " + str(torch.version.cuda) if torch.version.cuda else "CPU build"
    r.add("torch", "pass", f"torch {torch.__version__} ({build})")
    _versioned(r, "torch", {"torch": have.get("torch", torch_version)})
    from kit.system.device import torch_npu_import

    _mod, npu_error = torch_npu_import()
    on_ascend = bool(find_set_env_scripts(roots, env) or env.get("ASCEND_HOME_PATH"))
    _check_torch_npu(r, torch.__version__, npu_error, on_ascend)
    cann = getattr(torch.version, "cann", None) or cann_version_from_disk(env, roots)
    _check_cann(r, env, roots, cann)
    _check_driver(r, npu_smi)
    info = _check_device(r, env)
    if deepspeed:
        _check_deepspeed(r, info.kind, env)
        _versioned(r, "deepspeed", have)
    _check_stage_versions(r, have)
    if "IPython" in sys.modules and info.kind == "npu":
        r.add(
            "task queue",
            "warn",
            "inside Jupyter torch_npu sets TASK_QUEUE_ENABLE=0 (slower kernels)",
            "launch long training as a subprocess (notebook 04 shows how)",
        )
    return r


def register(sub) -> None:
    import argparse

    from kit.core.configs import add_config_arguments

    p = sub.add_parser("doctor", help="check Python, torch, torch_npu, CANN, driver, devices, DeepSpeed")
    add_config_arguments(p, DoctorConfig)
    p.add_argument("--explain", dest="explain_error", default=argparse.SUPPRESS, help="= --explain-error")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from kit.core.configs import explicit_values

    cfg = DoctorConfig(**explicit_values(args, DoctorConfig))
    if cfg.explain_error:
        why = explain(cfg.explain_error)
        print(why if why else t("doctor.unknown_error"))
        return 0 if why else 1
    report = diagnose(deepspeed=cfg.check_deepspeed)
    print(report)
    if args.json:
        print(t("doctor.written", path=report.to_json(args.json)))
    return 0 if report.ok else 1
