"""Decoder-only transformer (llama / qwen2 / gemma3 family) with a KV cache written at per-row positions.

One forward serves prefill, single-token decoding, multi-token verification and tree drafts
(docs/ARCHITECTURE.md, "Contract 3: the decoder forward")::

    logits_BxTxV, cache = Decoder(config).apply(params, tokens_BxT, positions_BxT, cache, attn_mask_BxTxS)

    tokens_BxT       int32 [B, T]     new tokens
    positions_BxT    int32 [B, T]     absolute position of each new token: its rotary angle and its cache slot
    cache            KVCache          k/v [L, B, S, K, H]; the T new keys/values are written at ``positions_BxT``
    attn_mask_BxTxS  bool  [B, T, S]  True = query t of row b may attend cache slot s (after the write)
    logits_BxTxV     f32   [B, T, V]
    hidden_BxTxD     [B, T, D]        (``return_hidden=True``) the final-norm output, i.e. the LM head's input
    taps_BxTxLxD     [B, T, L', D]    (``tap_layers=(i, …)``, a 4th output) the residual stream after layers i, …
                                      (before any norm): the "several depths" drafters that read the target use
    mlp_delta_LxBxTxF                 (optional input) added to every layer's MLP up-projection,
                                      ``down(act(gate(x)) * (up(x) + delta[i]))``; ``T`` may be 1 (one delta per row,
                                      broadcast over the new tokens). SD²'s steering biases; zeros change nothing.

Rows are independent: each has its own positions, so ragged batches need no left padding. A row's positions are
normally contiguous (p0..p0+T-1), but the write is a scatter, so any distinct slots work; slots >= S are dropped
(never clamped), which lets writes past a row's end fall off harmlessly. Rolling back a row is just reusing its slots:
stale entries are excluded by the mask and overwritten by the next write.

Layer structure (pre-norm): x += Attn(RMSNorm(x)); x += SwiGLU(RMSNorm(x)); logits = head(RMSNorm(x)).
Gemma 3 options (all off by default, so llama / qwen2 are unchanged): ``qk_norm`` (RMSNorm over head_dim of every q
and k head, before rotary), ``post_norms`` (x += RMSNorm(Attn(...)), x += RMSNorm(MLP(...))), ``embed_scale``
(embeddings * sqrt(D), in the compute dtype), ``mlp_activation="gelu_tanh"`` (GeGLU), ``query_scale`` (score scale,
default head_dim**-0.5), ``norm_plus_one`` (RMSNorms multiply by 1 + scale; GGUF files already store 1 + w, so
converted gemma3 weights use the plain convention), and local layers: ``layer_types[i] == "sliding"`` layers
rotate with ``rope_theta_local`` and additionally mask every slot s with ``position - s >= sliding_window`` (ANDed
with the caller's mask inside the decoder; the window is measured in slot indices, which equal positions for committed
tokens; a tree draft's node slots lie past its position, inside any window longer than the tree's depth).
Parameter tree (linear weights are (out, in), as in GGUF and torch, so decoding streams each output's weights
contiguously; see ``blockspec_jax.kernels``)::

    embed/embedding                       [V, D]
    layers_{i}/attn_norm/scale            [D]
    layers_{i}/attn/{q,k,v}/weight        [N*H, D] / [K*H, D]   (+ bias when ``qkv_bias``)
    layers_{i}/attn/o/weight              [D, N*H]
    layers_{i}/attn/{q,k}_norm/scale      [H]                   (only when ``qk_norm``)
    layers_{i}/post_attn_norm/scale       [D]                   (only when ``post_norms``)
    layers_{i}/mlp_norm/scale             [D]
    layers_{i}/post_mlp_norm/scale        [D]                   (only when ``post_norms``)
    layers_{i}/mlp/{gate,up}/weight       [F, D];  layers_{i}/mlp/down/weight [D, F]
    final_norm/scale                      [D]
    lm_head/weight                        [V, D]  (absent when ``tie_embeddings``: logits = x @ embed.T)

Linear layers run through ``blockspec_jax.kernels.linear`` with ``config.matmul`` ("auto": a streaming CPU kernel
for passes of at most ``KERNEL_MAX_TOKENS`` = 16 tokens per row (decode steps, verify passes), whatever the batch;
XLA's dot for longer prefill, on GPU/TPU and under multi-device meshes).

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

from blockspec_jax import kernels

__all__ = ["DecoderConfig", "KVCache", "init_cache", "causal_mask", "apply_rotary", "Decoder", "head_logits",
           "init_params"]

ROPE_STYLES = ("interleaved", "half")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
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
  # Gemma 3 options; the defaults reproduce llama / qwen2 exactly.
  qk_norm: bool = False  # RMSNorm of each q / k head over head_dim (before rotary): attn/{q,k}_norm/scale
  post_norms: bool = False  # RMSNorm of the attention and MLP outputs before the residual add
  norm_plus_one: bool = False  # every RMSNorm multiplies by (1 + scale) instead of scale (HF Gemma weights)
  embed_scale: bool = False  # multiply embeddings by sqrt(d_model) (in the compute dtype)
  mlp_activation: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gelu_pytorch_tanh)
  query_scale: float | None = None  # attention score scale; None = head_dim ** -0.5
  sliding_window: int | None = None  # local layers see slots s with position - s < sliding_window
  layer_types: tuple[str, ...] | None = None  # per layer "full" / "sliding"; None = all "full"
  rope_theta_local: float | None = None  # rotary base of "sliding" layers; None = rope_theta
  matmul: str = "auto"  # linear-layer implementation, one of kernels.IMPLS ("auto", "xla", "kernel")

  def __post_init__(self):
    if self.layer_types is not None:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))  # JSON round trips give lists
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
      bad = [t for t in self.layer_types if t not in LAYER_TYPES]
      if bad:
        raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {bad[0]!r}")
      if "sliding" in self.layer_types and self.sliding_window is None:
        raise ValueError("layer_types has sliding layers but sliding_window is None")
    if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                            or not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
      raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
    if self.matmul not in kernels.IMPLS:
      raise ValueError(f"matmul must be one of {kernels.IMPLS}, got {self.matmul!r}")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got {self.mlp_activation!r}")
    if self.query_scale is not None and not self.query_scale > 0:
      raise ValueError(f"query_scale must be > 0 or None, got {self.query_scale}")
    if self.rope_theta_local is not None and not self.rope_theta_local > 0:
      raise ValueError(f"rope_theta_local must be > 0 or None, got {self.rope_theta_local}")
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

  def layer_type(self, i: int) -> str:
    """"full" or "sliding" for layer ``i``."""
    return "full" if self.layer_types is None else self.layer_types[i]

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

  def move_slots(self, src_BxM: jax.Array, dst_BxM: jax.Array, valid_BxM: jax.Array) -> "KVCache":
    """Copy every layer's entries of slots ``src_BxM`` to slots ``dst_BxM`` where ``valid_BxM`` (a tree's path
    commit). All sources are gathered before any write, so a destination may be another move's source."""
    rows_Bx1 = jnp.arange(src_BxM.shape[0], dtype=jnp.int32)[:, None]
    dst_BxM = jnp.where(valid_BxM, dst_BxM, self.max_len)  # invalid moves write out of range and are dropped

    def move(x_LxBxSxKxH):
      moved_LxBxMxKxH = x_LxBxSxKxH[:, rows_Bx1, src_BxM]
      return x_LxBxSxKxH.at[:, rows_Bx1, dst_BxM].set(moved_LxBxMxKxH, mode="drop")

    return KVCache(move(self.k_LxBxSxKxH), move(self.v_LxBxSxKxH))


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
  """x * rsqrt(mean(x^2) + eps) * scale (or * (1 + scale) with ``plus_one``) over the last axis, in float32."""
  eps: float
  dtype: Any = jnp.float32
  plus_one: bool = False

  @nn.compact
  def __call__(self, x_BxTxD):
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale_D = self.param("scale", init, (x_BxTxD.shape[-1],), jnp.float32).astype(jnp.float32)
    if self.plus_one:
      scale_D = 1.0 + scale_D
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale_D.reshape((1,) * (x.ndim - 1) + scale_D.shape)).astype(self.dtype)


