"""Linear layers for decoding: ``y_MxN = x_MxK @ w_NxK.T`` with a streaming CPU kernel for small M.

    y_MxN = linear(x_MxK, w_NxK, impl="auto", dtype=jnp.float32)

Weights are stored (out, in) = [N, K], as in GGUF and torch. At decode time M (batch rows x new tokens) is 1 for a
step and γ+1 for a verify pass, and a linear layer is memory-bound: it streams N*K weights to do M*N*K multiply-adds.
XLA's CPU dot (Eigen / oneDNN GEMM) packs the weight panel first, so on a 2-core AVX2 machine a pass over 5 tokens
costs 1.5-3x a single-token step, which eats most of what speculative decoding saves. ``linear_cpu.cc`` (an XLA FFI
custom call) streams every weight row once and applies it to all M rows while it is in registers; it also makes each
output bit-identical whatever M is, so a token's logits in a verify pass equal its logits in a single step.

``impl``:
  "auto"   the kernel on CPU when M <= ``KERNEL_MAX_ROWS``, the weights are float32 / bfloat16, the kernel library
           could be built, and the call is not traced under a multi-device mesh (the custom call has no sharding
           rule); XLA's dot otherwise. On GPU/TPU ``lax.platform_dependent`` selects XLA's dot.
  "xla"    always ``jnp.einsum`` in ``dtype`` (what ``flax.linen.Dense`` computes).
  "kernel" like "auto" but raises if the kernel cannot be built (for tests and benchmarks).

The kernel path computes in float32 (bfloat16 weights are widened in registers) and returns ``dtype``; it has a
custom VJP made of XLA dots, so gradients work on either path.

Building: the first use compiles ``linear_cpu.cc`` with the system C++ compiler (``$CXX``, default ``g++``, about
10 s) into ``$BLOCKSPEC_JAX_CACHE/kernels`` (default ``~/.cache/blockspec_jax/kernels``), keyed by the source hash
and the jax version; later processes load the cached library. No compiler, or a failed build, gives one warning and
the XLA path. ``BLOCKSPEC_JAX_KERNEL=0`` disables the kernel. The kernel shares XLA's intra-op thread pool (no
threads of its own); ``BLOCKSPEC_JAX_KERNEL_THREADS`` caps how many of them one call uses.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax.paths import default_cache_dir

__all__ = ["IMPLS", "KERNEL_MAX_ROWS", "KernelUnavailable", "kernel_available", "linear"]

IMPLS = ("auto", "xla", "kernel")
# Above this many rows a GEMM that packs its operands wins (prefill); at or below it the streaming kernel does.
KERNEL_MAX_ROWS = 16
_SOURCE = pathlib.Path(__file__).with_name("linear_cpu.cc")
_TARGETS = {np.dtype(np.float32): "blockspec_jax_linear_f32", np.dtype(jnp.bfloat16): "blockspec_jax_linear_bf16"}


class KernelUnavailable(RuntimeError):
  """The CPU linear kernel could not be built or loaded (message says why)."""


def _cache_dir() -> pathlib.Path:
  return default_cache_dir() / "kernels"


def _build(source: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
  """Compile ``source`` into ``out_dir`` (atomic rename, so concurrent processes are safe); return the .so path."""
  text = source.read_bytes()
  key = hashlib.sha256(text + jax.__version__.encode()).hexdigest()[:16]
  lib = out_dir / f"linear_cpu-{key}.so"
  if lib.exists():
    return lib
  cxx = os.environ.get("CXX", "g++")
  if shutil.which(cxx) is None:
    raise KernelUnavailable(f"no C++ compiler {cxx!r} on PATH (set $CXX) to build {source.name}")
  out_dir.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-w", "-isystem", jax.ffi.include_dir(), str(source),
         "-o", tmp, "-lpthread"]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
      raise KernelUnavailable(f"building {source.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, lib)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
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
      lib = ctypes.CDLL(str(_build(_SOURCE, _cache_dir())))
      jax.ffi.register_ffi_target(_TARGETS[np.dtype(np.float32)], jax.ffi.pycapsule(lib.BsjLinearF32),
                                  platform="cpu")
      jax.ffi.register_ffi_target(_TARGETS[np.dtype(jnp.bfloat16)], jax.ffi.pycapsule(lib.BsjLinearBF16),
                                  platform="cpu")
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
      err = e if isinstance(e, KernelUnavailable) else KernelUnavailable(f"{type(e).__name__}: {e}")
      _state["error"] = err
      raise err
    _state["lib"] = lib
    return lib


def kernel_available(warn: bool = False) -> bool:
  """Whether the CPU kernel is built and registered (building it on first call). ``warn``: warn once if not."""
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
  """float32 [M, N]: the kernel on CPU, XLA's float32 dot on other platforms."""
  return jax.lax.platform_dependent(x_MxK, w_NxK, cpu=_ffi,
                                    default=lambda x, w: _xla(x, w, jnp.float32))


