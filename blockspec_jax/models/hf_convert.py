"""Hugging Face checkpoint directories → ``Decoder`` config, parameters and tokenizer (llama, qwen2, gemma3).

    check_checkpoint_dir(path)                        # FileNotFoundError naming a missing file
    config, params = convert(path, dtype="float32")   # params = {"params": {...}} with numpy leaves
    tokenizer = tokenizer_from_hf(path)               # TokenizerWrapper over tokenizer.json

A directory as ``save_pretrained`` writes it: ``config.json``, the weights as ``model.safetensors`` or shards listed
by ``model.safetensors.index.json`` (any ``*.safetensors`` files without an index are read together) and
``tokenizer.json`` (plus, when present, ``tokenizer_config.json``, ``special_tokens_map.json``,
``generation_config.json`` and ``chat_template.jinja`` / ``chat_template.json``).

Families (``config.json`` ``model_type``; ``architectures``, when given, must be the causal-LM class of it):

    llama        LlamaForCausalLM                 rotary "half" (HF keeps q/k rows unpermuted, unlike GGUF llama)
    qwen2        Qwen2ForCausalLM                 q/k/v biases
    gemma3_text  Gemma3ForCausalLM                q/k norms, post-norms, GeGLU, embeddings * sqrt(D), local layers
    gemma3       Gemma3ForConditionalGeneration   the ``text_config`` model; vision tower and projector are skipped

Weights (``i`` = layer; gemma3 multimodal names ``model.language_model.*`` / ``language_model.model.*`` are read as
``model.*``)::

    model.embed_tokens.weight                     [V, D]        → embed/embedding
    model.layers.i.input_layernorm.weight         [D]           → layers_i/attn_norm/scale
    model.layers.i.self_attn.{q,k,v}_proj.weight  [N*H|K*H, D]  → layers_i/attn/{q,k,v}/weight;  .bias → .../bias
    model.layers.i.self_attn.o_proj.weight        [D, N*H]      → layers_i/attn/o/weight
    model.layers.i.mlp.{gate,up,down}_proj.weight               → layers_i/mlp/{gate,up,down}/weight
    model.norm.weight                             [D]           → final_norm/scale
    lm_head.weight                                [V, D]        → lm_head/weight; absent → tied embeddings
    llama, qwen2:
    model.layers.i.post_attention_layernorm.weight [D]          → layers_i/mlp_norm/scale  (the pre-MLP norm)
    gemma3:
    model.layers.i.self_attn.{q,k}_norm.weight    [H]           → layers_i/attn/{q,k}_norm/scale
    model.layers.i.post_attention_layernorm.weight [D]          → layers_i/post_attn_norm/scale
    model.layers.i.pre_feedforward_layernorm.weight [D]         → layers_i/mlp_norm/scale
    model.layers.i.post_feedforward_layernorm.weight [D]        → layers_i/post_mlp_norm/scale

Linear weights are (out, in) in torch as in the Decoder: nothing is transposed. HF Gemma norms store ``w`` and
multiply by ``1 + w``; the converted config says so (``norm_plus_one=True``) instead of folding the 1 into the
weights (exact in bfloat16, where 1 + w would round). Embeddings are tied when ``tie_word_embeddings`` is true (an
``lm_head.weight`` in the files must then equal the embedding) or the files have no ``lm_head.weight``. Rotary
buffers (``*.rotary_emb.inv_freq``) of old checkpoints are ignored; any other tensor without a place, and any
parameter without a tensor, fails the conversion with a ValueError naming them.

Safetensors are read by a small reader of the documented format (8-byte little-endian header length, JSON header,
raw little-endian data), memory-mapped, one tensor at a time, so peak memory is the output plus one tensor: the
``safetensors`` package's numpy API cannot return bfloat16 (the dtype of most released checkpoints), and the package
is not a dependency of this library. Hostile or broken files: every header entry is checked before it is used (see
``read_safetensors_header``; sizes in exact integers, so ``[2**32, 2**32]`` cannot wrap around), and config.json's
sizes are checked against the tensors before anything is sized by them (every layer 0 .. ``num_hidden_layers`` - 1
must have tensors, every tensor's shape must be the one the config implies); each problem is one ValueError naming
the file (and the tensor).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from blockspec_jax.models.decoder import DecoderConfig
from blockspec_jax.models.gguf_convert import (check_layer_indices, describe_sizes, insert_param, layers_past,
                                               param_shapes)
from blockspec_jax.models.safetensors import (INDEX_FILE as _INDEX_FILE, _is_int, _read_json, _short, _tensor_files,
                                              iter_tensors, read_safetensors_header, safetensors_files)
from blockspec_jax.models.tokenizer import TokenizerWrapper

__all__ = ["SUPPORTED_MODEL_TYPES", "SUPPORTED_ARCHITECTURES", "REQUIRED_FILES", "check_checkpoint_dir",
           "read_config", "config_from_hf", "safetensors_files", "read_safetensors_header", "iter_tensors",
           "read_checkpoint_config", "convert", "tokenizer_from_hf"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gemma3_text", "gemma3")
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                           "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3"}
REQUIRED_FILES = ("config.json", "*.safetensors", "tokenizer.json")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Defaults of the transformers config classes for keys a config.json may leave out.
_TIE_DEFAULT = {"llama": False, "qwen2": False, "gemma3": True}
_THETA_DEFAULT = {"llama": 10000.0, "qwen2": 10000.0, "gemma3": 1_000_000.0}
GEMMA3_ROPE_THETA_LOCAL = 10000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6
# gemma3 multimodal prefixes → the text model's names; tensors under the skipped prefixes are not the text model.
_GEMMA3_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_GEMMA3_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


# ----------------------------------------------------------------------------------------------------------------
# Directory and config


def check_checkpoint_dir(directory: os.PathLike | str) -> None:
  """Raise FileNotFoundError naming every missing required file of an HF checkpoint directory (``config.json``,
  at least one ``*.safetensors``, ``tokenizer.json``); an index's missing shard is named by ``safetensors_files``."""
  directory = pathlib.Path(directory)
  missing = []
  if not (directory / "config.json").is_file():
    missing.append("config.json")
  if not (directory / _INDEX_FILE).is_file() and not any(directory.glob("*.safetensors")):
    missing.append("*.safetensors (model weights)")
  if not (directory / "tokenizer.json").is_file():
    missing.append("tokenizer.json")
  if missing:
    raise FileNotFoundError(
        f"{directory} is not a usable Hugging Face checkpoint directory: missing {', '.join(missing)} (expected "
        f"config.json, model.safetensors or shards with {_INDEX_FILE}, and tokenizer.json, as save_pretrained "
        "writes them)")


