"""Autoregressive and speculative decoding (chains and trees), each one ``jax.jit``-compiled ``lax.while_loop``.

Layout of a row (t5x-style padding slots, so ragged rows never need an early exit)::

    tokens_BxS[b, :length_B[b]]   prompt + committed tokens
    cache slots                   valid for positions < length − 1; the last committed token is fed next
    S = max_prompt_len + max_new_tokens + N + 1: a finished row keeps computing on its padding without committing

The loop talks to models only through the contracts of :mod:`blockspec_jax.decoding.contracts`: a ``target``
(:class:`~blockspec_jax.decoding.contracts.TargetScorer`; a ``DecoderConfig`` is wrapped in
:class:`~blockspec_jax.models.scorer.DecoderScorer`) and a ``drafter``
(:class:`~blockspec_jax.decoding.contracts.Drafter`).

One speculative iteration: the drafter proposes a :class:`~blockspec_jax.decoding.contracts.Draft` of ``N`` nodes
of depth ``≤ γ`` (a chain: ``N = γ``), the target scores ``[last, node_0..node_{N−1}]`` in one pass under the tree
mask (a chain: the causal mask; ``N + 1`` rows ``p``), the verifier (vmapped over rows) returns the accepted path
(``τ`` nodes) and ``Y``, each row commits the path's tokens and ``Y`` cut at its first stop token and then at its
token budget, the accepted path's cache entries move into place (trees only), and the drafter gets a
:class:`~blockspec_jax.decoding.contracts.Commit`. Rollback is moving ``length``: stale cache entries beyond it are
overwritten before they are attended to.

Randomness: row ``b`` uses ``fold_in(keys_B[b], iteration)`` only, so a row's output does not depend on its batch
neighbours, on padding or on the device count. The autoregressive sampler is the same machinery without a drafter.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax import sampling
from blockspec_jax.checks import check_int
from blockspec_jax.decoding import contracts
from blockspec_jax.decoding.contracts import Commit, Draft, Drafter, TargetScorer
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.models.scorer import as_scorer
from blockspec_jax.verify import Verifier, distribution_errors, get_verifier, warn_if_inexact

__all__ = ["DecodeMetrics", "DecodeState", "DecodeOutput", "prepare_prompts", "autoregressive_prefill",
           "autoregressive_decode", "autoregressive_program", "speculative_prefill", "speculative_decode",
           "speculative_program", "generate_autoregressive", "generate_speculative", "prefill_autoregressive",
           "decode_autoregressive", "prefill_speculative", "decode_speculative", "draft_and_score",
           "AUTOREGRESSIVE_STATIC", "AUTOREGRESSIVE_PREFILL_STATIC", "SPECULATIVE_STATIC",
           "SPECULATIVE_PREFILL_STATIC", "summarize_metrics", "check_prompt_values", "ScoredDraft"]


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
  ``invalid_prob_rows`` counter reports.
  """
  if isinstance(tokens_BxP, jax.core.Tracer) or isinstance(prompt_len_B, jax.core.Tracer):
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


def _check_common(target: TargetScorer, tokens_BxP, prompt_len_B, max_new_tokens, cache_len):
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


