"""The sandbox of generated code (blockspec_jax.eval.sandbox) and the escapes it closes in the HumanEval check.

Each escape test runs a hostile answer through ``humaneval.run_check`` and then looks at the world outside: the
files, processes, sockets and environment of this test. These tests were checked to fail against the subprocess-only
check this sandbox replaced, so every hostile program here is also safe to run uncontained: it only touches what the
test set up for it, its forks are bounded, and the memory it takes is address space that is never written (anonymous
``mmap`` mappings, or one allocation too large to succeed). Then: what the contained program sees, the channel's
protocol and value codec, the seccomp program, and the refusal (or explicit unsafe opt-in) where containment is
unavailable.
"""

import math
import os
import pathlib
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

import blockspec_jax
from blockspec_jax.eval import humaneval
from blockspec_jax.eval import sandbox


@pytest.fixture
def contained():
  """Containment tests need namespaces and seccomp: skip with the reason where the machine lacks them (CI has them)."""
  reason = sandbox.available()
  if reason is not None:
    pytest.skip(f"generated code cannot be contained here: {reason}")


def check(program: str, test: str = "def check(candidate):\n    candidate()\n", timeout_s: float = 10.0, **kwargs):
  """``humaneval.run_check`` of ``program`` (defining ``f``) against the trusted ``test``."""
  problem = dict(task_id="escape", entry_point="f", prompt="", test=test)
  return humaneval.run_check(textwrap.dedent(program), problem, timeout_s, **kwargs)


@pytest.fixture
def sessions(monkeypatch):
  """The session ids of the sandboxes this test starts: each starts in a session of its own (its first process's pid)
  and nothing in it may leave that session (setsid / setpgid are refused)."""
  started = []

  class Recording(subprocess.Popen):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      if kwargs.get("start_new_session"):
        started.append(self.pid)

  monkeypatch.setattr(subprocess, "Popen", Recording)
  return started


def left_behind(sessions) -> set[int]:
  """Live processes (zombies left out) in one of ``sessions``: what a sandbox left running. Other tests' sandboxes
  (pytest-xdist workers) are in sessions of their own, so they never show up here."""
  found = set()
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        fields = pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if fields[0] != "Z" and int(fields[3]) in sessions:  # state, ppid, pgrp, session
        found.add(int(entry))
  return found


def settles(condition, seconds: float = 5.0) -> bool:
  """Whether ``condition()`` becomes true within ``seconds`` (a killed process takes a moment to be gone)."""
  end = time.monotonic() + seconds
  while not condition():
    if time.monotonic() > end:
      return False
    time.sleep(0.02)
  return True


def alive(pid: int) -> bool:
  try:
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


# --- the escapes


def test_files_outside_are_neither_written_nor_deleted(contained, tmp_path):
  decoy = tmp_path / "decoy.txt"
  decoy.write_text("precious")
  decoy.chmod(0o644)
  planted = pathlib.Path(blockspec_jax.__file__).parent / "planted_by_generated_code.py"
  program = f"""
      import os
      def f():
          tries = [lambda: os.remove({str(decoy)!r}), lambda: open({str(decoy)!r}, "w").write("overwritten"),
                   lambda: os.chmod({str(decoy)!r}, 0o777), lambda: open({str(tmp_path / "new.txt")!r}, "w"),
                   lambda: open({str(planted)!r}, "w").write("import os  # runs on the next import"),
                   lambda: os.utime(0, (1, 123456789))]  # stdin: once the caller's /dev/null, owned by "its" uid
          done = []
          for attempt in tries:
              try:
                  attempt()
                  done.append("done")
              except OSError as e:
                  done.append(type(e).__name__)
          return done
      """
  null = os.stat("/dev/null")
  try:
    result = check(program, "def check(candidate):\n    assert 'done' not in candidate()\n")
    assert decoy.read_text() == "precious" and decoy.stat().st_mode & 0o777 == 0o644
    assert sorted(tmp_path.iterdir()) == [decoy]
    assert not planted.exists() and int(os.stat("/dev/null").st_mtime) != 123456789
    assert result == dict(passed=True, status="passed", detail=""), result  # every attempt was refused
  finally:
    planted.unlink(missing_ok=True)
    if os.stat("/dev/null").st_mtime_ns != null.st_mtime_ns:  # the uncontained check this replaced: undo
      os.utime("/dev/null", ns=(null.st_atime_ns, null.st_mtime_ns))


