"""Trees of a tabular drafter, as the tree rules' exact laws (:mod:`blockspec_jax.theory.trees`) see them: the
layout checks (``parents_N``), and every tree of one shape drawn with or without replacement, enumerated with its
probability (:func:`enumerate_trees`) or sampled (:func:`sample_trees`), with the drafter's and the target's rows
at every node; or, for :data:`POINT_MASS`, the one deterministic tree of the drafter's top tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from blockspec_jax.theory.exact import _check_models  # one check of a tabular pair
from blockspec_jax.theory.tabular import TabularLM

__all__ = ["WITH_REPLACEMENT", "WITHOUT_REPLACEMENT", "POINT_MASS", "MAX_ENUMERATED_TREES", "check_parents",
           "branching_parents",
           "tree_depths", "TreeDraws", "enumerate_trees", "sample_trees"]

WITH_REPLACEMENT = "with_replacement"
WITHOUT_REPLACEMENT = "without_replacement"
#: No draw: every sibling group is the top tokens of its row (the first sibling the most probable, ties to the lower
#: id), one tree per context with probability 1 (the tabular stand-in for a deterministic tree drafter).
POINT_MASS = "point_mass"
_SAMPLINGS = (WITH_REPLACEMENT, WITHOUT_REPLACEMENT, POINT_MASS)

#: Largest ``V**N`` (token assignments of one shape) that :func:`enumerate_trees` accepts.
MAX_ENUMERATED_TREES = 2**18


def _check_sampling(sampling: str) -> str:
  if sampling not in _SAMPLINGS:
    raise ValueError(f"sampling must be one of {', '.join(map(repr, _SAMPLINGS))}, got {sampling!r}")
  return sampling


def _check_epsilon(epsilon) -> float:
  epsilon = float(epsilon)
  if not 0.0 <= epsilon < 1.0:
    raise ValueError(f"epsilon must be in [0, 1), got {epsilon!r}")
  return epsilon


def check_parents(parents_N) -> tuple[int, ...]:
  """``parents_N`` (ints ``[N]``, N ≥ 1) as a tuple after checking the tree layout, else ``ValueError``.

  Required: ``−1 ≤ parents[n] < n`` (topological order, −1 = the root) and the children of each node consecutive
  (stored together, in draw order) — the layout of ``verify.tree.check_tree``.
  """
  array = np.asarray(parents_N)
  if array.ndim != 1 or array.shape[0] < 1:
    raise ValueError(f"parents must be a non-empty 1-D sequence of ints [N], got shape {array.shape}")
  if not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"parents must be integers, got dtype {array.dtype}")
  parents = tuple(int(u) for u in array)
  seen = set()
  for n, u in enumerate(parents):
    if not -1 <= u < n:
      raise ValueError(f"parents must satisfy -1 <= parents[n] < n (topological order, -1 = root); "
                       f"parents[{n}] = {u}")
    if n > 0 and u != parents[n - 1] and u in seen:
      raise ValueError(f"the children of node {u} are not consecutive (node {n} follows another node's children): "
                       f"siblings must be stored together, in draw order")
    seen.add(u)
  return parents


def branching_parents(branching: Sequence[int]) -> np.ndarray:
  """Parents (int32 ``[N]``) of the full tree with ``branching[d]`` children per node at depth ``d``, level order.

  Nodes depth-major, each depth grouped by parent in parent order: the layout of the tree drafters. Examples:
  ``(1,)*γ`` a chain of γ nodes, ``(k,) + (1,)*(γ−1)`` k chains of depth γ (k-chains /
  RSD-C shape), ``(2, 2)`` a binary tree of depth 2 (N = 6).
  """
  widths = tuple(branching)
  if not widths or any(isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or b < 1
                       for b in widths):
    raise ValueError(f"branching must be a non-empty sequence of integers >= 1, got {branching!r}")
  parents, level = [], [-1]
  for width in widths:
    next_level = []
    for u in level:
      for _ in range(int(width)):
        parents.append(u)
        next_level.append(len(parents) - 1)
    level = next_level
  return np.asarray(parents, dtype=np.int32)


def tree_depths(parents_N) -> np.ndarray:
  """Depth of every node (a root child has depth 1): int64 ``[N]``."""
  parents = check_parents(parents_N)
  depth = []
  for u in parents:
    depth.append(1 if u < 0 else depth[u] + 1)
  return np.asarray(depth, dtype=np.int64)


def _children(parents: tuple[int, ...]) -> dict[int, list[int]]:
  """``{u: [children of u in order]}`` for u = −1 (root) and every node."""
  children = {u: [] for u in range(-1, len(parents))}
  for n, u in enumerate(parents):
    children[u].append(n)
  return children


def _path_nodes(parents: tuple[int, ...], n: int) -> list[int]:
  """The nodes from the root's child down to ``n`` (``[]`` for the root, n = −1)."""
  path = []
  while n != -1:
    path.append(n)
    n = parents[n]
  return path[::-1]


