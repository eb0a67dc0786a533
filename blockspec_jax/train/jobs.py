"""The one registry of training jobs: each job's gin name -> the entry-point module that defines it.

Every entry point reads this table: ``python -m blockspec_jax.train`` (:mod:`blockspec_jax.train.__main__`: which
job the gin files configure) and ``python -m blockspec_jax.main`` (``TRAINING_JOBS``: the jobs that take
``--workdir``). A job's module defines, under the job's name, ``<name>(workdir, **overrides) -> dict`` (its
``metrics.json`` summary), whose settings object is registered with gin under the same name (``distill_job.num_steps
= 100``). Plain data: importing this module imports no job (nor gin).
"""

from __future__ import annotations

__all__ = ["TRAINING_JOBS", "DEFAULT_JOB"]

#: gin name of each training job -> the module defining it (``getattr(module, name)`` runs it).
TRAINING_JOBS: dict[str, str] = {
    "distill_job": "blockspec_jax.train.distill_job",
    "sprinter_job": "blockspec_jax.train.sprinter_job",
    "heads_job": "blockspec_jax.train.heads_job",
    "steer_job": "blockspec_jax.train.steer_job",
}
#: The job ``python -m blockspec_jax.train`` runs when the gin files bind none (its checks then say what is missing).
DEFAULT_JOB = "distill_job"