def test_environments_outside_are_not_readable(contained, monkeypatch):
  secret = "blockspec-secret-" + os.urandom(8).hex()
  marker = "blockspec-victim-" + os.urandom(6).hex()
  monkeypatch.setenv("BLOCKSPEC_TEST_SECRET", secret)
  # /proc/<pid>/environ shows a process's environment at exec: a child started with the secret holds it there. Only
  # the secret's own entry is ever kept, from the environments of the candidate's parent, this test, the victim (by
  # its pid, and as found by a scan of /proc for its marker) and the candidate itself.
  victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker], env=dict(os.environ))
  program = f"""
      import os
      def f():
          pids = {{"self", str(os.getppid()), "{victim.pid}", "{os.getpid()}"}}
          for entry in (os.listdir("/proc") if os.path.isdir("/proc") else []):
              try:
                  if {marker!r} in open("/proc/" + entry + "/cmdline", "rb").read().decode("latin-1"):
                      pids.add(entry)
              except OSError:
                  pass
          found = [os.environ.get("BLOCKSPEC_TEST_SECRET", "")]
          for pid in sorted(pids):
              try:
                  entries = open("/proc/" + pid + "/environ", "rb").read().decode("latin-1").split("\\0")
              except OSError:
                  continue
              found += [e for e in entries if e.startswith("BLOCKSPEC_TEST_SECRET=")]
          found = " ".join(f for f in found if f)
          print(found)
          return found
      """
  test = "def check(candidate):\n    found = candidate()\n    assert not found, found\n"
  try:
    result = check(program, test)
    assert secret not in result["detail"] and result["status"] == "passed", result
    with sandbox.Sandbox(10) as box:  # nor in what it prints
      box.load(textwrap.dedent(program))
      assert box.call("f") == ""
      assert secret not in box.output_tail()
  finally:
    victim.kill()
    victim.wait()


def test_processes_outside_cannot_be_signalled(contained):
  marker = "blockspec-victim-" + os.urandom(6).hex()
  victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
  received = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
  program = f"""
      import os, signal
      def f():
          for pid in (os.getppid(), {os.getpid()}):
              try:
                  os.kill(pid, signal.SIGTERM)
              except OSError:
                  pass
          targets = {{{victim.pid}}}
          for entry in (os.listdir("/proc") if os.path.isdir("/proc") else []):
              try:
                  if {marker!r} in open("/proc/" + entry + "/cmdline", "rb").read().decode("latin-1"):
                      targets.add(int(entry))
              except (OSError, ValueError):
                  pass
          for pid in targets:
              try:
                  os.kill(pid, signal.SIGKILL)
              except OSError:
                  pass
      """
  try:
    result = check(program)
    time.sleep(0.2)  # a signal, had one been sent, has arrived by now
    assert received == [] and victim.poll() is None and alive(victim.pid)
    assert result["status"] == "passed", result
  finally:
    signal.signal(signal.SIGTERM, previous)
    victim.kill()
    victim.wait()


def test_no_network_not_even_localhost(contained):
  server = socket.create_server(("127.0.0.1", 0))
  abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the abstract namespace belongs to the network ns
  name = "\0blockspec-test-" + os.urandom(6).hex()
  abstract.bind(name)
  abstract.listen(4)
  program = f"""
      import socket
      def f():
          reached = []
          try:
              socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), timeout=2).sendall(b"hello")
              reached.append("tcp")
          except OSError:
              pass
          try:
              unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
              unix.settimeout(2)
              unix.connect({name!r})
              reached.append("unix")
          except OSError:
              pass
          return reached
      """
  try:
    result = check(program, "def check(candidate):\n    assert candidate() == []\n")
    for listener in (server, abstract):
      listener.setblocking(False)
      with pytest.raises(BlockingIOError):
        listener.accept()
    assert result["status"] == "passed", result
  finally:
    server.close()
    abstract.close()