def _read_optional_json(path: pathlib.Path) -> dict:
  return _read_json(path) if path.is_file() else {}


def read_config(directory: os.PathLike | str) -> dict:
  """The directory's ``config.json`` as a dict (FileNotFoundError naming it when absent)."""
  path = pathlib.Path(directory) / "config.json"
  if not path.is_file():
    raise FileNotFoundError(f"{pathlib.Path(directory)} has no config.json")
  return _read_json(path)


def _family(config: dict, where: str = "config.json") -> tuple[str, dict]:
  """``(family, text config)``: family "llama" / "qwen2" / "gemma3"; the text config is ``text_config`` for a
  multimodal gemma3, else the config itself. Raises NotImplementedError naming an unsupported type."""
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise NotImplementedError(f"{where}: model_type {_short(model_type)} is not supported; supported model types: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  architectures = config.get("architectures") or []
  if isinstance(architectures, str):
    architectures = [architectures]
  if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
    raise ValueError(f"{where}: architectures must be a list of class names, got {_short(architectures)}")
  for arch in architectures:
    if SUPPORTED_ARCHITECTURES.get(arch) != model_type:
      supported = [a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type]
      raise NotImplementedError(
          f"{where}: architecture {arch!r} is not supported for model_type {model_type!r}; supported "
          f"architectures: {', '.join(supported)} (all: {', '.join(SUPPORTED_ARCHITECTURES)})")
  if model_type == "gemma3":
    text = config.get("text_config")
    if not isinstance(text, dict):
      raise ValueError(f"{where}: model_type 'gemma3' needs a text_config object")
    text = dict(text)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
      text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return "gemma3", text
  return ("gemma3" if model_type == "gemma3_text" else model_type), config


def _get(cfg: dict, key: str, default: Any = None, where: str = "config.json") -> Any:
  value = cfg.get(key)
  if value is None:
    if default is None:
      raise ValueError(f"{where} lacks {key!r}")
    return default
  return value


def _int(cfg: dict, key: str, default: int | None = None, where: str = "config.json") -> int:
  """A positive integer of the config (a size or a count)."""
  value = _get(cfg, key, default, where)
  if not _is_int(value) or value < 1:
    raise ValueError(f"{where}: {key} must be a positive integer, got {_short(value)}")
  return value


def _positive(value: Any, key: str, where: str) -> float:
  """A positive finite number of the config (a rotary base, an epsilon, a scale)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
    raise ValueError(f"{where}: {key} must be a positive number, got {_short(value)}")
  return float(value)


def _rope(cfg: dict, family: str, kind: str | None, theta_key: str, theta_default: float, where: str) -> float:
  """Rotary base for layers of ``kind`` ("full_attention" / "sliding_attention"; None: the one global set), from
  ``rope_parameters`` (transformers >= 5) or ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``
  (older); NotImplementedError for scaled or partial rotary."""
  params = cfg.get("rope_parameters") or {}
  scaling = cfg.get("rope_scaling") if kind in (None, "full_attention") else None
  for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
    if value is not None and not isinstance(value, dict):
      raise ValueError(f"{where}: {key} must be an object, got {_short(value)}")
  if kind is not None and isinstance(params.get(kind), dict):
    params = params[kind]
  elif any(isinstance(v, dict) for v in params.values()):
    params = {}
  rope_type = params.get("rope_type", params.get("type", "default"))
  if scaling:
    rope_type = scaling.get("rope_type", scaling.get("type", rope_type))
  if rope_type not in ("default", None):
    label = f" of {kind} layers" if kind else ""
    raise NotImplementedError(f"{where}: rope type {rope_type!r}{label} ({family}) is not supported by Decoder; "
                              "supported: 'default' (no scaling)")
  partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise NotImplementedError(f"{where}: partial_rotary_factor {partial} is not supported by Decoder")
  theta = params.get("rope_theta", cfg.get(theta_key))
  return _positive(theta_default if theta is None else theta, theta_key, where)


def _check_supported(cfg: dict, family: str, where: str) -> None:
  """NotImplementedError for an activation, bias, bidirectional or sliding attention, or soft-capping the Decoder
  cannot express for ``family``."""
  act_key = "hidden_activation" if family == "gemma3" and cfg.get("hidden_activation") else "hidden_act"
  act = cfg.get(act_key) or ("gelu_pytorch_tanh" if family == "gemma3" else "silu")
  wanted_act = "gelu_pytorch_tanh" if family == "gemma3" else "silu"
  if act != wanted_act:
    raise NotImplementedError(f"{where}: {act_key} {act!r} is not supported for {family}; supported: {wanted_act!r}")
  for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention", "use_sliding_window"):
    if cfg.get(key):
      raise NotImplementedError(f"{where}: {key}=true ({family}) is not supported by Decoder")
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if cfg.get(key) is not None:
      raise NotImplementedError(f"{where}: {key}={cfg[key]} ({family}) is not supported by Decoder")


def _gemma3_fields(cfg: dict, num_layers: int, where: str) -> dict[str, Any]:
  """Gemma 3's DecoderConfig fields beyond the shared ones: norms, scales, the sliding window, each layer's kind
  (``layer_types``, or every ``sliding_window_pattern``-th layer full) and the local rope base."""
  theta_local = _rope(cfg, "gemma3", "sliding_attention", "rope_local_base_freq", GEMMA3_ROPE_THETA_LOCAL, where)
  layer_types = cfg.get("layer_types")
  if layer_types is None:
    pattern = _int(cfg, "sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN, where)
    layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
  if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
    raise ValueError(f"{where}: layer_types must be a list of strings, got {_short(layer_types)}")
  if len(layer_types) != num_layers:
    raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for {num_layers} layers")
  kinds = {"full_attention": "full", "sliding_attention": "sliding"}
  bad = sorted({t for t in layer_types if t not in kinds})
  if bad:
    raise NotImplementedError(f"{where}: layer_types {bad} are not supported; supported: {tuple(kinds)}")
  return dict(qk_norm=True, post_norms=True, norm_plus_one=True, embed_scale=True, mlp_activation="gelu_tanh",
              query_scale=_positive(_get(cfg, "query_pre_attn_scalar", 256, where), "query_pre_attn_scalar",
                                    where) ** -0.5,
              sliding_window=_int(cfg, "sliding_window", 4096, where),
              layer_types=tuple(kinds[t] for t in layer_types), rope_theta_local=theta_local)


def config_from_hf(config: dict, *, tensor_names: Any = None, dtype: str = "float32",
                   where: str = "config.json") -> DecoderConfig:
  """DecoderConfig of an HF ``config.json`` (llama, qwen2, gemma3_text, or gemma3 with a ``text_config``).

  Args:
    config: the parsed config.json.
    tensor_names: names of the checkpoint's text-model tensors (gemma3 multimodal prefixes removed, as ``convert``
      passes them); without ``lm_head.weight`` the embeddings are tied, and every layer 0 .. ``num_hidden_layers`` - 1
      must have ``model.layers.N`` tensors (checked before anything is sized by the count). Without it,
      ``tie_word_embeddings`` (default per family) decides.
    dtype: compute dtype of the config, "float32" or "bfloat16".
    where: what to call the config in errors.
  Raises:
    NotImplementedError: unsupported model_type / architectures, or an option the Decoder cannot express (rope
      scaling, partial rotary, attention or MLP biases on llama, sliding windows on qwen2, soft-capping...).
    ValueError: missing or inconsistent fields (sizes that are not positive integers, a layer count the tensors do
      not back), unknown dtype.
  """
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
  family, cfg = _family(config, where)
  text = "text_config." if cfg is not config else ""
  num_layers = _int(cfg, "num_hidden_layers", where=where)
  if tensor_names is not None:
    layers = {int(m.group(1)) for m in map(_LAYER_RE.fullmatch, tensor_names) if m}
    check_layer_indices(layers, num_layers, f"{where}: {text}num_hidden_layers", "model.layers.N")
  d_model = _int(cfg, "hidden_size", where=where)
  num_heads = _int(cfg, "num_attention_heads", where=where)
  num_kv_heads = _int(cfg, "num_key_value_heads", num_heads, where)
  head_default = 256 if family == "gemma3" else (d_model // num_heads if d_model % num_heads == 0 else None)
  head_dim = _int(cfg, "head_dim", head_default, where)
  _check_supported(cfg, family, where)
  tie = bool(cfg.get("tie_word_embeddings", _TIE_DEFAULT[family]))
  if tensor_names is not None and "lm_head.weight" not in tensor_names:
    tie = True
  if family == "gemma3":
    theta = _rope(cfg, family, "full_attention", "rope_theta", _THETA_DEFAULT[family], where)
    gemma = _gemma3_fields(cfg, num_layers, where)
  else:
    theta, gemma = _rope(cfg, family, None, "rope_theta", _THETA_DEFAULT[family], where), {}
  fields = dict(
      vocab_size=_int(cfg, "vocab_size", where=where),
      d_model=d_model,
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      ffn_dim=_int(cfg, "intermediate_size", where=where),
      rope_theta=theta,
      rms_eps=_positive(_get(cfg, "rms_norm_eps", 1e-6, where), "rms_norm_eps", where),
      rope_style="half",
      qkv_bias=family == "qwen2",
      tie_embeddings=tie,
      dtype=_DTYPES[dtype],
      max_len=_int(cfg, "max_position_embeddings", 8192, where),
      **gemma,
  )
  try:
    return DecoderConfig(**fields)
  except ValueError as e:  # e.g. num_attention_heads not a multiple of num_key_value_heads
    raise ValueError(f"{where}: {e}") from e



# ----------------------------------------------------------------------------------------------------------------
# Weight names


def _canonical(name: str, family: str) -> str | None:
  """The text-model name of ``name`` (gemma3 multimodal prefixes removed), or None for a tensor to skip."""
  if name.endswith("rotary_emb.inv_freq"):
    return None
  if family == "gemma3":
    if name.startswith(_GEMMA3_SKIPPED):
      return None
    for old, new in _GEMMA3_RENAMES:
      if name.startswith(old):
        return new + name[len(old):]
  return name


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)", re.ASCII)
_LINEAR = {"self_attn.q_proj": ("attn", "q"), "self_attn.k_proj": ("attn", "k"), "self_attn.v_proj": ("attn", "v"),
           "self_attn.o_proj": ("attn", "o"), "mlp.gate_proj": ("mlp", "gate"), "mlp.up_proj": ("mlp", "up"),
           "mlp.down_proj": ("mlp", "down")}
_NORMS = {"llama": {"input_layernorm": ("attn_norm",), "post_attention_layernorm": ("mlp_norm",)},
          "gemma3": {"input_layernorm": ("attn_norm",), "post_attention_layernorm": ("post_attn_norm",),
                     "pre_feedforward_layernorm": ("mlp_norm",), "post_feedforward_layernorm": ("post_mlp_norm",),
                     "self_attn.q_norm": ("attn", "q_norm"), "self_attn.k_norm": ("attn", "k_norm")}}
_NORMS["qwen2"] = _NORMS["llama"]


def _target(name: str, family: str) -> tuple[str, ...] | None:
  """Canonical HF tensor name → Decoder param path, or None if the name is not one we map."""
  fixed = {"model.embed_tokens.weight": ("embed", "embedding"), "model.norm.weight": ("final_norm", "scale"),
           "lm_head.weight": ("lm_head", "weight")}
  if name in fixed:
    return fixed[name]
  match = _LAYER_RE.fullmatch(name)
  if match is None:
    return None
  layer, rest = f"layers_{int(match.group(1))}", match.group(2)
  module, _, leaf = rest.rpartition(".")
  if module in _NORMS[family] and leaf == "weight":
    return (layer, *_NORMS[family][module], "scale")
  if module in _LINEAR and leaf == "weight":
    return (layer, *_LINEAR[module], "weight")
  if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") and leaf == "bias":
    return (layer, *_LINEAR[module], "bias")
  return None


def _listed(names: list[str]) -> str:
  return f"{names[:10]}" + (f" (+{len(names) - 10} more)" if len(names) > 10 else "")


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What ``convert`` reads, checked before any tensor data is: the config, the files and their headers, and the
  Decoder parameter of every tensor that has one (``targets``; a tensor in neither it nor ``tied_head``, the
  ``lm_head.weight`` of tied embeddings, is skipped)."""
  directory: pathlib.Path
  config: DecoderConfig
  headers: dict[pathlib.Path, tuple[int, dict]]
  targets: dict[str, tuple[str, ...]]
  tied_head: str | None


