"""SPRINTER's verifier head (Zhong et al., arXiv 2502.04557): labels, training, evaluation, storage.

The head (:mod:`blockspec_jax.drafters.sprinter`) is ``sigmoid(h · w_D + b)`` on the drafter's final-norm hidden
state ``h`` at the position that PRODUCED a drafted token ``x``. For the drafter's law ``q`` and the target's law
``p`` at a context ``c`` (both after the sampling transform at the decoding temperature ``T``) the label is::

    y = 1[q(x | c) ≤ p(x | c)]        (speculative sampling accepts x with probability min(1, p/q) = 1)

Pipeline (the job is ``sprinter_job`` in :mod:`blockspec_jax.train.sprinter_job`)::

    data = collect_labels(target_config, target_params, drafter_config, drafter_params, tokens_BxP, prompt_len_B,
                          max_new_tokens=64, temperature=1.0, key=key, batch_size=4)
    head, fit_result = train_head(data["features_NxD"], data["labels_N"], workdir=...,
                                  loop=trainer.Loop(num_steps=400), batch_size=256, learning_rate=1e-2, seed=0,
                                  heldout=(features, labels))
    rows = head_report(head, heldout_features_NxD, heldout_labels_N, thresholds=(0.3, 0.5, 0.7, 0.9))
    save_head(workdir, head, {"drafter": ..., "target": ..., "temperature": 1.0, "report_heldout": rows})
    head, info = load_head(workdir, d_model=896)

Data are on-policy: the continuations are sampled from the drafter at ``T`` (:func:`distill.sample_sequences`, row
``r``'s key ``fold_in(key, r)``), the contexts the head meets at decode time; then one causal pass of each model over
prompt + continuation, the LM heads on the generated window only (:func:`distill.sequence_logits` with
:func:`distill.loss_window`), the drafter's pass also giving its hidden states there. A sequence with ``x`` at index
``t`` gives the feature ``hidden[t − 1]`` and ``q``/``p`` from the logits at ``t − 1``. Only generated tokens are
labelled (each row up to its end: ``max_new_tokens`` or its stop token, which is labelled).

Training (:func:`train_head`) standardises the features with the training set's per-dimension mean and standard
deviation (an optimisation aid: the final-norm outputs of real models have a few dimensions hundreds of times larger
than the rest), and FOLDS that affine map into ``w`` and ``b`` before returning the head
(:func:`fold_standardization`), so ``head_probs(head, raw_hidden)`` is all decoding needs; checkpoints hold the
standardised-space head, from which the folded one is recomputed exactly on a resume.
"""

from __future__ import annotations

import functools
import math
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import artifacts, parallel, runtime, sampling
from blockspec_jax.drafters.sprinter import HEAD_JSON, HEAD_NPZ, head_logits, head_probs, init_head, load_head, save_head
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, pools, trainer
from blockspec_jax.train.trainer import batch_indices

__all__ = ["LABEL_FIELDS", "LABEL_SETS", "REPORT_FIELDS", "HEAD_JSON", "HEAD_NPZ", "collect_labels",
           "collect_official_labels", "save_labels",
           "load_labels", "head_loss", "standardization", "fold_standardization", "batch_indices", "train_head",
           "evaluate_head", "head_report", "save_head", "load_head"]

LABEL_FIELDS = ("features_NxD", "labels_N", "q_tok_N", "p_tok_N", "token_N", "row_N", "position_N")
REPORT_FIELDS = ("threshold", "accuracy", "eta_fp", "eta_fn", "accept_rate", "positive_rate", "num")


