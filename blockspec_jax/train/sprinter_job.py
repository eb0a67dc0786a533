"""SPRINTER's verifier-head training job (gin: ``sprinter_job.*``; :mod:`blockspec_jax.train.sprinter` does the
work).

    python -m blockspec_jax.train --gin_file gin/train/sprinter_smoke.gin    (random tiny models, seconds)

Labels (``label_set``): the drafter continues every prompt (``max_new_tokens`` at ``temperature``,
``collect_batch_size`` prompts at a time); each generated token gets the drafter's hidden state that produced it and
``1[q ≤ p]`` (``"sampled"``; ``"official"``: the paper's code's greedy SD-like trajectory,
``sprinter.collect_official_labels``). They are cached in
``labels_train.npz`` / ``labels_heldout.npz``: a rerun (resume) reads them and loads no model. Head: ``num_steps``
steps of ``batch_size`` examples (optimizer: gin's ``make_optimizer``, ``total_steps`` = ``num_steps``), checkpoints
every ``checkpoint_every`` steps (resumed from), held-out BCE and accuracy every ``eval_every`` steps (0: only at the
end). Outputs: ``head.json`` + ``head.npz`` (``sprinter.load_head(workdir)``), ``metrics.json`` (held-out report per
threshold in ``thresholds``, label counts, seconds, peak RSS), ``metrics.jsonl``, ``loss.png``; real models also
``prompts_heldout.jsonl`` / ``prompts_train.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import gin
import jax
import numpy as np

from blockspec_jax import checks
from blockspec_jax import sampling
from blockspec_jax.train import distill, job_setup, pools, sprinter as sprinter_lib, trainer
from blockspec_jax.train.configurables import make_optimizer

__all__ = ["SprinterSettings", "sprinter_job"]

JOB = "sprinter_job"


@gin.configurable(JOB)
@dataclasses.dataclass(frozen=True, kw_only=True)
class SprinterSettings(job_setup.PairSettings):
  """``sprinter_job``'s settings (gin: ``sprinter_job.*``); constructing them checks them, loading no model.

  Models, as in ``distill_job``: random tiny ones (``target_config`` / ``drafter_config``, ``@tiny_decoder()``,
  random parameters of ``target_seed`` / ``drafter_seed``; ``num_prompts`` random prompts of ``prompt_len`` tokens
  split by ``heldout_fraction``) or real ones (``target`` and ``drafter``: model names, checkpoint paths or a
  drafter training run's workdir, anything ``sources.load_model`` takes; held-out prompts = ``heldout_prompts``,
  training prompts = ``train_prompts_per_task`` per category, disjoint from them; both written to the workdir).
  ``max_new_tokens`` drafter tokens per prompt at ``temperature`` give the labels; the head trains ``num_steps``
  steps of ``batch_size`` examples with held-out BCE and accuracy every ``eval_every`` steps (0: only at the end).
  """
  JOB = JOB
  INTS = (("num_prompts", 2), ("prompt_len", 1), ("max_new_tokens", 1), ("collect_batch_size", 1),
          ("batch_size", 1), ("num_steps", 1), ("checkpoint_every", 1), ("max_to_keep", 1),
          ("train_prompts_per_task", 1), ("max_prompt_len", 1), ("eval_every", 0))

  num_prompts: int = 64
  heldout_fraction: float = 0.25
  num_steps: int = 400
  batch_size: int = 256
  checkpoint_every: int = 100
  temperature: float = 1.0
  """The drafter's sampling temperature when collecting the labels (``"official"``: the laws' temperature)."""
  label_set: str = "sampled"
  """Which labels the head learns (``sprinter.LABEL_SETS``): ``"sampled"``, the drafter's sampled continuations,
  each token labelled ``1[q(x) ≤ p(x)]`` (``sprinter.collect_labels``); ``"official"``, the paper's code's: the
  drafter's greedy token labelled, the context continued with it when its label is 1, else with the target's greedy
  token (``sprinter.collect_official_labels``)."""
  collect_batch_size: int = 4
  """Prompts continued at a time when collecting the labels."""
  standardize: bool = True
  """Standardize the features (as in ``sprinter.train_head``)."""
  pos_weight: float | None = None
  """The positive labels' weight in the BCE (None: 1; as in ``sprinter.train_head``)."""
  thresholds: tuple = (0.3, 0.5, 0.7, 0.9)
  """The acceptance thresholds of the held-out report (numbers >= 0)."""
  dry_run: bool = False
  """Check the settings (no model loaded, nothing written) and return them."""

  def check(self) -> None:
    self.check_models_given()
    thresholds = self.thresholds
    thresholds = tuple(thresholds) if isinstance(thresholds, (list, tuple)) else (thresholds,)
    object.__setattr__(self, "thresholds", thresholds)
    if not thresholds or any(isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0
                             for t in thresholds):
      raise checks.UsageError(f"{JOB}.thresholds must be numbers >= 0, got {thresholds!r}")
    pos_weight = self.pos_weight
    if pos_weight is not None and (isinstance(pos_weight, bool) or not isinstance(pos_weight, (int, float))
                                   or not pos_weight > 0):
      raise checks.UsageError(f"{JOB}.pos_weight must be a number > 0 or None, got {pos_weight!r}")
    if self.real:
      self.check_model_names("target", "drafter")
    else:
      self.check_heldout_fraction()
    if self.label_set not in sprinter_lib.LABEL_SETS:
      raise checks.UsageError(f"{JOB}.label_set = {self.label_set!r} is not one of "
                              f"{', '.join(map(repr, sprinter_lib.LABEL_SETS))}")
    with job_setup.usage_errors():
      sampling.Sampler(self.temperature)
      self.build_optimizer()
      if not self.real:
        distill.check_pair(self.target_config, self.drafter_config)

  def build_optimizer(self):
    """gin's ``make_optimizer`` with ``total_steps`` = ``num_steps``."""
    return make_optimizer(total_steps=self.num_steps)

  def meta(self) -> dict:
    """What decides the labels (recorded with the cached label files)."""
    real = self.real
    return {"target": pools.model_name(self.target, self.target_config, self.target_seed),
            "drafter": pools.model_name(self.drafter, self.drafter_config, self.drafter_seed),
            "temperature": float(self.temperature), "label_set": self.label_set,
            "max_new_tokens": self.max_new_tokens, "seed": self.seed,
            "dtype": self.dtype, **self.weights_meta(), "target_config": None if real else repr(self.target_config),
            "drafter_config": None if real else repr(self.drafter_config), **self.prompt_meta()}

  def record(self) -> dict:
    """The settings as ``metrics.json`` (and a dry run) records them."""
    return {**self.meta(), "collect_batch_size": self.collect_batch_size, "num_steps": self.num_steps,
            "batch_size": self.batch_size, "standardize": bool(self.standardize), "pos_weight": self.pos_weight,
            "thresholds": list(self.thresholds)}


