"""The engine's contracts: what a drafter proposes, what a target scorer computes, what a commit tells the drafter.

Everything the speculative loop (:mod:`blockspec_jax.decoding.speculative`) exchanges with models lives here, so a
new drafter (tree drafters, n-gram lookup, heads on the target's hidden states, steered drafters) or a new target
model plugs in without the loop changing, as t5x's ``tokens_to_logits`` callback lets any model plug into its loop.
The loop imports nothing from :mod:`blockspec_jax.drafters`.

Layout of one iteration for a row with ``length`` committed tokens (the last one, at position ``length − 1``, is not
yet in any cache) and a draft of ``N`` nodes::

    query t = 0        the last committed token   position length − 1            cache slot length − 1
    query t = n + 1    draft node n               position length − 1 + depth_n  cache slot length + n

``depth_n ≥ 1`` is the number of nodes on the root-to-``n`` path (a chain has ``depth_n = n + 1``, so its slots are
its positions and nothing moves). Node ``n`` attends to the committed slots ``< length`` and to the slots of its own
ancestors and itself (:func:`tree_attention_mask`); its rotary angle is its depth's position, so the keys and values
it writes are exactly those an autoregressive pass over its root-to-node path would write at positions
``length .. length − 1 + depth_n``. *Path commit* then moves the accepted path's entries from slots
``length + path[i]`` to ``length + i`` (:func:`path_slots`, applied with the scorer's ``move_slots``), after which the
cache holds what a fresh autoregressive pass over the committed tokens holds.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct

from blockspec_jax import sampling

__all__ = ["Draft", "Commit", "Scored", "TargetScorer", "Drafter", "chain_draft", "chain_parents_BxN",
           "ancestors", "node_depths", "tree_positions", "tree_attention_mask", "accepted_path", "path_slots",
           "SAMPLING_CHAIN", "SAMPLING_BEAM", "WITH_REPLACEMENT", "WITHOUT_REPLACEMENT", "POINT_MASS", "check_drafter",
           "StepDrafter",
           "prompt_commit", "reads_target",
           "replays_history", "target_layers"]

#: A chain drafter's declared ``sibling_sampling``: one child per node, a draw both with and without replacement.
SAMPLING_CHAIN = "chain"
#: A beam drafter's: the chain is the best of several beams, so its tokens are NOT draws from the ``q`` rows it
#: returns (those are the drafter's laws along the chain, read as likelihoods). Only rules that do not read ``q`` as
#: the draw law (MTAD's joint verification, greedy, exact-match) may verify it; lossless ``q``-reading rules refuse.
SAMPLING_BEAM = "beam"
#: A tree drafter's siblings drawn i.i.d. from their parent's row (SpecTr's k chains), and the rules that need that.
WITH_REPLACEMENT = "with_replacement"
#: A tree drafter's siblings drawn without replacement (RSD's Gumbel-top-k trees), and the rules that need that.
WITHOUT_REPLACEMENT = "without_replacement"
#: A tree drafter whose nodes are no draws at all: fixed tokens chosen from the context (the p best paths of a
#: lattice search, the top-b tokens of a row); its ``q`` rows are the point masses ``one_hot(tokens)`` (``q = None``).
#: Only rules that never read ``q`` as a law may verify it (``verify.tree.point_mass_tree_verify``).
POINT_MASS = "point_mass"


@struct.dataclass
class Draft:
  """What a drafter proposes for every row: a tree of ``N`` nodes (a chain is the tree ``parents = [−1, 0, 1, …]``).

  ``tokens_BxN``   int32 ``[B, N]``      the drafted token of every node
  ``parents_BxN``  int32 ``[B, N]``      parent node (−1 = the last committed token), ``parents[b, n] < n``; the
                                         children of a node are consecutive, in the order they were drawn. Rows may hold
                                         different trees (same ``N``).
  ``q_BxNxV``      f32 ``[B, N, V]`` or ``None``   row ``n`` = the drafter's law at node ``n``'s PARENT context, the law
                                         ``n`` and its siblings were drawn from (before any without-replacement
                                         removal). ``None`` means every node is a point mass at its token (n-gram /
                                         prompt lookup): no ``[B, N, V]`` is built by the drafter; verification forms
                                         the one-hot rows inside its fused computation (:meth:`q_rows`).
                                         Only chains and :data:`POINT_MASS` trees (fixed siblings, no draw) may omit
                                         ``q`` (siblings drawn from a point mass would repeat one token).
  ``is_chain``     static bool           the drafter promises ``parents = chain``: the loop then skips the tree mask and
                                         the path commit (slots already equal positions).
  """
  tokens_BxN: jax.Array
  parents_BxN: jax.Array
  q_BxNxV: Optional[jax.Array] = None
  is_chain: bool = struct.field(pytree_node=False, default=False)

  @property
  def num_nodes(self) -> int:
    return self.tokens_BxN.shape[1]

  def q_rows(self, vocab_size: int) -> jax.Array:
    """``q_BxNxV``, or the point masses ``one_hot(tokens)`` when the drafter gave none (f32 ``[B, N, V]``)."""
    if self.q_BxNxV is not None:
      return self.q_BxNxV
    return jax.nn.one_hot(self.tokens_BxN, vocab_size, dtype=jnp.float32)


def chain_parents_BxN(batch: int, gamma: int) -> jax.Array:
  """int32 ``[B, γ]`` rows ``[−1, 0, 1, …, γ − 2]``: the parents of a chain."""
  return jnp.broadcast_to(jnp.arange(-1, gamma - 1, dtype=jnp.int32), (batch, gamma))


def chain_draft(tokens_BxG: jax.Array, q_BxGxV: Optional[jax.Array] = None) -> Draft:
  """A chain of ``γ`` tokens per row as a :class:`Draft` (``q_BxGxV[b, i]`` = the law token ``i`` was drawn from)."""
  batch, gamma = tokens_BxG.shape
  return Draft(tokens_BxG.astype(jnp.int32), chain_parents_BxN(batch, gamma), q_BxGxV, is_chain=True)


@struct.dataclass
class Commit:
  """What the loop tells the drafter after verification (one iteration, every row; ``G`` = γ, the maximum depth).

  ``old_length_B``      int32 ``[B]``          committed tokens before this iteration
  ``new_length_B``      int32 ``[B]``          after it (stop tokens and the budget applied; finished rows unchanged)
  ``num_accepted_B``    int32 ``[B]``          τ: draft nodes on the accepted path (before stop / budget cuts)
  ``path_BxG``          int32 ``[B, G]``       node index at depth ``i + 1`` of the accepted path, −1 from ``τ`` on
  ``tokens_BxG1``       int32 ``[B, G + 1]``   the emitted block: the path's tokens, then the correction/bonus ``Y`` at
                                               index τ (what was committed is its first ``new − old`` entries)
  ``hidden_BxG1xD``     ``[B, G + 1, D]``      the target's last-layer hidden states (the LM head's input) at the
                                               queries ``[last committed, path nodes]``: row ``i`` produced the target
                                               law that token ``i`` of the block was verified against (row τ: ``Y``'s).
                                               Rows beyond τ are unspecified.
  ``taps_BxG1xLxD``     ``[B, G + 1, L', D]`` or ``None``: the residual stream after the target layers the drafter
                                               declared (``target_layers``) at the same queries; ``None`` otherwise.

  For a drafter that declares ``reads_target = True``, the prefill also ends with a commit (:func:`prompt_commit`):
  the prompt as a block with ``τ = 0`` and ``Y`` = the last prompt token, row 0 holding the target's states at
  position ``prompt_len − 2`` (zeros for a one-token prompt). So "the states at row ``τ``" mean: at the position
  before the last committed token, the query that produced the law of the last committed token (for a row that
  ends in this iteration, on a stop token or its budget, the block may be cut before ``τ``; such a row drafts no
  more).
  """
  old_length_B: jax.Array
  new_length_B: jax.Array
  num_accepted_B: jax.Array
  path_BxG: jax.Array
  tokens_BxG1: jax.Array
  hidden_BxG1xD: jax.Array
  taps_BxG1xLxD: Optional[jax.Array] = None

  def last_states(self):
    """``(hidden_BxD, taps_BxLxD or None)``: the target's states at row τ (see the class docstring)."""
    rows_B = jnp.arange(self.num_accepted_B.shape[0])
    hidden_BxD = self.hidden_BxG1xD[rows_B, self.num_accepted_B]
    taps_BxLxD = None if self.taps_BxG1xLxD is None else self.taps_BxG1xLxD[rows_B, self.num_accepted_B]
    return hidden_BxD, taps_BxLxD


def prompt_commit(hidden_BxPxD: jax.Array, taps_BxPxLxD: Optional[jax.Array], tokens_BxP: jax.Array,
                  prompt_len_B: jax.Array, gamma: int) -> Commit:
  """The commit that ends the prefill for drafters that read the target: the prompt as a block with ``τ = 0``, its
  last token as ``Y``, and row 0 = the target's states at position ``prompt_len − 2`` (zeros when the prompt has one
  token: no query produced its law). Rows 1..γ are zeros."""
  batch = tokens_BxP.shape[0]
  rows_B = jnp.arange(batch)
  before_B = prompt_len_B - 2
  has_B = before_B >= 0

  def at_before(x_BxPx):
    picked = x_BxPx[rows_B, jnp.maximum(before_B, 0)]
    picked = jnp.where(has_B.reshape((batch,) + (1,) * (picked.ndim - 1)), picked, 0)
    return jnp.zeros((batch, gamma + 1) + picked.shape[1:], picked.dtype).at[:, 0].set(picked)

  tokens_BxG1 = jnp.zeros((batch, gamma + 1), jnp.int32).at[:, 0].set(tokens_BxP[rows_B, prompt_len_B - 1])
  return Commit(old_length_B=prompt_len_B - 1, new_length_B=prompt_len_B,
                num_accepted_B=jnp.zeros((batch,), jnp.int32), path_BxG=jnp.full((batch, gamma), -1, jnp.int32),
                tokens_BxG1=tokens_BxG1, hidden_BxG1xD=at_before(hidden_BxPxD),
                taps_BxG1xLxD=None if taps_BxPxLxD is None else at_before(taps_BxPxLxD))


@struct.dataclass
class Scored:
  """A target pass: ``logits_BxTxV`` f32, ``hidden_BxTxD`` (final-norm output), the updated cache, and
  ``taps_BxTxLxD`` (the residual stream after the layers the scorer taps; ``None`` when it taps none)."""
  logits_BxTxV: jax.Array
  hidden_BxTxD: jax.Array
  cache: Any
  taps_BxTxLxD: Optional[jax.Array] = None


@runtime_checkable
class TargetScorer(Protocol):
  """The target model as the loop sees it. Implementations are hashable frozen dataclasses (static under ``jit``);
  :class:`blockspec_jax.models.scorer.DecoderScorer` serves any :class:`~blockspec_jax.models.DecoderConfig`.

  ``vocab_size``  V of its rows;  ``max_len``  the longest cache (positions) it supports.
  ``init_cache(batch, cache_len)``  an empty cache for ``cache_len`` slots.
  ``score(params, tokens_BxT, positions_BxT, slots_BxT, mask_BxTxS, cache) -> Scored``: one pass over ``T`` new
      tokens; token ``t`` of row ``b`` gets rotary position ``positions_BxT[b, t]``, writes its keys/values at
      ``slots_BxT[b, t]`` (slots ``≥ S`` are dropped) and attends to the slots where ``mask_BxTxS[b, t]`` is True
      (after the write).
  ``move_slots(cache, src_BxM, dst_BxM, valid_BxM)``: copy the entries of slots ``src`` to slots ``dst`` where
      ``valid`` (the path commit); the destination slots of a row never hold a later source of that row.
  """

  @property
  def vocab_size(self) -> int: ...

  @property
  def max_len(self) -> int: ...

  def init_cache(self, batch: int, cache_len: int) -> Any: ...

  def score(self, params, tokens_BxT, positions_BxT, slots_BxT, mask_BxTxS, cache) -> Scored: ...

  def move_slots(self, cache, src_BxM, dst_BxM, valid_BxM) -> Any: ...


class Drafter(Protocol):
  """What the speculative loop needs from a drafter. Implementations are frozen dataclasses (static under ``jit``).

  Declared, not probed:
  ``vocab_size``   V of its rows (must equal the target's)
  ``max_len``      the longest cache it supports, or ``None`` (no cache: n-gram lookup)
  ``sibling_sampling``  how siblings are drawn: ``"with_replacement"`` (i.i.d.), ``"without_replacement"``, or
                   :data:`SAMPLING_CHAIN` (one child per node: both). A tree verifier requires its own mode.
  ``is_chain``     whether every draft is a chain (``parents = [−1, 0, …]``)
  ``num_nodes(gamma)``  ``N``: nodes per draft for maximum depth ``gamma`` (static; sizes the caches)

  Cache convention: at the start of an iteration the target's cache holds valid entries for positions
  ``< length − 1``; the last committed token has not been fed. A drafter's own cache is its business: the model
  drafters keep positions ``< length − 2`` valid (after a fully accepted block the drafter never fed the last draft
  token) and re-feed the last two committed tokens first. Tree nodes are written at slots ``length + n`` (see the
  module docstring) and :meth:`commit` moves the accepted path into place.

  ``init_state(params, tokens_BxP, prompt_len_B, max_len)``: prefill on the padded prompts (row ``b``'s prompt is
      ``tokens_BxP[b, :prompt_len_B[b]]``), returning the drafter's loop state for caches of ``max_len`` slots.
  ``propose(params, state, tokens_BxS, length_B, key_B, gamma, sampler) -> (state, Draft)``: a draft after each
      row's committed tokens ``tokens_BxS[b, :length_B[b]]``, using one key per row. ``Draft.q_BxNxV`` must be
      exactly the laws the nodes were drawn from, after ``sampler``.
  ``commit(params, state, commit: Commit) -> state``: after verification (rollback point, accepted path, the target's
      hidden states at the accepted positions).

  Optional declarations (absent = False / ``()``), for drafters that read the target (BPD heads, SD² steering):
  ``reads_target``   the prefill ends with :func:`prompt_commit`, so the first draft already sees the target's
                     states at the position before the last prompt token
  ``target_layers``  layers whose residual stream the loop's target pass must return (``Commit.taps_BxG1xLxD``);
                     the loop makes the scorer tap them (:func:`blockspec_jax.models.scorer.as_scorer`)
  ``replay(params, state, tokens_BxS, taps_BxPxLxD, start_B, end_B, stride) -> state``: for drafters whose state
                     depends on how the committed tokens were committed (SD²: the keys and values written under
                     each round's steering vector), bring a state prefilled plainly over ``tokens_BxS[b, :end_B[b]]``
                     to the state decoding leaves after committing positions ``start_B[b] .. end_B[b] − 1`` in rounds
                     of ``stride`` tokens (``taps_BxPxLxD``: the target's taps at every prefilled position).
                     Drafters without it are replayed by the plain prefill (:func:`replays_history`).
  """

  @property
  def vocab_size(self) -> int: ...

  @property
  def max_len(self) -> Optional[int]: ...

  @property
  def sibling_sampling(self) -> str: ...

  @property
  def is_chain(self) -> bool: ...

  def num_nodes(self, gamma: int) -> int: ...

  def init_state(self, params, tokens_BxP: jax.Array, prompt_len_B: jax.Array, max_len: int) -> Any: ...

  def propose(self, params, state, tokens_BxS: jax.Array, length_B: jax.Array, key_B: jax.Array, gamma: int,
              sampler: sampling.Sampler) -> tuple[Any, Draft]: ...

  def commit(self, params, state, commit: Commit) -> Any: ...


class StepDrafter(Drafter, Protocol):
  """A chain drafter that also drafts one token at a time and shows the hidden state behind each law, for loops that
  decide after every token whether to go on (SPRINTER: :mod:`blockspec_jax.decoding.sprinter`).
  :class:`~blockspec_jax.drafters.base.ModelDrafter` implements it (its ``propose`` is ``begin`` then ``step``s).

  ``begin(params, state, tokens_BxS, length_B, sampler) -> (state, q_BxV, hidden_BxD)``: bring the drafter's cache
      up to the committed tokens (its own convention) and return the law of the token at position ``length`` (after
      ``sampler``) with the last hidden state (final-norm output) that produced it.
  ``step(params, state, x_B, position_B, sampler) -> (state, q_BxV, hidden_BxD)``: feed ``x_B`` at ``position_B``;
      the law of the next position and its hidden state.
  A drafter with a learned verifier head adds ``acceptable_probs(params, hidden_BxD) -> f32 [B]``.
  """

  def begin(self, params, state, tokens_BxS: jax.Array, length_B: jax.Array, sampler: sampling.Sampler): ...

  def step(self, params, state, x_B: jax.Array, position_B: jax.Array, sampler: sampling.Sampler): ...


_DRAFTER_ATTRIBUTES = ("vocab_size", "max_len", "sibling_sampling", "is_chain", "num_nodes", "init_state", "propose",
                       "commit")


def check_drafter(drafter) -> None:
  """Raise a TypeError naming what ``drafter`` lacks of the :class:`Drafter` protocol."""
  missing = [name for name in _DRAFTER_ATTRIBUTES if not hasattr(drafter, name)]
  if missing:
    raise TypeError(f"{type(drafter).__name__} is not a Drafter: it lacks {', '.join(missing)} (see "
                    "blockspec_jax.contracts.Drafter)")


def reads_target(drafter) -> bool:
  """Whether ``drafter`` declares that it reads the target (and gets the prefill's :func:`prompt_commit`)."""
  return bool(getattr(drafter, "reads_target", False))


def replays_history(drafter) -> bool:
  """Whether ``drafter``'s state after committed tokens depends on how they were committed (it has ``replay``)."""
  return callable(getattr(drafter, "replay", None))


def target_layers(drafter) -> tuple[int, ...]:
  """The target layers ``drafter`` reads (its ``target_layers``; ``()`` when it declares none)."""
  return tuple(getattr(drafter, "target_layers", ()) or ())


# --- tree layout, shared by the loop and by tree drafters ------------------------------------------------------------

def ancestors(parents_BxN: jax.Array) -> jax.Array:
  """bool ``[B, N, N]``: ``A[b, n, m]`` iff node ``m`` is node ``n`` or one of its ancestors.

  Transitive closure of the parent relation by ``⌈log2 N⌉`` boolean squarings (``O(N³ log N)`` per row, tiny next
  to a model pass for the N ≤ 64 of drafts).
  """
  batch, n_nodes = parents_BxN.shape
  index_N = jnp.arange(n_nodes, dtype=jnp.int32)
  reach_BxNxN = (parents_BxN[:, :, None] == index_N[None, None, :]) | (index_N[:, None] == index_N[None, :])[None]
  steps = max(int(n_nodes - 1).bit_length(), 0)
  for _ in range(steps):
    reach_BxNxN = reach_BxNxN | (jnp.einsum("bnk,bkm->bnm", reach_BxNxN.astype(jnp.int32),
                                            reach_BxNxN.astype(jnp.int32)) > 0)
  return reach_BxNxN


def node_depths(ancestors_BxNxN: jax.Array) -> jax.Array:
  """int32 ``[B, N]``: ``depth_n`` = nodes on the root-to-``n`` path (children of the root have depth 1)."""
  return jnp.sum(ancestors_BxNxN, axis=-1).astype(jnp.int32)


def tree_positions(length_B: jax.Array, depth_BxN: jax.Array):
  """Rotary positions and cache slots of the query ``[last committed, node 0 .. N − 1]`` (int32 ``[B, N + 1]`` each)."""
  n_nodes = depth_BxN.shape[1]
  last_Bx1 = length_B[:, None] - 1
  positions_BxN1 = jnp.concatenate([last_Bx1, last_Bx1 + depth_BxN], axis=1)
  slots_BxN1 = last_Bx1 + jnp.arange(n_nodes + 1, dtype=jnp.int32)[None, :]
  return positions_BxN1, slots_BxN1


def tree_attention_mask(length_B: jax.Array, ancestors_BxNxN: jax.Array, cache_len: int) -> jax.Array:
  """bool ``[B, N + 1, S]`` for the query ``[last committed, nodes]`` laid out as in :func:`tree_positions`.

  Query 0 sees slots ``≤ length − 1``; node ``n`` sees slots ``< length`` and the slots ``length + m`` of its
  ancestors-or-self ``m``. On a chain this is the causal mask.
  """
  n_nodes = ancestors_BxNxN.shape[1]
  slots_S = jnp.arange(cache_len, dtype=jnp.int32)
  committed_BxS = slots_S[None, :] < length_B[:, None]
  node_BxS = slots_S[None, :] - length_B[:, None]
  in_tree_BxS = (node_BxS >= 0) & (node_BxS < n_nodes)
  node_BxS = jnp.clip(node_BxS, 0, n_nodes - 1)
  sees_BxNxS = jnp.take_along_axis(ancestors_BxNxN, jnp.broadcast_to(node_BxS[:, None, :], (
      node_BxS.shape[0], n_nodes, cache_len)), axis=2) & in_tree_BxS[:, None, :]
  nodes_BxNxS = sees_BxNxS | committed_BxS[:, None, :]
  return jnp.concatenate([committed_BxS[:, None, :], nodes_BxNxS], axis=1)


def accepted_path(accepted_BxN: jax.Array, depth_BxN: jax.Array, gamma: int) -> jax.Array:
  """int32 ``[B, γ]``: the accepted node at depth ``i + 1`` (−1 where the path is shorter), from a bool ``[B, N]``
  marking a root-to-node chain.

  A comparison and an argmax, not a scatter: XLA's GPU backend under ``--xla_gpu_deterministic_ops=true`` (JAX 0.11.2,
  H200) mixes up the values of a ``.at[].set(mode="drop")`` scatter whose updates include repeated out-of-range
  indices (an in-range slot received another slot's node), and the rejected nodes of a tree are exactly such
  updates. The tree rules then committed the wrong path's cache entries through the loop (docs/results/gpu.md)."""
  at_depth_BxGxN = accepted_BxN[:, None, :] & (
      depth_BxN[:, None, :] == jnp.arange(1, gamma + 1, dtype=depth_BxN.dtype)[None, :, None])
  return jnp.where(jnp.any(at_depth_BxGxN, axis=-1), jnp.argmax(at_depth_BxGxN, axis=-1).astype(jnp.int32), -1)


def path_slots(length_B: jax.Array, path_BxG: jax.Array, num_accepted_B: jax.Array):
  """The path commit's moves: ``(src_BxG, dst_BxG, valid_BxG)`` = slots ``length + path[i]`` → ``length + i`` for
  ``i < τ``. A destination never holds a later source (``path[j] ≥ j``), so one gather-then-scatter is exact."""
  gamma = path_BxG.shape[1]
  index_G = jnp.arange(gamma, dtype=jnp.int32)
  valid_BxG = index_G[None, :] < num_accepted_B[:, None]
  src_BxG = length_B[:, None] + jnp.maximum(path_BxG, 0)
  dst_BxG = length_B[:, None] + index_G[None, :]
  return src_BxG, dst_BxG, valid_BxG