def _commit(state_tokens_BxS, length_B, done_B, block_BxK, num_valid_B, generated_B, max_new_tokens: int,
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


def _score_causal(target: TargetScorer, params, tokens_BxT, positions_BxT, cache, cache_len: int):
  """A pass whose slots are its positions under the causal mask (prefill, autoregressive steps, chains)."""
  return target.score(params, tokens_BxT, positions_BxT, positions_BxT,
                      decoder_lib.causal_mask(positions_BxT, cache_len), cache)


def _init(target: TargetScorer, target_params, tokens_BxP, prompt_len_B, cache_len, cache_sharding=None):
  """The token buffer and the target's prefill pass over the prompt width: ``(tokens_BxS, Scored)``."""
  batch, width = tokens_BxP.shape
  tokens_BxS = jnp.zeros((batch, cache_len), jnp.int32).at[:, :width].set(tokens_BxP)
  cache = constrain_caches(target.init_cache(batch, cache_len), cache_sharding)
  positions_BxP = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  return tokens_BxS, _score_causal(target, target_params, tokens_BxP, positions_BxP, cache, cache_len)


def _output(state: DecodeState, max_new_tokens: int, pad_id: int, stopped_B) -> DecodeOutput:
  prompt_len_B = state.prompt_len_B
  rows_B = jnp.arange(state.tokens_BxS.shape[0])
  index_N = jnp.arange(max_new_tokens)
  slots_BxN = jnp.minimum(prompt_len_B[:, None] + index_N[None, :], state.tokens_BxS.shape[1] - 1)
  num_B = state.length_B - prompt_len_B
  tokens_BxN = jnp.where(index_N[None, :] < num_B[:, None], state.tokens_BxS[rows_B[:, None], slots_BxN], pad_id)
  return DecodeOutput(tokens_BxN, num_B, stopped_B, state.iteration, state.metrics)


def _check_state(state: DecodeState, keys_B, max_new_tokens: int, draft_slots: int, gamma) -> None:
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


AUTOREGRESSIVE_STATIC = ("target", "max_new_tokens", "sampler", "stop_ids", "pad_id", "cache_sharding")
AUTOREGRESSIVE_PREFILL_STATIC = ("target", "max_new_tokens", "cache_sharding")


def autoregressive_prefill(target_params, tokens_BxP, prompt_len_B, *, target, max_new_tokens: int,
                           cache_sharding=None) -> DecodeState:
  """Phase 1 of the baseline: checks, then one target forward over the prompt width into a fresh cache of
  ``S = P + max_new_tokens + 1`` slots. Returns the loop's initial state (``length_B = prompt_len_B``)."""
  target = as_scorer(target)
  cache_len = tokens_BxP.shape[1] + max_new_tokens + 1
  _check_common(target, tokens_BxP, prompt_len_B, max_new_tokens, cache_len)
  batch = tokens_BxP.shape[0]
  tokens_BxS, scored = _init(target, target_params, tokens_BxP, prompt_len_B, cache_len, cache_sharding)
  return DecodeState(tokens_BxS, prompt_len_B, jnp.zeros((batch,), bool), scored.cache, None, jnp.int32(0),
                     DecodeMetrics.zeros(batch, 0), prompt_len_B, prompt_width=tokens_BxP.shape[1])


def autoregressive_decode(target_params, keys_B, state: DecodeState, *, target, max_new_tokens: int,
                          sampler: sampling.Sampler = sampling.Sampler(), stop_ids: tuple[int, ...] = (),
                          pad_id: int = 0, cache_sharding=None) -> DecodeOutput:
  """Phase 2 of the baseline: one target step per token (``lax.while_loop``) from a prefilled ``state``."""
  del cache_sharding  # the caches in ``state`` already carry their layout
  target = as_scorer(target)
  batch, cache_len = state.tokens_BxS.shape
  _check_state(state, keys_B, max_new_tokens, 1, None)
  rows_B = jnp.arange(batch)

  def body(carry):
    state, stopped_B = carry
    position_B = state.length_B - 1
    last_B = state.tokens_BxS[rows_B, position_B]
    scored = _score_causal(target, target_params, last_B[:, None], position_B[:, None], state.target_cache,
                           cache_len)
    cache = scored.cache
    probs_BxV = sampler.probs(scored.logits_BxTxV[:, 0])
    step_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, state.iteration)
    next_B = jax.vmap(sampling.sample)(step_keys_B, probs_BxV)
    generated_B = state.length_B - state.prompt_len_B
    tokens_BxS, length_B, done_B, kept_B, stop_B = _commit(
        state.tokens_BxS, state.length_B, state.done_B, next_B[:, None], jnp.ones((batch,), jnp.int32),
        generated_B, max_new_tokens, stop_ids)
    m = state.metrics
    metrics = m.replace(num_emitted_tokens=m.num_emitted_tokens + kept_B,
                        invalid_prob_rows=m.invalid_prob_rows + (distribution_errors(probs_BxV) != 0))
    new_state = state.replace(tokens_BxS=tokens_BxS, length_B=length_B, done_B=done_B, target_cache=cache,
                              iteration=state.iteration + 1, metrics=metrics)
    return new_state, stopped_B | stop_B

  state, stopped_B = jax.lax.while_loop(lambda c: ~jnp.all(c[0].done_B), body, (state, jnp.zeros((batch,), bool)))
  return _output(state, max_new_tokens, pad_id, stopped_B)


