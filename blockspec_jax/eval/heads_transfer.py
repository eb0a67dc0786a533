"""BPD heads trained on one pool of prompts, measured on prompts from other sources or in another prompt format.

    python -m blockspec_jax.eval.heads_transfer --heads results/train/heads_qwen --prompts other [--system none]
        [--num-prompts N] [--json results/heads_transfer.json]

The heads' run (its ``metrics.json``: target, dtype, temperature, tokens per prompt, seed, heads, top-k, the n-gram's
weight) says how its held-out data was collected; the same collection runs on ``--prompts`` (a shipped set by name:
``other``, ``six``, ``default``, or a JSONL file) encoded with the chat template and ``--system`` (``default``,
``none`` or a system message): the target continues each prompt at the run's temperature (keyed by the run's seed
and the prompt's row, ``--first-row`` onwards) and one causal pass gives its hidden states. The heads are scored as
the run scored its held-out set: per head, the top-1 accuracy and cross-entropy of the token ``j + 2`` ahead on the
target's text, the top-1 after rescoring the head's ``top_k`` candidates with the run's n-gram LM on the true text
before the label, and whether the label is among the candidates; beside them the untrained heads (every head the
target's next-token head, the run's "before"), overall and per category, and the n-gram LM's NLL of the target's
tokens. Heads whose training edge over the untrained heads holds on other sources learnt the target, not the pool.

The hidden states are kept beside the report (``<json stem>_hidden.npz``, with the run's settings, the prompts, the
format and the prompts' token ids' digest): a rerun with the same ones reads them and samples nothing; another format
or prompt set on the same file is refused (pass another ``--json``).
"""

from __future__ import annotations

import argparse
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax.decoding import speculative as spec
from blockspec_jax.eval import transfer

__all__ = ["RUN_FIELDS", "collect", "combine", "score", "format_score", "run_settings", "main"]

#: What the heads' run recorded that decides how its held-out data is collected and scored (``heads_job``).
RUN_FIELDS = ("target", "dtype", "temperature", "max_new_tokens", "seed", "collect_batch_size", "num_heads", "top_k",
              "lm_weight")


def collect(target_config, target_params, prompt_ids: Sequence[Sequence[int]], *, temperature: float,
            max_new_tokens: int, seed: int, batch_size: int, stop_ids: tuple[int, ...] = (), progress: bool = True,
            first_row: int = 0) -> dict:
  """The target's continuations of ``prompt_ids`` (ragged token ids; prompt ``i`` is row ``first_row + i``) and its
  hidden states along them, collected as ``heads_job`` collects its own (keyed by ``fold_in(key(seed), 1)`` and the
  row; :func:`~blockspec_jax.train.heads.collect_hidden`'s arrays)."""
  from blockspec_jax.train import heads as heads_lib
  tokens_BxP, prompt_len_B = spec.prepare_prompts([list(p) for p in prompt_ids])
  return heads_lib.collect_hidden(target_config, target_params, tokens_BxP, prompt_len_B,
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  key=jax.random.fold_in(jax.random.key(seed), 1), batch_size=batch_size,
                                  progress=progress, rows=first_row + np.arange(len(prompt_ids)),
                                  stop_ids=tuple(stop_ids))


def combine(parts: Sequence[dict]) -> dict:
  """:func:`~blockspec_jax.train.heads.evaluate_heads` results of disjoint sets of positions as one result over
  their union: each part's per-head figures times its positions are its sums, which add
  (:func:`~blockspec_jax.train.heads.head_figures`)."""
  from blockspec_jax.train import heads as heads_lib
  count_PxH = np.asarray([p["num_per_head"] for p in parts], np.float64)
  totals = {"count_H": count_PxH.sum(axis=0)}
  for name, per_head in heads_lib.HEAD_SUMS.items():
    if per_head in parts[0]:
      totals[name] = (np.asarray([p[per_head] for p in parts], np.float64) * count_PxH).sum(axis=0)
  return heads_lib.head_figures(totals)


def score(heads, lm_head_VxD, ngram, data: dict, *, num_heads: int, top_k: int, lm_weight: float,
          tasks: Sequence[str] | None = None, first_row: int = 0, chunk: int = 64, progress: bool = False) -> dict:
  """``heads`` (and the untrained heads: each the target's next-token head) on :func:`collect`'s data, as
  ``heads_job`` scores its held-out set: ``{"positions", "prompts", "trained", "untrained", "ngram_nll",
  "by_task"}`` (``trained`` / ``untrained``: :func:`~blockspec_jax.train.heads.evaluate_heads`' figures with the
  n-gram LM ``ngram``; ``by_task``: the same per category when ``tasks[i]`` names prompt ``i``'s, whose row is
  ``first_row + i``; the overall figures are then the categories' :func:`combine`, each position evaluated once)."""
  from blockspec_jax.drafters import heads as heads_drafter
  from blockspec_jax.train import heads as heads_lib
  vocab, d_model = np.shape(lm_head_VxD)
  config = heads_lib.lm_head_config(int(vocab), int(d_model))
  lm_head_VxD = jnp.asarray(lm_head_VxD, jnp.float32)
  features_MxD = np.asarray(data["features_MxD"])
  labels_MxH = heads_lib.head_labels(data, num_heads)
  contexts_MxHxC = heads_lib.text_contexts(data, num_heads, ngram.order - 1, ngram.bos)
  candidates = {"trained": heads, "untrained": heads_drafter.init_heads(int(d_model), num_heads, jax.random.key(0))}

  def one(mask_M) -> dict:
    return {name: heads_lib.evaluate_heads(h, lm_head_VxD, config, features_MxD[mask_M], labels_MxH[mask_M],
                                           chunk=chunk, ngram=ngram, contexts_MxHxC=contexts_MxHxC[mask_M],
                                           top_k=top_k, lm_weight=lm_weight, progress=progress)
            for name, h in candidates.items()}

  out = {"positions": int(labels_MxH.shape[0]), "prompts": int(len(data["row_N"])),
         "ngram_nll": heads_lib.ngram_heldout_nll(ngram, data)}
  if tasks is None:
    return {**out, **one(np.ones(labels_MxH.shape[0], bool))}
  seq_M = np.asarray(data["seq_M"])
  by_task = {}
  for task, mask_N in transfer.task_masks(data["row_N"], tasks, first_row).items():
    mask_M = mask_N[seq_M]
    if mask_M.any():
      by_task[task] = {"positions": int(mask_M.sum()), **one(mask_M)}
  parts = list(by_task.values())
  return {**out, **{name: combine([p[name] for p in parts]) for name in candidates}, "by_task": by_task}


