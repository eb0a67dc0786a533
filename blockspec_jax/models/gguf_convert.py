"""GGUF → ``Decoder`` config and parameters (llama, qwen2 and gemma3 architectures).

    contents = read_gguf(path)                     # metadata dict + tensor infos (memory-mapped, nothing decoded)
    config = config_from_gguf(contents.metadata, tensor_names=contents.tensors)
    config, params = convert(path, dtype="float32")  # params = {"params": {...}} with numpy leaves

Conversion goes tensor by tensor: ``gguf.quants.dequantize`` gives float32 numpy in numpy order, which is ggml's
order reversed, so ``token_embd`` / ``output`` are (V, D) and linear weights are (out, in), the Decoder's layout:
nothing is transposed. Mapping (``i`` = layer)::

    token_embd.weight        [V, D]        → embed/embedding
    blk.i.attn_norm.weight   [D]           → layers_i/attn_norm/scale
    blk.i.attn_{q,k,v}.weight [N*H|K*H, D] → layers_i/attn/{q,k,v}/weight;  .bias → .../bias
    blk.i.attn_output.weight [D, N*H]      → layers_i/attn/o/weight
    blk.i.ffn_norm.weight    [D]           → layers_i/mlp_norm/scale
    blk.i.ffn_{gate,up,down}.weight        → layers_i/mlp/{gate,up,down}/weight
    output_norm.weight       [D]           → final_norm/scale
    output.weight            [V, D]        → lm_head/weight; absent → tied embeddings
    gemma3 only:
    blk.i.attn_{q,k}_norm.weight [H]       → layers_i/attn/{q,k}_norm/scale
    blk.i.post_attention_norm.weight [D]   → layers_i/post_attn_norm/scale
    blk.i.post_ffw_norm.weight [D]         → layers_i/post_mlp_norm/scale
    (blk.i.ffn_norm is gemma's pre_feedforward_layernorm → layers_i/mlp_norm/scale, as for llama)

Rotary: llama GGUF files were written by a converter that permuted the q/k rows of every head, so the rotation
pairs adjacent dims ("interleaved"); qwen2 and gemma3 files keep HF's layout ("half"). Every tensor of the file must be used
and every parameter filled, or conversion fails with a ValueError naming the tensors.

gemma3: llama.cpp's converter stores every RMSNorm weight as HF's ``1 + w`` (transformers' GGUF loader subtracts 1
again), so the converted config uses the plain ``x * scale`` norm (``norm_plus_one=False``). The rest comes from
HF's Gemma3 text model: q/k norms, post-norms, GeGLU, embeddings * sqrt(D), score scale
``query_pre_attn_scalar ** -0.5`` with query_pre_attn_scalar = head_dim (256 for every released text model), and
every 6th layer (i % 6 == 5) global with ``rope.freq_base``; the others are local (``attention.sliding_window``
slots, rotary base 10000). GGUF files do not record the pattern or the local base; llama.cpp hardcodes the same.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Collection

import gguf
import jax.numpy as jnp
import numpy as np

from blockspec_jax.models.decoder import DecoderConfig

__all__ = ["GGUFContents", "SUPPORTED_ARCHS", "read_gguf", "config_from_gguf", "convert", "param_shapes",
           "insert_param"]

SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# gemma3 constants that GGUF metadata does not carry (HF Gemma3TextConfig defaults; llama.cpp hardcodes the same).
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # layer i is global iff (i + 1) % 6 == 0
GEMMA3_ROPE_THETA_LOCAL = 10000.0


@dataclasses.dataclass(frozen=True)
class GGUFContents:
  """A parsed GGUF file: ``metadata`` (key → Python value) and ``tensors`` (name → gguf ReaderTensor, mmapped)."""
  path: str
  metadata: dict[str, Any]
  tensors: dict[str, Any]

  @property
  def arch(self) -> str:
    return self.metadata["general.architecture"]


def read_gguf(path: os.PathLike | str) -> GGUFContents:
  """Open ``path`` with ``gguf.GGUFReader``; metadata values are decoded (strings, lists), tensors stay mmapped."""
  reader = gguf.GGUFReader(os.fspath(path), "r")
  metadata = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    metadata[key] = field.contents()
  tensors = {t.name: t for t in reader.tensors}
  return GGUFContents(path=os.fspath(path), metadata=metadata, tensors=tensors)


def _meta(metadata: dict[str, Any], key: str, default: Any = None, required: bool = True) -> Any:
  if key in metadata:
    return metadata[key]
  if required and default is None:
    raise ValueError(f"GGUF metadata lacks {key!r}")
  return default


def config_from_gguf(metadata: dict[str, Any], arch: str | None = None, *,
                     tensor_names: Collection[str] | None = None, dtype: str = "float32") -> DecoderConfig:
  """DecoderConfig for a llama, qwen2 or gemma3 GGUF.

  Args:
    metadata: ``read_gguf(path).metadata``.
    arch: architecture (default ``metadata["general.architecture"]``).
    tensor_names: the file's tensor names; embeddings are tied iff there is no ``output.weight``. Without it,
      llama and gemma3 are assumed tied and qwen2 untied.
    dtype: compute dtype of the config, "float32" or "bfloat16".
  Raises:
    NotImplementedError: an architecture or rope variant the Decoder cannot express.
    ValueError: missing or inconsistent metadata, unknown dtype.
  """
  arch = arch or _meta(metadata, "general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise NotImplementedError(f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHS}")
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
  p = f"{arch}."
  d_model = int(_meta(metadata, p + "embedding_length"))
  num_heads = int(_meta(metadata, p + "attention.head_count"))
  num_kv_heads = int(_meta(metadata, p + "attention.head_count_kv", num_heads))
  if d_model % num_heads and p + "attention.key_length" not in metadata:
    raise ValueError(f"d_model {d_model} is not a multiple of head_count {num_heads} and no key_length is given")
  head_dim = int(_meta(metadata, p + "attention.key_length", d_model // num_heads))
  value_dim = int(_meta(metadata, p + "attention.value_length", head_dim))
  if value_dim != head_dim:
    raise NotImplementedError(f"key_length {head_dim} != value_length {value_dim} is not supported by Decoder")
  rope_dim = int(_meta(metadata, p + "rope.dimension_count", head_dim))
  if rope_dim != head_dim:
    raise NotImplementedError(f"partial rotary (rope.dimension_count {rope_dim} < head dim {head_dim}) is not "
                              "supported by Decoder")
  scaling = metadata.get(p + "rope.scaling.type", "none")
  if scaling not in ("none", "", None):
    raise NotImplementedError(f"rope scaling {scaling!r} is not supported by Decoder")
  if "tokenizer.ggml.tokens" in metadata:
    default_vocab = len(metadata["tokenizer.ggml.tokens"])
  else:
    default_vocab = None
  vocab_size = int(_meta(metadata, p + "vocab_size", default_vocab))
  if tensor_names is not None:
    tie = "output.weight" not in tensor_names
  else:
    tie = arch in ("llama", "gemma3")
  gemma: dict[str, Any] = {}
  if arch == "gemma3":
    num_layers = int(_meta(metadata, p + "block_count"))
    pattern = int(metadata.get(p + "attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN))
    gemma = dict(qk_norm=True, post_norms=True, embed_scale=True, mlp_activation="gelu_tanh",
                 query_scale=float(head_dim) ** -0.5,
                 sliding_window=int(_meta(metadata, p + "attention.sliding_window")),
                 layer_types=tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)),
                 rope_theta_local=GEMMA3_ROPE_THETA_LOCAL)
  return DecoderConfig(
      vocab_size=vocab_size,
      d_model=d_model,
      num_layers=int(_meta(metadata, p + "block_count")),
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      ffn_dim=int(_meta(metadata, p + "feed_forward_length")),
      rope_theta=float(_meta(metadata, p + "rope.freq_base", 10000.0)),
      rms_eps=float(_meta(metadata, p + "attention.layer_norm_rms_epsilon")),
      rope_style="interleaved" if arch == "llama" else "half",
      qkv_bias=arch == "qwen2",
      tie_embeddings=tie,
      dtype=_DTYPES[dtype],
      max_len=int(_meta(metadata, p + "context_length", 8192)),
      **gemma,
  )


def param_shapes(config: DecoderConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Path (under ``params``) → shape of every Decoder parameter, per the tree in decoder.py."""
  c = config
  d, nh, kh, f, v = c.d_model, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.ffn_dim, c.vocab_size
  shapes = {("embed", "embedding"): (v, d), ("final_norm", "scale"): (d,)}
  if not c.tie_embeddings:
    shapes[("lm_head", "weight")] = (v, d)
  for i in range(c.num_layers):
    layer = f"layers_{i}"
    shapes[(layer, "attn_norm", "scale")] = (d,)
    shapes[(layer, "mlp_norm", "scale")] = (d,)
    for name, width in (("q", nh), ("k", kh), ("v", kh)):
      shapes[(layer, "attn", name, "weight")] = (width, d)
      if c.qkv_bias:
        shapes[(layer, "attn", name, "bias")] = (width,)
    shapes[(layer, "attn", "o", "weight")] = (d, nh)
    shapes[(layer, "mlp", "gate", "weight")] = (f, d)
    shapes[(layer, "mlp", "up", "weight")] = (f, d)
    shapes[(layer, "mlp", "down", "weight")] = (d, f)
    if c.qk_norm:
      shapes[(layer, "attn", "q_norm", "scale")] = (c.head_dim,)
      shapes[(layer, "attn", "k_norm", "scale")] = (c.head_dim,)
    if c.post_norms:
      shapes[(layer, "post_attn_norm", "scale")] = (d,)
      shapes[(layer, "post_mlp_norm", "scale")] = (d,)
  return shapes


