"""The project settings (kit.core.project): set once, read by every notebook and command; an explicit value
overrides; a damaged file or a bad name is one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kit.core.project import read_project, set_project
from kit.core.workspace import get_workspace, repo_root
from kit.errors import InputError


@pytest.fixture
def project(tmp_path, monkeypatch):
    path = tmp_path / "kit_project.json"
    monkeypatch.setenv("KIT_PROJECT", str(path))
    monkeypatch.setenv("KIT_WORKSPACE", str(tmp_path / "default-ws"))
    return path


def test_without_a_project_the_defaults_and_with_one_its_values_unless_given(project, tmp_path):
    ws = get_workspace(create=False)
    assert (ws.model, ws.root) == ("demo", (tmp_path / "default-ws").resolve())
    assert ws.origin == f"model 'demo' (default), workspace {tmp_path / 'default-ws'} (default)"
    line = set_project(model="Qwen3-8B")
    assert line.startswith("Project: model 'Qwen3-8B' (the project), workspace ") and str(project) in line
    assert json.loads(project.read_text()) == {"model": "Qwen3-8B"}
    set_project(workspace=str(tmp_path / "proj-ws"))  # keeps the model
    ws = get_workspace(create=False)
    assert (ws.model, ws.root) == ("Qwen3-8B", (tmp_path / "proj-ws").resolve())
    mine = get_workspace(str(tmp_path / "mine"), model="GLM3-6B", create=False)
    assert (mine.model, mine.root) == ("GLM3-6B", (tmp_path / "mine").resolve())
    assert mine.origin.count("(set in this notebook or command)") == 2


def test_a_bad_name_or_a_damaged_file_is_one_line_and_changes_nothing(project):
    set_project(model="Qwen3-8B")
    with pytest.raises(InputError, match="is not a plain folder name"):
        set_project(model="../x")
    assert read_project() == {"model": "Qwen3-8B"}
    project.write_text("{not json")
    with pytest.raises(InputError, match=r"are not JSON .*set them again"):
        get_workspace(create=False)
    project.write_text(json.dumps({"model": "a", "secret": 1}))
    with pytest.raises(InputError, match="expected only workspace, model"):
        read_project()


def test_a_training_run_takes_the_projects_model_and_workspace(project, tmp_path):
    from kit.train import TrainConfig
    from kit.train.resolve import resolve

    set_project(workspace=str(tmp_path / "proj-ws"), model="tiny-proj")
    plan = resolve(TrainConfig(train_iters=1, gbs=2, mbs=1), environ={})
    assert plan.cfg.model_name == "tiny-proj" and plan.cfg.sources["model_name"].startswith("the project (")
    assert Path(plan.cfg.work_dir) == (tmp_path / "proj-ws").resolve()
    assert plan.folder.is_relative_to((tmp_path / "proj-ws").resolve())


def test_the_cli_sets_it_and_refuses_a_bad_name_in_one_line(project):
    def kit(*args):
        return subprocess.run(
            [sys.executable, "-m", "kit", "project", *args],
            capture_output=True,
            text=True,
            cwd=repo_root(),
            timeout=120,
        )

    done = kit("--model", "Qwen3-30B-A3B")
    assert done.returncode == 0 and done.stdout.startswith("Project: model 'Qwen3-30B-A3B' (the project)")
    bad = kit("--model", "a/b")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert read_project() == {"model": "Qwen3-30B-A3B"}


def test_every_notebook_takes_the_project_unless_its_parameters_say_otherwise():
    """Switching the model is one setting: no notebook names a model or workspace of its own by default, and each
    builds its workspace from its (None) parameters and says where the values came from; 00 sets the project."""
    for path in sorted((repo_root() / "notebooks").glob("0[0-7]_*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        params = next(
            "".join(c["source"]) for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])
        )
        assert re.search(r"^MODEL = None  # None: the project's", params, re.M), path.name
        assert re.search(r"^WORKSPACE = None  # None: the project's", params, re.M), path.name
        body = "\n".join(code[1:])
        uses = (
            "get_workspace(WORKSPACE, model=MODEL)",
            "set_project(WORKSPACE, MODEL, LANGUAGE)",
            "a WORKSPACE, MODEL or LANGUAGE",
        )
        rest = body
        for use in uses:
            rest = rest.replace(use, "")
        assert not re.search(r"\bMODEL\b", rest), path.name  # the model is ws.model everywhere else
        if path.name.startswith("00"):
            assert "print(set_project(WORKSPACE, MODEL, LANGUAGE))" in body and "ws = get_workspace()" in body
        else:
            assert (
                'ws = get_workspace(WORKSPACE, model=MODEL)\nprint(f"Project settings: {ws.origin}.")' in body
            )