def autoregressive_program(target_params, keys_B, tokens_BxP, prompt_len_B, *, target, max_new_tokens: int,
                           sampler: sampling.Sampler = sampling.Sampler(), stop_ids: tuple[int, ...] = (),
                           pad_id: int = 0, cache_sharding=None) -> DecodeOutput:
  """The baseline: prefill, then one target step per token (``lax.while_loop``). Row keys as in the speculative
  loop, so the autoregressive law per row is directly comparable. Exactly the composition of
  :func:`autoregressive_prefill` and :func:`autoregressive_decode` (which a caller can compile and time apart)."""
  state = autoregressive_prefill(target_params, tokens_BxP, prompt_len_B, target=target,
                                 max_new_tokens=max_new_tokens, cache_sharding=cache_sharding)
  return autoregressive_decode(target_params, keys_B, state, target=target,
                               max_new_tokens=max_new_tokens, sampler=sampler, stop_ids=stop_ids, pad_id=pad_id)


def _with_prompt_checks(jitted, tokens_arg: int):
  """``jitted`` preceded by :func:`check_prompt_values` on concrete prompts (positional ``tokens_arg`` and the next
  argument are the prompt ids and lengths); ``.jitted`` is the bare compiled function (``.lower`` etc.)."""
  @functools.wraps(jitted)
  def call(*args, **kwargs):
    if len(args) > tokens_arg + 1 and "target" in kwargs:
      check_prompt_values(args[tokens_arg], args[tokens_arg + 1], as_scorer(kwargs["target"]).vocab_size)
    return jitted(*args, **kwargs)
  call.jitted = jitted
  return call


#: The compiled autoregressive loop, and its two phases compiled apart (no donation: the output cannot alias the
#: caches, and copying a state into the loop's carry once is noise next to the loop). Concrete prompts are checked
#: (lengths in [1, P], ids in [0, V)) before the call.
generate_autoregressive = _with_prompt_checks(
    jax.jit(autoregressive_program, static_argnames=AUTOREGRESSIVE_STATIC), 2)
prefill_autoregressive = _with_prompt_checks(
    jax.jit(autoregressive_prefill, static_argnames=AUTOREGRESSIVE_PREFILL_STATIC), 1)
decode_autoregressive = jax.jit(autoregressive_decode, static_argnames=AUTOREGRESSIVE_STATIC)


SPECULATIVE_STATIC = ("target", "drafter", "gamma", "max_new_tokens", "verifier", "sampler", "stop_ids", "pad_id",
                      "cache_sharding")
SPECULATIVE_PREFILL_STATIC = ("target", "drafter", "gamma", "max_new_tokens", "cache_sharding", "replay_stride")


def _draft_slots(drafter: Drafter, gamma: int) -> int:
  """Cache slots a draft needs beyond the committed tokens: its ``N`` nodes and the bonus position."""
  if isinstance(gamma, bool) or not isinstance(gamma, (int,)) or gamma < 1:
    raise ValueError(f"block length gamma must be >= 1 (an integer), got {gamma!r}")
  contracts.check_drafter(drafter)
  return drafter.num_nodes(gamma) + 1


