"""Drafters on the engine's contract (:class:`blockspec_jax.contracts.Drafter`), and their registry.

``DRAFTERS``: ``"model"`` (one chain from a small model), ``"k_chains"`` (SpecTr: k i.i.d. chains), ``"rsd_c"``
(RSD-C trees without replacement), ``"rsd_s"`` (RSD-S stochastic beam trees), ``"ngram"`` (prompt lookup, no model),
``"sprinter"`` (the model chain plus SPRINTER's verifier head; its setting ``head`` names the trained head's directory),
``"beam"`` (MJSD/MTAD: the best of ``width`` beams, sampled or deterministic; only ``mtad``, greedy and exact-match
verify it), ``"heads"`` (BPD: heads on the target's hidden state, raw or with the top-k lattice rescored by an
n-gram or a small neural LM, locally or by a global p-best search; built on the target's config), ``"steered"``
(SD²: the model chain steered by the target's hidden states; its setting ``steer`` names the trained map's
directory).
``make(name, config=..., vocab_size=..., **settings)`` builds one; ``check_settings(name, settings)`` checks a job's
settings for one before any model loads (what does not depend on the models, and a trained run's record;
:mod:`blockspec_jax.drafters.settings`).
"""

from __future__ import annotations

from blockspec_jax.contracts import Drafter
from blockspec_jax.drafters.base import ModelDrafter, feed
from blockspec_jax.drafters.beam import BeamDrafter
from blockspec_jax.drafters.heads import HeadsDrafter
from blockspec_jax.drafters.ngram import NGramDrafter, lookup
from blockspec_jax.drafters.sprinter import SprinterDrafter
from blockspec_jax.drafters.steer import SteeredDrafter
from blockspec_jax.drafters.trees import (KChainDrafter, RSDConstantDrafter, RSDStochasticBeamDrafter, gumbel_top_k,
                                          shape_for_budget)

__all__ = ["Drafter", "ModelDrafter", "feed", "NGramDrafter", "lookup", "KChainDrafter", "RSDConstantDrafter",
           "RSDStochasticBeamDrafter", "SprinterDrafter", "SteeredDrafter", "HeadsDrafter", "BeamDrafter",
           "gumbel_top_k", "shape_for_budget", "DRAFTERS", "make", "check_settings"]

#: name -> drafter class (class attributes ``is_chain`` and ``sibling_sampling`` say which rules can verify it; ``name``
#: is its key; ``check_settings`` / ``setting_names``: :class:`~blockspec_jax.drafters.settings.Settings`).
DRAFTERS = {"model": ModelDrafter, "k_chains": KChainDrafter, "rsd_c": RSDConstantDrafter,
            "rsd_s": RSDStochasticBeamDrafter, "ngram": NGramDrafter,
            "sprinter": SprinterDrafter, "beam": BeamDrafter, "heads": HeadsDrafter,
            "steered": SteeredDrafter}

_MODEL_FREE = ("ngram",)


def _registered(name):
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
  run (``heads``, ``sprinter``, ``steered``) names one whose directory holds its record (the JSON alone)."""
  if not isinstance(name, str):
    raise ValueError(f"a drafter name is a string such as 'k_chains' or 'heads/ngram', got {name!r}")
  _registered(name.partition("/")[0]).check_settings(settings)


def make(name: str, config=None, vocab_size: int | None = None, **settings):
  """The drafter registered as ``name``: model drafters need ``config`` (the drafter's DecoderConfig; a ``vocab_size``
  given with it must match), model-free ones ``vocab_size`` (the target's; else ``config.vocab_size``); ``settings``
  are the class's fields (``k``; ``branching``, ``epsilon``; ``width``, ``epsilon``; ``max_ngram``, ``min_ngram``).
  Unknown names and settings are a ValueError naming what is known; invalid values a ValueError from the class."""
  cls = _registered(name)
  cls.check_known(settings)
  if name in _MODEL_FREE:
    if vocab_size is None:
      vocab_size = getattr(config, "vocab_size", None)
    if vocab_size is None:
      raise ValueError(f"drafter {name!r} needs the target's vocab_size")
    return cls(vocab_size=int(vocab_size), **settings)
  if config is None:
    raise ValueError(f"drafter {name!r} drafts with a model: pass its DecoderConfig (config=...)")
  if vocab_size is not None and int(vocab_size) != config.vocab_size:
    raise ValueError(f"vocabulary mismatch between drafter {name!r} (V = {config.vocab_size}) and target "
                     f"(V = {vocab_size}); both models must share one tokenizer")
  return cls(config, **settings)
