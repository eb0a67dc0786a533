"""Input checks for verification rules.

Two kinds of check:

* :func:`check_block_shapes` runs at trace time on static shapes and dtypes (wrong rank, drafter/target vocabulary
  mismatch, γ < 1, rows that do not line up) and raises ``ValueError`` naming the argument and the shapes.
* :func:`distribution_errors` is jittable and returns, per row, a bit mask of what is wrong with a probability row
  (negative entry, NaN/inf, sum away from 1). :func:`validate_distributions` runs it on concrete arrays and raises
  a ``ValueError`` that lists the offending rows, so garbage never turns silently into a draft decision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "NEGATIVE", "NOT_FINITE", "BAD_SUM", "check_block_shapes", "distribution_errors", "describe_errors",
    "validate_distributions", "validate_block",
]

# Bit flags returned by distribution_errors.
NEGATIVE = 1
NOT_FINITE = 2
BAD_SUM = 4
_FLAG_NAMES = ((NEGATIVE, "negative entry"), (NOT_FINITE, "NaN or inf entry"), (BAD_SUM, "does not sum to 1"))

DEFAULT_SUM_TOLERANCE = 1e-3  # f32 softmax over 150k entries sums to 1 within ~1e-5; garbage misses by far more


def check_block_shapes(draft_tokens, draft_probs, target_probs) -> tuple[int, int]:
  """Check one block's static shapes/dtypes; return ``(gamma, vocab_size)``.

  Expected: ``draft_tokens`` int ``[γ]``, ``draft_probs`` float ``[γ, V]``, ``target_probs`` float ``[γ+1, V]``,
  γ ≥ 1. Works on tracers (only ``.shape``/``.dtype`` are read), so it fires at trace time under ``jit``/``vmap``.
  """
  draft_tokens, draft_probs, target_probs = (jnp.asarray(x) if not hasattr(x, "shape") else x
                                             for x in (draft_tokens, draft_probs, target_probs))
  if draft_tokens.ndim != 1:
    raise ValueError(f"draft_tokens must have shape [gamma] for one block (use jax.vmap / the batched verifier for "
                     f"batches), got shape {tuple(draft_tokens.shape)}")
  if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
    raise ValueError(f"draft_tokens must be integer token ids, got dtype {draft_tokens.dtype}")
  gamma = draft_tokens.shape[0]
  if gamma < 1:
    raise ValueError(f"block length gamma must be >= 1, got gamma = {gamma}")
  for name, x in (("draft_probs", draft_probs), ("target_probs", target_probs)):
    if x.ndim != 2:
      raise ValueError(f"{name} must have rank 2 ([rows, vocab]) for one block, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point probabilities, got dtype {x.dtype}")
  if draft_probs.shape[1] != target_probs.shape[1]:
    raise ValueError(f"vocabulary mismatch between drafter and target: draft_probs has V = {draft_probs.shape[1]}, "
                     f"target_probs has V = {target_probs.shape[1]}; both models must share one tokenizer")
  if draft_probs.shape[0] != gamma:
    raise ValueError(f"draft_probs must have gamma = {gamma} rows (M_s(.|c, X^i), i = 0..gamma-1), got shape "
                     f"{tuple(draft_probs.shape)}")
  if target_probs.shape[0] != gamma + 1:
    raise ValueError(f"target_probs must have gamma + 1 = {gamma + 1} rows (M_b(.|c, X^i), i = 0..gamma), got "
                     f"shape {tuple(target_probs.shape)}")
  return gamma, draft_probs.shape[1]


def distribution_errors(probs_xV: jax.Array, atol: float = DEFAULT_SUM_TOLERANCE) -> jax.Array:
  """Per-row bit mask (int32 ``[...]``): NEGATIVE | NOT_FINITE | BAD_SUM; 0 means a valid distribution. Jittable."""
  probs_xV = jnp.asarray(probs_xV)
  not_finite = jnp.any(~jnp.isfinite(probs_xV), axis=-1)
  negative = jnp.any(probs_xV < 0, axis=-1)
  total = jnp.sum(jnp.where(jnp.isfinite(probs_xV), probs_xV, 0.0).astype(jnp.float32), axis=-1)
  bad_sum = jnp.abs(total - 1.0) > atol
  return (negative * NEGATIVE + not_finite * NOT_FINITE + bad_sum * BAD_SUM).astype(jnp.int32)


def describe_errors(flags: int) -> str:
  return ", ".join(name for bit, name in _FLAG_NAMES if flags & bit) or "ok"


def validate_distributions(name: str, probs_xV, atol: float = DEFAULT_SUM_TOLERANCE, max_listed: int = 8):
  """Raise ``ValueError`` listing the rows of concrete ``probs_xV`` that are not probability distributions."""
  if isinstance(probs_xV, jax.core.Tracer):
    raise TypeError("validate_distributions needs concrete arrays; inside jit use distribution_errors and carry the "
                    "flags out (the decode loops count them)")
  probs_np = np.asarray(probs_xV)
  flags = np.asarray(distribution_errors(probs_np, atol))
  bad = np.argwhere(flags != 0)
  if bad.size:
    sums = np.nansum(probs_np.astype(np.float64), axis=-1)
    listed = "; ".join(f"row {tuple(int(i) for i in idx)}: {describe_errors(int(flags[tuple(idx)]))} "
                       f"(sum = {sums[tuple(idx)]:.6g})" for idx in bad[:max_listed])
    more = f" (and {len(bad) - max_listed} more)" if len(bad) > max_listed else ""
    raise ValueError(f"{name}: {len(bad)} of {flags.size} rows are not probability distributions "
                     f"(tolerance {atol}): {listed}{more}")


def validate_block(draft_tokens, draft_probs, target_probs, atol: float = DEFAULT_SUM_TOLERANCE):
  """Eager full check of one block or a batch of blocks (leading batch axes allowed): shapes, token range, rows."""
  draft_tokens, draft_probs, target_probs = (np.asarray(x) for x in (draft_tokens, draft_probs, target_probs))
  batch_shape = draft_tokens.shape[:-1]
  if draft_probs.shape[:-2] != batch_shape or target_probs.shape[:-2] != batch_shape:
    raise ValueError(f"batch shapes differ: draft_tokens {draft_tokens.shape}, draft_probs {draft_probs.shape}, "
                     f"target_probs {target_probs.shape}")
  flat = len(batch_shape)
  gamma, vocab = check_block_shapes(draft_tokens.reshape((-1,) + draft_tokens.shape[flat:])[0],
                                    draft_probs.reshape((-1,) + draft_probs.shape[flat:])[0],
                                    target_probs.reshape((-1,) + target_probs.shape[flat:])[0])
  if draft_tokens.size and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
    raise ValueError(f"draft_tokens out of range [0, {vocab}): min {draft_tokens.min()}, max {draft_tokens.max()}")
  validate_distributions("draft_probs", draft_probs, atol)
  validate_distributions("target_probs", target_probs, atol)
  drafted_q = np.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
  if np.any(drafted_q <= 0):
    idx = tuple(int(i) for i in np.argwhere(drafted_q <= 0)[0])
    raise ValueError(f"draft token at {idx} has probability 0 under draft_probs: q must be the law the draft was "
                     f"sampled from (same temperature / top-k / top-p transform as the drafter used)")
  return gamma, vocab
