"""Logits -> the exact probability vectors drafter and target sample from.

Speculative decoding is lossless with respect to the *transformed* target: the law obtained after temperature,
top-k and top-p have been applied. Verification rules need the full transformed rows of both models, and the draft
row ``q`` must be the very law the draft token was drawn from. Drafter and target therefore go through the one
function in this module, :func:`probs_from_logits`, and tokens are drawn from its output with :func:`sample`.

Transform order (the common one): temperature, then top-k, then top-p, then renormalise.

* ``temperature == 0`` gives the one-hot vector at ``argmax`` (first index on ties); top-k / top-p do not change it.
* ``top_k == 0`` disables top-k. Otherwise the tokens whose logit is >= the k-th largest logit are kept (ties at the
  threshold are all kept, so the law does not depend on an arbitrary tie break).
* ``top_p == 1`` disables top-p. Otherwise tokens are sorted by probability (descending, stable) and token ``j`` is
  kept iff the mass strictly before it is < ``top_p``; the most likely token is always kept.

All settings are Python scalars (static under ``jax.jit``): the transform's code depends on them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["Sampler", "probs_from_logits", "probs_by_sorting", "sample", "sample_from_weights", "greedy_sampler"]


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Static sampling settings shared by drafter and target. Hashable: pass it as a static argument."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if not (self.temperature >= 0.0):  # also rejects NaN
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if int(self.top_k) != self.top_k or self.top_k < 0:
      raise ValueError(f"top_k must be a non-negative integer (0 disables it), got {self.top_k}")
    if not (0.0 < self.top_p <= 1.0):
      raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")

  @property
  def is_greedy(self) -> bool:
    return self.temperature == 0.0

  def probs(self, logits_xV: jax.Array) -> jax.Array:
    """Transformed probabilities, float32, same leading shape as ``logits_xV``."""
    return probs_from_logits(logits_xV, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def greedy_sampler() -> Sampler:
  return Sampler(temperature=0.0)


def probs_from_logits(logits_xV: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                      top_p: float = 1.0) -> jax.Array:
  """Turn logits ``[..., V]`` into the transformed law ``[..., V]`` (float32, rows sum to 1).

  ``-inf`` logits (masked tokens) get probability 0. A row whose logits are all ``-inf`` is an error upstream; it
  yields NaN here so that :func:`blockspec_jax.verify.distribution_errors` reports it rather than hiding it.
  """
  Sampler(temperature, top_k, top_p)  # validates the settings
  logits_xV = jnp.asarray(logits_xV).astype(jnp.float32)
  vocab = logits_xV.shape[-1]
  if temperature == 0.0:
    # A NaN or +inf logit, or a row with no finite logit, has no meaningful argmax (argmax would pick the NaN and
    # return a valid-looking one-hot): such rows become NaN so that distribution_errors counts them.
    bad_x = jnp.any(jnp.isnan(logits_xV) | (logits_xV == jnp.inf), axis=-1) | jnp.all(logits_xV == -jnp.inf, axis=-1)
    one_hot_xV = jax.nn.one_hot(jnp.argmax(logits_xV, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where(bad_x[..., None], jnp.float32(jnp.nan), one_hot_xV)
  scaled_xV = logits_xV / jnp.float32(temperature)
  if top_k and top_k < vocab:
    kth_x1 = _top_k(scaled_xV, top_k)[0][..., -1:]
    scaled_xV = jnp.where(scaled_xV >= kth_x1, scaled_xV, -jnp.inf)
  probs_xV = jax.nn.softmax(scaled_xV, axis=-1)
  if top_p < 1.0:
    keep_xV = _top_p_keep(probs_xV, float(top_p), top_k)
    probs_xV = jnp.where(keep_xV, probs_xV, 0.0)
    probs_xV = probs_xV / jnp.sum(probs_xV, axis=-1, keepdims=True)
  return probs_xV


def probs_by_sorting(logits_xV: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0) -> jax.Array:
  """The filters of :func:`probs_from_logits` (``temperature > 0``) as the module docstring defines them, computed by
  sorting every row whole: the reference the fast path is tested and benchmarked against
  (``eval.bench_sampling``). It keeps the same tokens; their probabilities agree up to the float rounding of the
  normalising sum."""
  Sampler(temperature, top_k, top_p)
  if temperature == 0.0:
    raise ValueError("probs_by_sorting is the reference of the filters at temperature > 0")
  scaled_xV = jnp.asarray(logits_xV).astype(jnp.float32) / jnp.float32(temperature)
  if top_k and top_k < scaled_xV.shape[-1]:
    scaled_xV = jnp.where(scaled_xV >= jnp.sort(scaled_xV, axis=-1)[..., -top_k][..., None], scaled_xV, -jnp.inf)
  probs_xV = jax.nn.softmax(scaled_xV, axis=-1)
  if top_p == 1.0:
    return probs_xV
  order_xV = jnp.argsort(-probs_xV, axis=-1, stable=True)
  sorted_xV = jnp.take_along_axis(probs_xV, order_xV, axis=-1)
  keep_sorted_xV = ((jnp.cumsum(sorted_xV, axis=-1) - sorted_xV) < jnp.float32(top_p)).at[..., 0].set(True)
  keep_xV = jnp.take_along_axis(keep_sorted_xV, jnp.argsort(order_xV, axis=-1), axis=-1)
  probs_xV = jnp.where(keep_xV, probs_xV, 0.0)
  return probs_xV / jnp.sum(probs_xV, axis=-1, keepdims=True)


#: The largest candidate set :func:`_top_p_keep` tries before it sorts the whole row.
_TOP_P_CANDIDATES = 64
#: How far above ``top_p`` the candidates' mass must be for the tokens after them to be surely dropped (float32 sums
#: of the same values in another order differ by a few ulps of 1).
_TOP_P_MARGIN = 2.0 ** -16


def _top_k(x_xV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``jax.lax.top_k`` (values descending, the lower index first among equal values), kept a top-k: XLA's CPU
  compiler rewrites a TopK whose result feeds further ops into a sort of the whole row (~45 ms for one row of
  Qwen's 151,936 logits against ~0.5 ms; the optimisation barrier keeps the TopK). The values are the same."""
  return jax.lax.optimization_barrier(jax.lax.top_k(x_xV, k))


