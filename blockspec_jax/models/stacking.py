"""The two parameter layouts of a decoder: unrolled (``layers_{i}/...``, one subtree per layer) and stacked
(``layers/...``, every leaf ``[L, ...]``, what a ``scan_layers`` decoder reads), and the moves between them.
Quantized weights (:class:`~blockspec_jax.models.quant.QuantizedTensor`) stack their arrays when every layer stores
the same block type. :mod:`blockspec_jax.models.decoder` re-exports both functions."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax.models import quant

__all__ = ["stack_layers", "unstack_layers", "UnstackableLayers"]


def stack_layers(params: dict, num_layers: int, consume: bool = False) -> dict:
  """The unrolled layout (``layers_{i}/...``) → the stacked one (``layers/...``, each leaf ``[L, ...]``) that a
  ``scan_layers`` decoder reads; other entries are kept. ``consume``: pop each layer's leaves from ``params`` (a
  mutable dict) as they are stacked, so a large model is never held twice (at most one group of leaves extra)."""
  names = [f"layers_{i}" for i in range(num_layers)]
  missing = [n for n in names if n not in params]
  if missing or "layers" in params:
    raise ValueError(f"stack_layers: expected layers_0..layers_{num_layers - 1} and no 'layers' entry; missing "
                     f"{missing[:3]}{' and more' if len(missing) > 3 else ''}")
  source = params if consume else {n: params[n] for n in names}
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(source[names[0]], is_leaf=_is_quantized)[0]]
  stacked = {}
  for path in paths:
    keys = [k.key for k in path]
    leaves = []
    for n in names:
      node = source[n]
      for k in keys[:-1]:
        node = node[k]
      leaves.append(node.pop(keys[-1]) if consume else node[keys[-1]])
    node = stacked
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = _stack(leaves, "/".join(keys))
    del leaves
  out = {k: v for k, v in params.items() if k not in names}
  if consume:
    for n in names:
      params.pop(n)
  out["layers"] = stacked
  return out


def _is_quantized(x) -> bool:
  return isinstance(x, quant.QuantizedTensor)


class UnstackableLayers(ValueError):
  """The layers store one weight in different quantized block types: a layout question, not a damaged file (a cache
  holding such a model is kept; ``hub.load_model`` raises this instead of converting again)."""


def _stack(leaves: list, where: str):
  """One ``[L, ...]`` leaf of the layers' ``leaves``: host arrays stay on the host until put. Quantized weights
  stack their codes and scales (the logical shape stays one layer's) when every layer stores the same block type;
  a GGUF that mixes types across layers (Q4_K_M files keep some layers' ``attn_v`` / ``ffn_down`` in Q6_K) cannot
  be stacked: :class:`UnstackableLayers` (a ValueError) names the types, and such a model runs in the unrolled
  layout."""
  if any(_is_quantized(leaf) for leaf in leaves):
    counts = collections.Counter((leaf.qtype, tuple(leaf.shape)) if _is_quantized(leaf)
                                 else ("float", tuple(np.shape(leaf))) for leaf in leaves)
    if len(counts) != 1:
      raise UnstackableLayers(f"stack_layers: {where} is stored as " + ", ".join(
          f"{t} {shape} in {n} layers" for (t, shape), n in sorted(counts.items())) + "; quantized weights of "
          "different block types cannot share one stack: load this model in the unrolled layout "
          "(scan_layers=False)")
    return jax.tree.map(lambda *arrays: _stack(list(arrays), where), *leaves)
  host = all(isinstance(leaf, np.ndarray) for leaf in leaves)
  return np.stack(leaves) if host else jnp.stack(leaves)


def unstack_layers(params: dict) -> dict:
  """The stacked layout (``layers/...`` [L, ...]) → the unrolled one (``layers_{i}/...``); other entries kept."""
  if "layers" not in params:
    raise ValueError("unstack_layers: no stacked 'layers' entry")
  stacked = params["layers"]
  num_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
  out = {k: v for k, v in params.items() if k != "layers"}
  for i in range(num_layers):
    out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
  return out
