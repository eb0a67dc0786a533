"""How a trained drafter is made from a pretrained model, and how it loads back into the decoding loop.

A :class:`DrafterRecipe` names a base model (a registry name or a checkpoint path, anything
:func:`blockspec_jax.models.hub.load_model` takes), which of its layers the drafter keeps, and what trains:

* LoRA (``lora_rank > 0``): adapters on the named linear modules of every kept layer, the base frozen; or
* a trainable subset: the kept layers listed in ``train_layers`` (all kept layers when None) plus the top-level
  modules in ``train_modules`` (e.g. ``("final_norm",)``); everything else frozen (not in the optimizer state).

Two drafters of our jobs, as recipes::

    DrafterRecipe("qwen2.5-coder-0.5b", lora_rank=16)                      # LoRA on the Qwen 0.5B drafter
    DrafterRecipe("smollm2-135m", layers=(0, 1, 29), train_modules=("final_norm",))
        # a 3-layer drafter sharing SmolLM2-135M's (frozen, tied) embeddings, its layers initialised from the base

A training run writes the recipe to ``<workdir>/drafter.json`` beside its orbax ``checkpoints/``; a run that trains
the drafter beside other parameters (SD²'s joint training: ``{"steer": map, "drafter": adapters}``) also records
there which subtree of its checkpoints is the drafter's (``checkpoint_subtree``), and every reader takes that part;
:func:`load_trained` rebuilds the drafter from both (``step="init"``: the untrained drafter, i.e. the recipe applied
to the base model alone) and returns a :class:`~blockspec_jax.models.hub.LoadedModel` whose parameters have the
adapters merged into the weights, so a trained drafter decodes at exactly the base model's cost. The job helper
``blockspec_jax.sources.load_model`` sends a workdir there, so ``run_job.drafter``, ``eval.paired --drafters`` and gin
take a trained drafter by its path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp

from blockspec_jax.checks import check_int
from blockspec_jax.models import decoder as decoder_lib
from blockspec_jax.models import quant
from blockspec_jax.train import params as params_lib

__all__ = ["DrafterRecipe", "RECIPE_FILE", "is_trained_dir", "select_layers", "DrafterParts", "save_recipe",
           "read_recipe", "checkpoint_subtree", "save_init_from", "read_init_from", "restore_trainable",
           "load_trained"]

RECIPE_FILE = "drafter.json"
_SUBTREE = "checkpoint_subtree"  # drafter.json: where the drafter's part sits in a joint run's trainable tree
INIT_FILE = "init_from.json"  # a run that started from another run's checkpoint: {"workdir": ..., "step": ...}
_INIT = "init"


@dataclasses.dataclass(frozen=True)
class DrafterRecipe:
  """A drafter derived from ``base`` (see the module docstring). ``seed`` keys the LoRA ``A`` initialisation."""
  base: str
  layers: tuple[int, ...] | None = None
  lora_rank: int = 0
  lora_targets: tuple[str, ...] = params_lib.LORA_TARGETS
  lora_alpha: float | None = None
  train_layers: tuple[int, ...] | None = None
  train_modules: tuple[str, ...] = ()
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.base, str) or not self.base:
      raise ValueError(f"DrafterRecipe.base must be a model name or path, got {self.base!r}")
    for name in ("layers", "train_layers"):
      value = getattr(self, name)
      if value is not None:
        value = tuple(int(i) for i in value)
        if not value or min(value) < 0 or len(set(value)) != len(value):
          raise ValueError(f"DrafterRecipe.{name} must be distinct layer indices >= 0, got {getattr(self, name)!r}")
        object.__setattr__(self, name, value)
    object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
    object.__setattr__(self, "train_modules", tuple(self.train_modules))
    object.__setattr__(self, "lora_rank", check_int(self.lora_rank, "DrafterRecipe.lora_rank", 0))
    if self.lora_rank and (self.train_layers is not None or self.train_modules):
      raise ValueError("DrafterRecipe: LoRA (lora_rank > 0) trains adapters only; train_layers / train_modules are "
                       "for full training of a subset, leave them unset with LoRA")
    unknown = set(self.lora_targets) - set(params_lib.LORA_TARGETS)
    if unknown:
      raise ValueError(f"unknown LoRA targets {sorted(unknown)}; the decoder's linear modules are "
                       f"{', '.join(params_lib.LORA_TARGETS)}")

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, fields: dict) -> "DrafterRecipe":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - known
    if unknown:
      raise ValueError(f"{RECIPE_FILE} has unknown fields {sorted(unknown)}")
    return cls(**fields)

  def derive(self, base_config: decoder_lib.DecoderConfig, base_params: dict
             ) -> tuple[decoder_lib.DecoderConfig, dict]:
    """The drafter's config and full parameter tree (the kept layers of the base, renumbered)."""
    if self.layers is None:
      return base_config, base_params
    return select_layers(base_config, base_params, self.layers)

  def split(self, config: decoder_lib.DecoderConfig, params: dict) -> "DrafterParts":
    """The trainable tree, the frozen tree and how to put them together (see :class:`DrafterParts`)."""
    if self.lora_rank:
      lora = params_lib.init_lora(params, self.lora_rank, jax.random.key(self.seed), self.lora_targets,
                                  self.lora_alpha)
      return DrafterParts(trainable=lora, frozen=params, assemble=_apply_lora)
    layers = range(config.num_layers) if self.train_layers is None else self.train_layers
    bad = [i for i in layers if i >= config.num_layers]
    if bad:
      raise ValueError(f"train_layers {bad} out of range: the drafter has {config.num_layers} layers")
    missing = [m for m in self.train_modules if m not in params]
    if missing:
      raise ValueError(f"train_modules {missing} are not top-level modules of the drafter "
                       f"(it has {', '.join(sorted(params))})")
    trainable, frozen = params_lib.partition(params, params_lib.layers_trainable(layers, extra=self.train_modules))
    return DrafterParts(trainable=trainable, frozen=frozen, assemble=params_lib.merge)


