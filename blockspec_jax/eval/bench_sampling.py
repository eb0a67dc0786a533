"""Benchmark: the sampling filters (top-k, top-p) as computed against sorting every row, side by side in one run.

    python -m blockspec_jax.eval.bench_sampling [--vocab 49152 151936] [--rows 1 5] [--reps 20]

Every draw of a filtered sampler, in the drafter and in the target's verify pass, transforms whole rows of logits
(``sampling.probs_from_logits``). Sorting a row of Qwen's 151,936 logits costs tens of milliseconds on a CPU core,
more than a decode step of a small drafter, so the filters take the ``K`` largest values instead and sort only rows
those do not decide (``sampling._top_p_keep``). This prints, per vocabulary size, rows per call and filter setting,
the median milliseconds of ``probs_from_logits`` and of ``sampling.probs_by_sorting`` (the reference: sorting every
row), timed round-robin on the same jitted inputs, their ratio, and whether both keep the same tokens. The logits
are random normals times ``--scale`` (3: a few dozen tokens hold most of the mass, as a language model's do; a
flatter row makes top-p alone sort). The machine's load average is printed: a loaded machine makes the figures
unreliable.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import sampling
from blockspec_jax.eval.bench_verify import interleaved_median_ms, machine_load

#: The filter settings of every size: (top_k, top_p); (0, 1.0) is the unfiltered softmax, for scale.
SETTINGS = ((0, 1.0), (10, 1.0), (0, 0.9), (10, 0.9), (50, 0.95))


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.bench_sampling", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 5], help="rows per call (a step: 1; a verify "
                      "pass at γ = 4: 5)")
  parser.add_argument("--scale", type=float, default=3.0, help="the logits' standard deviation")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  return parser


def main(argv=None) -> list[dict]:
  args = build_parser().parse_args(argv)
  if min(args.vocab) < 2 or min(args.rows) < 1 or args.reps < 1:
    raise SystemExit("--vocab must be >= 2, --rows and --reps >= 1")
  print(f"before the run: {machine_load()}; {jax.default_backend()}", flush=True)
  results = []
  print(f"{'V':>7} {'rows':>4} {'top_k':>5} {'top_p':>5} {'filters ms':>10} {'sorting ms':>10} {'ratio':>6}  same "
        "tokens kept")
  for vocab in args.vocab:
    for rows in args.rows:
      logits = jax.random.normal(jax.random.key(args.seed), (rows, vocab), jnp.float32) * jnp.float32(args.scale)
      for top_k, top_p in SETTINGS:
        kw = dict(temperature=1.0, top_k=top_k, top_p=top_p)
        fast = jax.jit(lambda x, kw=kw: sampling.probs_from_logits(x, **kw))
        sort = jax.jit(lambda x, kw=kw: sampling.probs_by_sorting(x, **kw))
        same = bool(np.array_equal(np.asarray(fast(logits)) > 0, np.asarray(sort(logits)) > 0))
        ms = interleaved_median_ms({"fast": (fast, (logits,)), "sort": (sort, (logits,))}, args.reps)
        row = dict(vocab=vocab, rows=rows, top_k=top_k, top_p=top_p, filters_ms=ms["fast"], sorting_ms=ms["sort"],
                   ratio=ms["sort"] / ms["fast"], same_tokens=same)
        results.append(row)
        print(f"{vocab:>7} {rows:>4} {top_k:>5} {top_p:>5g} {ms['fast']:>10.2f} {ms['sort']:>10.2f} "
              f"{row['ratio']:>5.1f}x  {'yes' if same else 'NO'}", flush=True)
  print(f"after the run: {machine_load()}")
  return results


if __name__ == "__main__":
  main()
