"""The CPU linear kernel (blockspec_jax.kernels): agreement with XLA's dot, M-invariance, dtypes, gradients, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import kernels
from blockspec_jax.models.decoder import Decoder, DecoderConfig, causal_mask, init_cache

pytestmark = pytest.mark.skipif(not kernels.kernel_available(), reason="CPU kernel could not be built here")


def _operands(m, k, n, seed=0, w_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x_MxK = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w_NxK = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32).astype(w_dtype)
  return x_MxK, w_NxK


_kernel = jax.jit(lambda x, w: kernels.linear(x, w, impl="kernel"))


# Shapes hit every code path: K below / not a multiple of the 8-lane vector, N tails of the 4-row blocks, N too small
# to split over threads, M = 1..16 (all row blockings), M above KERNEL_MAX_ROWS (the kernel still accepts it).
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 7, 3), (2, 8, 5), (3, 9, 4), (4, 37, 19), (5, 576, 203),
                                   (7, 64, 130), (16, 129, 257), (21, 40, 66)])
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_float64_product(m, k, n, w_dtype):
  x_MxK, w_NxK = _operands(m, k, n, seed=m * 1000 + k, w_dtype=w_dtype)
  y_MxN = np.asarray(_kernel(x_MxK, w_NxK))
  exact = np.asarray(x_MxK, np.float64) @ np.asarray(w_NxK.astype(jnp.float32), np.float64).T
  assert y_MxN.dtype == np.float32 and y_MxN.shape == (m, n)
  # float32 accumulation over k terms of size ~1/sqrt(k): error well under 1e-5 relative to the row norm.
  np.testing.assert_allclose(y_MxN, exact, atol=2e-6 * np.sqrt(k) + 1e-6, rtol=1e-5)


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_each_row_is_bit_identical_whatever_m(w_dtype):
  """Row i of a pass over M rows equals the same row computed alone (the verify pass == the single step)."""
  x_MxK, w_NxK = _operands(16, 300, 131, seed=3, w_dtype=w_dtype)
  full_MxN = np.asarray(_kernel(x_MxK, w_NxK))
  for m in (1, 2, 3, 5, 9):
    part = np.asarray(_kernel(x_MxK[:m], w_NxK))
    np.testing.assert_array_equal(part, full_MxN[:m])
  for i in (0, 6, 15):
    np.testing.assert_array_equal(np.asarray(_kernel(x_MxK[i:i + 1], w_NxK))[0], full_MxN[i])


def test_generic_path_is_bit_identical_to_vector_path(tmp_path):
  """The portable loop (BLOCKSPEC_JAX_KERNEL_GENERIC) sums in the same order as the AVX2 loop, and 1 thread equals
  the default thread split; checked in subprocesses because both are read once per process. Each subprocess's first
  kernel call runs inside a jitted program and is wide enough to use the thread pool (a pool created by that call
  once lost its first task and hung: the timeout turns such a hang into a failure)."""
  import subprocess
  import sys
  x_MxK, w_NxK = _operands(5, 203, 517, seed=9)
  np.save(tmp_path / "x.npy", np.asarray(x_MxK))
  np.save(tmp_path / "w.npy", np.asarray(w_NxK))
  script = ("import sys, numpy as np, jax\nfrom blockspec_jax import kernels\n"
            "x, w = np.load(sys.argv[1] + '/x.npy'), np.load(sys.argv[1] + '/w.npy')\n"
            "np.save(sys.argv[2], np.asarray(jax.jit(lambda a, b: kernels.linear(a, b, impl='kernel'))(x, w)))\n")
  outs = {}
  for name, env in (("default", {}), ("generic", {"BLOCKSPEC_JAX_KERNEL_GENERIC": "1"}),
                    ("one_thread", {"BLOCKSPEC_JAX_KERNEL_THREADS": "1"})):
    out = tmp_path / f"{name}.npy"
    import os
    subprocess.run([sys.executable, "-c", script, str(tmp_path), str(out)], check=True, timeout=120,
                   env=dict(os.environ, JAX_PLATFORMS="cpu", **env))
    outs[name] = np.load(out)
  np.testing.assert_array_equal(outs["generic"], outs["default"])
  np.testing.assert_array_equal(outs["one_thread"], outs["default"])
  np.testing.assert_array_equal(outs["default"], np.asarray(_kernel(x_MxK, w_NxK)))


def test_leading_dims_dtype_and_auto_dispatch():
  x_BxTxK, w_NxK = _operands(6, 24, 10, seed=4)
  x_BxTxK = x_BxTxK.reshape(2, 3, 24)
  xla = kernels.linear(x_BxTxK, w_NxK, impl="xla")
  for impl in ("auto", "kernel"):
    y = jax.jit(lambda x, w: kernels.linear(x, w, impl=impl, dtype=jnp.bfloat16))(x_BxTxK, w_NxK)
    assert y.shape == (2, 3, 10) and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(xla), atol=3e-2, rtol=1e-2)
  # "auto" above KERNEL_MAX_ROWS is XLA's dot: exactly the einsum.
  big, w = _operands(kernels.KERNEL_MAX_ROWS + 1, 24, 10, seed=5)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: kernels.linear(x, w))(big, w)),
                                np.asarray(jax.jit(lambda x, w: kernels.linear(x, w, impl="xla"))(big, w)))
  hlo = jax.jit(lambda x, w: kernels.linear(x, w)).lower(big[:4], w).as_text()
  assert "blockspec_jax_linear_f32" in hlo


def test_gradients_match_xla():
  x_MxK, w_NxK = _operands(3, 17, 9, seed=6)
  loss = lambda impl: lambda x, w: jnp.sum(jnp.sin(kernels.linear(x, w, impl=impl)))
  gk = jax.grad(loss("kernel"), argnums=(0, 1))(x_MxK, w_NxK)
  gx = jax.grad(loss("xla"), argnums=(0, 1))(x_MxK, w_NxK)
  for a, b in zip(gk, gx):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_bad_inputs():
  x_MxK, w_NxK = _operands(2, 8, 4)
  with pytest.raises(ValueError, match="do not contract"):
    kernels.linear(x_MxK, w_NxK.T)
  with pytest.raises(ValueError, match="impl must be one of"):
    kernels.linear(x_MxK, w_NxK, impl="blas")
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    kernels.linear(x_MxK, w_NxK.astype(jnp.float16), impl="kernel")
  with pytest.raises(ValueError, match="matmul must be one of"):
    DecoderConfig.tiny(matmul="blas")


def test_decoder_kernel_equals_xla_and_is_m_invariant():
  """The decoder with matmul="kernel" agrees with matmul="xla" to float32 rounding, and a 5-token pass gives each
  position bit-identical logits to feeding the tokens one at a time (what makes AR and speculative runs agree)."""
  cfg_k = DecoderConfig.tiny(matmul="kernel", qkv_bias=True)
  cfg_x = DecoderConfig.tiny(matmul="xla", qkv_bias=True)
  tokens_1x5 = jnp.asarray([[3, 17, 5, 60, 2]], jnp.int32)
  pos_1x5 = jnp.arange(5, dtype=jnp.int32)[None]
  params = Decoder(cfg_k).init(jax.random.PRNGKey(0), tokens_1x5, pos_1x5, init_cache(cfg_k, 1, 8),
                               causal_mask(pos_1x5, 8))
  run = lambda cfg: jax.jit(lambda p, t, pos, c: Decoder(cfg).apply(p, t, pos, c, causal_mask(pos, 8)))
  full_k, _ = run(cfg_k)(params, tokens_1x5, pos_1x5, init_cache(cfg_k, 1, 8))
  full_x, _ = run(cfg_x)(params, tokens_1x5, pos_1x5, init_cache(cfg_x, 1, 8))
  np.testing.assert_allclose(np.asarray(full_k), np.asarray(full_x), atol=1e-5, rtol=0)
  cache = init_cache(cfg_k, 1, 8)
  for t in range(5):
    step, cache = run(cfg_k)(params, tokens_1x5[:, t:t + 1], pos_1x5[:, t:t + 1], cache)
    np.testing.assert_array_equal(np.asarray(step[0, 0]), np.asarray(full_k[0, t]))