def speculative_prefill(target_params, drafter_params, tokens_BxP, prompt_len_B, *, target, drafter: Drafter,
                        gamma: int, max_new_tokens: int, cache_sharding=None, history_B=None,
                        replay_stride: int = 1) -> DecodeState:
  """Phase 1: checks (γ, vocabularies, cache room), then the target's and the drafter's forward over the prompt
  width into caches of ``S = P + max_new_tokens + N + 1`` slots (``N = drafter.num_nodes(γ)``). Returns the loop's
  initial state.

  ``history_B`` (int32 ``[B]``, optional): the last ``history_B[b]`` tokens of row ``b``'s prompt were committed by
  decoding, not given as a prompt (an evaluation that starts drafting inside a continuation). A drafter whose state
  depends on how tokens were committed (:func:`~blockspec_jax.decoding.contracts.replays_history`, SD²) is brought to
  the state decoding leaves after committing them in rounds of ``replay_stride`` tokens; for every other drafter the
  plain prefill already is that state, and ``history_B`` changes nothing."""
  draft_slots = _draft_slots(drafter, gamma)
  target = as_scorer(target, contracts.target_layers(drafter))
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(f"vocabulary mismatch between drafter (V = {drafter.vocab_size}) and target "
                     f"(V = {target.vocab_size}); both models must share one tokenizer")
  cache_len = tokens_BxP.shape[1] + max_new_tokens + draft_slots
  _check_common(target, tokens_BxP, prompt_len_B, max_new_tokens, cache_len)
  if drafter.max_len is not None and cache_len > drafter.max_len:
    raise ValueError(f"prompt too long for the drafter's cache: needs {cache_len} positions, drafter max_len is "
                     f"{drafter.max_len}")
  batch = tokens_BxP.shape[0]
  tokens_BxS, scored = _init(target, target_params, tokens_BxP, prompt_len_B, cache_len, cache_sharding)
  drafter_state = constrain_caches(drafter.init_state(drafter_params, tokens_BxP, prompt_len_B, cache_len),
                                   cache_sharding)
  if history_B is not None and contracts.replays_history(drafter):
    replay_stride = check_int(replay_stride, "replay_stride", hint=" (tokens committed per round)")
    history_B = jnp.clip(jnp.asarray(history_B, jnp.int32), 0, prompt_len_B - 1)
    drafter_state = drafter.replay(drafter_params, drafter_state, tokens_BxS, scored.taps_BxTxLxD,
                                   prompt_len_B - history_B, prompt_len_B, replay_stride)
  if contracts.reads_target(drafter):  # the prompt as a committed block: the first draft reads the target too
    drafter_state = drafter.commit(drafter_params, drafter_state, contracts.prompt_commit(
        scored.hidden_BxTxD, scored.taps_BxTxLxD, tokens_BxP, prompt_len_B, gamma))
  return DecodeState(tokens_BxS, prompt_len_B, jnp.zeros((batch,), bool), scored.cache, drafter_state, jnp.int32(0),
                     DecodeMetrics.zeros(batch, gamma), prompt_len_B, prompt_width=tokens_BxP.shape[1])


@struct.dataclass
class ScoredDraft:
  """The first half of an iteration (:func:`draft_and_score`), before verification.

  ``drafter_state``   the drafter's state after proposing
  ``draft``           :class:`~blockspec_jax.decoding.contracts.Draft` (``N`` nodes per row)
  ``p_BxN1xV``        f32 ``[B, N + 1, V]``: row 0 = the target's law after the committed tokens, row ``n + 1`` =
                      after node ``n`` (its root-to-node path), after ``sampler``
  ``hidden_BxN1xD``   the target's last-layer hidden states at the same ``N + 1`` queries
  ``depth_BxN``       int32 ``[B, N]``: depth of every node (1 = child of the root)
  ``target_cache``    the target's cache with the draft's entries at slots ``length − 1 + [0..N]``
  ``taps_BxN1xLxD``   the residual stream after the drafter's ``target_layers`` at the same queries (or None)
  """
  drafter_state: Any
  draft: Draft
  p_BxN1xV: jax.Array
  hidden_BxN1xD: jax.Array
  depth_BxN: jax.Array
  target_cache: Any
  taps_BxN1xLxD: Any = None


