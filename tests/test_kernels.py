"""The CPU linear kernel (blockspec_jax.kernels): agreement with XLA's dot, M-invariance, dtypes, gradients, errors,
the backend check, the build cache (key, validation, failure marker), fallbacks, and batch-independent decoding."""

import hashlib
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import kernels, sampling
from blockspec_jax.kernels import _build
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter
from blockspec_jax.models.decoder import Decoder, DecoderConfig, causal_mask, init_cache

# The backend is checked first, so a GPU / TPU host skips without building (the off-CPU path is tested below by
# reporting "gpu" from a CPU host).
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not kernels.kernel_available(),
                                reason="not a CPU backend, or the CPU kernel could not be built here")


def _operands(m, k, n, seed=0, w_dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x_MxK = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w_NxK = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32).astype(w_dtype)
  return x_MxK, w_NxK


_kernel = jax.jit(lambda x, w: kernels.linear(x, w, impl="kernel"))


# Shapes hit every code path: K below / not a multiple of the 8-lane vector, N tails of the 4-row blocks, N too small
# to split over threads, M = 1..16 (all row blockings), M above KERNEL_MAX_TOKENS (any M is accepted).
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
  """Row i of a pass over M rows equals the same row computed alone (the verify pass == the single step), for any
  M: K = 1000 makes the kernel tile the 100 rows in several L2 blocks of rows and of weight rows."""
  x_MxK, w_NxK = _operands(100, 1000, 131, seed=3, w_dtype=w_dtype)
  full_MxN = np.asarray(_kernel(x_MxK, w_NxK))
  for m in (1, 2, 3, 5, 16, 17, 40):
    part = np.asarray(_kernel(x_MxK[:m], w_NxK))
    np.testing.assert_array_equal(part, full_MxN[:m])
  for i in (0, 6, 57, 99):
    np.testing.assert_array_equal(np.asarray(_kernel(x_MxK[i:i + 1], w_NxK))[0], full_MxN[i])
  # "auto" on a wide batch of 1-token rows (a decode step of B = 100) is the kernel: each row as when alone.
  auto = jax.jit(lambda x, w: kernels.linear(x, w))
  np.testing.assert_array_equal(np.asarray(auto(x_MxK[:, None], w_NxK))[:, 0], full_MxN)
  np.testing.assert_array_equal(np.asarray(auto(x_MxK[57:58, None], w_NxK))[0, 0], full_MxN[57])


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
  # "auto" picks by tokens per row (x.shape[-2]), not by rows: above KERNEL_MAX_TOKENS it is XLA's dot (exactly the
  # einsum), at or below it the kernel whatever the batch.
  t = kernels.KERNEL_MAX_TOKENS
  long, w = _operands(2 * (t + 1), 24, 10, seed=5)
  long = long.reshape(2, t + 1, 24)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: kernels.linear(x, w))(long, w)),
                                np.asarray(jax.jit(lambda x, w: kernels.linear(x, w, impl="xla"))(long, w)))
  hlo = lambda x: jax.jit(lambda x, w: kernels.linear(x, w)).lower(x, w).as_text()
  assert "blockspec_jax_linear_f32" not in hlo(long)
  wide, _ = _operands(8 * t, 24, 10, seed=5)
  assert "blockspec_jax_linear_f32" in hlo(wide.reshape(8, t, 24))  # 8 * t rows of t tokens: the kernel
  assert "blockspec_jax_linear_f32" in hlo(wide.reshape(8 * t, 1, 24))


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decoder_pass_of_many_rows_equals_steps_and_row_alone(dtype):
  """B x T = 5 x 5 = 25 rows in one pass (more than 16, where "auto" used to switch to XLA's dot): each position's
  logits are bit-identical to feeding the tokens one step at a time (5 rows) and to the row alone, in float32 and
  bfloat16. (Compiled with ``xla_allow_excess_precision=False``: by default XLA may skip rounding a bfloat16
  intermediate, e.g. the residual sum entering an RMSNorm, depending on how it fuses a program of that shape, which
  moves bfloat16 logits by an ulp whatever the linear layers do.)"""
  cfg = DecoderConfig.tiny(dtype=dtype, qkv_bias=True)
  b, t, s = 5, 5, 8
  tokens_BxT = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (b, t)), jnp.int32)
  pos_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  params = Decoder(cfg).init(jax.random.PRNGKey(1), tokens_BxT, pos_BxT, init_cache(cfg, b, s), causal_mask(pos_BxT, s))
  run = jax.jit(lambda p, tok, pos, c: Decoder(cfg).apply(p, tok, pos, c, causal_mask(pos, s)),
                compiler_options={"xla_allow_excess_precision": False})
  full_BxTxV = np.asarray(run(params, tokens_BxT, pos_BxT, init_cache(cfg, b, s))[0])
  cache = init_cache(cfg, b, s)
  for i in range(t):
    logits_Bx1xV, cache = run(params, tokens_BxT[:, i:i + 1], pos_BxT[:, i:i + 1], cache)
    np.testing.assert_array_equal(np.asarray(logits_Bx1xV[:, 0]), full_BxTxV[:, i])
  alone_1xTxV, _ = run(params, tokens_BxT[2:3], pos_BxT[2:3], init_cache(cfg, 1, s))
  np.testing.assert_array_equal(np.asarray(alone_1xTxV[0]), full_BxTxV[2])


