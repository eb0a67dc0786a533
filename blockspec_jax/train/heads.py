"""Training BPD heads (:mod:`blockspec_jax.drafters.heads`) on a frozen target: data, loss, evaluation, storage.

Data (:func:`collect_hidden`): the target continues every prompt at ``T`` (default 1; ``distill.sample_sequences``,
prompt ``r``'s key ``fold_in(key, r)``), then one causal pass over prompt + continuation gives its final-norm hidden
states (the LM head's input). The positions kept are ``t = prompt_len − 2 .. prompt_len + n − 3`` (``n`` generated
tokens): the first is the state the drafter reads after the prefill (``Commit.last_states``), and head ``j`` at
``t`` is trained on the token at ``t + 2 + j`` (:func:`head_labels`; ``−1`` past the sequence's end). Everything is
numpy, cached by the job in the work directory (:func:`save_hidden` / :func:`load_hidden`, with the frozen LM head
in ``lm_head.npy``: :func:`save_lm_head`), so a resume loads no model::

    data = collect_hidden(target_config, target_params, tokens_BxP, prompt_len_B, max_new_tokens=64,
                          temperature=1.0, key=key, batch_size=4)
    labels_MxH = head_labels(data, num_heads=8)

Loss (:class:`HeadsLoss`, for :func:`trainer.fit`; the LM head in ``frozen``): the mean over heads ``j`` of head
``j``'s mean cross-entropy (T = 1, full vocabulary) on its valid labels, teacher-forced on the target's text.
:func:`train_heads` runs it; :func:`evaluate_heads` gives per-head top-1 accuracy and cross-entropy (and, with an
n-gram LM, the top-1 accuracy of locally rescored candidates given the true text); :func:`save_heads` /
:func:`load_heads` store the trained heads (``heads.npz`` + ``heads.json`` with its SHA-256).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import artifacts, parallel, runtime, sampling
from blockspec_jax.drafters import heads as heads_lib
from blockspec_jax.drafters.heads import HEADS_JSON, HEADS_NPZ, load_heads, save_heads
from blockspec_jax.drafters import lattice
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, pools, trainer

__all__ = ["HIDDEN_FIELDS", "HEADS_JSON", "HEADS_NPZ", "LM_HEAD_NPY", "collect_hidden", "head_labels",
           "save_hidden", "load_hidden", "save_lm_head", "load_lm_head", "lm_head_config", "HeadsLoss", "train_heads",
           "evaluate_heads", "HEAD_SUMS", "head_figures", "text_contexts", "ngram_heldout_nll", "build_text_ngram",
           "save_heads", "load_heads"]

HIDDEN_FIELDS = ("features_MxD", "seq_M", "position_M", "tokens_NxT", "length_N", "prompt_len_N", "row_N")
LM_HEAD_NPY = "lm_head.npy"


def lm_head_config(vocab_size: int, d_model: int) -> decoder_lib.DecoderConfig:
  """A DecoderConfig for :func:`~blockspec_jax.drafters.heads.heads_logits` with the target's LM head given as an
  untied f32 ``[V, D]`` weight (``lm_head.npy``): the only part of the target that training and evaluation read, so
  they run without loading it. Its layer fields are placeholders (no decoder is ever built from it)."""
  return decoder_lib.DecoderConfig(vocab_size=int(vocab_size), d_model=int(d_model), num_layers=1, num_heads=1,
                                   num_kv_heads=1, head_dim=2, ffn_dim=1, tie_embeddings=False, matmul="xla")


def _xla(config: decoder_lib.DecoderConfig) -> decoder_lib.DecoderConfig:
  """The config with XLA's dot for every linear layer: training passes are wide (many rows per call)."""
  return dataclasses.replace(config, matmul="xla")


