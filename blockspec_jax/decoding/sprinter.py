"""SPRINTER's decoding loop (Zhong et al., arXiv 2502.04557): a learned verifier decides when the target is called.

One iteration of the ``lax.while_loop`` for every row (``ℓ`` committed tokens, the last at position ``ℓ − 1``):

1. *Segment.* The drafter (:class:`~blockspec_jax.drafters.sprinter.SprinterDrafter`) drafts ``x_0, x_1, …`` one
   token at a time (an inner ``lax.while_loop`` that ends when every row's segment is closed). Before ``x_i`` is
   drawn from ``q_i``, the head reads the hidden state that produced ``q_i`` and accepts when
   ``acceptable ≥ threshold``. The first token the head does not accept, or the ``cap``-th token, is *flagged* and
   closes the row's segment of length ``L ∈ [1, cap]``.
2. *Target.* One target pass over ``[x_{ℓ−1}, x_0 … x_{L−2}]`` (positions ``ℓ − 1 … ℓ + L − 2``) gives
   ``p`` at the flagged token's context and fills the target's cache for everything that will be committed. The pass
   is as long as the batch's longest segment, rounded up to a bucket (1, 2, 4, …, cap: ``lax.switch``), so a short
   segment does not pay for a ``cap``-long pass.
3. *Test.* The flagged token alone goes through the speculative-sampling test: accepted with ``min(1, p/q)``, else
   replaced by a draw from ``norm(max(p − q, 0))`` (:func:`~blockspec_jax.verify.rules.token_verify` with γ = 1). No
   bonus token: ``L`` tokens are emitted per target call.

Law. Conditional on the context, a head-accepted token has law ``q`` and a flagged one law ``p`` (the SD test is
exact); whether a position is flagged depends on the hidden state before the token and on the segment's length so
far, never on the token drawn. So the per-step law is ``(1 − η)·p + η·q`` with ``η ∈ {0, 1}`` the head's decision at
that context (the cap forces ``η = 0``), ``TV = η·TV(p, q)``, and a head that flags everything (``threshold > 1``) is
exactly lossless. The exact law on tabular models: :func:`blockspec_jax.theory.lossy.sprinter_sequence_law`.

Counters (``DecodeOutput.extra``, int32 ``[B]`` each): ``num_head_flags`` (segments closed by the head),
``num_cap_flags`` (closed by the cap), ``num_sd_rejections`` (flagged tokens replaced by the SD test),
``num_head_accepted`` (tokens emitted without a target check). ``metrics.num_drafts`` counts target calls,
``num_draft_tokens`` drafted tokens and ``num_accepted_tokens`` Σ (L − 1), so the block efficiency
``1 + accepted / drafts`` is the mean number of tokens per target call, as for the other rules.
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

  @classmethod
  def zeros(cls, batch: int) -> "SprinterCounters":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, z, z)


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


def _score_segments(target, target_params, state: loop.DecodeState, seg: _Segment, *, cap: int,
                    sampler: sampling.Sampler):
  """The target's law at every row's flagged token (f32 ``[B, V]``) and the cache after one pass over
  ``[last committed, x_0 … x_{L−2}]``, bucketed by the batch's longest segment."""
  batch, cache_len = state.tokens_BxS.shape
  rows_B = jnp.arange(batch)
  last_B = state.tokens_BxS[rows_B, state.length_B - 1]
  inputs_BxC = jnp.concatenate([last_B[:, None], seg.tokens_BxC[:, :cap - 1]], axis=1)
  positions_BxC = state.length_B[:, None] - 1 + jnp.arange(cap, dtype=jnp.int32)[None, :]
  buckets = segment_buckets(cap)

  def branch(width: int):
    def run(cache):
      scored = loop.score_causal(target, target_params, inputs_BxC[:, :width], positions_BxC[:, :width], cache,
                                  cache_len)
      query_B = jnp.clip(seg.length_B - 1, 0, width - 1)
      logits_BxV = jnp.take_along_axis(scored.logits_BxTxV, query_B[:, None, None], axis=1)[:, 0]
      return sampler.probs(logits_BxV), scored.cache
    return run

  index = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), jnp.max(seg.length_B))
  return jax.lax.switch(jnp.minimum(index, len(buckets) - 1), [branch(w) for w in buckets], state.target_cache)


def _sd_test(key, token, q_V, p_V):
  """Speculative sampling of one token: ``(emitted, rejected)`` (token verification at γ = 1, bonus unused)."""
  res = rules.token_verify(key, token[None], q_V[None], jnp.stack([p_V, p_V]))
  return jnp.where(res.num_accepted == 1, token, res.next_token).astype(jnp.int32), res.num_accepted == 0


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
    p_BxV, cache = _score_segments(target, target_params, state, seg, cap=cap, sampler=sampler)
    rows_B = jnp.arange(batch)
    flagged_B = seg.tokens_BxC[rows_B, seg.length_B - 1]
    emitted_B, rejected_B = jax.vmap(_sd_test)(verify_key_B, flagged_B, seg.flag_q_BxV, p_BxV)
    block_BxC = seg.tokens_BxC.at[rows_B, seg.length_B - 1].set(emitted_B)
    generated_B = state.length_B - state.prompt_len_B
    tokens_BxS, length_B, done_B, kept_B, stop_B = loop.commit_block(
        state.tokens_BxS, state.length_B, state.done_B, block_BxC, seg.length_B, generated_B, max_new_tokens,
        stop_ids)
    active_B = ~state.done_B
    active_i = active_B.astype(jnp.int32)
    extra_B = seg.length_B - 1
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
        num_sd_rejections=counters.num_sd_rejections + (rejected_B & active_B),
        num_head_accepted=counters.num_head_accepted + extra_B * active_i)
    new_state = state.replace(tokens_BxS=tokens_BxS, length_B=length_B, done_B=done_B, target_cache=cache,
                              drafter_state=seg.drafter_state, iteration=state.iteration + 1, metrics=metrics)
    return new_state, stopped_B | stop_B, counters

  state, stopped_B, counters = jax.lax.while_loop(
      lambda c: ~jnp.all(c[0].done_B), body, (state, jnp.zeros((batch,), bool), SprinterCounters.zeros(batch)))
  out = loop.decode_output(state, max_new_tokens, pad_id, stopped_B)
  return out.replace(extra=counters)
