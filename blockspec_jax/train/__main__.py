"""Training jobs: ``python -m blockspec_jax.train --gin_file gin/train/<job>.gin [--gin_param B] [--workdir DIR]``.

Two jobs: DistillSpec (``distill_job``): a frozen target, a drafter distilled toward it with a token-level
divergence (:mod:`blockspec_jax.train.distill`) by the generic trainer (:mod:`blockspec_jax.train.trainer`); and
SPRINTER's verifier head (``sprinter_job``, :mod:`blockspec_jax.train.sprinter`), run when the gin files bind
``sprinter_job.*`` (:func:`selected_job`). Gin is used here only (library modules never import it): ``distill_job.*``
/ ``sprinter_job.*`` bind the job, ``make_optimizer.*`` the optimizer (``total_steps`` defaults to the job's
``num_steps``), and ``<scope>/tiny_decoder.*`` random tiny models (``distill_job.target_config =
@target/tiny_decoder()``).

Outputs in the workdir (default ``results/train/<gin file stem>``): ``config.gin`` (the operative config),
``metrics.jsonl`` (a line per step), ``checkpoints/`` (resumed from when present: re-running the command continues
a stopped run), ``loss.png`` (with matplotlib) and, at the end, ``metrics.json``: ``heldout_tv_before``,
``heldout_tv_after`` (mean total variation drafter vs target on the held-out prompts' generated positions;
``heldout_tv_before_by_offset`` / ``heldout_tv_after_by_offset``: the same by offset into the continuation, 16 a bin),
``final_loss``, ``steps``, ``seconds`` and the settings. ``sprinter_job``'s outputs are listed in its docstring.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time

import gin
import jax
import numpy as np

from blockspec_jax import parallel, sampling
from blockspec_jax import checks as checks_lib
from blockspec_jax import cli
from blockspec_jax import methods
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, divergences, params as params_lib, recipe as recipe_lib, trainer
from blockspec_jax.train import pools, sprinter as sprinter_lib

make_optimizer = gin.external_configurable(trainer.make_optimizer, "make_optimizer")


@gin.configurable
def tiny_decoder(vocab_size: int = 64, d_model: int = 32, num_layers: int = 2, num_heads: int = 4,
                 num_kv_heads: int = 2, head_dim: int = 8, ffn_dim: int = 64, max_len: int = 512,
                 matmul: str = "auto") -> decoder_lib.DecoderConfig:
  """A small random decoder's config (``DecoderConfig.tiny`` with these fields)."""
  return decoder_lib.DecoderConfig.tiny(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                                        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                        ffn_dim=ffn_dim, max_len=max_len, matmul=matmul)


@gin.configurable("drafter_recipe")
def drafter_recipe(base: str = gin.REQUIRED, layers=None, lora_rank: int = 0,
                   lora_targets=params_lib.LORA_TARGETS, lora_alpha: float | None = None, train_layers=None,
                   train_modules=(), seed: int = 0) -> recipe_lib.DrafterRecipe:
  """A :class:`blockspec_jax.train.recipe.DrafterRecipe` from gin (``distill_job.drafter = @drafter_recipe()``)."""
  try:
    return recipe_lib.DrafterRecipe(base=base, layers=layers, lora_rank=lora_rank, lora_targets=lora_targets,
                                    lora_alpha=lora_alpha, train_layers=train_layers, train_modules=train_modules,
                                    seed=seed)
  except ValueError as e:
    raise checks_lib.UsageError(str(e)) from None


@dataclasses.dataclass
class _Setup:
  """What the two kinds of job (random tiny models / real models) hand to the common training code."""
  target_config: decoder_lib.DecoderConfig
  target_params: dict
  drafter_config: decoder_lib.DecoderConfig
  parts: recipe_lib.DrafterParts
  prompts_NxP: np.ndarray
  prompt_len_N: np.ndarray
  split: tuple | None
  stop_ids: tuple
  info: dict


def _random_setup(target_config, drafter_config, *, target_seed, drafter_seed, trainable_layers, num_prompts,
                  prompt_len, seed) -> _Setup:
  target_params = decoder_lib.init_params(target_config, target_seed)
  drafter_params = decoder_lib.init_params(drafter_config, drafter_seed)
  if trainable_layers is None:
    parts = recipe_lib.DrafterParts(trainable=drafter_params, frozen={}, assemble=params_lib.merge)
  else:
    trainable, frozen = params_lib.partition(drafter_params, params_lib.layers_trainable(trainable_layers))
    parts = recipe_lib.DrafterParts(trainable=trainable, frozen=frozen, assemble=params_lib.merge)
  prompts_NxP, prompt_len_N = distill.random_prompts(num_prompts, prompt_len, target_config.vocab_size, seed)
  return _Setup(target_config, target_params, drafter_config, parts, prompts_NxP, prompt_len_N, None, (), {})


