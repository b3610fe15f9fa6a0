"""Evaluation (notebook 06): did training help, and how fast does the model answer?

`run(EvalConfig(...), ws)` compares the model a training run exported with the model it started from: held-out
loss and perplexity on the data's held-out split (the training's loss mask), multiple-choice accuracy on local
task files through EleutherAI's lm-eval (or the same recipe computed by the kit), answers side by side in the
data's chat template, and time to first token / decode tokens/s per batch size. Importing the package is light;
torch, transformers and lm-eval load when a function needs them.
"""

from kit.evaluate.config import EvalConfig
from kit.evaluate.run import EvalResult, run
from kit.evaluate.tasks import MCTask, load_task

__all__ = ["EvalConfig", "EvalResult", "MCTask", "load_task", "run"]
