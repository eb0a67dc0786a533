"""Sharding: rules, errors, and sharded = unsharded on 8 CPU devices (in a subprocess: XLA_FLAGS must be set before
JAX starts, and this process already has a single-device backend)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from blockspec_jax import parallel
from helpers import fake_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_sharded_script(*args) -> str:
  env = fake_devices_env(8)
  proc = subprocess.run([sys.executable, os.path.join(HERE, "sharded_equality_script.py"), *args], env=env,
                        capture_output=True, text=True, timeout=900)
  print(proc.stdout[-3000:], proc.stderr[-3000:])
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "ALL EQUAL" in proc.stdout
  assert "q weight P(None, 'model', None)" in proc.stdout  # a stacked q weight: split over model, not over L
  assert "compiled once: True" in proc.stdout  # a second batch of the same shapes does not recompile
  return proc.stdout


def test_sharded_equals_unsharded_on_eight_devices():
  # four mesh cases, 5 rows padded to the data axis, a training fit on data x model, the stacked layout
  assert _run_sharded_script().count("equal=True") == 7


@pytest.mark.slow  # the sharded loops, the row padding and a training fit run by default (the test above)
def test_sharded_evaluation_and_label_collection_equal_one_device():
  # and eval.paired's chain table and a trees arm, the training jobs' label collection
  out = _run_sharded_script("--extended")
  assert out.count("equal=True") == 10
  assert "paired_trees.run_arm" in out and "collect_labels and collect_hidden" in out


class _FakeMesh:
  shape = {"data": 2, "model": 2}


@pytest.mark.parametrize("path,shape,expected", [
    (("embed", "embedding"), (64, 32), P("model", None)),
    (("layers_0", "attn", "q", "weight"), (32, 32), P("model", None)),
    (("layers_0", "attn", "q", "bias"), (32,), P("model")),
    (("layers_0", "attn", "o", "weight"), (32, 32), P(None, "model")),
    (("layers_0", "mlp", "down", "weight"), (32, 64), P(None, "model")),
    (("layers_0", "mlp", "gate", "weight"), (64, 32), P("model", None)),
    (("layers_0", "attn_norm", "scale"), (32,), P()),
    (("lm_head", "weight"), (64, 32), P("model", None)),
    (("lm_head", "weight"), (63, 32), P()),  # 63 not divisible by 2: replicated
])
def test_param_spec_rules(path, shape, expected):
  assert parallel.param_spec(path, shape, _FakeMesh()) == expected


def test_mesh_and_batch_errors():
  with pytest.raises(ValueError, match="does not match"):
    parallel.make_mesh(data=2, model=1)  # one CPU device here
  mesh = parallel.make_mesh()
  assert mesh.shape == {"data": len(jax.devices()), "model": 1}
  if len(jax.devices()) == 1:
    parallel.batch_sharding(mesh, 3)  # any batch divides a 1-wide data axis


def test_mesh_shapes_are_checked_against_the_devices():
  from blockspec_jax.checks import UsageError
  devices = jax.device_count()
  assert parallel.check_mesh_shape(None) == (devices, 1) == parallel.parse_mesh_shape(None)
  assert parallel.parse_mesh_shape(f"{devices}x1") == parallel.parse_mesh_shape(f"{devices} × 1") == (devices, 1)
  for bad, message in (("4", "--mesh takes DATAxMODEL"), ("x2", "--mesh takes DATAxMODEL"),
                       (f"{devices}x2", f"--mesh {devices} x 2 \\(data x model\\) must cover")):
    with pytest.raises(UsageError, match=message):
      parallel.parse_mesh_shape(bad)
  for bad in ((0, 1), (1.0, 1), (True, 1), (1, 1, 1), "1x1"):
    with pytest.raises(UsageError, match="job.mesh must be \\(data, model\\), two positive integers"):
      parallel.check_mesh_shape(bad, "job.mesh")
  assert parallel.job_mesh((devices, 1)) is None if devices == 1 else parallel.job_mesh((devices, 1)).size == devices


def test_frozen_trees_are_laid_out_as_models_wherever_their_decoder_parameters_sit():
  """``param_specs`` finds decoder parameters below any keys (a training job's ``frozen``) and applies the
  model rules there; other leaves (a lone ``lm_head`` table, statistics) are replicated."""
  from blockspec_jax.models import decoder as dec
  params = dec.init_params(dec.DecoderConfig.tiny(vocab_size=64), 0)
  stacked = dec.stack_layers(params, 2)
  tree = {"target": params, "drafter": {"layers": stacked["layers"]}, "lm_head": np.zeros((64, 32)),
          "mean_D": np.zeros(32)}
  specs = parallel.param_specs(tree, _FakeMesh())
  assert specs["target"]["layers_0"]["attn"]["q"]["weight"] == P("model", None)
  assert specs["target"]["layers_0"]["attn"]["o"]["weight"] == P(None, "model")
  assert specs["target"]["embed"]["embedding"] == P("model", None)
  assert specs["drafter"]["layers"]["attn"]["q"]["weight"] == P(None, "model", None)  # stacked: never over L
  assert specs["lm_head"] == P() and specs["mean_D"] == P()
  # a model's own tree: every leaf as param_spec lays out its path (what shard_params always did for a model)
  for tree_ in (params, stacked):
    own = jax.tree_util.tree_leaves_with_path(parallel.param_specs(tree_, _FakeMesh()),
                                              is_leaf=lambda x: isinstance(x, P))
    for (path, spec), (_, leaf) in zip(own, jax.tree_util.tree_leaves_with_path(tree_)):
      assert spec == parallel.param_spec(parallel._path_names(path), leaf.shape, _FakeMesh()), path


def test_rows_are_padded_by_repeating_the_last_and_cut_back():
  import numpy as np
  from blockspec_jax.decoding.state import DecodeOutput
  assert parallel.pad_rows([4, 5], 4).tolist() == [4, 5, 5, 5]
  assert parallel.pad_rows(np.arange(3), 3).tolist() == [0, 1, 2]
  for bad in ([], [0, 1, 2]):
    with pytest.raises(ValueError, match=r"pad_rows needs 1 to 2 rows, got"):
      parallel.pad_rows(bad, 2)
  out = DecodeOutput(tokens_BxN=np.arange(8).reshape(4, 2), num_tokens_B=np.array([2, 1, 2, 2]),
                     stopped_B=np.zeros(4, bool), iterations=np.int32(3), metrics={"num_drafts": np.arange(4)})
  cut = parallel.take_rows(out, 2)
  assert cut.tokens_BxN.tolist() == [[0, 1], [2, 3]] and cut.num_tokens_B.tolist() == [2, 1]
  assert cut.metrics["num_drafts"].tolist() == [0, 1] and int(cut.iterations) == 3  # a scalar is kept


def test_a_model_given_twice_is_placed_once():
  import dataclasses
  import jax.numpy as jnp

  @dataclasses.dataclass(frozen=True)
  class Loaded:
    params: dict

  a, b = Loaded({"params": {"w": jnp.ones(4)}}), Loaded({"params": {"w": jnp.zeros(4)}})
  placed = parallel.shard_models((a, b, a), parallel.make_mesh())
  assert placed[0] is placed[2] and placed[1] is not placed[0] and placed[0] is not a
  assert placed[0].params["params"]["w"].sharding.mesh.shape == parallel.make_mesh().shape