def _model_setup(workdir, target_name, recipe, *, dtype, heldout_prompts, train_prompts_per_task, max_prompt_len,
                 chat, seed) -> _Setup:
  from blockspec_jax.models import hub
  heldout_rows, train_rows = pools.prompt_rows(workdir, heldout_prompts, train_prompts_per_task, seed)
  prompts_lib.check_disjoint(train_rows, heldout_rows)
  t0 = time.perf_counter()
  target = hub.load_model(target_name, dtype)
  base = target if recipe.base == target_name else hub.load_model(recipe.base, dtype)
  sources.check_pair(target, base)
  drafter_config, drafter_params = recipe.derive(base.config, base.params["params"])
  del base
  parts = recipe.split(drafter_config, drafter_params)
  print(f"loaded {target_name} (target) and {recipe.base} (drafter base, {drafter_config.num_layers} layers) in "
        f"{time.perf_counter() - t0:.1f} s; trainable parameters {params_lib.count_params(parts.trainable):,}",
        flush=True)
  prompts_NxP, prompt_len_N, split, by_task, dropped = pools.encode_pool(target, heldout_rows, train_rows,
                                                                         max_prompt_len, chat, "distill_job")
  recipe_lib.save_recipe(workdir, recipe)
  info = {"target": target_name, "drafter_recipe": recipe.to_json(), "dtype": dtype,
          "train_prompts_by_task": by_task, "train_prompts_dropped_long": dropped}
  return _Setup(target.config, target.params["params"], drafter_config, parts, prompts_NxP, prompt_len_N, split,
                target.stop_ids, info)


def _check_init_from(init_from, recipe) -> tuple[str, int | None]:
  """``(workdir, step)`` of ``distill_job.init_from`` (``<dir>[@<step>]``), checked before any model loads: a drafter
  training run's work directory whose recipe is ``recipe``."""
  spec = sources.trained_run_spec(init_from)
  if spec is None or spec[1] == "init":
    raise checks_lib.UsageError(f"distill_job.init_from = {init_from!r} is not the work directory of a drafter training "
                          "run (one with drafter.json and checkpoints), optionally with @<step>")
  saved = recipe_lib.read_recipe(spec[0])
  if saved != recipe:
    raise checks_lib.UsageError(f"distill_job.init_from = {init_from!r} was trained with another drafter recipe "
                          f"({saved.to_json()}) than this job's ({recipe.to_json()})")
  return spec


def _init_from(spec, parts) -> tuple[recipe_lib.DrafterParts, str, int]:
  """``parts`` with its trainable tree replaced by the checkpoint ``spec = (workdir, step)``, its label
  ``<absolute workdir>@<step>`` and the step."""
  workdir, step = spec
  try:
    trainable, step = recipe_lib.restore_trainable(workdir, parts.trainable, step)
  except (FileNotFoundError, ValueError) as e:
    raise checks_lib.UsageError(f"distill_job.init_from = {workdir!r}: {e}") from None
  label = f"{pathlib.Path(workdir).resolve()}@{step}"
  print(f"starting from {label} (its trained parameters, a fresh optimizer)", flush=True)
  return dataclasses.replace(parts, trainable=trainable), label, step


