"""Linear layers for decoding: ``y_MxN = x_MxK @ w_NxK.T`` with a streaming CPU kernel for decode-time passes.

    y_BxTxN = linear(x_BxTxK, w_NxK, impl="auto", dtype=jnp.float32)

Weights are stored (out, in) = [N, K], as in GGUF and torch. At decode time a pass has T = 1 token per row (a step)
or γ+1 (a verify pass), and a linear layer is memory-bound: it streams N*K weights to do B*T*N*K multiply-adds.
XLA's CPU dot (Eigen / oneDNN GEMM) packs the weight panel first, so on a 2-core AVX2 machine a pass over 5 tokens
costs 1.5-3x a single-token step, which eats most of what speculative decoding saves; with bfloat16 weights it also
widens the whole weight matrix on every call. ``linear_cpu.cc`` (an XLA FFI custom call) streams every weight row
once and applies it to all M = B*T rows (tiled in L2-sized blocks of rows and weight rows, any M) while it is in
registers.

Same numbers for a row whatever the pass: the kernel sums every output in one fixed order that depends only on K,
so a row's outputs are bit-identical whatever M, the blocking or the thread split. "auto" picks the kernel by the
tokens per row of the pass (``x.shape[-2] <= KERNEL_MAX_TOKENS``), never by the batch, so a row's linear layers give
the same numbers alone, in a batch of any size, one token at a time or inside a verify pass, for float32 and bfloat16
weights alike. For a float32 model that makes the whole decoder's rows bit-identical (greedy speculative decoding
reproduces autoregressive decoding exactly, at any batch). A bfloat16 compute dtype is not held to that: XLA's
fusions of the bfloat16 operations outside the linear layers (residual sums, norms, the attention operands) depend on
the program's shapes, so a row's bfloat16 numbers may move by bfloat16 rounding with its batch or its pass width
(measured on SmolLM2 in bfloat16: 10 of 12 greedy rows left their batch-of-12 tokens within 48 tokens when decoded
alone; in float32, none). Use float32 where rows must reproduce exactly. Passes longer than
``KERNEL_MAX_TOKENS`` tokens per row (prefill of long prompts; for bfloat16 weights, longer than
``KERNEL_MAX_TOKENS_BF16``) use XLA's GEMM in the kernel's precision (float32 operands and sums, whatever the
compute dtype: a bfloat16 compute dtype over float32 weights never rounds the weights for wide passes only), whose
summation order differs from the kernel's, so their numbers may differ from a narrower pass's by float32 rounding;
a verify pass of γ + 1 <= ``KERNEL_MAX_TOKENS`` tokens never takes it.

Quantized weights: ``w`` may be a ``blockspec_jax.models.quant.QuantizedTensor`` (GGUF codes and per-group scales,
2-D (N, K), or stacked [L, ...] with ``layer=``), recognised by duck typing (``is_quantized``: ``kernels`` sits below
``models`` in the import layers) and used through its ``dequantize`` / ``matmul`` methods on the XLA path. The kernel
streams the codes and scales as stored (0.56-1.25 bytes per weight instead of 4), rebuilds in registers exactly the
float32 weights ``quant.dequantize`` gives (``scale * float(code - zero_point) [+ offset]``: the product is exact, so
one rounding at most, as there) and feeds them to the same micro-kernels, in the same summation order, as float32
weights: ``linear(x, qt, impl="kernel")`` is bit-identical to ``linear(x, dequantize(qt), impl="kernel")``, for every
type in ``QUANT_KERNEL_TYPES`` (all of quant's: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), on every path
(scalar, AVX2, AVX-512), for any M. Every path computes in float32 and returns ``dtype``. "auto" uses the kernel
under the float32 weights' conditions but up to ``KERNEL_MAX_TOKENS_QUANT`` tokens per row (CPU, no multi-device
mesh, the library available) and a type in ``QUANT_KERNEL_TYPES``; otherwise ``quant.quantized_matmul`` (XLA, float32
accumulation), or for a wider pass (prefill) XLA's float32 GEMM on the dequantized weights, as for float32 weights.
"xla" is ``quant.quantized_matmul``; "kernel" raises KernelUnavailable for a type not in ``QUANT_KERNEL_TYPES``.
Gradients: w.r.t. ``x`` through XLA dots on the dequantized weights (trained adapters over a frozen quantized base);
the scales and offsets get theirs through ``dequantize``, the integer codes none.

``impl``:
  "auto"   the kernel when the computation runs on CPU (checked first, so on GPU / TPU the kernel is never built
           or called), the pass has at most ``KERNEL_MAX_TOKENS`` tokens per row (``KERNEL_MAX_TOKENS_BF16`` =
           1024 for bfloat16 weights, whose prefill is faster in the kernel than in XLA's bf16 GEMM), the weights
           are float32 / bfloat16, the call is not traced under a multi-device mesh (the custom call has no sharding
           rule) and the library could be built and loaded; XLA's dot otherwise: in float32 when only the pass's width
           ruled the kernel out (the kernel's precision, see above), else in ``dtype``. The platform is a concrete
           committed input's device, else the ``jax.default_device`` in effect, else ``jax.default_backend()``.
  "xla"    always ``jnp.einsum`` in ``dtype`` (what ``flax.linen.Dense`` computes), on every backend.
  "kernel" the kernel for any width; raises KernelUnavailable off CPU or if the library cannot be built (tests,
           benchmarks).

The kernel path computes in float32 (bfloat16 weights are widened in registers; float32 weights are used as they
are) and returns ``dtype``; it has a custom VJP made of XLA dots, so gradients work on either path.

Building: the first use in a process compiles ``linear_cpu.cc`` with the system C++ compiler (``$CXX``, default
``g++``, about 10 s) into ``<cache>/kernels`` (``blockspec_jax.paths.default_cache_dir()``: ``$BLOCKSPEC_JAX_CACHE``
or ``~/.cache/blockspec_jax``) as ``linear_cpu-<key>.so``. The key hashes the source, the compiler's resolved path
and ``--version`` output, the flags, the jax version and the machine (``platform.machine()`` plus whether
/proc/cpuinfo lists AVX2 / FMA / F16C / AVX-512F, the features the kernel dispatches on at run time; without AVX-512F
the quantized types take the AVX2 loop, without AVX2 / FMA / F16C every type the portable one). Next to the library a
sidecar ``.json``, written after it by atomic rename, records its size and SHA-256; a later process loads the cached
library only when both match (a truncated library would kill the process with SIGBUS inside ``ctypes.CDLL``), and a
library that does not match or does not load is deleted and rebuilt once, with a warning. A failed build writes a
``.failed`` marker holding the error, so later processes fall back at once instead of retrying a 10 s failing build;
the marker is keyed like the library, so a changed compiler or source retries, and ``BLOCKSPEC_JAX_KERNEL_REBUILD=1``
forces a rebuild (ignoring both the marker and a cached library). Checks and builds hold an exclusive ``flock`` on
``linear_cpu-<key>.lock``, so concurrent processes build once. No compiler, a failed build or a library that will not
load gives one warning per process and the XLA path. ``BLOCKSPEC_JAX_KERNEL=0`` disables the kernel. The kernel
shares XLA's intra-op thread pool (no threads of its own); ``BLOCKSPEC_JAX_KERNEL_THREADS`` caps how many of them one
call uses. ``BLOCKSPEC_JAX_KERNEL_GENERIC=1`` forces the portable loop and ``BLOCKSPEC_JAX_KERNEL_NO_AVX512=1`` the
AVX2 one (read once per process; every path gives the same bits).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax.kernels._build import KernelUnavailable, open_library
from blockspec_jax.paths import default_cache_dir

__all__ = ["IMPLS", "KERNEL_MAX_TOKENS", "KERNEL_MAX_TOKENS_BF16", "KERNEL_MAX_TOKENS_QUANT", "QUANT_KERNEL_TYPES",
           "KernelUnavailable", "kernel_available", "is_quantized", "linear"]

IMPLS = ("auto", "xla", "kernel")
# "auto" uses the kernel for passes of at most this many tokens per row (x.shape[-2]: decode steps, verify passes up
# to γ = 63, drafts, short prompts), whatever the batch; longer passes (prefill) use XLA's GEMM. At 17-64 tokens the
# kernel was as fast as XLA's float32 GEMM or faster on this 2-core CPU (0.9-2.6x, SmolLM2 and Qwen 0.5B shapes).
KERNEL_MAX_TOKENS = 64
# bfloat16 weights use the kernel up to this many tokens per row (prefill too): XLA's CPU GEMM in bfloat16 runs at
# 51-135 GFLOP/s for 64-512 tokens against the kernel's 142-163 on this 2-core AVX2 machine (float32 GEMM: 108-195).
KERNEL_MAX_TOKENS_BF16 = 1024
# Quantized weights use the kernel up to this many tokens per row (prompts of up to 256 tokens prefill through it):
# a Q4_K layer of 8960 x 1536 on this 2-core CPU took 11.9 / 23.1 / 43.8 / 90.0 ms at 64 / 128 / 256 / 512 tokens
# in the kernel against 30.3 / 37.7 / 48.2 / 71.8 ms dequantized by XLA then multiplied by its float32 GEMM, which
# also holds the dequantized weights in memory.
KERNEL_MAX_TOKENS_QUANT = 256
_SOURCE = pathlib.Path(__file__).with_name("linear_cpu.cc")
_TARGETS = {np.dtype(np.float32): "blockspec_jax_linear_f32", np.dtype(jnp.bfloat16): "blockspec_jax_linear_bf16"}
# One layer of a stacked [L, N, K] weight, read in place (``linear(..., layer=i)``: layers run in a loop).
_STACKED_TARGETS = {np.dtype(np.float32): "blockspec_jax_linear_stacked_f32",
                    np.dtype(jnp.bfloat16): "blockspec_jax_linear_stacked_bf16"}
# Quantized weights (a blockspec_jax.models.quant.QuantizedTensor, stacked or not): one target for every GGUF type,
# the type passed as the index of its name here (the order of kQuantTypes in linear_cpu.cc).
_QUANT_TARGET = "blockspec_jax_linear_quant"
_QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# The GGUF types the kernel streams as they are stored; any other quantized type takes the XLA path with "auto" and
# raises KernelUnavailable with "kernel". (Today every type blockspec_jax.models.quant holds.)
QUANT_KERNEL_TYPES = _QUANT_TYPES


def _cache_dir() -> pathlib.Path:
  return default_cache_dir() / "kernels"


def _register(lib: ctypes.CDLL) -> ctypes.CDLL:
  """Register the library's FFI handlers with XLA for the CPU platform (AttributeError if a symbol is missing)."""
  handlers = {_TARGETS[np.dtype(np.float32)]: lib.BsjLinearF32, _TARGETS[np.dtype(jnp.bfloat16)]: lib.BsjLinearBF16,
              _STACKED_TARGETS[np.dtype(np.float32)]: lib.BsjLinearStackedF32,
              _STACKED_TARGETS[np.dtype(jnp.bfloat16)]: lib.BsjLinearStackedBF16, _QUANT_TARGET: lib.BsjLinearQuant}
  for name, handler in handlers.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
  return lib