# --- labels ---------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("target", "drafter", "temperature"))
def _label_pass(target_params, drafter_params, tokens_BxT, positions_BxN, *, target, drafter, temperature):
  """``(hidden_BxNxD f32, q_tok_BxN f32, p_tok_BxN f32)``: the drafter's hidden state at each window position
  ``t − 1`` and both laws (after the temperature) at the token ``tokens[t]`` it predicts."""
  target_logits_BxNxV = distill.sequence_logits(target, target_params, tokens_BxT, positions_BxN)
  drafter_logits_BxNxV, hidden_BxNxD = distill.sequence_logits(drafter, drafter_params, tokens_BxT, positions_BxN,
                                                               return_hidden=True)
  next_BxN = jnp.take_along_axis(tokens_BxT, jnp.minimum(positions_BxN + 1, tokens_BxT.shape[1] - 1), axis=1)
  sampler = sampling.Sampler(temperature)
  q_tok_BxN = jnp.take_along_axis(sampler.probs(drafter_logits_BxNxV), next_BxN[:, :, None], axis=2)[:, :, 0]
  p_tok_BxN = jnp.take_along_axis(sampler.probs(target_logits_BxNxV), next_BxN[:, :, None], axis=2)[:, :, 0]
  return hidden_BxNxD.astype(jnp.float32), q_tok_BxN, p_tok_BxN


def collect_labels(target_config: decoder_lib.DecoderConfig, target_params, drafter_config: decoder_lib.DecoderConfig,
                   drafter_params, tokens_BxP, prompt_len_B, *, max_new_tokens: int, temperature: float,
                   key: jax.Array, batch_size: int, progress: bool = True, rows=None, stop_ids: tuple[int, ...] = (),
                   pad_id: int = 0, mesh=None) -> dict:
  """SPRINTER's training data from the drafter's own continuations of the prompts ``tokens_BxP`` (int32 [B, P],
  right-padded; lengths ``prompt_len_B``), processed ``batch_size`` prompts at a time (the last batch wraps around,
  its repeated rows dropped: one compiled program for every batch).

  ``rows`` (int [B], distinct; default ``arange(B)``): the prompts' ids, reported in ``row_N`` and keying the
  sampling (prompt ``r``'s continuation uses ``fold_in(key, r)``, so it does not depend on the batching).
  ``mesh`` (``parallel.make_mesh``): the continuations and the label pass with each batch's rows over its ``data``
  axis (``parallel.autoregressive_rows`` / ``parallel.map_rows``): the same tokens and labels as one device.

  Returns numpy arrays over the ``N`` generated tokens, in prompt order then position order:
  ``features_NxD`` f32 (the drafter's final-norm hidden state at ``t − 1``), ``labels_N`` int8
  (``1[q_tok ≤ p_tok]``), ``q_tok_N`` / ``p_tok_N`` f32 (drafter / target probability of the token at temperature
  ``temperature``), ``token_N`` int32 (the drafted token ``x``), ``row_N`` int64 (its prompt's id) and
  ``position_N`` int32 (``t``, the index of ``x`` in prompt + continuation: ``prompt_len`` for the first generated
  token).
  """
  distill.check_pair(target_config, drafter_config)
  sampling.Sampler(temperature)  # validates it (T = 0: greedy continuations, one-hot laws)
  tokens_BxP, prompt_len_B, rows, _ = pools.check_collection(
      tokens_BxP, prompt_len_B, rows, max_new_tokens=max_new_tokens, batch_size=batch_size,
      configs=(target_config, drafter_config))
  num = tokens_BxP.shape[0]
  chunks: dict[str, list] = {name: [] for name in LABEL_FIELDS}
  batches = pools.wrapped_batches(num, batch_size, progress=progress, desc="drafter samples + labels")
  for i, flat_B, local_B in batches:
    ids_B = rows[local_B]
    keys_B = distill._row_keys(key, ids_B)
    sample = lambda: distill.sample_sequences(drafter_config, drafter_params, tokens_BxP[local_B],
                                              prompt_len_B[local_B], keys_B, max_new_tokens=max_new_tokens,
                                              temperature=temperature, stop_ids=tuple(stop_ids), pad_id=pad_id,
                                              mesh=mesh)
    with runtime.compiling("drafter sampling", when=i == 0):
      tokens_BxT, mask_BxT = sample()
    positions_BxN, mask_BxN = distill.loss_window(mask_BxT, prompt_len_B[local_B], max_new_tokens)
    keep_BxN = (mask_BxN > 0) & (flat_B < num)[:, None]
    label_pass = functools.partial(_label_pass, target=target_config, drafter=drafter_config,
                                   temperature=float(temperature))
    score = lambda: parallel.map_rows(mesh, label_pass, (target_params, drafter_params), tokens_BxT, positions_BxN)
    with runtime.compiling("label pass (target and drafter)", when=i == 0):
      hidden_BxNxD, q_tok_BxN, p_tok_BxN = score()
    token_BxN = np.take_along_axis(tokens_BxT, np.minimum(positions_BxN + 1, tokens_BxT.shape[1] - 1), axis=1)
    chunks["features_NxD"].append(np.asarray(hidden_BxNxD, np.float32)[keep_BxN])
    chunks["q_tok_N"].append(np.asarray(q_tok_BxN, np.float32)[keep_BxN])
    chunks["p_tok_N"].append(np.asarray(p_tok_BxN, np.float32)[keep_BxN])
    chunks["token_N"].append(token_BxN.astype(np.int32)[keep_BxN])
    chunks["row_N"].append(np.broadcast_to(ids_B[:, None], keep_BxN.shape)[keep_BxN])
    chunks["position_N"].append((positions_BxN + 1).astype(np.int32)[keep_BxN])
  return _label_arrays(chunks, drafter_config.d_model)


