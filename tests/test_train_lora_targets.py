"""LoRA on DeepSeek-V3 (MLA projections) and GLM-4.5: the default LORA_TARGETS become each family's attention
projections; routers, experts and shared experts get no adapter; the adapted LoRA model trains."""

from __future__ import annotations

import pytest
import torch
from fixtures.convert import routed_moe
from test_families_moe_adapt import tiny_model

from kit.train import TrainConfig
from kit.train.engine import build_model

routed_moe.skip_module_without_the_families()

WANT = {  # family (+ overrides) -> the modules that get adapters, per layer
    ("deepseek_v3", ()): {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
    ("deepseek_v3", (("q_lora_rank", None),)): {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"},
    ("glm4_moe", ()): {"q_proj", "k_proj", "v_proj", "o_proj"},
}


@pytest.mark.parametrize("family, overrides", sorted(WANT))
def test_default_targets_cover_the_attention_projections_and_spare_routers_and_experts(
    family, overrides, tmp_path
):
    tiny_model(family, **dict(overrides)).save_pretrained(tmp_path / "model")
    cfg = TrainConfig(model_path=str(tmp_path / "model"), run_type="lora", lora_r=4, lora_alpha=8)
    model, report = build_model(cfg)
    assert report.moe_blocks == 1 and report.attention == "kit"
    adapted = {n for n, _ in model.named_parameters() if "lora_A" in n}
    layers = {n.split(".layers.")[1].split(".")[0] for n in adapted}
    kinds = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in adapted}
    assert layers == {"0", "1"} and kinds == WANT[(family, overrides)]
    assert not [n for n in adapted if ".mlp." in n]  # routers, experts, shared experts, dense MLPs: none
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapted | {n.replace("lora_A", "lora_B") for n in adapted}
    ids = torch.randint(3, 160, (2, 10), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_lora_on_the_router_or_experts_is_refused(tmp_path):
    from kit.errors import InputError

    tiny_model("deepseek_v3").save_pretrained(tmp_path / "model")
    for targets in (["q_b_proj", "gate"], ["experts"]):
        cfg = TrainConfig(model_path=str(tmp_path / "model"), run_type="lora", lora_targets=targets)
        with pytest.raises(InputError, match="'gate' is the router"):
            build_model(cfg)
