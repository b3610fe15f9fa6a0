"""Training stage (notebook 04): config (resolved from the inputs' manifests), the DeepSpeed trainer, launch, logs,
and the Megatron/MindSpeed path."""

from kit.train.config import TrainConfig, from_manifest, load_config

__all__ = ["TrainConfig", "from_manifest", "load_config", "train", "Trainer", "TrainResult"]


def __getattr__(name):
    # The trainer pulls in DeepSpeed; import it only when used so `import kit.train` stays fast.
    if name in ("train", "Trainer", "TrainResult"):
        from kit.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
