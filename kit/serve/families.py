"""The flags vllm-ascend's own model tutorials start a model family with, by config.json `model_type`.

Only flags those pages give for every deployment of the family are kept (not the cluster sizes, quantization, MTP
or graph settings they tune for 8-16 NPUs). A flag the user passes in extra_args (or its `--no-` form) wins.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

Flag = Tuple[str, Optional[str]]  # (flag, value or None for a switch)

ASCEND_FAMILY_FLAGS: Dict[str, Tuple[Flag, ...]] = {
    # vllm-project/vllm-ascend docs/source/tutorials/models/DeepSeek-V3.1.md (and DeepSeek-R1.md, the same
    # architecture): every `vllm serve` there has --enable-expert-parallel and --trust-remote-code. No reasoning
    # parser: V3 does not think and V3.1 thinks only when asked (vLLM docs features/reasoning_outputs.md)
    "deepseek_v3": (("--enable-expert-parallel", None), ("--trust-remote-code", None)),
    # vllm-project/vllm-ascend docs/source/tutorials/models/GLM4.x.md (GLM-4.5/4.6/4.7): --enable-expert-parallel,
    # --trust-remote-code, and --reasoning-parser glm45 (vLLM docs features/reasoning_outputs.md: "GLM-4.5 series
    # glm45"). Its tool-call parser there is glm47, for GLM-4.7 weights, so none is set here
    "glm4_moe": (
        ("--enable-expert-parallel", None),
        ("--trust-remote-code", None),
        ("--reasoning-parser", "glm45"),
    ),
}


def _names(args: List[str]) -> set:
    """The option names in argv, `--no-x`, `--x=v` and `--x_y` read as `--x`, `--x-y`."""
    out = set()
    for a in args:
        if a.startswith("--"):
            name = a.split("=", 1)[0].replace("_", "-")
            out.add(name.replace("--no-", "--", 1))
    return out


def ascend_family_flags(model_type: Optional[str], extra_args: List[str]) -> List[str]:
    """The argv vllm-ascend's tutorial gives `model_type`, less what extra_args sets itself."""
    given = _names(extra_args)
    argv: List[str] = []
    for flag, value in ASCEND_FAMILY_FLAGS.get(model_type or "", ()):
        if flag not in given:
            argv += [flag] if value is None else [flag, value]
    return argv
