"""Single-block verification rules: pure, jittable, written for one row; batch them with ``jax.vmap``.

Contract (docs/ARCHITECTURE.md, contract 1)::

    res = rule(key, draft_tokens, draft_probs, target_probs)
    draft_tokens  int    [γ]       X_1..X_γ, X_i ~ M_s(.|c, X^{i-1})
    draft_probs   float  [γ, V]    row i = M_s(.|c, X^i), i = 0..γ-1  (the law each draft token was drawn from)
    target_probs  float  [γ+1, V]  row i = M_b(.|c, X^i), i = 0..γ
    res.num_accepted      int32 []   τ ∈ [0, γ]
    res.next_token        int32 []   Y: the correction (τ < γ) or the bonus token (τ = γ)
    res.acceptance_probs  f32   [γ]  P(τ ≥ i | X^i) for i = 1..γ: summed along a draft, an unbiased
                                     (Rao–Blackwellised) estimate of E[τ] with less variance than counting τ

An iteration emits X_1..X_τ, Y. "Lossless" below means: the emitted tokens have exactly the target law M_b (the law
after the sampling transform, see :mod:`blockspec_jax.sampling`), provided ``draft_probs`` is the law the draft was
sampled from and the key is fresh for every iteration and every batch row (never keyed by absolute position).

Numerics. Ratios ``p/q`` are formed only where ``q > 0`` and clipped at 1 (a vanishing ``q`` gives ratio 1, never
inf/NaN); a zero-mass residual (possible only through rounding) falls back to the target row; ``Z_i + (1 − w_i)``
is summed in that order so ``h_i`` keeps its precision when ``w_i ≈ 1``, and ``0/0`` is defined as 1.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from blockspec_jax import sampling
from blockspec_jax.verify.validation import check_block_shapes

__all__ = ["VerifyResult", "token_verify", "lenient_verify", "block_verify", "block_verify_eager", "greedy_verify",
           "exact_match_verify", "clipped_ratio", "block_weights", "block_acceptance_thresholds", "LENIENT_FUNCTIONS",
           "LENIENT_DEFAULT_EPSILON", "check_lenient_settings", "joint_verify", "joint_log_ratios", "check_joint_tau",
           "JOINT_DEFAULT_TAU"]

#: DistillSpec's lenience functions ``f(p, ε)`` (:func:`lenient_verify`): ``p/ε``, ``p/ε²``, ``p^ε``.
LENIENT_FUNCTIONS = ("div", "div2", "pow")
LENIENT_DEFAULT_EPSILON = 0.5
#: MJSD/MTAD's default joint-likelihood threshold τ (its paper: 0.5; 0.3 for instruct targets).
JOINT_DEFAULT_TAU = 0.5


@struct.dataclass
class VerifyResult:
  """Outcome of verifying one block (or a batch of blocks: every field gains a leading ``[B]``).

  Whatever the rows hold, ``τ ∈ [0, γ]``, ``Y ∈ [0, V)`` and ``acceptance_probs ∈ [0, 1]`` (NaN → 0): garbage rows
  (NaN, negative, not summing to 1) are reported by :func:`blockspec_jax.verify.distribution_errors`, never by
  out-of-range outputs.
  """
  num_accepted: jax.Array      # int32 []   τ
  next_token: jax.Array        # int32 []   Y
  acceptance_probs: jax.Array  # f32 [γ]    P(τ ≥ i | X^i)


def _result(tau, next_token, acceptance_probs_G) -> VerifyResult:
  """A VerifyResult with ``acceptance_probs`` kept in [0, 1] (NaN → 0) for rows that are not distributions."""
  probs_G = jnp.where(jnp.isnan(acceptance_probs_G), 0.0, jnp.clip(acceptance_probs_G, 0.0, 1.0))
  return VerifyResult(tau, next_token, probs_G.astype(jnp.float32))


def clipped_ratio(w_prev: jax.Array, p: jax.Array, q: jax.Array) -> jax.Array:
  """``min(1, w_prev * p / q)`` elementwise without inf/NaN: ``q == 0`` gives 1 if ``w_prev * p > 0`` else 0."""
  numerator = w_prev * p
  safe_q = jnp.where(q > 0, q, 1.0)
  return jnp.where(q > 0, jnp.minimum(1.0, numerator / safe_q), jnp.where(numerator > 0, 1.0, 0.0))


def _prepare(draft_tokens, draft_probs, target_probs):
  """Shape checks (trace time), f32 casts, and the probabilities of each drafted token under both models."""
  gamma, _ = check_block_shapes(draft_tokens, draft_probs, target_probs)
  draft_tokens_G = jnp.asarray(draft_tokens).astype(jnp.int32)
  q_GxV = jnp.asarray(draft_probs, jnp.float32)
  p_G1xV = jnp.asarray(target_probs, jnp.float32)
  q_tok_G = jnp.take_along_axis(q_GxV, draft_tokens_G[:, None], axis=-1)[:, 0]
  p_tok_G = jnp.take_along_axis(p_G1xV[:gamma], draft_tokens_G[:, None], axis=-1)[:, 0]
  return gamma, draft_tokens_G, q_GxV, p_G1xV, q_tok_G, p_tok_G


def _leading_true_count(flags_G: jax.Array) -> jax.Array:
  """Number of leading True entries (int32)."""
  return jnp.sum(jnp.cumprod(flags_G.astype(jnp.int32))).astype(jnp.int32)


def _correction(key, tau, weight, q_GxV, p_G1xV):
  """Y ~ norm(max(weight · p_τ − q_τ, 0)) if τ < γ, else Y ~ p_γ.

  ``weight = 1`` is the token-level residual, ``weight = w_τ`` the block-level one. If the residual has no mass
  (only reachable through rounding) the target row is used.
  """
  gamma = q_GxV.shape[0]
  p_row_V = jax.lax.dynamic_index_in_dim(p_G1xV, tau, keepdims=False)
  q_row_V = jax.lax.dynamic_index_in_dim(q_GxV, jnp.minimum(tau, gamma - 1), keepdims=False)
  residual_V = jnp.maximum(weight * p_row_V - q_row_V, 0.0)
  use_target = (tau >= gamma) | ~jnp.any(residual_V > 0)
  return sampling.sample_from_weights(key, jnp.where(use_target, p_row_V, residual_V))


def _coins(key, gamma, coins):
  """The uniforms ``η_1..η_γ ~ U[0, 1)`` drawn from ``key``, or the caller's ``coins`` (tests, keying studies)."""
  if coins is None:
    return jax.random.uniform(key, (gamma,), jnp.float32)
  coins = jnp.asarray(coins, jnp.float32)
  if coins.shape != (gamma,):
    raise ValueError(f"coins must have shape [gamma] = ({gamma},), got {coins.shape}")
  return coins