def _kernel_linear_fwd(x_MxK, w_NxK):
  return _kernel_linear(x_MxK, w_NxK), (x_MxK, w_NxK)


def _kernel_linear_bwd(res, g_MxN):
  x_MxK, w_NxK = res
  g_MxN = g_MxN.astype(jnp.float32)
  dx_MxK = (g_MxN @ w_NxK.astype(jnp.float32)).astype(x_MxK.dtype)
  dw_NxK = (g_MxN.T @ x_MxK.astype(jnp.float32)).astype(w_NxK.dtype)
  return dx_MxK, dw_NxK


_kernel_linear.defvjp(_kernel_linear_fwd, _kernel_linear_bwd)


def _under_multidevice_mesh() -> bool:
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  if get is None:
    return False
  mesh = get()
  return mesh is not None and not getattr(mesh, "empty", True) and mesh.size > 1


def linear(x_MxK: jax.Array, w_NxK: jax.Array, *, impl: str = "auto", dtype=jnp.float32) -> jax.Array:
  """``x_MxK @ w_NxK.T`` in ``dtype``; leading dims of ``x`` beyond M are allowed (``[..., K] -> [..., N]``).

  Args:
    x_MxK: activations [..., K].
    w_NxK: weights [N, K] (out, in).
    impl: "auto", "xla" or "kernel" (see the module docstring).
    dtype: compute / result dtype of the XLA path and result dtype of the kernel path.
  Raises:
    ValueError: shapes that do not contract, unknown ``impl``.
    KernelUnavailable: ``impl="kernel"`` and the kernel cannot be built.
  """
  if impl not in IMPLS:
    raise ValueError(f"linear impl must be one of {IMPLS}, got {impl!r}")
  if w_NxK.ndim != 2 or x_MxK.shape[-1] != w_NxK.shape[1]:
    raise ValueError(f"linear: x {x_MxK.shape} and w {w_NxK.shape} do not contract (expected x [..., K], w [N, K])")
  lead = x_MxK.shape[:-1]
  rows = int(np.prod(lead, dtype=np.int64))
  use_kernel = impl != "xla" and np.dtype(w_NxK.dtype) in _TARGETS and not _under_multidevice_mesh()
  if impl == "auto":
    use_kernel = use_kernel and 0 < rows <= KERNEL_MAX_ROWS and kernel_available(warn=True)
  elif impl == "kernel":
    if np.dtype(w_NxK.dtype) not in _TARGETS:
      raise ValueError(f"linear impl='kernel' needs float32 or bfloat16 weights, got {w_NxK.dtype}")
    _load()
    use_kernel = rows > 0
  if not use_kernel:
    return _xla(x_MxK, w_NxK, dtype)
  y_MxN = _kernel_linear(x_MxK.reshape(rows, x_MxK.shape[-1]), w_NxK)
  return y_MxN.reshape(*lead, w_NxK.shape[0]).astype(dtype)
