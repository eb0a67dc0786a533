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

import dataclasses
import json
import math
import pathlib
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import checks
from blockspec_jax import sampling
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.drafters import heads as heads_drafter, lattice
from blockspec_jax.train import heads as heads_lib, job_setup, pools, trainer

__all__ = ["HeadsSettings", "heads_job"]

JOB = "heads_job"


@gin.configurable(JOB)
@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadsSettings(job_setup.JobSettings):
  """``heads_job``'s settings (gin: ``heads_job.*``); constructing them checks them, loading no model.

  Target: a random tiny one (``target_config``, ``@tiny_decoder()``, parameters of ``target_seed``; ``num_prompts``
  random prompts of ``prompt_len`` ids split by ``heldout_fraction``) or a real one (``target``: a registry name or
  path, anything ``sources.load_model`` takes, in ``dtype``; held-out prompts = ``heldout_prompts``, training prompts =
  ``train_prompts_per_task`` per category, chat-templated when ``chat``, those longer than ``max_prompt_len`` left
  out).

  Data: ``max_new_tokens`` target tokens per prompt at ``temperature`` (``collect_batch_size`` prompts at a time),
  the hidden states along them. Training: ``num_heads`` heads, ``num_steps`` steps of ``batch_size`` positions
  (each with ``num_heads`` labels), ``trainer.make_optimizer(optimizer, learning_rate, schedule, warmup_steps,
  num_steps, weight_decay, clip_norm)``, checkpoints every ``checkpoint_every`` steps, held-out CE / top-1 every
  ``eval_every`` steps (0: before and after only).
  """
  JOB = JOB
  INTS = (("num_prompts", 2), ("prompt_len", 1), ("train_prompts_per_task", 1), ("max_prompt_len", 1),
          ("max_new_tokens", 1), ("collect_batch_size", 1), ("num_heads", 1), ("num_steps", 1), ("batch_size", 1),
          ("warmup_steps", 0), ("ngram_order", 1), ("top_k", 1), ("eval_chunk", 1), ("checkpoint_every", 1),
          ("max_to_keep", 1), ("eval_every", 0), ("seed", 0), ("target_seed", 0))

  num_prompts: int = 64
  heldout_fraction: float = 0.25
  max_new_tokens: int = 32
  num_steps: int = 200
  batch_size: int = 64
  temperature: float = 1.0
  """The target's sampling temperature for the continuations."""
  collect_batch_size: int = 4
  """Prompts continued at a time when collecting the hidden states."""
  num_heads: int = 4
  """Heads trained (head ``k`` predicts the token ``k + 1`` positions ahead)."""
  optimizer: str = "adamw"
  """``trainer.make_optimizer``'s optimizer name."""
  learning_rate: float = 1e-3
  """Peak learning rate (> 0)."""
  schedule: str = "cosine"
  """``trainer.make_optimizer``'s schedule."""
  warmup_steps: int = 0
  """Warmup steps of the schedule."""
  weight_decay: float = 0.0
  """Weight decay (>= 0)."""
  clip_norm: float | None = 1.0
  """Global gradient-norm clip (None: none)."""
  ngram_order: int = 3
  """The order of the training text's n-gram LM."""
  top_k: int = 16
  """Candidates per head rescored by the n-gram LM in the held-out report."""
  lm_weight: float = 1.0
  """The n-gram LM's weight in the rescoring."""
  eval_chunk: int = 64
  """Positions per evaluation call."""
  dry_run: bool = False
  """Check the settings (no model loaded, nothing written) and return them."""

  def check(self) -> None:
    if self.real == (self.target_config is not None):
      raise checks.UsageError(f"give either {JOB}.target (a model name or path) or {JOB}.target_config (a random "
                              "tiny target, @tiny_decoder()), not both")
    if self.real:
      self.check_model_names("target")
    else:
      if not isinstance(self.target_config, decoder_lib.DecoderConfig):
        raise checks.UsageError(f"{JOB}.target_config must be a DecoderConfig (@tiny_decoder()), got "
                                f"{self.target_config!r}")
      self.check_heldout_fraction()
      self.check_top_k(self.target_config.vocab_size)
    pools.check_number(self.lm_weight, "lm_weight", job=JOB)
    with job_setup.usage_errors():
      sampling.Sampler(self.temperature)
      self.build_optimizer()

  def check_top_k(self, vocab: int) -> None:
    if self.top_k > vocab:
      raise checks.UsageError(f"{JOB}.top_k = {self.top_k} exceeds the target's V = {vocab}")

  def build_optimizer(self):
    """``trainer.make_optimizer`` of the optimizer settings (``total_steps`` = ``num_steps``)."""
    return trainer.make_optimizer(self.optimizer,
                                  pools.check_number(self.learning_rate, "learning_rate", strict=True, job=JOB),
                                  self.schedule, self.warmup_steps, self.num_steps,
                                  pools.check_number(self.weight_decay, "weight_decay", job=JOB), self.clip_norm)

  def meta(self) -> dict:
    """What decides the hidden states (recorded with the cached files)."""
    return {"target": pools.model_name(self.target, self.target_config, self.target_seed),
            "temperature": float(self.temperature), "max_new_tokens": self.max_new_tokens, "seed": self.seed,
            "dtype": self.dtype, **self.weights_meta(),
            "target_config": None if self.real else repr(self.target_config),
            **self.prompt_meta()}

  def record(self) -> dict:
    """The settings as ``metrics.json`` (and a dry run) records them."""
    return {**self.meta(), "num_heads": self.num_heads, "collect_batch_size": self.collect_batch_size,
            "num_steps": self.num_steps, "batch_size": self.batch_size, "optimizer": self.optimizer,
            "learning_rate": float(self.learning_rate), "schedule": self.schedule, "warmup_steps": self.warmup_steps,
            "weight_decay": float(self.weight_decay), "clip_norm": self.clip_norm, "ngram_order": self.ngram_order,
            "top_k": self.top_k, "lm_weight": float(self.lm_weight)}


