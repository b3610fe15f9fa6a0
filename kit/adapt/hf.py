"""Route transformers-native models (Llama, Qwen2/3, Qwen3-MoE, Mistral, GLM-4, DeepSeek-V3, GLM-4.5) through kit
ops.

`adapt_model(model)` switches attention to kit attention (transformers' AttentionInterface where it exists, the
flash-attention-2 path on transformers 4.44-4.47, see `kit.adapt.attention`), merges each SwiGLU MLP's gate/up
projections once, runs MoE blocks (Qwen3-MoE; DeepSeek-V3 and GLM-4.5 with their shared experts) through
kit.ops.moe (`kit.adapt.moe`), and swaps RMSNorm / SwiGLU MLP / rotary for the fused kit ops after checking, on a
probe input on the device the model will train on (the NPU when there is one, even while the model is still on
CPU), that each swap gives the same numbers. Packed samples (position_ids restarting inside a row) and padding run
as TND varlen attention, so no attention crosses dialogs.
"""

from __future__ import annotations

import copy
import inspect
import sys
import types
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from kit.adapt.attention import (
    ATTENTION_NAME,
    has_registry,
    kit_attention_forward,
    kit_attention_mask,
    register,
    use_fa2_path,
)
from kit.adapt.mlp import fused_mlp_forward, merge_gate_up, merged_mlp_forward
from kit.adapt.moe import is_moe_block, moe_block_forward, prepare_block
from kit.ops import fused as kit_fused
from kit.ops.backend import resolve, use_backend

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "glm", "deepseek_v3", "glm4_moe")
__all__ = [
    "ATTENTION_NAME",
    "SUPPORTED_MODEL_TYPES",
    "AdaptReport",
    "adapt_model",
    "kit_attention_forward",
    "kit_attention_mask",
    "register",
]


@dataclass
class AdaptReport:
    """What adapt_model changed, so notebooks and logs can show it."""

    model_type: str
    attention: str  # the attention implementation now in use
    attention_modules: int = 0
    rms_norms: int = 0
    mlps: int = 0
    moe_blocks: int = 0  # sparse MoE blocks (router + experts) now running kit.ops.moe
    rotary: list = field(default_factory=list)  # modeling modules whose apply_rotary_pos_emb now uses kit
    backend: str = "torch"  # where kit ops run for this model: "npu" (torch_npu kernels) or "torch"
    probe_device: str = "cpu"  # where the swaps were checked against the original modules
    attention_path: str = ""  # "registry" (AttentionInterface) or "flash_attention_2" (older transformers)
    skipped: list = field(default_factory=list)  # what was left alone, and why

    def to_dict(self) -> dict:
        return asdict(self)


def _rms_forward(self, hidden_states):
    return kit_fused.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _same(a, b) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):  # e.g. a MoE block's (hidden, router_logits)
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    # fused NPU kernels are not bit-identical: the parity bar is 1e-5 (fp32) / 1e-2 (bf16, fp16)
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 1e-2
    return a.shape == b.shape and bool(torch.allclose(a.float().cpu(), b.float().cpu(), rtol=tol, atol=tol))


def _allocate(device: str) -> torch.device:
    """The torch.device for probe tensors (a seam: the CPU stand-in of torch_npu cannot allocate NPU memory)."""
    return torch.device(device)


def probe_target(param) -> tuple:
    """(device string, backend) where the model's kit ops will run: its own device, or the accelerator it will
    be moved to (kit.system.device) while it is still on CPU, as in kit.train before DeepSpeed places it."""
    if param.device.type != "cpu":
        return str(param.device), resolve(param)
    from kit.system.device import detect

    info = detect()
    if info.kind == "cpu":
        return "cpu", resolve(param)
    import os

    device = f"{info.kind}:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device, resolve(types.SimpleNamespace(device=types.SimpleNamespace(type=info.kind)))


