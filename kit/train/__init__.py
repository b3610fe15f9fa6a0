"""Training stage (notebook 04): config (resolved from the inputs' manifests), the DeepSpeed trainer, launch, logs,
and the Megatron/MindSpeed path."""

from kit.system.lazy import lazy_exports
from kit.train.config import TrainConfig, from_manifest, load_config

__all__ = ["TrainConfig", "from_manifest", "load_config", "train", "Trainer", "TrainResult"]

# The trainer pulls in DeepSpeed; import it only when used so `import kit.train` stays fast.
__getattr__, __dir__ = lazy_exports(
    __name__, dict.fromkeys(("train", "Trainer", "TrainResult"), "kit.train.trainer")
)
