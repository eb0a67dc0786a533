"""The DistillSpec training job (gin: ``distill_job.*``): a frozen target, a drafter distilled toward it with a
token-level divergence (:mod:`blockspec_jax.train.distill`) by the generic trainer
(:mod:`blockspec_jax.train.trainer`).

    python -m blockspec_jax.train --gin_file gin/train/distill_smoke.gin    (random tiny models, seconds)

Outputs in the workdir: ``metrics.jsonl`` (a line per step), ``checkpoints/`` (resumed from when present: re-running
the command continues a stopped run), ``loss.png`` (with matplotlib) and, at the end, ``metrics.json``:
``heldout_tv_before``, ``heldout_tv_after`` (mean total variation drafter vs target on the held-out prompts'
generated positions; ``heldout_tv_before_by_offset`` / ``heldout_tv_after_by_offset``: the same by offset into the
continuation, 16 a bin), ``final_loss``, ``steps``, ``seconds`` and the settings. Real models also write
``drafter.json`` (so ``blockspec_jax.sources.load_model(workdir)`` loads the trained drafter) and the prompt files.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import gin
import jax

from blockspec_jax import checks
from blockspec_jax import methods
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.train import distill, divergences, job_setup, params as params_lib, pools, recipe as recipe_lib
from blockspec_jax.train import trainer
from blockspec_jax.train.configurables import make_optimizer

__all__ = ["DistillSettings", "distill_job"]

JOB = "distill_job"


@gin.configurable(JOB)
@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillSettings(job_setup.PairSettings):
  """``distill_job``'s settings (gin: ``distill_job.*``); constructing them checks them, loading no model. Two kinds
  of job:

  * random tiny models (smoke): ``target_config`` / ``drafter_config`` (``@tiny_decoder()``), random parameters
    (``target_seed`` / ``drafter_seed``), ``num_prompts`` random prompts of ``prompt_len`` tokens split by
    ``heldout_fraction``;
  * real models: ``target`` (a model name or path) and ``drafter`` (``@drafter_recipe()``: base model, kept layers,
    LoRA or trainable subset); held-out prompts = ``heldout_prompts`` (the shipped file: every category), training
    prompts = ``train_prompts_per_task`` per category from the same packages, disjoint from the held-out ones
    (item, math template and text); chat-templated when ``chat``; prompts longer than ``max_prompt_len`` tokens are
    left out of training (a held-out one is an error). The workdir gets ``drafter.json``, so
    ``blockspec_jax.sources.load_model(workdir)`` loads the trained drafter.

  ``eval_every``: the held-out TV every this many steps too (``eval_heldout_tv`` in ``metrics.jsonl`` and
  ``loss.png``; 0: only before and after). The optimizer is gin's ``make_optimizer`` (``total_steps`` =
  ``num_steps``).
  """
  JOB = JOB
  MODELS_HINT = "{job}.target (a model name) and {job}.drafter (@drafter_recipe())"
  INTS = (("num_prompts", 2), ("prompt_len", 1), ("max_new_tokens", 1), ("batch_size", 1), ("num_steps", 1),
          ("checkpoint_every", 1), ("max_to_keep", 1), ("train_prompts_per_task", 1), ("max_prompt_len", 1),
          ("eval_every", 0))

  source: str = "fixed"
  """The training data's source (``distill.SOURCES``: the target's fixed continuations, on-policy drafter samples,
  or a mix)."""
  on_policy_fraction: float = 0.5
  """The mixed source's fraction of on-policy rows."""
  divergence: str = "fkl"
  """The token-level divergence (``divergences.DIVERGENCES``)."""
  temperature: float = 1.0
  """The divergence's temperature."""
  sample_temperature: float = 1.0
  """The decoding temperature (continuations and the held-out TV)."""
  beta: float = 0.5
  """JSD's mixing weight."""
  loss_normalization: str = "sequence"
  """How the loss averages over a batch (``divergences.NORMALIZATIONS``): ``"sequence"``, DistillSpec's mean per
  continuation, then over continuations; ``"token"``, every position of the batch weighs the same (the only choice
  before 2026-11-28; the gin files of the runs reported until then set it, so they reproduce those figures)."""
  trainable_layers: tuple | None = None
  """Random tiny models: None trains the whole drafter, a list of layer indices those layers only (the rest,
  embeddings and head included, frozen)."""
  init_from: str | None = None
  """The work directory of an earlier real distillation run with the same drafter recipe (``<dir>@<step>`` for a
  kept step other than its newest): training starts from its trained parameters with a fresh optimizer (a new
  schedule, another divergence or batch), and the held-out TV "before" is theirs. A resume of this run's own
  checkpoints takes precedence over it."""
  sample_batch_size: int | None = None
  """Rows per batch when the target samples the fixed continuations (None: ``batch_size``; the samples' law does
  not depend on it, only the cost: the Qwen 1.5B target on 2 CPU cores samples a row in 4.3 s at 16 rows a batch,
  7.4 s at 2)."""
  reuse_samples: str | None = None
  """Another run's work directory (or its ``samples.npz``) made with the same target and sampling settings: its
  continuations of the prompts both runs have are taken rather than sampled again (``distill.make_distill_data``)."""

  def check(self) -> None:
    if self.sample_batch_size is None:
      object.__setattr__(self, "sample_batch_size", self.batch_size)
    self.check_int("sample_batch_size", 1)
    self.check_models_given()
    if self.real:
      if not isinstance(self.drafter, recipe_lib.DrafterRecipe):
        raise checks.UsageError(f"{JOB}.drafter must be a drafter recipe (@drafter_recipe()), got {self.drafter!r}")
      methods.check_settings(dtype=self.dtype, models=(self.target, self.drafter.base))
    if self.loss_normalization not in divergences.NORMALIZATIONS:
      raise checks.UsageError(f"{self.name('loss_normalization')} = {self.loss_normalization!r} is not one of "
                              f"{', '.join(map(repr, divergences.NORMALIZATIONS))} (token: every position of the batch "
                              "weighs the same; sequence: DistillSpec's mean per sequence, then over sequences)")
    with job_setup.usage_errors():
      divergences.check_divergence(self.divergence, self.beta)
      divergences.check_temperature(self.temperature)
      if self.source not in distill.SOURCES:
        raise ValueError(f"unknown data source {self.source!r}; known: {', '.join(distill.SOURCES)}")
      self.build_optimizer()
      if not self.real:
        distill.check_pair(self.target_config, self.drafter_config)
    if self.init_from is not None:
      if not self.real:
        raise checks.UsageError(f"{JOB}.init_from starts from an earlier real run (a drafter recipe's work "
                                "directory); the random tiny-model job has none")
      self.init_spec()

  def build_optimizer(self):
    """gin's ``make_optimizer`` with ``total_steps`` = ``num_steps``."""
    return make_optimizer(total_steps=self.num_steps)

  def init_spec(self) -> tuple[str, int | None] | None:
    """``(workdir, step)`` of ``init_from`` (``<dir>[@<step>]``): a drafter training run's work directory whose
    recipe is this job's; None without ``init_from``."""
    if self.init_from is None:
      return None
    spec = sources.trained_run_spec(self.init_from)
    if spec is None or spec[1] == "init":
      raise checks.UsageError(f"{JOB}.init_from = {self.init_from!r} is not the work directory of a drafter "
                              "training run (one with drafter.json and checkpoints), optionally with @<step>")
    saved = recipe_lib.read_recipe(spec[0])
    if saved != self.drafter:
      raise checks.UsageError(f"{JOB}.init_from = {self.init_from!r} was trained with another drafter recipe "
                              f"({saved.to_json()}) than this job's ({self.drafter.to_json()})")
    return spec


