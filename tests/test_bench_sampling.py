"""The sampling filters' benchmark: one row per size and setting, both ways agreeing on the tokens kept."""

from blockspec_jax.eval import bench_sampling


def test_bench_prints_both_ways_side_by_side(capsys):
  rows = bench_sampling.main(["--vocab", "300", "--rows", "2", "--reps", "2"])
  out = capsys.readouterr().out
  assert [(r["top_k"], r["top_p"]) for r in rows] == list(bench_sampling.SETTINGS)
  assert all(r["same_tokens"] and r["filters_ms"] > 0 and r["sorting_ms"] > 0 for r in rows)
  assert "before the run" in out and "after the run" in out and out.count("yes") == len(rows)
