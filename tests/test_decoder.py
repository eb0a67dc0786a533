"""Decoder: incremental = full, ragged rows, rotary styles, explicit masks, config and parameter names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax.models import Decoder, DecoderConfig, causal_mask, init_cache

S = 16  # cache length used throughout
ATOL = 1e-5


def make(config, batch=1, max_len=S, seed=0):
  model = Decoder(config)
  tokens = jnp.zeros((batch, 1), jnp.int32)
  positions = jnp.zeros((batch, 1), jnp.int32)
  cache = init_cache(config, batch, max_len)
  params = model.init(jax.random.PRNGKey(seed), tokens, positions, cache, causal_mask(positions, max_len))
  return model, params


def tokens_for(batch, length, seed=1, vocab=64):
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, vocab, dtype=jnp.int32)


def forward(model, params, tokens_BxT, positions_BxT, cache, mask_BxTxS=None, **kw):
  if mask_BxTxS is None:
    mask_BxTxS = causal_mask(positions_BxT, cache.max_len)
  return jax.jit(model.apply, static_argnames="return_hidden")(params, tokens_BxT, positions_BxT, cache,
                                                               mask_BxTxS, **kw)


def arange_positions(batch, start, length):
  return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32)[None, :], (batch, length))


@pytest.mark.parametrize("style,qkv_bias", [("half", True), ("interleaved", False)])
def test_incremental_equals_full(style, qkv_bias):
  config = DecoderConfig.tiny(rope_style=style, qkv_bias=qkv_bias)
  model, params = make(config, batch=2)
  length, prefill = 10, 4
  tokens = tokens_for(2, length)
  full, _ = forward(model, params, tokens, arange_positions(2, 0, length), init_cache(config, 2, S))

  for chunk in (1, 3):
    cache = init_cache(config, 2, S)
    parts = []
    logits, cache = forward(model, params, tokens[:, :prefill], arange_positions(2, 0, prefill), cache)
    parts.append(logits)
    for start in range(prefill, length, chunk):
      end = min(start + chunk, length)
      logits, cache = forward(model, params, tokens[:, start:end], arange_positions(2, start, end - start), cache)
      parts.append(logits)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, atol=ATOL, rtol=0)


def test_ragged_batch_matches_single_rows():
  config = DecoderConfig.tiny()
  model, params = make(config, batch=2)
  lengths = [7, 4]
  tokens = tokens_for(2, 7, seed=3)
  padded = tokens.at[1, 4:].set(0)  # row 1 is padded after its 4 real tokens
  positions = arange_positions(2, 0, 7)
  logits, cache = forward(model, params, padded, positions, init_cache(config, 2, S))
  # One decode step per row at its own position: row 0 at 7, row 1 at 4 (overwrites its padding slot 4).
  nxt = jnp.array([[5], [9]], jnp.int32)
  step_logits, _ = forward(model, params, nxt, jnp.array([[7], [4]], jnp.int32), cache)

  for row, n in enumerate(lengths):
    solo_tokens = jnp.concatenate([tokens[row:row + 1, :n], nxt[row:row + 1]], axis=1)
    solo, _ = forward(model, params, solo_tokens, arange_positions(1, 0, n + 1), init_cache(config, 1, S))
    np.testing.assert_allclose(logits[row, :n], solo[0, :n], atol=ATOL, rtol=0)
    np.testing.assert_allclose(step_logits[row, 0], solo[0, n], atol=ATOL, rtol=0)


def _interleave_columns(kernel_DxNH, bias_NH, num_heads, head_dim):
  """Half-layout q/k weights -> interleaved layout: each head's columns reordered [0, H/2, 1, H/2+1, ...]."""
  half = head_dim // 2
  perm_H = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
  perm = (np.arange(num_heads)[:, None] * head_dim + perm_H[None, :]).reshape(-1)
  return kernel_DxNH[:, perm], (None if bias_NH is None else bias_NH[perm])


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_interleaved_equals_half_after_permutation(qkv_bias):
  half_cfg = DecoderConfig.tiny(rope_style="half", qkv_bias=qkv_bias)
  inter_cfg = DecoderConfig.tiny(rope_style="interleaved", qkv_bias=qkv_bias)
  model_half, params = make(half_cfg)
  model_inter = Decoder(inter_cfg)
  inter_params = jax.tree_util.tree_map(lambda a: a, params)
  for i in range(half_cfg.num_layers):
    attn = inter_params["params"][f"layers_{i}"]["attn"]
    for name, heads in (("q", half_cfg.num_heads), ("k", half_cfg.num_kv_heads)):
      kernel, bias = _interleave_columns(attn[name]["kernel"], attn[name].get("bias"), heads, half_cfg.head_dim)
      attn[name] = {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}
  tokens = tokens_for(1, 9, seed=5)
  positions = arange_positions(1, 0, 9)
  a, _ = forward(model_half, params, tokens, positions, init_cache(half_cfg, 1, S))
  b, _ = forward(model_inter, inter_params, tokens, positions, init_cache(inter_cfg, 1, S))
  np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
  # Without the permutation the two styles disagree (the test is not vacuous).
  c, _ = forward(model_inter, params, tokens, positions, init_cache(inter_cfg, 1, S))
  assert np.max(np.abs(np.asarray(a - c))) > 1e-3


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rotary_relative_position_invariance(style):
  config = DecoderConfig.tiny(rope_style=style)
  model, params = make(config)
  tokens = tokens_for(1, 8, seed=7)
  base, _ = forward(model, params, tokens, arange_positions(1, 0, 8), init_cache(config, 1, S))
  shift = 5
  positions = arange_positions(1, shift, 8)
  slots_S = jnp.arange(S)
  mask = causal_mask(positions, S) & (slots_S >= shift)[None, None, :]
  shifted, _ = forward(model, params, tokens, positions, init_cache(config, 1, S), mask)
  np.testing.assert_allclose(shifted, base, atol=1e-4, rtol=0)


