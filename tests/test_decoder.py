"""Decoder: incremental = full, ragged rows, rotary styles, explicit masks, config and parameter names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import contracts
from blockspec_jax.models import Decoder, DecoderConfig, KVCache, causal_mask, init_cache

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


def assert_incremental_matches_full(model, params, config, tokens, prefill, chunks):
  """Prefill, then decode the rest in chunks of each size: logits equal one full forward over all tokens."""
  batch, length = tokens.shape
  full, _ = forward(model, params, tokens, arange_positions(batch, 0, length), init_cache(config, batch, S))
  for chunk in chunks:
    cache = init_cache(config, batch, S)
    logits, cache = forward(model, params, tokens[:, :prefill], arange_positions(batch, 0, prefill), cache)
    parts = [logits]
    for start in range(prefill, length, chunk):
      end = min(start + chunk, length)
      logits, cache = forward(model, params, tokens[:, start:end], arange_positions(batch, start, end - start),
                              cache)
      parts.append(logits)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("style,qkv_bias", [("half", True), ("interleaved", False)])
def test_incremental_equals_full(style, qkv_bias):
  config = DecoderConfig.tiny(rope_style=style, qkv_bias=qkv_bias)
  model, params = make(config, batch=2)
  length, prefill = 10, 4
  tokens = tokens_for(2, length)
  assert_incremental_matches_full(model, params, config, tokens, prefill, chunks=(1, 3))


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


def _interleave_rows(weight_NHxD, bias_NH, num_heads, head_dim):
  """Half-layout q/k weights -> interleaved layout: each head's output rows reordered [0, H/2, 1, H/2+1, ...]."""
  half = head_dim // 2
  perm_H = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
  perm = (np.arange(num_heads)[:, None] * head_dim + perm_H[None, :]).reshape(-1)
  return weight_NHxD[perm], (None if bias_NH is None else bias_NH[perm])


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
      weight, bias = _interleave_rows(attn[name]["weight"], attn[name].get("bias"), heads, half_cfg.head_dim)
      attn[name] = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
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
    assert p["lm_head"]["weight"].shape == (v, d)
  layer = p["layers_0"]
  assert set(layer) == {"attn_norm", "attn", "mlp_norm", "mlp"}
  assert set(layer["attn"]) == {"q", "k", "v", "o"}
  assert set(layer["mlp"]) == {"gate", "up", "down"}
  assert layer["attn"]["q"]["weight"].shape == (n * h, d)
  assert layer["attn"]["k"]["weight"].shape == (k * h, d)
  assert layer["attn"]["o"]["weight"].shape == (d, n * h)
  assert layer["mlp"]["down"]["weight"].shape == (d, f)
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


# ----------------------------------------------------------------------------------------------------------------
# Gemma 3 options: q/k norms, post-norms, (1 + scale) norms, GeGLU, embedding scale, local/global layers.

GEMMA_OPTIONS = dict(qk_norm=True, post_norms=True, embed_scale=True, mlp_activation="gelu_tanh", query_scale=0.3)
WINDOW = 4


