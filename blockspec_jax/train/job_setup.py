"""What the four training jobs share (no gin here: the jobs' entry-point modules register their settings with it).

* :class:`JobSettings`: the settings every job has (a real target or a random tiny one, the prompts, the training
  loop's steps, batch, checkpoints, seed) with their checks; :class:`PairSettings` adds the drafter (the jobs that
  train toward a target with a drafter: ``distill_job``, ``sprinter_job``, ``steer_job``) and the rule "give either
  real models or random tiny configs, not a mix". A job's settings object subclasses one of them (a frozen
  dataclass) and checks the rest in its ``check()``: constructing it checks everything, before any model loads.
* :class:`Setup` and :func:`setup_models`: the models (loaded by name, or random tiny ones) and the prompt pool
  (the shipped held-out file and a disjoint training pool, or random prompts) a job trains on.
* small pieces of the summaries (:func:`final_loss`, :func:`seconds_total`, :func:`machine`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from typing import Any, Callable, ClassVar

import jax
import numpy as np

from blockspec_jax import checks
from blockspec_jax import methods
from blockspec_jax import parallel
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.data import formats as formats_lib
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.train import distill, pools, trainer

__all__ = ["JobSettings", "PairSettings", "Setup", "random_setup", "setup_models", "real_prompt_rows", "encode_rows",
           "usage_errors", "final_loss", "seconds_total", "machine"]


@contextlib.contextmanager
def usage_errors(*errors: type[Exception], prefix: str = ""):
  """A ValueError (or ``errors``) raised inside becomes a :class:`~blockspec_jax.checks.UsageError` with its message
  (after ``prefix``)."""
  try:
    yield
  except errors or (ValueError,) as e:
    raise checks.UsageError(f"{prefix}{e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSettings:
  """The settings every training job has; constructing one checks them (a UsageError naming ``<job>.<setting>``).

  The target is either random tiny (``target_config``) or real (``target``); which fields a job requires is its
  ``check()``'s business. Subclasses set ``JOB`` (the gin name) and ``INTS`` (``(setting, lowest value)`` of their
  integer settings, checked in that order first), and may redeclare a field to change its default.
  """
  JOB: ClassVar[str] = "job"
  INTS: ClassVar[tuple] = ()

  target: Any = None
  """A real target: a model name or path (anything ``sources.load_model`` takes). None for a random tiny target."""
  target_config: Any = None
  """A random tiny target's config (``@tiny_decoder()``); None for a real target."""
  target_seed: int = 0
  """The random tiny target's parameter seed."""
  num_prompts: int = 128
  """Random tiny models: this many random prompts ..."""
  prompt_len: int = 8
  """... of this many tokens ..."""
  heldout_fraction: float = 0.125
  """... of which this fraction is held out."""
  heldout_prompts: str = pools.DEFAULT_HELDOUT
  """Real models: the held-out prompts (the shipped file: every category)."""
  train_prompts_per_task: int = 48
  """Real models: training prompts per category, from the same packages, disjoint from the held-out ones (item,
  math template and text)."""
  max_prompt_len: int = pools.DEFAULT_MAX_PROMPT_LEN
  """Real models: prompts longer than this many tokens are left out of training (a held-out one is an error)."""
  chat: bool = True
  """Real models: chat-templated prompts."""
  system: Any = "default"
  """Real models: each prompt's system turn, ``"default"`` (the template's own), ``"none"``, a system message, or a
  tuple of these cycled over the training prompts and over the held-out ones (varied formats; ``data.prompts``)."""
  dtype: str = "float32"
  """Real models: the parameters' dtype."""
  target_weights: str = "dequantized"
  """Real models: the target's weights (``hub.load_model``'s ``weights``). "quantized" keeps its GGUF's blocks as
  stored: its samples, hidden states and logits come from the same weights in about 5x fewer bytes a step (bit for
  bit on the CPU kernel up to 256 tokens a pass, within 1e-5 beyond). Drafters train in float32 either way."""
  max_new_tokens: int = 16
  """Tokens generated per prompt (the continuations the job learns from)."""
  batch_size: int = 16
  """Training examples per step."""
  num_steps: int = 100
  """Training steps (also the optimizer schedule's ``total_steps``)."""
  checkpoint_every: int = 50
  """A checkpoint every this many steps (``checkpoints/``; re-running the command resumes from the newest)."""
  max_to_keep: int = 2
  """Checkpoints kept."""
  eval_every: int = 0
  """A held-out evaluation every this many steps too (0: only before / after training)."""
  seed: int = 0
  """The job's seed (prompt pools, splits, sampling, batches)."""
  progress: bool = True
  """Progress bars and per-step lines."""
  data_parallel: bool = True
  """Train on every device (the ``mesh`` below: each batch split over ``data``, so ``batch_size`` must be a
  multiple of its size), the same updates as one device up to the order of float32 sums; on one device nothing
  changes (no mesh). False: the first device only."""
  mesh: tuple | None = None
  """``(data, model)`` with ``data × model`` = the run's devices (checked with the other settings, before any model
  loads): batches and the target's sampled rows over ``data``, the frozen target's parameters over ``model`` (as the
  main job lays out a model). None: ``(devices, 1)``, every device over ``data``."""
  stop_after: int | None = None
  """Stop (with a checkpoint) once this many steps are done, as if killed: for resume tests."""

  def __post_init__(self):
    for name, low in self.INTS:
      self.check_int(name, low)
    self.check_int("stop_after", 1, optional=True)
    self.check_target_weights()
    self.check_system()
    self.check()
    self.train_mesh()

  def train_mesh(self):
    """The ``(data, model)`` mesh of :attr:`mesh` over every device of the run with ``data_parallel`` and more than
    one device, else None; a UsageError when the shape does not cover the devices or ``batch_size`` does not split
    over ``data``."""
    if not self.data_parallel:
      return None
    shape = parallel.check_mesh_shape(self.mesh, self.name("mesh"))
    mesh = parallel.job_mesh(shape)
    if mesh is None:
      return None
    if self.batch_size % mesh.shape[parallel.DATA]:
      raise checks.UsageError(f"{self.name('batch_size')} = {self.batch_size} must be a multiple of the "
                              f"{mesh.shape[parallel.DATA]} devices the batches are split over (or another "
                              f"{self.name('mesh')}, or {self.name('data_parallel')} = False: one device)")
    return mesh

  def loop(self) -> trainer.Loop:
    """The training loop's settings (steps, checkpoints, evaluations, progress, stop, mesh) for ``trainer.fit``."""
    return trainer.Loop(num_steps=self.num_steps, checkpoint_every=self.checkpoint_every, max_to_keep=self.max_to_keep,
                        eval_every=self.eval_every, progress=self.progress, stop_after=self.stop_after,
                        mesh=self.train_mesh())

  def check(self) -> None:
    """The job's own checks (after ``INTS``); raises UsageError."""

  def name(self, setting: str) -> str:
    """``<job>.<setting>``, as messages name a setting."""
    return f"{self.JOB}.{setting}"

  def check_int(self, setting: str, low: int = 1, *, optional: bool = False) -> None:
    """``setting`` is a Python int >= ``low`` (or, ``optional``, None)."""
    value = getattr(self, setting)
    if not (optional and value is None):
      pools.check_int(value, setting, low, job=self.JOB)

  def check_model_names(self, *settings: str) -> None:
    """The real models ``settings`` are names or paths, and the dtype and names are usable."""
    for setting in settings:
      value = getattr(self, setting)
      if not isinstance(value, str):
        raise checks.UsageError(f"{self.name(setting)} must be a model name or path, got {value!r}")
    methods.check_settings(dtype=self.dtype, models=tuple(getattr(self, s) for s in settings))

  def check_target_weights(self) -> None:
    from blockspec_jax.models import hub
    if self.target_weights not in hub.WEIGHTS:
      raise checks.UsageError(f"{self.name('target_weights')} must be one of {hub.WEIGHTS}, got "
                              f"{self.target_weights!r}")
    if self.target_weights != "dequantized" and self.target is None:
      raise checks.UsageError(f"{self.name('target_weights')} = {self.target_weights!r} is for a real target (a "
                              "GGUF model); the random tiny target has float32 weights")

  def check_system(self) -> None:
    """:attr:`system` is a prompt format or a tuple of them (``formats.system_setting``: one becomes a string)."""
    try:
      object.__setattr__(self, "system", formats_lib.system_setting(self.system, self.chat))
    except checks.UsageError as e:
      raise checks.UsageError(f"{self.name('system')}: {e}") from None

  def weights_meta(self) -> dict:
    """What the target's weights add to a cached file's record: nothing for the dequantized weights (so earlier
    files stay valid), the kind otherwise."""
    return {} if self.target_weights == "dequantized" else {"target_weights": self.target_weights}

  def check_heldout_fraction(self) -> None:
    if not 0.0 < self.heldout_fraction < 1.0:
      raise checks.UsageError(f"{self.name('heldout_fraction')} must be in (0, 1), got {self.heldout_fraction}")

  @property
  def real(self) -> bool:
    """Real models (by name), not random tiny ones."""
    return self.target is not None

  def prompt_meta(self) -> dict:
    """The prompt settings that decide the prompt pool (recorded with cached data)."""
    if self.real:
      meta = dict(chat=self.chat, max_prompt_len=self.max_prompt_len,
                  train_prompts_per_task=self.train_prompts_per_task)
      if self.system != formats_lib.SYSTEM_DEFAULT:  # recorded only when set, so earlier files stay valid
        meta["system"] = list(self.system) if isinstance(self.system, tuple) else self.system
      return meta
    return dict(num_prompts=self.num_prompts, prompt_len=self.prompt_len,
                heldout_fraction=float(self.heldout_fraction))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairSettings(JobSettings):
  """:class:`JobSettings` with a drafter: real models (``target`` and ``drafter``) or random tiny ones
  (``target_config`` and ``drafter_config``), not a mix (``MODELS_HINT`` says how the job names its real models)."""
  MODELS_HINT: ClassVar[str] = "{job}.target and {job}.drafter (model names)"

  drafter: Any = None
  """A real drafter (a model name or path, anything ``sources.load_model`` takes); None for a random tiny one."""
  drafter_config: Any = None
  """A random tiny drafter's config (``@tiny_decoder()``); None for a real drafter."""
  drafter_seed: int = 1
  """The random tiny drafter's parameter seed."""

  @property
  def real(self) -> bool:
    return self.target is not None and self.drafter is not None

  def check_models_given(self) -> None:
    """Both real models and no config, or both configs and no real model."""
    models_given = (self.target is not None, self.drafter is not None)
    configs_given = (self.target_config is not None, self.drafter_config is not None)
    real = all(models_given)
    if not (real and not any(configs_given)) and not (all(configs_given) and not any(models_given)):
      raise checks.UsageError(f"give either {self.MODELS_HINT.format(job=self.JOB)}, or {self.JOB}.target_config and "
                              f"{self.JOB}.drafter_config (random tiny models), not a mix")