_lock = threading.Lock()
_state: dict = {}


def _load() -> ctypes.CDLL:
  """Build (once per machine), load and register the kernel (once per process); raises KernelUnavailable."""
  with _lock:
    if "lib" in _state:
      return _state["lib"]
    if "error" in _state:
      raise _state["error"]
    try:
      if os.environ.get("BLOCKSPEC_JAX_KERNEL", "1") == "0":
        raise KernelUnavailable("disabled by BLOCKSPEC_JAX_KERNEL=0")
      lib = open_library(_SOURCE, _cache_dir(), load=lambda path: _register(ctypes.CDLL(path)))
    except (KernelUnavailable, OSError) as e:
      err = e if isinstance(e, KernelUnavailable) else KernelUnavailable(f"{type(e).__name__}: {e}")
      _state["error"] = err
      raise err from None
    _state["lib"] = lib
    return lib


def kernel_available(warn: bool = False) -> bool:
  """Whether the CPU kernel is built and registered (building it on first call, whatever the platform: ``linear``
  checks the platform before calling this). ``warn``: warn once per process if not."""
  try:
    _load()
    return True
  except KernelUnavailable as e:
    if warn and not _state.get("warned"):
      _state["warned"] = True
      warnings.warn(f"blockspec_jax CPU linear kernel unavailable, using XLA's dot: {e}", RuntimeWarning,
                    stacklevel=3)
    return False


