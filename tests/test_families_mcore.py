"""megatron-core 0.16.1 loads the kit's Qwen3 / GLM-4 / Llama-3.1 / Qwen2.5 rank files strictly and matches
transformers' logits (TP1, CPU, gloo, local layer spec with q/k layernorm and llama3 rope scaling)."""

from __future__ import annotations

import argparse

import pytest
import torch
from fixtures.convert import families as fam_models

from kit.convert import ConvertConfig, hf_to_megatron
from kit.convert.megatron_io import MegatronReader
from kit.convert.verify import hf_logits, sample_tokens

pytest.importorskip(
    "megatron.core", reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)"
)
import test_convert_mcore as mc  # noqa: E402  (after the skip: it needs megatron-core)

build_gpt = mc.build_gpt
mcore_world, cpu_patches = (
    mc.mcore_world,
    mc.cpu_patches,
)  # shared fixtures (one gloo process group per module)

tiny_qwen3_dir = fam_models.tiny_qwen3_dir  # shared session fixtures
tiny_qwen3_untied_dir = fam_models.tiny_qwen3_untied_dir
tiny_glm4_dir = fam_models.tiny_glm4_dir
tiny_llama31_dir = fam_models.tiny_llama31_dir
tiny_qwen25_dir = fam_models.tiny_qwen25_dir
tiny_mistral_dir = fam_models.tiny_mistral_dir

TOKENS = 64  # llama3 rope scaling changes these logits by far more than the tolerance (see the last test)


def _run(model, s: int) -> torch.Tensor:
    ids = sample_tokens(2522, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]  # True = masked (Megatron)
    with torch.no_grad():
        return model(ids[None], torch.arange(s)[None], mask)[0]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen3_tied", "qwen3_untied", "glm4", "llama31", "qwen25", "mistral"])
def test_gptmodel_strict_load_and_logits(which, request, tmp_path, mcore_world, cpu_patches):
    src = request.getfixturevalue(
        {
            "qwen3_tied": "tiny_qwen3_dir",
            "qwen3_untied": "tiny_qwen3_untied_dir",
            "glm4": "tiny_glm4_dir",
            "llama31": "tiny_llama31_dir",
            "qwen25": "tiny_qwen25_dir",
            "mistral": "tiny_mistral_dir",
        }[which]
    )
    out = tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(src), str(out), tp=1, pp=1), progress=False)
    state = MegatronReader(out).state(0, 0)
    model = build_gpt(state["args"])
    result = model.load_state_dict(state["model"], strict=True)
    assert not result.missing_keys and not [k for k in result.unexpected_keys if "_extra_state" not in k]
    own = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    assert set(own) == set(state["model"])
    for k, v in own.items():  # every tensor of the model is the file's (none left at random init)
        assert torch.equal(v, state["model"][k]), k
    logits = _run(model, TOKENS)
    ref = hf_logits(src, sample_tokens(2522, TOKENS))
    assert float((logits[:, : ref.shape[-1]] - ref).abs().max()) <= 1e-4


@pytest.mark.slow
def test_llama31_without_rope_scaling_is_caught(tiny_llama31_dir, tmp_path, mcore_world, cpu_patches):
    """Negative control: the same rank files run without --use-rope-scaling give logits off by far more."""
    out = tmp_path / "m"
    hf_to_megatron(ConvertConfig(str(tiny_llama31_dir), str(out)), progress=False)
    state = MegatronReader(out).state(0, 0)
    args = argparse.Namespace(**dict(vars(state["args"]), use_rope_scaling=False))
    model = build_gpt(args)
    model.load_state_dict(state["model"], strict=True)
    ref = hf_logits(tiny_llama31_dir, sample_tokens(2522, TOKENS))
    assert float((_run(model, TOKENS)[:, : ref.shape[-1]] - ref).abs().max()) > 2e-3
