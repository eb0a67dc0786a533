"""Benchmark: jitted, vmapped token vs block verification (median wall time) on this machine.

    python -m blockspec_jax.eval.bench_verify [--config configs/verify_bench.py] [--batch 1 8 64] [--gamma 4 8]
        [--vocab 49152 151936] [--reps 20]

Prints one row per size with the median milliseconds of each rule and the ratio block / token, measured side by
side in one run (round-robin) on the same inputs, and whether the row meets the target (block ≤ 1.5 × token). The
machine's load average before and after the run is printed beside the figures: a loaded machine makes them
unreliable. Inputs are softmaxes of random logits (drafter and target differ), drafts are drawn from the drafter
rows so the rules see realistic acceptance patterns. ``--config`` reads the sizes from a Python file defining
``CONFIG = VerifyBenchConfig(...)`` (``configs/verify_bench.py``); explicit flags override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import statistics
import time

import jax
import jax.numpy as jnp

from blockspec_jax import sampling, verify

RATIO_TARGET = 1.5  # block verification at most 1.5 × token verification's time


@dataclasses.dataclass(frozen=True)
class VerifyBenchConfig:
  """Sizes of one benchmark run."""
  batches: tuple[int, ...] = (1, 8, 64)
  gammas: tuple[int, ...] = (4, 8)
  vocabs: tuple[int, ...] = (49152, 151936)  # SmolLM2, Qwen2.5
  reps: int = 20
  rules: tuple[str, ...] = ("token", "block")


def load_config(path: str) -> VerifyBenchConfig:
  """``CONFIG`` of a Python config file (e.g. ``configs/verify_bench.py``); clear errors for a missing file or name."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"benchmark config {path} not found")
  config = runpy.run_path(path).get("CONFIG")
  # Compared by name: run as ``python -m``, this module is ``__main__`` and the file imports the library's class.
  if not (dataclasses.is_dataclass(config) and type(config).__name__ == VerifyBenchConfig.__name__):
    raise ValueError(f"{path} must define CONFIG = VerifyBenchConfig(...), got {type(config).__name__}")
  return VerifyBenchConfig(**dataclasses.asdict(config))


def machine_load() -> str:
  """The 1/5/15-minute load averages over the core count, e.g. ``load 0.12 0.30 0.41 on 2 cores``."""
  one, five, fifteen = os.getloadavg()
  return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


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
        row = dict(batch=batch, gamma=gamma, vocab=vocab, **timings)
        line = (f"B={batch:3d} γ={gamma} V={vocab:6d}  "
                + "  ".join(f"{n} {t:8.3f} ms" for n, t in timings.items()))
        if {"block", "token"} <= set(rules):
          row["ratio"] = timings["block"] / timings["token"]
          row["target_met"] = row["ratio"] <= RATIO_TARGET
          line += f"  block/token {row['ratio']:.2f}x {'MET' if row['target_met'] else 'MISSED'} (≤ {RATIO_TARGET}x)"
        rows.append(row)
        print(line, flush=True)
  return rows


def build_parser() -> argparse.ArgumentParser:
  """The command line (also the gin job ``bench_verify``'s settings and defaults, ``blockspec_jax.main``)."""
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.bench_verify", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="Python file defining CONFIG = VerifyBenchConfig(...)")
  parser.add_argument("--batch", type=int, nargs="+")
  parser.add_argument("--gamma", type=int, nargs="+")
  parser.add_argument("--vocab", type=int, nargs="+")
  parser.add_argument("--reps", type=int)
  parser.add_argument("--rules", nargs="+")
  return parser


def main(argv=None):
  parser = build_parser()
  args = parser.parse_args(argv)
  config = load_config(args.config) if args.config else VerifyBenchConfig()
  overrides = {field: tuple(value) if isinstance(value, list) else value
               for field, value in (("batches", args.batch), ("gammas", args.gamma), ("vocabs", args.vocab),
                                    ("reps", args.reps), ("rules", args.rules)) if value is not None}
  config = dataclasses.replace(config, **overrides)
  if any(g < 1 for g in config.gammas) or config.reps < 1:
    parser.error(f"gammas and reps must be >= 1, got {config.gammas}, {config.reps}")
  before = machine_load()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {len(jax.devices())} device(s); {before} before "
        "the run")
  rows = run(config.batches, config.gammas, config.vocabs, config.reps, tuple(config.rules))
  print(f"{machine_load()} after the run (a load near or above the core count means the timings are contended)")
  if {"block", "token"} <= set(config.rules):
    met = sum(r["target_met"] for r in rows)
    worst = max(r["ratio"] for r in rows)
    print(f"target block/token ≤ {RATIO_TARGET}x: met in {met} of {len(rows)} rows; worst {worst:.2f}x")
  return rows


if __name__ == "__main__":
  main()
