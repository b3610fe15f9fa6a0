"""Differences between the transformers releases the kit supports (4.44 through 5.x), in one place."""

from __future__ import annotations

from functools import cache

# `from_pretrained(dtype=...)` exists from transformers 4.56 (the keyword was `torch_dtype` before; 4.44-4.55
# pass an unknown `dtype` on to the model's __init__, which rejects it). 5.x still accepts torch_dtype but warns.
DTYPE_KEYWORD_SINCE = "4.56.0"


@cache
def _transformers_at_least(version: str) -> bool:
    import transformers
    from packaging.version import Version

    from kit.system.progress import hf_bars

    hf_bars()  # before the kit's first load through transformers: its bars end on their last frame in a notebook
    return Version(Version(transformers.__version__).base_version) >= Version(version)


def dtype_kw(dtype) -> dict:
    """The keyword argument that sets the weights' dtype in `from_pretrained` on this transformers."""
    return {"dtype" if _transformers_at_least(DTYPE_KEYWORD_SINCE) else "torch_dtype": dtype}


def _forward_params(model) -> dict:
    """The parameters of the model's forward (PEFT's wrapper looked through), or {} where none can be read."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the HF model
    try:
        return dict(inspect.signature(base.forward).parameters)
    except (TypeError, ValueError):
        return {}


def takes_logit_positions(model) -> bool:
    """True when the model's forward takes `logits_to_keep` as a tensor of positions (transformers >= 4.50 models;
    4.45-4.49 had an int `num_logits_to_keep`, remote-code models may have neither)."""
    param = _forward_params(model).get("logits_to_keep")
    return param is not None and "Tensor" in str(param.annotation)


def last_logits_only(model) -> dict:
    """The keyword that makes the forward compute the LM head at the last position only, as `generate()` passes it
    in the prefill: `logits_to_keep` (transformers >= 4.50), `num_logits_to_keep` (4.45-4.49), else none."""
    params = _forward_params(model)
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def load_causal_lm(path, torch_dtype=None):
    """AutoModelForCausalLM from a local folder, ignoring a leftover GGUF `quantization_config`.

    The demo model was dequantized from a GGUF file but its config still names gguf; transformers would then
    treat the plain fp32 safetensors as quantized and refuse to save the trained model.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    quant = getattr(config, "quantization_config", None)
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        delattr(config, "quantization_config")
    return AutoModelForCausalLM.from_pretrained(
        str(path), config=config, **dtype_kw(torch_dtype or torch.float32)
    )