# --- drawing trees -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TreeDraws:
  """Every tree of one shape drawn after one context, with its probability (trees of probability 0 left out).

  Attributes:
    parents: the shape, a tuple ``[N]``.
    tokens_TxN: int64 ``[T, N]``, the token of every node.
    weights_T: float64 ``[T]``, the probability of drawing that (ordered) tree; sums to 1.
    draft_probs_TxNxV: float64 ``[T, N, V]``, row n = the drafter row at n's parent context (smoothed by ``ε``).
    target_probs_TxN1xV: float64 ``[T, N+1, V]``, row 0 = the target at the root, row n + 1 = after node n.
  """
  parents: tuple[int, ...]
  tokens_TxN: np.ndarray
  weights_T: np.ndarray
  draft_probs_TxNxV: np.ndarray
  target_probs_TxN1xV: np.ndarray


def _rows(model: TabularLM, prefix_TxL: np.ndarray) -> np.ndarray:
  """``model``'s rows after each prefix (all of one length, context included): float64 ``[T, V]``."""
  vocab, length = model.vocab_size, prefix_TxL.shape[1]
  m = min(length, model.depth)
  index_T = np.full(prefix_TxL.shape[0], sum(vocab**l for l in range(m)), dtype=np.int64)
  for j in range(m):
    index_T += prefix_TxL[:, length - m + j] * vocab**(m - 1 - j)
  return model.probs[index_T]


def _smoothed(q_xV: np.ndarray, epsilon: float) -> np.ndarray:
  return q_xV if epsilon == 0.0 else (1.0 - epsilon) * q_xV + epsilon / q_xV.shape[-1]


def _tree_rows(drafter, target, context, parents, tokens_TxN, epsilon):
  """Drafter rows at every node's parent context ``[T, N, V]`` and target rows ``[T, N+1, V]``."""
  num_trees, num_nodes = tokens_TxN.shape
  context_TxC = np.broadcast_to(np.asarray(context, np.int64), (num_trees, len(context)))
  prefix = {-1: context_TxC}
  for n in range(num_nodes):
    prefix[n] = np.concatenate([prefix[parents[n]], tokens_TxN[:, n:n + 1]], axis=1)
  draft_TxNxV = np.stack([_smoothed(_rows(drafter, prefix[u]), epsilon) for u in parents], axis=1)
  target_TxN1xV = np.stack([_rows(target, prefix[u]) for u in range(-1, num_nodes)], axis=1)
  return draft_TxNxV, target_TxN1xV