def test_wide_passes_keep_the_kernels_precision_under_a_bfloat16_compute_dtype():
  """Float32 weights with a bfloat16 compute dtype: a pass wider than KERNEL_MAX_TOKENS takes XLA's dot, and it
  computes in the kernel's precision (float32 operands and sums), never with the weights rounded to bfloat16 (what it
  did before: every wide pass, prefills and verify passes of γ >= 16, then ran in another precision than the steps).
  Its result is the kernel's, rounded once to bfloat16: equal up to one bfloat16 ulp (the sums' order differs)."""
  t = kernels.KERNEL_MAX_TOKENS + 1
  x_MxK, w_NxK = _operands(2 * t, 576, 96, seed=8)
  x_BxTxK = x_MxK.reshape(2, t, 576).astype(jnp.bfloat16)
  auto = jax.jit(lambda x, w: kernels.linear(x, w, dtype=jnp.bfloat16))
  assert "blockspec_jax_linear_f32" not in auto.lower(x_BxTxK, w_NxK).as_text()  # the wide pass: XLA's dot
  wide = np.asarray(auto(x_BxTxK, w_NxK), np.float32)
  kernel = np.asarray(_kernel(x_BxTxK.reshape(2 * t, 576), w_NxK)).reshape(wide.shape)
  ulp = np.abs(kernel) * 2.0 ** -7 + 1e-30
  assert np.all(np.abs(wide - kernel) <= ulp)
  rounded_weights = np.asarray(kernels.linear(x_BxTxK, w_NxK, impl="xla", dtype=jnp.bfloat16), np.float32)
  assert not np.all(np.abs(rounded_weights - kernel) <= ulp)  # what the old path computed is further off


