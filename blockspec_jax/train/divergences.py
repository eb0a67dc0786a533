"""Token-level divergences between a target's and a drafter's next-token laws (DistillSpec, Zhou et al. 2024).

    loss = token_divergence("fkl", target_logits_BxTxV, drafter_logits_BxTxV, mask_BxT, temperature=1.0)

``p = softmax(target / T)``, ``q = softmax(drafter / T)`` row by row; the result is the mean of ``D(p‖q)`` over the
positions where ``mask_BxT`` is set (all positions when it is None; 0 when no position is set). Every divergence is
computed from ``log_softmax`` (no log of a rounded-to-zero probability), in float32, and is differentiable in both
arguments (distillation differentiates the drafter's side only; the target's logits are a constant there).

``DIVERGENCES`` (name → per-position function of ``(logp_BxTxV, logq_BxTxV, beta) -> d_BxT``):

  "fkl"  forward KL   KL(p‖q) = Σ p (log p − log q)                  (mean-seeking: the drafter covers p)
  "rkl"  reverse KL   KL(q‖p) = Σ q (log q − log p)                  (mode-seeking)
  "jsd"  generalised Jensen–Shannon JSD[β] = β KL(p‖m) + (1−β) KL(q‖m), m = β p + (1−β) q, β ∈ (0, 1);
         0 ≤ JSD[β] ≤ H(β) = −β log β − (1−β) log(1−β) (log 2 at β = ½)
  "tvd"  total variation  ½ Σ |p − q| ∈ [0, 1]; 1 − TVD is the per-token acceptance rate of speculative sampling
         (Leviathan et al. 2023), which is what DistillSpec targets

Two ways to average over a batch (``normalization``, :data:`NORMALIZATIONS`): ``"token"`` pools every masked
position of the batch, ``Σ_b Σ_t m·D / Σ_b Σ_t m`` (a long continuation weighs as many times as it has tokens);
``"sequence"`` is DistillSpec's ``(1/B) Σ_b (1/|y_b|) Σ_t D`` (each continuation's mean, then the mean over the
continuations with at least one masked position: every sequence weighs the same).

A temperature of 0 (greedy decoding) has no softmax and no gradient: training refuses it. For evaluation,
:func:`mean_total_variation` accepts T = 0 (one-hot argmax laws, so the TV of a row is 1 where the argmaxes differ).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from blockspec_jax import sampling

__all__ = ["DIVERGENCES", "NORMALIZATIONS", "token_divergence", "per_token_divergence", "mean_total_variation", "total_variation",
           "masked_mean", "check_temperature", "check_divergence", "check_normalization"]

#: How a loss averages over a batch (see the module docstring).
NORMALIZATIONS = ("token", "sequence")


def _kl(logp_BxTxV: jax.Array, logq_BxTxV: jax.Array) -> jax.Array:
  """KL(p‖q) per row [B, T] from log-probabilities (finite logits give finite log-softmax values)."""
  return jnp.sum(jnp.exp(logp_BxTxV) * (logp_BxTxV - logq_BxTxV), axis=-1)


def _fkl(logp_BxTxV, logq_BxTxV, beta):
  del beta
  return _kl(logp_BxTxV, logq_BxTxV)


def _rkl(logp_BxTxV, logq_BxTxV, beta):
  del beta
  return _kl(logq_BxTxV, logp_BxTxV)


def _jsd(logp_BxTxV, logq_BxTxV, beta):
  # log m = log(β p + (1−β) q), computed as a logaddexp of log-probabilities (no log of a small sum).
  logm_BxTxV = jnp.logaddexp(jnp.log(beta) + logp_BxTxV, jnp.log1p(-beta) + logq_BxTxV)
  return beta * _kl(logp_BxTxV, logm_BxTxV) + (1.0 - beta) * _kl(logq_BxTxV, logm_BxTxV)


def _tvd(logp_BxTxV, logq_BxTxV, beta):
  del beta
  return 0.5 * jnp.sum(jnp.abs(jnp.exp(logp_BxTxV) - jnp.exp(logq_BxTxV)), axis=-1)


#: name -> per-position divergence ``(logp_BxTxV, logq_BxTxV, beta) -> d_BxT`` (p: target, q: drafter).
DIVERGENCES: dict[str, Callable[[jax.Array, jax.Array, float], jax.Array]] = {
    "fkl": _fkl, "rkl": _rkl, "jsd": _jsd, "tvd": _tvd}


def check_divergence(name: str, beta: float = 0.5) -> None:
  """ValueError for an unknown divergence name (listing the known ones) or a JSD β outside (0, 1)."""
  if name not in DIVERGENCES:
    raise ValueError(f"unknown divergence {name!r}; known: {', '.join(DIVERGENCES)}")
  if name == "jsd" and not (isinstance(beta, (int, float)) and 0.0 < beta < 1.0):
    raise ValueError(f"jsd needs beta in (0, 1), got {beta!r}")


def check_temperature(temperature: float) -> float:
  """A training temperature must be a finite number > 0 (T = 0 is greedy decoding: no softmax, no gradient)."""
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
    raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
  if not (temperature > 0.0 and math.isfinite(temperature)):
    raise ValueError(f"temperature must be > 0 for training (T = 0 is greedy: no softmax to match, no gradient); "
                     f"got {temperature}")
  return float(temperature)


def masked_mean(values_BxT: jax.Array, mask_BxT: jax.Array | None, normalization: str = "token") -> jax.Array:
  """Mean of ``values_BxT`` over the set positions of ``mask_BxT`` (all when None); 0 when none is set.

  ``normalization``: ``"token"`` weighs every set position the same (``Σ m·v / Σ m``); ``"sequence"`` takes each
  row's mean over its set positions (the last axis), then the mean over the rows with at least one."""
  check_normalization(normalization)
  values_BxT = values_BxT.astype(jnp.float32)
  mask_BxT = jnp.ones_like(values_BxT) if mask_BxT is None else jnp.asarray(mask_BxT).astype(jnp.float32)
  if mask_BxT.shape != values_BxT.shape:
    raise ValueError(f"mask shape {mask_BxT.shape} != per-position shape {values_BxT.shape}")
  if normalization == "token":
    return jnp.sum(values_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)
  count_B = jnp.sum(mask_BxT, axis=-1)
  row_mean_B = jnp.sum(values_BxT * mask_BxT, axis=-1) / jnp.maximum(count_B, 1.0)
  has_B = (count_B > 0).astype(jnp.float32)
  return jnp.sum(row_mean_B * has_B) / jnp.maximum(jnp.sum(has_B), 1.0)


