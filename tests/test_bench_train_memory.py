"""bench_train_memory on a tiny state: every mode runs in its own process and reports the resident set after the
state and after each save; the command line refuses sizes below 1."""

import json

import pytest

from blockspec_jax.eval import bench_train_memory


def test_every_mode_reports_one_resident_figure_per_save(tmp_path, capsys):
  out = tmp_path / "memory.json"
  assert bench_train_memory.main(["--arrays", "2", "--mib", "1", "--saves", "2", "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert list(report["modes"]) == list(bench_train_memory.MODES)
  for result in report["modes"].values():
    assert len(result["resident_gb"]) == 3 and result["peak_gb"] >= max(result["resident_gb"]) - 1e-3
    assert result["growth_gb"] == pytest.approx(result["resident_gb"][-1] - result["resident_gb"][1])
  printed = capsys.readouterr().out
  assert "growth from save 1 to save 2" in printed and "peak / glibc defaults' = 1.000" in printed


def test_sizes_below_one_are_refused(capsys):
  with pytest.raises(SystemExit):
    bench_train_memory.main(["--saves", "0"])
  assert "--saves: the value must be an integer >= 1, got 0" in capsys.readouterr().err
