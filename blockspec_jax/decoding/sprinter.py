"""SPRINTER's decoding loop (Zhong et al., arXiv 2502.04557): a learned verifier decides when the target is called.

One iteration of the ``lax.while_loop`` for every row (``ℓ`` committed tokens, the last at position ``ℓ − 1``):

1. *Segment.* The drafter (:class:`~blockspec_jax.drafters.sprinter.SprinterDrafter`) drafts ``x_0, x_1, …`` one
   token at a time (an inner ``lax.while_loop`` that ends when every row's segment is closed). Before ``x_i`` is
   drawn from ``q_i``, the head reads the hidden state that produced ``q_i`` and accepts when
   ``acceptable ≥ threshold``. The first token the head does not accept, or the ``cap``-th token, is *flagged* and
   closes the row's segment of length ``L ∈ [1, cap]``.
2. *Target.* One target pass over ``[x_{ℓ−1}, x_0 … x_{L−1}]`` (positions ``ℓ − 1 … ℓ + L − 1``) gives ``p`` at
   the flagged token's context and at its successor's, and fills the target's cache for everything that will be
   committed. The pass is as long as the batch's longest segment plus one, the segment rounded up to a bucket (1, 2,
   4, …, cap: ``lax.switch``), so a short segment does not pay for a ``cap``-long pass.
3. *Test.* The flagged token alone goes through the speculative-sampling test
   (:func:`~blockspec_jax.verify.rules.token_verify` with γ = 1): accepted with ``min(1, p/q)``, and then the *bonus*
   token is drawn from ``p(·| …, x_flagged)`` (``L + 1`` tokens for this target call, as the official code does);
   else replaced by a draw from ``norm(max(p − q, 0))`` (``L`` tokens). ``bonus = False`` (the verifier's setting;
   this codebase's only variant before 2026-11-28) stops at the flagged token: ``L`` tokens per call, a pass one token
   shorter.

Law. Conditional on the context, a head-accepted token has law ``q`` and a flagged one law ``p`` (the SD test is
exact: ``min(p, q) + max(p − q, 0) = p``); whether a position is flagged depends on the hidden state before the
token and on the segment's length so far, never on the token drawn. A bonus token has law ``p`` and starts a new
segment after it, but whether it comes depends on the flagged token's acceptance, which the token drawn does reveal
(given ``x``, it was accepted with probability ``min(p, q)(x) / p(x)``): so the position after a flagged token has
law ``a(x)·p + (1 − a(x))·[(1 − η)·p + η·q]`` there, not the per-step ``(1 − η)·p + η·q`` of the other positions.
A head that flags everything (``threshold > 1``) is exactly lossless either way. The exact law on tabular models:
:func:`blockspec_jax.theory.lossy.sprinter_sequence_law` (with ``bonus``).

Counters (``DecodeOutput.extra``, int32 ``[B]`` each): ``num_head_flags`` (segments closed by the head),
``num_cap_flags`` (closed by the cap), ``num_sd_rejections`` (flagged tokens replaced by the SD test),
``num_head_accepted`` (tokens emitted without a target check), ``num_bonus_tokens`` (flagged tokens accepted and
followed by a bonus). ``metrics.num_drafts`` counts target calls, ``num_draft_tokens`` drafted tokens and
``num_accepted_tokens`` the drafted tokens kept, Σ (L − 1 + accepted flag) with the bonus (Σ (L − 1) without), so the
block efficiency ``1 + accepted / drafts`` is the mean number of tokens per target call, as for the other rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax import sampling
from blockspec_jax.decoding import state as loop
from blockspec_jax.models.scorer import as_scorer
from blockspec_jax.verify import distribution_errors, rules

__all__ = ["SprinterCounters", "sprinter_decode", "segment_buckets"]


@struct.dataclass
class SprinterCounters:
  """Per-row SPRINTER counters, int32 ``[B]`` each (see the module docstring)."""
  num_head_flags: jax.Array
  num_cap_flags: jax.Array
  num_sd_rejections: jax.Array
  num_head_accepted: jax.Array
  num_bonus_tokens: jax.Array

  @classmethod
  def zeros(cls, batch: int) -> "SprinterCounters":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, z, z, z)


@struct.dataclass
class _Segment:
  """The inner loop's carry (``C`` = cap)."""
  step: jax.Array            # int32 []        tokens drafted so far in this iteration
  drafter_state: object
  q_BxV: jax.Array           # f32 [B, V]      law of the next token
  hidden_BxD: jax.Array      #                 the hidden state that produced it
  last_B: jax.Array          # int32 [B]       the token drawn at the previous step (fed at this step)
  tokens_BxC: jax.Array      # int32 [B, C]    the segment's tokens
  length_B: jax.Array        # int32 [B]       L (0 while the segment is open)
  flag_q_BxV: jax.Array      # f32 [B, V]      q of the flagged token
  by_head_B: jax.Array       # bool [B]        the head (not the cap) closed the segment


