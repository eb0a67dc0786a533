"""drafters.check_settings: a job's drafter settings checked before any model loads, by the same code that checks them
when the drafter is built on a real config. Every test runs over the registry (``drafters.DRAFTERS``), so a new
drafter is covered as soon as it is registered (and fails here until its settings have bad values below)."""

import json
import re

import jax
import pytest

from blockspec_jax import drafters
from blockspec_jax.drafters import heads as heads_lib, lattice, sprinter as sprinter_lib, steer as steer_lib
from blockspec_jax.train import heads as heads_train, sprinter as sprinter_train, steer as steer_train
from helpers import tiny_config

CONFIG = tiny_config()  # V = 64, D = 32, 2 layers, F = 64: target and drafter alike
V = CONFIG.vocab_size
TRAINED = [name for name, cls in drafters.DRAFTERS.items() if getattr(cls, "run_setting", None) is not None]

#: drafter -> (settings, message regex): a bad value of every model-independent constraint. Every setting of every
#: registered drafter needs at least one entry (test_bad_values_are_refused_before_and_after_loading checks it).
BAD = {
    "k_chains": [({"k": 0}, "k >= 1"), ({"k": 2.0}, "k >= 1"), ({"k": True}, "k >= 1")],
    "rsd_c": [({"branching": (2, 0)}, "non-empty tuple of integers >= 1"), ({"branching": ()}, "non-empty tuple"),
              ({"branching": 2}, "non-empty tuple"), ({"branching": (1.5,)}, "non-empty tuple"),
              ({"epsilon": 0.0}, r"epsilon must be in \(0, 1\)"), ({"epsilon": "x"}, "epsilon must be in")],
    "rsd_s": [({"width": 0}, r"rsd_s width must be an integer in \[1, V\]"), ({"width": 1.5}, "rsd_s width"),
              ({"epsilon": 1.0}, "epsilon must be in")],
    "ngram": [({"max_ngram": 0}, "min_ngram <= max_ngram"), ({"min_ngram": 4}, "min_ngram <= max_ngram"),
              ({"min_ngram": 1.0}, "integers"), ({"max_len": 0}, "max_len must be None")],
    "sprinter": [({"head": 3}, "head must name a directory"), ({"head": ""}, "head must name a directory")],
    "beam": [({"width": 0}, r"beam width must be an integer in \[1, V\] \(beams per step\)"),
             ({"width": "2"}, "beam width"), ({"sample": "yes"}, "sample must be a bool"),
             ({"per_step": 1}, "per_step must be a bool")],
    "heads": [({"rescore": "beam"}, "unknown rescorer 'beam'; known: none, ngram, neural"),
              ({"num_heads": 0}, "num_heads must be an integer >= 1"), ({"num_heads": 2.5}, "num_heads"),
              ({"top_k": 0}, r"top_k must be an integer in \[1, V\]"), ({"pbest": 0}, "pbest must be an integer"),
              ({"lm_weight": -1.0}, "lm_weight must be a finite number"), ({"lm_weight": float("nan")}, "lm_weight"),
              ({"heads": 5}, "heads must name a directory"), ({"ngram": ""}, "ngram must name a directory")],
    "heads_tree": [({"rescore": "ngram"}, "heads_tree proposes the p best paths .* must be one of pbest_ngram, "
                                          "pbest_none, got 'ngram'"),
                   ({"rescore": "pbest_neural"}, "neural LM's cache can follow one path only"),
                   ({"num_heads": 0}, "num_heads must be an integer >= 1"),
                   ({"top_k": 0}, r"top_k must be an integer in \[1, V\]"), ({"pbest": 0}, "pbest must be an integer"),
                   ({"lm_weight": -1.0}, "lm_weight must be a finite number"), ({"heads": 5}, "heads must name a"),
                   ({"ngram": ""}, "ngram must name a directory")],
    "steered": [({"target_layers": (-1,)}, "target_layers must be layer indices >= 0"),
                ({"target_layers": 3}, "target_layers must be a non-empty tuple"),
                ({"steered_layers": (1, 0)}, "steered_layers must be strictly increasing"),
                ({"steered_layers": ()}, "steered_layers must be a non-empty tuple"),
                ({"steer": 7}, "steer must name a directory")],
}


