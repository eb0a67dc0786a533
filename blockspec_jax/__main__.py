"""Main command (for now): token vs block verification on the paper's toy and random tabular models.

    python -m blockspec_jax [--gamma 2 4] [--samples 100000] [--seed 0] [--gin_file F] [--gin_param B]

Prints, per drafter/target pair, the exact expected accepted tokens E[τ] under token and block verification, the
same quantities measured with the jitted rules, and the full-information bound. Gin (entry point only, the t5x
convention): ``gin/theory_report.gin`` binds ``theory_report.*``; ``--gin_param`` overrides single bindings.
"""

from __future__ import annotations

import argparse
import sys

import gin
import jax

from blockspec_jax.eval import theory_report as report_lib


@gin.configurable("theory_report")
def theory_report(gammas=(2, 4), num_samples: int = 100_000, seed: int = 0) -> str:
  rows = report_lib.report_rows(report_lib.default_pairs(tuple(gammas), seed), num_samples, seed)
  return report_lib.format_table(rows)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gamma", type=int, nargs="+", help="block lengths for the random pairs (toy uses 2)")
  parser.add_argument("--samples", type=int, help="sampled blocks per rule and pair")
  parser.add_argument("--seed", type=int)
  parser.add_argument("--gin_file", action="append", default=[])
  parser.add_argument("--gin_param", action="append", default=[])
  args = parser.parse_args(argv)
  gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
  overrides = {k: v for k, v in (("gammas", args.gamma), ("num_samples", args.samples), ("seed", args.seed))
               if v is not None}
  if any(g < 1 for g in overrides.get("gammas", [1])):
    parser.error(f"--gamma values must be >= 1, got {overrides['gammas']}")
  print(f"blockspec_jax on {jax.devices()[0].platform}: token vs block verification, exact and measured\n")
  print(theory_report(**overrides))
  return 0


if __name__ == "__main__":
  sys.exit(main())