def _top_p_keep(probs_xV: jax.Array, top_p: float, top_k: int) -> jax.Array:
  """The top-p mask (module docstring) of ``probs_xV`` ``[..., V]``, bool ``[..., V]``.

  Exactly the mask of sorting the whole row, computed from the ``K = max(top_k, 64)`` largest probabilities when they
  decide it for every row: when a row has at most ``K`` tokens of positive probability (top-k left ≤ ``K``), the
  tokens after them have probability 0 and their mask does not change the law; when the ``K`` largest hold at least
  ``top_p`` (plus a float margin), every later token has mass ≥ ``top_p`` before it and is dropped. The ``K``
  largest come in the full sort's order (descending, the lower index first among equal values), so their cumulative
  sums are the full sort's first ``K``. Otherwise (a flat row: thousands of tokens inside ``top_p``) the whole rows are
  sorted. Sorting a 151,936-token row takes ~70 ms on a CPU core, the ``K`` largest ~1 ms."""
  vocab = probs_xV.shape[-1]
  k = min(vocab, max(int(top_k), _TOP_P_CANDIDATES))

  def keep_sorted(sorted_xK):
    mass_before_xK = jnp.cumsum(sorted_xK, axis=-1) - sorted_xK
    return (mass_before_xK < jnp.float32(top_p)).at[..., 0].set(True)

  def scatter(keep_xK, order_xK):
    flat_NxK, order_NxK = keep_xK.reshape(-1, keep_xK.shape[-1]), order_xK.reshape(-1, keep_xK.shape[-1])
    rows_Nx1 = jnp.arange(flat_NxK.shape[0])[:, None]
    keep_NxV = jnp.zeros((flat_NxK.shape[0], vocab), bool).at[rows_Nx1, order_NxK].set(flat_NxK)
    return keep_NxV.reshape(probs_xV.shape)

  def full_sort(_):
    order_xV = jnp.argsort(-probs_xV, axis=-1, stable=True)
    return scatter(keep_sorted(jnp.take_along_axis(probs_xV, order_xV, axis=-1)), order_xV)

  if k == vocab:
    return full_sort(None)
  top_xK, order_xK = _top_k(probs_xV, k)
  decided_x = (jnp.sum(probs_xV > 0, axis=-1) <= k) | (jnp.sum(top_xK, axis=-1) >= top_p + _TOP_P_MARGIN)
  return jax.lax.cond(jnp.all(decided_x), lambda _: scatter(keep_sorted(top_xK), order_xK), full_sort, None)


