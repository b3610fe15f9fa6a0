"""ModelArts training jobs from the kit: `build_job(resolve(train_cfg), JobConfig(...))` is the dry run, `submit(plan)`
sends it with the official SDK (`python -m kit job`)."""

from kit.train.job.config import JobConfig
from kit.train.job.request import JobPlan, build_job

__all__ = ["JobConfig", "JobPlan", "build_job", "submit"]


def submit(plan, environ=None) -> str:
    """Create the job on ModelArts (credentials from the environment); return its ID."""
    from kit.train.job.submit import submit as _submit

    return _submit(plan, environ)
