"""What runs inside the sandbox's container (:mod:`blockspec_jax.eval.sandbox`): the seccomp filter the driver
installs (built here, on the caller's side), and the boot and driver programs, self-contained functions whose source
text (``_program_source``, with the codec of :mod:`blockspec_jax.eval.sandbox_codec`) the container's interpreter
runs. Trusted code: the candidate only ever runs inside the driver, under the filter and limits it set."""

from __future__ import annotations

import functools
import inspect
import platform
import struct

from blockspec_jax.eval.sandbox_codec import CodecError, _from_json, _json_loads, _to_json

__all__ = ["seccomp_filter"]

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