def check_lenient_settings(epsilon, f) -> tuple[float, str]:
  """``(ε, f)`` of :func:`lenient_verify` checked (a ValueError naming the problem otherwise); ``ε`` as a float.

  ``ε`` must be a concrete (static) number in ``(0, 1]``, ``f`` one of :data:`LENIENT_FUNCTIONS`.
  """
  if f not in LENIENT_FUNCTIONS:
    raise ValueError(f"unknown lenience function f={f!r}; known: {', '.join(LENIENT_FUNCTIONS)} "
                     f"(div: p/eps, div2: p/eps^2, pow: p^eps)")
  if isinstance(epsilon, bool):
    raise ValueError(f"epsilon must be a number in (0, 1], got {epsilon!r}")
  try:
    epsilon = float(epsilon)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise ValueError(f"epsilon must be a concrete (static) number in (0, 1], got {epsilon!r}") from None
  if not 0.0 < epsilon <= 1.0:  # also refuses NaN
    raise ValueError(f"epsilon must be in (0, 1], got {epsilon!r}")
  return epsilon, f


def _lenient_numerator(p_tok_G, epsilon: float, f: str):
  """``f(p, ε)`` elementwise: ``p/ε`` ("div"), ``p/ε²`` ("div2") or ``p^ε`` ("pow"); ``p`` itself at ``ε = 1``.

  ``ε = 1`` returns ``p_tok_G`` untouched (not ``p/1`` or ``p^1``), so that case is token verification bit for bit.
  """
  if epsilon == 1.0:
    return p_tok_G
  if f == "div":
    return p_tok_G / jnp.float32(epsilon)
  if f == "div2":
    return p_tok_G / jnp.float32(epsilon * epsilon)
  return jnp.power(p_tok_G, jnp.float32(epsilon))  # "pow": 0^ε = 0 for ε > 0


