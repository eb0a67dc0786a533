"""bench_peer's report: the table of every engine's rows and one line per check (a), (b), (c), drift, time, bf16 and
peak memory, printed from :func:`blockspec_jax.eval.peer_analysis.analyse`'s result."""

from __future__ import annotations

from blockspec_jax.eval.peer_analysis import (IDEAL_FRACTION_TARGET, MAIN_JOB_RSS_TARGET_GB, PEER_RATIO_TARGET,
                                              verdict)


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
          f"{verdict(a['decode_passed'])}, vs refined {a['refined']:.2f}x = {100 * a['decode_ratio_refined']:.0f}%"
          + (f", vs ideal with the loop's own target step {a['ideal_loop']:.2f}x = {100 * a['decode_ratio_loop']:.0f}%"
             if a.get("ideal_loop") else "") + "; "
          f"end to end (with prefill) {a['speedup']:.2f}x = {100 * a['ratio']:.0f}% {verdict(a['passed'])}")
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
          f"(target ≥ {PEER_RATIO_TARGET}x) {verdict(b['passed'])}")
  for c in checks["c"]:
    print(f"(c) T={c['temperature']:g} γ={c['gamma']}: BE block {c['be_block']:.3f} vs token {c['be_token']:.3f}, "
          f"gain {100 * c['gain']:+.1f}% {verdict(c['passed'])}")
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
                 f"{verdict(rep['peak_rss_gb'] <= MAIN_JOB_RSS_TARGET_GB)}")
      print(f"peak RSS, {name} worker: {rep['peak_rss_gb']:.2f} GB (10^9 bytes){extra}; worker wall "
            f"{rep.get('worker_wall_s', 0):.0f} s")
  if ours and hf and ours["prompt_ids"] != hf["prompt_ids"]:
    print("WARNING: the two engines did not get the same prompt token ids")
  elif ours and hf:
    print(f"same prompt token ids in both engines (lengths {[len(p) for p in ours['prompt_ids']]}), same stop ids "
          f"{ours['stop_ids']} / {hf['stop_ids']}")



#: bench_peer's target for plain decoding of one GGUF file: ours on its quantized weights at this fraction of llama.cpp.
LLAMA_RATIO_TARGET = 0.8


def print_gguf_rows(ours: dict, quant: dict, llama: dict) -> None:
  """Plain decoding of the target's GGUF file, per temperature: ours on float32 (dequantized) weights, ours on its
  quantized blocks (and block verification with them), and llama.cpp, decode-phase and end-to-end tokens/s, each
  against llama.cpp's decode phase; the check that ours on quantized weights reaches LLAMA_RATIO_TARGET of it."""
  if not (quant or llama):
    return
  by_t: dict = {}
  for name, rep in (("ours float32", ours), ("ours quantized", quant), ("llama.cpp", llama)):
    for r in (rep or {}).get("results", []):
      if r["method"] in ("autoregressive", "block") and r.get("repeat", 0) == 0:
        by_t.setdefault(float(r["temperature"]), []).append((name, r))
  print("\nplain decoding of the target's GGUF file (ours float32 = its weights dequantized; decode tok/s: the steady "
        "rate after the prefill)")
  print(f"{'engine':<16} {'method':<14} {'T':>3} {'γ':>2} | {'tok/s':>6} {'dec t/s':>7} {'prefill s':>9} | "
        f"{'dec / llama.cpp':>15}")
  for t, rows in sorted(by_t.items()):
    ref = next((r["decode_tokens_per_s"] for n, r in rows if n == "llama.cpp"), None)
    for name, r in rows:
      ratio = "" if ref is None else f"{r['decode_tokens_per_s'] / ref:.2f}"
      print(f"{name:<16} {r['method']:<14} {t:>3g} {r.get('gamma') or '-':>2} | {r['tokens_per_s']:6.2f} "
            f"{r['decode_tokens_per_s']:7.2f} {r['prefill_s']:9.2f} | {ratio:>15}")
    ar = next((r for n, r in rows if n == "ours quantized" and r["method"] == "autoregressive"), None)
    if ar is not None and ref is not None:
      share = ar["decode_tokens_per_s"] / ref
      print(f"ours quantized autoregressive at T={t:g}: {share:.2f} of llama.cpp's decode rate (target ≥ "
            f"{LLAMA_RATIO_TARGET}) {verdict(share >= LLAMA_RATIO_TARGET)}")
  for name, rep in (("ours quantized", quant), ("llama.cpp", llama)):
    if rep:
      print(f"peak RSS, {name} worker: {rep['peak_rss_gb']:.2f} GB; worker wall {rep.get('worker_wall_s', 0):.0f} s")
  if quant and llama and quant["prompt_ids"] != llama["prompt_ids"]:
    print("WARNING: ours and llama.cpp did not get the same prompt token ids")