def _paths(workdir: pathlib.Path) -> dict:
  return {"train": workdir / "hidden_train.npz", "heldout": workdir / "hidden_heldout.npz"}


def _collect(workdir: pathlib.Path, s: HeadsSettings, data: dict) -> tuple[np.ndarray, dict]:
  """The target loaded, the missing splits' hidden states collected and saved, its LM head saved; returns the LM head
  ``[V, D]`` and the setup's ``info``."""
  meta, paths = s.meta(), _paths(workdir)
  setup = job_setup.setup_models(workdir, s, drafter=False, split=True, describe=lambda model, _, seconds: (
      f"loaded {s.target} (target, D = {model.config.d_model}, V = {model.config.vocab_size}) in {seconds:.1f} s"))
  config = setup.target_config

  def collect(split, rows):
    print(f"collecting {split} data: {len(rows)} prompts, {s.max_new_tokens} target tokens each at "
          f"T = {s.temperature:g}, and the target's hidden states", flush=True)
    return heads_lib.collect_hidden(
        config, setup.target_params, setup.prompts_NxP[rows], setup.prompt_len_N[rows],
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, key=jax.random.fold_in(jax.random.key(s.seed), 1),
        batch_size=s.collect_batch_size, progress=s.progress, rows=rows, stop_ids=tuple(setup.stop_ids),
        mesh=s.train_mesh())

  pools.collect_missing(data, setup.split, collect, lambda split, hidden: heads_lib.save_hidden(
      paths[split], hidden, {**meta, "split": split, "vocab_size": config.vocab_size, "d_model": config.d_model}))
  lm_head_VxD = np.asarray(jax.device_get(heads_drafter.lm_head_weight(config, setup.target_params)), np.float32)
  heads_lib.save_lm_head(workdir, lm_head_VxD)
  return lm_head_VxD, setup.info


def _data(workdir: pathlib.Path, s: HeadsSettings) -> tuple[dict, np.ndarray, bool, dict, float]:
  """Both splits' hidden states and the LM head (read from the cache, or collected), whether they were all cached,
  the setup's ``info`` and the collection's seconds."""
  meta, paths = s.meta(), _paths(workdir)
  redo = "the hidden_*.npz files, lm_head.* and checkpoints/ to collect again"
  data = {split: pools.read_cached(path, {**meta, "split": split}, heads_lib.load_hidden, redo=redo,
                                   compare_saved_keys=False)  # the files also record V and D
          for split, path in paths.items()}
  with job_setup.usage_errors():
    lm_head_VxD = heads_lib.load_lm_head(workdir)
  if all(v is not None for v in data.values()) and lm_head_VxD is not None:
    print(f"hidden states read from {paths['train'].name}, {paths['heldout'].name} and {heads_lib.LM_HEAD_NPY} (no "
          "model loaded)", flush=True)
    return data, lm_head_VxD, True, {}, 0.0
  t_collect = time.perf_counter()
  lm_head_VxD, info = _collect(workdir, s, data)
  return data, lm_head_VxD, False, info, time.perf_counter() - t_collect


def _labels(workdir: pathlib.Path, s: HeadsSettings, data: dict, lm_head_VxD: np.ndarray) -> tuple[dict, dict]:
  """Every split's per-head labels and their counts (printed), once the data is checked against the LM head."""
  train, held = data["train"], data["heldout"]
  if np.intersect1d(train["row_N"], held["row_N"]).size:
    raise RuntimeError("training and held-out data share prompts")  # the splits are disjoint by construction
  vocab, d_model = lm_head_VxD.shape
  s.check_top_k(vocab)
  if train["features_MxD"].shape[1] != d_model:
    raise checks.UsageError(f"{_paths(workdir)['train']} holds hidden states of D = {train['features_MxD'].shape[1]}, "
                            f"the LM head has D = {d_model}; delete the cached data")
  labels = {"train": heads_lib.head_labels(train, s.num_heads), "heldout": heads_lib.head_labels(held, s.num_heads)}
  counts = {split: {"positions": int(labels[split].shape[0]), "prompts": int(len(data[split]["row_N"])),
                    "labels_per_head": (labels[split] >= 0).sum(axis=0).astype(int).tolist()} for split in labels}
  print(f"data: {counts['train']['positions']} training positions ({counts['train']['prompts']} prompts), "
        f"{counts['heldout']['positions']} held-out positions ({counts['heldout']['prompts']} prompts)", flush=True)
  return labels, counts