def _label_arrays(chunks: dict, d_model: int) -> dict:
  """The collected per-batch chunks as :data:`LABEL_FIELDS` arrays, ``labels_N = 1[q_tok ≤ p_tok]``."""
  out = {}
  for name in LABEL_FIELDS:
    if name == "labels_N":
      continue
    if chunks[name]:
      out[name] = np.concatenate(chunks[name])
    else:
      out[name] = np.zeros((0, d_model) if name == "features_NxD" else (0,),
                           np.float32 if name in ("features_NxD", "q_tok_N", "p_tok_N") else np.int64)
  out["labels_N"] = (out["q_tok_N"] <= out["p_tok_N"]).astype(np.int8)
  out["row_N"] = out["row_N"].astype(np.int64)
  out["token_N"], out["position_N"] = out["token_N"].astype(np.int32), out["position_N"].astype(np.int32)
  return {name: out[name] for name in LABEL_FIELDS}


#: The label sets :func:`collect_labels` and :func:`collect_official_labels` make (``sprinter_job.labels``).
LABEL_SETS = ("sampled", "official")


@functools.partial(jax.jit, static_argnames=("target", "drafter", "max_new_tokens", "temperature", "stop_ids"))
def _official_pass(target_params, drafter_params, tokens_BxP, prompt_len_B, *, target, drafter, max_new_tokens: int,
                   temperature: float, stop_ids: tuple[int, ...]):
  """One batch of the official labels (:func:`collect_official_labels`): both models decode side by side with their
  caches, ``max_new_tokens`` steps. Returns ``(hidden_BxNxD f32, q_tok_BxN, p_tok_BxN, token_BxN int32 (the
  drafter's greedy token), valid_BxN bool)``."""
  from blockspec_jax.drafters import ModelDrafter
  batch, width = tokens_BxP.shape
  max_len = width + max_new_tokens + 2
  models = (ModelDrafter(drafter), ModelDrafter(target))
  params = (drafter_params, target_params)
  sampler = sampling.Sampler(temperature)
  tokens_BxS = jnp.zeros((batch, max_len), jnp.int32).at[:, :width].set(tokens_BxP)
  begun = [m.begin(w, m.init_state(w, tokens_BxP, prompt_len_B, max_len), tokens_BxS, prompt_len_B, sampler)
           for m, w in zip(models, params)]
  rows_B = jnp.arange(batch)

  def step(carry, i):
    (d_state, q_BxV, hidden_BxD), (t_state, p_BxV, _), done_B = carry
    x_B = jnp.argmax(q_BxV, axis=-1).astype(jnp.int32)
    q_tok_B, p_tok_B = q_BxV[rows_B, x_B], p_BxV[rows_B, x_B]
    # The drafter's greedy token when it passes (label 1), else the target's greedy token: an SD-like trajectory.
    next_B = jnp.where(q_tok_B <= p_tok_B, x_B, jnp.argmax(p_BxV, axis=-1).astype(jnp.int32))
    position_B = prompt_len_B + i
    d_next = models[0].step(params[0], d_state, next_B, position_B, sampler)
    t_next = models[1].step(params[1], t_state, next_B, position_B, sampler)
    stopped_B = jnp.isin(next_B, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else jnp.zeros_like(done_B)
    out = (hidden_BxD.astype(jnp.float32), q_tok_B, p_tok_B, x_B, ~done_B)
    return (d_next, t_next, done_B | stopped_B), out

  _, (hidden_NxBxD, q_NxB, p_NxB, x_NxB, valid_NxB) = jax.lax.scan(
      step, (begun[0], begun[1], jnp.zeros((batch,), bool)), jnp.arange(max_new_tokens))
  swap = lambda a: jnp.swapaxes(a, 0, 1)
  return swap(hidden_NxBxD), swap(q_NxB), swap(p_NxB), swap(x_NxB), swap(valid_NxB)


def collect_official_labels(target_config: decoder_lib.DecoderConfig, target_params,
                            drafter_config: decoder_lib.DecoderConfig, drafter_params, tokens_BxP, prompt_len_B, *,
                            max_new_tokens: int, batch_size: int, temperature: float = 1.0, progress: bool = True,
                            rows=None, stop_ids: tuple[int, ...] = (), mesh=None) -> dict:
  """SPRINTER's labels as the paper's official code collects them, beside :func:`collect_labels`' (ours): at each
  step the drafter's GREEDY token ``x`` gets ``q(x)``, ``p(x)`` (both at ``temperature``, 1 in the paper, over the
  full vocabulary) and the label ``1[q(x) ≤ p(x)]``, and the context continues with ``x`` when the label is 1, else
  with the target's greedy token: a trajectory as speculative decoding would commit it, so each label is about the
  token the head's state is followed by, not a sample the head never sees. Deterministic (no key).

  Same inputs (``rows``: the prompts' ids) and the same output fields as :func:`collect_labels` (``token_N``: the
  drafter's greedy ``x``; ``position_N``: its index in prompt + continuation), ``batch_size`` prompts at a time (the
  last batch wraps around, its repeated rows dropped); a stop token ends a row after it. ``mesh``: each batch's rows
  over its ``data`` axis (``parallel.map_rows``)."""
  distill.check_pair(target_config, drafter_config)
  sampling.Sampler(temperature)
  tokens_BxP, prompt_len_B, rows, _ = pools.check_collection(
      tokens_BxP, prompt_len_B, rows, max_new_tokens=max_new_tokens, batch_size=batch_size,
      configs=(target_config, drafter_config))
  num = tokens_BxP.shape[0]
  chunks: dict[str, list] = {name: [] for name in LABEL_FIELDS}
  run = functools.partial(_official_pass, target=target_config, drafter=drafter_config,
                          max_new_tokens=max_new_tokens, temperature=float(temperature), stop_ids=tuple(stop_ids))
  batches = pools.wrapped_batches(num, batch_size, progress=progress,
                                  desc="official labels (drafter and target greedy)")
  for i, flat_B, local_B in batches:
    with runtime.compiling("official label pass (both models, side by side)", when=i == 0):
      hidden_BxNxD, q_tok_BxN, p_tok_BxN, token_BxN, valid_BxN = parallel.map_rows(
          mesh, run, (target_params, drafter_params), tokens_BxP[local_B], prompt_len_B[local_B])
    keep_BxN = valid_BxN & (flat_B < num)[:, None]
    chunks["features_NxD"].append(np.asarray(hidden_BxNxD, np.float32)[keep_BxN])
    chunks["q_tok_N"].append(np.asarray(q_tok_BxN, np.float32)[keep_BxN])
    chunks["p_tok_N"].append(np.asarray(p_tok_BxN, np.float32)[keep_BxN])
    chunks["token_N"].append(np.asarray(token_BxN, np.int32)[keep_BxN])
    chunks["row_N"].append(np.broadcast_to(rows[local_B][:, None], keep_BxN.shape)[keep_BxN])
    positions_BxN = prompt_len_B[local_B][:, None] + np.arange(max_new_tokens)[None, :]
    chunks["position_N"].append(positions_BxN.astype(np.int32)[keep_BxN])
  return _label_arrays(chunks, drafter_config.d_model)


def save_labels(path, data: dict, meta: dict) -> pathlib.Path:
  """Write :func:`collect_labels`' arrays and ``meta`` (a JSON-able dict: how they were collected) to ``path`` (an
  ``.npz``), atomically (a temporary file renamed over it: a killed writer leaves no truncated file)."""
  return artifacts.save_tagged(path, {k: data[k] for k in LABEL_FIELDS if k in data}, meta, names=LABEL_FIELDS)


def load_labels(path) -> tuple[dict, dict]:
  """``(data, meta)`` of a :func:`save_labels` file; FileNotFoundError when absent, ValueError when unreadable."""
  return artifacts.load_tagged(path, LABEL_FIELDS, what="labels", redo="delete it to collect the labels again")


# --- training -------------------------------------------------------------------------------------------------------

def head_loss(head, frozen, batch, key):
  """``(loss f32 [], aux)`` for :func:`trainer.fit`: the mean binary cross-entropy with logits of ``head`` on
  ``batch = {"features_BxD": f32 [B, D], "labels_B": [B] (0/1)}``.

  ``frozen`` (may be ``{}``): ``mean_D`` / ``inv_scale_D`` standardise the features first (``(h − mean) ·
  inv_scale``; the head then lives in standardised space, see :func:`fold_standardization`); ``pos_weight`` (f32 [])
  multiplies the positive examples' terms, ``−[pw·y·log σ(z) + (1 − y)·log(1 − σ(z))]`` (as torch's
  ``BCEWithLogitsLoss(pos_weight=…)``): > 1 when labels 1 are rare and the head should flag less, < 1 to make it
  accept less (fewer false positives, the errors that cost SPRINTER quality). The decision threshold is chosen
  afterwards from :func:`head_report`, which usually makes re-weighting unnecessary. aux: ``accuracy`` (at
  probability 0.5), ``positive_rate`` and ``mean_prob`` of the batch.
  """
  del key  # deterministic given the batch
  features_BxD = batch["features_BxD"].astype(jnp.float32)
  labels_B = batch["labels_B"].astype(jnp.float32)
  if "mean_D" in frozen:
    features_BxD = (features_BxD - frozen["mean_D"][None, :]) * frozen["inv_scale_D"][None, :]
  logits_B = head_logits(head, features_BxD)
  pos_weight = frozen.get("pos_weight", jnp.float32(1.0))
  loss_B = -(pos_weight * labels_B * jax.nn.log_sigmoid(logits_B) + (1.0 - labels_B) * jax.nn.log_sigmoid(-logits_B))
  aux = {"accuracy": jnp.mean(((logits_B >= 0.0) == (labels_B > 0.5)).astype(jnp.float32)),
         "positive_rate": jnp.mean(labels_B), "mean_prob": jnp.mean(jax.nn.sigmoid(logits_B))}
  return jnp.mean(loss_B), aux


def standardization(features_NxD) -> tuple[np.ndarray, np.ndarray]:
  """``(mean_D, inv_scale_D)`` f32 of the features (computed in float64): ``1 / std`` per dimension, 1 where a
  dimension is (numerically) constant."""
  features_NxD = np.asarray(features_NxD, np.float64)
  mean_D = features_NxD.mean(axis=0)
  std_D = features_NxD.std(axis=0)
  floor = 1e-6 * max(float(np.max(std_D, initial=0.0)), 1e-30)
  inv_scale_D = np.where(std_D > floor, 1.0 / np.maximum(std_D, floor), 1.0)
  return mean_D.astype(np.float32), inv_scale_D.astype(np.float32)


def fold_standardization(head, mean_D, inv_scale_D):
  """The head on raw features equal to ``head`` on standardised ones: ``w · ((h − m) ⊙ s) + b = (w ⊙ s) · h +
  (b − (w ⊙ s) · m)``; computed in float64, returned as f32 ``{"w_D", "b"}``."""
  w_D = np.asarray(head["w_D"], np.float64) * np.asarray(inv_scale_D, np.float64)
  b = float(np.asarray(head["b"], np.float64)) - float(np.dot(w_D, np.asarray(mean_D, np.float64)))
  return {"w_D": jnp.asarray(w_D, jnp.float32), "b": jnp.asarray(b, jnp.float32)}


def _check_examples(features_NxD, labels_N, name: str) -> tuple[np.ndarray, np.ndarray]:
  features_NxD, labels_N = np.asarray(features_NxD, np.float32), np.asarray(labels_N)
  if features_NxD.ndim != 2 or labels_N.shape != features_NxD.shape[:1]:
    raise ValueError(f"{name}: need features [N, D] and labels [N], got {features_NxD.shape} and {labels_N.shape}")
  if features_NxD.shape[0] == 0:
    raise ValueError(f"{name}: no examples")
  if not np.all(np.isfinite(features_NxD)):
    raise ValueError(f"{name}: features hold NaN or infinite values")
  if not np.all((labels_N == 0) | (labels_N == 1)):
    raise ValueError(f"{name}: labels must be 0 or 1")
  return features_NxD, labels_N.astype(np.float32)


@jax.jit
def _eval_loss(head, frozen, features_NxD, labels_N):
  loss, aux = head_loss(head, frozen, {"features_BxD": features_NxD, "labels_B": labels_N}, None)
  return loss, aux["accuracy"]


def evaluate_head(head, features_NxD, labels_N) -> dict:
  """``{"bce", "accuracy"}`` of a (raw-feature) head on a labelled set: the mean binary cross-entropy and the
  accuracy at probability 0.5 (floats)."""
  features_NxD, labels_N = _check_examples(features_NxD, labels_N, "evaluation set")
  loss, accuracy = _eval_loss(head, {}, jnp.asarray(features_NxD), jnp.asarray(labels_N))
  return {"bce": float(loss), "accuracy": float(accuracy)}


def train_head(features_NxD, labels_N, *, workdir, loop: trainer.Loop, batch_size: int, learning_rate: float = 1e-2,
               seed: int = 0, heldout=None, optimizer=None, pos_weight: float | None = None, standardize: bool = True):
  """Train the head by :func:`trainer.fit_examples` in ``workdir`` (``checkpoints/``, ``metrics.jsonl``,
  ``loss.png``; resumed from its newest checkpoint). Returns ``(head, fit_result)``: ``head`` folded to raw features
  (f32 ``w_D`` [D], ``b`` []).

  ``features_NxD`` f32 [N, D], ``labels_N`` 0/1 [N]. Step ``s`` reads the examples :func:`batch_indices` ``(N,
  batch_size, seed, s)``. The head starts at ``w = 0`` and ``b = logit(positive rate)``. ``optimizer``: an optax
  transformation (the job passes gin's ``make_optimizer``); default ``trainer.make_optimizer("adamw",
  learning_rate, "cosine", total_steps=loop.num_steps)``. ``heldout = (features, labels)`` with ``loop.eval_every >
  0``: the held-out loss and accuracy (``eval_heldout_loss``, ``eval_heldout_accuracy``) every ``eval_every`` steps
  and after the last. ``standardize``: train on standardised features (:func:`standardization` of the training set)
  and fold the map into the returned head. ``pos_weight``: see :func:`head_loss`. ``loop``: the steps, checkpoints,
  output and mesh (:class:`trainer.Loop`; with a mesh, ``batch_size`` must be a multiple of its data axis).
  """
  features_NxD, labels_N = _check_examples(features_NxD, labels_N, "training set")
  d_model = features_NxD.shape[1]
  pools.check_int(batch_size, "batch_size")
  if pos_weight is not None and not (isinstance(pos_weight, (int, float)) and pos_weight > 0):
    raise ValueError(f"pos_weight must be a number > 0 (or None), got {pos_weight!r}")
  if standardize:
    mean_D, inv_scale_D = standardization(features_NxD)
  else:
    mean_D, inv_scale_D = np.zeros((d_model,), np.float32), np.ones((d_model,), np.float32)
  frozen = {"mean_D": jnp.asarray(mean_D), "inv_scale_D": jnp.asarray(inv_scale_D)}
  if pos_weight is not None:
    frozen["pos_weight"] = jnp.float32(pos_weight)
  rate = min(max(float(labels_N.mean()), 1e-4), 1.0 - 1e-4)
  head0 = init_head(d_model, bias=math.log(rate / (1.0 - rate)))
  eval_fn = None
  if heldout is not None and loop.eval_every:
    held_NxD, held_N = _check_examples(*heldout, "held-out set")
    if held_NxD.shape[1] != d_model:
      raise ValueError(f"held-out features have D = {held_NxD.shape[1]}, training features D = {d_model}")
    held_NxD, held_N = jnp.asarray(held_NxD), jnp.asarray(held_N)

    def eval_fn(step, trainable):
      loss, accuracy = _eval_loss(trainable, frozen, held_NxD, held_N)
      return {"heldout_loss": float(loss), "heldout_accuracy": float(accuracy)}

  result = trainer.fit_examples({"features_BxD": features_NxD, "labels_B": labels_N}, batch_size=batch_size, seed=seed,
                                loop=loop, learning_rate=learning_rate, optimizer=optimizer, loss_fn=head_loss,
                                trainable=head0, frozen=frozen, workdir=workdir, eval_fn=eval_fn,
                                label="SPRINTER head train step")
  return fold_standardization(result.state.trainable, mean_D, inv_scale_D), result


# --- evaluation -----------------------------------------------------------------------------------------------------

def _probs(head, features_NxD, chunk: int = 1 << 15) -> np.ndarray:
  features_NxD = np.asarray(features_NxD, np.float32)
  parts = [np.asarray(head_probs(head, jnp.asarray(features_NxD[i:i + chunk])))
           for i in range(0, features_NxD.shape[0], chunk)]
  return np.concatenate(parts) if parts else np.zeros((0,), np.float32)


def head_report(head, features_NxD, labels_N, thresholds: Sequence[float] = (0.3, 0.5, 0.7, 0.9)) -> list[dict]:
  """One row per threshold ``t`` (the head accepts a token when ``head_probs(head, h) ≥ t``), fields
  :data:`REPORT_FIELDS`: ``accuracy`` (accept = label), ``eta_fp`` = P(accept | label 0) (false positives: tokens
  emitted from ``q`` that speculative sampling might have rejected), ``eta_fn`` = P(flag | label 1) (target calls
  that were not needed), ``accept_rate`` = P(accept), ``positive_rate`` = P(label 1), ``num`` = N. A conditional rate
  whose class is empty is None."""
  labels_N = np.asarray(labels_N).astype(bool).reshape(-1)
  probs_N = _probs(head, features_NxD)
  if probs_N.shape != labels_N.shape:
    raise ValueError(f"{probs_N.shape[0]} feature rows but {labels_N.shape[0]} labels")
  num, pos = labels_N.size, int(labels_N.sum())
  neg = num - pos
  rows = []
  for t in thresholds:
    if isinstance(t, bool) or not isinstance(t, (int, float, np.floating)) or not t >= 0:
      raise ValueError(f"thresholds must be numbers >= 0, got {t!r}")
    accept_N = probs_N >= t
    rows.append({
        "threshold": float(t),
        "accuracy": float(np.mean(accept_N == labels_N)) if num else None,
        "eta_fp": float(np.sum(accept_N & ~labels_N) / neg) if neg else None,
        "eta_fn": float(np.sum(~accept_N & labels_N) / pos) if pos else None,
        "accept_rate": float(np.mean(accept_N)) if num else None,
        "positive_rate": pos / num if num else None,
        "num": int(num)})
  return rows
