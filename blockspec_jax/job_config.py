"""The settings the evaluation jobs share, grouped: the pair of models, the grid of decoding methods, the sampler, the
prompt data and the outputs. The main job (``run.run_job``) and the suites (``eval.suite.suite_job``) build the same
frozen dataclasses from their gin bindings (``run_job.gamma``, ``suite.gammas``, … keep working) and pass them to
their steps.

Each dataclass checks its own fields once, when it is built, with the checks the jobs have always used
(``methods.check_settings``, ``methods.check_verifier_settings``, ``methods.check_drafter_settings``,
``runtime.check_output_file`` / ``check_output_dir``), so a mistake is one :class:`UsageError` before any model is
loaded. What depends on the models (cache room, drafter sizes) is checked once they are loaded
(``methods.check_methods_fit``). No gin here: the entry points bind the settings.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Sequence

from blockspec_jax import methods as methods_lib
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.data import formats as formats_lib
from blockspec_jax.checks import UsageError

__all__ = ["Models", "MethodGrid", "SamplerSettings", "DataSettings", "OutputSettings", "EvalSettings",
           "check_switch", "check_mesh_shape"]


def check_switch(value, name: str) -> bool:
  """``value`` when it is True or False; a :class:`UsageError` naming ``name`` otherwise (``"yes"``, ``1``)."""
  if not isinstance(value, bool):
    raise UsageError(f"{name} must be True or False, got {value!r}")
  return value


@dataclasses.dataclass(frozen=True)
class Models:
  """The target and its drafter model(s), and how they are loaded."""

  #: The target model: a registry name (``models.hub``) or a local path.
  target: str = methods_lib.DEFAULT_TARGET
  #: The drafter models: model names or paths, work directories of drafter training runs (``python -m
  #: blockspec_jax.train``; ``<dir>@init`` is a run's drafter before training). With several, every speculative
  #: method runs with each drafter on the same prompts and keys. A single string is one drafter.
  drafters: tuple[str, ...] = (methods_lib.DEFAULT_DRAFTER,)
  #: ``"float32"`` or ``"bfloat16"``: the dtype both models are loaded in.
  dtype: str = "float32"
  #: Load both models in the stacked layout (layers compiled once: programs compile 3-5x faster, the same tokens; on
  #: a CPU its decode steps are about 6% and its prefill about 18% slower than the unrolled layout's, which False
  #: selects for long measurements).
  scan_layers: bool = True
  #: ``"dequantized"`` (every weight converted to ``dtype``) or ``"quantized"``: the GGUF's blocks as stored
  #: (``hub.load_model(weights=)``: about 5x fewer bytes a step, the same logits on the CPU kernel); a model whose
  #: block types differ across layers (the Qwen Q4_K_M files) needs ``scan_layers = False``.
  weights: str = "dequantized"
  #: Where model files are cached (None: the default cache directory).
  cache_dir: str | None = None
  #: JAX's persistent compilation cache directory (None: ``$BLOCKSPEC_JAX_COMPILE_CACHE`` or
  #: ``<cache dir>/jax_compilation``; ``"off"`` disables it): a second run loads its compiled programs from there.
  compilation_cache: str | None = None
  #: The device mesh ``(data, model)`` the job decodes on, ``data × model`` = every device of the run (all
  #: processes'): prompt rows over ``data`` (one row per ``data`` shard at a time), parameters and KV caches over
  #: ``model`` (``parallel``). None: ``(devices, 1)``. On one device the job runs today's batch-1 programs.
  mesh: tuple[int, int] | None = None

  def __post_init__(self):
    drafters = (self.drafters,) if isinstance(self.drafters, str) else tuple(self.drafters)
    object.__setattr__(self, "drafters", drafters)
    if not drafters:
      raise UsageError("drafter: give at least one drafter")
    methods_lib.check_settings(dtype=self.dtype, models=(self.target, *drafters))
    check_switch(self.scan_layers, "scan_layers")
    from blockspec_jax.models.hub import WEIGHTS
    if self.weights not in WEIGHTS:
      raise UsageError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
    object.__setattr__(self, "mesh", check_mesh_shape(self.mesh))

  def device_mesh(self):
    """The ``jax.sharding.Mesh`` of :attr:`mesh` over every device, or None on one device (today's programs)."""
    from blockspec_jax import parallel
    return parallel.job_mesh(self.mesh)

  def load(self):
    """Load the target and every drafter (``sources.load_models``): ``(target_model, drafter_models, seconds)``; on
    several devices their parameters are laid out on :meth:`device_mesh` once, here."""
    target, drafters, seconds = sources.load_models(self.target, self.drafters, self.dtype, self.cache_dir,
                                                    self.scan_layers, self.weights)
    mesh = self.device_mesh()
    if mesh is not None:
      from blockspec_jax import parallel
      target, *drafters = parallel.shard_models((target, *drafters), mesh)
    return target, drafters, seconds


def check_mesh_shape(shape) -> tuple[int, int]:
  """``parallel.check_mesh_shape`` (imported here when called: this module does not load JAX)."""
  from blockspec_jax import parallel
  return parallel.check_mesh_shape(shape)


@dataclasses.dataclass(frozen=True)
class MethodGrid:
  """The decoding methods and the draft lengths γ they run at."""

  #: ``"autoregressive"``, any registered verifier (``verify.VERIFIERS``), or ``"<verifier>@<drafter>"``
  #: (``drafters.DRAFTERS``; see ``methods.parse_method``).
  methods: tuple[str, ...] = methods_lib.METHODS
  #: The draft lengths γ every speculative method runs at (autoregressive decoding runs once: γ does not apply).
  gammas: tuple[int, ...] = (4,)
  #: Drafter shapes by drafter name, e.g. ``{"k_chains": {"k": 4}, "rsd_c": {"branching": (2, 2, 1, 1)}}``.
  drafter_settings: dict | None = None
  #: Settings of registered rules by name, e.g. ``{"lenient": {"epsilon": 0.5, "f": "div"}}``.
  verifier_settings: dict | None = None
  #: γ for the methods it names, overriding ``gammas``, e.g. ``{"block": (8,), "traversal@rsd_c": (4,)}`` to compare
  #: a chain and trees at one budget of draft nodes.
  method_gammas: dict | None = None

  def __post_init__(self):
    methods_lib.check_settings(gammas=self.gammas, methods=self.methods)  # lists, not scalars, not empty
    object.__setattr__(self, "methods", tuple(self.methods))
    object.__setattr__(self, "gammas", tuple(self.gammas))
    if not isinstance(self.method_gammas or {}, dict):
      raise UsageError(f"method_gammas must map methods to tuples of γ, got {self.method_gammas!r}")
    own_gammas = {}
    for method, own in (self.method_gammas or {}).items():
      methods_lib.check_settings(gammas=own)
      own_gammas[method] = tuple(own)
    object.__setattr__(self, "method_gammas", own_gammas or None)
    stray = [m for m in own_gammas if m not in self.methods]
    if stray:
      raise UsageError(f"method_gammas names {stray}, which are not among the methods {list(self.methods)}")
    methods_lib.check_settings(gammas=self.all_gammas)
    methods_lib.check_verifier_settings(self.verifier_settings)
    methods_lib.check_drafter_settings(self.drafter_settings)

  def gammas_of(self, method: str) -> tuple:
    """The γ ``method`` runs at: ``(None,)`` for autoregressive decoding, else its own γ or ``gammas``."""
    if method == methods_lib.AUTOREGRESSIVE:
      return (None,)
    return (self.method_gammas or {}).get(method, self.gammas)

  @property
  def all_gammas(self) -> tuple[int, ...]:
    """Every γ of the grid, ``gammas`` first, without repeats."""
    return tuple(dict.fromkeys(self.gammas + tuple(g for gs in (self.method_gammas or {}).values() for g in gs)))


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """How both models sample (through the same transform), and the seed of the keys."""

  #: The temperatures every method decodes at (0: greedy).
  temperatures: tuple[float, ...] = (1.0,)
  #: Keep the k most likely tokens (0 disables it).
  top_k: int = 0
  #: Keep the smallest set of tokens with probability >= p (1 disables it).
  top_p: float = 1.0
  #: The seed of the decoding keys: every method and category starts from it (same prompts, same keys).
  seed: int = 0

  def __post_init__(self):
    methods_lib.check_settings(temperatures=self.temperatures)
    object.__setattr__(self, "temperatures", tuple(self.temperatures))
    from blockspec_jax import sampling
    try:
      sampling.Sampler(temperature=1.0, top_k=self.top_k, top_p=self.top_p)
    except ValueError as e:
      raise UsageError(str(e)) from None

  def sampler(self, temperature: float):
    """The ``sampling.Sampler`` at ``temperature`` with these top-k / top-p."""
    from blockspec_jax import sampling
    return sampling.Sampler(temperature=temperature, top_k=self.top_k, top_p=self.top_p)


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """The prompts and how much each one decodes."""

  #: A shipped prompt file by name (``"six"``: code, chat, math, summarization, translation, qa, 4 prompts each;
  #: ``"default"``: the main job's file: code, chat, math), ``"seqio:<task>[:<split>]"`` (the suites, with the seqio
  #: extra) or the path of a prompt JSONL file (``data.prompts.load_prompts``: a user's own rows need only ``task``
  #: and ``text``).
  prompts: str = "default"
  #: The first N prompts (round-robin over the categories); None: all of them.
  num_prompts: int | None = None
  #: The categories to run (None: every category in the file, in file order).
  tasks: Sequence[str] | None = None
  #: The first N prompts of each category; None: all of them.
  prompts_per_task: int | None = None
  #: Chat-template each prompt when the tokenizer has a template.
  chat: bool = True
  #: The system turn of each chat prompt: ``"default"`` (the template's own: Qwen2.5 and SmolLM2 insert a default
  #: system message), ``"none"`` (no system turn), a system message, or a tuple of these cycled over the prompts
  #: (``data.formats.chat_text``).
  system: Any = "default"
  #: New tokens decoded per prompt.
  max_new_tokens: int = 64

  def __post_init__(self):
    methods_lib.check_settings(max_new_tokens=self.max_new_tokens, num_prompts=self.num_prompts)
    methods_lib.check_settings(num_prompts=self.prompts_per_task)
    object.__setattr__(self, "system", formats_lib.system_setting(self.system, self.chat))
    if self.tasks is not None:
      object.__setattr__(self, "tasks", tuple(self.tasks))


@dataclasses.dataclass(frozen=True)
class OutputSettings:
  """Where a job writes and what it shows. The report file's or directory's folder is proved writable when built."""

  #: The JSON report of the main job (None: none).
  output_json: str | None = None
  #: The directory of a suite (``config.gin``, ``results.json``, ``results.csv``, plots, ``report.md``); None: none.
  out_dir: str | None = None
  #: Draw the suite's plots (with matplotlib).
  plots: bool = True
  #: Print each method's generated text of the first prompt.
  show_text: bool = True
  #: Show a progress bar on stderr.
  progress: bool = True

  def __post_init__(self):
    runtime.check_output_file(self.output_json, "the report (output_json)")
    if self.out_dir is not None:
      object.__setattr__(self, "out_dir", runtime.check_output_dir(pathlib.Path(self.out_dir),
                                                                   "the suite's directory"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSettings:
  """The settings every evaluation job binds flat in gin (``run_job.target``, ``suite.seed``, ``bench_lossy.mesh``).

  Each job's settings object (``run.RunSettings``, ``eval.suite.SuiteSettings``, ``eval.bench_lossy.LossySettings``)
  subclasses this one, adds its own fields and defaults, and groups them into the dataclasses above with
  :meth:`models`, :meth:`sampler_settings` and :meth:`data_settings` (each checks its fields when built); it builds
  every group when it is made, so a mistake is one :class:`UsageError` before any model loads, as with the training
  jobs' settings (``train.job_setup.JobSettings``).
  """

  target: str = methods_lib.DEFAULT_TARGET
  """:attr:`Models.target`."""
  drafter: Any = methods_lib.DEFAULT_DRAFTER
  """:attr:`Models.drafters` (a name, or a tuple of them where the job runs several)."""
  dtype: str = "float32"
  """:attr:`Models.dtype`."""
  scan_layers: bool = True
  """:attr:`Models.scan_layers`."""
  weights: str = "dequantized"
  """:attr:`Models.weights`."""
  cache_dir: str | None = None
  """:attr:`Models.cache_dir`."""
  compilation_cache: str | None = None
  """:attr:`Models.compilation_cache`."""
  mesh: tuple | None = None
  """:attr:`Models.mesh` (``(data, model)``; None: every device over ``data``)."""
  seed: int = 0
  """:attr:`SamplerSettings.seed`."""
  top_k: int = 0
  """:attr:`SamplerSettings.top_k`."""
  top_p: float = 1.0
  """:attr:`SamplerSettings.top_p`."""
  chat: bool = True
  """:attr:`DataSettings.chat`."""
  system: Any = "default"
  """:attr:`DataSettings.system`."""
  max_new_tokens: int = 64
  """:attr:`DataSettings.max_new_tokens`."""
  share_prefills: bool = True
  """Rows that run the same prefill (same models, drafter, γ and budget) compute each prompt's prefill once
  (``harness.PrefillCache``: the same state bit for bit) and each count its measured time; False times every row's
  own."""

  def __post_init__(self):
    check_switch(self.share_prefills, "share_prefills")
    self.groups()

  def groups(self) -> tuple:
    """The job's grouped settings, in the order its run function takes them (each checked as it is built)."""
    raise NotImplementedError

  def models(self) -> Models:
    return Models(target=self.target, drafters=self.drafter, dtype=self.dtype, scan_layers=self.scan_layers,
                  weights=self.weights, cache_dir=self.cache_dir, compilation_cache=self.compilation_cache,
                  mesh=self.mesh)

  def sampler_settings(self, temperatures) -> SamplerSettings:
    return SamplerSettings(temperatures=temperatures, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

  def data_settings(self, prompts: str, **fields) -> DataSettings:
    """:class:`DataSettings` of ``prompts`` and ``fields`` (``num_prompts``, ``tasks``, …) with :attr:`chat`,
    :attr:`system` and :attr:`max_new_tokens`."""
    return DataSettings(prompts=prompts, chat=self.chat, system=self.system, max_new_tokens=self.max_new_tokens,
                        **fields)