def test_double_fork_and_setsid_are_refused_and_nothing_outlives_the_check(contained, sessions, tmp_path):
  pid_file = tmp_path / "survivor.pid"
  program = f"""
      import os, time
      def f():
          try:
              pid = os.fork()
          except OSError as e:
              return "refused: " + e.strerror
          if pid == 0:
              try:
                  os.setsid()
                  if os.fork() == 0:
                      with open({str(pid_file)!r} + ".tmp", "w") as out:
                          out.write(str(os.getpid()))
                      os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
                      time.sleep(60)
              finally:
                  os._exit(0)
          os.waitpid(pid, 0)
          for _ in range(500):
              if os.path.exists({str(pid_file)!r}):
                  break
              time.sleep(0.01)
          return "forked"
      """
  result = check(program, "def check(candidate):\n    assert candidate() == 'refused: Operation not permitted'\n")
  try:
    assert result == dict(passed=True, status="passed", detail=""), result
    assert not pid_file.exists()
    assert len(sessions) == 1 and settles(lambda: not left_behind(sessions)), left_behind(sessions)
  finally:
    if pid_file.exists():  # the uncontained check this replaced: kill what escaped
      survivor = int(pid_file.read_text())
      try:
        os.kill(survivor, signal.SIGKILL)
      except ProcessLookupError:
        pass


def test_a_fork_bomb_is_contained(contained, sessions):
  bomb = """
      import os, time
      def f():
          for _ in range(5):
              os.fork()  # every process forks again: 32 of them (bounded, so that it is safe uncontained too)
          time.sleep(3)
          return 0
      """
  start = time.monotonic()
  result = check(bomb, "def check(candidate):\n    assert candidate() == 'never'\n", timeout_s=5)
  assert time.monotonic() - start < 5 + 3
  assert result == dict(passed=False, status="error", detail="PermissionError: [Errno 1] Operation not permitted")
  assert len(sessions) == 1 and settles(lambda: not left_behind(sessions)), left_behind(sessions)


def test_memory_is_capped_in_total_not_only_per_process(contained):
  limit = humaneval.MEMORY_LIMIT_BYTES
  one_block = "def f():\n    return len(bytearray(3 * 1024 ** 3))\n"  # refused before a byte is written
  assert check(one_block) == dict(passed=False, status="error", detail="MemoryError")
  blocks = """
      import mmap
      def f():
          return len([mmap.mmap(-1, 256 * 1024 ** 2) for _ in range(12)])  # 3 GiB of address space, never written
      """
  assert check(blocks) == dict(passed=False, status="error", detail="OSError: [Errno 12] Cannot allocate memory")
  threads = """
      import mmap, threading
      def f():
          held, blocks = [], []
          def grab():
              try:
                  blocks.append(mmap.mmap(-1, 512 * 1024 ** 2))
                  held.append(512 * 1024 ** 2)
              except OSError:
                  pass
          workers = [threading.Thread(target=grab) for _ in range(8)]  # 4 GiB asked for
          for w in workers:
              w.start()
          for w in workers:
              w.join()
          return sum(held)
      """
  assert check(threads, f"def check(candidate):\n    assert 0 < candidate() < {limit}\n")["status"] == "passed"
  # Six children holding 1.5 GiB each (9 GiB together, never written) under a limit that RLIMIT_AS sets per process.
  children = """
      import mmap, os, time
      def f():
          r, w = os.pipe()
          for _ in range(6):
              try:
                  child = os.fork()
              except OSError:
                  break
              if child == 0:
                  try:
                      block = mmap.mmap(-1, 1536 * 1024 ** 2)
                      os.write(w, b"1")
                      time.sleep(3)
                  finally:
                      os._exit(0)
          os.close(w)
          held = 0
          while os.read(r, 1):
              held += 1536 * 1024 ** 2
          return held
      """
  start = time.monotonic()
  result = check(children, f"def check(candidate):\n    assert candidate() <= {limit}\n", timeout_s=8)
  assert result == dict(passed=True, status="passed", detail="") and time.monotonic() - start < 8


def test_a_forged_verdict_does_not_pass_a_wrong_answer(contained):
  # A wrong answer (x + 1 for 2 * x) that, when loaded, prints markers (its argv's included) on stdout and stderr,
  # writes forged protocol frames (answers to the next requests, a "passed" verdict) on every descriptor it has and
  # exits with code 0.
  program = """
      import json, os, struct, sys
      def f(x):
          return x + 1
      forged = [{"id": 1, "ok": None}, {"id": 2, "ok": 2}, {"id": 3, "ok": 10}, {"id": 0, "ready": {}},
                {"verdict": "passed"}, {"id": 2, "raised": ["AssertionError", ""]}]
      for fd in range(64):
          for message in forged:
              data = json.dumps(message).encode()
              try:
                  os.write(fd, struct.pack(">I", len(data)) + data)
              except OSError:
                  pass
      for text in sys.argv + ["passed", "__blockspec_humaneval_check_finished__"]:
          print(text, file=sys.stderr)
          print(text)
      print(sys.argv[2] if len(sys.argv) > 2 else "passed")
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(0)
      """
  test = "def check(candidate):\n" + "".join(f"    assert candidate({x}) == {2 * x}\n" for x in (1, 5, 7))
  result = check(program, test)
  assert not result["passed"] and result["status"] in ("failed", "error"), result


