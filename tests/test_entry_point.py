"""The one gin entry point (python -m blockspec_jax.main): every shipped gin file names exactly one job, which is
dispatched to that job's own entry point with the same arguments; no job, two jobs and a misplaced --workdir are
one-line usage errors."""

import importlib
import pathlib

import gin
import pytest

from blockspec_jax import main as entry

REPO = pathlib.Path(__file__).resolve().parents[1]
INCLUDE_ONLY = {"gin/eval/qwen_pair.gin",  # bound settings shared by the Qwen suites, no job of its own
                "gin/bench/paired_other.gin"}  # the second set's design, shared by its eval.paired cells
GIN_FILES = sorted(str(p.relative_to(REPO)) for p in (REPO / "gin").rglob("*.gin")
                   if str(p.relative_to(REPO)) not in INCLUDE_ONLY)
EXPECTED = {"gin/theory_report.gin": "theory_report", "gin/bench/lossy_qwen.gin": "bench_lossy",
            "gin/bench/mtad_official_qwen.gin": "bench_lossy",
            "gin/bench/verify_small.gin": "bench_verify",
            "gin/bench/mesh_smollm2.gin": "bench_mesh", "gin/bench/mesh_jobs.gin": "bench_mesh"}


def _job_of(path: str) -> str:
  if path in EXPECTED:
    return EXPECTED[path]
  kind = path.split("/")[1]
  if kind == "runs":
    return "run_job"
  if kind == "eval":
    return "suite"
  if path.startswith("gin/bench/paired_"):  # eval.paired's cells: paired_six.gin, paired_other_<drafter>.gin
    return "paired"
  stem = pathlib.Path(path).stem
  return next(job for job in entry.TRAINING_JOBS if stem.startswith(job.removesuffix("_job")))


@pytest.mark.parametrize("path", GIN_FILES)
def test_every_gin_file_configures_one_job_and_is_dispatched_to_it(path, monkeypatch):
  monkeypatch.chdir(REPO)
  job = _job_of(path)
  if job in entry.ARGPARSE_JOBS:
    module = importlib.import_module(entry.ARGPARSE_JOBS[job])
  else:
    module = importlib.import_module(entry.TRAINING_MODULE if job in entry.TRAINING_JOBS else entry.JOBS[job])
  calls = []
  monkeypatch.setattr(module, "main", lambda argv=None: calls.append(argv) or 0)
  argv = ["--gin_file", path]
  try:
    assert entry.main(argv) == 0
  finally:
    gin.clear_config()
  if job not in entry.ARGPARSE_JOBS:
    assert calls == [argv]
    return
  # An argparse command gets its own command line, carrying exactly the file's bindings.
  entry.argparse_job(job)
  try:
    gin.parse_config_file(path)
    bound = gin.get_bindings(job)
  finally:
    gin.clear_config()
  (command_line,) = calls
  args, defaults = module.build_parser().parse_args(command_line), module.build_parser().parse_args([])
  for dest, value in vars(args).items():
    expected = bound.get(dest, getattr(defaults, dest))
    assert (list(value) if isinstance(value, (list, tuple)) else value) == \
        (list(expected) if isinstance(expected, (list, tuple)) else expected), dest


@pytest.mark.parametrize("name", sorted(entry.ARGPARSE_JOBS))
def test_every_argparse_command_is_a_gin_job_with_its_parsers_settings(name):
  """The gin job's settings are the parser's visible options (by dest); bound to nothing it runs the command with
  an empty command line, i.e. the parser's own defaults (one definition)."""
  import argparse
  import inspect
  module = importlib.import_module(entry.ARGPARSE_JOBS[name])
  visible = [a.dest for a in module.build_parser()._actions
             if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS]
  job = entry.argparse_job(name)
  assert list(inspect.signature(job).parameters) == visible
  calls = []
  original = module.main
  module.main = lambda argv=None: calls.append(argv) or 0
  try:
    job()
  finally:
    module.main = original
  assert calls == [[]]


def test_settings_become_the_command_line_they_stand_for():
  """Switches appear when bound True, nargs options take separate words, other sequences are comma-joined (our
  commands' list syntax), None keeps the default; unknown names and a non-bool switch are one-line usage errors."""
  import argparse
  from blockspec_jax import checks
  from blockspec_jax import cli
  parser = argparse.ArgumentParser(prog="demo")
  parser.add_argument("--num-prompts", type=int, default=3)
  parser.add_argument("--gammas", type=lambda s: [int(x) for x in s.split(",")], default=[4])
  parser.add_argument("--batch", type=int, nargs="+")
  parser.add_argument("--trees", action="store_true")
  parser.add_argument("--hidden", help=argparse.SUPPRESS)
  argv = cli.argv_from_settings(parser, dict(num_prompts=12, gammas=(2, 8), batch=[1, 8], trees=True))
  assert argv == ["--num-prompts", "12", "--gammas", "2,8", "--batch", "1", "8", "--trees"]
  args = parser.parse_args(argv)
  assert (args.num_prompts, args.gammas, args.batch, args.trees) == (12, [2, 8], [1, 8], True)
  assert cli.argv_from_settings(parser, dict(trees=False, num_prompts=None)) == []
  with pytest.raises(checks.UsageError, match=r"unknown settings \['hidden', 'num_prompt'\]; known: num_prompts"):
    cli.argv_from_settings(parser, dict(num_prompt=1, hidden="x"))
  with pytest.raises(checks.UsageError, match="trees is a switch"):
    cli.argv_from_settings(parser, dict(trees="yes"))


def test_an_argparse_job_runs_from_gin_end_to_end(tmp_path, capsys, monkeypatch):
  """bench_verify from a gin file through the one entry point: a tiny grid runs and prints its row."""
  monkeypatch.chdir(REPO)
  config = tmp_path / "verify.gin"
  config.write_text("bench_verify.batch = (1,)\nbench_verify.gamma = (2,)\nbench_verify.vocab = (16,)\n"
                    "bench_verify.reps = 1\nbench_verify.rules = ('token', 'block')\n")
  try:
    assert entry.main(["--gin_file", str(config)]) == 0
  finally:
    gin.clear_config()
  out = capsys.readouterr().out
  assert "target block/token" in out and "met in" in out


@pytest.mark.parametrize("argv, message", [
    ([], "give the job's gin file"),
    (["--gin_file", "gin/eval/smoke.gin", "--gin_file", "gin/runs/smollm2_self.gin"],
     "configure run_job and suite; a run runs one job"),
    (["--gin_file", "gin/eval/smoke.gin", "--workdir", "/tmp/x"], "--workdir is for training jobs"),
    (["--gin_param", "suite.gammas = (2,)", "--gin_file", "/nonexistent.gin"], "nonexistent.gin"),
    (["--gin_file", "gin/eval/smoke.gin", "--gin_param", "suite.gammas = ("], "the gin configuration does not parse"),
    (["--gin_file", "gin/eval/smoke.gin", "--gin_param", "suite.gammas = 3"],
     "gammas must be a tuple or list, e.g. (3,), got 3"),
    (["--gin_file", "gin/eval/smoke.gin", "--gin_param", "suite.out_dir = '/proc/version/suite'"],
     "cannot write the suite's directory /proc/version/suite"),
    (["--gin_file", "gin/train/distill_smoke.gin", "--workdir", "/proc/version"],
     "cannot write the training run's work directory (--workdir) /proc/version: /proc/version is a file"),
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
