"""The CPU linear kernel on quantized weights (blockspec_jax.kernels with a blockspec_jax.models.quant.QuantizedTensor):
bit-identical to the float32 kernel on the dequantized weights for every GGUF type and every code path (scalar, AVX2,
AVX-512, widened wide passes, thread splits), stacked layers read in place, use inside jit and scan, the XLA path,
"auto"'s choice, gradients, errors, and real SmolLM2 tensors (Q4_1, Q8_0)."""

import dataclasses
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import kernels
from blockspec_jax.models import gguf_convert, quant, registry

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not kernels.kernel_available(),
                                reason="not a CPU backend, or the CPU kernel could not be built here")

#: Byte offsets of the float16 fields (d, m, dmin) inside one block of each type.
F16_FIELDS = quant.F16_FIELDS


def _random_qt(type_name: str, shape: tuple[int, ...], seed: int) -> quant.QuantizedTensor:
  """A QuantizedTensor of ``shape`` (numpy order) from random raw blocks: random bytes, every float16 field a random
  finite float16 (any sign, subnormals, +0 and -0 included), through ``quant.quantize_from_gguf``."""
  rng = np.random.default_rng(seed)
  layout = quant.LAYOUTS[type_name]
  num_blocks = int(np.prod(shape)) // layout.block
  blocks = rng.integers(0, 256, (num_blocks, layout.type_size), dtype=np.uint8)
  for at in F16_FIELDS[type_name]:
    bits = rng.integers(0, 1 << 16, num_blocks, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # no inf / NaN: those become subnormals
    bits[:min(2, num_blocks)] = (0x0000, 0x8000)[:min(2, num_blocks)]
    blocks[:, at:at + 2] = bits.astype("<u2").view(np.uint8).reshape(num_blocks, 2)
  return quant.quantize_from_gguf(blocks, type_name, shape)


def _x(m: int, k: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


def _bits_equal(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype == np.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


_kernel = jax.jit(lambda x, w: kernels.linear(x, w, impl="kernel"))
_kernel_layer = jax.jit(lambda x, w, layer: kernels.linear(x, w, impl="kernel", layer=layer))


# M = 1 (a step), 5 (a verify pass), 6 (the AVX-512 row block), 8 and 17 (wider: widened blocks); odd N (pairs and
# single rows of the AVX-512 path); K a multiple of 32 only (legacy types) and of 256.
SHAPES = [(1, 7, 256), (5, 33, 512), (6, 5, 96), (8, 130, 768), (17, 66, 256)]


@pytest.mark.parametrize("type_name", quant.SUPPORTED_TYPES)
def test_kernel_is_bit_identical_to_the_float32_kernel_on_the_dequantized_weights(type_name):
  for i, (m, n, k) in enumerate(SHAPES):
    if k % quant.LAYOUTS[type_name].block:
      k = 256
    qt = _random_qt(type_name, (n, k), seed=i)
    w_NxK = quant.dequantize_np(qt)
    assert np.isfinite(w_NxK).all()
    x_MxK = _x(m, k, seed=100 + i)
    y_MxN = _kernel(x_MxK, qt)
    _bits_equal(y_MxN, _kernel(x_MxK, w_NxK))
    # Each row as when computed alone (a verify pass gives the single steps' numbers).
    _bits_equal(_kernel(x_MxK[m - 1:], qt)[0], np.asarray(y_MxN)[m - 1])
    # And the product itself: float32 sums of exact weights, close to float64.
    exact = x_MxK.astype(np.float64) @ w_NxK.astype(np.float64).T
    scale = np.abs(x_MxK).astype(np.float64) @ np.abs(w_NxK).astype(np.float64).T
    assert (np.abs(np.asarray(y_MxN) - exact) <= 1e-5 * scale + 1e-30).all()


def test_every_code_path_and_thread_split_gives_the_same_bits(tmp_path):
  """The portable loop (BLOCKSPEC_JAX_KERNEL_GENERIC), the AVX2 loop (BLOCKSPEC_JAX_KERNEL_NO_AVX512), the default
  (AVX-512 where the CPU has it) and one thread give the same bits for every type, at M = 1, 5 and 9 (widened);
  subprocesses, because the paths are chosen once per process."""
  arrays = {}
  for t, type_name in enumerate(quant.SUPPORTED_TYPES):
    qt = _random_qt(type_name, (1031, 512), seed=50 + t)  # 2 thread chunks; the last ends in a pair and a single
    arrays.update({f"{type_name}.{name}": np.asarray(a) for name, a in
                   (("codes", qt.codes_OxC), ("scale", qt.scale_OxG), ("offset", qt.offset_OxG)) if a is not None})
  arrays["x"] = _x(9, 512, seed=7)
  np.savez(tmp_path / "in.npz", **arrays)
  script = (
      "import sys, numpy as np, jax\nfrom blockspec_jax import kernels\nfrom blockspec_jax.models import quant\n"
      "a = np.load(sys.argv[1])\nout = {}\n"
      "f = jax.jit(lambda x, q: kernels.linear(x, q, impl='kernel'))\n"
      "for t in quant.SUPPORTED_TYPES:\n"
      "  qt = quant.QuantizedTensor(a[t + '.codes'], a[t + '.scale'], t, (1031, 512), a.get(t + '.offset'))\n"
      "  for m in (1, 5, 9):\n"
      "    out[f'{t}.{m}'] = np.asarray(f(a['x'][:m], qt))\n"
      "np.savez(sys.argv[2], **out)\n")
  outs = {}
  for name, env in (("default", {}), ("generic", {"BLOCKSPEC_JAX_KERNEL_GENERIC": "1"}),
                    ("avx2", {"BLOCKSPEC_JAX_KERNEL_NO_AVX512": "1"}),
                    ("one_thread", {"BLOCKSPEC_JAX_KERNEL_THREADS": "1"})):
    out = tmp_path / f"{name}.npz"
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.npz"), str(out)], check=True, timeout=180,
                   env=dict(os.environ, JAX_PLATFORMS="cpu", **env))
    outs[name] = dict(np.load(out))
  for t, type_name in enumerate(quant.SUPPORTED_TYPES):
    qt = quant.QuantizedTensor(arrays[f"{type_name}.codes"], arrays[f"{type_name}.scale"], type_name, (1031, 512),
                               arrays.get(f"{type_name}.offset"))
    w_NxK = quant.dequantize_np(qt)
    for m in (1, 5, 9):
      key = f"{type_name}.{m}"
      want = np.asarray(_kernel(arrays["x"][:m], w_NxK))
      for name, out in outs.items():
        assert np.array_equal(out[key].view(np.uint32), want.view(np.uint32)), (name, key)


def _stack(type_name, layers, n, k, seed):
  parts = [_random_qt(type_name, (n, k), seed=seed + i) for i in range(layers)]
  stacked = jax.tree.map(lambda *a: np.stack(a), *parts)
  return parts, stacked


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
def test_stacked_layers_are_read_in_place_inside_jit_and_scan(type_name):
  parts, stacked = _stack(type_name, 3, 37, 256, seed=10)
  assert stacked.codes_OxC.shape[0] == 3 and stacked.shape == (37, 256)
  x_MxK = _x(5, 256, seed=11)
  for layer, part in enumerate(parts):
    want = _kernel(x_MxK, part)
    _bits_equal(_kernel_layer(x_MxK, stacked, np.int32(layer)), want)
    np.testing.assert_allclose(np.asarray(kernels.linear(x_MxK, stacked, impl="xla", layer=layer)),
                               np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))

  # A loop over layers inside jit (what a scanned decoder does): K = N so the layers chain.
  parts, stacked = _stack(type_name, 3, 256, 256, seed=20)

  @jax.jit
  def run(x, q):
    def body(h, layer):
      h = kernels.linear(h, q, layer=layer)  # "auto": the kernel (5 tokens per row, on CPU)
      return h / jnp.max(jnp.abs(h)), None
    return jax.lax.scan(body, x, jnp.arange(3, dtype=jnp.int32))[0]

  assert "blockspec_jax_linear_quant" in run.lower(x_MxK[None], stacked).as_text()
  h = x_MxK
  for part in parts:
    h = _kernel(h, part)
    h = h / jnp.max(jnp.abs(h))
  _bits_equal(run(x_MxK[None], stacked)[0], h)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"])
def test_xla_path_agrees_and_auto_picks_by_tokens_per_row(type_name):
  qt = _random_qt(type_name, (48, 512), seed=30)
  x_BxTxK = _x(2 * 3, 512, seed=31).reshape(2, 3, 512)
  kernel = np.asarray(jax.jit(lambda x, q: kernels.linear(x, q, impl="kernel"))(x_BxTxK, qt))
  assert kernel.shape == (2, 3, 48)
  bound = 1e-5 * float(np.abs(kernel).max())
  for fn in (lambda x, q: kernels.linear(x, q, impl="xla"), lambda x, q: quant.quantized_matmul(x, q)):
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(x_BxTxK, qt)), kernel, rtol=1e-5, atol=bound)
  auto = jax.jit(lambda x, q: kernels.linear(x, q))
  _bits_equal(auto(x_BxTxK, qt), kernel)
  y = jax.jit(lambda x, q: kernels.linear(x, q, dtype=jnp.bfloat16))(x_BxTxK, qt)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.asarray(kernel).astype(jnp.bfloat16)))
  # "auto" picks by tokens per row: a batch of many 1-token rows is the kernel, a pass of KERNEL_MAX_TOKENS_QUANT + 1
  # tokens (a long prefill) is XLA's float32 GEMM on the dequantized weights.
  hlo = lambda x: auto.lower(x, qt).as_text()
  t = kernels.KERNEL_MAX_TOKENS_QUANT
  assert "blockspec_jax_linear_quant" in hlo(np.zeros((4 * t, 1, 512), np.float32))
  assert "blockspec_jax_linear_quant" in hlo(np.zeros((2, t, 512), np.float32))
  long = _x(t + 1, 512, seed=32)[None]
  assert "blockspec_jax_linear_quant" not in hlo(long)
  wide = np.asarray(auto(long, qt))
  np.testing.assert_allclose(wide, np.asarray(_kernel(long[0], qt))[None], rtol=1e-5,
                             atol=1e-5 * float(np.abs(wide).max()))


