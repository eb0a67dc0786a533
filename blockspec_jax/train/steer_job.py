"""The SD² training job (``steer_job``, gin): a frozen target, the steering map trained
(:mod:`blockspec_jax.train.steer`, :mod:`blockspec_jax.drafters.steer`), and the drafter frozen or, with
``finetune_drafter``, fine-tuned jointly with the map (the authors' default; LoRA or a trained subset).

    python -m blockspec_jax.train --gin_file gin/train/steer_qwen.gin

or, from Python, ``gin.parse_config_file("gin/train/steer_smoke.gin"); steer_job(workdir)``. This module registers
only ``steer_job`` (its :class:`SteerSettings`) with gin; its models and optimizer are plain settings
(``target_config`` / ``drafter_config`` as :class:`~blockspec_jax.models.decoder.DecoderConfig` or a dict of
``DecoderConfig.tiny`` fields, ``optimizer`` as a dict of :func:`blockspec_jax.train.trainer.make_optimizer`
arguments), so it needs none of the configurables of :mod:`blockspec_jax.train.configurables`.

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

from blockspec_jax import checks
from blockspec_jax import sampling
from blockspec_jax import sources
from blockspec_jax.drafters.steer import default_target_layers, init_steer
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, divergences, job_setup, params as params_lib, pools, recipe as recipe_lib, \
    steer as steer_lib, trainer

__all__ = ["SteerSettings", "steer_job"]

JOB = "steer_job"
#: The steering map's optimizer when ``optimizer`` is None.
DEFAULT_OPTIMIZER = {"name": "adamw", "learning_rate": 1e-3}


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


@gin.configurable(JOB)
@dataclasses.dataclass(frozen=True, kw_only=True)
class SteerSettings(job_setup.PairSettings):
  """``steer_job``'s settings (gin: ``steer_job.*``); constructing them checks them, loading no model.

  Models, as in ``distill_job``: random tiny ones (``target_config`` / ``drafter_config``, each a
  :class:`~blockspec_jax.models.decoder.DecoderConfig` or a dict of ``DecoderConfig.tiny`` fields; random parameters
  of ``target_seed`` / ``drafter_seed``; ``num_prompts`` random prompts of ``prompt_len`` tokens split by
  ``heldout_fraction``) or real ones (``target`` / ``drafter``: anything ``sources.load_model`` takes; held-out
  prompts = ``heldout_prompts``, training prompts = ``train_prompts_per_task`` per category from the same packages,
  disjoint from them, chat-templated when ``chat``, those longer than ``max_prompt_len`` tokens left out).

  Data: the target's continuations (``max_new_tokens`` at ``sample_temperature``). ``eval_every``: the steered
  held-out TV every this many steps too (``eval_heldout_tv``; 0: only at the end).
  """
  JOB = JOB
  INTS = (("num_prompts", 2), ("prompt_len", 1), ("max_new_tokens", 1), ("batch_size", 1), ("num_steps", 1),
          ("checkpoint_every", 1), ("max_to_keep", 1), ("train_prompts_per_task", 1), ("max_prompt_len", 1),
          ("eval_every", 0), ("gamma", 1))

  sample_batch_size: int | None = None
  """Prompts a batch when the target samples the continuations (None: ``batch_size``)."""
  reuse_samples: str | None = None
  """Another run's work directory (or its ``samples.npz``) made with the same target and sampling settings, whose
  continuations of the prompts both runs have are taken rather than sampled again (a wider pool pays only for its
  new prompts)."""
  target_layers: tuple | None = None
  """The target layers the map reads (None: ``default_target_layers``)."""
  steered_layers: tuple | None = None
  """The drafter layers the map steers (None: all)."""
  rank: int | None = None
  """The map's rank (None: the paper's full ``W_guide``)."""
  gamma: int = 4
  """The loss's offsets ``1..gamma``."""
  scheme: str = "regular"
  """``"regular"``: one offset per step, the authors'; ``"blocks"``: blocks of ``gamma`` sharing one vector, as
  decoding drafts (``steer.SteerLoss``)."""
  divergence: str = "fkl"
  """The token-level divergence."""
  temperature: float = 1.0
  """The divergence's temperature."""
  sample_temperature: float = 1.0
  """The decoding temperature of the continuations."""
  beta: float = 0.5
  """JSD's mixing weight."""
  optimizer: dict | None = None
  """A dict of ``trainer.make_optimizer`` arguments (``total_steps`` = ``num_steps``; None: adamw 1e-3, cosine)."""
  finetune_drafter: dict | None = None
  """None (the drafter frozen), or a dict of :class:`~blockspec_jax.train.recipe.DrafterRecipe` fields but ``base``
  (``{"lora_rank": 16, "lora_alpha": 32}``): that part of the drafter trains with the map under the one loss."""
  drafter_optimizer: dict | None = None
  """The tuned drafter's own ``make_optimizer`` arguments (None: ``optimizer``'s), the map keeping ``optimizer``."""

  def check(self) -> None:
    if self.scheme not in steer_lib.SCHEMES:
      raise checks.UsageError(f"{JOB}.scheme must be one of {steer_lib.SCHEMES}, got {self.scheme!r}")
    self.check_int("sample_batch_size", optional=True)
    self.check_finetune()
    self.check_int("rank", optional=True)
    self.check_models_given()
    if self.real:
      self.check_model_names("target", "drafter")
      if self.finetune_recipe() is not None and sources.trained_run_spec(self.drafter) is not None:
        raise checks.UsageError(f"{JOB}.finetune_drafter tunes a base model; {JOB}.drafter = {self.drafter!r} is a "
                                "training run (train a map for it frozen, or give its base)")
    with job_setup.usage_errors(TypeError, ValueError):
      divergences.check_divergence(self.divergence, self.beta)
      divergences.check_temperature(self.temperature)
      sampling.Sampler(self.sample_temperature)
      self.build_optimizer()
    if not self.real:
      object.__setattr__(self, "target_config", _as_config(self.target_config, "target_config"))
      object.__setattr__(self, "drafter_config", _as_config(self.drafter_config, "drafter_config"))

  def check_finetune(self) -> None:
    """``finetune_drafter`` and ``drafter_optimizer``: dicts, the first without ``base``, the second only with the
    first; the recipe's fields checked."""
    finetune, drafter_optimizer = self.finetune_drafter, self.drafter_optimizer
    if finetune is not None and not isinstance(finetune, dict):
      raise checks.UsageError(f"{JOB}.finetune_drafter must be None or a dict of drafter recipe fields (e.g. "
                              f"{{'lora_rank': 16}}), got {finetune!r}")
    if finetune is not None and "base" in finetune:
      raise checks.UsageError(f"{JOB}.finetune_drafter must not set base: the base is {JOB}.drafter")
    if drafter_optimizer is not None and finetune is None:
      raise checks.UsageError(f"{JOB}.drafter_optimizer is set but the drafter is frozen (set {JOB}.finetune_drafter)")
    if drafter_optimizer is not None and not isinstance(drafter_optimizer, dict):
      raise checks.UsageError(f"{JOB}.drafter_optimizer must be a dict of make_optimizer arguments, got "
                              f"{drafter_optimizer!r}")
    self.finetune_recipe()

  def finetune_recipe(self) -> recipe_lib.DrafterRecipe | None:
    """The joint drafter's recipe (its base set once the drafter is loaded), None for a frozen drafter."""
    if self.finetune_drafter is None:
      return None
    with job_setup.usage_errors(TypeError, ValueError, prefix=f"{JOB}.finetune_drafter: "):
      return recipe_lib.DrafterRecipe(base=str(self.drafter or "drafter"), **self.finetune_drafter)

  def optimizer_args(self) -> dict:
    """The map's ``make_optimizer`` arguments."""
    return dict(self.optimizer or DEFAULT_OPTIMIZER)

  def drafter_optimizer_args(self) -> dict | None:
    """The tuned drafter's ``make_optimizer`` arguments (None for a frozen drafter)."""
    if self.finetune_drafter is None:
      return self.drafter_optimizer
    return dict(self.drafter_optimizer or self.optimizer_args())

  def build_optimizer(self):
    """The map's optimizer, or with ``finetune_drafter`` one per part (``"steer"``, ``"drafter"``)."""
    optimizer = self.optimizer_args()
    for name, value in (("optimizer", optimizer), ("drafter_optimizer", self.drafter_optimizer or {})):
      if "total_steps" in value:
        raise ValueError(f"{JOB}.{name} must not set total_steps (it is num_steps = {self.num_steps})")
    opt = trainer.make_optimizer(**optimizer, total_steps=self.num_steps)
    if self.finetune_drafter is not None:
      opt = trainer.by_part({"steer": opt, "drafter": trainer.make_optimizer(**self.drafter_optimizer_args(),
                                                                               total_steps=self.num_steps)})
    return opt


