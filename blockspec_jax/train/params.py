"""Which parameters train: a trainable / frozen split of a parameter tree, and LoRA adapters.

    trainable, frozen = partition(params, layers_trainable([1]))   # nested dicts holding complementary leaves
    params = merge(trainable, frozen)                              # the full tree again

A *path* is the tuple of dict keys from the root to a leaf, e.g. ``("layers_0", "attn", "q", "weight")`` in the
decoder's tree (``blockspec_jax.models.decoder``). ``partition`` prunes: the trainable tree holds only trainable
leaves (and no empty dicts), so an optimizer initialised on it has no state for frozen parameters at all.

LoRA (Hu et al. 2022) on the decoder's (out, in) linear weights::

    lora = init_lora(params, rank=4, key=key, targets=("q", "v"), alpha=8.0)   # Lora(adapters, scale)
    adapted = apply_lora(params, lora)       # W_OxI + scale · B_Oxr @ A_rxI on every targeted weight

``A`` is Gaussian (std 1/√in), ``B`` is zero, so at initialisation the adapted model *is* the base model exactly.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax.checks import check_int
from blockspec_jax.models import quant

__all__ = ["partition", "merge", "leaf_paths", "all_trainable", "layers_trainable", "names_trainable", "Lora",
           "LORA_TARGETS", "init_lora", "apply_lora", "count_params"]

Path = tuple[str, ...]
Predicate = Callable[[Path], bool]

#: The decoder's linear layers (``layers_{i}/attn/{q,k,v,o}`` and ``layers_{i}/mlp/{gate,up,down}``).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _check_tree(params, what: str) -> None:
  if not isinstance(params, Mapping):
    raise TypeError(f"{what} must be a nested dict of arrays (a Flax parameter tree), got {type(params).__name__}")


def _split(tree: Mapping, predicate: Predicate, prefix: Path) -> tuple[dict, dict]:
  keep, rest = {}, {}
  for name, value in tree.items():
    path = prefix + (str(name),)
    if isinstance(value, Mapping):
      k, r = _split(value, predicate, path)
      if k:
        keep[name] = k
      if r:
        rest[name] = r
    elif predicate(path):
      keep[name] = value
    else:
      rest[name] = value
  return keep, rest


def partition(params: Mapping, trainable: Predicate) -> tuple[dict, dict]:
  """``(trainable_tree, frozen_tree)``: the leaves whose path satisfies ``trainable`` and the others, each a pruned
  nested dict (a subtree with no leaf of its kind is left out). ``merge`` inverts it."""
  _check_tree(params, "params")
  return _split(params, trainable, ())


def merge(trainable: Mapping, frozen: Mapping) -> dict:
  """The union of two disjoint nested dicts (the inverse of :func:`partition`); ValueError on a path in both."""
  _check_tree(trainable, "trainable")
  _check_tree(frozen, "frozen")
  out = dict(frozen)
  for name, value in trainable.items():
    if name not in out:
      out[name] = value
    elif isinstance(value, Mapping) and isinstance(out[name], Mapping):
      out[name] = merge(value, out[name])
    else:
      raise ValueError(f"merge: {name!r} is in both the trainable and the frozen tree")
  return out


def leaf_paths(params: Mapping, prefix: Path = ()) -> list[Path]:
  """Every leaf's path, in dict order."""
  paths = []
  for name, value in params.items():
    path = prefix + (str(name),)
    paths.extend(leaf_paths(value, path) if isinstance(value, Mapping) else [path])
  return paths


def all_trainable(path: Path) -> bool:
  """Every parameter trains (full fine-tuning)."""
  del path
  return True


def layers_trainable(layer_indices: Iterable[int], *, extra: Iterable[str] = ()) -> Predicate:
  """Predicate: the parameters of decoder layers ``layers_{i}`` for ``i`` in ``layer_indices`` train, plus the
  top-level modules named in ``extra`` (e.g. ``("final_norm", "lm_head")``); everything else is frozen."""
  names = frozenset(f"layers_{int(i)}" for i in layer_indices) | frozenset(extra)

  def predicate(path: Path) -> bool:
    return bool(path) and path[0] in names

  return predicate


def names_trainable(*names: str) -> Predicate:
  """Predicate: a parameter trains when any component of its path is one of ``names`` (e.g. ``"lm_head"``,
  ``"mlp"``, ``"attn_norm"``)."""
  wanted = frozenset(names)
  return lambda path: any(part in wanted for part in path)


