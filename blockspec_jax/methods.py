"""What a method is: ``"autoregressive"``, a registered verifier, or ``"<verifier>@<drafter>[/<variant>]"``; how its
drafter is built and given its parameters; and the checks every job runs on its settings before any model loads.

* names: :data:`METHODS` (the main job's comparison), :data:`DEFAULT_TARGET` / :data:`DEFAULT_DRAFTER` (the pair every
  job decodes unless told otherwise), :func:`known_methods`, :func:`parse_method`, :func:`drafter_kind`,
  :func:`drafter_labels`;
* drafters: :func:`build_drafter` (a registered drafter on the loaded models, with its settings),
  :func:`trained_drafter_spec` (``heads:<run dir>?…`` entries), :func:`drafter_params`;
* a rule's draft length and losslessness: :func:`method_gamma`, :func:`method_is_lossy`;
* settings checks (a :class:`~blockspec_jax.checks.UsageError` naming the mistake): :func:`check_settings`,
  :func:`check_gamma`, :func:`check_drafter_settings`, :func:`check_verifier_settings`, :func:`check_cache_room`,
  :func:`check_methods_fit`.
"""

from __future__ import annotations

import pathlib
from typing import Iterable, Sequence

import numpy as np

from blockspec_jax.checks import UsageError, check_int
from blockspec_jax.sources import trained_run_spec

__all__ = ["DEFAULT_TARGET", "DEFAULT_DRAFTER", "AUTOREGRESSIVE", "METHODS", "known_methods", "drafter_kind",
           "parse_method", "build_drafter", "trained_drafter_spec", "drafter_params", "method_is_lossy",
           "method_gamma", "check_gamma", "check_settings", "check_cache_room", "check_methods_fit",
           "check_drafter_settings", "check_verifier_settings", "drafter_labels", "check_model_name"]


#: The pair every job decodes with unless told otherwise (one definition for the gin jobs and the command lines).
DEFAULT_TARGET = "qwen2.5-coder-1.5b"


DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"


AUTOREGRESSIVE = "autoregressive"


METHODS = (AUTOREGRESSIVE, "token", "block")  # the main job's default comparison


def known_methods() -> tuple[str, ...]:
  """``"autoregressive"`` and every registered verifier (``verify.VERIFIERS``); each verifier also as
  ``"<verifier>@<drafter>"`` with any registered drafter (``drafters.DRAFTERS``)."""
  from blockspec_jax import verify
  return (AUTOREGRESSIVE,) + tuple(verify.VERIFIERS)


def drafter_kind(drafter_name: str) -> str:
  """The registered drafter of a drafter name: ``"heads/ngram"`` → ``"heads"``. A ``/<label>`` suffix names a
  variant: its settings are ``drafter_settings["heads/ngram"]``, so one job can run several variants of one drafter
  (raw and rescored BPD heads) side by side."""
  return str(drafter_name).partition("/")[0]


def parse_method(method: str) -> tuple[str, str | None]:
  """``"autoregressive"`` → ``("autoregressive", None)``; ``"<verifier>[@<drafter>[/<variant>]]"`` → ``(verifier,
  drafter)`` with the rule's declared ``default_drafter`` filled in (a variant keeps its label:
  :func:`drafter_kind`). Unknown names and drafters the rule cannot verify losslessly are a :class:`UsageError`
  listing what is known."""
  from blockspec_jax import drafters, verify
  if not isinstance(method, str):
    raise UsageError(f"a method is a string like 'block' or 'rrs_wor@rsd_c', got {method!r}")
  if method == AUTOREGRESSIVE:
    return AUTOREGRESSIVE, None
  rule, _, drafter_name = method.partition("@")
  if rule not in verify.VERIFIERS:
    raise UsageError(f"unknown method {method!r}; known: {', '.join(known_methods())} (a verifier may name its "
                     f"drafter: '<verifier>@<drafter>', drafters: {', '.join(drafters.DRAFTERS)})")
  verifier = verify.get_verifier(rule)
  drafter_name = drafter_name or verifier.default_drafter
  kind = drafter_kind(drafter_name)
  if kind not in drafters.DRAFTERS:
    raise UsageError(f"unknown drafter {kind!r} in method {method!r}; known drafters: "
                     f"{', '.join(drafters.DRAFTERS)}")
  cls = drafters.DRAFTERS[kind]
  try:
    verifier.check_drafter(repr(drafter_name), cls)
  except ValueError as e:
    raise UsageError(f"method {method!r}: {e}") from None
  return rule, drafter_name


