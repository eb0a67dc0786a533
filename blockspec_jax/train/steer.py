"""Training SD²'s steering map (:mod:`blockspec_jax.drafters.steer`): the target frozen, the map trained with a
token-level divergence to the target (DistillSpec's, :mod:`blockspec_jax.train.divergences`); the drafter frozen, or
fine-tuned jointly with the map (``SteerLoss.assemble_drafter``, the authors' default).

    data = make_steer_data(target, target_params, drafter, prompts_NxP, prompt_len_N, batch_size=2,
                           max_new_tokens=64, sample_batch_size=12)          # target continuations, held-out split
    loss_fn = SteerLoss(target, drafter, target_layers=(2, 13, 24), gamma=4, divergence="fkl")
    fit(loss_fn=loss_fn, trainable=init_steer(...), frozen={"target": tp, "drafter": dp},
        batch_fn=make_batch_fn(data), ...)
    report = heldout_tv(data, tp, dp, {"before": steer0, "after": steer1, "plain": None}, target_layers=...,
                        gamma=4)
    save_steer(workdir, steer1, info);  steer, info = load_steer(workdir, target_config=..., drafter_config=...)

Sequences are a prompt and the target's sampled continuation (:func:`blockspec_jax.train.distill.make_distill_data`,
source ``"fixed"``), row ``b`` = ``prompt[:P_b] + generated[:n_b]`` then padding. Inside the jitted step the target
runs once over the whole sequence (no cache on disk) and gives the teacher logits on the loss window and its taps
``[B, T, K, Dt]`` at the ``target_layers``; then the drafter runs once with a bias per position::

    position t < P − 2              no bias (the decoding loop feeds the prompt plain)
    P − 2 ≤ t < P − 1 + n           the map of the target's taps at src(t) = max(t − o, P − 2)  (zeros at src < 0)
    t ≥ P − 1 + n                   no bias (after the last loss position: cannot reach the loss)

The offset ``o`` is drawn uniformly from ``1..γ`` per step (the authors' "regular" scheme), from the step's key: at
decode time the ``o``-th draft law after a commit is produced by the query ``o`` positions after the last accepted
one. The "blocks" scheme (``SteerLoss.scheme``) instead tiles the window with blocks of ``γ`` positions at a random
phase, each block reading the taps just before it, as a decode drafts (the positions before the ``o``-th draft law
ran under the same vector). The clamp at ``P − 2`` is the first steered position of decoding (the prefill's commit). The loss is the mean
over the loss window (positions ``P − 1 .. P − 2 + n`` that predict generated tokens, :func:`distill.loss_window`)
of ``D(p_target(t) ‖ q_steered(t))``; gradients reach only the map (both models are ``frozen``).

Held-out metric (:func:`heldout_tv`): the mean total variation, at the decoding temperature, between the target's
and the drafter's next-token laws on the held-out prompts' generated positions, with the drafter steered as a
decode whose blocks tile the continuation by ``γ``: position ``t`` of the window reads the taps at the start of its
block, so the ``j``-th window position has offset ``(j mod γ) + 1`` — every offset decoding meets, equally often.
``by_offset`` splits the mean by offset. ``None`` as a map means the plain drafter (no bias at all).

Storage (:func:`save_steer` / :func:`load_steer`): ``steer.npz`` (the map's leaves by path) and ``steer.json`` (its
dimensions, layers, the training info, the npz's SHA-256, checked on load).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import runtime, sampling
from blockspec_jax.checks import check_int
from blockspec_jax.drafters.steer import (STEER_JSON, STEER_NPZ, check_layers, load_steer, read_steer_info, save_steer,
                                         steering_vectors, to_layers)
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, divergences

__all__ = ["STEER_JSON", "STEER_NPZ", "SCHEMES", "SteerLoss", "window_sources", "target_window", "steered_window_logits",
           "make_steer_data", "make_batch_fn", "heldout_tv", "save_steer", "load_steer", "read_steer_info",
           "check_steer_setup"]

#: Where a training position's bias comes from (:class:`SteerLoss`): the authors' one offset per step, or blocks of
#: γ positions sharing one vector, as decoding drafts them.
SCHEMES = ("regular", "blocks")


def check_steer_setup(target: decoder_lib.DecoderConfig, drafter: decoder_lib.DecoderConfig, target_layers,
                      steered_layers, gamma: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(target_layers, steered_layers)`` checked against the pair (``steered_layers`` None: every drafter layer);
  ValueError for another vocabulary, bad layers or ``gamma < 1``."""
  distill.check_pair(target, drafter)
  target_layers = check_layers(target_layers, target.num_layers, "target_layers", allow_repeats=True)
  steered_layers = tuple(range(drafter.num_layers)) if steered_layers is None else check_layers(
      steered_layers, drafter.num_layers, "steered_layers")
  check_int(gamma, "gamma")
  return target_layers, steered_layers


