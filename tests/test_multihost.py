"""Multi-host with real processes on this machine: every process of a run is its own JAX process on its own fake CPU
devices, joined through ``jax.distributed`` on 127.0.0.1 (a free port found at run time) with gloo collectives, and
the sharded loops run on one global mesh over all of them (``tests/multihost_script.py``). A TPU pod or a GPU cluster
is out of reach here; these are the same multi-controller code paths (global arrays built from each process's values,
collectives between processes, outputs gathered on every process)."""

import json
import os

import numpy as np
import pytest
import jax

from blockspec_jax import parallel
from helpers import run_processes

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multihost_script.py")


@pytest.mark.parametrize("count", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_processes_on_one_global_mesh_emit_one_devices_tokens(count):
  """2 processes × 2 devices (4 processes in the heavy run): block and RSD-C traversal at T = 1, speculative and
  autoregressive, the batch given in full to every process and as each process's own rows: every process reads back
  the tokens and acceptance counts that one device computes alone."""
  results = run_processes(SCRIPT, count, ("loops",), devices_each=2, timeout=420)
  for i, (code, out) in enumerate(results):
    assert code == 0, f"process {i} ended with {code}:\n{out[-3000:]}"
    assert out.count("EQUAL ") == 4 and "DIFFERENT" not in out and "ALL EQUAL" in out, out[-3000:]
    assert f"process {i} of {count}: 2 local devices, {2 * count} in all" in out


def test_data_parallel_train_steps_across_processes_reach_one_devices_parameters():
  """2 processes × 2 devices: three train steps of a tiny DistillSpec pair on a 4 x 1 data mesh (every process passing
  the same global batches; the trainer places the rows each process's devices hold) reach the parameters one device
  reaches, within 1e-6 (the mean over rows is summed in another order)."""
  results = run_processes(SCRIPT, 2, ("train",), devices_each=2, timeout=300)
  for i, (code, out) in enumerate(results):
    assert code == 0 and "TRAIN EQUAL" in out, f"process {i} ended with {code}:\n{out[-3000:]}"


def test_a_fit_stopped_and_resumed_across_processes_equals_one_process(tmp_path):
  """trainer.fit on a data mesh over 2 processes × 2 devices, stopped after 2 of 4 steps and resumed (checkpoints
  through orbax's multi-process path in one shared work directory), against the same in 1 process on 2 devices: the
  same steps in metrics.jsonl, written once (by process 0), losses within 1e-6, the same checkpoints kept, and
  parameters within 1e-6."""
  runs = {}
  for count in (2, 1):
    workdir = tmp_path / f"processes_{count}"
    for i, (code, out) in enumerate(run_processes(SCRIPT, count, ("fit", str(workdir)), devices_each=2,
                                                  timeout=300)):
      assert code == 0 and "FIT DONE" in out, f"process {i} of {count} ended with {code}:\n{out[-3000:]}"
      assert "resumed from 2, 2 steps" in out
    runs[count] = workdir
  rows = {count: [json.loads(line) for line in (runs[count] / "metrics.jsonl").read_text().splitlines()]
          for count in runs}
  assert [r["step"] for r in rows[2]] == [r["step"] for r in rows[1]] == [1, 2, 3, 4]
  np.testing.assert_allclose([r["loss"] for r in rows[2]], [r["loss"] for r in rows[1]], rtol=1e-6)
  steps = {count: sorted(p.name for p in (runs[count] / "checkpoints").iterdir() if p.name.isdigit())
           for count in runs}
  assert steps[2] == steps[1]
  with np.load(runs[2] / "final.npz") as two, np.load(runs[1] / "final.npz") as one:
    assert two.files == one.files
    for name in one.files:
      np.testing.assert_allclose(two[name], one[name], rtol=1e-6, atol=1e-7)


def test_the_main_job_and_the_smoke_suite_across_processes_give_the_recorded_numbers(tmp_path):
  """2 processes × 2 devices, each running the SmolLM2 main job and the smoke suite on the global 4 x 1 mesh: every
  process reads back the token ids, target calls, block efficiencies and acceptance that one device recorded
  (``tests/test_main_job_ids.py``), and only process 0 writes the suite's files."""
  import test_main_job_ids as ids
  results = run_processes(SCRIPT, 2, ("jobs", str(tmp_path)), devices_each=2, timeout=840, product_level=True)
  for i, (code, out) in enumerate(results):
    assert code == 0 and "JOBS DONE" in out, f"process {i} ended with {code}:\n{out[-3000:]}"
    got = json.loads((tmp_path / f"record_{i}.json").read_text())
    ids.assert_matches_record(got)
    assert {key.rsplit("@", 1)[1] for key in got["smoke_suite_rows"]} == set(ids.SUITE_TASKS)
  assert (tmp_path / "suite_0" / "results.json").exists()
  assert not (tmp_path / "suite_1" / "results.json").exists()
  settings = json.loads((tmp_path / "suite_0" / "results.json").read_text())
  assert settings["settings"]["mesh"] == [4, 1] and settings["environment"]["processes"] == 2


def test_a_process_that_dies_ends_the_others_with_an_error_not_a_hang():
  """Process 1 exits without a word while process 0 waits in a collective for it: process 0 ends with the
  distributed runtime's error (missing heartbeats: 10 s in the script) well within the test's deadline."""
  results = run_processes(SCRIPT, 2, ("hang",), devices_each=2, timeout=120)
  (code0, out0), (code1, _) = results
  assert code1 == 0
  assert code0 is not None, "process 0 was still waiting at the deadline"
  assert code0 != 0 and "the collective returned" not in out0
  assert "another task died" in out0 or "stopped sending heartbeats" in out0, out0[-3000:]


def test_one_process_puts_and_gathers_as_device_put_and_asarray():
  """On one process the multi-host paths are today's: process-local rows are the global batch, and gather is
  np.asarray."""
  mesh = parallel.make_mesh()
  keys = jax.random.split(jax.random.key(3), 4)
  tokens = np.arange(12, dtype=np.int32).reshape(4, 3)
  full = parallel.shard_batch(mesh, keys, tokens)
  local = parallel.shard_batch(mesh, keys, tokens, process_local=True)
  np.testing.assert_array_equal(jax.random.key_data(full[0]), jax.random.key_data(local[0]))
  assert parallel.gather(full[1]).tolist() == parallel.gather(local[1]).tolist() == tokens.tolist()
  assert isinstance(parallel.gather({"t": full[1]})["t"], np.ndarray)
