"""Tree verification: one target pass over a tree of drafts, one accepted root-to-node path plus one more token.

Contract (docs/ALGORITHMS.md §4)::

    res = tree_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, *, rule)
    tokens_N           int    [N]       the drafted token of every node
    parents_N          int    [N]       parent of every node, −1 = the root (the context); parents[n] < n, and the
                                        children of one node are consecutive, in the order they were drawn
    draft_probs_NxV    float  [N, V]    row n = the drafter's law at node n's PARENT context, the law the siblings
                                        were drawn from (the same row for all siblings, before any without-
                                        replacement removal)
    target_probs_N1xV  float  [N+1, V]  row 0 = the target's law at the root, row n + 1 = after node n
    res.num_accepted   int32  []        τ ∈ [0, N]: number of nodes on the accepted path
    res.accepted_N     bool   [N]       the accepted nodes, one per depth from a child of the root down (τ of
                                        them) along one token path; under the with-replacement rules, which merge
                                        equal prefixes, a node's parent may be another node with the same prefix
    res.next_token     int32  []        Y ∈ [0, V): the correction (children of the last accepted node all
                                        rejected) or the bonus token (the last accepted node is a leaf)

An iteration emits the tokens of the accepted path, root first, then Y. How the tree must be drawn depends on the
rule: :func:`tree_sampling` says whether siblings are i.i.d. draws from their row (``"with_replacement"``) or draws
without replacement (``"without_replacement"``: Gumbel-top-k or sequential sampling, never more siblings than the
row has tokens of positive probability). Every rule here is lossless (the emitted tokens have exactly the target
law) when the tree was drawn that way and the key is fresh for every call and every batch row.

All rules walk the tree once in node order (``lax.fori_loop`` over N, static N and V, any tree shape encoded in
``parents_N``), keeping the current node (−1 = root) and a state of ``[V]`` rows; the children of the current node
are the nodes whose parent it is (``rrs`` and ``spectr``: whose parent has the current node's root-to-node tokens,
:func:`prefix_classes`: SpecTr's K-SEQ over every draft consistent with the accepted prefix). A node whose subtree was left is skipped. Per-node constants (SpecTr's ρ) are
computed for all nodes at once before the walk. Cost: N sequential steps of O(V) each, plus an ``[N, V]`` gather of
parent rows for SpecTr. Jittable and vmappable; batch with ``jax.vmap`` (one key per row).

Registry. A tree rule is a function ``fn(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) ->
TreeVerifyResult`` (the ones below, :func:`blockspec_jax.verify.traversal.traversal_verify`) and a
``TreeVerifier`` subclass registered by ``@verify.register`` (``verify/verifiers.py``), which declares its name, its
function and its exact law (whence the sibling sampling). The registration fills :data:`TREE_RULES` (name ->
``(fn, sampling)``), on which :func:`tree_verify` dispatches after checking the inputs (:func:`check_tree`).

Numerics as in :mod:`blockspec_jax.verify.rules`: ratios through :func:`~blockspec_jax.verify.rules.clipped_ratio`
(no inf/NaN); a residual without positive mass (reachable only through rounding) falls back to the target row of the
current node; garbage rows (NaN, negative) never produce ids outside ``[0, V)`` or ``τ`` outside ``[0, N]``: a NaN
acceptance probability rejects, and Y comes from :func:`blockspec_jax.sampling.sample_from_weights`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from blockspec_jax import sampling
from blockspec_jax.contracts import POINT_MASS, WITH_REPLACEMENT, WITHOUT_REPLACEMENT
from blockspec_jax.verify.rules import clipped_ratio

__all__ = ["TreeVerifyResult", "TREE_RULES", "WITH_REPLACEMENT", "WITHOUT_REPLACEMENT", "POINT_MASS", "tree_verify",
           "tree_sampling", "check_tree", "chain_parents", "rrs_tree_verify", "rrs_wor_tree_verify",
           "point_mass_tree_verify",
           "spectr_tree_verify", "spectr_rho", "prefix_classes"]

_SAMPLING_MODES = (WITH_REPLACEMENT, WITHOUT_REPLACEMENT, POINT_MASS)

_RHO_BISECTION_STEPS = 32  # [1, k] halved 32 times: below one f32 ulp of ρ for any k < 2**8


@struct.dataclass
class TreeVerifyResult:
  """Outcome of verifying one tree (a batch under ``jax.vmap``: every field gains a leading ``[B]``)."""
  num_accepted: jax.Array  # int32 []   τ: nodes on the accepted path
  accepted_N: jax.Array    # bool [N]   the accepted path (a chain hanging from the root)
  next_token: jax.Array    # int32 []   Y: correction or bonus


# --- checks --------------------------------------------------------------------------------------------------------

def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def chain_parents(gamma: int) -> np.ndarray:
  """Parents of a single chain of ``gamma`` nodes, ``[−1, 0, 1, …, γ−2]`` (int32 ``[γ]``): token verification's
  draft as a tree."""
  if int(gamma) != gamma or gamma < 1:
    raise ValueError(f"chain length gamma must be an integer >= 1, got {gamma!r}")
  return np.arange(-1, int(gamma) - 1, dtype=np.int32)


def _check_parents_values(parents_N: np.ndarray) -> None:
  """Concrete ``parents_N``: −1 ≤ parents[n] < n (topological) and each node's children consecutive."""
  n_nodes = parents_N.shape[0]
  index_N = np.arange(n_nodes)
  bad = np.flatnonzero((parents_N < -1) | (parents_N >= index_N))
  if bad.size:
    n = int(bad[0])
    raise ValueError(f"parents must satisfy -1 <= parents[n] < n (nodes in topological order, -1 = root); "
                     f"parents[{n}] = {int(parents_N[n])}")
  seen_before = set()
  for n in range(n_nodes):
    parent = int(parents_N[n])
    if n > 0 and parent != int(parents_N[n - 1]):
      if parent in seen_before:
        raise ValueError(f"the children of node {parent} are not consecutive (node {n} follows another node's "
                         f"children): siblings must be stored together, in the order they were drawn")
    seen_before.add(parent)


