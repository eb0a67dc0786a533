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
pairs adjacent dims ("interleaved"); qwen2 and gemma3 files keep HF's layout ("half"). Every tensor of the file must
be used and every parameter filled, or conversion fails with a ValueError naming the tensors.

gemma3: llama.cpp's converter stores every RMSNorm weight as HF's ``1 + w`` (transformers' GGUF loader subtracts 1
again), so the converted config uses the plain ``x * scale`` norm (``norm_plus_one=False``). The rest comes from
HF's Gemma3 text model: q/k norms, post-norms, GeGLU, embeddings * sqrt(D), score scale
``query_pre_attn_scalar ** -0.5`` with query_pre_attn_scalar = head_dim (256 for every released text model), and
every 6th layer (i % 6 == 5) global with ``rope.freq_base``; the others are local (``attention.sliding_window``
slots, rotary base 10000). GGUF files do not record the pattern or the local base; llama.cpp hardcodes the same.

Hostile or broken files: before ``gguf.GGUFReader`` sees a file, ``read_gguf`` walks its header, metadata and tensor
infos with every length checked against the file size (strings, arrays, counts, at most 4 dimensions, known value
and tensor type ids, rows a whole number of quantisation blocks, tensor offsets aligned, every tensor's bytes inside
the file and no two overlapping); what the reader still raises is wrapped. Every such problem is one ``GGUFError``
(a ValueError) naming the file. Sizes in the metadata are checked against the tensors before anything is sized by
them: every layer 0 .. ``block_count`` - 1 must have ``blk.N`` tensors (and tensors of layers past the count have no
place), and every tensor's shape must be the one the metadata implies (vocab × d_model for the embedding...), before
any tensor is dequantised.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import re
import struct
from typing import Any, Collection

import gguf
import jax.numpy as jnp
import numpy as np

from blockspec_jax.checks import UsageError
from blockspec_jax.models.decoder import DecoderConfig
from blockspec_jax.models import quant

__all__ = ["GGUFContents", "GGUFError", "SUPPORTED_ARCHS", "read_gguf", "config_from_gguf", "convert",
           "converted_nbytes", "param_shapes", "insert_param", "check_layer_indices", "layers_past",
           "describe_sizes"]

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


class GGUFError(UsageError):
  """A GGUF file that is truncated, damaged or inconsistent; the message names the file and the problem."""


_V = gguf.GGUFValueType
_SCALAR_SIZES = {_V.UINT8: 1, _V.INT8: 1, _V.UINT16: 2, _V.INT16: 2, _V.UINT32: 4, _V.INT32: 4, _V.FLOAT32: 4,
                 _V.BOOL: 1, _V.UINT64: 8, _V.INT64: 8, _V.FLOAT64: 8}
_MIN_VALUE_SIZES = {**_SCALAR_SIZES, _V.STRING: 8, _V.ARRAY: 12}  # a string's length; an array's type and length
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_NESTING = 4  # arrays of arrays of ... (released files have none); deeper ones are refused, not recursed