class Linear(nn.Module):
  """``x @ weight.T (+ bias)`` with ``weight`` [features, in] (out, in); float32 parameters, ``dtype`` output."""
  features: int
  use_bias: bool = False
  dtype: Any = jnp.float32
  impl: str = "auto"

  @nn.compact
  def __call__(self, x_BxTxI):
    weight_FxI = self.param("weight", nn.initializers.lecun_normal(in_axis=-1, out_axis=-2),
                            (self.features, x_BxTxI.shape[-1]), jnp.float32)
    y_BxTxF = kernels.linear(x_BxTxI, weight_FxI, impl=self.impl, dtype=self.dtype)
    if self.use_bias:
      bias_F = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
      y_BxTxF = y_BxTxF + bias_F.astype(self.dtype).reshape((1,) * (y_BxTxF.ndim - 1) + bias_F.shape)
    return y_BxTxF


class Attention(nn.Module):
  """Grouped-query attention over all S cache slots with an explicit mask; writes the new k/v first."""
  config: DecoderConfig
  sliding: bool = False  # local layer: rope_theta_local and the sliding-window mask

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, slots_BxT, k_BxSxKxH, v_BxSxKxH, attn_mask_BxTxS):
    cfg = self.config
    b, t, _ = x_BxTxD.shape
    n, kh, h, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
    dense = lambda feats, name, bias: Linear(feats, bias, cfg.dtype, cfg.matmul, name=name)
    q_BxTxNxH = dense(n * h, "q", cfg.qkv_bias)(x_BxTxD).reshape(b, t, n, h)
    k_BxTxKxH = dense(kh * h, "k", cfg.qkv_bias)(x_BxTxD).reshape(b, t, kh, h)
    v_BxTxKxH = dense(kh * h, "v", cfg.qkv_bias)(x_BxTxD).reshape(b, t, kh, h)
    if cfg.qk_norm:
      q_BxTxNxH = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.norm_plus_one, name="q_norm")(q_BxTxNxH)
      k_BxTxKxH = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.norm_plus_one, name="k_norm")(k_BxTxKxH)
    theta = cfg.rope_theta
    if self.sliding and cfg.rope_theta_local is not None:
      theta = cfg.rope_theta_local
    q_BxTxNxH = apply_rotary(q_BxTxNxH, positions_BxT, theta, cfg.rope_style)
    k_BxTxKxH = apply_rotary(k_BxTxKxH, positions_BxT, theta, cfg.rope_style)

    k_BxSxKxH = _write_slots(k_BxSxKxH, k_BxTxKxH, slots_BxT)
    v_BxSxKxH = _write_slots(v_BxSxKxH, v_BxTxKxH, slots_BxT)

    scale = h ** -0.5 if cfg.query_scale is None else cfg.query_scale
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, g, h)  # query head n = kv head (n // g), as in HF repeat_kv
    scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH.astype(jnp.float32),
                                  k_BxSxKxH.astype(jnp.float32)) * scale
    if self.sliding:
      slots_S = jnp.arange(k_BxSxKxH.shape[1], dtype=jnp.int32)
      attn_mask_BxTxS = attn_mask_BxTxS & (positions_BxT[:, :, None] - slots_S[None, None, :] < cfg.sliding_window)
    mask_Bx1x1xTxS = attn_mask_BxTxS[:, None, None, :, :]
    scores_BxKxGxTxS = jnp.where(mask_Bx1x1xTxS, scores_BxKxGxTxS, _MASK_VALUE)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1)
    # A fully masked query row attends to nothing (zero output) instead of averaging every slot.
    probs_BxKxGxTxS = jnp.where(mask_Bx1x1xTxS, probs_BxKxGxTxS, 0.0)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxH.astype(jnp.float32))
    out_BxTxD = dense(cfg.d_model, "o", False)(out_BxTxKxGxH.reshape(b, t, n * h).astype(cfg.dtype))
    return out_BxTxD, k_BxSxKxH, v_BxSxKxH


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU (tanh-approximated gelu) with ``mlp_activation="gelu_tanh"``."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, x_BxTxD, delta_BxTxF=None):
    cfg = self.config
    dense = lambda feats, name: Linear(feats, False, cfg.dtype, cfg.matmul, name=name)
    gate_BxTxF = dense(cfg.ffn_dim, "gate")(x_BxTxD)
    up_BxTxF = dense(cfg.ffn_dim, "up")(x_BxTxD)
    if delta_BxTxF is not None:  # steering bias inside the MLP (SD²); skipped entirely when absent
      up_BxTxF = up_BxTxF + delta_BxTxF.astype(up_BxTxF.dtype)
    if cfg.mlp_activation == "gelu_tanh":
      act_BxTxF = jax.nn.gelu(gate_BxTxF, approximate=True)
    else:
      act_BxTxF = nn.silu(gate_BxTxF)
    return dense(cfg.d_model, "down")(act_BxTxF * up_BxTxF)