def check_tree(tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) -> tuple[int, int]:
  """Check one tree's inputs; return ``(N, V)``.

  Static shapes and dtypes are checked at trace time (under ``jit``/``vmap`` too): ranks, integer ids, float rows,
  ``N`` agreeing across the four arguments, ``V`` agreeing between drafter and target, ``N ≥ 1``. Where ``parents_N``
  (or ``tokens_N``) is a concrete array its values are checked as well: topological order, consecutive siblings (and
  token ids in ``[0, V)``). Traced values cannot be checked; a traced out-of-range token is never accepted.
  """
  args = {"tokens_N": tokens_N, "parents_N": parents_N, "draft_probs_NxV": draft_probs_NxV,
          "target_probs_N1xV": target_probs_N1xV}
  args = {name: x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x) for name, x in args.items()}
  for name in ("tokens_N", "parents_N"):
    x = args[name]
    if x.ndim != 1:
      raise ValueError(f"{name} must have shape [N] for one tree (use jax.vmap for batches), got shape "
                       f"{tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be integers, got dtype {x.dtype}")
  for name in ("draft_probs_NxV", "target_probs_N1xV"):
    x = args[name]
    if x.ndim != 2:
      raise ValueError(f"{name} must have rank 2 ([rows, V]) for one tree, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point probabilities, got dtype {x.dtype}")
  n_nodes = args["tokens_N"].shape[0]
  if n_nodes < 1:
    raise ValueError("a tree needs at least one node (N >= 1), got N = 0")
  if args["parents_N"].shape[0] != n_nodes:
    raise ValueError(f"parents_N has {args['parents_N'].shape[0]} entries but tokens_N has N = {n_nodes}")
  if args["draft_probs_NxV"].shape[0] != n_nodes:
    raise ValueError(f"draft_probs_NxV must have N = {n_nodes} rows (the law at each node's parent), got shape "
                     f"{tuple(args['draft_probs_NxV'].shape)}")
  if args["target_probs_N1xV"].shape[0] != n_nodes + 1:
    raise ValueError(f"target_probs_N1xV must have N + 1 = {n_nodes + 1} rows (root, then after each node), got "
                     f"shape {tuple(args['target_probs_N1xV'].shape)}")
  vocab = args["draft_probs_NxV"].shape[1]
  if args["target_probs_N1xV"].shape[1] != vocab:
    raise ValueError(f"vocabulary mismatch between drafter and target: draft_probs_NxV has V = {vocab}, "
                     f"target_probs_N1xV has V = {args['target_probs_N1xV'].shape[1]}; both models must share one "
                     f"tokenizer")
  if vocab < 1:
    raise ValueError("the vocabulary must have V >= 1 tokens")
  if _is_concrete(args["parents_N"]):
    _check_parents_values(np.asarray(args["parents_N"]))
  if _is_concrete(args["tokens_N"]):
    tokens_np = np.asarray(args["tokens_N"])
    if tokens_np.min() < 0 or tokens_np.max() >= vocab:
      raise ValueError(f"tokens_N out of range [0, {vocab}): min {tokens_np.min()}, max {tokens_np.max()}")
  return n_nodes, vocab


