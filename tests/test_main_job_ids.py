"""The SmolLM2 main job and the smoke suite give the numbers recorded in ``tests/data/smollm2_main_job_ids.json``:
the main job's token ids (greedy and T = 1; autoregressive, token and block verification) with every row's target
calls, tokens and block efficiency, and the smoke suite's rows (target calls, tokens, block efficiency, acceptance
per position). Recorded on one device; restructuring the code must not change a user's numbers, and neither must the
layout: on 8 fake devices (rows over a data axis of 8, the padded rows dropped) the jobs give the same numbers, and
across 2 processes ``tests/test_multihost.py`` checks the same record.

The jobs run in subprocesses at XLA's default optimisation level (the level the record was made at and the jobs run
at; the test workers compile at level 0, which moves float32 results by ulps: ``tests/conftest.py``). To record again
after a change that is meant to move the numbers, run this file: ``python tests/test_main_job_ids.py`` (and say why
in the commit)."""

import json
import pathlib
import subprocess
import sys

import helpers
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "data" / "smollm2_main_job_ids.json"
GIN_FILE = "gin/runs/smollm2_self.gin"
SUITE_GIN_FILE = "gin/eval/smoke.gin"


def _row_numbers(row: dict) -> dict:
  """The counts of one report row that a layout must not change."""
  keys = ("target_calls", "tokens_generated", "block_efficiency", "acceptance_per_position")
  return {k: row[k] for k in keys if k in row}


def main_job_record(extra=()) -> dict:
  """The SmolLM2 main job (its gin file and ``extra`` bindings, no report file): ``{"generated_ids": {"<method>@T=<t>":
  [[token ids of prompt i] …]}, "main_job_rows": {"<method>@T=<t>": counts}}``."""
  import gin
  from blockspec_jax import cli
  from blockspec_jax import run
  cli.parse_gin([str(REPO / GIN_FILE)], ["run_job.output_json = None", "run_job.show_text = False",
                                          "run_job.compilation_cache = 'off'", *extra])
  try:
    report = run.run_job()
  finally:
    gin.clear_config()
  return dict(generated_ids={k: [list(map(int, row)) for row in v] for k, v in report["generated_ids"].items()},
              main_job_rows={f"{r['method']}@T={r['temperature']}": _row_numbers(r) for r in report["results"]})


def smoke_suite_record(out_dir, extra=()) -> dict:
  """The smoke suite (its gin file and ``extra`` bindings) writing to ``out_dir``: ``{"smoke_suite_rows":
  {"<method>@γ=<γ>@T=<t>@<task>": counts}}``, one per category (not the pooled rows, which depend on the categories
  run)."""
  import gin
  from blockspec_jax import cli
  from blockspec_jax.eval import suite
  cli.parse_gin([str(REPO / SUITE_GIN_FILE)], [f"suite.out_dir = {str(out_dir)!r}", "suite.plots = False",
                                                "suite.progress = False", "suite.compilation_cache = 'off'", *extra])
  try:
    report = suite.suite_job()
  finally:
    gin.clear_config()
  return dict(smoke_suite_rows={f"{r['method']}@γ={r['gamma']}@T={r['temperature']}@{r['task']}": _row_numbers(r)
                                for r in report["results"] if r["task"] != "all"})  # pooled: of the categories run


def recorded() -> dict:
  record = json.loads(RECORD.read_text())
  assert record["gin_file"] == GIN_FILE and record["suite_gin_file"] == SUITE_GIN_FILE
  return record


#: The smoke suite's categories the layout tests run (each category is one prompt: on 8 devices a batch of 1 prompt
#: and 7 padded rows, which the fake devices all compute; two categories keep the tests to minutes).
SUITE_TASKS = ("code", "math")


def assert_matches_record(got: dict, temperatures: tuple[float, ...] | None = None) -> None:
  """Every section of ``got`` equals the record's, key by key (the first difference named); the main job's sections
  in full (``temperatures``: its rows at those temperatures only), the suite's rows for the categories that ran."""
  record = recorded()
  for section, rows in got.items():
    if section == "smoke_suite_rows":
      assert rows and set(rows) <= set(record[section]), sorted(rows)
    elif temperatures is not None:
      assert set(rows) == {k for k in record[section] if float(k.rsplit("@T=", 1)[1]) in temperatures}, section
    else:
      assert set(rows) == set(record[section]), section
    for key in rows:
      assert rows[key] == record[section][key], (section, key, rows[key], record[section][key])


def _in_subprocess(tmp_path, devices: int, code: str) -> dict:
  """Run ``code`` (it defines ``out``, a dict) in a subprocess on ``devices`` fake CPU devices at the jobs'
  optimisation level; returns ``out``."""
  out = tmp_path / "out.json"
  script = (f"import json, sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import test_main_job_ids as t; "
            f"out = {{}}; {code}; json.dump(out, open({str(out)!r}, 'w'))")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=helpers.fake_devices_env(devices, True),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def test_the_smollm2_main_job_emits_the_recorded_token_ids(tmp_path):
  assert_matches_record(_in_subprocess(tmp_path, 1, "out.update(t.main_job_record())"))


@pytest.mark.slow  # the same record across 2 processes x 2 devices runs by default (tests/test_multihost.py)
def test_on_8_devices_the_main_job_and_the_smoke_suite_give_the_recorded_numbers(tmp_path):
  """Rows over a data axis of 8 (3 prompts: one batch, 5 padded rows; a suite category of 1 prompt: 7 padded rows):
  the same token ids, target calls, block efficiencies and acceptance as one device."""
  suite_params = [f"suite.tasks = {SUITE_TASKS!r}"]
  got = _in_subprocess(tmp_path, 8, f"out.update(t.main_job_record(['run_job.mesh = (8, 1)'])); "
                                    f"out.update(t.smoke_suite_record({str(tmp_path / 'suite')!r}, {suite_params!r}))")
  assert_matches_record(got)
  assert {key.rsplit("@", 1)[1] for key in got["smoke_suite_rows"]} == set(SUITE_TASKS)
  report = json.loads((tmp_path / "suite" / "results.json").read_text())
  assert report["settings"]["mesh"] == [8, 1] and report["environment"]["devices"].startswith("8 ")


if __name__ == "__main__":
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    record = dict(gin_file=GIN_FILE, suite_gin_file=SUITE_GIN_FILE, **main_job_record(),
                  **smoke_suite_record(pathlib.Path(tmp) / "suite"))
  RECORD.write_text(json.dumps(record, indent=0, sort_keys=True))
  print(f"wrote {RECORD}")