class _Prober:
    """Checks one representative module per (class, swap) on the target device; the verdict covers the rest."""

    def __init__(self, device: str, backend: str, report: AdaptReport, probe: bool = True):
        self.device, self.backend, self.report, self.probe = device, backend, report, probe
        self.verdicts: dict = {}

    def check(self, module, new_forward, width: int, label: str, prepare=None) -> bool:
        if not self.probe:
            return True
        key = (type(module), new_forward)
        if key in self.verdicts:
            return self.verdicts[key]
        param = next(module.parameters())
        gen = torch.Generator().manual_seed(0)
        try:
            probe_module = copy.deepcopy(module).to(_allocate(self.device))
            probe = torch.randn(2, 3, width, generator=gen).to(
                device=_allocate(self.device), dtype=param.dtype
            )
            with torch.no_grad():
                with use_backend("torch"):
                    expected = probe_module(probe)
                if prepare is not None:
                    prepare(probe_module)
                with use_backend(self.backend):
                    got = new_forward(probe_module, probe)
        except Exception as exc:  # e.g. ZeRO-3 partitioned (empty) weights: adapt before deepspeed.initialize
            self.report.skipped.append(
                f"{label} {type(module).__name__}: probe failed ({type(exc).__name__}: {exc}); "
                "kept original. Call adapt_model before wrapping the model (DeepSpeed/FSDP)."
            )
            self.verdicts[key] = False
            return False
        ok = _same(expected, got)
        if not ok:
            self.report.skipped.append(
                f"{label} {type(module).__name__}: kit op differs on a probe input on {self.device}; kept original"
            )
        self.verdicts[key] = ok
        return ok


def _patch_rotary(attn_module, report: AdaptReport, prober: _Prober) -> None:
    modeling = sys.modules.get(type(attn_module).__module__)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    name = getattr(modeling, "__name__", "?")
    if original is None or getattr(original, "__kit__", False) or name in report.rotary:
        if getattr(original, "__kit__", False) and name not in report.rotary:
            report.rotary.append(name)
        return
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        params = {}
    indexed = "position_ids" in params and params["position_ids"].default is inspect.Parameter.empty
    replacement = _indexed_rotary if indexed else _kit_rotary
    if name.endswith(".modeling_glm"):  # GLM-4: interleaved pairs on the first half of each head
        replacement = _glm_rotary
    if not prober.probe:
        modeling.apply_rotary_pos_emb = replacement
        report.rotary.append(name)
        return
    gen = torch.Generator().manual_seed(1)
    device = _allocate(prober.device)
    q, k = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    angles = torch.rand(7 if indexed else 2, *(() if indexed else (5,)), 8, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()  # real cos/sin: npu_rotary_mul wants values in [-1, 1]
    args = [t.to(device) for t in (q, k, cos, sin)]
    if indexed:
        args.append(torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]], device=device))
    try:
        with use_backend("torch"):
            want = original(*args)
    except TypeError:
        report.skipped.append(f"rotary in {name}: unexpected signature; kept original")
        return
    with use_backend(prober.backend):
        got = replacement(*args)
    if not all(_same(a, b) for a, b in zip(want, got)):
        report.skipped.append(
            f"rotary in {name}: differs from kit rotary_mul on {prober.device}; kept original"
        )
        return
    # module-global: every model of this family in the process uses it (numerically identical, checked above)
    modeling.apply_rotary_pos_emb = replacement
    report.rotary.append(name)


def _kit_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return kit_fused.apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)