def check_normalization(normalization: str) -> None:
  """ValueError naming the choices for anything but a name of :data:`NORMALIZATIONS`."""
  if normalization not in NORMALIZATIONS:
    raise ValueError(f"unknown loss normalization {normalization!r}; known: {', '.join(NORMALIZATIONS)} (token: "
                     "every position of the batch weighs the same; sequence: DistillSpec's mean per sequence first)")


def _check_logits(target_logits_BxTxV, drafter_logits_BxTxV):
  if target_logits_BxTxV.shape != drafter_logits_BxTxV.shape:
    raise ValueError(f"target logits {target_logits_BxTxV.shape} and drafter logits {drafter_logits_BxTxV.shape} "
                     f"differ in shape (same batch, positions and vocabulary needed)")


def per_token_divergence(name: str, target_logits_BxTxV: jax.Array, drafter_logits_BxTxV: jax.Array, *,
                         temperature: float = 1.0, beta: float = 0.5) -> jax.Array:
  """``D(p‖q)`` at every position: f32 ``[...]`` (the logits' leading shape), p = target, q = drafter laws at T."""
  check_divergence(name, beta)
  temperature = check_temperature(temperature)
  _check_logits(target_logits_BxTxV, drafter_logits_BxTxV)
  logp_BxTxV = jax.nn.log_softmax(jnp.asarray(target_logits_BxTxV, jnp.float32) / temperature, axis=-1)
  logq_BxTxV = jax.nn.log_softmax(jnp.asarray(drafter_logits_BxTxV, jnp.float32) / temperature, axis=-1)
  return DIVERGENCES[name](logp_BxTxV, logq_BxTxV, float(beta))


def token_divergence(name: str, target_logits_BxTxV: jax.Array, drafter_logits_BxTxV: jax.Array,
                     mask_BxT: jax.Array | None = None, *, temperature: float = 1.0, beta: float = 0.5,
                     normalization: str = "token") -> jax.Array:
  """Scalar f32: mean over masked positions of ``D(p‖q)``, p = softmax(target / T), q = softmax(drafter / T),
  pooled over the batch's positions or averaged per sequence first (``normalization``, :func:`masked_mean`).

  Args:
    name: a key of :data:`DIVERGENCES` ("fkl", "rkl", "jsd", "tvd").
    target_logits_BxTxV, drafter_logits_BxTxV: f32 [B, T, V] (any equal leading shape works).
    mask_BxT: bool / float [B, T] weights of the positions (None: every position).
    temperature: T > 0 (ValueError for 0, negative or non-finite values).
    beta: the JSD mixture weight, in (0, 1) (ignored by the other divergences).
  """
  d_BxT = per_token_divergence(name, target_logits_BxTxV, drafter_logits_BxTxV, temperature=temperature, beta=beta)
  return masked_mean(d_BxT, mask_BxT, normalization)


def mean_total_variation(target_logits_BxTxV: jax.Array, drafter_logits_BxTxV: jax.Array,
                         mask_BxT: jax.Array | None = None, *, temperature: float = 1.0, top_k: int = 0,
                         top_p: float = 1.0) -> jax.Array:
  """Evaluation: mean over masked positions of ½ Σ |p − q| with both laws transformed as the sampler does
  (:func:`blockspec_jax.sampling.probs_from_logits`: T = 0 allowed (argmax one-hots), top-k / top-p too)."""
  return masked_mean(total_variation(target_logits_BxTxV, drafter_logits_BxTxV, temperature=temperature,
                                     top_k=top_k, top_p=top_p), mask_BxT)


def total_variation(target_logits_BxTxV: jax.Array, drafter_logits_BxTxV: jax.Array, *, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """f32 [B, T]: ½ Σ |p − q| at every position, both laws transformed as the sampler does (what
  :func:`mean_total_variation` averages; at T = 1, one minus token verification's acceptance rate there)."""
  _check_logits(target_logits_BxTxV, drafter_logits_BxTxV)
  p_BxTxV = sampling.probs_from_logits(target_logits_BxTxV, temperature=temperature, top_k=top_k, top_p=top_p)
  q_BxTxV = sampling.probs_from_logits(drafter_logits_BxTxV, temperature=temperature, top_k=top_k, top_p=top_p)
  return 0.5 * jnp.sum(jnp.abs(p_BxTxV - q_BxTxV), axis=-1)