def draft_and_score(target_params, drafter_params, state: DecodeState, key_B, *, target, drafter: Drafter,
                    gamma: int, sampler: sampling.Sampler) -> ScoredDraft:
  """The drafter proposes a draft after each row's committed tokens, then the target scores
  ``[last committed, nodes]`` in one pass (tree layout of :mod:`blockspec_jax.decoding.contracts`; a chain's nodes
  sit at their own positions under the causal mask). Pure: ``state`` is not consumed, so several drafts can be
  scored from one state (``blockspec_jax.eval.paired``).
  """
  target = as_scorer(target, contracts.target_layers(drafter))
  batch, cache_len = state.tokens_BxS.shape
  rows_B = jnp.arange(batch)
  drafter_state, draft = drafter.propose(drafter_params, state.drafter_state, state.tokens_BxS, state.length_B,
                                         key_B, gamma, sampler)
  n_nodes = drafter.num_nodes(gamma)
  if draft.tokens_BxN.shape != (batch, n_nodes) or draft.parents_BxN.shape != (batch, n_nodes):
    raise ValueError(f"{type(drafter).__name__} declared N = {n_nodes} nodes for gamma = {gamma} but proposed "
                     f"tokens {draft.tokens_BxN.shape} and parents {draft.parents_BxN.shape}; expected "
                     f"{(batch, n_nodes)}")
  if draft.q_BxNxV is None and not draft.is_chain:
    raise ValueError(f"{type(drafter).__name__} proposed a tree without rows q: point-mass drafts must be chains "
                     "(siblings drawn from a point mass repeat one token; a tree needs the laws it was drawn from)")
  if draft.is_chain != drafter.is_chain:
    raise ValueError(f"{type(drafter).__name__} declares is_chain = {drafter.is_chain} but its draft says "
                     f"{draft.is_chain}")
  last_B = state.tokens_BxS[rows_B, state.length_B - 1]
  inputs_BxN1 = jnp.concatenate([last_B[:, None], draft.tokens_BxN], axis=1)
  if draft.is_chain:
    depth_BxN = jnp.broadcast_to(jnp.arange(1, n_nodes + 1, dtype=jnp.int32), (batch, n_nodes))
    positions_BxN1 = state.length_B[:, None] - 1 + jnp.arange(n_nodes + 1, dtype=jnp.int32)[None, :]
    scored = _score_causal(target, target_params, inputs_BxN1, positions_BxN1, state.target_cache, cache_len)
  else:
    ancestors_BxNxN = contracts.ancestors(draft.parents_BxN)
    depth_BxN = contracts.node_depths(ancestors_BxNxN)
    positions_BxN1, slots_BxN1 = contracts.tree_positions(state.length_B, depth_BxN)
    mask_BxN1xS = contracts.tree_attention_mask(state.length_B, ancestors_BxNxN, cache_len)
    scored = target.score(target_params, inputs_BxN1, positions_BxN1, slots_BxN1, mask_BxN1xS, state.target_cache)
  return ScoredDraft(drafter_state, draft, sampler.probs(scored.logits_BxTxV), scored.hidden_BxTxD, depth_BxN,
                     scored.cache, scored.taps_BxTxLxD)


def _iteration_keys(keys_B, iteration):
  """``(draft_key_B, verify_key_B)`` of one iteration: ``fold_in(row key, iteration)`` split in two."""
  iter_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, iteration)
  split_Bx2 = jax.vmap(jax.random.split)(iter_keys_B)
  return split_Bx2[:, 0], split_Bx2[:, 1]