def test_gradients_through_the_kernel():
  """d/dx through the kernel path equals the XLA path's; the scales and offsets get their cotangents too (frozen
  weights ignore them), the integer codes none."""
  qt = _random_qt("Q4_K", (24, 256), seed=40)
  rng = np.random.default_rng(44)  # weights of order 0.1 (random file scales reach 1e6): a well-conditioned loss
  small = lambda a: (rng.uniform(-0.02, 0.02, a.shape)).astype(a.dtype)
  qt = dataclasses.replace(qt, scale_OxG=small(qt.scale_OxG), offset_OxG=small(qt.offset_OxG))
  x_MxK = jnp.asarray(_x(3, 256, seed=41))
  loss = lambda impl: lambda x, q: jnp.sum(jnp.sin(kernels.linear(x, q, impl=impl)))
  gk = jax.jit(jax.grad(loss("kernel")))(x_MxK, qt)
  gx = jax.jit(jax.grad(loss("xla")))(x_MxK, qt)
  np.testing.assert_allclose(np.asarray(gk), np.asarray(gx), rtol=1e-5, atol=1e-6)
  scale_grad = lambda impl: jax.grad(lambda s: loss(impl)(x_MxK, dataclasses.replace(qt, scale_OxG=s)))
  want = np.asarray(scale_grad("xla")(jnp.asarray(qt.scale_OxG)))
  # Each entry sums 3 x 32 products of a code, x and cos(y): two float32 summation orders differ by a few ulps of
  # the largest terms (~1e-5 here, where the largest entry is ~130), so the bound scales with the gradient (an entry
  # near 0 has no relative accuracy).
  np.testing.assert_allclose(np.asarray(scale_grad("kernel")(jnp.asarray(qt.scale_OxG))), want, rtol=1e-4,
                             atol=1e-6 * float(np.abs(want).max()))
  # Stacked, with the layer traced: the gradient w.r.t. x of one layer.
  parts, stacked = _stack("Q8_0", 2, 16, 64, seed=42)
  x_MxK = jnp.asarray(_x(2, 64, seed=43))
  c_MxN = jnp.asarray(_x(2, 16, seed=44))  # a linear loss: the file-sized random scales make sin() ill-conditioned
  g_layer = jax.jit(jax.grad(lambda x, l: jnp.sum(c_MxN * kernels.linear(x, stacked, impl="kernel", layer=l))))
  g_part = np.asarray(jax.grad(lambda x: jnp.sum(c_MxN * kernels.linear(x, parts[1], impl="xla")))(x_MxK))
  np.testing.assert_allclose(np.asarray(g_layer(x_MxK, 1)), g_part, rtol=1e-5, atol=1e-5 * np.abs(g_part).max())


