"""The process a job runs in: memory, compiled programs, JAX's persistent compilation cache, the first compile's
announcement, and where reports go.

* :func:`peak_rss_gb`, :func:`resident_gb`; :func:`limit_heap_growth` (freed arrays go back to the system: a long
  run's heap does not grow); :func:`release_programs_if_near_map_limit` (drop compiled programs before a long-lived
  process runs out of memory mappings); :func:`backend_compiles` (programs compiled so far: says whether a timed section
  compiled);
* :func:`compiling` (``compiling <label> …`` with a spinner, every first compile says it is compiling);
* :func:`enable_compilation_cache` (JAX's persistent cache, shared safely by several processes);
* :func:`is_main_process` (only process 0 of a multi-host run writes files), :func:`check_output_dir` /
  :func:`check_output_file` (a report or work directory checked writable before any work) and :func:`write_report`.

Core layer: imports nothing of blockspec_jax but ``checks`` and ``paths``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pathlib
import resource
import sys
import threading
import time

from blockspec_jax.checks import UsageError
from blockspec_jax.paths import default_cache_dir

__all__ = ["peak_rss_gb", "resident_gb", "limit_heap_growth", "mapped_regions", "max_mapped_regions",
           "release_programs_if_near_map_limit", "backend_compiles", "compiling", "COMPILE_CACHE_ENV_VAR",
           "COMPILE_CACHE_MAX_BYTES", "enable_compilation_cache", "is_main_process", "sync_processes", "check_output_dir", "check_output_file",
           "write_report", "describe_devices"]


def peak_rss_gb() -> float:
  """Peak resident memory of this process in GB (10^9 bytes); Linux reports ``ru_maxrss`` in KiB."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def resident_gb() -> float:
  """Resident memory of this process now, in GB (10^9 bytes), from ``/proc/self/statm``; :func:`peak_rss_gb` is the
  peak. Linux only."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def limit_heap_growth(mmap_threshold: int = 1 << 20, arenas: int = 1) -> dict[str, int]:
  """Keeps glibc's heap from growing over a long training process; returns the settings made (``{}`` off glibc).

  * ``mallopt(M_MMAP_THRESHOLD, mmap_threshold)``: every block of at least that size is mapped on its own and goes back
    to the system when freed. By default the threshold is dynamic: each freed mapped block raises it, up to 32 MiB,
    and from then on arrays under it (a 0.5B model's weight matrices and optimizer moments are 2-17 MiB each) come
    from the heap, where freed ones stay resident between live ones.
  * ``mallopt(M_ARENA_MAX, arenas)``: glibc gives allocating threads arenas of their own (up to 8 per core); orbax's
    checkpoint saves run in tensorstore's threads, whose arenas fragment, so each save's peak was higher than the last
    (saving one 2.3 GB state 8 times: resident 2.8 -> 4.3 GB with the default arenas, flat at 3.0 GB with one).

  Measured on an SD² run resumed from a checkpoint: 23.3 GB peak before, 18.2 GB with the threshold fixed. The
  arena limit removes the growth over repeated saves in ``eval.bench_train_memory``; on the real run (358M trained
  parameters) saves still raised the peak after it (docs/results/sd2.md). An environment
  setting (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``) stands: that one is not made. Process-wide: called first
  thing by the training command, never by library code."""
  for name, value, least in (("mmap_threshold", mmap_threshold, 4096), ("arenas", arenas, 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
  if not sys.platform.startswith("linux"):
    return {}
  import ctypes
  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):  # not glibc (musl has no mallopt)
    return {}
  made = {}
  for env, option, name, value in (("MALLOC_MMAP_THRESHOLD_", -3, "mmap_threshold", mmap_threshold),
                                   ("MALLOC_ARENA_MAX", -8, "arenas", arenas)):
    if env not in os.environ and mallopt(option, value):
      made[name] = value
  return made


def mapped_regions() -> int | None:
  """How many memory mappings this process holds (lines of ``/proc/self/maps``); None where there is no such file."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return f.read().count(b"\n")
  except OSError:
    return None


def max_mapped_regions() -> int | None:
  """The kernel's per-process limit on memory mappings (``vm.max_map_count``, 65,530 by default); None if unknown."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None


def release_programs_if_near_map_limit(fraction: float = 0.5) -> bool:
  """Drop every compiled program (``jax.clear_caches()``) once this process holds more than ``fraction`` of the
  kernel's limit on memory mappings; True if it did.

  Why: XLA's CPU backend loads each compiled executable's code and data as separate anonymous mappings (about ten for
  a small program, more for a decoding loop), and the jit caches keep every executable alive for the life of the
  process. A process that compiles thousands of programs (a test worker, a sweep over many shapes and settings) grows
  towards ``vm.max_map_count``; when a mapping is refused there, XLA aborts or segfaults inside the next compilation
  or executable load, far from the cause. Released programs are simply compiled again when next called (same
  results), so a process that stays under the limit never pays anything but the ``/proc/self/maps`` read.
  """
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
  count, limit = mapped_regions(), max_mapped_regions()
  if count is None or limit is None or count <= fraction * limit:
    return False
  import gc

  import jax
  jax.clear_caches()
  gc.collect()
  return True


_BACKEND_COMPILES = [0]  # XLA compilations in this process since the first backend_compiles() call


def backend_compiles() -> int:
  """How many programs XLA has compiled in this process since this was first called (a jax.monitoring listener,
  installed once): the difference across a timed section says whether compilation fell inside it."""
  if not getattr(backend_compiles, "installed", False):
    import jax

    def listen(event: str, duration: float, **kwargs) -> None:
      if event == "/jax/core/compile/backend_compile_duration":
        _BACKEND_COMPILES[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    backend_compiles.installed = True
  return _BACKEND_COMPILES[0]


@contextlib.contextmanager
def compiling(label: str, stream=None, when: bool = True):
  """Announce a first (compiling) call: ``compiling <label> …`` with a spinner and the elapsed seconds on a terminal,
  a start and an end line otherwise (logs). ``when`` false: a silent no-op, so a loop writes
  ``with compiling(label, when=i == 0):`` once for its first (compiling) and later calls alike."""
  if not when:
    yield
    return
  stream = sys.stderr if stream is None else stream
  start = time.perf_counter()
  done = threading.Event()
  tty = hasattr(stream, "isatty") and stream.isatty()
  if tty:
    def spin():
      for ch in itertools.cycle("|/-\\"):
        if done.wait(0.25):
          return
        stream.write(f"\rcompiling {label} … {ch} {time.perf_counter() - start:5.1f} s")
        stream.flush()
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
  else:
    stream.write(f"compiling {label} …\n")
    stream.flush()
  try:
    yield
  finally:
    done.set()
    if tty:
      thread.join()
    stream.write(("\r" if tty else "") + f"compiled {label} in {time.perf_counter() - start:.1f} s" + " " * 8 + "\n")
    stream.flush()


COMPILE_CACHE_ENV_VAR = "BLOCKSPEC_JAX_COMPILE_CACHE"


#: The persistent compilation cache's size limit (bytes): setting one turns on JAX's file lock for the directory.
COMPILE_CACHE_MAX_BYTES = 8 << 30


def _add_access_times(path: pathlib.Path) -> None:
  """Give every entry of a cache directory written without a size limit (no ``-atime`` file beside it) the access
  time JAX's eviction reads (its modification time); without it every later write fails. Under the directory's lock,
  as JAX's own reads and writes."""
  import filelock
  with filelock.FileLock(path / ".lockfile"):
    for entry in path.glob("*-cache"):
      atime = path / (entry.name[:-len("-cache")] + "-atime")
      if not atime.exists():
        try:
          atime.write_bytes(int(entry.stat().st_mtime_ns).to_bytes(8, "little"))
        except OSError:
          pass  # the entry went away meanwhile


def enable_compilation_cache(directory: str | os.PathLike | None = None, min_compile_time_s: float = 0.5
                             ) -> pathlib.Path | None:
  """Turn on JAX's persistent compilation cache, so a second run of a job loads its compiled programs from disk.

  ``directory``: explicit path; else ``$BLOCKSPEC_JAX_COMPILE_CACHE``; else ``<cache dir>/jax_compilation``. The
  strings ``""``, ``"0"`` and ``"off"`` (argument or variable) disable it. Programs that compile faster than
  ``min_compile_time_s`` are not written. Returns the directory in use, or None.

  Several processes share the directory (two jobs, or test workers): JAX's cache writes an entry in place and reads
  without a lock unless a size limit is set, so a reader could load a half-written program. A limit
  (:data:`COMPILE_CACHE_MAX_BYTES`, least recently used entries evicted) makes every read and write hold the
  directory's file lock.
  """
  import jax
  if directory is None:
    directory = os.environ.get(COMPILE_CACHE_ENV_VAR)
  if directory is None:
    directory = default_cache_dir() / "jax_compilation"
  if str(directory).strip().lower() in ("", "0", "off", "none"):
    return None
  path = pathlib.Path(directory).expanduser()
  path.mkdir(parents=True, exist_ok=True)
  _add_access_times(path)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_MAX_BYTES)
  return path