def _draw_weights(parents, tokens_TxN, draft_TxNxV, sampling) -> np.ndarray:
  """Probability of drawing each ordered tree (module docstring): float64 ``[T]``; ``ValueError`` when a reachable
  sibling group asks for more distinct tokens than its row has tokens of positive probability."""
  num_trees, num_nodes = tokens_TxN.shape
  vocab = draft_TxNxV.shape[2]
  trees_T = np.arange(num_trees)
  weights_T = np.ones(num_trees, dtype=np.float64)
  for n in range(num_nodes):
    q_TxV = draft_TxNxV[:, n]
    x_T = tokens_TxN[:, n]
    if sampling == WITH_REPLACEMENT:
      weights_T = weights_T * q_TxV[trees_T, x_T]
      continue
    earlier = [s for s in range(n) if parents[s] == parents[n]]
    taken_TxV = np.zeros((num_trees, vocab), dtype=bool)
    for s in earlier:
      taken_TxV[trees_T, tokens_TxN[:, s]] = True
    remaining_T = np.where(taken_TxV, 0.0, q_TxV).sum(axis=1)
    stuck_T = (weights_T > 0) & ~(remaining_T > 0)
    if np.any(stuck_T):
      t = int(np.argmax(stuck_T))
      raise ValueError(
          f"drawing without replacement: node {n} is sibling number {len(earlier) + 1} of its group but its row has "
          f"only {int(np.count_nonzero(q_TxV[t] > 0))} tokens of positive drafter probability (e.g. tree "
          f"{tokens_TxN[t, :n].tolist()}...); use a shape with fewer siblings or smooth the drafter with "
          f"epsilon > 0 as the without-replacement drafters do")
    q_x_T = np.where(taken_TxV[trees_T, x_T], 0.0, q_TxV[trees_T, x_T])
    weights_T = weights_T * np.divide(q_x_T, remaining_T, out=np.zeros(num_trees), where=remaining_T > 0)
  return weights_T


def enumerate_trees(drafter: TabularLM, target: TabularLM, context: Sequence[int], parents_N, sampling: str,
                    epsilon: float = 0.0) -> TreeDraws:
  """Every tree of shape ``parents_N`` after ``context`` with its draw probability (module docstring).

  ``sampling``: ``"with_replacement"`` or ``"without_replacement"``; ``epsilon``: the drafter rows are
  ``(1 − ε) q + ε/V`` (the without-replacement drafters' smoothing; 0: as they are). ``ValueError`` when ``V**N``
  exceeds :data:`MAX_ENUMERATED_TREES`.
  """
  context = _check_models(drafter, target, context)
  parents = check_parents(parents_N)
  sampling = _check_sampling(sampling)
  epsilon = _check_epsilon(epsilon)
  vocab, num_nodes = target.vocab_size, len(parents)
  if sampling == POINT_MASS:  # no draw: one tree
    return _point_mass_tree(drafter, target, context, parents, epsilon, 1)
  if vocab**num_nodes > MAX_ENUMERATED_TREES:
    raise ValueError(f"V**N = {vocab}**{num_nodes} = {vocab**num_nodes} trees is too many to enumerate (at most "
                     f"{MAX_ENUMERATED_TREES}); use a smaller vocabulary or fewer nodes")
  largest_group = max(len(kids) for kids in _children(parents).values())
  if sampling == WITHOUT_REPLACEMENT and largest_group > vocab:
    raise ValueError(f"drawing without replacement: a node has {largest_group} children but there are only V = "
                     f"{vocab} tokens")
  tokens_TxN = np.indices((vocab,) * num_nodes).reshape(num_nodes, -1).T.astype(np.int64)
  if sampling == WITHOUT_REPLACEMENT:  # repeated siblings have probability 0: leave them out early
    distinct_T = np.ones(tokens_TxN.shape[0], dtype=bool)
    for n in range(num_nodes):
      for s in range(n):
        if parents[s] == parents[n]:
          distinct_T &= tokens_TxN[:, s] != tokens_TxN[:, n]
    tokens_TxN = tokens_TxN[distinct_T]
  draft_TxNxV, target_TxN1xV = _tree_rows(drafter, target, context, parents, tokens_TxN, epsilon)
  weights_T = _draw_weights(parents, tokens_TxN, draft_TxNxV, sampling)
  keep_T = weights_T > 0
  return TreeDraws(parents, tokens_TxN[keep_T], weights_T[keep_T], draft_TxNxV[keep_T], target_TxN1xV[keep_T])


