"""Drafter settings, checked before the models load (:func:`blockspec_jax.drafters.check_settings`) and again, with
the models' configs, when the drafter is built: one implementation of every constraint.

Every registered drafter class mixes in :class:`Settings`. Its settings are its dataclass fields but those the job
fills in itself (``job_fields``: the drafter's or the target's DecoderConfig, the target's vocabulary). One
classmethod, ``checked(values, config)``, holds every constraint on their values: without a config (before any model
loads) it checks what does not depend on the models; ``__post_init__`` calls it with the drafter's config
(:meth:`Settings.check_fields`), which adds the constraints that do (``V``, layer counts). Drafters with a trained
run (class attribute ``run_setting``: the field naming the run's work directory; ``run_what``, ``run_train`` say what
it holds and how to train one) also check, before any model loads, that it is given and holds its record (the JSON
alone: cheap); their ``load_params`` reads the arrays.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["Settings", "is_int", "check_count", "check_directory", "read_record"]


def is_int(value, low: int | None = None) -> bool:
  """True for a Python or NumPy integer (not a bool) ``>= low`` (any integer when ``low`` is None)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    return False
  return low is None or value >= low


def check_count(value, config, what: str, hint: str = "") -> int:
  """``value`` as an ``int`` when it is an integer in ``[1, V]`` (``V = config.vocab_size``; ``config`` None: before
  the models load, only ``>= 1`` is checked). ValueError ``"<what> must be an integer in [1, V = <V>]<hint>, got
  <value!r>"`` otherwise (``[1, V]`` without a config)."""
  vocab = None if config is None else config.vocab_size
  if not is_int(value, 1) or (vocab is not None and value > vocab):
    bound = "V" if vocab is None else f"V = {vocab}"
    raise ValueError(f"{what} must be an integer in [1, {bound}]{hint}, got {value!r}")
  return int(value)


def check_directory(value, setting: str):
  """``value`` when it is None or a path (a non-empty string or ``os.PathLike``): a setting naming a directory;
  ValueError naming ``setting`` otherwise."""
  if value is None or (isinstance(value, os.PathLike) or (isinstance(value, str) and value)):
    return value
  raise ValueError(f"{setting} must name a directory (a path), got {value!r}")


def read_record(read: Callable[[Any], dict], directory, remedy: str) -> dict:
  """``read(directory)``: an artifact's record (:meth:`blockspec_jax.artifacts.Artifact.read_record`), with every
  problem a ValueError: the artifact's own message (a missing directory also says ``remedy``: how to make one; a
  directory without the record already names the training job)."""
  try:
    return read(directory)
  except FileNotFoundError as e:
    hint = "" if pathlib.Path(directory).expanduser().is_dir() else f"; {remedy}"
    raise ValueError(f"{e}{hint}") from None