def test_float32_weights_with_a_bfloat16_compute_dtype_decode_greedy_rows_exactly_at_gamma_20():
  """The defect: float32 parameters and compute dtype bfloat16: verify passes of γ + 1 > 16 tokens took XLA's dot
  with both operands in bfloat16 while decode steps took the kernel, so greedy speculative rows left the
  autoregressive ones (16 of 33 rows at γ = 16 on a real model). Verify passes up to KERNEL_MAX_TOKENS tokens
  per row now run in the kernel: at γ = 20, every row equals autoregressive decoding."""
  cfg = DecoderConfig.tiny(dtype=jnp.bfloat16, num_layers=2)
  pos_1x1 = jnp.zeros((1, 1), jnp.int32)
  params = Decoder(cfg).init(jax.random.key(3), pos_1x1, pos_1x1, init_cache(cfg, 1, 4), causal_mask(pos_1x1, 4))
  target = params["params"]
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(target))
  leaves, tree = jax.tree.flatten(target)
  noise = [jax.random.normal(k, x.shape) for x, k in zip(leaves, jax.random.split(jax.random.key(4), len(leaves)))]
  drafter = jax.tree.unflatten(tree, [x + 0.1 * jnp.std(x) * n for x, n in zip(leaves, noise)])
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(1, cfg.vocab_size, size=rng.choice([2, 5]))) for _ in range(6)]
  tokens_BxP, len_B = spec.prepare_prompts(prompts)
  keys_B = jax.random.split(jax.random.key(0), 6)
  greedy, n_new = sampling.Sampler(temperature=0.0), 44
  ar = spec.generate_autoregressive(target, keys_B, tokens_BxP, len_B, target=cfg, max_new_tokens=n_new,
                                    sampler=greedy)
  out = spec.generate_speculative(target, drafter, keys_B, tokens_BxP, len_B, target=cfg, drafter=ModelDrafter(cfg),
                                  gamma=20, max_new_tokens=n_new, sampler=greedy)
  np.testing.assert_array_equal(np.asarray(out.tokens_BxN), np.asarray(ar.tokens_BxN))
  assert int(out.metrics.num_accepted_tokens.sum()) > 0


# bfloat16 is the dtype where the old batch-dependent switch changed tokens; float32 rows are held bit-identical at
# the forward level by test_decoder_pass_of_many_rows_equals_steps_and_row_alone (both dtypes).
@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_greedy_rows_do_not_depend_on_the_batch_or_the_pass_width(dtype):
  """The defect: with bfloat16 models, passes over more than 16 rows went to XLA's bfloat16 dot while single steps
  stayed on the kernel (float32 sums), so greedy speculative output differed from autoregressive once
  B x (γ+1) > 16, and a row's output depended on its batch neighbours (B = 33 ragged prompts: rows differed). At
  T = 0, in float32 and bfloat16, every row of a B = 33 ragged batch decoded autoregressively, and decoded
  speculatively with γ = 3 (verify passes of 132 rows), equals that row decoded alone."""
  cfg = DecoderConfig.tiny(dtype=dtype, num_layers=1)
  pos_1x1 = jnp.zeros((1, 1), jnp.int32)
  target = Decoder(cfg).init(jax.random.key(0), pos_1x1, pos_1x1, init_cache(cfg, 1, 4),
                             causal_mask(pos_1x1, 4))["params"]
  leaves, tree = jax.tree.flatten(target)
  noise = [jax.random.normal(k, x.shape) for x, k in zip(leaves, jax.random.split(jax.random.key(1), len(leaves)))]
  drafter = jax.tree.unflatten(tree, [x + 0.3 * jnp.std(x) * n for x, n in zip(leaves, noise)])
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, cfg.vocab_size, size=rng.choice([2, 4]))) for _ in range(33)]
  keys_B = jax.random.split(jax.random.key(0), 33)
  greedy, n_new = sampling.Sampler(temperature=0.0), 12

  def ar(rows):
    tokens_BxP, len_B = spec.prepare_prompts([prompts[i] for i in rows])
    out = spec.generate_autoregressive(target, keys_B[np.asarray(rows)], tokens_BxP, len_B, target=cfg,
                                       max_new_tokens=n_new, sampler=greedy)
    return np.asarray(out.tokens_BxN)

  alone_BxN = np.concatenate([ar([i]) for i in range(33)])
  np.testing.assert_array_equal(ar(range(33)), alone_BxN)
  tokens_BxP, len_B = spec.prepare_prompts(prompts)
  out = spec.generate_speculative(target, drafter, keys_B, tokens_BxP, len_B, target=cfg, drafter=ModelDrafter(cfg),
                                  gamma=3, max_new_tokens=n_new, sampler=greedy)
  np.testing.assert_array_equal(np.asarray(out.tokens_BxN), alone_BxN)
  assert 0 < int(out.metrics.num_accepted_tokens.sum()) < int(out.metrics.num_draft_tokens.sum())