def _xla(x_MxK, w_NxK, dtype):
  return jnp.einsum("...k,nk->...n", x_MxK.astype(dtype), w_NxK.astype(dtype))


def _ffi(x_MxK, w_NxK):
  target = _TARGETS[np.dtype(w_NxK.dtype)]
  out = jax.ShapeDtypeStruct((x_MxK.shape[0], w_NxK.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x_MxK.astype(jnp.float32), w_NxK)


@jax.custom_vjp
def _kernel_linear(x_MxK, w_NxK):
  """float32 [M, N] from the CPU kernel (only ever called once ``linear`` has found the platform is CPU)."""
  return _ffi(x_MxK, w_NxK)


def _kernel_linear_fwd(x_MxK, w_NxK):
  return _kernel_linear(x_MxK, w_NxK), (x_MxK, w_NxK)


def _kernel_linear_bwd(res, g_MxN):
  x_MxK, w_NxK = res
  g_MxN = g_MxN.astype(jnp.float32)
  dx_MxK = (g_MxN @ w_NxK.astype(jnp.float32)).astype(x_MxK.dtype)
  dw_NxK = (g_MxN.T @ x_MxK.astype(jnp.float32)).astype(w_NxK.dtype)
  return dx_MxK, dw_NxK


_kernel_linear.defvjp(_kernel_linear_fwd, _kernel_linear_bwd)


@jax.custom_vjp
def _kernel_linear_stacked(x_MxK, w_LxNxK, layer):
  """float32 [M, N] = x @ w[layer].T from the CPU kernel, reading layer ``layer`` of ``w`` in place."""
  target = _STACKED_TARGETS[np.dtype(w_LxNxK.dtype)]
  out = jax.ShapeDtypeStruct((x_MxK.shape[0], w_LxNxK.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x_MxK.astype(jnp.float32), w_LxNxK,
                                                                 jnp.asarray(layer, jnp.int32))


def _kernel_linear_stacked_fwd(x_MxK, w_LxNxK, layer):
  return _kernel_linear_stacked(x_MxK, w_LxNxK, layer), (x_MxK, w_LxNxK, layer)


def _kernel_linear_stacked_bwd(res, g_MxN):
  x_MxK, w_LxNxK, layer = res
  w_NxK = jax.lax.dynamic_index_in_dim(w_LxNxK, layer, 0, keepdims=False)
  dx_MxK, dw_NxK = _kernel_linear_bwd((x_MxK, w_NxK), g_MxN)
  dw_LxNxK = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(w_LxNxK), dw_NxK, layer, 0)
  return dx_MxK, dw_LxNxK, np.zeros(np.shape(layer), jax.dtypes.float0)


_kernel_linear_stacked.defvjp(_kernel_linear_stacked_fwd, _kernel_linear_stacked_bwd)


# ---------------------------------------------------------------------------------------------------------------
# Quantized weights. ``kernels`` sits below ``models`` in the import layers, so a QuantizedTensor is recognised by its
# fields and used through its own methods (``dequantize``, ``matmul``), never by importing blockspec_jax.models.quant.

def is_quantized(w) -> bool:
  """Whether ``w`` is a ``blockspec_jax.models.quant.QuantizedTensor`` (duck typing: codes, scales, type, shape)."""
  return all(hasattr(w, name) for name in ("codes_OxC", "scale_OxG", "offset_OxG", "qtype", "shape", "layout",
                                           "dequantize", "matmul"))


def _quant_layer(qt, layer):
  """Layer ``layer`` of a stacked QuantizedTensor (its arrays' leading axis), or ``qt`` itself when not stacked."""
  if np.ndim(qt.codes_OxC) == len(qt.shape):
    return qt
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), qt)


