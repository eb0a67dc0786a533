"""The decoding loops' shared state and building blocks (autoregressive, speculative and SPRINTER's loop).

* :class:`DecodeState` (the ``lax.while_loop`` carry: token buffer, per-row lengths, caches, metrics),
  :class:`DecodeMetrics` (per-row counters), :class:`DecodeOutput` (what a loop returns);
* the steps every loop takes: :func:`init_buffer` (token buffer and the prefill pass), :func:`score_causal` (a causal
  pass), :func:`commit_block` (a block committed under the stop and budget cuts), :func:`iteration_keys` (a row's
  keys depend on its own key and the iteration only), :func:`decode_output`, and the checks
  (:func:`check_common`, :func:`check_state`, :func:`check_prompt_values`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax.contracts import TargetScorer
from blockspec_jax.models import decoder as decoder_lib

__all__ = ["DecodeMetrics", "DecodeState", "DecodeOutput", "prepare_prompts", "check_prompt_values", "check_common",
           "commit_block", "constrain_caches", "score_causal", "init_buffer", "decode_output", "check_state",
           "iteration_keys"]


@struct.dataclass
class DecodeMetrics:
  """Per-row counters (names of docs/ALGORITHMS.md §7). All int32 ``[B]`` unless noted."""
  num_drafts: jax.Array                 # iterations in which the row was active (= target calls for the row)
  num_draft_tokens: jax.Array           # draft nodes scored per draft (N; γ for a chain)
  num_accepted_tokens: jax.Array        # Σ τ (before stop / budget cuts: what the verifier accepted)
  accepted_per_position_BxG: jax.Array  # int32 [B, γ]: number of drafts with τ ≥ i (accepted path reached depth i)
  num_emitted_tokens: jax.Array         # tokens committed after the prompt
  expected_accepted: jax.Array          # f32 [B]: Σ over drafts of Σ_i P(τ ≥ i | X^i) (Rao–Blackwellised; chain
                                        #   rules only, NaN for tree rules, which do not provide it)
  invalid_prob_rows: jax.Array          # rows of p or q that were not distributions (should stay 0)

  @classmethod
  def zeros(cls, batch: int, gamma: int) -> "DecodeMetrics":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, z, jnp.zeros((batch, max(gamma, 1)), jnp.int32), z, jnp.zeros((batch,), jnp.float32), z)


@struct.dataclass
class DecodeState:
  tokens_BxS: jax.Array   # int32 [B, S]
  length_B: jax.Array     # int32 [B]  committed tokens (prompt + generated)
  done_B: jax.Array       # bool  [B]
  target_cache: Any       # decoder KVCache
  drafter_state: Any      # drafter-specific (None for autoregressive)
  iteration: jax.Array    # int32 []
  metrics: DecodeMetrics
  prompt_len_B: jax.Array  # int32 [B]  prompt lengths (fixed: generated = length_B − prompt_len_B)
  prompt_width: int = struct.field(pytree_node=False, default=0)  # P: static, lets a decode phase check its state


@struct.dataclass
class DecodeOutput:
  tokens_BxN: jax.Array       # int32 [B, max_new_tokens], generated tokens, ``pad_id`` after a row's end
  num_tokens_B: jax.Array     # int32 [B]
  stopped_B: jax.Array        # bool [B]: ended on a stop token (else on the budget)
  iterations: jax.Array       # int32 []: loop iterations (target calls of the longest row)
  metrics: DecodeMetrics
  extra: Any = None           # rule-specific per-row counters (SPRINTER: decoding.sprinter.SprinterCounters)


def prepare_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0):
  """Ragged Python prompts → ``(tokens_BxP int32, prompt_len_B int32)``, right-padded with ``pad_id``."""
  if len(prompts) == 0:
    raise ValueError("no prompts given")
  lengths = [len(p) for p in prompts]
  if min(lengths) < 1:
    raise ValueError(f"every prompt needs at least one token (e.g. BOS); prompt lengths {lengths}")
  width = max(lengths)
  rows = [list(p) + [pad_id] * (width - len(p)) for p in prompts]
  return jnp.asarray(rows, jnp.int32), jnp.asarray(lengths, jnp.int32)


def check_prompt_values(tokens_BxP, prompt_len_B, vocab_size: int) -> None:
  """Eager value checks of concrete prompts (skipped for tracers, whose values are unknown at trace time): every
  length in ``[1, P]`` and every prompt id (before each row's length) in ``[0, V)``. Raises ValueError naming the rows.

  Under ``jit`` the loop cannot raise on values; an out-of-vocabulary id there gives NaN logits, which the loop's
  ``invalid_prob_rows`` counter reports. A global array of a multi-host run is checked on the rows this process
  holds (the other processes check theirs; fetching the whole array is refused there).
  """
  if isinstance(tokens_BxP, jax.core.Tracer) or isinstance(prompt_len_B, jax.core.Tracer):
    return
  if (isinstance(tokens_BxP, jax.Array) and isinstance(prompt_len_B, jax.Array)
      and not tokens_BxP.is_fully_addressable):
    lengths = {shard.device: shard.data for shard in prompt_len_B.addressable_shards}
    for shard in tokens_BxP.addressable_shards:
      check_prompt_values(shard.data, lengths[shard.device], vocab_size)
    return
  import numpy as np  # host-side check
  tokens_BxP, lens_B = np.asarray(tokens_BxP), np.asarray(prompt_len_B)
  if tokens_BxP.ndim != 2 or lens_B.shape != tokens_BxP.shape[:1]:
    return  # shape errors are reported by the trace-time checks, with the shapes
  width = tokens_BxP.shape[1]
  bad_len = np.flatnonzero((lens_B < 1) | (lens_B > width))
  if bad_len.size:
    raise ValueError(f"prompt_len_B must be in [1, prompt width {width}]; rows {bad_len[:8].tolist()} have lengths "
                     f"{lens_B[bad_len[:8]].tolist()}")
  in_prompt_BxP = np.arange(width)[None, :] < lens_B[:, None]
  bad_BxP = in_prompt_BxP & ((tokens_BxP < 0) | (tokens_BxP >= vocab_size))
  if bad_BxP.any():
    rows, cols = np.nonzero(bad_BxP)
    raise ValueError(f"prompt ids must be in [0, V = {vocab_size}); row {rows[0]} position {cols[0]} holds "
                     f"{tokens_BxP[rows[0], cols[0]]} ({bad_BxP.sum()} bad ids in {len(set(rows.tolist()))} rows)")


def check_common(target: TargetScorer, tokens_BxP, prompt_len_B, max_new_tokens, cache_len):
  if tokens_BxP.ndim != 2:
    raise ValueError(f"prompt tokens must be [B, P], got shape {tokens_BxP.shape}")
  if prompt_len_B.shape != (tokens_BxP.shape[0],):
    raise ValueError(f"prompt_len_B must be [B] = [{tokens_BxP.shape[0]}], got {prompt_len_B.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if cache_len > target.max_len:
    raise ValueError(
        f"prompt too long for the cache: longest prompt {tokens_BxP.shape[1]} + max_new_tokens {max_new_tokens} + "
        f"draft slots needs {cache_len} positions, model max_len is {target.max_len}")


def commit_block(state_tokens_BxS, length_B, done_B, block_BxK, num_valid_B, generated_B, max_new_tokens: int,
            stop_ids: tuple[int, ...]):
  """Write ``block_BxK[:, :n]`` at each row's ``length`` where n = tokens kept after the stop and budget cuts.

  A stop token inside the block ends the row there (the stop token is kept); then the budget is applied. Finished
  rows commit nothing. Returns ``(tokens_BxS, length_B, done_B, num_kept_B, stopped_B)``.
  """
  k = block_BxK.shape[1]
  index_K = jnp.arange(k)
  in_block_BxK = index_K[None, :] < num_valid_B[:, None]
  if stop_ids:
    is_stop_BxK = jnp.isin(block_BxK, jnp.asarray(stop_ids, jnp.int32)) & in_block_BxK
    has_stop_B = jnp.any(is_stop_BxK, axis=1)
    first_stop_B = jnp.argmax(is_stop_BxK, axis=1)
    num_kept_B = jnp.where(has_stop_B, first_stop_B + 1, num_valid_B)
  else:
    has_stop_B = jnp.zeros_like(done_B)
    num_kept_B = num_valid_B
  budget_left_B = max_new_tokens - generated_B
  stopped_B = has_stop_B & (num_kept_B <= budget_left_B) & ~done_B
  num_kept_B = jnp.where(done_B, 0, jnp.minimum(num_kept_B, budget_left_B))
  rows_B = jnp.arange(block_BxK.shape[0])
  slots_BxK = length_B[:, None] + index_K[None, :]
  write_BxK = index_K[None, :] < num_kept_B[:, None]
  current_BxK = state_tokens_BxS[rows_B[:, None], jnp.minimum(slots_BxK, state_tokens_BxS.shape[1] - 1)]
  tokens_BxS = state_tokens_BxS.at[rows_B[:, None], jnp.minimum(slots_BxK, state_tokens_BxS.shape[1] - 1)].set(
      jnp.where(write_BxK, block_BxK, current_BxK))
  new_generated_B = generated_B + num_kept_B
  done_B = done_B | stopped_B | (new_generated_B >= max_new_tokens)
  return tokens_BxS, length_B + num_kept_B, done_B, num_kept_B, stopped_B


def constrain_caches(tree, cache_sharding):
  """Pin every KV cache in ``tree`` to ``cache_sharding`` (a NamedSharding from blockspec_jax.parallel, or None)."""
  if cache_sharding is None:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, cache_sharding) if x.ndim == 5 else x, tree)


def score_causal(target: TargetScorer, params, tokens_BxT, positions_BxT, cache, cache_len: int):
  """A pass whose slots are its positions under the causal mask (prefill, autoregressive steps, chains)."""
  return target.score(params, tokens_BxT, positions_BxT, positions_BxT,
                      decoder_lib.causal_mask(positions_BxT, cache_len), cache)


def init_buffer(target: TargetScorer, target_params, tokens_BxP, prompt_len_B, cache_len, cache_sharding=None):
  """The token buffer and the target's prefill pass over the prompt width: ``(tokens_BxS, Scored)``."""
  batch, width = tokens_BxP.shape
  tokens_BxS = jnp.zeros((batch, cache_len), jnp.int32).at[:, :width].set(tokens_BxP)
  cache = constrain_caches(target.init_cache(batch, cache_len), cache_sharding)
  positions_BxP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  return tokens_BxS, score_causal(target, target_params, tokens_BxP, positions_BxP, cache, cache_len)


def decode_output(state: DecodeState, max_new_tokens: int, pad_id: int, stopped_B) -> DecodeOutput:
  prompt_len_B = state.prompt_len_B
  rows_B = jnp.arange(state.tokens_BxS.shape[0])
  index_N = jnp.arange(max_new_tokens)
  slots_BxN = jnp.minimum(prompt_len_B[:, None] + index_N[None, :], state.tokens_BxS.shape[1] - 1)
  num_B = state.length_B - prompt_len_B
  tokens_BxN = jnp.where(index_N[None, :] < num_B[:, None], state.tokens_BxS[rows_B[:, None], slots_BxN], pad_id)
  return DecodeOutput(tokens_BxN, num_B, stopped_B, state.iteration, state.metrics)


def check_state(state: DecodeState, keys_B, max_new_tokens: int, draft_slots: int, gamma) -> None:
  """A decode phase must get the state its own prefill made: a cache sized for the same ``max_new_tokens`` and γ
  (a bigger budget would run past the cache) and a metrics block for the same γ. (The prompts' lengths travel in
  the state, so they cannot disagree with the prefill.) One key per row."""
  rows = state.length_B.shape
  typed = jax.dtypes.issubdtype(keys_B.dtype, jax.dtypes.prng_key)
  if (keys_B.shape if typed else keys_B.shape[:1]) != rows or (not typed and keys_B.ndim != 2):
    raise ValueError(f"keys_B must hold one key per row: shape {rows} (typed keys) or {rows + (2,)} (raw uint32 "
                     f"keys); got {keys_B.shape}")
  cache_len = state.tokens_BxS.shape[1]
  if state.prompt_width + max_new_tokens + draft_slots != cache_len:
    raise ValueError(f"state has {cache_len} slots for prompt width {state.prompt_width}: it was prefilled for "
                     f"{cache_len - state.prompt_width - draft_slots} new tokens, decoding asks for {max_new_tokens} "
                     "(prefill and decode need the same max_new_tokens and gamma)")
  if gamma is not None and state.metrics.accepted_per_position_BxG.shape[1] != gamma:
    raise ValueError(f"state was prefilled for gamma = {state.metrics.accepted_per_position_BxG.shape[1]}, "
                     f"decoding with gamma = {gamma}")



def iteration_keys(keys_B, iteration):
  """``(draft_key_B, verify_key_B)`` of one iteration: ``fold_in(row key, iteration)`` split in two."""
  iter_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, iteration)
  split_Bx2 = jax.vmap(jax.random.split)(iter_keys_B)
  return split_Bx2[:, 0], split_Bx2[:, 1]
