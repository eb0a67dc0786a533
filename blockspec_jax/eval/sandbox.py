"""Runs untrusted Python (a model's generated code) in a Linux container and talks to it over pipes.

Generated code must not touch the caller's files, processes, network, environment or memory, and must not be able
to forge its own verdict. This module gives it a throw-away container and a narrow channel:

* :class:`Sandbox`: one container running one interpreter. :meth:`Sandbox.load` executes a program's text there
  (module name ``"__candidate__"``, so an ``if __name__ == "__main__":`` block does not run) and :meth:`Sandbox.call`
  calls one of its functions with plain data and returns the result as plain data. Whoever judges the result (e.g. the
  HumanEval test, :mod:`blockspec_jax.eval.humaneval`) runs in the caller, never in the container.
* :func:`encode` / :func:`decode`: the value codec of that channel, tagged JSON (never pickle, never eval): ``None``,
  ``bool``, ``int``, ``float`` (``inf`` and ``nan`` included), ``str``, ``bytes``, ``list``, ``tuple``, ``dict`` (any
  encodable keys), ``set`` and ``frozenset``, exactly these types (no subclasses), with depth and size limits.
* :func:`available`: ``None`` when containment works on this machine, else the reason it does not (probed once per
  process by starting a trial container). Without it :class:`Sandbox` raises :class:`SandboxUnavailable`, unless the
  caller passes ``unsafe_no_sandbox=True``: then the same driver runs as a plain subprocess with resource limits only,
  and an :class:`UnsafeSandboxWarning` says that generated code runs uncontained.

Layers (``docs/SANDBOX.md`` says what each one contains, which limits hold on which kernels, and what is not
contained):

1. Namespaces. ``unshare`` (util-linux) enters new user (the caller's uid mapped to root), mount, pid, network, IPC
   and UTS namespaces and runs the boot program (:mod:`blockspec_jax.eval.sandbox_inside`) in its place (trusted code). That process forks PID 1 of the new
   pid namespace (everything in it dies with PID 1, which dies with its parent) and waits. The network namespace has
   nothing but a loopback that is down; the IPC one no SysV objects or message queues of the caller's.
2. File system. PID 1 builds a new root on a tmpfs: read-only binds of ``/usr`` (``/bin``, ``/lib``, … as the same
   symlinks, or binds), of the interpreter's prefix at its own path, and of ``/dev/null``, ``/dev/zero``,
   ``/dev/random``, ``/dev/urandom``; a read-only ``proc`` of the new pid namespace showing only its processes; a
   64 MiB tmpfs at ``/tmp`` (working directory and ``HOME``). It pivots into that root with ``pivot_root`` (not
   ``chroot``), detaches the old root and remounts the new one read-only: nothing else of the machine's file system
   is reachable, and no descriptor of the caller's files but the captured output's is inherited.
3. Privileges. PID 1 forks the driver, which enters one more user namespace where its uid and gid are 65534, and
   runs the interpreter with ``execve``: a non-zero uid after ``execve`` holds no capabilities at all.
4. System calls and limits. The driver (:mod:`blockspec_jax.eval.sandbox_inside`) lowers its resource limits (address space, CPU time,
   file size, open files, processes; no core files) and installs a seccomp filter (:func:`seccomp_filter`): no new
   processes (threads only), no ``execve``, no ``setsid``, no namespace, mount, ptrace, BPF, keyring, io_uring, memfd
   or SysV/POSIX IPC system calls. One process: its address-space limit is the container's memory limit.
5. The channel. The driver serves ``load`` / ``call`` requests on two pipes of their own; the candidate's ``print``
   goes to a capture file (fds 1 and 2). At worst a candidate forges a return value, which the caller then judges
   like any other; every read and write of the caller has the session's deadline and a size limit.
6. Lifetime. The caller (:class:`Sandbox`) starts ``unshare`` in a session of its own and, on timeout and on close,
   kills PID 1 and then the whole process group, and reaps it: nothing the candidate did outlives
   :meth:`Sandbox.close`.
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from blockspec_jax.eval.sandbox_codec import (MAX_DEPTH, MAX_ITEMS, CodecError, _from_json, _json_loads, _to_json, decode,
                                            encode)
from blockspec_jax.eval.sandbox_inside import _SYSCALLS, _machine, _program_source, seccomp_filter

__all__ = ["MEMORY_LIMIT_BYTES", "FILE_SIZE_LIMIT_BYTES", "TMP_SIZE_BYTES", "MAX_OPEN_FILES", "MAX_TASKS",
           "MAX_FRAME_BYTES", "MAX_DEPTH", "MAX_ITEMS", "SANDBOX_UID", "SandboxUnavailable", "SandboxFailure",
           "CandidateError", "CodecError", "UnsafeSandboxWarning", "Sandbox", "available", "check_available",
           "encode", "decode", "seccomp_filter"]

MEMORY_LIMIT_BYTES = 2 * 1024 ** 3  # RLIMIT_AS of the sandboxed interpreter (its threads share it)
FILE_SIZE_LIMIT_BYTES = 16 * 1024 ** 2  # RLIMIT_FSIZE: any file it writes, its captured output included
TMP_SIZE_BYTES = 64 * 1024 ** 2  # the tmpfs at /tmp, its only writable place
MAX_OPEN_FILES = 64  # RLIMIT_NOFILE
MAX_TASKS = 301  # pid_max of its pid namespace (the kernel's minimum; Linux >= 6.14) and bound of RLIMIT_NPROC
MAX_FRAME_BYTES = 16 * 1024 ** 2  # one protocol message, either way
SANDBOX_UID = 65534  # the candidate's uid (and gid) inside the container
_TAIL_BYTES = 8192  # how much of the end of the captured output is read back
_DETAIL_CHARS = 300
_SETUP_EXIT = 125  # the container's setup failed (its message is on the captured stderr)
_SETUP_TAG = "blockspec-sandbox: setup failed: "
_GRACE_S = 2.0  # how long an exiting container may take to go away by itself before it is killed


class SandboxUnavailable(RuntimeError):
  """Generated code cannot be contained on this machine (the message says why and how to opt out)."""


class SandboxFailure(BaseException):
  """The sandboxed program timed out, crashed, broke the protocol or returned what cannot be encoded.

  ``status``: ``"timeout"`` or ``"error"``; ``detail``: one short line. A BaseException, not an Exception, so that
  judging code that catches ``Exception`` around a call (to accept an expected error) cannot swallow it; the
  :class:`Sandbox` also records it (:attr:`Sandbox.failure`) and raises it again on every later call."""

  def __init__(self, status: str, detail: str):
    super().__init__(f"{status}: {detail}")
    self.status, self.detail = status, detail


class CandidateError(Exception):
  """The sandboxed program raised: ``type_name`` and the first line of its message, as data (``str``: both)."""

  def __init__(self, type_name: str, message: str):
    super().__init__(f"{type_name}: {message}" if message else type_name)
    self.type_name, self.message = type_name, message


class UnsafeSandboxWarning(RuntimeWarning):
  """Generated code runs uncontained (``unsafe_no_sandbox=True``)."""


# ----------------------------------------------------------------------------------------------------------------
# The caller's side.


def _python() -> str:
  """The real interpreter file behind ``sys.executable`` (a venv's python is a symlink, its base a real file)."""
  return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _covered(path: str, roots) -> bool:
  return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _layout():
  """``(mountpoint, [(kind, path, extra), ...])`` of the container's root: what is bound or linked where."""
  layout, binds = [], ["/usr"]
  if not os.path.isdir("/usr"):
    raise SandboxUnavailable("there is no /usr to bind into the container")
  layout.append(("bind", "/usr", None))
  for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(name):
      layout.append(("symlink", name, os.readlink(name)))
    elif os.path.isdir(name):
      layout.append(("bind", name, None))
      binds.append(name)
  python = _python()
  prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix), os.path.dirname(python)}
  for prefix in sorted(prefixes, key=len):
    if not _covered(prefix, binds):
      layout.append(("bind", prefix, None))
      binds.append(prefix)
  for name in ("null", "zero", "random", "urandom"):
    layout.append(("device", "/dev/" + name, None))
  sources = binds + [p for kind, p, _ in layout if kind != "bind"]
  for candidate in ("/tmp", "/mnt", "/media", "/srv", "/run", "/var/tmp", "/opt", "/home"):
    if os.path.isdir(candidate) and not os.path.islink(candidate) and not any(
        _covered(s, [candidate]) for s in sources + [python]):
      return candidate, layout
  raise SandboxUnavailable("no directory to mount the container's root on (none of /tmp, /mnt, … is free)")


