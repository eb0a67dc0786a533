"""The BPD heads training job (gin: ``heads_job.*``; :mod:`blockspec_jax.train.heads` does the work).

    python -m blockspec_jax.train --gin_file gin/train/heads_smoke.gin    (random tiny target, seconds)
    python -m blockspec_jax.train --gin_file gin/train/heads_qwen.gin     (Qwen2.5-Coder 1.5B target)

Steps: prompts (random ids for a random tiny target; for a real target the shipped held-out prompt file and a
training pool from the same packages, disjoint from it, both written to the workdir as ``prompts_*.jsonl``); the
target continues them at ``temperature`` and one causal pass gives its hidden states (cached as
``hidden_train.npz`` / ``hidden_heldout.npz`` with the frozen LM head in ``lm_head.npy``: a rerun loads no model);
``num_heads`` heads trained with :func:`blockspec_jax.train.heads.train_heads` (checkpoints resumed from); the
n-gram LM of the training text (``ngram.npz`` / ``ngram.json``); the trained heads (``heads.npz`` / ``heads.json``);
``metrics.json``: held-out per-head top-1 accuracy and cross-entropy before (the untrained heads = the target's
next-token head) and after training, the top-1 of the n-gram-rescored candidates and whether the label is among the
top ``k``, the n-gram's held-out cross-entropy, counts, seconds and peak RSS.

Decoding with the result: ``HeadsDrafter(target=<target config>, num_heads=…, rescore=…, heads=<this workdir>)``
(:mod:`blockspec_jax.drafters.heads`) and its ``load_params(drafter_model, target_model)``.

This is the only module of the heads stack that imports gin. The optimizer is configured by the job's own settings
(``learning_rate``, ``warmup_steps``, …), so the job needs no other gin registration than ``tiny_decoder`` for a
random target.
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import sampling
from blockspec_jax import checks
from blockspec_jax import methods
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.drafters import heads as heads_drafter, lattice
from blockspec_jax.train import distill, heads as heads_lib, pools, trainer

__all__ = ["heads_job"]

JOB = "heads_job"


def _setup(workdir: pathlib.Path, *, real, target, target_config, target_seed, dtype, num_prompts, prompt_len,
           heldout_fraction, heldout_prompts, train_prompts_per_task, max_prompt_len, chat, seed) -> dict:
  """The target (config and parameters), the prompts, their (train, held-out) split and the stop ids."""
  if not real:
    prompts_NxP, prompt_len_N = distill.random_prompts(num_prompts, prompt_len, target_config.vocab_size, seed)
    return dict(config=target_config, params=decoder_lib.init_params(target_config, target_seed),
                prompts_NxP=prompts_NxP, prompt_len_N=prompt_len_N,
                split=distill.split_prompts(num_prompts, heldout_fraction, seed), stop_ids=(), info={})
  heldout_rows, train_rows = pools.prompt_rows(workdir, heldout_prompts, train_prompts_per_task, seed)
  prompts_lib.check_disjoint(train_rows, heldout_rows)
  t0 = time.perf_counter()
  model = sources.load_model(target, dtype)
  print(f"loaded {target} (target, D = {model.config.d_model}, V = {model.config.vocab_size}) in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  prompts_NxP, prompt_len_N, split, by_task, dropped = pools.encode_pool(model, heldout_rows, train_rows,
                                                                         max_prompt_len, chat, JOB)
  return dict(config=model.config, params=model.params["params"], prompts_NxP=prompts_NxP,
              prompt_len_N=prompt_len_N, split=split, stop_ids=model.stop_ids,
              info={"train_prompts_by_task": by_task, "train_prompts_dropped_long": dropped})


@gin.configurable(JOB)
def heads_job(workdir, *, target_config=None, target=None, target_seed: int = 0, num_prompts: int = 64,
              prompt_len: int = 8, heldout_fraction: float = 0.25,
              heldout_prompts: str = pools.DEFAULT_HELDOUT, train_prompts_per_task: int = 48,
              max_prompt_len: int = pools.DEFAULT_MAX_PROMPT_LEN, chat: bool = True, dtype: str = "float32",
              max_new_tokens: int = 32,
              temperature: float = 1.0, collect_batch_size: int = 4, num_heads: int = 4, num_steps: int = 200,
              batch_size: int = 64, optimizer: str = "adamw", learning_rate: float = 1e-3, schedule: str = "cosine",
              warmup_steps: int = 0, weight_decay: float = 0.0, clip_norm: float | None = 1.0,
              ngram_order: int = 3, top_k: int = 16, lm_weight: float = 1.0, eval_chunk: int = 64,
              checkpoint_every: int = 50, max_to_keep: int = 2, eval_every: int = 0, seed: int = 0,
              progress: bool = True, stop_after: int | None = None, dry_run: bool = False) -> dict:
  """BPD heads on a frozen target; returns the ``metrics.json`` summary (see the module docstring for the outputs).

  Target: a random tiny one (``target_config``, ``@tiny_decoder()``, parameters of ``target_seed``; ``num_prompts``
  random prompts of ``prompt_len`` ids split by ``heldout_fraction``) or a real one (``target``: a registry name or
  path, anything ``sources.load_model`` takes, in ``dtype``; held-out prompts = ``heldout_prompts``, training prompts =
  ``train_prompts_per_task`` per category, chat-templated when ``chat``, those longer than ``max_prompt_len`` left
  out).

  Data: ``max_new_tokens`` target tokens per prompt at ``temperature`` (``collect_batch_size`` prompts at a time),
  the hidden states along them. Training: ``num_heads`` heads, ``num_steps`` steps of ``batch_size`` positions
  (each with ``num_heads`` labels), ``trainer.make_optimizer(optimizer, learning_rate, schedule, warmup_steps,
  num_steps, weight_decay, clip_norm)``, checkpoints every ``checkpoint_every`` steps, held-out CE / top-1 every
  ``eval_every`` steps (0: before and after only; ``eval_chunk`` positions per evaluation call). The n-gram LM has
  order ``ngram_order``; the rescored held-out top-1 uses ``top_k`` candidates and weight ``lm_weight``.
  ``stop_after``: stop after that many steps as if killed (resume tests). ``dry_run``: check the settings (no model
  loaded, nothing written) and return them.
  """
  t0 = time.perf_counter()
  for name, value, low in (("num_prompts", num_prompts, 2), ("prompt_len", prompt_len, 1),
                           ("train_prompts_per_task", train_prompts_per_task, 1),
                           ("max_prompt_len", max_prompt_len, 1), ("max_new_tokens", max_new_tokens, 1),
                           ("collect_batch_size", collect_batch_size, 1), ("num_heads", num_heads, 1),
                           ("num_steps", num_steps, 1), ("batch_size", batch_size, 1),
                           ("warmup_steps", warmup_steps, 0), ("ngram_order", ngram_order, 1), ("top_k", top_k, 1),
                           ("eval_chunk", eval_chunk, 1), ("checkpoint_every", checkpoint_every, 1),
                           ("max_to_keep", max_to_keep, 1), ("eval_every", eval_every, 0), ("seed", seed, 0),
                           ("target_seed", target_seed, 0)):
    pools.check_int(value, name, low, job=JOB)
  if stop_after is not None:
    pools.check_int(stop_after, "stop_after", 1, job=JOB)
  real = target is not None
  if real == (target_config is not None):
    raise checks.UsageError(f"give either {JOB}.target (a model name or path) or {JOB}.target_config (a random tiny "
                          "target, @tiny_decoder()), not both")
  if real:
    if not isinstance(target, str):
      raise checks.UsageError(f"{JOB}.target must be a model name or path, got {target!r}")
    methods.check_settings(dtype=dtype, models=(target,))
  else:
    if not isinstance(target_config, decoder_lib.DecoderConfig):
      raise checks.UsageError(f"{JOB}.target_config must be a DecoderConfig (@tiny_decoder()), got {target_config!r}")
    if not 0.0 < heldout_fraction < 1.0:
      raise checks.UsageError(f"{JOB}.heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if top_k > target_config.vocab_size:
      raise checks.UsageError(f"{JOB}.top_k = {top_k} exceeds the target's V = {target_config.vocab_size}")
  pools.check_number(lm_weight, "lm_weight", job=JOB)
  try:
    sampling.Sampler(temperature)
    opt = trainer.make_optimizer(optimizer, pools.check_number(learning_rate, "learning_rate", strict=True, job=JOB),
                                 schedule, warmup_steps, num_steps,
                                 pools.check_number(weight_decay, "weight_decay", job=JOB), clip_norm)
  except ValueError as e:
    raise checks.UsageError(str(e)) from None
  target_name = pools.model_name(target, target_config, target_seed)
  meta = {"target": target_name, "temperature": float(temperature), "max_new_tokens": max_new_tokens, "seed": seed,
          "dtype": dtype, "target_config": None if real else repr(target_config)}
  if real:
    meta.update(chat=chat, max_prompt_len=max_prompt_len, train_prompts_per_task=train_prompts_per_task)
  else:
    meta.update(num_prompts=num_prompts, prompt_len=prompt_len, heldout_fraction=float(heldout_fraction))
  settings = {**meta, "num_heads": num_heads, "collect_batch_size": collect_batch_size, "num_steps": num_steps,
              "batch_size": batch_size, "optimizer": optimizer, "learning_rate": float(learning_rate),
              "schedule": schedule, "warmup_steps": warmup_steps, "weight_decay": float(weight_decay),
              "clip_norm": clip_norm, "ngram_order": ngram_order, "top_k": top_k, "lm_weight": float(lm_weight)}
  if dry_run:
    return {"dry_run": True, **settings}

  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  paths = {"train": workdir / "hidden_train.npz", "heldout": workdir / "hidden_heldout.npz"}
  redo = "the hidden_*.npz files, lm_head.* and checkpoints/ to collect again"
  data = {split: pools.read_cached(path, {**meta, "split": split}, heads_lib.load_hidden, redo=redo,
                                   compare_saved_keys=False)  # the files also record V and D
          for split, path in paths.items()}
  try:
    lm_head_VxD = heads_lib.load_lm_head(workdir)
  except ValueError as e:
    raise checks.UsageError(str(e)) from None
  cached = all(v is not None for v in data.values()) and lm_head_VxD is not None
  info, collect_seconds = {}, 0.0
  if cached:
    print(f"hidden states read from {paths['train'].name}, {paths['heldout'].name} and {heads_lib.LM_HEAD_NPY} (no "
          "model loaded)", flush=True)
  else:
    t_collect = time.perf_counter()
    setup = _setup(workdir, real=real, target=target, target_config=target_config, target_seed=target_seed,
                   dtype=dtype, num_prompts=num_prompts, prompt_len=prompt_len, heldout_fraction=heldout_fraction,
                   heldout_prompts=heldout_prompts, train_prompts_per_task=train_prompts_per_task,
                   max_prompt_len=max_prompt_len, chat=chat, seed=seed)
    info = setup["info"]
    config = setup["config"]

    def collect(split, rows):
      print(f"collecting {split} data: {len(rows)} prompts, {max_new_tokens} target tokens each at "
            f"T = {temperature:g}, and the target's hidden states", flush=True)
      return heads_lib.collect_hidden(
          config, setup["params"], setup["prompts_NxP"][rows], setup["prompt_len_N"][rows],
          max_new_tokens=max_new_tokens, temperature=temperature, key=jax.random.fold_in(jax.random.key(seed), 1),
          batch_size=collect_batch_size, progress=progress, rows=rows, stop_ids=tuple(setup["stop_ids"]))

    pools.collect_missing(data, setup["split"], collect, lambda split, hidden: heads_lib.save_hidden(
        paths[split], hidden, {**meta, "split": split, "vocab_size": config.vocab_size, "d_model": config.d_model}))
    lm_head_VxD = np.asarray(jax.device_get(heads_drafter.lm_head_weight(config, setup["params"])), np.float32)
    heads_lib.save_lm_head(workdir, lm_head_VxD)
    del setup
    collect_seconds = time.perf_counter() - t_collect
  train, held = data["train"], data["heldout"]
  if np.intersect1d(train["row_N"], held["row_N"]).size:
    raise RuntimeError("training and held-out data share prompts")  # the splits are disjoint by construction
  vocab, d_model = lm_head_VxD.shape
  if top_k > vocab:
    raise checks.UsageError(f"{JOB}.top_k = {top_k} exceeds the target's V = {vocab}")
  lm_head_VxD = jnp.asarray(lm_head_VxD)  # one device copy, shared by training and every evaluation
  if train["features_MxD"].shape[1] != d_model:
    raise checks.UsageError(f"{paths['train']} holds hidden states of D = {train['features_MxD'].shape[1]}, the LM head "
                          f"has D = {d_model}; delete the cached data")
  head_config = heads_lib.lm_head_config(vocab, d_model)
  labels = {"train": heads_lib.head_labels(train, num_heads), "heldout": heads_lib.head_labels(held, num_heads)}
  counts = {split: {"positions": int(labels[split].shape[0]), "prompts": int(len(data[split]["row_N"])),
                    "labels_per_head": (labels[split] >= 0).sum(axis=0).astype(int).tolist()} for split in labels}
  print(f"data: {counts['train']['positions']} training positions ({counts['train']['prompts']} prompts), "
        f"{counts['heldout']['positions']} held-out positions ({counts['heldout']['prompts']} prompts)", flush=True)

  print(f"building the order-{ngram_order} n-gram LM of the training text …", flush=True)
  ngram = heads_lib.build_text_ngram(train, vocab, ngram_order)
  lattice.save_ngram(workdir, ngram, {"target": target_name, "source": "training text (prompts + target samples)",
                                      "num_tokens": int(np.sum(train["length_N"]))})
  ngram_nll = heads_lib.ngram_heldout_nll(ngram, held)
  contexts = heads_lib.text_contexts(held, num_heads, ngram_order - 1, ngram.bos)
  evaluate = lambda heads: heads_lib.evaluate_heads(heads, lm_head_VxD, head_config, held["features_MxD"],
                                                    labels["heldout"], chunk=eval_chunk, ngram=ngram,
                                                    contexts_MxHxC=contexts, top_k=top_k, lm_weight=lm_weight,
                                                    progress=progress)
  init = heads_drafter.init_heads(d_model, num_heads, jax.random.key(0))  # W2 = 0: the target's next-token head
  before = evaluate(init)
  print(f"held-out before training (each head = the target's next-token head): CE {before['ce']:.4f}, top-1 "
        f"{before['top1']:.4f}", flush=True)
  try:
    heads, result = heads_lib.train_heads(
        train["features_MxD"], labels["train"], lm_head_VxD, target_config=head_config, workdir=workdir,
        num_steps=num_steps, batch_size=batch_size, seed=seed, heldout=(held["features_MxD"], labels["heldout"]),
        eval_every=eval_every, optimizer=opt, checkpoint_every=checkpoint_every, max_to_keep=max_to_keep,
        progress=progress, stop_after=stop_after)
  except ValueError as e:
    raise checks.UsageError(str(e)) from None
  after = evaluate(heads)
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  report = {"heldout_before": before, "heldout_after": after, "ngram_heldout_nll": ngram_nll,
            "ngram_heldout_ppl": float(math.exp(ngram_nll))}
  heads_lib.save_heads(workdir, heads, {"target": target_name, "temperature": float(temperature),
                                        "steps": int(result.state.step), "heldout_ce": after["ce"],
                                        "heldout_top1_per_head": after["top1_per_head"], "data": counts})
  summary = {
      **report, "data": counts, "final_loss": rows[-1]["loss"] if rows else None, "steps": int(result.state.step),
      "resumed_from": result.resumed_from, "data_cached": cached, "seconds": time.perf_counter() - t0,
      "collect_seconds": collect_seconds, "train_seconds": result.seconds,
      "train_seconds_total": rows[-1]["seconds_total"] if rows and "seconds_total" in rows[-1] else None,
      "peak_rss_gb": runtime.peak_rss_gb(), "device": jax.devices()[0].platform, "d_model": int(d_model),
      "vocab_size": int(vocab), "ngram_num": [int(t.key_hash_M.shape[0]) for t in ngram.tables],
      **settings, **info,
  }
  (workdir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  print(f"held-out top-1 per head {['%.3f' % a for a in after['top1_per_head']]} (before "
        f"{['%.3f' % a for a in before['top1_per_head']]}), CE {before['ce']:.3f} -> {after['ce']:.3f}; n-gram "
        f"rescored top-1 {after['top1_rescored']:.3f}; outputs in {workdir}", flush=True)
  return summary

