"""Where a job's models come from: a registry name, a checkpoint path (GGUF file or Hugging Face directory), or the
work directory of a drafter training run (``<dir>``, ``<dir>@<step>``, ``<dir>@init``); and the drafter/target pair
check (one tokenizer).
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from blockspec_jax.checks import UsageError

__all__ = ["trained_run_spec", "load_model", "load_models", "check_pair"]


def trained_run_spec(name) -> tuple[str, int | str | None] | None:
  """``(workdir, step)`` when ``name`` is a drafter training run's work directory, optionally with ``@<step>`` or
  ``@init`` appended (``results/train/distill_qwen_tvd@init``); None otherwise."""
  from blockspec_jax.train import recipe
  if not isinstance(name, (str, os.PathLike)):
    return None
  text = os.fspath(name)
  base, sep, tail = text.rpartition("@")
  if sep and recipe.is_trained_dir(base):
    if tail == "init":
      return base, "init"
    if tail.isdigit():
      return base, int(tail)
    raise UsageError(f"{text!r}: after '@' a trained drafter takes a checkpoint step or 'init', got {tail!r}")
  if recipe.is_trained_dir(text):
    return text, None
  return None


def load_model(name, dtype: str = "float32", cache_dir=None, progress: bool = True, scan_layers: bool = False,
               weights: str = "dequantized"):
  """A model for a job: a registry name or checkpoint path (:func:`blockspec_jax.models.hub.load_model`), or the work
  directory of a drafter training run (``python -m blockspec_jax.train``; it holds ``drafter.json``): its newest
  checkpoint, ``<dir>@<step>`` for another kept step, ``<dir>@init`` for the drafter before training
  (:func:`blockspec_jax.train.recipe.load_trained`). ``scan_layers``: the decoding layout, layers stacked and
  compiled once (``hub.scanned``); decoding jobs ask for it, training jobs keep the per-layer layout. ``weights``:
  ``hub.load_model``'s ("quantized": the GGUF's blocks as stored; for a trained run, its base model's, with the
  trained parts beside them: ``recipe.load_trained``)."""
  from blockspec_jax.models import hub
  trained = trained_run_spec(name)
  if trained is not None:
    from blockspec_jax.train import recipe
    model = recipe.load_trained(trained[0], trained[1], dtype, cache_dir, progress=progress, weights=weights)
    return hub.scanned(model) if scan_layers else model
  try:
    return hub.load_model(name, dtype, cache_dir, progress=progress, scan_layers=scan_layers, weights=weights)
  except (ValueError, NotImplementedError) as e:
    if isinstance(e, UsageError) or not os.path.exists(os.fspath(name)):
      raise
    # A user's own checkpoint that cannot be read (hub names the file and the problem): the input's fault.
    raise UsageError(f"cannot load the checkpoint {name}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None


def load_models(target: str, drafters: Sequence[str], dtype: str = "float32", cache_dir=None,
                scan_layers: bool = True, weights: str = "dequantized"):
  """The target and each drafter (``hub.LoadedModel``, via :func:`load_model`; by default in the decoding layout,
  layers compiled once), every drafter checked against the target (:func:`check_pair`); returns ``(target_model,
  [drafter_model, …], seconds)``. A name given twice (a model drafting for itself) is loaded once: one object, one
  copy of its parameters in memory. ``weights``: :func:`load_model`'s, for every model."""
  start = time.perf_counter()
  loaded = {target: load_model(target, dtype, cache_dir, scan_layers=scan_layers, weights=weights)}
  for d in drafters:
    if d not in loaded:
      loaded[d] = load_model(d, dtype, cache_dir, scan_layers=scan_layers, weights=weights)
  target_model, drafter_models = loaded[target], [loaded[d] for d in drafters]
  for drafter_model in drafter_models:
    check_pair(target_model, drafter_model)
  return target_model, drafter_models, time.perf_counter() - start


def check_pair(target, drafter) -> None:
  """Drafter and target (``hub.LoadedModel``) must share one tokenizer: same vocabulary size and the same ids for the
  same text."""
  if target.config.vocab_size != drafter.config.vocab_size:
    raise UsageError(f"vocabulary mismatch between drafter {drafter.spec.name} (V = {drafter.config.vocab_size}) "
                     f"and target {target.spec.name} (V = {target.config.vocab_size}): speculative decoding needs one "
                     "tokenizer")
  probe = "def f(x):\n    return x ** 2  # café ✓"
  if target.tokenizer.encode(probe) != drafter.tokenizer.encode(probe):
    raise UsageError(f"tokenizers of {drafter.spec.name} and {target.spec.name} differ on the same text")
