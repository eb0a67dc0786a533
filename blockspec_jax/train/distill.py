"""DistillSpec (Zhou et al., ICLR 2024): distil a drafter toward a frozen target with token-level divergences.

The loss of a batch of sequences ``tokens_BxT`` (prompt + continuation, right-padded) is the mean over the
positions that predict a generated token (``mask_BxT``) of ``D(p_target‖q_drafter)``; teacher logits come from the
target on the fly (one causal forward per step, no cache on disk)::

    loss_fn = DistillLoss(target_config, drafter_config, divergence="fkl", temperature=1.0)
    loss, aux = loss_fn(trainable, {"target": target_params, "drafter": frozen_drafter_part}, batch, key)

Data (:class:`DistillData`, built by :func:`make_distill_data`):

* prompts are split into train / held-out by a fixed-seed numpy permutation (never Python's ``hash()``); held-out
  prompts are never used in training;
* ``"fixed"``: continuations sampled once from the target (``generate_autoregressive`` at the decoding temperature,
  row ``i``'s key ``fold_in(key, i)``), kept in memory and, with ``samples_path``, on disk for a resume;
* ``"on_policy"``: continuations sampled from the current drafter at each step;
* ``"mixed"``: each batch is on-policy with probability ``on_policy_fraction`` (λ), drawn from
  ``numpy.random.default_rng([seed, step])``, so a step's source is a pure function of the step.

The batch of step ``s`` is a pure function of ``s`` and the current drafter (epochs are fixed-seed permutations of
the training prompts), which makes :func:`blockspec_jax.train.trainer.fit`'s resume exact.

Sequence layout: row ``b`` holds ``prompt[:len_b] + generated[:n_b]`` then ``pad_id``; position ``t`` predicts
token ``t + 1``, so the mask is set on ``t ∈ [len_b − 1, len_b − 1 + n_b)``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import artifacts, sampling
from blockspec_jax.checks import check_int
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import divergences, params as params_lib

__all__ = ["SOURCES", "check_pair", "sequence_logits", "loss_window", "DistillLoss", "split_prompts", "random_prompts",
           "build_sequences", "sample_sequences", "DistillData", "make_distill_data", "make_batch_fn",
           "HeldoutTV", "heldout_tv_report", "heldout_tv"]

SOURCES = ("fixed", "on_policy", "mixed")
Assemble = Callable[[Any, Any], Any]  # (trainable, frozen drafter part) -> drafter params


def check_pair(target: decoder_lib.DecoderConfig, drafter: decoder_lib.DecoderConfig) -> None:
  """Distillation compares next-token laws row by row: the vocabularies must be the same."""
  if target.vocab_size != drafter.vocab_size:
    raise ValueError(f"target and drafter vocabularies differ: target vocab_size = {target.vocab_size}, drafter "
                     f"vocab_size = {drafter.vocab_size} (token-level distillation needs one vocabulary)")


def sequence_logits(config: decoder_lib.DecoderConfig, params, tokens_BxT: jax.Array,
                    positions_BxN: jax.Array | None = None, return_hidden: bool = False):
  """f32 [B, T, V]: a causal forward over whole sequences (positions 0..T−1, a fresh cache of T slots); with
  ``positions_BxN`` (int32 [B, N]), the logits at those positions only, f32 [B, N, V]: the LM head runs on the
  gathered final-norm outputs, so a [B, T, V] tensor is never formed (under jit the full head is dead code).

  ``return_hidden``: ``(logits, hidden)`` with the final-norm outputs (the LM head's input, the model's dtype) at
  the same positions, ``[B, T, D]`` or ``[B, N, D]`` (SPRINTER's verifier head reads them)."""
  batch, length = tokens_BxT.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))
  cache = decoder_lib.init_cache(config, batch, length)
  mask_BxTxS = decoder_lib.causal_mask(positions_BxT, length)
  if positions_BxN is None:
    out = decoder_lib.Decoder(config).apply({"params": params}, tokens_BxT, positions_BxT, cache, mask_BxTxS,
                                            return_hidden=return_hidden)
    return (out[0], out[2]) if return_hidden else out[0]
  _, _, hidden_BxTxD = decoder_lib.Decoder(config).apply({"params": params}, tokens_BxT, positions_BxT, cache,
                                                         mask_BxTxS, return_hidden=True)
  hidden_BxNxD = jnp.take_along_axis(hidden_BxTxD, positions_BxN[:, :, None].astype(jnp.int32), axis=1)
  logits_BxNxV = decoder_lib.head_logits(config, params, hidden_BxNxD)
  return (logits_BxNxV, hidden_BxNxD) if return_hidden else logits_BxNxV


