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

Stacked layout (``scan_layers=True``, the decoding jobs' layout): the ``layers_{i}`` subtrees become one ``layers``
subtree with the same leaves, each stacked over a leading [L] axis (``stack_layers`` / ``unstack_layers`` convert),
and the layers run as one ``nn.scan`` body: a program holds one copy of the layer instead of L, so compile time
stops growing with depth. The body indexes every parameter by its (traced) layer; the CPU kernel reads a layer of a
stacked weight in place, so no weights are copied per iteration; mixed local/global layers look their type up per
iteration. The numbers are those of the unrolled layout, bit for bit (tests/test_scan_layers.py). Conversion, LoRA
and training address layers one by one and use the unrolled layout.

Linear layers run through ``blockspec_jax.kernels.linear`` with ``config.matmul`` ("auto": a streaming CPU kernel
for passes of at most ``KERNEL_MAX_TOKENS`` = 64 tokens per row (decode steps, verify passes), whatever the batch;
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
import numpy as np
from flax import struct

from blockspec_jax import kernels
from blockspec_jax.models import quant
from blockspec_jax.models.stacking import stack_layers, unstack_layers

__all__ = ["DecoderConfig", "KVCache", "init_cache", "causal_mask", "apply_rotary", "Decoder", "head_logits",
           "init_params", "stack_layers", "unstack_layers"]

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
  # Layers as one loop (lax.scan) over stacked parameters ``layers/...`` [L, ...] instead of L unrolled copies
  # ``layers_{i}/...``: a program's size and compile time stop growing with depth; same numbers (see stack_layers).
  scan_layers: bool = False

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
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
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
    commit); an invalid move writes its destination's own entry back. ``dst_BxM`` must hold distinct slots per row
    (slots ``≥ S`` are dropped).

    All sources are read before any write (a gather, then a scatter), so a destination may be another move's source
    (the path commit's ``length + path[j] = length + i`` for some ``j < i``). Invalid moves keep their own in-range
    destination rather than all going to one dropped index: XLA's GPU backend under
    ``--xla_gpu_deterministic_ops=true`` mixes up the values of a dropping scatter whose indices repeat out of range
    (see ``contracts.accepted_path``)."""
    rows_Bx1 = jnp.arange(src_BxM.shape[0], dtype=jnp.int32)[:, None]
    src_BxM = jnp.where(valid_BxM, src_BxM, dst_BxM)

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


def rotary_inv_freq(theta: float, head_dim: int) -> jax.Array:
  """f32 [H/2]: the rotary frequency ``theta^(-2i/H)`` of pair i."""
  return theta ** (-jnp.arange(head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)


def apply_rotary(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float, style: str,
                 inv_freq_P: jax.Array | None = None) -> jax.Array:
  """Rotary embedding of q or k ([B, T, N, H]) at absolute ``positions_BxT``; angles computed in float32.
  ``inv_freq_P``: the pairs' frequencies when given (default ``rotary_inv_freq(theta, H)``)."""
  head_dim = x_BxTxNxH.shape[-1]
  half = head_dim // 2
  if inv_freq_P is None:
    inv_freq_P = rotary_inv_freq(theta, head_dim)  # P = H/2 pairs
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


def _weight_param(module: nn.Module, name: str, init, shape: tuple, stacked: int | None = None):
  """A weight ``shape`` (with ``stacked`` = L: ``[L, *shape]``) of ``module``: ``module.param`` for a float array, or
  the :class:`~blockspec_jax.models.quant.QuantizedTensor` the parameters hold there (GGUF blocks as stored,
  ``hub.load_model(weights="quantized")``; frozen, never initialised here), whose logical shape must be ``shape`` (one
  layer's, the stacked arrays carrying L in front)."""
  if module.has_variable("params", name):
    stored = module.get_variable("params", name)
    if isinstance(stored, quant.QuantizedTensor):
      layers = np.ndim(stored.codes_OxC) - len(stored.shape)
      if tuple(stored.shape) != tuple(shape) or layers != (0 if stacked is None else 1):
        raise ValueError(f"{module.name}/{name}: quantized weight of logical shape {stored.shape} with "
                         f"{layers} stacked axes, expected {shape}" + ("" if stacked is None else
                                                                       f" stacked over {stacked} layers"))
      return stored
  return _param_or_stack(module, name, init, shape, stacked)


def _param_or_stack(module: nn.Module, name: str, init, shape: tuple, stacked: int | None):
  """``module.param`` of ``shape``, or with ``stacked`` = L the stack ``[L, *shape]`` (built by ``stack_layers``,
  never initialised)."""
  if stacked is None:
    return module.param(name, init, shape, jnp.float32)
  return module.param(name, nn.initializers.zeros, (stacked, *shape), jnp.float32)


class Embed(nn.Module):
  """Token embeddings: ``embedding`` [V, D] (float32, or quantized rows, each dequantized as it is looked up);
  ``x_BxTxD = embedding[tokens_BxT]`` in ``dtype``. The same parameter and numbers as ``flax.linen.Embed`` (whose
  initialiser it keeps), plus quantized tables."""
  num_embeddings: int
  features: int
  dtype: Any = jnp.float32

  def setup(self):
    self.embedding = _weight_param(self, "embedding", nn.initializers.normal(stddev=0.02),
                                   (self.num_embeddings, self.features))

  def __call__(self, tokens_BxT):
    if not jnp.issubdtype(tokens_BxT.dtype, jnp.integer):
      raise ValueError(f"token ids must be integers, got {tokens_BxT.dtype}")
    table = self.embedding
    if isinstance(table, quant.QuantizedTensor):  # gather the rows' codes and scales, then dequantize those rows
      rows = jax.tree.map(lambda a: jnp.take(a, tokens_BxT, axis=0), table)
      return quant.dequantize(dataclasses.replace(rows, shape=table.shape[1:])).astype(self.dtype)
    return jnp.take(jnp.asarray(table, self.dtype), tokens_BxT, axis=0)


def _layer_param(module: nn.Module, name: str, init, shape: tuple, stacked: int | None, layer):
  """A parameter of one decoder layer: ``shape`` itself, or with ``stacked`` = L a stack ``[L, *shape]`` of which
  layer ``layer`` (an int32 scalar, traced inside the layer loop) is returned."""
  value = _param_or_stack(module, name, init, shape, stacked)
  return value if stacked is None else jax.lax.dynamic_index_in_dim(value, layer, 0, keepdims=False)


class RMSNorm(nn.Module):
  """x * rsqrt(mean(x^2) + eps) * scale (or * (1 + scale) with ``plus_one``) over the last axis, in float32.
  ``stacked``: the scale of every layer, [L, D], of which ``layer`` is used."""
  eps: float
  dtype: Any = jnp.float32
  plus_one: bool = False
  stacked: int | None = None

  @nn.compact
  def __call__(self, x_BxTxD, layer=None):
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale_D = _layer_param(self, "scale", init, (x_BxTxD.shape[-1],), self.stacked, layer).astype(jnp.float32)
    if self.plus_one:
      scale_D = 1.0 + scale_D
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale_D.reshape((1,) * (x.ndim - 1) + scale_D.shape)).astype(self.dtype)


class Linear(nn.Module):
  """``x @ weight.T (+ bias)`` with ``weight`` [features, in] (out, in); float32 parameters (or a quantized weight,
  :func:`_weight_param`, optionally with a low-rank adapter beside it: ``lora_a`` [r, in] and ``lora_b`` [features, r]
  add ``(x @ lora_a.T) @ lora_b.T``), ``dtype`` output.
  ``stacked``: every layer's weight, [L, features, in], of which ``layer`` is used; the CPU kernel reads that layer in
  place (``kernels.linear(..., layer=)``), so a loop over layers never copies weights."""
  features: int
  use_bias: bool = False
  dtype: Any = jnp.float32
  impl: str = "auto"
  stacked: int | None = None

  @nn.compact
  def __call__(self, x_BxTxI, layer=None):
    shape = (self.features, x_BxTxI.shape[-1])
    weight = _weight_param(self, "weight", nn.initializers.lecun_normal(in_axis=-1, out_axis=-2), shape,
                           self.stacked)
    if self.stacked is None:
      y_BxTxF = kernels.linear(x_BxTxI, weight, impl=self.impl, dtype=self.dtype)
    else:  # the whole stack goes to the kernel, which offsets into it by ``layer``
      y_BxTxF = kernels.linear(x_BxTxI, weight, impl=self.impl, dtype=self.dtype, layer=layer)
    if self.has_variable("params", "lora_a"):  # an adapter beside a quantized weight (train.params.apply_lora)
      a_rxI, b_Fxr = (self.get_variable("params", n) for n in ("lora_a", "lora_b"))
      if self.stacked is not None:
        a_rxI, b_Fxr = (jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False) for w in (a_rxI, b_Fxr))
      low_BxTxr = jnp.einsum("...i,ri->...r", x_BxTxI.astype(jnp.float32), a_rxI.astype(jnp.float32))
      y_BxTxF = y_BxTxF + jnp.einsum("...r,fr->...f", low_BxTxr, b_Fxr.astype(jnp.float32)).astype(self.dtype)
    if self.use_bias:
      bias_F = _layer_param(self, "bias", nn.initializers.zeros, (self.features,), self.stacked, layer)
      y_BxTxF = y_BxTxF + bias_F.astype(self.dtype).reshape((1,) * (y_BxTxF.ndim - 1) + bias_F.shape)
    return y_BxTxF


