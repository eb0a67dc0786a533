"""Traversal verification of a draft tree (Weng et al., NeurIPS 2025, arXiv 2505.12398): pure, jittable, one tree.

Contract (the tree-rule contract of ``verify/tree.py``)::

    res = traversal_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)
    tokens_N           int    [N]       drafted token of node n
    parents_N          int    [N]       parent of node n: -1 = the root (the context c), else parents_N[n] < n; the
                                        children of a node are consecutive and in the order they were drawn
    draft_probs_NxV    float  [N, V]    M_s(.|c, path to parent(n)): the drafter row node n's *parent* context drew
                                        its children from (one row for all siblings, before any removal)
    target_probs_N1xV  float  [N+1, V]  row 0 = M_b(.|c), row n+1 = M_b(.|c, path to n)
    res.num_accepted   int32  []        depth of the accepted node (0: only the root, nothing accepted)
    res.accepted_N     bool   [N]       the accepted root-to-node chain
    res.next_token     int32  []        Y: the correction / bonus token drawn at the accepted node

The iteration emits the tokens of the accepted chain, then ``Y``. Batch with ``jax.vmap``; ``N`` and ``V`` are static.

The rule (notation of docs/ALGORITHMS.md §2; every context ``u`` — the root or a node — carries a current target row
``P_u``, a current drafter row ``Q_u`` for its children and, once one of its children was rejected, a fixed weight
``α_u``; initially ``P_u`` is the target row after ``u`` and ``Q_u`` the drafter row its children were drawn from)::

    α_root = 1,   α_n = min(1, α_{parent(n)} · P_{parent(n)}(x_n) / Q_{parent(n)}(x_n))   unless n has a fixed α_n
    visit the nodes in post-order (children in draw order before their parent), with a fresh η_n ~ U[0, 1) each:
      η_n < α_n:  accept the chain root → n, draw Y ~ P_n, stop
      otherwise:  delete n; at its parent u, with Q_u the law n was drawn from:
                    S   = Σ_x max(α_u P_u(x) − Q_u(x), 0)
                    P_u ← max(α_u P_u − Q_u, 0) / S
                    α_u ← S / (S + (1 − α_u))                                (0/0 := 1; fixed from now on)
                    Q_u ← Q_u without x_n, renormalised                      (the law of the next sibling)
    all nodes deleted: accept the root, Y ~ P_root

A node is visited only after its whole subtree was rejected, so a deep path is tried first and a rejected leaf does
not condemn its ancestors (top-down recursive rejection sampling drops a subtree as soon as its root is rejected).
``α_n`` is the sequence-level weight of the whole path (block verification's running ``w_i``), not a product of
token-level ratios.

Why it is lossless (an induction; tests/test_traversal.py checks it exactly by enumeration). Claim: the procedure on the
subtree of a context ``u`` with state ``(α_u, P_u, Q_u)`` accepts "``u``, then continuation ``s``" with probability
``α_u · P_u(s)`` (``P_u`` extended by the target beyond the tree) and rejects ``u`` with probability ``1 − α_u``. A
leaf does so by its coin. For the first remaining child ``x ~ Q_u``, by induction its subtree accepts a path through
``x`` with probability ``Q_u(x) α_x = min(α_u P_u(x), Q_u(x))`` followed by ``P_x``, and rejects with total
probability ``1 − α_u + S``. What is still owed is ``max(α_u P_u − Q_u, 0) = S · P_u'`` of acceptance and
``1 − α_u`` of rejection, i.e. after a rejection exactly the state ``(α_u', P_u')`` above — whatever ``x`` was,
provided ``Q_u'`` is the law the next sibling is drawn from. Hence siblings must be drawn **without replacement**
from ``M_s`` for :func:`traversal_verify` (removal and renormalisation of ``Q_u``); the same argument with ``Q_u``
left unchanged gives :func:`traversal_verify_with_replacement` for i.i.d. siblings. Mixing the two is biased. At the
root ``α = 1`` and nothing can reject it, so the emitted tokens have exactly the target law. On a chain the post-order
is X_γ, …, X_1 and the weights are block verification's ``w_i`` and ``h_i = Z_i / (Z_i + 1 − w_i)``, so the law (and,
for the same key, the outcome) is block verification's (the paper's Theorem 3.4; docs/ALGORITHMS.md §2).

Numerics follow ``verify/rules.py``: ``clipped_ratio`` never forms inf/NaN; a residual with zero mass (reachable only
through rounding or where it is never used) keeps the previous row, and ``Y`` falls back to the original target row
when its row has no positive finite mass. Garbage never leaves range: an invalid parent (not in ``[-1, n)``) counts
as -1, a token outside ``[0, V)`` has probability 0 under both models (never accepted), NaN rows reject their nodes,
and ``Y ∈ [0, V)`` always.

Cost: the post-order and the ancestor matrix take ``O(N² log N)``; each of the N visits costs ``O(N · depth)`` for
the weights plus a few passes over one ``[V]`` row pair at the visited node's parent (about as much as reading the
inputs once in all). The loop has a fixed trip count N (visits after the acceptance are masked no-ops) so that under
``jax.vmap`` the ``[N+1, V]`` rows are updated in place rather than selected between old and new at every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax import sampling
from blockspec_jax.verify.rules import clipped_ratio
from blockspec_jax.verify.tree import TreeVerifyResult, check_tree

__all__ = ["TreeVerifyResult", "traversal_verify", "traversal_verify_with_replacement",
           "tree_postorder"]


def _sanitised_parents(parents_N: jax.Array) -> jax.Array:
  """``parents_N`` as int32 with every entry outside ``[-1, n)`` replaced by -1 (so the nodes always form a tree)."""
  index_N = jnp.arange(parents_N.shape[0], dtype=jnp.int32)
  parents_N = jnp.asarray(parents_N).astype(jnp.int32)
  return jnp.where((parents_N >= -1) & (parents_N < index_N), parents_N, -1)


def _ancestors(parents_N: jax.Array) -> jax.Array:
  """``anc_NxN[i, j]``: node j is an ancestor of node i or i itself (bool). Pointer doubling, ``O(N² log N)``.

  After level r, ``anc`` holds the ancestors at distance ``< 2^r`` and ``jump`` the ``2^r``-th ancestor (index N
  stands for "above the root").
  """
  num_nodes = parents_N.shape[0]
  jump_N = jnp.where(parents_N >= 0, parents_N, num_nodes)
  anc_NxN = jnp.eye(num_nodes, dtype=bool)
  for _ in range((num_nodes - 1).bit_length()):  # 2^levels > N - 1 >= the largest distance
    anc_ext_N1xN = jnp.concatenate([anc_NxN, jnp.zeros((1, num_nodes), bool)])
    jump_ext_N1 = jnp.concatenate([jump_N, jnp.full((1,), num_nodes, jnp.int32)])
    anc_NxN = anc_NxN | anc_ext_N1xN[jump_N]
    jump_N = jump_ext_N1[jump_N]
  return anc_NxN


def tree_postorder(parents_N: jax.Array) -> jax.Array:
  """Post-order of the nodes (children in index order, each before its parent): int32 ``[N]``, a permutation.

  ``post(v) = #descendants(v) + Σ_{b ancestor-or-self of v} Σ_{a earlier sibling of b} size(a)``. Invalid parents
  are read as -1 (see the module docstring). Jittable; ``O(N² log N)``.
  """
  parents_N = _sanitised_parents(parents_N)
  return _postorder(parents_N, _ancestors(parents_N))


def _postorder(parents_N, anc_NxN) -> jax.Array:
  num_nodes = parents_N.shape[0]
  index_N = jnp.arange(num_nodes, dtype=jnp.int32)
  size_N = jnp.sum(anc_NxN, axis=0, dtype=jnp.int32)
  earlier_sibling_NxN = (parents_N[:, None] == parents_N[None, :]) & (index_N[:, None] < index_N[None, :])
  before_N = jnp.sum(jnp.where(earlier_sibling_NxN, size_N[:, None], 0), axis=0)
  rank_N = (size_N - 1) + jnp.sum(jnp.where(anc_NxN, before_N[None, :], 0), axis=1)
  return jnp.argsort(rank_N, stable=True).astype(jnp.int32)


@struct.dataclass
class _State:
  """Loop state of the traversal (one tree)."""
  accepted: jax.Array       # int32 []       accepted node, -1 while none (and for the root)
  done: jax.Array           # bool []        a node was accepted
  deleted_N: jax.Array      # bool [N]       rejected nodes
  rows_N1xV: jax.Array      # f32 [N+1, V]   current target rows P_u (row 0 the root, n+1 node n)
  p_tok_N: jax.Array        # f32 [N]        P_{parent(n)}(x_n) under the current row of the parent
  q_tok_N: jax.Array        # f32 [N]        Q_{parent(n)}(x_n), the law x_n was drawn from
  fixed_alpha_N: jax.Array  # f32 [N]        α_n once a child of n was rejected
  is_fixed_N: jax.Array     # bool [N]


def _path_weights(state: _State, parents_N, max_depth) -> jax.Array:
  """Current ``α_n`` of every node, f32 ``[N]``: the fixed value where set, else the clipped running ratio.

  ``max_depth`` rounds of ``α_n ← min(1, α_{parent} P(x_n)/Q(x_n))`` settle every level (the root's α is 1, fixed
  nodes are constants); rejected nodes get values that are never read.
  """
  def round_(_, alpha_N):
    alpha_parent_N = jnp.where(parents_N >= 0, alpha_N[jnp.maximum(parents_N, 0)], 1.0)
    return jnp.where(state.is_fixed_N, state.fixed_alpha_N, clipped_ratio(alpha_parent_N, state.p_tok_N,
                                                                           state.q_tok_N))
  return jax.lax.fori_loop(0, max_depth, round_, jnp.ones_like(state.p_tok_N))


def _traversal_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, coins, without_replacement):
  num_nodes, vocab = check_tree(tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)
  tokens_N = jnp.asarray(tokens_N).astype(jnp.int32)
  parents_N = _sanitised_parents(parents_N)
  q_NxV = jnp.asarray(draft_probs_NxV, jnp.float32)
  p_N1xV = jnp.asarray(target_probs_N1xV, jnp.float32)
  key_coins, key_next = jax.random.split(key)
  if coins is None:
    eta_N = jax.random.uniform(key_coins, (num_nodes,), jnp.float32)
  else:
    eta_N = jnp.asarray(coins, jnp.float32)
    if eta_N.shape != (num_nodes,):
      raise ValueError(f"coins must have shape [N] = ({num_nodes},) (the coin of each node), got {eta_N.shape}")

  anc_NxN = _ancestors(parents_N)
  depth_N = jnp.sum(anc_NxN, axis=1, dtype=jnp.int32)
  max_depth = jnp.max(depth_N)
  order_N = _postorder(parents_N, anc_NxN)
  valid_tok_N = (tokens_N >= 0) & (tokens_N < vocab)
  safe_tok_N = jnp.clip(tokens_N, 0, vocab - 1)
  drop_tok_N = jnp.where(valid_tok_N, tokens_N, vocab)  # scatter index that is dropped for an invalid token

  q_raw_tok_N = jnp.where(valid_tok_N, q_NxV[jnp.arange(num_nodes), safe_tok_N], 0.0)  # q_{parent(n)}(x_n) as drawn
  same_token_NxN = (tokens_N[:, None] == tokens_N[None, :]) & valid_tok_N[:, None] & valid_tok_N[None, :]

  def kept_mass(q_row_V, remove_N):
    """``(Σ_x q_row(x) over tokens not removed, whether any valid token is removed)`` for the nodes in remove_N."""
    removed_V = jnp.zeros((vocab,), bool).at[jnp.where(remove_N, drop_tok_N, vocab)].set(True, mode="drop")
    return jnp.sum(jnp.where(removed_V, 0.0, q_row_V)), removed_V

  def body(step, state: _State) -> _State:
    # A fixed trip count with finished trees masked: under vmap a while_loop with a per-row predicate would select
    # between old and new for every carried array, i.e. copy all N + 1 target rows at every step.
    v = order_N[step]
    alpha_N = _path_weights(state, parents_N, max_depth)
    active = ~state.done
    accept = active & (eta_N[v] < alpha_N[v])
    reject = active & ~accept
    # Rejection of v: update its parent u (context row u + 1; the root is u = -1 with α = 1).
    u = parents_N[v]
    alpha_u = jnp.where(u >= 0, alpha_N[jnp.maximum(u, 0)], 1.0)
    siblings_N = parents_N == u
    q_row_V = q_NxV[v]
    if without_replacement:
      earlier_N = siblings_N & state.deleted_N  # the siblings drawn before v: all rejected by now
      kept_before, removed_V = kept_mass(q_row_V, earlier_N)
      q_before_V = jnp.where(removed_V, 0.0, q_row_V) / jnp.where(kept_before > 0, kept_before, 1.0)
      q_before_V = jnp.where(jnp.any(removed_V), q_before_V, q_row_V)
      removed_after_N = earlier_N | (jnp.arange(num_nodes) == v)
      kept_after, removed_after_V = kept_mass(q_row_V, removed_after_N)
      gone_N = jnp.any(same_token_NxN & removed_after_N[None, :], axis=1)  # token removed from Q_u
      q_after_tok_N = jnp.where(gone_N, 0.0, q_raw_tok_N / jnp.where(kept_after > 0, kept_after, 1.0))
      q_after_tok_N = jnp.where(jnp.any(removed_after_V), q_after_tok_N, q_raw_tok_N)
    else:
      q_before_V, q_after_tok_N = q_row_V, state.q_tok_N
    p_row_V = state.rows_N1xV[u + 1]
    residual_V = jnp.maximum(alpha_u * p_row_V - q_before_V, 0.0)
    mass = jnp.sum(residual_V)
    safe_mass = jnp.where(mass > 0, mass, 1.0)
    new_row_V = jnp.where(mass > 0, residual_V / safe_mass, p_row_V)
    # The children's entries of the new rows, from the carried scalars (p_tok_N and q_tok_N hold P_u and Q_u at the
    # siblings' tokens): reading them from new_row_V inside the loop would make XLA copy the [N+1, V] buffer.
    new_p_tok_N = jnp.where(mass > 0, jnp.maximum(alpha_u * state.p_tok_N - state.q_tok_N, 0.0) / safe_mass,
                            state.p_tok_N)
    denominator = mass + (1.0 - alpha_u)
    new_alpha_u = jnp.where(denominator > 0, mass / jnp.where(denominator > 0, denominator, 1.0), 1.0)
    update_N = siblings_N & reject
    fix_u = (u >= 0) & reject
    u_safe = jnp.maximum(u, 0)
    return _State(
        accepted=jnp.where(accept, v, state.accepted),
        done=state.done | accept,
        deleted_N=state.deleted_N.at[v].set(state.deleted_N[v] | reject),
        rows_N1xV=state.rows_N1xV.at[u + 1].set(jnp.where(reject, new_row_V, p_row_V)),
        p_tok_N=jnp.where(update_N, new_p_tok_N, state.p_tok_N),
        q_tok_N=jnp.where(update_N, q_after_tok_N, state.q_tok_N),
        fixed_alpha_N=state.fixed_alpha_N.at[u_safe].set(jnp.where(fix_u, new_alpha_u, state.fixed_alpha_N[u_safe])),
        is_fixed_N=state.is_fixed_N.at[u_safe].set(state.is_fixed_N[u_safe] | fix_u))

  parent_rows_N = parents_N + 1
  init = _State(
      accepted=jnp.int32(-1), done=jnp.bool_(False),
      deleted_N=jnp.zeros((num_nodes,), bool), rows_N1xV=p_N1xV,
      p_tok_N=jnp.where(valid_tok_N, p_N1xV[parent_rows_N, safe_tok_N], 0.0),
      q_tok_N=q_raw_tok_N,
      fixed_alpha_N=jnp.ones((num_nodes,), jnp.float32), is_fixed_N=jnp.zeros((num_nodes,), bool))
  final = jax.lax.fori_loop(0, num_nodes, body, init)

  accepted = final.accepted  # -1: every node was rejected, the root is accepted
  is_node = accepted >= 0
  accepted_N = is_node & anc_NxN[jnp.maximum(accepted, 0)]
  num_accepted = jnp.where(is_node, depth_N[jnp.maximum(accepted, 0)], 0).astype(jnp.int32)
  y_row_V = final.rows_N1xV[accepted + 1]
  has_mass = jnp.any(jnp.isfinite(y_row_V) & (y_row_V > 0))
  next_token = sampling.sample_from_weights(key_next, jnp.where(has_mass, y_row_V, p_N1xV[accepted + 1]))
  return TreeVerifyResult(num_accepted, accepted_N, next_token)


def traversal_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, coins=None) -> TreeVerifyResult:
  """Traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398). Lossless for trees whose siblings were
  drawn **without replacement** (each next sibling from ``M_s`` with the earlier siblings' tokens removed).

  Post-order traversal with sequence-level weights; a rejected node passes the residual
  ``norm(max(α_u P_u − Q_u, 0))``, the weight ``S / (S + 1 − α_u)`` and ``Q_u`` without its token to its parent
  (module docstring). ``coins`` optionally supplies ``η`` per node (``[N]``; node n's coin is used when n is
  visited); by default they come from ``key``. On a chain, the same key gives block verification's outcome.
  """
  return _traversal_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, coins, True)


def traversal_verify_with_replacement(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV,
                                      coins=None) -> TreeVerifyResult:
  """:func:`traversal_verify` for trees whose siblings are drawn **i.i.d.** from ``M_s`` (with replacement).

  Not in the paper: the same rule with ``Q_u`` left unchanged after a rejection, lossless by the same argument (the
  next sibling's law is still ``Q_u``). Equal to :func:`traversal_verify` on chains.
  """
  return _traversal_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV, coins, False)
