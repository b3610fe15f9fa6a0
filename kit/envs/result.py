"""What notebook 01 did, as one object (the clone, its archive, the unpacked copy, the kernel and the restore), and
a table and a chart of what each step cost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union


@dataclass
class EnvStageResult:
    """The results of clone / pack / unpack / register_kernel / check_kernel / restore for one env."""

    envs_root: Path
    source: Path
    cloned: dict
    packed: dict
    unpacked: dict
    kernel: dict
    kernel_run: dict
    restored: dict
    conda: Optional[str] = None
    plot: Optional[Path] = None

    def summary(self) -> dict:
        """Scalars and paths for the workspace summary (`ws.write_summary("01_env_clone_to_sfs", ...)`)."""
        return {
            "envs_root": str(self.envs_root),
            "source": str(self.source),
            "kind": self.cloned["kind"],
            "method": self.cloned["method"],
            "clone": str(self.cloned["target"]),
            "clone_files": self.cloned["files"],
            "clone_seconds": self.cloned["seconds"],
            "verify": self.cloned["verify"]["imports"],
            "archive": str(self.packed["archive"]),
            "archive_bytes": self.packed["archive_bytes"],
            "pack_seconds": self.packed["seconds"],
            "unpacked": str(self.unpacked["target"]),
            "unpacked_prefix": self.unpacked["verify"]["prefix"],
            "kernel": self.kernel["name"],
            "kernel_installed": self.kernel["installed"],
            "kernel_stored": self.kernel["stored"],
            "cann_vars": self.kernel["cann_vars"],
            "kernel_prefix": self.kernel_run["prefix"],
            "kernel_env": self.kernel_run["env"],
            "kernel_code_error": self.kernel_run["error"],
            "conda": self.conda,
            "restore": self.restored,
            "plot": str(self.plot) if self.plot else None,
        }


def steps_table(cloned: dict, packed: dict, unpacked: dict) -> list[dict]:
    """One row per step (clone, pack, unpack) with its size in MiB (env, archive, extracted) and seconds."""
    steps = [
        (f"clone ({cloned['method']})", cloned["bytes"], cloned["target"], cloned),
        (f"pack ({packed['format']})", packed["archive_bytes"], packed["archive"], packed),
        ("unpack", unpacked.get("bytes", 0), unpacked["target"], unpacked),
    ]
    return [
        {"step": s, "MiB": round(n / 2**20, 3), "seconds": r["seconds"], "where": w} for s, n, w, r in steps
    ]


def plot_steps(rows: list[dict], png: Optional[Union[str, Path]] = None):
    """Bar charts of seconds and MiB per step; saved as PNG when `png` is given."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3))
    names = [r["step"] for r in rows]
    ax1.barh(names, [r["seconds"] for r in rows], color="#4C72B0")
    ax1.set_xlabel("seconds")
    ax2.barh(names, [r["MiB"] for r in rows], color="#DD8452")
    ax2.set_xlabel("MiB (env, archive, extracted)")
    ax2.set_yticklabels([])
    fig.tight_layout()
    if png:
        Path(png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=100)
    return fig
