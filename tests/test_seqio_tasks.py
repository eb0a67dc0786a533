"""The prompt sets as seqio Tasks (blockspec_jax.data.seqio_tasks, the optional seqio extra). Without seqio the
suite's "seqio:" prompts are a one-line usage error naming the extra (what CI, which does not install TensorFlow,
checks); with it (pip install -e ".[seqio]"), every category's Task gives back exactly the file's rows, and user
files and bad names behave."""

import importlib.util
import json

import pytest

from blockspec_jax import checks as checks_lib
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.eval import suite

HAVE_SEQIO = importlib.util.find_spec("seqio") is not None
needs_seqio = pytest.mark.skipif(not HAVE_SEQIO, reason="the seqio extra is not installed")


@pytest.mark.skipif(HAVE_SEQIO, reason="seqio is installed: the round-trip tests run instead")
def test_without_the_extra_seqio_prompts_name_it():
  with pytest.raises(checks_lib.UsageError, match=r"seqio is not installed.*pip install -e \"\.\[seqio\]\""):
    suite.load_suite_prompts("seqio:blockspec_code")


def test_malformed_seqio_names_are_usage_errors():
  for bad in ("seqio:", "seqio:a:b:c"):
    with pytest.raises(checks_lib.UsageError, match="seqio:<task>"):
      suite.load_suite_prompts(bad)


@needs_seqio
def test_every_category_task_gives_back_the_file_rows():
  from blockspec_jax.data import seqio_tasks
  names = seqio_tasks.register_prompt_tasks()
  assert names == [f"blockspec_{t}" for t in prompts_lib.TASKS]
  rows = prompts_lib.load_prompts(prompts_lib.SIX_TASK_PROMPTS)
  for task, name in zip(prompts_lib.TASKS, names):
    assert seqio_tasks.prompts_from_seqio(name) == [
        {k: r[k] for k in seqio_tasks.FIELDS} for r in rows if r["task"] == task]
  assert suite.load_suite_prompts("seqio:blockspec_math:validation") == seqio_tasks.prompts_from_seqio(
      "blockspec_math")


@needs_seqio
def test_a_users_file_registers_and_unknown_names_fail(tmp_path):
  from blockspec_jax.data import seqio_tasks
  path = tmp_path / "mine.jsonl"
  path.write_text("\n".join(json.dumps({"task": "poems", "text": f"Write a poem about {x}."}) for x in ("rain", "tea")))
  assert seqio_tasks.register_prompt_tasks(path, prefix="mine_") == ["mine_poems"]
  rows = seqio_tasks.prompts_from_seqio("mine_poems")
  assert [r["text"] for r in rows] == ["Write a poem about rain.", "Write a poem about tea."]
  assert rows[0]["id"] == "mine/1" and rows[0]["licence"] == "unknown"
  with pytest.raises(ValueError, match="unknown seqio task"):
    seqio_tasks.prompts_from_seqio("no_such_task")
  with pytest.raises(checks_lib.UsageError, match="unknown seqio task"):
    suite.load_suite_prompts("seqio:no_such_task")