_FANOUT = 128  # children per node of the summation tree used by the sampler


def _pad_to_multiple(x_N: jax.Array, multiple: int) -> jax.Array:
  pad = (-x_N.shape[-1]) % multiple
  return x_N if pad == 0 else jnp.pad(x_N, (0, pad))


def _first_crossing(weights_F: jax.Array, target: jax.Array):
  """Index ``j`` of the first positive weight whose running sum exceeds ``target``, and the mass before it.

  ``weights_F`` has ``_FANOUT`` entries; the running sum is a triangular matmul at full f32 precision (XLA's CPU
  cumsum is slow). When rounding puts ``target`` past the end, the last positive entry is returned.
  """
  fanout = weights_F.shape[-1]
  upper_FxF = jnp.triu(jnp.ones((fanout, fanout), jnp.float32))
  cumsum_F = jnp.matmul(weights_F, upper_FxF, precision=jax.lax.Precision.HIGHEST)
  positive_F = weights_F > 0
  crossing_F = (cumsum_F > target) & positive_F
  last_positive = (fanout - 1) - jnp.argmax(positive_F[::-1])
  j = jnp.where(jnp.any(crossing_F), jnp.argmax(crossing_F), last_positive)
  mass_before = cumsum_F[j] - weights_F[j]
  return j, mass_before


def sample_from_weights(key: jax.Array, weights_V: jax.Array) -> jax.Array:
  """Draw one index with probability proportional to non-negative ``weights_V`` (need not be normalised).

  Inverse-CDF sampling with one uniform ``u``: the index whose cumulative mass interval contains ``u * total``.
  Cumulative sums are taken over a tree of fan-out 128 (block sums, then a descent that looks at 128 entries per
  level), which keeps f32 rounding at the level of a few ulps of the total (a flat running sum over 150k entries
  would not) and costs one read of the row. Indices with weight 0 are never returned. Garbage never leaves the
  vocabulary: NaN, infinite and negative weights count as 0, and a row with no positive finite weight returns 0 (such
  rows are not distributions; :func:`blockspec_jax.verify.distribution_errors` reports them, and the decode loops
  count them in ``invalid_prob_rows``). Returns int32 scalar in ``[0, V)``; batch with ``jax.vmap``.
  """
  weights_V = jnp.asarray(weights_V, jnp.float32)
  vocab = weights_V.shape[-1]
  weights_V = jnp.where(jnp.isfinite(weights_V) & (weights_V > 0), weights_V, 0.0)
  levels = [_pad_to_multiple(weights_V, _FANOUT)]
  while levels[-1].shape[-1] > _FANOUT:
    levels.append(_pad_to_multiple(levels[-1].reshape(-1, _FANOUT).sum(-1), _FANOUT))
  target = jax.random.uniform(key, (), dtype=jnp.float32) * jnp.sum(levels[-1])
  index = jnp.int32(0)
  for level_N in reversed(levels):
    segment_F = jax.lax.dynamic_slice_in_dim(level_N, index * _FANOUT, _FANOUT)
    j, mass_before = _first_crossing(segment_F, target)
    target = jnp.maximum(target - mass_before, 0.0)
    index = index * _FANOUT + j.astype(jnp.int32)
  # Only a row without positive mass (or a total that overflowed to inf) can walk into the padding.
  return jnp.where(index < vocab, index, 0).astype(jnp.int32)


def sample(key: jax.Array, probs_V: jax.Array) -> jax.Array:
  """Draw a token from a probability row ``probs_V`` (int32 scalar). The law drawn from is exactly ``probs_V``."""
  return sample_from_weights(key, probs_V)