def _target(name: str) -> tuple[str, ...] | None:
  """GGUF tensor name → Decoder param path, or None if the name is not one we map."""
  fixed = {"token_embd.weight": ("embed", "embedding"),
           "output_norm.weight": ("final_norm", "scale"),
           "output.weight": ("lm_head", "weight")}
  if name in fixed:
    return fixed[name]
  parts = name.split(".")
  if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
    return None
  layer, kind, leaf = f"layers_{int(parts[1])}", parts[2], parts[3]
  linear = {"attn_q": ("attn", "q"), "attn_k": ("attn", "k"), "attn_v": ("attn", "v"), "attn_output": ("attn", "o"),
            "ffn_gate": ("mlp", "gate"), "ffn_up": ("mlp", "up"), "ffn_down": ("mlp", "down")}
  norms = {"attn_norm": ("attn_norm",), "ffn_norm": ("mlp_norm",), "attn_q_norm": ("attn", "q_norm"),
           "attn_k_norm": ("attn", "k_norm"), "post_attention_norm": ("post_attn_norm",),
           "post_ffw_norm": ("post_mlp_norm",)}
  if kind in norms and leaf == "weight":
    return (layer, *norms[kind], "scale")
  if kind in linear and leaf == "weight":
    return (layer, *linear[kind], "weight")
  if kind in ("attn_q", "attn_k", "attn_v") and leaf == "bias":
    return (layer, *linear[kind], "bias")
  return None


