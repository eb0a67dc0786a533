"""The mesh benchmark (blockspec_jax.eval.bench_mesh): its comparison of the jobs' reports is exact, the device count
reaches the subprocesses' XLA flags, and bad settings fail in one line before any job starts. The benchmark's real run
is documented in docs/results/mesh.md (the main job on 8 fake devices is tested in tests/test_main_job_ids.py)."""

import json
import pathlib
import subprocess

import pytest

from blockspec_jax import checks
from blockspec_jax.eval import bench_mesh


def _report(mesh, decode_tps, ids, compiled=10, timed=0):
  rows = [dict(method="autoregressive", temperature=0.0, compiles_while_timed=timed, decode_tokens_per_s=decode_tps,
               tokens_per_s=decode_tps / 2),
          dict(method="block", temperature=0.0, compiles_while_timed=0, decode_tokens_per_s=2 * decode_tps,
               tokens_per_s=decode_tps, block_efficiency=3.5)]
  return dict(mesh=mesh, programs_compiled=compiled, results=rows,
              generated_ids={"autoregressive@T=0.0": ids, "block@T=0.0": [[1, 2, 3]]})


def test_compare_sets_every_row_against_the_first_device_count():
  lines = bench_mesh.compare({8: _report([8, 1], 5.0, [[1, 2]], compiled=12, timed=1),
                              1: _report([1, 1], 10.0, [[1, 2, 3]])})
  assert [(x["devices"], x["row"]) for x in lines] == [(1, "autoregressive@T=0.0"), (1, "block@T=0.0"),
                                                       (8, "autoregressive@T=0.0"), (8, "block@T=0.0")]
  eight_ar, eight_block = lines[2], lines[3]
  assert eight_ar["decode_ratio"] == 0.5 and eight_ar["ratio"] == 0.5 and eight_block["decode_ratio"] == 0.5
  assert lines[0]["decode_ratio"] == 1.0 and lines[0]["same_tokens"] and eight_block["same_tokens"]
  assert not eight_ar["same_tokens"]  # other ids: the table must say so
  assert eight_ar["programs_compiled"] == 12 and eight_ar["compiles_while_timed"] == 1
  table = bench_mesh.format_table(lines)
  assert "NO" in table.splitlines()[4] and "8x1" in table and "3.50" in table


def test_the_device_count_replaces_any_count_in_xla_flags():
  env = bench_mesh.device_env(4, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_foo=1", "A": "b"})
  assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=4"]
  assert env["A"] == "b" and env["JAX_PLATFORMS"] == "cpu"


@pytest.mark.parametrize("settings, message", [
    (dict(devices=()), "devices must be a tuple of device counts"),
    (dict(devices=(1, 0)), "devices must be a tuple of device counts"),
    (dict(devices=4), "devices must be a tuple of device counts"),
    (dict(job_gin_file="gin/runs/nope.gin"), "no gin file"),
    (dict(devices=(), compile_jobs=("suite", "train")), r"unknown job\(s\) \['train'\]"),
    (dict(devices=(), compile_jobs=("suite",), compile_devices=()), "compile_devices must be a tuple"),
])
def test_bad_settings_fail_before_any_job_runs(settings, message, monkeypatch):
  monkeypatch.setattr(bench_mesh.subprocess, "run", lambda *a, **k: pytest.fail("a job ran"))
  with pytest.raises(checks.UsageError, match=message):
    bench_mesh.bench_mesh_job(**settings, output_json=None)


def test_the_compile_table_marks_recompiles_and_changed_numbers(monkeypatch, tmp_path):
  """``compile_counts`` runs every job on every count in its own process (here a stand-in) and compares each count's
  numbers with the first's; the table shows "-" for a job without repeated calls and NO for changed numbers."""
  runs = []

  def fake_run(command, env, **kwargs):
    devices = int(env["XLA_FLAGS"].rsplit("=", 1)[1])
    runs.append((command[3], devices))
    (pathlib.Path(command[4])).write_text(json.dumps({"rc": 0, "programs_compiled": 10 + devices}))
    return subprocess.CompletedProcess(command, 0, "", "")

  def fake_job(n, tmp):
    return "blockspec_jax.fake", [], lambda: (None if n == 1 else 0, [1.0] if n == 1 else [2.0])

  monkeypatch.setattr(bench_mesh.subprocess, "run", fake_run)
  monkeypatch.setitem(bench_mesh.COMPILE_JOBS, "fake", fake_job)
  lines = bench_mesh.compile_counts(("fake",), (1, 8), timeout_s=10)
  assert runs == [("blockspec_jax.fake", 1), ("blockspec_jax.fake", 8)]
  assert [(x["devices"], x["programs_compiled"], x["after_first"], x["same"]) for x in lines] == [
      (1, 11, None, True), (8, 18, 0, False)]
  table = bench_mesh.format_compile_table(lines).splitlines()
  assert table[2].split() == ["fake", "1", "11", "-", "yes"] and table[3].split() == ["fake", "8", "18", "0", "NO"]
  # floats agree to 1e-5 relative (float32 sums split over devices), counts and structure exactly
  assert bench_mesh._same({"a": [1, 2.0]}, {"a": [1, 2.0 + 1e-6]}) and not bench_mesh._same([1, 2.0], [1, 2.001])
  assert not bench_mesh._same({"a": 1}, {"b": 1}) and not bench_mesh._same([6, 16], [6, 17])
