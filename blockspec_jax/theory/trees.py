"""Exact laws of one tree-verification iteration by enumeration (numpy, float64; V up to ~5, N up to ~6 nodes).

The tree rules of ``blockspec_jax.verify.tree`` / ``verify.traversal`` (docs/ALGORITHMS.md §4) transcribed from
their definitions, with every coin of the rule summed out exactly (no Monte Carlo). Conventions:

* A tree **shape** is a static ``parents_N`` (int ``[N]``): ``−1 ≤ parents[n] < n`` (topological, −1 = the root, the
  context) and the children of one node consecutive, in draw order — the layout ``verify.tree_verify`` takes.
  :func:`branching_parents` builds the level-order layout of constant per-depth branching (``(k, 1, …, 1)`` is
  ``k`` chains, the layout of the k-chains drafter; ``(2, 2)`` a full binary tree of depth 2).
* **Drawing a tree** after context ``c``: node ``n`` is drawn from the drafter's row at its parent's context
  ``q = M_s(·|c ⊕ path to parent(n))``. ``"with_replacement"``: siblings i.i.d. from ``q``; an ordered tree has
  probability ``Π_n q_{parent(n)}(x_n)``. ``"without_replacement"``: siblings drawn one after another with the
  earlier siblings' tokens removed (the law of Gumbel-top-k); an ordered sibling sequence ``x_1..x_K`` has
  probability ``Π_j q(x_j) / Σ_{x ∉ {x_1..x_{j-1}}} q(x)`` (the remaining mass summed, not ``1 − Σ_{i<j} q(x_i)``,
  so a row that sums to 1 only up to rounding still gives a law of total mass 1).
  A sibling group must never hold more siblings than its row has tokens of positive probability: where a reachable
  group would (only possible without replacement), the enumeration raises ``ValueError`` rather than invent a draw.
  Pass ``epsilon > 0`` to do what the without-replacement drafters do (``drafters/trees.py``): draw from and report
  ``q_ε = (1 − ε) q + ε/V``, which gives every token positive mass (the rules then see exactly the law used).
* The rows handed to a rule follow the tree contract: ``draft_probs_NxV[n]`` = the drafter row at n's PARENT context
  (the same row for all siblings, before any removal), ``target_probs_N1xV[0]`` the target row at the root and
  ``[n + 1]`` the row after node ``n``.
* The **outcome** of one iteration: the end node ``e`` (the last accepted node, or the root when nothing is accepted;
  ``τ = depth(e)``) and the extra token ``Y``. :func:`tree_conditional_law` gives ``P(e, Y | tree)`` as a
  ``[N+1, V]`` table (row 0: the root, row ``n + 1``: node ``n``); the iteration emits the tokens on the path to
  ``e``, then ``Y``. Laws over trees are sums over all ``V**N`` token assignments weighted by their draw probability
  (trees of probability 0 are skipped).

Laws (:data:`TREE_LAWS`): each is a function ``fn(tokens_TxN, parents, q_TxNxV, p_TxN1xV) -> [T, N+1, V]`` registered
where it is defined by :func:`tree_law` with the sibling sampling its rule needs (``@tree_law("rrs",
sampling=WITH_REPLACEMENT)``). That declaration is the only one: :data:`TREE_RULE_SAMPLING` is read from it, and a
tree verifier (``verify.TreeVerifier``) naming the law as its ``theory_law`` takes its ``sibling_sampling`` from it.

* ``"rrs"`` / ``"rrs_wor"`` (top down): at the current node with target row ``p`` and ordered children
  ``x_1..x_K``: ``p_1 = p``, ``q_1 = q``; child ``k`` accepted w.p. ``min(1, p_k(x_k)/q_k(x_k))``, else
  ``p_{k+1} = norm(max(p_k − q_k, 0))`` and, for ``"rrs_wor"`` only, ``q_{k+1} = norm(q_k`` without ``x_k)``
  (``"rrs"``: ``q_{k+1} = q``). All rejected: ``Y ~ p_{K+1}``; an accepted leaf: ``Y ~`` its target row.
* ``"point_mass"`` (top down, ``"rrs"`` with every child its own point mass ``q_k = one_hot(x_k)``, the rows never
  read): child ``k`` accepted w.p. ``p_k(x_k)``, else ``p_{k+1} = norm(p_k`` without ``x_k)``; shared prefixes
  merged. Its trees are the :data:`POINT_MASS` ones (no draw: the drafter's top tokens).
* ``"spectr"`` (top down, k-sequential selection): ``ρ`` solves ``1 − (1 − β(ρ))^K = ρ β(ρ)``,
  ``β(ρ) = Σ min(q, p/ρ)``, by bisection on ``[1, K]`` keeping the upper end (the lossless side), as
  ``verify.tree.spectr_rho`` does, here in float64 with :data:`SPECTR_BISECTION_STEPS` steps; child ``k`` accepted
  w.p. ``min(1, p(x_k)/(ρ q(x_k)))``; all rejected: ``Y ~ norm(p − c·min(q, p/ρ))``, ``c = (1 − (1 − β)^K)/β``.
* ``"traversal"`` (leaf to root, post-order): path weights ``α_n = min(1, α_{parent} P_{parent}(x_n)/Q_{parent}(x_n))``
  (fixed once a child of ``n`` was rejected), visit ``n``: accept the chain root → n w.p. ``α_n`` with
  ``Y ~ P_n``; else delete ``n`` and update its parent ``u``: ``P_u ← norm(max(α_u P_u − Q_u, 0))``,
  ``α_u ← S/(S + 1 − α_u)``, ``Q_u ← norm(Q_u`` without ``x_n)``; all deleted: ``Y ~ P_root``. The visit order and
  which weights are fixed are static, so the conditional law is one pass over the N visits (the mass that reaches
  visit ``k`` is ``Π_{j<k}(1 − α_{v_j})``).

Numerical fallbacks as in the jax rules: a residual without positive mass keeps the previous row (Y: the node's
original target row); the ``clipped_ratio`` zero conventions of :mod:`blockspec_jax.theory.estimators`.

Multi-iteration laws (:func:`tree_emitted_prefix_law`): when an iteration emits fewer than ``m`` tokens, the next
iteration drafts a fresh tree of the same shape after the emitted tokens, exactly as the decoding loop does; a
lossless rule gives the target's :func:`~blockspec_jax.theory.exact.sequence_law`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from blockspec_jax.theory.estimators import clipped_ratio
from blockspec_jax.theory.exact import _check_models, sequence_law  # one check of a tabular pair
from blockspec_jax.theory.tabular import TabularLM
from blockspec_jax.theory.tree_draws import (MAX_ENUMERATED_TREES, POINT_MASS, WITH_REPLACEMENT, WITHOUT_REPLACEMENT,
                                             TreeDraws, _check_sampling, _children, _path_nodes, branching_parents,
                                             check_parents, enumerate_trees, sample_trees, tree_depths)

__all__ = ["WITH_REPLACEMENT", "WITHOUT_REPLACEMENT", "POINT_MASS", "TREE_LAWS", "TreeLaw", "tree_law",
           "TREE_RULE_SAMPLING", "MAX_ENUMERATED_TREES",
           "SPECTR_BISECTION_STEPS", "TreeDraws", "branching_parents", "check_parents", "tree_depths",
           "enumerate_trees", "sample_trees", "tree_conditional_law", "spectr_rho_f64", "tree_outcome_law",
           "tree_tau_law", "tree_expected_accepted", "tree_emitted_prefix_law", "tree_lossless_error"]


@dataclasses.dataclass(frozen=True)
class TreeLaw:
  """One tree rule's exact conditional law (registered by :func:`tree_law`): ``fn(tokens_TxN, parents, q_TxNxV,
  p_TxN1xV)`` → ``P(end node, Y | tree)`` float64 ``[T, N+1, V]`` for ``T`` trees of one shape (``parents`` a
  tuple, checked); ``sampling`` how the rule's siblings must be drawn for it to be lossless."""
  name: str
  fn: Callable[..., np.ndarray]
  sampling: str