@dataclasses.dataclass
class Setup:
  """The models and prompts a job trains on: configs and parameters (the drafter's None for a target-only job), the
  prompts (``prompts_NxP`` int32, ``prompt_len_N``), their ``(train_idx, heldout_idx)`` split (None: the job splits
  by ``heldout_fraction``), the stop ids, the models' labels and ``info`` for the summary (real models: the training
  prompts by task and how many were too long)."""
  target_config: decoder_lib.DecoderConfig
  target_params: dict
  drafter_config: decoder_lib.DecoderConfig | None
  drafter_params: dict | None
  prompts_NxP: np.ndarray
  prompt_len_N: np.ndarray
  split: tuple | None
  stop_ids: tuple
  target_name: str
  drafter_name: str | None
  info: dict


def random_setup(settings: JobSettings, drafter: bool, split: bool) -> Setup:
  """Random tiny models: parameters of ``target_seed`` (and ``drafter_seed``), ``num_prompts`` random prompts of
  ``prompt_len`` tokens, split by ``heldout_fraction`` when ``split`` (else None: the job splits them)."""
  s = settings
  prompts_NxP, prompt_len_N = distill.random_prompts(s.num_prompts, s.prompt_len, s.target_config.vocab_size, s.seed)
  drafter_config = s.drafter_config if drafter else None
  return Setup(target_config=s.target_config, target_params=decoder_lib.init_params(s.target_config, s.target_seed),
               drafter_config=drafter_config,
               drafter_params=decoder_lib.init_params(drafter_config, s.drafter_seed) if drafter else None,
               prompts_NxP=prompts_NxP, prompt_len_N=prompt_len_N,
               split=distill.split_prompts(s.num_prompts, s.heldout_fraction, s.seed) if split else None,
               stop_ids=(), target_name=pools.model_name(None, s.target_config, s.target_seed),
               drafter_name=pools.model_name(None, drafter_config, s.drafter_seed) if drafter else None, info={})