def test_an_infinite_loop_times_out_and_leaves_nothing_behind(contained, sessions, tmp_path):
  # It spins in five threads after trying to leave its process group and to start a process of its own in a new
  # session (which writes its pid where this test can see it, so that it can be found if it escapes, and sleeps: the
  # CPU-time limit would end a spinning one).
  pid_file = tmp_path / "spinner.pid"
  program = f"""
      import os, threading, time
      def spin():
          while True:
              pass
      def f():
          for call in (os.setsid, lambda: os.setpgid(0, 0)):
              try:
                  call()
              except OSError:
                  pass
          try:
              if os.fork() == 0:
                  os.setsid()
                  with open({str(pid_file)!r}, "w") as out:
                      out.write(str(os.getpid()))
                  time.sleep(60)
          except OSError:
              pass
          for _ in range(4):
              threading.Thread(target=spin, daemon=False).start()
          spin()
      """
  with sandbox.Sandbox(10):  # first, that left_behind sees a sandbox's processes: its first process, PID 1, driver
    assert len(left_behind(sessions)) == 3
  assert not left_behind(sessions)
  start = time.monotonic()
  result = check(program, timeout_s=2)
  elapsed = time.monotonic() - start
  try:
    assert result["status"] == "timeout" and not result["passed"], result
    assert result["detail"] in ("timed out after 2 s", "CPU time limit of 3 s exceeded")
    assert elapsed < 2 + 3, elapsed
    assert len(sessions) == 2 and settles(lambda: not left_behind(sessions)), left_behind(sessions)
    assert not pid_file.exists() or settles(lambda: not alive(int(pid_file.read_text())))
  finally:
    if pid_file.exists():
      try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
      except (ProcessLookupError, ValueError):
        pass


# --- what the contained program sees, and the channel


def test_what_the_contained_program_sees(contained):
  program = """
      import os, resource, socket
      def f():
          status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines()
                        if ":\\t" in line)
          def writable(path):
              try:
                  with open(os.path.join(path, ".probe"), "w"):
                      pass
                  return True
              except OSError:
                  return False
          return dict(uid=os.getuid(), gid=os.getgid(), cap=status["CapEff"].strip(), seccomp=status["Seccomp"].strip(),
                      cwd=os.getcwd(), home=os.environ.get("HOME"), env=sorted(os.environ), top=sorted(os.listdir("/")),
                      pids=sorted(p for p in os.listdir("/proc") if p.isdigit()), host=socket.gethostname(),
                      writable=[p for p in ("/", "/usr", "/dev", "/proc", "/tmp", os.path.dirname(os.__file__))
                                if writable(p)],
                      exists=[p for p in ("/work", "/home", "/etc", "/run", "/var", "/sys", "/root/.cache")
                              if os.path.exists(p)],
                      tmp=os.statvfs("/tmp").f_blocks * os.statvfs("/tmp").f_frsize,
                      nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                      core=resource.getrlimit(resource.RLIMIT_CORE)[0],
                      address_space=resource.getrlimit(resource.RLIMIT_AS)[0])
      """
  with sandbox.Sandbox(10) as box:
    box.load(textwrap.dedent(program))
    seen = box.call("f")
    assert box.info["uid"] == sandbox.SANDBOX_UID and box.info["seccomp"] and box.info["contained"]
  assert (seen["uid"], seen["gid"], seen["cap"], seen["seccomp"]) == (65534, 65534, "0000000000000000", "2")
  assert (seen["cwd"], seen["home"], seen["env"]) == ("/tmp", "/tmp", ["HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"])
  assert seen["writable"] == ["/tmp"] and seen["exists"] == [] and seen["tmp"] == sandbox.TMP_SIZE_BYTES
  assert set(seen["top"]) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr",
                              os.path.realpath(sys.base_prefix).split("/")[1]}
  assert seen["pids"] in (["1", "2"], []) and seen["host"] == "sandbox"
  assert (seen["nofile"], seen["core"], seen["address_space"]) == (sandbox.MAX_OPEN_FILES, 0,
                                                                    sandbox.MEMORY_LIMIT_BYTES)