def _random_models(s: DistillSettings) -> tuple[job_setup.Setup, recipe_lib.DrafterParts]:
  setup = job_setup.random_setup(s, drafter=True, split=False)
  if s.trainable_layers is None:
    parts = recipe_lib.DrafterParts(trainable=setup.drafter_params, frozen={}, assemble=params_lib.merge)
  else:
    trainable, frozen = params_lib.partition(setup.drafter_params, params_lib.layers_trainable(s.trainable_layers))
    parts = recipe_lib.DrafterParts(trainable=trainable, frozen=frozen, assemble=params_lib.merge)
  return setup, parts


def _real_models(workdir: pathlib.Path, s: DistillSettings) -> tuple[job_setup.Setup, recipe_lib.DrafterParts]:
  """The target, the drafter derived from the recipe's base (its trainable / frozen parts) and the prompts; writes
  the run's ``drafter.json``."""
  from blockspec_jax.models import hub
  recipe = s.drafter
  rows = job_setup.real_prompt_rows(workdir, s)
  t0 = time.perf_counter()
  target = hub.load_model(s.target, s.dtype, weights=s.target_weights)
  same = recipe.base == s.target and s.target_weights == "dequantized"
  base = target if same else hub.load_model(recipe.base, s.dtype)
  sources.check_pair(target, base)
  drafter_config, drafter_params = recipe.derive(base.config, base.params["params"])
  del base
  parts = recipe.split(drafter_config, drafter_params)
  print(f"loaded {s.target} (target) and {recipe.base} (drafter base, {drafter_config.num_layers} layers) in "
        f"{time.perf_counter() - t0:.1f} s; trainable parameters {params_lib.count_params(parts.trainable):,}",
        flush=True)
  prompts_NxP, prompt_len_N, split, pool_info = job_setup.encode_rows(target, rows, s)
  recipe_lib.save_recipe(workdir, recipe)
  info = {"target": s.target, "drafter_recipe": recipe.to_json(), "dtype": s.dtype, **s.weights_meta(),
          **pool_info}
  setup = job_setup.Setup(target_config=target.config, target_params=target.params["params"],
                          drafter_config=drafter_config, drafter_params=None, prompts_NxP=prompts_NxP,
                          prompt_len_N=prompt_len_N, split=split, stop_ids=target.stop_ids,
                          target_name=str(s.target), drafter_name=recipe.base, info=info)
  return setup, parts


