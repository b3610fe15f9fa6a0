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

    return Version(Version(transformers.__version__).base_version) >= Version(version)


def dtype_kw(dtype) -> dict:
    """The keyword argument that sets the weights' dtype in `from_pretrained` on this transformers."""
    return {"dtype" if _transformers_at_least(DTYPE_KEYWORD_SINCE) else "torch_dtype": dtype}
