"""`kit.profiling.demo`: the names notebook 05 and `python -m kit profile demo` use, kept importable here.

The profile stage lives in kit.profiling.training_run (profile the training notebook 04 configured); the plain
loop over an HF model lives in kit.profiling.plain_loop.
"""

from kit.profiling.plain_loop import load_model, profile_training, run_steps, sample_batches
from kit.profiling.training_run import ProfileResult, profile_trainer, run

__all__ = [
    "ProfileResult",
    "load_model",
    "profile_trainer",
    "profile_training",
    "run",
    "run_steps",
    "sample_batches",
]
