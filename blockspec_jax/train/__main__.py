"""Training jobs: ``python -m blockspec_jax.train --gin_file gin/train/<job>.gin [--gin_param B] [--workdir DIR]``.

The jobs are those of the one registry :data:`blockspec_jax.train.jobs.TRAINING_JOBS` (``python -m
blockspec_jax.main`` reads the same table): DistillSpec (``distill_job``, :mod:`blockspec_jax.train.distill_job`),
SPRINTER's verifier head (``sprinter_job``, :mod:`blockspec_jax.train.sprinter_job`), the BPD heads (``heads_job``,
:mod:`blockspec_jax.train.heads_job`) and SD²'s steering map (``steer_job``, :mod:`blockspec_jax.train.steer_job`).
The job run is the one the gin files bind (:func:`selected_job`; ``distill_job`` when none). Each job's settings are
one object (e.g. :class:`blockspec_jax.train.distill_job.DistillSettings`) registered with gin under the job's name,
so ``distill_job.num_steps = 100`` sets its field; the settings every job shares and the models' and prompts' setup
are :mod:`blockspec_jax.train.job_setup`. Gin is used by the entry-point modules only (library modules never import
it): ``make_optimizer.*`` binds the optimizer of ``distill_job`` / ``sprinter_job`` (``total_steps`` is the job's
``num_steps``), ``<scope>/tiny_decoder.*`` random tiny models (``distill_job.target_config =
@target/tiny_decoder()``) and ``drafter_recipe.*`` a drafter recipe (:mod:`blockspec_jax.train.configurables`).

Outputs in the workdir (default ``results/train/<gin file stem>``): ``config.gin`` (the operative config),
``metrics.jsonl`` (a line per step), ``checkpoints/`` (resumed from when present: re-running the command continues
a stopped run), ``loss.png`` (with matplotlib) and, at the end, ``metrics.json`` (each job's module lists its own).
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys
from typing import Callable

import gin

from blockspec_jax import checks as checks_lib
from blockspec_jax import cli
from blockspec_jax import runtime
from blockspec_jax.train import jobs as jobs_lib
from blockspec_jax.train.configurables import drafter_recipe, make_optimizer, tiny_decoder
from blockspec_jax.train.distill_job import distill_job
from blockspec_jax.train.sprinter_job import sprinter_job

__all__ = ["JOBS", "selected_job", "default_workdir", "main", "distill_job", "sprinter_job", "tiny_decoder",
           "drafter_recipe", "make_optimizer"]


def default_workdir(gin_files) -> pathlib.Path:
  """``results/train/<stem of the last gin file>`` (relative to the working directory)."""
  return pathlib.Path("results") / "train" / pathlib.Path(gin_files[-1]).stem


def _jobs() -> dict[str, Callable]:
  """Every training job of the registry by its gin name (importing a job's module registers its settings)."""
  return {name: getattr(importlib.import_module(module), name) for name, module in jobs_lib.TRAINING_JOBS.items()}


#: The training jobs' gin names: the registry's (:data:`blockspec_jax.train.jobs.TRAINING_JOBS`).
JOBS = tuple(jobs_lib.TRAINING_JOBS)


def selected_job() -> Callable:
  """The job the parsed gin files configure (the one with bindings), else ``distill_job`` (also when nothing is
  bound: its own checks then say what is missing); two configured jobs are a UsageError."""
  configured = cli.bound_jobs(JOBS)
  if len(configured) > 1:
    raise checks_lib.UsageError(f"the gin files configure {' and '.join(configured)}; a run trains one job")
  name = configured[0] if configured else jobs_lib.DEFAULT_JOB
  # Only the selected job's module: a bound job's is imported already (its settings are registered), and importing
  # another job's module would register configurables in a locked gin config.
  return getattr(importlib.import_module(jobs_lib.TRAINING_JOBS[name]), name)


def _print_result(job: Callable, summary: dict, workdir: pathlib.Path) -> None:
  """The run's one-line result after its summary."""
  if job is sprinter_job:
    at = min(summary["report_heldout"], key=lambda r: abs(r["threshold"] - 0.5))
    print(f"held-out head at threshold {at['threshold']:g}: accuracy {at['accuracy']:.4f}, eta_fp {at['eta_fp']}, "
          f"eta_fn {at['eta_fn']}, accept rate {at['accept_rate']:.4f} over {at['num']} tokens after "
          f"{summary['steps']} steps ({summary['seconds']:.1f} s); outputs in {workdir}")
  elif "heldout_tv_before" in summary:
    print(f"held-out TV {summary['heldout_tv_before']:.4f} -> {summary['heldout_tv_after']:.4f} after "
          f"{summary['steps']} steps ({summary['seconds']:.1f} s); outputs in {workdir}")
  else:
    print(f"{getattr(job, '__name__', 'job')}: {summary.get('steps')} steps ({summary.get('seconds', 0.0):.1f} s); "
          f"outputs in {workdir}")


def main(argv=None) -> int:
  parser = cli.gin_parser("python -m blockspec_jax.train", __doc__, workdir=True)
  args = parser.parse_args(argv)
  with cli.cli_errors(parser.prog):
    if not args.gin_file:
      raise checks_lib.UsageError("give a job with --gin_file gin/train/<job>.gin")
    runtime.limit_heap_growth()  # checkpoint saves and restores otherwise grow the heap by gigabytes
    cli.join_multihost_from_env()
    _jobs()  # every job's configurables registered before the files are parsed
    cli.parse_gin(args.gin_file, args.gin_param)
    workdir = pathlib.Path(args.workdir) if args.workdir else default_workdir(args.gin_file)
    runtime.check_output_dir(workdir, "the training run's work directory (--workdir)")
    (workdir / "config.gin").write_text(gin.config_str())  # what was bound; the operative config replaces it
    job = selected_job()
    summary = job(workdir)
    (workdir / "config.gin").write_text(gin.operative_config_str())
  print(json.dumps(summary, indent=2))
  _print_result(job, summary, workdir)
  return 0


if __name__ == "__main__":
  sys.exit(main())