def _ffi_quant(x_MxK, qt, layer):
  offset = qt.scale_OxG if qt.offset_OxG is None else qt.offset_OxG  # not read for the types without an offset
  out = jax.ShapeDtypeStruct((x_MxK.shape[0], qt.shape[0]), jnp.float32)
  call = jax.ffi.ffi_call(_QUANT_TARGET, out, vmap_method="sequential")
  return call(x_MxK.astype(jnp.float32), qt.codes_OxC, qt.scale_OxG, offset, jnp.asarray(layer, jnp.int32),
              qtype=np.int32(_QUANT_TYPES.index(qt.qtype)))


@jax.custom_vjp
def _kernel_linear_quant(x_MxK, qt, layer):
  """float32 [M, N] = x @ dequantize(qt[layer]).T from the CPU kernel, reading the codes and scales in place (layer:
  an int32 scalar, used when the arrays of ``qt`` carry a leading layer axis). Bit-identical to the float32 kernel
  on ``dequantize(qt[layer])``: the kernel builds exactly those float32 weights in registers and sums them in the
  float32 kernel's order."""
  return _ffi_quant(x_MxK, qt, layer)


def _kernel_linear_quant_fwd(x_MxK, qt, layer):
  return _kernel_linear_quant(x_MxK, qt, layer), (x_MxK, qt, layer)


