"""The SD² training job (``steer_job``, gin): a frozen target, the steering map trained
(:mod:`blockspec_jax.train.steer`, :mod:`blockspec_jax.drafters.steer`), and the drafter frozen or, with
``finetune_drafter``, fine-tuned jointly with the map (the authors' default; LoRA or a trained subset).

    python -m blockspec_jax.train --gin_file gin/train/steer_qwen.gin      (once registered in train/__main__.py)

or, from Python, ``gin.parse_config_file("gin/train/steer_smoke.gin"); steer_job(workdir)``. This module registers
only ``steer_job`` with gin; its models and optimizer are plain arguments (``target_config`` / ``drafter_config``
as :class:`~blockspec_jax.models.decoder.DecoderConfig` or a dict of ``DecoderConfig.tiny`` fields, ``optimizer``
as a dict of :func:`blockspec_jax.train.trainer.make_optimizer` arguments), so it neither needs nor collides with
the configurables of ``blockspec_jax.train.__main__``.

Outputs in ``workdir``: ``checkpoints/`` (resumed from: re-running continues a stopped run), ``metrics.jsonl``,
``loss.png``, ``steer.json`` + ``steer.npz`` (the trained map, :func:`blockspec_jax.train.steer.load_steer`; decode
with ``drafter_settings = {"steered": {"steer": "<workdir>"}}``) and ``metrics.json``: ``heldout_tv_before`` /
``heldout_tv_after`` (the steered drafter with the initial / trained map), ``heldout_tv_plain`` (the drafter without
steering; equal to ``before`` for the zero initial map), each also ``*_by_offset``, plus the loss, steps, seconds,
peak memory and the settings. Real models also get ``prompts_heldout.jsonl`` / ``prompts_train.jsonl``.

A joint run (``finetune_drafter``) checkpoints ``{"steer": map, "drafter": the drafter's trainable part}`` and
also writes ``drafter.json`` (the drafter's recipe, naming its ``"drafter"`` part of the checkpoints), so its work
directory is both the drafter and the map: ``--drafter <workdir>`` with ``steered:<workdir>`` (the map's record
names the run as its drafter, so the map refuses the untuned base). ``metrics.json`` adds
``heldout_tv_drafter_only`` (the tuned drafter without the map).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import gin
import jax

from blockspec_jax import sampling
from blockspec_jax import checks
from blockspec_jax import methods
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.drafters.steer import default_target_layers, init_steer
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, divergences, params as params_lib, pools, recipe as recipe_lib, \
    steer as steer_lib, trainer

__all__ = ["steer_job"]

JOB = "steer_job"


def _as_config(value, name: str) -> decoder_lib.DecoderConfig:
  """A DecoderConfig, or a dict of ``DecoderConfig.tiny`` overrides (gin: ``{"vocab_size": 128, ...}``)."""
  if isinstance(value, decoder_lib.DecoderConfig):
    return value
  if isinstance(value, dict):
    try:
      return decoder_lib.DecoderConfig.tiny(**value)
    except (TypeError, ValueError) as e:
      raise checks.UsageError(f"{JOB}.{name}: {e}") from None
  raise checks.UsageError(f"{JOB}.{name} must be a DecoderConfig or a dict of its fields, got {value!r}")


def _models(workdir, real, *, target, drafter, target_config, drafter_config, target_seed, drafter_seed, dtype,
            num_prompts, prompt_len, heldout_prompts, train_prompts_per_task, max_prompt_len, chat, seed) -> dict:
  """Both models, the prompts, their split and the stop ids (random tiny models, or real ones by name)."""
  if not real:
    target_config, drafter_config = _as_config(target_config, "target_config"), _as_config(drafter_config,
                                                                                           "drafter_config")
    prompts_NxP, prompt_len_N = distill.random_prompts(num_prompts, prompt_len, target_config.vocab_size, seed)
    return dict(target_config=target_config, target_params=decoder_lib.init_params(target_config, target_seed),
                drafter_config=drafter_config, drafter_params=decoder_lib.init_params(drafter_config, drafter_seed),
                prompts_NxP=prompts_NxP, prompt_len_N=prompt_len_N, split=None, stop_ids=(),
                target_name=pools.model_name(None, target_config, target_seed),
                drafter_name=pools.model_name(None, drafter_config, drafter_seed), info={})
  heldout_rows, train_rows = pools.prompt_rows(workdir, heldout_prompts, train_prompts_per_task, seed)
  prompts_lib.check_disjoint(train_rows, heldout_rows)
  t0 = time.perf_counter()
  target_model = sources.load_model(target, dtype)
  drafter_model = sources.load_model(drafter, dtype)
  sources.check_pair(target_model, drafter_model)
  print(f"loaded {target} (target, {target_model.config.num_layers} layers, D = {target_model.config.d_model}) "
        f"and {drafter} (drafter, {drafter_model.config.num_layers} layers, F = {drafter_model.config.ffn_dim}) in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  prompts_NxP, prompt_len_N, split, by_task, dropped = pools.encode_pool(target_model, heldout_rows, train_rows,
                                                                         max_prompt_len, chat, JOB)
  return dict(target_config=target_model.config, target_params=target_model.params["params"],
              drafter_config=drafter_model.config, drafter_params=drafter_model.params["params"],
              prompts_NxP=prompts_NxP, prompt_len_N=prompt_len_N, split=split, stop_ids=tuple(target_model.stop_ids),
              target_name=str(target), drafter_name=str(drafter),
              info={"train_prompts_by_task": by_task, "train_prompts_dropped_long": dropped})


def _joint_parts(workdir: pathlib.Path, setup: dict, recipe: recipe_lib.DrafterRecipe, real: bool) -> dict:
  """The drafter's recipe for joint training (``recipe`` with ``base`` = the job's drafter), its derived config and
  parameters, its trainable / frozen parts, and its identity (the run's resolved directory for real models). Writes
  the run's ``drafter.json``, naming the ``"drafter"`` part of the checkpoints."""
  recipe = dataclasses.replace(recipe, base=setup["drafter_name"])
  try:
    config, params = recipe.derive(setup["drafter_config"], setup["drafter_params"])
    parts = recipe.split(config, params)
  except (TypeError, ValueError) as e:
    raise checks.UsageError(f"{JOB}.finetune_drafter: {e}") from None
  recipe_lib.save_recipe(workdir, recipe, subtree="drafter")
  kept = "" if recipe.layers is None else f" (keeping layers {list(recipe.layers)})"
  print(f"the drafter tuned with the map: {recipe.base}{kept}, "
        f"{f'LoRA rank {recipe.lora_rank}' if recipe.lora_rank else 'a trainable subset'}", flush=True)
  name = str(workdir.resolve()) if real else f"{setup['drafter_name']} tuned in {workdir.resolve()}"
  return dict(recipe=recipe, config=config, params=params, parts=parts, name=name)


@gin.configurable(JOB)
def steer_job(workdir, *, target_config=None, drafter_config=None, target=None, drafter=None, target_seed: int = 0,
              drafter_seed: int = 1, num_prompts: int = 128, prompt_len: int = 8, heldout_fraction: float = 0.125,
              heldout_prompts: str = pools.DEFAULT_HELDOUT, train_prompts_per_task: int = 48,
              max_prompt_len: int = pools.DEFAULT_MAX_PROMPT_LEN, chat: bool = True, dtype: str = "float32",
              max_new_tokens: int = 16,
              batch_size: int = 16, sample_batch_size=None, target_layers=None, steered_layers=None, rank=None,
              gamma: int = 4, scheme: str = "regular", divergence: str = "fkl", temperature: float = 1.0,
              sample_temperature: float = 1.0,
              beta: float = 0.5, optimizer=None, num_steps: int = 100, checkpoint_every: int = 50,
              max_to_keep: int = 2, eval_every: int = 0, seed: int = 0, progress: bool = True,
              stop_after=None, finetune_drafter=None, drafter_optimizer=None, reuse_samples=None) -> dict:
  """SD²'s steering map; returns the ``metrics.json`` summary (see the module docstring for the outputs).

  Models, as in ``distill_job``: random tiny ones (``target_config`` / ``drafter_config``; random parameters of
  ``target_seed`` / ``drafter_seed``; ``num_prompts`` random prompts of ``prompt_len`` tokens split by
  ``heldout_fraction``) or real ones (``target`` / ``drafter``: anything ``sources.load_model`` takes; held-out prompts
  = ``heldout_prompts``, training prompts = ``train_prompts_per_task`` per category from the same packages, disjoint
  from them, chat-templated when ``chat``, those longer than ``max_prompt_len`` tokens left out).

  Data: the target's continuations (``max_new_tokens`` at ``sample_temperature``, ``sample_batch_size`` prompts at a
  time, default ``batch_size``); ``reuse_samples``: another run's work directory (or its ``samples.npz``) made with
  the same target and sampling settings, whose continuations of the prompts both runs have are taken rather than
  sampled again (a wider pool pays only for its new prompts). Map: ``target_layers`` (default
  ``default_target_layers``), ``steered_layers`` (default all drafter layers), ``rank`` (None: the paper's full
  ``W_guide``). Loss: ``divergence`` at ``temperature`` (``beta`` for JSD), offsets ``1..gamma`` under ``scheme``
  (``"regular"``: one offset per step, the authors'; ``"blocks"``: blocks of ``gamma`` sharing one vector, as decoding
  drafts; ``steer.SteerLoss``). ``optimizer``: a dict of ``trainer.make_optimizer`` arguments (``total_steps`` =
  ``num_steps``; default adamw 1e-3, cosine). ``eval_every``: the steered held-out TV every this many steps too
  (``eval_heldout_tv``; 0: only at the end). ``stop_after``: stop after that many steps as if killed (resume tests):
  only the checkpoints and ``metrics.jsonl`` are written.

  ``finetune_drafter``: None (the drafter frozen), or a dict of
  :class:`~blockspec_jax.train.recipe.DrafterRecipe` fields but ``base`` (``{"lora_rank": 16, "lora_alpha": 32}``):
  that part of the drafter trains with the map under the one loss; ``drafter_optimizer``: its own
  ``make_optimizer`` arguments (default: ``optimizer``'s), the map keeping ``optimizer``.
  """
  t0 = time.perf_counter()
  for name, value, low in (("num_prompts", num_prompts, 2), ("prompt_len", prompt_len, 1),
                           ("max_new_tokens", max_new_tokens, 1), ("batch_size", batch_size, 1),
                           ("num_steps", num_steps, 1), ("checkpoint_every", checkpoint_every, 1),
                           ("max_to_keep", max_to_keep, 1), ("train_prompts_per_task", train_prompts_per_task, 1),
                           ("max_prompt_len", max_prompt_len, 1), ("eval_every", eval_every, 0),
                           ("gamma", gamma, 1)):
    pools.check_int(value, name, low, job=JOB)
  if scheme not in steer_lib.SCHEMES:
    raise checks.UsageError(f"{JOB}.scheme must be one of {steer_lib.SCHEMES}, got {scheme!r}")
  if sample_batch_size is not None:
    pools.check_int(sample_batch_size, "sample_batch_size", job=JOB)
  if stop_after is not None:
    pools.check_int(stop_after, "stop_after", job=JOB)
  if finetune_drafter is not None and not isinstance(finetune_drafter, dict):
    raise checks.UsageError(f"{JOB}.finetune_drafter must be None or a dict of drafter recipe fields (e.g. "
                          f"{{'lora_rank': 16}}), got {finetune_drafter!r}")
  if finetune_drafter is not None and "base" in finetune_drafter:
    raise checks.UsageError(f"{JOB}.finetune_drafter must not set base: the base is {JOB}.drafter")
  if drafter_optimizer is not None and finetune_drafter is None:
    raise checks.UsageError(f"{JOB}.drafter_optimizer is set but the drafter is frozen (set {JOB}.finetune_drafter)")
  if drafter_optimizer is not None and not isinstance(drafter_optimizer, dict):
    raise checks.UsageError(f"{JOB}.drafter_optimizer must be a dict of make_optimizer arguments, got "
                          f"{drafter_optimizer!r}")
  recipe = None
  if finetune_drafter is not None:
    try:  # the recipe's fields checked before any model loads (its base is set once the drafter is named)
      recipe = recipe_lib.DrafterRecipe(base=str(drafter or "drafter"), **finetune_drafter)
    except (TypeError, ValueError) as e:
      raise checks.UsageError(f"{JOB}.finetune_drafter: {e}") from None
  if rank is not None:
    pools.check_int(rank, "rank", job=JOB)
  models_given = (target is not None, drafter is not None)
  configs_given = (target_config is not None, drafter_config is not None)
  real = all(models_given)
  if not (real and not any(configs_given)) and not (all(configs_given) and not any(models_given)):
    raise checks.UsageError(f"give either {JOB}.target and {JOB}.drafter (model names), or {JOB}.target_config and "
                          f"{JOB}.drafter_config (random tiny models), not a mix")
  if real:
    for name, value in (("target", target), ("drafter", drafter)):
      if not isinstance(value, str):
        raise checks.UsageError(f"{JOB}.{name} must be a model name or path, got {value!r}")
    methods.check_settings(dtype=dtype, models=(target, drafter))
    if recipe is not None and sources.trained_run_spec(drafter) is not None:
      raise checks.UsageError(f"{JOB}.finetune_drafter tunes a base model; {JOB}.drafter = {drafter!r} is a training "
                            "run (train a map for it frozen, or give its base)")
  optimizer = dict(optimizer or {"name": "adamw", "learning_rate": 1e-3})
  try:
    divergences.check_divergence(divergence, beta)
    divergences.check_temperature(temperature)
    sampling.Sampler(sample_temperature)
    for name, value in (("optimizer", optimizer), ("drafter_optimizer", drafter_optimizer or {})):
      if "total_steps" in value:
        raise ValueError(f"{JOB}.{name} must not set total_steps (it is num_steps = {num_steps})")
    opt = trainer.make_optimizer(**optimizer, total_steps=num_steps)
    if finetune_drafter is not None:
      drafter_optimizer = dict(drafter_optimizer or optimizer)
      opt = trainer.by_part({"steer": opt, "drafter": trainer.make_optimizer(**drafter_optimizer,
                                                                               total_steps=num_steps)})
  except (TypeError, ValueError) as e:
    raise checks.UsageError(str(e)) from None
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  setup = _models(workdir, real, target=target, drafter=drafter, target_config=target_config,
                  drafter_config=drafter_config, target_seed=target_seed, drafter_seed=drafter_seed, dtype=dtype,
                  num_prompts=num_prompts, prompt_len=prompt_len, heldout_prompts=heldout_prompts,
                  train_prompts_per_task=train_prompts_per_task, max_prompt_len=max_prompt_len, chat=chat, seed=seed)
  target_cfg = setup["target_config"]
  joint = None
  if finetune_drafter is not None:
    joint = _joint_parts(workdir, setup, recipe, real)
    setup["drafter_config"], setup["drafter_params"] = joint["config"], joint["params"]
  drafter_cfg = setup["drafter_config"]
  try:
    if target_layers is None:
      target_layers = default_target_layers(target_cfg.num_layers)
    target_layers, steered_layers = steer_lib.check_steer_setup(target_cfg, drafter_cfg, target_layers,
                                                                steered_layers, gamma)
    loss_fn = steer_lib.SteerLoss(target_cfg, drafter_cfg, target_layers, steered_layers, gamma, divergence,
                                  temperature, beta, scheme,
                                  assemble_drafter=None if joint is None else joint["parts"].assemble)
    data = steer_lib.make_steer_data(target_cfg, setup["target_params"], drafter_cfg, setup["prompts_NxP"],
                                     setup["prompt_len_N"], batch_size=batch_size, max_new_tokens=max_new_tokens,
                                     sample_batch_size=sample_batch_size, sample_temperature=sample_temperature,
                                     heldout_fraction=heldout_fraction, seed=seed, stop_ids=setup["stop_ids"],
                                     split=setup["split"], progress=progress,
                                     samples_path=pools.samples_path(workdir),
                                     samples_meta=pools.samples_meta(target if real else None, target_seed),
                                     reuse_samples=reuse_samples)
  except ValueError as e:
    raise checks.UsageError(str(e)) from None
  steer0 = init_steer(target_cfg.d_model, len(target_layers), drafter_cfg, steered_layers, rank=rank, seed=seed)
  target_params, drafter_params = setup["target_params"], setup["drafter_params"]
  settings = dict(target_layers=list(target_layers), steered_layers=list(steered_layers), rank=rank, gamma=gamma,
                  scheme=scheme,
                  divergence=divergence, temperature=temperature, sample_temperature=sample_temperature,
                  batch_size=batch_size, max_new_tokens=max_new_tokens, num_steps=num_steps, optimizer=optimizer,
                  seed=seed)
  if joint is not None:
    settings.update(finetune_drafter=joint["recipe"].to_json(), drafter_optimizer=drafter_optimizer)
  trainable0 = steer0 if joint is None else {"steer": steer0, "drafter": joint["parts"].trainable}
  frozen = {"target": target_params, "drafter": drafter_params if joint is None else joint["parts"].frozen}
  tuned_count = "" if joint is None else \
      f", trained with the drafter's {params_lib.count_params(joint['parts'].trainable):,}"
  print(f"SD² map: target layers {list(target_layers)} -> {len(steered_layers)} drafter layers, "
        f"{'full rank' if rank is None else f'rank {rank}'}, {params_lib.count_params(steer0):,} parameters"
        f"{tuned_count}; {len(data.train_idx)} training / {len(data.heldout_idx)} held-out prompts", flush=True)
  eval_kwargs = dict(target_layers=target_layers, steered_layers=steered_layers, gamma=gamma)

  def eval_fn(step, trainable):
    del step
    steer, tuned_params = loss_fn.parts(trainable, frozen)
    return {"heldout_tv": steer_lib.heldout_tv(data, target_params, tuned_params, {"steered": steer},
                                               **eval_kwargs)["steered"]["tv"]}

  result = trainer.fit(loss_fn=loss_fn, optimizer=opt, trainable=trainable0, frozen=frozen,
                       batch_fn=steer_lib.make_batch_fn(data), num_steps=num_steps, key=jax.random.key(seed),
                       workdir=workdir, checkpoint_every=checkpoint_every, max_to_keep=max_to_keep,
                       eval_fn=eval_fn if eval_every else None, eval_every=eval_every, progress=progress,
                       label="SD² steering train step", stop_after=stop_after)
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  steps = int(result.state.step)
  if steps < num_steps:  # stopped early (stop_after): as if killed, nothing but the checkpoints
    return {"stopped_after": steps, "resumed_from": result.resumed_from, **settings}
  trained, tuned_params = loss_fn.parts(result.state.trainable, frozen)
  if joint is None:
    report = steer_lib.heldout_tv(data, target_params, drafter_params,
                                  {"before": steer0, "after": trained, "plain": None}, progress=progress,
                                  **eval_kwargs)
  else:  # the untuned drafter with and without the initial map, the tuned one with and without the trained map
    report = {**steer_lib.heldout_tv(data, target_params, drafter_params, {"before": steer0, "plain": None},
                                     progress=progress, **eval_kwargs),
              **steer_lib.heldout_tv(data, target_params, tuned_params, {"after": trained, "drafter_only": None},
                                     progress=progress, **eval_kwargs)}
  print(f"held-out TV: plain drafter {report['plain']['tv']:.4f}, steered before {report['before']['tv']:.4f}, "
        f"after {report['after']['tv']:.4f} (by offset 1..{gamma}: "
        f"{', '.join(f'{v:.4f}' for v in report['after']['by_offset'] if v is not None)})", flush=True)
  if joint is not None:
    print(f"held-out TV of the jointly tuned drafter without the map: {report['drafter_only']['tv']:.4f}",
          flush=True)
  record = {"target": setup["target_name"], "drafter": setup["drafter_name"],
            "drafter_layers": drafter_cfg.num_layers, "ffn_dim": drafter_cfg.ffn_dim, "steps": steps,
            "heldout_tv_before": report["before"]["tv"], "heldout_tv_after": report["after"]["tv"],
            "heldout_tv_plain": report["plain"]["tv"], **settings}
  if joint is not None:  # the map belongs to the drafter tuned with it: this run, at this step
    record.update(drafter=joint["name"], drafter_base=setup["drafter_name"], drafter_step=steps,
                  heldout_tv_drafter_only=report["drafter_only"]["tv"])
  steer_lib.save_steer(workdir, trained, record)
  trainer.plot_losses(rows, workdir / "loss.png",  # the held-out curve from the untrained map to the trained one
                      points={"eval_heldout_tv": [(0, report["before"]["tv"]), (steps, report["after"]["tv"])]})
  summary = {
      "heldout_tv_before": report["before"]["tv"], "heldout_tv_after": report["after"]["tv"],
      "heldout_tv_plain": report["plain"]["tv"], "heldout_tv_before_by_offset": report["before"]["by_offset"],
      "heldout_tv_after_by_offset": report["after"]["by_offset"],
      "heldout_tv_plain_by_offset": report["plain"]["by_offset"],
      "final_loss": rows[-1]["loss"] if rows else None, "final_train_tv": rows[-1]["tv"] if rows else None,
      "steps": steps, "resumed_from": result.resumed_from, "seconds": time.perf_counter() - t0,
      "train_seconds": result.seconds,
      "train_seconds_total": rows[-1]["seconds_total"] if rows and "seconds_total" in rows[-1] else None,
      "num_train_prompts": int(len(data.train_idx)), "num_heldout_prompts": int(len(data.heldout_idx)),
      "heldout_positions": int(data.fixed_mask_NxT[data.heldout_idx].sum()),
      "steer_params": params_lib.count_params(steer0), "target": setup["target_name"],
      "drafter": setup["drafter_name"], "peak_rss_gb": runtime.peak_rss_gb(), "device": jax.devices()[0].platform,
      **settings, **setup["info"],
  }
  if joint is not None:
    summary.update(heldout_tv_drafter_only=report["drafter_only"]["tv"],
                   heldout_tv_drafter_only_by_offset=report["drafter_only"]["by_offset"],
                   drafter_trainable_params=params_lib.count_params(joint["parts"].trainable))
  (workdir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary
