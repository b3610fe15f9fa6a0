"""The kit trainer (DeepSpeed, CPU, kit.adapt on) on GLM-4, Llama-3.1 and Qwen2.5 with LoRA: the loss goes down on packed
SFT rows, the adapter export keeps every adapter tensor, and the merged export gives the adapted logits. (Qwen3
goes through the same stages in tests/test_families_chain.py.)"""

from __future__ import annotations

import pytest
import test_train_helpers as H
import torch
from fixtures.convert import families as fam_models
from safetensors import safe_open

from kit.train import train

tiny_glm4_dir = fam_models.tiny_glm4_dir  # shared session fixtures
tiny_llama31_dir = fam_models.tiny_llama31_dir
tiny_qwen25_dir = fam_models.tiny_qwen25_dir

# every linear of attention and MLP, under each family's own names, and the output layer (a tiny model's random
# lm_head caps how far adapters on the layers alone can lower the loss)
TARGETS = {
    "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"],
    "llama31": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    # tied embeddings: no adapter on lm_head (merging it would change the input embedding too)
    "qwen25": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return H.make_sft(tmp_path_factory.mktemp("data") / "synthetic_sft_hf")


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(TARGETS))
def test_lora_trains_and_exports_every_adapter_tensor(which, request, sft_data, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kit.adapt.attention import has_registry

    fam_models.require({"glm4": "glm", "llama31": "llama", "qwen25": "qwen2"}[which])
    if which == "glm4" and not has_registry():
        pytest.skip(
            "GLM-4 is adapted through transformers' AttentionInterface (no flash-attention-2 mapping)"
        )
    src = request.getfixturevalue(f"tiny_{which}_dir")
    cfg = H.tiny_config(
        src,
        sft_data,
        tmp_path / "ws",
        run_type="lora",
        train_iters=8,
        gbs=8,
        mbs=4,
        lr=1e-2,
        save_hf=True,
        lora_r=8,
        lora_alpha=32,
        lora_targets=TARGETS[which],
    )
    result = train(cfg, progress=False)
    drop = 0.3 if "lm_head" in TARGETS[which] else 0.1  # the random output layer caps the rest
    assert result.status == "completed" and result.losses[-1] < result.losses[0] - drop, result.losses
    with safe_open(str(result.adapter_dir / "adapter_model.safetensors"), "pt") as fh:
        saved = sorted(k for k in fh.keys() if "lora_" in k)  # peft also stores lm_head's base weight
    layer_targets = [t for t in TARGETS[which] if t != "lm_head"]
    # (2 layers x targets + lm_head) x (A, B)
    assert len(saved) == 2 * (2 * len(layer_targets) + ("lm_head" in TARGETS[which]))
    assert {k.split(".")[-3] for k in saved} == set(TARGETS[which])
    base = AutoModelForCausalLM.from_pretrained(src).eval()
    adapted = PeftModel.from_pretrained(base, result.adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(result.hf_dir).eval()
    ids = torch.tensor([[5, 101, 120, 133, 6, 133, 120, 101, 2]])
    with torch.no_grad():
        a, m = adapted(ids).logits, merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(src)(ids).logits
    torch.testing.assert_close(m, a, atol=1e-4, rtol=1e-4)
    assert (m - plain).abs().max() > 1e-2 and not any("lora" in k for k in merged.state_dict())
