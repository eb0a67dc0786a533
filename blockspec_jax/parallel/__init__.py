"""Meshes, sharding rules and the sharded decode loops (``jax.jit`` with ``NamedSharding``: the modern pjit).

Mesh axes: ``data`` (batch rows) and ``model`` (weights and KV heads). Rules:

* batch-leading arrays (tokens, lengths, keys, outputs, per-row metrics): ``P("data")``;
* weights ((out, in) linear weights): q/k/v and MLP gate/up split their output features over ``model``, o/down their
  input features, the embedding and LM head the vocabulary; norms and biases of unsplit dims are replicated. A
  dimension that ``model`` does not divide is replicated (so any config runs on any mesh);
* KV cache ``[L, B, S, K, H]``: ``P(None, "data", None, "model", None)`` when ``model`` divides K.

Because each row's randomness is ``fold_in(row_key, iteration)``, a sharded run emits the same tokens as one device.

Multi-host (TPU pods, GPU clusters, or several processes on one machine): call :func:`initialize_multihost` first
in every process (it wraps ``jax.distributed.initialize()``, which reads the coordinator from the TPU environment,
or takes ``coordinator_address``, ``num_processes`` and ``process_id`` explicitly; CPU devices talk through gloo);
then build the mesh from ``jax.devices()`` (every process's devices). A process can put on the mesh only the parts
its own devices hold, so :func:`shard_params` and :func:`shard_batch` build global arrays from the values each
process holds (the same parameters everywhere; the same full batch everywhere, or with ``process_local=True`` each
process's own rows); the loops check the prompt rows each process holds, and :func:`gather` reads a global output
on every process (``multihost_utils.process_allgather``). On one process these are today's ``jax.device_put`` and
``np.asarray``, bit for bit. ``tests/test_multihost.py`` runs the loops in 2 processes joined on 127.0.0.1.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from blockspec_jax.decoding import speculative as spec
from blockspec_jax.models.scorer import as_scorer

__all__ = ["DATA", "MODEL", "make_mesh", "check_mesh_shape", "parse_mesh_shape", "job_mesh", "initialize_multihost",
           "param_spec", "param_specs", "param_shardings", "shard_params", "shard_model", "shard_models",
           "batch_sharding", "put_global", "replicate", "layout_rows", "shard_batch", "gather", "cache_sharding",
           "sharded_speculative", "sharded_autoregressive", "autoregressive_rows", "map_rows", "pad_rows",
           "take_rows"]

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


def check_mesh_shape(shape, name: str = "mesh") -> tuple[int, int]:
  """``(data, model)`` of a job's mesh: ``shape`` (two positive integers whose product is the run's device count) or,
  for None, ``(devices, 1)``; a ``UsageError`` naming ``name`` and the problem otherwise. Touches the JAX backend (a
  multi-host run must have joined before)."""
  from blockspec_jax.checks import UsageError
  devices = jax.device_count()
  if shape is None:
    return (devices, 1)
  if (isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or len(shape) != 2
      or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
    raise UsageError(f"{name} must be (data, model), two positive integers, got {shape!r}")
  data, model = shape
  if data * model != devices:
    raise UsageError(f"{name} {data} x {model} (data x model) must cover the run's {devices} device(s): data × model "
                     f"= {devices}")
  return (data, model)


def parse_mesh_shape(text: str | None, option: str = "--mesh") -> tuple[int, int]:
  """A command line's ``DATAxMODEL`` (``"4x2"``; None: every device over ``data``) checked by
  :func:`check_mesh_shape`."""
  from blockspec_jax.checks import UsageError
  if text is None:
    return check_mesh_shape(None, option)
  parts = str(text).lower().replace("×", "x").split("x")
  if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
    raise UsageError(f"{option} takes DATAxMODEL (e.g. 4x2), got {text!r}")
  return check_mesh_shape(tuple(int(p) for p in parts), option)


def job_mesh(shape: tuple[int, int]) -> Mesh | None:
  """The mesh of a checked ``(data, model)`` shape (:func:`check_mesh_shape`), or None on one device (the one-device
  programs, as without a mesh)."""
  return make_mesh(*shape) if jax.device_count() > 1 else None


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


_DECODER_TOP = ("embed", "layers", "final_norm", "lm_head")


def param_specs(tree, mesh: Mesh):
  """Partition specs of a model's parameters, or of any pytree that holds them somewhere inside (a drafter's
  ``{"model": …, "heads": …}``, a training job's frozen inputs ``{"target": params, "drafter": part of params}``): a
  leaf whose path passes through a decoder's top-level name (``embed``, ``layers``, ``layers_<i>``, ``final_norm``,
  ``lm_head``) is laid out by :func:`param_spec` from that name on; every other leaf (and a lone ``lm_head`` table,
  which is not a ``.../weight``) is replicated."""
  def spec(path, x):
    names = _path_names(path)
    for i, name in enumerate(names):
      if name in _DECODER_TOP or name.startswith("layers_"):
        return param_spec(names[i:], tuple(np.shape(x)), mesh)
    return P()
  return jax.tree_util.tree_map_with_path(spec, tree)


def param_shardings(params, mesh: Mesh):
  """:func:`param_specs` as ``NamedSharding`` on ``mesh``."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, mesh),
                      is_leaf=lambda x: isinstance(x, P))


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def put_global(x, sharding: NamedSharding):
  """``jax.device_put(x, sharding)`` for a multi-host run: a value every process holds in full (the same on each)
  as a global array on ``sharding``. One process addressing every device: ``jax.device_put``. Otherwise a
  ``device_put`` onto other processes' devices is refused, so each process places only the slices its own devices
  hold (``jax.make_array_from_callback``); typed PRNG keys travel as their ``key_data``."""
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x  # already there (e.g. parameters placed when the job loaded them)
  if _is_key(x):
    return jax.random.wrap_key_data(put_global(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _put_process_local(x, sharding: NamedSharding):
  """This process's rows of a batch-leading array (every process the same number, in process order) as the
  global array of all processes' rows on ``sharding``."""
  if _is_key(x):
    data = _put_process_local(jax.random.key_data(x), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def replicate(tree, mesh: Mesh):
  """Every leaf of ``tree`` (the same value on every process: sampling keys, small tables) whole on every device of
  ``mesh`` (:func:`put_global` on a replicated sharding)."""
  return jax.tree.map(lambda x: put_global(x, NamedSharding(mesh, P())), tree)


def layout_rows(mesh: Mesh | None, param_trees: tuple, shared):
  """``(mesh, param_trees, shared, rows)`` for a measurement that splits its rows over ``data``: on a ``mesh`` of
  several devices each tree of ``param_trees`` laid out by :func:`shard_params`, ``shared`` (keys every row reads)
  replicated (:func:`replicate`), ``rows`` the ``data`` axis size a batch is padded to; else
  ``(None, param_trees, shared, 1)``: one device, nothing moved."""
  if mesh is None or mesh.size == 1:
    return None, param_trees, shared, 1
  return mesh, tuple(shard_params(p, mesh) for p in param_trees), replicate(shared, mesh), mesh.shape[DATA]


def shard_params(params, mesh: Mesh):
  """The parameters (a model's, or any tree holding them: :func:`param_specs`) on ``mesh`` (every process passes the
  same parameters)."""
  return jax.tree.map(put_global, params, param_shardings(params, mesh))


def shard_model(model, mesh: Mesh):
  """A loaded model (``models.hub.LoadedModel``: ``params = {"params": tree}``) with its parameters on ``mesh``."""
  import dataclasses
  params = dict(model.params, params=shard_params(model.params["params"], mesh))
  return dataclasses.replace(model, params=params)


def shard_models(models, mesh: Mesh) -> list:
  """:func:`shard_model` of each of ``models``; a model given twice (one drafting for itself) is placed once and
  comes back as one object, so its parameters stay one copy on the devices."""
  placed = {}
  for model in models:
    if id(model) not in placed:
      placed[id(model)] = shard_model(model, mesh)
  return [placed[id(model)] for model in models]


def batch_sharding(mesh: Mesh, batch: int) -> NamedSharding:
  if batch % mesh.shape[DATA]:
    raise ValueError(f"batch size {batch} must be a multiple of the data axis size {mesh.shape[DATA]}")
  return NamedSharding(mesh, P(DATA))


def shard_batch(mesh: Mesh, *arrays, process_local: bool = False):
  """Put batch-leading arrays (keys, tokens, lengths) on the mesh, rows split over ``data``.

  ``process_local=False``: every process passes the same global batch (each places the rows its devices hold).
  ``process_local=True``: each process passes only its own rows, the same number in every process; the global batch
  is process 0's rows, then process 1's, and so on (``jax.make_array_from_process_local_data``). On one process both
  are the same.
  """
  count = jax.process_count() if process_local else 1
  out = []
  for a in arrays:
    sharding = batch_sharding(mesh, a.shape[0] * count)
    out.append(_put_process_local(a, sharding) if process_local and count > 1 else put_global(a, sharding))
  return tuple(out)


def gather(tree):
  """Every leaf of ``tree`` as a numpy array of its global value, on every process (a collective: all processes
  call it): ``np.asarray`` where this process holds the whole value, else
  ``multihost_utils.process_allgather``."""
  from jax.experimental import multihost_utils

  def read(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(read, tree)


def _check_prompts(tokens_BxP, prompt_len_B, target) -> None:
  """The loops' prompt value checks (on the rows this process holds, for a global array)."""
  spec.check_prompt_values(tokens_BxP, prompt_len_B, as_scorer(target).vocab_size)


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
  _check_prompts(tokens_BxP, prompt_len_B, static["target"])
  with _mesh_context(mesh):
    fn = _compiled(spec.speculative_program, static, mesh, (target_params, drafter_params),
                   (keys_B, tokens_BxP, prompt_len_B))
    return fn(target_params, drafter_params, keys_B, tokens_BxP, prompt_len_B)


def sharded_autoregressive(mesh: Mesh, target_params, keys_B, tokens_BxP, prompt_len_B, **static):
  """The autoregressive baseline on ``mesh`` (see :func:`sharded_speculative`)."""
  _check_prompts(tokens_BxP, prompt_len_B, static["target"])
  with _mesh_context(mesh):
    fn = _compiled(spec.autoregressive_program, static, mesh, (target_params,), (keys_B, tokens_BxP, prompt_len_B))
    return fn(target_params, keys_B, tokens_BxP, prompt_len_B)


def _padded_batch(mesh: Mesh, arrays) -> tuple[int, tuple]:
  """``(B, arrays on the mesh)``: batch-leading ``arrays`` (numpy, or jax such as typed keys) of ``B`` rows padded
  to a multiple of the ``data`` axis by repeating the last row (:func:`pad_rows`), rows over ``data``."""
  rows = int(np.shape(arrays[0])[0])
  index = pad_rows(np.arange(rows), rows + -rows % mesh.shape[DATA])
  return rows, shard_batch(mesh, *(a[index] if isinstance(a, jax.Array) else np.asarray(a)[index] for a in arrays))


def autoregressive_rows(mesh: Mesh | None, target_params, keys_B, tokens_BxP, prompt_len_B, **static):
  """``generate_autoregressive`` over any number of rows on ``mesh``, read back as numpy (a ``DecodeOutput`` of the
  ``B`` rows given, on every process): the rows padded to a multiple of the ``data`` axis by repeating the last one,
  decoded by :func:`sharded_autoregressive`, gathered, and the padding cut before anything is returned. Row ``b``
  samples from ``keys_B[b]`` whatever the layout. ``mesh`` None or of one device: the one-device loop."""
  if mesh is None or mesh.size == 1:
    out = spec.generate_autoregressive(target_params, keys_B, tokens_BxP, prompt_len_B, **static)
    return gather(out)
  rows, batch = _padded_batch(mesh, (keys_B, tokens_BxP, prompt_len_B))
  out = gather(sharded_autoregressive(mesh, shard_params(target_params, mesh), *batch, **static))
  return take_rows(out, rows)


def map_rows(mesh: Mesh | None, fn, param_trees: tuple, *arrays):
  """``fn(*param_trees, *arrays)`` read back as numpy on every process, for a jitted ``fn`` whose outputs are
  row-wise in the leading axis of ``arrays`` (a forward pass over a batch): on ``mesh`` the rows padded to a multiple
  of ``data`` (:func:`pad_rows`) and split over it, each tree of ``param_trees`` laid out by :func:`shard_params`
  (a no-op for one placed already), the padding cut from the outputs (:func:`take_rows`). ``mesh`` None or of one
  device: ``fn`` as it is. Each row's outputs are one device's up to float rounding (``model`` > 1 splits sums)."""
  if mesh is None or mesh.size == 1:
    return gather(fn(*param_trees, *arrays))
  rows, batch = _padded_batch(mesh, arrays)
  return take_rows(gather(fn(*(shard_params(p, mesh) for p in param_trees), *batch)), rows)


def pad_rows(index, size: int) -> np.ndarray:
  """int64 [size]: the row indices ``index`` (at least one, at most ``size``) padded to ``size`` by repeating the last
  one: how a batch fills every ``data`` shard (the padded rows are computed, then cut with :func:`take_rows`)."""
  index = np.asarray(index, np.int64)
  if not 1 <= len(index) <= size:
    raise ValueError(f"pad_rows needs 1 to {size} rows, got {len(index)}")
  return np.concatenate([index, np.full(size - len(index), index[-1], np.int64)])


def take_rows(tree, rows: int):
  """``tree`` (arrays with a leading row axis, read back as numpy; a struct dataclass such as a ``DecodeOutput``
  too) cut to its first ``rows`` rows: the padding of :func:`pad_rows` dropped. Scalars (a ``DecodeOutput``'s
  ``iterations``) are kept as they are."""
  return jax.tree.map(lambda x: np.asarray(x)[:rows] if np.ndim(x) else np.asarray(x), tree)
