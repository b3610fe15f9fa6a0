"""LoRA export keeps every adapter tensor (peft 0.12/0.13 dropped them all when given state_dict=)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kit.errors import IntegrityError
from kit.system.hf_compat import load_causal_lm
from kit.train.export import _check_adapter, export_lora


def _lora_model(base_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(load_causal_lm(base_dir), lora)
    with torch.no_grad():  # B starts at zero; make the adapter change the output as training would
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    return model.eval()


def test_export_lora_keeps_every_adapter_tensor_and_merges_them(tiny_llama_dir, tmp_path):
    model = _lora_model(tiny_llama_dir)
    lora_names = [n for n, _ in model.named_parameters() if "lora_" in n]
    adapter, merged = export_lora(
        model, tmp_path / "adapter", tmp_path / "merged", tiny_llama_dir, tiny_llama_dir
    )
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as fh:
        saved = list(fh.keys())
    # 2 layers x (q_proj, v_proj) x (A, B)
    assert len(saved) == len(lora_names) == 8
    ids = torch.tensor([[1, 5, 9, 200, 17, 3]])
    with torch.no_grad():
        base = load_causal_lm(tiny_llama_dir).eval()(ids).logits
        got = load_causal_lm(merged).eval()(ids).logits
        want = model(input_ids=ids).logits
    assert (got - base).abs().max() > 1e-2  # the merged model is not the base
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_an_adapter_missing_tensors_is_refused(tiny_llama_dir, tmp_path):
    from safetensors.torch import save_file

    save_file({"a.lora_A.weight": torch.zeros(2, 2)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(IntegrityError, match="1 tensors, the model has 2"):
        _check_adapter(tmp_path, {"a.lora_A.weight", "a.lora_B.weight"})
    with pytest.raises(IntegrityError):
        _check_adapter(tmp_path, set())
