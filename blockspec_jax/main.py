"""One gin entry point for every gin-configured job (the t5x convention: the gin files say what runs).

    python -m blockspec_jax.main --gin_file gin/eval/smoke.gin [--gin_file more.gin] [--gin_param "suite.gammas = (2,)"]
    python -m blockspec_jax.main --gin_file gin/train/distill_smoke.gin [--workdir DIR]

The job is the one whose settings the gin files bind (``JOBS``: the main job ``run_job``, the evaluation suites
``suite``, the benchmarks ``bench_lossy``, ``bench_startup`` and
``bench_mesh``, the theory report ``theory_report``; the training
jobs ``distill_job``, ``sprinter_job``, ``heads_job``, ``steer_job``, which also take ``--workdir``; and the
argparse commands ``ARGPARSE_JOBS`` (``paired``, ``bench_decode``, ``bench_peer``, ``bench_trees``,
``bench_verify``, ``bench_sampling``, ``sprinter_transfer``, ``heads_transfer``, ``build_prompts``), whose gin
settings are their options by dest with the parser's defaults, e.g. ``paired.num_prompts = 24``). Gin files compose
with ``include``; bindings of two different jobs are refused.
Each job's own command (``python -m blockspec_jax.run``, ``python -m blockspec_jax.eval.suite``, ``python -m
blockspec_jax.train``, ``python -m blockspec_jax.eval.paired --num-prompts 24``, …) does the same for its job alone.
"""

from __future__ import annotations

import importlib
import sys

import gin

from blockspec_jax import checks
from blockspec_jax import cli
from blockspec_jax.train import jobs as train_jobs

__all__ = ["JOBS", "TRAINING_JOBS", "ARGPARSE_JOBS", "configured_job", "main"]

#: gin name of each job -> the module whose ``main(argv)`` runs it (and whose import registers its settings).
JOBS = {
    "run_job": "blockspec_jax.run",
    "suite": "blockspec_jax.eval.suite",
    "bench_lossy": "blockspec_jax.eval.bench_lossy",
    "bench_startup": "blockspec_jax.eval.bench_startup",
    "bench_mesh": "blockspec_jax.eval.bench_mesh",
    "theory_report": "blockspec_jax.__main__",
}
#: Training jobs: run by the training entry point (``--workdir``, checkpoints, metrics); the names of the one
#: registry of training jobs (:data:`blockspec_jax.train.jobs.TRAINING_JOBS`), which that entry point reads too.
TRAINING_JOBS = tuple(train_jobs.TRAINING_JOBS)
TRAINING_MODULE = "blockspec_jax.train.__main__"
#: Commands with an argparse command line -> their module (``build_parser()`` and ``main(argv)``): gin jobs made by
#: ``cli.argparse_gin_job`` when this entry point registers them, so the library modules never import gin.
ARGPARSE_JOBS = {
    "paired": "blockspec_jax.eval.paired",
    "bench_decode": "blockspec_jax.eval.bench_decode",
    "bench_peer": "blockspec_jax.eval.bench_peer",
    "bench_trees": "blockspec_jax.eval.bench_trees",
    "bench_verify": "blockspec_jax.eval.bench_verify",
    "bench_sampling": "blockspec_jax.eval.bench_sampling",
    "sprinter_transfer": "blockspec_jax.eval.sprinter_transfer",
    "heads_transfer": "blockspec_jax.eval.heads_transfer",
    "build_prompts": "blockspec_jax.data.prompts",
}
_ARGPARSE_CONFIGURABLES: dict = {}


def argparse_job(name: str):
  """The gin configurable of the argparse command ``name`` (registered once per process)."""
  if name not in _ARGPARSE_CONFIGURABLES:
    module = importlib.import_module(ARGPARSE_JOBS[name])
    _ARGPARSE_CONFIGURABLES[name] = cli.argparse_gin_job(name, module.build_parser, lambda argv: module.main(argv))
  return _ARGPARSE_CONFIGURABLES[name]


def _register_all() -> None:
  """Import every job's module, so each configurable is known before the gin files are parsed."""
  for module in JOBS.values():
    importlib.import_module(module)
  importlib.import_module(TRAINING_MODULE)._jobs()
  for name in ARGPARSE_JOBS:
    argparse_job(name)


def configured_job() -> str:
  """The name of the one job the parsed gin configuration binds; a UsageError for none or several."""
  names = (*JOBS, *TRAINING_JOBS, *ARGPARSE_JOBS)
  configured = cli.bound_jobs(names)
  if not configured:
    raise checks.UsageError(f"the gin files bind no job's settings; bind one of {', '.join(names)} "
                          "(e.g. --gin_file gin/eval/smoke.gin)")
  if len(configured) > 1:
    raise checks.UsageError(f"the gin files configure {' and '.join(configured)}; a run runs one job")
  return configured[0]


def main(argv=None) -> int:
  parser = cli.gin_parser("python -m blockspec_jax.main", __doc__, workdir=True)
  args = parser.parse_args(argv)
  with cli.cli_errors(parser.prog):
    if not args.gin_file:
      raise checks.UsageError("give the job's gin file: --gin_file gin/<kind>/<job>.gin")
    _register_all()
    cli.parse_gin(args.gin_file, args.gin_param)
    name = configured_job()
    if args.workdir and name not in TRAINING_JOBS:
      raise checks.UsageError(f"--workdir is for training jobs; {name} writes where its own settings say")
    if name in ARGPARSE_JOBS:  # the bound settings become the command's own command line
      result = argparse_job(name)()
      gin.clear_config()
      return result if isinstance(result, int) else 0
  gin.clear_config()  # the job's own entry point parses the same files again
  return importlib.import_module(TRAINING_MODULE if name in TRAINING_JOBS else JOBS[name]).main(argv)


if __name__ == "__main__":
  sys.exit(main())