class Attention(nn.Module):
  """Grouped-query attention over all S cache slots with an explicit mask; writes the new k/v first.
  ``sliding`` (call argument): a local layer (rope_theta_local and the sliding-window mask); a Python bool, or a
  traced bool when layers run in a loop and their types differ."""
  config: DecoderConfig
  stacked: int | None = None

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, slots_BxT, k_BxSxKxH, v_BxSxKxH, attn_mask_BxTxS, sliding=False,
               layer=None):
    cfg = self.config
    b, t, _ = x_BxTxD.shape
    n, kh, h, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size
    dense = lambda feats, name, bias: Linear(feats, bias, cfg.dtype, cfg.matmul, self.stacked, name=name)
    q_BxTxNxH = dense(n * h, "q", cfg.qkv_bias)(x_BxTxD, layer).reshape(b, t, n, h)
    k_BxTxKxH = dense(kh * h, "k", cfg.qkv_bias)(x_BxTxD, layer).reshape(b, t, kh, h)
    v_BxTxKxH = dense(kh * h, "v", cfg.qkv_bias)(x_BxTxD, layer).reshape(b, t, kh, h)
    if cfg.qk_norm:
      q_BxTxNxH = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.norm_plus_one, self.stacked, name="q_norm")(q_BxTxNxH, layer)
      k_BxTxKxH = RMSNorm(cfg.rms_eps, cfg.dtype, cfg.norm_plus_one, self.stacked, name="k_norm")(k_BxTxKxH, layer)
    theta, inv_freq_P = cfg.rope_theta, None
    if cfg.rope_theta_local is not None and not isinstance(sliding, bool):  # per layer, inside the layer loop
      # Both constant tables, then a choice: the frequencies of the unrolled layers, exactly.
      inv_freq_P = jnp.where(sliding, rotary_inv_freq(cfg.rope_theta_local, h), rotary_inv_freq(cfg.rope_theta, h))
    elif cfg.rope_theta_local is not None and sliding:
      theta = cfg.rope_theta_local
    q_BxTxNxH = apply_rotary(q_BxTxNxH, positions_BxT, theta, cfg.rope_style, inv_freq_P)
    k_BxTxKxH = apply_rotary(k_BxTxKxH, positions_BxT, theta, cfg.rope_style, inv_freq_P)

    k_BxSxKxH = _write_slots(k_BxSxKxH, k_BxTxKxH, slots_BxT)
    v_BxSxKxH = _write_slots(v_BxSxKxH, v_BxTxKxH, slots_BxT)

    scale = h ** -0.5 if cfg.query_scale is None else cfg.query_scale
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, g, h)  # query head n = kv head (n // g), as in HF repeat_kv
    scores_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH.astype(jnp.float32),
                                  k_BxSxKxH.astype(jnp.float32)) * scale
    if not isinstance(sliding, bool) or sliding:
      slots_S = jnp.arange(k_BxSxKxH.shape[1], dtype=jnp.int32)
      window_BxTxS = positions_BxT[:, :, None] - slots_S[None, None, :] < cfg.sliding_window
      attn_mask_BxTxS = attn_mask_BxTxS & (window_BxTxS if isinstance(sliding, bool) else (window_BxTxS | ~sliding))
    mask_Bx1x1xTxS = attn_mask_BxTxS[:, None, None, :, :]
    scores_BxKxGxTxS = jnp.where(mask_Bx1x1xTxS, scores_BxKxGxTxS, _MASK_VALUE)
    probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1)
    # A fully masked query row attends to nothing (zero output) instead of averaging every slot.
    probs_BxKxGxTxS = jnp.where(mask_Bx1x1xTxS, probs_BxKxGxTxS, 0.0)
    out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", probs_BxKxGxTxS, v_BxSxKxH.astype(jnp.float32))
    out_BxTxD = dense(cfg.d_model, "o", False)(out_BxTxKxGxH.reshape(b, t, n * h).astype(cfg.dtype), layer)
    return out_BxTxD, k_BxSxKxH, v_BxSxKxH


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU (tanh-approximated gelu) with ``mlp_activation="gelu_tanh"``."""
  config: DecoderConfig
  stacked: int | None = None

  @nn.compact
  def __call__(self, x_BxTxD, delta_BxTxF=None, layer=None):
    cfg = self.config
    dense = lambda feats, name: Linear(feats, False, cfg.dtype, cfg.matmul, self.stacked, name=name)
    gate_BxTxF = dense(cfg.ffn_dim, "gate")(x_BxTxD, layer)
    up_BxTxF = dense(cfg.ffn_dim, "up")(x_BxTxD, layer)
    if delta_BxTxF is not None:  # steering bias inside the MLP (SD²); skipped entirely when absent
      up_BxTxF = up_BxTxF + delta_BxTxF.astype(up_BxTxF.dtype)
    if cfg.mlp_activation == "gelu_tanh":
      act_BxTxF = jax.nn.gelu(gate_BxTxF, approximate=True)
    else:
      act_BxTxF = nn.silu(gate_BxTxF)
    return dense(cfg.d_model, "down")(act_BxTxF * up_BxTxF, layer)


class Block(nn.Module):
  """Pre-norm transformer layer (with ``post_norms``, the sublayer outputs are normalised too), in the form of a
  loop body so that one definition serves both layouts::

      (x_BxTxD, k_LxBxSxKxH, v_LxBxSxKxH), x_out = Block(config)(carry, (layer, delta_BxTxF), positions, slots, mask)

  ``layer``: this layer's index, a Python int for the unrolled layout (parameters ``layers_{i}``), a traced int32
  inside ``nn.scan`` for the stacked one (``stacked`` = L, parameters ``layers`` [L, ...] indexed by it). The layer
  reads and writes its own slice ``layer`` of the caches. ``x_out`` is the residual stream after the layer when
  ``collect`` (taps), else None."""
  config: DecoderConfig
  stacked: int | None = None
  collect: bool = False

  @nn.compact
  def __call__(self, carry, xs, positions_BxT, slots_BxT, attn_mask_BxTxS):
    cfg = self.config
    x_BxTxD, k_LxBxSxKxH, v_LxBxSxKxH = carry
    layer, mlp_delta_BxTxF = xs
    if isinstance(layer, int):
      sliding = cfg.layer_type(layer) == "sliding"
    elif cfg.layer_types is None or len(set(cfg.layer_types)) == 1:
      sliding = cfg.layer_type(0) == "sliding"
    else:  # mixed local and global layers inside the loop: the type is looked up per iteration
      sliding = jnp.asarray([t == "sliding" for t in cfg.layer_types])[layer]
    norm = lambda name: RMSNorm(cfg.rms_eps, cfg.dtype, cfg.norm_plus_one, self.stacked, name=name)
    h_BxTxD = norm("attn_norm")(x_BxTxD, layer)
    attn_BxTxD, k_BxSxKxH, v_BxSxKxH = Attention(cfg, self.stacked, name="attn")(
        h_BxTxD, positions_BxT, slots_BxT, k_LxBxSxKxH[layer], v_LxBxSxKxH[layer], attn_mask_BxTxS, sliding, layer)
    if cfg.post_norms:
      attn_BxTxD = norm("post_attn_norm")(attn_BxTxD, layer)
    x_BxTxD = x_BxTxD + attn_BxTxD
    h_BxTxD = norm("mlp_norm")(x_BxTxD, layer)
    mlp_BxTxD = MLP(cfg, self.stacked, name="mlp")(h_BxTxD, mlp_delta_BxTxF, layer)
    if cfg.post_norms:
      mlp_BxTxD = norm("post_mlp_norm")(mlp_BxTxD, layer)
    x_BxTxD = x_BxTxD + mlp_BxTxD
    carry = (x_BxTxD, k_LxBxSxKxH.at[layer].set(k_BxSxKxH), v_LxBxSxKxH.at[layer].set(v_BxSxKxH))
    return carry, (x_BxTxD if self.collect else None)


class Decoder(nn.Module):
  """Decoder-only LM; see the module docstring for the call contract and the parameter tree."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, cache: KVCache, attn_mask_BxTxS, return_hidden: bool = False,
               slots_BxT=None, tap_layers: tuple[int, ...] = (), mlp_delta_LxBxTxF=None):
    """Returns ``(logits_BxTxV f32, new_cache)`` or ``(logits_BxTxV, new_cache, hidden_BxTxD)``; with
    ``tap_layers`` also ``taps_BxTxLxD`` (the residual stream after each listed layer) as a 4th output.

    ``slots_BxT`` (default: ``positions_BxT``) are the cache slots the new keys/values go to; tree drafts write
    node ``n`` at its own slot while rotating it by its depth's position (see blockspec_jax.contracts).
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

    embed = Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="embed")
    x_BxTxD = embed(tokens_BxT)
    if cfg.embed_scale:
      x_BxTxD = x_BxTxD * jnp.asarray(cfg.d_model ** 0.5, dtype=x_BxTxD.dtype)
    carry = (x_BxTxD, cache.k_LxBxSxKxH, cache.v_LxBxSxKxH)
    taps = {}
    if cfg.scan_layers:  # one loop body over the stacked parameters: compiled once, whatever the depth
      if self.is_initializing():
        raise ValueError("a scan_layers decoder's parameters are the unrolled ones stacked: build them with "
                         "init_params(config, seed) or stack_layers(params, num_layers)")
      layers = nn.scan(Block, variable_broadcast="params", split_rngs={"params": False},
                       in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.num_layers)(
                           cfg, stacked=cfg.num_layers, collect=bool(tap_layers), name="layers")
      xs = (jnp.arange(cfg.num_layers, dtype=jnp.int32), mlp_delta_LxBxTxF)
      carry, x_LxBxTxD = layers(carry, xs, positions_BxT, slots_BxT, attn_mask_BxTxS)
      taps = {i: x_LxBxTxD[i] for i in tap_layers}
    else:
      for i in range(cfg.num_layers):
        delta_BxTxF = None if mlp_delta_LxBxTxF is None else mlp_delta_LxBxTxF[i]
        carry, x_BxTxD = Block(cfg, collect=i in tap_layers, name=f"layers_{i}")(
            carry, (i, delta_BxTxF), positions_BxT, slots_BxT, attn_mask_BxTxS)
        if i in tap_layers:
          taps[i] = x_BxTxD
    x_BxTxD, k_LxBxSxKxH, v_LxBxSxKxH = carry
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
  Tiny random models for tests and smoke jobs; real weights come from :mod:`blockspec_jax.models.hub`. A
  ``scan_layers`` config gets the unrolled layout's parameters, stacked (:func:`stack_layers`): the same model."""
  if config.scan_layers:
    return stack_layers(init_params(dataclasses.replace(config, scan_layers=False), seed), config.num_layers)
  tokens_1x1 = jnp.zeros((1, 1), jnp.int32)
  return Decoder(config).init(jax.random.key(seed), tokens_1x1, tokens_1x1, init_cache(config, 1, 4),
                              causal_mask(tokens_1x1, 4))["params"]
