"""Tree drafters on one small model: SpecTr's k i.i.d. chains, RSD-C (constant branching, Gumbel-top-k without
replacement) and RSD-S (stochastic beam search), all on the :class:`~blockspec_jax.decoding.contracts.Drafter`
contract.

Layout (every drafter): nodes depth-major, ``w_d`` nodes at depth ``d`` stored at indices ``off_d .. off_d + w_d − 1``,
each depth's nodes grouped by parent and, within a parent, in draw order (so siblings are consecutive and parents
come first: the layout :func:`blockspec_jax.verify.tree_verify` requires). One drafter forward per depth feeds that
depth's nodes at once (rotary position ``length − 1 + d``, cache slot ``length + n``, attending to the committed slots
and to its own root-to-node path: :mod:`blockspec_jax.decoding.contracts`), except the deepest, whose rows nobody
needs. ``q`` row of node ``n`` = the law of its parent's context (after ``sampler``), the row its siblings were drawn
from. ``commit`` moves the accepted path's entries into contiguous slots (the path commit) so the drafter's cache is
the one an autoregressive pass over the committed tokens would leave; the next ``propose`` re-feeds the last two
committed tokens (as :class:`~blockspec_jax.drafters.base.ModelDrafter` does), which covers an accepted leaf that
was never fed.

Without-replacement drafters (RSD-C, RSD-S) draw from and report ``q_ε = (1 − ε)·q + ε/V`` (``ε = 1e-6`` by
default): every token has positive probability, so ``b ≤ V`` distinct children always exist (at T = 0 or under top-k
a row may have a single token of positive mass). Losslessness needs only that the reported rows are the laws the
nodes were drawn from, which they are; block efficiency changes by O(ε).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import sampling
from blockspec_jax.decoding.contracts import Commit, Draft, path_slots
from blockspec_jax.drafters.base import ModelDrafter, feed
from blockspec_jax.models import decoder as decoder_lib

__all__ = ["KChainDrafter", "RSDConstantDrafter", "RSDStochasticBeamDrafter", "gumbel_top_k", "shape_for_budget"]

WITH_REPLACEMENT = "with_replacement"
WITHOUT_REPLACEMENT = "without_replacement"


def gumbel_top_k(key_B, log_weights_BxWxV: jax.Array, k: int):
  """Indices ``[B, W, k]`` of ``k`` draws without replacement from each row ``∝ exp(log_weights)``, in draw order
  (the top-k of ``log_weights + Gumbel``; one key per batch row)."""
  _, width, vocab = log_weights_BxWxV.shape
  noise_BxWxV = jax.vmap(lambda key: jax.random.gumbel(key, (width, vocab), jnp.float32))(key_B)
  _, top_BxWxK = jax.lax.top_k(log_weights_BxWxV + noise_BxWxV, k)
  return top_BxWxK.astype(jnp.int32)


def _smoothed(q_BxWxV: jax.Array, epsilon: float) -> jax.Array:
  vocab = q_BxWxV.shape[-1]
  return (1.0 - epsilon) * q_BxWxV + epsilon / vocab


def _log1mexp(x):
  """``log(1 − exp(x))`` for ``x ≤ 0``, stable at both ends."""
  x = jnp.minimum(x, -1e-30)
  return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


@dataclasses.dataclass(frozen=True)
class _TreeModelDrafter(ModelDrafter):
  """Shared machinery (the model, its declared sizes and its prefill come from :class:`ModelDrafter`): per-depth
  growth with tree-masked feeding, path commit. Subclasses define ``widths(gamma)`` and
  ``_children(key_B, rows_BxWxV, carry, d) -> (parent_BxW, tokens_BxW, rows_BxWxV, carry)``."""

  is_chain = False

  def widths(self, gamma: int) -> tuple[int, ...]:
    raise NotImplementedError

  def num_nodes(self, gamma: int) -> int:
    return int(sum(self.widths(gamma)))

  def _start(self, root_rows_Bx1xV):
    return None

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler: sampling.Sampler):
    widths = self.widths(gamma)
    module = decoder_lib.Decoder(self.config)
    cache = state
    batch, cache_len = tokens_BxS.shape
    rows_B = jnp.arange(batch)
    positions_Bx2 = jnp.maximum(length_B[:, None] + jnp.array([[-2, -1]]), 0)
    logits_Bx2xV, cache = feed(module, params, tokens_BxS[rows_B[:, None], positions_Bx2], positions_Bx2, cache,
                               cache_len)
    rows_BxWxV = sampler.probs(logits_Bx2xV[:, -1:])  # the root: one "parent" row
    keys_BxD = jax.vmap(lambda k: jax.random.split(k, len(widths)))(key_B)
    paths_BxWxd = jnp.zeros((batch, 1, 0), jnp.int32)  # root-to-node node indices of the previous depth's nodes
    carry = self._start(rows_BxWxV)
    slots_S = jnp.arange(cache_len, dtype=jnp.int32)
    committed_BxS = slots_S[None, :] < length_B[:, None]
    tokens, parents, q_rows = [], [], []
    offset, previous_offset = 0, -1
    for d, width in enumerate(widths, start=1):
      parent_BxW, tokens_BxW, rows_BxWxV, carry = self._children(keys_BxD[:, d - 1], rows_BxWxV, carry, d)
      q_rows.append(jnp.take_along_axis(rows_BxWxV, parent_BxW[:, :, None], axis=1))
      tokens.append(tokens_BxW)
      parents.append(jnp.where(d == 1, -1, previous_offset + parent_BxW).astype(jnp.int32))
      nodes_BxW = jnp.broadcast_to(offset + jnp.arange(width, dtype=jnp.int32), (batch, width))
      paths_BxWxd = jnp.concatenate([jnp.take_along_axis(paths_BxWxd, parent_BxW[:, :, None], axis=1),
                                     nodes_BxW[:, :, None]], axis=2)
      if d < len(widths):  # feed this depth: its rows are the next depth's parents' laws
        on_path_BxWxS = jnp.any(slots_S[None, None, None, :] == (length_B[:, None, None, None]
                                                                 + paths_BxWxd[:, :, :, None]), axis=2)
        mask_BxWxS = committed_BxS[:, None, :] | on_path_BxWxS
        positions_BxW = jnp.broadcast_to(length_B[:, None] - 1 + d, (batch, width))
        logits_BxWxV, cache = module.apply({"params": params}, tokens_BxW, positions_BxW, cache, mask_BxWxS,
                                           slots_BxT=length_B[:, None] + nodes_BxW)
        rows_BxWxV = sampler.probs(logits_BxWxV.astype(jnp.float32))
      previous_offset, offset = offset, offset + width
    draft = Draft(jnp.concatenate(tokens, axis=1).astype(jnp.int32), jnp.concatenate(parents, axis=1),
                  jnp.concatenate(q_rows, axis=1))
    return cache, draft

  def commit(self, params, state, commit: Commit):
    del params
    return state.move_slots(*path_slots(commit.old_length_B, commit.path_BxG, commit.num_accepted_B))


@dataclasses.dataclass(frozen=True)
class KChainDrafter(_TreeModelDrafter):
  """SpecTr's draft: ``k`` i.i.d. chains of length γ (``N = kγ``), siblings at the root drawn WITH replacement (the
  chains may share tokens). Verify with ``"spectr"`` or ``"rrs"``."""

  k: int = 2
  sibling_sampling = WITH_REPLACEMENT

  def __post_init__(self):
    if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
      raise ValueError(f"k_chains needs k >= 1 chains, got {self.k!r}")

  def widths(self, gamma):
    return (self.k,) * gamma

  def _children(self, key_B, rows_BxWxV, carry, d):
    batch = rows_BxWxV.shape[0]
    parent_BxK = (jnp.zeros((batch, self.k), jnp.int32) if d == 1
                  else jnp.broadcast_to(jnp.arange(self.k, dtype=jnp.int32), (batch, self.k)))
    chain_rows_BxKxV = jnp.take_along_axis(rows_BxWxV, parent_BxK[:, :, None], axis=1)
    keys_BxK = jax.vmap(lambda k: jax.random.split(k, self.k))(key_B)
    tokens_BxK = jax.vmap(jax.vmap(sampling.sample))(keys_BxK, chain_rows_BxKxV)
    return parent_BxK, tokens_BxK.astype(jnp.int32), rows_BxWxV, carry


@dataclasses.dataclass(frozen=True)
class RSDConstantDrafter(_TreeModelDrafter):
  """RSD-C (Jeon et al., arXiv 2402.14160): every node at depth ``d − 1`` gets ``branching[d − 1]`` children drawn
  WITHOUT replacement (Gumbel-top-k of its row ``q_ε``, children in draw order); γ must equal ``len(branching)``.
  Verify with ``"rrs_wor"`` or ``"traversal"``."""

  branching: tuple[int, ...] = (2, 1)
  epsilon: float = 1e-6
  sibling_sampling = WITHOUT_REPLACEMENT

  def __post_init__(self):
    b = tuple(self.branching)
    if not b or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1 for x in b):
      raise ValueError(f"rsd_c branching must be a non-empty tuple of integers >= 1, got {self.branching!r}")
    if max(b) > self.config.vocab_size:
      raise ValueError(f"rsd_c branching {b} asks for more distinct children than the V = {self.config.vocab_size} "
                       "tokens")
    if not 0.0 < self.epsilon < 1.0:
      raise ValueError(f"epsilon must be in (0, 1), got {self.epsilon}")
    object.__setattr__(self, "branching", tuple(int(x) for x in b))

  def widths(self, gamma):
    if gamma != len(self.branching):
      raise ValueError(f"rsd_c with branching {self.branching} drafts depth {len(self.branching)}; gamma is {gamma} "
                       "(set gamma = len(branching))")
    return tuple(int(np.prod(self.branching[:d])) for d in range(1, gamma + 1))

  def _children(self, key_B, rows_BxWxV, carry, d):
    b = self.branching[d - 1]
    batch, width, vocab = rows_BxWxV.shape
    rows_BxWxV = _smoothed(rows_BxWxV, self.epsilon)
    top_BxWxb = gumbel_top_k(key_B, jnp.log(rows_BxWxV), b)
    tokens_BxWb = top_BxWxb.reshape(batch, width * b)
    parent_BxWb = jnp.broadcast_to(jnp.repeat(jnp.arange(width, dtype=jnp.int32), b), (batch, width * b))
    return parent_BxWb, tokens_BxWb, rows_BxWxV, carry


@dataclasses.dataclass(frozen=True)
class RSDStochasticBeamDrafter(_TreeModelDrafter):
  """RSD-S: stochastic beam search (Kool et al. 2019) of width ``W`` over γ depths (``N = Wγ``). Depth 1: the root's
  Gumbel-top-W children; depth d: the W best of all beams' continuations by conditioned Gumbel scores. A beam's kept
  children are the top of its own Gumbel perturbation (the conditioning is monotone per beam), i.e. a prefix of a
  without-replacement sample of its row ``q_ε``, stored in that order. Verify with ``"rrs_wor"`` or
  ``"traversal"``."""

  width: int = 2
  epsilon: float = 1e-6
  sibling_sampling = WITHOUT_REPLACEMENT

  def __post_init__(self):
    if isinstance(self.width, bool) or not isinstance(self.width, int) or not 1 <= self.width <= self.config.vocab_size:
      raise ValueError(f"rsd_s width must be an integer in [1, V = {self.config.vocab_size}], got {self.width!r}")
    if not 0.0 < self.epsilon < 1.0:
      raise ValueError(f"epsilon must be in (0, 1), got {self.epsilon}")

  def widths(self, gamma):
    return (self.width,) * gamma

  def _start(self, root_q_Bx1xV):
    batch = root_q_Bx1xV.shape[0]
    return (jnp.zeros((batch, 1), jnp.float32), jnp.zeros((batch, 1), jnp.float32))  # log prob, perturbed score

  def _children(self, key_B, rows_BxWxV, carry, d):
    logp_BxW, score_BxW = carry
    batch, beams, vocab = rows_BxWxV.shape
    rows_BxWxV = _smoothed(rows_BxWxV, self.epsilon)
    phi_BxWxV = logp_BxW[:, :, None] + jnp.log(rows_BxWxV)
    g_BxWxV = phi_BxWxV + jax.vmap(lambda k: jax.random.gumbel(k, (beams, vocab), jnp.float32))(key_B)
    z_BxW = jnp.max(g_BxWxV, axis=-1)
    # Conditioned scores G̃ = −log(exp(−T) − exp(−Z) + exp(−g)) in Kool et al.'s stable form (T: the beam's score).
    v_BxWxV = score_BxW[:, :, None] - g_BxWxV + _log1mexp(g_BxWxV - z_BxW[:, :, None])
    cond_BxWxV = score_BxW[:, :, None] - jax.nn.relu(v_BxWxV) - jnp.log1p(jnp.exp(-jnp.abs(v_BxWxV)))
    if d == 1:
      cond_BxWxV = g_BxWxV  # a single root beam: its own Gumbel order
    best_BxW, flat_BxW = jax.lax.top_k(cond_BxWxV.reshape(batch, beams * vocab), self.width)
    parent_BxW = (flat_BxW // vocab).astype(jnp.int32)
    tokens_BxW = (flat_BxW % vocab).astype(jnp.int32)
    # Group by parent (stable: within a parent the top_k order is its Gumbel order).
    order_BxW = jnp.argsort(parent_BxW, axis=1, stable=True)
    parent_BxW = jnp.take_along_axis(parent_BxW, order_BxW, axis=1)
    tokens_BxW = jnp.take_along_axis(tokens_BxW, order_BxW, axis=1)
    flat_BxW = jnp.take_along_axis(flat_BxW, order_BxW, axis=1)
    best_BxW = jnp.take_along_axis(best_BxW, order_BxW, axis=1)
    logp_BxW = jnp.take_along_axis(phi_BxWxV.reshape(batch, beams * vocab), flat_BxW, axis=1)
    return parent_BxW, tokens_BxW, rows_BxWxV, (logp_BxW, best_BxW)


def shape_for_budget(kind: str, budget: int) -> tuple[dict, int]:
  """``(settings, gamma)`` of a ``kind`` drafter with exactly ``budget`` nodes: ``"k_chains"`` k = 2 (depth N/2);
  ``"rsd_c"`` branching (2, 1, …, 1) (two chains drawn without replacement: the shape of SpecTr k = 2, so the two
  compare sampling with and without replacement at one shape); ``"rsd_s"`` width 2 (depth N/2); ``"model"`` γ = N."""
  if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
    raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
  if kind == "model":
    return {}, budget
  if budget % 2:
    raise ValueError(f"{kind} shapes have two branches: budget must be even, got {budget}")
  depth = budget // 2
  if kind == "k_chains":
    return {"k": 2}, depth
  if kind == "rsd_c":
    return {"branching": (2,) + (1,) * (depth - 1)}, depth
  if kind == "rsd_s":
    return {"width": 2}, depth
  raise ValueError(f"no budget shapes for drafter {kind!r}; known: model, k_chains, rsd_c, rsd_s")

