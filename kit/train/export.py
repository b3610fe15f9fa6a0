"""Plain HF folders from a trained engine (LoRA: adapter + merged weights) and a quick generation check."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional, Union

from kit.errors import IntegrityError, writing
from kit.storage.atomic import atomic_dir

PathLike = Union[str, Path]


@contextlib.contextmanager
def _full_params(module, zero_stage: int):
    """Inside: every parameter is whole on every rank (ZeRO-3 gathers them; other stages keep them whole)."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield
    else:
        yield


def _save_tokenizer(tokenizer_dir: PathLike, out: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out)


def export_hf(
    module,
    out_dir: PathLike,
    tokenizer_dir: PathLike,
    zero_stage: int = 0,
    rank: int = 0,
    base_path: Optional[PathLike] = None,
) -> Path:
    """Save the trained (non-LoRA) model as safetensors + config + tokenizer; all ranks call, rank 0 writes.
    base_path: the folder it was trained from, whose MTP layers the export carries (kit/train/mtp_carry.py)."""
    from kit.train.mtp_carry import carry_mtp_layers

    out_dir = Path(out_dir)
    with _full_params(module, zero_stage):
        if rank == 0:
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            with writing(out_dir), atomic_dir(out_dir, overwrite=True, what="exported HF folder") as tmp:
                module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
                if base_path is not None:
                    carry_mtp_layers(base_path, tmp)
                _save_tokenizer(tokenizer_dir, tmp)
    return out_dir


def export_lora(
    module,
    adapter_dir: PathLike,
    merged_dir: PathLike,
    base_path: PathLike,
    tokenizer_dir: PathLike,
    zero_stage: int = 0,
    rank: int = 0,
) -> tuple:
    """Save the LoRA adapter, then merge it into a fresh copy of the base model and save that as plain HF."""
    from peft import get_peft_model_state_dict

    adapter_dir, merged_dir = Path(adapter_dir), Path(merged_dir)
    with _full_params(module, zero_stage):
        if rank == 0:
            expected = set(get_peft_model_state_dict(module))
            with (
                writing(adapter_dir),
                atomic_dir(adapter_dir, overwrite=True, what="LoRA adapter folder") as tmp,
            ):
                # No state_dict= here: peft 0.12/0.13 filter a passed state dict again by adapter name, which the
                # output of get_peft_model_state_dict() no longer carries, and silently save zero tensors.
                module.save_pretrained(tmp, safe_serialization=True)
                _check_adapter(tmp, expected)
    if rank == 0:
        merge_lora(base_path, adapter_dir, merged_dir, tokenizer_dir)
    return adapter_dir, merged_dir


def _check_adapter(folder: Path, expected: set) -> None:
    """The saved adapter holds every LoRA tensor of the model (a partial adapter must not look finished)."""
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as fh:
        saved = set(fh.keys())
    if not expected or saved != expected:
        raise IntegrityError(
            f"the LoRA adapter would hold {len(saved)} tensors, the model has {len(expected)} "
            f"(missing e.g. {sorted(expected - saved)[:2]}); this peft version saves it wrongly: "
            f"install a peft the README lists as tested."
        )


def merge_lora(
    base_path: PathLike, adapter_dir: PathLike, out_dir: PathLike, tokenizer_dir: Optional[PathLike] = None
) -> Path:
    """base + adapter -> one plain HF folder (W + B·A·alpha/r folded into each target weight), fp32 on CPU."""
    from peft import PeftModel

    from kit.system.hf_compat import load_causal_lm
    from kit.system.noise import quiet
    from kit.train.mtp_carry import carry_mtp_layers

    base = load_causal_lm(base_path)
    # peft asks transformers a deprecated attribute (a FutureWarning in the notebook's kernel otherwise)
    with quiet(Path(out_dir).parent / "third_party.log"):
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    with writing(out_dir), atomic_dir(out_dir, overwrite=True, what="merged LoRA folder") as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        carry_mtp_layers(base_path, tmp)  # transformers does not build GLM-4.5 / DeepSeek-V3's MTP layers
        _save_tokenizer(tokenizer_dir or base_path, tmp)
    return Path(out_dir)


def generate(model_dir: PathLike, prompt: str, max_new_tokens: int = 32, chat: bool = True) -> str:
    """Greedy continuation of `prompt` (through the tokenizer's chat template when it has one), on CPU."""
    import torch
    from transformers import AutoTokenizer

    from kit.system.hf_compat import load_causal_lm

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_causal_lm(model_dir).eval()
    if chat and tok.chat_template:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