def _randomize_norms(params, seed=0):
  """Norm scales drawn around 1 (init is all ones / zeros), so the norms are not identities."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  out = []
  for (path, leaf), key in zip(leaves, keys):
    if getattr(path[-1], "key", None) == "scale":
      leaf = leaf + 0.5 * jax.random.normal(key, leaf.shape)
    out.append(leaf)
  return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.parametrize("overrides", [
    GEMMA_OPTIONS,
    pytest.param(dict(GEMMA_OPTIONS, norm_plus_one=True, rope_style="interleaved", qkv_bias=True),
                 marks=pytest.mark.slow),
    pytest.param(dict(GEMMA_OPTIONS, sliding_window=WINDOW, layer_types=("sliding", "full"), rope_theta_local=100.0),
                 marks=pytest.mark.slow),
    pytest.param(dict(sliding_window=WINDOW, layer_types=("full", "sliding")), marks=pytest.mark.slow),
])
def test_incremental_equals_full_gemma_options(overrides):
  config = DecoderConfig.tiny(**overrides)
  model, params = make(config, batch=2)
  params = _randomize_norms(params)
  length, prefill = 11, 3
  tokens = tokens_for(2, length, seed=21)
  assert_incremental_matches_full(model, params, config, tokens, prefill, chunks=(1, 4))


def _influence(config, change_at, length=10, seed=23):
  """Max |Δ logits| per query position when token ``change_at`` is replaced (full forward, causal mask)."""
  model, params = make(config)
  tokens = tokens_for(1, length, seed=seed)
  changed = tokens.at[0, change_at].set((tokens[0, change_at] + 1) % config.vocab_size)
  positions = arange_positions(1, 0, length)
  a, _ = forward(model, params, tokens, positions, init_cache(config, 1, S))
  b, _ = forward(model, params, changed, positions, init_cache(config, 1, S))
  return np.max(np.abs(np.asarray(a - b))[0], axis=-1)


def test_sliding_window_limits_influence():
  # One local layer: query p sees slots p - WINDOW + 1 .. p, so token 2 reaches positions 2 .. 2 + WINDOW - 1 only.
  local = DecoderConfig.tiny(num_layers=1, sliding_window=WINDOW, layer_types=("sliding",), **GEMMA_OPTIONS)
  delta = _influence(local, change_at=2)
  assert np.all(delta[2:2 + WINDOW] > 1e-4), delta
  assert np.all(delta[2 + WINDOW:] == 0.0), delta
  assert np.all(delta[:2] == 0.0)
  # The same layer as a global one (or sliding_window without local layers): every later position is influenced.
  for overrides in (dict(layer_types=("full",)), dict(layer_types=None)):
    full = DecoderConfig.tiny(num_layers=1, sliding_window=WINDOW, **dict(GEMMA_OPTIONS, **overrides))
    assert np.all(_influence(full, change_at=2)[2:] > 1e-4)
  # Two local layers: the receptive field grows to 2 * (WINDOW - 1) back.
  two = DecoderConfig.tiny(sliding_window=WINDOW, layer_types=("sliding", "sliding"))
  delta = _influence(two, change_at=1, length=12)
  reach = 1 + 2 * (WINDOW - 1)
  assert np.all(delta[1:reach + 1] > 1e-6) and np.all(delta[reach + 1:] == 0.0), delta


def test_sliding_window_uses_query_positions_when_decoding():
  """The window is applied from the query positions inside the decoder: cached decoding and ragged rows."""
  config = DecoderConfig.tiny(num_layers=1, sliding_window=WINDOW, layer_types=("sliding",), **GEMMA_OPTIONS)
  model, params = make(config, batch=2)
  tokens = tokens_for(2, 10, seed=29)

  def step_logits(tokens_2x10):
    # Row 0 prefills 9 tokens and decodes position 9; row 1 prefills 6 (then padding) and decodes position 6.
    cache = init_cache(config, 2, S)
    valid = jnp.array([9, 6], jnp.int32)
    prompt_positions = arange_positions(2, 0, 9)
    _, cache = forward(model, params, tokens_2x10[:, :9], prompt_positions, cache,
                       causal_mask(prompt_positions, S, valid))
    step_positions = valid[:, None]
    out, _ = forward(model, params, tokens_2x10[:, 9:10], step_positions, cache,
                     causal_mask(step_positions, S, valid + 1))
    return np.asarray(out[:, 0])

  base = step_logits(tokens)
  for row, query_pos in ((0, 9), (1, 6)):
    inside = query_pos - WINDOW + 1  # oldest slot in the window
    for slot, influences in ((inside, True), (inside - 1, False), (0, False)):
      changed = tokens.at[row, slot].set((tokens[row, slot] + 1) % config.vocab_size)
      delta = np.max(np.abs(step_logits(changed)[row] - base[row]))
      assert (delta > 1e-4) == influences, (row, slot, delta)


def test_norm_plus_one_equals_shifted_scales():
  plain = DecoderConfig.tiny(**GEMMA_OPTIONS)
  plus_one = DecoderConfig.tiny(norm_plus_one=True, **GEMMA_OPTIONS)
  model, params = make(plus_one)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(params["params"]["layers_0"]["post_mlp_norm"]))
  params = _randomize_norms(params)
  shifted = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 1.0 if getattr(path[-1], "key", None) == "scale" else x, params)
  tokens = tokens_for(1, 7, seed=31)
  positions = arange_positions(1, 0, 7)
  a, _ = forward(model, params, tokens, positions, init_cache(plus_one, 1, S))
  b, _ = forward(Decoder(plain), shifted, tokens, positions, init_cache(plain, 1, S))
  np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_gemma_param_tree():
  config = DecoderConfig.tiny(tie_embeddings=True, **GEMMA_OPTIONS)
  _, params = make(config)
  layer = params["params"]["layers_1"]
  assert set(layer) == {"attn_norm", "attn", "post_attn_norm", "mlp_norm", "mlp", "post_mlp_norm"}
  assert set(layer["attn"]) == {"q", "k", "v", "o", "q_norm", "k_norm"}
  assert layer["attn"]["q_norm"]["scale"].shape == (8,) and layer["attn"]["k_norm"]["scale"].shape == (8,)
  assert layer["post_attn_norm"]["scale"].shape == (32,) and layer["post_mlp_norm"]["scale"].shape == (32,)
  # Window / local layers / activation / scales add no parameters.
  _, plain = make(DecoderConfig.tiny(sliding_window=3, layer_types=("sliding", "full"), rope_theta_local=5.0,
                                     mlp_activation="gelu_tanh", embed_scale=True, query_scale=0.1))
  assert set(plain["params"]["layers_0"]) == {"attn_norm", "attn", "mlp_norm", "mlp"}
  assert set(plain["params"]["layers_0"]["attn"]) == {"q", "k", "v", "o"}


@pytest.mark.parametrize("overrides", [dict(mlp_activation="gelu_tanh"), dict(embed_scale=True),
                                       dict(query_scale=0.1), dict(rope_theta_local=7.0, sliding_window=3,
                                                                   layer_types=("sliding", "sliding"))])
def test_each_gemma_option_changes_the_output(overrides):
  base_cfg = DecoderConfig.tiny()
  model, params = make(base_cfg)
  tokens = tokens_for(1, 9, seed=37)
  positions = arange_positions(1, 0, 9)
  a, _ = forward(model, params, tokens, positions, init_cache(base_cfg, 1, S))
  cfg = DecoderConfig.tiny(**overrides)
  b, _ = forward(Decoder(cfg), params, tokens, positions, init_cache(cfg, 1, S))
  assert np.max(np.abs(np.asarray(a - b))) > 1e-4


@pytest.mark.parametrize("overrides", [dict(layer_types=("sliding",)), dict(layer_types=("sliding", "full")),
                                       dict(layer_types=("full", "local"), sliding_window=4),
                                       dict(sliding_window=0), dict(sliding_window=True),
                                       dict(mlp_activation="gelu"), dict(query_scale=0.0),
                                       dict(rope_theta_local=0.0)])
def test_bad_gemma_config_raises(overrides):
  with pytest.raises(ValueError):
    DecoderConfig.tiny(**overrides)


def test_layer_types_list_becomes_tuple():
  config = DecoderConfig.tiny(sliding_window=4, layer_types=["sliding", "full"])
  assert config.layer_types == ("sliding", "full") and hash(config) is not None
  assert [config.layer_type(i) for i in range(2)] == ["sliding", "full"]
  assert DecoderConfig.tiny().layer_type(1) == "full"


def test_matches_transformers_gemma3_tiny():
  """A random tiny transformers Gemma3 (eager attention, window 4 < sequence) and ours with its weights copied."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
  hf_cfg = transformers.Gemma3TextConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=layer_types,
      max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
      attn_implementation="eager")
  torch.manual_seed(0)
  hf = transformers.Gemma3ForCausalLM(hf_cfg).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      p.copy_(0.3 * torch.randn_like(p))  # norm weights too: (1 + w) with w != 0
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
  config = DecoderConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                         ffn_dim=64, rope_theta=1000.0, rms_eps=1e-6, tie_embeddings=True, norm_plus_one=True,
                         **dict(GEMMA_OPTIONS, query_scale=16 ** -0.5), sliding_window=WINDOW,
                         layer_types=("sliding", "sliding", "full"), rope_theta_local=10.0)
  tree = {"embed": {"embedding": sd["model.embed_tokens.weight"]}, "final_norm": {"scale": sd["model.norm.weight"]}}
  for i in range(3):
    pre = f"model.layers.{i}."
    lin = lambda name: {"weight": sd[pre + name + ".weight"]}
    norm = lambda name: {"scale": sd[pre + name + ".weight"]}
    tree[f"layers_{i}"] = {
        "attn_norm": norm("input_layernorm"), "post_attn_norm": norm("post_attention_layernorm"),
        "mlp_norm": norm("pre_feedforward_layernorm"), "post_mlp_norm": norm("post_feedforward_layernorm"),
        "attn": {"q": lin("self_attn.q_proj"), "k": lin("self_attn.k_proj"), "v": lin("self_attn.v_proj"),
                 "o": lin("self_attn.o_proj"), "q_norm": norm("self_attn.q_norm"),
                 "k_norm": norm("self_attn.k_norm")},
        "mlp": {"gate": lin("mlp.gate_proj"), "up": lin("mlp.up_proj"), "down": lin("mlp.down_proj")}}
  params = {"params": tree}
  length = 12
  tokens = tokens_for(1, length, seed=41)
  with torch.no_grad():
    ref = hf(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits[0].numpy()
  ours, _ = forward(Decoder(config), params, tokens, arange_positions(1, 0, length), init_cache(config, 1, S))
  np.testing.assert_allclose(np.asarray(ours[0]), ref, atol=2e-4 * max(1.0, np.abs(ref).max()), rtol=0)


def _reference_moves(x_LxBxSxKxH, src_BxM, dst_BxM, valid_BxM):
  """numpy: gather every valid source first, then write each to its destination."""
  out = np.array(x_LxBxSxKxH)
  for b in range(src_BxM.shape[0]):
    moved = {int(d): np.array(x_LxBxSxKxH[:, b, s]) for s, d, v in zip(src_BxM[b], dst_BxM[b], valid_BxM[b]) if v}
    for d, value in moved.items():
      out[:, b, d] = value
  return out


@pytest.mark.parametrize("in_loop", [False, True], ids=["one_call", "donated_loop"])
def test_move_slots_gathers_every_source_before_writing(in_loop):
  """The path commit's moves chain (slot ``length + path[j]`` is move ``i``'s destination for ``j < i``): every move
  must read its source as it was before any write, also inside a jitted loop whose carried cache is updated in place
  (where a fused in-place gather-and-scatter would read slots already written). Paths of several shapes: the longest
  chain of overlapping moves (``path = [1, 2, …]``), sparse paths, nothing moved, τ = 0 and τ = γ; exact."""
  layers, batch, slots, heads, dim, gamma, steps = 2, 4, 40, 2, 3, 6, 3
  rng = np.random.default_rng(0)
  x = rng.standard_normal((layers, batch, slots, heads, dim)).astype(np.float32)
  cache = KVCache(jnp.asarray(x), jnp.asarray(-x))
  paths, lengths, taus = [], [], []
  for step in range(steps):
    length_B = np.array([3 + step, 5, 9 + 2 * step, 4], np.int32)
    path_BxG = np.stack([np.arange(1, gamma + 1),  # every destination is the previous move's source
                         np.sort(rng.choice(np.arange(gamma + 8), gamma, replace=False)),
                         np.arange(gamma) * 2 + 1,
                         np.arange(gamma)]).astype(np.int32)  # path[i] = i: nothing moves
    tau_B = np.array([gamma, rng.integers(0, gamma + 1), step, 0], np.int32)
    paths.append(path_BxG)
    lengths.append(length_B)
    taus.append(tau_B)
  moves = [contracts.path_slots(jnp.asarray(length_B), jnp.asarray(path_BxG), jnp.asarray(tau_B))
           for length_B, path_BxG, tau_B in zip(lengths, paths, taus)]
  src_TxBxM, dst_TxBxM, valid_TxBxM = (jnp.stack(parts) for parts in zip(*moves))

  if in_loop:
    def run(cache, src_TxBxM, dst_TxBxM, valid_TxBxM):
      return jax.lax.fori_loop(0, steps, lambda t, c: c.move_slots(src_TxBxM[t], dst_TxBxM[t], valid_TxBxM[t]), cache)
    moved = jax.jit(run, donate_argnums=0)(cache, src_TxBxM, dst_TxBxM, valid_TxBxM)
  else:
    moved = cache
    for t in range(steps):
      moved = jax.jit(KVCache.move_slots)(moved, src_TxBxM[t], dst_TxBxM[t], valid_TxBxM[t])
  want_k = x
  for t in range(steps):
    want_k = _reference_moves(want_k, *(np.asarray(a[t]) for a in (src_TxBxM, dst_TxBxM, valid_TxBxM)))
  np.testing.assert_array_equal(np.asarray(moved.k_LxBxSxKxH), want_k)
  np.testing.assert_array_equal(np.asarray(moved.v_LxBxSxKxH), -want_k)