# --- the walk shared by every rule -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _NodeRule:
  """How one rule verifies the ordered children of a node; a state is a tuple of arrays of fixed shapes.

  ``merge``: nodes with the same root-to-node token path are one node (:func:`prefix_classes`): the children of the
  current node are the children of every node of its class, in node order (with-replacement drafts, whose sibling
  chains may share prefixes: SpecTr's k chains, SpecInfer's token tree). Without-replacement trees have distinct
  siblings, so merging would change nothing there.
  ``prepare(p_parent_NxV, q_NxV, siblings_N)``: optional per-node constants computed for all nodes at once before
  the walk (row n: target row of n's parent, n's draft row, number of children of n's parent), a pytree with a
  leading ``[N]``; the walk hands node n's slice to ``start`` (``None`` without ``prepare``).
  ``start(p_V, q_V, aux)``: state before the first child (``p_V`` target row of the node, ``q_V`` the children's
  draft row). ``accept_prob(state, x)``: probability of accepting the next child, token ``x``.
  ``reject(state, x)``: state after that child was rejected. ``correction(state)``: weights ``[V]`` of Y once every
  child was rejected (negative and non-finite entries count as 0).
  """
  start: Callable[[jax.Array, jax.Array, Any], Any]
  accept_prob: Callable[[Any, jax.Array], jax.Array]
  reject: Callable[[Any, jax.Array], Any]
  correction: Callable[[Any], jax.Array]
  prepare: Optional[Callable[[jax.Array, jax.Array, jax.Array], Any]] = None
  merge: bool = False


def prefix_classes(tokens_N, parents_N) -> jax.Array:
  """int32 ``[N]``: for every node, the first node (in node order) with the same root-to-node token path (itself when
  there is none before it). Two nodes are in one class when their tokens are equal and their parents are in one
  class (the root's children: the root). Jittable; O(N²)."""
  tokens_N = jnp.asarray(tokens_N).astype(jnp.int32)
  parents_N = jnp.asarray(parents_N).astype(jnp.int32)
  index_N = jnp.arange(tokens_N.shape[0], dtype=jnp.int32)

  def body(n, canon_N):
    parent_class_N = jnp.where(parents_N >= 0, canon_N[jnp.clip(parents_N, 0)], -1)
    same_N = (tokens_N == tokens_N[n]) & (parent_class_N == parent_class_N[n]) & (index_N < n)
    return canon_N.at[n].set(jnp.where(jnp.any(same_N), jnp.argmax(same_N).astype(jnp.int32), n))

  return jax.lax.fori_loop(0, tokens_N.shape[0], body, index_N)