def _kernel_linear_quant_bwd(res, g_MxN):
  """XLA dots on the dequantized weights (float32): dx, and the scales' and offsets' cotangents through
  ``dequantize`` (the integer codes get none) in case a caller differentiates them (frozen weights do not)."""
  x_MxK, qt, layer = res
  g_MxN = g_MxN.astype(jnp.float32)
  w_NxK, pullback = jax.vjp(lambda q: _quant_layer(q, layer).dequantize(), qt)
  dx_MxK = (g_MxN @ w_NxK).astype(x_MxK.dtype)
  (dqt,) = pullback(g_MxN.T @ x_MxK.astype(jnp.float32))
  return dx_MxK, dqt, np.zeros(np.shape(layer), jax.dtypes.float0)


_kernel_linear_quant.defvjp(_kernel_linear_quant_fwd, _kernel_linear_quant_bwd)


def _check_quantized(x_MxK, qt, layer) -> None:
  """ValueError unless ``qt`` is a 2-D (N, K) QuantizedTensor that contracts with ``x`` [..., K], its arrays of the
  layout's dtypes and with one leading (layer) axis exactly when ``layer`` is given."""
  stacked = np.ndim(qt.codes_OxC) - len(qt.shape)
  if len(qt.shape) != 2 or x_MxK.shape[-1] != qt.shape[1] or stacked != (0 if layer is None else 1):
    want = "w [N, K]" if layer is None else "a stack [L, N, K] (arrays with one leading layer axis)"
    raise ValueError(f"linear: x {x_MxK.shape} and a {qt.qtype} QuantizedTensor of shape {qt.shape} (codes "
                     f"{tuple(np.shape(qt.codes_OxC))}) do not contract (expected x [..., K], {want})")
  layout = qt.layout
  arrays = [("codes_OxC", qt.codes_OxC, layout.code_dtype), ("scale_OxG", qt.scale_OxG, layout.scale_dtype)]
  if layout.has_offset:
    arrays.append(("offset_OxG", qt.offset_OxG, layout.scale_dtype))
  for name, array, dtype in arrays:
    if array is None or np.dtype(array.dtype) != np.dtype(dtype):
      raise ValueError(f"linear: a {qt.qtype} QuantizedTensor needs {name} of dtype {np.dtype(dtype).name}, got "
                       f"{None if array is None else np.dtype(array.dtype).name}")


