"""Tables and a chart of what an env operation cost: files, sizes, seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union


def steps_table(cloned: dict, packed: dict, unpacked: dict) -> list[dict]:
    """One row per step (clone, pack, unpack) with its size in MiB and seconds."""
    mib = 1 / 2**20
    return [
        {
            "step": f"clone ({cloned['method']})",
            "MiB": round(cloned["bytes"] * mib, 3),
            "seconds": cloned["seconds"],
            "where": cloned["target"],
        },
        {
            "step": f"pack ({packed['format']})",
            "MiB": round(packed["archive_bytes"] * mib, 3),
            "seconds": packed["seconds"],
            "where": packed["archive"],
        },
        {
            "step": "unpack",
            "MiB": round(unpacked.get("bytes", 0) * mib, 3),
            "seconds": unpacked["seconds"],
            "where": unpacked["target"],
        },
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
