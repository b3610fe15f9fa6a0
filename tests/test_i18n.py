"""The kit's lines in English and Chinese (kit.core.i18n, kit.core.messages): one catalog that cannot drift or rot,
one setting (KIT_LANG, else the project's language, else en) that the report, the refusals and the CLI follow."""

from __future__ import annotations

import json
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest

from kit.core.i18n import LANGUAGES, language, language_and_source, t
from kit.core.messages import MESSAGES
from kit.core.project import read_project, set_project
from kit.core.workspace import repo_root
from kit.errors import InputError

CJK = re.compile(r"[\u4e00-\u9fff]")


def _fields(text: str) -> list:
    return sorted(f"{name}!{conv}:{spec}" for _, name, spec, conv in string.Formatter().parse(text) if name)


@pytest.fixture
def project(tmp_path, monkeypatch):
    path = tmp_path / "kit_project.json"
    monkeypatch.setenv("KIT_PROJECT", str(path))
    monkeypatch.setenv("KIT_WORKSPACE", str(tmp_path / "ws"))
    monkeypatch.delenv("KIT_LANG", raising=False)
    return path


def test_every_key_in_both_languages_with_the_same_placeholders_and_the_chinese_is_chinese():
    assert len(MESSAGES) >= 40
    for key, lines in MESSAGES.items():
        assert set(lines) == set(LANGUAGES), key
        assert _fields(lines["en"]) == _fields(lines["zh"]), key
    # only the check names that stay technical terms in Chinese (CANN, DeepSpeed, ...) have no Chinese in them;
    # every other line is Chinese and differs from its English
    latin = sorted(k for k, v in MESSAGES.items() if not CJK.search(v["zh"]))
    assert latin == [f"doctor.check.{n}" for n in ("cann", "deepspeed", "python", "torch", "torch_npu")]
    assert [k for k in MESSAGES if k not in latin and MESSAGES[k]["zh"] == MESSAGES[k]["en"]] == []


def test_every_key_is_used_in_the_kit():
    from kit.errors import ERROR_PREFIX
    from kit.storage.atomic import EXISTS

    # the lines of the layers below the catalog are theirs (the catalog holds the very dicts they use)
    owned = {"error.prefix": ERROR_PREFIX, "output.exists": EXISTS}
    assert all(MESSAGES[k] is v for k, v in owned.items())
    sources = "\n".join(
        p.read_text(encoding="utf-8") for p in (repo_root() / "kit").rglob("*.py") if p.name != "messages.py"
    )
    unused = [k for k in MESSAGES if k not in owned and f'"{k}"' not in sources and f"'{k}'" not in sources]
    assert unused == []


def test_kit_lang_chooses_and_fills_the_line(monkeypatch):
    monkeypatch.setenv("KIT_LANG", "zh")
    assert language_and_source() == ("zh", "KIT_LANG")
    assert t("workspace.bad_run_type", run_type="x", choices="sft") == "RUN_TYPE 'x' 无效，可选值：sft。"
    monkeypatch.setenv("KIT_LANG", "en")
    assert t("workspace.bad_run_type", run_type="x", choices="sft") == "RUN_TYPE 'x' is not one of sft."


def test_the_project_language_is_used_unless_kit_lang_says_otherwise(project, monkeypatch):
    assert language_and_source() == ("en", "default")
    line = set_project(model="Qwen3-8B", language="zh")
    assert json.loads(project.read_text()) == {"model": "Qwen3-8B", "language": "zh"}
    assert line.startswith("项目：model 'Qwen3-8B' (the project)") and "语言 zh（the project）" in line
    assert language_and_source() == ("zh", "the project")
    monkeypatch.setenv("KIT_LANG", "en")
    assert language() == "en"
    assert set_project().startswith("Project: model 'Qwen3-8B'") and "language en (KIT_LANG)" in set_project()


def test_an_unknown_language_is_refused_in_one_line(project, monkeypatch):
    with pytest.raises(
        InputError, match=r"language 'fr' \(language\) is not one the kit speaks; use en or zh"
    ):
        set_project(language="fr")
    assert read_project() == {}
    project.write_text(json.dumps({"language": "de"}))
    with pytest.raises(InputError, match=r"language 'de' \(the project settings .*\) is not one"):
        language()
    monkeypatch.setenv("KIT_LANG", "klingon")
    with pytest.raises(InputError, match=r"'klingon' \(KIT_LANG\)"):
        language()


def test_the_doctor_report_speaks_the_language(tmp_path, monkeypatch):
    from kit.doctor.report import diagnose

    report = diagnose(roots=[str(tmp_path / "noascend")], npu_smi="npu-smi-absent", deepspeed=False)
    assert list(report.table().columns) == ["status", "check", "detail", "fix"]
    assert str(report).splitlines()[-1].startswith(f"{len(report.checks)} checks: ")
    monkeypatch.setenv("KIT_LANG", "zh")
    table = report.table()
    assert list(table.columns) == ["状态", "检查项", "详情", "修复方法"]
    assert table.set_index("检查项").loc["驱动", "状态"] == "提示"  # no npu-smi here: INFO
    assert "<th>状态</th><th>检查项</th>" in report._repr_html_()
    counts = report.counts
    assert str(report).splitlines()[-1] == (
        f"共 {len(report.checks)} 项检查：{counts['pass']} 项通过，{counts['warn']} 项警告，"
        f"{counts['fail']} 项失败，{counts['info']} 项提示；kit 可以在 cpu（gloo）上运行。"
    )
    assert report.to_dict()["checks"][0]["status"] == "pass"  # what programs read stays English


