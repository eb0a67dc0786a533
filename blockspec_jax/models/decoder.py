"""Decoder-only transformer (llama / qwen2 family) with a KV cache written at per-row positions.

One forward serves prefill, single-token decoding, multi-token verification and tree drafts (DESIGN.md, "The decode
loop")::

    logits_BxTxV, cache = Decoder(config).apply(params, tokens_BxT, positions_BxT, cache, attn_mask_BxTxS)

    tokens_BxT       int32 [B, T]     new tokens
    positions_BxT    int32 [B, T]     absolute position of each new token: its rotary angle and its cache slot
    cache            KVCache          k/v [L, B, S, K, H]; the T new keys/values are written at ``positions_BxT``
    attn_mask_BxTxS  bool  [B, T, S]  True = query t of row b may attend cache slot s (after the write)
    logits_BxTxV     f32   [B, T, V]
    hidden_BxTxD     [B, T, D]        (``return_hidden=True``) the final-norm output, i.e. the LM head's input

Rows are independent: each has its own positions, so ragged batches need no left padding. A row's positions are
normally contiguous (p0..p0+T-1), but the write is a scatter, so any distinct slots work; slots >= S are dropped
(never clamped), which lets writes past a row's end fall off harmlessly. Rolling back a row is just reusing its slots:
stale entries are excluded by the mask and overwritten by the next write.

Layer structure (pre-norm): x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)); logits = head(RMSNorm(x)).
Parameter tree (Dense kernels are (in, out))::

    embed/embedding                       [V, D]
    layers_{i}/attn_norm/scale            [D]
    layers_{i}/attn/{q,k,v}/kernel        [D, N*H] / [D, K*H]   (+ bias when ``qkv_bias``)
    layers_{i}/attn/o/kernel              [N*H, D]
    layers_{i}/mlp_norm/scale             [D]
    layers_{i}/mlp/{gate,up}/kernel       [D, F];  layers_{i}/mlp/down/kernel [F, D]
    final_norm/scale                      [D]
    lm_head/kernel                        [D, V]  (absent when ``tie_embeddings``: logits = x @ embed.T)

Rotary styles: "half" (rotate-half / NeoX: dim i pairs with i + H/2, as in HF llama and qwen2) and "interleaved"
(adjacent pairs 2i, 2i+1, as in GGUF llama files whose converter permuted the q/k rows). Both use frequency
theta^(-2i/H) for pair i, so interleaved weights = half weights with each head's q/k output columns reordered
[0, H/2, 1, H/2+1, ...].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["DecoderConfig", "KVCache", "init_cache", "causal_mask", "apply_rotary", "Decoder"]

ROPE_STYLES = ("interleaved", "half")
# Masked attention logits: large, negative and finite (f32 softmax of an all-masked row stays finite).
_MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Static architecture of a decoder. ``dtype`` is the compute dtype; parameters are always float32."""
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6
  rope_style: str = "half"
  qkv_bias: bool = False
  tie_embeddings: bool = False
  dtype: Any = jnp.float32
  max_len: int = 8192  # longest sequence (prompt + generation + draft slots) a cache may be built for

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                 "max_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    if self.rope_style not in ROPE_STYLES:
      raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}")
    if not self.rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
    if not self.rms_eps > 0:
      raise ValueError(f"rms_eps must be > 0, got {self.rms_eps}")

  @property
  def group_size(self) -> int:
    """Query heads per KV head (grouped-query attention)."""
    return self.num_heads // self.num_kv_heads

  @classmethod
  def tiny(cls, **overrides) -> "DecoderConfig":
    """A small config for tests: V=64, D=32, 2 layers, 4 heads / 2 KV heads, H=8, F=64."""
    kwargs = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64)
    kwargs.update(overrides)
    return cls(**kwargs)


@struct.dataclass
class KVCache:
  """Per-layer keys and values for every slot of every row."""
  k_LxBxSxKxH: jax.Array  # [L, B, S, K, H]
  v_LxBxSxKxH: jax.Array  # [L, B, S, K, H]

  @property
  def max_len(self) -> int:
    return self.k_LxBxSxKxH.shape[2]