def _apply_lora(lora, base):
  return params_lib.apply_lora(base, lora)


@dataclasses.dataclass(frozen=True, eq=False)
class DrafterParts:
  """``assemble(trainable, frozen)`` is the drafter's full parameter tree (what ``Decoder.apply`` takes)."""
  trainable: Any
  frozen: dict
  assemble: Callable[[Any, dict], dict]


def select_layers(config: decoder_lib.DecoderConfig, params: dict, layers) -> tuple[decoder_lib.DecoderConfig, dict]:
  """A decoder made of ``layers`` of another (in that order, renumbered 0..k−1), sharing its embeddings, final norm
  and head. Per-layer settings (``layer_types``) follow their layers."""
  layers = tuple(int(i) for i in layers)
  bad = [i for i in layers if not 0 <= i < config.num_layers]
  if not layers or bad:
    raise ValueError(f"layers {list(layers)} must be non-empty indices into the base model's {config.num_layers} "
                     "layers")
  layer_types = None if config.layer_types is None else tuple(config.layer_types[i] for i in layers)
  new_config = dataclasses.replace(config, num_layers=len(layers), layer_types=layer_types)
  new_params = {k: v for k, v in params.items() if not k.startswith("layers_")}
  for j, i in enumerate(layers):
    new_params[f"layers_{j}"] = params[f"layers_{i}"]
  return new_config, new_params


def is_trained_dir(path: str | os.PathLike) -> bool:
  """True for a directory written by a training run (it holds ``drafter.json``)."""
  try:
    return (pathlib.Path(path).expanduser() / RECIPE_FILE).is_file()
  except (TypeError, OSError):
    return False


def save_recipe(workdir: str | os.PathLike, recipe: DrafterRecipe, subtree: str | None = None) -> pathlib.Path:
  """Writes ``<workdir>/drafter.json``; ``subtree``: the key of the drafter's part in the run's trainable tree, for a
  run that trains more than the drafter (None: the whole trainable tree is the drafter's)."""
  record = recipe.to_json()
  if subtree is not None:
    if not isinstance(subtree, str) or not subtree:
      raise ValueError(f"subtree must be a non-empty key of the trainable tree, got {subtree!r}")
    record[_SUBTREE] = subtree
  path = pathlib.Path(workdir) / RECIPE_FILE
  path.write_text(json.dumps(record, indent=2) + "\n")
  return path


def save_init_from(workdir: str | os.PathLike, source: str | os.PathLike, step: int) -> pathlib.Path:
  """Records that the run in ``workdir`` started from checkpoint ``step`` of the run in ``source`` (its ``@init``)."""
  path = pathlib.Path(workdir) / INIT_FILE
  path.write_text(json.dumps({"workdir": str(pathlib.Path(source).expanduser().resolve()), "step": int(step)}) + "\n")
  return path


def read_init_from(workdir: str | os.PathLike) -> tuple[str, int] | None:
  """``(source workdir, step)`` written by :func:`save_init_from`, None for a run that started from its recipe."""
  path = pathlib.Path(workdir).expanduser() / INIT_FILE
  if not path.is_file():
    return None
  try:
    record = json.loads(path.read_text())
    return str(record["workdir"]), int(record["step"])
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path} is not a valid record of the run's starting point: {e}") from None


def _read_record(workdir: str | os.PathLike) -> tuple[DrafterRecipe, str | None]:
  path = pathlib.Path(workdir).expanduser() / RECIPE_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found: {workdir} is not the work directory of a drafter training run")
  try:
    fields = json.loads(path.read_text())
    subtree = fields.pop(_SUBTREE, None) if isinstance(fields, dict) else None
    if subtree is not None and (not isinstance(subtree, str) or not subtree):
      raise ValueError(f"{_SUBTREE} must be a non-empty string, got {subtree!r}")
    return DrafterRecipe.from_json(fields), subtree
  except (json.JSONDecodeError, TypeError, ValueError) as e:
    raise ValueError(f"{path} is not a valid drafter recipe: {e}") from None


def read_recipe(workdir: str | os.PathLike) -> DrafterRecipe:
  return _read_record(workdir)[0]


