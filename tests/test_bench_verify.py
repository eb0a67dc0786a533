"""The verification benchmark's report: target verdicts per row, the machine's load, and configs/verify_bench.py."""

import pathlib

import pytest

from blockspec_jax.eval import bench_verify

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_report_states_targets_and_load(capsys):
  rows = bench_verify.main(["--batch", "2", "--gamma", "2", "--vocab", "64", "--reps", "2"])
  out = capsys.readouterr().out
  assert len(rows) == 1 and set(rows[0]) >= {"token", "block", "ratio", "target_met"}
  assert rows[0]["target_met"] == (rows[0]["ratio"] <= bench_verify.RATIO_TARGET)
  assert ("MET" if rows[0]["target_met"] else "MISSED") in out
  assert "before the run" in out and "after the run" in out and out.count(" cores") == 2
  assert "met in" in out and "of 1 rows" in out


def test_the_shipped_config_is_what_the_benchmark_reads(tmp_path):
  config = bench_verify.load_config(str(REPO / "configs" / "verify_bench.py"))
  assert config == bench_verify.VerifyBenchConfig()
  assert "--config configs/verify_bench.py" in (REPO / "launch" / "local.sh").read_text()
  bad = tmp_path / "bad.py"
  bad.write_text("CONFIG = 3\n")
  with pytest.raises(ValueError, match="must define CONFIG"):
    bench_verify.load_config(str(bad))
  with pytest.raises(FileNotFoundError, match="not found"):
    bench_verify.load_config(str(tmp_path / "missing.py"))