def build_drafter(drafter_name: str, target_model, drafter_model, settings: dict | None = None,
                  gamma: int | None = None):
  """The drafter object of a method: a registered drafter built by its class's ``build`` on the loaded models
  (``hub.LoadedModel``s: by default on ``drafter_model``, sized by the target's vocabulary; the BPD heads on the
  target's config) with ``settings[drafter_name]`` (e.g. ``{"k_chains": {"k": 4}}``). With ``gamma``, settings it
  leaves unset come from the class's ``default_settings(gamma)`` (RSD-C: branching ``(2, 1, …, 1)`` of depth
  ``gamma``) and the drafter's shape is checked against it (``num_nodes``)."""
  from blockspec_jax import drafters
  own = dict((settings or {}).get(drafter_name, {}))
  drafter_name = drafter_kind(drafter_name)
  try:
    cls = drafters.drafter_class(drafter_name)
    if gamma is not None:
      own = {**cls.default_settings(gamma), **own}
    drafter = cls.build(target_model.config, drafter_model.config, **own)
    if gamma is not None:
      drafter.num_nodes(gamma)
    return drafter
  except (TypeError, ValueError) as e:
    raise UsageError(f"drafter {drafter_name!r}: {e}") from None


def _trained_drafter_kind(entry) -> str | None:
  """The registered drafter ``"<drafter>:<run dir>…"`` names when that drafter has trained parts, else None (no
  checks: labels and dispatch only)."""
  from blockspec_jax import drafters
  kind, sep, _ = str(entry).partition(":")
  return kind if sep and hasattr(drafters.DRAFTERS.get(kind), "run_setting") else None


def trained_drafter_spec(entry, job_settings: Sequence[str] = ()) -> tuple[str, dict] | None:
  """``"<drafter>:<run dir>[?key=value&…]"`` → ``(drafter, settings)`` for a registered drafter with trained parts
  (``heads:results/train/heads_qwen?rescore=pbest_ngram``, ``steered:results/train/steer_qwen``,
  ``sprinter:results/train/sprinter_qwen``): the run directory goes to the drafter's ``run_setting`` field, the
  query's values are numbers where they parse as numbers. None when ``entry`` names a model instead. The settings are
  checked before any model loads (``drafters.check_settings``), except ``job_settings``: keys the calling job takes
  for itself (``eval.paired``'s ``replay``), returned with the rest."""
  from blockspec_jax import drafters
  kind = _trained_drafter_kind(entry)
  if kind is None:
    return None
  cls = drafters.DRAFTERS[kind]
  workdir, _, query = str(entry).partition(":")[2].partition("?")
  if not workdir:
    raise UsageError(f"{entry!r}: give the training run's directory after '{kind}:'")
  settings: dict = {cls.run_setting: workdir}
  for item in filter(None, query.split("&")):
    key, eq, value = item.partition("=")
    if not eq:
      raise UsageError(f"{entry!r}: settings after '?' are key=value pairs joined by '&', got {item!r}")
    for parse in (int, float):
      try:
        value = parse(value)
        break
      except ValueError:
        pass
    settings[key] = value
  try:  # before any model loads: the run's record, the settings' values
    drafters.check_settings(kind, {k: v for k, v in settings.items() if k not in job_settings})
  except ValueError as e:
    raise UsageError(f"{entry!r}: {e}") from None
  return kind, settings


def drafter_params(drafter_obj, drafter_model, target_model):
  """The parameters ``drafter_obj`` decodes with: the drafter model's own, or, for a drafter with trained parts
  (SPRINTER's head, BPD heads, SD²'s steering map), what its ``load_params(drafter_model, target_model)`` assembles
  from its settings (host side: it reads the training run's work directory). A missing or bad run is a UsageError
  naming the drafter and the problem."""
  load = getattr(drafter_obj, "load_params", None)
  if load is None:
    return drafter_model.params["params"]
  try:
    return load(drafter_model, target_model)
  except (OSError, ValueError) as e:
    raise UsageError(f"drafter {getattr(drafter_obj, 'name', type(drafter_obj).__name__)!r}: {e}") from None


