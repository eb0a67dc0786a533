"""Reference speculative decoding over tabular language models (no neural network), fully jitted.

A tabular model is a table ``probs_RxV`` of next-token laws indexed by the prefix (see
:class:`blockspec_jax.theory.TabularLM`: every prefix up to ``depth`` tokens has its own row, longer prefixes use
their last ``depth`` tokens). The loop is the real algorithm in miniature: ``lax.while_loop`` over iterations; a
``lax.scan`` of γ drafter steps sampling ``X_i ~ q`` with :func:`blockspec_jax.sampling.sample`; the γ+1 target rows
of the drafted prefix; one verification; commit ``X_1..X_τ, Y``; repeat. Because the emitted sequence must have
exactly the target's law whatever the drafter, the law of the first few emitted tokens of many runs (``jax.vmap``
over keys) is compared with the target law computed by enumeration: the losslessness proof of every rule.

Randomness: each iteration uses ``fold_in(key, iteration)``, fresh for every iteration (and, under ``vmap``, every
row has its own key). ``coin_keying="position"`` instead derives the verification uniforms from the *absolute
position* of each drafted token, so a position that is re-drafted reuses its uniform. That is a known bug pattern,
kept here only so a test can show that it biases block verification (which looks at every coin) while token
verification (which never looks past its first rejection) stays exact; it needs a rule that declares
``takes_coins`` (its ``rule`` accepts ``coins=``). Do not use it otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax import sampling
from blockspec_jax.verify import VERIFIERS, Verifier, get_verifier

__all__ = ["TabularTables", "ReferenceState", "tabular_row_index", "tabular_probs", "verify_blocks_tabular",
           "speculative_decode_tabular"]

COIN_KEYINGS = ("iteration", "position")


@struct.dataclass
class TabularTables:
  """A tabular model on device: ``probs_RxV`` with static ``depth``. Build from a TabularLM with ``from_lm``."""
  probs_RxV: jax.Array
  depth: int = struct.field(pytree_node=False)

  @classmethod
  def from_lm(cls, lm) -> "TabularTables":
    return cls(jnp.asarray(lm.probs, jnp.float32), int(lm.depth))

  @property
  def vocab_size(self) -> int:
    return self.probs_RxV.shape[-1]


def tabular_row_index(tokens_T: jax.Array, length: jax.Array, vocab_size: int, depth: int) -> jax.Array:
  """Row of the prefix ``tokens_T[:length]``: ``offset(m) + Σ_j s_j V^(m−1−j)`` over its last ``m = min(length,
  depth)`` tokens ``s``, where ``offset(m) = Σ_{l<m} V^l``. Matches ``TabularLM.row_index``."""
  if depth == 0:
    return jnp.int32(0)
  m = jnp.minimum(length, depth)
  offsets_D1 = jnp.cumsum(jnp.array([0] + [vocab_size ** l for l in range(depth)], jnp.int32))
  k_D = jnp.arange(depth, dtype=jnp.int32)
  positions_D = length - m + k_D
  digits_D = jnp.where(k_D < m, tokens_T[jnp.clip(positions_D, 0, tokens_T.shape[0] - 1)], 0)
  powers_D = jnp.where(k_D < m, vocab_size ** jnp.maximum(m - 1 - k_D, 0), 0)
  return offsets_D1[m] + jnp.sum(digits_D * powers_D)


def tabular_probs(tables: TabularTables, tokens_T: jax.Array, length: jax.Array) -> jax.Array:
  return tables.probs_RxV[tabular_row_index(tokens_T, length, tables.vocab_size, tables.depth)]


@struct.dataclass
class ReferenceState:
  tokens_T: jax.Array        # int32 [T]  prompt, emitted tokens, then scratch for the current draft
  length: jax.Array          # int32 []   prompt + emitted tokens so far
  iteration: jax.Array       # int32 []   iterations run (= target calls = num_drafts)
  num_accepted: jax.Array    # int32 []   accepted draft tokens, summed over iterations
  expected_accepted: jax.Array  # f32 [] Σ over iterations of Σ_i P(τ ≥ i | X^i) (Rao–Blackwellised)


def _draft_and_score(key_draft, drafter: TabularTables, target: TabularTables, tokens_T, length, gamma: int):
  """γ drafter steps (``lax.scan``) after ``tokens_T[:length]`` and the γ+1 target rows of the drafted prefix.

  Returns ``(tokens_T with the draft written at length.., draft_G, q_GxV, p_G1xV)``; ``q_GxV`` are exactly the rows
  the draft tokens were sampled from.
  """
  def draft_step(carry, key_i):
    tokens_T, position = carry
    q_V = tabular_probs(drafter, tokens_T, position)
    x = sampling.sample(key_i, q_V)
    return (tokens_T.at[position].set(x), position + 1), (x, q_V)

  (tokens_T, _), (draft_G, q_GxV) = jax.lax.scan(draft_step, (tokens_T, length), jax.random.split(key_draft, gamma))
  p_G1xV = jax.vmap(lambda i: tabular_probs(target, tokens_T, length + i))(jnp.arange(gamma + 1))
  return tokens_T, draft_G, q_GxV, p_G1xV


def _check_pair(drafter: TabularTables, target: TabularTables, gamma: int):
  if gamma < 1:
    raise ValueError(f"block length gamma must be >= 1, got {gamma}")
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(f"vocabulary mismatch: drafter V = {drafter.vocab_size}, target V = {target.vocab_size}")


def verify_blocks_tabular(keys_N, drafter: TabularTables, target: TabularTables, context_C, *, gamma: int,
                          verifier: Verifier | str = "block"):
  """One iteration (draft γ tokens after ``context_C``, verify) per key: ``(draft_NxG, VerifyResult [N])``.

  The measured counterpart of the exact single-iteration laws in :mod:`blockspec_jax.theory`.
  """
  verifier = get_verifier(verifier)
  _check_pair(drafter, target, gamma)
  context_C = jnp.asarray(context_C, jnp.int32)
  length = context_C.shape[0]
  tokens_T = jnp.zeros((length + gamma + 1,), jnp.int32).at[:length].set(context_C)

  def one(key):
    key_draft, key_verify = jax.random.split(key)
    _, draft_G, q_GxV, p_G1xV = _draft_and_score(key_draft, drafter, target, tokens_T, jnp.int32(length), gamma)
    return draft_G, verifier(key_verify, draft_G, q_GxV, p_G1xV)

  return jax.vmap(one)(keys_N)


def speculative_decode_tabular(key, drafter: TabularTables, target: TabularTables, prompt_P, *, gamma: int,
                               num_tokens: int, verifier: Verifier | str = "block",
                               coin_keying: str = "iteration"):
  """Generate ``num_tokens`` tokens after ``prompt_P`` by speculative decoding; returns ``(tokens_N, state)``.

  Jittable with ``gamma``, ``num_tokens``, ``verifier`` and ``coin_keying`` static; vmap it over keys for laws.
  """
  verifier = get_verifier(verifier)
  _check_pair(drafter, target, gamma)
  if coin_keying not in COIN_KEYINGS:
    raise ValueError(f"unknown coin_keying {coin_keying!r}; known: {COIN_KEYINGS}")
  if coin_keying == "position" and not verifier.takes_coins:
    with_coins = " or ".join(name for name, cls in VERIFIERS.items() if cls.takes_coins)
    raise ValueError(f"coin_keying='position' needs a rule that takes coins ({with_coins}); {verifier.name!r} does not")
  prompt_P = jnp.asarray(prompt_P, jnp.int32)
  prompt_len = prompt_P.shape[0]
  end = prompt_len + num_tokens
  buffer_len = end + gamma + 1
  tokens_T = jnp.zeros((buffer_len,), jnp.int32).at[:prompt_len].set(prompt_P)
  key_iterations, key_positions = jax.random.split(key)

  def body(state: ReferenceState) -> ReferenceState:
    key_iter = jax.random.fold_in(key_iterations, state.iteration)
    key_draft, key_verify = jax.random.split(key_iter)
    tokens_T, draft_G, q_GxV, p_G1xV = _draft_and_score(key_draft, drafter, target, state.tokens_T, state.length,
                                                         gamma)
    if coin_keying == "position":
      positions_G = state.length + jnp.arange(gamma)
      coins_G = jax.vmap(lambda t: jax.random.uniform(jax.random.fold_in(key_positions, t)))(positions_G)
      result = type(verifier).rule(key_verify, draft_G, q_GxV, p_G1xV, coins=coins_G)
    else:
      result = verifier(key_verify, draft_G, q_GxV, p_G1xV)
    tokens_T = tokens_T.at[state.length + result.num_accepted].set(result.next_token)
    return ReferenceState(tokens_T, state.length + result.num_accepted + 1, state.iteration + 1,
                          state.num_accepted + result.num_accepted,
                          state.expected_accepted + jnp.sum(result.acceptance_probs))

  init = ReferenceState(tokens_T, jnp.int32(prompt_len), jnp.int32(0), jnp.int32(0), jnp.float32(0.0))
  final = jax.lax.while_loop(lambda s: s.length < end, body, init)
  return jax.lax.dynamic_slice_in_dim(final.tokens_T, prompt_len, num_tokens), final