def count_params(tree) -> int:
  """Number of scalars in a pytree of arrays."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


@struct.dataclass
class Lora:
  """LoRA adapters: ``adapters`` mirrors the parameter tree down to each targeted linear module, holding
  ``{"a": A_rxI, "b": B_Oxr}``; ``scale`` = alpha / rank is static (not trained, not in the optimizer state)."""
  adapters: dict
  scale: float = struct.field(pytree_node=False, default=1.0)


def _lora_modules(params: Mapping, targets: frozenset, prefix: Path = ()) -> list[Path]:
  """Paths of the modules named in ``targets`` that hold a 2-D ``weight`` (a linear layer)."""
  found = []
  for name, value in params.items():
    if not isinstance(value, Mapping):
      continue
    path = prefix + (str(name),)
    weight = value.get("weight")
    if str(name) in targets and weight is not None and not isinstance(weight, Mapping) and len(weight.shape) == 2:
      found.append(path)
    else:
      found.extend(_lora_modules(value, targets, path))
  return found


def _get(tree: Mapping, path: Path):
  for name in path:
    tree = tree[name]
  return tree


def _set(tree: dict, path: Path, value) -> None:
  for name in path[:-1]:
    tree = tree.setdefault(name, {})
  tree[path[-1]] = value


def init_lora(params: Mapping, rank: int, key: jax.Array, targets: Iterable[str] = ("q", "k", "v", "o"),
              alpha: float | None = None) -> Lora:
  """Adapters of rank ``rank`` on every linear module named in ``targets`` (see :data:`LORA_TARGETS`).

  For a weight ``W_OxI`` (out, in): ``A_rxI ~ N(0, 1/I)``, ``B_Oxr = 0``; ``scale = alpha / rank`` (alpha defaults
  to ``rank``: scale 1). Raises ValueError for a rank < 1 or when no module matches ``targets``.
  """
  _check_tree(params, "params")
  rank = check_int(rank, "LoRA rank")
  targets = frozenset(targets)
  modules = _lora_modules(params, targets)
  if not modules:
    raise ValueError(f"no linear module named {sorted(targets)} in the parameter tree; the decoder's are "
                     f"{', '.join(LORA_TARGETS)}")
  alpha = float(rank if alpha is None else alpha)
  adapters: dict = {}
  keys = jax.random.split(key, len(modules))
  for path, k in zip(modules, keys):
    out_dim, in_dim = _get(params, path)["weight"].shape
    a_rxI = jax.random.normal(k, (rank, in_dim), jnp.float32) / math.sqrt(in_dim)
    b_Oxr = jnp.zeros((out_dim, rank), jnp.float32)
    _set(adapters, path, {"a": a_rxI, "b": b_Oxr})
  return Lora(adapters=adapters, scale=alpha / rank)


def apply_lora(params: Mapping, lora: Lora) -> dict:
  """``params`` with every adapted weight replaced by ``W_OxI + scale · B_Oxr @ A_rxI`` (a new tree; the
  rest is shared). Pure and differentiable in ``lora``.

  A quantized base weight (``hub.load_model(weights="quantized")``: GGUF blocks, which a float update cannot be
  added to without giving up their bytes) keeps its blocks, and the adapter goes beside it in the same module:
  ``lora_a`` = ``A_rxI`` and ``lora_b`` = ``scale · B_Oxr``, which the decoder's ``Linear`` applies as
  ``x @ W.T + (x @ A.T) @ (scale · B).T``. The same function as the merged weight; the float32 roundings differ
  (the drafter only proposes, so the verified output's law does not depend on them)."""
  _check_tree(params, "params")

  def walk(tree: Mapping, adapters: Mapping, path: Path) -> dict:
    out = dict(tree)
    for name, sub in adapters.items():
      if name not in tree:
        raise ValueError(f"LoRA adapter at {'/'.join(path + (str(name),))} has no parameter to adapt")
      if "a" in sub and "b" in sub and not isinstance(sub["a"], Mapping):
        module = dict(tree[name])
        weight_OxI = module["weight"]
        if isinstance(weight_OxI, quant.QuantizedTensor):
          module["lora_a"], module["lora_b"] = sub["a"], lora.scale * sub["b"]
        else:
          delta_OxI = lora.scale * (sub["b"] @ sub["a"])
          module["weight"] = (weight_OxI + delta_OxI.astype(weight_OxI.dtype))
        out[name] = module
      else:
        out[name] = walk(tree[name], sub, path + (str(name),))
    return out

  return walk(params, lora.adapters, ())