def method_is_lossy(method: str, sampler, verifier_settings: dict | None = None) -> bool:
  """Whether ``method``'s rule (with its ``verifier_settings``) does not sample the target's law under ``sampler``;
  False for autoregressive decoding. Needs no model."""
  if method == AUTOREGRESSIVE:
    return False
  from blockspec_jax import verify
  rule = parse_method(method)[0]
  return not verify.get_verifier(rule, **dict((verifier_settings or {}).get(rule, {}))).lossless_under(sampler)


def method_gamma(rule: str, gamma: int, verifier_settings: dict | None = None) -> int:
  """The draft length a rule runs with: ``gamma``, except for rules that decide themselves when the target is
  called (SPRINTER), whose segments of at most ``cap`` tokens size the caches."""
  from blockspec_jax import verify
  if rule == AUTOREGRESSIVE:
    return gamma
  verifier = verify.get_verifier(rule, **dict((verifier_settings or {}).get(rule, {})))
  return verifier.cap if verifier.skips_target else gamma


def check_gamma(gamma, name: str = "gamma") -> int:
  """γ must be an integer >= 1 (``2.5``, ``True`` and ``-1`` are refused); returns it."""
  if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)):
    raise UsageError(f"{name} must be an integer >= 1, got {gamma!r} ({type(gamma).__name__})")
  if gamma < 1:
    raise UsageError(f"{name} must be >= 1, got {gamma}")
  return int(gamma)


def _check_positive_int(value, name: str) -> int:
  return check_int(value, name, error=UsageError)


def _sequence(value, name: str) -> tuple:
  """``value`` as a non-empty tuple when it is a list or tuple; a :class:`UsageError` for a scalar, a string or an
  empty sequence (``temperatures = 1.0`` is a scalar where the job runs a list: bind ``(1.0,)``)."""
  if not isinstance(value, (list, tuple)):
    raise UsageError(f"{name} must be a tuple or list, e.g. ({value!r},), got {value!r} ({type(value).__name__})")
  if not value:
    raise UsageError(f"{name} is empty: the job would run nothing; give at least one")
  return tuple(value)


def check_settings(*, gamma=None, gammas=None, methods=None, known_methods: Sequence[str] | None = None,
                   temperatures=None, max_new_tokens=None, num_prompts=None, dtype: str | None = None,
                   models: Iterable[str] = ()) -> None:
  """Check a job's settings before anything heavy runs (no model is loaded); raises :class:`UsageError`.

  ``gammas``, ``methods`` and ``temperatures`` (when given) must be non-empty tuples or lists. ``methods`` are checked
  with :func:`parse_method` (every registered verifier, optionally ``@drafter``) unless ``known_methods`` lists the
  only allowed names. ``models``: registry names, local paths or trained drafters' entries (:func:`check_model_name`)."""
  if gamma is not None:
    check_gamma(gamma)
  if gammas is not None:
    for g in _sequence(gammas, "gammas"):
      check_gamma(g, "every gamma")
  if methods is not None:
    methods = _sequence(methods, "methods")
    if known_methods is None:
      for method in methods:
        parse_method(method)
    else:
      unknown = [m for m in methods if m not in known_methods]
      if unknown:
        raise UsageError(f"unknown methods {unknown}; known: {', '.join(known_methods)}")
  if temperatures is not None:
    for t in _sequence(temperatures, "temperatures"):
      if isinstance(t, bool) or not isinstance(t, (int, float, np.number)) or not t >= 0:
        raise UsageError(f"temperatures must be numbers >= 0, got {t!r}")
  if max_new_tokens is not None:
    _check_positive_int(max_new_tokens, "max_new_tokens")
  if num_prompts is not None:
    _check_positive_int(num_prompts, "num_prompts")
  if dtype is not None and dtype not in ("float32", "bfloat16"):
    raise UsageError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
  for name in models:
    check_model_name(name)


def check_cache_room(prompt_width: int, max_new_tokens: int, draft_nodes: int, *configs) -> int:
  """Slots a decode needs, ``P + max_new_tokens + N + 1`` (``N`` draft nodes: γ for a chain, 0 for autoregressive
  decoding); raises :class:`UsageError` naming the numbers when it exceeds the smallest ``max_len`` of ``configs``
  (entries that are None, e.g. model-free drafters, have no limit). Returns it."""
  needed = prompt_width + max_new_tokens + draft_nodes + 1
  limits = [c.max_len for c in configs if c is not None and c.max_len is not None]
  limit = min(limits) if limits else needed
  if needed > limit:
    raise UsageError(f"prompts too long for the cache: longest prompt {prompt_width} tokens + {max_new_tokens} new "
                     f"+ {draft_nodes + 1} draft slots = {needed} > max_len {limit}")
  return needed