def _joint_parts(workdir: pathlib.Path, setup: job_setup.Setup, recipe: recipe_lib.DrafterRecipe, real: bool) -> dict:
  """The drafter's recipe for joint training (``recipe`` with ``base`` = the job's drafter), its derived config and
  parameters, its trainable / frozen parts, and its identity (the run's resolved directory for real models). Writes
  the run's ``drafter.json``, naming the ``"drafter"`` part of the checkpoints."""
  recipe = dataclasses.replace(recipe, base=setup.drafter_name)
  try:
    config, params = recipe.derive(setup.drafter_config, setup.drafter_params)
    parts = recipe.split(config, params)
  except (TypeError, ValueError) as e:
    raise checks.UsageError(f"{JOB}.finetune_drafter: {e}") from None
  recipe_lib.save_recipe(workdir, recipe, subtree="drafter")
  kept = "" if recipe.layers is None else f" (keeping layers {list(recipe.layers)})"
  print(f"the drafter tuned with the map: {recipe.base}{kept}, "
        f"{f'LoRA rank {recipe.lora_rank}' if recipe.lora_rank else 'a trainable subset'}", flush=True)
  name = str(workdir.resolve()) if real else f"{setup.drafter_name} tuned in {workdir.resolve()}"
  return dict(recipe=recipe, config=config, params=params, parts=parts, name=name)


