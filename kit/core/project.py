"""The project's choices, set once and read by every notebook and CLI: which workspace, which model, which language.

Notebook 00 (or `python -m kit project --model M [--workspace W] [--language zh]`) writes them into
`kit_project.json` at the default workspace root (kit.core.workspace.default_root; `KIT_PROJECT` names another
file). Every notebook's `WORKSPACE` and `MODEL` default to None, which means "the project's"; a value typed in a
notebook overrides the project for that notebook only, and the workspace's `origin` says which value came from
where. Without a project file the model is "demo" and the workspace the default root. The language (en | zh) of the
kit's lines is the project's unless KIT_LANG says otherwise (kit.core.i18n).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

from kit.errors import InputError

PROJECT_FILE = "kit_project.json"
DEFAULT_MODEL = "demo"
FIELDS = ("workspace", "model", "language")


def project_path() -> Path:
    """KIT_PROJECT if set, else kit_project.json at the default workspace root."""
    from kit.core.workspace import default_root

    env = os.environ.get("KIT_PROJECT")
    return Path(env).expanduser() if env else default_root() / PROJECT_FILE


def read_project(path: Optional[Path] = None) -> dict:
    """The project's values ({} without a project file); a damaged file is an error in one line."""
    path = Path(path) if path else project_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise InputError(f"cannot read the project settings {path}: {exc.strerror or exc}.") from exc
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise InputError(
            f"the project settings {path} are not JSON ({exc}); set them again (`python -m kit project`)."
        ) from exc
    if not isinstance(values, dict) or set(values) - set(FIELDS):
        raise InputError(
            f"the project settings {path} hold {sorted(values) if isinstance(values, dict) else values!r}; "
            f"expected only {', '.join(FIELDS)} (`python -m kit project` writes them)."
        )
    if values.get("language") is not None:
        from kit.core.i18n import check_language

        check_language(values["language"], f"the project settings {path}")
    return {k: v for k, v in values.items() if v is not None}


def set_project(
    workspace: Optional[str] = None, model: Optional[str] = None, language: Optional[str] = None
) -> str:
    """Set the values given (None keeps the project's) and say, in one sentence, what the project now is."""
    from kit.core.i18n import check_language, language_and_source, t
    from kit.core.workspace import Workspace
    from kit.storage.atomic import atomic_write_text

    path = project_path()
    values = read_project(path)
    if workspace is not None:
        values["workspace"] = str(Path(workspace).expanduser().resolve())
    if model is not None:
        Workspace(Path(values.get("workspace") or "."), model)  # the model name's check, in one line
        values["model"] = model
    if language is not None:
        values["language"] = check_language(language, "language")
    if workspace is not None or model is not None or language is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(values, indent=1) + "\n")
    from kit.core.workspace import get_workspace

    lang, lang_from = language_and_source()
    return t(
        "project.now",
        origin=get_workspace(create=False).origin,
        language=lang,
        language_from=lang_from,
        path=path,
    )


PROJECT, DEFAULT, GIVEN = "the project", "default", "set in this notebook or command"


def resolve(root: Optional[str], model: Optional[str]) -> Tuple[Path, str, Dict[str, str]]:
    """(workspace root, model, {"workspace": where it came from, "model": ...}): an explicit value (GIVEN), else
    the project's (PROJECT), else the default (DEFAULT)."""
    from kit.core.workspace import default_root

    values = read_project() if root is None or model is None else {}

    def pick(given, key, default):
        if given is not None:
            return given, GIVEN
        if key in values:
            return values[key], PROJECT
        return default, DEFAULT

    root_value, root_from = pick(root, "workspace", None)
    name, model_from = pick(model, "model", DEFAULT_MODEL)
    root_path = Path(root_value).expanduser() if root_value else default_root()
    return root_path, name, {"workspace": root_from, "model": model_from}


def add_workspace_arguments(p, model_flag: str = "--workspace-model") -> None:
    """A command's --workspace and model options (default: the project's), for get_workspace."""
    p.add_argument(
        "--workspace",
        default=None,
        help="workspace root (default: the project's, else the kit's default workspace)",
    )
    p.add_argument(
        model_flag,
        default=None,
        help="the model's folder name in the workspace (default: the project's, else demo)",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "project",
        help="set the project's model, workspace and language once; every notebook and command uses them",
    )
    p.add_argument("--model", default=None, help="the model's folder name in the workspace (e.g. Qwen3-8B)")
    p.add_argument(
        "--workspace", default=None, help="the workspace root (default: the default workspace root)"
    )
    p.add_argument(
        "--language",
        default=None,
        help="the language of the kit's reports and error lines: en or zh (KIT_LANG overrides it)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    print(set_project(args.workspace, args.model, args.language))
    return 0