def check_methods_fit(methods: Iterable[str], gammas: Iterable[int], target_model, drafter_models, width: int,
                      max_new_tokens: int, drafter_settings=None, verifier_settings=None) -> int:
  """Build every method's drafter at every γ (drafter settings are checked there) and check that the longest prompt
  (``width``), ``max_new_tokens`` and the largest draft fit every cache (:func:`check_cache_room`); before any
  compilation. Returns the slots needed."""
  specs = [parse_method(m) for m in methods if m != AUTOREGRESSIVE]
  built = [(build_drafter(name, target_model, dm, drafter_settings, g), g)
           for rule, name in specs for g in {method_gamma(rule, gamma, verifier_settings) for gamma in gammas}
           for dm in drafter_models]
  draft_nodes = max([d.num_nodes(g) for d, g in built], default=0)
  return check_cache_room(width, max_new_tokens, draft_nodes, target_model.config, *(d for d, _ in built))


def check_drafter_settings(settings: dict | None) -> None:
  """Check ``drafter_settings`` (drafter name, or ``name/variant``, -> its settings) before any model loads: every
  name a registered drafter, every setting one of its own with a value it accepts, every trained run it names present
  with its record (``drafters.check_settings``); a :class:`UsageError` naming the entry otherwise. What depends on
  the models (sizes, layers) is checked when the drafter is built on them."""
  from blockspec_jax import drafters
  if settings is None:
    return
  if not isinstance(settings, dict):
    raise UsageError(f"drafter_settings must map drafter names to settings dicts, got {settings!r}")
  for name, own in settings.items():
    try:
      drafters.check_settings(name, own)
    except ValueError as e:
      raise UsageError(f"drafter_settings[{name!r}]: {e}") from None


def check_verifier_settings(settings: dict | None) -> None:
  """``{"<rule>": {setting: value}}`` (e.g. ``{"lenient": {"epsilon": 0.5, "f": "div"}}``): every rule registered,
  every rule buildable with its settings; a :class:`UsageError` naming the problem otherwise."""
  from blockspec_jax import verify
  if settings is None:
    return
  if not isinstance(settings, dict):
    raise UsageError(f"verifier_settings must map rule names to settings dicts, got {settings!r}")
  for rule, own in settings.items():
    if rule not in verify.VERIFIERS:
      raise UsageError(f"verifier_settings: unknown verifier {rule!r}; known: {', '.join(verify.VERIFIERS)}")
    if not isinstance(own, dict):
      raise UsageError(f"verifier_settings[{rule!r}] must be a dict of settings, got {own!r}")
    try:
      verify.get_verifier(rule, **own)
    except (TypeError, ValueError) as e:
      raise UsageError(f"verifier_settings[{rule!r}]: {e}") from None


def drafter_labels(names) -> list[str]:
  """Short, distinct labels for drafters given by name or path (a path's last component, ``@step`` kept; a trained
  drafter's kind kept: ``steered:results/train/run?replay=8`` → ``steered:run?replay=8``, told apart from the run's
  own drafter ``results/train/run`` → ``run``)."""
  labels = []
  for name in names:
    kind, text = "", str(name)
    if _trained_drafter_kind(text) is not None:  # a label, not a use: the settings are checked where it is used
      kind, _, text = text.partition(":")
      kind += ":"
    base, sep, tail = text.rpartition("@")
    stem = pathlib.Path(base if sep else text).name or text
    label = kind + stem + (f"@{tail}" if sep else "")
    while label in labels:
      label += "'"
    labels.append(label)
  return labels


def check_model_name(name) -> None:
  """What :func:`load_model` would refuse at once (unknown names, missing paths, a bad ``@step``), without loading;
  a :class:`UsageError` (a trained drafter's entry: :func:`trained_drafter_spec`'s checks)."""
  if trained_run_spec(name) is not None or trained_drafter_spec(name) is not None:
    return
  from blockspec_jax.models import hub
  try:
    hub.check_model_name(name)
  except ValueError as e:
    raise UsageError(str(e)) from None