# --- data -------------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("config",))
def _hidden_pass(params, tokens_BxT, positions_BxN, *, config):
  """f32 ``[B, N, D]``: the final-norm hidden states at ``positions_BxN`` of one causal pass (the LM head's logits
  are computed by ``sequence_logits`` but unused, so XLA drops them)."""
  _, hidden_BxNxD = distill.sequence_logits(config, params, tokens_BxT, positions_BxN, return_hidden=True)
  return hidden_BxNxD.astype(jnp.float32)


def collect_hidden(target_config: decoder_lib.DecoderConfig, target_params, tokens_BxP, prompt_len_B, *,
                   max_new_tokens: int, temperature: float = 1.0, key: jax.Array, batch_size: int,
                   progress: bool = True, rows=None, stop_ids: tuple[int, ...] = (), pad_id: int = 0,
                   mesh=None) -> dict:
  """The heads' training data for prompts ``tokens_BxP`` (int32 [B, P], right-padded; lengths ``prompt_len_B``),
  ``batch_size`` prompts at a time (the last batch wraps around; its repeated rows are dropped).

  ``rows`` (distinct ids, default ``arange(B)``): prompt ``r``'s continuation uses ``fold_in(key, r)``.
  ``mesh`` (``parallel.make_mesh``): the continuations and the hidden-state pass with each batch's rows over its
  ``data`` axis (``parallel.autoregressive_rows`` / ``parallel.map_rows``): the same tokens as one device.
  Returns numpy arrays: per kept position ``m`` (see the module docstring) ``features_MxD`` f32 (the target's hidden
  state), ``seq_M`` int64 (its sequence), ``position_M`` int32 (``t``); per sequence ``tokens_NxT`` int32 (prompt +
  continuation, ``pad_id`` after), ``length_N`` int32 (valid tokens), ``prompt_len_N`` int32, ``row_N`` int64 (the
  prompt's id).
  """
  sampling.Sampler(temperature)  # validates it
  tokens_BxP, prompt_len_B, rows, width = pools.check_collection(
      tokens_BxP, prompt_len_B, rows, max_new_tokens=max_new_tokens, batch_size=batch_size, configs=(target_config,))
  num = tokens_BxP.shape[0]
  pass_config = _xla(target_config)
  tokens_NxT = np.zeros((num, width), np.int32)
  length_N = np.zeros((num,), np.int32)
  feats, seqs, positions = [], [], []
  batches = pools.wrapped_batches(num, batch_size, progress=progress, desc="target samples + hidden states")
  for i, flat_B, local_B in batches:
    keys_B = distill._row_keys(key, rows[local_B])
    sample = lambda: distill.sample_sequences(target_config, target_params, tokens_BxP[local_B],
                                              prompt_len_B[local_B], keys_B, max_new_tokens=max_new_tokens,
                                              temperature=temperature, stop_ids=tuple(stop_ids), pad_id=pad_id,
                                              mesh=mesh)
    with runtime.compiling("target sampling", when=i == 0):
      seq_BxT, mask_BxT = sample()
    generated_B = mask_BxT.sum(axis=1).astype(np.int32)
    lens_B = prompt_len_B[local_B] + generated_B
    # t = P − 2 + i, i < max_new_tokens: head 0's label t + 2 is generated token i.
    t_BxN = prompt_len_B[local_B][:, None] - 2 + np.arange(max_new_tokens)[None, :]
    keep_BxN = (t_BxN >= 0) & (np.arange(max_new_tokens)[None, :] < generated_B[:, None]) & (flat_B < num)[:, None]
    run = lambda: parallel.map_rows(mesh, functools.partial(_hidden_pass, config=pass_config), (target_params,),
                                    seq_BxT, np.clip(t_BxN, 0, width - 1).astype(np.int32))
    with runtime.compiling("target hidden-state pass", when=i == 0):
      hidden_BxNxD = run()
    fresh_B = flat_B < num
    tokens_NxT[local_B[fresh_B]] = seq_BxT[fresh_B]
    length_N[local_B[fresh_B]] = lens_B[fresh_B]
    feats.append(hidden_BxNxD[keep_BxN])
    seqs.append(np.broadcast_to(local_B[:, None], keep_BxN.shape)[keep_BxN])
    positions.append(t_BxN[keep_BxN])
  d_model = target_config.d_model
  return {"features_MxD": np.concatenate(feats).astype(np.float32) if feats else np.zeros((0, d_model), np.float32),
          "seq_M": np.concatenate(seqs).astype(np.int64) if seqs else np.zeros((0,), np.int64),
          "position_M": np.concatenate(positions).astype(np.int32) if positions else np.zeros((0,), np.int32),
          "tokens_NxT": tokens_NxT, "length_N": length_N, "prompt_len_N": prompt_len_B.copy(), "row_N": rows}


