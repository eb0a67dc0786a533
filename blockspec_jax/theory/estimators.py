"""Estimators of the expected number of accepted draft tokens from sampled drafts (numpy, float64).

Along a draft ``X^γ ~ M_s`` the probability that verification accepts at least ``i`` tokens given the first ``i``
draft tokens is a known function of the draft (docs/ALGORITHMS.md §2, §8):

* token verification: ``P(τ ≥ i | X^i) = Π_{j≤i} min(1, p_{j-1}(X_j) / q_{j-1}(X_j))``  (:func:`token_weights`);
* block verification: ``P(τ ≥ i | X^i) = w_i``, ``w_i = min(1, w_{i-1} p_{i-1}(X_i) / q_{i-1}(X_i))``, ``w_0 = 1``
  (:func:`block_weights`).

Hence ``E[τ] = Σ_i P(τ ≥ i) = E_{X^γ~M_s}[Σ_i weight_i]``: averaging ``Σ_i weight_i`` over sampled drafts
(:func:`rao_blackwell_accepted`) is unbiased for ``E[τ]`` and has no more variance than averaging the accepted counts
themselves (:func:`counting_estimate`), since it conditions out the verifier's own coins.

Zero safety (shared with ``blockspec_jax.verify.rules.clipped_ratio``): ``min(1, w·p/q)`` is computed as
``min(1, (w·p)/q)`` where ``q > 0``; where ``q == 0`` the ratio ``p/q`` is taken as ``+∞`` when ``w·p > 0`` (so the
clipped value is 1) and the result is 0 when ``w·p == 0``. Never NaN for finite non-negative inputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from blockspec_jax.theory.tabular import TabularLM

__all__ = ["Estimate", "DraftSample", "clipped_ratio", "token_weights", "block_weights", "rao_blackwell_accepted",
           "counting_estimate", "sample_drafts"]


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A Monte-Carlo mean with its standard error ``std(ddof=1) / sqrt(n)`` (NaN when ``n < 2``)."""
  mean: float
  stderr: float
  n: int


def _non_negative_pair(p, q, name_p: str, name_q: str) -> tuple[np.ndarray, np.ndarray]:
  p = np.asarray(p, dtype=np.float64)
  q = np.asarray(q, dtype=np.float64)
  if p.shape != q.shape:
    raise ValueError(f"{name_p} and {name_q} must have the same shape, got {p.shape} and {q.shape}")
  for name, array in ((name_p, p), (name_q, q)):
    if not np.all(np.isfinite(array)) or np.any(array < 0):
      raise ValueError(f"{name} must be finite and non-negative")
  return p, q


def clipped_ratio(w_prev, p, q) -> np.ndarray:
  """``min(1, w_prev · p / q)`` elementwise (broadcast, float64), zero-safe (module docstring).

  ``w_prev · p`` is formed first, then divided by ``q``: the same rounding as ``w_prev * p / q`` in Python.
  """
  numerator = np.multiply(np.asarray(w_prev, dtype=np.float64), np.asarray(p, dtype=np.float64))
  q = np.asarray(q, dtype=np.float64)
  numerator, q = np.broadcast_arrays(numerator, q)
  positive_q = q > 0
  with np.errstate(over="ignore"):  # tiny q: the quotient may overflow to +inf, which clips to 1 (never NaN)
    ratio = np.divide(numerator, q, out=np.zeros(numerator.shape, dtype=np.float64), where=positive_q)
  return np.where(positive_q, np.minimum(1.0, ratio), np.where(numerator > 0, 1.0, 0.0))


def token_weights(p_tok_NxG, q_tok_NxG) -> np.ndarray:
  """Token verification's ``P(τ ≥ i | X^i) = Π_{j≤i} min(1, p_tok[.., j-1] / q_tok[.., j-1])``; float64 ``[..., G]``.

  ``p_tok[..., i-1] = p(X_i | c, X^{i-1})``, ``q_tok`` likewise for the drafter. ``p = 0`` gives 0, ``q = 0 < p`` 1.
  """
  p_tok, q_tok = _non_negative_pair(p_tok_NxG, q_tok_NxG, "p_tok", "q_tok")
  if p_tok.ndim < 1:
    raise ValueError("p_tok and q_tok must have a trailing draft axis [..., G]")
  return np.cumprod(clipped_ratio(1.0, p_tok, q_tok), axis=-1)


def block_weights(p_tok_NxG, q_tok_NxG) -> np.ndarray:
  """Block verification's running clipped ratio ``w_i = min(1, w_{i-1} p_tok[.., i-1] / q_tok[.., i-1])``, ``w_0 = 1``.

  Inputs float ``[..., G]`` (the probabilities of each drafted token under target and drafter); output float64
  ``[..., G]``, entry ``i-1`` is ``w_i = P(τ_block ≥ i | X^i)``. Zero-safe, never NaN.
  """
  p_tok, q_tok = _non_negative_pair(p_tok_NxG, q_tok_NxG, "p_tok", "q_tok")
  if p_tok.ndim < 1:
    raise ValueError("p_tok and q_tok must have a trailing draft axis [..., G]")
  weights = np.empty_like(p_tok)
  w_prev = np.ones(p_tok.shape[:-1], dtype=np.float64)
  for i in range(p_tok.shape[-1]):
    w_prev = clipped_ratio(w_prev, p_tok[..., i], q_tok[..., i])
    weights[..., i] = w_prev
  return weights


