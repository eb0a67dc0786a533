"""Layers compiled once: a ``scan_layers`` decoder (one ``nn.scan`` body over stacked parameters ``layers`` [L, ...])
is the same model as the unrolled one (``layers_{i}``): bit-identical logits, hidden states, taps and caches on every
path in float32 (CPU kernel steps and verify passes, XLA prefill, steering deltas, taps; SmolLM2's real weights too),
Gemma's options to a few ulps, bfloat16 well inside bfloat16's own error; its
compiled program does not grow with depth, and the CPU kernel reads one layer of a stacked weight in place with the
numbers (and gradients) of the unstacked call."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import kernels
from blockspec_jax.models import decoder as dec
from helpers import tiny_config

GEMMA = dict(qk_norm=True, post_norms=True, embed_scale=True, mlp_activation="gelu_tanh", query_scale=0.3,
             sliding_window=3, layer_types=("sliding", "full", "sliding"), rope_theta_local=100.0, num_layers=3)


def _pair(overrides, seed=0):
  config = tiny_config(**overrides)
  params = dec.init_params(config, seed)
  # Norm scales away from 1 and non-zero biases, so every parameter matters.
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.3 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
      if p[-1].key in ("scale", "bias") else x, params)
  scanned = dataclasses.replace(config, scan_layers=True)
  return config, params, scanned, dec.stack_layers(params, config.num_layers)


def _run(config, params, tokens_BxT, positions_BxT, cache, **kw):
  mask = dec.causal_mask(positions_BxT, cache.max_len)
  fn = jax.jit(lambda p, t, pos, c, m: dec.Decoder(config).apply({"params": p}, t, pos, c, m, **kw))
  return fn(params, tokens_BxT, positions_BxT, cache, mask)


@pytest.mark.parametrize("overrides", [dict(), dict(qkv_bias=True, tie_embeddings=True), pytest.param(GEMMA, marks=pytest.mark.slow),
                                       pytest.param(dict(dtype=jnp.bfloat16, num_layers=3), marks=pytest.mark.slow)], ids=["llama", "qwen", "gemma", "bf16"])
def test_scanned_equals_unrolled_bit_for_bit(overrides):
  """Prefill of 20 tokens (XLA's GEMM) then steps of 1 and verify passes of 5 (the CPU kernel), with taps and a
  steering delta: every output equal to the last bit."""
  config, params, scanned, stacked = _pair(overrides)
  b, s = 2, 40
  tokens = jax.random.randint(jax.random.key(1), (b, 30), 0, config.vocab_size, dtype=jnp.int32)
  delta = 0.1 * jax.random.normal(jax.random.key(2), (config.num_layers, b, 1, config.ffn_dim))
  taps = (0, config.num_layers - 1)
  outs = []
  for cfg, p in ((config, params), (scanned, stacked)):
    cache = dec.init_cache(cfg, b, s)
    got = []
    for start, end in ((0, 20), (20, 21), (21, 26), (26, 27)):
      positions = jnp.broadcast_to(jnp.arange(start, end, dtype=jnp.int32), (b, end - start))
      logits, cache, hidden, tap = _run(cfg, p, tokens[:, start:end], positions, cache, tap_layers=taps,
                                        mlp_delta_LxBxTxF=delta)
      got += [logits, hidden, tap]
    outs.append(got + [cache.k_LxBxSxKxH, cache.v_LxBxSxKxH])
  if overrides.get("dtype") == jnp.bfloat16:
    # bfloat16 compute: XLA widens chains of bf16 elementwise ops inside a fusion and rounds where the fusion ends, so
    # the two programs round at different points. The layout must move the numbers far less than bfloat16 itself
    # moves them from float32.
    f32 = dataclasses.replace(config, dtype=jnp.float32)
    ref = _run(f32, params, tokens[:, :20], jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (b, 20)),
               dec.init_cache(f32, b, s))[0]
    layout_err = np.max(np.abs(np.asarray(outs[0][0], np.float32) - np.asarray(outs[1][0], np.float32)))
    bf16_err = np.max(np.abs(np.asarray(outs[0][0], np.float32) - np.asarray(ref)))
    assert layout_err <= 0.5 * bf16_err, (layout_err, bf16_err)
    return
  for a, c in zip(*outs):
    if overrides is GEMMA:
      # With embed_scale (Gemma's sqrt(D) on the embeddings), XLA compiles the unrolled program's first layer with
      # different last bits (a 1-layer program matches the scanned one exactly; 2 layers do not): a few ulps.
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), rtol=1e-5, atol=1e-5)
    else:
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def test_stack_and_unstack_are_inverse_and_consume_frees_the_layers():
  config = tiny_config(num_layers=3)
  params = dec.init_params(config, 0)
  stacked = dec.stack_layers(params, 3)
  assert set(stacked) == {"embed", "final_norm", "lm_head", "layers"}
  chex.assert_shape(stacked["layers"]["attn"]["q"]["weight"], (3, 32, 32))
  back = dec.unstack_layers(stacked)
  chex.assert_trees_all_equal(back, params)
  mutable = jax.tree.map(lambda x: x, params)
  dec.stack_layers(mutable, 3, consume=True)
  assert not any(k.startswith("layers_") for k in mutable)
  with pytest.raises(ValueError, match="missing"):
    dec.stack_layers({"embed": params["embed"]}, 3)
  scanned = dataclasses.replace(config, scan_layers=True)
  chex.assert_trees_all_equal(dec.init_params(scanned, 0), stacked)  # the same model


def test_the_scanned_program_does_not_grow_with_depth():
  """The unrolled program grows with the number of layers; the scanned one stays the size of one layer."""
  def hlo_size(num_layers, scan):
    cfg = tiny_config(num_layers=num_layers, scan_layers=scan)
    params = dec.init_params(cfg, 0)
    tokens = jnp.zeros((1, 1), jnp.int32)
    cache = dec.init_cache(cfg, 1, 8)
    fn = jax.jit(lambda p, c: dec.Decoder(cfg).apply({"params": p}, tokens, tokens, c, dec.causal_mask(tokens, 8)))
    return len(fn.lower(params, cache).as_text())

  assert hlo_size(8, False) > 2.5 * hlo_size(2, False)
  assert hlo_size(8, True) < 1.1 * hlo_size(2, True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_linear_reads_one_layer_of_a_stack(impl, dtype):
  """``linear(x, w_LxNxK, layer=i)`` = ``linear(x, w[i])`` exactly, inside a jitted loop over layers too, and its
  gradients are those of the unstacked call placed at layer i."""
  if impl == "kernel" and not kernels.kernel_available():
    pytest.skip("no CPU kernel here")
  x = jax.random.normal(jax.random.key(0), (3, 5, 24))
  w = jax.random.normal(jax.random.key(1), (4, 40, 24)).astype(dtype)
  for i in range(4):
    np.testing.assert_array_equal(kernels.linear(x, w, impl=impl, layer=jnp.int32(i)),
                                  kernels.linear(x, w[i], impl=impl))
  looped = jax.jit(lambda x, w: jax.lax.fori_loop(
      0, 4, lambda i, acc: acc + kernels.linear(x, w, impl=impl, layer=i), jnp.zeros((3, 5, 40))))(x, w)
  np.testing.assert_allclose(looped, sum(kernels.linear(x, w[i], impl=impl) for i in range(4)), rtol=1e-6)
  if dtype == jnp.float32:
    loss = lambda x, w: jnp.sum(kernels.linear(x, w, impl=impl, layer=jnp.int32(2)) ** 2)
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w2: jnp.sum(kernels.linear(x, w2, impl=impl) ** 2), argnums=(0, 1))(x, w[2])
    np.testing.assert_allclose(gx, rx, rtol=1e-6)
    np.testing.assert_allclose(gw[2], rw, rtol=1e-6)
    assert not np.any(np.asarray(gw)[[0, 1, 3]])
  with pytest.raises(ValueError, match="stacked"):
    kernels.linear(x, w[0], impl=impl, layer=jnp.int32(0))


@pytest.mark.slow  # the tiny llama and qwen layouts are checked bit for bit by default
def test_smollm2_scanned_equals_unrolled_bit_for_bit():
  """The real 30-layer SmolLM2, loaded in both layouts: prefill (XLA GEMM), a step and a verify pass (the kernel)
  give the same logits to the last bit, and greedy decoding emits the same tokens."""
  from blockspec_jax import sampling
  from blockspec_jax.decoding import speculative as spec
  from blockspec_jax.models import hub
  unrolled = hub.load_model("smollm2-135m", progress=False)
  scanned = hub.load_model("smollm2-135m", progress=False, scan_layers=True)
  assert scanned.config.scan_layers and "layers" in scanned.params["params"]
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, unrolled.config.vocab_size, (2, 36)), jnp.int32)
  outs = []
  for model in (unrolled, scanned):
    cache, got = dec.init_cache(model.config, 2, 64), []
    for start, end in ((0, 30), (30, 31), (31, 36)):
      positions = jnp.broadcast_to(jnp.arange(start, end, dtype=jnp.int32), (2, end - start))
      logits, cache = _run(model.config, model.params["params"], tokens[:, start:end], positions, cache)
      got.append(logits)
    tokens_BxP, lens = spec.prepare_prompts([[1, 2, 3, 4, 5], [7, 8, 9]])
    greedy = spec.generate_autoregressive(model.params["params"], jax.random.split(jax.random.key(0), 2), tokens_BxP,
                                          lens, target=model.config, max_new_tokens=12,
                                          sampler=sampling.Sampler(temperature=0.0))
    outs.append(got + [greedy.tokens_BxN])
  for a, c in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
