"""Lossless quantized weights: a GGUF tensor kept as its codes and per-block scales, dequantized where it is used.

    qt = quantize_from_gguf(reader_tensor)             # or quantize_from_gguf(raw_bytes, "Q4_K", (out, in))
    w_OxI = dequantize_np(qt)                          # float32 numpy, == gguf.quants.dequantize bit for bit
    w_OxI = jax.jit(dequantize)(qt)                    # float32 jax.Array, the same bits
    y_BxO = quantized_matmul(x_BxI, qt)                # x @ dequantize(qt).T, float32 accumulation

A :class:`QuantizedTensor` holds one GGUF tensor of a block-quantized type without loss, re-laid out so that a SIMD
kernel streams the codes separately from the scales: ``codes_OxC`` (the codes, one or two per byte), ``scale_OxG``
and, for types with a minimum, ``offset_OxG`` (one per group of ``group`` weights), and the static type name and
logical shape (numpy order: a linear weight is ``(O, I)`` = (out, in), ``y = x @ W.T``). Blocks and groups run along
the last (input) axis; ``O`` stands for all leading axes (a 1-D tensor has none, a stacked one has more). Every weight
is ``scale * float32(code - zero_point) [+ offset]`` of its group::

    type  file B/w  codes_OxC                         scale_OxG (G = I / group)        offset_OxG         B/w here
    Q4_0  0.5625    uint8 (O, I/2) nibbles, zp 8      float16 d, group 32              -                  0.5625
    Q4_1  0.6250    uint8 (O, I/2) nibbles            float16 d, group 32              float16 m          0.6250
    Q5_0  0.6875    int8  (O, I)  in [-16, 15]        float16 d, group 32              -                  1.0625
    Q5_1  0.7500    uint8 (O, I)  in [0, 31]          float16 d, group 32              float16 m          1.1250
    Q8_0  1.0625    int8  (O, I)                      float16 d, group 32              -                  1.0625
    Q4_K  0.5625    uint8 (O, I/2) nibbles            float32 d*sc, group 32           float32 -(dmin*m)  0.7500
    Q5_K  0.6875    uint8 (O, I)  in [0, 31]          float32 d*sc, group 32           float32 -(dmin*m)  1.2500
    Q6_K  0.8203    int8  (O, I)  in [-32, 31]        float32 d*sc, group 16           -                  1.2500

(B/w: bytes per weight; :func:`layout_table` prints this from :data:`LAYOUTS`.) Nibbles: the 4-bit codes of every
group of 32 weights fill 16 bytes, byte ``j`` holding weight ``j`` in its low nibble and weight ``16 + j`` in its high
nibble (ggml's own order for Q4_0 / Q4_1; Q4_K's 64-weight chunks are repacked into this order), so one mask and one
shift give two runs of 16 consecutive weights. Codes of 5 to 8 bits take one byte each, stored signed where the type is
symmetric (Q5_0, Q6_K, Q8_0: ggml's code minus its zero point) and unsigned where a minimum is added (Q5_1, Q5_K). F32,
F16 and BF16 tensors are not quantized: they stay float arrays (``gguf.quants.dequantize``), as in the converter.

Why it is lossless, bit for bit. The codes are the file's integers, moved, never rounded. The scales are either the
file's float16 fields, stored as float16 (converting them to float32 is exact), or, for the K types, the float32
product ``d * sc`` (``dmin * m``) of the file's float16 super-block scale and 6-bit (Q6_K: int8) sub-block scale,
precomputed with the very numpy operation ``gguf.quants`` uses: ``float32(d) * float32(sc)``. That product is exact
anyway (11 + 8 significant bits fit float32's 24), as is every ``scale * code`` product (at most 11 + 7 + 5 = 23
significant bits, Q6_K), and nothing underflows (every product and sum is a multiple of 2^-24, so flushing
subnormals to zero, as GPUs do, changes nothing): each weight takes at most one rounding, the addition of the offset,
exactly as in ``gguf.quants``. The K types' minimum is stored negated and added: ``a - b`` and ``a + (-b)`` are the
same IEEE operation, signed zeros included. Because the products are exact, a compiler that contracts
``scale * code + offset`` into one fused multiply-add (XLA may) gets the same bits too; multiplication being
commutative, ``code * d`` (gguf's order for Q8_0) is ``d * code``. NaN or infinite scales (no real file has them)
give NaN / inf weights, but a NaN's payload bits are not promised.

Stacking: the arrays may carry extra leading axes (layers stacked for ``scan``/``vmap``) beyond the logical
``shape``, which describes one tensor; :func:`dequantize` keeps such axes, and under ``jax.vmap`` / ``lax.scan``
each slice is one tensor again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

__all__ = ["QuantLayout", "QuantizedTensor", "LAYOUTS", "SUPPORTED_TYPES", "FLOAT_TYPES", "layout_of",
           "quantize_from_gguf", "tensor_from_gguf", "dequantize_np", "dequantize", "quantized_matmul", "nbytes",
           "bytes_per_weight", "layout_table", "row_slice", "check_tensor", "F16_FIELDS"]

_T = gguf.GGMLQuantizationType
_QK_K = 256
_PACK = 32  # weights per nibble-packed run (16 bytes)
_CHUNK_WEIGHTS = 1 << 23  # host work goes this many weights at a time (peak memory: a few times this, in bytes)


@dataclasses.dataclass(frozen=True)
class QuantLayout:
  """How one GGUF type is stored in a :class:`QuantizedTensor`.

  ``block`` / ``type_size``: weights and bytes of one block in the file (``gguf.GGML_QUANT_SIZES``). ``group``:
  weights per scale. ``bits``: code width; ``packed``: two 4-bit codes per byte. ``zero_point`` is subtracted from a
  stored code before it is scaled. ``scale_dtype`` is that of ``scale_OxG`` and ``offset_OxG`` (``has_offset``).
  """
  name: str
  block: int
  type_size: int
  group: int
  bits: int
  packed: bool
  code_dtype: Any
  zero_point: int
  scale_dtype: Any
  has_offset: bool

  @property
  def fields(self) -> tuple[str, ...]:
    """The :class:`QuantizedTensor` array fields this layout fills (``offset_OxG`` only with ``has_offset``)."""
    return ("codes_OxC", "scale_OxG") + (("offset_OxG",) if self.has_offset else ())

  @property
  def file_bytes_per_weight(self) -> float:
    return self.type_size / self.block

  @property
  def bytes_per_weight(self) -> float:
    """Bytes per weight of this layout (codes, scales and offsets), for a row a whole number of blocks long."""
    codes = 0.5 if self.packed else 1.0
    scales = np.dtype(self.scale_dtype).itemsize * (2 if self.has_offset else 1) / self.group
    return codes + scales


def _layout(name, group, bits, code_dtype, zero_point, scale_dtype, has_offset) -> QuantLayout:
  block, type_size = gguf.GGML_QUANT_SIZES[_T[name]]
  return QuantLayout(name, block, type_size, group, bits, bits == 4, np.dtype(code_dtype), zero_point,
                     np.dtype(scale_dtype), has_offset)


LAYOUTS: dict[str, QuantLayout] = {
    "Q4_0": _layout("Q4_0", 32, 4, np.uint8, 8, np.float16, False),
    "Q4_1": _layout("Q4_1", 32, 4, np.uint8, 0, np.float16, True),
    "Q5_0": _layout("Q5_0", 32, 5, np.int8, 0, np.float16, False),
    "Q5_1": _layout("Q5_1", 32, 5, np.uint8, 0, np.float16, True),
    "Q8_0": _layout("Q8_0", 32, 8, np.int8, 0, np.float16, False),
    "Q4_K": _layout("Q4_K", 32, 4, np.uint8, 0, np.float32, True),
    "Q5_K": _layout("Q5_K", 32, 5, np.uint8, 0, np.float32, True),
    "Q6_K": _layout("Q6_K", 16, 6, np.int8, 0, np.float32, False),
}
SUPPORTED_TYPES = tuple(LAYOUTS)
#: Byte offsets of the float16 fields in one GGUF block of each type (``d``, and ``m`` / ``dmin`` where the type has
#: one), for building or inspecting raw blocks.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}
FLOAT_TYPES = ("F32", "F16", "BF16")  # not quantized: they stay float arrays


def _type_name(qtype) -> str:
  """The GGML type name of ``qtype`` (a GGMLQuantizationType, its int id or its name), checked to be known."""
  if isinstance(qtype, str):
    if qtype.upper() not in _T.__members__:
      raise ValueError(f"unknown GGML tensor type {qtype!r}; quantized types supported here: "
                       f"{', '.join(SUPPORTED_TYPES)}")
    return qtype.upper()
  try:
    return _T(int(qtype)).name
  except (ValueError, TypeError):
    raise ValueError(f"unknown GGML tensor type {qtype!r}; quantized types supported here: "
                     f"{', '.join(SUPPORTED_TYPES)}") from None


def layout_of(qtype) -> QuantLayout:
  """The :class:`QuantLayout` of ``qtype`` (type, id or name); NotImplementedError naming it and the supported types
  for any other quantized type, ValueError for a float type (F32 / F16 / BF16 stay float arrays)."""
  name = _type_name(qtype)
  if name in FLOAT_TYPES:
    raise ValueError(f"GGUF tensor type {name} is not quantized: it stays a float array (gguf.quants.dequantize or "
                     f"tensor_from_gguf); quantized types supported here: {', '.join(SUPPORTED_TYPES)}")
  if name not in LAYOUTS:
    raise NotImplementedError(f"GGUF tensor type {name} is not supported by blockspec_jax.models.quant; supported: "
                              f"{', '.join(SUPPORTED_TYPES)} (and {', '.join(FLOAT_TYPES)}, which stay float)")
  return LAYOUTS[name]


def bytes_per_weight(qtype) -> tuple[float, float]:
  """``(in the file, in a QuantizedTensor)`` bytes per weight of ``qtype``, rows a whole number of blocks long."""
  layout = layout_of(qtype)
  return layout.file_bytes_per_weight, layout.bytes_per_weight


def layout_table() -> str:
  """One line per supported type: the file's and this layout's bytes per weight, and the arrays' dtypes."""
  lines = [f"{'type':5} {'file B/w':>8} {'here B/w':>8}  codes                 scale/offset"]
  for lay in LAYOUTS.values():
    codes = f"{np.dtype(lay.code_dtype).name} {'I/2 nibbles' if lay.packed else 'I'}"
    scales = f"{np.dtype(lay.scale_dtype).name} per {lay.group}" + (" + offset" if lay.has_offset else "")
    lines.append(f"{lay.name:5} {lay.file_bytes_per_weight:8.4f} {lay.bytes_per_weight:8.4f}  {codes:21} {scales}")
  return "\n".join(lines)