def init_cache(config: DecoderConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
  """Zero cache of shape [L, B, S=max_len, K, H] in ``dtype`` (default: the config's compute dtype)."""
  shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
  dtype = config.dtype if dtype is None else dtype
  return KVCache(k_LxBxSxKxH=jnp.zeros(shape, dtype), v_LxBxSxKxH=jnp.zeros(shape, dtype))


def causal_mask(positions_BxT: jax.Array, max_len: int, valid_len_B: jax.Array | None = None) -> jax.Array:
  """bool [B, T, S]: slot s is allowed for query (b, t) iff s <= positions[b, t] (and s < valid_len[b] if given)."""
  slots_S = jnp.arange(max_len, dtype=jnp.int32)
  mask_BxTxS = slots_S[None, None, :] <= positions_BxT[:, :, None]
  if valid_len_B is not None:
    mask_BxTxS = mask_BxTxS & (slots_S[None, None, :] < valid_len_B[:, None, None])
  return mask_BxTxS


def apply_rotary(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float, style: str) -> jax.Array:
  """Rotary embedding of q or k ([B, T, N, H]) at absolute ``positions_BxT``; angles computed in float32."""
  head_dim = x_BxTxNxH.shape[-1]
  half = head_dim // 2
  inv_freq_P = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim)  # P = H/2 pairs
  angle_BxTxP = positions_BxT.astype(jnp.float32)[:, :, None] * inv_freq_P[None, None, :]
  cos_BxTx1xP = jnp.cos(angle_BxTxP)[:, :, None, :]
  sin_BxTx1xP = jnp.sin(angle_BxTxP)[:, :, None, :]
  x = x_BxTxNxH.astype(jnp.float32)
  if style == "half":
    x1, x2 = x[..., :half], x[..., half:]
  elif style == "interleaved":
    x1, x2 = x[..., 0::2], x[..., 1::2]
  else:
    raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {style!r}")
  y1 = x1 * cos_BxTx1xP - x2 * sin_BxTx1xP
  y2 = x2 * cos_BxTx1xP + x1 * sin_BxTx1xP
  if style == "half":
    y = jnp.concatenate([y1, y2], axis=-1)
  else:
    y = jnp.stack([y1, y2], axis=-1).reshape(x.shape)
  return y.astype(x_BxTxNxH.dtype)


def _write_slots(cache_BxSxKxH: jax.Array, new_BxTxKxH: jax.Array, positions_BxT: jax.Array) -> jax.Array:
  """Scatter row b's T new entries into slots ``positions_BxT[b]``; slots outside [0, S) are dropped."""
  batch = cache_BxSxKxH.shape[0]
  rows_Bx1 = jnp.arange(batch, dtype=jnp.int32)[:, None]
  return cache_BxSxKxH.at[rows_Bx1, positions_BxT].set(new_BxTxKxH.astype(cache_BxSxKxH.dtype), mode="drop")


class RMSNorm(nn.Module):
  """x * rsqrt(mean(x^2) + eps) * scale, computed in float32."""
  eps: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD):
    scale_D = self.param("scale", nn.initializers.ones, (x_BxTxD.shape[-1],), jnp.float32)
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale_D[None, None, :]).astype(self.dtype)


