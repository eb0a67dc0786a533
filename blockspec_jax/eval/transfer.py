"""What the transfer commands share (``eval.sprinter_transfer``, ``eval.heads_transfer``): a trained part's run
record, the prompts it is measured on (a set, a format, the rows' ids), the key of the data kept beside the report,
and the split of that data by category.

Each command measures a trained part on prompts it was not trained on, or in another prompt format, with its run's
own metric, on data collected exactly as its run collected its held-out data. The data is kept beside the report
(``<json stem>_<suffix>.npz``) under :func:`data_key`: a rerun with the same run, prompts and format reads it; any
other is refused (pass another ``--json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import time
from typing import Callable, Sequence

import numpy as np

from blockspec_jax import checks
from blockspec_jax import runtime
from blockspec_jax.data import formats

__all__ = ["read_run", "add_prompt_options", "check_prompt_options", "data_key", "kept_path", "read_kept",
           "collect_or_read", "write_report", "task_masks"]


def read_run(directory, fields: Sequence[str], *, flag: str, job: str, what: str,
             names: Sequence[str] = ("target",)) -> dict:
  """``fields`` of the run record (``metrics.json``) in ``directory``; a UsageError naming ``flag`` when there is none,
  it is not JSON, or it lacks a field or a model name (``names``: fields that must be strings, as a real-model run
  records them; ``job`` writes the record, ``what`` names its part)."""
  path = pathlib.Path(directory) / "metrics.json"
  if not path.is_file():
    raise checks.UsageError(f"{flag} {directory}: no metrics.json there (a finished {job} run writes it)")
  try:
    record = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise checks.UsageError(f"{flag} {directory}: {path} is not readable JSON ({e})") from None
  missing = [k for k in fields if k not in record]
  if missing or not all(isinstance(record.get(name), str) for name in names):
    raise checks.UsageError(f"{flag} {directory}: {path} is not a real-model {what} run's record (missing "
                            f"{', '.join(missing) or 'model names'})")
  return {k: record[k] for k in fields}


def add_prompt_options(ap: argparse.ArgumentParser, default_json: str) -> None:
  """``--prompts``, ``--system``, ``--num-prompts``, ``--first-row`` and ``--json``."""
  ap.add_argument("--prompts", default="other", help="a shipped prompt set by name (other, six, default) or a JSONL")
  ap.add_argument("--system", default=formats.SYSTEM_DEFAULT, help=formats.SYSTEM_OPTION_HELP)
  ap.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (default all)")
  ap.add_argument("--first-row", type=int, default=0,
                  help="the first prompt's row id, which keys its sampled continuation: a run's own held-out prompts "
                       "(rows after its training prompts) collected with their ids give the run's own data")
  ap.add_argument("--json", default=default_json)


def check_prompt_options(args: argparse.Namespace) -> list[dict]:
  """:func:`add_prompt_options`' values checked (a UsageError naming the option); returns the prompts' rows."""
  from blockspec_jax.data import prompts as prompts_lib
  if args.num_prompts is not None:
    checks.check_int(args.num_prompts, "--num-prompts", error=checks.UsageError)
  checks.check_int(args.first_row, "--first-row", 0, error=checks.UsageError)
  formats.check_system_option(args.system)
  runtime.check_output_file(args.json, "the report (--json)")
  return prompts_lib.load_prompts(args.prompts, limit=args.num_prompts)


def data_key(run: dict, args: argparse.Namespace, prompt_ids: Sequence[Sequence[int]]) -> dict:
  """What decides the kept data: the run's settings, the prompts, their format, the first row and the SHA-256 of the
  prompts' token ids (another tokenizer or template is other data)."""
  return {**run, "prompts": args.prompts, "system": args.system, "first_row": args.first_row,
          "prompt_ids_sha256": hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_ids]).encode()
                                              ).hexdigest()}


def kept_path(report, suffix: str) -> pathlib.Path:
  """``<report stem>_<suffix>.npz`` beside the report."""
  report = pathlib.Path(report)
  return report.with_name(f"{report.stem}_{suffix}.npz")


def read_kept(target, rows: list[dict], args: argparse.Namespace, run: dict, suffix: str, load: Callable):
  """``(prompt_ids, kept, meta, data)``: the prompts' token ids (chat-templated in ``args.system``'s format with the
  target's tokenizer), the kept data's file (:func:`kept_path`), its key (:func:`data_key`) and the data in it when
  it was collected with that key (``load``: the file's reader; None when absent; another key is a UsageError)."""
  from blockspec_jax.data import prompts as prompts_lib
  from blockspec_jax.train import pools
  prompt_ids = prompts_lib.encode_prompts(target, rows, True, args.system)
  kept = kept_path(args.json, suffix)
  meta = data_key(run, args, prompt_ids)
  return prompt_ids, kept, meta, pools.read_cached(kept, meta, load, redo=str(kept))


def collect_or_read(data, kept: pathlib.Path, meta: dict, what: str, collect: Callable[[], dict],
                    save: Callable) -> dict:
  """``data`` when :func:`read_kept` found it (said), else ``collect()``, saved at once as ``save(kept, data, meta)``
  so that a rerun (another report title, a failed write) reads it."""
  if data is not None:
    print(f"{what} read from {kept} (collected with the same run, prompts and format)", flush=True)
    return data
  data = collect()
  kept.parent.mkdir(parents=True, exist_ok=True)
  save(kept, data, meta)
  return data


def write_report(args: argparse.Namespace, run: dict, result: dict, start: float) -> pathlib.Path:
  """The report ``--json``: the options, the run's settings, the seconds since ``start`` and ``result``."""
  path = pathlib.Path(args.json)
  path.write_text(json.dumps(dict(config=vars(args), run=run, seconds=time.perf_counter() - start, **result),
                             indent=1) + "\n")
  print(f"wrote {path}; {time.perf_counter() - start:.0f} s")
  return path


def task_masks(row_of_item, tasks: Sequence[str], first_row: int = 0) -> dict[str, np.ndarray]:
  """``{task: bool mask over the items}`` in the prompts' order of categories, where item ``i`` comes from the
  prompt of row ``row_of_item[i]`` and prompt ``j`` (row ``first_row + j``) is of category ``tasks[j]``."""
  task_of_item = np.asarray(tasks)[np.asarray(row_of_item) - first_row]
  return {task: task_of_item == task for task in dict.fromkeys(tasks)}
