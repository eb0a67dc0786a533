"""Blockwise parallel decoding heads (Stern et al. 2018; Kim, Suresh et al., arXiv 2404.09221): ``h`` heads on the
TARGET's last hidden state draft the next block, optionally refined by rescoring the top-k lattice with an n-gram LM
or a small neural LM.

**Heads** (Medusa-style residual blocks, one per head ``j``, on the target's final-norm hidden state ``x``, the LM
head's input)::

    h_j(x) = x + W2_j · silu(W1_j · x + b1_j)        logits_j = target LM head(h_j(x))
    params["heads"] = {"w1_HxDxD": f32 [H, D, D], "b1_HxD": f32 [H, D], "w2_HxDxD": f32 [H, D, D]}   (out, in)

``W2`` starts at zero (:func:`init_heads`), so an untrained head is the target's own next-token head. The LM head is
the target's (``params["lm_head"]``: its ``[V, D]`` weight, tied embedding or ``lm_head/weight``), never part of a
heads checkpoint.

**Offset.** The drafter declares ``reads_target``: after the prefill and after every iteration it keeps the
target's hidden state ``x`` at the position BEFORE the last committed token (``Commit.last_states``: the query that
produced the last committed token's law; position ``length − 2``). Head ``j`` on ``x`` gives the law of draft token
``j``, at position ``length + j`` (offset ``j + 2`` from ``x``'s position; the target's own head on ``x`` gave the
last committed token, offset 1). Training (:mod:`blockspec_jax.train.heads`) matches it: head ``j`` at position
``t`` is scored against the token at ``t + 2 + j``.

**Drafts** (``rescore``), a chain of ``γ ≤ h`` tokens:

* ``"none"``: token ``j ~ q_j = sampler.probs(logits_j)``, independently; ``q_BxGxV`` = those laws. Since the tokens
  are independent, ``q_j`` is also token ``j``'s law given the earlier ones: lossless with every lossless rule.
* ``"ngram"`` / ``"neural"`` (local rescoring, :func:`blockspec_jax.drafters.lattice.local_rescore`): candidates =
  head ``j``'s top ``k`` (T = 1), scores ``log q_j + λ · log LM(x | context, drafted prefix)``, token ``j`` drawn from
  ``sampler.probs`` of the scores (``−inf`` off the candidates); ``q`` rows = exactly those laws: lossless at any
  temperature, the paper's greedy local rescoring at T = 0.
* ``"pbest_ngram"`` / ``"pbest_neural"`` / ``"pbest_none"`` (global,
  :func:`~blockspec_jax.drafters.lattice.pbest_search`; ``"pbest_none"`` ranks by the heads' scores alone): the best
  path of a width-``pbest`` beam search over the ``k^γ`` lattice ("1best"); deterministic given the committed
  tokens, so a point-mass draft (``q = None``): lossless with every rule.

**The p best paths verified together** (:class:`HeadsTreeDrafter`, ``"heads_tree"``, the paper's global rescoring):
the same search's ``pbest`` paths proposed as one tree of ``pbest`` chains (``N = pbest·γ``, node ``d·p + w`` =
path ``w``'s token ``d``), every node a point mass, verified in one target pass by ``"point_mass"``
(:func:`blockspec_jax.verify.tree.point_mass_tree_verify`, shared prefixes merged): lossless at any temperature, and
at T = 0 exactly "keep the longest accepted prefix". With the n-gram LM (``"pbest_ngram"``) or none
(``"pbest_none"``, the paper's "p-best 0-gram" control); the neural LM stays with the chain (its cache keeps one
path, and which path the target accepts is known only after the drafter's last call).

At T = 0 every variant emits exactly the target's greedy tokens (the verifier keeps only what the target's argmax
agrees with).

**LMs.** ``ngram``: :class:`~blockspec_jax.drafters.lattice.NGramLM` (``params["ngram"]``, built from the training
text by :mod:`blockspec_jax.train.heads`). ``neural``: a small decoder with the target's tokenizer (``lm_config``,
``params["lm"]``, e.g. the 0.5B drafter) with its own KV cache, kept as
:class:`~blockspec_jax.drafters.base.ModelDrafter` keeps it (valid for positions ``< length − 2``; ``begin`` re-feeds
the last two committed tokens, ``step`` feeds a drafted token). Local rescoring feeds the chosen tokens with
``step``. The p-best search scores its ``p`` paths at once as a tree in ``γ·p`` scratch slots past the loop's
cache length (each path attends to the committed slots and its own ancestors' slots, at its true positions), then
moves the best path's entries to their positions (``KVCache.move_slots``): the cache then holds what an
autoregressive pass would. The scratch slots are why ``max_len = lm_config.max_len − num_heads · pbest``.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from blockspec_jax import artifacts, sampling
from blockspec_jax.checks import check_int
from blockspec_jax.contracts import POINT_MASS, SAMPLING_CHAIN, Commit, Draft, chain_draft
from blockspec_jax.drafters import lattice
from blockspec_jax.drafters.base import ModelDrafter
from blockspec_jax.drafters.registry import register
from blockspec_jax.drafters.settings import Settings, check_count, check_directory, is_int, read_record
from blockspec_jax.models import decoder as decoder_lib

__all__ = ["RESCORERS", "TREE_RESCORERS", "HeadsDrafter", "HeadsTreeDrafter", "HeadsState", "init_heads",
           "heads_logits", "lm_head_weight", "chain_tree_parents",
           "check_heads"]

#: ``rescore`` values: the raw heads, local rescoring with either LM, the p-best search with either LM or with none
#: (``"pbest_none"``: the heads' scores alone, the paper's "0-gram" control).
RESCORERS = ("none", "ngram", "neural", "pbest_ngram", "pbest_neural", "pbest_none")
#: The tree drafter's (:class:`HeadsTreeDrafter`): the p best paths with the n-gram LM or with none.
TREE_RESCORERS = ("pbest_ngram", "pbest_none")
_NGRAM_RESCORERS, _NEURAL_RESCORERS = ("ngram", "pbest_ngram"), ("neural", "pbest_neural")
_HEAD_KEYS = ("w1_HxDxD", "b1_HxD", "w2_HxDxD")
_LOG_FLOOR = 1e-30  # the neural LM's probabilities are floored before the log: no −inf score, no NaN law


def init_heads(d_model: int, num_heads: int, key: jax.Array):
  """Heads at the start of training: ``W1`` ~ N(0, 1/D) (LeCun normal, (out, in)), ``b1 = 0``, ``W2 = 0`` (so every
  head equals the target's next-token head). f32."""
  for name, value in (("d_model", d_model), ("num_heads", num_heads)):
    check_int(value, name)
  w1 = jax.random.normal(key, (num_heads, d_model, d_model), jnp.float32) / math.sqrt(d_model)
  return {"w1_HxDxD": w1, "b1_HxD": jnp.zeros((num_heads, d_model), jnp.float32),
          "w2_HxDxD": jnp.zeros((num_heads, d_model, d_model), jnp.float32)}


def check_heads(heads, d_model: int | None = None) -> tuple[int, int]:
  """``(H, D)`` of a heads pytree; ValueError naming what is wrong (missing arrays, shapes, width ``d_model``)."""
  if not isinstance(heads, dict) or set(heads) != set(_HEAD_KEYS):
    got = sorted(heads) if isinstance(heads, dict) else type(heads).__name__
    raise ValueError(f"heads must be a dict with {list(_HEAD_KEYS)}, got {got}")
  shape = tuple(heads["w1_HxDxD"].shape)
  if len(shape) != 3 or shape[1] != shape[2] or tuple(heads["w2_HxDxD"].shape) != shape \
      or tuple(heads["b1_HxD"].shape) != shape[:2]:
    raise ValueError(f"heads need w1_HxDxD and w2_HxDxD [H, D, D] and b1_HxD [H, D]; got "
                     f"{[tuple(heads[k].shape) for k in _HEAD_KEYS]}")
  if d_model is not None and shape[1] != d_model:
    raise ValueError(f"the heads act on hidden states of D = {shape[1]}; the target has D = {d_model}")
  return shape[0], shape[1]


def _lm_head_params(target: decoder_lib.DecoderConfig, weight_VxD):
  return {"embed": {"embedding": weight_VxD}} if target.tie_embeddings else {"lm_head": {"weight": weight_VxD}}


def lm_head_weight(target: decoder_lib.DecoderConfig, target_params):
  """The target's LM head weight ``[V, D]`` from its parameter tree (the embedding when tied)."""
  if target.tie_embeddings:
    return target_params["embed"]["embedding"]
  return target_params["lm_head"]["weight"]


def heads_logits(params, target_config: decoder_lib.DecoderConfig, hidden_BxD: jax.Array, num: int) -> jax.Array:
  """f32 ``[B, num, V]``: heads ``0 .. num − 1`` on the target's final-norm hidden states ``hidden_BxD``, through the
  target's LM head exactly as the target applies it (:func:`blockspec_jax.models.decoder.head_logits`).
  ``params = {"heads": …, "lm_head": [V, D]}`` (other entries ignored)."""
  heads = params["heads"]
  total = heads["w1_HxDxD"].shape[0]
  if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= total:
    raise ValueError(f"asked for {num!r} heads; the parameters hold {total}")
  x_BxD = hidden_BxD.astype(jnp.float32)
  w1_HxDxD, b1_HxD, w2_HxDxD = (heads[k][:num].astype(jnp.float32) for k in _HEAD_KEYS)
  pre_BxHxD = jnp.einsum("bd,hed->bhe", x_BxD, w1_HxDxD) + b1_HxD[None]
  h_BxHxD = x_BxD[:, None, :] + jnp.einsum("bhe,hde->bhd", jax.nn.silu(pre_BxHxD), w2_HxDxD)
  lm_params = _lm_head_params(target_config, params["lm_head"])
  return decoder_lib.head_logits(target_config, lm_params, h_BxHxD.astype(target_config.dtype))


@struct.dataclass
class HeadsState:
  """The drafter's loop state: ``hidden_BxD`` f32 (the target's state before the last committed token) and the
  neural LM's KV cache (``None`` without one)."""
  hidden_BxD: jax.Array
  lm_cache: Optional[decoder_lib.KVCache] = None


@register("heads")
@dataclasses.dataclass(frozen=True)
class HeadsDrafter(Settings):
  """BPD heads on the target's hidden state, raw or rescored (see the module docstring). Hashable, static under jit.

  ``target``      the target's DecoderConfig (V, D, tied LM head, compute dtype)
  ``num_heads``   ``h``: heads in the parameters; γ may not exceed it
  ``rescore``     one of :data:`RESCORERS`
  ``top_k``       ``k``: lattice candidates per head (1 ≤ k ≤ V)
  ``lm_weight``   ``λ ≥ 0``: the LM's weight in the score
  ``pbest``       ``p``: beam width of the global search
  ``heads``       work directory of the trained heads (:func:`blockspec_jax.train.heads.load_heads`); host side only
  ``ngram``       directory of the n-gram LM (``ngram.json`` / ``ngram.npz``); default: the ``heads`` directory
  ``lm_config``   the neural LM's DecoderConfig (the small drafter model); required by the neural rescorers
  Parameters: ``{"heads", "lm_head": [V, D], "lm": <decoder params> (neural), "ngram": NGramLM (n-gram)}``.
  """

  target: decoder_lib.DecoderConfig
  num_heads: int = 4
  rescore: str = "none"
  top_k: int = 16
  lm_weight: float = 1.0
  pbest: int = 4
  heads: str | None = None
  ngram: str | None = None
  lm_config: decoder_lib.DecoderConfig | None = None

  job_fields = ("target", "lm_config")  # the job builds the drafter on the loaded target and drafter models
  run_setting = "heads"  # the field naming the training run (methods.trained_drafter_spec)
  run_what = "trained BPD heads"
  run_train = "train them with `python -m blockspec_jax.train --gin_file gin/train/heads_qwen.gin`"
  reads_target = True
  sibling_sampling = SAMPLING_CHAIN
  is_chain = True

  def __post_init__(self):
    if not isinstance(self.target, decoder_lib.DecoderConfig):
      raise ValueError(f"heads drafter needs the target's DecoderConfig, got {type(self.target).__name__}")
    self.check_fields(self.target)
    vocab = self.target.vocab_size
    if self.uses_neural:
      if not isinstance(self.lm_config, decoder_lib.DecoderConfig):
        raise ValueError(f"rescorer {self.rescore!r} needs the neural LM's DecoderConfig (lm_config)")
      if self.lm_config.vocab_size != vocab:
        raise ValueError(f"vocabulary mismatch between the neural LM (V = {self.lm_config.vocab_size}) and the "
                         f"target (V = {vocab}); both must share one tokenizer")
      if self.lm_config.max_len <= self.scratch_slots:
        raise ValueError(f"the neural LM's max_len {self.lm_config.max_len} leaves no room past the "
                         f"{self.scratch_slots} scratch slots of the p-best search")

  @classmethod
  def checked(cls, values, config=None):
    """``config``: the target's DecoderConfig (``top_k <= V``). The neural LM's config is checked by
    ``__post_init__``."""
    values = super().checked(values, config)
    if values["rescore"] not in RESCORERS:
      raise ValueError(f"unknown rescorer {values['rescore']!r}; known: {', '.join(RESCORERS)}")
    num_heads = check_int(values["num_heads"], "num_heads")
    top_k = check_count(values["top_k"], config, "top_k")
    pbest = check_int(values["pbest"], "pbest")
    lm_weight = values["lm_weight"]
    if isinstance(lm_weight, bool) or not isinstance(lm_weight, (int, float)) or not math.isfinite(lm_weight) \
        or lm_weight < 0:
      raise ValueError(f"lm_weight must be a finite number >= 0, got {lm_weight!r}")
    return {**values, "num_heads": num_heads, "top_k": top_k, "pbest": pbest,
            "heads": check_directory(values["heads"], "heads"), "ngram": check_directory(values["ngram"], "ngram")}

  @classmethod
  def _run_record(cls, directory) -> dict:
    return HEADS.read_record(directory, convert={"num_heads": int, "d_model": int})

  @classmethod
  def check_run(cls, settings) -> dict:
    """The heads' record (and, asked for, no more heads than it holds) and the n-gram LM's record: in ``ngram``
    when given, else in the heads' directory when the rescorer reads one."""
    record = super().check_run(settings)
    asked = settings.get("num_heads")
    if asked is not None and asked > record["num_heads"]:
      raise ValueError(f"the checkpoint in {settings['heads']} has {record['num_heads']} heads; the drafter asks for "
                       f"{asked}")
    ngram = settings.get("ngram")
    if ngram is None and settings.get("rescore", "none") in _NGRAM_RESCORERS:
      ngram = settings["heads"]
    if ngram is not None:
      read_record(lambda d: lattice._NGRAM.read_record(d, convert={"order": int, "vocab_size": int, "probe": int}),
                  ngram, "the BPD heads training job writes one in its work directory (python -m blockspec_jax.train "
                  "--gin_file gin/train/heads_qwen.gin)")
    return record

  @classmethod
  def build(cls, target_config: decoder_lib.DecoderConfig, lm_config: decoder_lib.DecoderConfig | None = None,
            **settings) -> "HeadsDrafter":
    """The drafter for a target and (for the neural rescorers) a small drafter model; ``settings`` are the other
    fields. ``lm_config`` is dropped for the rescorers that do not read it (so a job may always pass its drafter).
    Without ``num_heads``, a trained run's (``heads``) number of heads is used (its record:
    :meth:`~.settings.Settings.read_run`)."""
    cls.check_known(settings)
    rescore = settings.get("rescore", "none")
    if rescore not in _NEURAL_RESCORERS:
      lm_config = None
    if "num_heads" not in settings and settings.get("heads") is not None:
      settings["num_heads"] = cls.read_run(settings["heads"])["num_heads"]
    return cls(target=target_config, lm_config=lm_config, **settings)

  @classmethod
  def budget_shape(cls, budget, branches=2):
    """A chain of ``budget`` tokens, one head each (``num_heads = budget``)."""
    return {"num_heads": int(budget)}, int(budget)

  @classmethod
  def untrained(cls, target_config, target_params, drafter_config, drafter_params, gamma):
    """Raw heads (no rescorer) at their initial values (:func:`init_heads`, ``key(0)``: every head equals the
    target's next-token head), at least ``gamma`` of them, with the target's LM head (``top_k`` at most V)."""
    defaults = cls._defaults()
    num_heads = max(int(gamma), defaults["num_heads"])
    drafter = cls.build(target_config, drafter_config, num_heads=num_heads,
                        top_k=min(defaults["top_k"], target_config.vocab_size))
    heads = init_heads(target_config.d_model, num_heads, jax.random.key(0))
    return drafter, {"heads": heads, "lm_head": lm_head_weight(target_config, target_params)}

  # --- declarations -----------------------------------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    return self.target.vocab_size

  @property
  def uses_neural(self) -> bool:
    return self.rescore in _NEURAL_RESCORERS

  @property
  def uses_ngram(self) -> bool:
    return self.rescore in _NGRAM_RESCORERS

  @property
  def is_global(self) -> bool:
    return self.rescore.startswith("pbest_")

  @property
  def scratch_slots(self) -> int:
    """Extra neural-LM cache slots past the loop's cache length (the p-best search's tree)."""
    return self.num_heads * self.pbest if self.rescore == "pbest_neural" else 0

  @property
  def max_len(self) -> Optional[int]:
    if not self.uses_neural:
      return None
    return self.lm_config.max_len - self.scratch_slots

  def num_nodes(self, gamma: int) -> int:
    if not is_int(gamma, 1) or gamma > self.num_heads:
      raise ValueError(f"heads drafter has {self.num_heads} heads; gamma must be an integer in [1, "
                       f"{self.num_heads}], got {gamma!r}")
    return int(gamma)

  @property
  def _lm(self) -> ModelDrafter:
    return ModelDrafter(self.lm_config)

  # --- the loop's calls -------------------------------------------------------------------------------------------

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    batch = tokens_BxP.shape[0]
    hidden_BxD = jnp.zeros((batch, self.target.d_model), jnp.float32)
    lm_cache = None
    if self.uses_neural:
      lm_cache = self._lm.init_state(params["lm"], tokens_BxP, prompt_len_B, max_len + self.scratch_slots)
    return HeadsState(hidden_BxD, lm_cache)

  def commit(self, params, state: HeadsState, commit: Commit):
    """Keep the target's hidden state at the position before the last committed token; the LM cache needs nothing
    (rollback is the row's length)."""
    del params
    hidden_BxD, _ = commit.last_states()
    return state.replace(hidden_BxD=hidden_BxD.astype(jnp.float32))

  def propose(self, params, state: HeadsState, tokens_BxS, length_B, key_B, gamma, sampler):
    self.num_nodes(gamma)
    logits_BxGxV = heads_logits(params, self.target, state.hidden_BxD, gamma)
    if self.rescore == "none":
      keys_BxG = jax.vmap(lambda k: jax.random.split(k, gamma))(key_B)
      q_BxGxV = sampler.probs(logits_BxGxV)
      draft_BxG = jax.vmap(jax.vmap(sampling.sample))(keys_BxG, q_BxGxV)
      return state, chain_draft(draft_BxG, q_BxGxV)
    cand_BxGxK, head_logp_BxGxK = lattice.lattice_candidates(logits_BxGxV, self.top_k)
    lm, lm_state = self._lattice_lm(params, state, tokens_BxS, length_B, gamma)
    if not self.is_global:
      lm_state, draft_BxG, q_BxGxV = lattice.local_rescore(key_B, cand_BxGxK, head_logp_BxGxK, lm, lm_state,
                                                           self.lm_weight, sampler, self.vocab_size)
      if self.uses_neural:
        state = state.replace(lm_cache=lm_state)
      return state, chain_draft(draft_BxG, q_BxGxV)
    lm_state, draft_BxG, _, lm_path_B = lattice.pbest_search(cand_BxGxK, head_logp_BxGxK, lm, lm_state,
                                                             self.lm_weight, self.pbest)
    if self.uses_neural:
      state = state.replace(lm_cache=self._keep_path(lm_state, lm_path_B, length_B, gamma))
    return state, chain_draft(draft_BxG)

  def _lattice_lm(self, params, state: HeadsState, tokens_BxS, length_B, gamma):
    """``(LatticeLM, its state)`` of the rescorer: the n-gram LM, the neural LM (``p`` paths at once for the global
    search, one path for the local one) or none (``"pbest_none"``)."""
    if self.uses_ngram:
      return lattice.ngram_lattice_lm(params["ngram"], tokens_BxS, length_B)
    if not self.uses_neural:
      return lattice.zero_lattice_lm()
    if self.is_global:
      return self._tree_lm(params["lm"], state.lm_cache, tokens_BxS, length_B, gamma)
    return self._chain_lm(params["lm"], state.lm_cache, tokens_BxS, length_B)

  # --- the neural LM as a lattice LM --------------------------------------------------------------------------------

  def _chain_lm(self, lm_params, cache, tokens_BxS, length_B):
    """One path at the true positions: ``begin`` (the last two committed tokens), then ``step`` per chosen token."""
    t1 = sampling.Sampler(1.0)
    model = self._lm

    def init(cache, cand_BxK):
      cache, q_BxV, _ = model.begin(lm_params, cache, tokens_BxS, length_B, t1)
      return cache, _candidate_logp(q_BxV, cand_BxK)

    def extend(cache, j, prefix_Bx1xG, parent_Bx1, cand_BxK):
      del parent_Bx1
      x_B = jax.lax.dynamic_index_in_dim(prefix_Bx1xG[:, 0], j - 1, axis=1, keepdims=False)
      cache, q_BxV, _ = model.step(lm_params, cache, x_B, length_B + j - 1, t1)
      return cache, _candidate_logp(q_BxV, cand_BxK)[:, None, :]

    return lattice.LatticeLM(init, extend), cache

  def _tree_lm(self, lm_params, cache, tokens_BxS, length_B, gamma):
    """``p`` paths at once: path ``w``'s token of depth ``d`` sits in scratch slot ``S + d·p + w`` (``S`` = the
    loop's cache length) at position ``length + d`` and attends to the committed slots and its ancestors' slots."""
    t1 = sampling.Sampler(1.0)
    model = self._lm
    width, batch = self.pbest, tokens_BxS.shape[0]
    total_slots = cache.max_len
    base = total_slots - self.scratch_slots
    slots_S = jnp.arange(total_slots, dtype=jnp.int32)
    index_G = jnp.arange(gamma, dtype=jnp.int32)
    padded_BxS = jnp.pad(tokens_BxS, ((0, 0), (0, total_slots - tokens_BxS.shape[1])))

    def init(state, cand_BxK):
      cache, anc_BxWxG = state
      cache, q_BxV, _ = model.begin(lm_params, cache, padded_BxS, length_B, t1)
      return (cache, anc_BxWxG), _candidate_logp(q_BxV, cand_BxK)

    def extend(state, j, prefix_BxWxG, parent_BxW, cand_BxK):
      cache, anc_BxWxG = state
      anc_BxWxG = jnp.take_along_axis(anc_BxWxG, parent_BxW[:, :, None], axis=1)
      slot_BxW = jnp.broadcast_to(base + (j - 1) * width + jnp.arange(width, dtype=jnp.int32), (batch, width))
      anc_BxWxG = jnp.where((index_G == j - 1)[None, None, :], slot_BxW[:, :, None], anc_BxWxG)
      x_BxW = jax.lax.dynamic_index_in_dim(prefix_BxWxG, j - 1, axis=2, keepdims=False)
      position_BxW = jnp.broadcast_to(length_B[:, None] + j - 1, (batch, width))
      ancestor_BxWxS = jnp.any(anc_BxWxG[:, :, :, None] == slots_S[None, None, None, :], axis=2)
      mask_BxWxS = (slots_S[None, None, :] < length_B[:, None, None]) | ancestor_BxWxS
      logits_BxWxV, cache = model.module.apply({"params": lm_params}, x_BxW, position_BxW, cache, mask_BxWxS,
                                               slots_BxT=slot_BxW)
      q_BxWxV = t1.probs(logits_BxWxV)
      cand_BxWxK = jnp.broadcast_to(cand_BxK[:, None, :], (batch, width, cand_BxK.shape[1]))
      logp_BxWxK = jnp.log(jnp.maximum(jnp.take_along_axis(q_BxWxV, cand_BxWxK, axis=2), _LOG_FLOOR))
      return (cache, anc_BxWxG), logp_BxWxK

    anc_BxWxG = jnp.full((batch, width, gamma), -1, jnp.int32)
    return lattice.LatticeLM(init, extend), (cache, anc_BxWxG)

  def _keep_path(self, lm_state, lm_path_B, length_B, gamma):
    """Move the chosen path's entries (depths ``0 .. γ − 2``, the tokens that were fed) from their scratch slots to
    slots ``length .. length + γ − 2``: the cache convention of :class:`ModelDrafter` holds again."""
    cache, anc_BxWxG = lm_state
    if gamma == 1:
      return cache
    src_BxM = jnp.take_along_axis(anc_BxWxG, lm_path_B[:, None, None], axis=1)[:, 0, :gamma - 1]
    dst_BxM = length_B[:, None] + jnp.arange(gamma - 1, dtype=jnp.int32)[None, :]
    return cache.move_slots(src_BxM, dst_BxM, jnp.ones(src_BxM.shape, bool))

  # --- host side --------------------------------------------------------------------------------------------------

  def load_params(self, drafter_model, target_model):
    """The decoding parameters (host side): ``heads`` from the ``heads`` work directory (SHA-256 checked, D and the
    number of heads checked), the LM head from ``target_model``, the neural LM = ``drafter_model``'s parameters, the
    n-gram LM from ``ngram`` (default: the heads directory). ``drafter_model`` / ``target_model``:
    ``hub.LoadedModel``s."""
    if self.heads is None:
      raise ValueError(self.run_needed())
    target_config = target_model.config
    if target_config.vocab_size != self.vocab_size or target_config.d_model != self.target.d_model:
      raise ValueError(f"the drafter was built for a target of V = {self.vocab_size}, D = {self.target.d_model}; "
                       f"the target has V = {target_config.vocab_size}, D = {target_config.d_model}")
    heads, _ = load_heads(self.heads, d_model=self.target.d_model, num_heads=self.num_heads)
    params = {"heads": heads, "lm_head": lm_head_weight(self.target, target_model.params["params"])}
    if self.uses_neural:
      if drafter_model.config.vocab_size != self.vocab_size:
        raise ValueError(f"vocabulary mismatch between the neural LM (V = {drafter_model.config.vocab_size}) and "
                         f"the target (V = {self.vocab_size})")
      params["lm"] = drafter_model.params["params"]
    if self.uses_ngram:
      params["ngram"], _ = lattice.load_ngram(self.ngram or self.heads, vocab_size=self.vocab_size)
    return params


def _candidate_logp(q_BxV, cand_BxK):
  """f32 ``[B, K]``: log of the LM's T = 1 probabilities at the candidates (floored, so never −inf)."""
  return jnp.log(jnp.maximum(jnp.take_along_axis(q_BxV, cand_BxK, axis=1), _LOG_FLOOR))


# --- trained artifact: the heads' files (written by blockspec_jax.train.heads, read here) --------------------

HEADS_JSON, HEADS_NPZ = "heads.json", "heads.npz"
HEADS = artifacts.Artifact(
    HEADS_NPZ, HEADS_JSON, what="BPD heads",
    absent="is not the work directory of a finished BPD heads training run (python -m blockspec_jax.train "
    "--gin_file gin/train/heads_*.gin)", remedy="rerun the heads' training job")


def save_heads(workdir, heads, info: dict | None = None) -> pathlib.Path:
  """Write the heads to ``<workdir>/heads.npz`` and ``<workdir>/heads.json`` (``info``, JSON-able, plus
  ``num_heads``, ``d_model``, the npz's name and SHA-256, checked on load), atomically, the npz first. Returns the
  json's path."""
  arrays = {k: np.asarray(jax.device_get(v), np.float32) for k, v in heads.items()}
  num_heads, d_model = check_heads(arrays)
  if not all(np.all(np.isfinite(v)) for v in arrays.values()):
    raise ValueError("save_heads: the heads hold NaN or infinite values")
  return HEADS.save(workdir, arrays, info, {"num_heads": num_heads, "d_model": d_model})


def load_heads(workdir, d_model: int | None = None, num_heads: int | None = None):
  """``(heads, info)`` saved by :func:`save_heads`: the heads pytree (jax f32 arrays) and the json's dict.

  ``d_model``: the target's width (a mismatch is a ValueError). ``num_heads``: how many heads the caller uses: the
  first ``num_heads`` are returned (ValueError when the checkpoint has fewer). FileNotFoundError for a missing
  directory or file; ValueError for a corrupted or tampered file (SHA-256 checked)."""
  workdir = pathlib.Path(workdir).expanduser()
  heads, info = HEADS.load(workdir, convert={"num_heads": int, "d_model": int}, dtype=np.float32)
  saved_heads, saved_width = info["num_heads"], info["d_model"]
  path, npz_path = HEADS.paths(workdir, info)
  try:
    found_heads, found_width = check_heads(heads)
  except ValueError as e:
    raise ValueError(f"{npz_path}: {e}") from None
  if (found_heads, found_width) != (saved_heads, saved_width):
    raise ValueError(f"{npz_path} holds {found_heads} heads of D = {found_width}; {path} says {saved_heads} of "
                     f"D = {saved_width}")
  if d_model is not None and int(d_model) != found_width:
    raise ValueError(f"the BPD heads in {workdir} were trained on hidden states of D = {found_width} (target "
                     f"{info.get('target', '?')}); this target has D = {d_model}")
  if num_heads is not None:
    check_int(num_heads, "num_heads")
    if num_heads > found_heads:
      raise ValueError(f"the checkpoint in {workdir} has {found_heads} heads; the drafter asks for {num_heads}")
    heads = {k: v[:num_heads] for k, v in heads.items()}
  return {k: jnp.asarray(v) for k, v in heads.items()}, info


@register("heads_tree")
@dataclasses.dataclass(frozen=True)
class HeadsTreeDrafter(HeadsDrafter):
  """BPD's global rescoring as the paper verifies it (module docstring): the ``pbest`` best paths of the lattice,
  with the n-gram LM (``rescore = "pbest_ngram"``) or by the heads' scores alone (``"pbest_none"``, the default: the
  "p-best 0-gram" control, and what :meth:`untrained` heads run), proposed as one tree of ``pbest`` chains of γ
  point masses (``N = pbest·γ``, depth-major: node ``d·p + w`` is path ``w``'s token ``d``, path 0 the best).
  Verify with ``"point_mass"``. Fields as :class:`HeadsDrafter`; ``pbest`` is the number of paths (and the search's
  width)."""

  rescore: str = "pbest_none"
  sibling_sampling = POINT_MASS
  is_chain = False

  @classmethod
  def checked(cls, values, config=None):
    values = super().checked(values, config)
    if values["rescore"] not in TREE_RESCORERS:
      raise ValueError(f"heads_tree proposes the p best paths of the n-gram or 0-gram lattice search: rescore must be "
                       f"one of {', '.join(TREE_RESCORERS)}, got {values['rescore']!r} (the local rescorers draft one "
                       f"chain: use the 'heads' drafter; the neural LM's cache can follow one path only)")
    return values

  @classmethod
  def budget_shape(cls, budget, branches=2):
    """``branches`` paths (``pbest``) of depth ``budget / branches`` (one head per depth)."""
    depth = cls._budget_depth(budget, branches)
    return {"num_heads": depth, "pbest": int(branches)}, depth

  def num_nodes(self, gamma: int) -> int:
    return super().num_nodes(gamma) * self.pbest

  def propose(self, params, state: HeadsState, tokens_BxS, length_B, key_B, gamma, sampler):
    """``(state, Draft)``: the ``pbest`` paths as a tree of chains, ``q = None`` (point masses: the search draws
    nothing, so neither ``key_B`` nor the sampler's temperature enters)."""
    del key_B, sampler
    super().num_nodes(gamma)
    logits_BxGxV = heads_logits(params, self.target, state.hidden_BxD, gamma)
    cand_BxGxK, head_logp_BxGxK = lattice.lattice_candidates(logits_BxGxV, self.top_k)
    lm, lm_state = self._lattice_lm(params, state, tokens_BxS, length_B, gamma)
    _, paths_BxWxG, _, _ = lattice.pbest_paths(cand_BxGxK, head_logp_BxGxK, lm, lm_state, self.lm_weight,
                                               self.pbest)
    batch, width = paths_BxWxG.shape[:2]
    tokens_BxN = jnp.swapaxes(paths_BxWxG, 1, 2).reshape(batch, gamma * width)
    return state, Draft(tokens_BxN.astype(jnp.int32), chain_tree_parents(batch, width, gamma))


def chain_tree_parents(batch: int, width: int, gamma: int) -> jax.Array:
  """int32 ``[B, width·γ]``: ``width`` chains of depth ``γ`` laid out depth-major (node ``d·width + w`` is chain
  ``w``'s node of depth ``d + 1``, child of node ``(d − 1)·width + w``; the root's children first)."""
  node_N = jnp.arange(width * gamma, dtype=jnp.int32)
  return jnp.broadcast_to(jnp.where(node_N < width, -1, node_N - width), (batch, width * gamma))
