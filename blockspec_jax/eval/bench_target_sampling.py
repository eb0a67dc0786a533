"""Benchmark: the training jobs' target sampling with dequantized against quantized weights, side by side in one run.

    python -m blockspec_jax.eval.bench_target_sampling [--target qwen2.5-coder-1.5b] [--rows 16] [--batch 8]
        [--max-new-tokens 32] [--temperature 1.0] [--prompts six]

Every training job (DistillSpec, SD², BPD heads, SPRINTER's labels) starts by sampling the target's continuations of
its prompts with ``distill.sample_sequences`` (``make_distill_data``: ``sample_batch_size`` rows a compiled program).
This runs exactly that on the first ``--rows`` prompts of a shipped prompt file (chat-templated, as the jobs encode
them, padded to the jobs' 352-token width), in batches of ``--batch`` rows, with the target loaded both ways
(``hub.load_model(weights=)``, the training jobs' ``target_weights``), and prints per kind the seconds per sampled
row after compilation (the first batch is compiled and run once untimed), the generated tokens per second, the
seconds of that first batch (compilation included), and whether both kinds drew the same tokens (same keys;
bit-identical logits give identical rows).
The machine's load average is printed: a loaded machine makes the figures unreliable.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from blockspec_jax import runtime
from blockspec_jax.data import prompts as prompts_lib
from blockspec_jax.models import hub
from blockspec_jax.train import distill, pools


def _prompts(model, name: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
  ids = prompts_lib.encode_prompts(model, prompts_lib.load_prompts(name)[:rows], True)
  if len(ids) < rows:
    raise SystemExit(f"--rows {rows}: the prompt file {name!r} has {len(ids)} prompts")
  width = max(pools.DEFAULT_MAX_PROMPT_LEN, max(map(len, ids)))
  tokens_NxP = np.zeros((rows, width), np.int32)
  for i, row in enumerate(ids):
    tokens_NxP[i, :len(row)] = row
  return tokens_NxP, np.array([len(r) for r in ids], np.int32)


def _sample(model, tokens_NxP, len_N, batch: int, max_new_tokens: int, temperature: float) -> dict:
  keys_N = jax.random.split(jax.random.key(0), len(len_N))
  params, stop = model.params["params"], tuple(model.stop_ids)

  def run(rows):
    return distill.sample_sequences(model.config, params, tokens_NxP[rows], len_N[rows], keys_N[rows],
                                    max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=stop)

  print("  compiling the sampling program (first batch, untimed) …", flush=True)
  t0 = time.perf_counter()
  run(np.arange(batch))
  compile_s = time.perf_counter() - t0
  out_tokens, out_mask = [], []
  t0 = time.perf_counter()
  for start in range(0, len(len_N), batch):
    tokens, mask = run(np.arange(start, start + batch))
    out_tokens.append(tokens)
    out_mask.append(mask)
  seconds = time.perf_counter() - t0
  mask = np.concatenate(out_mask)
  return {"seconds": seconds, "compile_s": compile_s, "tokens": np.concatenate(out_tokens), "mask": mask,
          "generated": int(mask.sum())}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="qwen2.5-coder-1.5b")
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--max-new-tokens", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--prompts", default=pools.DEFAULT_HELDOUT)
  args = parser.parse_args(argv)
  if args.rows < 1 or args.batch < 1 or args.rows % args.batch:
    raise SystemExit(f"--rows ({args.rows}) must be a positive multiple of --batch ({args.batch})")
  print(f"load average {os.getloadavg()[0]:.2f}; {args.target}, {args.rows} rows in batches of {args.batch}, "
        f"{args.max_new_tokens} new tokens, T = {args.temperature}", flush=True)
  results = {}
  for weights in hub.WEIGHTS:
    model = hub.load_model(args.target, weights=weights, scan_layers=False)
    tokens_NxP, len_N = _prompts(model, args.prompts, args.rows)
    print(f"{weights}: prompts of {int(len_N.min())}-{int(len_N.max())} tokens (width {tokens_NxP.shape[1]})",
          flush=True)
    results[weights] = _sample(model, tokens_NxP, len_N, args.batch, args.max_new_tokens, args.temperature)
    del model
  print(f"\n{'weights':<12} {'s / row':>8} {'tok/s':>7} {'first batch s (compiles)':>25} {'tokens':>7}   peak RSS "
        f"{runtime.peak_rss_gb():.2f} GB")
  for weights, r in results.items():
    print(f"{weights:<12} {r['seconds'] / args.rows:8.3f} {r['generated'] / r['seconds']:7.2f} "
          f"{r['compile_s']:25.1f} {r['generated']:7d}")
  a, b = results["dequantized"], results["quantized"]
  same = np.array_equal(a["tokens"], b["tokens"]) and np.array_equal(a["mask"], b["mask"])
  rows_differ = int((a["tokens"] != b["tokens"]).any(axis=1).sum())
  print(f"speed-up (dequantized s/row / quantized s/row): {a['seconds'] / b['seconds']:.2f}x; "
        f"same sampled tokens: {same}" + ("" if same else f" ({rows_differ} of {args.rows} rows differ)"))


if __name__ == "__main__":
  main()
