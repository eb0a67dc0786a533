"""The training jobs as settings objects: one registry (``blockspec_jax.train.jobs``) that both entry points read,
each job's settings one frozen dataclass registered with gin under the job's name, and a settings mistake one
UsageError raised when the settings are made, before any model loads or anything is written."""

import dataclasses
import importlib

import gin
import pytest

from blockspec_jax import checks
from blockspec_jax import main as entry
from blockspec_jax import sources
from blockspec_jax.models import hub
from blockspec_jax.train import __main__ as train_main
from blockspec_jax.train import job_setup, jobs, trainer

TINY = train_main.tiny_decoder()  # the config `@tiny_decoder()` gives
#: job -> its settings class' name and the message of giving a real target and a tiny config at once
SETTINGS = {"distill_job": ("DistillSettings", "not a mix"), "sprinter_job": ("SprinterSettings", "not a mix"),
            "heads_job": ("HeadsSettings", "not both"), "steer_job": ("SteerSettings", "not a mix")}


def test_both_entry_points_read_the_one_registry():
  assert tuple(jobs.TRAINING_JOBS) == entry.TRAINING_JOBS == train_main.JOBS
  assert set(SETTINGS) == set(jobs.TRAINING_JOBS) and jobs.DEFAULT_JOB in jobs.TRAINING_JOBS
  found = train_main._jobs()
  assert list(found) == list(jobs.TRAINING_JOBS)
  for name, module in jobs.TRAINING_JOBS.items():
    assert found[name] is getattr(importlib.import_module(module), name)
  assert found["distill_job"] is train_main.distill_job and found["sprinter_job"] is train_main.sprinter_job


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_job_has_one_frozen_settings_object_bound_by_its_gin_name(name):
  module = importlib.import_module(jobs.TRAINING_JOBS[name])
  cls = getattr(module, SETTINGS[name][0])
  assert dataclasses.is_dataclass(cls) and issubclass(cls, job_setup.JobSettings) and cls.JOB == name
  gin.clear_config()
  try:
    gin.parse_config([f"{name}.target_config = @tiny_decoder()", f"{name}.num_steps = 7"]
                     + ([f"{name}.drafter_config = @tiny_decoder()"] if issubclass(cls, job_setup.PairSettings)
                        else []))
    settings = cls()
  finally:
    gin.clear_config()
  assert settings.num_steps == 7 and settings.target_config == TINY
  with pytest.raises(dataclasses.FrozenInstanceError):
    settings.num_steps = 8
  # the loop every job hands to trainer.fit: its settings, and no mesh on one device (data_parallel's default)
  assert settings.data_parallel and settings.train_mesh() is None
  assert settings.loop() == trainer.Loop(num_steps=7, checkpoint_every=settings.checkpoint_every,
                                         max_to_keep=settings.max_to_keep, eval_every=settings.eval_every,
                                         progress=settings.progress, stop_after=None, mesh=None)
  assert dataclasses.replace(settings, stop_after=3).loop().stop_after == 3
  with pytest.raises(checks.UsageError, match=rf"^{name}\.stop_after must be an integer >= 1, got 0"):
    dataclasses.replace(settings, stop_after=0)
  # the (data, model) mesh shape: checked when made, before any model loads, naming the job's setting
  assert dataclasses.replace(settings, mesh=(1, 1)).train_mesh() is None
  with pytest.raises(checks.UsageError, match=rf"^{name}\.mesh 2 x 2 \(data x model\) must cover the run's 1 "):
    dataclasses.replace(settings, mesh=(2, 2))
  with pytest.raises(checks.UsageError, match=rf"^{name}\.mesh must be \(data, model\), two positive integers"):
    dataclasses.replace(settings, mesh="4x2")
  assert dataclasses.replace(settings, mesh=(2, 2), data_parallel=False).train_mesh() is None  # one device: no mesh


