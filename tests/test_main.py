"""The main command and its gin file."""

import os

import gin
import pytest

from blockspec_jax import __main__ as cli
from blockspec_jax.eval import theory_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_prints_exact_and_measured(capsys):
  gin.clear_config()
  assert cli.main(["--gamma", "2", "--samples", "20000", "--seed", "1"]) == 0
  out = capsys.readouterr().out
  assert "paper toy V=2" in out and "1.1111" in out and "1.2222" in out and "1.3333" in out
  assert out.count("random V=") == 3


def test_gin_file_binds_the_report():
  gin.clear_config()
  gin.parse_config_files_and_bindings([os.path.join(REPO, "gin", "theory_report.gin")], ["theory_report.seed = 3"])
  assert gin.query_parameter("theory_report.gammas") == (2, 4)
  assert gin.query_parameter("theory_report.seed") == 3
  gin.clear_config()


def test_bad_gamma_is_rejected(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--gamma", "0"])
  gin.clear_config()
  with pytest.raises(SystemExit):  # V^γ drafts to enumerate (V = 5: 390,625): refused before any work
    cli.main(["--gamma", "8"])
  assert "γ = 8 enumerates V^γ = 390,625 drafts" in capsys.readouterr().err


def test_measured_matches_exact_within_five_stderr():
  rows = theory_report.report_rows(theory_report.default_pairs((3,), seed=2), num_samples=40_000, seed=5)
  for r in rows:
    for rule in ("token", "block"):
      assert abs(r[f"{rule}_measured"] - r[f"{rule}_exact"]) < 5 * r[f"{rule}_stderr"], r
    assert r["token_exact"] <= r["block_exact"] + 1e-12 <= r["bound"] + 2e-12
