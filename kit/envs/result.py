"""What notebook 01 did, as one object: the clone, its archive, the unpacked copy, the kernel and the restore."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


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