@struct.dataclass
class QuantizedTensor:
  """One GGUF tensor of a block-quantized type, without loss (layouts: module docstring).

  ``codes_OxC``   ``(..., C)`` ``code_dtype``: C = I / 2 (4-bit, two codes per byte) or I
  ``scale_OxG``   ``(..., I / group)`` float16 (the file's ``d``) or float32 (K types: ``d * sc``)
  ``qtype``       static: the GGML type name ("Q4_K")
  ``shape``       static: the logical shape in numpy order, ``(..., I)``; the arrays may add leading (stacked) axes
  ``offset_OxG``  like ``scale_OxG``: added after scaling (Q4_1 / Q5_1: the file's ``m``; K types: ``-(dmin * m)``);
                  None for symmetric types
  """
  codes_OxC: Any
  scale_OxG: Any
  qtype: str = struct.field(pytree_node=False)
  shape: tuple[int, ...] = struct.field(pytree_node=False)
  offset_OxG: Optional[Any] = None

  @property
  def layout(self) -> QuantLayout:
    return layout_of(self.qtype)

  @property
  def size(self) -> int:
    """Weights in one tensor of the logical shape (stacked axes not counted)."""
    return math.prod(self.shape)

  # Methods for callers below ``models`` in the import layers (``blockspec_jax.kernels`` takes a QuantizedTensor by
  # duck typing and may not import this module).
  def dequantize(self) -> jax.Array:
    """:func:`dequantize` of this tensor: float32 ``(..., I)``, bit for bit ``gguf.quants.dequantize``."""
    return dequantize(self)

  def matmul(self, x_BxI: jax.Array) -> jax.Array:
    """:func:`quantized_matmul` of ``x_BxI`` with this 2-D tensor: float32 ``(..., O)``."""
    return quantized_matmul(x_BxI, self)


