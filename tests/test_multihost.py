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


@pytest.mark.slow  # the distillation smoke job across processes (train steps, checkpoints, resume) runs by default
def test_data_parallel_train_steps_across_processes_reach_one_devices_parameters():
  """2 processes × 2 devices: three train steps of a tiny DistillSpec pair on a 4 x 1 data mesh (every process passing
  the same global batches; the trainer places the rows each process's devices hold) reach the parameters one device
  reaches, within 1e-6 (the mean over rows is summed in another order)."""
  results = run_processes(SCRIPT, 2, ("train",), devices_each=2, timeout=300)
  for i, (code, out) in enumerate(results):
    assert code == 0 and "TRAIN EQUAL" in out, f"process {i} ended with {code}:\n{out[-3000:]}"


@pytest.mark.parametrize("count", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_the_distillation_smoke_job_stopped_and_resumed_across_processes_equals_one_process(tmp_path, count):
  """The distillation smoke job on its default mesh (every device over ``data``: the target's continuations drawn
  there, every batch split there) in 2 processes × 2 devices (4 × 1 in the heavy run), stopped after 2 of 4 steps and resumed (checkpoints
  through orbax's multi-process path in one shared work directory), against the same in 1 process on 4 devices: the
  same continuations bit for bit, the same steps in metrics.jsonl (written once, by process 0), losses and the
  held-out TV before and after within 1e-6, the same checkpoints kept; every process returns the same summary; a
  batch of 6 rows is refused on 4 devices, naming the setting."""
  runs = {}
  for processes, each in ((count, 4 // count), (1, 4)):
    workdir = tmp_path / f"processes_{processes}"
    for i, (code, out) in enumerate(run_processes(SCRIPT, processes, ("distill", str(workdir)), devices_each=each,
                                                  timeout=150 * (processes + 1))):
      assert code == 0 and "DISTILL DONE" in out, f"process {i} of {processes} ended with {code}:\n{out[-3000:]}"
      assert "stopped: {'stopped_after': 2, 'resumed_from': None}" in out and "resumed from 2, 4 steps" in out
      assert "BATCH REFUSED: distill_job.batch_size = 6 must be a multiple of the 4 devices" in out, out[-2000:]
    runs[processes] = workdir
  summaries = {n: [json.loads((runs[n] / f"summary_{i}.json").read_text()) for i in range(n)] for n in runs}
  timing = ("seconds", "train_seconds", "train_seconds_total", "peak_rss_gb")
  same = lambda s: {k: v for k, v in s.items() if k not in timing}
  assert all(same(s) == same(summaries[count][0]) for s in summaries[count])  # every process: the same summary
  several, one = summaries[count][0], summaries[1][0]
  assert several["data_parallel_devices"] == one["data_parallel_devices"] == 4
  assert json.loads((runs[count] / "metrics.json").read_text())["steps"] == 4
  for key in ("heldout_tv_before", "heldout_tv_after", "final_loss"):
    np.testing.assert_allclose(several[key], one[key], rtol=1e-6, err_msg=key)
  with np.load(runs[count] / "samples.npz") as a, np.load(runs[1] / "samples.npz") as b:
    np.testing.assert_array_equal(a["tokens_NxT"], b["tokens_NxT"])
  rows = {n: [json.loads(line) for line in (runs[n] / "metrics.jsonl").read_text().splitlines()] for n in runs}
  assert [r["step"] for r in rows[count]] == [r["step"] for r in rows[1]] == [1, 2, 3, 4]
  np.testing.assert_allclose([r["loss"] for r in rows[count]], [r["loss"] for r in rows[1]], rtol=1e-6)
  steps = {n: sorted(p.name for p in (runs[n] / "checkpoints").iterdir() if p.name.isdigit()) for n in runs}
  assert steps[count] == steps[1]


# slow: the job path across processes runs by default in the distillation smoke job above (process-local rows,
# gathered outputs, process 0 writes), the sharded loops across processes in the first test, the recorded ids in one
# process (tests/test_main_job_ids.py); this one (5 minutes of the default run) runs SmolLM2 at XLA's default level
# in every process.
@pytest.mark.slow
@pytest.mark.parametrize("count", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_the_main_job_and_the_smoke_suite_across_processes_give_the_recorded_numbers(tmp_path, count):
  """2 processes × 2 devices (4 × 2 in the heavy run: a data axis of 8, 3 prompts and 5 padded rows), each running the SmolLM2 main job (at T = 1: sampled rows, each from its own keys; the
  greedy half of the record is checked on 8 devices in the slow tier) and the smoke suite on the global (2 · count) x 1 mesh:
  every process reads back the token ids, target calls, block efficiencies and acceptance that one device recorded
  (``tests/test_main_job_ids.py``), and only process 0 writes the suite's files."""
  import test_main_job_ids as ids
  results = run_processes(SCRIPT, count, ("jobs", str(tmp_path)), devices_each=2, timeout=420 * count,
                          product_level=True)
  for i, (code, out) in enumerate(results):
    assert code == 0 and "JOBS DONE" in out, f"process {i} ended with {code}:\n{out[-3000:]}"
    got = json.loads((tmp_path / f"record_{i}.json").read_text())
    ids.assert_matches_record(got, temperatures=(1.0,))
    assert {key.rsplit("@", 1)[1] for key in got["smoke_suite_rows"]} == set(ids.SUITE_TASKS)
    assert len(got["generated_ids"]) == 3
  assert (tmp_path / "suite_0" / "results.json").exists()
  assert not any((tmp_path / f"suite_{i}" / "results.json").exists() for i in range(1, count))
  settings = json.loads((tmp_path / "suite_0" / "results.json").read_text())
  assert settings["settings"]["mesh"] == [2 * count, 1] and settings["environment"]["processes"] == count


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
