"""Drafters on the engine's contract (:class:`blockspec_jax.decoding.contracts.Drafter`), and their registry.

``DRAFTERS``: ``"model"`` (one chain from a small model), ``"k_chains"`` (SpecTr: k i.i.d. chains), ``"rsd_c"``
(RSD-C trees without replacement), ``"rsd_s"`` (RSD-S stochastic beam trees), ``"ngram"`` (prompt lookup, no model),
``"sprinter"`` (the model chain plus SPRINTER's verifier head; its setting ``head`` names the trained head's directory),
``"beam"`` (MJSD/MTAD: the best of ``width`` beams, sampled or deterministic; only ``mtad``, greedy and exact-match
verify it), ``"heads"`` (BPD: heads on the target's hidden state, raw or with the top-k lattice rescored by an
n-gram or a small neural LM, locally or by a global p-best search; built on the target's config), ``"steered"`` (SD²: the model chain steered by the target's hidden states; its setting ``steer`` names the
trained map's directory).
``make(name, config=..., vocab_size=..., **settings)`` builds one.
"""

from __future__ import annotations

from blockspec_jax.decoding.contracts import Drafter
from blockspec_jax.drafters.base import ModelDrafter, feed
from blockspec_jax.drafters.beam import BeamDrafter
from blockspec_jax.drafters.heads import HeadsDrafter
from blockspec_jax.drafters.ngram import NGramDrafter, lookup
from blockspec_jax.drafters.sprinter import SprinterDrafter
from blockspec_jax.drafters.steer import SteeredDrafter
from blockspec_jax.drafters.trees import (KChainDrafter, RSDConstantDrafter, RSDStochasticBeamDrafter, gumbel_top_k,
                                          shape_for_budget)

__all__ = ["Drafter", "ModelDrafter", "feed", "NGramDrafter", "lookup", "KChainDrafter", "RSDConstantDrafter",
           "RSDStochasticBeamDrafter", "SprinterDrafter", "SteeredDrafter", "HeadsDrafter", "BeamDrafter", "gumbel_top_k", "shape_for_budget", "DRAFTERS",
           "make"]

#: name -> drafter class (class attributes ``is_chain`` and ``sibling_sampling`` say which rules can verify it).
DRAFTERS = {"model": ModelDrafter, "k_chains": KChainDrafter, "rsd_c": RSDConstantDrafter,
            "rsd_s": RSDStochasticBeamDrafter, "ngram": NGramDrafter,
            "sprinter": SprinterDrafter, "beam": BeamDrafter, "heads": HeadsDrafter,
            "steered": SteeredDrafter}

_MODEL_FREE = ("ngram",)


def make(name: str, config=None, vocab_size: int | None = None, **settings):
  """The drafter registered as ``name``: model drafters need ``config`` (the drafter's DecoderConfig; a ``vocab_size``
  given with it must match), model-free ones ``vocab_size`` (the target's; else ``config.vocab_size``); ``settings``
  are the class's fields (``k``; ``branching``, ``epsilon``; ``width``, ``epsilon``; ``max_ngram``, ``min_ngram``).
  Unknown names and settings are a ValueError naming what is known; invalid values a ValueError from the class."""
  if name not in DRAFTERS:
    raise ValueError(f"unknown drafter {name!r}; known drafters: {', '.join(DRAFTERS)}")
  cls = DRAFTERS[name]
  fields = [f for f in cls.__dataclass_fields__ if f not in ("config", "vocab_size")]
  unknown = sorted(set(settings) - set(fields))
  if unknown:
    raise ValueError(f"drafter {name!r} has no settings {unknown}; its settings: {', '.join(fields) or 'none'}")
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