def nbytes(qt: QuantizedTensor) -> int:
  """Bytes of the arrays of ``qt`` (codes, scales, offsets; stacked axes included)."""
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(qt))


# --- GGUF blocks → codes and scales (numpy, exact integer moves and gguf.quants' float32 products) -----------------

def _f16(blocks_NxT: np.ndarray, at: int) -> np.ndarray:
  """The float16 field at byte ``at`` of every block: ``(N, 1)``."""
  return np.ascontiguousarray(blocks_NxT[:, at:at + 2]).view(np.float16)


def _pack_nibbles(codes_NxK: np.ndarray) -> np.ndarray:
  """``(N, K)`` 4-bit codes → ``(N, K / 2)`` bytes: per run of 32, byte j = code j | code (16 + j) << 4."""
  runs = codes_NxK.reshape(codes_NxK.shape[0], -1, 2, _PACK // 2)
  return (runs[:, :, 0] | (runs[:, :, 1] << np.uint8(4))).reshape(codes_NxK.shape[0], -1)


def _unpack_nibbles(xp, packed_OxC):
  """Inverse of the packing: ``(..., I / 2)`` uint8 → ``(..., I)`` uint8 codes (``xp``: numpy or jax.numpy)."""
  runs = packed_OxC.reshape(*packed_OxC.shape[:-1], -1, _PACK // 2)
  both = xp.concatenate([runs & np.uint8(0x0F), runs >> np.uint8(4)], axis=-1)
  return both.reshape(*packed_OxC.shape[:-1], -1)


def _high_bits(qh_Nx4: np.ndarray) -> np.ndarray:
  """Q5_0 / Q5_1: the fifth bit of the 32 codes of a block, from its little-endian uint32 ``qh``: ``(N, 32)``."""
  qh = np.ascontiguousarray(qh_Nx4).view("<u4")
  return ((qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & np.uint32(1)).astype(np.uint8)


def _low_nibbles_32(qs_Nx16: np.ndarray) -> np.ndarray:
  """Q4_0 .. Q5_1: the low 4 bits of a block's 32 codes, ggml order (low nibbles, then high): ``(N, 32)``."""
  return np.concatenate([qs_Nx16 & np.uint8(0x0F), qs_Nx16 >> np.uint8(4)], axis=-1)


def _k_scale_min(scales_Nx12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K / Q5_K: the 8 six-bit sub-block scales and minimums packed in 12 bytes (``gguf.quants.Q4_K``)."""
  s = np.ascontiguousarray(scales_Nx12).reshape(-1, 3, 4)
  d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
  sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
  mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc, mn


def _k_scales(blocks_NxT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K / Q5_K: ``(d * sc, -(dmin * m))`` float32 ``(N, 8)``, the products computed as ``gguf.quants`` does."""
  d = _f16(blocks_NxT, 0).astype(np.float32)
  dmin = _f16(blocks_NxT, 2).astype(np.float32)
  sc, mn = _k_scale_min(blocks_NxT[:, 4:16])
  return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _k_low_nibbles(qs_Nx128: np.ndarray) -> np.ndarray:
  """Q4_K / Q5_K: low 4 bits of the 256 codes: chunk c of 32 bytes holds sub-block 2c (low) and 2c + 1 (high)."""
  q = qs_Nx128.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
  return (q & np.uint8(0x0F)).reshape(-1, _QK_K)


def _q4_0(b):
  return np.ascontiguousarray(b[:, 2:18]), _f16(b, 0), None


def _q4_1(b):
  return np.ascontiguousarray(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
  q = _low_nibbles_32(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << np.uint8(4))
  return q.astype(np.int8) - np.int8(16), _f16(b, 0), None


def _q5_1(b):
  return _low_nibbles_32(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << np.uint8(4)), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
  return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b, 0), None


def _q4_k(b):
  scale, offset = _k_scales(b)
  return _pack_nibbles(_k_low_nibbles(b[:, 16:144])), scale, offset


def _q5_k(b):
  scale, offset = _k_scales(b)
  qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
  qh = (qh & np.uint8(1)).reshape(-1, _QK_K)
  return _k_low_nibbles(b[:, 48:176]) | (qh << np.uint8(4)), scale, offset


def _q6_k(b):
  ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
  ql = (ql & np.uint8(0x0F)).reshape(-1, 8, 32)
  qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
  qh = (qh & np.uint8(0x03)).reshape(-1, 8, 32)
  q = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(-1, _QK_K)
  sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
  return q, _f16(b, 208).astype(np.float32) * sc, None


_PARSERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
            "Q5_K": _q5_k, "Q6_K": _q6_k}


def _raw_bytes(data) -> np.ndarray:
  if isinstance(data, (bytes, bytearray, memoryview)):
    return np.frombuffer(data, dtype=np.uint8)
  if isinstance(data, np.ndarray):
    if data.dtype != np.uint8:
      raise ValueError(f"raw GGUF block data must be uint8 bytes, got a {data.dtype} array")
    return data.reshape(-1)
  raise TypeError(f"quantize_from_gguf takes a gguf ReaderTensor, bytes or a uint8 numpy array, got "
                  f"{type(data).__name__}")


def _check_shape(shape, layout: QuantLayout) -> tuple[int, ...]:
  try:
    shape = tuple(int(n) for n in shape)
  except TypeError:
    raise ValueError(f"shape must be a sequence of ints (numpy order), got {shape!r}") from None
  if not shape or any(n <= 0 for n in shape):
    raise ValueError(f"a {layout.name} tensor needs a shape of at least one positive dimension, got {shape}")
  if shape[-1] % layout.block:
    raise ValueError(f"a {layout.name} tensor's rows must be a whole number of {layout.block}-weight blocks: the "
                     f"last axis (numpy order) of shape {shape} is {shape[-1]}")
  return shape


def quantize_from_gguf(data, qtype=None, shape: Optional[Sequence[int]] = None) -> QuantizedTensor:
  """A :class:`QuantizedTensor` holding a GGUF tensor's raw blocks, without loss (numpy leaves).

  Args:
    data: a ``gguf`` ReaderTensor (its type and shape are used; ``qtype`` / ``shape`` may be omitted or must agree),
      or the tensor's raw block bytes (bytes or a uint8 numpy array, exactly ``rows * I / block * type_size``).
    qtype: a GGMLQuantizationType, its int id or its name ("Q4_K").
    shape: the logical shape in numpy order, ``(..., I)`` (a ReaderTensor's ``shape`` is ggml's order, reversed).
  Raises:
    NotImplementedError: a quantized type not in :data:`SUPPORTED_TYPES` (the message names both).
    ValueError: a float type (F32 / F16 / BF16: not quantized), a bad shape (rows not whole blocks), or data that is
      truncated or too long for the shape.
  """
  if hasattr(data, "tensor_type") and hasattr(data, "data"):  # a gguf ReaderTensor
    file_type, file_shape = _T(data.tensor_type).name, tuple(int(n) for n in reversed(data.shape))
    name = getattr(data, "name", "?")
    if qtype is not None and _type_name(qtype) != file_type:
      raise ValueError(f"tensor {name} is {file_type} in the file, not {_type_name(qtype)}")
    if shape is not None and tuple(int(n) for n in shape) != file_shape:
      raise ValueError(f"tensor {name} has shape {file_shape} (numpy order) in the file, not {tuple(shape)}")
    qtype, shape, data = file_type, file_shape, np.asarray(data.data).view(np.uint8)
  elif qtype is None or shape is None:
    raise ValueError("quantize_from_gguf needs qtype and shape with raw bytes (only a ReaderTensor carries them)")
  layout = layout_of(qtype)
  shape = _check_shape(shape, layout)
  raw = _raw_bytes(data)
  rows, in_features = math.prod(shape[:-1]), shape[-1]
  blocks_per_row = in_features // layout.block
  needed = rows * blocks_per_row * layout.type_size
  if raw.size != needed:
    what = "truncated" if raw.size < needed else "too long"
    raise ValueError(f"{layout.name} data for shape {shape} is {what}: {raw.size} bytes, expected {needed} "
                     f"({rows} rows x {blocks_per_row} blocks x {layout.type_size} bytes)")
  blocks_NxT = raw.reshape(-1, layout.type_size)
  codes_per_block = layout.block // 2 if layout.packed else layout.block
  groups_per_block = layout.block // layout.group
  codes = np.empty((blocks_NxT.shape[0], codes_per_block), layout.code_dtype)
  scale = np.empty((blocks_NxT.shape[0], groups_per_block), layout.scale_dtype)
  offset = np.empty_like(scale) if layout.has_offset else None
  step = max(1, _CHUNK_WEIGHTS // layout.block)
  for start in range(0, blocks_NxT.shape[0], step):  # a chunk at a time: the parsers' temporaries stay small
    stop = min(start + step, blocks_NxT.shape[0])
    c, s, o = _PARSERS[layout.name](blocks_NxT[start:stop])
    codes[start:stop], scale[start:stop] = c.reshape(stop - start, -1), s.reshape(stop - start, -1)
    if offset is not None:
      offset[start:stop] = o.reshape(stop - start, -1)
  lead = shape[:-1]
  return QuantizedTensor(
      codes_OxC=codes.reshape(*lead, -1), scale_OxG=scale.reshape(*lead, -1), qtype=layout.name, shape=shape,
      offset_OxG=None if offset is None else offset.reshape(*lead, -1))


def tensor_from_gguf(tensor) -> QuantizedTensor | np.ndarray:
  """A ReaderTensor as used without loss: a :class:`QuantizedTensor` for a supported quantized type, a float32
  numpy array in numpy order for F32 / F16 / BF16 (``gguf.quants.dequantize``, as the converter does)."""
  name = _T(tensor.tensor_type).name
  if name in FLOAT_TYPES:
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)
  return quantize_from_gguf(tensor)


# --- dequantization --------------------------------------------------------------------------------------------------

def check_tensor(qt: QuantizedTensor, stacked_axes: int = 0) -> None:
  """ValueError unless ``qt``'s arrays have the shapes and dtypes its type and logical shape call for, with exactly
  ``stacked_axes`` leading (stacked) axes: for data read back from a file."""
  _check(qt)
  if np.ndim(qt.codes_OxC) != len(qt.shape) + stacked_axes:
    raise ValueError(f"{qt.qtype} QuantizedTensor of shape {qt.shape}: codes_OxC has shape "
                     f"{tuple(np.shape(qt.codes_OxC))}, expected {stacked_axes} stacked axes")


def _check(qt: QuantizedTensor) -> QuantLayout:
  """The layout of ``qt``, its arrays' trailing shapes and dtypes checked against it (stacked axes allowed)."""
  layout = layout_of(qt.qtype)
  shape = _check_shape(qt.shape, layout)
  lead, in_features = shape[:-1], shape[-1]
  want = {"codes_OxC": ((*lead, in_features // 2 if layout.packed else in_features), layout.code_dtype),
          "scale_OxG": ((*lead, in_features // layout.group), layout.scale_dtype)}
  if layout.has_offset:
    want["offset_OxG"] = want["scale_OxG"]
  elif qt.offset_OxG is not None:
    raise ValueError(f"a {layout.name} QuantizedTensor has no offset, got offset_OxG of shape "
                     f"{tuple(qt.offset_OxG.shape)}")
  for field, (tail, dtype) in want.items():
    array = getattr(qt, field)
    if array is None:
      raise ValueError(f"a {layout.name} QuantizedTensor needs {field}")
    got = tuple(array.shape)
    if got[len(got) - len(tail):] != tail or len(got) < len(tail) or np.dtype(array.dtype) != np.dtype(dtype):
      raise ValueError(f"{layout.name} QuantizedTensor of shape {shape}: {field} must be {np.dtype(dtype).name} "
                       f"(..., {', '.join(map(str, tail))}), got {np.dtype(array.dtype).name} {got}")
  return layout


def _dequantize(xp, qt: QuantizedTensor, layout: QuantLayout):
  """``scale * float32(code - zero_point) [+ offset]`` per group, with ``xp`` (numpy or jax.numpy)."""
  codes = _unpack_nibbles(xp, qt.codes_OxC) if layout.packed else qt.codes_OxC
  if layout.zero_point:
    codes = codes.astype(np.int32) - np.int32(layout.zero_point)
  lead, num_groups = qt.scale_OxG.shape[:-1], qt.scale_OxG.shape[-1]
  q_OxGxg = codes.astype(np.float32).reshape(*lead, num_groups, layout.group)
  w_OxGxg = qt.scale_OxG.astype(np.float32)[..., None] * q_OxGxg
  if layout.has_offset:
    w_OxGxg = w_OxGxg + qt.offset_OxG.astype(np.float32)[..., None]
  return w_OxGxg.reshape(*lead, num_groups * layout.group)


def dequantize_np(qt: QuantizedTensor) -> np.ndarray:
  """float32 numpy ``(..., I)``: the weights of ``qt``, equal to ``gguf.quants.dequantize`` bit for bit (the same
  float32 operations on the same values; module docstring). Works a chunk of rows at a time."""
  layout = _check(qt)
  arrays = {k: np.asarray(v) for k, v in
            (("codes_OxC", qt.codes_OxC), ("scale_OxG", qt.scale_OxG), ("offset_OxG", qt.offset_OxG))
            if v is not None}
  lead, in_features = arrays["codes_OxC"].shape[:-1], qt.shape[-1]
  flat = {k: v.reshape(-1, v.shape[-1]) for k, v in arrays.items()}
  rows = flat["codes_OxC"].shape[0]
  out_RxI = np.empty((rows, in_features), np.float32)
  step = max(1, _CHUNK_WEIGHTS // in_features)
  for start in range(0, rows, step):
    part = dataclasses.replace(qt, **{k: v[start:start + step] for k, v in flat.items()})
    out_RxI[start:start + step] = _dequantize(np, part, layout)
  return out_RxI.reshape(*lead, in_features)


def dequantize(qt: QuantizedTensor) -> jax.Array:
  """float32 ``(..., I)`` jax.Array: the weights of ``qt`` in jax.numpy (jit-able, vmappable; the XLA path fuses it
  into its consumer), equal to ``gguf.quants.dequantize`` bit for bit (module docstring)."""
  layout = _check(qt)
  arrays = jax.tree.map(jnp.asarray, qt)
  return _dequantize(jnp, arrays, layout)


def quantized_matmul(x_BxI: jax.Array, qt: QuantizedTensor) -> jax.Array:
  """``x_BxI @ dequantize(qt).T``: float32 ``(..., O)`` for ``x`` of shape ``(..., I)`` and a 2-D ``qt`` of shape
  ``(O, I)``, accumulated in float32 (``x`` of any float dtype is computed in float32). Jit-able and vmappable
  (over ``x`` and over a stack of ``qt``). The dequantization is written next to the dot, so XLA fuses it into the
  dot's operand where it can; the products are those of ``x @ dequantize(qt).T``.
  """
  if len(qt.shape) != 2:
    raise ValueError(f"quantized_matmul needs a 2-D (out, in) QuantizedTensor, got shape {qt.shape}")
  if x_BxI.ndim < 1 or x_BxI.shape[-1] != qt.shape[-1]:
    raise ValueError(f"quantized_matmul: x must be (..., {qt.shape[-1]}) for a QuantizedTensor of shape {qt.shape}, "
                     f"got {tuple(x_BxI.shape)}")
  w_OxI = dequantize(qt)
  if w_OxI.ndim != 2:
    raise ValueError(f"quantized_matmul: the QuantizedTensor carries stacked axes (weights {w_OxI.shape}); vmap over "
                     "them")
  return jax.lax.dot_general(x_BxI.astype(jnp.float32), w_OxI, (((x_BxI.ndim - 1,), (1,)), ((), ())),
                             precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def row_slice(qt: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
  """Rows ``start:stop`` of the first logical axis of a ``qt`` of at least 2 dimensions (not stacked), e.g. to
  dequantize a large tensor a piece at a time: ``dequantize(row_slice(qt, a, b)) == dequantize(qt)[a:b]``."""
  if len(qt.shape) < 2:
    raise ValueError(f"row_slice needs a QuantizedTensor of at least 2 dimensions, got shape {qt.shape}")
  if np.ndim(qt.codes_OxC) != len(qt.shape):
    raise ValueError(f"row_slice: the arrays of this QuantizedTensor carry stacked axes (codes "
                     f"{tuple(np.shape(qt.codes_OxC))}, logical shape {qt.shape})")
  rows = range(qt.shape[0])[start:stop]
  sliced = jax.tree.map(lambda a: a[rows.start:rows.stop], qt)
  return dataclasses.replace(sliced, shape=(len(rows), *qt.shape[1:]))
