"""Checkpoint integrity (blockspec_jax.train.checkpoints) on real orbax checkpoints of a tiny run.

A run of 6 steps saving every 2 and keeping 2, stopped after 4 (kept: steps 2 and 4), is damaged in its newest step:
one flipped byte in a data file (which orbax restores silently), a zero-length file, a missing metadata file. The
resume passes over the damaged step with one line on stderr, restarts from step 2, drops the later metrics lines and
reaches the uninterrupted run's state bit for bit. Every step damaged is one error line; a step without a record
(older runs, a run killed before recording) is used when orbax restores it, always with a line, and passed over when
it cannot; ``recipe.restore_trainable`` falls back only when no step is asked for; records of steps orbax deleted go
with them.
"""

import asyncio
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax.train import checkpoints, recipe as recipe_lib, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_STEPS = 6


def run(workdir, stop_after=None):
  """The tiny job: 6 steps of a (64, 64) and an (8,) parameter, noise keys, checkpoints every 2 steps, 2 kept."""
  def loss_fn(trainable, frozen, batch, key):
    noise = 0.01 * jax.random.normal(key, trainable["w"].shape)
    return jnp.mean((trainable["w"] * frozen["scale"] - batch["y"] + noise) ** 2) + jnp.sum(trainable["b"] ** 2), {}
  init = {"w": jax.random.normal(jax.random.key(1), (64, 64)), "b": jnp.ones(8)}
  return trainer.fit(loss_fn=loss_fn, optimizer=trainer.make_optimizer("adamw", 0.05, "cosine", total_steps=NUM_STEPS),
                     trainable=init, frozen={"scale": jnp.float32(2.0)},
                     batch_fn=lambda step, t: {"y": jnp.full((64, 64), 0.1 * step, jnp.float32)},
                     key=jax.random.key(0), workdir=workdir,
                     loop=trainer.Loop(num_steps=NUM_STEPS, checkpoint_every=2, max_to_keep=2, progress=False,
                                       plot=False, stop_after=stop_after))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(the uninterrupted run's result, the work directory of the run stopped after step 4: checkpoints 2 and 4)."""
  root = tmp_path_factory.mktemp("runs")
  straight = run(root / "straight")
  stopped = run(root / "stopped", stop_after=4)
  assert stopped.resumed_from is None and int(stopped.state.step) == 4
  assert _steps(root / "stopped") == [2, 4] and _records(root / "stopped") == [2, 4]
  return straight, root / "stopped"


def _copy(runs, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(runs[1], workdir)
  return workdir


def _steps(workdir):
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _records(workdir):
  folder = workdir / "checkpoints_sha256"
  return sorted(int(p.stem) for p in folder.glob("*.json")) if folder.is_dir() else []


def _data_file(workdir, step):
  """The largest file of the step: tensorstore's chunk of the (64, 64) arrays, in a ``d/`` folder."""
  files = [p for p in (workdir / "checkpoints" / str(step)).rglob("*") if p.is_file()]
  data = max(files, key=lambda p: p.stat().st_size)
  assert data.parent.name == "d" and data.stat().st_size > 10_000
  return data


def _flip(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x40
  path.write_bytes(bytes(data))


def _lines(err):
  """stderr lines but the trainer's own compile announcements."""
  return [line for line in err.splitlines() if line.strip() and "compil" not in line]


def _assert_same_state(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a.state), jax.tree.leaves(b.state)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_resumed_exactly(straight, resumed, workdir):
  _assert_same_state(straight, resumed)
  assert [r["step"] for r in resumed.history] == [3, 4, 5, 6]
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))  # lines 3 and 4 of the stopped run dropped
  assert [r["loss"] for r in rows] == [r["loss"] for r in straight.history]
  assert _steps(workdir) == [4, 6] and _records(workdir) == [4, 6]
  for step in (4, 6):
    assert checkpoints.verify_step(workdir / "checkpoints", step) == (True, "")


def test_a_flipped_byte_in_a_data_file_falls_back_to_the_previous_step_and_trains_to_the_same_state(runs, tmp_path,
                                                                                                     capsys):
  straight, _ = runs
  workdir = _copy(runs, tmp_path)
  data = _data_file(workdir, 4)
  _flip(data)
  rel = data.relative_to(workdir / "checkpoints" / "4").as_posix()
  assert checkpoints.verify_step(workdir / "checkpoints", 4) == (
      False, f"{rel}: sha256 differs from the one recorded when it was saved")
  assert checkpoints.verify_step(workdir / "checkpoints", 2) == (True, "")
  capsys.readouterr()
  resumed = run(workdir)
  assert resumed.resumed_from == 2
  assert _lines(capsys.readouterr().err) == [
      f"[blockspec_jax] checkpoint step 4 ({workdir.absolute() / 'checkpoints' / '4'}) is damaged ({rel}: sha256 "
      "differs from the one recorded when it was saved); resuming from step 2 instead (step 4 is deleted: the run "
      "saves it again)"]
  _assert_resumed_exactly(straight, resumed, workdir)


@pytest.mark.parametrize("damage", ["zero-length data file", "_METADATA missing", "_CHECKPOINT_METADATA missing"])
def test_a_zero_length_or_missing_file_is_one_line_and_a_fallback(runs, tmp_path, capsys, damage):
  straight, _ = runs
  workdir = _copy(runs, tmp_path)
  step_dir = workdir / "checkpoints" / "4"
  if damage == "zero-length data file":
    data = _data_file(workdir, 4)
    size = data.stat().st_size
    data.write_bytes(b"")
    why = f"{data.relative_to(step_dir).as_posix()} is empty, {size} bytes when it was saved"
  else:
    rel = "default/_METADATA" if damage == "_METADATA missing" else "_CHECKPOINT_METADATA"
    (step_dir / rel).unlink()  # orbax writes both: unlink raises otherwise
    why = f"{rel} is missing"
  capsys.readouterr()
  resumed = run(workdir)
  assert resumed.resumed_from == 2
  assert _lines(capsys.readouterr().err) == [
      f"[blockspec_jax] checkpoint step 4 ({step_dir.absolute()}) is damaged ({why}); resuming from step 2 instead "
      "(step 4 is deleted: the run saves it again)"]
  _assert_resumed_exactly(straight, resumed, workdir)


def test_every_kept_step_damaged_is_one_error_and_deletes_nothing(runs, tmp_path, capsys):
  workdir = _copy(runs, tmp_path)
  _flip(_data_file(workdir, 4))
  (workdir / "checkpoints" / "2" / "default" / "_METADATA").write_bytes(b"")
  capsys.readouterr()
  with pytest.raises(checkpoints.DamagedCheckpointError) as e:
    run(workdir)
  message = str(e.value)
  directory = workdir.absolute() / "checkpoints"
  assert "\n" not in message and message.startswith(f"no intact checkpoint in {directory} (step 4: ")
  assert "sha256 differs" in message and "step 2: default/_METADATA is empty" in message
  assert message.endswith(f"; delete {directory} to start the run over")
  assert isinstance(e.value, ValueError)
  assert _lines(capsys.readouterr().err) == []
  assert _steps(workdir) == [2, 4] and _records(workdir) == [2, 4]
  assert len(trainer.read_metrics(workdir / "metrics.jsonl")) == 4  # untouched


def test_orbax_failures_on_unrecorded_steps_are_one_line_in_a_real_process(runs, tmp_path):
  """Steps without records that orbax cannot read (a zero-length _METADATA, a zero-length data file): the whole
  stderr of the process is the error line, no orbax logging, no asyncio or tensorstore tracebacks."""
  workdir = _copy(runs, tmp_path)
  shutil.rmtree(workdir / "checkpoints_sha256")
  (workdir / "checkpoints" / "4" / "default" / "_METADATA").write_bytes(b"")
  _data_file(workdir, 2).write_bytes(b"")
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
      from blockspec_jax.train import checkpoints
      from test_checkpoint_integrity import run
      try:
        run({str(workdir)!r})
      except checkpoints.DamagedCheckpointError as e:
        print("error:", e, file=sys.stderr)
        sys.exit(3)
      """)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                        cwd=REPO)
  assert proc.returncode == 3, proc.stderr[-3000:]
  lines = _lines(proc.stderr)
  assert len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith(f"error: no intact checkpoint in {workdir / 'checkpoints'} (step 4: it is not verified "
                             "and orbax cannot restore it: JSONDecodeError")
  assert "step 2: it is not verified and orbax cannot restore it: ValueError: OUT_OF_RANGE" in lines[0]


def _report_never_retrieved(exc):
  """Has asyncio report "Task exception was never retrieved" for ``exc``, as it does for orbax's abandoned reads:
  a task raises it in a loop closed without retrieving it, and the garbage collector reaches the task later."""
  async def fail():
    raise exc
  loop = asyncio.new_event_loop()
  task = loop.create_task(fail())
  loop.run_until_complete(asyncio.sleep(0.01))
  loop.close()
  del task
  gc.collect()


def test_asyncio_reports_about_orbax_tasks_after_a_failed_restore_are_dropped_and_no_others(runs, tmp_path, caplog):
  """Orbax closes its event loop without cancelling the reads still pending, and asyncio reports those tasks when the
  garbage collector reaches them: possibly at interpreter exit, after the one error line (a loaded CI machine printed
  such a traceback there). Once a restore has failed, asyncio's report about an exception raised in orbax's code is
  dropped for good; the same report about any other exception still reaches the log."""
  import orbax.checkpoint as ocp
  workdir = _copy(runs, tmp_path)
  _data_file(workdir, 2).write_bytes(b"")
  manager = checkpoints.make_manager(workdir / "checkpoints", max_to_keep=2, every=2)
  with pytest.raises(Exception) as orbax_error:
    with checkpoints._quiet():
      manager.restore(2, args=ocp.args.StandardRestore())
  assert "OUT_OF_RANGE" in str(orbax_error.value.__cause__)
  caplog.set_level(logging.WARNING)
  _report_never_retrieved(orbax_error.value)
  assert [r for r in caplog.records if r.name == "asyncio"] == []
  _report_never_retrieved(ValueError("not orbax's"))
  reports = [r for r in caplog.records if r.name == "asyncio"]
  assert len(reports) == 1 and reports[0].getMessage().startswith("Task exception was never retrieved")
  assert reports[0].exc_info[1].args == ("not orbax's",)


def test_a_run_of_an_older_version_without_records_resumes_from_its_newest_step_with_a_line(runs, tmp_path, capsys):
  """No records at all (a run saved before they existed): the newest step that restores is used, with a line that
  it is not verified; the steps saved from then on are recorded."""
  straight, _ = runs
  workdir = _copy(runs, tmp_path)
  shutil.rmtree(workdir / "checkpoints_sha256")
  capsys.readouterr()
  resumed = run(workdir)
  assert resumed.resumed_from == 4
  lines = _lines(capsys.readouterr().err)
  assert lines == [f"[blockspec_jax] checkpoint step 4 ({workdir.absolute() / 'checkpoints' / '4'}) is not verified "
                   f"(no record of its files' SHA-256 in {workdir.absolute() / 'checkpoints_sha256'}: saved by a "
                   "version that did not record them, or the run stopped before it could); resuming from it "
                   "unverified"]
  _assert_same_state(straight, resumed)
  assert _steps(workdir) == [4, 6] and _records(workdir) == [6]
  assert checkpoints.verify_step(workdir / "checkpoints", 4)[0] is None


def test_an_unrecorded_step_that_is_damaged_is_passed_over_for_an_older_unrecorded_one(runs, tmp_path, capsys):
  straight, _ = runs
  workdir = _copy(runs, tmp_path)
  shutil.rmtree(workdir / "checkpoints_sha256")
  _data_file(workdir, 4).write_bytes(b"")
  capsys.readouterr()
  resumed = run(workdir)
  assert resumed.resumed_from == 2
  lines = _lines(capsys.readouterr().err)
  assert len(lines) == 2
  assert lines[0].startswith("[blockspec_jax] checkpoint step 4 (")
  assert "is damaged (it is not verified and orbax cannot restore it: ValueError: OUT_OF_RANGE" in lines[0]
  assert lines[0].endswith("resuming from step 2 instead (step 4 is deleted: the run saves it again)")
  assert lines[1].startswith("[blockspec_jax] checkpoint step 2 (") and lines[1].endswith("resuming from it unverified")
  _assert_same_state(straight, resumed)


def test_a_newest_step_whose_record_is_missing_is_used_with_a_line_before_an_older_verified_one(runs, tmp_path,
                                                                                                 capsys):
  """A run killed between orbax's (atomic) save of step 4 and its record: step 4 is the newest step that restores,
  so it is used, with the line that it is not verified; the verified step 2 is not preferred over it."""
  straight, _ = runs
  workdir = _copy(runs, tmp_path)
  (workdir / "checkpoints_sha256" / "4.json").unlink()
  capsys.readouterr()
  resumed = run(workdir)
  assert resumed.resumed_from == 4
  lines = _lines(capsys.readouterr().err)
  assert len(lines) == 1 and lines[0].startswith(f"[blockspec_jax] checkpoint step 4 "
                                                 f"({workdir.absolute() / 'checkpoints' / '4'}) is not verified (no "
                                                 "record of its files' SHA-256")
  assert lines[0].endswith("); resuming from it unverified")
  _assert_same_state(straight, resumed)
  assert _steps(workdir) == [4, 6] and _records(workdir) == [6]


def test_an_unreadable_record_counts_as_missing(runs, tmp_path, capsys):
  workdir = _copy(runs, tmp_path)
  record = workdir / "checkpoints_sha256" / "4.json"
  record.write_text("{not json")
  verified, why = checkpoints.verify_step(workdir / "checkpoints", 4)
  assert verified is None and why.startswith(f"its record {record.absolute()} is unreadable (JSONDecodeError")
  record.write_text(json.dumps({"format": 1, "step": 2, "files": {}}))  # another step's record
  assert checkpoints.verify_step(workdir / "checkpoints", 4)[0] is None


def test_restore_trainable_refuses_a_damaged_step_it_is_asked_for_and_falls_back_otherwise(runs, tmp_path, capsys):
  workdir = _copy(runs, tmp_path)
  template = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}
  at_2, step = recipe_lib.restore_trainable(workdir, template, step=2)
  assert step == 2
  data = _data_file(workdir, 4)
  _flip(data)
  rel = data.relative_to(workdir / "checkpoints" / "4").as_posix()
  step_dir = workdir.absolute() / "checkpoints" / "4"
  with pytest.raises(checkpoints.DamagedCheckpointError) as e:
    recipe_lib.restore_trainable(workdir, template, step=4)
  assert str(e.value) == (f"checkpoint step 4 ({step_dir}) is damaged ({rel}: sha256 differs from the one recorded "
                          "when it was saved); other kept steps: 2")
  capsys.readouterr()
  trainable, step = recipe_lib.restore_trainable(workdir, template)
  assert step == 2
  for a, b in zip(jax.tree.leaves(at_2), jax.tree.leaves(trainable)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _lines(capsys.readouterr().err) == [
      f"[blockspec_jax] checkpoint step 4 ({step_dir}) is damaged ({rel}: sha256 differs from the one recorded when "
      "it was saved); loading step 2 instead"]
  assert _steps(workdir) == [2, 4] and _records(workdir) == [2, 4]  # reading deletes nothing
  with pytest.raises(ValueError, match=r"no checkpoint of step 3 .* kept steps: \[2, 4\]"):
    recipe_lib.restore_trainable(workdir, template, step=3)


def test_records_follow_the_kept_steps_and_a_restarted_run_replaces_stale_ones(runs, tmp_path, capsys):
  """max_to_keep = 2 over saves at 2, 4 and 6: orbax deletes step 2 and its record goes too. Deleting the checkpoints
  (as the error says, to start over) leaves records behind; the new run's saves replace them."""
  straight, _ = runs
  workdir = tmp_path / "run"
  shutil.copytree(runs[1].parent / "straight", workdir)
  assert _steps(workdir) == [4, 6] and _records(workdir) == [4, 6]
  for step in (4, 6):
    assert checkpoints.verify_step(workdir / "checkpoints", step) == (True, "")
  shutil.rmtree(workdir / "checkpoints")
  again = run(workdir)
  assert again.resumed_from is None and _steps(workdir) == [4, 6] and _records(workdir) == [4, 6]
  for step in (4, 6):
    assert checkpoints.verify_step(workdir / "checkpoints", step) == (True, "")
  _assert_same_state(straight, again)
  assert _lines(capsys.readouterr().err) == []


def test_intact_checkpoints_of_another_shape_are_a_one_line_error_not_damage(runs, tmp_path, capsys):
  """Files as recorded but another state (a run resumed with other settings): a plain ValueError saying so, nothing
  deleted."""
  workdir = _copy(runs, tmp_path)
  template = trainer.init_state({"w": jnp.zeros((32, 64)), "b": jnp.zeros(8)},
                                trainer.make_optimizer("adamw", 0.05, "cosine", total_steps=6))
  capsys.readouterr()
  with pytest.raises(ValueError) as e:
    trainer.restore_latest(workdir / "checkpoints", template)
  message = str(e.value)
  assert not isinstance(e.value, checkpoints.DamagedCheckpointError) and "\n" not in message
  assert message.startswith(f"the checkpoints in {workdir.absolute() / 'checkpoints'} are intact but do not restore "
                            "into this run's state (saved with other settings?): step 4: its files match their record "
                            "but orbax cannot restore it: ValueError: ")
  assert "(32, 64)" in message and "; step 2: " in message
  assert _lines(capsys.readouterr().err) == []
  assert _steps(workdir) == [2, 4] and _records(workdir) == [2, 4]