def _init_from(workdir: pathlib.Path, s: DistillSettings, setup: job_setup.Setup,
               parts: recipe_lib.DrafterParts) -> recipe_lib.DrafterParts:
  """``parts`` with its trainable tree replaced by ``init_from``'s checkpoint (recorded in ``setup.info`` and the
  run's ``drafter.json``)."""
  spec_dir, step = s.init_spec()
  try:
    trainable, step = recipe_lib.restore_trainable(spec_dir, parts.trainable, step)
  except (FileNotFoundError, ValueError) as e:
    raise checks.UsageError(f"{JOB}.init_from = {spec_dir!r}: {e}") from None
  label = f"{pathlib.Path(spec_dir).resolve()}@{step}"
  print(f"starting from {label} (its trained parameters, a fresh optimizer)", flush=True)
  setup.info["init_from"] = label
  recipe_lib.save_init_from(workdir, spec_dir, step)
  return dataclasses.replace(parts, trainable=trainable)


def _data(workdir: pathlib.Path, s: DistillSettings, setup: job_setup.Setup, mesh=None):
  with job_setup.usage_errors():
    return distill.make_distill_data(
        setup.target_config, setup.target_params, setup.drafter_config, setup.prompts_NxP, setup.prompt_len_N,
        batch_size=s.batch_size, max_new_tokens=s.max_new_tokens, sample_temperature=s.sample_temperature,
        source=s.source, on_policy_fraction=s.on_policy_fraction, heldout_fraction=s.heldout_fraction, seed=s.seed,
        stop_ids=setup.stop_ids, split=setup.split, progress=s.progress and s.real,
        samples_path=pools.samples_path(workdir),
        samples_meta=pools.samples_meta(s.target if s.real else None, s.target_seed, s.weights_meta()),
        sample_batch_size=s.sample_batch_size, reuse_samples=s.reuse_samples, mesh=mesh)


