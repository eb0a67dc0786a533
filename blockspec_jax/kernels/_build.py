"""Building, caching and loading ``linear_cpu.cc`` (the package docstring's "Building"): one build per source,
compiler, flags, jax version and kind of machine, verified by size and SHA-256 before it is loaded, rebuilt once when
it does not match or load, and remembered as failed so later processes fall back at once."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import time
import warnings

import jax

class KernelUnavailable(RuntimeError):
  """The CPU linear kernel could not be built or loaded, or cannot run here (message says why)."""


_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
# CPU features linear_cpu.cc dispatches on at run time (``target`` attributes, no -march): part of the cache key so
# a cache directory shared by different machines keeps one build per kind of machine.
_CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f")


def _machine() -> str:
  """``platform.machine()`` plus the ``_CPU_FEATURES`` that /proc/cpuinfo lists, e.g. "x86_64+avx2+fma"."""
  machine = platform.machine() or "unknown"
  try:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          have = set(line.split(":", 1)[-1].split())
          return "+".join([machine] + [c for c in _CPU_FEATURES if c in have])
  except OSError:
    pass
  return machine


@dataclasses.dataclass(frozen=True)
class _Plan:
  """One build of a source: its key and files (``<stem>-<key>.so`` / ``.json`` / ``.failed`` / ``.lock``)."""
  key: str
  cmd: tuple[str, ...]  # without the output path
  compiler: str  # resolved path
  compiler_version: str
  lib: pathlib.Path  # the library
  meta: pathlib.Path  # sidecar: {"size", "sha256", ...} of the library, written after it
  failed: pathlib.Path  # failure marker: {"error", ...}
  lock: pathlib.Path  # flock'd while checking / building / loading


def _plan(source: pathlib.Path, out_dir: pathlib.Path) -> _Plan:
  """The build of ``source`` with ``$CXX`` (default g++). The key hashes the source, the compiler's resolved path and
  ``--version`` output, the flags, the jax version and ``_machine()``. Raises KernelUnavailable without a compiler."""
  name = os.environ.get("CXX", "g++")
  found = shutil.which(name)
  if found is None:
    raise KernelUnavailable(f"no C++ compiler {name!r} on PATH (set $CXX) to build {source.name}")
  compiler = os.path.realpath(found)
  try:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e:
    raise KernelUnavailable(f"cannot run {compiler} --version: {type(e).__name__}: {e}") from e
  cmd = (compiler, *_FLAGS, "-isystem", jax.ffi.include_dir(), str(source), "-lpthread")
  digest = hashlib.sha256()
  for part in (source.read_bytes(), compiler.encode(), version.encode(), " ".join(_FLAGS).encode(),
               jax.__version__.encode(), _machine().encode()):
    digest.update(len(part).to_bytes(8, "little") + part)
  key = digest.hexdigest()[:16]
  base = out_dir / f"{source.stem}-{key}"
  return _Plan(key, cmd, compiler, version.strip(), base.with_suffix(".so"), base.with_suffix(".json"),
               base.with_suffix(".failed"), base.with_suffix(".lock"))


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
  """An exclusive ``flock`` on ``path`` (no-op where fcntl is missing): one process checks or builds at a time."""
  try:
    import fcntl
  except ImportError:  # not POSIX
    yield
    return
  with open(path, "a+b") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _write_json(path: pathlib.Path, obj: dict) -> None:
  """Write ``obj`` to ``path`` atomically (temporary file + rename)."""
  fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _sha256(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(plan: _Plan) -> bool:
  """The library exists and its size and SHA-256 match the sidecar written when it was built."""
  try:
    meta = json.loads(plan.meta.read_text())
    size = plan.lib.stat().st_size
  except (OSError, ValueError):
    return False
  return isinstance(meta, dict) and meta.get("size") == size and meta.get("sha256") == _sha256(plan.lib)


def _remove(*paths: pathlib.Path) -> None:
  for path in paths:
    path.unlink(missing_ok=True)


def _fail(plan: _Plan, message: str) -> KernelUnavailable:
  """Remember a failed build (the marker makes later processes skip it) and return the error to raise."""
  _write_json(plan.failed, {"error": message, "cmd": list(plan.cmd), "compiler_version": plan.compiler_version,
                            "jax": jax.__version__, "machine": _machine(), "time": time.time()})
  return KernelUnavailable(message)


def _compile(plan: _Plan) -> None:
  """Compile into a temporary file, then rename it to ``plan.lib`` and write the sidecar; a failure writes the
  marker and raises KernelUnavailable."""
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=plan.lib.parent)
  os.close(fd)
  cmd = [*plan.cmd, "-o", tmp]
  try:
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
      raise _fail(plan, f"running {' '.join(cmd)} failed: {type(e).__name__}: {e}") from e
    if proc.returncode != 0:
      raise _fail(plan, f"building {plan.lib.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    size, sha = os.path.getsize(tmp), _sha256(pathlib.Path(tmp))
    os.chmod(tmp, 0o755)  # mkstemp made it private; a shared cache directory needs it readable
    os.replace(tmp, plan.lib)
    _write_json(plan.meta, {"size": size, "sha256": sha, "cmd": list(plan.cmd),
                            "compiler_version": plan.compiler_version, "jax": jax.__version__,
                            "machine": _machine()})
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def open_library(source: pathlib.Path, out_dir: pathlib.Path, load=ctypes.CDLL):
  """``load(path)`` of the built library of ``source``, building it if needed; raises KernelUnavailable.

  Under an exclusive lock on the build's lock file: a failure marker raises at once (unless
  ``BLOCKSPEC_JAX_KERNEL_REBUILD=1``); a cached library is loaded only after its size and SHA-256 match its sidecar
  (a truncated file would crash the process with SIGBUS inside the loader); a library that does not match, or does
  not load, is deleted and rebuilt once (with a warning); a failed build, or a fresh build that does not load,
  writes the failure marker.
  """
  out_dir.mkdir(parents=True, exist_ok=True)
  plan = _plan(source, out_dir)
  forced = os.environ.get("BLOCKSPEC_JAX_KERNEL_REBUILD", "0") == "1"
  with _file_lock(plan.lock):
    if plan.failed.exists() and not forced:
      try:
        error = json.loads(plan.failed.read_text()).get("error", "?")
      except (OSError, ValueError, AttributeError):
        error = "?"
      raise KernelUnavailable(f"an earlier build failed ({plan.failed}; it is retried when the compiler or the "
                              f"source changes, or with BLOCKSPEC_JAX_KERNEL_REBUILD=1): {error}")
    stale = None
    if plan.lib.exists() and not forced:
      if not _verified(plan):
        stale = "does not match the size / SHA-256 recorded when it was built"
      else:
        try:
          return load(str(plan.lib))
        except (OSError, AttributeError) as e:
          stale = f"failed to load ({type(e).__name__}: {e})"
    if stale is not None:
      warnings.warn(f"blockspec_jax: cached kernel library {plan.lib} {stale}; rebuilding it", RuntimeWarning,
                  stacklevel=2)
    _remove(plan.lib, plan.meta, plan.failed)
    _compile(plan)
    try:
      return load(str(plan.lib))
    except (OSError, AttributeError) as e:
      raise _fail(plan, f"the freshly built {plan.lib} failed to load: {type(e).__name__}: {e}") from e