def _describe(target_model, drafter_model, seconds: float, s: SteerSettings) -> str:
  return (f"loaded {s.target} (target, {target_model.config.num_layers} layers, D = {target_model.config.d_model}) "
          f"and {s.drafter} (drafter, {drafter_model.config.num_layers} layers, F = {drafter_model.config.ffn_dim}) "
          f"in {seconds:.1f} s")


@dataclasses.dataclass
class _Run:
  """What the training step and the report share: the models and prompts, the joint drafter (None: frozen), the
  layers, the loss and the data."""
  setup: job_setup.Setup
  joint: dict | None
  target_layers: tuple
  steered_layers: tuple
  loss_fn: steer_lib.SteerLoss
  data: distill.DistillData


def _prepare(workdir: pathlib.Path, s: SteerSettings) -> _Run:
  """The models and prompts, the joint drafter's parts, the layers checked, the loss and the data."""
  setup = job_setup.setup_models(workdir, s, drafter=True, split=False,
                                 describe=lambda t, d, seconds: _describe(t, d, seconds, s))
  target_cfg = setup.target_config
  joint = None
  if s.finetune_drafter is not None:
    joint = _joint_parts(workdir, setup, s.finetune_recipe(), s.real)
    setup.drafter_config, setup.drafter_params = joint["config"], joint["params"]
  drafter_cfg = setup.drafter_config
  with job_setup.usage_errors():
    target_layers = default_target_layers(target_cfg.num_layers) if s.target_layers is None else s.target_layers
    target_layers, steered_layers = steer_lib.check_steer_setup(target_cfg, drafter_cfg, target_layers,
                                                                s.steered_layers, s.gamma)
    loss_fn = steer_lib.SteerLoss(target_cfg, drafter_cfg, target_layers, steered_layers, s.gamma, s.divergence,
                                  s.temperature, s.beta, s.scheme,
                                  assemble_drafter=None if joint is None else joint["parts"].assemble)
    data = steer_lib.make_steer_data(target_cfg, setup.target_params, drafter_cfg, setup.prompts_NxP,
                                     setup.prompt_len_N, batch_size=s.batch_size, max_new_tokens=s.max_new_tokens,
                                     sample_batch_size=s.sample_batch_size, sample_temperature=s.sample_temperature,
                                     heldout_fraction=s.heldout_fraction, seed=s.seed, stop_ids=setup.stop_ids,
                                     split=setup.split, progress=s.progress,
                                     samples_path=pools.samples_path(workdir),
                                     samples_meta=pools.samples_meta(s.target if s.real else None, s.target_seed,
                                                                     s.weights_meta()),
                                     reuse_samples=s.reuse_samples, mesh=s.train_mesh())
  return _Run(setup, joint, target_layers, steered_layers, loss_fn, data)


