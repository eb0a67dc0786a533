"""Meshes, sharding rules and the sharded decode loops (``jax.jit`` with ``NamedSharding``: the modern pjit).

Mesh axes: ``data`` (batch rows) and ``model`` (weights and KV heads). Rules:

* batch-leading arrays (tokens, lengths, keys, outputs, per-row metrics): ``P("data")``;
* weights ((out, in) linear weights): q/k/v and MLP gate/up split their output features over ``model``, o/down their
  input features, the embedding and LM head the vocabulary; norms and biases of unsplit dims are replicated. A
  dimension that ``model`` does not divide is replicated (so any config runs on any mesh);
* KV cache ``[L, B, S, K, H]``: ``P(None, "data", None, "model", None)`` when ``model`` divides K.

Because each row's randomness is ``fold_in(row_key, iteration)``, a sharded run emits the same tokens as one device.

Multi-host (TPU pods): call :func:`initialize_multihost` first on every host (it wraps
``jax.distributed.initialize()``, which reads the coordinator from the TPU environment, or takes
``coordinator_address``, ``num_processes`` and ``process_id`` explicitly on GPU clusters); then build the mesh from
``jax.devices()`` (all hosts' devices), give every host the same prompts and keys, and put the batch on the mesh
with :func:`shard_batch`. Outputs are global arrays: use ``jax.experimental.multihost_utils.process_allgather`` to
read them on one host.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from blockspec_jax.decoding import speculative as spec
from blockspec_jax.models.scorer import as_scorer

__all__ = ["DATA", "MODEL", "make_mesh", "initialize_multihost", "param_spec", "param_shardings", "shard_params",
           "batch_sharding", "shard_batch", "cache_sharding", "sharded_speculative", "sharded_autoregressive"]

DATA, MODEL = "data", "model"


def initialize_multihost(**kwargs) -> None:
  """Join a multi-host run (TPU pod / GPU cluster): ``jax.distributed.initialize(**kwargs)``; no-op on one host.

  Must run before anything touches the JAX backend (``jax.devices()`` included).
  """
  if kwargs or _looks_multihost():
    jax.distributed.initialize(**kwargs)


def _looks_multihost() -> bool:
  import os
  return any(v in os.environ for v in ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
                                       "JAX_COORDINATOR_ADDRESS"))


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
  """A ``(data, model)`` mesh over ``devices`` (default all); ``data`` defaults to ``len(devices) // model``."""
  devices = list(jax.devices() if devices is None else devices)
  if model < 1 or len(devices) % model:
    raise ValueError(f"model axis size {model} must divide the {len(devices)} devices")
  data = len(devices) // model if data is None else data
  if data * model != len(devices):
    raise ValueError(f"mesh {data} x {model} does not match {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))


def _divisible(size: int, mesh: Mesh, axis: str) -> bool:
  return size % mesh.shape[axis] == 0


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
  """Partition spec of one parameter from its path in the decoder's tree (see the module docstring). A leaf of the
  stacked layout (``layers/...`` [L, ...], ``scan_layers``) is split as its one-layer counterpart, never over L."""
  if path and path[0] == "layers" and len(shape) >= 1:
    inner = param_spec(path[1:], shape[1:], mesh)
    return P(None, *inner) if len(inner) else P()
  name = "/".join(path)
  leaf = path[-1] if path else ""

  def split(dim):
    if not _divisible(shape[dim], mesh, MODEL):
      return P()
    spec = [None] * len(shape)
    spec[dim] = MODEL
    return P(*spec)

  if len(shape) < 2:
    if leaf == "bias" and any(f"/{k}/" in f"/{name}" for k in ("q", "k", "v")):
      return split(0)
    return P()
  if "embed" in path:
    return split(0)  # [V, D]: vocabulary
  if leaf == "weight" and (path[-2] in ("q", "k", "v", "gate", "up") or path[-2] == "lm_head"):
    return split(0)  # [out, in]: output features
  if leaf == "weight" and path[-2] in ("o", "down"):
    return split(1)  # [out, in]: input features
  return P()


def _path_names(path) -> tuple[str, ...]:
  return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def param_shardings(params, mesh: Mesh):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(_path_names(path), tuple(x.shape), mesh)), params)


