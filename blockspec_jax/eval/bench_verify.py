"""Benchmark: jitted, vmapped token vs block verification (median wall time) on this machine.

    python -m blockspec_jax.eval.bench_verify [--batch 1 8 64] [--gamma 4 8] [--vocab 49152 151936] [--reps 20]

Prints one row per size with the median milliseconds of each rule and the ratio block / token, measured side by
side in one run on the same inputs. Inputs are softmaxes of random logits (drafter and target differ), drafts are
drawn from the drafter rows so the rules see realistic acceptance patterns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from blockspec_jax import sampling, verify


def make_inputs(key, batch, gamma, vocab, logit_scale=3.0, mismatch=1.0):
  """Random drafter/target rows ``[B, γ, V]``/``[B, γ+1, V]`` and drafts drawn from the drafter rows."""
  k_base, k_noise, k_draft = jax.random.split(key, 3)
  base = logit_scale * jax.random.normal(k_base, (batch, gamma + 1, vocab), jnp.float32)
  noise = mismatch * jax.random.normal(k_noise, (batch, gamma + 1, vocab), jnp.float32)
  target_probs = jax.nn.softmax(base, axis=-1)
  draft_probs = jax.nn.softmax(base[:, :gamma] + noise[:, :gamma], axis=-1)
  draft_keys = jax.random.split(k_draft, batch * gamma).reshape(batch, gamma)
  draft_tokens = jax.vmap(jax.vmap(sampling.sample))(draft_keys, draft_probs)
  return draft_tokens, draft_probs, target_probs


def interleaved_median_ms(calls: dict, reps: int) -> dict:
  """Median ms of each ``name -> (fn, args)`` call, timed round-robin: after one warm-up call each (compile), every
  round times every call once, so a slow spell of a busy machine hits all of them alike and their ratios are
  measured side by side rather than minutes apart."""
  for fn, args in calls.values():
    jax.block_until_ready(fn(*args))  # compile + warm up
  times = {name: [] for name in calls}
  for _ in range(reps):
    for name, (fn, args) in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def median_ms(fn, args, reps):
  return interleaved_median_ms({0: (fn, args)}, reps)[0]


def run(batches, gammas, vocabs, reps, rules=("token", "block")):
  rows = []
  for vocab in vocabs:
    for gamma in gammas:
      for batch in batches:
        inputs = make_inputs(jax.random.key(batch * 1000 + gamma), batch, gamma, vocab)
        keys = verify.row_keys(jax.random.key(7), batch)
        timings = {}
        for name in rules:
          fn = jax.jit(verify.get_verifier(name).batch)
          timings[name] = median_ms(fn, (keys, *inputs), reps)
        rows.append(dict(batch=batch, gamma=gamma, vocab=vocab, **timings))
        print(f"B={batch:3d} γ={gamma} V={vocab:6d}  " + "  ".join(f"{n} {t:8.3f} ms" for n, t in timings.items())
              + (f"  block/token {timings['block'] / timings['token']:.2f}x" if {"block", "token"} <= set(rules)
                 else ""), flush=True)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
  parser.add_argument("--gamma", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--rules", nargs="+", default=["token", "block"])
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {len(jax.devices())} device(s)")
  rows = run(args.batch, args.gamma, args.vocab, args.reps, tuple(args.rules))
  if {"block", "token"} <= set(args.rules):
    worst = max(r["block"] / r["token"] for r in rows)
    print(f"worst block/token ratio: {worst:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
  main()
