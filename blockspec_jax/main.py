"""One gin entry point for every gin-configured job (the t5x convention: the gin files say what runs).

    python -m blockspec_jax.main --gin_file gin/eval/smoke.gin [--gin_file more.gin] [--gin_param "suite.gammas = (2,)"]
    python -m blockspec_jax.main --gin_file gin/train/distill_smoke.gin [--workdir DIR]

The job is the one whose settings the gin files bind (``JOBS``: the main job ``run_job``, the evaluation suites
``suite``, the benchmarks ``bench_lossy`` and ``bench_startup``, the theory report ``theory_report``, and the
training jobs ``distill_job``, ``sprinter_job``, ``heads_job``, ``steer_job``, which also take ``--workdir``). Gin
files compose with ``include``; bindings of two different jobs are refused. Each job's own command (``python -m
blockspec_jax.run``, ``python -m blockspec_jax.eval.suite``, ``python -m blockspec_jax.train``, …) does the same for
its job alone.
"""

from __future__ import annotations

import importlib
import sys

import gin

from blockspec_jax import jobs

__all__ = ["JOBS", "TRAINING_JOBS", "configured_job", "main"]

#: gin name of each job -> the module whose ``main(argv)`` runs it (and whose import registers its settings).
JOBS = {
    "run_job": "blockspec_jax.run",
    "suite": "blockspec_jax.eval.suite",
    "bench_lossy": "blockspec_jax.eval.bench_lossy",
    "bench_startup": "blockspec_jax.eval.bench_startup",
    "theory_report": "blockspec_jax.__main__",
}
#: Training jobs: run by the training entry point (``--workdir``, checkpoints, metrics).
TRAINING_JOBS = ("distill_job", "sprinter_job", "heads_job", "steer_job")
TRAINING_MODULE = "blockspec_jax.train.__main__"


def _register_all() -> None:
  """Import every job's module, so each configurable is known before the gin files are parsed."""
  for module in JOBS.values():
    importlib.import_module(module)
  importlib.import_module(TRAINING_MODULE)._jobs()


def configured_job() -> str:
  """The name of the one job the parsed gin configuration binds; a UsageError for none or several."""
  configured = jobs.bound_jobs((*JOBS, *TRAINING_JOBS))
  if not configured:
    raise jobs.UsageError(f"the gin files bind no job's settings; bind one of {', '.join((*JOBS, *TRAINING_JOBS))} "
                          "(e.g. --gin_file gin/eval/smoke.gin)")
  if len(configured) > 1:
    raise jobs.UsageError(f"the gin files configure {' and '.join(configured)}; a run runs one job")
  return configured[0]


def main(argv=None) -> int:
  parser = jobs.gin_parser("python -m blockspec_jax.main", __doc__, workdir=True)
  args = parser.parse_args(argv)
  with jobs.cli_errors(parser.prog):
    if not args.gin_file:
      raise jobs.UsageError("give the job's gin file: --gin_file gin/<kind>/<job>.gin")
    jobs.add_gin_search_path()
    _register_all()
    gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
    name = configured_job()
    if args.workdir and name not in TRAINING_JOBS:
      raise jobs.UsageError(f"--workdir is for training jobs; {name} writes where its own settings say")
  gin.clear_config()  # the job's own entry point parses the same files again
  return importlib.import_module(TRAINING_MODULE if name in TRAINING_JOBS else JOBS[name]).main(argv)


if __name__ == "__main__":
  sys.exit(main())