def head_labels(data: dict, num_heads: int) -> np.ndarray:
  """int32 ``[M, H]``: head ``j``'s label at kept position ``m`` = the token at ``position_M[m] + 2 + j`` of its
  sequence, ``−1`` where that lies past the sequence's last token."""
  pools.check_int(num_heads, "num_heads")
  seq_M, t_M = np.asarray(data["seq_M"]), np.asarray(data["position_M"])
  tokens_NxT, length_N = np.asarray(data["tokens_NxT"]), np.asarray(data["length_N"])
  at_MxH = t_M[:, None] + 2 + np.arange(num_heads)[None, :]
  valid_MxH = at_MxH < length_N[seq_M][:, None]
  picked_MxH = tokens_NxT[seq_M[:, None], np.minimum(at_MxH, tokens_NxT.shape[1] - 1)]
  return np.where(valid_MxH, picked_MxH, -1).astype(np.int32)


def save_hidden(path, data: dict, meta: dict) -> pathlib.Path:
  """Write :func:`collect_hidden`'s arrays and ``meta`` (JSON-able: how they were collected) to ``path`` (.npz),
  atomically."""
  return artifacts.save_tagged(path, {k: data[k] for k in HIDDEN_FIELDS if k in data}, meta, names=HIDDEN_FIELDS)


def load_hidden(path) -> tuple[dict, dict]:
  """``(data, meta)`` of a :func:`save_hidden` file; FileNotFoundError when absent, ValueError when unreadable or
  inconsistent."""
  data, meta = artifacts.load_tagged(path, HIDDEN_FIELDS, what="hidden-state",
                                     redo="delete it to collect the data again")
  m = data["features_MxD"].shape[0]
  n = data["tokens_NxT"].shape[0]
  if data["features_MxD"].ndim != 2 or data["seq_M"].shape != (m,) or data["position_M"].shape != (m,) \
      or data["length_N"].shape != (n,) or data["prompt_len_N"].shape != (n,) or data["row_N"].shape != (n,) \
      or (m and (data["seq_M"].min() < 0 or data["seq_M"].max() >= n)):
    raise ValueError(f"{path} holds inconsistent arrays; delete it to collect the data again")
  return data, meta