def format_score(result: dict, title: str) -> str:
  """Per head: top-1 untrained → trained, the n-gram-rescored top-1, the label in the top-k; then per category."""
  trained, untrained = result["trained"], result["untrained"]
  lines = [title, f"{result['positions']} positions of {result['prompts']} prompts; n-gram NLL of the target's tokens "
                  f"{result['ngram_nll']:.3f}; CE untrained {untrained['ce']:.3f} -> trained {trained['ce']:.3f}",
           f"{'head':>4} {'untrained':>9} {'trained':>8} {'rescored':>8} {'in top-k':>8} {'positions':>9}"]
  for j, top1 in enumerate(trained["top1_per_head"]):
    lines.append(f"{j + 1:>4} {untrained['top1_per_head'][j]:>9.3f} {top1:>8.3f} "
                 f"{trained['top1_rescored_per_head'][j]:>8.3f} {trained['in_topk_per_head'][j]:>8.3f} "
                 f"{trained['num_per_head'][j]:>9}")
  lines.append(f"{'mean':>4} {untrained['top1']:>9.3f} {trained['top1']:>8.3f} {trained['top1_rescored']:>8.3f}")
  for task, sub in result.get("by_task", {}).items():
    lines.append(f"  {task:<14} {sub['positions']:>5} positions: top-1 {sub['untrained']['top1']:.3f} -> "
                 f"{sub['trained']['top1']:.3f}, rescored {sub['trained']['top1_rescored']:.3f}")
  return "\n".join(lines)


def run_settings(heads_dir) -> dict:
  """The heads' run's :data:`RUN_FIELDS` from its ``metrics.json``; a UsageError when the directory is not a
  finished real-model heads run."""
  return transfer.read_run(heads_dir, RUN_FIELDS, flag="--heads", job="heads_job", what="BPD heads")


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.heads_transfer", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--heads", required=True,
                  help="a heads_job run directory (heads.npz, heads.json, ngram.npz, ngram.json, metrics.json)")
  transfer.add_prompt_options(ap, "results/heads_transfer.json")
  return ap


def main(argv=None) -> int:
  from blockspec_jax import checks
  from blockspec_jax import cli
  from blockspec_jax import sources
  from blockspec_jax.drafters import heads as heads_drafter
  from blockspec_jax.drafters import lattice
  from blockspec_jax.train import heads as heads_lib
  ap = build_parser()
  args = ap.parse_args(argv)
  start = time.perf_counter()
  with cli.cli_errors(ap.prog):
    run = run_settings(args.heads)
    rows = transfer.check_prompt_options(args)
    try:
      heads, _ = heads_drafter.load_heads(args.heads, num_heads=run["num_heads"])
    except (OSError, ValueError) as e:
      raise checks.UsageError(f"--heads {args.heads}: {e}") from None
    target = sources.load_model(run["target"], run["dtype"], scan_layers=True)
    config = target.config
    try:
      heads_drafter.check_heads(heads, config.d_model)
      ngram, _ = lattice.load_ngram(args.heads, vocab_size=config.vocab_size)
    except (OSError, ValueError) as e:
      raise checks.UsageError(f"--heads {args.heads}: {e}") from None
    prompt_ids, kept, meta, data = transfer.read_kept(target, rows, args, run, "hidden", heads_lib.load_hidden)

  def collect_hidden():
    print(f"collecting {len(rows)} prompts of {args.prompts} (system {args.system!r}): {run['max_new_tokens']} "
          f"target tokens each at T = {run['temperature']:g}, and the target's hidden states", flush=True)
    return collect(config, target.params["params"], prompt_ids, temperature=run["temperature"],
                   max_new_tokens=run["max_new_tokens"], seed=run["seed"], batch_size=run["collect_batch_size"],
                   stop_ids=tuple(target.stop_ids), first_row=args.first_row)

  data = transfer.collect_or_read(data, kept, meta, "hidden states", collect_hidden, heads_lib.save_hidden)
  lm_head_VxD = heads_drafter.lm_head_weight(config, target.params["params"])
  result = score(heads, lm_head_VxD, ngram, data, num_heads=run["num_heads"], top_k=run["top_k"],
                 lm_weight=run["lm_weight"], tasks=[r["task"] for r in rows], first_row=args.first_row,
                 progress=True)
  print(format_score(result, f"BPD heads {args.heads} on {args.prompts} (system {args.system!r})"))
  transfer.write_report(args, run, result, start)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