def _dequantize(tensor) -> np.ndarray:
  """float32 numpy array of a ReaderTensor, in numpy order (ggml shape reversed)."""
  values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  shape = tuple(int(n) for n in reversed(tensor.shape))
  return np.asarray(values, dtype=np.float32).reshape(shape)


def convert(path: os.PathLike | str | GGUFContents, dtype: str = "float32", progress: bool = False
            ) -> tuple[DecoderConfig, dict]:
  """Dequantise a llama/qwen2/gemma3 GGUF into ``(config, {"params": tree})`` with host numpy leaves of ``dtype``.

  ``dtype``: "float32" or "bfloat16" (parameters and the config's compute dtype). One tensor is dequantised at a
  time, so peak memory is about the output plus the largest tensor.
  """
  contents = path if isinstance(path, GGUFContents) else read_gguf(path)
  config = config_from_gguf(contents.metadata, tensor_names=contents.tensors, dtype=dtype)
  np_dtype = np.dtype(_DTYPES[dtype])
  expected = param_shapes(config)
  # Unmapped names, and names this config has no parameter for (e.g. q/k norms in a llama file).
  unknown = [n for n in contents.tensors if _target(n) is None or _target(n) not in expected]
  if unknown:
    raise ValueError(f"{contents.path}: tensors with no place in Decoder: {unknown[:10]}"
                     + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else ""))
  tree: dict = {}
  names = list(contents.tensors)
  if progress:
    from tqdm.auto import tqdm
    names = tqdm(names, desc="convert", unit="tensor")
  for name in names:
    param_path = _target(name)
    if param_path not in expected:
      raise ValueError(f"{contents.path}: tensor {name} maps to {'/'.join(param_path)}, which the config "
                       "does not have (layer index out of range, biases without qkv_bias, or q/k/post norms "
                       "without qk_norm / post_norms?)")
    insert_param(tree, param_path, np.ascontiguousarray(_dequantize(contents.tensors[name]), dtype=np_dtype),
                 expected[param_path], f"{contents.path}: tensor {name}")
  missing = [p for p in expected if _lookup(tree, p) is None]
  if missing:
    raise ValueError(f"{contents.path}: missing tensors for {['/'.join(p) for p in missing[:10]]}")
  return config, {"params": tree}


def insert_param(tree: dict, param_path: tuple[str, ...], value: np.ndarray, shape: tuple[int, ...], where: str
                 ) -> None:
  """Put ``value`` at ``param_path`` of the nested ``tree``; ValueError (naming ``where``) if its shape is not
  ``shape`` or the place is already filled. Shared by the GGUF and the Hugging Face converters."""
  if value.shape != shape:
    raise ValueError(f"{where} has shape {value.shape}, expected {shape} for {'/'.join(param_path)}")
  node = tree
  for key in param_path[:-1]:
    node = node.setdefault(key, {})
  if param_path[-1] in node:
    raise ValueError(f"{where}: two tensors map to {'/'.join(param_path)}")
  node[param_path[-1]] = value


def _lookup(tree: dict, path: tuple[str, ...]):
  node = tree
  for key in path:
    if not isinstance(node, dict) or key not in node:
      return None
    node = node[key]
  return node
