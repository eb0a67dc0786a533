"""What the jobs share: the main job (``blockspec_jax.run``), the evaluation scripts (``blockspec_jax.eval``) and the
benchmarks import these helpers from here, so no job imports another.

* settings checks that run before any model is loaded (:func:`check_gamma`, :func:`check_settings`), and the one
  cache-room check (:func:`check_cache_room`);
* a drafter/target pair check (:func:`check_pair`), prompt encoding (:func:`encode_prompts`);
* one method's timed decode over a prompt set (:func:`run_method`), with the first call's compilation announced
  (:func:`compiling`) and prefills shared between methods that run the same one (:class:`PrefillCache`);
* JAX's persistent compilation cache (:func:`enable_compilation_cache`), peak memory (:func:`peak_rss_gb`), and the
  release of compiled programs before a long-lived process runs out of memory mappings
  (:func:`release_programs_if_near_map_limit`);
* a command-line wrapper that turns a user's mistake into one line instead of a traceback (:func:`cli_errors`);
* the gin command line of every job (:func:`gin_parser`, :func:`gin_main`), and :func:`argparse_gin_job`, which makes
  an argparse command a gin job with the parser's own settings and defaults (one definition of both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import resource
import sys
import threading
import time
from typing import Iterable, Sequence

import numpy as np

from blockspec_jax.checks import UsageError, check_int
from blockspec_jax.paths import default_cache_dir

__all__ = ["METHODS", "AUTOREGRESSIVE", "known_methods", "parse_method", "build_drafter", "UsageError", "load_model",
           "check_model_name", "drafter_labels", "check_gamma", "check_settings", "check_verifier_settings",
           "check_drafter_settings",
           "check_cache_room", "check_pair", "encode_prompts", "load_models", "check_methods_fit", "run_method",
           "PrefillCache",
           "method_gamma", "method_is_lossy", "compiling", "enable_compilation_cache", "COMPILE_CACHE_ENV_VAR",
           "peak_rss_gb",
           "mapped_regions", "max_mapped_regions", "release_programs_if_near_map_limit", "cli_errors", "parse_gin",
           "join_multihost_from_env", "is_main_process", "add_gin_search_path", "bound_jobs", "MULTIHOST_ENV_VAR",
           "gin_parser", "gin_main", "write_report", "check_output_dir", "check_output_file", "backend_compiles", "DEFAULT_TARGET", "DEFAULT_DRAFTER",
           "argparse_gin_job", "argv_from_settings"]

#: The pair every job decodes with unless told otherwise (one definition for the gin jobs and the command lines).
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"
AUTOREGRESSIVE = "autoregressive"
METHODS = (AUTOREGRESSIVE, "token", "block")  # the main job's default comparison
COMPILE_CACHE_ENV_VAR = "BLOCKSPEC_JAX_COMPILE_CACHE"


def known_methods() -> tuple[str, ...]:
  """``"autoregressive"`` and every registered verifier (``verify.VERIFIERS``); each verifier also as
  ``"<verifier>@<drafter>"`` with any registered drafter (``drafters.DRAFTERS``)."""
  from blockspec_jax import verify
  return (AUTOREGRESSIVE,) + tuple(verify.VERIFIERS)


def _default_drafter(verifier) -> str:
  """The drafter a bare verifier name runs with: the model chain for chain rules, k i.i.d. chains for tree rules
  that need siblings drawn with replacement, RSD-C trees for rules that need them drawn without."""
  if verifier.default_drafter is not None:
    return verifier.default_drafter
  if verifier.structure == "chain":
    return "model"
  return "k_chains" if verifier.sibling_sampling == "with_replacement" else "rsd_c"


def drafter_kind(drafter_name: str) -> str:
  """The registered drafter of a drafter name: ``"heads/ngram"`` → ``"heads"``. A ``/<label>`` suffix names a
  variant: its settings are ``drafter_settings["heads/ngram"]``, so one job can run several variants of one drafter
  (raw and rescored BPD heads) side by side."""
  return str(drafter_name).partition("/")[0]


def parse_method(method: str) -> tuple[str, str | None]:
  """``"autoregressive"`` → ``("autoregressive", None)``; ``"<verifier>[@<drafter>[/<variant>]]"`` → ``(verifier,
  drafter)`` with the rule's default drafter filled in (a variant keeps its label: :func:`drafter_kind`). Unknown
  names and drafters the rule cannot verify losslessly are a :class:`UsageError` listing what is known."""
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
  drafter_name = drafter_name or _default_drafter(verifier)
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
  """The drafter object of a method: a registered drafter built on ``drafter_model`` (a ``hub.LoadedModel``; model-
  free drafters take the target's vocabulary; drafters with a ``build`` classmethod, the BPD heads, are built on the
  target's config and the drafter model's) with ``settings[drafter_name]`` (e.g. ``{"k_chains": {"k": 4}}``).
  RSD-C without a ``branching`` setting gets ``(2, 1, …, 1)`` of depth ``gamma``. With ``gamma``, the drafter's
  shape is checked against it (``num_nodes``)."""
  from blockspec_jax import drafters
  own = dict((settings or {}).get(drafter_name, {}))
  drafter_name = drafter_kind(drafter_name)
  if drafter_name == "rsd_c" and "branching" not in own and gamma is not None:
    own["branching"] = drafters.shape_for_budget("rsd_c", 2 * gamma)[0]["branching"]
  try:
    if hasattr(drafters.DRAFTERS.get(drafter_name), "build"):  # drafters built on the target (BPD heads)
      drafter = drafters.DRAFTERS[drafter_name].build(target_model.config, drafter_model.config, **own)
    else:
      drafter = drafters.make(drafter_name, config=drafter_model.config, vocab_size=target_model.config.vocab_size,
                              **own)
    if gamma is not None:
      drafter.num_nodes(gamma)
    return drafter
  except (TypeError, ValueError) as e:
    raise UsageError(f"drafter {drafter_name!r}: {e}") from None


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


def trained_drafter_spec(entry, job_settings: Sequence[str] = ()) -> tuple[str, dict] | None:
  """``"<drafter>:<run dir>[?key=value&…]"`` → ``(drafter, settings)`` for a registered drafter with trained parts
  (``heads:results/train/heads_qwen?rescore=pbest_ngram``, ``steered:results/train/steer_qwen``,
  ``sprinter:results/train/sprinter_qwen``): the run directory goes to the drafter's ``run_setting`` field, the
  query's values are numbers where they parse as numbers. None when ``entry`` names a model instead. The settings are
  checked before any model loads (``drafters.check_settings``), except ``job_settings``: keys the calling job takes
  for itself (``eval.paired``'s ``replay``), returned with the rest."""
  from blockspec_jax import drafters
  kind, sep, rest = str(entry).partition(":")
  cls = drafters.DRAFTERS.get(kind)
  if not sep or cls is None or not hasattr(cls, "run_setting"):
    return None
  workdir, _, query = rest.partition("?")
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


def load_model(name, dtype: str = "float32", cache_dir=None, progress: bool = True, scan_layers: bool = False):
  """A model for a job: a registry name or checkpoint path (:func:`blockspec_jax.models.hub.load_model`), or the work
  directory of a drafter training run (``python -m blockspec_jax.train``; it holds ``drafter.json``): its newest
  checkpoint, ``<dir>@<step>`` for another kept step, ``<dir>@init`` for the drafter before training
  (:func:`blockspec_jax.train.recipe.load_trained`). ``scan_layers``: the decoding layout, layers stacked and
  compiled once (``hub.scanned``); decoding jobs ask for it, training jobs keep the per-layer layout."""
  from blockspec_jax.models import hub
  trained = trained_run_spec(name)
  if trained is not None:
    from blockspec_jax.train import recipe
    model = recipe.load_trained(trained[0], trained[1], dtype, cache_dir, progress=progress)
    return hub.scanned(model) if scan_layers else model
  try:
    return hub.load_model(name, dtype, cache_dir, progress=progress, scan_layers=scan_layers)
  except (ValueError, NotImplementedError) as e:
    if isinstance(e, UsageError) or not os.path.exists(os.fspath(name)):
      raise
    # A user's own checkpoint that cannot be read (hub names the file and the problem): the input's fault.
    raise UsageError(f"cannot load the checkpoint {name}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None


def drafter_labels(names) -> list[str]:
  """Short, distinct labels for drafters given by name or path (a path's last component, ``@step`` kept; a trained
  drafter's kind kept: ``steered:results/train/run?replay=8`` → ``steered:run?replay=8``, told apart from the run's
  own drafter ``results/train/run`` → ``run``)."""
  labels = []
  for name in names:
    kind, text = "", str(name)
    if trained_drafter_spec(text) is not None:
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
  a :class:`UsageError`."""
  if trained_run_spec(name) is not None or trained_drafter_spec(name) is not None:
    return
  from blockspec_jax.models import hub
  try:
    hub.check_model_name(name)
  except ValueError as e:
    raise UsageError(str(e)) from None


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
  only allowed names. ``models``: registry names or local paths (checked with ``hub.check_model_name``)."""
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


def load_models(target: str, drafters: Sequence[str], dtype: str = "float32", cache_dir=None,
                scan_layers: bool = True):
  """The target and each drafter (``hub.LoadedModel``, via :func:`load_model`; by default in the decoding layout,
  layers compiled once), every drafter checked against the target (:func:`check_pair`); returns ``(target_model,
  [drafter_model, …], seconds)``."""
  start = time.perf_counter()
  target_model = load_model(target, dtype, cache_dir, scan_layers=scan_layers)
  drafter_models = [load_model(d, dtype, cache_dir, scan_layers=scan_layers) for d in drafters]
  for drafter_model in drafter_models:
    check_pair(target_model, drafter_model)
  return target_model, drafter_models, time.perf_counter() - start


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


def encode_prompts(model, rows, chat: bool = True) -> list[list[int]]:
  """Token ids of each prompt row (``row["text"]``): chat-templated when ``chat`` and the tokenizer has a template.
  Raises :class:`UsageError` when there are no rows or a prompt encodes to nothing."""
  if not rows:
    raise UsageError("no prompts to decode (empty prompt file, or a filter/limit that kept none)")
  out = []
  for row in rows:
    if chat and model.tokenizer.chat_template:
      text = model.tokenizer.apply_chat_template([{"role": "user", "content": row["text"]}])
      ids = model.tokenizer.encode(text)
    else:
      ids = model.tokenizer.encode(row["text"], add_special_tokens=True)
    if not ids:
      raise UsageError(f"prompt {row.get('id', '?')!r} encodes to no tokens")
    out.append(ids)
  return out


def peak_rss_gb() -> float:
  """Peak resident memory of this process in GB (10^9 bytes); Linux reports ``ru_maxrss`` in KiB."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def mapped_regions() -> int | None:
  """How many memory mappings this process holds (lines of ``/proc/self/maps``); None where there is no such file."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return None


def max_mapped_regions() -> int | None:
  """The kernel's per-process limit on memory mappings (``vm.max_map_count``, 65,530 by default); None if unknown."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None


def release_programs_if_near_map_limit(fraction: float = 0.5) -> bool:
  """Drop every compiled program (``jax.clear_caches()``) once this process holds more than ``fraction`` of the
  kernel's limit on memory mappings; True if it did.

  Why: XLA's CPU backend loads each compiled executable's code and data as separate anonymous mappings (about ten for
  a small program, more for a decoding loop), and the jit caches keep every executable alive for the life of the
  process. A process that compiles thousands of programs (a test worker, a sweep over many shapes and settings) grows
  towards ``vm.max_map_count``; when a mapping is refused there, XLA aborts or segfaults inside the next compilation
  or executable load, far from the cause. Released programs are simply compiled again when next called (same
  results), so a process that stays under the limit never pays anything but the ``/proc/self/maps`` read.
  """
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
  count, limit = mapped_regions(), max_mapped_regions()
  if count is None or limit is None or count <= fraction * limit:
    return False
  import gc

  import jax
  jax.clear_caches()
  gc.collect()
  return True


_BACKEND_COMPILES = [0]  # XLA compilations in this process since the first backend_compiles() call


def backend_compiles() -> int:
  """How many programs XLA has compiled in this process since this was first called (a jax.monitoring listener,
  installed once): the difference across a timed section says whether compilation fell inside it."""
  if not getattr(backend_compiles, "installed", False):
    import jax

    def listen(event: str, duration: float, **kwargs) -> None:
      if event == "/jax/core/compile/backend_compile_duration":
        _BACKEND_COMPILES[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    backend_compiles.installed = True
  return _BACKEND_COMPILES[0]


@contextlib.contextmanager
def compiling(label: str, stream=None, when: bool = True):
  """Announce a first (compiling) call: ``compiling <label> …`` with a spinner and the elapsed seconds on a terminal,
  a start and an end line otherwise (logs). ``when`` false: a silent no-op, so a loop writes
  ``with compiling(label, when=i == 0):`` once for its first (compiling) and later calls alike."""
  if not when:
    yield
    return
  stream = sys.stderr if stream is None else stream
  start = time.perf_counter()
  done = threading.Event()
  tty = hasattr(stream, "isatty") and stream.isatty()
  if tty:
    def spin():
      for ch in itertools.cycle("|/-\\"):
        if done.wait(0.25):
          return
        stream.write(f"\rcompiling {label} … {ch} {time.perf_counter() - start:5.1f} s")
        stream.flush()
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
  else:
    stream.write(f"compiling {label} …\n")
    stream.flush()
  try:
    yield
  finally:
    done.set()
    if tty:
      thread.join()
    stream.write(("\r" if tty else "") + f"compiled {label} in {time.perf_counter() - start:.1f} s" + " " * 8 + "\n")
    stream.flush()


#: The persistent compilation cache's size limit (bytes): setting one turns on JAX's file lock for the directory.
COMPILE_CACHE_MAX_BYTES = 8 << 30


def _add_access_times(path: pathlib.Path) -> None:
  """Give every entry of a cache directory written without a size limit (no ``-atime`` file beside it) the access
  time JAX's eviction reads (its modification time); without it every later write fails. Under the directory's lock,
  as JAX's own reads and writes."""
  import filelock
  with filelock.FileLock(path / ".lockfile"):
    for entry in path.glob("*-cache"):
      atime = path / (entry.name[:-len("-cache")] + "-atime")
      if not atime.exists():
        try:
          atime.write_bytes(int(entry.stat().st_mtime_ns).to_bytes(8, "little"))
        except OSError:
          pass  # the entry went away meanwhile


def enable_compilation_cache(directory: str | os.PathLike | None = None, min_compile_time_s: float = 0.5
                             ) -> pathlib.Path | None:
  """Turn on JAX's persistent compilation cache, so a second run of a job loads its compiled programs from disk.

  ``directory``: explicit path; else ``$BLOCKSPEC_JAX_COMPILE_CACHE``; else ``<cache dir>/jax_compilation``. The
  strings ``""``, ``"0"`` and ``"off"`` (argument or variable) disable it. Programs that compile faster than
  ``min_compile_time_s`` are not written. Returns the directory in use, or None.

  Several processes share the directory (two jobs, or test workers): JAX's cache writes an entry in place and reads
  without a lock unless a size limit is set, so a reader could load a half-written program. A limit
  (:data:`COMPILE_CACHE_MAX_BYTES`, least recently used entries evicted) makes every read and write hold the
  directory's file lock.
  """
  import jax
  if directory is None:
    directory = os.environ.get(COMPILE_CACHE_ENV_VAR)
  if directory is None:
    directory = default_cache_dir() / "jax_compilation"
  if str(directory).strip().lower() in ("", "0", "off", "none"):
    return None
  path = pathlib.Path(directory).expanduser()
  path.mkdir(parents=True, exist_ok=True)
  _add_access_times(path)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
  return path


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


class PrefillCache:
  """Prefill states shared by the methods of one job: a prompt's prefill depends on the models, the drafter, γ and
  the token budget (they size and fill the caches), never on the temperature, the sampler or the verifier, so
  ``autoregressive`` at T = 0 and T = 1, or ``token`` and ``block`` at one γ with one drafter, run the same prefill
  program on the same inputs and get the same state bit for bit. :func:`run_method` given a cache computes each
  such state once, times it once, and charges that measured time to every row that uses it (its ``prefill_s``),
  so rows stay comparable end to end. The decode phase never donates its input state, so a state serves any
  number of decodes.

  Keys hold the models' ``id``: a cache belongs to one job, whose models live as long as it does. States are kept
  oldest-first and evicted beyond ``max_bytes`` (the Qwen pair's state of a 300-token prompt is ~30 MB), so a job
  reuses best when the rows sharing a prefill run close together. ``hits`` counts reused states."""

  def __init__(self, max_bytes: int = 2 << 30):
    import collections
    self.max_bytes = int(max_bytes)
    self.hits = 0
    self._entries = collections.OrderedDict()  # key -> (state, seconds, bytes)
    self._bytes = 0

  def get(self, key):
    """``(state, seconds)`` of ``key``, or None."""
    entry = self._entries.get(key)
    if entry is None:
      return None
    self.hits += 1
    return entry[0], entry[1]

  def put(self, key, state, seconds: float) -> None:
    """Keep ``state`` (measured in ``seconds``), evicting the oldest states beyond ``max_bytes``."""
    import jax
    size = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
    if key in self._entries or size > self.max_bytes:
      return
    self._entries[key] = (state, float(seconds), size)
    self._bytes += size
    while self._bytes > self.max_bytes:
      self._bytes -= self._entries.popitem(last=False)[1][2]

  def __len__(self) -> int:
    return len(self._entries)


def _phases(method: str, target, drafter, gamma: int, max_new_tokens: int, sampler, stop_ids,
            drafter_settings=None, verifier_settings=None):
  """The method's two compiled phases: ``prefill(tokens, lens) -> state`` and ``decode(keys, state) ->
  DecodeOutput`` (together exactly ``generate_autoregressive`` / ``generate_speculative``), and the key of its
  prefill (:class:`PrefillCache`: equal for methods whose prefills are the same program on the same parameters;
  None when the drafter cannot be hashed, then nothing is shared)."""
  from blockspec_jax.decoding import speculative as spec
  tp = target.params["params"]
  rule, drafter_name = parse_method(method)
  if rule == AUTOREGRESSIVE:
    common = dict(target=target.config, max_new_tokens=max_new_tokens)
    return (lambda tokens, lens: spec.prefill_autoregressive(tp, tokens, lens, **common),
            lambda keys, state: spec.decode_autoregressive(tp, keys, state, sampler=sampler, stop_ids=stop_ids,
                                                           **common),
            (AUTOREGRESSIVE, id(target), max_new_tokens))
  from blockspec_jax import verify
  gamma = method_gamma(rule, gamma, verifier_settings)
  rule = verify.get_verifier(rule, **dict((verifier_settings or {}).get(rule, {})))
  drafter_obj = build_drafter(drafter_name, target, drafter, drafter_settings, gamma)
  dp = drafter_params(drafter_obj, drafter, target)
  common = dict(target=target.config, drafter=drafter_obj, gamma=gamma, max_new_tokens=max_new_tokens)
  # The drafter object (its settings: a trained drafter's path, a tree's shape) and the two models determine ``dp``.
  key = ("speculative", id(target), id(drafter), drafter_obj, gamma, max_new_tokens)
  try:
    hash(key)
  except TypeError:
    key = None
  return (lambda tokens, lens: spec.prefill_speculative(tp, dp, tokens, lens, **common),
          lambda keys, state: spec.decode_speculative(tp, dp, keys, state, verifier=rule, sampler=sampler,
                                                      stop_ids=stop_ids, **common),
          key)


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


def run_method(method, target, drafter, prompt_ids, width, *, gamma, max_new_tokens, temperature, seed, stop_ids,
               drafter_settings=None, verifier_settings=None, top_k: int = 0, top_p: float = 1.0,
               warm: bool = False, prefills: PrefillCache | None = None):
  """Decode every prompt at batch 1 with ``method`` ("autoregressive", a verifier name, or
  ``"<verifier>@<drafter>"``, see :func:`parse_method`; ``drafter_settings`` as in :func:`build_drafter`); returns
  the summary row and the generated token lists.

  Prefill and decode phase are compiled and timed apart (each ends in ``block_until_ready``): ``wall_s`` is their
  sum, ``prefill_s`` the prompt forwards (target, and drafter for speculative methods), ``decode_s`` the loop, which
  is the phase the ideal speedup BE / (1 + γ·c) describes. Before the timed prompts, the first prompt's prefill runs
  once untimed and the decode program is compiled on a finished state (no loop iteration), so compiling costs no
  extra decode.
  ``temperature``, ``top_k`` and ``top_p`` make the sampler both models decode with (``sampling.Sampler``).
  ``warm``: a previous call compiled the same programs (same method, γ, sampler, width and models), so the untimed
  first run is skipped (a suite's later categories).
  ``prefills``: a :class:`PrefillCache` shared by the job's calls: a prompt whose prefill another method already
  ran (same models, drafter, γ and budget) starts from that state, and this row's ``prefill_s`` counts the time it
  took there (``prefills_reused`` says for how many prompts).
  """
  import jax
  from blockspec_jax import sampling
  from blockspec_jax.decoding import speculative as spec
  if not warm:  # a long sweep of methods and shapes in one process; never between a warm call and its programs
    release_programs_if_near_map_limit()
  sampler = sampling.Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
  prefill, decode, prefill_key = _phases(method, target, drafter, gamma, max_new_tokens, sampler, stop_ids,
                                         drafter_settings, verifier_settings)
  if prefill_key is None:
    prefills = None
  padded = [(ids + [0] * (width - len(ids))) for ids in prompt_ids]
  key = jax.random.key(seed)
  reused = 0

  def one(keys, row, length, compile_only=False):
    """One prompt: (output, prefill seconds, decode seconds, programs compiled inside the two timed calls).
    ``compile_only``: the decode phase starts from a state whose rows are all finished, so it compiles the very
    program the timed prompts run (same shapes, same static arguments) but its loop runs no iteration. A state
    from ``prefills`` is used as it is and its recorded time returned; a timed prefill is kept there."""
    nonlocal reused
    tokens, lens = np.asarray([row], np.int32), np.asarray([length], np.int32)
    cache_key = (prefill_key, tuple(row), length) if prefills is not None else None
    shared = prefills.get(cache_key) if cache_key is not None else None
    compiled = backend_compiles()
    start = time.perf_counter()
    if shared is not None:
      state, prefill_s = shared
      reused += not compile_only
    else:
      state = jax.block_until_ready(prefill(tokens, lens))
      prefill_s = time.perf_counter() - start
      if cache_key is not None and not compile_only:  # a compiling call's time is not a prefill's
        prefills.put(cache_key, state, prefill_s)
    if compile_only:  # every row finished, by a device op: the array keeps the state's placement (a host array
      # would be uncommitted where the state's is committed, e.g. a trained drafter's parameters, and the timed
      # prompts would compile the decode program again)
      state = state.replace(done_B=jax.numpy.logical_or(state.done_B, True))
    middle = time.perf_counter()
    out = jax.block_until_ready(decode(keys, state))
    end = time.perf_counter()
    return out, prefill_s, end - middle, backend_compiles() - compiled

  label = f"{method} (T = {temperature:g}" + ("" if method == "autoregressive" else
                                               f", γ = {method_gamma(method.partition('@')[0], gamma, verifier_settings)}") + ")"
  if not warm:
    with compiling(label):
      # Compile both phases once per method and T: one prompt's prefill, and the decode loop with no iteration.
      one(jax.random.split(key, 1), padded[0], len(prompt_ids[0]), compile_only=True)
  prefill_s, decode_s, tokens, calls, outputs, metrics, extras = 0.0, 0.0, 0, 0, [], [], []
  compiles = 0
  for i, (row, ids) in enumerate(zip(padded, prompt_ids)):
    out, p_s, d_s, c = one(jax.random.fold_in(key, i)[None], row, len(ids))
    prefill_s, decode_s, compiles = prefill_s + p_s, decode_s + d_s, compiles + c
    n = int(out.num_tokens_B[0])
    tokens += n
    calls += n if method == AUTOREGRESSIVE else int(out.metrics.num_drafts[0])
    outputs.append(np.asarray(out.tokens_BxN[0, :n]).tolist())
    metrics.append(out.metrics)
    extras.append(out.extra)
  wall = prefill_s + decode_s
  if compiles:
    print(f"WARNING: {label}: {compiles} program(s) compiled inside the timed prompts; its times include "
          "compilation", file=sys.stderr)
  lossy, rule_gamma = method_is_lossy(method, sampler, verifier_settings), gamma
  if method != AUTOREGRESSIVE:
    rule_gamma = method_gamma(parse_method(method)[0], gamma, verifier_settings)
  summary = dict(method=method, temperature=temperature, gamma=None if method == AUTOREGRESSIVE else rule_gamma,
                 lossy=lossy, target_calls_per_token=calls / max(tokens, 1),
                 prompts=len(prompt_ids), tokens_generated=tokens, target_calls=calls, wall_s=wall,
                 tokens_per_s=tokens / wall, prefill_s=prefill_s, decode_s=decode_s,
                 decode_tokens_per_s=tokens / decode_s, compiles_while_timed=compiles, prefills_reused=reused)
  merged = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *metrics)
  if extras and extras[0] is not None:  # rule-specific counters (SPRINTER's flags and SD rejections), summed
    summary.update({k: int(np.sum(v)) for k, v in dataclasses.asdict(
        jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *extras)).items()})
  s = spec.summarize_metrics(merged)
  summary["invalid_prob_rows"] = s["invalid_prob_rows"]
  if method != AUTOREGRESSIVE:
    summary.update(block_efficiency=s["mean_acceptance_length"], draft_acceptance_rate=s["draft_acceptance_rate"],
                   draft_nodes=int(np.sum(merged.num_draft_tokens)) // max(int(np.sum(merged.num_drafts)), 1),
                   acceptance_per_position=s["acceptance_per_position"],
                   expected_accepted_per_draft=s["expected_accepted_per_draft"],
                   per_prompt_acceptance_length=s["per_row_mean_acceptance_length"])
  if s["invalid_prob_rows"]:
    print(f"WARNING: {method} at T = {temperature:g}: {s['invalid_prob_rows']} probability rows were not "
          "distributions (NaN/inf logits or bad rows); its numbers are not trustworthy", file=sys.stderr)
  return summary, outputs