#: name -> :class:`TreeLaw`, filled by :func:`tree_law`.
TREE_LAWS: dict[str, TreeLaw] = {}


class _SamplingTable(Mapping):
  """A read-only view name -> ``TREE_LAWS[name].sampling`` (always current: later registrations show)."""

  def __getitem__(self, name: str) -> str:
    return TREE_LAWS[name].sampling

  def __iter__(self):
    return iter(TREE_LAWS)

  def __len__(self) -> int:
    return len(TREE_LAWS)

  def __repr__(self) -> str:
    return repr(dict(self))


#: name -> how that rule's trees are drawn (``"with_replacement"`` / ``"without_replacement"``): read from
#: :data:`TREE_LAWS`, so the registered laws' declarations are the table.
TREE_RULE_SAMPLING: Mapping[str, str] = _SamplingTable()


def tree_law(name: str, *, sampling: str):
  """Decorator registering a tree law function under ``name`` in :data:`TREE_LAWS` with the sibling ``sampling`` its
  rule needs (see :class:`TreeLaw`); a ValueError when the name is taken or the sampling unknown. Returns the
  function unchanged."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"a tree law's name is a non-empty string, got {name!r}")
  sampling = _check_sampling(sampling)

  def register(fn):
    if name in TREE_LAWS:
      raise ValueError(f"tree law {name!r} is already registered ({TREE_LAWS[name].fn.__qualname__})")
    TREE_LAWS[name] = TreeLaw(name, fn, sampling)
    return fn

  return register


#: Bisection steps for SpecTr's ρ in float64: [1, K] halved 64 times is below one ulp of ρ.
SPECTR_BISECTION_STEPS = 64


# --- arguments ---------------------------------------------------------------------------------------------------

def _law(rule: str) -> TreeLaw:
  if not isinstance(rule, str) or rule not in TREE_LAWS:
    raise ValueError(f"unknown tree rule {rule!r}; known tree rules: {', '.join(sorted(TREE_LAWS))}")
  return TREE_LAWS[rule]


# --- the conditional law of one rule on given trees --------------------------------------------------------------

def _normalised(weights_TxV: np.ndarray, fallback_TxV: np.ndarray) -> np.ndarray:
  """Rows ``w / Σ w``, or the fallback row where ``w`` has no positive mass."""
  total_T = weights_TxV.sum(axis=1, keepdims=True)
  return np.where(total_T > 0, weights_TxV / np.where(total_T > 0, total_T, 1.0), fallback_TxV)


def _y_row(weights_TxV: np.ndarray, fallback_TxV: np.ndarray) -> np.ndarray:
  """The law of Y from weights as ``sampling.sample_from_weights`` reads them (non-finite and negative entries are
  0), or the normalised fallback row when no positive weight is left."""
  weights_TxV = np.where(np.isfinite(weights_TxV) & (weights_TxV > 0), weights_TxV, 0.0)
  return _normalised(weights_TxV, _normalised(fallback_TxV, fallback_TxV))


def _at(rows_TxV: np.ndarray, x_T: np.ndarray) -> np.ndarray:
  return rows_TxV[np.arange(rows_TxV.shape[0]), x_T]


def spectr_rho_f64(p_TxV, q_TxV, k: int, num_steps: int = SPECTR_BISECTION_STEPS):
  """``(ρ, β, c)`` of SpecTr's k-sequential selection, float64 ``[T]`` each (rows ``[T, V]``; one ``k``).

  The algorithm of ``verify.tree.spectr_rho`` in float64: ``f(ρ) = 1 − (1 − β(ρ))^k − ρ β(ρ)``, bisection on
  ``[1, max(k, 1)]`` keeping the upper end where ``f ≤ 0`` (the lossless side), ``ρ = 1`` when ``f(1) ≤ 0``;
  ``c = (1 − (1 − β)^k)/β`` (``k`` when ``β = 0``).
  """
  p_TxV = np.asarray(p_TxV, dtype=np.float64)
  q_TxV = np.asarray(q_TxV, dtype=np.float64)
  k_f = float(max(int(k), 1))

  def beta(rho_T):
    return np.clip(np.minimum(q_TxV, p_TxV / rho_T[:, None]).sum(axis=1), 0.0, 1.0)

  def acceptance_mass(beta_T):
    with np.errstate(divide="ignore"):  # log1p(−1) = −inf: mass 1
      return -np.expm1(k_f * np.log1p(-beta_T))

  def excess(rho_T):
    beta_T = beta(rho_T)
    return acceptance_mass(beta_T) - rho_T * beta_T

  low_T = np.ones(p_TxV.shape[0])
  high_T = np.full(p_TxV.shape[0], k_f)
  for _ in range(num_steps):
    middle_T = 0.5 * (low_T + high_T)
    valid_T = excess(middle_T) <= 0
    low_T, high_T = np.where(valid_T, low_T, middle_T), np.where(valid_T, middle_T, high_T)
  ones_T = np.ones_like(low_T)
  rho_T = np.where(excess(ones_T) <= 0, ones_T, high_T)
  beta_T = beta(rho_T)
  scale_T = np.where(beta_T > 0, acceptance_mass(beta_T) / np.where(beta_T > 0, beta_T, 1.0), k_f)
  return rho_T, beta_T, scale_T


def prefix_classes_np(tokens_TxN: np.ndarray, parents) -> np.ndarray:
  """int ``[T, N]``: per tree, the first node with the same root-to-node token path as each node (itself when none
  before it): ``verify.tree.prefix_classes`` in numpy."""
  tokens_TxN = np.asarray(tokens_TxN)
  parents = np.asarray(parents)
  num_trees, num_nodes = tokens_TxN.shape
  class_TxN = np.tile(np.arange(num_nodes), (num_trees, 1))
  for n in range(num_nodes):
    parent_class_TxN = np.where(parents[None, :] >= 0, class_TxN[:, np.clip(parents, 0, None)], -1)
    for m in range(n - 1, -1, -1):  # the first match wins: scan down to it
      same_T = (tokens_TxN[:, m] == tokens_TxN[:, n]) & (parent_class_TxN[:, m] == parent_class_TxN[:, n])
      class_TxN[same_T, n] = m
  return class_TxN


def _top_down_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV, *, spectr: bool, remove_drawn: bool,
                  merge: bool, point_mass: bool = False) -> np.ndarray:
  """The top-down rules, ``"rrs"`` / ``"rrs_wor"`` (``remove_drawn``: the drafter row loses each rejected sibling's
  token), ``"spectr"`` (``spectr``: k-sequential selection) and ``"point_mass"`` (``point_mass``: every child is its
  own point mass, ``q_k = one_hot(x_k)``, whatever rows are given): the mass reaching each node times its children's
  decisions. ``merge`` (the with-replacement rules): the children of a node are those of every node with the same
  root-to-node tokens (:func:`prefix_classes_np`), in node order, as the walk of ``verify.tree`` takes them."""
  num_trees, num_nodes = tokens_TxN.shape
  parents = np.asarray(parents)
  class_TxN = prefix_classes_np(tokens_TxN, parents) if merge else np.tile(np.arange(num_nodes), (num_trees, 1))
  parent_class_TxN = np.where(parents[None, :] >= 0, class_TxN[:, np.clip(parents, 0, None)], -1)
  law_TxN1xV = np.zeros(p_TxN1xV.shape, dtype=np.float64)
  reach_TxN1 = np.zeros((num_trees, num_nodes + 1))  # P(the walk makes u the current node), column u + 1
  reach_TxN1[:, 0] = 1.0
  for u in range(-1, num_nodes):  # topological: u's reach is complete before its children are decided
    reach_T = reach_TxN1[:, u + 1]
    p_V = p_TxN1xV[:, u + 1]
    u_class_T = np.full(num_trees, -1) if u < 0 else class_TxN[:, u]
    kid_TxN = (parent_class_TxN == u_class_T[:, None]) & (np.arange(num_nodes)[None, :] > u)
    count_T = kid_TxN.sum(axis=1)
    if not count_T.any():  # a leaf in every tree: the bonus from its target row
      law_TxN1xV[:, u + 1] = reach_T[:, None] * _y_row(p_V, p_V)
      continue
    first_T = np.argmax(kid_TxN, axis=1)  # the class's children share their parent context's row
    q_V = q_TxNxV[np.arange(num_trees), first_T]
    p_k, q_k = p_V, q_V
    if spectr:  # one bisection per distinct (p, q, k) (trees share their parents' contexts)
      rho_T, scale_T = np.ones(num_trees), np.ones(num_trees)
      for k in np.unique(count_T[count_T > 0]):
        sel = count_T == k
        pairs_Ux2V, inverse = np.unique(np.concatenate([p_V[sel], q_V[sel]], axis=1), axis=0, return_inverse=True)
        rho_U, _, scale_U = spectr_rho_f64(pairs_Ux2V[:, :p_V.shape[1]], pairs_Ux2V[:, p_V.shape[1]:], int(k))
        rho_T[sel], scale_T[sel] = rho_U[inverse.reshape(-1)], scale_U[inverse.reshape(-1)]
    none_T = np.ones(num_trees)  # P(every child so far rejected)
    for c in range(u + 1, num_nodes):
      kid_T = kid_TxN[:, c]
      if not kid_T.any():
        continue
      x_T = tokens_TxN[:, c]
      if point_mass:  # the given rows are never read: each child is its own point mass
        q_k = np.eye(p_V.shape[1])[x_T]
      if spectr:
        accept_T = clipped_ratio(1.0 / rho_T, _at(p_V, x_T), _at(q_V, x_T))
      else:
        accept_T = clipped_ratio(1.0, _at(p_k, x_T), _at(q_k, x_T))
      accept_T = np.where(kid_T, accept_T, 0.0)
      reach_TxN1[:, c + 1] += reach_T * none_T * accept_T
      none_T = none_T * (1.0 - accept_T)
      if not spectr:
        p_next = _normalised(np.maximum(p_k - q_k, 0.0), p_k)
        if remove_drawn:
          q_removed = np.where(np.arange(q_k.shape[1])[None, :] == x_T[:, None], 0.0, q_k)
          q_k = np.where(kid_T[:, None], _normalised(q_removed, q_removed), q_k)
        p_k = np.where(kid_T[:, None], p_next, p_k)
    residual_V = p_V - np.minimum(q_V, p_V / rho_T[:, None]) * scale_T[:, None] if spectr else p_k
    leaf_T = count_T == 0
    law_TxN1xV[:, u + 1] = reach_T[:, None] * np.where(leaf_T[:, None], _y_row(p_V, p_V),
                                                       none_T[:, None] * _y_row(residual_V, p_V))
  return law_TxN1xV


@tree_law("rrs", sampling=WITH_REPLACEMENT)
def _rrs_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV) -> np.ndarray:
  """Recursive rejection sampling (SpecInfer) over i.i.d. siblings."""
  return _top_down_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV, spectr=False, remove_drawn=False, merge=True)


@tree_law("rrs_wor", sampling=WITHOUT_REPLACEMENT)
def _rrs_wor_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV) -> np.ndarray:
  """Recursive rejection sampling (RSD) over siblings drawn without replacement."""
  return _top_down_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV, spectr=False, remove_drawn=True, merge=False)


@tree_law("point_mass", sampling=POINT_MASS)
def _point_mass_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV) -> np.ndarray:
  """Recursive rejection sampling over fixed siblings, each its own point mass (shared prefixes merged)."""
  return _top_down_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV, spectr=False, remove_drawn=False, merge=True,
                       point_mass=True)


@tree_law("spectr", sampling=WITH_REPLACEMENT)
def _spectr_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV) -> np.ndarray:
  """SpecTr's k-sequential selection over i.i.d. siblings."""
  return _top_down_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV, spectr=True, remove_drawn=False, merge=True)