# ---------------------------------------------------------------------------------------------------------------
# The backend check, the build cache and the fallbacks.

def test_off_cpu_the_kernel_is_never_built(monkeypatch):
  """With the default backend reported as "gpu", "auto" never builds or calls the kernel and computes exactly what
  impl="xla" computes, in the configured dtype (no float32 detour); impl="kernel" refuses. A CPU default device or
  a committed CPU input still gives "cpu"."""
  monkeypatch.setattr(kernels, "_state", {})  # as in a fresh process: nothing built or loaded yet
  built = []
  monkeypatch.setattr(kernels, "open_library", lambda *a, **k: built.append(a))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  x_MxK, w_NxK = _operands(6, 24, 10, seed=11)
  x_BxTxK = x_MxK.reshape(2, 3, 24)
  for dtype in (jnp.float32, jnp.bfloat16):
    for w in (w_NxK, w_NxK.astype(jnp.bfloat16)):
      auto = jax.jit(lambda x, w: kernels.linear(x, w, dtype=dtype))
      xla = np.asarray(jax.jit(lambda x, w: kernels.linear(x, w, impl="xla", dtype=dtype))(x_BxTxK, w))
      assert "blockspec_jax_linear" not in auto.lower(x_BxTxK, w).as_text()
      np.testing.assert_array_equal(np.asarray(auto(x_BxTxK, w)), xla)
      eager = kernels.linear(x_BxTxK, w, dtype=dtype)  # uncommitted arrays: the default backend decides
      assert eager.dtype == dtype
      np.testing.assert_array_equal(np.asarray(eager), xla)
  with pytest.raises(kernels.KernelUnavailable, match="CPU only"):
    kernels.linear(x_BxTxK, w_NxK, impl="kernel")
  assert built == [] and kernels._state == {}
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    assert kernels._platform(x_BxTxK) == "cpu"
  assert kernels._platform(jax.device_put(x_BxTxK, cpu)) == "cpu"


def test_build_key_covers_source_compiler_flags_jax_and_machine(tmp_path, monkeypatch):
  src = tmp_path / "k.cc"
  src.write_text("int f() { return 1; }\n")
  key = lambda: _build._plan(src, tmp_path).key
  keys = [key()]
  assert key() == keys[0]  # stable
  src.write_text("int f() { return 2; }\n")
  keys.append(key())
  cxx = tmp_path / "cxx"  # a wrapper around the real compiler: another path, then another --version output
  real = shutil.which(os.environ.get("CXX", "g++"))
  cxx.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
  cxx.chmod(0o755)
  monkeypatch.setenv("CXX", str(cxx))
  keys.append(key())
  assert _build._plan(src, tmp_path).cmd[0] == str(cxx.resolve())
  cxx.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo fake 2.0 && exit 0\nexec {real} "$@"\n')
  keys.append(key())
  monkeypatch.setattr(_build, "_FLAGS", _build._FLAGS + ("-march=native",))
  keys.append(key())
  monkeypatch.setattr(jax, "__version__", "0.0.1")
  keys.append(key())
  monkeypatch.setattr(_build, "_machine", lambda: "x86_64")  # the same machine without AVX2 / FMA
  keys.append(key())
  assert len(set(keys)) == len(keys)
  monkeypatch.undo()
  machine = _build._machine().split("+")
  assert machine[0] == platform.machine()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    for feature in ("avx2", "fma"):
      assert (feature in flags) == (feature in machine[1:])


_PROBE_SRC = 'extern "C" int bsj_probe() { return 7; }\n'


@pytest.fixture
def compiles(monkeypatch):
  """Records every build (_build._compile call) by key."""
  calls, real = [], _build._compile
  monkeypatch.setattr(_build, "_compile", lambda plan: (calls.append(plan.key), real(plan))[1])
  return calls


