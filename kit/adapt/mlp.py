"""SwiGLU MLPs with gate_proj and up_proj merged into one projection, so npu_swiglu needs no per-call concatenation.

`merge_gate_up(mlp)` builds `gate_up_proj` (one Linear holding [gate; up]) once, at adaptation. `gate_proj` and
`up_proj` stay as modules whose weight is a slice of it (no copy), so module names, LoRA targets and peft keep
working; the MLP's state_dict splits the merged weight back into `gate_proj.weight` / `up_proj.weight` (saved
checkpoints and HF exports keep the HF layout) and load_state_dict merges them again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kit.ops import fused as kit_fused
from kit.ops import resolve_backend


class MergedHalf(nn.Linear):
    """One half of a merged gate/up projection: a Linear whose weight is a row slice of the merged weight."""

    def __init__(self, merged: nn.Linear, start: int, stop: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = merged.in_features, stop - start
        self._merged = [merged]  # a list, so the merged Linear is not registered twice as a submodule
        self._rows = (start, stop)

    @property
    def weight(self):
        start, stop = self._rows
        return self._merged[0].weight[start:stop]

    @property
    def bias(self):
        return None

    def forward(self, x):
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self._rows} of gate_up_proj"


def can_merge(mlp) -> bool:
    """Plain bias-free gate_proj/up_proj Linears of the same input size (Llama, Qwen2/3, Mistral MLPs)."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    return (
        type(gate) is nn.Linear
        and type(up) is nn.Linear
        and gate.bias is None
        and up.bias is None
        and gate.in_features == up.in_features
        and gate.weight.dtype == up.weight.dtype
        and gate.weight.device == up.weight.device
    )


def _split_hook(module, state_dict, prefix, local_metadata):
    merged = state_dict.pop(prefix + "gate_up_proj.weight", None)
    if merged is not None:
        rows = module.gate_proj_rows
        # clones: safetensors refuses two tensors sharing one storage
        state_dict[prefix + "gate_proj.weight"] = merged[:rows].clone()
        state_dict[prefix + "up_proj.weight"] = merged[rows:].clone()
    return state_dict


def _merge_pre_hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    gate, up = prefix + "gate_proj.weight", prefix + "up_proj.weight"
    if gate in state_dict and up in state_dict:
        state_dict[prefix + "gate_up_proj.weight"] = torch.cat((state_dict.pop(gate), state_dict.pop(up)), 0)


def merge_gate_up(mlp) -> bool:
    """Merge mlp.gate_proj / mlp.up_proj into mlp.gate_up_proj (once); False if the MLP does not qualify."""
    if isinstance(getattr(mlp, "gate_up_proj", None), nn.Linear) and isinstance(mlp.gate_proj, MergedHalf):
        return True
    if not can_merge(mlp):
        return False
    gate, up = mlp.gate_proj, mlp.up_proj
    rows = gate.out_features
    merged = nn.Linear(gate.in_features, rows + up.out_features, bias=False)
    merged.weight = nn.Parameter(
        torch.cat((gate.weight.detach(), up.weight.detach()), 0), requires_grad=gate.weight.requires_grad
    )
    mlp.gate_up_proj = merged
    mlp.gate_proj = MergedHalf(merged, 0, rows)
    mlp.up_proj = MergedHalf(merged, rows, rows + up.out_features)
    mlp.gate_proj_rows = rows
    mlp._register_state_dict_hook(_split_hook)
    mlp._register_load_state_dict_pre_hook(_merge_pre_hook)
    return True


def merged_mlp_forward(self, x):
    """down(silu(gate x) * up x): on NPU one matmul into npu_swiglu; elsewhere the two halves as before."""
    gate, up = self.gate_proj, self.up_proj
    if isinstance(gate, MergedHalf) and isinstance(up, MergedHalf) and resolve_backend(x) == "npu":
        return self.down_proj(kit_fused.swiglu(self.gate_up_proj(x), dim=-1))
    # CPU/CUDA (and LoRA-wrapped halves): the same two matmuls as the original module, same numbers
    return self.down_proj(kit_fused.silu_mul(gate(x), up(x)))


def fused_mlp_forward(self, x):
    """down(silu(A) * B) with [A; B] = gate_up_proj(x), the GLM-4 MLP (gate first): npu_swiglu on NPU."""
    return self.down_proj(kit_fused.swiglu(self.gate_up_proj(x), dim=-1))