def _plan(directory: os.PathLike | str, dtype: str) -> _Plan:
  """Read config.json and the safetensors headers and check every tensor's name and shape against the config."""
  directory = pathlib.Path(directory)
  config_path = directory / "config.json"
  raw_config = read_config(directory)
  family, _ = _family(raw_config, str(config_path))
  headers = {path: read_safetensors_header(path) for path in safetensors_files(directory)}
  files = _tensor_files(headers)
  canonical = {n: _canonical(n, family) for n in files}
  kept = {c for c in canonical.values() if c is not None}
  config = config_from_hf(raw_config, tensor_names=kept, dtype=dtype, where=str(config_path))
  expected = param_shapes(config)
  heads = [n for n, c in canonical.items() if c == "lm_head.weight"]
  tied_head = heads[0] if config.tie_embeddings and heads else None
  targets = {n: _target(c, family) for n, c in canonical.items() if c is not None and n != tied_head}
  unknown = sorted(n for n, t in targets.items() if t not in expected)
  if unknown:
    hint = layers_past([canonical[n] for n in unknown], config.num_layers, _LAYER_RE,
                       "config.json's num_hidden_layers")
    raise ValueError(f"{directory}: tensors with no place in Decoder ({family}, {config.num_layers} layers): "
                     f"{_listed(unknown)}{hint}")
  by_target: dict[tuple[str, ...], str] = {}
  for n, t in targets.items():
    if t in by_target:
      raise ValueError(f"{directory}: tensors {by_target[t]} and {n} both map to {'/'.join(t)}")
    by_target[t] = n
  missing = [p for p in expected if p not in by_target]
  if missing:
    raise ValueError(f"{directory}: missing tensors for {_listed(['/'.join(p) for p in missing])} (e.g. "
                     f"{_hf_name(missing[0], family)!r})")
  checked = [(n, expected[t], "/".join(t)) for n, t in targets.items()]
  if tied_head is not None:
    checked.append((tied_head, expected[("embed", "embedding")], "lm_head/weight (tied to the embedding)"))
  for n, want, label in checked:
    shape = tuple(headers[files[n]][1][n]["shape"])
    if shape != want:
      raise ValueError(f"{files[n]}: tensor {n} has shape {shape}, expected {want} for {label} (config.json's "
                       f"sizes: {describe_sizes(config)})")
  return _Plan(directory, config, headers, targets, tied_head)


