"""The one gin entry point (python -m blockspec_jax.main): every shipped gin file names exactly one job, which is
dispatched to that job's own entry point with the same arguments; no job, two jobs and a misplaced --workdir are
one-line usage errors."""

import importlib
import pathlib

import gin
import pytest

from blockspec_jax import main as entry

REPO = pathlib.Path(__file__).resolve().parents[1]
INCLUDE_ONLY = {"gin/eval/qwen_pair.gin"}  # bound settings shared by the Qwen suites, no job of its own
GIN_FILES = sorted(str(p.relative_to(REPO)) for p in (REPO / "gin").rglob("*.gin")
                   if str(p.relative_to(REPO)) not in INCLUDE_ONLY)
EXPECTED = {"gin/theory_report.gin": "theory_report", "gin/bench/lossy_qwen.gin": "bench_lossy"}


def _job_of(path: str) -> str:
  if path in EXPECTED:
    return EXPECTED[path]
  kind = path.split("/")[1]
  if kind == "runs":
    return "run_job"
  if kind == "eval":
    return "suite"
  stem = pathlib.Path(path).stem
  return next(job for job in entry.TRAINING_JOBS if stem.startswith(job.removesuffix("_job")))


@pytest.mark.parametrize("path", GIN_FILES)
def test_every_gin_file_configures_one_job_and_is_dispatched_to_it(path, monkeypatch):
  monkeypatch.chdir(REPO)
  job = _job_of(path)
  module = importlib.import_module(entry.TRAINING_MODULE if job in entry.TRAINING_JOBS else entry.JOBS[job])
  calls = []
  monkeypatch.setattr(module, "main", lambda argv=None: calls.append(argv) or 0)
  argv = ["--gin_file", path]
  try:
    assert entry.main(argv) == 0
  finally:
    gin.clear_config()
  assert calls == [argv]


@pytest.mark.parametrize("argv, message", [
    ([], "give the job's gin file"),
    (["--gin_file", "gin/eval/smoke.gin", "--gin_file", "gin/runs/smollm2_self.gin"],
     "configure run_job and suite; a run runs one job"),
    (["--gin_file", "gin/eval/smoke.gin", "--workdir", "/tmp/x"], "--workdir is for training jobs"),
    (["--gin_param", "suite.gammas = (2,)", "--gin_file", "/nonexistent.gin"], "nonexistent.gin"),
])
def test_usage_errors_are_one_line(argv, message, capsys, monkeypatch):
  monkeypatch.chdir(REPO)
  try:
    with pytest.raises(SystemExit) as exc:
      entry.main(argv)
  finally:
    gin.clear_config()
  err = capsys.readouterr().err.strip().splitlines()
  assert exc.value.code == 2 and len(err) == 1 and message in err[0], err


def test_a_file_binding_no_job_is_refused(tmp_path, capsys):
  empty = tmp_path / "nothing.gin"
  empty.write_text("# no bindings\n")
  try:
    with pytest.raises(SystemExit):
      entry.main(["--gin_file", str(empty)])
  finally:
    gin.clear_config()
  assert "bind no job's settings" in capsys.readouterr().err