def _load(settings: JobSettings, drafter: bool, describe: Callable[[Any, Any, float], str]) -> tuple:
  """The real target (and drafter: the target itself when both are the same name), checked as a pair, and the line
  ``describe(target_model, drafter_model, seconds)`` printed."""
  t0 = time.perf_counter()
  target_model = sources.load_model(settings.target, settings.dtype, weights=settings.target_weights)
  drafter_model = None
  if drafter:
    same = settings.drafter == settings.target and settings.target_weights == "dequantized"
    drafter_model = target_model if same else sources.load_model(settings.drafter, settings.dtype)
    sources.check_pair(target_model, drafter_model)
  print(describe(target_model, drafter_model, time.perf_counter() - t0), flush=True)
  return target_model, drafter_model


def real_prompt_rows(workdir: pathlib.Path, settings: JobSettings) -> tuple[list, list]:
  """Real models: the held-out rows (``heldout_prompts``) and a disjoint training pool (``train_prompts_per_task``
  per category), written to ``workdir`` as ``prompts_*.jsonl`` on the first run and read back on a resume."""
  s = settings
  heldout_rows, train_rows = pools.prompt_rows(workdir, s.heldout_prompts, s.train_prompts_per_task, s.seed)
  prompts_lib.check_disjoint(train_rows, heldout_rows)
  return heldout_rows, train_rows