def segment_buckets(cap: int) -> tuple[int, ...]:
  """Target pass lengths ``(1, 2, 4, …, cap)``: a pass covers the batch's longest segment, rounded up."""
  sizes, t = [], 1
  while t < cap:
    sizes.append(t)
    t *= 2
  return tuple(sizes) + (cap,)


def _draft_segment(drafter, drafter_params, state: loop.DecodeState, key_B, *, cap: int, threshold: float,
                   sampler: sampling.Sampler) -> _Segment:
  batch = state.tokens_BxS.shape[0]
  drafter_state, q_BxV, hidden_BxD = drafter.begin(drafter_params, state.drafter_state, state.tokens_BxS,
                                                   state.length_B, sampler)
  start = _Segment(jnp.int32(0), drafter_state, q_BxV, hidden_BxD, jnp.zeros((batch,), jnp.int32),
                   jnp.zeros((batch, cap), jnp.int32), jnp.zeros((batch,), jnp.int32), jnp.zeros_like(q_BxV),
                   jnp.zeros((batch,), bool))

  def feed_last(seg: _Segment):
    # x_{i−1} sits at position ℓ + i − 1; its forward gives q_i and the hidden state that produces it.
    return drafter.step(drafter_params, seg.drafter_state, seg.last_B, state.length_B + seg.step - 1, sampler)

  def body(seg: _Segment) -> _Segment:
    i = seg.step
    drafter_state, q_BxV, hidden_BxD = jax.lax.cond(
        i > 0, feed_last, lambda s: (s.drafter_state, s.q_BxV, s.hidden_BxD), seg)
    step_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(key_B, i)
    x_B = jax.vmap(sampling.sample)(step_keys_B, q_BxV).astype(jnp.int32)
    head_ok_B = drafter.acceptable_probs(drafter_params, hidden_BxD) >= threshold
    open_B = seg.length_B == 0
    flag_B = open_B & (~head_ok_B | (i == cap - 1))
    tokens_BxC = jax.lax.dynamic_update_slice_in_dim(
        seg.tokens_BxC, jnp.where(open_B, x_B, 0)[:, None], i, axis=1)
    return _Segment(i + 1, drafter_state, q_BxV, hidden_BxD, x_B, tokens_BxC,
                    jnp.where(flag_B, i + 1, seg.length_B), jnp.where(flag_B[:, None], q_BxV, seg.flag_q_BxV),
                    jnp.where(flag_B, ~head_ok_B, seg.by_head_B))

  return jax.lax.while_loop(lambda s: (s.step < cap) & jnp.any(s.length_B == 0), body, start)


def _score_segments(target, target_params, state: loop.DecodeState, seg: _Segment, *, cap: int, bonus: bool,
                    sampler: sampling.Sampler):
  """``(p_flag_BxV, p_next_BxV, cache)``: the target's law (f32) at every row's flagged token and at its successor
  (``bonus``; else ``p_next = p_flag``), and the cache after one pass over ``[last committed, x_0 … x_{L−1}]``
  (``[…, x_{L−2}]`` without the bonus), bucketed by the batch's longest segment."""
  batch, cache_len = state.tokens_BxS.shape
  extra = int(bonus)
  rows_B = jnp.arange(batch)
  last_B = state.tokens_BxS[rows_B, state.length_B - 1]
  inputs_BxW = jnp.concatenate([last_B[:, None], seg.tokens_BxC[:, :cap - 1 + extra]], axis=1)
  positions_BxW = state.length_B[:, None] - 1 + jnp.arange(cap + extra, dtype=jnp.int32)[None, :]
  buckets = segment_buckets(cap)

  def branch(width: int):
    def run(cache):
      scored = loop.score_causal(target, target_params, inputs_BxW[:, :width], positions_BxW[:, :width], cache,
                                  cache_len)
      pick = lambda query_B: sampler.probs(jnp.take_along_axis(
          scored.logits_BxTxV, jnp.clip(query_B, 0, width - 1)[:, None, None], axis=1)[:, 0])
      p_flag_BxV = pick(seg.length_B - 1)
      return p_flag_BxV, (pick(seg.length_B) if bonus else p_flag_BxV), scored.cache
    return run

  index = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), jnp.max(seg.length_B))
  return jax.lax.switch(jnp.minimum(index, len(buckets) - 1), [branch(w + extra) for w in buckets],
                        state.target_cache)


def _sd_test(key, token, q_V, p_V, p_next_V):
  """Speculative sampling of one token (token verification at γ = 1): ``(next, accepted)``, ``next`` the draw from
  ``p_next_V`` (the bonus) when the token is accepted, else its replacement from ``norm(max(p − q, 0))``."""
  res = rules.token_verify(key, token[None], q_V[None], jnp.stack([p_V, p_next_V]))
  return res.next_token.astype(jnp.int32), res.num_accepted == 1


