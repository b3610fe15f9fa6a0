"""Which torch / torch_npu / CANN / Python versions go together (Ascend/pytorch README release tables)."""

from __future__ import annotations

import re
from typing import Optional

# (CANN, torch, torch_npu package) rows of the Ascend/pytorch README "TorchNPU Version" tables, newest first.
# Source: github.com/Ascend/pytorch README.md (active and historical tables), read 2026-11.
CANN_TORCH_NPU = [
    ("9.1.X", "2.12.0", "2.12.0.post2"),
    ("9.1.X", "2.11.0", "2.11.0.post2"),
    ("9.1.X", "2.10.0", "2.10.0.post6"),
    ("9.1.X", "2.9.0", "2.9.0.post8"),
    ("9.1.X", "2.7.1", "2.7.1.post10"),
    ("9.1.0", "2.12.0", "2.12.0"),
    ("9.1.0", "2.11.0", "2.11.0"),
    ("9.1.0", "2.10.0", "2.10.0.post4"),
    ("9.1.0", "2.9.0", "2.9.0.post6"),
    ("9.1.0", "2.7.1", "2.7.1.post8"),
    ("9.0.0", "2.10.0", "2.10.0"),
    ("9.0.0", "2.9.0", "2.9.0.post2"),
    ("9.0.0", "2.8.0", "2.8.0.post4"),
    ("9.0.0", "2.7.1", "2.7.1.post4"),
    ("8.5.0", "2.9.0", "2.9.0"),
    ("8.5.0", "2.8.0", "2.8.0.post2"),
    ("8.5.0", "2.7.1", "2.7.1.post2"),
    ("8.5.0", "2.6.0", "2.6.0.post5"),
    ("8.3.RC1", "2.8.0", "2.8.0"),
    ("8.3.RC1", "2.7.1", "2.7.1"),
    ("8.3.RC1", "2.6.0", "2.6.0.post3"),
    ("8.3.RC1", "2.1.0", "2.1.0.post17"),
    ("8.2.RC1", "2.6.0", "2.6.0"),
    ("8.2.RC1", "2.5.1", "2.5.1.post1"),
    ("8.2.RC1", "2.1.0", "2.1.0.post13"),
    ("8.1.RC1", "2.5.1", "2.5.1"),
    ("8.1.RC1", "2.4.0", "2.4.0.post4"),
    ("8.1.RC1", "2.3.1", "2.3.1.post6"),
    ("8.1.RC1", "2.1.0", "2.1.0.post12"),
    ("8.0.0", "2.4.0", "2.4.0.post2"),
    ("8.0.0", "2.3.1", "2.3.1.post4"),
    ("8.0.0", "2.1.0", "2.1.0.post10"),
    ("8.0.RC3", "2.4.0", "2.4.0"),
    ("8.0.RC3", "2.3.1", "2.3.1.post2"),
    ("8.0.RC3", "2.1.0", "2.1.0.post8"),
    ("8.0.RC2", "2.3.1", "2.3.1"),
    ("8.0.RC2", "2.2.0", "2.2.0.post2"),
    ("8.0.RC2", "2.1.0", "2.1.0.post6"),
    ("8.0.RC1", "2.2.0", "2.2.0"),
    ("8.0.RC1", "2.1.0", "2.1.0.post4"),
    ("7.0.0", "2.1.0", "2.1.0"),
    ("7.0.0", "2.0.1", "2.0.1.post1"),
]

# Python versions each torch release supports (same README, "PyTorch and Python versions").
TORCH_PYTHON = {
    "2.13": ("3.10", "3.14"),
    "2.12": ("3.10", "3.14"),
    "2.11": ("3.10", "3.14"),
    "2.10": ("3.10", "3.13"),
    "2.9": ("3.10", "3.13"),
    "2.8": ("3.9", "3.13"),
    "2.7": ("3.9", "3.13"),
    "2.6": ("3.9", "3.11"),
    "2.5": ("3.9", "3.11"),
    "2.4": ("3.8", "3.11"),
    "2.3": ("3.8", "3.11"),
    "2.2": ("3.8", "3.10"),
    "2.1": ("3.8", "3.11"),
}


