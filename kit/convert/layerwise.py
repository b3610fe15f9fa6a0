"""The HF side of the logits check with one decoder layer's weights in memory at a time, and what the check needs.

`from_pretrained` in fp32 holds the whole model, 3.2x its bf16 size (a 7B was killed under 8 GiB). Here
transformers' own model is built with its parameters on the meta device; each decoder layer's weights are read from
the HF folder in fp32 just before the layer runs and dropped after it, the embedding rows of the tokens and the LM
head are read in row blocks (kit.convert.reference.embed / head_logits). The remote-code families run the kit's
reference forward over `Streamed`, which reads each tensor when the forward uses it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections.abc import Mapping
from typing import Dict

import torch

from kit.convert.checks import ConversionError
from kit.convert.hf_io import HFReader
from kit.convert.reference import BLOCK_BYTES, embed, head_logits
from kit.system.memory import give_back_freed

_LAYER = re.compile(r"\.layers\.(\d+)\.")
# what importing transformers' model code and the allocator's slack add to the check (measured ~230 MiB)
IMPORTS = 256 << 20


class Streamed(Mapping):
    """An HF folder's tensors as a read-on-use mapping (fp32), for kit.convert.reference.hf_forward."""

    def __init__(self, reader: HFReader):
        self.reader = reader

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.reader.weight_map:
            raise KeyError(key)
        return self.reader.read(key).float()

    def __iter__(self):
        return iter(self.reader.weight_map)

    def __len__(self) -> int:
        return len(self.reader.weight_map)

    def piece(self, key: str):
        """The tensor still on disk (rows read on use)."""
        return self.reader.read(key, copy=False)


def logits_check_bytes(reader: HFReader, seq_len: int) -> int:
    """Memory the logits check adds to the process: twice the largest decoder layer in fp32 (its weights, and the
    checkpoint-dtype copies and fused-expert stacks made while reading them), two row blocks of the LM head, the
    activations, and transformers' model code with the allocator's slack (IMPORTS)."""
    layers: Dict[int, int] = {}
    widest = 1
    for key in reader.keys():
        shape = reader.shape(key)
        numel = math.prod(shape)
        m = _LAYER.search(key)
        if m:
            layers[int(m[1])] = layers.get(int(m[1]), 0) + numel
        elif len(shape) == 2:
            widest = max(widest, *shape)
    activations = 16 * seq_len * widest * 4
    return 2 * 4 * max(layers.values(), default=0) + 2 * BLOCK_BYTES + activations + IMPORTS


@contextlib.contextmanager
def _weightless():
    """Modules built inside get their parameters on the meta device (no memory); buffers (the rotary frequencies)
    stay real. accelerate's init_empty_weights does the same; accelerate is not a dependency of the convert stage."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _fetch(reader: HFReader, name: str, like: torch.Tensor) -> torch.Tensor:
    """Parameter `name` from the checkpoint in fp32. transformers >= 5 fuses each MoE layer's experts into
    experts.gate_up_proj [E, 2F, H] and experts.down_proj [E, H, F]; checkpoints store them per expert."""
    prefix = name.rsplit(".", 1)[0] + "."
    if name in reader.weight_map:
        t = reader.read(name).float()
    elif name.endswith("experts.gate_up_proj"):
        t = torch.stack(
            [
                torch.cat([reader.read(f"{prefix}{e}.{n}_proj.weight").float() for n in ("gate", "up")])
                for e in range(like.shape[0])
            ]
        )
    elif name.endswith("experts.down_proj"):
        t = torch.stack([reader.read(f"{prefix}{e}.down_proj.weight").float() for e in range(like.shape[0])])
    else:
        raise ConversionError(
            [f"transformers' model has parameter {name} {tuple(like.shape)}, which {reader.folder} lacks"],
            "HF checkpoint",
        )
    if tuple(t.shape) != tuple(like.shape):
        raise ConversionError(
            [f"{reader.folder}: {name} is {tuple(t.shape)}, transformers' model has {tuple(like.shape)}"],
            "HF checkpoint",
        )
    return t


def _swap(module: torch.nn.Module, prefix: str, tensors, reader: HFReader = None) -> None:
    """Give each parameter of `module` (named prefix.path) the tensor tensors(name, current parameter); with a
    reader, also each buffer the checkpoint holds (DeepSeek-V3 / GLM-4.5's router e_score_correction_bias)."""
    for path, sub in module.named_modules(prefix=prefix):
        for n, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[n] = torch.nn.Parameter(tensors(f"{path}.{n}", p), requires_grad=False)
        for n, b in list(sub._buffers.items()):
            if reader is not None and b is not None and f"{path}.{n}" in reader.weight_map:
                sub._buffers[n] = reader.read(f"{path}.{n}").to(b.dtype)


def _drop(layer: torch.nn.Module, prefix: str) -> None:
    _swap(layer, prefix, lambda _, p: p.to("meta"))
    give_back_freed()


def transformers_logits(reader: HFReader, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [seq, vocab] of transformers' model for the folder, one decoder layer's weights in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kit.system.hf_compat import dtype_kw

    config = AutoConfig.from_pretrained(str(reader.folder))
    with _weightless():
        model = AutoModelForCausalLM.from_config(config, **dtype_kw(torch.float32)).eval()
    base, names = model.base_model, {m: n for n, m in model.named_modules()}
    embedding, fetch = base.get_input_embeddings(), functools.partial(_fetch, reader)
    for child in base.children():  # the final norm: read for the whole run; the layers: each while it runs
        if child is base.layers:
            for layer in child:
                layer.register_forward_pre_hook(lambda m, args: _swap(m, names[m], fetch, reader))
                layer.register_forward_hook(lambda m, args, out: _drop(m, names[m]))
        elif child is not embedding:
            _swap(child, names[child], fetch)
    emb_key = names[embedding] + ".weight"
    head_key = names[model.get_output_embeddings()] + ".weight"
    with torch.no_grad():
        x = embed([reader.read(emb_key, copy=False)], ids)[None]
        h = base(inputs_embeds=x, use_cache=False)[0][0]
        head = head_key if head_key in reader.weight_map else emb_key  # tied: the embedding
        return head_logits(h, [reader.read(head, copy=False)])