def test_a_refusal_from_the_catalog_in_chinese(monkeypatch, tmp_path):
    from kit.convert.families import family_for_config
    from kit.core.manifest import read_manifest

    monkeypatch.setenv("KIT_LANG", "zh")
    with pytest.raises(InputError, match="^未知的模型系列 'gpt5'；已支持："):
        family_for_config({}, "gpt5")
    with pytest.raises(InputError, match="不存在；这里需要 kit 某个阶段的输出文件夹。$"):
        read_manifest(tmp_path / "nothing")


def _kit(*args, lang=None, project=None):
    env = {k: v for k, v in os.environ.items() if k != "KIT_LANG"}
    if lang:
        env["KIT_LANG"] = lang
    if project:
        env["KIT_PROJECT"] = str(project)
    return subprocess.run(
        [sys.executable, "-m", "kit", *args],
        capture_output=True,
        text=True,
        cwd=repo_root(),
        env=env,
        timeout=120,
    )


def test_the_cli_error_line_speaks_the_language(tmp_path):
    bad = ["project", "--model", "a/b"]
    zh = _kit(*bad, lang="zh", project=tmp_path / "p.json")
    assert zh.returncode == 2 and "Traceback" not in zh.stderr
    assert zh.stderr.splitlines() == [
        "错误：模型名 'a/b' 不是合法的文件夹名；只能使用字母、数字、'.'、'_' 或 '-'（例如 'Llama2-7B' 或 'GLM3-6B'）。"
    ]
    en = _kit(*bad, project=tmp_path / "p.json")
    assert en.returncode == 2 and en.stderr.splitlines() == [
        "error: model name 'a/b' is not a plain folder name; use letters, digits, '.', '_' or '-' "
        "(for example 'Llama2-7B' or 'GLM3-6B')."
    ]
    fr = _kit(*bad, lang="fr", project=tmp_path / "p.json")
    assert fr.returncode == 2 and fr.stderr.splitlines() == [
        "error: language 'fr' (KIT_LANG) is not one the kit speaks; use en or zh (KIT_LANG=zh, or "
        "`python -m kit project --language zh`)."
    ]
    assert not Path(tmp_path / "p.json").exists()
    chosen = _kit("project", "--language", "zh", project=tmp_path / "p.json")
    assert chosen.returncode == 0 and chosen.stdout.startswith("项目：model 'demo' (default)")
    by_project = _kit(*bad, project=tmp_path / "p.json")
    assert by_project.returncode == 2 and by_project.stderr.startswith("错误：模型名 'a/b' ")


def test_the_notebook_error_line_and_the_launcher_read_the_chinese_prefix(monkeypatch, tmp_path):
    import io

    from kit.errors import KitError
    from kit.train.launch import LaunchResult, _consume

    monkeypatch.setenv("KIT_LANG", "zh")
    assert KitError("坏了")._render_traceback_() == ["错误：坏了"]
    monkeypatch.setenv("KIT_LANG", "en")
    assert KitError("broken")._render_traceback_() == ["error: broken"]

    class Bar:
        n = 0

    result = LaunchResult(2, tmp_path / "log", [])
    line = "错误：数据集第 7 行已损坏\n"
    for _ in range(2):  # two ranks say the same: kept once
        _consume(line, io.StringIO(), [], False, result, Bar())
    assert result.rank_lines == [line.rstrip("\n")]


def test_the_does_not_fit_refusal_of_a_launch_in_chinese(tmp_path, tiny_llama_dir, monkeypatch):
    """test_plan's refused launch (8 MiB of host memory for 2 CPU ranks), with KIT_LANG=zh: nothing starts."""
    import test_train_helpers as H
    import torch

    from kit.plan.trace import TORCH_NEEDED
    from kit.system import memory
    from kit.train.launch import launch

    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < TORCH_NEEDED:
        pytest.skip(f"the planner's trace needs torch >= 2.5 (this is {torch.__version__})")
    monkeypatch.setattr(memory, "available_memory", lambda *a, **k: (8 * 2**20, "a test's 8 MiB"))
    data = H.make_pretrain(tmp_path / "p_hf", num_samples=8)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", train_iters=1, nproc_per_node=2, mbs=1, gbs=2)
    monkeypatch.setenv("KIT_LANG", "zh")
    with pytest.raises(InputError) as refused:
        launch(cfg, progress=False)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("放得下吗？DeepSpeed ZeRO-0 在 2 张 ")
    assert "上放不下：" in line and "占用最大的一项是 " in line and "（每张 0.00390625 GiB）" in line
    assert line.endswith("GiB）。如仍要启动，请加 --force（force=True）。")
    assert not list((tmp_path / "ws").rglob("*plan*.json"))


def test_a_list_of_problems_is_one_line_in_chinese(monkeypatch):
    from kit.core.configs import check
    from kit.data.config import DataConfig
    from kit.errors import one_line

    monkeypatch.setenv("KIT_LANG", "zh")
    with pytest.raises(InputError) as refused:
        check(DataConfig(template="bogus"))
    assert one_line(refused.value).startswith(
        "DataConfig 中有 1 个问题：template='bogus' 无效；可选：['alpaca', "
    )


def test_an_existing_output_is_refused_in_the_language(monkeypatch, tmp_path):
    from kit.storage.atomic import OutputExistsError, refuse_existing

    (tmp_path / "out").mkdir()
    with pytest.raises(
        OutputExistsError, match=r"^prepared data '.*out' already exists; choose another path"
    ):
        refuse_existing(tmp_path / "out", False, "prepared data")
    monkeypatch.setenv("KIT_LANG", "zh")
    with pytest.raises(
        OutputExistsError, match=r"^prepared data '.*out' 已存在；请换一个路径.*--overwrite）以覆盖它。$"
    ):
        refuse_existing(tmp_path / "out", False, "prepared data")
    refuse_existing(tmp_path / "out", True, "prepared data")  # asked to overwrite: no refusal