def test_threads_are_capped_where_the_kernel_has_a_pid_max_per_namespace(contained):
  with sandbox.Sandbox(20) as box:
    if box.info.get("pid_max") is None:
      pytest.skip("this kernel has no pid_max per pid namespace (Linux < 6.14): threads are capped by RLIMIT_AS "
                  "(and RLIMIT_NPROC where the caller is not root) only")
    box.load(textwrap.dedent("""
        import threading
        def f():
            threading.stack_size(64 * 1024)  # small stacks: the address-space limit alone would allow thousands
            gate, started = threading.Event(), 0
            try:
                for _ in range(5000):
                    threading.Thread(target=gate.wait).start()
                    started += 1
            except RuntimeError:
                pass
            gate.set()
            return started
        """))
    started = box.call("f")
  assert 10 < started < sandbox.MAX_TASKS, started


def test_protocol_violations_and_a_closed_channel_are_errors(contained):
  # The channel's pipes keep the numbers they had in the caller (any, in a process with many files open, as a pytest
  # worker is): the candidate writes to, and closes, every descriptor it holds, found in its own /proc.
  huge_frame = """
      import os, struct
      def f():
          for fd in sorted(int(name) for name in os.listdir("/proc/self/fd") if int(name) >= 3):
              try:
                  os.write(fd, struct.pack(">I", 2 ** 31) + b"x" * 16)
              except OSError:
                  pass
          return 1
      """
  result = check(huge_frame)
  assert result["status"] == "error" and result["detail"].startswith("protocol violation"), result
  closed = """
      import os
      def f():
          for fd in sorted(int(name) for name in os.listdir("/proc/self/fd") if int(name) >= 3):
              try:
                  os.close(fd)
              except OSError:
                  pass
          while True:
              pass
      """
  start = time.monotonic()
  result = check(closed, timeout_s=20)
  assert result == dict(passed=False, status="error", detail="closed its result channel"), result
  assert time.monotonic() - start < 10
  unencodable = check("def f():\n    return map(str, [1])\n")
  assert unencodable == dict(passed=False, status="error",
                             detail="unencodable result: cannot encode a value of type map")


def test_a_value_whose_equality_lies_cannot_pass(contained):
  # Results arrive as plain built-in types: a subclass with an __eq__ that is always true does not even cross.
  program = """
      class Anything(int):
          def __eq__(self, other):
              return True
          __hash__ = int.__hash__
      def f(x):
          return Anything(0)
      """
  result = check(program, "def check(candidate):\n    assert candidate(3) == 6\n")
  assert result["status"] == "error" and "cannot encode a value of type" in result["detail"], result


def test_candidate_exceptions_come_back_with_their_type_and_first_line(contained):
  with sandbox.Sandbox(10) as box:
    box.load("def f(kind):\n    raise {'a': AssertionError, 'k': KeyError}[kind]('first\\nsecond')\n"
             "def g(*args, **kwargs):\n    return [args, kwargs]\n")
    with pytest.raises(sandbox.CandidateError, match=r"^AssertionError: first$"):
      box.call("f", "a")
    with pytest.raises(sandbox.CandidateError) as info:
      box.call("f", "k")
    assert (info.value.type_name, info.value.message) == ("KeyError", "'first\\nsecond'")  # a KeyError's repr
    assert box.call("g", 1, (2, 3), b=frozenset({4})) == [(1, (2, 3)), {"b": frozenset({4})}]
    with pytest.raises(sandbox.CandidateError, match="name 'h' is not defined"):
      box.call("h")
  # An exception the candidate raised is an error of the answer, not a failed check.
  assert check("def f():\n    assert False, 'mine'\n") == dict(passed=False, status="error",
                                                               detail="AssertionError: mine")


# --- where containment is unavailable