def _emitted_block(draft: Draft, verdict, batch: int, gamma: int):
  """int32 ``[B, γ + 1]``: the accepted path's tokens, then ``Y`` at index τ (zeros after)."""
  rows_B = jnp.arange(batch)
  path_tokens_BxG = jnp.take_along_axis(draft.tokens_BxN, jnp.maximum(verdict.path_BxG, 0), axis=1)
  path_tokens_BxG = jnp.where(verdict.path_BxG >= 0, path_tokens_BxG, 0)
  block_BxG1 = jnp.concatenate([path_tokens_BxG, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  return block_BxG1.at[rows_B, verdict.num_accepted_B].set(verdict.next_token_B)


def _path_hidden(hidden_BxN1x, path_BxG):
  """The target's states at the queries ``[last committed, path nodes]``: ``[B, γ + 1, ...]`` (hidden states
  ``[B, N + 1, D]`` or taps ``[B, N + 1, L', D]``; ``None`` stays ``None``)."""
  if hidden_BxN1x is None:
    return None
  query_BxG1 = jnp.concatenate([jnp.zeros_like(path_BxG[:, :1]), jnp.maximum(path_BxG, -1) + 1], axis=1)
  index = query_BxG1.reshape(query_BxG1.shape + (1,) * (hidden_BxN1x.ndim - 2))
  return jnp.take_along_axis(hidden_BxN1x, index, axis=1)


def speculative_decode(target_params, drafter_params, keys_B, state: DecodeState, *, target,
                       drafter: Drafter, gamma: int, max_new_tokens: int, verifier: Verifier | str = "block",
                       sampler: sampling.Sampler = sampling.Sampler(), stop_ids: tuple[int, ...] = (),
                       pad_id: int = 0, cache_sharding=None) -> DecodeOutput:
  """Phase 2: the speculative ``lax.while_loop`` from a state made by :func:`speculative_prefill` with the same
  ``target``, ``drafter``, ``gamma`` and ``max_new_tokens``. See the module docstring."""
  del cache_sharding  # the caches in ``state`` already carry their layout
  target = as_scorer(target, contracts.target_layers(drafter))
  verifier = get_verifier(verifier)
  draft_slots = _draft_slots(drafter, gamma)
  verifier.check_drafter(type(drafter).__name__, drafter)
  warn_if_inexact(verifier, sampler)
  if verifier.skips_target:  # the rule decides when the target is called: its own loop (SPRINTER)
    return verifier.decode(target_params, drafter_params, keys_B, state, target=target, drafter=drafter,
                           gamma=gamma, max_new_tokens=max_new_tokens, sampler=sampler, stop_ids=stop_ids,
                           pad_id=pad_id)
  batch = state.tokens_BxS.shape[0]
  n_nodes = draft_slots - 1
  _check_state(state, keys_B, max_new_tokens, draft_slots, gamma)

  def body(carry):
    state, stopped_B = carry
    draft_key_B, verify_key_B = _iteration_keys(keys_B, state.iteration)
    scored = draft_and_score(target_params, drafter_params, state, draft_key_B, target=target, drafter=drafter,
                             gamma=gamma, sampler=sampler)
    draft = scored.draft
    verdict = verifier.verify_draft(verify_key_B, draft, scored.p_BxN1xV, scored.depth_BxN, gamma)
    tau_B = verdict.num_accepted_B
    block_BxG1 = _emitted_block(draft, verdict, batch, gamma)
    generated_B = state.length_B - state.prompt_len_B
    tokens_BxS, length_B, done_B, kept_B, stop_B = _commit(
        state.tokens_BxS, state.length_B, state.done_B, block_BxG1, tau_B + 1, generated_B, max_new_tokens,
        stop_ids)
    cache = scored.target_cache
    if not draft.is_chain:  # path commit: the accepted nodes' entries into slots length .. length + τ − 1
      cache = target.move_slots(cache, *contracts.path_slots(state.length_B, verdict.path_BxG, tau_B))
    commit = Commit(old_length_B=state.length_B, new_length_B=length_B, num_accepted_B=tau_B,
                    path_BxG=verdict.path_BxG, tokens_BxG1=block_BxG1,
                    hidden_BxG1xD=_path_hidden(scored.hidden_BxN1xD, verdict.path_BxG),
                    taps_BxG1xLxD=_path_hidden(scored.taps_BxN1xLxD, verdict.path_BxG))
    drafter_state = drafter.commit(drafter_params, scored.drafter_state, commit)
    active_B = ~state.done_B
    active_i = active_B.astype(jnp.int32)
    m = state.metrics
    bad_rows_B = jnp.sum(distribution_errors(scored.p_BxN1xV) != 0, axis=1)
    if draft.q_BxNxV is not None:
      bad_rows_B = bad_rows_B + jnp.sum(distribution_errors(draft.q_BxNxV) != 0, axis=1)
    metrics = DecodeMetrics(
        num_drafts=m.num_drafts + active_i,
        num_draft_tokens=m.num_draft_tokens + n_nodes * active_i,
        num_accepted_tokens=m.num_accepted_tokens + tau_B * active_i,
        accepted_per_position_BxG=m.accepted_per_position_BxG
        + ((jnp.arange(1, gamma + 1)[None, :] <= tau_B[:, None]) & active_B[:, None]).astype(jnp.int32),
        num_emitted_tokens=m.num_emitted_tokens + kept_B,
        expected_accepted=m.expected_accepted + jnp.where(active_B, verdict.expected_accepted_B, 0.0),
        invalid_prob_rows=m.invalid_prob_rows + jnp.where(active_B, bad_rows_B, 0))
    new_state = state.replace(tokens_BxS=tokens_BxS, length_B=length_B, done_B=done_B, target_cache=cache,
                              drafter_state=drafter_state, iteration=state.iteration + 1, metrics=metrics)
    return new_state, stopped_B | stop_B

  state, stopped_B = jax.lax.while_loop(lambda c: ~jnp.all(c[0].done_B), body, (state, jnp.zeros((batch,), bool)))
  return _output(state, max_new_tokens, pad_id, stopped_B)


def speculative_program(target_params, drafter_params, keys_B, tokens_BxP, prompt_len_B, *, target,
                        drafter: Drafter, gamma: int, max_new_tokens: int, verifier: Verifier | str = "block",
                        sampler: sampling.Sampler = sampling.Sampler(), stop_ids: tuple[int, ...] = (),
                        pad_id: int = 0, cache_sharding=None) -> DecodeOutput:
  """Speculative decoding of ``max_new_tokens`` per row in one compiled program: exactly the composition of
  :func:`speculative_prefill` and :func:`speculative_decode` (which a caller can compile and time apart).

  Lossless for lossless verifiers: every row's tokens have the target's law under ``sampler``, because drafter and
  target rows both come from ``sampler.probs``, the draft is drawn from exactly the rows it passes as ``q`` (or is a
  point mass), and a tree rule only runs on trees drawn the way it requires (checked at trace time).
  """
  state = speculative_prefill(target_params, drafter_params, tokens_BxP, prompt_len_B, target=target,
                              drafter=drafter, gamma=gamma, max_new_tokens=max_new_tokens,
                              cache_sharding=cache_sharding)
  return speculative_decode(target_params, drafter_params, keys_B, state, target=target,
                            drafter=drafter, gamma=gamma, max_new_tokens=max_new_tokens, verifier=verifier,
                            sampler=sampler, stop_ids=stop_ids, pad_id=pad_id)


#: The compiled speculative loop (one device or default placement). For meshes see ``blockspec_jax.parallel``.
generate_speculative = _with_prompt_checks(jax.jit(speculative_program, static_argnames=SPECULATIVE_STATIC), 3)
prefill_speculative = _with_prompt_checks(
    jax.jit(speculative_prefill, static_argnames=SPECULATIVE_PREFILL_STATIC), 2)
decode_speculative = jax.jit(speculative_decode, static_argnames=SPECULATIVE_STATIC)


def _finite_or_none(x: float):
  return x if x == x else None  # NaN: the tree rules do not provide the Rao–Blackwellised estimate


def summarize_metrics(metrics: DecodeMetrics) -> dict:
  """Batch totals with the names of docs/ALGORITHMS.md §7 (host-side; call on a finished run's ``metrics``).

  ``mean_acceptance_length = 1 + accepted / drafts`` (block efficiency), ``draft_acceptance_rate = accepted /
  drafted``, ``acceptance_per_position[i] = P(τ ≥ i+1)`` over drafts, ``expected_accepted_per_draft`` the
  Rao–Blackwellised ``E[τ]``, and per-row acceptance lengths (a histogram source for per-request statistics).
  """
  import numpy as np  # host-side only

  drafts = int(np.sum(metrics.num_drafts))
  drafted = int(np.sum(metrics.num_draft_tokens))
  accepted = int(np.sum(metrics.num_accepted_tokens))
  per_row_drafts = np.maximum(np.asarray(metrics.num_drafts), 1)
  return dict(
      num_drafts=drafts,
      num_draft_tokens=drafted,
      num_accepted_tokens=accepted,
      num_emitted_tokens=int(np.sum(metrics.num_emitted_tokens)),
      mean_acceptance_length=1.0 + accepted / max(drafts, 1),
      draft_acceptance_rate=accepted / max(drafted, 1),
      acceptance_per_position=(np.sum(metrics.accepted_per_position_BxG, axis=0) / max(drafts, 1)).tolist(),
      expected_accepted_per_draft=_finite_or_none(float(np.sum(metrics.expected_accepted)) / max(drafts, 1)),
      per_row_mean_acceptance_length=(1.0 + np.asarray(metrics.num_accepted_tokens) / per_row_drafts).tolist(),
      invalid_prob_rows=int(np.sum(metrics.invalid_prob_rows)),
  )
