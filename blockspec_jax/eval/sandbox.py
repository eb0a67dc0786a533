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
   and UTS namespaces and runs :func:`_boot_main` in its place (trusted code). That process forks PID 1 of the new
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
4. System calls and limits. The driver, :func:`_driver_main`, lowers its resource limits (address space, CPU time,
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

import functools
import inspect
import json
import math
import os
import platform
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
MAX_DEPTH = 100  # nesting of one value
MAX_ITEMS = 1_000_000  # values (containers and scalars) in one message
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
# The value codec. These definitions also run inside the container: their source is sent along with the driver
# (_program_source), so they use nothing but the standard library and each other.


class CodecError(ValueError):
  """A value that cannot cross the sandbox channel: a type outside the codec, too deep, too large, or malformed."""


def _to_json(value, max_depth, max_items):
  """``value`` as a JSON-ready tree: None, bools, ints of 64 bits, finite floats and strs as themselves, everything
  else as ``[tag, payload]`` (tags: int, float, bytes, list, tuple, set, frozenset, dict). CodecError otherwise."""
  import base64
  import math
  count = [0]

  def enc(v, depth):
    if depth > max_depth:
      raise CodecError(f"value nested deeper than {max_depth} levels")
    count[0] += 1
    if count[0] > max_items:
      raise CodecError(f"value has more than {max_items} items")
    kind = type(v)
    if v is None or kind is bool or kind is str:
      return v
    if kind is int:
      return v if -2 ** 63 <= v < 2 ** 63 else ["int", format(v, "x")]
    if kind is float:
      return v if math.isfinite(v) else ["float", repr(v)]
    if kind is bytes:
      return ["bytes", base64.b64encode(v).decode("ascii")]
    if kind in (list, tuple, set, frozenset):
      return [kind.__name__, [enc(x, depth + 1) for x in v]]
    if kind is dict:
      return ["dict", [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]]
    raise CodecError(f"cannot encode a value of type {kind.__module__}.{kind.__qualname__}"
                     if kind.__module__ != "builtins" else f"cannot encode a value of type {kind.__qualname__}")

  return enc(value, 0)


def _from_json(tree, max_depth, max_items):
  """The value of a tree made by :func:`_to_json` (only plain built-in types come out). CodecError when malformed."""
  import base64
  import binascii
  count = [0]

  def dec(o, depth):
    if depth > max_depth:
      raise CodecError(f"value nested deeper than {max_depth} levels")
    count[0] += 1
    if count[0] > max_items:
      raise CodecError(f"value has more than {max_items} items")
    kind = type(o)
    if o is None or kind in (bool, int, float, str):
      return o
    if kind is not list or len(o) != 2 or type(o[0]) is not str:
      raise CodecError(f"malformed value: expected a scalar or [tag, payload], got {kind.__name__}")
    tag, payload = o
    if tag == "int" and type(payload) is str and payload.lstrip("-").isalnum():
      try:
        return int(payload, 16)
      except ValueError:
        pass
    elif tag == "float" and payload in ("nan", "inf", "-inf"):
      return float(payload)
    elif tag == "bytes" and type(payload) is str:
      try:
        return base64.b64decode(payload.encode("ascii"), validate=True)
      except (binascii.Error, UnicodeEncodeError):
        pass
    elif tag in ("list", "tuple", "set", "frozenset") and type(payload) is list:
      items = [dec(x, depth + 1) for x in payload]
      if tag == "list":
        return items
      if tag == "tuple":
        return tuple(items)
      try:
        return set(items) if tag == "set" else frozenset(items)
      except TypeError as e:
        raise CodecError(f"malformed {tag}: {e}") from None
    elif tag == "dict" and type(payload) is list:
      out = {}
      for pair in payload:
        if type(pair) is not list or len(pair) != 2:
          raise CodecError("malformed dict: expected [key, value] pairs")
        key = dec(pair[0], depth + 1)
        try:
          out[key] = dec(pair[1], depth + 1)
        except TypeError as e:
          raise CodecError(f"malformed dict: {e}") from None
      return out
    raise CodecError(f"malformed value with tag {tag[:40]!r}")

  return dec(tree, 0)


def _json_loads(data):
  """Strict JSON of a protocol message (no NaN / Infinity literals; numbers past 4300 digits refused). CodecError."""
  import json

  def constant(name):
    raise CodecError(f"malformed JSON: {name} is not allowed")

  try:
    return json.loads(data, parse_constant=constant)
  except (ValueError, RecursionError, UnicodeDecodeError) as e:
    if isinstance(e, CodecError):
      raise
    raise CodecError(f"malformed JSON: {str(e)[:100]}") from None


def encode(value, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS) -> bytes:
  """``value`` as the channel's UTF-8 JSON bytes (tagged JSON; module docstring). CodecError naming the type of a
  value outside the codec (a subclass of a supported type included), or the limit a value exceeds."""
  return json.dumps(_to_json(value, max_depth, max_items), separators=(",", ":")).encode()


def decode(data: bytes | str, max_depth: int = MAX_DEPTH, max_items: int = MAX_ITEMS):
  """The value :func:`encode` made ``data`` from. CodecError for anything malformed (including JSON objects, NaN
  literals, unknown tags, unhashable set members or dict keys) or over the limits."""
  return _from_json(_json_loads(data), max_depth, max_items)


# ----------------------------------------------------------------------------------------------------------------
# The seccomp filter (built here, installed by the driver inside the container).

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# System calls refused with EPERM (a name missing on a machine is left out). clone and clone3 are handled apart.
_DENIED = ("fork", "vfork", "execve", "execveat", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
           "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "keyctl", "add_key",
           "request_key", "userfaultfd", "open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount",
           "fspick", "mount_setattr", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
           "reboot", "swapon", "swapoff", "acct", "setsid", "setpgid", "memfd_create", "memfd_secret",
           "io_uring_setup", "io_uring_enter", "io_uring_register", "open_by_handle_at", "name_to_handle_at",
           "pidfd_getfd", "shmget", "shmat", "shmctl", "msgget", "semget", "mq_open", "syslog", "settimeofday",
           "clock_settime", "adjtimex", "clock_adjtime", "quotactl", "quotactl_fd", "sethostname", "setdomainname",
           "vhangup", "lookup_dcookie", "fanotify_init", "kcmp", "seccomp", "iopl", "ioperm", "uselib",
           "personality")
_SYSCALLS = {
    "x86_64": dict(
        fork=57, vfork=58, clone=56, clone3=435, execve=59, execveat=322, unshare=272, setns=308, mount=165,
        umount2=166, pivot_root=155, chroot=161, ptrace=101, process_vm_readv=310, process_vm_writev=311, bpf=321,
        perf_event_open=298, keyctl=250, add_key=248, request_key=249, userfaultfd=323, open_tree=428,
        open_tree_attr=467, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        init_module=175, finit_module=313, delete_module=176, kexec_load=246, kexec_file_load=320, reboot=169,
        swapon=167, swapoff=168, acct=163, setsid=112, setpgid=109, memfd_create=319, memfd_secret=447,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_by_handle_at=304, name_to_handle_at=303,
        pidfd_getfd=438, shmget=29, shmat=30, shmctl=31, msgget=68, semget=64, mq_open=240, syslog=103,
        settimeofday=164, clock_settime=227, adjtimex=159, clock_adjtime=305, quotactl=179, quotactl_fd=443,
        sethostname=170, setdomainname=171, vhangup=153, lookup_dcookie=212, fanotify_init=300, kcmp=312,
        seccomp=317, iopl=172, ioperm=173, uselib=134, personality=135),
    "aarch64": dict(  # the asm-generic table: no fork, vfork, iopl, ioperm, uselib
        clone=220, clone3=435, execve=221, execveat=281, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41,
        chroot=51, ptrace=117, process_vm_readv=270, process_vm_writev=271, bpf=280, perf_event_open=241,
        keyctl=219, add_key=217, request_key=218, userfaultfd=282, open_tree=428, open_tree_attr=467,
        move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, init_module=105,
        finit_module=273, delete_module=106, kexec_load=104, kexec_file_load=294, reboot=142, swapon=224,
        swapoff=225, acct=89, setsid=157, setpgid=154, memfd_create=279, memfd_secret=447, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, open_by_handle_at=265, name_to_handle_at=264, pidfd_getfd=438,
        shmget=194, shmat=196, shmctl=195, msgget=186, semget=190, mq_open=180, syslog=116, settimeofday=170,
        clock_settime=112, adjtimex=171, clock_adjtime=266, quotactl=60, quotactl_fd=443, sethostname=161,
        setdomainname=162, vhangup=58, lookup_dcookie=18, fanotify_init=262, kcmp=272, seccomp=277,
        personality=92),
}
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_EPERM, _ENOSYS = 1, 38
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, RET|K
_X32_SYSCALL_BIT = 0x40000000


def _machine() -> str:
  machine = platform.machine().lower()
  return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def seccomp_filter(machine: str | None = None) -> bytes:
  """The seccomp BPF program (``struct sock_filter`` array) the driver installs, for ``machine`` (default: this one).

  A system call of another architecture (e.g. 32-bit x86 through ``int 0x80``, or x32 on x86_64) kills the process;
  ``clone`` is allowed only for threads (``CLONE_THREAD`` set, no ``CLONE_NEW*`` flag), ``clone3`` answers ENOSYS (the
  C library then creates threads with ``clone``), the calls in ``_DENIED`` answer EPERM, everything else is allowed.
  ValueError for a machine without a table (only x86_64 and aarch64 have one)."""
  machine = machine or _machine()
  if machine not in _SYSCALLS:
    raise ValueError(f"no seccomp system-call table for the machine {machine!r} (known: {', '.join(_SYSCALLS)})")
  numbers = _SYSCALLS[machine]

  def op(code, k, jt=0, jf=0):
    return struct.pack("=HBBI", code, jt, jf, k)

  prog = [op(_LD_ABS_W, 4), op(_JEQ, _AUDIT_ARCH[machine], 1, 0), op(_RET, _RET_KILL_PROCESS), op(_LD_ABS_W, 0)]
  if machine == "x86_64":
    prog += [op(_JGE, _X32_SYSCALL_BIT, 0, 1), op(_RET, _RET_KILL_PROCESS)]
  for name in _DENIED:
    if name in numbers:
      prog += [op(_JEQ, numbers[name], 0, 1), op(_RET, _RET_ERRNO | _EPERM)]
  prog += [op(_JEQ, numbers["clone3"], 0, 1), op(_RET, _RET_ERRNO | _ENOSYS)]
  prog += [op(_JEQ, numbers["clone"], 0, 5),  # not clone: on to ALLOW
           op(_LD_ABS_W, 16),  # the low 32 bits of args[0] (little-endian), the clone flags
           op(_JSET, _CLONE_THREAD, 0, 2), op(_JSET, _CLONE_NAMESPACES, 1, 0), op(_RET, _RET_ALLOW),
           op(_RET, _RET_ERRNO | _EPERM)]
  prog.append(op(_RET, _RET_ALLOW))
  return b"".join(prog)


# ----------------------------------------------------------------------------------------------------------------
# Code that runs in the container. Each function is self-contained (its imports inside it); _program_source sends
# their source text to the interpreter there.


def _boot_main(settings):
  """The container's first processes (trusted; root of the new user namespace, in new mount/net/IPC/UTS namespaces).

  ``unshare`` runs this in place of itself (no ``--fork``: so ``unshare`` holds no copy of the protocol pipes, whose
  end-of-file then means that the driver is gone). This process forks PID 1 of the new pid namespace and waits for it;
  PID 1 builds the new root (module docstring, layer 2), pivots into it, forks the driver (which becomes uid 65534 of
  one more user namespace and execs the interpreter) and reaps it. Each exits with its child's exit code, a death by
  signal N as exit code 128 + N. A setup failure prints ``setup_tag`` + the reason on stderr and exits
  ``setup_exit``.
  """
  import ctypes
  import json
  import os
  import signal

  def fail(message):
    os.write(2, (settings["setup_tag"] + message + "\n").encode("utf-8", "replace"))
    os._exit(settings["setup_exit"])

  def pass_on(child):
    """Wait for ``child`` and exit as it did (protocol pipes closed first, so only the driver holds them)."""
    for fd in (settings["driver"]["rfd"], settings["driver"]["wfd"]):
      os.close(fd)
    while True:
      try:
        _, status = os.waitpid(child, 0)
        break
      except ChildProcessError:
        os._exit(settings["setup_exit"])
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)

  ms_rdonly, ms_nosuid, ms_nodev, ms_noexec, ms_remount, ms_bind, ms_rec = 1, 2, 4, 8, 32, 4096, 16384
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    init = os.fork()
  except Exception as e:
    fail(f"{type(e).__name__}: {e}")
  if init != 0:
    pass_on(init)
  try:  # PID 1 from here on: dies with the process above (which the caller kills with its group), ...
    if libc.prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:  # PR_SET_PDEATHSIG
      raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # ... and ignores the default-action signals sent from inside
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.syscall.restype = ctypes.c_long

    def checked(result, what):
      if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(source, target, fstype, flags, data=None):
      enc = lambda s: None if s is None else s.encode()  # noqa: E731
      checked(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
              f"mount {source or fstype} on {target}")

    class MountAttr(ctypes.Structure):
      _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                  ("userns_fd", ctypes.c_uint64)]

    def read_only(target, recursive, nodev):
      """Make the bind mount at ``target`` read-only and nosuid (and nodev) (all its submounts when recursive)."""
      attr = MountAttr(1 | 2 | (4 if nodev else 0), 0, 0, 0)  # MOUNT_ATTR_RDONLY | NOSUID | NODEV
      result = libc.syscall(ctypes.c_long(settings["nr_mount_setattr"]), ctypes.c_int(-100),  # AT_FDCWD
                            ctypes.c_char_p(target.encode()), ctypes.c_uint(0x8000 if recursive else 0),  # AT_RECURSIVE
                            ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
      if result == 0:
        return True
      if ctypes.get_errno() != 38:  # ENOSYS: a kernel before 5.12; else a real failure
        checked(-1, f"mount_setattr {target}")
      # MS_REMOUNT keeps only the flags it is given: repeat the ones the kernel locked on the source mount.
      locked = os.statvfs(target).f_flag
      keep = sum(ms for st, ms in ((8, ms_noexec), (1024, 1024), (2048, 2048), (4096, 1 << 21)) if locked & st)
      mount(None, target, None, ms_remount | ms_bind | ms_rdonly | ms_nosuid | (ms_nodev if nodev else 0) | keep)
      return False

    os.umask(0o022)
    root = settings["mountpoint"]
    mount("tmpfs", root, "tmpfs", ms_nosuid | ms_nodev, "size=1m,nr_inodes=1024,mode=755")
    for kind, path, extra in settings["layout"]:
      target = root + path
      if kind == "symlink":
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.symlink(extra, target)
      elif kind == "bind":
        os.makedirs(target, mode=0o755, exist_ok=True)
        mount(path, target, None, ms_bind | ms_rec)
        if not read_only(target, True, True):  # no mount_setattr: its submounts would stay writable; drop them
          libc.umount2(target.encode(), 2)  # MNT_DETACH
          mount(path, target, None, ms_bind)
          read_only(target, False, True)
      elif kind == "device":
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
        mount(path, target, None, ms_bind)
        read_only(target, False, False)
    info = {"proc": None, "pid_max": None}
    proc = root + "/proc"
    os.mkdir(proc, 0o555)
    try:  # a proc of the new pid namespace (the kernel wants the old, fully visible one still there)
      mount("proc", proc, "proc", ms_nosuid | ms_nodev | ms_noexec)
      try:  # per-pid-namespace pid_max (Linux >= 6.14): bounds the container's threads
        with open(proc + "/sys/kernel/pid_max", "w") as f:
          f.write(str(settings["pid_max"]))
        info["pid_max"] = settings["pid_max"]
      except OSError:
        pass
      checked(libc.umount2(proc.encode(), 0), "unmount proc")
      try:  # only the process directories (Linux >= 5.8): no /proc/sys, /proc/kallsyms, ... in the container
        mount("proc", proc, "proc", ms_nosuid | ms_nodev | ms_noexec, "subset=pid")
        info["proc"] = "subset=pid"
      except OSError:
        mount("proc", proc, "proc", ms_nosuid | ms_nodev | ms_noexec)
        info["proc"] = "full"
      mount(None, proc, None, ms_remount | ms_bind | ms_rdonly | ms_nosuid | ms_nodev | ms_noexec)
    except OSError:
      pass  # a proc with masked paths over it (some container runtimes) refuses a new mount: go on without /proc
    checked(libc.sethostname(b"sandbox", ctypes.c_size_t(7)), "sethostname")
    os.mkdir(root + "/tmp", 0o755)
    mount("tmpfs", root + "/tmp", "tmpfs", ms_nosuid | ms_nodev,
          f"size={settings['tmp_size']},nr_inodes=4096,mode=1777")
    host_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # for the driver's uid_map (closed before exec)
    os.chdir(root)
    checked(libc.syscall(ctypes.c_long(settings["nr_pivot_root"]), ctypes.c_char_p(b"."), ctypes.c_char_p(b".")),
            "pivot_root")
    checked(libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
    os.chdir("/")
    mount(None, "/", None, ms_remount | ms_bind | ms_rdonly | ms_nosuid | ms_nodev)
    os.chdir("/tmp")
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
  except Exception as e:
    fail(f"{type(e).__name__}: {e}")

  driver = settings["driver"]
  driver["info"].update(info)
  pid = os.fork()
  if pid == 0:
    try:
      checked(libc.unshare(0x10000000), "unshare(CLONE_NEWUSER)")  # one more user namespace, to drop to 65534

      def write(name, text):
        fd = os.open("self/" + name, os.O_WRONLY, dir_fd=host_proc)
        try:
          os.write(fd, text.encode())
        finally:
          os.close(fd)

      uid = settings["uid"]
      write("setgroups", "deny")
      write("uid_map", f"{uid} 0 1")
      write("gid_map", f"{uid} 0 1")
      os.close(host_proc)
      python = settings["python"]
      os.execve(python, [python, "-I", "-S", "-c", settings["driver_source"], json.dumps(driver)], settings["env"])
    except BaseException as e:  # noqa: B036 (the child must never return into the parent's code)
      fail(f"{type(e).__name__}: {e}")
  os.close(host_proc)
  pass_on(pid)


def _driver_main(settings):
  """The interpreter that runs the candidate (trusted code around untrusted code; uid 65534, no capabilities).

  Lowers its resource limits, installs the seccomp filter (when given), sends ``{"ready": info}`` and serves
  requests until end-of-file: ``{"id", "op": "load", "source", "filename"}`` executes a program as module
  ``__candidate__``; ``{"id", "op": "call", "name", "args", "kwargs"}`` calls one of its functions. Each answer
  carries the request's ``id`` and one of ``"ok"`` (the encoded result), ``"raised"`` ([exception type name, first
  line of its message]) or ``"unencodable"`` (why the result cannot be sent). Frames are a 4-byte big-endian length
  and UTF-8 JSON."""
  import json
  import os
  import struct
  import sys
  import types
  rfd, wfd, max_frame = settings["rfd"], settings["wfd"], settings["max_frame"]
  max_depth, max_items = settings["max_depth"], settings["max_items"]

  def fail(message):
    os.write(2, (settings["setup_tag"] + message + "\n").encode("utf-8", "replace"))
    os._exit(settings["setup_exit"])

  try:
    import resource
  except ImportError:
    resource = None
  if resource is not None:
    for name, (soft, hard) in settings["limits"].items():
      kind = getattr(resource, name, None)
      if kind is None:
        continue
      current = resource.getrlimit(kind)[1]
      if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
      try:
        resource.setrlimit(kind, (soft, hard))
      except (ValueError, OSError) as e:
        if settings["filter"]:  # contained: every limit must hold
          fail(f"setrlimit {name}: {e}")
  if settings["filter"]:
    try:
      import ctypes
      libc = ctypes.CDLL(None, use_errno=True)
      program = bytes.fromhex(settings["filter"])

      class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

      buf = ctypes.create_string_buffer(program, len(program))
      prog = SockFprog(len(program) // 8, ctypes.addressof(buf))
      ulong = ctypes.c_ulong
      if libc.prctl(ctypes.c_int(38), ulong(1), ulong(0), ulong(0), ulong(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
      if libc.prctl(ctypes.c_int(22), ulong(2), ctypes.byref(prog), ulong(0), ulong(0)) != 0:  # SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP): seccomp filters unavailable")
      del buf, prog, libc
    except Exception as e:
      fail(f"{type(e).__name__}: {e}")

  def read_exact(n):
    data = b""
    while len(data) < n:
      chunk = os.read(rfd, n - len(data))
      if not chunk:
        os._exit(0)  # the caller is done (or gone): no waiting for threads the candidate left running
      data += chunk
    return data

  def send(message):
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > max_frame:
      data = json.dumps({"id": message["id"], "unencodable": f"the result takes {len(data)} bytes, more than the "
                         f"limit of {max_frame}"}).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
      data = data[os.write(wfd, data):]

  def first_line(e):
    try:
      return (str(e).splitlines() or [""])[0][:500]
    except BaseException:  # noqa: B036 (a candidate's __str__ may raise anything)
      return "<message could not be printed>"

  module = None
  send({"id": 0, "ready": dict(settings["info"], uid=os.getuid())})
  while True:
    size = struct.unpack(">I", read_exact(4))[0]
    if size > max_frame:
      os._exit(3)
    request = json.loads(read_exact(size))
    answer = {"id": request["id"]}
    try:
      if request["op"] == "load":
        module = types.ModuleType("__candidate__")
        module.__file__ = request["filename"]
        sys.modules["__candidate__"] = module
        code = compile(request["source"], request["filename"], "exec", dont_inherit=True)
        exec(code, module.__dict__)
        answer["ok"] = None
      else:
        if module is None or request["name"] not in module.__dict__:
          raise NameError(f"name {request['name']!r} is not defined")
        args = _from_json(request["args"], max_depth, max_items)
        kwargs = _from_json(request["kwargs"], max_depth, max_items)
        result = module.__dict__[request["name"]](*args, **kwargs)
        try:
          answer["ok"] = _to_json(result, max_depth, max_items)
        except CodecError as e:
          answer["unencodable"] = str(e)
    except BaseException as e:  # noqa: B036 (SystemExit and KeyboardInterrupt of the candidate are answers too)
      answer.pop("ok", None)
      answer["raised"] = [type(e).__name__, first_line(e)]
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    except BaseException:  # noqa: B036
      pass
    try:
      send(answer)
    except MemoryError:
      send({"id": request["id"], "raised": ["MemoryError", ""]})


@functools.lru_cache(maxsize=None)
def _program_source(kind: str) -> str:
  """The source text run with ``python -I -S -c`` in the container: the codec, then the boot or driver function."""
  parts = [CodecError, _to_json, _from_json, _json_loads] + ([_driver_main] if kind == "driver" else [_boot_main])
  source = "\n\n".join(inspect.getsource(p) for p in parts)
  entry = "_driver_main" if kind == "driver" else "_boot_main"
  return f"import json, sys\n\n{source}\n\n{entry}(json.loads(sys.argv[1]))\n"


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