def build(name, settings):
  """The drafter ``name`` built on the tiny config as a job builds it (``methods.build_drafter``)."""
  cls = drafters.DRAFTERS[name]
  if hasattr(cls, "build"):
    return cls.build(CONFIG, CONFIG, **settings)
  return drafters.make(name, config=CONFIG, vocab_size=V, **settings)


def error(fn, *args) -> str:
  with pytest.raises(ValueError) as e:
    fn(*args)
  return str(e.value)


def write_run(name, directory) -> None:
  """A finished training run of drafter ``name`` in ``directory``, written by its artifact's ``save``."""
  if name in ("heads", "heads_tree"):
    heads_train.save_heads(directory, heads_lib.init_heads(CONFIG.d_model, 2, jax.random.key(0)))
  elif name == "sprinter":
    sprinter_train.save_head(directory, sprinter_lib.init_head(CONFIG.d_model))
  elif name == "steered":
    steer_train.save_steer(directory, steer_lib.init_steer(CONFIG.d_model, 2, CONFIG),
                           {"target_layers": [0, 1], "steered_layers": [0, 1], "drafter_layers": CONFIG.num_layers,
                            "ffn_dim": CONFIG.ffn_dim})
  else:
    raise AssertionError(f"no run writer for the trained drafter {name!r}: add one here")


@pytest.mark.parametrize("name", list(drafters.DRAFTERS))
def test_defaults_pass_and_unknown_settings_are_refused(name, tmp_path):
  cls = drafters.DRAFTERS[name]
  assert cls.name == name
  if name in TRAINED:  # a job cannot decode without the run: refused before loading, as load_params refuses after
    message = error(drafters.check_settings, name, {})
    assert message.startswith("needs ") and "python -m blockspec_jax.train" in message
    assert error(build(name, {}).load_params, None, None) == message
    write_run(name, tmp_path)
    minimal = {cls.run_setting: str(tmp_path)}
  else:
    minimal = {}
  drafters.check_settings(name, minimal)
  drafters.check_settings(f"{name}/variant", minimal)
  build(name, minimal)
  message = error(drafters.check_settings, name, {**minimal, "no_such": 1})
  assert message == (f"drafter {name!r} has no settings ['no_such']; its settings: "
                     f"{', '.join(cls.setting_names()) or 'none'}")
  assert error(build, name, {**minimal, "no_such": 1}) == message  # make / build: the same check
  assert not set(cls.setting_names()) & {"config", "vocab_size", "target", "lm_config"}  # what the job passes


@pytest.mark.parametrize("name", list(drafters.DRAFTERS))
def test_bad_values_are_refused_before_and_after_loading(name):
  """Each bad value: the same message from check_settings (no model) and from building on a real config (where a
  vocabulary bound names V)."""
  bad = BAD.get(name, [])
  assert set(drafters.DRAFTERS[name].setting_names()) <= {k for settings, _ in bad for k in settings}, \
      f"give every setting of {name!r} a bad value in BAD"
  for settings, pattern in bad:
    before = error(drafters.check_settings, name, settings)
    assert re.search(pattern, before), (settings, before)
    assert error(build, name, settings) == before.replace("[1, V]", f"[1, V = {V}]"), settings