def test_cached_library_is_verified_before_loading_and_rebuilt_once(tmp_path, compiles):
  """Size and SHA-256 are recorded at build time and checked before loading; a truncated library, a library without
  its sidecar, or one that fails to load is deleted and rebuilt once (with a warning); one that fails to load again
  after the rebuild leaves the failure marker."""
  src, out = tmp_path / "probe.cc", tmp_path / "cache"
  src.write_text(_PROBE_SRC)
  opened = lambda load=str: _build.open_library(src, out, load=load)
  lib = pathlib.Path(opened())
  meta = json.loads(lib.with_suffix(".json").read_text())
  assert meta["size"] == lib.stat().st_size and meta["sha256"] == hashlib.sha256(lib.read_bytes()).hexdigest()
  assert opened() == str(lib) and len(compiles) == 1  # verified, loaded from the cache
  os.truncate(lib, 4096)  # what a full disk or a killed copy leaves (loading it would be SIGBUS)
  with pytest.warns(RuntimeWarning, match="does not match the size / SHA-256"):
    assert opened() == str(lib)
  assert len(compiles) == 2 and _build._verified(_build._plan(src, out))
  lib.with_suffix(".json").unlink()  # killed between the two renames: not trusted
  with pytest.warns(RuntimeWarning, match="does not match"):
    opened()
  assert len(compiles) == 3
  outcomes = iter([OSError("invalid ELF header"), None])

  def flaky(path):
    error = next(outcomes)
    if error is not None:
      raise error
    return path

  with pytest.warns(RuntimeWarning, match="failed to load .*invalid ELF header"):
    assert opened(flaky) == str(lib)
  assert len(compiles) == 4

  def broken(path):
    raise OSError("invalid ELF header")

  with pytest.warns(RuntimeWarning), pytest.raises(kernels.KernelUnavailable, match="freshly built"):
    opened(broken)
  assert len(compiles) == 5 and lib.with_suffix(".failed").exists()
  with pytest.raises(kernels.KernelUnavailable, match="earlier build failed"):
    opened()
  assert len(compiles) == 5
  # The real loader on a library that was never truncated (another key).
  src.write_text(_PROBE_SRC + "// another build\n")
  assert _build.open_library(src, out).bsj_probe() == 7


def test_failed_build_is_remembered_until_the_compiler_or_source_changes_or_a_rebuild_is_forced(tmp_path,
                                                                                               monkeypatch, compiles):
  src, out = tmp_path / "bad.cc", tmp_path / "cache"
  src.write_text("this is not C++;\n")
  opened = lambda: _build.open_library(src, out, load=str)
  with pytest.raises(kernels.KernelUnavailable, match="building bad-.* failed"):
    opened()
  marker = _build._plan(src, out).failed
  assert "building" in json.loads(marker.read_text())["error"] and len(compiles) == 1
  for _ in range(2):  # later calls (later processes) fail at once, quoting the error, without building
    with pytest.raises(kernels.KernelUnavailable, match="earlier build failed .*BLOCKSPEC_JAX_KERNEL_REBUILD"):
      opened()
  assert len(compiles) == 1
  monkeypatch.setenv("BLOCKSPEC_JAX_KERNEL_REBUILD", "1")
  with pytest.raises(kernels.KernelUnavailable, match="building"):
    opened()
  assert len(compiles) == 2
  monkeypatch.delenv("BLOCKSPEC_JAX_KERNEL_REBUILD")
  cxx = tmp_path / "cxx"  # another compiler: its own key, so it is tried
  cxx.write_text(f'#!/bin/sh\nexec {shutil.which(os.environ.get("CXX", "g++"))} "$@"\n')
  cxx.chmod(0o755)
  monkeypatch.setenv("CXX", str(cxx))
  with pytest.raises(kernels.KernelUnavailable, match="building"):
    opened()
  assert len(compiles) == 3
  src.write_text(_PROBE_SRC)  # the source fixed: its own key, built
  assert pathlib.Path(opened()).exists() and len(compiles) == 4