def _postorder(parents: tuple[int, ...]) -> list[int]:
  """Children in index order, each subtree before its root."""
  children = _children(parents)
  order = []

  def visit(u):
    for c in children[u]:
      visit(c)
    if u >= 0:
      order.append(u)

  visit(-1)
  return order


@tree_law("traversal", sampling=WITHOUT_REPLACEMENT)
def _traversal_law(tokens_TxN, parents, q_TxNxV, p_TxN1xV, without_replacement=True) -> np.ndarray:
  """``"traversal"``: one pass over the post-order; the state after each deletion is deterministic."""
  num_trees, num_nodes = tokens_TxN.shape
  children = _children(parents)
  rows = {u: p_TxN1xV[:, u + 1].copy() for u in range(-1, num_nodes)}  # current P_u
  drafts = {u: q_TxNxV[:, kids[0]].copy() for u, kids in children.items() if kids}  # current Q_u
  fixed = {}  # u -> α_u [T], once a child of u was deleted
  law_TxN1xV = np.zeros(p_TxN1xV.shape, dtype=np.float64)
  reach_T = np.ones(num_trees)  # P(every earlier visit rejected)

  def alpha(n):
    if n == -1:
      return np.ones(num_trees)
    if n in fixed:
      return fixed[n]
    u, x_T = parents[n], tokens_TxN[:, n]
    return clipped_ratio(alpha(u), _at(rows[u], x_T), _at(drafts[u], x_T))

  for v in _postorder(parents):
    alpha_v = alpha(v)
    law_TxN1xV[:, v + 1] += (reach_T * alpha_v)[:, None] * _y_row(rows[v], p_TxN1xV[:, v + 1])
    reach_T = reach_T * (1.0 - alpha_v)
    u = parents[v]
    alpha_u = alpha(u)  # before the deletion fixes it
    residual_TxV = np.maximum(alpha_u[:, None] * rows[u] - drafts[u], 0.0)
    mass_T = residual_TxV.sum(axis=1)
    rows[u] = _normalised(residual_TxV, rows[u])
    if u >= 0:
      denominator_T = mass_T + (1.0 - alpha_u)
      fixed[u] = np.where(denominator_T > 0, mass_T / np.where(denominator_T > 0, denominator_T, 1.0), 1.0)
    if without_replacement:
      removed = np.where(np.arange(drafts[u].shape[1])[None, :] == tokens_TxN[:, v:v + 1], 0.0, drafts[u])
      drafts[u] = _normalised(removed, removed)
  law_TxN1xV[:, 0] += reach_T[:, None] * _y_row(rows[-1], p_TxN1xV[:, 0])
  return law_TxN1xV


