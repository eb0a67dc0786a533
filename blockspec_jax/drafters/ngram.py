"""Prompt lookup / n-gram drafting (Saxena 2023, "prompt lookup decoding"): no model, no parameters.

The draft continues the most recent earlier occurrence of the row's last ``n`` committed tokens (``n`` from
``max_ngram`` down to ``min_ngram``, the longest match wins): the γ tokens that followed that occurrence. Without a
match (or where the continuation runs past the committed tokens) the last available token is repeated. Every draft
token is a point mass: ``Draft.q_BxNxV = None``, no ``[B, γ, V]`` is built. Lossless with every lossless chain rule:
a point mass is the law the token was "drawn" from (the choice depends on committed tokens only, never on the
target's coins).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

from blockspec_jax.decoding.contracts import SAMPLING_CHAIN, Commit, chain_draft

__all__ = ["NGramDrafter", "lookup"]


def lookup(tokens_BxS, length_B, gamma: int, max_ngram: int = 3, min_ngram: int = 1):
  """int32 ``[B, γ]``: the continuation of the latest earlier match of the last ``n`` committed tokens (longest ``n``
  first), reading only positions ``< length_B``; the last committed token repeated where nothing matches."""
  batch, slots = tokens_BxS.shape
  index_S = jnp.arange(slots, dtype=jnp.int32)
  rows_Bx1 = jnp.arange(batch)[:, None]
  last_B = tokens_BxS[jnp.arange(batch), length_B - 1]
  start_B = jnp.full((batch,), -1, jnp.int32)  # where the continuation starts (−1: no match yet)
  for n in range(max_ngram, min_ngram - 1, -1):
    # A match at i: tokens[i .. i+n−1] == tokens[L−n .. L−1], with i + n ≤ L − 1 (one continuation token committed).
    match_BxS = (index_S[None, :] + n <= length_B[:, None] - 1) & (length_B[:, None] >= n + 1)
    for j in range(n):
      here_BxS = tokens_BxS[rows_Bx1, jnp.minimum(index_S[None, :] + j, slots - 1)]
      want_B = tokens_BxS[jnp.arange(batch), jnp.maximum(length_B - n + j, 0)]
      match_BxS = match_BxS & (here_BxS == want_B[:, None])
    latest_B = jnp.max(jnp.where(match_BxS, index_S[None, :] + n, -1), axis=1)
    start_B = jnp.where(start_B < 0, latest_B, start_B)
  offsets_G = jnp.arange(gamma, dtype=jnp.int32)
  source_BxG = start_B[:, None] + offsets_G[None, :]
  valid_BxG = (start_B[:, None] >= 0) & (source_BxG < length_B[:, None])
  picked_BxG = tokens_BxS[rows_Bx1, jnp.clip(source_BxG, 0, slots - 1)]
  # Past the committed tokens, or without a match: repeat the last valid token of the draft (or the last committed).
  draft_BxG = jnp.where(valid_BxG, picked_BxG, -1)
  filled = []
  previous_B = last_B
  for g in range(gamma):
    current_B = jnp.where(draft_BxG[:, g] >= 0, draft_BxG[:, g], previous_B)
    filled.append(current_B)
    previous_B = current_B
  return jnp.stack(filled, axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NGramDrafter:
  """Prompt lookup over the row's committed tokens (see the module docstring); ``vocab_size`` must be the target's."""

  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1
  max_len: Optional[int] = None
  sibling_sampling = SAMPLING_CHAIN
  is_chain = True

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"ngram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
    if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
      raise ValueError(f"ngram drafter needs the target's vocab_size (an integer >= 1), got {self.vocab_size!r}")

  def num_nodes(self, gamma):
    return gamma

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    return None

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler):
    del params, key_B, sampler  # deterministic: a point mass needs no randomness
    return state, chain_draft(lookup(tokens_BxS, length_B, gamma, self.max_ngram, self.min_ngram))

  def commit(self, params, state, commit: Commit):
    return state