def _chain_verify(key, draft_tokens, draft_probs, target_probs, coins, epsilon: float, f: str) -> VerifyResult:
  """Token verification with the acceptance numerator ``f(p, ε)`` (:func:`_lenient_numerator`): the one code path
  of :func:`token_verify` (``ε = 1``) and :func:`lenient_verify`."""
  gamma, _, q_GxV, p_G1xV, q_tok_G, p_tok_G = _prepare(draft_tokens, draft_probs, target_probs)
  key_coins, key_next = jax.random.split(key)
  eta_G = _coins(key_coins, gamma, coins)
  accept_prob_G = clipped_ratio(1.0, _lenient_numerator(p_tok_G, epsilon, f), q_tok_G)
  tau = _leading_true_count(eta_G < accept_prob_G)
  next_token = _correction(key_next, tau, jnp.float32(1.0), q_GxV, p_G1xV)
  return _result(tau, next_token, jnp.cumprod(accept_prob_G))


def token_verify(key, draft_tokens, draft_probs, target_probs, coins=None) -> VerifyResult:
  """Token-level verification (Leviathan et al. 2023; Chen et al. 2023). Lossless.

  Accept ``X_i`` with probability ``min(1, p_{i-1}(X_i)/q_{i-1}(X_i))`` until the first rejection; the correction
  comes from ``norm(max(p_τ − q_τ, 0))`` (standard rejection sampling at the rejected position), the bonus from
  ``p_γ``. ``coins`` optionally supplies ``η`` (``[γ]``); by default they come from ``key``.
  """
  return _chain_verify(key, draft_tokens, draft_probs, target_probs, coins, 1.0, "div")


def lenient_verify(key, draft_tokens, draft_probs, target_probs, *, epsilon: float, f: str = "div",
                   coins=None) -> VerifyResult:
  """DistillSpec's lenient verification (Zhou et al., ICLR 2024). LOSSY for ``ε < 1``.

  Shapes as :func:`token_verify`: ``draft_tokens`` int ``[γ]``, ``draft_probs`` ``[γ, V]``, ``target_probs``
  ``[γ+1, V]``; ``coins`` optionally ``[γ]``. Accept ``X_i`` with probability
  ``min(1, f(p_{i-1}(X_i), ε) / q_{i-1}(X_i))`` until the first rejection, with ``f`` one of
  :data:`LENIENT_FUNCTIONS`: ``"div"`` ``p/ε``, ``"div2"`` ``p/ε²``, ``"pow"`` ``p^ε``; the correction comes from
  ``norm(max(p_τ − q_τ, 0))`` (``p_τ`` if that has no mass), the bonus from ``p_γ`` — exactly as in token
  verification, which this is at ``ε = 1`` (same key → same result).

  Why lossy: ``f(p, ε) ≥ p`` on ``[0, 1]``, so a drafted token is accepted with probability ``min(q, f(p))`` instead of
  ``min(q, p)`` — more often where ``q > p`` — while the correction still only refills ``max(p − q, 0)``. The first
  emitted token then has law ``min(q, f(p)) + (Σ_x max(q(x) − f(p(x)), 0)) · norm(max(p − q, 0))``, which leans towards
  ``q``: it exceeds ``p(x)`` at any ``x`` with ``q(x) > p(x) > 0`` when ``ε < 1``. In exchange more drafts are
  accepted (``P(τ ≥ i | X^i)`` never decreases as ``ε`` decreases).
  ``epsilon`` and ``f`` are static (checked at trace time); jittable and vmappable over the array arguments.
  """
  epsilon, f = check_lenient_settings(epsilon, f)
  return _chain_verify(key, draft_tokens, draft_probs, target_probs, coins, epsilon, f)