class Block(nn.Module):
  """Pre-norm transformer layer (with ``post_norms``, the sublayer outputs are normalised too)."""
  config: DecoderConfig
  sliding: bool = False

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, slots_BxT, k_BxSxKxH, v_BxSxKxH, attn_mask_BxTxS, mlp_delta_BxTxF=None):
    cfg = self.config
    norm = lambda name: RMSNorm(cfg.rms_eps, cfg.dtype, cfg.norm_plus_one, name=name)
    h_BxTxD = norm("attn_norm")(x_BxTxD)
    attn_BxTxD, k_BxSxKxH, v_BxSxKxH = Attention(cfg, self.sliding, name="attn")(
        h_BxTxD, positions_BxT, slots_BxT, k_BxSxKxH, v_BxSxKxH, attn_mask_BxTxS)
    if cfg.post_norms:
      attn_BxTxD = norm("post_attn_norm")(attn_BxTxD)
    x_BxTxD = x_BxTxD + attn_BxTxD
    h_BxTxD = norm("mlp_norm")(x_BxTxD)
    mlp_BxTxD = MLP(cfg, name="mlp")(h_BxTxD, mlp_delta_BxTxF)
    if cfg.post_norms:
      mlp_BxTxD = norm("post_mlp_norm")(mlp_BxTxD)
    x_BxTxD = x_BxTxD + mlp_BxTxD
    return x_BxTxD, k_BxSxKxH, v_BxSxKxH