def _label_counts(data: dict) -> dict:
  labels_N = data["labels_N"]
  return {"num": int(labels_N.size), "positive": int(labels_N.sum()),
          "positive_rate": float(labels_N.mean()) if labels_N.size else None,
          "prompts": int(np.unique(data["row_N"]).size)}


def _describe(target_model, drafter_model, seconds: float, s: SprinterSettings) -> str:
  return (f"loaded {s.target} (target) and {s.drafter} (drafter, D = {drafter_model.config.d_model}) in "
          f"{seconds:.1f} s")


def _labels(workdir: pathlib.Path, s: SprinterSettings) -> tuple[dict, bool, dict, float]:
  """Both splits' labels (read from the cache, or collected: the models loaded and the missing splits saved), whether
  they were all cached, the setup's ``info`` and the collection's seconds."""
  meta = s.meta()
  paths = {"train": workdir / "labels_train.npz", "heldout": workdir / "labels_heldout.npz"}
  redo = "the labels_*.npz files (and checkpoints/) to collect them again"
  labels = {split: pools.read_cached(path, {**meta, "split": split}, sprinter_lib.load_labels, redo=redo)
            for split, path in paths.items()}
  if all(v is not None for v in labels.values()):
    print(f"labels read from {paths['train'].name} and {paths['heldout'].name} (no model loaded)", flush=True)
    return labels, True, {}, 0.0
  t_collect = time.perf_counter()
  setup = job_setup.setup_models(workdir, s, drafter=True, split=True,
                                 describe=lambda t, d, seconds: _describe(t, d, seconds, s))

  def collect(split, rows):
    if s.label_set == "official":
      print(f"collecting {split} labels as the paper's code does: {len(rows)} prompts, {s.max_new_tokens} greedy "
            f"steps of both models", flush=True)
      return sprinter_lib.collect_official_labels(
          setup.target_config, setup.target_params, setup.drafter_config, setup.drafter_params,
          setup.prompts_NxP[rows], setup.prompt_len_N[rows], max_new_tokens=s.max_new_tokens,
          batch_size=s.collect_batch_size, temperature=s.temperature, progress=s.progress, rows=rows,
          stop_ids=tuple(setup.stop_ids), mesh=s.train_mesh())
    print(f"collecting {split} labels: {len(rows)} prompts, {s.max_new_tokens} drafter tokens each at "
          f"T = {s.temperature:g}", flush=True)
    return sprinter_lib.collect_labels(
        setup.target_config, setup.target_params, setup.drafter_config, setup.drafter_params,
        setup.prompts_NxP[rows], setup.prompt_len_N[rows], max_new_tokens=s.max_new_tokens,
        temperature=s.temperature, key=jax.random.fold_in(jax.random.key(s.seed), 1),
        batch_size=s.collect_batch_size, progress=s.progress, rows=rows, stop_ids=tuple(setup.stop_ids),
        mesh=s.train_mesh())

  pools.collect_missing(labels, setup.split, collect,
                        lambda split, data: sprinter_lib.save_labels(paths[split], data, {**meta, "split": split}))
  return labels, False, setup.info, time.perf_counter() - t_collect