def _linear_quantized(x_MxK, qt, impl: str, dtype, layer):
  """``linear`` for a QuantizedTensor (see ``linear``); every path computes in float32 and returns ``dtype``."""
  _check_quantized(x_MxK, qt, layer)
  lead = x_MxK.shape[:-1]
  rows = int(np.prod(lead, dtype=np.int64))
  tokens = x_MxK.shape[-2] if x_MxK.ndim >= 2 else 1
  use_kernel = False
  if impl == "auto":
    use_kernel = (qt.qtype in QUANT_KERNEL_TYPES and 0 < rows and tokens <= KERNEL_MAX_TOKENS_QUANT
                  and not _under_multidevice_mesh() and _platform(x_MxK) == "cpu" and kernel_available(warn=True))
  elif impl == "kernel":
    if qt.qtype not in QUANT_KERNEL_TYPES:
      raise KernelUnavailable(f"linear impl='kernel': the CPU kernel does not stream {qt.qtype} weights (it does "
                              f"{', '.join(QUANT_KERNEL_TYPES)}); use impl='auto' or 'xla'")
    _kernel_here(x_MxK)
    use_kernel = rows > 0
  if not use_kernel:
    qt_NxK = _quant_layer(qt, layer)
    if impl == "auto" and tokens > KERNEL_MAX_TOKENS_QUANT:  # a wide pass (prefill): XLA's float32 GEMM
      return _xla(x_MxK, qt_NxK.dequantize(), jnp.float32).astype(dtype)
    return qt_NxK.matmul(x_MxK).astype(dtype)
  x_2d = x_MxK.reshape(rows, x_MxK.shape[-1])
  y_MxN = _kernel_linear_quant(x_2d, qt, 0 if layer is None else layer)
  return y_MxN.reshape(*lead, qt.shape[0]).astype(dtype)


def _kernel_here(x_MxK) -> None:
  """``impl="kernel"``: KernelUnavailable unless the product runs on CPU and the library builds and loads."""
  where = _platform(x_MxK)
  if where != "cpu":
    raise KernelUnavailable(f"linear impl='kernel' runs on CPU only; this computation runs on {where!r}")
  _load()


def _under_multidevice_mesh() -> bool:
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  if get is None:
    return False
  mesh = get()
  return mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1


def _platform(x) -> str:
  """The platform ("cpu", "gpu", "tpu", ...) the product with ``x`` runs on: a concrete committed array's device,
  else the ``jax.default_device`` in effect, else ``jax.default_backend()``. (A jitted function whose inputs are
  committed to another platform than the default one is not seen here; the kernel is then left out only if that
  default is not CPU.)"""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and getattr(x, "committed", False):
    return next(iter(x.devices())).platform
  device = jax.config.jax_default_device
  if device is not None:
    return device.split(":")[0] if isinstance(device, str) else device.platform
  return jax.default_backend()


