"""Lossless quantized weights (blockspec_jax.models.quant): every tensor of the real GGUF files and random raw blocks of
every supported type dequantize to ``gguf.quants.dequantize``'s float32 bit for bit (numpy and jitted jax.numpy),
bytes per weight, stacking / vmap, the matmul building block, and the errors.

SmolLM2 (Q4_1, Q8_0, F32) is the slow tier (its weights are checked by default through the loaded model,
tests/test_quantized_weights.py); Qwen 0.5B / 1.5B and Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0) are marked
``heavy``: python -m pytest -q -p no:xdist -m heavy tests/test_quant.py
"""

import collections
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax.models import gguf_convert, quant, registry

_T = gguf.GGMLQuantizationType

#: Bytes per weight of the layout (rows a whole number of blocks): codes + scales (+ offsets).
EXPECTED_BYTES_PER_WEIGHT = {"Q4_0": 0.5625, "Q4_1": 0.625, "Q5_0": 1.0625, "Q5_1": 1.125, "Q8_0": 1.0625,
                             "Q4_K": 0.75, "Q5_K": 1.25, "Q6_K": 1.25}
#: Byte offsets of the float16 fields (d, m, dmin) inside one block of each type.
F16_FIELDS = quant.F16_FIELDS

_jit_dequantize = jax.jit(quant.dequantize)


