"""Drafters on the engine's contract (:class:`blockspec_jax.contracts.Drafter`), and their registry.

``DRAFTERS`` (name -> class) is filled by one ``@register("<name>")`` on each drafter class
(:mod:`blockspec_jax.drafters.registry`); importing this package imports the modules that hold them. Each class's
docstring says what it drafts and which rules verify it; its settings are its fields
(:mod:`blockspec_jax.drafters.settings`), and drafters with a trained run own its artifact's I/O (``heads.py``,
``sprinter.py``, ``steer.py``).
``make(name, config=..., vocab_size=..., **settings)`` builds one; ``check_settings(name, settings)`` checks a job's
settings for one before any model loads (what does not depend on the models, and a trained run's record);
``shape_for_budget(name, budget)`` gives its shape at a node budget.
"""

from __future__ import annotations

from blockspec_jax.contracts import Drafter
from blockspec_jax.drafters.registry import DRAFTERS, register
from blockspec_jax.drafters.settings import is_int
# The built-in drafters, in the registry's order (each module registers its classes).
from blockspec_jax.drafters.base import ModelDrafter, feed
from blockspec_jax.drafters.trees import KChainDrafter, RSDConstantDrafter, RSDStochasticBeamDrafter, gumbel_top_k
from blockspec_jax.drafters.ngram import NGramDrafter, lookup
from blockspec_jax.drafters.sprinter import SprinterDrafter
from blockspec_jax.drafters.beam import BeamDrafter
from blockspec_jax.drafters.heads import HeadsDrafter
from blockspec_jax.drafters.steer import SteeredDrafter

__all__ = ["Drafter", "ModelDrafter", "feed", "NGramDrafter", "lookup", "KChainDrafter", "RSDConstantDrafter",
           "RSDStochasticBeamDrafter", "SprinterDrafter", "SteeredDrafter", "HeadsDrafter", "BeamDrafter",
           "gumbel_top_k", "shape_for_budget", "DRAFTERS", "register", "drafter_class", "make", "check_settings"]


def drafter_class(name):
  """The drafter class registered as ``name``; ValueError listing the known ones otherwise."""
  if not isinstance(name, str) or name not in DRAFTERS:
    raise ValueError(f"unknown drafter {name!r}; known drafters: {', '.join(DRAFTERS)}")
  return DRAFTERS[name]


def check_settings(name: str, settings: dict) -> None:
  """Check a job's settings for drafter ``name`` before any model loads; ValueError naming the problem.

  ``name``: a registered drafter, or a variant of one (``"heads/ngram"``: the drafter ``heads``; the part before
  ``/``, as ``methods.drafter_kind``). ``settings``: a dict of its settings. Checked: every key is a setting of the
  drafter, every value meets the constraints that do not depend on the models (those that do, such as sizes against
  ``V`` or layer counts, are checked when the drafter is built on the loaded models), and a drafter with a trained
  run (``run_setting``) names one whose directory holds its record (the JSON alone)."""
  if not isinstance(name, str):
    raise ValueError(f"a drafter name is a string such as 'k_chains' or 'heads/ngram', got {name!r}")
  drafter_class(name.partition("/")[0]).check_settings(settings)


def make(name: str, config=None, vocab_size: int | None = None, **settings):
  """The drafter registered as ``name``: model drafters need ``config`` (the drafter's DecoderConfig; a ``vocab_size``
  given with it must match), model-free ones ``vocab_size`` (the target's; else ``config.vocab_size``); ``settings``
  are the class's fields (``k``; ``branching``, ``epsilon``; ``width``, ``epsilon``; ``max_ngram``, ``min_ngram``).
  Unknown names and settings are a ValueError naming what is known; invalid values a ValueError from the class."""
  return drafter_class(name).from_configs(config, vocab_size, **settings)


def shape_for_budget(kind: str, budget: int, branches: int = 2) -> tuple[dict, int]:
  """``(settings, gamma)`` of a ``kind`` drafter with exactly ``budget`` draft nodes (what one target pass scores):
  the class's ``budget_shape``. Chains: γ = N. Trees put ``branches`` (2 by default, or 4) branches at the root and
  keep the depth at ``N / branches`` (``k_chains``: k = branches; ``rsd_c``: branching ``(branches, 1, …, 1)``;
  ``rsd_s``: width = branches). Budgets 4, 8, 16 give depths 2, 4, 8 (branches 2) and 1, 2, 4 (branches 4; depth 1 is
  no tree). Branching spread over depths, e.g. RSD-C ``(2, 2, 1, …)``, reaches only ``N = 2 + 4(γ − 1)`` (6, 10,
  14, …), none of the power-of-two budgets; build such drafters directly."""
  if not is_int(budget, 1):
    raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
  if kind not in DRAFTERS:
    raise ValueError(f"no budget shapes for drafter {kind!r}; known: {', '.join(DRAFTERS)}")
  return DRAFTERS[kind].budget_shape(int(budget), branches)