def linear(x_MxK: jax.Array, w_NxK: jax.Array, *, impl: str = "auto", dtype=jnp.float32, layer=None) -> jax.Array:
  """``x_MxK @ w_NxK.T`` in ``dtype``; leading dims of ``x`` beyond M are allowed (``[..., T, K] -> [..., T, N]``).

  Args:
    x_MxK: activations [..., T, K] (T = ``x.shape[-2]``, the tokens per row of the pass; 1 for a 1-D ``x``).
    w_NxK: weights [N, K] (out, in); with ``layer``, a stack [L, N, K] of which layer ``layer`` is used. Or a
      ``QuantizedTensor`` of logical shape (N, K) (with ``layer``: arrays with one leading layer axis), computed in
      float32 whatever the path (module docstring).
    impl: "auto", "xla" or "kernel" (see the module docstring).
    dtype: compute / result dtype of the XLA path and result dtype of the kernel path.
    layer: None, or an int32 scalar (traced inside a loop over layers): the kernel path then reads that layer's
      [N, K] block of the stack in place (no copy of the weights per iteration); the XLA path slices it.
      Same numbers as ``linear(x, w[layer])``.
  Raises:
    ValueError: shapes that do not contract, unknown ``impl``, ``impl="kernel"`` with other than f32 / bf16 /
      quantized weights, a QuantizedTensor whose arrays do not have its layout's dtypes.
    KernelUnavailable: ``impl="kernel"`` and the platform is not CPU, the kernel cannot be built, or a quantized type
      is not in ``QUANT_KERNEL_TYPES``.
  """
  if impl not in IMPLS:
    raise ValueError(f"linear impl must be one of {IMPLS}, got {impl!r}")
  if is_quantized(w_NxK):
    return _linear_quantized(x_MxK, w_NxK, impl, dtype, layer)
  if layer is not None:
    if w_NxK.ndim != 3 or x_MxK.shape[-1] != w_NxK.shape[2]:
      raise ValueError(f"linear: x {x_MxK.shape} and a stacked w {w_NxK.shape} do not contract (expected x [..., K], "
                       "w [L, N, K])")
    w_shape = w_NxK.shape[1:]
  elif w_NxK.ndim != 2 or x_MxK.shape[-1] != w_NxK.shape[1]:
    raise ValueError(f"linear: x {x_MxK.shape} and w {w_NxK.shape} do not contract (expected x [..., K], w [N, K])")
  else:
    w_shape = w_NxK.shape
  lead = x_MxK.shape[:-1]
  rows = int(np.prod(lead, dtype=np.int64))
  tokens = x_MxK.shape[-2] if x_MxK.ndim >= 2 else 1
  use_kernel = kernel_precision = False
  if impl == "auto":
    # The platform is checked before kernel_available(), so on GPU / TPU the kernel is never built. The width test
    # looks at the tokens per row only, never at the batch, so a row's numbers do not depend on its neighbours.
    # A wider pass that other widths of the same layer run in the kernel gets XLA's dot in the kernel's precision
    # (float32 operands and sums), never the compute dtype's: one precision for every width.
    most = KERNEL_MAX_TOKENS_BF16 if np.dtype(w_NxK.dtype) == np.dtype(jnp.bfloat16) else KERNEL_MAX_TOKENS
    kernel_precision = (np.dtype(w_NxK.dtype) in _TARGETS and 0 < rows and not _under_multidevice_mesh()
                        and _platform(x_MxK) == "cpu" and kernel_available(warn=True))
    use_kernel = kernel_precision and tokens <= most
  elif impl == "kernel":
    if np.dtype(w_NxK.dtype) not in _TARGETS:
      raise ValueError(f"linear impl='kernel' needs float32 or bfloat16 weights, got {w_NxK.dtype}")
    _kernel_here(x_MxK)
    use_kernel = rows > 0
  if not use_kernel:
    if layer is not None:
      w_NxK = jax.lax.dynamic_index_in_dim(w_NxK, layer, 0, keepdims=False)
    return _xla(x_MxK, w_NxK, jnp.float32).astype(dtype) if kernel_precision else _xla(x_MxK, w_NxK, dtype)
  x_2d = x_MxK.reshape(rows, x_MxK.shape[-1])
  y_MxN = _kernel_linear(x_2d, w_NxK) if layer is None else _kernel_linear_stacked(x_2d, w_NxK, layer)
  return y_MxN.reshape(*lead, w_shape[0]).astype(dtype)