class Decoder(nn.Module):
  """Decoder-only LM; see the module docstring for the call contract and the parameter tree."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, cache: KVCache, attn_mask_BxTxS, return_hidden: bool = False,
               slots_BxT=None, tap_layers: tuple[int, ...] = (), mlp_delta_LxBxTxF=None):
    """Returns ``(logits_BxTxV f32, new_cache)`` or ``(logits_BxTxV, new_cache, hidden_BxTxD)``; with
    ``tap_layers`` also ``taps_BxTxLxD`` (the residual stream after each listed layer) as a 4th output.

    ``slots_BxT`` (default: ``positions_BxT``) are the cache slots the new keys/values go to; tree drafts write
    node ``n`` at its own slot while rotating it by its depth's position (see blockspec_jax.decoding.contracts).
    """
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
    slots_BxT = positions_BxT if slots_BxT is None else jnp.asarray(slots_BxT).astype(jnp.int32)
    if slots_BxT.shape != (b, t):
      raise ValueError(f"slots_BxT shape {slots_BxT.shape} != tokens shape {(b, t)}")
    attn_mask_BxTxS = attn_mask_BxTxS.astype(jnp.bool_)
    tap_layers = tuple(tap_layers)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.num_layers for i in tap_layers):
      raise ValueError(f"tap_layers must be layer indices in [0, {cfg.num_layers}), got {tap_layers}")
    if mlp_delta_LxBxTxF is not None:
      shape = mlp_delta_LxBxTxF.shape
      if len(shape) != 4 or shape[0] != cfg.num_layers or shape[1] != b or shape[2] not in (1, t) \
          or shape[3] != cfg.ffn_dim:
        raise ValueError(f"mlp_delta_LxBxTxF must be [L = {cfg.num_layers}, B = {b}, T = {t} or 1, F = "
                         f"{cfg.ffn_dim}], got {shape}")

    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=jnp.float32,
                     embedding_init=nn.initializers.normal(stddev=0.02), name="embed")
    x_BxTxD = embed(tokens_BxT)
    if cfg.embed_scale:
      x_BxTxD = x_BxTxD * jnp.asarray(cfg.d_model ** 0.5, dtype=x_BxTxD.dtype)
    k_LxBxSxKxH, v_LxBxSxKxH = cache.k_LxBxSxKxH, cache.v_LxBxSxKxH
    taps = {}
    for i in range(cfg.num_layers):
      delta_BxTxF = None if mlp_delta_LxBxTxF is None else mlp_delta_LxBxTxF[i]
      x_BxTxD, k_BxSxKxH, v_BxSxKxH = Block(cfg, cfg.layer_type(i) == "sliding", name=f"layers_{i}")(
          x_BxTxD, positions_BxT, slots_BxT, k_LxBxSxKxH[i], v_LxBxSxKxH[i], attn_mask_BxTxS, delta_BxTxF)
      k_LxBxSxKxH = k_LxBxSxKxH.at[i].set(k_BxSxKxH)
      v_LxBxSxKxH = v_LxBxSxKxH.at[i].set(v_BxSxKxH)
      if i in tap_layers:
        taps[i] = x_BxTxD
    hidden_BxTxD = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.norm_plus_one, name="final_norm")(x_BxTxD)
    if cfg.tie_embeddings:  # the embedding table [V, D] is already an (out, in) weight
      logits_BxTxV = kernels.linear(hidden_BxTxD, embed.embedding, impl=cfg.matmul, dtype=cfg.dtype)
    else:
      logits_BxTxV = Linear(cfg.vocab_size, False, cfg.dtype, cfg.matmul, name="lm_head")(hidden_BxTxD)
    new_cache = KVCache(k_LxBxSxKxH=k_LxBxSxKxH, v_LxBxSxKxH=v_LxBxSxKxH)
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    if tap_layers:
      taps_BxTxLxD = jnp.stack([taps[i] for i in tap_layers], axis=2)
      return logits_BxTxV, new_cache, hidden_BxTxD, taps_BxTxLxD
    if return_hidden:
      return logits_BxTxV, new_cache, hidden_BxTxD
    return logits_BxTxV, new_cache


def head_logits(config: DecoderConfig, params, hidden_BxTxD: jax.Array) -> jax.Array:
  """f32 [B, T, V]: the LM head alone on final-norm outputs (``return_hidden``), exactly as :class:`Decoder` applies
  it; for callers that need logits at a few positions only (training losses gather the positions first)."""
  weight_VxD = params["embed"]["embedding"] if config.tie_embeddings else params["lm_head"]["weight"]
  return kernels.linear(hidden_BxTxD, weight_VxD, impl=config.matmul, dtype=config.dtype).astype(jnp.float32)


def init_params(config: DecoderConfig, seed: int):
  """Random parameters of ``Decoder(config)`` (Flax's own initialisers, ``key(seed)``): the ``params`` collection.
  Tiny random models for tests and smoke jobs; real weights come from :mod:`blockspec_jax.models.hub`."""
  tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
  return Decoder(config).init(jax.random.key(seed), tokens_1x1, tokens_1x1, init_cache(config, 1, 4),
                              causal_mask(tokens_1x1, 4))["params"]