# --- the forward passes ---------------------------------------------------------------------------------------------

def _forward(config: decoder_lib.DecoderConfig, params, tokens_BxT, positions_BxN, tap_layers=(),
             mlp_delta_LxBxTxF=None):
  """A causal pass over whole sequences: ``(logits_BxNxV f32 at positions_BxN, taps_BxTxKxD or None)``; the LM head
  runs on the gathered final-norm outputs only (as :func:`distill.sequence_logits`)."""
  batch, length = tokens_BxT.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))
  out = decoder_lib.Decoder(config).apply({"params": params}, tokens_BxT, positions_BxT,
                                          decoder_lib.init_cache(config, batch, length),
                                          decoder_lib.causal_mask(positions_BxT, length), return_hidden=True,
                                          tap_layers=tuple(tap_layers), mlp_delta_LxBxTxF=mlp_delta_LxBxTxF)
  hidden_BxNxD = jnp.take_along_axis(out[2], positions_BxN[:, :, None].astype(jnp.int32), axis=1)
  return decoder_lib.head_logits(config, params, hidden_BxNxD), (out[3] if tap_layers else None)


def target_window(target: decoder_lib.DecoderConfig, target_params, tokens_BxT, positions_BxN,
                  target_layers: Sequence[int]):
  """The teacher: ``(logits_BxNxV f32 at the window, taps_BxTxKxD at every position)``, no gradient."""
  logits_BxNxV, taps_BxTxKxD = _forward(target, target_params, tokens_BxT, positions_BxN, target_layers)
  return jax.lax.stop_gradient(logits_BxNxV), jax.lax.stop_gradient(taps_BxTxKxD)


def window_sources(prompt_len_B: jax.Array, length: int, window: int, offset=None, gamma: Optional[int] = None,
                   phase=0):
  """Where each position's bias comes from: ``(src_BxT int32 in [0, window), active_BxT bool)`` relative to the
  first steered position ``w0 = P − 2`` (``window`` = n + 1 steered positions, ``P − 2 .. P − 2 + n``).

  ``offset`` (int32 [] or int, ≥ 1): ``src(t) = max(t − o, P − 2)`` (the "regular" training scheme); else
  ``gamma``: blocks of ``γ`` draft laws tiling the window from ``P − 1`` on, each reading the taps just before its
  block: with window index ``k = t − (P − 2)``, ``src = γ·⌊(k − 1 + φ) / γ⌋ − φ`` clamped at 0, where the
  ``phase`` ``φ`` (int32 [] or int in ``0..γ−1``) shortens the first block to ``γ − φ`` positions (φ = 0: the
  held-out metric's tiling; a random φ per step: the "blocks" training scheme)."""
  batch = prompt_len_B.shape[0]
  t_BxT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))
  k_BxT = t_BxT - (prompt_len_B[:, None] - 2)  # index in the window
  active_BxT = (k_BxT >= 0) & (k_BxT < window)
  if offset is not None:
    src_BxT = k_BxT - offset
  elif gamma is not None:
    src_BxT = gamma * jnp.floor_divide(k_BxT - 1 + phase, gamma) - phase
  else:
    raise ValueError("window_sources needs an offset (training) or gamma (tiled blocks)")
  return jnp.clip(src_BxT, 0, window - 1), active_BxT