def _at(row_V: jax.Array, x: jax.Array) -> jax.Array:
  """``row_V[x]``; 0 for an id outside ``[0, V)`` (such a token is never accepted)."""
  vocab = row_V.shape[-1]
  return jnp.where((x >= 0) & (x < vocab), row_V[jnp.clip(x, 0, vocab - 1)], 0.0)


def _normalised(weights_V: jax.Array, fallback_V: jax.Array) -> jax.Array:
  """``weights_V / Σ weights_V``, or ``fallback_V`` when the weights have no positive mass."""
  total = jnp.sum(weights_V)
  return jnp.where(total > 0, weights_V / jnp.where(total > 0, total, 1.0), fallback_V)


def _walk(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, node_rule: _NodeRule) -> TreeVerifyResult:
  """Verify the tree top-down with ``node_rule`` at every node on the way (see the module docstring).

  One ``fori_loop`` over the N nodes in order, carrying the current node (−1 = root), whether a child of it was
  seen yet, the accepted mask and the rule's state. A node whose parent is not the current node (``merge``: not in
  the current node's prefix class) is skipped: it lies in a subtree already left (or below a node not reached yet,
  whose children come later since parents[n] < n).
  """
  n_nodes, _ = check_tree(tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)
  tokens_N = jnp.asarray(tokens_N).astype(jnp.int32)
  parents_N = jnp.asarray(parents_N).astype(jnp.int32)
  q_NxV = jnp.asarray(draft_probs_NxV, jnp.float32)
  p_N1xV = jnp.asarray(target_probs_N1xV, jnp.float32)
  key_coins, key_next = jax.random.split(key)
  coins_N = jax.random.uniform(key_coins, (n_nodes,), jnp.float32)
  class_N = prefix_classes(tokens_N, parents_N) if node_rule.merge else jnp.arange(n_nodes, dtype=jnp.int32)
  parent_class_N = jnp.where(parents_N >= 0, class_N[jnp.clip(parents_N, 0)], -1)  # whose child each node is
  aux_N = None
  if node_rule.prepare is not None:
    siblings_N = jnp.sum((parent_class_N[:, None] == parent_class_N[None, :]).astype(jnp.int32), axis=1)
    aux_N = node_rule.prepare(p_N1xV[jnp.clip(parents_N + 1, 0, n_nodes)], q_NxV, siblings_N)
  # Placeholder of the right shapes: the state is started at the first child of the root (node 0).
  state_shapes = jax.eval_shape(node_rule.start, p_N1xV[0], q_NxV[0], jax.tree.map(lambda a: a[0], aux_N))
  initial_state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state_shapes)

  def body(n, carry):
    current, fresh, accepted_N, state = carry
    is_child = parent_class_N[n] == jnp.where(current >= 0, class_N[jnp.clip(current, 0)], -1)
    x = tokens_N[n]
    # The state is (re)started at the first child of the current node; siblings after it share that state.
    p_V = jax.lax.dynamic_index_in_dim(p_N1xV, current + 1, keepdims=False)
    started = node_rule.start(p_V, q_NxV[n], jax.tree.map(lambda a: a[n], aux_N))
    state_in = jax.tree.map(lambda new, old: jnp.where(fresh, new, old), started, state)
    accepted = is_child & (coins_N[n] < node_rule.accept_prob(state_in, x))
    rejected_state = node_rule.reject(state_in, x)
    state_out = jax.tree.map(lambda new, old: jnp.where(is_child, new, old), rejected_state, state)
    return (jnp.where(accepted, n, current), jnp.where(is_child, accepted, fresh), accepted_N.at[n].set(accepted),
            state_out)

  carry = (jnp.int32(-1), jnp.bool_(True), jnp.zeros((n_nodes,), bool), initial_state)
  current, fresh, accepted_N, state = jax.lax.fori_loop(0, n_nodes, body, carry)
  # fresh: no child of the current node was seen, it is a leaf (bonus from its target row); otherwise every child
  # was rejected (correction from the rule's residual). A residual without mass (rounding only) uses the target row.
  target_V = jax.lax.dynamic_index_in_dim(p_N1xV, current + 1, keepdims=False)
  residual_V = node_rule.correction(state)
  residual_V = jnp.where(jnp.isfinite(residual_V) & (residual_V > 0), residual_V, 0.0)
  use_target = fresh | ~jnp.any(residual_V > 0)
  next_token = sampling.sample_from_weights(key_next, jnp.where(use_target, target_V, residual_V))
  num_accepted = jnp.sum(accepted_N.astype(jnp.int32))
  return TreeVerifyResult(num_accepted, accepted_N, next_token)


