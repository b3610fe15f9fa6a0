"""fix_remote_code: the Baichuan tokenizer fix turns a failing tokenizer folder into a working one, idempotently."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kit.adapt import RemoteCodeFixError, fix_remote_code

FIXTURE = Path(__file__).parent / "fixtures" / "remote_code" / "baichuan_tokenizer"


@pytest.fixture
def tokenizer_dir(tmp_path):
    return Path(shutil.copytree(FIXTURE, tmp_path / "baichuan2-tiny"))


def _load(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


def test_fix_turns_failing_tokenizer_into_working_one(tokenizer_dir):
    with pytest.raises(AttributeError, match="encoder"):
        _load(tokenizer_dir)
    original = (tokenizer_dir / "tokenization_baichuan.py").read_text(encoding="utf-8")
    (result,) = fix_remote_code(tokenizer_dir)
    assert result.status == "applied" and "moved super().__init__" in result.detail
    assert Path(result.backup).read_text(encoding="utf-8") == original
    tok = _load(tokenizer_dir)
    ids = tok("hello 你好")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "hello 你好"
    fixed = (tokenizer_dir / "tokenization_baichuan.py").read_text(encoding="utf-8")
    assert fixed.count("        super().__init__(\n") == 1  # moved, not copied
    assert fixed.index("self.decoder = {") < fixed.index("        super().__init__(\n")


def test_fix_is_idempotent_and_keeps_first_backup(tokenizer_dir):
    original = (tokenizer_dir / "tokenization_baichuan.py").read_text(encoding="utf-8")
    fix_remote_code(tokenizer_dir)
    once = (tokenizer_dir / "tokenization_baichuan.py").read_text(encoding="utf-8")
    (again,) = fix_remote_code(tokenizer_dir)
    assert again.status == "already applied"
    assert (tokenizer_dir / "tokenization_baichuan.py").read_text(encoding="utf-8") == once
    assert (tokenizer_dir / "tokenization_baichuan.py.kit-orig").read_text(encoding="utf-8") == original


def test_dry_run_changes_nothing(tokenizer_dir):
    before = (tokenizer_dir / "tokenization_baichuan.py").read_text(encoding="utf-8")
    (result,) = fix_remote_code(tokenizer_dir, dry_run=True)
    assert result.status == "would apply"
    assert (tokenizer_dir / "tokenization_baichuan.py").read_text(encoding="utf-8") == before
    assert not (tokenizer_dir / "tokenization_baichuan.py.kit-orig").exists()


def test_unexpected_shape_is_reported_clearly(tmp_path):
    (tmp_path / "tokenization_baichuan.py").write_text("class Other:\n    pass\n", encoding="utf-8")
    with pytest.raises(RemoteCodeFixError, match="Tokenizer"):
        fix_remote_code(tmp_path)
    (tmp_path / "tokenization_baichuan.py").write_text(
        "class BaichuanTokenizer:\n    def __init__(self):\n        self.x = 1\n", encoding="utf-8"
    )
    with pytest.raises(RemoteCodeFixError, match="0 top-level super"):
        fix_remote_code(tmp_path)


def test_folder_without_known_files_gives_no_results(tmp_path):
    (tmp_path / "modeling_x.py").write_text("x = 1\n", encoding="utf-8")
    assert fix_remote_code(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        fix_remote_code(tmp_path / "missing")


def test_jit_script_decorators_removed_and_code_still_works(tmp_path):
    import importlib.util

    folder = Path(shutil.copytree(FIXTURE.parent / "chatglm_jit", tmp_path / "glm"))
    (result,) = fix_remote_code(folder)
    assert result.fix == "torch-jit-script-off" and result.status == "applied"
    assert "2 function(s): gelu_impl, rotate_half" in result.detail
    text = (folder / "modeling_chatglm.py").read_text(encoding="utf-8")
    assert "@torch.jit.script" not in text and "@staticmethod" in text
    spec = importlib.util.spec_from_file_location("glm_fixed", folder / "modeling_chatglm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x = torch.linspace(-3, 3, 8)
    torch.testing.assert_close(module.gelu(x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert module.RotaryHelper.rotate_half(torch.tensor([1.0, 2.0])).tolist() == [-2.0, 1.0]
    assert fix_remote_code(folder) == []  # nothing left to do, nothing reported