def block_weights(p_tok_G: jax.Array, q_tok_G: jax.Array) -> jax.Array:
  """Running clipped ratio ``w_i = min(1, w_{i-1} p(X_i|X^{i-1}) / q(X_i|X^{i-1}))``, ``w_0 = 1``; f32 ``[γ]``."""
  def step(w_prev, pq):
    w = clipped_ratio(w_prev, *pq)
    return w, w
  _, w_G = jax.lax.scan(step, jnp.float32(1.0), (p_tok_G, q_tok_G))
  return w_G


def block_acceptance_thresholds(w_G, q_GxV, p_G1xV) -> jax.Array:
  """Coin thresholds ``h_1..h_γ`` of block verification, f32 ``[γ]``.

  ``h_i = Z_i / (Z_i + (1 − w_i))`` with ``Z_i = Σ_x max(w_i p_i(x) − q_i(x), 0)`` for ``i < γ`` (rows i of both
  models, one fused pass over ``[γ−1, V]``), ``h_γ = w_γ``; ``0/0 := 1``.
  """
  mass_Gm1 = jnp.sum(jnp.maximum(w_G[:-1, None] * p_G1xV[1:-1] - q_GxV[1:], 0.0), axis=-1)
  denominator_Gm1 = mass_Gm1 + (1.0 - w_G[:-1])
  h_Gm1 = jnp.where(denominator_Gm1 > 0, mass_Gm1 / jnp.where(denominator_Gm1 > 0, denominator_Gm1, 1.0), 1.0)
  return jnp.concatenate([h_Gm1, w_G[-1:]])


def _block_tau(eta_G, w_G, q_GxV, p_G1xV) -> jax.Array:
  """``τ = max{i : η_i < h_i}`` evaluating ``Z_i`` only where the answer depends on it.

  Exact reformulation of the coin scan with the thresholds of :func:`block_acceptance_thresholds`:
  since ``Z_i ≤ w_i``, ``h_i ≤ w_i``, so a coin with ``η_i ≥ w_i`` fails without looking at the rows; for ``i < γ``
  a coin with ``w_i = 1`` has ``h_i = 1`` and succeeds; ``h_γ = w_γ`` is known. Only the remaining coins above the
  highest certain success are undecided; they are visited from the top, one row pair (``[V]``) per visit, and the
  first success is τ. The verdict equals the eager scan's for the same ``η``; the rows read are usually a small
  fraction of the ``[γ−1, V]`` the eager form reads.
  """
  gamma = w_G.shape[0]
  position_G = jnp.arange(1, gamma + 1, dtype=jnp.int32)
  is_last_G = position_G == gamma
  certain_G = jnp.where(is_last_G, eta_G < w_G, w_G >= 1.0)
  tau_certain = jnp.max(jnp.where(certain_G, position_G, 0))
  undecided_G = ~is_last_G & (eta_G < w_G) & (w_G < 1.0) & (position_G > tau_certain)

  def highest_undecided_below(i):
    return jnp.max(jnp.where(undecided_G & (position_G < i), position_G, 0))

  def cond(state):
    i, tau = state
    return (i > 0) & (tau == tau_certain)

  def body(state):
    i, tau = state
    w_i = w_G[i - 1]
    p_row_V = jax.lax.dynamic_index_in_dim(p_G1xV, i, keepdims=False)
    q_row_V = jax.lax.dynamic_index_in_dim(q_GxV, i, keepdims=False)
    mass = jnp.sum(jnp.maximum(w_i * p_row_V - q_row_V, 0.0))
    denominator = mass + (1.0 - w_i)
    h_i = jnp.where(denominator > 0, mass / jnp.where(denominator > 0, denominator, 1.0), 1.0)
    accepted = eta_G[i - 1] < h_i
    return highest_undecided_below(i), jnp.where(accepted, i, tau)

  # The loop ends at the first success above tau_certain (tau changes) or when no undecided coin is left.
  first = highest_undecided_below(gamma + 1)
  _, tau = jax.lax.while_loop(cond, body, (first, tau_certain))
  return tau.astype(jnp.int32)


def _block_tau_eager(eta_G, w_G, q_GxV, p_G1xV) -> jax.Array:
  """``τ = max{i : η_i < h_i}`` with every threshold computed up front (the literal algorithm)."""
  gamma = w_G.shape[0]
  success_G = eta_G < block_acceptance_thresholds(w_G, q_GxV, p_G1xV)
  return jnp.where(jnp.any(success_G), gamma - jnp.argmax(success_G[::-1]), 0).astype(jnp.int32)


def _block_verify(key, draft_tokens, draft_probs, target_probs, coins, tau_fn) -> VerifyResult:
  gamma, _, q_GxV, p_G1xV, q_tok_G, p_tok_G = _prepare(draft_tokens, draft_probs, target_probs)
  key_coins, key_next = jax.random.split(key)
  eta_G = _coins(key_coins, gamma, coins)
  w_G = block_weights(p_tok_G, q_tok_G)
  tau = tau_fn(eta_G, w_G, q_GxV, p_G1xV)
  w_tau = jnp.concatenate([jnp.ones((1,), jnp.float32), w_G])[tau]
  next_token = _correction(key_next, tau, w_tau, q_GxV, p_G1xV)
  return _result(tau, next_token, w_G)


def block_verify(key, draft_tokens, draft_probs, target_probs, coins=None) -> VerifyResult:
  """Block verification (Sun et al., ICLR 2025, arXiv 2403.10444): optimal and lossless.

  ``w_i`` is the clipped running ratio along the draft, ``h_i`` the coin threshold at position ``i``
  (:func:`block_acceptance_thresholds`); with fresh ``η_i ~ U[0, 1)``, ``τ = max{i : η_i < h_i}`` (0 if none: later
  successes accept the whole prefix, so every coin counts; :func:`_block_tau` computes it lazily) and
  ``Y ~ norm(max(w_τ p_τ − q_τ, 0))`` or ``p_γ``. ``P(τ ≥ i | X^i) = w_i ≥ Π_{j≤i} min(1, p_j/q_j)``, so it never
  accepts fewer tokens in expectation than :func:`token_verify`, and equals it for γ = 1 and a one-hot target.
  ``coins`` optionally supplies ``η`` (``[γ]``); by default they come from ``key``.
  """
  return _block_verify(key, draft_tokens, draft_probs, target_probs, coins, _block_tau)


def block_verify_eager(key, draft_tokens, draft_probs, target_probs, coins=None) -> VerifyResult:
  """:func:`block_verify` with every threshold ``h_i`` computed up front (one pass over ``[γ−1, V]``).

  Same key → same result as :func:`block_verify`; kept as the literal transcription of the algorithm for tests.
  """
  return _block_verify(key, draft_tokens, draft_probs, target_probs, coins, _block_tau_eager)


def greedy_verify(key, draft_tokens, draft_probs, target_probs) -> VerifyResult:
  """Greedy verification: accept while ``X_i == argmax p_{i-1}``; ``Y = argmax p_τ`` (first index on ties).

  Lossless for a greedy (T = 0) target; ``key`` and ``draft_probs`` are not used beyond shape checks.
  """
  del key
  _, draft_tokens_G, _, p_G1xV, _, _ = _prepare(draft_tokens, draft_probs, target_probs)
  argmax_G1 = jnp.argmax(p_G1xV, axis=-1).astype(jnp.int32)
  match_G = draft_tokens_G == argmax_G1[:-1]
  tau = _leading_true_count(match_G)
  return _result(tau, argmax_G1[tau], jnp.cumprod(match_G.astype(jnp.float32)))


def exact_match_verify(key, draft_tokens, draft_probs, target_probs) -> VerifyResult:
  """Exact-match sampling: draw ``Y_i ~ p_i`` for every row, accept while ``Y_{i-1} == X_i``, emit ``Y_τ``.

  Lossless (the emitted tokens are target samples), accepts ``Σ p·q`` per position instead of ``Σ min(p, q)``.
  Needs no drafter probabilities, so it also serves drafters that have none (n-gram, prompt lookup).
  """
  gamma, draft_tokens_G, _, p_G1xV, _, p_tok_G = _prepare(draft_tokens, draft_probs, target_probs)
  samples_G1 = jax.vmap(sampling.sample_from_weights)(jax.random.split(key, gamma + 1), p_G1xV)
  tau = _leading_true_count(samples_G1[:-1] == draft_tokens_G)
  return _result(tau, samples_G1[tau], jnp.cumprod(p_tok_G))