def _train(workdir: pathlib.Path, s: DistillSettings, setup: job_setup.Setup, parts: recipe_lib.DrafterParts,
           data) -> tuple:
  """Held-out TV before, the training run, held-out TV after (the last step's evaluation when there was one; None
  for a run stopped early by ``stop_after``)."""
  loss_fn = distill.DistillLoss(setup.target_config, setup.drafter_config, s.divergence, s.temperature, s.beta,
                                assemble=parts.assemble, normalization=s.loss_normalization)
  report = lambda trainable: distill.heldout_tv_report(parts.assemble(trainable, parts.frozen), setup.target_params,
                                                        data)
  tv_before = report(parts.trainable)
  print(f"held-out TV before training: {tv_before.mean:.4f}", flush=True)
  last_eval = {}  # the last evaluation's full report, so the final one is not computed twice

  def eval_fn(step, trainable):
    last_eval.update(step=step, report=report(trainable))
    return {"heldout_tv": last_eval["report"].mean}

  result = trainer.fit(loss_fn=loss_fn, optimizer=s.build_optimizer(), trainable=parts.trainable,
                       frozen={"target": setup.target_params, "drafter": parts.frozen},
                       batch_fn=distill.make_batch_fn(data, parts.frozen, parts.assemble), key=jax.random.key(s.seed),
                       workdir=workdir, loop=s.loop(), eval_fn=eval_fn if s.eval_every else None,
                       label="distill train step")
  if int(result.state.step) < s.num_steps:
    tv_after = None  # stopped early (stop_after): as if killed
  elif last_eval.get("step") == int(result.state.step):
    tv_after = last_eval["report"]  # measured on the final parameters by the last step's evaluation
  else:
    tv_after = report(result.state.trainable)
  return tv_before, result, tv_after


def run(workdir, settings: DistillSettings) -> dict:
  """DistillSpec with ``settings``; returns the ``metrics.json`` summary (see the module docstring)."""
  t0 = time.perf_counter()
  s = settings
  workdir = pathlib.Path(workdir)
  mesh = s.train_mesh()
  setup, parts = _real_models(workdir, s) if s.real else _random_models(s)
  if s.init_from is not None:
    parts = _init_from(workdir, s, setup, parts)
  data = _data(workdir, s, setup, mesh)
  tv_before, result, tv_after = _train(workdir, s, setup, parts, data)
  if tv_after is None:  # stopped early (stop_after): as if killed, nothing but the checkpoints and metrics.jsonl
    return {"stopped_after": int(result.state.step), "resumed_from": result.resumed_from}
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  main = runtime.is_main_process()  # a multi-host run: every process computes the same summary, process 0 writes it
  if main:
    trainer.plot_losses(rows, workdir / "loss.png",  # the held-out curve from step 0 to the last
                        points={"eval_heldout_tv": [(0, tv_before.mean), (int(result.state.step), tv_after.mean)]})
  summary = {
      "heldout_tv_before": tv_before.mean, "heldout_tv_after": tv_after.mean,
      # by offset into the continuation (16 tokens a bin): where the drafter moved toward the target
      "heldout_tv_before_by_offset": tv_before.by_offset(), "heldout_tv_after_by_offset": tv_after.by_offset(),
      "final_loss": job_setup.final_loss(rows), "final_train_tv": rows[-1]["tv"] if rows else None,
      "steps": int(result.state.step), "resumed_from": result.resumed_from,
      "seconds": time.perf_counter() - t0, "train_seconds": result.seconds,
      "train_seconds_total": job_setup.seconds_total(rows),
      "num_train_prompts": int(len(data.train_idx)), "num_heldout_prompts": int(len(data.heldout_idx)),
      "heldout_positions": int(data.fixed_mask_NxT[data.heldout_idx].sum()),
      "divergence": s.divergence, "loss_normalization": s.loss_normalization, "source": s.source,
      "temperature": s.temperature,
      "sample_temperature": s.sample_temperature, "batch_size": s.batch_size, "max_new_tokens": s.max_new_tokens,
      "sample_batch_size": s.sample_batch_size,
      "trainable_params": params_lib.count_params(result.state.trainable),
      **job_setup.machine(s),
      **setup.info,
  }
  if main:
    (workdir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def distill_job(workdir, **overrides) -> dict:
  """DistillSpec: :class:`DistillSettings` from gin (``distill_job.*``) and ``overrides``, checked before any model
  loads, then :func:`run`; returns the ``metrics.json`` summary."""
  return run(workdir, DistillSettings(**overrides))
