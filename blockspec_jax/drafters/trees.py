"""Tree drafters on one small model: SpecTr's k i.i.d. chains, RSD-C (constant branching, Gumbel-top-k without
replacement) and RSD-S (stochastic beam search), all on the :class:`~blockspec_jax.contracts.Drafter`
contract.

Layout (every drafter): nodes depth-major, ``w_d`` nodes at depth ``d`` stored at indices ``off_d .. off_d + w_d − 1``,
each depth's nodes grouped by parent and, within a parent, in draw order (so siblings are consecutive and parents
come first: the layout :func:`blockspec_jax.verify.tree_verify` requires). One drafter forward per depth feeds that
depth's nodes at once (rotary position ``length − 1 + d``, cache slot ``length + n``, attending to the committed slots
and to its own root-to-node path: :mod:`blockspec_jax.contracts`), except the deepest, whose rows nobody
needs; where every depth has the same width the depths run in a ``lax.scan`` (one forward compiled). ``q`` row of
node ``n`` = the law of its parent's context (after ``sampler``), the row its siblings were drawn from. ``commit`` moves the accepted path's entries into contiguous slots (the path commit) so the drafter's cache is
the one an autoregressive pass over the committed tokens would leave, up to the deepest accepted node when it is a
leaf of depth γ (never fed, like the last token of :class:`~blockspec_jax.drafters.base.ModelDrafter`'s chain); the
next ``propose`` re-feeds the last two committed tokens, which covers it.

Zero-probability children. Without-replacement drafters (RSD-C, RSD-S) draw from and report
``q_ε = (1 − ε)·q + ε/V`` (``ε = 1e-6`` by default). At T = 0, under top-k / top-p, a row may have fewer tokens of
positive mass than children are asked for; Gumbel-top-k would then fill the remaining children with tokens of
probability 0, which is outside what the without-replacement rules accept ("never more siblings than the row has
tokens of positive probability", :mod:`blockspec_jax.verify.tree`): once the positive tokens are exhausted the
residual drafter row is 0 and :func:`~blockspec_jax.verify.rules.clipped_ratio` accepts a child with ``q = 0`` and
``p > 0`` with probability 1, so a deterministic filler token would be emitted with the wrong law. Marking such
children with an out-of-vocabulary id instead would break the ``[0, V)`` token contract and the drafter's own forward.
With ``q_ε`` every token has positive mass, every child is a legal without-replacement draw, and the rows the verifier
sees are exactly the laws used: decoding is lossless (the output law is the target's, whatever the drafter's law) and
acceptance changes by O(ε). (The i.i.d. k-chain drafter needs no smoothing: i.i.d. siblings may repeat.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import sampling
from blockspec_jax.contracts import WITH_REPLACEMENT, WITHOUT_REPLACEMENT, Commit, Draft, path_slots
from blockspec_jax.drafters.base import ModelDrafter, feed
from blockspec_jax.drafters.registry import register
from blockspec_jax.drafters.settings import check_count, is_int

__all__ = ["KChainDrafter", "RSDConstantDrafter", "RSDStochasticBeamDrafter", "gumbel_top_k"]

def gumbel_top_k(key_B, log_weights_BxWxV: jax.Array, k: int):
  """Indices ``[B, W, k]`` of ``k`` draws without replacement from each row ``∝ exp(log_weights)``, in draw order
  (the top-k of ``log_weights + Gumbel``; one key per batch row)."""
  _, width, vocab = log_weights_BxWxV.shape
  noise_BxWxV = jax.vmap(lambda key: jax.random.gumbel(key, (width, vocab), jnp.float32))(key_B)
  _, top_BxWxK = jax.lax.top_k(log_weights_BxWxV + noise_BxWxV, k)
  return top_BxWxK.astype(jnp.int32)


def _check_epsilon(epsilon) -> float:
  if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.floating)) or not 0.0 < epsilon < 1.0:
    raise ValueError(f"epsilon must be in (0, 1) (the without-replacement drafters' smoothing), got {epsilon!r}")
  return epsilon


def _smoothed(q_BxWxV: jax.Array, epsilon: float) -> jax.Array:
  """``q_ε = (1 − ε)·q + ε/V`` (f32, same shape): every token gets positive mass (see the module docstring)."""
  vocab = q_BxWxV.shape[-1]
  return (1.0 - epsilon) * q_BxWxV + epsilon / vocab


def _log1mexp(x):
  """``log(1 − exp(x))`` for ``x ≤ 0``, stable at both ends."""
  x = jnp.minimum(x, -1e-30)
  return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def conditioned_scores(g_BxKxV: jax.Array, score_BxK: jax.Array) -> jax.Array:
  """Kool et al.'s conditioned perturbed scores ``G̃ = −log(e^{−T_u} − e^{−Z_u} + e^{−g})`` in a stable form
  (``G̃ = T − max(v, 0) − log1p(e^{−|v|})``, ``v = T − g + log1mexp(g − Z)``), f32 ``[B, K, V]``.

  ``g`` = perturbed log-probabilities of the continuations of beam ``u`` (score ``T_u``), ``Z_u = max g``. Dead
  candidates (``g = −inf``: a zero-probability token or a dead parent, possible at T = 0 or under top-k / top-p)
  get ``−inf`` without ever forming ``−inf − (−inf)``.
  """
  z_BxK = jnp.max(g_BxKxV, axis=-1)
  alive_BxKxV = (g_BxKxV > -jnp.inf) & (score_BxK[:, :, None] > -jnp.inf)
  g_BxKxV = jnp.where(alive_BxKxV, g_BxKxV, 0.0)
  z_BxK = jnp.where(z_BxK > -jnp.inf, z_BxK, 0.0)
  t_BxK = jnp.where(score_BxK > -jnp.inf, score_BxK, 0.0)
  v_BxKxV = t_BxK[:, :, None] - g_BxKxV + _log1mexp(g_BxKxV - z_BxK[:, :, None])
  cond_BxKxV = t_BxK[:, :, None] - jax.nn.relu(v_BxKxV) - jnp.log1p(jnp.exp(-jnp.abs(v_BxKxV)))
  return jnp.where(alive_BxKxV, cond_BxKxV, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class _TreeModelDrafter(ModelDrafter):
  """Shared machinery (the model, its declared sizes and its prefill come from :class:`ModelDrafter`): per-depth
  growth with tree-masked feeding, path commit. Subclasses define ``widths(gamma)`` (nodes per depth) and
  ``_children(key_B, rows_BxWxV, carry, depth) -> (parent_BxC, tokens_BxC, rows_BxWxV, carry)``: the ``C`` nodes of
  depth ``depth`` drawn from the rows of the ``W`` nodes of depth ``depth − 1`` (depth 1: the root, ``W = 1``), their
  parents as indices in ``[0, W)`` grouped and in draw order, and the rows they were drawn from (after any
  smoothing). ``depth`` is static; under the scan (constant widths) it is 2 for every depth ≥ 2, which draw alike."""

  is_chain = False

  def widths(self, gamma: int) -> tuple[int, ...]:
    raise NotImplementedError

  def num_nodes(self, gamma: int) -> int:
    return int(sum(self.widths(gamma)))

  def _start(self, root_rows_Bx1xV):
    return None

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler: sampling.Sampler):
    """``(cache, Draft)``: ``tokens_BxN`` / ``parents_BxN`` int32 ``[B, N]`` (``N = num_nodes(gamma)``), ``q_BxNxV``
    f32 ``[B, N, V]`` (row n = the law node n and its siblings were drawn from). ``tokens_BxS`` int32 ``[B, S]``
    (``S`` = the cache's slots, ``≥ length + N``), ``length_B`` int32 ``[B]``, ``key_B`` one key per row.

    One forward of the last two committed tokens (the root's row), then one per depth but the deepest, each feeding
    all nodes of that depth at once: γ forwards. Where every depth has the same width (k-chains, RSD-S) the depths
    run in a ``lax.scan`` (one forward compiled, as :class:`ModelDrafter` does); RSD-C's widths differ, its depths
    are unrolled."""
    widths = self.widths(gamma)
    n_nodes = int(sum(widths))
    module = self.module
    batch, cache_len = tokens_BxS.shape
    rows_B = jnp.arange(batch)
    positions_Bx2 = jnp.maximum(length_B[:, None] + jnp.array([[-2, -1]]), 0)
    logits_Bx2xV, cache = feed(module, params, tokens_BxS[rows_B[:, None], positions_Bx2], positions_Bx2, state,
                               cache_len)
    root_rows_Bx1xV = sampler.probs(logits_Bx2xV[:, -1:])
    keys_DxB = jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, gamma))(key_B), 0, 1)
    parent_BxW, tokens_BxW, root_q_Bx1xV, carry = self._children(keys_DxB[0], root_rows_Bx1xV,
                                                                  self._start(root_rows_Bx1xV), 1)
    node_N = jnp.arange(n_nodes, dtype=jnp.int32)
    anc_BxWxN = jnp.broadcast_to(node_N[None, None, :] == jnp.arange(widths[0])[None, :, None],
                                 (batch, widths[0], n_nodes))  # ancestors-or-self of this depth's nodes
    slots_S = jnp.arange(cache_len, dtype=jnp.int32)
    committed_BxS = slots_S[None, :] < length_B[:, None]
    tree_BxS = slots_S[None, :] - length_B[:, None]  # node index of each slot (valid where in [0, N))
    in_tree_BxS = (tree_BxS >= 0) & (tree_BxS < n_nodes)
    tree_BxS = jnp.clip(tree_BxS, 0, n_nodes - 1)

    def grow(cache, tokens_BxW, anc_BxWxN, carry, offset, key_B, depth, width, next_width):
      """Feed depth ``depth − 1``'s ``width`` nodes (indices ``offset ..``), draw depth ``depth``'s ``next_width``."""
      nodes_BxW = jnp.broadcast_to(offset + jnp.arange(width, dtype=jnp.int32), (batch, width))
      sees_BxWxS = jnp.take_along_axis(anc_BxWxN, jnp.broadcast_to(tree_BxS[:, None, :], (batch, width, cache_len)),
                                       axis=2) & in_tree_BxS[:, None, :]
      positions_BxW = jnp.broadcast_to(length_B[:, None] + jnp.sum(anc_BxWxN, axis=2, dtype=jnp.int32) - 1,
                                       (batch, width))
      mask_BxWxS = committed_BxS[:, None, :] | sees_BxWxS
      logits_BxWxV, cache = module.apply({"params": params}, tokens_BxW, positions_BxW, cache, mask_BxWxS,
                                         slots_BxT=length_B[:, None] + nodes_BxW)
      rows_BxWxV = sampler.probs(logits_BxWxV.astype(jnp.float32))
      parent_BxC, tokens_BxC, rows_BxWxV, carry = self._children(key_B, rows_BxWxV, carry, depth)
      q_BxCxV = jnp.take_along_axis(rows_BxWxV, parent_BxC[:, :, None], axis=1)
      next_nodes_C = offset + width + jnp.arange(next_width, dtype=jnp.int32)
      anc_BxCxN = (jnp.take_along_axis(anc_BxWxN, parent_BxC[:, :, None], axis=1)
                   | (node_N[None, None, :] == next_nodes_C[None, :, None]))
      return cache, tokens_BxC, anc_BxCxN, carry, offset + parent_BxC, q_BxCxV

    tokens = [tokens_BxW]
    parents = [jnp.full((batch, widths[0]), -1, jnp.int32)]
    q_rows = [jnp.take_along_axis(root_q_Bx1xV, parent_BxW[:, :, None], axis=1)]
    if gamma > 1 and len(set(widths)) == 1:  # constant width: scan the depths (one forward compiled)
      width = widths[0]

      def step(scan_carry, xs):
        cache, tokens_BxW, anc_BxWxN, carry = scan_carry
        offset, key_B = xs
        cache, tokens_BxW, anc_BxWxN, carry, parent_BxW, q_BxWxV = grow(cache, tokens_BxW, anc_BxWxN, carry, offset,
                                                                       key_B, 2, width, width)
        return (cache, tokens_BxW, anc_BxWxN, carry), (tokens_BxW, parent_BxW, q_BxWxV)

      offsets_D = width * jnp.arange(gamma - 1, dtype=jnp.int32)
      (cache, _, _, _), (tokens_DxBxW, parents_DxBxW, q_DxBxWxV) = jax.lax.scan(
          step, (cache, tokens_BxW, anc_BxWxN, carry), (offsets_D, keys_DxB[1:]))
      tokens.append(jnp.swapaxes(tokens_DxBxW, 0, 1).reshape(batch, -1))
      parents.append(jnp.swapaxes(parents_DxBxW, 0, 1).reshape(batch, -1))
      q_rows.append(jnp.swapaxes(q_DxBxWxV, 0, 1).reshape(batch, n_nodes - width, -1))
    else:
      offset = 0
      for d in range(1, gamma):
        cache, tokens_BxW, anc_BxWxN, carry, parent_BxW, q_BxWxV = grow(
            cache, tokens_BxW, anc_BxWxN, carry, offset, keys_DxB[d], d + 1, widths[d - 1], widths[d])
        tokens.append(tokens_BxW)
        parents.append(parent_BxW)
        q_rows.append(q_BxWxV)
        offset += widths[d - 1]
    draft = Draft(jnp.concatenate(tokens, axis=1).astype(jnp.int32),
                  jnp.concatenate(parents, axis=1).astype(jnp.int32), jnp.concatenate(q_rows, axis=1))
    return cache, draft

  def commit(self, params, state, commit: Commit):
    """The path commit: the accepted path's entries move from slots ``old_length + path[i]`` to ``old_length + i``."""
    del params
    return state.move_slots(*path_slots(commit.old_length_B, commit.path_BxG, commit.num_accepted_B))


@register("k_chains")
@dataclasses.dataclass(frozen=True)
class KChainDrafter(_TreeModelDrafter):
  """SpecTr's draft (Sun et al. 2023): ``k`` i.i.d. chains of length γ (``N = kγ``). Depth-major layout: nodes
  ``0 .. k − 1`` are the root's children (drawn i.i.d. WITH replacement from the root row: chains may share tokens),
  node ``dk + c`` is chain ``c``'s node at depth ``d + 1``, child of node ``(d − 1)k + c``. Verify with ``"spectr"`` or
  ``"rrs"``. With ``k = 1`` the draft is ModelDrafter's chain (same tokens and rows at T = 0, same law otherwise);
  ``is_chain`` stays False (the loop then uses the tree mask, which on a chain is the causal one)."""

  k: int = 2
  sibling_sampling = WITH_REPLACEMENT

  @classmethod
  def budget_shape(cls, budget, branches=2):
    """``k = branches`` chains of depth ``budget / branches``."""
    return {"k": int(branches)}, cls._budget_depth(budget, branches)

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    if not is_int(values["k"], 1):
      raise ValueError(f"k_chains needs an integer number of chains k >= 1, got {values['k']!r}")
    return {**values, "k": int(values["k"])}

  def widths(self, gamma):
    return (self.k,) * gamma

  def _children(self, key_B, rows_BxWxV, carry, depth):
    batch = rows_BxWxV.shape[0]
    parent_BxK = (jnp.zeros((batch, self.k), jnp.int32) if depth == 1
                  else jnp.broadcast_to(jnp.arange(self.k, dtype=jnp.int32), (batch, self.k)))
    chain_rows_BxKxV = jnp.take_along_axis(rows_BxWxV, parent_BxK[:, :, None], axis=1)
    keys_BxK = jax.vmap(lambda k: jax.random.split(k, self.k))(key_B)
    tokens_BxK = jax.vmap(jax.vmap(sampling.sample))(keys_BxK, chain_rows_BxKxV)
    return parent_BxK, tokens_BxK.astype(jnp.int32), rows_BxWxV, carry


@register("rsd_c")
@dataclasses.dataclass(frozen=True)
class RSDConstantDrafter(_TreeModelDrafter):
  """RSD-C (Jeon et al., arXiv 2402.14160): every node at depth ``d − 1`` gets ``branching[d − 1]`` children drawn
  WITHOUT replacement from its row ``q_ε`` (Gumbel-top-k: the top-k of ``log q_ε + Gumbel`` is an ordered sequential
  sample without replacement), stored in draw order. γ must equal ``len(branching)``;
  ``N = Σ_d Π_{j≤d} b_j``. Verify with ``"rrs_wor"`` or ``"traversal"`` (both lossless for children drawn this way;
  ``q_ε`` rows keep every child a legal draw, see the module docstring)."""

  branching: tuple[int, ...] = (2, 1)
  epsilon: float = 1e-6
  sibling_sampling = WITHOUT_REPLACEMENT

  @classmethod
  def budget_shape(cls, budget, branches=2):
    """Branching ``(branches, 1, …, 1)`` of depth ``budget / branches``: SpecTr's k chains' shape, drawn without
    replacement (the two compare sampling with and without replacement at one shape and depth)."""
    depth = cls._budget_depth(budget, branches)
    return {"branching": (int(branches),) + (1,) * (depth - 1)}, depth

  @classmethod
  def default_settings(cls, gamma):
    """Its depth is its shape: without a ``branching`` setting a job's RSD-C gets ``(2, 1, …, 1)`` of depth γ."""
    return cls.budget_shape(2 * gamma)[0]

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    try:
      b = tuple(values["branching"])
    except TypeError:
      b = ()
    if not b or any(not is_int(x, 1) for x in b):
      raise ValueError(f"rsd_c branching must be a non-empty tuple of integers >= 1 (children per node at each "
                       f"depth), got {values['branching']!r}")
    if config is not None and max(b) > config.vocab_size:
      raise ValueError(f"rsd_c branching {b} asks for more distinct children than the V = {config.vocab_size} "
                       "tokens")
    return {**values, "branching": tuple(int(x) for x in b), "epsilon": _check_epsilon(values["epsilon"])}

  def widths(self, gamma):
    if gamma != len(self.branching):
      raise ValueError(f"rsd_c with branching {self.branching} drafts depth {len(self.branching)}; gamma is {gamma} "
                       "(set gamma = len(branching))")
    return tuple(int(np.prod(self.branching[:d])) for d in range(1, gamma + 1))

  def _children(self, key_B, rows_BxWxV, carry, depth):
    b = self.branching[depth - 1]  # under the scan (branching (b, 1, …, 1)) depth 2 stands for every depth ≥ 2
    batch, width, _ = rows_BxWxV.shape
    rows_BxWxV = _smoothed(rows_BxWxV, self.epsilon)
    top_BxWxb = gumbel_top_k(key_B, jnp.log(rows_BxWxV), b)
    tokens_BxWb = top_BxWxb.reshape(batch, width * b)
    parent_BxWb = jnp.broadcast_to(jnp.repeat(jnp.arange(width, dtype=jnp.int32), b), (batch, width * b))
    return parent_BxWb, tokens_BxWb, rows_BxWxV, carry


@register("rsd_s")
@dataclasses.dataclass(frozen=True)
class RSDStochasticBeamDrafter(_TreeModelDrafter):
  """RSD-S (Jeon et al., arXiv 2402.14160): stochastic beam search (Kool et al., ICML 2019) of width ``W`` over γ
  depths (``N = Wγ``) on the rows ``q_ε``. Depth 1: the root's Gumbel-top-W children. Depth d: every kept beam ``u``
  (score ``T_u``, log-probability ``φ_u``) perturbs its continuations, ``g = φ_u + log q_ε(x) + Gumbel``,
  ``Z_u = max g``, conditions them on their maximum being ``T_u``: ``G̃ = −log(e^{−T_u} − e^{−Z_u} + e^{−g})``
  (Kool et al.'s stable form), and the W best ``G̃`` over all beams are kept. Nodes at depth d are those W beams,
  grouped by parent (parents in depth d − 1's order), within a parent in decreasing ``G̃``. By Kool et al., the
  depth-d beams are a without-replacement sample of W length-d sequences from the drafter's sequence law.

  Why ``rrs_wor`` / ``traversal`` stay lossless although a beam keeps a random number of children. In exponential-
  race terms ``e^{−G̃} = e^{−T_u} + (e^{−g} − e^{−Z_u})``: beam ``u``'s children arrive at the times of an exponential
  race with rates ``∝ q_ε(x | u)``, started at ``u``'s own arrival ``e^{−T_u}``, and the kept beams are the W earliest
  arrivals of all races. Within one race the arrival order is a sequential sample without replacement (the kept
  children, in stored order, are a prefix of it), and by memorylessness the time of the i-th arrival is independent of
  which token arrives i-th, given the earlier arrivals. Whether ``u`` keeps an i-th child depends only on arrival
  times (its own and other beams'), so conditioning on its existence does not bias its token: given the earlier
  siblings it is distributed as ``q_ε`` without them, which is all the rules' induction over siblings needs (the
  number of siblings may depend on anything else, including the earlier siblings' tokens). The χ² law tests through
  the loop (tests/test_engine_trees.py) run these pairings."""

  width: int = 2
  epsilon: float = 1e-6
  sibling_sampling = WITHOUT_REPLACEMENT

  @classmethod
  def budget_shape(cls, budget, branches=2):
    """``width = branches`` beams over depth ``budget / branches`` (the beams may share prefixes, so the tree is as
    deep as RSD-C's but narrower near the root)."""
    return {"width": int(branches)}, cls._budget_depth(budget, branches)

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    return {**values, "width": check_count(values["width"], config, "rsd_s width"),
            "epsilon": _check_epsilon(values["epsilon"])}

  def widths(self, gamma):
    return (self.width,) * gamma

  def _start(self, root_q_Bx1xV):
    batch = root_q_Bx1xV.shape[0]
    return (jnp.zeros((batch, 1), jnp.float32), jnp.zeros((batch, 1), jnp.float32))  # log prob φ, score G̃

  def _children(self, key_B, rows_BxWxV, carry, depth):
    logp_BxW, score_BxW = carry
    batch, beams, vocab = rows_BxWxV.shape
    rows_BxWxV = _smoothed(rows_BxWxV, self.epsilon)
    phi_BxWxV = logp_BxW[:, :, None] + jnp.log(rows_BxWxV)
    g_BxWxV = phi_BxWxV + jax.vmap(lambda k: jax.random.gumbel(k, (beams, vocab), jnp.float32))(key_B)
    if depth == 1:
      cond_BxWxV = g_BxWxV  # one root beam: its unconditioned Gumbels (the root's score is their maximum)
    else:
      cond_BxWxV = conditioned_scores(g_BxWxV, score_BxW)  # Kool et al., appendix B
    best_BxW, flat_BxW = jax.lax.top_k(cond_BxWxV.reshape(batch, beams * vocab), self.width)
    parent_BxW = (flat_BxW // vocab).astype(jnp.int32)
    # Group by parent; the sort is stable, so within a parent the order stays decreasing G̃ (its Gumbel order).
    order_BxW = jnp.argsort(parent_BxW, axis=1, stable=True)
    flat_BxW = jnp.take_along_axis(flat_BxW, order_BxW, axis=1)
    best_BxW = jnp.take_along_axis(best_BxW, order_BxW, axis=1)
    parent_BxW = (flat_BxW // vocab).astype(jnp.int32)
    tokens_BxW = (flat_BxW % vocab).astype(jnp.int32)
    logp_BxW = jnp.take_along_axis(phi_BxWxV.reshape(batch, beams * vocab), flat_BxW, axis=1)
    return parent_BxW, tokens_BxW, rows_BxWxV, (logp_BxW, best_BxW)