def base_version(version: str) -> str:
    """'2.1.0.post3' -> '2.1.0', '2.5.1+cpu' -> '2.5.1', '2.1.0rc1' -> '2.1.0'."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return ".".join(x for x in (m.group(1), m.group(2), m.group(3) or "0"))


def torch_npu_pairs(torch_version: str, torch_npu_version: str) -> bool:
    """torch_npu X.Y.Z[.postN] is built for torch X.Y.Z exactly (the naming rule of torch_npu releases)."""
    return base_version(torch_version) == base_version(torch_npu_version)


def cann_for(torch_npu_version: str) -> list[str]:
    """CANN versions a torch_npu package release was published for (empty when not in the table)."""
    v = torch_npu_version.strip()
    return [cann for cann, _t, pkg in CANN_TORCH_NPU if pkg == v]


def _cann_key(cann: str) -> str:
    return cann.upper().replace(" ", "")


def cann_matches(cann_version: str, torch_npu_version: str) -> Optional[bool]:
    """True/False when the table knows this torch_npu release; None when it does not (too new or a dev build)."""
    known = cann_for(torch_npu_version)
    if not known:
        return None
    have = _cann_key(cann_version)
    for want in known:
        want = _cann_key(want)
        if want.endswith(".X") and have.startswith(want[:-1]):
            return True
        if have == want or have.startswith(want + "."):  # e.g. 8.0.RC1.alpha002 under 8.0.RC1
            return True
    return False


def python_supported(torch_version: str, python_version: str) -> Optional[bool]:
    """Whether this Python is in the range torch_version supports (None when the release is not in the table)."""
    major_minor = ".".join(base_version(torch_version).split(".")[:2])
    rng = TORCH_PYTHON.get(major_minor)
    if rng is None:
        return None

    def key(v: str) -> tuple:
        return tuple(int(x) for x in v.split(".")[:2])

    return key(rng[0]) <= key(python_version) <= key(rng[1])


# What each stage needs at least: the oldest versions the kit's tests pass with (the Python 3.9 + torch 2.1 stack,
# envs/compat/py39-torch21.txt; `make test-compat` runs it). Keys are distribution names.
STAGE_NEEDS = {
    "02 data prep": {"transformers": "4.44", "tokenizers": "0.19", "datasets": "2.21", "pyarrow": "17.0"},
    "03 weight conversion": {"torch": "2.1", "transformers": "4.44", "safetensors": "0.4.5"},
    "04 training": {
        "torch": "2.1",
        "transformers": "4.44",
        "datasets": "2.21",
        "safetensors": "0.4.5",
        "deepspeed": "0.14.4",
        "accelerate": "0.34",
        "peft": "0.12",
    },
    "05 profiling": {"torch": "2.1", "transformers": "4.44", "pandas": "2.2"},
}


def _key(version: str) -> tuple:
    return tuple(int(x) for x in base_version(version).split("."))


def below_needs(package: str, installed: Optional[str]) -> tuple:
    """(minimum, stages) of the stages whose needs `installed` does not meet, else (None, ()).

    `installed` None means not installed; the minimum is the highest any unmet stage asks for.
    """
    unmet = [
        (need, stage)
        for stage, needs in STAGE_NEEDS.items()
        for pkg, need in needs.items()
        if pkg == package and (installed is None or _key(installed) < _key(need))
    ]
    if not unmet:
        return None, ()
    return max((need for need, _ in unmet), key=_key), tuple(stage for _, stage in unmet)


def needed_packages() -> list:
    """Every distribution some stage needs, in first-mentioned order."""
    seen = {}
    for needs in STAGE_NEEDS.values():
        seen.update(dict.fromkeys(needs))
    return list(seen)