class _Layout:
  """One pass over a GGUF file's header, metadata and tensor infos (memory-mapped, nothing decoded but names), every
  length checked against the file size before it is used; ``check()`` raises GGUFError naming the first problem."""

  def __init__(self, path: str, buf, size: int):
    self.path, self.buf, self.size, self.pos, self.order = path, buf, size, 0, "<"

  def fail(self, problem: str) -> GGUFError:
    return GGUFError(f"{self.path}: {problem}")

  def truncated(self, what: str) -> GGUFError:
    return self.fail(f"the file is truncated or damaged: it ends at byte {self.size}, inside {what}")

  def take(self, n: int, what: str) -> int:
    """Step over ``n`` bytes of ``what``; returns where they start."""
    if n > self.size - self.pos:
      raise self.truncated(what)
    start, self.pos = self.pos, self.pos + n
    return start

  def uint(self, width: int, what: str) -> int:
    return struct.unpack_from(self.order + ("I" if width == 4 else "Q"), self.buf, self.take(width, what))[0]

  def text(self, what: str) -> str:
    start = self.take(self.uint(8, what), what)
    try:
      return bytes(self.buf[start:self.pos]).decode("utf-8")
    except UnicodeDecodeError:
      raise self.fail(f"{what} has a name that is not UTF-8 (the file is damaged)") from None

  def room_for(self, count: int, min_size: int, what: str, items: str) -> None:
    """``count`` ``items`` of at least ``min_size`` bytes each must fit in the rest of the file."""
    if count * min_size > self.size - self.pos:
      raise self.fail(f"the file is truncated or damaged: {what} lists {count} {items}, more than the "
                      f"{self.size - self.pos} bytes left in the file can hold")

  def value(self, vtype: int, what: str, depth: int = 0) -> None:
    if vtype in _SCALAR_SIZES:
      self.take(_SCALAR_SIZES[vtype], what)
    elif vtype == _V.STRING:
      self.take(self.uint(8, what), what)
    elif vtype != _V.ARRAY:
      raise self.fail(f"{what} has value type id {vtype}, which is not a GGUF value type (the file is damaged)")
    elif depth == _MAX_ARRAY_NESTING:
      raise self.fail(f"{what} nests arrays more than {_MAX_ARRAY_NESTING} deep")
    else:
      itype, count = self.uint(4, what), self.uint(8, what)
      if itype not in _MIN_VALUE_SIZES:
        raise self.fail(f"{what} is an array of value type id {itype}, which is not a GGUF value type (the file "
                        "is damaged)")
      if itype in _SCALAR_SIZES:
        self.take(count * _SCALAR_SIZES[itype], what)
        return
      self.room_for(count, _MIN_VALUE_SIZES[itype], what, "strings" if itype == _V.STRING else "arrays")
      if itype == _V.ARRAY:  # each element: its own element type and length, then its items
        for _ in range(count):
          self.value(_V.ARRAY, what, depth + 1)
        return
      unpack = struct.Struct(self.order + "Q").unpack_from
      buf, size, pos = self.buf, self.size, self.pos
      for _ in range(count):  # strings (150k tokens and merges in a real file): the loop is kept tight
        if pos + 8 > size:
          raise self.truncated(what)
        pos += 8 + unpack(buf, pos)[0]
      if pos > size:
        raise self.truncated(what)
      self.pos = pos

  def check(self) -> None:
    if self.size < 4 or bytes(self.buf[:4]) != b"GGUF":
      raise self.fail("not a GGUF file (it does not start with b'GGUF')")
    self.pos = 4
    version = self.uint(4, "the header")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as GGUFReader decides it)
      self.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
      raise self.fail(f"GGUF version {version} is not supported (2 or 3; the file may be damaged)")
    tensor_count, kv_count = self.uint(8, "the header"), self.uint(8, "the header")
    self.room_for(kv_count, 8 + 4 + 1, "the header", "metadata entries")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for i in range(kv_count):
      key = self.text(f"metadata entry #{i}")
      if key in keys:
        raise self.fail(f"metadata key {key!r} appears twice (the file is damaged)")
      keys.add(key)
      what = f"metadata entry {key!r}"
      vtype = self.uint(4, what)
      self.value(vtype, what)
      if key == "general.alignment":
        alignment = struct.unpack_from(self.order + "I", self.buf, self.pos - 4)[0] if vtype == _V.UINT32 else 0
        if vtype != _V.UINT32 or alignment == 0 or alignment & (alignment - 1):
          raise self.fail("general.alignment must be a uint32 power of two (the file is damaged)")
    self.room_for(tensor_count, _MIN_TENSOR_INFO, "the header", "tensors")
    infos = []
    names: set[str] = set()
    for i in range(tensor_count):
      name = self.text(f"tensor info #{i}")
      if name in names:
        raise self.fail(f"tensor {name!r} appears twice (the file is damaged)")
      names.add(name)
      what = f"the tensor info of {name!r}"
      n_dims = self.uint(4, what)
      if not 1 <= n_dims <= _MAX_DIMS:
        raise self.fail(f"tensor {name!r} claims {n_dims} dimensions; a GGUF tensor has 1 to {_MAX_DIMS} (the file "
                        "is damaged)")
      dims = [self.uint(8, what) for _ in range(n_dims)]
      type_id = self.uint(4, what)
      try:
        tensor_type = gguf.GGMLQuantizationType(type_id)
      except ValueError:
        raise self.fail(f"tensor {name!r} has type id {type_id}, which is not a GGML tensor type (the file is "
                        "damaged)") from None
      infos.append((name, dims, tensor_type, self.uint(8, what)))
    data_start = -(-self.pos // alignment) * alignment
    spans = []
    for name, dims, tensor_type, offset in infos:
      block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
      label = f"tensor {name!r} ({tensor_type.name}, shape {tuple(reversed(dims))})"
      if dims[0] % block:
        raise self.fail(f"{label}: rows of {dims[0]} values are not a whole number of {tensor_type.name} blocks of "
                        f"{block} (a damaged type id or shape)")
      if offset % alignment:
        raise self.fail(f"{label} starts at byte {offset} of the data section, not a multiple of its alignment "
                        f"{alignment} (the file is damaged)")
      begin = data_start + offset
      end = begin + math.prod(dims) // block * type_size  # Python ints: no overflow whatever the dimensions
      if end > self.size:
        raise self.fail(f"the file is truncated or damaged: {label} needs bytes {begin} to {end}, but the file ends "
                        f"at byte {self.size}")
      spans.append((begin, end, name))
    spans.sort()
    for (_, end0, name0), (begin1, _, name1) in zip(spans, spans[1:]):
      if begin1 < end0:
        raise self.fail(f"tensors {name0!r} and {name1!r} overlap in the data section (a damaged offset, shape or "
                        "type id)")


def _check_layout(path: str) -> None:
  """GGUFError naming the first problem of the file's layout (see ``_Layout``); reads no tensor data."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    if size == 0:
      raise GGUFError(f"{path}: not a GGUF file (it is empty)")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
      _Layout(path, buf, size).check()


def read_gguf(path: os.PathLike | str) -> GGUFContents:
  """Open ``path`` with ``gguf.GGUFReader``; metadata values are decoded (strings, lists), tensors stay mmapped.

  Raises GGUFError (a ValueError) naming the file for a truncated, damaged or inconsistent file (checked before the
  reader parses it, see the module docstring); OSError (naming it) when it cannot be opened.
  """
  path = os.fspath(path)
  _check_layout(path)
  try:
    reader = gguf.GGUFReader(path, "r")
    metadata = {}
    for key, field in reader.fields.items():
      if key.startswith("GGUF."):
        continue
      metadata[key] = field.contents()
    tensors = {t.name: t for t in reader.tensors}
  except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:  # UnicodeDecodeError is a ValueError
    raise GGUFError(f"{path}: the file is damaged, the GGUF reader failed on it ({type(e).__name__}: {e})") from e
  return GGUFContents(path=path, metadata=metadata, tensors=tensors)


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _meta(metadata: dict[str, Any], key: str, default: Any = None, required: bool = True) -> Any:
  if key in metadata:
    return metadata[key]
  if required and default is None:
    raise ValueError(f"GGUF metadata lacks {key!r}")
  return default


def _meta_int(metadata: dict[str, Any], key: str, default: int | None = None) -> int:
  """A positive integer of the metadata (a size or a count)."""
  value = _meta(metadata, key, default)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"GGUF metadata {key!r} must be a positive integer, got {_short(value)}")
  return value


def _meta_float(metadata: dict[str, Any], key: str, default: float | None = None) -> float:
  """A positive finite number of the metadata (a rotary base, an epsilon)."""
  value = _meta(metadata, key, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
    raise ValueError(f"GGUF metadata {key!r} must be a positive number, got {_short(value)}")
  return float(value)


_BLOCK_RE = re.compile(r"blk\.(\d+)\.", re.ASCII)


def _spans(indices: Collection[int]) -> str:
  """``0-29`` / ``0-3, 5, 9999999``: sorted indices as runs (the first 6)."""
  runs: list[list[int]] = []
  for i in sorted(indices):
    if runs and i == runs[-1][1] + 1:
      runs[-1][1] = i
    else:
      runs.append([i, i])
  text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:6])
  return text + (", ..." if len(runs) > 6 else "") if runs else "none"


def check_layer_indices(indices: Collection[int], num_layers: int, count_name: str, pattern: str) -> None:
  """ValueError unless every layer 0 .. ``num_layers`` - 1 has tensors (``indices``: the layer numbers in the tensor
  names), so that a layer count the tensors do not back is refused before anything is sized by it. ``count_name``
  names the count in the message ("GGUF metadata 'llama.block_count'"), ``pattern`` the layers' tensor names
  ("blk.N"). Tensors of layers past the count are left to the caller (they have no place in the model)."""
  present = sorted(i for i in indices if i < num_layers)
  if len(present) == num_layers:
    return
  missing, expect = [], 0
  for i in present + [num_layers]:
    if i > expect:
      missing.append(f"{expect}" if i == expect + 1 else f"{expect}-{i - 1}")
    expect = i + 1
  listed = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
  lacking = f"layer {listed} has" if len(missing) == 1 and "-" not in listed else f"layers {listed} have"
  raise ValueError(f"{count_name} is {num_layers}, but {lacking} no tensors (the tensors are those of "
                   f"{len(indices)} layers: {pattern} with N in {_spans(indices)})")


def layers_past(names: Collection[str], num_layers: int, pattern: re.Pattern, count_name: str) -> str:
  """A hint for an error listing ``names`` that some of them are tensors of layers past the layer count
  (``pattern`` matches a name, group 1 its layer; ``count_name`` names the count), or ""."""
  extra = {int(m.group(1)) for m in map(pattern.match, names) if m and int(m.group(1)) >= num_layers}
  if not extra:
    return ""
  return f"; {count_name} is {num_layers}, but there are tensors of layers up to {max(extra)} (numbered from 0)"


def describe_sizes(config: DecoderConfig) -> str:
  """The sizes a config gives the parameters, for shape errors."""
  c = config
  return (f"vocab {c.vocab_size}, d_model {c.d_model}, {c.num_heads} heads ({c.num_kv_heads} KV) of dim {c.head_dim}, "
          f"ffn {c.ffn_dim}, {c.num_layers} layers")


def config_from_gguf(metadata: dict[str, Any], arch: str | None = None, *,
                     tensor_names: Collection[str] | None = None, dtype: str = "float32") -> DecoderConfig:
  """DecoderConfig for a llama, qwen2 or gemma3 GGUF.

  Args:
    metadata: ``read_gguf(path).metadata``.
    arch: architecture (default ``metadata["general.architecture"]``).
    tensor_names: the file's tensor names; embeddings are tied iff there is no ``output.weight``, and every layer
      0 .. ``block_count`` - 1 must have ``blk.N`` tensors (checked before anything is sized by the count). Without
      it, llama and gemma3 are assumed tied and qwen2 untied.
    dtype: compute dtype of the config, "float32" or "bfloat16".
  Raises:
    NotImplementedError: an architecture or rope variant the Decoder cannot express.
    ValueError: missing or inconsistent metadata (sizes that are not positive integers, a block_count the tensors
      do not back), unknown dtype.
  """
  arch = arch or _meta(metadata, "general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise NotImplementedError(f"GGUF architecture {_short(arch)} is not supported; supported: {SUPPORTED_ARCHS}")
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
  p = f"{arch}."
  num_layers = _meta_int(metadata, p + "block_count")
  if tensor_names is not None:
    layers = {int(m.group(1)) for m in map(_BLOCK_RE.match, tensor_names) if m}
    check_layer_indices(layers, num_layers, f"GGUF metadata {p + 'block_count'!r}", "blk.N")
  d_model = _meta_int(metadata, p + "embedding_length")
  num_heads = _meta_int(metadata, p + "attention.head_count")
  num_kv_heads = _meta_int(metadata, p + "attention.head_count_kv", num_heads)
  if d_model % num_heads and p + "attention.key_length" not in metadata:
    raise ValueError(f"d_model {d_model} is not a multiple of head_count {num_heads} and no key_length is given")
  head_dim = _meta_int(metadata, p + "attention.key_length", d_model // num_heads)
  value_dim = _meta_int(metadata, p + "attention.value_length", head_dim)
  if value_dim != head_dim:
    raise NotImplementedError(f"key_length {head_dim} != value_length {value_dim} is not supported by Decoder")
  rope_dim = _meta_int(metadata, p + "rope.dimension_count", head_dim)
  if rope_dim != head_dim:
    raise NotImplementedError(f"partial rotary (rope.dimension_count {rope_dim} < head dim {head_dim}) is not "
                              "supported by Decoder")
  scaling = metadata.get(p + "rope.scaling.type", "none")
  if scaling not in ("none", "", None):
    raise NotImplementedError(f"rope scaling {_short(scaling)} is not supported by Decoder")
  tokens = metadata.get("tokenizer.ggml.tokens")
  vocab_size = _meta_int(metadata, p + "vocab_size", len(tokens) if isinstance(tokens, list) and tokens else None)
  if tensor_names is not None:
    tie = "output.weight" not in tensor_names
  else:
    tie = arch in ("llama", "gemma3")
  gemma: dict[str, Any] = {}
  if arch == "gemma3":
    pattern = _meta_int(metadata, p + "attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    gemma = dict(qk_norm=True, post_norms=True, embed_scale=True, mlp_activation="gelu_tanh",
                 query_scale=float(head_dim) ** -0.5,
                 sliding_window=_meta_int(metadata, p + "attention.sliding_window"),
                 layer_types=tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)),
                 rope_theta_local=GEMMA3_ROPE_THETA_LOCAL)
  return DecoderConfig(
      vocab_size=vocab_size,
      d_model=d_model,
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      ffn_dim=_meta_int(metadata, p + "feed_forward_length"),
      rope_theta=_meta_float(metadata, p + "rope.freq_base", 10000.0),
      rms_eps=_meta_float(metadata, p + "attention.layer_norm_rms_epsilon"),
      rope_style="interleaved" if arch == "llama" else "half",
      qkv_bias=arch == "qwen2",
      tie_embeddings=tie,
      dtype=_DTYPES[dtype],
      max_len=_meta_int(metadata, p + "context_length", 8192),
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
  if len(parts) != 4 or parts[0] != "blk" or not (parts[1].isascii() and parts[1].isdigit()):
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


def converted_nbytes(contents: GGUFContents, dtype: str = "float32", quantized: bool = False) -> int:
  """Bytes of the parameters ``convert(contents, dtype, quantized=)`` returns (every tensor's elements × the dtype's
  size, or × its quantized layout's bytes per weight), from the tensor infos alone: what a converted cache needs on
  disk, before converting."""
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
  itemsize = np.dtype(_DTYPES[dtype]).itemsize
  total = 0.0
  for t in contents.tensors.values():
    per_weight = quant.bytes_per_weight(t.tensor_type)[1] if _kept_quantized(t, quantized) else itemsize
    total += math.prod(int(n) for n in t.shape) * per_weight
  return int(math.ceil(total))


def _kept_quantized(tensor, quantized: bool) -> bool:
  """Whether ``convert(..., quantized=quantized)`` keeps ``tensor`` as its blocks (a type ``quant`` holds)."""
  return quantized and gguf.GGMLQuantizationType(tensor.tensor_type).name in quant.SUPPORTED_TYPES


def convert(path: os.PathLike | str | GGUFContents, dtype: str = "float32", progress: bool = False,
            quantized: bool = False) -> tuple[DecoderConfig, dict]:
  """Dequantise a llama/qwen2/gemma3 GGUF into ``(config, {"params": tree})`` with host numpy leaves of ``dtype``.

  ``dtype``: "float32" or "bfloat16" (parameters and the config's compute dtype). One tensor is dequantised at a
  time, so peak memory is about the output plus the largest tensor. ``quantized``: every weight stored in a type
  :mod:`~blockspec_jax.models.quant` holds (``quant.SUPPORTED_TYPES``) stays as its blocks, a host
  :class:`~blockspec_jax.models.quant.QuantizedTensor` that dequantizes to the float32 values of the default path
  bit for bit; float tensors (norms, biases) and any other type are converted as without it. Every tensor's name
  and shape is checked against the config before the first one is dequantised. Raises GGUFError (a ValueError) naming
  the file for a broken or inconsistent file, NotImplementedError for an architecture or tensor type the converter
  cannot handle.
  """
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
  contents = path if isinstance(path, GGUFContents) else read_gguf(path)
  try:
    config = config_from_gguf(contents.metadata, tensor_names=contents.tensors, dtype=dtype)
  except NotImplementedError as e:
    raise NotImplementedError(f"{contents.path}: {e}") from e
  except ValueError as e:
    raise GGUFError(f"{contents.path}: {e}") from e
  np_dtype = np.dtype(_DTYPES[dtype])
  expected = param_shapes(config)
  targets = {name: _target(name) for name in contents.tensors}
  # Unmapped names, and names this config has no parameter for (e.g. q/k norms in a llama file).
  unknown = [n for n, t in targets.items() if t is None or t not in expected]
  if unknown:
    raise GGUFError(f"{contents.path}: tensors with no place in Decoder: {unknown[:10]}"
                    + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
                    + layers_past(unknown, config.num_layers, _BLOCK_RE,
                                  f"GGUF metadata {contents.arch + '.block_count'!r}"))
  filled = set(targets.values())
  missing = [p for p in expected if p not in filled]
  if missing:
    raise GGUFError(f"{contents.path}: missing tensors for {['/'.join(p) for p in missing[:10]]}")
  for name, tensor in contents.tensors.items():
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if shape != expected[targets[name]]:
      raise GGUFError(f"{contents.path}: tensor {name} has shape {shape}, expected {expected[targets[name]]} for "
                      f"{'/'.join(targets[name])} (the metadata's sizes: {describe_sizes(config)})")
  tree: dict = {}
  names = list(contents.tensors)
  if progress:
    from tqdm.auto import tqdm
    names = tqdm(names, desc="convert", unit="tensor")
  for name in names:
    tensor = contents.tensors[name]
    if _kept_quantized(tensor, quantized):
      try:
        value = quant.quantize_from_gguf(tensor)
      except ValueError as e:
        raise GGUFError(f"{contents.path}: tensor {name} ({tensor.tensor_type.name}) cannot be read as blocks "
                        f"({e}); the file is damaged") from e
      insert_param(tree, targets[name], value, expected[targets[name]], f"{contents.path}: tensor {name}")
      continue
    try:
      value = _dequantize(tensor)
    except NotImplementedError as e:
      raise NotImplementedError(f"{contents.path}: tensor {name} ({tensor.tensor_type.name}): {e}") from e
    except (ValueError, TypeError) as e:
      raise GGUFError(f"{contents.path}: tensor {name} ({tensor.tensor_type.name}) cannot be dequantised "
                      f"({type(e).__name__}: {e}); the file is damaged") from e
    insert_param(tree, targets[name], np.ascontiguousarray(value, dtype=np_dtype), expected[targets[name]],
                 f"{contents.path}: tensor {name}")
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