def _assert_bits_equal(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == np.float32 and want.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape,
                                                                                             want.shape)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _random_blocks(type_name: str, num_blocks: int, seed: int) -> np.ndarray:
  """Random raw blocks of ``type_name``: random bytes, every float16 field a random finite float16 (any sign,
  subnormals and zeros included; no NaN / inf)."""
  rng = np.random.default_rng(seed)
  layout = quant.LAYOUTS[type_name]
  blocks = rng.integers(0, 256, (num_blocks, layout.type_size), dtype=np.uint8)
  for at in F16_FIELDS[type_name]:
    bits = rng.integers(0, 1 << 16, num_blocks, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # exponent all ones (inf / NaN) → subnormal
    if num_blocks >= 3:
      bits[1:3] = (0x0000, 0x8000)  # +0 and -0 scales
    blocks[:, at:at + 2] = bits.astype("<u2").view(np.uint8).reshape(num_blocks, 2)
  return blocks


def _check_both(qt: quant.QuantizedTensor, want: np.ndarray):
  _assert_bits_equal(quant.dequantize_np(qt), want)
  _assert_bits_equal(_jit_dequantize(qt), want)


# --- synthetic blocks of every supported type -----------------------------------------------------------------------

@pytest.mark.parametrize("type_name", quant.SUPPORTED_TYPES)
def test_random_blocks_roundtrip_bit_for_bit(type_name):
  layout = quant.LAYOUTS[type_name]
  shape = (16, 2 * 256)  # a whole number of blocks for every type (32 or 256 weights)
  blocks = _random_blocks(type_name, 16 * 2 * 256 // layout.block, seed=len(type_name) + layout.type_size)
  want = gguf.quants.dequantize(blocks.reshape(shape[0], -1), _T[type_name]).reshape(shape)
  assert np.isfinite(want).all()
  for data in (blocks, blocks.tobytes()):
    qt = quant.quantize_from_gguf(data, type_name, shape)
    assert qt.qtype == type_name and qt.shape == shape and qt.layout is layout
    _check_both(qt, want)
  qt = quant.quantize_from_gguf(blocks, _T[type_name], list(shape))  # the enum and a list do too
  _check_both(qt, want)
  assert quant.nbytes(qt) == qt.size * EXPECTED_BYTES_PER_WEIGHT[type_name] == qt.size * layout.bytes_per_weight
  assert quant.bytes_per_weight(type_name) == (layout.type_size / layout.block, EXPECTED_BYTES_PER_WEIGHT[type_name])
  codes_width = shape[-1] // 2 if layout.packed else shape[-1]
  assert qt.codes_OxC.shape == (16, codes_width) and qt.codes_OxC.dtype == layout.code_dtype
  assert qt.scale_OxG.shape == (16, shape[-1] // layout.group) and qt.scale_OxG.dtype == layout.scale_dtype
  assert (qt.offset_OxG is not None) == layout.has_offset


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("shape", [(256,), (2, 3, 256)])
def test_one_and_three_dimensional_tensors(type_name, shape):
  layout = quant.LAYOUTS[type_name]
  blocks = _random_blocks(type_name, int(np.prod(shape)) // layout.block, seed=7)
  want = gguf.quants.dequantize(blocks.reshape(*shape[:-1], -1), _T[type_name]).reshape(shape)
  qt = quant.quantize_from_gguf(blocks, type_name, shape)
  _check_both(qt, want)
  if len(shape) > 1:
    _assert_bits_equal(quant.dequantize_np(quant.row_slice(qt, 1, 2)), want[1:2])


def test_nibble_layout_and_k_scales_are_as_documented():
  """Q4_K: byte j of a 16-byte run holds weight j (low nibble) and 16 + j (high); the scale is the float32 product
  ``d * sc`` and the offset ``-(dmin * m)``; so weight = scale * code + offset."""
  blocks = _random_blocks("Q4_K", 1, seed=3)
  qt = quant.quantize_from_gguf(blocks, "Q4_K", (256,))
  want = gguf.quants.dequantize(blocks, _T.Q4_K).reshape(256)
  codes = np.concatenate([qt.codes_OxC.reshape(8, 16) & 15, qt.codes_OxC.reshape(8, 16) >> 4], axis=1)
  rebuilt = qt.scale_OxG[:, None] * codes.astype(np.float32) + qt.offset_OxG[:, None]
  _assert_bits_equal(rebuilt.reshape(256), want)
  sc, _ = quant._k_scale_min(blocks[:, 4:16])
  d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
  _assert_bits_equal(qt.scale_OxG, (d * sc.astype(np.float32)).reshape(8))


def test_stacked_tensors_vmap_and_scan():
  type_name, shape = "Q4_K", (3, 512)
  layers = [quant.quantize_from_gguf(_random_blocks(type_name, 6, seed=s), type_name, shape) for s in range(4)]
  stacked = jax.tree.map(lambda *a: np.stack(a), *layers)
  want = np.stack([quant.dequantize_np(layer) for layer in layers])
  _assert_bits_equal(jax.jit(jax.vmap(quant.dequantize))(stacked), want)
  _assert_bits_equal(_jit_dequantize(stacked), want)  # leading axes kept without vmap too
  _assert_bits_equal(quant.dequantize_np(stacked), want)
  _, scanned = jax.lax.scan(lambda c, layer: (c, quant.dequantize(layer)), 0, stacked)
  _assert_bits_equal(scanned, want)
  assert quant.nbytes(stacked) == 4 * quant.nbytes(layers[0])


# --- the matmul building block --------------------------------------------------------------------------------------

@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_quantized_matmul_matches_the_dequantized_dot(type_name):
  shape = (6, 512)
  layout = quant.LAYOUTS[type_name]
  blocks = _random_blocks(type_name, 6 * 512 // layout.block, seed=11)
  rng = np.random.default_rng(1)
  for at in F16_FIELDS[type_name]:  # scales of a real layer's size, so the tolerance means something
    d = rng.uniform(1e-3, 1e-2, blocks.shape[0]).astype("<f2")
    blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
  qt = quant.quantize_from_gguf(blocks, type_name, shape)
  rng = np.random.default_rng(0)
  x_BxI = jnp.asarray(rng.standard_normal((4, 512)), jnp.float32)
  w_OxI = quant.dequantize(qt)
  want_BxO = jnp.dot(x_BxI, w_OxI.T, precision=jax.lax.Precision.HIGHEST)
  scale = float(jnp.abs(want_BxO).max())
  got_BxO = jax.jit(quant.quantized_matmul)(x_BxI, qt)
  assert got_BxO.shape == (4, 6) and got_BxO.dtype == jnp.float32
  np.testing.assert_allclose(got_BxO, want_BxO, rtol=1e-5, atol=1e-6 * scale)
  rows_B = jax.vmap(quant.quantized_matmul, in_axes=(0, None))(x_BxI, qt)  # vmapped over tokens
  np.testing.assert_allclose(rows_B, want_BxO, rtol=1e-5, atol=1e-6 * scale)
  np.testing.assert_allclose(quant.quantized_matmul(x_BxI.astype(jnp.bfloat16), qt),
                             jnp.dot(x_BxI.astype(jnp.bfloat16).astype(jnp.float32), w_OxI.T,
                                     precision=jax.lax.Precision.HIGHEST), rtol=1e-5, atol=1e-6 * scale)
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), qt, qt)  # vmapped over stacked layers
  per_layer = jax.jit(jax.vmap(quant.quantized_matmul, in_axes=(None, 0)))(x_BxI, stacked)
  np.testing.assert_allclose(per_layer, jnp.stack([want_BxO, want_BxO]), rtol=1e-5, atol=1e-6 * scale)


# --- errors ---------------------------------------------------------------------------------------------------------

def test_errors():
  blocks = _random_blocks("Q4_K", 2, seed=0)
  with pytest.raises(NotImplementedError, match="Q2_K is not supported.*Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K"):
    quant.quantize_from_gguf(blocks, "Q2_K", (512,))
  with pytest.raises(NotImplementedError, match="IQ4_XS"):
    quant.layout_of(_T.IQ4_XS)
  with pytest.raises(ValueError, match="F32 is not quantized"):
    quant.quantize_from_gguf(blocks, "F32", (72,))
  with pytest.raises(ValueError, match="unknown GGML tensor type 'Q9_9'"):
    quant.quantize_from_gguf(blocks, "Q9_9", (512,))
  with pytest.raises(ValueError, match="unknown GGML tensor type 12345"):
    quant.layout_of(12345)
  with pytest.raises(ValueError, match="whole number of 256-weight blocks.*is 288"):
    quant.quantize_from_gguf(blocks, "Q4_K", (1, 288))
  with pytest.raises(ValueError, match="at least one positive dimension"):
    quant.quantize_from_gguf(blocks, "Q4_K", (0, 256))
  with pytest.raises(ValueError, match=r"truncated: 287 bytes, expected 288 \(1 rows x 2 blocks x 144 bytes\)"):
    quant.quantize_from_gguf(blocks.reshape(-1)[:-1], "Q4_K", (1, 512))
  with pytest.raises(ValueError, match="too long: 288 bytes, expected 144"):
    quant.quantize_from_gguf(blocks, "Q4_K", (256,))
  with pytest.raises(ValueError, match="must be uint8 bytes"):
    quant.quantize_from_gguf(blocks.view(np.int8), "Q4_K", (512,))
  with pytest.raises(TypeError, match="takes a gguf ReaderTensor"):
    quant.quantize_from_gguf([1, 2, 3], "Q4_K", (512,))
  with pytest.raises(ValueError, match="needs qtype and shape"):
    quant.quantize_from_gguf(blocks)
  qt = quant.quantize_from_gguf(blocks, "Q4_K", (512,))
  with pytest.raises(ValueError, match=r"codes_OxC must be uint8 \(\.\.\., 256\), got int8"):
    quant.dequantize(qt.replace(codes_OxC=qt.codes_OxC.view(np.int8)))
  with pytest.raises(ValueError, match=r"scale_OxG must be float32 \(\.\.\., 16\), got float32 \(15,\)"):
    quant.dequantize_np(qt.replace(scale_OxG=qt.scale_OxG[:15]))
  with pytest.raises(ValueError, match="needs offset_OxG"):
    quant.dequantize(qt.replace(offset_OxG=None))
  with pytest.raises(ValueError, match="2-D"):
    quant.quantized_matmul(jnp.ones((1, 512)), qt)
  with pytest.raises(ValueError, match="at least 2 dimensions"):
    quant.row_slice(qt, 0, 1)
  q8 = quant.quantize_from_gguf(_random_blocks("Q8_0", 4, seed=0), "Q8_0", (2, 64))
  with pytest.raises(ValueError, match="has no offset"):
    quant.dequantize(q8.replace(offset_OxG=q8.scale_OxG))
  with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
    quant.quantized_matmul(jnp.ones((1, 32)), q8)


# --- real files -----------------------------------------------------------------------------------------------------

def _check_file(path, chunk_weights: int = 1 << 25) -> dict[str, list[int]]:
  """Every tensor of the GGUF at ``path``, a chunk of rows at a time: quantized ones bit for bit against
  ``gguf.quants.dequantize`` (numpy and jitted jax.numpy) with the expected bytes; float ones as floats.
  Returns ``{type: [tensors, file bytes, bytes here, weights]}``."""
  contents = gguf_convert.read_gguf(path)
  seen = collections.defaultdict(lambda: [0, 0, 0, 0])
  for name, tensor in contents.tensors.items():
    type_name = _T(tensor.tensor_type).name
    shape = tuple(int(n) for n in reversed(tensor.shape))
    size = int(np.prod(shape))
    counts = seen[type_name]
    counts[0], counts[1], counts[3] = counts[0] + 1, counts[1] + int(tensor.n_bytes), counts[3] + size
    if type_name in quant.FLOAT_TYPES:
      value = quant.tensor_from_gguf(tensor)
      _assert_bits_equal(value, np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shape))
      counts[2] += value.nbytes
      continue
    qt = quant.quantize_from_gguf(tensor)
    layout = qt.layout
    assert qt.shape == shape and quant.nbytes(qt) == size * EXPECTED_BYTES_PER_WEIGHT[type_name], name
    assert int(tensor.n_bytes) == size * layout.file_bytes_per_weight, name
    counts[2] += quant.nbytes(qt)
    data = np.asarray(tensor.data).reshape(-1, int(tensor.n_bytes) // max(1, size // shape[-1]))
    step = max(1, chunk_weights // shape[-1])
    flat = qt if len(shape) == 2 else quant.quantize_from_gguf(np.asarray(tensor.data).view(np.uint8), type_name,
                                                               (size // shape[-1], shape[-1]))
    for start in range(0, data.shape[0], step):
      want = gguf.quants.dequantize(data[start:start + step], tensor.tensor_type)
      part = quant.row_slice(flat, start, start + step)
      try:
        _check_both(part, want)
      except AssertionError as e:
        raise AssertionError(f"{name} ({type_name}, rows {start}:{start + step}): {e}") from None
  return dict(seen)


def _report(name, seen, seconds):
  print(f"\n{name}: {sum(c[0] for c in seen.values())} tensors in {seconds:.1f} s")
  for type_name, (count, file_bytes, here_bytes, weights) in sorted(seen.items()):
    print(f"  {type_name:5} {count:4d} tensors {weights:>11d} weights  file {file_bytes:>11d} B "
          f"({file_bytes / weights:.4f} B/w)  here {here_bytes:>11d} B ({here_bytes / weights:.4f} B/w)")


@pytest.mark.slow  # the default run checks every SmolLM2 weight through hub.load_model(weights="quantized") against
#                    the dequantized model (tests/test_quantized_weights.py) and the jitted path on random blocks here
def test_every_smollm2_tensor_bit_for_bit():
  start = time.perf_counter()
  seen = _check_file(registry.fetch_gguf("smollm2-135m", progress=False))
  _report("smollm2-135m", seen, time.perf_counter() - start)
  assert {t: c[0] for t, c in seen.items()} == {"F32": 61, "Q4_1": 210, "Q8_0": 1}


@pytest.mark.heavy
@pytest.mark.parametrize("model, types", [
    ("qwen2.5-coder-0.5b", {"F32": 121, "Q4_K": 12, "Q5_0": 133, "Q6_K": 12, "Q8_0": 13}),
    ("qwen2.5-coder-1.5b", {"F32": 141, "Q4_K": 169, "Q6_K": 29}),
    ("gemma3-270m", {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}),
])
def test_every_tensor_of_the_larger_models_bit_for_bit(model, types):
  start = time.perf_counter()
  seen = _check_file(registry.fetch_gguf(model, progress=False))
  _report(model, seen, time.perf_counter() - start)
  assert {t: c[0] for t, c in seen.items()} == types