def tree_conditional_law(rule: str, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) -> np.ndarray:
  """``P(end node, Y | tree)`` for ``rule``: float64 ``[..., N+1, V]`` (row 0: nothing accepted, the root; row
  ``n + 1``: node ``n`` is the last accepted node; entries sum to 1).

  The arguments of ``verify.tree_verify`` (one tree), or with a common leading batch axis ``[T]`` on ``tokens``,
  ``draft_probs`` and ``target_probs`` (the shape ``parents_N`` is shared and static). Exact: the rule's coins are
  summed out (module docstring). ``τ`` is the depth of the end node, the emitted tokens the path to it, then ``Y``.
  """
  law = _law(rule)
  parents = check_parents(parents_N)
  tokens = np.asarray(tokens_N)
  q = np.asarray(draft_probs_NxV, dtype=np.float64)
  p = np.asarray(target_probs_N1xV, dtype=np.float64)
  single = tokens.ndim == 1
  tokens_TxN, q_TxNxV, p_TxN1xV = (tokens[None], q[None], p[None]) if single else (tokens, q, p)
  num_nodes = len(parents)
  if tokens_TxN.ndim != 2 or tokens_TxN.shape[1] != num_nodes or not np.issubdtype(tokens_TxN.dtype, np.integer):
    raise ValueError(f"tokens must be ints of shape [N] or [T, N] with N = {num_nodes}, got {tokens.shape}")
  num_trees = tokens_TxN.shape[0]
  if q_TxNxV.ndim != 3 or q_TxNxV.shape[:2] != (num_trees, num_nodes):
    raise ValueError(f"draft_probs must have shape [N, V] (or [T, N, V]) with N = {num_nodes}, got {q.shape}")
  vocab = q_TxNxV.shape[2]
  if p_TxN1xV.shape != (num_trees, num_nodes + 1, vocab):
    raise ValueError(f"target_probs must have shape [N+1, V] = [{num_nodes + 1}, {vocab}] (or with a leading T), "
                     f"got {p.shape}")
  if tokens_TxN.size and (tokens_TxN.min() < 0 or tokens_TxN.max() >= vocab):
    raise ValueError(f"tokens out of range [0, {vocab})")
  law_TxN1xV = law.fn(tokens_TxN.astype(np.int64), parents, q_TxNxV, p_TxN1xV)
  return law_TxN1xV[0] if single else law_TxN1xV