def steered_window_logits(drafter: decoder_lib.DecoderConfig, drafter_params, steer, tokens_BxT, positions_BxN,
                          prompt_len_B, taps_BxTxKxD, src_BxT, active_BxT, steered_layers: Sequence[int]):
  """f32 ``[B, N, V]``: the drafter's logits at the window with position ``t``'s MLP biases = the map of the taps
  at window source ``src_BxT[b, t]`` where ``active_BxT`` (see :func:`window_sources`); ``steer`` None: the plain
  drafter (no bias at all)."""
  if steer is None:
    return _forward(drafter, drafter_params, tokens_BxT, positions_BxN)[0]
  batch, length = tokens_BxT.shape
  window = positions_BxN.shape[1] + 1
  first_B = prompt_len_B - 2
  source_BxW = first_B[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]
  taps_BxWxKxD = jnp.take_along_axis(taps_BxTxKxD, jnp.clip(source_BxW, 0, length - 1)[:, :, None, None], axis=1)
  taps_BxWxKxD = jnp.where((source_BxW >= 0)[:, :, None, None], taps_BxWxKxD, 0)  # one-token prompts: no state
  vectors_BxWxNxF = steering_vectors(steer, taps_BxWxKxD, drafter.ffn_dim)
  vectors_BxTxNxF = jnp.take_along_axis(vectors_BxWxNxF, src_BxT[:, :, None, None], axis=1)
  vectors_BxTxNxF = jnp.where(active_BxT[:, :, None, None], vectors_BxTxNxF, 0.0)
  delta_LxBxTxF = to_layers(vectors_BxTxNxF, drafter.num_layers, steered_layers)
  return _forward(drafter, drafter_params, tokens_BxT, positions_BxN, mlp_delta_LxBxTxF=delta_LxBxTxF)[0]


# --- the loss -------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SteerLoss:
  """``(steer, frozen, batch, key) -> (loss, aux)`` for :func:`blockspec_jax.train.trainer.fit`.

  ``frozen = {"target": target params, "drafter": drafter params}``; ``batch = {"tokens_BxT" int32 [B, T],
  "prompt_len_B" int32 [B], "positions_BxN" int32 [B, N], "mask_BxN" f32 [B, N]}`` (:func:`make_batch_fn`).
  ``scheme`` says where each position's bias comes from (:func:`window_sources`), drawn from ``key`` per step:

  * ``"regular"`` (the authors'): one offset ``o ~ U{1..γ}``; every position reads the taps ``o`` before it, so the
    positions before it, which a decode would draft under the same vector, were run under other vectors;
  * ``"blocks"``: a phase ``φ ~ U{0..γ−1}`` and blocks of ``γ`` positions that share the vector of the position
    before the block, as a decode drafts them (every earlier position of a draft runs under the vector its
    successors read), so one pass trains every offset ``1..γ`` in the context decoding gives it.

  ``assemble_drafter`` (None: only the map trains, ``trainable`` IS the map): joint training, the authors' default
  (their drafter is fine-tuned beside the map): ``trainable = {"steer": map, "drafter": the drafter's trainable
  part}`` and the drafter's parameters are ``assemble_drafter(trainable["drafter"], frozen["drafter"])`` (a
  :class:`~blockspec_jax.train.recipe.DrafterParts`' ``assemble``: LoRA adapters on the frozen base, or a trained
  subset merged into it); one loss, gradients to both parts.

  aux: ``tv`` (mean total variation at the loss temperature, no gradient) and ``offset`` (regular) or ``phase``.
  """
  target: decoder_lib.DecoderConfig
  drafter: decoder_lib.DecoderConfig
  target_layers: tuple[int, ...]
  steered_layers: Optional[tuple[int, ...]] = None
  gamma: int = 4
  divergence: str = "fkl"
  temperature: float = 1.0
  beta: float = 0.5
  scheme: str = "regular"
  assemble_drafter: Optional[Callable] = None

  def __post_init__(self):
    if self.scheme not in SCHEMES:
      raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
    target_layers, steered_layers = check_steer_setup(self.target, self.drafter, self.target_layers,
                                                      self.steered_layers, self.gamma)
    object.__setattr__(self, "target_layers", target_layers)
    object.__setattr__(self, "steered_layers", steered_layers)
    divergences.check_divergence(self.divergence, self.beta)
    divergences.check_temperature(self.temperature)

  def parts(self, trainable, frozen) -> tuple:
    """``(map, drafter parameters)`` of a trainable tree (see ``assemble_drafter``)."""
    if self.assemble_drafter is None:
      return trainable, frozen["drafter"]
    return trainable["steer"], self.assemble_drafter(trainable["drafter"], frozen["drafter"])

  def __call__(self, trainable, frozen, batch, key):
    steer, drafter_params = self.parts(trainable, frozen)
    tokens_BxT, positions_BxN, mask_BxN = batch["tokens_BxT"], batch["positions_BxN"], batch["mask_BxN"]
    prompt_len_B = batch["prompt_len_B"]
    target_logits_BxNxV, taps_BxTxKxD = target_window(self.target, frozen["target"], tokens_BxT, positions_BxN,
                                                      self.target_layers)
    window = positions_BxN.shape[1] + 1
    if self.scheme == "regular":
      draw = jax.random.randint(key, (), 1, self.gamma + 1)
      src_BxT, active_BxT = window_sources(prompt_len_B, tokens_BxT.shape[1], window, offset=draw)
    else:
      draw = jax.random.randint(key, (), 0, self.gamma)
      src_BxT, active_BxT = window_sources(prompt_len_B, tokens_BxT.shape[1], window, gamma=self.gamma, phase=draw)
    drafter_logits_BxNxV = steered_window_logits(self.drafter, drafter_params, steer, tokens_BxT, positions_BxN,
                                                 prompt_len_B, taps_BxTxKxD, src_BxT, active_BxT, self.steered_layers)
    loss = divergences.token_divergence(self.divergence, target_logits_BxNxV, drafter_logits_BxNxV, mask_BxN,
                                        temperature=self.temperature, beta=self.beta)
    tv = divergences.token_divergence("tvd", target_logits_BxNxV, jax.lax.stop_gradient(drafter_logits_BxNxV),
                                      mask_BxN, temperature=self.temperature)
    return loss, {"tv": tv, ("offset" if self.scheme == "regular" else "phase"): draw.astype(jnp.float32)}