def _train(workdir: pathlib.Path, s: SprinterSettings, train: dict, held: dict) -> tuple:
  try:
    return sprinter_lib.train_head(
        train["features_NxD"], train["labels_N"], workdir=workdir, loop=s.loop(), batch_size=s.batch_size,
        seed=s.seed, heldout=(held["features_NxD"], held["labels_N"]), optimizer=s.build_optimizer(),
        pos_weight=s.pos_weight, standardize=s.standardize)
  except ValueError as e:
    raise checks.UsageError(str(e)) from None


def run(workdir, settings: SprinterSettings) -> dict:
  """Train SPRINTER's verifier head with ``settings``; returns the ``metrics.json`` summary (see the module
  docstring for the outputs)."""
  t0 = time.perf_counter()
  s = settings
  if s.dry_run:
    return {"dry_run": True, **s.record()}
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  labels, cached, info, collect_seconds = _labels(workdir, s)
  train, held = labels["train"], labels["heldout"]
  counts = {split: _label_counts(data) for split, data in labels.items()}
  print(f"labels: {counts['train']['num']} training tokens ({counts['train']['positive_rate']:.3f} acceptable), "
        f"{counts['heldout']['num']} held-out tokens ({counts['heldout']['positive_rate']:.3f} acceptable)",
        flush=True)
  if np.intersect1d(train["row_N"], held["row_N"]).size:
    raise RuntimeError("training and held-out labels share prompts")  # the splits are disjoint by construction
  head, result = _train(workdir, s, train, held)
  report_heldout = sprinter_lib.head_report(head, held["features_NxD"], held["labels_N"], s.thresholds)
  report_train = sprinter_lib.head_report(head, train["features_NxD"], train["labels_N"], s.thresholds)
  held_eval = sprinter_lib.evaluate_head(head, held["features_NxD"], held["labels_N"])
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  d_model = int(train["features_NxD"].shape[1])
  meta = s.meta()
  head_info = {"drafter": meta["drafter"], "target": meta["target"], "temperature": float(s.temperature),
               "d_model": d_model, "max_new_tokens": s.max_new_tokens, "steps": int(result.state.step),
               "standardize": bool(s.standardize), "pos_weight": s.pos_weight, "labels": counts,
               "heldout_bce": held_eval["bce"], "report_heldout": report_heldout}
  sprinter_lib.save_head(workdir, head, head_info)
  summary = {
      "report_heldout": report_heldout, "report_train": report_train, "labels": counts,
      "heldout_bce": held_eval["bce"], "heldout_accuracy": held_eval["accuracy"],
      "final_loss": job_setup.final_loss(rows), "steps": int(result.state.step),
      "resumed_from": result.resumed_from, "labels_cached": cached,
      "seconds": time.perf_counter() - t0, "collect_seconds": collect_seconds, "train_seconds": result.seconds,
      "train_seconds_total": job_setup.seconds_total(rows), **job_setup.machine(s), "d_model": d_model,
      "head_b": float(head["b"]), "head_w_norm": float(np.linalg.norm(np.asarray(head["w_D"], np.float64))),
      **s.record(), **info,
  }
  (workdir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def sprinter_job(workdir, **overrides) -> dict:
  """SPRINTER's verifier head (:mod:`blockspec_jax.train.sprinter`): :class:`SprinterSettings` from gin
  (``sprinter_job.*``) and ``overrides``, checked before any model loads, then :func:`run`; returns the
  ``metrics.json`` summary."""
  return run(workdir, SprinterSettings(**overrides))