# --- laws of one iteration over all trees ------------------------------------------------------------------------

def _iteration(rule, drafter, target, context, parents_N, epsilon):
  """``(TreeDraws, P(end, Y | tree) [T, N+1, V])`` of one iteration after ``context``."""
  draws = enumerate_trees(drafter, target, context, parents_N, _law(rule).sampling, epsilon)
  law_TxN1xV = tree_conditional_law(rule, draws.tokens_TxN, draws.parents, draws.draft_probs_TxNxV,
                                    draws.target_probs_TxN1xV)
  return draws, law_TxN1xV


def tree_outcome_law(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int], parents_N,
                     epsilon: float = 0.0) -> dict[tuple[int, ...], float]:
  """Law of the emitted tuple (tokens of the accepted path, then ``Y``; length ``τ + 1``) of one iteration, trees
  drawn as ``rule`` requires (:data:`TREE_RULE_SAMPLING`). Only outcomes of positive probability; keys sorted.

  Shared by the functions below: ``parents_N`` the static shape (:func:`check_parents`; :func:`branching_parents`
  for per-depth branching); ``epsilon`` the drafter smoothing of :func:`enumerate_trees` (0: rows as they are).
  """
  draws, law_TxN1xV = _iteration(rule, drafter, target, context, parents_N, epsilon)
  parents = draws.parents
  law: dict[tuple[int, ...], float] = {}
  for end in range(-1, len(parents)):
    path_T = draws.tokens_TxN[:, _path_nodes(parents, end)]
    mass_TxV = draws.weights_T[:, None] * law_TxN1xV[:, end + 1]
    paths_U, inverse_T = np.unique(path_T, axis=0, return_inverse=True)
    inverse_T = inverse_T.reshape(-1)
    for y in range(mass_TxV.shape[1]):
      sums_U = np.bincount(inverse_T, weights=mass_TxV[:, y], minlength=paths_U.shape[0])
      for path, total in zip(paths_U, sums_U):
        if total > 0:
          outcome = tuple(int(x) for x in path) + (y,)
          law[outcome] = law.get(outcome, 0.0) + float(total)
  return {outcome: law[outcome] for outcome in sorted(law)}