# --- recursive rejection sampling ------------------------------------------------------------------------------

def _rrs_start(p_V, q_V, aux):
  del aux
  return (p_V, q_V)


def _rrs_accept_prob(state, x):
  p_V, q_V = state
  return clipped_ratio(1.0, _at(p_V, x), _at(q_V, x))


def _rrs_reject(state, x):
  """``p ← norm(max(p − q, 0))``; ``q`` unchanged (the next sibling is a fresh draw from the same row)."""
  p_V, q_V = state
  del x
  return (_normalised(jnp.maximum(p_V - q_V, 0.0), p_V), q_V)


def _rrs_wor_reject(state, x):
  """``p ← norm(max(p − q, 0))``, ``q ← norm(q with x removed)`` (the next sibling is drawn without ``x``)."""
  p_V, q_V = state
  p_next_V = _normalised(jnp.maximum(p_V - q_V, 0.0), p_V)
  q_removed_V = jnp.where(jnp.arange(q_V.shape[-1]) == x, 0.0, q_V)
  return (p_next_V, _normalised(q_removed_V, q_removed_V))


def _rrs_correction(state):
  return state[0]


def _point_mass_start(p_V, q_V, aux):
  del q_V, aux
  return (p_V,)


def _point_mass_accept_prob(state, x):
  return jnp.clip(_at(state[0], x), 0.0, 1.0)


def _point_mass_reject(state, x):
  """``p ← norm(p`` without ``x)``: ``norm(max(p − one_hot(x), 0))``."""
  p_V = state[0]
  return (_normalised(jnp.where(jnp.arange(p_V.shape[-1]) == x, 0.0, jnp.maximum(p_V, 0.0)), p_V),)


_RRS = _NodeRule(_rrs_start, _rrs_accept_prob, _rrs_reject, _rrs_correction, merge=True)
_POINT_MASS = _NodeRule(_point_mass_start, _point_mass_accept_prob, _point_mass_reject, _rrs_correction, merge=True)
_RRS_WOR = _NodeRule(_rrs_start, _rrs_accept_prob, _rrs_wor_reject, _rrs_correction)


