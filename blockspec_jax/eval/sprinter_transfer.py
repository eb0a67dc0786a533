"""SPRINTER's trained verifier head on prompts it was not trained on, or in another prompt format.

    python -m blockspec_jax.eval.sprinter_transfer --head results/train/sprinter_qwen --prompts other [--system none]
        [--num-prompts N] [--json results/sprinter_transfer.json]

The head's run (its ``metrics.json``: target, drafter, dtype, label set, temperature, tokens per prompt, seed,
thresholds) says how its labels were collected; the same collection runs on ``--prompts`` (a shipped set by name:
``other``, ``six``, ``default``, or a JSONL file) encoded with the chat template and ``--system`` (``default``,
``none`` or a system message), and the head is scored on those labels as the run scored its own held-out set:
accuracy, η_FP = P(accept | label 0), η_FN = P(flag | label 1) and the accept rate per threshold, the BCE, and the
base rate (the better constant answer, ``max(P(label 1), P(label 0))``), overall and per category. A head that beats
its base rate on its own held-out prompts but not here has learnt the sources' style, not the pair.

The labels are kept beside the report (``<json stem>_labels.npz``, with the run's settings, the prompts, the format
and the prompts' token ids' digest): a rerun with the same ones reads them and collects nothing; another format or
prompt set on the same file is refused (pass another ``--json``).
"""

from __future__ import annotations

import argparse
import time
from typing import Sequence

import jax
import numpy as np

from blockspec_jax.decoding import speculative as spec
from blockspec_jax.eval import transfer

#: What the head's run recorded that decides how labels are collected (``sprinter_job``'s ``metrics.json``).
RUN_FIELDS = ("target", "drafter", "dtype", "label_set", "temperature", "max_new_tokens", "seed", "thresholds",
              "collect_batch_size")


def collect(target_config, target_params, drafter_config, drafter_params, prompt_ids: Sequence[Sequence[int]], *,
            label_set: str, temperature: float, max_new_tokens: int, seed: int, batch_size: int,
            stop_ids: tuple[int, ...] = (), progress: bool = True, first_row: int = 0) -> dict:
  """The labels of ``prompt_ids`` (ragged token ids; prompt ``i`` is row ``first_row + i``) collected as
  ``sprinter_job`` collects its own with these settings: ``"sampled"`` (the drafter's continuations keyed by
  ``fold_in(key(seed), 1)`` and the row, :func:`~blockspec_jax.train.sprinter.collect_labels`) or ``"official"``
  (both models greedy, :func:`~blockspec_jax.train.sprinter.collect_official_labels`). Returns their arrays
  (``features_NxD``, ``labels_N``, ``row_N``, …)."""
  from blockspec_jax.train import sprinter as sprinter_lib
  if label_set not in sprinter_lib.LABEL_SETS:
    raise ValueError(f"label_set {label_set!r} is not one of {', '.join(map(repr, sprinter_lib.LABEL_SETS))}")
  tokens_BxP, prompt_len_B = spec.prepare_prompts([list(p) for p in prompt_ids])
  common = dict(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=batch_size, progress=progress,
                rows=first_row + np.arange(len(prompt_ids)), stop_ids=tuple(stop_ids))
  if label_set == "official":
    return sprinter_lib.collect_official_labels(target_config, target_params, drafter_config, drafter_params,
                                                tokens_BxP, prompt_len_B, **common)
  return sprinter_lib.collect_labels(target_config, target_params, drafter_config, drafter_params, tokens_BxP,
                                     prompt_len_B, key=jax.random.fold_in(jax.random.key(seed), 1), **common)


def score(head, data: dict, thresholds: Sequence[float], tasks: Sequence[str] | None = None,
          first_row: int = 0) -> dict:
  """The head on labelled data (:func:`collect`'s): ``{"num", "positive_rate", "base_rate", "bce", "report",
  "by_task"}`` (``report``: :func:`~blockspec_jax.train.sprinter.head_report`'s rows; ``by_task``: the same per
  category, when ``tasks[i]`` names prompt ``i``'s, whose row is ``first_row + i``)."""
  from blockspec_jax.train import sprinter as sprinter_lib
  features_NxD, labels_N = data["features_NxD"], np.asarray(data["labels_N"])

  def one(mask_N) -> dict:
    labels = labels_N[mask_N]
    rate = float(labels.mean()) if labels.size else None
    return {"num": int(labels.size), "positive_rate": rate,
            "base_rate": None if rate is None else max(rate, 1 - rate),
            "bce": sprinter_lib.evaluate_head(head, features_NxD[mask_N], labels)["bce"] if labels.size else None,
            "report": sprinter_lib.head_report(head, features_NxD[mask_N], labels, thresholds)}

  out = one(np.ones(labels_N.shape, bool))
  if tasks is not None:
    out["by_task"] = {task: one(mask_N) for task, mask_N in transfer.task_masks(data["row_N"], tasks,
                                                                               first_row).items()}
  return out


