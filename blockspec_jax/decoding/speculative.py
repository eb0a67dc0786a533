"""Autoregressive and speculative decoding (chains and trees), each one ``jax.jit``-compiled ``lax.while_loop``.

Layout of a row (t5x-style padding slots, so ragged rows never need an early exit)::

    tokens_BxS[b, :length_B[b]]   prompt + committed tokens
    cache slots                   valid for positions < length − 1; the last committed token is fed next
    S = max_prompt_len + max_new_tokens + N + 1: a finished row keeps computing on its padding without committing

The loop talks to models only through the contracts of :mod:`blockspec_jax.contracts`: a ``target``
(:class:`~blockspec_jax.contracts.TargetScorer`; a ``DecoderConfig`` is wrapped in
:class:`~blockspec_jax.models.scorer.DecoderScorer`) and a ``drafter``
(:class:`~blockspec_jax.contracts.Drafter`).

One speculative iteration: the drafter proposes a :class:`~blockspec_jax.contracts.Draft` of ``N`` nodes
of depth ``≤ γ`` (a chain: ``N = γ``), the target scores ``[last, node_0..node_{N−1}]`` in one pass under the tree
mask (a chain: the causal mask; ``N + 1`` rows ``p``), the verifier (vmapped over rows) returns the accepted path
(``τ`` nodes) and ``Y``, each row commits the path's tokens and ``Y`` cut at its first stop token and then at its
token budget, the accepted path's cache entries move into place (trees only), and the drafter gets a
:class:`~blockspec_jax.contracts.Commit`. Rollback is moving ``length``: stale cache entries beyond it are
overwritten before they are attended to.

Randomness: row ``b`` uses ``fold_in(keys_B[b], iteration)`` only, so a row's output does not depend on its batch
neighbours, on padding or on the device count. The autoregressive sampler is the same machinery without a drafter.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax import sampling
from blockspec_jax.checks import check_int
from blockspec_jax import contracts
from blockspec_jax.contracts import Commit, Draft, Drafter
from blockspec_jax.models.scorer import as_scorer
from blockspec_jax.decoding import sprinter
from blockspec_jax.decoding.state import (DecodeMetrics, DecodeOutput, DecodeState, check_common, check_prompt_values,
                                          check_state, commit_block, constrain_caches, decode_output, init_buffer,
                                          iteration_keys, prepare_prompts, score_causal)
from blockspec_jax.verify import Verifier, distribution_errors, get_verifier, warn_if_inexact

__all__ = ["DecodeMetrics", "DecodeState", "DecodeOutput", "prepare_prompts", "autoregressive_prefill",
           "autoregressive_decode", "autoregressive_program", "speculative_prefill", "speculative_decode",
           "speculative_program", "generate_autoregressive", "generate_speculative", "prefill_autoregressive",
           "decode_autoregressive", "prefill_speculative", "decode_speculative", "draft_and_score",
           "AUTOREGRESSIVE_STATIC", "AUTOREGRESSIVE_PREFILL_STATIC", "SPECULATIVE_STATIC",
           "SPECULATIVE_PREFILL_STATIC", "summarize_metrics", "check_prompt_values", "ScoredDraft"]


AUTOREGRESSIVE_STATIC = ("target", "max_new_tokens", "sampler", "stop_ids", "pad_id", "cache_sharding")
AUTOREGRESSIVE_PREFILL_STATIC = ("target", "max_new_tokens", "cache_sharding")


def autoregressive_prefill(target_params, tokens_BxP, prompt_len_B, *, target, max_new_tokens: int,
                           cache_sharding=None) -> DecodeState:
  """Phase 1 of the baseline: checks, then one target forward over the prompt width into a fresh cache of
  ``S = P + max_new_tokens + 1`` slots. Returns the loop's initial state (``length_B = prompt_len_B``)."""
  target = as_scorer(target)
  cache_len = tokens_BxP.shape[1] + max_new_tokens + 1
  check_common(target, tokens_BxP, prompt_len_B, max_new_tokens, cache_len)
  batch = tokens_BxP.shape[0]
  tokens_BxS, scored = init_buffer(target, target_params, tokens_BxP, prompt_len_B, cache_len, cache_sharding)
  return DecodeState(tokens_BxS, prompt_len_B, jnp.zeros((batch,), bool), scored.cache, None, jnp.int32(0),
                     DecodeMetrics.zeros(batch, 0), prompt_len_B, prompt_width=tokens_BxP.shape[1])