def _point_mass_tree(drafter, target, context, parents, epsilon, copies: int) -> TreeDraws:
  """The one :data:`POINT_MASS` tree after ``context`` (``copies`` rows of it, weight ``1/copies`` each): sibling
  number ``r`` of a group is the ``r``-th most probable token of its row (stable: ties to the lower id); a group
  larger than ``V`` is a ``ValueError``. Its draft rows are the point masses ``one_hot(token)``."""
  num_nodes, vocab = len(parents), target.vocab_size
  largest_group = max(len(kids) for kids in _children(parents).values())
  if largest_group > vocab:
    raise ValueError(f"a point-mass tree names distinct siblings: a node has {largest_group} children but there are "
                     f"only V = {vocab} tokens")
  prefix = {-1: np.asarray(context, np.int64)[None, :]}
  tokens_N = np.zeros(num_nodes, dtype=np.int64)
  for n, u in enumerate(parents):
    rank = sum(1 for s in range(n) if parents[s] == u)
    order_V = np.argsort(-_smoothed(_rows(drafter, prefix[u]), epsilon)[0], kind="stable")
    tokens_N[n] = order_V[rank]
    prefix[n] = np.concatenate([prefix[u], tokens_N[None, n:n + 1]], axis=1)
  tokens_TxN = np.broadcast_to(tokens_N, (copies, num_nodes)).copy()
  _, target_TxN1xV = _tree_rows(drafter, target, context, parents, tokens_TxN[:1], epsilon)
  draft_TxNxV = np.broadcast_to(np.eye(vocab)[tokens_N], (copies, num_nodes, vocab)).copy()
  return TreeDraws(parents, tokens_TxN, np.full(copies, 1.0 / copies), draft_TxNxV,
                   np.broadcast_to(target_TxN1xV, (copies,) + target_TxN1xV.shape[1:]).copy())


def sample_trees(rng, drafter: TabularLM, target: TabularLM, context: Sequence[int], parents_N, num_samples: int,
                 sampling: str, epsilon: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Draw ``num_samples`` trees of shape ``parents_N`` with numpy (inverse CDF, nodes in order; vectorised).

  Returns ``(tokens_BxN int64, draft_probs_BxNxV, target_probs_BxN1xV)`` (float64) in the tree contract, ready for
  ``verify.tree_verify`` (cast to int32 / float32). Same law as :func:`enumerate_trees` (the same ``ValueError``
  where a sibling group runs out of tokens). ``rng``: anything ``np.random.default_rng`` accepts.
  """
  context = _check_models(drafter, target, context)
  parents = check_parents(parents_N)
  sampling = _check_sampling(sampling)
  epsilon = _check_epsilon(epsilon)
  if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
    raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
  rng = np.random.default_rng(rng)
  num, num_nodes, vocab = int(num_samples), len(parents), target.vocab_size
  if sampling == POINT_MASS:
    draws = _point_mass_tree(drafter, target, context, parents, epsilon, num)
    return draws.tokens_TxN, draws.draft_probs_TxNxV, draws.target_probs_TxN1xV
  rows_B = np.arange(num)
  prefix = {-1: np.broadcast_to(np.asarray(context, np.int64), (num, len(context)))}
  tokens_BxN = np.zeros((num, num_nodes), dtype=np.int64)
  for n, u in enumerate(parents):
    q_BxV = _smoothed(_rows(drafter, prefix[u]), epsilon)
    weights_BxV = q_BxV
    if sampling == WITHOUT_REPLACEMENT:
      weights_BxV = q_BxV.copy()
      for s in range(n):
        if parents[s] == u:
          weights_BxV[rows_B, tokens_BxN[:, s]] = 0.0
      if np.any(~(weights_BxV.sum(axis=1) > 0)):
        raise ValueError(f"drawing without replacement: node {n} has no token of positive drafter probability left; "
                         f"use a shape with fewer siblings or epsilon > 0")
    cdf_BxV = np.cumsum(weights_BxV, axis=1)
    u_B = rng.random(num) * cdf_BxV[:, -1]
    x_B = np.sum(cdf_BxV <= u_B[:, None], axis=1)
    last_positive_B = vocab - 1 - np.argmax(weights_BxV[:, ::-1] > 0, axis=1)  # rounding guard
    tokens_BxN[:, n] = np.minimum(x_B, last_positive_B)
    prefix[n] = np.concatenate([prefix[u], tokens_BxN[:, n:n + 1]], axis=1)
  draft_BxNxV, target_BxN1xV = _tree_rows(drafter, target, context, parents, tokens_BxN, epsilon)
  return tokens_BxN, draft_BxNxV, target_BxN1xV
