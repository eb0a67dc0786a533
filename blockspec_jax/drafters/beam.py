"""MJSD/MTAD's beam drafter (Qin et al., arXiv 2407.09722): beam search on the drafter, one chain out.

:class:`BeamDrafter` runs a beam search of width ``W`` over γ tokens on the drafter's sequence law and proposes the
best final beam (highest cumulative ``log q``) as a chain, with the drafter's rows ``q`` along it. Two modes:

* ``sample=True`` (default): beam *sampling*, i.e. stochastic beam search (Kool et al., ICML 2019) on the drafter's
  sequence law, with the conditioning of RSD-S (:class:`~blockspec_jax.drafters.trees.RSDStochasticBeamDrafter`)
  but on the plain rows ``q`` (no ``ε`` smoothing: zero-probability continuations are dead beams, guarded below).
  The final W beams are a without-replacement sample of W sequences from the drafter; the best of them is proposed.
  ``W = 1`` is exactly ancestral sampling (the Gumbel-max trick at every depth: ModelDrafter's chain law).
* ``sample=True, per_step=True``: the official MTAD code's sampler: every step draws ``W`` (beam, token) pairs
  without replacement in proportion to ``exp(cumulative log q)`` (Gumbel-top-W over the ``W·V`` continuations,
  each step's perturbation fresh, not conditioned on the beams' earlier scores), then proposes the beam of highest
  cumulative ``log q`` as the other modes do. Unlike Kool's, its final beams are not a without-replacement sample
  of sequences; its law is :func:`blockspec_jax.theory.lossy.per_step_beam_law`.
* ``sample=False``: deterministic top-W beam search on cumulative ``log q``; ``W = 1`` is greedy drafting (the
  official code's mode at draft temperature 0).

NOT a draw from ``q``: the proposed tokens are the best of several beams, so the rows ``q`` it returns are the
drafter's laws along the chain (likelihoods), not the laws the tokens were drawn from. The drafter declares
``sibling_sampling = SAMPLING_BEAM``: lossless ``q``-reading rules (token, block, tree rules) refuse it
(:meth:`blockspec_jax.verify.Verifier.check_drafter`); MTAD's joint verification (``"mtad"``, which reads ``q`` only
as a likelihood), greedy and exact-match (which do not read ``q``) accept it. At T = 0 every row is one-hot, the only
beam of finite log-likelihood is the greedy chain, and the proposal is the greedy chain in both modes.

Ties (``sample=False``, and ``-inf`` scores in both modes): ``lax.top_k`` over the flattened ``[W·V]`` candidates
(index ``parent · V + token``) keeps the lower index first, and the best final beam is the first maximum
(``jnp.argmax``). :func:`blockspec_jax.theory.lossy.beam_search` reproduces this order on tabular models.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import sampling
from blockspec_jax.contracts import SAMPLING_BEAM, chain_draft
from blockspec_jax.drafters.base import ModelDrafter, feed
from blockspec_jax.drafters.registry import register
from blockspec_jax.drafters.settings import check_count
from blockspec_jax.drafters.trees import conditioned_scores  # shared with RSD-S

__all__ = ["BeamDrafter"]


def _log_probs(q_xV: jax.Array) -> jax.Array:
  """``log q`` with ``log 0 = −inf`` exactly (no NaN, no warning-prone ``log`` of 0 in the taken branch)."""
  return jnp.where(q_xV > 0, jnp.log(jnp.where(q_xV > 0, q_xV, 1.0)), -jnp.inf)


def _take_rows(cache, rows_R: jax.Array):
  """The cache rows ``rows_R`` (the batch axis of the decoder's KVCache is axis 1: ``[L, B, S, K, H]``)."""
  return jax.tree.map(lambda x: jnp.take(x, rows_R, axis=1), cache)


@register("beam")
@dataclasses.dataclass(frozen=True)
class BeamDrafter(ModelDrafter):
  """MTAD's drafter: beam search of width ``W`` (``width``) over γ tokens; proposes the best beam as a chain.

  ``width``  int in ``[1, V]``, default 4.   ``sample``  True: stochastic beam search (beam sampling), False:
  deterministic top-W beam search. LOSSY with every rule that reads ``q`` as the draw law (they refuse it: see the
  module docstring); meant for ``"mtad"`` (joint verification), also valid for ``"greedy"`` and ``"exact_match"``.

  Cache convention (:class:`~blockspec_jax.drafters.base.ModelDrafter`'s): at the start of ``propose`` the B-row cache
  holds positions ``< length − 2``; the last two committed tokens are re-fed on the B rows, then the rows are
  replicated into ``B·W`` beam rows (row ``b·W + w`` = beam ``w`` of row ``b``). Each of the γ − 1 forward steps
  first reorders the beam rows by parent index (so a beam's cache holds its own prefix), then feeds every beam's
  newest token at position ``length − 1 + d``. The returned state is the B-row cache of the best beam's depth-(γ − 1)
  prefix: positions ``< length + γ − 1`` hold the committed tokens and draft tokens ``1..γ − 1`` of the proposed
  chain. The loop then commits an accepted prefix of ``a ≤ γ`` tokens of that chain plus one token ``y``:
  ``new_length = length + a + 1``, and the next iteration needs positions ``< new_length − 2 = length + a − 1``, all
  of which hold the committed tokens (draft tokens ``1..a − 1`` are the accepted ones, fed on the best beam's own
  rows); positions ``≥ length + a − 1`` are stale and are re-fed or overwritten before anything attends to them.
  ``commit`` therefore does nothing: the rollback is the row's length.
  """

  width: int = 4
  sample: bool = True
  per_step: bool = False
  sibling_sampling = SAMPLING_BEAM
  is_chain = True

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    width = check_count(values["width"], config, "beam width", " (beams per step)")
    if not isinstance(values["sample"], (bool, np.bool_)):
      raise ValueError(f"beam sample must be a bool (True: stochastic beam search, False: deterministic top-W), "
                       f"got {values['sample']!r}")
    if not isinstance(values["per_step"], (bool, np.bool_)):
      raise ValueError(f"beam per_step must be a bool (True: the official MTAD code's per-step sampler, False: "
                       f"Kool's stochastic beam search), got {values['per_step']!r}")
    return {**values, "width": width, "sample": bool(values["sample"]), "per_step": bool(values["per_step"])}

  def num_nodes(self, gamma: int) -> int:
    return gamma

  def _select(self, key_B, q_BxKxV, logp_BxK, score_BxK, root: bool):
    """The ``W`` next beams among the ``K·V`` continuations of ``K`` beams (``K = 1`` at the root).

    ``q_BxKxV`` f32 the beams' next-token rows, ``logp_BxK`` their cumulative ``log q``, ``score_BxK`` their
    perturbed scores (``sample``). Returns ``(parent_BxW, tokens_BxW, logp_BxW, score_BxW)``: int32 parents in
    ``[0, K)``, tokens, and the new beams' cumulative ``log q`` and scores, in top-k order (decreasing score).
    """
    batch, beams, vocab = q_BxKxV.shape
    phi_BxKxV = logp_BxK[:, :, None] + _log_probs(q_BxKxV)
    if self.sample:
      g_BxKxV = phi_BxKxV + jax.vmap(lambda k: jax.random.gumbel(k, (beams, vocab), jnp.float32))(key_B)
      # One parent (the root, or W = 1): the conditioning is monotone in g, the plain Gumbel-max is exact. The
      # official sampler (per_step) never conditions: W pairs drawn without replacement ∝ exp(φ) at every step.
      plain = root or self.width == 1 or self.per_step
      score_BxKxV = g_BxKxV if plain else conditioned_scores(g_BxKxV, score_BxK)
    else:
      score_BxKxV = phi_BxKxV
    best_BxW, flat_BxW = jax.lax.top_k(score_BxKxV.reshape(batch, beams * vocab), self.width)
    parent_BxW = (flat_BxW // vocab).astype(jnp.int32)
    tokens_BxW = (flat_BxW % vocab).astype(jnp.int32)
    logp_BxW = jnp.take_along_axis(phi_BxKxV.reshape(batch, beams * vocab), flat_BxW, axis=1)
    return parent_BxW, tokens_BxW, logp_BxW, best_BxW

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler: sampling.Sampler):
    """``(cache, chain_draft(tokens_BxG, q_BxGxV))``: the best of ``W`` beams of γ tokens per row.

    ``tokens_BxS`` int32 ``[B, S]`` (committed tokens, ``S`` = the cache's slots), ``length_B`` int32 ``[B]``,
    ``key_B`` one key per row (only ``sample=True`` reads it; a row's beams never see its neighbours'). Returns int32
    ``tokens_BxG`` and f32 ``q_BxGxV`` with ``q_BxGxV[b, i]`` = the drafter's law (after ``sampler``) at the
    chain's prefix ``tokens_BxG[b, :i]``: exactly the rows :func:`~blockspec_jax.verify.rules.joint_verify` reads.
    One forward of the last two committed tokens (B rows), then γ − 1 forwards of one token per beam (``B·W`` rows,
    one ``lax.scan``); the state is the best beam's B-row cache (see the class docstring).
    """
    width = self.width
    module = self.module
    batch, cache_len = tokens_BxS.shape
    rows_B = jnp.arange(batch, dtype=jnp.int32)
    positions_Bx2 = jnp.maximum(length_B[:, None] + jnp.array([[-2, -1]]), 0)
    logits_Bx2xV, cache = feed(module, params, tokens_BxS[rows_B[:, None], positions_Bx2], positions_Bx2, state,
                               cache_len)
    root_q_Bx1xV = sampler.probs(logits_Bx2xV[:, -1:])
    vocab = root_q_Bx1xV.shape[-1]
    keys_GxB = jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, gamma))(key_B), 0, 1)
    zeros_Bx1 = jnp.zeros((batch, 1), jnp.float32)
    parent_BxW, tokens_BxW, logp_BxW, score_BxW = self._select(keys_GxB[0], root_q_Bx1xV, zeros_Bx1, zeros_Bx1,
                                                               root=True)
    # Per depth d = 1..γ: the beams' tokens, their parents (beam indices at depth d − 1) and the parents' rows.
    tokens_by_depth, parents_by_depth, rows_by_depth = [tokens_BxW], [parent_BxW], [root_q_Bx1xV]
    if gamma > 1:
      cache = _take_rows(cache, jnp.repeat(rows_B, width))  # B·W beam rows, all the root's
      base_BxW = rows_B[:, None] * width

      def step(carry, key_B):
        cache, parent_BxW, tokens_BxW, logp_BxW, score_BxW, position_B = carry
        cache = _take_rows(cache, (base_BxW + parent_BxW).reshape(-1))  # every beam gets its parent's prefix
        positions_BW1 = jnp.repeat(position_B, width)[:, None]
        logits_BWx1xV, cache = feed(module, params, tokens_BxW.reshape(-1, 1), positions_BW1, cache, cache_len)
        q_BxWxV = sampler.probs(logits_BWx1xV[:, 0]).reshape(batch, width, vocab)
        parent_BxW, tokens_BxW, logp_BxW, score_BxW = self._select(key_B, q_BxWxV, logp_BxW, score_BxW, root=False)
        return (cache, parent_BxW, tokens_BxW, logp_BxW, score_BxW, position_B + 1), (tokens_BxW, parent_BxW, q_BxWxV)

      (cache, parent_BxW, _, logp_BxW, _, _), (tokens_DxBxW, parents_DxBxW, q_DxBxWxV) = jax.lax.scan(
          step, (cache, parent_BxW, tokens_BxW, logp_BxW, score_BxW, length_B), keys_GxB[1:])
      for d in range(gamma - 1):
        tokens_by_depth.append(tokens_DxBxW[d])
        parents_by_depth.append(parents_DxBxW[d])
        rows_by_depth.append(q_DxBxWxV[d])
    # The best final beam (first maximum of the cumulative log q), then back along its parents.
    beam_B = jnp.argmax(logp_BxW, axis=1).astype(jnp.int32)
    if gamma > 1:  # the cache rows hold the depth-(γ − 1) beams: keep the best beam's parent's rows
      cache = _take_rows(cache, rows_B * width + parent_BxW[rows_B, beam_B])
    tokens, q_rows = [], []
    for d in range(gamma - 1, -1, -1):
      tokens.append(tokens_by_depth[d][rows_B, beam_B])
      beam_B = parents_by_depth[d][rows_B, beam_B]
      q_rows.append(rows_by_depth[d][rows_B, beam_B])
    tokens_BxG = jnp.stack(tokens[::-1], axis=1).astype(jnp.int32)
    q_BxGxV = jnp.stack(q_rows[::-1], axis=1)
    return cache, chain_draft(tokens_BxG, q_BxGxV)