@gin.configurable
def distill_job(workdir, *, target_config=None, drafter_config=None, target=None, drafter=None,
                target_seed: int = 0, drafter_seed: int = 1, num_prompts: int = 128, prompt_len: int = 8,
                heldout_prompts: str = pools.DEFAULT_HELDOUT, train_prompts_per_task: int = 48,
                max_prompt_len: int = pools.DEFAULT_MAX_PROMPT_LEN, chat: bool = True, dtype: str = "float32",
                max_new_tokens: int = 16,
                heldout_fraction: float = 0.125, batch_size: int = 16, source: str = "fixed",
                on_policy_fraction: float = 0.5, divergence: str = "fkl", temperature: float = 1.0,
                sample_temperature: float = 1.0, beta: float = 0.5, trainable_layers=None, num_steps: int = 100,
                checkpoint_every: int = 50, max_to_keep: int = 2, seed: int = 0, progress: bool = True,
                data_parallel: bool = False, eval_every: int = 0, init_from: str | None = None,
                sample_batch_size: int | None = None, reuse_samples: str | None = None) -> dict:
  """DistillSpec; returns the ``metrics.json`` summary. Two kinds of job:

  * random tiny models (smoke): ``target_config`` / ``drafter_config`` (``@tiny_decoder()``), random parameters
    (``target_seed`` / ``drafter_seed``), ``num_prompts`` random prompts of ``prompt_len`` tokens split by
    ``heldout_fraction``; ``trainable_layers``: None trains the whole drafter, a list of layer indices those layers
    only (the rest, embeddings and head included, frozen);
  * real models: ``target`` (a model name or path) and ``drafter`` (``@drafter_recipe()``: base model, kept layers,
    LoRA or trainable subset); held-out prompts = ``heldout_prompts`` (the shipped file: every category), training
    prompts = ``train_prompts_per_task`` per category from the same packages, disjoint from the held-out ones
    (item, math template and text); chat-templated when ``chat``; prompts longer than ``max_prompt_len`` tokens are
    left out of training (a held-out one is an error). The workdir gets ``drafter.json``, so
    ``blockspec_jax.sources.load_model(workdir)`` loads the trained drafter.

  ``temperature`` is the divergence's, ``sample_temperature`` the decoding temperature (continuations and the held-out
  TV). ``sample_batch_size``: rows per batch when the target samples the fixed continuations (default ``batch_size``;
  the samples' law does not depend on it, only the cost: the Qwen 1.5B target on 2 CPU cores samples a row in 4.3 s at
  16 rows a batch, 7.4 s at 2). ``reuse_samples``: another run's work directory (or its ``samples.npz``) made with the
  same target and sampling settings: its continuations of the prompts both runs have are taken rather than sampled
  again (``distill.make_distill_data``). ``eval_every``: the held-out TV every this many steps too
  (``eval_heldout_tv`` in ``metrics.jsonl`` and ``loss.png``; 0: only before and after). ``data_parallel``: split
  every batch over all devices (a ``(data, 1)`` mesh; ``batch_size`` must be a multiple of the device count), same
  updates as one device. ``init_from``: the work directory of an earlier real distillation run with the same drafter
  recipe (``<dir>@<step>`` for a kept step other than its newest): training starts from its trained parameters with a
  fresh optimizer (a new schedule, another divergence or batch), and the held-out TV "before" is theirs. A resume of
  this run's own checkpoints takes precedence over it.
  """
  t0 = time.perf_counter()
  sample_batch_size = batch_size if sample_batch_size is None else sample_batch_size
  for name, value, low in (("num_prompts", num_prompts, 2), ("prompt_len", prompt_len, 1),
                           ("max_new_tokens", max_new_tokens, 1), ("batch_size", batch_size, 1),
                           ("num_steps", num_steps, 1), ("checkpoint_every", checkpoint_every, 1),
                           ("max_to_keep", max_to_keep, 1), ("train_prompts_per_task", train_prompts_per_task, 1),
                           ("max_prompt_len", max_prompt_len, 1), ("eval_every", eval_every, 0),
                           ("sample_batch_size", sample_batch_size, 1)):
    pools.check_int(value, name, low, job="distill_job")
  models_given = (target is not None, drafter is not None)
  configs_given = (target_config is not None, drafter_config is not None)
  real = all(models_given)
  if not (real and not any(configs_given)) and not (all(configs_given) and not any(models_given)):
    raise checks_lib.UsageError("give either distill_job.target (a model name) and distill_job.drafter "
                          "(@drafter_recipe()), or distill_job.target_config and distill_job.drafter_config "
                          "(random tiny models), not a mix")
  if real:
    if not isinstance(drafter, recipe_lib.DrafterRecipe):
      raise checks_lib.UsageError(f"distill_job.drafter must be a drafter recipe (@drafter_recipe()), got {drafter!r}")
    methods.check_settings(dtype=dtype, models=(target, drafter.base))
  try:
    divergences.check_divergence(divergence, beta)
    divergences.check_temperature(temperature)
    if source not in distill.SOURCES:
      raise ValueError(f"unknown data source {source!r}; known: {', '.join(distill.SOURCES)}")
    optimizer = make_optimizer(total_steps=num_steps)
    if not real:
      distill.check_pair(target_config, drafter_config)
  except ValueError as e:
    raise checks_lib.UsageError(str(e)) from None
  init_spec = None
  if init_from is not None:
    if not real:
      raise checks_lib.UsageError("distill_job.init_from starts from an earlier real run (a drafter recipe's work "
                            "directory); the random tiny-model job has none")
    init_spec = _check_init_from(init_from, drafter)
  mesh = None
  if data_parallel:
    mesh = parallel.make_mesh(model=1)
    if batch_size % mesh.shape[parallel.DATA]:
      raise checks_lib.UsageError(f"distill_job.batch_size = {batch_size} must be a multiple of the "
                            f"{mesh.shape[parallel.DATA]} devices with data_parallel = True")
  if real:
    setup = _model_setup(workdir, target, drafter, dtype=dtype, heldout_prompts=heldout_prompts,
                         train_prompts_per_task=train_prompts_per_task, max_prompt_len=max_prompt_len, chat=chat,
                         seed=seed)
  else:
    setup = _random_setup(target_config, drafter_config, target_seed=target_seed, drafter_seed=drafter_seed,
                          trainable_layers=trainable_layers, num_prompts=num_prompts, prompt_len=prompt_len,
                          seed=seed)
  parts = setup.parts
  if init_from is not None:
    parts, setup.info["init_from"], step = _init_from(init_spec, parts)
    recipe_lib.save_init_from(workdir, init_spec[0], step)
  loss_fn = distill.DistillLoss(setup.target_config, setup.drafter_config, divergence, temperature, beta,
                                assemble=parts.assemble)
  try:
    data = distill.make_distill_data(setup.target_config, setup.target_params, setup.drafter_config,
                                     setup.prompts_NxP, setup.prompt_len_N, batch_size=batch_size,
                                     max_new_tokens=max_new_tokens, sample_temperature=sample_temperature,
                                     source=source, on_policy_fraction=on_policy_fraction,
                                     heldout_fraction=heldout_fraction, seed=seed, stop_ids=setup.stop_ids,
                                     split=setup.split, progress=progress and real,
                                     samples_path=pools.samples_path(workdir),
                                     samples_meta=pools.samples_meta(target if real else None, target_seed),
                                     sample_batch_size=sample_batch_size, reuse_samples=reuse_samples)
  except ValueError as e:
    raise checks_lib.UsageError(str(e)) from None
  report = lambda trainable: distill.heldout_tv_report(parts.assemble(trainable, parts.frozen), setup.target_params,
                                                        data)
  tv_before = report(parts.trainable)
  print(f"held-out TV before training: {tv_before.mean:.4f}", flush=True)
  last_eval = {}  # the last evaluation's full report, so the final one is not computed twice

  def eval_fn(step, trainable):
    last_eval.update(step=step, report=report(trainable))
    return {"heldout_tv": last_eval["report"].mean}

  result = trainer.fit(loss_fn=loss_fn, optimizer=optimizer, trainable=parts.trainable,
                       frozen={"target": setup.target_params, "drafter": parts.frozen},
                       batch_fn=distill.make_batch_fn(data, parts.frozen, parts.assemble), num_steps=num_steps,
                       key=jax.random.key(seed), workdir=workdir, checkpoint_every=checkpoint_every,
                       max_to_keep=max_to_keep, progress=progress, label="distill train step", mesh=mesh,
                       eval_fn=eval_fn if eval_every else None, eval_every=eval_every)
  rows = trainer.read_metrics(pathlib.Path(workdir) / "metrics.jsonl")
  if last_eval.get("step") == int(result.state.step):
    tv_after = last_eval["report"]  # measured on the final parameters by the last step's evaluation
  else:
    tv_after = report(result.state.trainable)
  trainer.plot_losses(rows, pathlib.Path(workdir) / "loss.png",  # the held-out curve from step 0 to the last
                      points={"eval_heldout_tv": [(0, tv_before.mean), (int(result.state.step), tv_after.mean)]})
  summary = {
      "heldout_tv_before": tv_before.mean, "heldout_tv_after": tv_after.mean,
      # by offset into the continuation (16 tokens a bin): where the drafter moved toward the target
      "heldout_tv_before_by_offset": tv_before.by_offset(), "heldout_tv_after_by_offset": tv_after.by_offset(),
      "final_loss": rows[-1]["loss"] if rows else None, "final_train_tv": rows[-1]["tv"] if rows else None,
      "steps": int(result.state.step), "resumed_from": result.resumed_from,
      "seconds": time.perf_counter() - t0, "train_seconds": result.seconds,
      "train_seconds_total": rows[-1]["seconds_total"] if rows and "seconds_total" in rows[-1] else None,
      "num_train_prompts": int(len(data.train_idx)), "num_heldout_prompts": int(len(data.heldout_idx)),
      "heldout_positions": int(data.fixed_mask_NxT[data.heldout_idx].sum()),
      "divergence": divergence, "source": source, "temperature": temperature,
      "sample_temperature": sample_temperature, "batch_size": batch_size, "max_new_tokens": max_new_tokens,
      "sample_batch_size": sample_batch_size,
      "trainable_params": params_lib.count_params(result.state.trainable),
      "peak_rss_gb": runtime.peak_rss_gb(),
      "device": jax.devices()[0].platform, "data_parallel_devices": mesh.size if mesh is not None else 1,
      **setup.info,
  }
  (pathlib.Path(workdir) / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def _sprinter_setup(workdir, *, real, target, drafter, target_config, drafter_config, target_seed, drafter_seed,
                    num_prompts, prompt_len, heldout_fraction, heldout_prompts, train_prompts_per_task,
                    max_prompt_len, chat, dtype, seed) -> dict:
  """Both models' configs and parameters, the prompts, their (train, held-out) split and the stop ids."""
  if not real:
    prompts_NxP, prompt_len_N = distill.random_prompts(num_prompts, prompt_len, target_config.vocab_size, seed)
    return dict(target_config=target_config, target_params=decoder_lib.init_params(target_config, target_seed),
                drafter_config=drafter_config, drafter_params=decoder_lib.init_params(drafter_config, drafter_seed),
                prompts_NxP=prompts_NxP, prompt_len_N=prompt_len_N,
                split=distill.split_prompts(num_prompts, heldout_fraction, seed), stop_ids=(), info={})
  heldout_rows, train_rows = pools.prompt_rows(workdir, heldout_prompts, train_prompts_per_task, seed)
  prompts_lib.check_disjoint(train_rows, heldout_rows)
  t0 = time.perf_counter()
  target_model = sources.load_model(target, dtype)
  drafter_model = target_model if drafter == target else sources.load_model(drafter, dtype)
  sources.check_pair(target_model, drafter_model)
  print(f"loaded {target} (target) and {drafter} (drafter, D = {drafter_model.config.d_model}) in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  prompts_NxP, prompt_len_N, split, by_task, dropped = pools.encode_pool(target_model, heldout_rows, train_rows,
                                                                         max_prompt_len, chat, "sprinter_job")
  return dict(target_config=target_model.config, target_params=target_model.params["params"],
              drafter_config=drafter_model.config, drafter_params=drafter_model.params["params"],
              prompts_NxP=prompts_NxP, prompt_len_N=prompt_len_N, split=split, stop_ids=target_model.stop_ids,
              info={"train_prompts_by_task": by_task, "train_prompts_dropped_long": dropped})


def _label_counts(data: dict) -> dict:
  labels_N = data["labels_N"]
  return {"num": int(labels_N.size), "positive": int(labels_N.sum()),
          "positive_rate": float(labels_N.mean()) if labels_N.size else None,
          "prompts": int(np.unique(data["row_N"]).size)}


@gin.configurable
def sprinter_job(workdir, *, target=None, drafter=None, target_config=None, drafter_config=None,
                 target_seed: int = 0, drafter_seed: int = 1, num_prompts: int = 64, prompt_len: int = 8,
                 heldout_fraction: float = 0.25, heldout_prompts: str = pools.DEFAULT_HELDOUT,
                 train_prompts_per_task: int = 48, max_prompt_len: int = pools.DEFAULT_MAX_PROMPT_LEN,
                 chat: bool = True,
                 dtype: str = "float32", max_new_tokens: int = 16, temperature: float = 1.0,
                 collect_batch_size: int = 4, num_steps: int = 400, batch_size: int = 256, standardize: bool = True,
                 pos_weight: float | None = None, thresholds=(0.3, 0.5, 0.7, 0.9), checkpoint_every: int = 100,
                 max_to_keep: int = 2, eval_every: int = 0, seed: int = 0, progress: bool = True,
                 stop_after: int | None = None, dry_run: bool = False) -> dict:
  """SPRINTER's verifier head (:mod:`blockspec_jax.train.sprinter`); returns the ``metrics.json`` summary.

  Models, as in ``distill_job``: random tiny ones (``target_config`` / ``drafter_config``, ``@tiny_decoder()``,
  random parameters of ``target_seed`` / ``drafter_seed``; ``num_prompts`` random prompts of ``prompt_len`` tokens
  split by ``heldout_fraction``) or real ones (``target`` and ``drafter``: model names, checkpoint paths or a
  drafter training run's workdir, anything ``sources.load_model`` takes; held-out prompts = ``heldout_prompts``,
  training prompts = ``train_prompts_per_task`` per category, disjoint from them; both written to the workdir).

  Labels: the drafter continues every prompt (``max_new_tokens`` at ``temperature``, ``collect_batch_size``
  prompts at a time); each generated token gets the drafter's hidden state that produced it and ``1[q ≤ p]``. They
  are cached in ``labels_train.npz`` / ``labels_heldout.npz``: a rerun (resume) reads them and loads no model.
  Head: ``num_steps`` steps of ``batch_size`` examples (optimizer: gin's ``make_optimizer``, ``total_steps`` =
  ``num_steps``), checkpoints every ``checkpoint_every`` steps (resumed from), held-out BCE and accuracy every
  ``eval_every`` steps (0: only at the end); ``standardize`` / ``pos_weight`` as in ``train_head``. Outputs:
  ``head.json`` + ``head.npz`` (``sprinter.load_head(workdir)``), ``metrics.json`` (held-out report per threshold
  in ``thresholds``, label counts, seconds, peak RSS), ``metrics.jsonl``, ``loss.png``. ``stop_after``: stop after
  that many steps as if killed (resume tests). ``dry_run``: check the settings (no model loaded, nothing written)
  and return them.
  """
  t0 = time.perf_counter()
  job = "sprinter_job"
  for name, value, low in (("num_prompts", num_prompts, 2), ("prompt_len", prompt_len, 1),
                           ("max_new_tokens", max_new_tokens, 1), ("collect_batch_size", collect_batch_size, 1),
                           ("batch_size", batch_size, 1), ("num_steps", num_steps, 1),
                           ("checkpoint_every", checkpoint_every, 1), ("max_to_keep", max_to_keep, 1),
                           ("train_prompts_per_task", train_prompts_per_task, 1),
                           ("max_prompt_len", max_prompt_len, 1), ("eval_every", eval_every, 0)):
    pools.check_int(value, name, low, job=job)
  if stop_after is not None:
    pools.check_int(stop_after, "stop_after", 1, job=job)
  models_given = (target is not None, drafter is not None)
  configs_given = (target_config is not None, drafter_config is not None)
  real = all(models_given)
  if not (real and not any(configs_given)) and not (all(configs_given) and not any(models_given)):
    raise checks_lib.UsageError("give either sprinter_job.target and sprinter_job.drafter (model names), or "
                          "sprinter_job.target_config and sprinter_job.drafter_config (random tiny models), not a mix")
  thresholds = tuple(thresholds) if isinstance(thresholds, (list, tuple)) else (thresholds,)
  if not thresholds or any(isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0
                           for t in thresholds):
    raise checks_lib.UsageError(f"sprinter_job.thresholds must be numbers >= 0, got {thresholds!r}")
  if pos_weight is not None and (isinstance(pos_weight, bool) or not isinstance(pos_weight, (int, float))
                                 or not pos_weight > 0):
    raise checks_lib.UsageError(f"sprinter_job.pos_weight must be a number > 0 or None, got {pos_weight!r}")
  if real:
    for name, value in (("target", target), ("drafter", drafter)):
      if not isinstance(value, str):
        raise checks_lib.UsageError(f"sprinter_job.{name} must be a model name or path, got {value!r}")
    methods.check_settings(dtype=dtype, models=(target, drafter))
  elif not 0.0 < heldout_fraction < 1.0:
    raise checks_lib.UsageError(f"sprinter_job.heldout_fraction must be in (0, 1), got {heldout_fraction}")
  try:
    sampling.Sampler(temperature)
    optimizer = make_optimizer(total_steps=num_steps)
    if not real:
      distill.check_pair(target_config, drafter_config)
  except ValueError as e:
    raise checks_lib.UsageError(str(e)) from None
  target_name = pools.model_name(target, target_config, target_seed)
  drafter_name = pools.model_name(drafter, drafter_config, drafter_seed)
  meta = {"target": target_name, "drafter": drafter_name, "temperature": float(temperature),
          "max_new_tokens": max_new_tokens, "seed": seed, "dtype": dtype,
          "target_config": None if real else repr(target_config),
          "drafter_config": None if real else repr(drafter_config)}
  if real:
    meta.update(chat=chat, max_prompt_len=max_prompt_len, train_prompts_per_task=train_prompts_per_task)
  else:
    meta.update(num_prompts=num_prompts, prompt_len=prompt_len, heldout_fraction=float(heldout_fraction))
  settings = {**meta, "collect_batch_size": collect_batch_size, "num_steps": num_steps, "batch_size": batch_size,
              "standardize": bool(standardize), "pos_weight": pos_weight, "thresholds": list(thresholds)}
  if dry_run:
    return {"dry_run": True, **settings}

  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  paths = {"train": workdir / "labels_train.npz", "heldout": workdir / "labels_heldout.npz"}
  redo = "the labels_*.npz files (and checkpoints/) to collect them again"
  labels = {split: pools.read_cached(path, {**meta, "split": split}, sprinter_lib.load_labels, redo=redo)
            for split, path in paths.items()}
  cached = all(v is not None for v in labels.values())
  info = {}
  collect_seconds = 0.0
  if cached:
    print(f"labels read from {paths['train'].name} and {paths['heldout'].name} (no model loaded)", flush=True)
  else:
    t_collect = time.perf_counter()
    setup = _sprinter_setup(workdir, real=real, target=target, drafter=drafter, target_config=target_config,
                            drafter_config=drafter_config, target_seed=target_seed, drafter_seed=drafter_seed,
                            num_prompts=num_prompts, prompt_len=prompt_len, heldout_fraction=heldout_fraction,
                            heldout_prompts=heldout_prompts, train_prompts_per_task=train_prompts_per_task,
                            max_prompt_len=max_prompt_len, chat=chat, dtype=dtype, seed=seed)
    info = setup["info"]

    def collect(split, rows):
      print(f"collecting {split} labels: {len(rows)} prompts, {max_new_tokens} drafter tokens each at "
            f"T = {temperature:g}", flush=True)
      return sprinter_lib.collect_labels(
          setup["target_config"], setup["target_params"], setup["drafter_config"], setup["drafter_params"],
          setup["prompts_NxP"][rows], setup["prompt_len_N"][rows], max_new_tokens=max_new_tokens,
          temperature=temperature, key=jax.random.fold_in(jax.random.key(seed), 1),
          batch_size=collect_batch_size, progress=progress, rows=rows, stop_ids=tuple(setup["stop_ids"]))

    pools.collect_missing(labels, setup["split"], collect,
                          lambda split, data: sprinter_lib.save_labels(paths[split], data, {**meta, "split": split}))
    del setup
    collect_seconds = time.perf_counter() - t_collect
  train, held = labels["train"], labels["heldout"]
  counts = {split: _label_counts(data) for split, data in labels.items()}
  print(f"labels: {counts['train']['num']} training tokens ({counts['train']['positive_rate']:.3f} acceptable), "
        f"{counts['heldout']['num']} held-out tokens ({counts['heldout']['positive_rate']:.3f} acceptable)",
        flush=True)
  if np.intersect1d(train["row_N"], held["row_N"]).size:
    raise RuntimeError("training and held-out labels share prompts")  # the splits are disjoint by construction
  try:
    head, result = sprinter_lib.train_head(
        train["features_NxD"], train["labels_N"], workdir=workdir, num_steps=num_steps, batch_size=batch_size,
        seed=seed, heldout=(held["features_NxD"], held["labels_N"]), eval_every=eval_every, optimizer=optimizer,
        pos_weight=pos_weight, standardize=standardize, checkpoint_every=checkpoint_every,
        max_to_keep=max_to_keep, progress=progress, stop_after=stop_after)
  except ValueError as e:
    raise checks_lib.UsageError(str(e)) from None
  report_heldout = sprinter_lib.head_report(head, held["features_NxD"], held["labels_N"], thresholds)
  report_train = sprinter_lib.head_report(head, train["features_NxD"], train["labels_N"], thresholds)
  held_eval = sprinter_lib.evaluate_head(head, held["features_NxD"], held["labels_N"])
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  d_model = int(train["features_NxD"].shape[1])
  head_info = {"drafter": drafter_name, "target": target_name, "temperature": float(temperature),
               "d_model": d_model, "max_new_tokens": max_new_tokens, "steps": int(result.state.step),
               "standardize": bool(standardize), "pos_weight": pos_weight, "labels": counts,
               "heldout_bce": held_eval["bce"], "report_heldout": report_heldout}
  sprinter_lib.save_head(workdir, head, head_info)
  summary = {
      "report_heldout": report_heldout, "report_train": report_train, "labels": counts,
      "heldout_bce": held_eval["bce"], "heldout_accuracy": held_eval["accuracy"],
      "final_loss": rows[-1]["loss"] if rows else None, "steps": int(result.state.step),
      "resumed_from": result.resumed_from, "labels_cached": cached,
      "seconds": time.perf_counter() - t0, "collect_seconds": collect_seconds, "train_seconds": result.seconds,
      "train_seconds_total": rows[-1]["seconds_total"] if rows and "seconds_total" in rows[-1] else None,
      "peak_rss_gb": runtime.peak_rss_gb(), "device": jax.devices()[0].platform, "d_model": d_model,
      "head_b": float(head["b"]), "head_w_norm": float(np.linalg.norm(np.asarray(head["w_D"], np.float64))),
      **settings, **info,
  }
  (workdir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def default_workdir(gin_files) -> pathlib.Path:
  """``results/train/<stem of the last gin file>`` (relative to the working directory)."""
  return pathlib.Path("results") / "train" / pathlib.Path(gin_files[-1]).stem


def _jobs() -> dict:
  """Every training job by its gin name (the BPD heads' and SD²'s jobs live in their own entry-point modules)."""
  from blockspec_jax.train.heads_job import heads_job
  from blockspec_jax.train.steer_job import steer_job
  return {"distill_job": distill_job, "sprinter_job": sprinter_job, "heads_job": heads_job, "steer_job": steer_job}


JOBS = ("distill_job", "sprinter_job", "heads_job", "steer_job")


def selected_job():
  """The job the parsed gin files configure (the one with bindings), else ``distill_job`` (also when nothing is
  bound: its own checks then say what is missing); two configured jobs are a UsageError."""
  configured = cli.bound_jobs(JOBS)
  if len(configured) > 1:
    raise checks_lib.UsageError(f"the gin files configure {' and '.join(configured)}; a run trains one job")
  return _jobs()[configured[0] if configured else "distill_job"]


def main(argv=None) -> int:
  parser = cli.gin_parser("python -m blockspec_jax.train", __doc__, workdir=True)
  args = parser.parse_args(argv)
  with cli.cli_errors(parser.prog):
    if not args.gin_file:
      raise checks_lib.UsageError("give a job with --gin_file gin/train/<job>.gin")
    cli.join_multihost_from_env()
    _jobs()  # every job's configurables registered before the files are parsed
    cli.parse_gin(args.gin_file, args.gin_param)
    workdir = pathlib.Path(args.workdir) if args.workdir else default_workdir(args.gin_file)
    runtime.check_output_dir(workdir, "the training run's work directory (--workdir)")
    (workdir / "config.gin").write_text(gin.config_str())  # what was bound; the operative config replaces it
    job = selected_job()
    summary = job(workdir)
    (workdir / "config.gin").write_text(gin.operative_config_str())
  print(json.dumps(summary, indent=2))
  if job is sprinter_job:
    at = min(summary["report_heldout"], key=lambda r: abs(r["threshold"] - 0.5))
    print(f"held-out head at threshold {at['threshold']:g}: accuracy {at['accuracy']:.4f}, eta_fp {at['eta_fp']}, "
          f"eta_fn {at['eta_fn']}, accept rate {at['accept_rate']:.4f} over {at['num']} tokens after "
          f"{summary['steps']} steps ({summary['seconds']:.1f} s); outputs in {workdir}")
  elif "heldout_tv_before" in summary:
    print(f"held-out TV {summary['heldout_tv_before']:.4f} -> {summary['heldout_tv_after']:.4f} after "
          f"{summary['steps']} steps ({summary['seconds']:.1f} s); outputs in {workdir}")
  else:
    print(f"{getattr(job, '__name__', 'job')}: {summary.get('steps')} steps ({summary.get('seconds', 0.0):.1f} s); "
          f"outputs in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