def checkpoint_subtree(workdir: str | os.PathLike) -> str | None:
  """The key of the drafter's part in the run's checkpoints (:func:`save_recipe`), None when the whole trainable
  tree is the drafter's or the directory has no recipe."""
  if not is_trained_dir(workdir):
    return None
  return _read_record(workdir)[1]


def restore_trainable(workdir: str | os.PathLike, template, step: int | None = None):
  """The trainable tree of the checkpoint at ``step`` (the newest intact one when None) in ``<workdir>/checkpoints``,
  restored into ``template``'s structure (the optimizer state is not needed and not read). Returns ``(trainable,
  step)``. A run whose ``drafter.json`` names a ``checkpoint_subtree`` gives that part of its trainable tree.

  Each step's files are checked against the SHA-256 record written when it was saved
  (:mod:`blockspec_jax.train.checkpoints`): with ``step=None`` a damaged newest step is passed over for the previous
  intact one (a line on stderr says so); a given ``step`` that is damaged, or no intact step at all, is a
  ``checkpoints.DamagedCheckpointError`` (a ValueError) naming it."""
  from blockspec_jax.train import checkpoints as checkpoints_lib
  directory = (pathlib.Path(workdir).expanduser() / "checkpoints").absolute()
  if not directory.is_dir():
    raise FileNotFoundError(f"no checkpoints in {directory} (the run has not saved one yet)")
  found = checkpoints_lib.restore(directory, step=step, verb="loading")
  if found is None:
    raise FileNotFoundError(f"no checkpoints in {directory} (the run has not saved one yet)")
  raw, step = found.value, found.step
  saved, subtree = raw["trainable"], checkpoint_subtree(workdir)
  if subtree is not None:
    if not isinstance(saved, dict) or subtree not in saved:
      raise ValueError(f"checkpoint of step {step} in {directory} has no {subtree!r} part (its drafter.json names it)")
    saved = saved[subtree]
  flat_saved = dict(_flatten(saved))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  if len(flat_saved) != len(leaves):
    raise ValueError(f"checkpoint of step {step} in {directory} holds {len(flat_saved)} trainable arrays, the "
                     f"recipe gives {len(leaves)}: it was written for another drafter")
  out = []
  for key_path, leaf in leaves:  # the template's own (sorted) leaf order, matched to the saved arrays by path
    path = tuple(_key_name(k) for k in key_path)
    if path not in flat_saved:
      raise ValueError(f"checkpoint of step {step} in {directory} lacks {'/'.join(path)}: it was written for "
                       "another drafter")
    value = flat_saved[path]
    if tuple(value.shape) != tuple(leaf.shape):
      raise ValueError(f"checkpoint array {'/'.join(path)} has shape {tuple(value.shape)}, the recipe gives "
                       f"{tuple(leaf.shape)}")
    out.append(jnp.asarray(value, leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out), int(step)


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _flatten(tree, prefix=()):
  """``[(path, leaf)]`` of a restored checkpoint tree (nested dicts keyed by strings)."""
  if isinstance(tree, dict):
    items = []
    for k in tree:
      items.extend(_flatten(tree[k], prefix + (str(k),)))
    return items
  return [(prefix, tree)]


def load_trained(workdir: str | os.PathLike, step: int | str | None = None, dtype: str = "float32",
                 cache_dir: str | os.PathLike | None = None, progress: bool = True, weights: str = "dequantized"):
  """The drafter of a training run as a ``hub.LoadedModel`` (adapters merged into the weights).

  ``step``: None for the newest checkpoint, an int for that checkpoint, ``"init"`` for what the run started from:
  the recipe applied to the base model without training, or, for a run started from another run's checkpoint
  (``init_from.json``), that checkpoint. The tokenizer is the base model's. ``spec.name`` is
  ``<absolute workdir>@<step>``. ``weights``: ``hub.load_model``'s, for the base model. With "quantized" the frozen
  weights keep the GGUF's blocks (they dequantize bit for bit to the float32 weights the run trained against), LoRA
  adapters sit beside their quantized weights (``params.apply_lora``), and trained layers are float32.
  """
  from blockspec_jax.models import hub
  workdir = pathlib.Path(workdir).expanduser().resolve()
  recipe = read_recipe(workdir)
  base = hub.load_model(recipe.base, dtype, cache_dir, progress=progress, weights=weights)
  config, params = recipe.derive(base.config, base.params["params"])
  parts = recipe.split(config, params)
  # A trained weight is float32 in the checkpoint even where the quantized base stores blocks: restore into shapes.
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
                          if isinstance(x, quant.QuantizedTensor) else x, parts.trainable,
                          is_leaf=lambda x: isinstance(x, quant.QuantizedTensor))
  if step == _INIT:
    label, started = _INIT, read_init_from(workdir)
    trainable = parts.trainable if started is None else restore_trainable(started[0], template, started[1])[0]
  else:
    trainable, label = restore_trainable(workdir, template, step)
  merged = parts.assemble(trainable, parts.frozen)
  source = hub.LocalSource(name=f"{workdir}@{label}", kind="trained", path=workdir)
  return hub.LoadedModel(config=config, params={"params": merged}, tokenizer=base.tokenizer, spec=source)