def _record(s: SteerSettings, r: _Run) -> dict:
  """The settings as ``metrics.json`` and the map's record keep them."""
  settings = dict(target_layers=list(r.target_layers), steered_layers=list(r.steered_layers), rank=s.rank,
                  gamma=s.gamma, scheme=s.scheme, divergence=s.divergence, temperature=s.temperature,
                  sample_temperature=s.sample_temperature, batch_size=s.batch_size, max_new_tokens=s.max_new_tokens,
                  num_steps=s.num_steps, optimizer=s.optimizer_args(), seed=s.seed)
  if r.joint is not None:
    settings.update(finetune_drafter=r.joint["recipe"].to_json(), drafter_optimizer=s.drafter_optimizer_args())
  return settings


def _fit(workdir: pathlib.Path, s: SteerSettings, r: _Run, steer0) -> tuple:
  """The training run (resumed from the checkpoints) and the frozen trees."""
  setup, joint = r.setup, r.joint
  target_params, drafter_params = setup.target_params, setup.drafter_params
  trainable0 = steer0 if joint is None else {"steer": steer0, "drafter": joint["parts"].trainable}
  frozen = {"target": target_params, "drafter": drafter_params if joint is None else joint["parts"].frozen}
  tuned_count = "" if joint is None else \
      f", trained with the drafter's {params_lib.count_params(joint['parts'].trainable):,}"
  print(f"SD² map: target layers {list(r.target_layers)} -> {len(r.steered_layers)} drafter layers, "
        f"{'full rank' if s.rank is None else f'rank {s.rank}'}, {params_lib.count_params(steer0):,} parameters"
        f"{tuned_count}; {len(r.data.train_idx)} training / {len(r.data.heldout_idx)} held-out prompts", flush=True)
  eval_kwargs = dict(target_layers=r.target_layers, steered_layers=r.steered_layers, gamma=s.gamma)

  def eval_fn(step, trainable):
    del step
    steer, tuned_params = r.loss_fn.parts(trainable, frozen)
    return {"heldout_tv": steer_lib.heldout_tv(r.data, target_params, tuned_params, {"steered": steer},
                                               **eval_kwargs)["steered"]["tv"]}

  result = trainer.fit(loss_fn=r.loss_fn, optimizer=s.build_optimizer(), trainable=trainable0, frozen=frozen,
                       batch_fn=steer_lib.make_batch_fn(r.data), key=jax.random.key(s.seed), workdir=workdir,
                       loop=s.loop(), eval_fn=eval_fn if s.eval_every else None, label="SD² steering train step")
  return result, frozen


def _heldout_report(s: SteerSettings, r: _Run, steer0, trained, tuned_params) -> dict:
  """The held-out TV of the drafter plain and steered by the initial and trained maps (joint: the tuned drafter with
  the trained map and alone); printed."""
  target_params, drafter_params = r.setup.target_params, r.setup.drafter_params
  eval_kwargs = dict(target_layers=r.target_layers, steered_layers=r.steered_layers, gamma=s.gamma,
                     progress=s.progress)
  if r.joint is None:
    report = steer_lib.heldout_tv(r.data, target_params, drafter_params,
                                  {"before": steer0, "after": trained, "plain": None}, **eval_kwargs)
  else:  # the untuned drafter with and without the initial map, the tuned one with and without the trained map
    report = {**steer_lib.heldout_tv(r.data, target_params, drafter_params, {"before": steer0, "plain": None},
                                     **eval_kwargs),
              **steer_lib.heldout_tv(r.data, target_params, tuned_params, {"after": trained, "drafter_only": None},
                                     **eval_kwargs)}
  print(f"held-out TV: plain drafter {report['plain']['tv']:.4f}, steered before {report['before']['tv']:.4f}, "
        f"after {report['after']['tv']:.4f} (by offset 1..{s.gamma}: "
        f"{', '.join(f'{v:.4f}' for v in report['after']['by_offset'] if v is not None)})", flush=True)
  if r.joint is not None:
    print(f"held-out TV of the jointly tuned drafter without the map: {report['drafter_only']['tv']:.4f}",
          flush=True)
  return report