def check_joint_tau(tau) -> float:
  """MTAD's threshold ``τ`` as a float in ``(0, ∞]`` (``inf`` accepts nothing); a ValueError naming it otherwise."""
  if isinstance(tau, (bool, np.bool_)) or not isinstance(tau, (int, float, np.integer, np.floating)) or not tau > 0:
    raise ValueError(f"MTAD's threshold tau must be a number > 0 (log τ is the acceptance bound; tau = inf accepts "
                     f"nothing), got {tau!r}")
  return float(tau)


def joint_log_ratios(p_tok_G: jax.Array, q_tok_G: jax.Array) -> jax.Array:
  """``L_i = Σ_{j≤i} [log p(X_j|X^{j−1}) − log q(X_j|X^{j−1})]`` for ``i = 1..γ`` (f32 ``[γ]``).

  A token the target gives no mass makes ``L = −inf`` from there on (never accepted); a token with ``q = 0 < p``
  (possible for beam drafts) counts ``+inf`` until a later ``p = 0`` token; ``0/0`` counts ``−inf``.
  """
  log_p_G = jnp.where(p_tok_G > 0, jnp.log(jnp.where(p_tok_G > 0, p_tok_G, 1.0)), -jnp.inf)
  log_q_G = jnp.log(jnp.where(q_tok_G > 0, q_tok_G, 1.0))
  term_G = jnp.where(q_tok_G > 0, log_p_G - log_q_G, jnp.where(p_tok_G > 0, jnp.inf, -jnp.inf))
  # −inf must dominate +inf (a rejected token ends every longer prefix): cumulate the two parts apart.
  dead_G = jnp.cumsum(term_G == -jnp.inf) > 0
  finite_G = jnp.cumsum(jnp.where(jnp.isfinite(term_G), term_G, 0.0))
  boosted_G = jnp.cumsum(term_G == jnp.inf) > 0
  return jnp.where(dead_G, -jnp.inf, jnp.where(boosted_G, jnp.inf, finite_G)).astype(jnp.float32)


def joint_verify(key, draft_tokens, draft_probs, target_probs, *, tau: float = JOINT_DEFAULT_TAU) -> VerifyResult:
  """MJSD / MTAD joint verification (Qin et al., arXiv 2407.09722): LOSSY.

  ``τ_acc = max{a ∈ 1..γ : L_a > log τ}`` (0 if none) with ``L_a`` the joint log-likelihood ratio of the prefix
  (:func:`joint_log_ratios`); every prefix is scanned, so a prefix that fails can still be followed by a longer one
  that passes. Then one token ``Y ~ p_{τ_acc}`` (the plain target row: no residual). ``draft_probs`` are read only
  at the drafted tokens, as likelihoods: the draft may come from beam search (it need not be a sample of ``q``).

  Not lossless: accepted prefixes are the drafter's, judged by a likelihood ratio. Exact special cases: ``τ = inf``
  accepts nothing (one target sample per call: the target's law); a greedy target (one-hot ``p``) accepts only
  target-argmax tokens, so at T = 0 it emits exactly the greedy target's tokens for any ``τ``.
  ``acceptance_probs[i − 1] = 1[τ_acc ≥ i]`` (the verdict is a function of the draft).
  """
  tau = check_joint_tau(tau)
  gamma, _, _, p_G1xV, q_tok_G, p_tok_G = _prepare(draft_tokens, draft_probs, target_probs)
  log_tau = math.log(tau)  # in float64 on the host: τ = inf gives inf (nothing passes)
  passes_G = joint_log_ratios(p_tok_G, q_tok_G) > log_tau
  position_G = jnp.arange(1, gamma + 1, dtype=jnp.int32)
  num_accepted = jnp.max(jnp.where(passes_G, position_G, 0)).astype(jnp.int32)
  next_token = sampling.sample(key, jax.lax.dynamic_index_in_dim(p_G1xV, num_accepted, keepdims=False))
  return _result(num_accepted, next_token.astype(jnp.int32), (position_G <= num_accepted).astype(jnp.float32))