def loss_window(mask_BxT: np.ndarray, prompt_len_B: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
  """Host-side: ``(positions_BxN int32, mask_BxN f32)``, the ``width`` positions from ``len_b − 1`` on (those that
  predict generated tokens, clipped to the sequence) and the mask there: the only rows a distillation loss reads."""
  mask_BxT, prompt_len_B = np.asarray(mask_BxT), np.asarray(prompt_len_B)
  length = mask_BxT.shape[1]
  positions_BxN = np.clip(prompt_len_B[:, None] - 1 + np.arange(width)[None, :], 0, length - 1).astype(np.int32)
  mask_BxN = np.take_along_axis(mask_BxT, positions_BxN, axis=1).astype(np.float32)
  inside = (prompt_len_B[:, None] - 1 + np.arange(width)[None, :]) < length
  return positions_BxN, mask_BxN * inside


@dataclasses.dataclass(frozen=True)
class DistillLoss:
  """``(trainable, frozen, batch, key) -> (loss, aux)`` for :mod:`blockspec_jax.train.trainer`.

  ``frozen = {"target": target_params, "drafter": the drafter's frozen part}`` and the drafter's parameters are
  ``assemble(trainable, frozen["drafter"])`` (default :func:`params.merge`; LoRA: ``lambda lora, base:
  apply_lora(base, lora)``). ``batch = {"tokens_BxT": int32 [B, T], "mask_BxT": f32 [B, T], "on_policy_B": f32
  [B]}``. aux: ``tv`` (mean total variation at the loss temperature, no gradient, pooled over the batch's
  positions), ``on_policy`` (batch share).

  ``normalization`` (``divergences.NORMALIZATIONS``): ``"sequence"``, the paper's ``(1/B) Σ_b (1/|y_b|) Σ_t D``
  (every continuation weighs the same, however long); ``"token"``, every position of the batch weighs the same (the
  only choice before 2026-11-28: the distilled drafters reported until then were trained with it).
  """
  target: decoder_lib.DecoderConfig
  drafter: decoder_lib.DecoderConfig
  divergence: str = "fkl"
  temperature: float = 1.0
  beta: float = 0.5
  assemble: Assemble = params_lib.merge
  normalization: str = "sequence"

  def __post_init__(self):
    check_pair(self.target, self.drafter)
    divergences.check_divergence(self.divergence, self.beta)
    divergences.check_temperature(self.temperature)
    divergences.check_normalization(self.normalization)

  def __call__(self, trainable, frozen, batch, key):
    del key  # the loss is deterministic given the batch
    tokens_BxT, mask_BxT = batch["tokens_BxT"], batch["mask_BxT"]
    positions_BxN = batch.get("positions_BxN")
    if positions_BxN is not None:  # logits only where the mask can be set (see loss_window)
      mask_BxT = batch["mask_BxN"]
    target_logits_BxTxV = jax.lax.stop_gradient(sequence_logits(self.target, frozen["target"], tokens_BxT,
                                                                positions_BxN))
    drafter_params = self.assemble(trainable, frozen["drafter"])
    drafter_logits_BxTxV = sequence_logits(self.drafter, drafter_params, tokens_BxT, positions_BxN)
    loss = divergences.token_divergence(self.divergence, target_logits_BxTxV, drafter_logits_BxTxV, mask_BxT,
                                        temperature=self.temperature, beta=self.beta,
                                        normalization=self.normalization)
    tv = divergences.token_divergence("tvd", target_logits_BxTxV, jax.lax.stop_gradient(drafter_logits_BxTxV),
                                      mask_BxT, temperature=self.temperature)
    aux = {"tv": tv}
    if "on_policy_B" in batch:
      aux["on_policy"] = jnp.mean(batch["on_policy_B"].astype(jnp.float32))
    return loss, aux


def split_prompts(num_prompts: int, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """``(train_idx, heldout_idx)``: a fixed-seed numpy permutation of ``range(num_prompts)``, its first
  ``round(fraction · N)`` entries (at least 1 when the fraction is > 0) held out; both sorted, disjoint."""
  if not 0.0 <= heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
  perm = np.random.default_rng(seed).permutation(num_prompts)
  num_heldout = max(1, int(round(heldout_fraction * num_prompts))) if heldout_fraction > 0 else 0
  if num_heldout >= num_prompts:
    raise ValueError(f"{num_prompts} prompts leave none for training with heldout_fraction = {heldout_fraction}")
  return np.sort(perm[num_heldout:]), np.sort(perm[:num_heldout])


def random_prompts(num_prompts: int, length: int, vocab_size: int, seed: int,
                   low: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens_NxP int32, prompt_len_N int32)``: uniform ids in ``[low, V)`` (smoke jobs on random models)."""
  rng = np.random.default_rng(seed)
  tokens_NxP = rng.integers(low, vocab_size, size=(num_prompts, length), dtype=np.int64).astype(np.int32)
  return tokens_NxP, np.full((num_prompts,), length, np.int32)


def build_sequences(tokens_BxP, prompt_len_B, generated_BxN, num_generated_B,
                    pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Host-side: ``(tokens_BxT int32, mask_BxT f32)`` with T = P + N (see the module docstring for the layout)."""
  tokens_BxP, prompt_len_B = np.asarray(tokens_BxP), np.asarray(prompt_len_B)
  generated_BxN, num_generated_B = np.asarray(generated_BxN), np.asarray(num_generated_B)
  batch, width = tokens_BxP.shape
  length = width + generated_BxN.shape[1]
  tokens_BxT = np.full((batch, length), pad_id, np.int32)
  mask_BxT = np.zeros((batch, length), np.float32)
  for b in range(batch):
    p, n = int(prompt_len_B[b]), int(num_generated_B[b])
    tokens_BxT[b, :p] = tokens_BxP[b, :p]
    tokens_BxT[b, p:p + n] = generated_BxN[b, :n]
    mask_BxT[b, p - 1:p - 1 + n] = 1.0
  return tokens_BxT, mask_BxT


def sample_sequences(config: decoder_lib.DecoderConfig, params, tokens_BxP, prompt_len_B, keys_B, *,
                     max_new_tokens: int, temperature: float, stop_ids: tuple[int, ...] = (),
                     pad_id: int = 0, mesh=None) -> tuple[np.ndarray, np.ndarray]:
  """Continuations sampled from ``config``/``params`` (``generate_autoregressive``; row ``b`` uses ``keys_B[b]``, so
  on a ``mesh`` (``parallel.autoregressive_rows``: rows over ``data``, any number of them) the same tokens as on one
  device), returned as :func:`build_sequences` arrays."""
  from blockspec_jax import parallel
  out = parallel.autoregressive_rows(mesh, params, keys_B, np.asarray(tokens_BxP), np.asarray(prompt_len_B),
                                     target=config, max_new_tokens=max_new_tokens,
                                     sampler=sampling.Sampler(temperature), stop_ids=tuple(stop_ids), pad_id=pad_id)
  return build_sequences(tokens_BxP, prompt_len_B, out.tokens_BxN, out.num_tokens_B, pad_id)


def _row_keys(key: jax.Array, rows: np.ndarray) -> jax.Array:
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(rows, jnp.uint32))


@dataclasses.dataclass(frozen=True, eq=False)
class DistillData:
  """Prompts, their split and the target's fixed continuations (host numpy arrays; see the module docstring)."""
  target: decoder_lib.DecoderConfig
  drafter: decoder_lib.DecoderConfig
  prompts_NxP: np.ndarray
  prompt_len_N: np.ndarray
  train_idx: np.ndarray
  heldout_idx: np.ndarray
  fixed_tokens_NxT: np.ndarray  # target continuations of every prompt (train and held-out)
  fixed_mask_NxT: np.ndarray
  batch_size: int
  max_new_tokens: int
  sample_temperature: float
  source: str = "fixed"
  on_policy_fraction: float = 0.0
  seed: int = 0
  stop_ids: tuple[int, ...] = ()
  mesh: Any = None  # where on-policy samples are drawn (``parallel.autoregressive_rows``); None: one device


def make_distill_data(target: decoder_lib.DecoderConfig, target_params, drafter: decoder_lib.DecoderConfig,
                      prompts_NxP, prompt_len_N, *, batch_size: int, max_new_tokens: int,
                      sample_temperature: float = 1.0, source: str = "fixed", on_policy_fraction: float = 0.5,
                      heldout_fraction: float = 0.125, seed: int = 0, stop_ids: tuple[int, ...] = (),
                      split: tuple[np.ndarray, np.ndarray] | None = None, progress: bool = False,
                      samples_path=None, samples_meta: dict | None = None,
                      sample_batch_size: int | None = None, reuse_samples=None, mesh=None) -> DistillData:
  """Split the prompts and sample the target's continuations (in batches of ``sample_batch_size`` rows, default
  ``batch_size``, one compiled program), row ``i`` with key ``fold_in(key(seed), i)``: the law of a row does not
  depend on the rows sampled beside it, so a wider sampling batch changes the cost (each decode step reads the
  weights once for all its rows), not the data's distribution. ``batch_size`` is the training batch.

  ``samples_path`` (an ``.npz``, e.g. in a run's work directory): the continuations are read from it when it holds
  those of the same prompts, rows and sampling settings (and ``samples_meta``: what names the target, e.g. its model
  name), else sampled and written there atomically, so a resumed run does not sample them again. While sampling,
  the finished rows are kept after every batch in ``samples.partial.npz`` beside it: a run stopped then samples only
  the rest (each row has its own key, so the arrays are those of an uninterrupted run). A file made with other
  settings is a ValueError naming them.

  ``split``: explicit ``(train_idx, heldout_idx)`` (disjoint indices into the prompts), e.g. a held-out file and a
  training pool concatenated; default :func:`split_prompts` with ``heldout_fraction``. The target samples the
  held-out prompts (the held-out TV is measured on them) and, unless ``source = "on_policy"`` (which never reads
  them), the training prompts; rows not sampled keep an empty mask.

  ``mesh``: the target's continuations, and later the drafter's on-policy samples, are drawn with their rows over
  its ``data`` axis (the same tokens as one device: each row has its own key); None: one device.
  ``reuse_samples``: another run's samples file (e.g. the run whose prompt pool this one widens): a row whose prompt
  (its tokens, exactly) has a continuation there takes it instead of a new sample. That file must have been made
  with the same target and sampling settings (``max_new_tokens``, ``sample_temperature``, ``stop_ids`` and
  ``samples_meta``; ValueError naming those that differ); the other rows are sampled with keys of their own stream
  (``fold_in(fold_in(key(seed), 1), s)``, ``s`` from the file's SHA-256), so no new row shares a key with a reused
  one. Each row is still one independent draw from the target given its prompt: the data has the law of a fresh
  sample, and the same two files give it bit for bit again.
  """
  check_pair(target, drafter)
  if source not in SOURCES:
    raise ValueError(f"unknown data source {source!r}; known: {', '.join(SOURCES)}")
  if not 0.0 <= on_policy_fraction <= 1.0:
    raise ValueError(f"on_policy_fraction must be in [0, 1], got {on_policy_fraction}")
  sample_batch_size = batch_size if sample_batch_size is None else sample_batch_size
  for name, value in (("batch_size", batch_size), ("sample_batch_size", sample_batch_size)):
    check_int(value, name)
  prompts_NxP, prompt_len_N = np.asarray(prompts_NxP, np.int32), np.asarray(prompt_len_N, np.int32)
  spec.check_prompt_values(prompts_NxP, prompt_len_N, target.vocab_size)
  sampling.Sampler(sample_temperature)  # validates it (T = 0: greedy continuations are allowed)
  num = prompts_NxP.shape[0]
  train_idx, heldout_idx = _checked_split(split, num, heldout_fraction, seed)
  need = heldout_idx if source == "on_policy" else np.arange(num)
  key = jax.random.fold_in(jax.random.key(seed), 0)
  width = prompts_NxP.shape[1] + max_new_tokens
  meta = {"prompts_sha256": _sha256(prompts_NxP, prompt_len_N), "rows_sha256": _sha256(np.asarray(need, np.int64)),
          "max_new_tokens": int(max_new_tokens), "sample_temperature": float(sample_temperature), "seed": int(seed),
          "stop_ids": [int(i) for i in stop_ids], "target": repr(target), **(samples_meta or {})}
  reused = None
  if reuse_samples is not None:
    reused = _reusable_samples(reuse_samples, meta)
    meta["reused_samples_sha256"] = reused["sha256"]
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), int(reused["sha256"][:8], 16))
  cached, fixed_tokens_NxT, fixed_mask_NxT, done_N = _known_rows(
      samples_path, meta, (num, width), need, reused, (prompts_NxP, prompt_len_N), progress, reuse_samples)
  partial_path = None if samples_path is None else _partial_path(samples_path)
  need = need[~done_N[need]]
  sample_batch_size = max(1, min(sample_batch_size, max(len(need), 1)))
  starts = range(0, len(need) if cached is None else 0, sample_batch_size)
  if progress and len(starts):
    from tqdm import tqdm
    starts = tqdm(starts, desc="target samples", unit="batch", dynamic_ncols=True)
  for start in starts:
    rows = need[np.arange(start, start + sample_batch_size) % len(need)]  # the last one wraps: no recompile
    tokens_BxT, mask_BxT = sample_sequences(target, target_params, prompts_NxP[rows], prompt_len_N[rows],
                                            _row_keys(key, rows), max_new_tokens=max_new_tokens,
                                            temperature=sample_temperature, stop_ids=stop_ids, mesh=mesh)
    fixed_tokens_NxT[rows], fixed_mask_NxT[rows] = tokens_BxT, mask_BxT
    done_N[rows] = True
    if partial_path is not None:  # each row has its own key: a resume samples the rest to the same arrays
      artifacts.save_tagged(partial_path, {"tokens_NxT": fixed_tokens_NxT, "mask_NxT": fixed_mask_NxT,
                                           "done_N": done_N}, meta)
  if samples_path is not None and cached is None:
    artifacts.save_tagged(samples_path, {"tokens_NxT": fixed_tokens_NxT, "mask_NxT": fixed_mask_NxT}, meta)
    partial_path.unlink(missing_ok=True)
  return DistillData(target, drafter, prompts_NxP, prompt_len_N, train_idx, heldout_idx, fixed_tokens_NxT,
                     fixed_mask_NxT, batch_size, max_new_tokens, float(sample_temperature), source,
                     float(on_policy_fraction), seed, tuple(stop_ids), mesh)