def test_arbitrary_mask_equals_dropping_the_token():
  config = DecoderConfig.tiny(qkv_bias=True)
  model, params = make(config)
  tokens = tokens_for(1, 6, seed=11)
  positions = arange_positions(1, 0, 6)
  causal = causal_mask(positions, S)
  hole = 2
  # Queries after the hole may not see slot 2; queries up to the hole keep their causal prefix.
  after_hole_1xTx1 = (jnp.arange(6) > hole)[None, :, None]
  masked = causal & ~(after_hole_1xTx1 & (jnp.arange(S) == hole)[None, None, :])
  out_causal, _ = forward(model, params, tokens, positions, init_cache(config, 1, S), causal)
  out_masked, _ = forward(model, params, tokens, positions, init_cache(config, 1, S), masked)
  np.testing.assert_allclose(out_masked[:, :hole + 1], out_causal[:, :hole + 1], atol=ATOL, rtol=0)
  assert np.all(np.max(np.abs(np.asarray(out_masked - out_causal))[0, hole + 1:], axis=-1) > 1e-4)

  keep = np.array([0, 1, 3, 4, 5])  # the same tokens at their original positions, token 2 never written
  kept_positions = positions[:, keep]
  kept_mask = causal_mask(kept_positions, S) & (jnp.arange(S) != hole)[None, None, :]
  out_dropped, _ = forward(model, params, tokens[:, keep], kept_positions, init_cache(config, 1, S), kept_mask)
  np.testing.assert_allclose(out_dropped[:, hole:], out_masked[:, hole + 1:], atol=ATOL, rtol=0)


def test_fully_masked_row_is_finite():
  config = DecoderConfig.tiny()
  model, params = make(config)
  tokens = tokens_for(1, 4, seed=13)
  positions = arange_positions(1, 0, 4)
  mask = causal_mask(positions, S).at[0, 1].set(False)
  logits, cache, hidden = forward(model, params, tokens, positions, init_cache(config, 1, S), mask,
                                  return_hidden=True)
  assert np.all(np.isfinite(np.asarray(logits)))
  assert np.all(np.isfinite(np.asarray(hidden)))
  assert np.all(np.isfinite(np.asarray(cache.k_LxBxSxKxH)))


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_param_tree_names_and_shapes(qkv_bias, tie):
  config = DecoderConfig.tiny(qkv_bias=qkv_bias, tie_embeddings=tie)
  model, params = make(config)
  p = params["params"]
  expected_top = {"embed", "final_norm"} | {f"layers_{i}" for i in range(config.num_layers)}
  if not tie:
    expected_top.add("lm_head")
  assert set(p) == expected_top
  d, n, k, h, f, v = 32, 4, 2, 8, 64, 64
  assert p["embed"]["embedding"].shape == (v, d)
  assert p["final_norm"]["scale"].shape == (d,)
  if not tie:
    assert p["lm_head"]["kernel"].shape == (d, v)
  layer = p["layers_0"]
  assert set(layer) == {"attn_norm", "attn", "mlp_norm", "mlp"}
  assert set(layer["attn"]) == {"q", "k", "v", "o"}
  assert set(layer["mlp"]) == {"gate", "up", "down"}
  assert layer["attn"]["q"]["kernel"].shape == (d, n * h)
  assert layer["attn"]["k"]["kernel"].shape == (d, k * h)
  assert layer["attn"]["o"]["kernel"].shape == (n * h, d)
  assert layer["mlp"]["down"]["kernel"].shape == (f, d)
  for name in ("q", "k", "v"):
    assert ("bias" in layer["attn"][name]) == qkv_bias
  assert "bias" not in layer["attn"]["o"]
  tokens = tokens_for(2, 3)
  positions = arange_positions(2, 0, 3)
  logits, cache, hidden = forward(model, params, tokens, positions, init_cache(config, 2, S), return_hidden=True)
  assert logits.shape == (2, 3, v) and logits.dtype == jnp.float32
  assert hidden.shape == (2, 3, d)
  assert cache.k_LxBxSxKxH.shape == (2, 2, S, k, h)
  if tie:  # tied head: logits = final hidden @ embed.T
    np.testing.assert_allclose(logits, hidden @ p["embed"]["embedding"].T, atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides", [dict(num_kv_heads=3), dict(head_dim=7), dict(rope_style="neox"),
                                       dict(num_layers=0), dict(rms_eps=0.0), dict(rope_theta=-1.0),
                                       dict(vocab_size=64.0)])
def test_bad_config_raises(overrides):
  with pytest.raises(ValueError):
    DecoderConfig.tiny(**overrides)


def test_bad_shapes_raise():
  config = DecoderConfig.tiny()
  model, params = make(config)
  tokens = tokens_for(1, 3)
  positions = arange_positions(1, 0, 3)
  with pytest.raises(ValueError):
    model.apply(params, tokens, positions, init_cache(config, 1, S), causal_mask(positions, S + 1))