def encode_rows(target_model, rows: tuple[list, list], settings: JobSettings) -> tuple:
  """``(prompts_NxP, prompt_len_N, (train_idx, heldout_idx), info)``: ``rows = (heldout, train)`` encoded with the
  target's tokenizer (``pools.encode_pool``); ``info`` counts the training prompts by task and the long ones."""
  prompts_NxP, prompt_len_N, split, by_task, dropped = pools.encode_pool(
      target_model, rows[0], rows[1], settings.max_prompt_len, settings.chat, settings.JOB, settings.system)
  return prompts_NxP, prompt_len_N, split, {"train_prompts_by_task": by_task, "train_prompts_dropped_long": dropped}


def setup_models(workdir: pathlib.Path, settings: JobSettings, *, drafter: bool, split: bool,
                 describe: Callable[[Any, Any, float], str]) -> Setup:
  """The job's models and prompts. Random tiny models: parameters of the seeds, ``num_prompts`` random prompts (split
  by ``heldout_fraction`` when ``split``, else None). Real models: the prompts (:func:`real_prompt_rows`), the models
  by name (``describe(target_model, drafter_model, seconds)`` is the line printed after loading), the prompts encoded
  with the target's tokenizer. ``drafter``: the job has a drafter (:class:`PairSettings`)."""
  s = settings
  if not s.real:
    return random_setup(s, drafter, split)
  rows = real_prompt_rows(workdir, s)
  target_model, drafter_model = _load(s, drafter, describe)
  prompts_NxP, prompt_len_N, split_idx, info = encode_rows(target_model, rows, s)
  return Setup(target_config=target_model.config, target_params=target_model.params["params"],
               drafter_config=drafter_model.config if drafter else None,
               drafter_params=drafter_model.params["params"] if drafter else None,
               prompts_NxP=prompts_NxP, prompt_len_N=prompt_len_N, split=split_idx,
               stop_ids=tuple(target_model.stop_ids), target_name=str(s.target),
               drafter_name=str(s.drafter) if drafter else None, info=info)


def final_loss(rows: list):
  """The last ``metrics.jsonl`` row's loss (None without rows)."""
  return rows[-1]["loss"] if rows else None


def seconds_total(rows: list):
  """The run's training seconds over every resume (the last row's ``seconds_total``; None without one)."""
  return rows[-1]["seconds_total"] if rows and "seconds_total" in rows[-1] else None


def machine(settings: JobSettings) -> dict:
  """``peak_rss_gb``, ``device`` (the platform), ``data_parallel_devices`` (the devices each training batch was
  split over: 1 without a mesh) and ``mesh`` (``[data, model]``) for a summary."""
  mesh = settings.train_mesh()
  return {"peak_rss_gb": runtime.peak_rss_gb(), "device": jax.devices()[0].platform,
          "data_parallel_devices": 1 if mesh is None else mesh.shape[parallel.DATA],
          "mesh": [1, 1] if mesh is None else [mesh.shape[parallel.DATA], mesh.shape[parallel.MODEL]]}