_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


class Sandbox:
  """One sandboxed interpreter (module docstring): :meth:`load` a program, :meth:`call` its functions, :meth:`close`.

  ``timeout_s``: wall-clock budget of the whole session from construction (start-up, load and every call); past it
  the next read or write raises ``SandboxFailure("timeout", "timed out after X s")``. Limits: ``memory_bytes``
  (RLIMIT_AS, default :data:`MEMORY_LIMIT_BYTES`), ``cpu_s`` (RLIMIT_CPU, default ``ceil(timeout_s) + 1``; exceeding
  it is a ``"timeout"`` too) and ``file_size_bytes`` (RLIMIT_FSIZE, default :data:`FILE_SIZE_LIMIT_BYTES`).

  ``unsafe_no_sandbox=True`` runs the same driver as a plain subprocess (own session, minimal environment, a
  temporary working directory, the same resource limits; no namespaces, no seccomp) with an
  :class:`UnsafeSandboxWarning`; otherwise :class:`SandboxUnavailable` when :func:`available` gives a reason.

  Errors of :meth:`load` / :meth:`call`: :class:`CandidateError` (the program raised; the session goes on) and
  :class:`SandboxFailure` (timeout, crash, protocol violation, unencodable result; the session is over: every later
  call raises it again, and it stays in :attr:`failure`). :attr:`info`: what the container reported at start-up
  (``uid``, ``contained``, ``seccomp``, ``proc``: ``"subset=pid"``, ``"full"`` or None, ``pid_max``: the thread cap
  or None). Use it as a context manager, or call :meth:`close`.
  """

  def __init__(self, timeout_s: float = 10.0, *, memory_bytes: int = MEMORY_LIMIT_BYTES, cpu_s: int | None = None,
               file_size_bytes: int = FILE_SIZE_LIMIT_BYTES, unsafe_no_sandbox: bool = False, _probing=False):
    if not isinstance(unsafe_no_sandbox, bool):
      raise ValueError(f"unsafe_no_sandbox must be True or False, got {unsafe_no_sandbox!r}")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    self.timeout_s = timeout_s
    self._deadline = time.monotonic() + timeout_s
    self.cpu_s = int(cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1)
    self.failure: SandboxFailure | None = None
    self.info: dict = {}
    self.contained = not unsafe_no_sandbox
    self._proc = self._tmp = self._req_w = self._resp_r = None
    self._next_id = 1
    self._buffer = b""
    if self.contained:
      if not _probing:
        check_available()
    else:
      warnings.warn("unsafe_no_sandbox=True: generated code runs uncontained, as this user, with this user's files, "
                    "network and processes (resource limits only)", UnsafeSandboxWarning, stacklevel=2)
    limits = {"RLIMIT_AS": (memory_bytes, memory_bytes), "RLIMIT_CPU": (self.cpu_s, self.cpu_s + 1),
              "RLIMIT_CORE": (0, 0), "RLIMIT_FSIZE": (file_size_bytes, file_size_bytes)}
    if self.contained:
      limits.update(RLIMIT_NOFILE=(MAX_OPEN_FILES, MAX_OPEN_FILES), RLIMIT_NPROC=(MAX_TASKS, MAX_TASKS))
    self._capture = tempfile.TemporaryFile(prefix="sandbox_output_")
    req_r, self._req_w = os.pipe()
    self._resp_r, resp_w = os.pipe()
    driver = dict(rfd=req_r, wfd=resp_w, limits=limits, max_frame=MAX_FRAME_BYTES, max_depth=MAX_DEPTH,
                  max_items=MAX_ITEMS, setup_tag=_SETUP_TAG, setup_exit=_SETUP_EXIT,
                  filter=seccomp_filter().hex() if self.contained else None,
                  info={"seccomp": self.contained, "contained": self.contained})
    python = _python()
    try:
      if self.contained:
        mountpoint, layout = _layout()
        numbers = _SYSCALLS[_machine()]
        env = dict(_ENV, HOME="/tmp", TMPDIR="/tmp")
        boot = dict(mountpoint=mountpoint, layout=layout, tmp_size=TMP_SIZE_BYTES, pid_max=MAX_TASKS,
                    nr_pivot_root=numbers["pivot_root"], nr_mount_setattr=numbers["mount_setattr"], uid=SANDBOX_UID,
                    python=python, env=env, driver=driver, driver_source=_program_source("driver"),
                    setup_tag=_SETUP_TAG, setup_exit=_SETUP_EXIT)
        cmd = [_unshare(), "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts",
               "--propagation", "private", "--", python, "-I", "-S", "-c", _program_source("boot"),
               json.dumps(boot)]
        cwd = "/"
      else:
        self._tmp = tempfile.TemporaryDirectory(prefix="sandbox_unsafe_")
        env = dict(_ENV, HOME=self._tmp.name, TMPDIR=self._tmp.name)
        cmd = [python, "-I", "-S", "-c", _program_source("driver"), json.dumps(driver)]
        cwd = self._tmp.name
      self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self._capture, stderr=self._capture,
                                    pass_fds=(req_r, resp_w), env=env, cwd=cwd, start_new_session=True)
      self._proc.stdin.close()
    except BaseException:
      self.close()
      raise
    finally:
      os.close(req_r)
      os.close(resp_w)
    try:
      os.set_blocking(self._req_w, False)
      os.set_blocking(self._resp_r, False)
      ready = self._receive(0, started=False)
      if not isinstance(ready.get("ready"), dict):
        self._fail("error", "protocol violation: no ready message")
      self.info = ready["ready"]
    except BaseException:
      self.close()
      raise

  # --- the session

  def load(self, source: str, filename: str = "program.py") -> None:
    """Executes ``source`` in the container as module ``__candidate__``. CandidateError when it raises (a syntax
    error included), SandboxFailure (class docstring)."""
    self._request({"op": "load", "source": source, "filename": filename})

  def call(self, name: str, *args, **kwargs):
    """``name(*args, **kwargs)`` of the loaded program, run in the container: its result, decoded into plain
    built-in types. CandidateError when it raises, SandboxFailure (class docstring)."""
    try:
      payload = {"op": "call", "name": name, "args": _to_json(args, MAX_DEPTH, MAX_ITEMS),
                 "kwargs": _to_json(kwargs, MAX_DEPTH, MAX_ITEMS)}
    except CodecError as e:
      raise ValueError(f"the arguments of {name}() cannot be sent into the sandbox: {e}") from None
    return self._request(payload)

  def output_tail(self, max_bytes: int = _TAIL_BYTES) -> str:
    """The end of what the container wrote on its stdout and stderr (the candidate's prints, setup errors)."""
    f = self._capture
    if f.closed:
      return ""
    size = f.seek(0, os.SEEK_END)
    f.seek(max(size - max_bytes, 0))
    return f.read().decode("utf-8", errors="replace")

  def close(self) -> None:
    """Ends the session: the container is told to exit (end-of-file on its requests), killed with its whole process
    group if it has not exited within a moment, and reaped; the captured output is discarded. Idempotent."""
    if self._req_w is not None:
      os.close(self._req_w)
      self._req_w = None
    if self._proc is not None and self._proc.returncode is None:
      self._wait_exit(_GRACE_S if self.failure is None else 0)
      self._kill()
    if self._resp_r is not None:
      os.close(self._resp_r)
      self._resp_r = None
    if self._tmp is not None:
      self._tmp.cleanup()
      self._tmp = None
    if not self._capture.closed:
      self._capture.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      if hasattr(self, "_capture"):
        self.close()
    except Exception:  # at interpreter exit, modules may be gone already
      pass

  # --- internals

  def _remaining(self) -> float:
    return self._deadline - time.monotonic()

  def _fail(self, status: str, detail: str):
    if self.failure is None:
      self.failure = SandboxFailure(status, detail[:_DETAIL_CHARS])
      self._kill()
    raise self.failure

  def _request(self, payload: dict):
    if self.failure is not None:
      raise self.failure
    if self._req_w is None:
      raise RuntimeError("the sandbox session is closed")
    request_id = self._next_id
    self._next_id += 1
    data = json.dumps(dict(payload, id=request_id), separators=(",", ":")).encode()
    if len(data) > MAX_FRAME_BYTES:
      raise ValueError(f"a request of {len(data)} bytes exceeds the frame limit of {MAX_FRAME_BYTES} bytes")
    self._send(struct.pack(">I", len(data)) + data)
    answer = self._receive(request_id)
    keys = set(answer) - {"id"}
    if keys == {"ok"}:
      try:
        return _from_json(answer["ok"], MAX_DEPTH, MAX_ITEMS)
      except CodecError as e:
        self._fail("error", f"protocol violation: {e}")
    if keys == {"raised"} and isinstance(answer["raised"], list) and len(answer["raised"]) == 2 and all(
        isinstance(s, str) for s in answer["raised"]):
      raise CandidateError(answer["raised"][0][:100], answer["raised"][1][:_DETAIL_CHARS])
    if keys == {"unencodable"} and isinstance(answer["unencodable"], str):
      self._fail("error", f"unencodable result: {answer['unencodable']}")
    self._fail("error", "protocol violation: malformed answer")

  def _send(self, data: bytes) -> None:
    poller = select.poll()
    poller.register(self._req_w, select.POLLOUT)
    while data:
      remaining = self._remaining()
      if remaining <= 0:
        self._fail("timeout", f"timed out after {self.timeout_s:g} s")
      if not poller.poll(max(1, int(remaining * 1000))):
        continue
      try:
        data = data[os.write(self._req_w, data):]
      except BlockingIOError:
        continue
      except BrokenPipeError:
        self._died()

  def _receive(self, request_id: int, started: bool = True) -> dict:
    poller = select.poll()
    poller.register(self._resp_r, select.POLLIN)
    while True:
      if len(self._buffer) >= 4:
        size = struct.unpack(">I", self._buffer[:4])[0]
        if size > MAX_FRAME_BYTES:
          self._fail("error", f"protocol violation: a message of {size} bytes, more than the limit of "
                              f"{MAX_FRAME_BYTES}")
        if len(self._buffer) >= 4 + size:
          frame, self._buffer = self._buffer[4:4 + size], self._buffer[4 + size:]
          try:
            message = _json_loads(frame)
          except CodecError as e:
            self._fail("error", f"protocol violation: {e}")
          if not isinstance(message, dict) or message.get("id") != request_id or type(message["id"]) is not int:
            self._fail("error", "protocol violation: an answer out of turn")
          return message
      remaining = self._remaining()
      if remaining <= 0:
        self._fail("timeout", f"timed out after {self.timeout_s:g} s")
      if not poller.poll(max(1, int(remaining * 1000))):
        continue
      try:
        chunk = os.read(self._resp_r, 1 << 16)
      except BlockingIOError:
        continue
      if not chunk:
        self._died(started)
      self._buffer += chunk

  def _died(self, started: bool = True):
    """The channel closed: how the container ended, as a SandboxFailure."""
    ended = self._wait_exit(min(_GRACE_S, max(self._remaining(), 0.0)))
    if ended is None:
      self._fail("error", "closed its result channel")
    if ended.si_code == os.CLD_EXITED:
      code, signum = ended.si_status, None
      if self.contained and 128 < code < 128 + 65:  # PID 1 reports its child's death by signal N as 128 + N
        signum = code - 128
    else:
      code, signum = None, ended.si_status
    tail = self.output_tail()
    setup = [line[len(_SETUP_TAG):] for line in tail.splitlines() if line.startswith(_SETUP_TAG)]
    if not started or (setup and code == _SETUP_EXIT):
      last = setup[-1] if setup else ((tail.strip().splitlines() or [f"exit code {code}"])[-1])
      self._fail("error", f"the sandbox failed to start: {last}")
    if signum is not None and signum == getattr(signal, "SIGXCPU", None):
      self._fail("timeout", f"CPU time limit of {self.cpu_s} s exceeded")
    if signum is not None:
      self._fail("error", f"killed by {_signal_name(signum)}")
    if code == 0:
      self._fail("error", "exited (code 0) before the check finished")
    self._fail("error", f"exit code {code}")

  def _wait_exit(self, timeout_s: float):
    """The ``os.waitid`` result once the process has exited within ``timeout_s``, else None. The process is not
    reaped, so its process group id stays valid for the kill that follows."""
    end = time.monotonic() + timeout_s
    while True:
      try:
        ended = os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
      except ChildProcessError:  # reaped already (cannot happen while the session holds it)
        return None
      if ended is not None:
        return ended
      if time.monotonic() >= end:
        return None
      time.sleep(0.005)

  def _kill(self) -> None:
    """Kills and reaps the container: its PID 1 first (so that its parent reaps it), then the whole process group."""
    proc = self._proc
    if proc is None or proc.returncode is not None:
      return
    if self.contained:
      try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
          children = [int(p) for p in f.read().split()]
      except (OSError, ValueError):
        children = []
      for child in children:
        try:
          os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
          pass
      if children:
        self._wait_exit(1.0)
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet: the group id is still ours
    except (ProcessLookupError, PermissionError):
      pass
    proc.wait()


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