@pytest.mark.parametrize("bad,message", [
    (dict(num_steps=0), "num_steps must be an integer >= 1, got 0"),
    (dict(num_steps=3, checkpoint_every=0), "checkpoint_every and max_to_keep must be >= 1, got 0, 3"),
    (dict(num_steps=3, max_to_keep=0), "checkpoint_every and max_to_keep must be >= 1, got 100, 0"),
    (dict(num_steps=3, eval_every=-1), "eval_every must be an integer >= 0, got -1"),
    (dict(num_steps=3, stop_after=0), "stop_after must be an integer >= 1, got 0"),
])
def test_the_training_loops_settings_are_checked_when_made(bad, message):
  with pytest.raises(ValueError, match=message):
    trainer.Loop(**bad)


@pytest.fixture
def no_model_loads(monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("a model was loaded")

  monkeypatch.setattr(sources, "load_model", refuse)
  monkeypatch.setattr(hub, "load_model", refuse)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_settings_mistake_is_one_usage_error_before_any_model_loads(name, tmp_path, no_model_loads):
  job = train_main._jobs()[name]
  cls = getattr(importlib.import_module(jobs.TRAINING_JOBS[name]), SETTINGS[name][0])
  pair = issubclass(cls, job_setup.PairSettings)
  tiny = dict(target_config=TINY, drafter_config=TINY) if pair else dict(target_config=TINY)
  workdir = tmp_path / "never_written"
  gin.clear_config()
  try:
    # the message first (gin may add the configurable it was raised in on a line of its own)
    with pytest.raises(checks.UsageError, match=rf"^{name}\.num_steps must be an integer >= 1, got 0\b"):
      job(workdir, num_steps=0, progress=False, **tiny)
    with pytest.raises(checks.UsageError, match=SETTINGS[name][1]):
      job(workdir, target="smollm2-135m", progress=False, **tiny)
    with pytest.raises(checks.UsageError, match=SETTINGS[name][1]):
      cls(target="smollm2-135m", **tiny)
  finally:
    gin.clear_config()
  assert not workdir.exists()


@pytest.mark.slow  # four smoke jobs in subprocesses (~3 min); the multi-process distillation test runs by default
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_training_job_splits_its_batches_over_two_devices_by_default(name, tmp_path):
  """Each job's smoke gin file on 2 fake CPU devices: the default mesh splits every batch over both (the summary
  says so), the run ends, and a batch that does not split is refused before anything runs; with ``mesh = (1, 2)``
  the job runs with its models over a model axis instead."""
  import json
  import os
  import subprocess
  import sys
  from helpers import fake_devices_env
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  job = name.removesuffix("_job")
  steps = ["--gin_param", f"{name}.num_steps = 12", "--gin_param", f"{name}.progress = False"]
  command = [sys.executable, "-m", "blockspec_jax.train", "--gin_file", f"gin/train/{job}_smoke.gin"]
  proc = subprocess.run(command + ["--workdir", str(tmp_path / "run")] + steps, cwd=repo, env=fake_devices_env(2),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
  assert summary["data_parallel_devices"] == 2 and summary["steps"] == 12
  odd = ["--gin_param", f"{name}.batch_size = 3"]
  proc = subprocess.run(command + ["--workdir", str(tmp_path / "odd")] + steps + odd, cwd=repo,
                        env=fake_devices_env(2), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 2 and f"{name}.batch_size = 3 must be a multiple of the 2 devices" in proc.stderr, \
      proc.stderr[-2000:]
  # the same job on a model axis: the target's parameters over both devices, every batch whole on each
  model = ["--gin_param", f"{name}.mesh = (1, 2)"]
  proc = subprocess.run(command + ["--workdir", str(tmp_path / "model")] + steps + model, cwd=repo,
                        env=fake_devices_env(2), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((tmp_path / "model" / "metrics.json").read_text())
  assert summary["mesh"] == [1, 2] and summary["data_parallel_devices"] == 1 and summary["steps"] == 12
  assert not (tmp_path / "odd" / "checkpoints").exists()