# --- data -----------------------------------------------------------------------------------------------------------

def make_steer_data(target: decoder_lib.DecoderConfig, target_params, drafter: decoder_lib.DecoderConfig,
                    prompts_NxP, prompt_len_N, *, batch_size: int, sample_batch_size: Optional[int] = None,
                    **sampling) -> distill.DistillData:
  """:func:`distill.make_distill_data` with source ``"fixed"`` (the target's continuations of every prompt, sampled
  once at ``sample_temperature``), sampled ``sample_batch_size`` prompts at a time (default ``batch_size``: a larger
  one amortises the target's weights over more rows), then served ``batch_size`` rows per step. ``sampling``:
  :func:`distill.make_distill_data`'s other keyword arguments (``max_new_tokens``, ``sample_temperature``,
  ``heldout_fraction``, ``seed``, ``stop_ids``, ``split``, ``progress``; ``samples_path`` / ``samples_meta``: the
  samples kept for a resume; ``reuse_samples``: another run's samples whose continuations of the same prompts are
  taken rather than sampled again; ``mesh``: where the continuations are drawn)."""
  sample_batch_size = batch_size if sample_batch_size is None else sample_batch_size
  batch_size = check_int(batch_size, "batch_size")
  data = distill.make_distill_data(target, target_params, drafter, prompts_NxP, prompt_len_N,
                                   batch_size=sample_batch_size, source="fixed", **sampling)
  return dataclasses.replace(data, batch_size=batch_size)


def make_batch_fn(data: distill.DistillData):
  """``batch_fn(step, steer) -> batch`` for :func:`trainer.fit`: :func:`distill.make_batch_fn`'s fixed-source batch
  (epochs are fixed-seed permutations of the training prompts: a pure function of the step) plus ``prompt_len_B``."""
  if data.source != "fixed":
    raise ValueError(f"SD² trains on the target's fixed continuations (source 'fixed'), got {data.source!r}")
  base = distill.make_batch_fn(data, frozen_drafter=None)

  def batch_fn(step: int, steer):
    del steer  # fixed data: the batch does not depend on the map
    batch = base(step, None)
    # loss_window's first position is each row's prompt_len − 1 (never clipped: T > P), so it gives the lengths.
    return {"tokens_BxT": batch["tokens_BxT"], "positions_BxN": batch["positions_BxN"],
            "mask_BxN": batch["mask_BxN"], "prompt_len_B": batch["positions_BxN"][:, 0] + 1}

  return batch_fn


# --- held-out metric ------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("target", "drafter", "target_layers", "steered_layers", "gamma",
                                             "temperature"))