class Settings:
  """The settings of a drafter class (a frozen dataclass; see the module docstring), and how a job builds it.
  Subclasses are registered by ``@drafters.register("<name>")`` (which sets ``name``), set ``job_fields`` and extend
  :meth:`checked`; those with a trained run set ``run_setting``, ``run_what``, ``run_train`` and define
  ``_run_record(directory) -> dict``. The classmethods below are the drafter's declarations to the jobs and tests:
  override them where the defaults do not fit (a tree's shape, trained parts)."""

  name = ""  # the registered name: set by drafters.register
  job_fields = ()  # fields the job fills in: "config" (the drafter model's DecoderConfig), "vocab_size" (the target's)

  # --- construction -------------------------------------------------------------------------------------------------

  @classmethod
  def from_configs(cls, config=None, vocab_size: int | None = None, **settings):
    """The drafter on the drafter model's ``config`` (a DecoderConfig; a ``vocab_size`` given with it must match) or,
    for a model-free drafter (``"vocab_size"`` in ``job_fields``), sized by ``vocab_size`` (the target's; else
    ``config.vocab_size``); ``settings`` are its fields. ValueError naming an unknown setting, a missing config or
    vocabulary, a mismatch (invalid values: the class's own ValueError)."""
    cls.check_known(settings)
    if "vocab_size" in cls.job_fields:
      if vocab_size is None:
        vocab_size = getattr(config, "vocab_size", None)
      if vocab_size is None:
        raise ValueError(f"drafter {cls.name!r} needs the target's vocab_size")
      return cls(vocab_size=int(vocab_size), **settings)
    if config is None:
      raise ValueError(f"drafter {cls.name!r} drafts with a model: pass its DecoderConfig (config=...)")
    if vocab_size is not None and int(vocab_size) != config.vocab_size:
      raise ValueError(f"vocabulary mismatch between drafter {cls.name!r} (V = {config.vocab_size}) and target "
                       f"(V = {vocab_size}); both models must share one tokenizer")
    return cls(config, **settings)

  @classmethod
  def build(cls, target_config, drafter_config, **settings):
    """The drafter a job runs on its loaded models' DecoderConfigs (default: :meth:`from_configs` on the drafter
    model, sized by the target's vocabulary; drafters built on the target, the BPD heads, override it)."""
    return cls.from_configs(drafter_config, target_config.vocab_size, **settings)

  @classmethod
  def default_settings(cls, gamma: int) -> dict:
    """The settings a job's drafter gets for maximum depth ``gamma`` where it sets none itself (default: none; the
    class's field defaults apply). RSD-C, whose depth is its shape, returns a branching of depth ``gamma``."""
    del gamma
    return {}

  @classmethod
  def budget_shape(cls, budget: int, branches: int = 2) -> tuple[dict, int]:
    """``(settings, gamma)`` with exactly ``budget`` draft nodes (``drafters.shape_for_budget``): a chain drafter
    drafts ``γ = budget`` nodes; tree drafters override it (``branches`` branches at the root)."""
    if getattr(cls, "is_chain", False):
      return {}, int(budget)
    raise ValueError(f"drafter {cls.name!r} declares no shapes for a node budget (budget_shape)")

  @classmethod
  def _budget_depth(cls, budget: int, branches) -> int:
    """The depth ``budget / branches`` of a tree with ``branches`` branches at the root (for the tree drafters'
    :meth:`budget_shape`)."""
    if not is_int(branches, 1):
      raise ValueError(f"branches must be an integer >= 1, got {branches!r}")
    if budget % branches:
      raise ValueError(f"{cls.name} shapes with {branches} branches need a budget divisible by {branches}, got "
                       f"{budget}")
    return budget // branches

  @classmethod
  def untrained(cls, target_config, target_params, drafter_config, drafter_params, gamma: int):
    """``(drafter, params)`` on the given models (DecoderConfigs and their parameter trees) for maximum depth
    ``gamma``, at :meth:`default_settings`, with any trained parts at their initial values (what the registry-wide
    law tests and smoke runs use where no training run exists). Default: :meth:`build`, the drafter model's
    parameters; drafters with trained parts override it."""
    del target_params
    return cls.build(target_config, drafter_config, **cls.default_settings(gamma)), drafter_params

  # --- settings -------------------------------------------------------------------------------------------------------

  @classmethod
  def setting_names(cls) -> tuple[str, ...]:
    """The fields a job's ``drafter_settings`` entry may set, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in cls.job_fields)

  @classmethod
  def check_known(cls, settings) -> None:
    """ValueError unless ``settings`` is a dict whose keys are all settings of this drafter (naming the unknown ones
    and listing the known)."""
    if not isinstance(settings, Mapping):
      raise ValueError(f"drafter {cls.name!r} takes its settings as a dict of setting -> value, got {settings!r}")
    names = cls.setting_names()
    unknown = sorted(set(settings) - set(names), key=str)
    if unknown:
      raise ValueError(f"drafter {cls.name!r} has no settings {unknown}; its settings: {', '.join(names) or 'none'}")

  @classmethod
  def checked(cls, values: dict, config=None) -> dict:
    """``values`` (every setting, by name) normalized (Python ints, tuples), after checking every constraint on
    them: those that need no model always, those that depend on the models' sizes when ``config`` (the DecoderConfig
    the drafter is built on) is given. ValueError naming the first problem. Subclasses extend it."""
    return dict(values)

  @classmethod
  def check_settings(cls, settings: Mapping) -> None:
    """Everything about ``settings`` (a job's ``drafter_settings`` entry, unset settings at their defaults) that can
    be checked before the models load: known settings, values (:meth:`checked` without a config) and, for a drafter
    with a trained run, the run's record (:meth:`check_run`). ValueError naming the problem."""
    cls.check_known(settings)
    cls.checked({**cls._defaults(), **settings})
    if getattr(cls, "run_setting", None) is not None:
      cls.check_run(settings)

  @classmethod
  def _defaults(cls) -> dict:
    return {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.name not in cls.job_fields}

  def check_fields(self, config) -> None:
    """``__post_init__``'s check: :meth:`checked` on the drafter's own settings with ``config``; the normalized
    values replace the fields."""
    values = {name: getattr(self, name) for name in self.setting_names()}
    for name, value in self.checked(values, config).items():
      object.__setattr__(self, name, value)

  # --- drafters with a trained run ------------------------------------------------------------------------------------

  @classmethod
  def run_needed(cls) -> str:
    """The message for a missing run: what the drafter needs, how to train it and how to bind it."""
    return (f"needs {cls.run_what}: {cls.run_train} and bind drafter_settings = "
            f"{{{cls.name!r}: {{{cls.run_setting!r}: '<its work directory>'}}}}")

  @classmethod
  def read_run(cls, directory) -> dict:
    """The record of the trained run in ``directory`` (its JSON alone); ValueError saying what is wrong and what to
    do (None: the run is missing, :meth:`run_needed`)."""
    if directory is None:
      raise ValueError(cls.run_needed())
    return read_record(cls._run_record, check_directory(directory, cls.run_setting), cls.run_train)

  @classmethod
  def check_run(cls, settings: Mapping) -> dict:
    """The run's record for ``settings`` (ValueError when it is missing or unreadable); subclasses check more."""
    return cls.read_run(settings.get(cls.run_setting))
