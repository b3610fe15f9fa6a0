"""Stage 7: serve the trained model behind an OpenAI-compatible engine, load-test it, package it for ModelArts."""

from kit.serve.config import BenchConfig, PackageConfig, ServeConfig
from kit.system.lazy import lazy_exports

__all__ = ["BenchConfig", "PackageConfig", "ServeConfig", "bench", "chat", "package", "serve"]

# the heavy parts load when used (python -m kit serve --help stays light)
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "serve": "kit.serve.start",
        "bench": "kit.serve.loadtest",
        "chat": "kit.serve.client",
        "package": "kit.serve.modelarts",
    },
)
