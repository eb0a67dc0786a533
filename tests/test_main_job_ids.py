"""The SmolLM2 main job emits the token ids recorded in ``tests/data/smollm2_main_job_ids.json`` (greedy and T = 1,
autoregressive, token and block verification): restructuring the code must not change a user's numbers.

The job runs in a subprocess at XLA's default optimisation level (the level the ids were recorded at and the jobs
run at; the test workers compile at level 0, which moves float32 results by ulps: ``tests/conftest.py``). To record
the ids again after a change that is meant to move them, run this file's ``main``: ``python
tests/test_main_job_ids.py`` (and say why in the commit)."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
RECORD = REPO / "tests" / "data" / "smollm2_main_job_ids.json"
GIN_FILE = "gin/runs/smollm2_self.gin"


def main_job_ids() -> dict:
  """``{"<method>@T=<t>": [[token ids of prompt i] …]}`` of the SmolLM2 main job (its gin file, no report file)."""
  import gin
  from blockspec_jax import run
  from blockspec_jax import cli
  cli.parse_gin([str(REPO / GIN_FILE)], ["run_job.output_json = None", "run_job.show_text = False",
                                          "run_job.compilation_cache = 'off'"])
  try:
    report = run.run_job()
  finally:
    gin.clear_config()
  return {k: [list(map(int, row)) for row in v] for k, v in report["generated_ids"].items()}


def test_the_smollm2_main_job_emits_the_recorded_token_ids(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_backend_optimization_level" not in f)
  if flags:
    env["XLA_FLAGS"] = flags
  out = tmp_path / "ids.json"
  code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'tests')!r}); import test_main_job_ids as t; "
          f"json.dump(t.main_job_ids(), open({str(out)!r}, 'w'))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  recorded = json.loads(RECORD.read_text())
  assert recorded["gin_file"] == GIN_FILE
  assert json.loads(out.read_text()) == recorded["generated_ids"]


if __name__ == "__main__":
  RECORD.write_text(json.dumps({"gin_file": GIN_FILE, "generated_ids": main_job_ids()}, indent=0, sort_keys=True))
  print(f"wrote {RECORD}")
