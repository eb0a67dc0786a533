"""Main command (for now): token vs block verification on the paper's toy and random tabular models.

    python -m blockspec_jax [--gamma 2 4] [--samples 100000] [--seed 0] [--tree_samples 0] [--gin_file F]
                            [--gin_param B]

Prints, per drafter/target pair, the exact expected accepted tokens E[τ] under token and block verification, the
same quantities measured with the jitted rules, and the full-information bound; with ``--tree_samples`` (set in
``gin/theory_report.gin``) also the exact and measured E[τ] of every tree rule on three tree shapes. Gin (entry
point only, the t5x convention): ``gin/theory_report.gin`` binds ``theory_report.*``; ``--gin_param`` overrides
single bindings.
"""

from __future__ import annotations

import argparse
import sys

import gin
import jax

from blockspec_jax import checks as checks_lib
from blockspec_jax import cli
from blockspec_jax import methods
from blockspec_jax.checks import check_int
from blockspec_jax.eval import theory_report as report_lib


@gin.configurable("theory_report")
def theory_report(gammas=(2, 4), num_samples: int = 100_000, seed: int = 0, tree_samples: int = 0) -> str:
  """The chain table; with ``tree_samples > 0`` also the tree table (trees per rule, shape and pair)."""
  methods.check_settings(gammas=gammas)
  check_int(num_samples, "num_samples", 2, error=checks_lib.UsageError)
  if isinstance(tree_samples, bool) or not isinstance(tree_samples, int) or tree_samples < 0 or tree_samples == 1:
    raise checks_lib.UsageError(f"tree_samples must be 0 (no tree table) or an integer >= 2, got {tree_samples!r}")
  pairs = report_lib.default_pairs(tuple(gammas), seed)
  try:
    report_lib.check_enumerable(pairs)
  except ValueError as e:
    raise checks_lib.UsageError(str(e)) from None
  rows = report_lib.report_rows(pairs, num_samples, seed)
  report = report_lib.format_table(rows)
  if tree_samples:
    tree_rows = report_lib.tree_report_rows(report_lib.default_tree_pairs(seed), tree_samples, seed)
    report += "\n\n" + report_lib.format_tree_table(tree_rows)
  return report


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gamma", type=int, nargs="+", help="block lengths for the random pairs (toy uses 2)")
  parser.add_argument("--samples", type=int, help="sampled blocks per rule and pair")
  parser.add_argument("--seed", type=int)
  parser.add_argument("--tree_samples", type=int, help="sampled trees per rule, shape and pair (0: no tree table)")
  parser.add_argument("--gin_file", action="append", default=[])
  parser.add_argument("--gin_param", action="append", default=[])
  args = parser.parse_args(argv)
  overrides = {k: v for k, v in (("gammas", args.gamma), ("num_samples", args.samples), ("seed", args.seed),
                                 ("tree_samples", args.tree_samples)) if v is not None}
  with cli.cli_errors(parser.prog):
    cli.parse_gin(args.gin_file, args.gin_param)
    report = theory_report(**overrides)
  print(f"blockspec_jax on {jax.devices()[0].platform}: token vs block verification, exact and measured\n")
  print(report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