def sprinter_decode(target_params, drafter_params, keys_B, state: loop.DecodeState, *, target, drafter, gamma: int,
                    max_new_tokens: int, verifier, sampler: sampling.Sampler = sampling.Sampler(),
                    stop_ids: tuple[int, ...] = (), pad_id: int = 0) -> loop.DecodeOutput:
  """The SPRINTER loop (module docstring) from a state made by ``speculative_prefill`` with ``gamma = verifier.cap``.

  ``verifier``: a :class:`~blockspec_jax.verify.SprinterVerifier` (``threshold``, ``cap``); ``drafter`` must offer
  ``begin`` / ``step`` / ``acceptable_probs`` (:class:`~blockspec_jax.drafters.sprinter.SprinterDrafter`). Returns a
  ``DecodeOutput`` whose ``extra`` holds :class:`SprinterCounters`. LOSSY unless the head flags every token.
  """
  target = as_scorer(target)
  cap = verifier.cap
  if gamma != cap:
    raise ValueError(f"SPRINTER's segments are at most cap = {cap} tokens: prefill and decode with gamma = cap "
                     f"(got gamma = {gamma})")
  missing = [m for m in ("begin", "step", "acceptable_probs") if not hasattr(drafter, m)]
  if missing:
    raise ValueError(f"SPRINTER needs a drafter that drafts one token at a time and has a verifier head; "
                     f"{type(drafter).__name__} lacks {', '.join(missing)}")
  batch = state.tokens_BxS.shape[0]
  loop.check_state(state, keys_B, max_new_tokens, drafter.num_nodes(cap) + 1, cap)

  def body(carry):
    state, stopped_B, counters = carry
    draft_key_B, verify_key_B = loop.iteration_keys(keys_B, state.iteration)
    seg = _draft_segment(drafter, drafter_params, state, draft_key_B, cap=cap, threshold=verifier.threshold,
                         sampler=sampler)
    p_BxV, p_next_BxV, cache = _score_segments(target, target_params, state, seg, cap=cap, bonus=verifier.bonus,
                                               sampler=sampler)
    rows_B = jnp.arange(batch)
    flagged_B = seg.tokens_BxC[rows_B, seg.length_B - 1]
    next_B, accepted_B = jax.vmap(_sd_test)(verify_key_B, flagged_B, seg.flag_q_BxV, p_BxV, p_next_BxV)
    # Accepted: the bonus after the flagged token (or, without the bonus, nothing: the token stays); rejected: the
    # replacement at the flagged token's place.
    with_bonus_B = accepted_B & verifier.bonus
    block_BxC1 = jnp.concatenate([seg.tokens_BxC, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    block_BxC1 = block_BxC1.at[rows_B, seg.length_B - 1 + with_bonus_B].set(
        jnp.where(accepted_B & ~with_bonus_B, flagged_B, next_B))
    generated_B = state.length_B - state.prompt_len_B
    tokens_BxS, length_B, done_B, kept_B, stop_B = loop.commit_block(
        state.tokens_BxS, state.length_B, state.done_B, block_BxC1, seg.length_B + with_bonus_B, generated_B,
        max_new_tokens, stop_ids)
    active_B = ~state.done_B
    active_i = active_B.astype(jnp.int32)
    extra_B = seg.length_B - 1 + with_bonus_B  # drafted tokens kept (τ): the emitted count is τ + 1
    m = state.metrics
    bad_rows_B = (distribution_errors(p_BxV) != 0).astype(jnp.int32) + (
        distribution_errors(seg.flag_q_BxV) != 0).astype(jnp.int32)
    metrics = m.replace(
        num_drafts=m.num_drafts + active_i,
        num_draft_tokens=m.num_draft_tokens + seg.length_B * active_i,
        num_accepted_tokens=m.num_accepted_tokens + extra_B * active_i,
        accepted_per_position_BxG=m.accepted_per_position_BxG
        + ((jnp.arange(1, cap + 1)[None, :] <= extra_B[:, None]) & active_B[:, None]).astype(jnp.int32),
        num_emitted_tokens=m.num_emitted_tokens + kept_B,
        expected_accepted=jnp.full_like(m.expected_accepted, jnp.nan),
        invalid_prob_rows=m.invalid_prob_rows + jnp.where(active_B, bad_rows_B, 0))
    counters = SprinterCounters(
        num_head_flags=counters.num_head_flags + (seg.by_head_B & active_B),
        num_cap_flags=counters.num_cap_flags + (~seg.by_head_B & active_B),
        num_sd_rejections=counters.num_sd_rejections + (~accepted_B & active_B),
        num_head_accepted=counters.num_head_accepted + (seg.length_B - 1) * active_i,
        num_bonus_tokens=counters.num_bonus_tokens + (with_bonus_B & active_B))
    new_state = state.replace(tokens_BxS=tokens_BxS, length_B=length_B, done_B=done_B, target_cache=cache,
                              drafter_state=seg.drafter_state, iteration=state.iteration + 1, metrics=metrics)
    return new_state, stopped_B | stop_B, counters

  state, stopped_B, counters = jax.lax.while_loop(
      lambda c: ~jnp.all(c[0].done_B), body, (state, jnp.zeros((batch,), bool), SprinterCounters.zeros(batch)))
  out = loop.decode_output(state, max_new_tokens, pad_id, stopped_B)
  return out.replace(extra=counters)
