"""Stage 7: serve the trained model behind an OpenAI-compatible engine, load-test it, package it for ModelArts."""

from kit.serve.config import BenchConfig, PackageConfig, ServeConfig

__all__ = ["BenchConfig", "PackageConfig", "ServeConfig", "bench", "chat", "package", "serve"]


def __getattr__(name):  # the heavy parts load when used (python -m kit serve --help stays light)
    if name == "serve":
        from kit.serve.start import serve

        return serve
    if name == "bench":
        from kit.serve.loadtest import bench

        return bench
    if name == "chat":
        from kit.serve.client import chat

        return chat
    if name == "package":
        from kit.serve.modelarts import package

        return package
    raise AttributeError(name)
