"""Prompt lookup / n-gram drafting (Saxena 2023, "prompt lookup decoding"): no model, no parameters.

The draft continues the most recent earlier occurrence of the row's last ``n`` committed tokens (``n`` from
``max_ngram`` down to ``min_ngram``: the longest match wins, then the latest): the γ tokens that followed that
occurrence. Only the committed tokens ``tokens_BxS[b, :length_B[b]]`` are ever read. When the continuation reaches
the end of the committed tokens it goes on copying from the draft itself (an overlapping copy, as in LZ77): a match
``P`` tokens back proposes ``tokens[start + (g mod P)]``, which continues a periodic text (``4 8 4 8 4`` → ``8 4 8``)
instead of stopping. Without a match the last committed token is repeated. Every draft token is a point mass:
``Draft.q_BxNxV = None``, no ``[B, γ, V]`` is built. Lossless with every lossless chain rule: a point mass is the law
the token was "drawn" from (the choice depends on committed tokens only, never on the target's coins).

Cost: ``O(max_ngram² · S)`` comparisons per row and iteration, vectorised over rows and positions (the only Python
loops run over the n-gram sizes and their ``n`` offsets, at trace time). Jittable; static shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from blockspec_jax.contracts import SAMPLING_CHAIN, Commit, chain_draft
from blockspec_jax.drafters.registry import register
from blockspec_jax.drafters.settings import Settings, is_int

__all__ = ["NGramDrafter", "lookup"]


def lookup(tokens_BxS: jax.Array, length_B: jax.Array, gamma: int, max_ngram: int = 3,
           min_ngram: int = 1) -> jax.Array:
  """int32 ``[B, γ]``: each row's prompt-lookup draft (see the module docstring).

  ``tokens_BxS`` int ``[B, S]``, ``length_B`` int ``[B]`` (≥ 1: the committed tokens of row b are
  ``tokens_BxS[b, :length_B[b]]``; later entries are never read). A match of size ``n`` is a position ``i`` with
  ``tokens[i : i + n] == tokens[L − n : L]`` and ``i + n ≤ L − 1`` (at least one committed token follows it, which also
  excludes the suffix matching itself); the continuation starts at ``start = i + n`` of the latest such ``i`` for the
  largest ``n`` that has one.
  """
  batch, slots = tokens_BxS.shape
  tokens_BxS = jnp.asarray(tokens_BxS).astype(jnp.int32)
  length_B = jnp.asarray(length_B).astype(jnp.int32)
  index_S = jnp.arange(slots, dtype=jnp.int32)
  rows_B = jnp.arange(batch)
  last_B = tokens_BxS[rows_B, jnp.maximum(length_B - 1, 0)]
  start_B = jnp.full((batch,), -1, jnp.int32)  # where the continuation starts (−1: no match yet)
  for n in range(max_ngram, min_ngram - 1, -1):
    # Candidates i with i + n ≤ L − 1: every position compared below (i + j ≤ i + n − 1 ≤ L − 2) is committed.
    match_BxS = (index_S[None, :] + n <= length_B[:, None] - 1)
    for j in range(n):
      here_BxS = jnp.roll(tokens_BxS, -j, axis=1)  # tokens[i + j] (wrapped entries only where i + j ≥ S: masked)
      want_B = tokens_BxS[rows_B, jnp.maximum(length_B - n + j, 0)]
      match_BxS = match_BxS & (here_BxS == want_B[:, None])
    latest_B = jnp.max(jnp.where(match_BxS, index_S[None, :] + n, -1), axis=1)
    start_B = jnp.where(start_B < 0, latest_B, start_B)
  # Overlapping copy: source start + (g mod P), P = L − start ≥ 1, always a committed position.
  period_B = jnp.maximum(length_B - start_B, 1)
  source_BxG = start_B[:, None] + jnp.arange(gamma, dtype=jnp.int32)[None, :] % period_B[:, None]
  picked_BxG = tokens_BxS[rows_B[:, None], jnp.clip(source_BxG, 0, slots - 1)]
  return jnp.where(start_B[:, None] >= 0, picked_BxG, last_B[:, None]).astype(jnp.int32)


@register("ngram")
@dataclasses.dataclass(frozen=True)
class NGramDrafter(Settings):
  """Prompt lookup over the row's committed tokens (see the module docstring); a point-mass chain of γ tokens.

  ``vocab_size``  the target's V (declared; the drafter never builds a row of it; the job passes it)
  ``max_ngram``, ``min_ngram``  the n-gram sizes tried, longest first (default 3 down to 1)
  ``max_len``     ``None``: no cache, any length works (else an integer >= 1)
  No parameters (``params`` may be ``None``), no state (``None``), no randomness (the key is ignored).
  """

  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1
  max_len: Optional[int] = None
  job_fields = ("vocab_size",)
  sibling_sampling = SAMPLING_CHAIN
  is_chain = True

  def __post_init__(self):
    if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
      raise ValueError(f"ngram drafter needs the target's vocab_size (an integer >= 1), got {self.vocab_size!r}")
    self.check_fields(None)  # no model: every constraint is model-independent

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    low, high = values["min_ngram"], values["max_ngram"]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (low, high)) or not 1 <= low <= high:
      raise ValueError(f"ngram sizes need integers 1 <= min_ngram <= max_ngram, got min_ngram={low!r}, "
                       f"max_ngram={high!r}")
    max_len = values["max_len"]
    if max_len is not None and not is_int(max_len, 1):
      raise ValueError(f"ngram max_len must be None (no limit) or an integer >= 1, got {max_len!r}")
    return {**values, "max_len": None if max_len is None else int(max_len)}

  def num_nodes(self, gamma: int) -> int:
    return gamma

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    del params, tokens_BxP, prompt_len_B, max_len
    return None

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler):
    """``(state, chain_draft(lookup(...)))``: a point-mass chain, ``q_BxNxV = None``."""
    del params, key_B, sampler  # deterministic: a point mass needs no randomness
    return state, chain_draft(lookup(tokens_BxS, length_B, gamma, self.max_ngram, self.min_ngram))

  def commit(self, params, state, commit: Commit):
    del params, commit
    return state