def read_checkpoint_config(directory: os.PathLike | str, dtype: str = "float32") -> DecoderConfig:
  """The DecoderConfig ``convert(directory, dtype)`` would return, after every check it makes before reading tensor
  data (config.json, the safetensors headers, tensor names and shapes against the config); reads no tensor data.
  Raises as ``convert``."""
  return _plan(directory, dtype).config


def convert(directory: os.PathLike | str, dtype: str = "float32", progress: bool = False
            ) -> tuple[DecoderConfig, dict]:
  """Read an HF llama/qwen2/gemma3 checkpoint directory into ``(config, {"params": tree})`` with host numpy leaves
  of ``dtype`` ("float32" or "bfloat16"), one tensor at a time. Everything is checked against the config and the
  files before the first tensor is read (see ``read_safetensors_header`` and ``config_from_hf``).

  Raises:
    FileNotFoundError: no config.json, no weights, or a shard of the index is missing.
    NotImplementedError: see ``config_from_hf``; a tensor dtype the reader does not know (e.g. FP8).
    ValueError: tensors without a place in the Decoder or parameters without a tensor (both named), wrong shapes,
      a layer count the tensors do not back, a tied ``lm_head.weight`` that differs from the embedding, a malformed
      file (named, with the tensor).
  """
  plan = _plan(directory, dtype)
  config, expected = plan.config, param_shapes(plan.config)
  np_dtype = np.dtype(_DTYPES[dtype])
  tree: dict = {}
  head = None
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=sum(len(header) for _, header in plan.headers.values()), desc="convert", unit="tensor")
  try:
    for name, path, value in iter_tensors(list(plan.headers), plan.headers):
      if bar is not None:
        bar.update(1)
      if name == plan.tied_head:  # checked against the embedding below
        head = (name, np.array(value, dtype=np_dtype))
      elif name in plan.targets:
        param_path = plan.targets[name]
        # np.array copies out of the memory map.
        insert_param(tree, param_path, np.array(value, dtype=np_dtype), expected[param_path],
                     f"{path}: tensor {name}")
  finally:
    if bar is not None:
      bar.close()
  if head is not None and not np.array_equal(head[1], tree["embed"]["embedding"]):
    raise ValueError(f"{plan.directory}: tie_word_embeddings is true but {head[0]} differs from the embedding")
  return config, {"params": tree}