def format_score(result: dict, title: str) -> str:
  """A table per threshold: accuracy against the base rate, η_FP, η_FN, accept rate; then accuracy per category."""
  lines = [title, f"{result['num']} labels, {result['positive_rate']:.3f} acceptable (label 1); base rate "
                  f"{result['base_rate']:.3f}; BCE {result['bce']:.3f}",
           f"{'θ':>4} {'accuracy':>8} {'− base':>7} {'η_FP':>6} {'η_FN':>6} {'accept':>6}"]
  for r in result["report"]:
    fp = "–" if r["eta_fp"] is None else f"{r['eta_fp']:.3f}"
    fn = "–" if r["eta_fn"] is None else f"{r['eta_fn']:.3f}"
    lines.append(f"{r['threshold']:>4g} {r['accuracy']:>8.3f} {r['accuracy'] - result['base_rate']:>+7.3f} "
                 f"{fp:>6} {fn:>6} {r['accept_rate']:>6.3f}")
  for task, sub in result.get("by_task", {}).items():
    accuracies = " ".join(f"θ={r['threshold']:g} {r['accuracy']:.3f}" for r in sub["report"])
    lines.append(f"  {task:<14} {sub['num']:>5} labels, base {sub['base_rate']:.3f}: {accuracies}")
  return "\n".join(lines)


def run_settings(head_dir) -> dict:
  """The head's run's :data:`RUN_FIELDS` from its ``metrics.json``; a UsageError when the directory is not a
  finished SPRINTER run."""
  return transfer.read_run(head_dir, RUN_FIELDS, flag="--head", job="sprinter_job", what="SPRINTER",
                           names=("target", "drafter"))


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.sprinter_transfer", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--head", required=True, help="a sprinter_job run directory (head.npz, head.json, metrics.json)")
  transfer.add_prompt_options(ap, "results/sprinter_transfer.json")
  return ap


def main(argv=None) -> int:
  from blockspec_jax import checks as checks_lib
  from blockspec_jax import cli
  from blockspec_jax import sources
  from blockspec_jax.drafters.sprinter import load_head
  from blockspec_jax.train import sprinter as sprinter_lib
  ap = build_parser()
  args = ap.parse_args(argv)
  start = time.perf_counter()
  with cli.cli_errors(ap.prog):
    run = run_settings(args.head)
    rows = transfer.check_prompt_options(args)
    try:
      head, _ = load_head(args.head)
    except ValueError as e:
      raise checks_lib.UsageError(f"--head {args.head}: {e}") from None
    target = sources.load_model(run["target"], run["dtype"], scan_layers=True)  # its tokenizer keys the cache
    prompt_ids, kept, meta, data = transfer.read_kept(target, rows, args, run, "labels", sprinter_lib.load_labels)
    if data is None:  # the drafter only to collect
      drafter = sources.load_model(run["drafter"], run["dtype"], scan_layers=True)
      sources.check_pair(target, drafter)
      if int(head["w_D"].shape[0]) != drafter.config.d_model:
        raise checks_lib.UsageError(f"--head {args.head}: a head of D = {head['w_D'].shape[0]}, the drafter "
                                    f"{run['drafter']} has D = {drafter.config.d_model}")

  def collect_labels():
    print(f"collecting {run['label_set']} labels on {len(rows)} prompts of {args.prompts} (system {args.system!r}), "
          f"{run['max_new_tokens']} tokens each at T = {run['temperature']:g}", flush=True)
    return collect(target.config, target.params["params"], drafter.config, drafter.params["params"], prompt_ids,
                   label_set=run["label_set"], temperature=run["temperature"], max_new_tokens=run["max_new_tokens"],
                   seed=run["seed"], batch_size=run["collect_batch_size"], stop_ids=tuple(target.stop_ids),
                   first_row=args.first_row)

  data = transfer.collect_or_read(data, kept, meta, "labels", collect_labels, sprinter_lib.save_labels)
  result = score(head, data, run["thresholds"], [r["task"] for r in rows], args.first_row)
  print(format_score(result, f"SPRINTER head {args.head} on {args.prompts} (system {args.system!r})"))
  transfer.write_report(args, run, result, start)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
