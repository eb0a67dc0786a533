"""Verifiers: frozen dataclasses wrapping one single-block rule, with a batched form; selectable by name or gin."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp

from blockspec_jax.verify import rules

__all__ = ["Verifier", "TokenVerifier", "BlockVerifier", "GreedyVerifier", "ExactMatchVerifier", "VERIFIERS",
           "DEFAULT_VERIFIER", "get_verifier", "row_keys", "warn_if_inexact"]


def row_keys(key: jax.Array, batch_size: int) -> jax.Array:
  """Per-row keys ``fold_in(key, row)``: a row's randomness depends only on its index, not on its neighbours."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch_size, dtype=jnp.uint32))


@dataclasses.dataclass(frozen=True)
class Verifier:
  """A verification rule plus its settings. Call it on one block; ``batch`` maps it over rows with ``jax.vmap``.

  Subclasses set ``name``, ``lossless`` (exactly the target law when the draft law is the one passed in),
  ``requires_greedy_target`` (lossless only when the target is sampled at temperature 0) and ``needs_draft_probs``.
  Hashable and static under ``jax.jit``.
  """

  name: ClassVar[str] = ""
  lossless: ClassVar[bool] = True
  requires_greedy_target: ClassVar[bool] = False
  needs_draft_probs: ClassVar[bool] = True
  rule: ClassVar[Callable[..., rules.VerifyResult]]

  def lossless_under(self, sampler) -> bool:
    """Whether decoding with this rule has exactly the target's law under ``sampler`` (a ``sampling.Sampler``)."""
    return self.lossless and (sampler.temperature == 0.0 or not self.requires_greedy_target)

  def __call__(self, key, draft_tokens, draft_probs, target_probs) -> rules.VerifyResult:
    return type(self).rule(key, draft_tokens, draft_probs, target_probs)

  def batch(self, keys_B, draft_tokens_BxG, draft_probs_BxGxV, target_probs_BxG1xV) -> rules.VerifyResult:
    """Verify ``B`` independent blocks; ``keys_B`` holds one key per row (see :func:`row_keys`)."""
    for name, x, rank in (("draft_tokens", draft_tokens_BxG, 2), ("draft_probs", draft_probs_BxGxV, 3),
                          ("target_probs", target_probs_BxG1xV, 3)):
      if jnp.ndim(x) != rank:
        raise ValueError(f"batched {name} must have rank {rank} (leading batch axis), got shape {jnp.shape(x)}")
    sizes = {jnp.shape(keys_B)[0], jnp.shape(draft_tokens_BxG)[0], jnp.shape(draft_probs_BxGxV)[0],
             jnp.shape(target_probs_BxG1xV)[0]}
    if len(sizes) != 1:
      raise ValueError(f"batch sizes differ: keys {jnp.shape(keys_B)}, draft_tokens {jnp.shape(draft_tokens_BxG)}, "
                       f"draft_probs {jnp.shape(draft_probs_BxGxV)}, target_probs {jnp.shape(target_probs_BxG1xV)}")
    return jax.vmap(self)(keys_B, draft_tokens_BxG, draft_probs_BxGxV, target_probs_BxG1xV)


@dataclasses.dataclass(frozen=True)
class TokenVerifier(Verifier):
  name: ClassVar[str] = "token"
  rule = staticmethod(rules.token_verify)


@dataclasses.dataclass(frozen=True)
class BlockVerifier(Verifier):
  name: ClassVar[str] = "block"
  rule = staticmethod(rules.block_verify)


@dataclasses.dataclass(frozen=True)
class GreedyVerifier(Verifier):
  """Lossless only for a greedy (temperature 0) target; at T > 0 it emits argmaxes, not samples."""
  name: ClassVar[str] = "greedy"
  requires_greedy_target: ClassVar[bool] = True
  needs_draft_probs: ClassVar[bool] = False
  rule = staticmethod(rules.greedy_verify)


@dataclasses.dataclass(frozen=True)
class ExactMatchVerifier(Verifier):
  name: ClassVar[str] = "exact_match"
  needs_draft_probs: ClassVar[bool] = False
  rule = staticmethod(rules.exact_match_verify)


VERIFIERS: dict[str, type[Verifier]] = {
    cls.name: cls for cls in (BlockVerifier, TokenVerifier, GreedyVerifier, ExactMatchVerifier)}
DEFAULT_VERIFIER = "block"


_warned_inexact: set = set()  # (rule name, temperature) pairs already warned about in this process


def warn_if_inexact(verifier: Verifier, sampler) -> bool:
  """Warn (once per rule and temperature in a process) when ``verifier`` does not sample the target's law under
  ``sampler`` although the user asked for sampling (e.g. the greedy rule at T > 0). Returns True when inexact."""
  if verifier.lossless_under(sampler):
    return False
  key = (verifier.name, float(sampler.temperature))
  if key not in _warned_inexact:
    _warned_inexact.add(key)
    why = ("it is lossless only for a greedy (T = 0) target" if verifier.requires_greedy_target
           else "it is a lossy rule")
    warnings.warn(f"verifier {verifier.name!r} at temperature {sampler.temperature:g} does not sample the target's "
                  f"distribution: {why}; use 'block' or 'token' for exact sampling", UserWarning, stacklevel=3)
  return True


def get_verifier(name: str = DEFAULT_VERIFIER, **settings) -> Verifier:
  """The verifier registered under ``name`` ("block" by default); unknown names list the known ones."""
  if isinstance(name, Verifier):
    return name
  try:
    cls = VERIFIERS[name]
  except KeyError:
    raise ValueError(f"unknown verifier {name!r}; known verifiers: {', '.join(sorted(VERIFIERS))}") from None
  return cls(**settings)