def _hf_name(param_path: tuple[str, ...], family: str) -> str:
  """An HF tensor name that maps to ``param_path`` (for error messages)."""
  fixed = {("embed", "embedding"): "model.embed_tokens.weight", ("final_norm", "scale"): "model.norm.weight",
           ("lm_head", "weight"): "lm_head.weight"}
  if param_path in fixed:
    return fixed[param_path]
  i = int(param_path[0].removeprefix("layers_"))
  inner, leaf = param_path[1:-1], param_path[-1]
  for module, target in _NORMS[family].items():
    if target == inner:
      return f"model.layers.{i}.{module}.weight"
  for module, target in _LINEAR.items():
    if target == inner:
      return f"model.layers.{i}.{module}.{leaf}"
  return "/".join(param_path)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def _token_string(value: Any) -> str | None:
  """A special token as tokenizer_config.json / special_tokens_map.json spell it: a string, an AddedToken dict
  (``{"content": ...}``) or null."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def _first_id(value: Any) -> int | None:
  if isinstance(value, list):
    value = value[0] if value else None
  return None if value is None else int(value)


def _chat_template(directory: pathlib.Path, tokenizer_config: dict) -> str | None:
  """``chat_template.jinja`` (transformers >= 4.50), else tokenizer_config.json's ``chat_template`` (a string, or
  named templates: "default" or the first), else ``chat_template.json``."""
  jinja = directory / "chat_template.jinja"
  if jinja.is_file():
    return jinja.read_text(encoding="utf-8")
  for source in (tokenizer_config, _read_optional_json(directory / "chat_template.json")):
    template = source.get("chat_template")
    if isinstance(template, list):
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str) and template:
      return template
  return None


def tokenizer_from_hf(directory: os.PathLike | str) -> TokenizerWrapper:
  """The ``tokenizers`` tokenizer of ``tokenizer.json`` with bos / eos / pad, add_bos / add_eos and the chat
  template of the directory.

  Special tokens come from the first file that names them: ``tokenizer_config.json`` then
  ``special_tokens_map.json`` (token strings), then ``generation_config.json`` then ``config.json`` (``*_token_id``;
  a list of eos ids gives its first). ``add_bos`` / ``add_eos`` are tokenizer_config.json's ``add_bos_token`` /
  ``add_eos_token`` when given, else whether tokenizer.json's post-processor adds them.
  Raises FileNotFoundError without tokenizer.json, ValueError for a special token that is not in the vocabulary.
  """
  directory = pathlib.Path(directory)
  path = directory / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"{directory} has no tokenizer.json")
  tok = Tokenizer.from_file(str(path))
  tokenizer_config = _read_optional_json(directory / "tokenizer_config.json")
  special_map = _read_optional_json(directory / "special_tokens_map.json")
  config = _read_optional_json(directory / "config.json")
  id_sources = [_read_optional_json(directory / "generation_config.json"), config]
  if isinstance(config.get("text_config"), dict):
    id_sources.append(config["text_config"])

  def special_id(kind: str) -> int | None:
    for source in (tokenizer_config, special_map):
      token = _token_string(source.get(f"{kind}_token"))
      if token is not None:
        token_id = tok.token_to_id(token)
        if token_id is None:
          raise ValueError(f"{directory}: {kind}_token {token!r} is not in tokenizer.json's vocabulary")
        return token_id
    for source in id_sources:
      token_id = _first_id(source.get(f"{kind}_token_id"))
      if token_id is not None:
        return token_id
    return None

  bos_id, eos_id, pad_id = special_id("bos"), special_id("eos"), special_id("pad")
  plain, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
  adds = len(full) > len(plain)
  add_bos, add_eos = tokenizer_config.get("add_bos_token"), tokenizer_config.get("add_eos_token")
  return TokenizerWrapper(
      tokenizer=tok, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
      add_bos=bool(add_bos) if add_bos is not None else adds and bos_id is not None and full[0] == bos_id,
      add_eos=bool(add_eos) if add_eos is not None else adds and eos_id is not None and full[-1] == eos_id,
      chat_template=_chat_template(directory, tokenizer_config))