def rrs_tree_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) -> TreeVerifyResult:
  """Recursive rejection sampling over siblings drawn i.i.d. WITH replacement (SpecInfer, multi-draft). Lossless.

  At a node with target row ``p`` and ordered children ``x_1..x_K ~ q`` i.i.d.: ``p_1 = p``; child ``x_k`` is
  accepted with probability ``min(1, p_k(x_k)/q(x_k))``, else ``p_{k+1} = norm(max(p_k − q, 0))``. An accepted child
  becomes the current node; if all K are rejected, ``Y ~ p_{K+1}``; an accepted leaf gives the bonus ``Y ~`` its
  target row.

  Why lossless: step ``k`` is one round of standard speculative sampling of ``p_k`` from the proposal ``q`` (a
  fresh, independent draw): it returns ``x_k`` (law ``min(p_k, q)``) or defers to ``p_{k+1}`` with probability
  ``1 − Σ min(p_k, q)``, and ``min(p_k, q) + (1 − Σ min(p_k, q)) p_{k+1} = p_k``. By induction from
  ``Y ~ p_{K+1}`` the selected token has law ``p_1 = p``. Which child is selected depends only on the tokens and
  coins, never on the subtrees, so the subtree of the selected child is a fresh draft given its token and the
  argument repeats.
  Duplicates need no special case: a rejected ``x`` had ``p_k(x) < q(x)``, so ``p_{k+1}(x) = 0`` and a later copy
  of ``x`` is rejected.

  Shared prefixes are merged (SpecInfer's token tree): the children of the current node are the children of every
  node with the same root-to-node tokens (:func:`prefix_classes`), in node order. On SpecTr's ``k`` i.i.d. chains
  that is every chain consistent with the accepted prefix, whose next tokens are i.i.d. draws from the drafter's row
  there, independent of everything the walk has read (each chain's continuation depends on its own prefix only):
  the argument above applies to them, however many they are.
  """
  return _walk(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, _RRS)


def rrs_wor_tree_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) -> TreeVerifyResult:
  """Recursive speculative decoding (RSD, Jeon et al., arXiv 2402.14160): siblings drawn WITHOUT replacement.

  ``p_1 = p``, ``q_1 = q``; child ``x_k`` is accepted with ``min(1, p_k(x_k)/q_k(x_k))``, else
  ``p_{k+1} = norm(max(p_k − q_k, 0))`` and ``q_{k+1} = norm(q_k`` with ``x_k`` removed``)``; all rejected →
  ``Y ~ p_{K+1}``. Lossless for the same reason as :func:`rrs_tree_verify`: sampling without replacement draws
  ``x_k ~ q_k`` given the earlier siblings, so step ``k`` is standard speculative sampling of ``p_k`` from ``q_k``.
  The tree must never hold more siblings than their row has tokens of positive probability.
  """
  return _walk(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, _RRS_WOR)


def point_mass_tree_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) -> TreeVerifyResult:
  """Recursive rejection sampling over FIXED siblings (``POINT_MASS`` trees: the p best paths of a lattice search, a
  top-b token tree), each child its own point mass ``q_k = one_hot(x_k)``. Lossless. ``draft_probs_NxV`` is not
  read (only checked for shape).

  At a node with target row ``p`` and ordered children ``x_1..x_K`` (those of every node with the same root-to-node
  tokens, :func:`prefix_classes`): ``p_1 = p``; child ``x_k`` is accepted with probability ``p_k(x_k)``, else
  ``p_{k+1} = norm(p_k`` without ``x_k)``; all rejected: ``Y ~ p_{K+1}``; an accepted leaf: ``Y ~`` its target row.

  Why lossless: step ``k`` is standard speculative sampling of ``p_k`` from the proposal ``one_hot(x_k)``: it returns
  ``x_k`` with probability ``min(p_k(x_k), 1) = p_k(x_k)`` or defers to ``norm(max(p_k − one_hot(x_k), 0)) =
  p_{k+1}``, and ``p_k(x_k)·one_hot(x_k) + (1 − p_k(x_k))·p_{k+1} = p_k``; by induction the selected token has law
  ``p``. The children are fixed before any coin of this node is thrown (a function of the context: the drafter
  draws nothing), so the argument holds for whatever tokens they are, and repeats in the selected child's subtree.
  A repeated child needs no special case: a rejected ``x`` has ``p_{k+1}(x) = 0``. At T = 0 (one-hot ``p``) the
  walk follows the target's argmax through the merged tree: the longest prefix any path shares with the target's
  greedy continuation is accepted.
  """
  return _walk(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, _POINT_MASS)


# --- SpecTr (k-sequential selection) ------------------------------------------------------------------------------