def _save_map(workdir: pathlib.Path, r: _Run, trained, report: dict, steps: int, settings: dict) -> None:
  """The trained map and its record (``steer.json`` / ``steer.npz``)."""
  setup, drafter_cfg = r.setup, r.setup.drafter_config
  record = {"target": setup.target_name, "drafter": setup.drafter_name,
            "drafter_layers": drafter_cfg.num_layers, "ffn_dim": drafter_cfg.ffn_dim, "steps": steps,
            "heldout_tv_before": report["before"]["tv"], "heldout_tv_after": report["after"]["tv"],
            "heldout_tv_plain": report["plain"]["tv"], **settings}
  if r.joint is not None:  # the map belongs to the drafter tuned with it: this run, at this step
    record.update(drafter=r.joint["name"], drafter_base=setup.drafter_name, drafter_step=steps,
                  heldout_tv_drafter_only=report["drafter_only"]["tv"])
  steer_lib.save_steer(workdir, trained, record)


def run(workdir, settings: SteerSettings) -> dict:
  """SD²'s steering map with ``settings``; returns the ``metrics.json`` summary (see the module docstring for the
  outputs)."""
  t0 = time.perf_counter()
  s = settings
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  r = _prepare(workdir, s)
  setup, data = r.setup, r.data
  steer0 = init_steer(setup.target_config.d_model, len(r.target_layers), setup.drafter_config, r.steered_layers,
                      rank=s.rank, seed=s.seed)
  settings_record = _record(s, r)
  result, frozen = _fit(workdir, s, r, steer0)
  rows = trainer.read_metrics(workdir / "metrics.jsonl")
  steps = int(result.state.step)
  if steps < s.num_steps:  # stopped early (stop_after): as if killed, nothing but the checkpoints
    return {"stopped_after": steps, "resumed_from": result.resumed_from, **settings_record}
  trained, tuned_params = r.loss_fn.parts(result.state.trainable, frozen)
  report = _heldout_report(s, r, steer0, trained, tuned_params)
  _save_map(workdir, r, trained, report, steps, settings_record)
  trainer.plot_losses(rows, workdir / "loss.png",  # the held-out curve from the untrained map to the trained one
                      points={"eval_heldout_tv": [(0, report["before"]["tv"]), (steps, report["after"]["tv"])]})
  summary = {
      "heldout_tv_before": report["before"]["tv"], "heldout_tv_after": report["after"]["tv"],
      "heldout_tv_plain": report["plain"]["tv"], "heldout_tv_before_by_offset": report["before"]["by_offset"],
      "heldout_tv_after_by_offset": report["after"]["by_offset"],
      "heldout_tv_plain_by_offset": report["plain"]["by_offset"],
      "final_loss": job_setup.final_loss(rows), "final_train_tv": rows[-1]["tv"] if rows else None,
      "steps": steps, "resumed_from": result.resumed_from, "seconds": time.perf_counter() - t0,
      "train_seconds": result.seconds, "train_seconds_total": job_setup.seconds_total(rows),
      "num_train_prompts": int(len(data.train_idx)), "num_heldout_prompts": int(len(data.heldout_idx)),
      "heldout_positions": int(data.fixed_mask_NxT[data.heldout_idx].sum()),
      "steer_params": params_lib.count_params(steer0), "target": setup.target_name,
      "drafter": setup.drafter_name, **job_setup.machine(s), **settings_record, **setup.info,
  }
  if r.joint is not None:
    summary.update(heldout_tv_drafter_only=report["drafter_only"]["tv"],
                   heldout_tv_drafter_only_by_offset=report["drafter_only"]["by_offset"],
                   drafter_trainable_params=params_lib.count_params(r.joint["parts"].trainable))
  (workdir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def steer_job(workdir, **overrides) -> dict:
  """SD²'s steering map: :class:`SteerSettings` from gin (``steer_job.*``) and ``overrides``, checked before any
  model loads, then :func:`run`; returns the ``metrics.json`` summary (see the module docstring for the outputs)."""
  return run(workdir, SteerSettings(**overrides))