def _indexed_rotary(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    """transformers 4.44 Qwen2 convention: cos/sin are (S, D) tables that position_ids index."""
    return kit_fused.apply_rotary_pos_emb(
        q, k, cos[position_ids], sin[position_ids], unsqueeze_dim=unsqueeze_dim
    )


def _glm_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' GLM rotary: the first half of cos/sin repeated pairwise, applied to as many leading channels
    in interleaved pairs (npu_rotary_mul's 'interleave' mode), the rest passed through."""
    if isinstance(position_ids, int):
        unsqueeze_dim = position_ids
    cos, sin = (t.unsqueeze(unsqueeze_dim) for t in (cos, sin))
    cos, sin = (t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
    return (
        kit_fused.rotary_mul(q, cos, sin, rotary_mode="interleave"),
        kit_fused.rotary_mul(k, cos, sin, rotary_mode="interleave"),
    )


_kit_rotary.__kit__ = _indexed_rotary.__kit__ = _glm_rotary.__kit__ = True


def _switch_attention(model, model_type: str, report: AdaptReport) -> None:
    if has_registry() and hasattr(model, "set_attn_implementation"):
        register()
        model.set_attn_implementation(ATTENTION_NAME)
        report.attention, report.attention_path = ATTENTION_NAME, "registry"
        return
    use_fa2_path(model, model_type)
    report.attention, report.attention_path = ATTENTION_NAME, "flash_attention_2"


def adapt_model(
    model,
    *,
    attention: bool = True,
    norms: bool = True,
    mlp: bool = True,
    rotary: bool = True,
    force: bool = False,
    device: Optional[str] = None,
    probe: bool = True,
) -> AdaptReport:
    """Make a transformers causal LM use kit ops (attention, RMSNorm, SwiGLU, rotary); return what changed.

    `device`: where to check the swaps (default: the model's device, or the accelerator kit.system.device finds).
    `probe=False` makes every swap without running it against the original first: for a model of fake tensors
    (kit.plan traces memory with them), where nothing can be computed or compared.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"adapt_model needs a transformers PreTrainedModel, got {type(model).__name__}.")
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES and not force:
        raise ValueError(
            f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES} that adapt_model was checked on. "
            "Pass force=True to try anyway, or use install_flash_attn_bridge() for remote-code models."
        )
    param = next(model.parameters())
    target, backend = probe_target(param)
    if device is not None:
        target = device
        backend = resolve(types.SimpleNamespace(device=types.SimpleNamespace(type=device.split(":")[0])))
    report = AdaptReport(
        model_type=model_type,
        attention=str(config._attn_implementation),
        backend=backend,
        probe_device=target,
    )
    prober = _Prober(target, backend, report, probe)
    if attention:
        _switch_attention(model, model_type, report)
    hidden_act = str(getattr(config, "hidden_act", ""))
    for name, module in model.named_modules():
        cls = type(module).__name__
        if hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            report.attention_modules += int(attention)
            if rotary:
                _patch_rotary(module, report, prober)
        elif norms and cls.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            if _adapted(module) or prober.check(module, _rms_forward, module.weight.shape[-1], name):
                _set_forward(module, _rms_forward)
                report.rms_norms += 1
        elif mlp and is_moe_block(module):
            if hidden_act not in ("silu", "swish"):
                report.skipped.append(f"{name}: hidden_act={hidden_act!r} is not SwiGLU; kept original")
            elif _adapted(module) or prober.check(
                module, moe_block_forward, config.hidden_size, name, prepare=prepare_block
            ):
                prepare_block(module)
                _set_forward(module, moe_block_forward)
                report.moe_blocks += 1
        elif mlp and all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")):
            if hidden_act not in ("silu", "swish"):
                report.skipped.append(f"{name}: hidden_act={hidden_act!r} is not SwiGLU; kept original")
            elif _adapted(module) or prober.check(
                module, merged_mlp_forward, module.gate_proj.in_features, name, prepare=merge_gate_up
            ):
                merge_gate_up(module)
                _set_forward(module, merged_mlp_forward)
                report.mlps += 1
        elif mlp and _fused_glu(module):  # GLM-4: gate_up_proj is one Linear already
            if hidden_act not in ("silu", "swish"):
                report.skipped.append(f"{name}: hidden_act={hidden_act!r} is not SwiGLU; kept original")
            elif _adapted(module) or prober.check(
                module, fused_mlp_forward, module.gate_up_proj.in_features, name
            ):
                _set_forward(module, fused_mlp_forward)
                report.mlps += 1
    return report


def _fused_glu(module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        type(gate_up) is torch.nn.Linear
        and gate_up.bias is None
        and isinstance(down, torch.nn.Linear)
        and not hasattr(module, "gate_proj")
    )


def _adapted(module) -> bool:
    return isinstance(module.__dict__.get("forward"), types.MethodType)


def _set_forward(module, new_forward) -> None:
    if not _adapted(module):
        module.forward = types.MethodType(new_forward, module)