def tree_tau_law(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int], parents_N,
                 epsilon: float = 0.0) -> np.ndarray:
  """``P(τ = t)`` for t = 0..D (D the deepest node's depth): float64 ``[D+1]``."""
  draws, law_TxN1xV = _iteration(rule, drafter, target, context, parents_N, epsilon)
  depth_N1 = np.concatenate([[0], tree_depths(draws.parents)])
  end_mass_N1 = np.einsum("t,tev->e", draws.weights_T, law_TxN1xV)
  return np.bincount(depth_N1, weights=end_mass_N1, minlength=int(depth_N1.max()) + 1)


def tree_expected_accepted(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int], parents_N,
                           epsilon: float = 0.0) -> float:
  """``E[τ]``: expected accepted nodes per iteration (block efficiency is this + 1)."""
  tau_law = tree_tau_law(rule, drafter, target, context, parents_N, epsilon)
  return float(np.dot(np.arange(tau_law.shape[0], dtype=np.float64), tau_law))


def tree_emitted_prefix_law(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int], parents_N,
                            m: int, epsilon: float = 0.0) -> dict[tuple[int, ...], float]:
  """Law of the first ``m`` emitted tokens when iterations of ``rule`` on trees of shape ``parents_N`` repeat from
  ``context``: an iteration that emits ``o`` with ``len(o) < m`` is followed by a fresh tree of the same shape after
  ``context ⊕ o`` (the decoding loop). All ``V**m`` tuples (zeros included), lexicographic order; a lossless rule
  gives :func:`~blockspec_jax.theory.exact.sequence_law` ``(target, context, m)``.
  """
  context = _check_models(drafter, target, context)
  if isinstance(m, (bool, np.bool_)) or not isinstance(m, (int, np.integer)) or m < 1:
    raise ValueError(f"m must be an integer >= 1, got {m!r}")
  vocab = target.vocab_size

  @functools.lru_cache(maxsize=None)
  def prefix_law(ctx: tuple[int, ...], length: int) -> np.ndarray:
    law = np.zeros((vocab,) * length, dtype=np.float64)
    for outcome, prob in tree_outcome_law(rule, drafter, target, ctx, parents_N, epsilon).items():
      if len(outcome) >= length:
        law[outcome[:length]] += prob
      else:
        law[outcome] += prob * prefix_law(ctx + outcome, length - len(outcome))
    return law

  law = prefix_law(context, int(m))
  return {tokens: float(law[tokens]) for tokens in np.ndindex(*law.shape)}


def tree_lossless_error(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int], parents_N,
                        m: int = 3, epsilon: float = 0.0) -> float:
  """``max_s |P(first m emitted = s) − M_b(s | context)|`` over all ``V**m`` tuples (0 up to rounding: lossless)."""
  law = tree_emitted_prefix_law(rule, drafter, target, context, parents_N, m, epsilon)
  reference = sequence_law(target, context, m)
  return float(max(abs(law[s] - reference[s]) for s in reference))

