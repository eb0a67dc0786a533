"""Peer benchmark: our JAX speculative decoding vs transformers' assisted generation, same pair, prompts, γ, T.

    python -m blockspec_jax.eval.bench_peer [--quick] [--num-prompts 3] [--max-new-tokens 32]
        [--gammas 1,2,3,4,6,8] [--temperatures 0,1] [--hf-gammas 4] [--bf16-gammas 4] [--engines ours,bf16,hf]
        [--json results/bench_peer.json]
    python -m blockspec_jax.eval.bench_peer --from-json results/bench_peer.json   # the report of a saved run

Default pair: Qwen2.5-Coder 0.5B drafter → 1.5B target (one tokenizer), batch 1, CPU. One invocation runs every engine,
each in its own subprocess (``--worker ours|hf``, which writes a JSON file), one after the other, so that only one
engine's copy of the models is resident at a time and each engine's peak resident memory (``ru_maxrss`` of the worker)
is its own. The parent collects the JSON files, prints one table and the target checks, and writes ``--json``.

Workers:

* ``ours`` (``--dtype float32``, and ``bfloat16`` for the bf16 row): loads the pair with ``hub.load_model`` and decodes
  with :func:`blockspec_jax.run.run_method` (the main job's own function: prompts chat-templated and padded to one
  width, prefill and decode phase compiled and timed apart, compiled on prompt 0 before timing). Per T:
  autoregressive, then token- and block-verified speculative decoding for each γ, then autoregressive again (the
  faster of the two baselines is used, so drift of the machine over the sweep cannot inflate a speedup; both are
  printed). Speedups are reported end to end (prefill + decode) and for the decode phase alone, the phase the ideals
  model (a prompt's prefill is one compute-bound forward per model, outside BE / (1 + γ·c)). Then, with jitted
  single forwards on a cache of the loop's size at a representative position (prompt width + max_new_tokens / 2;
  ``bench_decode.forward_calls``; medians of ``--reps`` rounds, each round timing every forward of both models once,
  so the ratios are measured side by side): c = drafter 1-token forward / target 1-token forward, and v(γ) = target
  forward over γ+1 tokens / target 1-token forward. Ideal speedup BE / (1 + γ·c) (the issue's model) and the refined
  BE / (γ·c + v(γ)). Beside them, the ideal with c taken against the target step of the autoregressive loop itself
  (its decode ms per token: the step the speedup divides by; isolated 1-token forwards have measured 10–25% slower
  than it here). Where the time goes (:func:`time_breakdown`): ms per decode iteration against γ drafter forwards
  plus one verify pass, the rest being sampling, verifier, commit and loop; and tokens kept per target call (below BE
  when the token budget cuts a run's last block).
* ``hf``: transformers ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` on the same GGUF files, float32,
  ``torch.set_num_threads(--threads)``; the same token ids (the same chat template through our tokenizer, read from the
  drafter's GGUF, passed as ``input_ids``); ``generate`` with max_new_tokens, do_sample = T > 0, temperature, top_k=0,
  top_p=1, eos_token_id = our stop ids, and (assisted) ``assistant_model`` with num_assistant_tokens = γ,
  num_assistant_tokens_schedule = "constant" and assistant_confidence_threshold = 0 (no early exit of the draft).
  The assisted candidate generator reads those three from the *assistant's* ``generation_config``, so they are set
  there as well as in the call. Mean acceptance length = tokens generated / target forward calls (a forward hook on
  the target). One untimed warm-up generate per configuration.

Threads: XLA's CPU client uses one thread per core; ``--threads`` (default: the core count) sets torch to the same.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import types

DEFAULT_GAMMAS = (1, 2, 3, 4, 6, 8)
IDEAL_FRACTION_TARGET = 0.90     # (a) measured speedup ≥ 90% of BE / (1 + γ·c)
PEER_RATIO_TARGET = 1.5          # (b) ours (block) ≥ 1.5 × transformers assisted tokens/s
MAIN_JOB_RSS_TARGET_GB = 14.0


def _rows(args):
  from blockspec_jax.eval import prompts as prompts_lib
  return prompts_lib.load_prompts(args.prompts, limit=args.num_prompts)


# ------------------------------------------------------------------------------------------------------------------
# Worker: ours


def worker_ours(args) -> dict:
  import jax
  from blockspec_jax import run
  from blockspec_jax.eval import bench_decode, bench_verify
  from blockspec_jax.models import hub

  rows = _rows(args)
  start = time.perf_counter()
  target = hub.load_model(args.target, args.dtype)
  drafter = hub.load_model(args.drafter, args.dtype)
  run.check_pair(target, drafter)
  load_s = time.perf_counter() - start
  print(f"[ours {args.dtype}] loaded {args.drafter} → {args.target} in {load_s:.1f} s (jax {jax.__version__}, "
        f"{jax.devices()[0].platform})", flush=True)
  prompt_ids = run.encode_prompts(target, rows, chat=True)
  width = max(len(p) for p in prompt_ids)
  stop_ids = target.stop_ids
  max_gamma = max(args.gammas)
  if width + args.max_new_tokens + max_gamma + 1 > min(target.config.max_len, drafter.config.max_len):
    raise ValueError("prompts too long for the cache")
  results = []
  for temperature in args.temperatures:
    # The autoregressive baseline runs before and after the speculative sweep at this T (pass 0 and 1): drift of the
    # machine over the sweep shows as the gap between them, and the speedups use the faster one (conservative).
    plan = [("autoregressive", [None], 0), ("token", args.gammas, 0), ("block", args.gammas, 0),
            ("autoregressive", [None], 1)]
    for method, gammas, repeat in plan:
      if method not in args.methods:
        continue
      for gamma in gammas:
        t0 = time.perf_counter()
        summary, _ = run.run_method(method, target, drafter, prompt_ids, width, gamma=gamma or 1,
                                    max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed,
                                    stop_ids=stop_ids)
        summary["gamma"] = gamma
        summary["repeat"] = repeat
        summary["total_s_incl_compile"] = time.perf_counter() - t0
        results.append(summary)
        print(f"[ours {args.dtype}] {method:<14} T={temperature:g} γ={gamma or '-'}"
              f"{' (again)' if repeat else ''}: {summary['tokens_per_s']:.2f} tok/s end to end, "
              f"{summary['decode_tokens_per_s']:.2f} decode phase (prefill {summary['prefill_s']:.1f} s)"
              + (f", BE {summary['block_efficiency']:.2f}" if "block_efficiency" in summary else "")
              + f" ({summary['total_s_incl_compile']:.0f} s with compile)", flush=True)
  # Forward costs at a representative position of a cache of the loop's size.
  cache_len = width + args.max_new_tokens + max_gamma + 1
  position = width + args.max_new_tokens // 2
  key = jax.random.key(args.seed)
  t0 = time.perf_counter()
  # Target and drafter forwards timed round-robin in the same rounds: c and v(γ) are ratios measured side by side.
  calls = {("target", t): call for t, call in bench_decode.forward_calls(
      target.config, target.params["params"], cache_len, position, sorted({1} | {g + 1 for g in args.gammas}),
      key).items()}
  calls[("drafter", 1)] = bench_decode.forward_calls(drafter.config, drafter.params["params"], cache_len, position,
                                                     (1,), key)[1]
  timed = bench_verify.interleaved_median_ms(calls, args.reps)
  target_ms = {t: ms for (model, t), ms in timed.items() if model == "target"}
  drafter_ms = {1: timed[("drafter", 1)]}
  print(f"[ours {args.dtype}] forwards: target {', '.join(f'{t} tok {ms:.0f} ms' for t, ms in target_ms.items())}; "
        f"drafter 1 tok {drafter_ms[1]:.0f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
  return dict(engine="ours", dtype=args.dtype, load_s=load_s, prompt_ids=prompt_ids, stop_ids=list(stop_ids),
              width=width, cache_len=cache_len, position=position,
              target_forward_ms={str(k): v for k, v in target_ms.items()}, drafter_forward_ms=drafter_ms[1],
              results=results, peak_rss_gb=run.peak_rss_gb())


# ------------------------------------------------------------------------------------------------------------------
# Worker: transformers


def worker_hf(args) -> dict:
  import torch
  import transformers
  from blockspec_jax import run
  from blockspec_jax.models import gguf_convert, registry
  from blockspec_jax.models.tokenizer import tokenizer_from_gguf

  torch.set_num_threads(args.threads)
  rows = _rows(args)
  target_path = registry.fetch_gguf(args.target, progress=False)
  drafter_path = registry.fetch_gguf(args.drafter, progress=False)
  tokenizer = tokenizer_from_gguf(gguf_convert.read_gguf(drafter_path).metadata)
  prompt_ids = run.encode_prompts(types.SimpleNamespace(tokenizer=tokenizer), rows, chat=True)  # same ids as ours
  stop_ids = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
  start = time.perf_counter()
  load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name,
                                                                      dtype=torch.float32).eval()
  target, drafter = load(target_path), load(drafter_path)
  load_s = time.perf_counter() - start
  print(f"[hf] transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"loaded in {load_s:.1f} s", flush=True)
  calls = [0]
  target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

  def gen_config(temperature, gamma, max_new_tokens):
    kw = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=temperature > 0, top_k=0, top_p=1.0,
              repetition_penalty=1.0, eos_token_id=stop_ids, pad_token_id=stop_ids[0] if stop_ids else 0)
    if temperature > 0:
      kw["temperature"] = temperature
    if gamma is not None:
      kw.update(num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0)
    return transformers.GenerationConfig(**kw)

  def generate(ids, temperature, gamma, max_new_tokens, seed):
    cfg = gen_config(temperature, gamma, max_new_tokens)
    extra = {}
    if gamma is not None:
      # AssistedCandidateGenerator reads these from the assistant's own generation_config.
      drafter.generation_config.num_assistant_tokens = gamma
      drafter.generation_config.num_assistant_tokens_schedule = "constant"
      drafter.generation_config.assistant_confidence_threshold = 0.0
      extra["assistant_model"] = drafter
    torch.manual_seed(seed)
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.inference_mode():
      out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=cfg,
                            **extra)
    new = out[0, len(ids):].tolist()
    # generate pads finished rows with pad_token_id; batch 1 stops at the first stop id (kept, as ours counts it).
    for i, t in enumerate(new):
      if t in stop_ids:
        return new[:i + 1]
    return new

  results = []
  for temperature in args.temperatures:
    for method, gammas in (("autoregressive", [None]), ("assisted", args.hf_gammas)):
      for gamma in gammas:
        t0 = time.perf_counter()
        generate(prompt_ids[0], temperature, gamma, args.max_new_tokens, args.seed)  # warm-up
        wall, tokens, target_calls, outputs = 0.0, 0, 0, []
        for i, ids in enumerate(prompt_ids):
          calls[0] = 0
          start = time.perf_counter()
          new = generate(ids, temperature, gamma, args.max_new_tokens, args.seed + i)
          wall += time.perf_counter() - start
          tokens += len(new)
          target_calls += calls[0]
          outputs.append(new)
        summary = dict(method=method, temperature=temperature, gamma=gamma, prompts=len(prompt_ids),
                       tokens_generated=tokens, target_calls=target_calls, wall_s=wall, tokens_per_s=tokens / wall,
                       total_s_incl_warmup=time.perf_counter() - t0)
        if gamma is not None:
          summary["block_efficiency"] = tokens / target_calls
        results.append(summary)
        print(f"[hf] {method:<14} T={temperature:g} γ={gamma or '-'}: {summary['tokens_per_s']:.2f} tok/s"
              + (f", BE {summary['block_efficiency']:.2f}" if gamma else "")
              + f" (target calls {target_calls}, tokens {tokens})", flush=True)
  return dict(engine="hf", dtype="float32", load_s=load_s, threads=torch.get_num_threads(), prompt_ids=prompt_ids,
              stop_ids=stop_ids, transformers=transformers.__version__, torch=torch.__version__, results=results,
              peak_rss_gb=run.peak_rss_gb())


# ------------------------------------------------------------------------------------------------------------------
# Parent: estimate, spawn, table, checks


def estimate_seconds(args) -> dict:
  """Rough runtime: 1.5B f32 target ≈ 2 tok/s, speculative ≈ 1.3× that, one warm-up decode per program, ≈ 20 s of
  compilation per JAX program, ≈ 60 s of model loading per worker."""
  n, p, tps, compile_s = args.max_new_tokens, args.num_prompts, 2.0, 20.0
  decode = lambda speedup: (p + 1) * n / (tps * speedup)
  est = {}
  if "ours" in args.engines:
    per_t = 2 * decode(1) + compile_s + 2 * len(args.gammas) * (decode(1.3) + compile_s)  # baseline twice
    est["ours"] = 60 + len(args.temperatures) * per_t + (len(args.gammas) + 2) * (compile_s / 2)
  if "bf16" in args.engines:
    est["bf16"] = 60 + len(args.temperatures[:1]) * (2 * decode(1) + compile_s + len(args.bf16_gammas) * (
        decode(1.3) + compile_s)) + 3 * compile_s
  if "hf" in args.engines:
    est["hf"] = 90 + len(args.temperatures) * (decode(1) + len(args.hf_gammas) * decode(1.0))
  est["total"] = sum(est.values())
  return est


def _spawn(worker: str, args, extra: list[str], out_dir: pathlib.Path) -> dict:
  out = out_dir / f"{worker}{'-'.join([''] + extra[1::2])}.json"
  argv = [sys.executable, "-m", "blockspec_jax.eval.bench_peer", "--worker", worker, "--worker-out", str(out),
          "--target", args.target, "--drafter", args.drafter, "--prompts", args.prompts,
          "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
          "--gammas", ",".join(map(str, args.gammas)), "--hf-gammas", ",".join(map(str, args.hf_gammas)),
          "--temperatures", ",".join(map(str, args.temperatures)), "--threads", str(args.threads),
          "--reps", str(args.reps), "--seed", str(args.seed), *extra]
  start = time.perf_counter()
  proc = subprocess.run(argv)
  if proc.returncode != 0:
    print(f"!! worker {worker} {' '.join(extra)} failed with exit status {proc.returncode}", flush=True)
    return {}
  report = json.loads(out.read_text())
  report["worker_wall_s"] = time.perf_counter() - start
  return report


def _verdict(ok: bool) -> str:
  return "PASS" if ok else "MISS"


def time_breakdown(result: dict, rep: dict) -> dict:
  """Where one decode iteration's time goes, from a run's decode phase and the isolated forwards of the same worker.

  Autoregressive: ms per token in the loop vs one isolated 1-token target forward. Speculative: ms per iteration
  (decode time / target calls) = γ drafter forwards (a propose is one 2-token forward and γ − 1 1-token forwards,
  each costing about a 1-token forward with the streaming kernel) + one target pass over γ + 1 tokens + the rest:
  sampling the drafter's and the target's full-vocabulary rows, the verifier, the commit and the loop itself. The
  rest is what the ideals leave out."""
  target_ms = {int(k): v for k, v in rep["target_forward_ms"].items()}
  out = dict(method=result["method"], temperature=result["temperature"], gamma=result["gamma"])
  if result["method"] == "autoregressive":
    step_ms = 1e3 * result["decode_s"] / result["tokens_generated"]
    return dict(out, iteration_ms=step_ms, drafter_ms=0.0, verify_ms=target_ms[1], rest_ms=step_ms - target_ms[1],
              tokens_per_call=1.0)
  g = result["gamma"]
  iteration_ms = 1e3 * result["decode_s"] / result["target_calls"]
  drafter_ms, verify_ms = g * rep["drafter_forward_ms"], target_ms[g + 1]
  return dict(out, iteration_ms=iteration_ms, drafter_ms=drafter_ms, verify_ms=verify_ms,
              rest_ms=iteration_ms - drafter_ms - verify_ms,
              tokens_per_call=result["tokens_generated"] / result["target_calls"])


def analyse(ours: dict, bf16: dict, hf: dict) -> dict:
  """Speedups, ideals and the checks (a), (b), (c)."""
  rows, checks = [], dict(a=[], b=[], c=[], fastest={}, bf16=[], drift={}, time=[])
  costs = {}
  for rep in (ours, bf16):
    if not rep:
      continue
    t1 = rep["target_forward_ms"]["1"]
    c = rep["drafter_forward_ms"] / t1
    v = {int(k): ms / t1 for k, ms in rep["target_forward_ms"].items()}
    costs[rep["dtype"]] = dict(c=c, v=v, target_1tok_ms=t1, drafter_1tok_ms=rep["drafter_forward_ms"])
    # Baselines per T: the faster of the autoregressive passes before and after the sweep (conservative speedups).
    ar_rows = [r for r in rep["results"] if r["method"] == "autoregressive"]
    ar = {t: max(r["tokens_per_s"] for r in ar_rows if r["temperature"] == t) for t in {r["temperature"] for r in ar_rows}}
    ar_decode = {t: max(r["decode_tokens_per_s"] for r in ar_rows if r["temperature"] == t) for t in ar}
    # The same c with the target step taken from the baseline's own loop (ms per autoregressive token, decode phase).
    c_loop = {t: rep["drafter_forward_ms"] * ar_decode[t] / 1e3 for t in ar}
    costs[rep["dtype"]]["c_loop"] = {str(t): x for t, x in c_loop.items()}
    for r in rep["results"]:
      row = dict(engine=f"ours-{'f32' if rep['dtype'] == 'float32' else 'bf16'}", **{
          k: r.get(k) for k in ("method", "temperature", "gamma", "repeat", "tokens_per_s", "decode_tokens_per_s",
                                "prefill_s", "decode_s", "block_efficiency", "tokens_generated", "target_calls",
                                "wall_s")})
      base, base_decode = ar.get(r["temperature"]), ar_decode.get(r["temperature"])
      row["speedup"] = r["tokens_per_s"] / base if base else None
      row["decode_speedup"] = r["decode_tokens_per_s"] / base_decode if base_decode else None
      if r["gamma"] is not None and r["method"] != "autoregressive":
        g, be = r["gamma"], r["block_efficiency"]
        row["ideal"] = be / (1 + g * c)
        row["ideal_refined"] = be / (g * c + v[g + 1])
        if r["temperature"] in c_loop:
          row["ideal_loop"] = be / (1 + g * c_loop[r["temperature"]])
          row["decode_over_ideal_loop"] = row["decode_speedup"] / row["ideal_loop"]
        row["measured_over_ideal"] = row["speedup"] / row["ideal"] if row["speedup"] else None
        row["measured_over_refined"] = row["speedup"] / row["ideal_refined"] if row["speedup"] else None
        row["decode_over_ideal"] = row["decode_speedup"] / row["ideal"] if row["decode_speedup"] else None
        row["decode_over_refined"] = row["decode_speedup"] / row["ideal_refined"] if row["decode_speedup"] else None
      if rep["dtype"] == "float32" and r.get("decode_s") and not r.get("repeat"):
        checks["time"].append(time_breakdown(r, rep))
      rows.append(row)
  if hf:
    ar = {r["temperature"]: r["tokens_per_s"] for r in hf["results"] if r["method"] == "autoregressive"}
    for r in hf["results"]:
      row = dict(engine="hf-f32", **{k: r.get(k) for k in ("method", "temperature", "gamma", "tokens_per_s",
                                                           "block_efficiency", "tokens_generated", "target_calls",
                                                           "wall_s")})
      base = ar.get(r["temperature"])
      row["speedup"] = r["tokens_per_s"] / base if base else None
      rows.append(row)
  find = lambda engine, method, t, g, repeat=0: next(
      (r for r in rows if r["engine"] == engine and r["method"] == method and r["temperature"] == t
       and r["gamma"] == g and (r.get("repeat") or 0) == repeat), None)
  f32 = [r for r in rows if r["engine"] == "ours-f32"]
  for t in sorted({r["temperature"] for r in f32}):
    spec_rows = [r for r in f32 if r["temperature"] == t and r["method"] in ("token", "block")]
    for r in spec_rows:
      if r["method"] == "block":
        checks["a"].append(dict(temperature=t, gamma=r["gamma"], speedup=r["speedup"], ideal=r["ideal"],
                                ratio=r["measured_over_ideal"], refined=r["ideal_refined"],
                                ratio_refined=r["measured_over_refined"],
                                decode_speedup=r["decode_speedup"], decode_ratio=r["decode_over_ideal"],
                                decode_ratio_refined=r["decode_over_refined"],
                                ideal_loop=r.get("ideal_loop"), decode_ratio_loop=r.get("decode_over_ideal_loop"),
                                passed=r["measured_over_ideal"] >= IDEAL_FRACTION_TARGET,
                                decode_passed=r["decode_over_ideal"] >= IDEAL_FRACTION_TARGET))
    ar_passes = [r for r in f32 if r["temperature"] == t and r["method"] == "autoregressive"]
    if len(ar_passes) > 1:
      checks["drift"][str(t)] = dict(tokens_per_s=[r["tokens_per_s"] for r in ar_passes],
                                     decode_tokens_per_s=[r["decode_tokens_per_s"] for r in ar_passes])
    if spec_rows:
      best = max(spec_rows, key=lambda r: r["tokens_per_s"])
      best_decode = max(spec_rows, key=lambda r: r["decode_tokens_per_s"])
      checks["fastest"][str(t)] = dict(gamma=best["gamma"], method=best["method"], tokens_per_s=best["tokens_per_s"],
                                       speedup=best["speedup"], decode_gamma=best_decode["gamma"],
                                       decode_method=best_decode["method"],
                                       decode_tokens_per_s=best_decode["decode_tokens_per_s"],
                                       decode_speedup=best_decode["decode_speedup"])
    for g in sorted({r["gamma"] for r in spec_rows}):
      tok, blk = find("ours-f32", "token", t, g), find("ours-f32", "block", t, g)
      if tok and blk and t == 1.0:
        checks["c"].append(dict(temperature=t, gamma=g, be_token=tok["block_efficiency"],
                                be_block=blk["block_efficiency"],
                                gain=blk["block_efficiency"] / tok["block_efficiency"] - 1,
                                passed=blk["block_efficiency"] >= tok["block_efficiency"]))
  for r in rows:
    if r["engine"] == "hf-f32" and r["method"] == "assisted":
      ours_row = find("ours-f32", "block", r["temperature"], r["gamma"])
      if ours_row:
        ratio = ours_row["tokens_per_s"] / r["tokens_per_s"]
        checks["b"].append(dict(temperature=r["temperature"], gamma=r["gamma"], ours=ours_row["tokens_per_s"],
                                hf=r["tokens_per_s"], ratio=ratio, ours_be=ours_row["block_efficiency"],
                                hf_be=r["block_efficiency"], passed=ratio >= PEER_RATIO_TARGET))
  for r in rows:
    if r["engine"] == "ours-bf16":
      ref = find("ours-f32", r["method"], r["temperature"], r["gamma"], r.get("repeat") or 0)
      if ref:
        checks["bf16"].append(dict(method=r["method"], temperature=r["temperature"], gamma=r["gamma"],
                                   repeat=r.get("repeat") or 0, bf16=r["tokens_per_s"], f32=ref["tokens_per_s"],
                                   ratio=r["tokens_per_s"] / ref["tokens_per_s"],
                                   decode_ratio=r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]))
  return dict(rows=rows, checks=checks, costs=costs)


def _f(x, fmt):
  return "-" if x is None else format(x, fmt)


def print_report(analysis: dict, ours: dict, bf16: dict, hf: dict, args) -> None:
  rows, checks, costs = analysis["rows"], analysis["checks"], analysis["costs"]
  print()
  print(f"peer benchmark: {args.drafter} → {args.target}, batch 1, CPU, {args.num_prompts} prompts, "
        f"{args.max_new_tokens} new tokens, threads {args.threads}")
  for dtype, c in costs.items():
    v = ", ".join(f"v({k - 1})={x:.2f}" for k, x in sorted(c["v"].items()) if k > 1)
    print(f"forward costs ({dtype}, cache position {ours.get('position') if ours else '?'}): target 1 token "
          f"{c['target_1tok_ms']:.0f} ms, drafter 1 token {c['drafter_1tok_ms']:.0f} ms → c = {c['c']:.3f}; "
          f"verify pass over γ+1 tokens / 1 token: {v}; c with the target step of the autoregressive loop: "
          + ", ".join(f"T={float(t):g} {x:.3f}" for t, x in c.get("c_loop", {}).items()))
  header = (f"{'engine':<9} {'method':<14} {'T':>3} {'γ':>2} | {'tok/s':>6} {'BE':>5} {'calls':>5} {'tokens':>6} | "
            f"{'speedup':>7} {'ideal':>6} {'meas/id':>7} {'ideal2':>6} {'meas/id2':>8} | {'prefill':>7} {'dec t/s':>7} "
            f"{'dec x':>6} {'dec/id':>6} {'dec/id2':>7}")
  print(header)
  print("-" * len(header))
  for r in rows:
    method = r["method"] + (" (again)" if r.get("repeat") else "")
    print(f"{r['engine']:<9} {method:<14} {r['temperature']:>3g} {r['gamma'] or '-':>2} | "
          f"{r['tokens_per_s']:>6.2f} {_f(r.get('block_efficiency'), '5.2f'):>5} {r['target_calls']:>5} "
          f"{r['tokens_generated']:>6} | {_f(r['speedup'], '6.2f'):>6}x {_f(r.get('ideal'), '6.2f'):>6} "
          f"{_f(r.get('measured_over_ideal'), '7.2f'):>7} {_f(r.get('ideal_refined'), '6.2f'):>6} "
          f"{_f(r.get('measured_over_refined'), '8.2f'):>8} | {_f(r.get('prefill_s'), '6.1f'):>6}s "
          f"{_f(r.get('decode_tokens_per_s'), '7.2f'):>7} {_f(r.get('decode_speedup'), '5.2f'):>5}x "
          f"{_f(r.get('decode_over_ideal'), '6.2f'):>6} {_f(r.get('decode_over_refined'), '7.2f'):>7}")
  print("BE: mean acceptance length (tokens per target call); speedup: tokens/s over the same engine's autoregressive "
        "decoding at the same T (ours: the faster of the passes before and after the sweep), end to end; "
        "ideal = BE/(1+γc); ideal2 = BE/(γc+v(γ)); prefill: prompt forwards, timed apart; dec: the decode phase alone "
        "(the phase both ideals model).")
  print()
  for t, d in checks["drift"].items():
    print(f"drift at T={float(t):g}: autoregressive before / after the sweep {d['tokens_per_s'][0]:.2f} / "
          f"{d['tokens_per_s'][1]:.2f} tok/s end to end, {d['decode_tokens_per_s'][0]:.2f} / "
          f"{d['decode_tokens_per_s'][1]:.2f} decode phase")
  for a in checks["a"]:
    print(f"(a) T={a['temperature']:g} γ={a['gamma']}: decode phase {a['decode_speedup']:.2f}x vs ideal "
          f"{a['ideal']:.2f}x = {100 * a['decode_ratio']:.0f}% (target ≥ {100 * IDEAL_FRACTION_TARGET:.0f}%) "
          f"{_verdict(a['decode_passed'])}, vs refined {a['refined']:.2f}x = {100 * a['decode_ratio_refined']:.0f}%"
          + (f", vs ideal with the loop's own target step {a['ideal_loop']:.2f}x = {100 * a['decode_ratio_loop']:.0f}%"
             if a.get("ideal_loop") else "") + "; "
          f"end to end (with prefill) {a['speedup']:.2f}x = {100 * a['ratio']:.0f}% {_verdict(a['passed'])}")
  for b in checks["time"]:
    if b["method"] == "autoregressive":
      print(f"time T={b['temperature']:g} autoregressive: {b['iteration_ms']:.0f} ms per token in the loop = target "
            f"1-token forward {b['verify_ms']:.0f} + rest {b['rest_ms']:.0f} ms")
    elif b["method"] == "block":
      print(f"time T={b['temperature']:g} block γ={b['gamma']}: {b['iteration_ms']:.0f} ms per iteration = drafter "
            f"{b['gamma']}×{b['drafter_ms'] / b['gamma']:.0f} + verify pass {b['verify_ms']:.0f} + rest "
            f"{b['rest_ms']:.0f} ms ({100 * b['rest_ms'] / b['iteration_ms']:.0f}%: sampling, verifier, commit, loop); "
            f"{b['tokens_per_call']:.2f} tokens kept per call (the token budget cuts the last block)")
  for t, b in checks["fastest"].items():
    print(f"(a) fastest at T={float(t):g}: end to end γ={b['gamma']} ({b['method']}), {b['tokens_per_s']:.2f} tok/s, "
          f"{b['speedup']:.2f}x autoregressive; decode phase γ={b['decode_gamma']} ({b['decode_method']}), "
          f"{b['decode_tokens_per_s']:.2f} tok/s, {b['decode_speedup']:.2f}x")
  for b in checks["b"]:
    print(f"(b) T={b['temperature']:g} γ={b['gamma']}: ours block {b['ours']:.2f} tok/s (BE {b['ours_be']:.2f}) / "
          f"transformers assisted {b['hf']:.2f} tok/s (BE {b['hf_be']:.2f}) = {b['ratio']:.2f}x "
          f"(target ≥ {PEER_RATIO_TARGET}x) {_verdict(b['passed'])}")
  for c in checks["c"]:
    print(f"(c) T={c['temperature']:g} γ={c['gamma']}: BE block {c['be_block']:.3f} vs token {c['be_token']:.3f}, "
          f"gain {100 * c['gain']:+.1f}% {_verdict(c['passed'])}")
  if checks["c"]:
    print("(c) these are realised BE of two different trajectories (a few dozen drafts per run, standard error "
          "±0.1–0.3); the gain on identical contexts and drafts: python -m blockspec_jax.eval.paired")
  for b in checks["bf16"]:
    print(f"bf16 {b['method']}{' (again)' if b['repeat'] else ''} T={b['temperature']:g} γ={b['gamma'] or '-'}: "
          f"{b['bf16']:.2f} tok/s vs f32 {b['f32']:.2f} = {b['ratio']:.2f}x end to end, {b['decode_ratio']:.2f}x "
          f"decode phase → {'pays' if b['ratio'] > 1.0 else 'does not pay'} end to end, "
          f"{'pays' if b['decode_ratio'] > 1.0 else 'does not pay'} in the decode phase")
  for name, rep in (("ours float32 (the main job's pair)", ours), ("ours bfloat16", bf16), ("transformers", hf)):
    if rep:
      extra = ""
      if rep is ours:
        extra = (f" (target ≤ {MAIN_JOB_RSS_TARGET_GB:.0f} GB) "
                 f"{_verdict(rep['peak_rss_gb'] <= MAIN_JOB_RSS_TARGET_GB)}")
      print(f"peak RSS, {name} worker: {rep['peak_rss_gb']:.2f} GB (10^9 bytes){extra}; worker wall "
            f"{rep.get('worker_wall_s', 0):.0f} s")
  if ours and hf and ours["prompt_ids"] != hf["prompt_ids"]:
    print("WARNING: the two engines did not get the same prompt token ids")
  elif ours and hf:
    print(f"same prompt token ids in both engines (lengths {[len(p) for p in ours['prompt_ids']]}), same stop ids "
          f"{ours['stop_ids']} / {hf['stop_ids']}")


def _ints(s):
  return [int(x) for x in s.split(",") if x]


def _floats(s):
  return [float(x) for x in s.split(",") if x]


def parse_args(argv=None):
  from blockspec_jax.eval import prompts as prompts_lib
  p = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.bench_peer", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default="qwen2.5-coder-1.5b")
  p.add_argument("--drafter", default="qwen2.5-coder-0.5b")
  p.add_argument("--prompts", default=str(prompts_lib.DEFAULT_PROMPTS))
  p.add_argument("--num-prompts", type=int, default=3, help="round-robin over tasks: 3 = one code, chat, math")
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--gammas", type=_ints, default=list(DEFAULT_GAMMAS), help="our γ sweep (comma separated)")
  p.add_argument("--hf-gammas", type=_ints, default=[4], help="γ values also run in transformers")
  p.add_argument("--bf16-gammas", type=_ints, default=[4], help="γ values of the bfloat16 row (block, first T)")
  p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
  p.add_argument("--engines", default="ours,bf16,hf", help="subset of ours,bf16,hf")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--reps", type=int, default=9, help="rounds of the single-forward timings (median)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true",
                 help="1 prompt, 16 new tokens, γ ∈ {2, 4}, transformers and bf16 at γ = 4, 3 reps")
  p.add_argument("--json", default="results/bench_peer.json")
  p.add_argument("--from-json", help="print the report of a saved run's measurements (its JSON) without running")
  p.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
  p.add_argument("--worker-out", help=argparse.SUPPRESS)
  p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
  p.add_argument("--methods", default="autoregressive,token,block", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.quick and not args.worker:
    args.num_prompts, args.max_new_tokens, args.gammas, args.hf_gammas, args.bf16_gammas, args.reps = (
        1, 16, [2, 4], [4], [4], 3)
  args.engines = [e for e in args.engines.split(",") if e]
  args.methods = [m for m in args.methods.split(",") if m]
  if min(args.gammas + args.hf_gammas + args.bf16_gammas) < 1:
    p.error("every γ must be ≥ 1")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    report = worker_ours(args) if args.worker == "ours" else worker_hf(args)
    pathlib.Path(args.worker_out).write_text(json.dumps(report))
    return 0
  if args.from_json:
    try:
      saved = json.loads(pathlib.Path(args.from_json).read_text())
      workers, config = saved["workers"], saved["config"]
    except (OSError, ValueError, KeyError) as e:
      raise SystemExit(f"--from-json {args.from_json}: not a bench_peer JSON with 'workers' and 'config' ({e!r})")
    print_report(analyse(workers["ours"], workers["bf16"], workers["hf"]), workers["ours"], workers["bf16"],
                 workers["hf"], types.SimpleNamespace(**config))
    return 0
  est = estimate_seconds(args)
  print(f"bench_peer: {args.drafter} → {args.target}; {args.num_prompts} prompts × {args.max_new_tokens} new tokens; "
        f"ours γ ∈ {args.gammas}, T ∈ {args.temperatures}; transformers γ ∈ {args.hf_gammas}; bf16 γ ∈ "
        f"{args.bf16_gammas}; engines {args.engines}; {args.threads} threads")
  print("estimated runtime (≈2 tok/s target, ≈20 s compile per JAX program): "
        + ", ".join(f"{k} {v / 60:.0f} min" for k, v in est.items()), flush=True)
  start = time.perf_counter()
  ours = bf16 = hf = {}
  with tempfile.TemporaryDirectory(prefix="bench_peer-") as tmp:
    tmp = pathlib.Path(tmp)
    if "ours" in args.engines:
      ours = _spawn("ours", args, ["--dtype", "float32"], tmp)
    if "bf16" in args.engines:
      bf16 = _spawn("ours", args, ["--dtype", "bfloat16", "--methods", "autoregressive,block",
                                   "--gammas", ",".join(map(str, args.bf16_gammas)),
                                   "--temperatures", str(args.temperatures[0])], tmp)
    if "hf" in args.engines:
      hf = _spawn("hf", args, [], tmp)
  config = {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")}
  workers = dict(ours=ours, bf16=bf16, hf=hf)
  path = pathlib.Path(args.json) if args.json else None
  if path:  # the raw measurements first: an hour of work survives a failure in the analysis below
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(config=config, estimate_s=est, workers=workers), indent=2))
  analysis = analyse(ours, bf16, hf)
  print_report(analysis, ours, bf16, hf, args)
  total = time.perf_counter() - start
  print(f"total runtime {total:.0f} s (estimated {est['total']:.0f} s)")
  if path:
    path.write_text(json.dumps(dict(config=config, estimate_s=est, total_s=total, workers=workers, **analysis),
                               indent=2))
    print(f"wrote {path}")
  return 0 if (ours or bf16 or hf) else 1


if __name__ == "__main__":
  sys.exit(main())