def save_lm_head(workdir, weight_VxD) -> pathlib.Path:
  """The frozen LM head ``[V, D]`` as ``<workdir>/lm_head.npy`` (+ ``lm_head.json``: shape, dtype, SHA-256), so a
  resumed training run needs no model. Written atomically."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  weight = np.asarray(jax.device_get(weight_VxD), np.float32)
  buffer = io.BytesIO()
  np.save(buffer, weight, allow_pickle=False)
  data = buffer.getvalue()
  artifacts.atomic_write(workdir / LM_HEAD_NPY, data)
  record = {"shape": list(weight.shape), "sha256": hashlib.sha256(data).hexdigest()}
  artifacts.atomic_write(workdir / "lm_head.json", (json.dumps(record) + "\n").encode())
  return workdir / LM_HEAD_NPY


def load_lm_head(workdir):
  """The LM head saved by :func:`save_lm_head` (f32 numpy ``[V, D]``); None when absent, ValueError when corrupted."""
  workdir = pathlib.Path(workdir)
  path, record_path = workdir / LM_HEAD_NPY, workdir / "lm_head.json"
  if not (path.is_file() and record_path.is_file()):
    return None
  data = path.read_bytes()
  try:
    record = json.loads(record_path.read_text())
    ok = hashlib.sha256(data).hexdigest() == record["sha256"]
    weight = np.load(io.BytesIO(data), allow_pickle=False) if ok else None
  except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
    raise ValueError(f"{path} is corrupted ({type(e).__name__}: {e}); delete it and rerun") from None
  if not ok or list(weight.shape) != record["shape"]:
    raise ValueError(f"{path} is corrupted (SHA-256 or shape differs from {record_path}); delete it and rerun")
  return weight


# --- loss and training ------------------------------------------------------------------------------------------------

def _head_ce(logits_BxHxV, labels_BxH):
  """``(ce_BxH, top1_BxH, valid_BxH)``: cross-entropy and top-1 hit at each label (0 where the label is −1)."""
  valid_BxH = labels_BxH >= 0
  safe_BxH = jnp.maximum(labels_BxH, 0)
  logz_BxH = jax.nn.logsumexp(logits_BxHxV, axis=-1)
  picked_BxH = jnp.take_along_axis(logits_BxHxV, safe_BxH[..., None], axis=-1)[..., 0]
  ce_BxH = jnp.where(valid_BxH, logz_BxH - picked_BxH, 0.0)
  top1_BxH = jnp.where(valid_BxH, jnp.argmax(logits_BxHxV, axis=-1) == safe_BxH, False)
  return ce_BxH, top1_BxH, valid_BxH


@dataclasses.dataclass(frozen=True)
class HeadsLoss:
  """``(heads, frozen, batch, key) -> (loss, aux)`` for :func:`trainer.fit`.

  ``frozen = {"lm_head": [V, D]}``; ``batch = {"features_BxD": f32 [B, D], "labels_BxH": int32 [B, H] (−1 = none)}``.
  Loss: the mean over heads (those with a label in the batch) of each head's mean cross-entropy. aux: ``top1``
  (mean over heads of each head's top-1 accuracy) and ``ce_h{j}`` / ``top1_h{j}`` per head.
  """
  target: decoder_lib.DecoderConfig
  num_heads: int

  def __call__(self, heads, frozen, batch, key):
    del key  # deterministic given the batch
    params = {"heads": heads, "lm_head": frozen["lm_head"]}
    logits_BxHxV = heads_lib.heads_logits(params, _xla(self.target), batch["features_BxD"], self.num_heads)
    ce_BxH, top1_BxH, valid_BxH = _head_ce(logits_BxHxV, batch["labels_BxH"])
    count_H = jnp.sum(valid_BxH, axis=0).astype(jnp.float32)
    has_H = count_H > 0
    ce_H = jnp.sum(ce_BxH, axis=0) / jnp.maximum(count_H, 1.0)
    acc_H = jnp.sum(top1_BxH, axis=0) / jnp.maximum(count_H, 1.0)
    heads_with_labels = jnp.maximum(jnp.sum(has_H), 1)
    loss = jnp.sum(jnp.where(has_H, ce_H, 0.0)) / heads_with_labels
    aux = {"top1": jnp.sum(jnp.where(has_H, acc_H, 0.0)) / heads_with_labels}
    for j in range(self.num_heads):
      aux[f"ce_h{j}"], aux[f"top1_h{j}"] = ce_H[j], acc_H[j]
    return loss, aux


def _check_data(features_MxD, labels_MxH, name: str):
  features_MxD, labels_MxH = np.asarray(features_MxD, np.float32), np.asarray(labels_MxH, np.int32)
  if features_MxD.ndim != 2 or labels_MxH.ndim != 2 or labels_MxH.shape[0] != features_MxD.shape[0]:
    raise ValueError(f"{name}: need features [M, D] and labels [M, H], got {features_MxD.shape} and "
                     f"{labels_MxH.shape}")
  if features_MxD.shape[0] == 0:
    raise ValueError(f"{name}: no positions")
  if not np.all(np.isfinite(features_MxD)):
    raise ValueError(f"{name}: features hold NaN or infinite values")
  return features_MxD, labels_MxH


def train_heads(features_MxD, labels_MxH, lm_head_VxD, *, target_config: decoder_lib.DecoderConfig, workdir,
                loop: trainer.Loop, batch_size: int, learning_rate: float = 1e-3, seed: int = 0, heldout=None,
                optimizer=None):
  """Train ``H = labels_MxH.shape[1]`` heads with :func:`trainer.fit_examples` in ``workdir`` (``checkpoints/``,
  ``metrics.jsonl``, ``loss.png``; resumed from its newest checkpoint). Returns ``(heads, fit_result)``.

  Step ``s`` reads positions ``trainer.batch_indices(M, batch_size, seed, s)``. The heads start at
  :func:`~blockspec_jax.drafters.heads.init_heads` (key ``fold_in(key(seed), 1)``). ``optimizer``: default
  ``trainer.make_optimizer("adamw", learning_rate, "cosine", total_steps=loop.num_steps)``. ``heldout = (features,
  labels)`` with ``loop.eval_every > 0``: ``eval_heldout_ce`` / ``eval_heldout_top1`` every ``eval_every`` steps and
  after the last. ``loop``: the steps, checkpoints, output and mesh (:class:`trainer.Loop`; with a mesh,
  ``batch_size`` must be a multiple of its data axis).
  """
  features_MxD, labels_MxH = _check_data(features_MxD, labels_MxH, "training set")
  d_model = features_MxD.shape[1]
  num_heads = labels_MxH.shape[1]
  pools.check_int(batch_size, "batch_size")
  lm_head_VxD = jnp.asarray(lm_head_VxD, jnp.float32)
  if lm_head_VxD.shape != (target_config.vocab_size, d_model):
    raise ValueError(f"the LM head must be [V = {target_config.vocab_size}, D = {d_model}], got {lm_head_VxD.shape}")
  if labels_MxH.max() >= target_config.vocab_size:
    raise ValueError(f"labels hold ids >= V = {target_config.vocab_size}")
  heads0 = heads_lib.init_heads(d_model, num_heads, jax.random.fold_in(jax.random.key(seed), 1))
  eval_fn = None
  if heldout is not None and loop.eval_every:
    held_MxD, held_MxH = _check_data(*heldout, "held-out set")

    def heldout_eval(step, trainable):
      del step
      report = evaluate_heads(trainable, lm_head_VxD, target_config, held_MxD, held_MxH)
      return {"heldout_ce": report["ce"], "heldout_top1": report["top1"]}

    eval_fn = heldout_eval

  result = trainer.fit_examples({"features_BxD": features_MxD, "labels_BxH": labels_MxH}, batch_size=batch_size,
                                seed=seed, loop=loop, learning_rate=learning_rate, optimizer=optimizer,
                                loss_fn=HeadsLoss(target_config, num_heads), trainable=heads0,
                                frozen={"lm_head": lm_head_VxD}, workdir=workdir, eval_fn=eval_fn,
                                label="BPD heads train step")
  return result.state.trainable, result


# --- evaluation -------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("target", "num_heads", "top_k", "lm_weight"))
def _eval_chunk(heads, lm_head_VxD, features_BxD, labels_BxH, contexts_BxHxC, ngram, *, target, num_heads, top_k,
                lm_weight):
  logits_BxHxV = heads_lib.heads_logits({"heads": heads, "lm_head": lm_head_VxD}, _xla(target), features_BxD,
                                        num_heads)
  ce_BxH, top1_BxH, valid_BxH = _head_ce(logits_BxHxV, labels_BxH)
  sums = {"ce_H": jnp.sum(ce_BxH, axis=0), "top1_H": jnp.sum(top1_BxH, axis=0).astype(jnp.float32),
          "count_H": jnp.sum(valid_BxH, axis=0).astype(jnp.float32)}
  if ngram is not None:  # local rescoring with the true text as context: is the rescored best the label?
    cand_BxHxK, logp_BxHxK = lattice.lattice_candidates(logits_BxHxV, top_k)
    context_BxHxKxC = jnp.broadcast_to(contexts_BxHxC[:, :, None, :], cand_BxHxK.shape + contexts_BxHxC.shape[-1:])
    score_BxHxK = logp_BxHxK + jnp.float32(lm_weight) * lattice.ngram_logprob(ngram, context_BxHxKxC, cand_BxHxK)
    best_BxH = jnp.take_along_axis(cand_BxHxK, jnp.argmax(score_BxHxK, axis=-1)[..., None], axis=-1)[..., 0]
    sums["top1_rescored_H"] = jnp.sum(valid_BxH & (best_BxH == labels_BxH), axis=0).astype(jnp.float32)
    sums["in_topk_H"] = jnp.sum(valid_BxH & jnp.any(cand_BxHxK == labels_BxH[..., None], axis=-1),
                                axis=0).astype(jnp.float32)
  return sums


def text_contexts(data: dict, num_heads: int, width: int, bos: int) -> np.ndarray:
  """int32 ``[M, H, width]``: the ``width`` true tokens before head ``j``'s label (``bos`` before position 0)."""
  seq_M, t_M, tokens_NxT = np.asarray(data["seq_M"]), np.asarray(data["position_M"]), np.asarray(data["tokens_NxT"])
  at_MxHxC = (t_M[:, None, None] + 2 + np.arange(num_heads)[None, :, None] - width
              + np.arange(width)[None, None, :])
  picked = tokens_NxT[seq_M[:, None, None], np.clip(at_MxHxC, 0, tokens_NxT.shape[1] - 1)]
  return np.where(at_MxHxC >= 0, picked, bos).astype(np.int32)


def evaluate_heads(heads, lm_head_VxD, target_config: decoder_lib.DecoderConfig, features_MxD, labels_MxH, *,
                   chunk: int = 64, ngram: lattice.NGramLM | None = None, contexts_MxHxC=None, top_k: int = 16,
                   lm_weight: float = 1.0, progress: bool = False) -> dict:
  """Per-head top-1 accuracy and cross-entropy of ``heads`` on labelled positions (``chunk`` at a time, the last one
  padded with label −1: one compiled program). Returns floats: ``ce`` / ``top1`` (means over heads),
  ``ce_per_head``, ``top1_per_head``, ``num_per_head``. With ``ngram`` and ``contexts_MxHxC`` (the true text before
  each label, :func:`text_contexts`): ``in_topk_per_head`` (the label is among the ``top_k`` candidates) and
  ``top1_rescored_per_head`` (it is the best candidate under ``log q + λ log P_ngram``). ``progress``: a progress
  bar over the chunks and the first (compiling) call announced."""
  features_MxD, labels_MxH = _check_data(features_MxD, labels_MxH, "evaluation set")
  num, num_heads = labels_MxH.shape
  pools.check_int(chunk, "chunk")
  lm_head_VxD = jnp.asarray(lm_head_VxD, jnp.float32)
  if ngram is not None and (contexts_MxHxC is None or np.shape(contexts_MxHxC)[:2] != (num, num_heads)):
    raise ValueError(f"rescored evaluation needs contexts [M = {num}, H = {num_heads}, n − 1] (text_contexts), got "
                     f"{None if contexts_MxHxC is None else np.shape(contexts_MxHxC)}")
  totals: dict[str, np.ndarray] = {}
  starts = range(0, num, chunk)
  if progress:
    from tqdm import tqdm
    starts = tqdm(starts, desc="held-out evaluation", unit="chunk", dynamic_ncols=True, leave=False)
  for i, start in enumerate(starts):
    idx = np.arange(start, start + chunk)
    real = idx < num
    idx = np.minimum(idx, num - 1)
    labels = np.where(real[:, None], labels_MxH[idx], -1)
    contexts = None if ngram is None else jnp.asarray(np.asarray(contexts_MxHxC)[idx])
    run = lambda: jax.device_get(_eval_chunk(heads, lm_head_VxD, jnp.asarray(features_MxD[idx]), jnp.asarray(labels),
                                             contexts, ngram, target=target_config, num_heads=num_heads,
                                             top_k=int(top_k), lm_weight=float(lm_weight)))
    with runtime.compiling("held-out evaluation", when=i == 0 and progress):
      sums = run()
    for name, value in sums.items():
      totals[name] = totals.get(name, 0.0) + np.asarray(value, np.float64)
  return head_figures(totals)


#: The sums :func:`evaluate_heads` adds over positions (per head ``H``) and the per-head means it divides them into.
HEAD_SUMS = {"ce_H": "ce_per_head", "top1_H": "top1_per_head", "in_topk_H": "in_topk_per_head",
             "top1_rescored_H": "top1_rescored_per_head"}


def head_figures(totals: dict) -> dict:
  """:func:`evaluate_heads`' result from its sums over positions: ``count_H`` (labelled positions per head) and those
  of :data:`HEAD_SUMS` it has. Each per-head sum divided by the head's positions; ``ce`` / ``top1`` /
  ``top1_rescored``: their means over the heads that have positions. Sums of disjoint sets of positions add, so
  this also scores their union."""
  count_H = np.asarray(totals["count_H"], np.float64)
  has_H = count_H > 0
  out = {"num_per_head": count_H.astype(int).tolist()}
  for name, per_head in HEAD_SUMS.items():
    if name in totals:
      out[per_head] = (np.asarray(totals[name], np.float64) / np.maximum(count_H, 1.0)).tolist()
  for name, per_head in (("ce", "ce_per_head"), ("top1", "top1_per_head"), ("top1_rescored", "top1_rescored_per_head")):
    if per_head in out:
      out[name] = float(np.mean(np.asarray(out[per_head])[has_H]))
  return out


def build_text_ngram(data: dict, vocab_size: int, order: int = 3) -> lattice.NGramLM:
  """The n-gram LM of the training text: every sequence's valid tokens (prompt + the target's continuation)."""
  sequences = [np.asarray(data["tokens_NxT"][i, :int(data["length_N"][i])]) for i in range(len(data["length_N"]))]
  return lattice.build_ngram(sequences, vocab_size, order)


def ngram_heldout_nll(lm: lattice.NGramLM, data: dict, chunk: int = 4096) -> float:
  """Mean ``−log P_ngram`` (nats) of the generated tokens of ``data``'s sequences given the text before them."""
  n = lm.order
  contexts, tokens = [], []
  for i in range(len(data["length_N"])):
    seq = np.asarray(data["tokens_NxT"][i, :int(data["length_N"][i])])
    padded = np.concatenate([np.full((n - 1,), lm.bos, np.int64), seq])
    for t in range(int(data["prompt_len_N"][i]), len(seq)):
      contexts.append(padded[t:t + n - 1])
      tokens.append(seq[t])
  if not tokens:
    raise ValueError("no generated tokens to score")
  contexts_NxC, tokens_N = np.asarray(contexts, np.int32).reshape(len(tokens), n - 1), np.asarray(tokens, np.int32)
  fn = jax.jit(lattice.ngram_logprob)
  total = 0.0
  for start in range(0, len(tokens_N), chunk):
    idx = np.minimum(np.arange(start, start + chunk), len(tokens_N) - 1)
    logp = np.asarray(fn(lm, jnp.asarray(contexts_NxC[idx]), jnp.asarray(tokens_N[idx])), np.float64)
    total += float(np.sum(logp[:min(chunk, len(tokens_N) - start)]))
  return -total / len(tokens_N)