_FRESH_PROCESS = """
import json, sys, warnings
import numpy as np
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
  import jax, jax.numpy as jnp
  from blockspec_jax import kernels
  x_BxTxK, w_NxK = np.load(sys.argv[1]), np.load(sys.argv[2])
  outs = []
  for w_dtype in (jnp.float32, jnp.bfloat16):
    w = jnp.asarray(w_NxK).astype(w_dtype)
    outs.append(np.asarray(jax.jit(lambda x, w: kernels.linear(x, w, dtype=w_dtype))(x_BxTxK, w), np.float32))
    outs.append(np.asarray(kernels.linear(x_BxTxK[:1], w, dtype=w_dtype), np.float32))
  np.save(sys.argv[3], np.concatenate([o.reshape(-1) for o in outs]))
  available = kernels.kernel_available()
print(json.dumps({"available": available, "warnings": [str(w.message) for w in caught if "blockspec_jax" in
                                                         str(w.message)]}))
"""


def _fresh_process(tmp_path, name, x_BxTxK, w_NxK, **env):
  np.save(tmp_path / "x.npy", np.asarray(x_BxTxK))
  np.save(tmp_path / "w.npy", np.asarray(w_NxK))
  out = tmp_path / f"{name}.npy"
  proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tmp_path / "x.npy"), str(tmp_path / "w.npy"),
                         str(out)], capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", **env))
  assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS):\n{proc.stderr[-3000:]}"
  return json.loads(proc.stdout.strip().splitlines()[-1]), np.load(out)


def test_fresh_processes_rebuild_a_corrupt_library_and_fall_back_without_a_compiler(tmp_path):
  """End to end, in fresh processes: (1) a cache holding this process's library truncated to 4096 bytes (loading it
  used to kill every later process with SIGBUS) is rebuilt, with one warning, and gives the kernel's numbers;
  (2) with no compiler (CXX=/nonexistent/g++, empty cache) there is one warning and exactly XLA's numbers."""
  x_MxK, w_NxK = _operands(6, 40, 24, seed=12)
  x_BxTxK = x_MxK.reshape(3, 2, 40)

  def numbers(impl):  # what the script below computes, in this process
    outs = []
    for w_dtype in (jnp.float32, jnp.bfloat16):
      w = w_NxK.astype(w_dtype)
      outs.append(jax.jit(lambda x, w: kernels.linear(x, w, impl=impl, dtype=w_dtype))(x_BxTxK, w))
      outs.append(kernels.linear(x_BxTxK[:1], w, impl=impl, dtype=w_dtype))
    return np.concatenate([np.asarray(o, np.float32).reshape(-1) for o in outs])

  lib = pathlib.Path(kernels._load()._name)
  cache = tmp_path / "cache"
  (cache / "kernels").mkdir(parents=True)
  for suffix in (".so", ".json"):
    shutil.copy(lib.with_suffix(suffix), cache / "kernels")
  os.truncate(cache / "kernels" / lib.name, 4096)
  report, got = _fresh_process(tmp_path, "corrupt", x_BxTxK, w_NxK, BLOCKSPEC_JAX_CACHE=str(cache))
  assert report["available"] and len(report["warnings"]) == 1 and "rebuilding" in report["warnings"][0], report
  np.testing.assert_array_equal(got, numbers("kernel"))
  assert (cache / "kernels" / lib.name).stat().st_size == lib.stat().st_size
  report, got = _fresh_process(tmp_path, "no_compiler", x_BxTxK, w_NxK, BLOCKSPEC_JAX_CACHE=str(tmp_path / "empty"),
                               CXX="/nonexistent/g++")
  assert not report["available"] and len(report["warnings"]) == 1, report
  assert "no C++ compiler '/nonexistent/g++'" in report["warnings"][0]
  np.testing.assert_array_equal(got, numbers("xla"))