def _unshare() -> str:
  path = shutil.which("unshare") or ("/usr/bin/unshare" if os.access("/usr/bin/unshare", os.X_OK) else None)
  if path is None:
    raise SandboxUnavailable("the unshare program (util-linux) is not installed")
  return path


_PROBE = """\
import os
def probe():
    try:
        os.fork()
        refused = False
    except PermissionError:
        refused = True
    return [os.getuid(), refused, os.path.exists("/work"), os.access("/", os.W_OK)]
"""
_probe_lock = threading.Lock()
_probe_result: list = []  # [reason or None] once probed


def _probe() -> str | None:
  if not sys.platform.startswith("linux"):
    return f"generated code can only be contained on Linux (this is {sys.platform})"
  if _machine() not in _SYSCALLS:
    return f"no seccomp system-call table for this machine ({_machine()}; known: {', '.join(_SYSCALLS)})"
  try:
    _unshare()
    _layout()
  except SandboxUnavailable as e:
    return str(e)
  try:
    with Sandbox(timeout_s=60.0, _probing=True) as box:
      box.load(_PROBE, filename="probe.py")
      seen = box.call("probe")
  except SandboxUnavailable as e:
    return str(e)
  except SandboxFailure as e:
    return f"a trial sandbox failed: {e.detail}"
  except CandidateError as e:
    return f"a trial sandbox failed: {e}"
  expected = [SANDBOX_UID, True, False, False]
  if seen != expected:
    return f"a trial sandbox is not contained (uid, fork refused, /work visible, / writable: {seen})"
  return None


def available() -> str | None:
  """``None`` when generated code can be contained here, else the reason it cannot (not Linux, an unknown machine,
  no ``unshare``, user namespaces or seccomp disabled, …). Probed once per process by starting a trial sandbox
  (checked: uid 65534, fork refused, the caller's files invisible, the root read-only)."""
  with _probe_lock:
    if not _probe_result:
      _probe_result.append(_probe())
    return _probe_result[0]


def check_available() -> None:
  """Raises :class:`SandboxUnavailable` naming the reason and the opt-out when :func:`available` gives a reason."""
  reason = available()
  if reason is not None:
    raise SandboxUnavailable(f"generated code cannot be contained on this machine: {reason}. Running it anyway, "
                             "uncontained, needs the explicit opt-in unsafe_no_sandbox=True (docs/SANDBOX.md)")