def _tv_sums(target_params, drafter_params, steers, tokens_BxT, prompt_len_B, positions_BxN, mask_BxN, *, target,
             drafter, target_layers, steered_layers, gamma, temperature):
  """Per map in ``steers`` (a tuple; None = plain drafter): f32 ``[γ]`` sums of the TV by offset (window position
  ``j`` has offset ``(j mod γ) + 1``); and f32 ``[γ]`` masked counts."""
  target_logits_BxNxV, taps_BxTxKxD = target_window(target, target_params, tokens_BxT, positions_BxN,
                                                    target_layers)
  width = positions_BxN.shape[1]
  src_BxT, active_BxT = window_sources(prompt_len_B, tokens_BxT.shape[1], width + 1, gamma=gamma)
  p_BxNxV = sampling.probs_from_logits(target_logits_BxNxV, temperature=temperature)
  by_offset_NxG = jax.nn.one_hot(jnp.arange(width) % gamma, gamma, dtype=jnp.float32)
  counts_G = jnp.einsum("bn,ng->g", mask_BxN, by_offset_NxG)
  sums = []
  for steer in steers:
    logits_BxNxV = steered_window_logits(drafter, drafter_params, steer, tokens_BxT, positions_BxN, prompt_len_B,
                                         taps_BxTxKxD, src_BxT, active_BxT, steered_layers)
    q_BxNxV = sampling.probs_from_logits(logits_BxNxV, temperature=temperature)
    tv_BxN = 0.5 * jnp.sum(jnp.abs(p_BxNxV - q_BxNxV), axis=-1)
    sums.append(jnp.einsum("bn,ng->g", tv_BxN * mask_BxN, by_offset_NxG))
  return tuple(sums), counts_G


def heldout_tv(data: distill.DistillData, target_params, drafter_params, steers: Mapping[str, object], *,
               target_layers: Sequence[int], steered_layers: Optional[Sequence[int]] = None, gamma: int,
               temperature: Optional[float] = None, progress: bool = False) -> dict:
  """``{name: {"tv": mean TV, "by_offset": [TV at offset 1..γ]}}`` for every map in ``steers`` (``None``: the plain
  drafter), over the held-out prompts' generated positions, at the decoding temperature (``data``'s sampling one)
  by default; one target pass per batch of ``data.batch_size`` rows serves every map (the last batch wraps around,
  its repeated rows masked out). See the module docstring for the offsets. ``progress``: announce the first
  (compiling) batch and show a bar."""
  if len(data.heldout_idx) == 0:
    raise ValueError("no held-out prompts (heldout_fraction = 0)")
  target_layers, steered_layers = check_steer_setup(data.target, data.drafter, target_layers, steered_layers, gamma)
  temperature = data.sample_temperature if temperature is None else float(temperature)
  names = list(steers)
  maps = tuple(steers[name] for name in names)
  totals = np.zeros((len(names), gamma))
  counts = np.zeros((gamma,))
  n = len(data.heldout_idx)
  starts = list(range(0, n, data.batch_size))

  def one(start):
    flat = np.arange(start, start + data.batch_size)
    rows = data.heldout_idx[flat % n]
    mask_BxT = data.fixed_mask_NxT[rows] * (flat < n)[:, None]
    positions_BxN, mask_BxN = distill.loss_window(mask_BxT, data.prompt_len_N[rows], data.max_new_tokens)
    sums, c = _tv_sums(target_params, drafter_params, maps, jnp.asarray(data.fixed_tokens_NxT[rows]),
                       jnp.asarray(data.prompt_len_N[rows]), jnp.asarray(positions_BxN), jnp.asarray(mask_BxN),
                       target=data.target, drafter=data.drafter, target_layers=target_layers,
                       steered_layers=steered_layers, gamma=gamma, temperature=temperature)
    return np.asarray(jax.device_get(sums), np.float64), np.asarray(c, np.float64)

  bar = None
  if progress:
    from tqdm import tqdm
    with runtime.compiling(f"held-out TV pass ({len(names)} drafter variants)"):
      results = [one(starts[0])]
    bar = tqdm(total=len(starts), initial=1, desc="held-out TV", unit="batch", dynamic_ncols=True)
  else:
    results = [one(starts[0])]
  for start in starts[1:]:
    results.append(one(start))
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  for sums, c in results:
    totals += sums
    counts += c
  out = {}
  for i, name in enumerate(names):
    out[name] = {"tv": float(totals[i].sum() / max(counts.sum(), 1.0)),
                 "by_offset": [float(s / c) if c else None for s, c in zip(totals[i], counts)]}
  return out