def check_output_dir(path, what: str) -> pathlib.Path:
  """Create directory ``path`` if needed and prove it writable (a file created and deleted in it), before any work
  whose results go there; a :class:`UsageError` naming ``what`` and the reason otherwise (a file in its place, no
  permission, a read-only or full disk)."""
  path = pathlib.Path(path)
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    reason = f"{blocker} is a file, not a directory" if blocker is not None else (e.strerror or str(e))
    raise UsageError(f"cannot write {what} {path}: {reason}") from None
  return path


def check_output_file(path, what: str) -> pathlib.Path | None:
  """Check, before any work, that the file ``path`` (None: no file) can be written later: its folder can be created
  and written (:func:`check_output_dir`) and ``path`` is not a directory. A :class:`UsageError` otherwise, so a long
  run never ends in a report it cannot write."""
  if path is None or path == "":
    return None
  path = pathlib.Path(path)
  if path.is_dir():
    raise UsageError(f"cannot write {what} {path}: it is a directory")
  check_output_dir(path.parent, f"the folder of {what}")
  return path


def write_report(path, report: dict) -> pathlib.Path:
  """Write a job's JSON report (indented) to ``path``, creating its folder; returns the path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2))
  return path


def gin_parser(prog: str, description: str, workdir: bool = False):
  """The command line of every gin entry point: ``--gin_file`` and ``--gin_param``, both repeatable (t5x's flags),
  and with ``workdir`` a ``--workdir`` for training runs."""
  import argparse
  parser = argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[], help="a gin file (repeatable; later files win)")
  parser.add_argument("--gin_param", action="append", default=[], help='one binding, e.g. "suite.gammas = (2, 4)"')
  if workdir:
    parser.add_argument("--workdir", help="training jobs: the run's folder (default results/train/<gin file stem>)")
  return parser


def gin_main(prog: str, description: str, job, argv=None) -> int:
  """A gin-configured job's command line (:func:`gin_parser`), then ``job()``; usage and configuration errors print
  one line (:func:`cli_errors`)."""
  parser = gin_parser(prog, description)
  args = parser.parse_args(argv)
  with cli_errors(parser.prog):
    join_multihost_from_env()
    parse_gin(args.gin_file, args.gin_param)
    job()
  return 0


def _gin_options(parser) -> dict:
  """The options of an argparse ``parser`` a gin job exposes: every visible option by its ``dest``."""
  import argparse
  return {a.dest: a for a in parser._actions
          if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS}


def argv_from_settings(parser, settings: dict) -> list[str]:
  """The command line that gives ``parser`` the option values ``settings`` (``dest`` -> value): a flag for a
  ``store_true`` option bound True, the items of a sequence as separate words for ``nargs`` options and joined with
  commas otherwise (the comma-separated lists of our commands), ``str(value)`` for the rest; None leaves an option
  at its default. Unknown names are a :class:`UsageError` listing the known ones."""
  import argparse
  options = _gin_options(parser)
  unknown = sorted(set(settings) - set(options))
  if unknown:
    raise UsageError(f"{parser.prog}: unknown settings {unknown}; known: {', '.join(options)}")
  argv = []
  for dest, value in settings.items():
    action = options[dest]
    flag = action.option_strings[-1]
    if value is None:
      continue
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
      if not isinstance(value, bool):
        raise UsageError(f"{parser.prog}: {dest} is a switch; bind True or False, got {value!r}")
      if value != action.default:
        argv.append(flag)
    elif action.nargs not in (None, "?"):
      argv += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    else:
      argv += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
  return argv


def argparse_gin_job(name: str, build_parser, main):
  """Register the argparse command ``main(argv)`` (options from ``build_parser()``) as the gin job ``name``.

  Its settings are the parser's options by ``dest`` (``paired.num_prompts = 12``, ``bench_peer.gammas = (2, 4)``)
  and their defaults are the parser's, so the command line and the gin job share one definition of both. Calling the
  configurable turns the bound settings back into a command line (:func:`argv_from_settings`) and runs ``main``, so
  the command's own checks and derived defaults apply unchanged; it returns what ``main`` returns."""
  import inspect
  import gin
  parser = build_parser()

  def job(**settings):
    return main(argv_from_settings(parser, settings))

  job.__name__ = job.__qualname__ = name
  job.__doc__ = f"The gin job of ``{parser.prog}``: one keyword per option (its dest), the parser's defaults."
  job.__signature__ = inspect.Signature([inspect.Parameter(dest, inspect.Parameter.KEYWORD_ONLY, default=None)
                                         for dest in _gin_options(parser)])
  return gin.configurable(name)(job)


def add_gin_search_path() -> None:
  """Let ``include 'gin/…'`` and ``--gin_file gin/…`` resolve from any working directory (the repository root, when
  the package sits in it, as with an editable install), besides the working directory itself."""
  import gin
  root = pathlib.Path(__file__).resolve().parents[1]
  if (root / "gin").is_dir() and str(root) not in gin.config._LOCATION_PREFIXES:
    gin.add_config_file_search_path(str(root))


def bound_jobs(names) -> list[str]:
  """Which of the configurable jobs ``names`` the parsed gin configuration binds settings of (in ``names`` order):
  how an entry point tells what its gin files ask it to run."""
  import gin
  return [name for name in names if gin.get_bindings(name)]


MULTIHOST_ENV_VAR = "BLOCKSPEC_JAX_MULTIHOST"


def join_multihost_from_env() -> bool:
  """With ``$BLOCKSPEC_JAX_MULTIHOST=1`` (set on every worker by ``launch/tpu_vm.sh`` and ``launch/gpu_vm.sh`` for a
  slice of several hosts), join the multi-host run (``parallel.initialize_multihost``: ``jax.distributed`` reads the
  coordinator from the TPU environment, or from ``$JAX_COORDINATOR_ADDRESS``, ``$JAX_NUM_PROCESSES`` and
  ``$JAX_PROCESS_ID`` on GPU hosts) before any computation; True if it did. Unset or ``0``: nothing (one host)."""
  value = os.environ.get(MULTIHOST_ENV_VAR, "0").strip()
  if value in ("", "0"):
    return False
  if value != "1":
    raise UsageError(f"${MULTIHOST_ENV_VAR} must be 0 or 1, got {value!r}")
  from blockspec_jax import parallel
  kwargs = {}
  for name, key, cast in (("JAX_COORDINATOR_ADDRESS", "coordinator_address", str),
                          ("JAX_NUM_PROCESSES", "num_processes", int), ("JAX_PROCESS_ID", "process_id", int)):
    if os.environ.get(name):
      try:
        kwargs[key] = cast(os.environ[name])
      except ValueError:
        raise UsageError(f"${name} must be an integer, got {os.environ[name]!r}") from None
  parallel.initialize_multihost(**kwargs)
  return True


def is_main_process() -> bool:
  """Whether this process writes the run's files: always on one host, process 0 of a multi-host run."""
  import jax
  return jax.process_index() == 0


@contextlib.contextmanager
def cli_errors(prog: str):
  """Run a command-line job: a :class:`UsageError` (a setting, name, path or file of the user's that cannot work,
  including a gin configuration that does not parse: :func:`parse_gin`) or a missing file becomes one line
  ``<prog>: error: …`` on stderr and exit status 2. Every other exception is a fault of the program, not of its
  input, and keeps its traceback."""
  try:
    yield
  except (UsageError, FileNotFoundError) as e:
    _fail(prog, e)


def parse_gin(files: Sequence[str], bindings: Sequence[str]) -> None:
  """``gin.parse_config_files_and_bindings(files, bindings)`` with the gin search path set (:func:`add_gin_search_path`);
  whatever the parse raises (a syntax error, an unknown configurable or setting, a missing file, a bad value) is a
  :class:`UsageError` naming the gin configuration, since nothing has run yet."""
  import gin
  add_gin_search_path()
  try:
    gin.parse_config_files_and_bindings(files, bindings)
  except Exception as e:  # noqa: BLE001  (any failure to parse is the configuration's)
    message = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, SyntaxError) and e.lineno is not None and str(e.lineno) not in message:
      message += f" (line {e.lineno}: {(e.text or '').strip()!r})"
    raise UsageError(f"the gin configuration does not parse: {type(e).__name__}: {message}") from None


def _fail(prog: str, e: BaseException):
  # The first line says what is wrong; gin appends where it was raised ("In call to configurable …") below it.
  message = str(e).strip().splitlines()
  print(f"{prog}: error: {message[0] if message else type(e).__name__}", file=sys.stderr)
  raise SystemExit(2)
