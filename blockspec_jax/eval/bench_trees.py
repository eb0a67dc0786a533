"""Tokens/s of trees against chains on real models, side by side in one run (the fair-cost question: a 16-node tree
costs a wider target pass and more drafter work than an 8-token chain).

    python -m blockspec_jax.eval.bench_trees [--paired results/paired_trees.json] [--temperature 1]
        [--num-prompts 3] [--max-new-tokens 32] [--json results/bench_trees.json]

Arms: autoregressive decoding of the target; chain-block at γ ∈ {4, 8}; and, for every tree rule, the arm with the
highest block efficiency in the paired measurement at that temperature (``--paired``, made by
``python -m blockspec_jax.eval.paired --trees``; without it, every tree arm at 8 and 16 nodes). Each arm decodes the
same prompts with :func:`blockspec_jax.harness.run_method` (prefill and decode compiled and timed apart), in one
process, one after the other: at batch 1 on one device; on several, one prompt per device at a time (every device
over ``data``, the models' parameters laid out once; the same tokens, and tokens/s then the throughput of that many
rows at once).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def _arms(paired_path, temperature: float):
  """``[(method, gamma, drafter_settings, label)]``."""
  from blockspec_jax.eval import paired_trees as pt
  arms = [("block", 4, {}, "chain γ=4"), ("block", 8, {}, "chain γ=8")]
  candidates = [a for b in (8, 16) for a in pt.arms_for_budget(b) if a.drafter != "model"]
  if paired_path and pathlib.Path(paired_path).exists():
    results = [r for r in json.loads(pathlib.Path(paired_path).read_text())["results"]
               if r["temperature"] == temperature]
    best = {}
    for row in pt.summarize_arms(results):
      if row["arm"] != "chain" and row["be"] > best.get(row["rule"], (0,))[0]:
        best[row["rule"]] = (row["be"], row["budget"], row["arm"])
    by_label = {(a.label, b): a for b in (4, 8, 16) for a in pt.arms_for_budget(b)}
    for rule, (_, budget, label) in sorted(best.items()):
      arm = by_label[(label, budget)]
      arms.append((f"{rule}@{arm.drafter}", arm.gamma, {arm.drafter: dict(arm.settings)}, f"{label} N={budget}"))
    return arms
  for arm in candidates:
    for rule in arm.rules:
      arms.append((f"{rule}@{arm.drafter}", arm.gamma, {arm.drafter: dict(arm.settings)}, arm.label))
  return arms


def build_parser() -> argparse.ArgumentParser:
  """The command line (also the gin job ``bench_trees``'s settings and defaults, ``blockspec_jax.main``)."""
  from blockspec_jax import methods
  ap = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.bench_trees", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--target", default=methods.DEFAULT_TARGET)
  ap.add_argument("--drafter", default=methods.DEFAULT_DRAFTER)
  ap.add_argument("--paired", default="results/paired_trees.json")
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--num-prompts", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default="results/bench_trees.json")
  ap.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                  help="the devices' mesh, data × model = every device (e.g. 4x2): prompts over data, both models' "
                       "parameters over model; default every device over data")
  return ap


def main(argv=None) -> int:
  from blockspec_jax import cli
  from blockspec_jax.eval import harness
  from blockspec_jax import methods
  from blockspec_jax import parallel
  from blockspec_jax import runtime
  from blockspec_jax import sources
  from blockspec_jax.data import prompts as prompts_lib

  ap = build_parser()
  args = ap.parse_args(argv)
  with cli.cli_errors(ap.prog):
    methods.check_settings(temperatures=(args.temperature,), num_prompts=args.num_prompts,
                        max_new_tokens=args.max_new_tokens, models=(args.target, args.drafter))
    arms = _arms(args.paired, args.temperature)
    for method, _, _, _ in arms:
      methods.parse_method(method)
    mesh_shape = parallel.parse_mesh_shape(args.mesh)
    mesh = parallel.job_mesh(mesh_shape)
  start = time.perf_counter()
  target, (drafter,), _ = sources.load_models(args.target, [args.drafter])  # one object when they are one model
  if mesh is not None:
    target, drafter = parallel.shard_models((target, drafter), mesh)
  rows = prompts_lib.load_prompts(prompts_lib.DEFAULT_PROMPTS, limit=args.num_prompts)
  prompt_ids = prompts_lib.encode_prompts(target, rows)
  width = max(len(p) for p in prompt_ids)
  nodes = max(methods.build_drafter(methods.parse_method(m)[1], target, drafter, s, g).num_nodes(g) for m, g, s, _ in arms)
  methods.check_cache_room(width, args.max_new_tokens, nodes, target.config, drafter.config)
  common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                stop_ids=target.stop_ids, mesh=mesh)
  baseline, _ = harness.run_method(methods.AUTOREGRESSIVE, target, drafter, prompt_ids, width, gamma=1, **common)
  baseline["label"] = "autoregressive"
  results = [baseline]
  for method, gamma, settings, label in arms:
    summary, _ = harness.run_method(method, target, drafter, prompt_ids, width, gamma=gamma, drafter_settings=settings,
                                 **common)
    summary["label"] = label
    results.append(summary)
    print(f"  {method:<20} {label:<22} BE {summary['block_efficiency']:.2f}, decode "
          f"{summary['decode_tokens_per_s']:.2f} tok/s", flush=True)
  print(f"\n{'method':<20} {'arm':<22} {'N':>3} {'BE':>5} {'tok/s':>7} {'dec tok/s':>9} {'dec ×AR':>7}")
  for r in results:
    be = f"{r['block_efficiency']:5.2f}" if "block_efficiency" in r else "    -"
    print(f"{r['method']:<20} {r['label']:<22} {r.get('draft_nodes', '-')!s:>3} {be} {r['tokens_per_s']:>7.2f} "
          f"{r['decode_tokens_per_s']:>9.2f} {r['decode_tokens_per_s'] / baseline['decode_tokens_per_s']:>6.2f}x")
  layout = "at batch 1" if mesh is None else f"{mesh.shape['data']} prompts at a time on {mesh.size} devices"
  print(f"T = {args.temperature:g}, {len(prompt_ids)} prompts × {args.max_new_tokens} tokens {layout}; "
        f"{time.perf_counter() - start:.0f} s; peak RSS {runtime.peak_rss_gb():.1f} GB")
  if args.json:
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    config = dict(vars(args), mesh=list(mesh_shape))
    path.write_text(json.dumps(dict(config=config, devices=runtime.describe_devices(mesh), results=results),
                               indent=1))
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