def shard_params(params, mesh: Mesh):
  return jax.device_put(params, param_shardings(params, mesh))


def batch_sharding(mesh: Mesh, batch: int) -> NamedSharding:
  if batch % mesh.shape[DATA]:
    raise ValueError(f"batch size {batch} must be a multiple of the data axis size {mesh.shape[DATA]}")
  return NamedSharding(mesh, P(DATA))


def shard_batch(mesh: Mesh, *arrays):
  """Put batch-leading arrays (keys, tokens, lengths) on the mesh, rows split over ``data``."""
  return tuple(jax.device_put(a, batch_sharding(mesh, a.shape[0])) for a in arrays)


def _output_shardings(out_shape, mesh: Mesh):
  return jax.tree.map(lambda x: NamedSharding(mesh, P(DATA) if x.ndim else P()), out_shape)


def cache_sharding(mesh: Mesh, target) -> NamedSharding:
  """KV cache ``[L, B, S, K, H]``: rows over ``data``, KV heads over ``model`` when it divides them. ``target``: a
  ``DecoderConfig`` or a scorer carrying one (``.config``)."""
  config = getattr(as_scorer(target), "config", None)
  if config is None:
    raise TypeError(f"sharding the caches of {type(target).__name__} needs its DecoderConfig (a .config attribute)")
  heads = MODEL if _divisible(config.num_kv_heads, mesh, MODEL) else None
  return NamedSharding(mesh, P(None, DATA, None, heads, None))


def _abstract(tree):
  """Hashable description of a pytree of arrays: its structure and every leaf's shape and dtype."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


# (program, static settings, mesh, abstract inputs) -> the jax.jit for them: one jit object per distinct program, so
# its compiled executable is reused by every later call with the same shapes instead of recompiling per call.
_COMPILED: dict = {}


def _compiled(program, static, mesh, param_trees, batch_arrays):
  key = (program, tuple(sorted(static.items())), mesh, tuple(_abstract(t) for t in param_trees),
         _abstract(batch_arrays))
  fn = _COMPILED.get(key)
  if fn is None:
    batch = batch_arrays[0].shape[0]
    settings = dict(static, cache_sharding=cache_sharding(mesh, static["target"]))
    bound = functools.partial(program, **settings)
    out_shape = jax.eval_shape(bound, *param_trees, *batch_arrays)
    in_shardings = tuple(param_shardings(p, mesh) for p in param_trees) + tuple(
        batch_sharding(mesh, batch) for _ in batch_arrays)
    fn = _COMPILED[key] = jax.jit(bound, in_shardings=in_shardings, out_shardings=_output_shardings(out_shape, mesh))
  return fn


def _mesh_context(mesh: Mesh):
  return jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else mesh


def sharded_speculative(mesh: Mesh, target_params, drafter_params, keys_B, tokens_BxP, prompt_len_B, **static):
  """Run the speculative loop with parameters, caches and rows laid out on ``mesh``; same tokens as one device.

  ``static``: the keyword settings of ``generate_speculative`` (target, drafter, gamma, max_new_tokens, verifier,
  sampler, stop_ids, pad_id). The compiled program is cached per (settings, mesh, shapes): a second call with the
  same shapes does not recompile.
  """
  spec.check_prompt_values(tokens_BxP, prompt_len_B, as_scorer(static["target"]).vocab_size)
  with _mesh_context(mesh):
    fn = _compiled(spec.speculative_program, static, mesh, (target_params, drafter_params),
                   (keys_B, tokens_BxP, prompt_len_B))
    return fn(target_params, drafter_params, keys_B, tokens_BxP, prompt_len_B)


def sharded_autoregressive(mesh: Mesh, target_params, keys_B, tokens_BxP, prompt_len_B, **static):
  """The autoregressive baseline on ``mesh`` (see :func:`sharded_speculative`)."""
  spec.check_prompt_values(tokens_BxP, prompt_len_B, as_scorer(static["target"]).vocab_size)
  with _mesh_context(mesh):
    fn = _compiled(spec.autoregressive_program, static, mesh, (target_params,), (keys_B, tokens_BxP, prompt_len_B))
    return fn(target_params, keys_B, tokens_BxP, prompt_len_B)