def autoregressive_decode(target_params, keys_B, state: DecodeState, *, target, max_new_tokens: int,
                          sampler: sampling.Sampler = sampling.Sampler(), stop_ids: tuple[int, ...] = (),
                          pad_id: int = 0, cache_sharding=None) -> DecodeOutput:
  """Phase 2 of the baseline: one target step per token (``lax.while_loop``) from a prefilled ``state``."""
  del cache_sharding  # the caches in ``state`` already carry their layout
  target = as_scorer(target)
  batch, cache_len = state.tokens_BxS.shape
  check_state(state, keys_B, max_new_tokens, 1, None)
  rows_B = jnp.arange(batch)

  def body(carry):
    state, stopped_B = carry
    position_B = state.length_B - 1
    last_B = state.tokens_BxS[rows_B, position_B]
    scored = score_causal(target, target_params, last_B[:, None], position_B[:, None], state.target_cache,
                           cache_len)
    cache = scored.cache
    probs_BxV = sampler.probs(scored.logits_BxTxV[:, 0])
    step_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, state.iteration)
    next_B = jax.vmap(sampling.sample)(step_keys_B, probs_BxV)
    generated_B = state.length_B - state.prompt_len_B
    tokens_BxS, length_B, done_B, kept_B, stop_B = commit_block(
        state.tokens_BxS, state.length_B, state.done_B, next_B[:, None], jnp.ones((batch,), jnp.int32),
        generated_B, max_new_tokens, stop_ids)
    m = state.metrics
    metrics = m.replace(num_emitted_tokens=m.num_emitted_tokens + kept_B,
                        invalid_prob_rows=m.invalid_prob_rows + (distribution_errors(probs_BxV) != 0))
    new_state = state.replace(tokens_BxS=tokens_BxS, length_B=length_B, done_B=done_B, target_cache=cache,
                              iteration=state.iteration + 1, metrics=metrics)
    return new_state, stopped_B | stop_B

  state, stopped_B = jax.lax.while_loop(lambda c: ~jnp.all(c[0].done_B), body, (state, jnp.zeros((batch,), bool)))
  return decode_output(state, max_new_tokens, pad_id, stopped_B)


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
  depends on how tokens were committed (:func:`~blockspec_jax.contracts.replays_history`, SD²) is brought to
  the state decoding leaves after committing them in rounds of ``replay_stride`` tokens; for every other drafter the
  plain prefill already is that state, and ``history_B`` changes nothing."""
  draft_slots = _draft_slots(drafter, gamma)
  target = as_scorer(target, contracts.target_layers(drafter))
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(f"vocabulary mismatch between drafter (V = {drafter.vocab_size}) and target "
                     f"(V = {target.vocab_size}); both models must share one tokenizer")
  cache_len = tokens_BxP.shape[1] + max_new_tokens + draft_slots
  check_common(target, tokens_BxP, prompt_len_B, max_new_tokens, cache_len)
  if drafter.max_len is not None and cache_len > drafter.max_len:
    raise ValueError(f"prompt too long for the drafter's cache: needs {cache_len} positions, drafter max_len is "
                     f"{drafter.max_len}")
  batch = tokens_BxP.shape[0]
  tokens_BxS, scored = init_buffer(target, target_params, tokens_BxP, prompt_len_B, cache_len, cache_sharding)
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
  ``draft``           :class:`~blockspec_jax.contracts.Draft` (``N`` nodes per row)
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
  ``[last committed, nodes]`` in one pass (tree layout of :mod:`blockspec_jax.contracts`; a chain's nodes
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
  if draft.q_BxNxV is None and not draft.is_chain and drafter.sibling_sampling != contracts.POINT_MASS:
    raise ValueError(f"{type(drafter).__name__} proposed a tree without rows q: point-mass drafts must be chains or "
                     "declare sibling_sampling = POINT_MASS (siblings drawn from a point mass repeat one token; a "
                     "drawn tree needs the laws it was drawn from)")
  if draft.is_chain != drafter.is_chain:
    raise ValueError(f"{type(drafter).__name__} declares is_chain = {drafter.is_chain} but its draft says "
                     f"{draft.is_chain}")
  last_B = state.tokens_BxS[rows_B, state.length_B - 1]
  inputs_BxN1 = jnp.concatenate([last_B[:, None], draft.tokens_BxN], axis=1)
  if draft.is_chain:
    depth_BxN = jnp.broadcast_to(jnp.arange(1, n_nodes + 1, dtype=jnp.int32), (batch, n_nodes))
    positions_BxN1 = state.length_B[:, None] - 1 + jnp.arange(n_nodes + 1, dtype=jnp.int32)[None, :]
    scored = score_causal(target, target_params, inputs_BxN1, positions_BxN1, state.target_cache, cache_len)
  else:
    ancestors_BxNxN = contracts.ancestors(draft.parents_BxN)
    depth_BxN = contracts.node_depths(ancestors_BxNxN)
    positions_BxN1, slots_BxN1 = contracts.tree_positions(state.length_B, depth_BxN)
    mask_BxN1xS = contracts.tree_attention_mask(state.length_B, ancestors_BxNxN, cache_len)
    scored = target.score(target_params, inputs_BxN1, positions_BxN1, slots_BxN1, mask_BxN1xS, state.target_cache)
  return ScoredDraft(drafter_state, draft, sampler.probs(scored.logits_BxTxV), scored.hidden_BxTxD, depth_BxN,
                     scored.cache, scored.taps_BxTxLxD)


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
    return sprinter.sprinter_decode(target_params, drafter_params, keys_B, state, target=target, drafter=drafter,
                                    gamma=gamma, max_new_tokens=max_new_tokens, verifier=verifier, sampler=sampler,
                                    stop_ids=stop_ids, pad_id=pad_id)
  batch = state.tokens_BxS.shape[0]
  n_nodes = draft_slots - 1
  check_state(state, keys_B, max_new_tokens, draft_slots, gamma)

  def body(carry):
    state, stopped_B = carry
    draft_key_B, verify_key_B = iteration_keys(keys_B, state.iteration)
    scored = draft_and_score(target_params, drafter_params, state, draft_key_B, target=target, drafter=drafter,
                             gamma=gamma, sampler=sampler)
    draft = scored.draft
    verdict = verifier.verify_draft(verify_key_B, draft, scored.p_BxN1xV, scored.depth_BxN, gamma)
    tau_B = verdict.num_accepted_B
    block_BxG1 = _emitted_block(draft, verdict, batch, gamma)
    generated_B = state.length_B - state.prompt_len_B
    tokens_BxS, length_B, done_B, kept_B, stop_B = commit_block(
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
  return decode_output(state, max_new_tokens, pad_id, stopped_B)


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