def test_model_dependent_constraints_wait_for_the_models(tmp_path):
  """Bounds that need the model's sizes pass the pre-check and are refused when the drafter is built."""
  runs = {}
  for name in TRAINED:
    write_run(name, tmp_path / name)
    runs[name] = {drafters.DRAFTERS[name].run_setting: str(tmp_path / name)}
  cases = [("rsd_c", {"branching": (V + 1,)}, "more distinct children than the V = 64"),
           ("rsd_s", {"width": V + 1}, r"rsd_s width must be an integer in \[1, V = 64\], got 65"),
           ("beam", {"width": V + 1}, r"beam width must be an integer in \[1, V = 64\]"),
           ("heads", {"top_k": V + 1}, r"top_k must be an integer in \[1, V = 64\]"),
           ("steered", {"steered_layers": (0, 2)}, r"steered_layers must be layer indices in \[0, 2\)")]
  for name, settings, message in cases:
    settings = {**settings, **runs.get(name, {})}
    drafters.check_settings(name, settings)
    with pytest.raises(ValueError, match=message):
      build(name, settings)


@pytest.mark.parametrize("name", TRAINED)
def test_trained_runs_need_their_record(name, tmp_path):
  setting = drafters.DRAFTERS[name].run_setting
  missing = error(drafters.check_settings, name, {setting: str(tmp_path / "nowhere")})
  assert "nowhere does not exist" in missing and "python -m blockspec_jax.train --gin_file gin/train/" in missing
  empty = error(drafters.check_settings, name, {setting: str(tmp_path)})
  assert "not found" in empty and "is not the work directory of a finished" in empty and "python -m" in empty
  write_run(name, tmp_path)
  drafters.check_settings(name, {setting: str(tmp_path)})
  record = next(p for p in tmp_path.iterdir() if p.suffix == ".json")
  text = record.read_text()
  record.write_text("{not json")
  assert "is corrupted" in error(drafters.check_settings, name, {setting: str(tmp_path)})
  record.write_text(json.dumps({**json.loads(text), "format": 99}))
  assert "format 99" in error(drafters.check_settings, name, {setting: str(tmp_path)})


def test_heads_run_extras(tmp_path):
  """No more heads than the run holds; an n-gram rescorer needs the LM's record (in ``ngram``, else the heads'
  directory); the record's number of heads is what build uses without ``num_heads``."""
  write_run("heads", tmp_path)
  run = {"heads": str(tmp_path)}
  assert build("heads", run).num_heads == 2
  drafters.check_settings("heads", {**run, "num_heads": 2})
  assert error(drafters.check_settings, "heads", {**run, "num_heads": 3}) == (
      f"the checkpoint in {tmp_path} has 2 heads; the drafter asks for 3")
  for rescore in ("ngram", "pbest_ngram"):
    assert "ngram.json not found" in error(drafters.check_settings, "heads", {**run, "rescore": rescore})
  drafters.check_settings("heads", {**run, "rescore": "neural"})  # no n-gram LM read
  message = error(drafters.check_settings, "heads", {**run, "ngram": str(tmp_path / "lm")})
  assert "n-gram LM directory" in message and "does not exist" in message and "heads_qwen.gin" in message
  lattice.save_ngram(tmp_path, lattice.build_ngram([[1, 2, 3, 4] * 3], V, order=2))
  drafters.check_settings("heads", {**run, "rescore": "pbest_ngram"})
  drafters.check_settings("heads/ngram", {**run, "rescore": "ngram", "ngram": str(tmp_path)})


def test_names_and_settings_shapes():
  assert error(drafters.check_settings, "lattice/ngram", {}) == (
      f"unknown drafter 'lattice'; known drafters: {', '.join(drafters.DRAFTERS)}")
  assert "a drafter name is a string" in error(drafters.check_settings, 3, {})
  for settings in (None, [("k", 2)], "k=2"):
    assert "takes its settings as a dict" in error(drafters.check_settings, "k_chains", settings)
  drafters.check_settings("rsd_c", {"branching": [2, 1], "epsilon": 1e-3})  # JSON lists are tuples' stand-ins
  assert build("rsd_c", {"branching": [2, 1]}).branching == (2, 1)
  assert "check_settings" in drafters.__all__