def _mean_and_stderr(values_N: np.ndarray) -> Estimate:
  n = int(values_N.shape[0])
  if n == 0:
    raise ValueError("need at least one sample")
  mean = float(np.mean(values_N))
  stderr = float(np.std(values_N, ddof=1) / math.sqrt(n)) if n >= 2 else float("nan")
  return Estimate(mean=mean, stderr=stderr, n=n)


def rao_blackwell_accepted(weights_NxG) -> Estimate:
  """Unbiased estimate of ``E[τ] = E[Σ_i w_i]`` from ``weights[n, i-1] = P(τ ≥ i | X^i)`` along N sampled drafts.

  ``weights`` float ``[N, G]`` from :func:`block_weights` (block verification) or :func:`token_weights` (token
  verification), drafts sampled from the drafter. Returns the mean of the per-draft sums ``Σ_i weights[n, i]``.
  """
  weights = np.asarray(weights_NxG, dtype=np.float64)
  if weights.ndim != 2:
    raise ValueError(f"weights must be 2-D [N, G], got shape {weights.shape}")
  if not np.all(np.isfinite(weights)) or np.any(weights < 0) or np.any(weights > 1):
    raise ValueError("weights must be probabilities in [0, 1]")
  return _mean_and_stderr(weights.sum(axis=1))


def counting_estimate(num_accepted_N) -> Estimate:
  """Plain Monte-Carlo estimate of ``E[τ]``: the mean of observed accepted counts ``[N]``."""
  counts = np.asarray(num_accepted_N, dtype=np.float64)
  if counts.ndim != 1:
    raise ValueError(f"num_accepted must be 1-D [N], got shape {counts.shape}")
  if not np.all(np.isfinite(counts)) or np.any(counts < 0):
    raise ValueError("num_accepted must be finite and non-negative")
  return _mean_and_stderr(counts)


@dataclasses.dataclass(frozen=True, eq=False)
class DraftSample:
  """N drafts from the drafter and the probabilities of each drafted token under both models.

  Attributes:
    drafts_NxG: int64 ``[N, G]``, ``X_1..X_γ`` per row.
    p_tok_NxG: float64 ``[N, G]``, ``p(X_i | c, X^{i-1})`` at ``[n, i-1]``.
    q_tok_NxG: float64 ``[N, G]``, ``q(X_i | c, X^{i-1})`` at ``[n, i-1]``.
  """
  drafts_NxG: np.ndarray
  p_tok_NxG: np.ndarray
  q_tok_NxG: np.ndarray


def _row_indices(model: TabularLM, history_NxT: np.ndarray) -> np.ndarray:
  """Row of each history (prefix) ``[N, T]`` in ``model``'s table: int64 ``[N]``."""
  m = min(history_NxT.shape[1], model.depth)
  vocab_size = model.vocab_size
  index_N = np.full(history_NxT.shape[0], sum(vocab_size**l for l in range(m)), dtype=np.int64)
  for j in range(m):
    index_N += history_NxT[:, history_NxT.shape[1] - m + j] * vocab_size**(m - 1 - j)
  return index_N


def sample_drafts(drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int, num_samples: int,
                  rng) -> DraftSample:
  """Draw ``num_samples`` drafts ``X^γ ~ M_s(·|context)`` with numpy (inverse CDF, one uniform per token).

  ``rng`` is anything ``np.random.default_rng`` accepts (a seed or a Generator). Vectorised over samples.
  """
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(f"drafter and target vocabularies differ: {drafter.vocab_size} vs {target.vocab_size}")
  if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
    raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
  if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
    raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
  gamma, num_samples = int(gamma), int(num_samples)
  context = drafter._checked_prefix(context)  # pylint: disable=protected-access
  rng = np.random.default_rng(rng)
  history_NxT = np.tile(np.asarray(context, dtype=np.int64), (num_samples, 1)).reshape(num_samples, len(context))
  drafts_NxG = np.empty((num_samples, gamma), dtype=np.int64)
  p_tok_NxG = np.empty((num_samples, gamma), dtype=np.float64)
  q_tok_NxG = np.empty((num_samples, gamma), dtype=np.float64)
  rows = np.arange(num_samples)
  for i in range(gamma):
    q_NxV = drafter.probs[_row_indices(drafter, history_NxT)]
    p_NxV = target.probs[_row_indices(target, history_NxT)]
    cdf_NxV = np.cumsum(q_NxV, axis=1)
    u_N = rng.random(num_samples) * cdf_NxV[:, -1]
    token_N = np.sum(cdf_NxV <= u_N[:, None], axis=1)
    # Rounding guard: never return an index past the last token with positive probability.
    last_positive_N = q_NxV.shape[1] - 1 - np.argmax(q_NxV[:, ::-1] > 0, axis=1)
    token_N = np.minimum(token_N, last_positive_N)
    drafts_NxG[:, i] = token_N
    q_tok_NxG[:, i] = q_NxV[rows, token_N]
    p_tok_NxG[:, i] = p_NxV[rows, token_N]
    history_NxT = np.concatenate([history_NxT, token_N[:, None]], axis=1)
  return DraftSample(drafts_NxG=drafts_NxG, p_tok_NxG=p_tok_NxG, q_tok_NxG=q_tok_NxG)