def test_unavailable_containment_refuses_unless_the_unsafe_opt_in_is_given(monkeypatch):
  monkeypatch.setattr(sandbox, "available", lambda: "user namespaces are disabled (test)")
  problem = dict(task_id="X", entry_point="f", prompt="", test="def check(candidate):\n    assert candidate(2) == 4\n")
  refusal = r"user namespaces are disabled \(test\).*unsafe_no_sandbox=True"
  with pytest.raises(sandbox.SandboxUnavailable, match=refusal):
    humaneval.run_check("def f(x):\n    return 2 * x\n", problem)
  rows, answers = [dict(id="HumanEval/0")], ["```python\ndef f(x):\n    return 2 * x\n```"]
  with pytest.raises(sandbox.SandboxUnavailable, match="cannot be contained"):
    humaneval.score_completions(rows, answers, problems={"HumanEval/0": problem})
  with pytest.warns(sandbox.UnsafeSandboxWarning, match="uncontained"):
    right = humaneval.run_check("def f(x):\n    return 2 * x\n", problem, unsafe_no_sandbox=True)
  assert right == dict(passed=True, status="passed", detail="")
  with pytest.warns(sandbox.UnsafeSandboxWarning):
    score = humaneval.score_completions(rows, answers, problems={"HumanEval/0": problem}, unsafe_no_sandbox=True)
  assert score["passed"] == 1
  with pytest.warns(sandbox.UnsafeSandboxWarning):  # the verdict channel holds without containment too
    wrong = humaneval.run_check("import os\ndef f(x):\n    return x\nprint('passed')\nos._exit(0)\n", problem,
                                unsafe_no_sandbox=True)
    slow = humaneval.run_check("def f(x):\n    while True:\n        pass\n", problem, timeout_s=1,
                               unsafe_no_sandbox=True)
  assert wrong["status"] == "error" and slow["status"] == "timeout"
  with pytest.raises(ValueError, match="unsafe_no_sandbox must be True or False"):
    humaneval.score_completions(rows, answers, problems={"HumanEval/0": problem}, unsafe_no_sandbox="yes")


def test_the_availability_probe_names_the_reason(contained, monkeypatch):
  with monkeypatch.context() as m:  # a root the container cannot build: the setup error comes back as the reason
    m.setattr(sandbox, "_layout", lambda: ("/tmp", [("bind", "/nonexistent-blockspec-source", None)]))
    reason = sandbox._probe()
  assert reason.startswith("a trial sandbox failed: the sandbox failed to start: ") and "nonexistent" in reason
  with monkeypatch.context() as m:  # a namespace tool that fails without a word (as unshare does without userns)
    m.setattr(sandbox, "_unshare", lambda: "/bin/false")
    assert sandbox._probe() == "a trial sandbox failed: the sandbox failed to start: exit code 1"
  with monkeypatch.context() as m:
    m.setattr(sandbox, "_machine", lambda: "riscv64")
    assert "no seccomp system-call table for this machine (riscv64" in sandbox._probe()
  with pytest.raises(ValueError, match="riscv64"):
    sandbox.seccomp_filter("riscv64")
  assert len(sandbox.seccomp_filter("aarch64")) % 8 == 0 and len(sandbox.seccomp_filter("x86_64")) % 8 == 0
  assert sandbox.available() is None  # the cached answer of this process is untouched


# --- the value codec


ROUND_TRIPS = [None, True, False, 0, -1, 2 ** 63 - 1, 2 ** 63, -2 ** 63, -2 ** 63 - 1, 10 ** 400, -(3 ** 1000), 0.1,
               -0.0, 1e300, math.inf, -math.inf, "", "héllo\n\x00\udc80", b"", b"\x00\xff" * 3, [], (), [1, [2, (3,)]],
               (1,), {"a": 1}, {(1, "x"): [None], frozenset({1}): {2: 3}, 4.5: b"k"}, set(), {1, "a", (2, 3)},
               frozenset({frozenset()}), [[[[[]]]]], {"nested": {"deeper": [{"k": (True, None)}]}}]


@pytest.mark.parametrize("value", ROUND_TRIPS, ids=range(len(ROUND_TRIPS)))
def test_codec_round_trips_keep_values_and_types(value):
  back = sandbox.decode(sandbox.encode(value))

  def shape(v):  # types all the way down (== alone would let 1 == 1.0 == True and [1] vs (1,) differ only in type)
    if isinstance(v, (list, tuple)):
      return type(v), [shape(x) for x in v]
    if isinstance(v, (set, frozenset)):
      return type(v), sorted(map(repr, v))
    if isinstance(v, dict):
      return dict, [(shape(k), shape(x)) for k, x in v.items()]
    return type(v), repr(v)

  assert shape(back) == shape(value)
  nan = sandbox.decode(sandbox.encode(math.nan))
  assert isinstance(nan, float) and math.isnan(nan)