def _acceptance_mass(beta, k_f):
  """``1 − (1 − β)^k`` (probability that one of k candidates is accepted) without cancellation for small β."""
  return -jnp.expm1(k_f * jnp.log1p(-beta))


def _spectr_beta(p_V, q_V, rho):
  """``β(ρ) = Σ_x min(q(x), p(x)/ρ)`` in [0, 1]: the probability that one candidate ``x ~ q`` is accepted."""
  return jnp.clip(jnp.sum(jnp.minimum(q_V, p_V / rho)), 0.0, 1.0)


def spectr_rho(p_V, q_V, k, num_steps: int = _RHO_BISECTION_STEPS):
  """``(ρ, β(ρ), c)`` for k-sequential selection of ``k`` i.i.d. candidates from ``q`` targeting ``p`` (f32 scalars).

  ``ρ ∈ [1, max(k, 1)]`` solves ``1 − (1 − β(ρ))^k = ρ β(ρ)`` by bisection in ``num_steps`` (static) steps;
  ``c = (1 − (1 − β)^k)/β`` (``k`` when ``β = 0``).

  ``f(ρ) = 1 − (1 − β(ρ))^k − ρ β(ρ)`` is non-increasing in ρ (``β`` falls, ``ρβ = Σ min(ρq, p)`` rises),
  ``f(1) ≥ 0`` and ``f(k) ≤ 0`` (Bernoulli's inequality), and the rule is lossless for every ρ with ``f(ρ) ≤ 0``
  (that is ``c ≤ ρ``, which keeps the residual non-negative): the bisection keeps its upper end in that set and
  returns it, so a finite number of steps costs a little acceptance, never exactness. The root maximises
  acceptance among those ρ. ``ρ = 1`` when ``f(1) ≤ 0`` (k = 1, p = q, disjoint supports). Jittable; ``k`` may be
  traced (int, ``[]``).
  """
  p_V = jnp.asarray(p_V, jnp.float32)
  q_V = jnp.asarray(q_V, jnp.float32)
  k_f = jnp.maximum(jnp.asarray(k, jnp.float32), 1.0)

  def excess(rho):
    beta = _spectr_beta(p_V, q_V, rho)
    return _acceptance_mass(beta, k_f) - rho * beta

  def step(_, bounds):
    low, high = bounds
    middle = 0.5 * (low + high)
    valid = excess(middle) <= 0
    return jnp.where(valid, low, middle), jnp.where(valid, middle, high)

  _, high = jax.lax.fori_loop(0, num_steps, step, (jnp.float32(1.0), k_f))
  rho = jnp.where(excess(jnp.float32(1.0)) <= 0, jnp.float32(1.0), high)
  beta = _spectr_beta(p_V, q_V, rho)
  scale = jnp.where(beta > 0, _acceptance_mass(beta, k_f) / jnp.where(beta > 0, beta, 1.0), k_f)
  return rho, beta, scale


def _spectr_prepare(p_parent_NxV, q_NxV, siblings_N):
  """``(ρ, c)`` of every node's sibling group, all bisections at once (``[N]`` each; siblings get equal values)."""
  rho_N, _, scale_N = jax.vmap(spectr_rho)(p_parent_NxV, q_NxV, siblings_N)
  return rho_N, scale_N


def _spectr_start(p_V, q_V, aux):
  rho, scale = aux
  return (p_V, q_V, rho, scale)


def _spectr_accept_prob(state, x):
  p_V, q_V, rho, _ = state
  return clipped_ratio(1.0 / rho, _at(p_V, x), _at(q_V, x))


def _spectr_reject(state, x):
  del x
  return state


def _spectr_correction(state):
  """``p_res ∝ p − min(q, p/ρ) · c`` with ``c = (1 − (1 − β)^k)/β`` (mass ``(1 − β)^k``)."""
  p_V, q_V, rho, scale = state
  return p_V - jnp.minimum(q_V, p_V / rho) * scale