def _checked_split(split, num: int, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """``(train_idx, heldout_idx)``: ``split`` sorted and checked (distinct, disjoint, in ``[0, num)``, some training
  prompts), or :func:`split_prompts` when it is None."""
  if split is None:
    return split_prompts(num, heldout_fraction, seed)
  train_idx, heldout_idx = (np.sort(np.asarray(i, np.int64).reshape(-1)) for i in split)
  if np.intersect1d(train_idx, heldout_idx).size or len(np.unique(train_idx)) != len(train_idx):
    raise ValueError("split: training and held-out indices must be distinct and disjoint")
  both = np.concatenate([train_idx, heldout_idx])
  if both.size and (both.min() < 0 or both.max() >= num):
    raise ValueError(f"split indices must lie in [0, {num})")
  if train_idx.size == 0:
    raise ValueError("split: no training prompts")
  return train_idx, heldout_idx


def _known_rows(samples_path, meta: dict, shape: tuple[int, int], need: np.ndarray, reused: dict | None,
                prompts: tuple[np.ndarray, np.ndarray], progress: bool, reuse_samples) -> tuple:
  """``(cached, tokens_NxT, mask_NxT, done_N)``: the continuations already known before sampling: all of them from
  ``samples_path`` (``cached``, not None), else a stopped run's finished rows from the partial file beside it, else
  the rows ``reused`` has (``prompts = (prompts_NxP, prompt_len_N)``); ``done_N`` marks the rows known."""
  num, width = shape
  cached = None if samples_path is None else _read_samples(samples_path, meta)
  fixed_tokens_NxT, fixed_mask_NxT = cached or (np.zeros((num, width), np.int32), np.zeros((num, width), np.float32))
  if cached is not None and progress:
    print(f"target continuations of {len(need)} prompts read from {samples_path} (made with these settings)",
          flush=True)
  partial_path = None if samples_path is None else _partial_path(samples_path)
  done_N = np.zeros((num,), bool)
  if cached is not None and partial_path is not None:
    partial_path.unlink(missing_ok=True)  # left by a run stopped between writing samples.npz and removing it
  partial = None if cached is not None or partial_path is None else _read_samples(partial_path, meta, partial=True)
  if partial is not None:  # a run stopped while sampling: its finished rows are kept
    fixed_tokens_NxT, fixed_mask_NxT, done_N = partial
    if progress:
      print(f"target continuations of {int(done_N[need].sum())} of {len(need)} prompts read from {partial_path} "
            "(a stopped run's)", flush=True)
  elif cached is None and reused is not None:
    taken = _take_reused(reused, prompts[0], prompts[1], need, fixed_tokens_NxT, fixed_mask_NxT)
    done_N[taken] = True
    if progress:
      print(f"target continuations of {len(taken)} of {len(need)} prompts taken from {reuse_samples}", flush=True)
  return cached, fixed_tokens_NxT, fixed_mask_NxT, done_N


def _sha256(*arrays) -> str:
  digest = hashlib.sha256()
  for a in arrays:
    a = np.ascontiguousarray(a)
    digest.update(f"{a.dtype.str}{a.shape}".encode())
    digest.update(a.tobytes())
  return digest.hexdigest()


#: Settings of a samples file that a run reusing its continuations need not share: its prompts, rows and seed.
_OWN_SETTINGS = ("prompts_sha256", "rows_sha256", "seed", "reused_samples_sha256")


def _reusable_samples(path, meta: dict) -> dict:
  """A samples file (or the work directory holding ``samples.npz``) to take continuations from: its arrays, its
  SHA-256 and, per sampled row, its prompt (the tokens before the row's first masked position). ValueError when it
  is absent, damaged, or made with other target / sampling settings than ``meta``'s."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / "samples.npz"
  redo = "pass a samples file made by a training job (its work directory's samples.npz)"
  try:
    arrays, saved = artifacts.load_tagged(path, ("tokens_NxT", "mask_NxT"), what="target samples", redo=redo)
  except FileNotFoundError:
    raise ValueError(f"reuse_samples: no target samples file {path}") from None
  changed = artifacts.changed_settings({k: v for k, v in meta.items() if k not in _OWN_SETTINGS}, saved,
                                      compare_saved_keys=False)
  if changed:
    raise ValueError(f"reuse_samples: {path} was sampled with other settings ({', '.join(changed)} differ), so its "
                     "continuations do not have this run's law")
  tokens_NxT, mask_NxT = np.asarray(arrays["tokens_NxT"], np.int32), np.asarray(arrays["mask_NxT"], np.float32)
  by_prompt = {}
  for j in range(tokens_NxT.shape[0]):
    ones = np.flatnonzero(mask_NxT[j])
    if ones.size:  # an unsampled row (or an empty continuation) gives nothing to reuse
      by_prompt.setdefault(tokens_NxT[j, :ones[0] + 1].tobytes(), []).append(j)
  return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "tokens_NxT": tokens_NxT, "mask_NxT": mask_NxT,
          "by_prompt": by_prompt}


def _take_reused(reused: dict, prompts_NxP, prompt_len_N, rows, tokens_NxT, mask_NxT) -> np.ndarray:
  """Copy into ``tokens_NxT`` / ``mask_NxT`` (in place) the reused continuation of each of ``rows`` whose prompt has
  one; returns those rows. A continuation serves one row: two rows with the same prompt take two of them, or the
  second is sampled (rows stay independent draws)."""
  unused = {prompt: list(js) for prompt, js in reused["by_prompt"].items()}
  taken = []
  for i in rows:
    p = int(prompt_len_N[i])
    js = unused.get(np.ascontiguousarray(prompts_NxP[i, :p], np.int32).tobytes())
    if not js:
      continue
    j = js.pop(0)
    n = int(reused["mask_NxT"][j].sum())
    tokens_NxT[i, :p + n] = reused["tokens_NxT"][j, :p + n]
    mask_NxT[i, p - 1:p - 1 + n] = 1.0
    taken.append(i)
  return np.asarray(taken, np.int64)


def _partial_path(samples_path) -> pathlib.Path:
  """Where sampling keeps its finished rows until every row is done (``samples.partial.npz`` beside the file)."""
  samples_path = pathlib.Path(samples_path)
  return samples_path.with_name(samples_path.name.removesuffix(".npz") + ".partial.npz")


def _read_samples(path, meta: dict, partial: bool = False):
  """``(tokens_NxT, mask_NxT)`` from a samples file (:func:`make_distill_data`) made with ``meta`` (``partial``:
  ``(tokens_NxT, mask_NxT, done_N)`` from the file of a run stopped while sampling); None when absent; ValueError
  for one made with other settings or damaged."""
  redo = "delete it to sample them again"
  names = ("tokens_NxT", "mask_NxT", "done_N") if partial else ("tokens_NxT", "mask_NxT")
  what = "partial target samples" if partial else "target samples"
  arrays = artifacts.read_matching(path, meta, lambda p: artifacts.load_tagged(p, names, what=what, redo=redo),
                                   redo=redo)
  if arrays is None:
    return None
  out = np.array(arrays["tokens_NxT"], np.int32), np.array(arrays["mask_NxT"], np.float32)
  return (*out, np.array(arrays["done_N"], bool)) if partial else out


def _train_rows(data: DistillData, step: int) -> np.ndarray:
  """Prompt indices of step ``step``'s batch: epoch ``e`` visits the training prompts in the order of
  ``default_rng([seed, 1, e]).permutation``."""
  n = len(data.train_idx)
  flat = step * data.batch_size + np.arange(data.batch_size)
  epochs, offsets = flat // n, flat % n
  rows = np.empty_like(flat)
  for e in np.unique(epochs):
    perm = np.random.default_rng([data.seed, 1, int(e)]).permutation(n)
    rows[epochs == e] = data.train_idx[perm[offsets[epochs == e]]]
  return rows


def _is_on_policy(data: DistillData, step: int) -> bool:
  if data.source == "on_policy":
    return True
  if data.source == "fixed":
    return False
  return bool(np.random.default_rng([data.seed, 2, step]).random() < data.on_policy_fraction)


def make_batch_fn(data: DistillData, frozen_drafter, assemble: Assemble = params_lib.merge):
  """``batch_fn(step, trainable) -> batch`` for :func:`blockspec_jax.train.trainer.fit` (pure in its arguments)."""
  sample_key = jax.random.fold_in(jax.random.key(data.seed), 1)

  def batch_fn(step: int, trainable):
    rows = _train_rows(data, step)
    if _is_on_policy(data, step):
      drafter_params = assemble(trainable, frozen_drafter)
      tokens_BxT, mask_BxT = sample_sequences(
          data.drafter, drafter_params, data.prompts_NxP[rows], data.prompt_len_N[rows],
          _row_keys(jax.random.fold_in(sample_key, step), rows), max_new_tokens=data.max_new_tokens,
          temperature=data.sample_temperature, stop_ids=data.stop_ids, mesh=data.mesh)
      on_policy_B = np.ones((len(rows),), np.float32)
    else:
      tokens_BxT, mask_BxT = data.fixed_tokens_NxT[rows], data.fixed_mask_NxT[rows]
      on_policy_B = np.zeros((len(rows),), np.float32)
    positions_BxN, mask_BxN = loss_window(mask_BxT, data.prompt_len_N[rows], data.max_new_tokens)
    return {"tokens_BxT": jnp.asarray(tokens_BxT), "mask_BxT": jnp.asarray(mask_BxT),
            "positions_BxN": jnp.asarray(positions_BxN), "mask_BxN": jnp.asarray(mask_BxN),
            "on_policy_B": jnp.asarray(on_policy_B)}

  return batch_fn


@functools.partial(jax.jit, static_argnames=("target", "drafter", "temperature"))
def _tv_sums(target_params, drafter_params, tokens_BxT, positions_BxN, mask_BxN, *, target, drafter, temperature):
  """``(sum_N, count_N)``: the masked total variation summed over the batch at each continuation offset."""
  target_logits_BxNxV = sequence_logits(target, target_params, tokens_BxT, positions_BxN)
  drafter_logits_BxNxV = sequence_logits(drafter, drafter_params, tokens_BxT, positions_BxN)
  tv_BxN = divergences.total_variation(target_logits_BxNxV, drafter_logits_BxNxV, temperature=temperature)
  return jnp.sum(tv_BxN * mask_BxN, axis=0), jnp.sum(mask_BxN, axis=0)


@dataclasses.dataclass(frozen=True)
class HeldoutTV:
  """The held-out total variation: ``mean`` over every generated position, and per continuation offset
  (``sum_N`` / ``count_N``, offset ``i`` = the drafter's law for generated token ``i``, N = ``max_new_tokens``)."""
  sum_N: np.ndarray
  count_N: np.ndarray

  @property
  def mean(self) -> float:
    return float(self.sum_N.sum() / max(self.count_N.sum(), 1.0))

  def by_offset(self, width: int = 16) -> dict[str, float | None]:
    """Means over offsets ``[k·width, (k+1)·width)`` (None where no position is set), keyed ``"0-15"``, …"""
    width = check_int(width, "width")
    out = {}
    for lo in range(0, len(self.sum_N), width):
      hi = min(lo + width, len(self.sum_N))
      count = float(self.count_N[lo:hi].sum())
      out[f"{lo}-{hi - 1}"] = float(self.sum_N[lo:hi].sum()) / count if count else None
    return out


def heldout_tv_report(drafter_params, target_params, data: DistillData,
                      temperature: float | None = None) -> HeldoutTV:
  """Total variation between the drafter's and the target's next-token laws (at the decoding temperature by
  default) on the held-out prompts' generated positions (the target's fixed continuations), per continuation
  offset, in batches of ``data.batch_size`` rows (the last one wrapped around with its repeated rows masked out)."""
  if len(data.heldout_idx) == 0:
    raise ValueError("no held-out prompts (heldout_fraction = 0)")
  temperature = data.sample_temperature if temperature is None else temperature
  sum_N = np.zeros((data.max_new_tokens,), np.float64)
  count_N = np.zeros((data.max_new_tokens,), np.float64)
  n = len(data.heldout_idx)
  for start in range(0, n, data.batch_size):
    flat = np.arange(start, start + data.batch_size)
    rows = data.heldout_idx[flat % n]
    mask_BxT = data.fixed_mask_NxT[rows] * (flat < n)[:, None]
    positions_BxN, mask_BxN = loss_window(mask_BxT, data.prompt_len_N[rows], data.max_new_tokens)
    s_N, c_N = _tv_sums(target_params, drafter_params, jnp.asarray(data.fixed_tokens_NxT[rows]),
                        jnp.asarray(positions_BxN), jnp.asarray(mask_BxN), target=data.target,
                        drafter=data.drafter, temperature=float(temperature))
    sum_N += np.asarray(jax.device_get(s_N), np.float64)
    count_N += np.asarray(jax.device_get(c_N), np.float64)
  return HeldoutTV(sum_N, count_N)


def heldout_tv(drafter_params, target_params, data: DistillData, temperature: float | None = None) -> float:
  """Mean total variation over the held-out prompts' generated positions (:func:`heldout_tv_report`)."""
  return heldout_tv_report(drafter_params, target_params, data, temperature).mean