class Sub(int):
  pass


@pytest.mark.parametrize("value, message", [
    (object(), "cannot encode a value of type object"),
    (Sub(3), "cannot encode a value of type test_sandbox.Sub"),
    (map(str, []), "cannot encode a value of type map"),
    ([1, [print]], "type builtin_function_or_method"),
    (bytearray(b"x"), "type bytearray"),
    (1j, "type complex"),
    (range(3), "type range"),
])
def test_codec_refuses_other_types_by_name(value, message):
  with pytest.raises(sandbox.CodecError, match=message):
    sandbox.encode(value)


def test_codec_limits_and_malformed_input():
  deep = []
  for _ in range(sandbox.MAX_DEPTH + 1):
    deep = [deep]
  with pytest.raises(sandbox.CodecError, match="nested deeper"):
    sandbox.encode(deep)
  with pytest.raises(sandbox.CodecError, match="more than 10 items"):
    sandbox.encode(list(range(20)), max_items=10)
  with pytest.raises(sandbox.CodecError, match="nested deeper"):
    sandbox.decode('["list", [' * (sandbox.MAX_DEPTH + 2) + "]]" * (sandbox.MAX_DEPTH + 2))
  with pytest.raises(sandbox.CodecError, match="malformed JSON"):
    sandbox.decode("[" * 5000 + "]" * 5000)
  for bad in ['{"a": 1}', "NaN", "Infinity", '["float", "1.5"]', '["pickle", "gASVAAAA"]', '["list"]',
              '["set", [["list", []]]]', '["dict", [[["list", []], 1]]]', '["dict", [[1]]]', '["bytes", "@@"]',
              '["int", "12z"]', '["int", 5]', "1" * 5000, "[1, 2", b"\xff\xfe"]:
    with pytest.raises(sandbox.CodecError):
      sandbox.decode(bad)


# --- the seccomp program, run by a classic-BPF interpreter (both architectures, whatever this machine is)


def run_filter(program: bytes, nr: int, arch: int, flags: int = 0) -> int:
  """The action of the seccomp ``program`` for one system call (``flags``: its first argument)."""
  data = struct.pack("=iIQ6Q", nr, arch, 0, flags, 0, 0, 0, 0, 0)
  ops = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
  pc, acc = 0, 0
  while True:
    code, jt, jf, k = ops[pc]
    if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
      acc = struct.unpack("=I", data[k:k + 4])[0]
      pc += 1
    elif code == 0x06:  # BPF_RET | BPF_K
      return k
    else:
      taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]  # JEQ, JGE, JSET (BPF_K)
      pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("machine, arch, numbers", [
    ("x86_64", 0xC000003E, dict(read=0, clone=56, clone3=435, fork=57, execve=59, unshare=272, setsid=112)),
    ("aarch64", 0xC00000B7, dict(read=63, clone=220, clone3=435, fork=None, execve=221, unshare=97, setsid=157)),
])
def test_the_seccomp_program_allows_threads_only_and_refuses_the_listed_calls(machine, arch, numbers):
  program = sandbox.seccomp_filter(machine)
  allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x00050001, 0x00050026
  thread = 0x00010000 | 0x00000100 | 0x00000800 | 0x00000200  # CLONE_THREAD | VM | SIGHAND | FS, as pthreads
  assert run_filter(program, numbers["read"], arch) == allow
  assert run_filter(program, numbers["clone"], arch, thread) == allow
  assert run_filter(program, numbers["clone"], arch, 0x11) == eperm  # fork's clone: SIGCHLD, no CLONE_THREAD
  assert run_filter(program, numbers["clone"], arch, thread | 0x10000000) == eperm  # a thread in a new user ns
  assert run_filter(program, numbers["clone3"], arch) == enosys
  for name in ("execve", "unshare", "setsid", "fork"):
    if numbers[name] is not None:
      assert run_filter(program, numbers[name], arch) == eperm, name
  assert run_filter(program, numbers["read"], 0x40000003) == kill  # i386 (int 0x80 on x86_64): another arch
  if machine == "x86_64":
    assert run_filter(program, 0x40000000 | 0, arch) == kill  # x32