def _ngram(workdir: pathlib.Path, s: HeadsSettings, data: dict, vocab: int):
  """The training text's n-gram LM (saved), its held-out NLL and the held-out contexts of every head."""
  train, held = data["train"], data["heldout"]
  print(f"building the order-{s.ngram_order} n-gram LM of the training text …", flush=True)
  ngram = heads_lib.build_text_ngram(train, vocab, s.ngram_order)
  lattice.save_ngram(workdir, ngram, {"target": s.meta()["target"],
                                      "source": "training text (prompts + target samples)",
                                      "num_tokens": int(np.sum(train["length_N"]))})
  ngram_nll = heads_lib.ngram_heldout_nll(ngram, held)
  contexts = heads_lib.text_contexts(held, s.num_heads, s.ngram_order - 1, ngram.bos)
  return ngram, ngram_nll, contexts


def _train(workdir: pathlib.Path, s: HeadsSettings, data: dict, labels: dict, lm_head_VxD, head_config) -> tuple:
  try:
    return heads_lib.train_heads(
        data["train"]["features_MxD"], labels["train"], lm_head_VxD, target_config=head_config, workdir=workdir,
        loop=s.loop(), batch_size=s.batch_size, seed=s.seed,
        heldout=(data["heldout"]["features_MxD"], labels["heldout"]), optimizer=s.build_optimizer())
  except ValueError as e:
    raise checks.UsageError(str(e)) from None


def run(workdir, settings: HeadsSettings) -> dict:
  """BPD heads on a frozen target with ``settings``; returns the ``metrics.json`` summary (see the module docstring
  for the outputs)."""
  t0 = time.perf_counter()
  s = settings
  if s.dry_run:
    return {"dry_run": True, **s.record()}
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  data, lm_head_VxD, cached, info, collect_seconds = _data(workdir, s)
  labels, counts = _labels(workdir, s, data, lm_head_VxD)
  vocab, d_model = lm_head_VxD.shape
  lm_head_VxD = jnp.asarray(lm_head_VxD)  # one device copy, shared by training and every evaluation
  head_config = heads_lib.lm_head_config(vocab, d_model)
  ngram, ngram_nll, contexts = _ngram(workdir, s, data, vocab)
  evaluate = lambda heads: heads_lib.evaluate_heads(heads, lm_head_VxD, head_config, data["heldout"]["features_MxD"],
                                                    labels["heldout"], chunk=s.eval_chunk, ngram=ngram,
                                                    contexts_MxHxC=contexts, top_k=s.top_k, lm_weight=s.lm_weight,
                                                    progress=s.progress)
  init = heads_drafter.init_heads(d_model, s.num_heads, jax.random.key(0))  # W2 = 0: the target's next-token head
  before = evaluate(init)
  print(f"held-out before training (each head = the target's next-token head): CE {before['ce']:.4f}, top-1 "
        f"{before['top1']:.4f}", flush=True)
  heads, result = _train(workdir, s, data, labels, lm_head_VxD, head_config)
  after = evaluate(heads)
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  report = {"heldout_before": before, "heldout_after": after, "ngram_heldout_nll": ngram_nll,
            "ngram_heldout_ppl": float(math.exp(ngram_nll))}
  heads_lib.save_heads(workdir, heads, {"target": s.meta()["target"], "temperature": float(s.temperature),
                                        "steps": int(result.state.step), "heldout_ce": after["ce"],
                                        "heldout_top1_per_head": after["top1_per_head"], "data": counts})
  summary = {
      **report, "data": counts, "final_loss": job_setup.final_loss(rows), "steps": int(result.state.step),
      "resumed_from": result.resumed_from, "data_cached": cached, "seconds": time.perf_counter() - t0,
      "collect_seconds": collect_seconds, "train_seconds": result.seconds,
      "train_seconds_total": job_setup.seconds_total(rows), **job_setup.machine(s), "d_model": int(d_model),
      "vocab_size": int(vocab), "ngram_num": [int(t.key_hash_M.shape[0]) for t in ngram.tables],
      **s.record(), **info,
  }
  (workdir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  print(f"held-out top-1 per head {['%.3f' % a for a in after['top1_per_head']]} (before "
        f"{['%.3f' % a for a in before['top1_per_head']]}), CE {before['ce']:.3f} -> {after['ce']:.3f}; n-gram "
        f"rescored top-1 {after['top1_rescored']:.3f}; outputs in {workdir}", flush=True)
  return summary


def heads_job(workdir, **overrides) -> dict:
  """BPD heads on a frozen target: :class:`HeadsSettings` from gin (``heads_job.*``) and ``overrides``, checked
  before any model loads, then :func:`run`; returns the ``metrics.json`` summary (see the module docstring for the
  outputs)."""
  return run(workdir, HeadsSettings(**overrides))