def is_main_process() -> bool:
  """Whether this process writes the run's files: always on one host, process 0 of a multi-host run."""
  import jax
  return jax.process_index() == 0


def describe_devices(mesh=None) -> str:
  """What a job runs on, for its first lines: ``"cpu"`` on one device, else e.g. ``"8 cpu devices in 2 processes,
  mesh 8 x 1 (data x model)"``."""
  import jax
  platform = jax.devices()[0].platform
  if jax.device_count() == 1:
    return platform
  text = f"{jax.device_count()} {platform} devices"
  if jax.process_count() > 1:
    text += f" in {jax.process_count()} processes"
  if mesh is not None:
    text += f", mesh {mesh.shape['data']} x {mesh.shape['model']} (data x model)"
  return text


def sync_processes(name: str) -> None:
  """Wait until every process of a multi-host run reaches the barrier ``name`` (the same name in every process);
  nothing on one process. For steps that read a directory another process is about to write."""
  import jax
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def check_output_dir(path, what: str) -> pathlib.Path:
  """Create directory ``path`` if needed and prove it writable (a file created and deleted in it), before any work
  whose results go there; a :class:`UsageError` naming ``what`` and the reason otherwise (a file in its place, no
  permission, a read-only or full disk)."""
  path = pathlib.Path(path)
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    reason = f"{blocker} is a file, not a directory" if blocker is not None else (e.strerror or str(e))
    raise UsageError(f"cannot write {what} {path}: {reason}") from None
  return path


def check_output_file(path, what: str) -> pathlib.Path | None:
  """Check, before any work, that the file ``path`` (None: no file) can be written later: its folder can be created
  and written (:func:`check_output_dir`) and ``path`` is not a directory. A :class:`UsageError` otherwise, so a long
  run never ends in a report it cannot write."""
  if path is None or path == "":
    return None
  path = pathlib.Path(path)
  if path.is_dir():
    raise UsageError(f"cannot write {what} {path}: it is a directory")
  check_output_dir(path.parent, f"the folder of {what}")
  return path


def write_report(path, report: dict) -> pathlib.Path:
  """Write a job's JSON report (indented) to ``path``, creating its folder; returns the path."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2))
  return path