def test_errors_and_fallbacks(monkeypatch):
  qt = _random_qt("Q4_K", (8, 256), seed=60)
  x_MxK = _x(2, 256, seed=61)
  with pytest.raises(ValueError, match="do not contract"):
    kernels.linear(x_MxK[:, :128], qt)
  with pytest.raises(ValueError, match="do not contract"):
    kernels.linear(x_MxK, qt, layer=0)  # not stacked
  _, stacked = _stack("Q4_K", 2, 8, 256, seed=62)
  with pytest.raises(ValueError, match="do not contract"):
    kernels.linear(x_MxK, stacked)  # stacked without a layer
  with pytest.raises(ValueError, match="do not contract"):
    kernels.linear(x_MxK, quant.quantize_from_gguf(np.zeros(2 * 4 * 144, np.uint8), "Q4_K", (2, 4, 256)))
  with pytest.raises(ValueError, match="scale_OxG of dtype float32"):
    kernels.linear(x_MxK, dataclasses.replace(qt, scale_OxG=np.zeros(qt.scale_OxG.shape, np.float16)), impl="kernel")
  with pytest.raises(ValueError, match="impl must be one of"):
    kernels.linear(x_MxK, qt, impl="blas")
  # A type the kernel does not stream: "kernel" says so, "auto" takes the XLA path.
  monkeypatch.setattr(kernels, "QUANT_KERNEL_TYPES", ("Q8_0",))
  with pytest.raises(kernels.KernelUnavailable, match="does not stream Q4_K"):
    kernels.linear(x_MxK, qt, impl="kernel")
  auto = lambda x, q: kernels.linear(x, q)
  assert "blockspec_jax_linear_quant" not in jax.jit(auto).lower(x_MxK, qt).as_text()
  fallback = np.asarray(auto(x_MxK, qt))
  monkeypatch.undo()
  want = np.asarray(_kernel(x_MxK, qt))
  np.testing.assert_allclose(fallback, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
  # Off CPU: "auto" never builds or calls the kernel, "kernel" raises.
  monkeypatch.setattr(kernels, "_platform", lambda x: "gpu")
  assert "blockspec_jax_linear_quant" not in jax.jit(auto).lower(x_MxK, qt).as_text()
  with pytest.raises(kernels.KernelUnavailable, match="CPU only"):
    kernels.linear(x_MxK, qt, impl="kernel")


def test_real_smollm2_tensors_q4_1_and_q8_0():
  """SmolLM2's Q4_1 layer weights and its Q8_0 embedding / output head: the kernel on the codes equals the float32
  kernel on ``gguf.quants.dequantize``'s weights, bit for bit, for a step and a verify pass."""
  contents = gguf_convert.read_gguf(registry.fetch_gguf("smollm2-135m", progress=False))
  seen = set()
  for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight", "token_embd.weight"):
    tensor = contents.tensors[name]
    qt = quant.quantize_from_gguf(tensor)
    seen.add(qt.qtype)
    w_NxK = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(qt.shape)
    x_MxK = _x(5, qt.shape[1], seed=70)
    for m in (1, 5):
      _bits_equal(_kernel(x_MxK[:m], qt), _kernel(x_MxK[:m], w_NxK))
  assert seen == {"Q4_1", "Q8_0"}
