"""The ModelArts `${workdir}` layout every stage reads from and writes to (ModelArts user manual, section "工作目录结构")."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Union

from kit.core.i18n import t
from kit.errors import InputError

MODELARTS_ROOT = Path("/home/ma-user/ws")
RUN_TYPES = ("pretrain", "sft", "lora", "dpo", "retrain")
# the default LoRA targets, a training run's and the planner's (kit.adapt.lora_targets: each family's names for them)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def repo_root() -> Path:
    """The checkout this kit was imported from (the folder holding `kit/`)."""
    return Path(__file__).resolve().parents[2]


def on_modelarts() -> bool:
    """True inside a ModelArts Notebook (its home folder and platform variables are present)."""
    return Path("/home/ma-user").is_dir() and any(k.startswith("MA_") for k in os.environ)


def default_root() -> Path:
    """KIT_WORKSPACE if set, /home/ma-user/ws on ModelArts, else `runs/ws` in this checkout."""
    env = os.environ.get("KIT_WORKSPACE")
    if env:
        return Path(env).expanduser()
    return MODELARTS_ROOT if on_modelarts() else repo_root() / "runs" / "ws"


@dataclass(frozen=True)
class Workspace:
    """Paths of one model's work under a `${workdir}` root; `create()` makes the folders."""

    root: Path
    model: str
    sources: Dict[str, str] = field(default_factory=dict, compare=False)
    """Where the root and model came from (kit.core.project.resolve: "workspace" / "model" -> where)."""

    @property
    def origin(self) -> str:
        """One phrase the notebooks print: each value and where it came from."""
        return (
            f"model {self.model!r} ({self.sources.get('model', '?')}), "
            f"workspace {self.root} ({self.sources.get('workspace', '?')})"
        )

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).expanduser().resolve())
        if not _MODEL_NAME.match(self.model or ""):
            raise InputError(t("workspace.bad_model_name", name=self.model))

    # ${workdir}/llm_train: the AscendCloud code package (AscendSpeed / ModelLink / scripts), if the user has it
    @property
    def llm_train(self) -> Path:
        return self.root / "llm_train"

    @property
    def model_input(self) -> Path:
        return self.root / "processed_for_ma_input" / self.model

    @property
    def data_pretrain(self) -> Path:
        return self.model_input / "data" / "pretrain"

    @property
    def data_finetune(self) -> Path:
        return self.model_input / "data" / "finetune"

    @property
    def converted_weights(self) -> Path:
        return self.model_input / "converted_weights"

    @property
    def model_output(self) -> Path:
        return self.root / "saved_dir_for_ma_output" / self.model

    @property
    def logs(self) -> Path:
        return self.model_output / "logs"

    def output(self, run_type: str) -> Path:
        """Where a training run of `run_type` saves weights (retrain continues into pretrain's folder)."""
        if run_type not in RUN_TYPES:
            raise InputError(t("workspace.bad_run_type", run_type=run_type, choices=", ".join(RUN_TYPES)))
        return self.model_output / ("pretrain" if run_type == "retrain" else run_type)

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizers" / self.model

    @property
    def training_data_pretrain(self) -> Path:
        return self.root / "training_data" / "pretrain"

    @property
    def training_data_finetune(self) -> Path:
        return self.root / "training_data" / "finetune"

    @property
    def profiles(self) -> Path:
        return self.model_output / "profiles"

    @property
    def reports(self) -> Path:
        """Small JSON/PNG reports of notebooks (doctor, summaries) that belong to no single stage."""
        return self.root / "reports"

    def folders(self) -> list[Path]:
        return [
            self.llm_train,
            self.data_pretrain,
            self.data_finetune,
            self.converted_weights,
            self.logs,
            *(self.output(t) for t in ("pretrain", "sft", "lora")),
            self.tokenizer,
            self.training_data_pretrain,
            self.training_data_finetune,
            self.reports,
        ]

    def create(self) -> Workspace:
        """Create every folder of the layout (idempotent); clear error if the root is not writable."""
        try:
            for folder in self.folders():
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(
                f"cannot create the workspace under {self.root} ({exc.strerror}); set WORKSPACE in the notebook "
                f"or KIT_WORKSPACE to a writable folder (on ModelArts: one under /home/ma-user/work to keep it)."
            ) from exc
        return self

    def write_summary(self, notebook: str, data: dict) -> Path:
        """Write `reports/<notebook>.summary.json`: what a notebook produced, for tests and `make demo`."""
        import json

        from kit.core.configs import to_jsonable
        from kit.storage.atomic import atomic_write_text

        path = self.reports / f"{notebook}.summary.json"
        atomic_write_text(path, json.dumps(to_jsonable(data), indent=2, ensure_ascii=False) + "\n")
        return path

    def missing(self) -> list[Path]:
        """Folders of the layout that do not exist yet."""
        return [f for f in self.folders() if not f.is_dir()]

    def tree(self) -> str:
        """The layout as an indented text tree (every intermediate folder shown), for notebooks."""
        rels = set()
        for folder in self.folders():
            parts = folder.relative_to(self.root).parts
            rels.update(parts[: i + 1] for i in range(len(parts)))
        lines = [f"{self.root}/"]
        for parts in sorted(rels):
            missing = "" if (self.root.joinpath(*parts)).is_dir() else "  (missing)"
            lines.append("    " * len(parts) + f"{parts[-1]}/{missing}")
        return "\n".join(lines)


def get_workspace(
    root: Optional[Union[str, Path]] = None, model: Optional[str] = None, create: bool = True
) -> Workspace:
    """The workspace at `root` for `model`, created unless create=False; None: the project's (kit.core.project:
    notebook 00, `python -m kit project`), else `default_root()` and "demo"."""
    from kit.core.project import resolve

    path, name, sources = resolve(str(root) if root else None, model or None)
    ws = Workspace(path, name, sources)
    return ws.create() if create else ws
