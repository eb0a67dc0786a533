"""Helpers shared by the training jobs (``distill_job``, ``sprinter_job``, ``heads_job``, ``steer_job``, each in its
``train/<job>.py``; their common setup is :mod:`blockspec_jax.train.job_setup`) and their library modules: setting
checks, the real-model prompt pool (held-out file + disjoint training pool, kept in the workdir and encoded into
padded arrays), model labels for reports and the reader of cached collected data. No gin here: the jobs register themselves.

Errors: a job's settings (``job`` given) raise :class:`blockspec_jax.checks_lib.UsageError` naming ``<job>.<setting>``;
library arguments (no ``job``) raise ``ValueError`` naming the argument.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Callable

import numpy as np

from blockspec_jax import artifacts, checks
from blockspec_jax import checks as checks_lib
from blockspec_jax.data import formats as formats_lib
from blockspec_jax.data import prompts as prompts_lib

__all__ = ["check_int", "check_collection", "check_number", "prompt_rows", "encode_pool", "model_name", "read_cached",
           "collect_missing", "DEFAULT_HELDOUT", "DEFAULT_MAX_PROMPT_LEN", "samples_path", "samples_meta"]

#: The real-model training jobs' held-out prompts: the shipped six-category file (code, chat, math, summarization,
#: translation, qa); their training pool comes from the same packages, disjoint from it, ``per_task`` per category.
DEFAULT_HELDOUT = "six"
#: Longest prompt (tokens, chat template included) a training job keeps; every shipped held-out prompt fits with
#: either tokenizer (the longest, a summarization prompt, is about 320 tokens with Qwen's template).
DEFAULT_MAX_PROMPT_LEN = 352


def check_int(value, name: str, low: int = 1, *, job: str | None = None) -> int:
  """``value`` as an int when it is an integer >= ``low``. With ``job``: a job setting (``<job>.<name>`` in the
  UsageError), which must be a Python int (it is recorded as JSON); without: a library argument (ValueError), a NumPy
  integer allowed."""
  if job is None:
    return checks.check_int(value, name, low)
  return checks.check_int(value, f"{job}.{name}", low, error=checks_lib.UsageError, numpy=False)  # NumPy ints: not JSON


def check_collection(tokens_BxP, prompt_len_B, rows, *, max_new_tokens: int, batch_size: int, configs: tuple):
  """The inputs of a collection pass (every prompt continued by a model, something recorded at each new token;
  ``heads.collect_hidden``, ``sprinter.collect_labels``), checked: ``(tokens_BxP int32 [B, P], prompt_len_B int32
  [B], rows int64 [B] (distinct ids >= 0, default ``arange(B)``), width = P + max_new_tokens)``. ValueError naming
  the problem: bad counts, shapes, prompt ids or lengths, repeated or negative rows, or a width past a config's
  ``max_len`` (``configs``: the models that run over it)."""
  from blockspec_jax.decoding import speculative as spec
  check_int(max_new_tokens, "max_new_tokens")
  check_int(batch_size, "batch_size")
  tokens_BxP, prompt_len_B = np.asarray(tokens_BxP, np.int32), np.asarray(prompt_len_B, np.int32)
  if tokens_BxP.ndim != 2 or prompt_len_B.shape != tokens_BxP.shape[:1]:
    raise ValueError(f"need tokens_BxP [B, P] and prompt_len_B [B], got {tokens_BxP.shape} and {prompt_len_B.shape}")
  spec.check_prompt_values(tokens_BxP, prompt_len_B, configs[0].vocab_size)
  num = tokens_BxP.shape[0]
  rows = np.arange(num, dtype=np.int64) if rows is None else np.asarray(rows, np.int64).reshape(-1)
  if rows.shape != (num,) or len(np.unique(rows)) != num or (num and rows.min() < 0):
    raise ValueError(f"rows must be {num} distinct prompt ids >= 0, got {rows.tolist()}")
  width = tokens_BxP.shape[1] + max_new_tokens
  for config in configs:
    if config.max_len is not None and width + 1 > config.max_len:
      raise ValueError(f"prompt width {tokens_BxP.shape[1]} + {max_new_tokens} new tokens does not fit max_len "
                       f"{config.max_len}")
  return tokens_BxP, prompt_len_B, rows, width


def wrapped_batches(num: int, batch_size: int, *, progress: bool, desc: str):
  """``(i, flat_B, local_B)`` for each batch of a collection pass over ``num`` prompts, ``batch_size`` at a time:
  ``flat_B`` the batch's positions (past ``num`` in the last batch), ``local_B = flat_B % num`` the prompts it
  holds (the last batch wraps around, so every batch has one shape: one compiled program; rows with ``flat_B >=
  num`` are repeats the caller drops). A tqdm bar named ``desc`` with ``progress``."""
  starts = range(0, num, batch_size)
  if progress and num:
    from tqdm import tqdm
    starts = tqdm(starts, desc=desc, unit="batch", dynamic_ncols=True)
  for i, start in enumerate(starts):
    flat_B = np.arange(start, start + batch_size)
    yield i, flat_B, flat_B % num


def check_number(value, name: str, low: float = 0.0, strict: bool = False, *, job: str | None = None) -> float:
  """``value`` as a float when it is a finite number >= ``low`` (> when ``strict``); errors as :func:`check_int`."""
  ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
  if not ok or value < low or (strict and value == low):
    message = f"must be a finite number {'>' if strict else '>='} {low}, got {value!r}"
    if job is not None:
      raise checks_lib.UsageError(f"{job}.{name} {message}")
    raise ValueError(f"{name} {message}")
  return float(value)


def prompt_rows(workdir, heldout_prompts: str, per_task: int, seed: int) -> tuple[list, list]:
  """Held-out rows (the prompt file) and training rows (a pool from the same packages, disjoint from them), written
  to ``workdir`` (``prompts_heldout.jsonl`` / ``prompts_train.jsonl``) on the first run and read back from there on
  a resume (same prompts, no download)."""
  workdir = pathlib.Path(workdir)
  held_path, train_path = workdir / "prompts_heldout.jsonl", workdir / "prompts_train.jsonl"
  if held_path.exists() and train_path.exists():
    return prompts_lib.load_prompts(held_path), prompts_lib.load_prompts(train_path)
  heldout = prompts_lib.load_prompts(heldout_prompts)
  print(f"building the training prompt pool ({per_task} per task, disjoint from {heldout_prompts}) …", flush=True)
  train = prompts_lib.build_training_pool(heldout, per_task=per_task, seed=seed)
  for path, rows in ((held_path, heldout), (train_path, train)):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
  return heldout, train


def encode_pool(model, heldout_rows, train_rows, max_prompt_len: int, chat: bool, job: str,
                system=formats_lib.SYSTEM_DEFAULT):
  """The training prompts then the held-out ones, encoded with ``model``'s tokenizer (chat-templated when ``chat``, each
  pool's prompts with the ``system`` formats cycled over them: ``prompts.encode_prompts``) into ``(prompts_NxP int32,
  prompt_len_N, (train_idx, heldout_idx), by_task, dropped)``: training prompts longer than ``max_prompt_len`` tokens
  are left out (``dropped`` of them; ``by_task`` counts the kept ones per task), a held-out one that long is a
  UsageError naming ``<job>.max_prompt_len``."""
  held_ids = prompts_lib.encode_prompts(model, heldout_rows, chat, system)
  too_long = [r["id"] for r, ids in zip(heldout_rows, held_ids) if len(ids) > max_prompt_len]
  if too_long:
    raise checks_lib.UsageError(f"held-out prompts {too_long} are longer than {job}.max_prompt_len = {max_prompt_len} "
                          "tokens; raise it")
  train_ids = prompts_lib.encode_prompts(model, train_rows, chat, system)
  kept = [i for i, ids in enumerate(train_ids) if len(ids) <= max_prompt_len]
  by_task: dict[str, int] = {}
  for i in kept:
    by_task[train_rows[i]["task"]] = by_task.get(train_rows[i]["task"], 0) + 1
  dropped = len(train_ids) - len(kept)
  print(f"prompts: {len(kept)} for training {by_task} ({dropped} longer than {max_prompt_len} tokens left out), "
        f"{len(held_ids)} held out", flush=True)
  all_ids = [train_ids[i] for i in kept] + held_ids
  prompts_NxP = np.zeros((len(all_ids), max_prompt_len), np.int32)
  for i, ids in enumerate(all_ids):
    prompts_NxP[i, :len(ids)] = ids
  prompt_len_N = np.asarray([len(ids) for ids in all_ids], np.int32)
  split = (np.arange(len(kept)), np.arange(len(kept), len(all_ids)))
  return prompts_NxP, prompt_len_N, split, by_task, dropped


def model_name(name, config, seed) -> str:
  """A model's label in reports: its name, or (``name`` None) a random tiny decoder's shape and seed."""
  if name is not None:
    return str(name)
  return f"random tiny decoder (seed {seed}, V = {config.vocab_size}, D = {config.d_model}, {config.num_layers} layers)"


def read_cached(path: pathlib.Path, meta: dict, load: Callable, *, redo: str, compare_saved_keys: bool = True):
  """:func:`blockspec_jax.artifacts.read_matching` for a job: the data in ``path`` when it was collected with
  ``meta``'s settings, None when absent; other settings or a damaged file are a UsageError (other settings: ending
  ``use a fresh work directory or delete {redo}``)."""
  try:
    return artifacts.read_matching(path, meta, load, redo=f"delete {redo}", compare_saved_keys=compare_saved_keys)
  except ValueError as e:
    raise checks_lib.UsageError(str(e)) from None


def collect_missing(data: dict, split_rows, collect: Callable, save: Callable) -> dict:
  """Fill the splits of ``data`` (``{"train": …, "heldout": …}``, None where nothing was cached) in that order:
  ``data[split] = collect(split, rows)`` (``rows`` int64; a ValueError becomes a UsageError), then
  ``save(split, data[split])`` at once, so a run stopped during the second split keeps the first. Returns ``data``."""
  for split, rows in zip(("train", "heldout"), split_rows):
    if data[split] is not None:
      continue
    try:
      data[split] = collect(split, np.asarray(rows, np.int64))
    except ValueError as e:
      raise checks_lib.UsageError(str(e)) from None
    save(split, data[split])
  return data


def samples_path(workdir) -> pathlib.Path:
  """Where a run keeps the target's sampled continuations (``distill.make_distill_data``): a resume reads them."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  return workdir / "samples.npz"


def samples_meta(target_name, target_seed: int, weights: dict | None = None) -> dict:
  """What names the target of a run's samples: its model name, or the seed of a random tiny target; ``weights``: the
  job's ``weights_meta()`` (its target's weights when they are not the dequantized ones)."""
  return {"target_name": str(target_name) if target_name is not None else f"random tiny target, seed {target_seed}",
          **(weights or {})}