_SPECTR = _NodeRule(_spectr_start, _spectr_accept_prob, _spectr_reject, _spectr_correction, _spectr_prepare,
                    merge=True)


def spectr_tree_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) -> TreeVerifyResult:
  """SpecTr's k-sequential selection (Sun et al., NeurIPS 2023) at every node; siblings i.i.d. WITH replacement.

  At a node with target row ``p``, draft row ``q`` and ``k`` children ``x_1..x_k ~ q`` i.i.d., with ``ρ`` from
  :func:`spectr_rho`: the children are tried in order, ``x_i`` accepted with ``min(1, p(x_i)/(ρ q(x_i)))``; the
  first accepted becomes the current node; if all ``k`` are rejected, ``Y ~ p_res``,
  ``p_res(x) = [p(x) − min(q(x), p(x)/ρ) · c] / (1 − β)^k``, ``c = (1 − (1 − β)^k)/β``, ``β = β(ρ)``.

  Why lossless: one candidate is ``x`` and accepted with probability ``min(q(x), p(x)/ρ)`` (total ``β``), so the
  selected token is ``x`` with probability ``Σ_{i<k} (1 − β)^i min(q(x), p(x)/ρ) = c · min(q(x), p(x)/ρ)``, and
  none is accepted with probability ``(1 − β)^k``: adding ``(1 − β)^k p_res(x)`` gives ``p(x)``. ``p_res ≥ 0``
  because ``c ≤ ρ`` whenever ``f(ρ) ≤ 0`` (see :func:`spectr_rho`). The choice depends on tokens and coins only, so the
  selected child's subtree is a fresh draft. With ``k = 1``, ``ρ = 1``: token verification.

  Over every draft consistent with the accepted prefix (SpecTr's K-SEQ on merged prefixes): the children of the
  current node are those of its whole prefix class (:func:`prefix_classes`), ``k`` their number (the chains that
  share the prefix), i.i.d. from the drafter's row there as :func:`rrs_tree_verify` explains.
  """
  return _walk(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, _SPECTR)


# --- registry ----------------------------------------------------------------------------------------------------

#: name -> (fn, sampling): ``fn(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV) -> TreeVerifyResult``;
#: ``sampling`` is how the rule's trees must be drawn (:data:`WITH_REPLACEMENT`, :data:`WITHOUT_REPLACEMENT`, or
#: :data:`POINT_MASS`: not drawn at all).
#: Filled by ``verify.register`` from the registered tree verifiers (their one declaration); not edited by hand.
TREE_RULES: dict[str, tuple[Callable[..., TreeVerifyResult], str]] = {}


def _lookup(rule: str) -> tuple[Callable[..., TreeVerifyResult], str]:
  if not isinstance(rule, str) or rule not in TREE_RULES:
    raise ValueError(f"unknown tree verification rule {rule!r}; known rules: {', '.join(sorted(TREE_RULES))}")
  fn, mode = TREE_RULES[rule]
  if mode not in _SAMPLING_MODES:
    raise ValueError(f"tree rule {rule!r} is registered with sampling {mode!r}; expected one of {_SAMPLING_MODES}")
  return fn, mode


def tree_sampling(rule: str) -> str:
  """``"with_replacement"``, ``"without_replacement"`` or ``"point_mass"``: how siblings must be drawn for ``rule``
  to be lossless."""
  return _lookup(rule)[1]


def tree_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, *, rule: str) -> TreeVerifyResult:
  """Verify one tree with the rule registered as ``rule`` in :data:`TREE_RULES` (see the module docstring).

  ``rule`` is static (a Python string: ``functools.partial`` it before ``jax.jit``). Inputs are checked first
  (:func:`check_tree`); an unknown rule is a ``ValueError`` listing the known ones.
  """
  fn, _ = _lookup(rule)
  check_tree(tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)
  return fn(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)