class Attention(nn.Module):
  """Grouped-query attention over all S cache slots with an explicit mask; writes the new k/v first."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, k_BxSxKxH, v_BxSxKxH, attn_mask_BxTxS):
    cfg = self.config
    b, t, _ = x_BxTxD.shape
    n, kh, h, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
    dense = lambda feats, name, bias: nn.Dense(feats, use_bias=bias, dtype=cfg.dtype, param_dtype=jnp.float32,
                                               name=name)
    q_BxTxNxH = dense(n * h, "q", cfg.qkv_bias)(x_BxTxD).reshape(b, t, n, h)
    k_BxTxKxH = dense(kh * h, "k", cfg.qkv_bias)(x_BxTxD).reshape(b, t, kh, h)
    v_BxTxKxH = dense(kh * h, "v", cfg.qkv_bias)(x_BxTxD).reshape(b, t, kh, h)
    q_BxTxNxH = apply_rotary(q_BxTxNxH, positions_BxT, cfg.rope_theta, cfg.rope_style)
    k_BxTxKxH = apply_rotary(k_BxTxKxH, positions_BxT, cfg.rope_theta, cfg.rope_style)

    k_BxSxKxH = _write_slots(k_BxSxKxH, k_BxTxKxH, positions_BxT)
    v_BxSxKxH = _write_slots(v_BxSxKxH, v_BxTxKxH, positions_BxT)

    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, g, h)  # query head n = kv head (n // g), as in HF repeat_kv
    scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH.astype(jnp.float32),
                                  k_BxSxKxH.astype(jnp.float32)) * (h ** -0.5)
    mask_Bx1x1xTxS = attn_mask_BxTxS[:, None, None, :, :]
    scores_BxKxGxTxS = jnp.where(mask_Bx1x1xTxS, scores_BxKxGxTxS, _MASK_VALUE)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1)
    # A fully masked query row attends to nothing (zero output) instead of averaging every slot.
    probs_BxKxGxTxS = jnp.where(mask_Bx1x1xTxS, probs_BxKxGxTxS, 0.0)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxH.astype(jnp.float32))
    out_BxTxD = dense(cfg.d_model, "o", False)(out_BxTxKxGxH.reshape(b, t, n * h).astype(cfg.dtype))
    return out_BxTxD, k_BxSxKxH, v_BxSxKxH


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.config
    dense = lambda feats, name: nn.Dense(feats, use_bias=False, dtype=cfg.dtype, param_dtype=jnp.float32, name=name)
    gate_BxTxF = dense(cfg.ffn_dim, "gate")(x_BxTxD)
    up_BxTxF = dense(cfg.ffn_dim, "up")(x_BxTxD)
    return dense(cfg.d_model, "down")(nn.silu(gate_BxTxF) * up_BxTxF)


class Block(nn.Module):
  """Pre-norm transformer layer."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, k_BxSxKxH, v_BxSxKxH, attn_mask_BxTxS):
    cfg = self.config
    h_BxTxD = RMSNorm(cfg.rms_eps, cfg.dtype, name="attn_norm")(x_BxTxD)
    attn_BxTxD, k_BxSxKxH, v_BxSxKxH = Attention(cfg, name="attn")(h_BxTxD, positions_BxT, k_BxSxKxH, v_BxSxKxH,
                                                                   attn_mask_BxTxS)
    x_BxTxD = x_BxTxD + attn_BxTxD
    h_BxTxD = RMSNorm(cfg.rms_eps, cfg.dtype, name="mlp_norm")(x_BxTxD)
    x_BxTxD = x_BxTxD + MLP(cfg, name="mlp")(h_BxTxD)
    return x_BxTxD, k_BxSxKxH, v_BxSxKxH


class Decoder(nn.Module):
  """Decoder-only LM; see the module docstring for the call contract and the parameter tree."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, cache: KVCache, attn_mask_BxTxS, return_hidden: bool = False):
    """Returns ``(logits_BxTxV f32, new_cache)`` or ``(logits_BxTxV, new_cache, hidden_BxTxD)``."""
    cfg = self.config
    b, t = tokens_BxT.shape
    s = cache.max_len
    if positions_BxT.shape != (b, t):
      raise ValueError(f"positions_BxT shape {positions_BxT.shape} != tokens shape {(b, t)}")
    if attn_mask_BxTxS.shape != (b, t, s):
      raise ValueError(f"attn_mask_BxTxS shape {attn_mask_BxTxS.shape} != {(b, t, s)}")
    if cache.k_LxBxSxKxH.shape != (cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim):
      raise ValueError(f"cache shape {cache.k_LxBxSxKxH.shape} does not match config/batch")
    positions_BxT = positions_BxT.astype(jnp.int32)
    attn_mask_BxTxS = attn_mask_BxTxS.astype(jnp.bool_)

    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=jnp.float32,
                     embedding_init=nn.initializers.normal(stddev=0.02), name="embed")
    x_BxTxD = embed(tokens_BxT)
    k_LxBxSxKxH, v_LxBxSxKxH = cache.k_LxBxSxKxH, cache.v_LxBxSxKxH
    for i in range(cfg.num_layers):
      x_BxTxD, k_BxSxKxH, v_BxSxKxH = Block(cfg, name=f"layers_{i}")(
          x_BxTxD, positions_BxT, k_LxBxSxKxH[i], v_LxBxSxKxH[i], attn_mask_BxTxS)
      k_LxBxSxKxH = k_LxBxSxKxH.at[i].set(k_BxSxKxH)
      v_LxBxSxKxH = v_LxBxSxKxH.at[i].set(v_BxSxKxH)
    hidden_BxTxD = RMSNorm(cfg.rms_eps, cfg.dtype, name="final_norm")(x_BxTxD)
    if cfg.tie_embeddings:
      logits_BxTxV = embed.attend(hidden_BxTxD)
    else:
      logits_BxTxV = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=jnp.float32,
                              name="lm_head")(hidden_BxTxD)
    new_cache = KVCache(k_LxBxSxKxH=k_LxBxSxKxH, v_LxBxSxKxH=v_LxBxSxKxH)
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    if return_hidden:
      return logits_BxTxV, new_cache, hidden_BxTxD
    return logits_BxTxV, new_cache
