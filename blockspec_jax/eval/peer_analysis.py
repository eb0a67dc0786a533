"""bench_peer's pure analysis: speedups, ideals, where the time goes, and the checks against the targets.

Input: the worker reports (:mod:`blockspec_jax.eval.peer_workers`) as plain dicts, so a saved run (``--from-json``)
is analysed again without JAX or torch (neither is imported here).
"""

from __future__ import annotations

IDEAL_FRACTION_TARGET = 0.90     # (a) measured speedup ≥ 90% of BE / (1 + γ·c)
PEER_RATIO_TARGET = 1.5          # (b) ours (block) ≥ 1.5 × transformers assisted tokens/s
MAIN_JOB_RSS_TARGET_GB = 14.0


def verdict(ok: bool) -> str:
  """PASS when a target is met, else MISS."""
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


_ROW_KEYS = ("method", "temperature", "gamma", "repeat", "tokens_per_s", "decode_tokens_per_s", "prefill_s", "decode_s",
             "block_efficiency", "tokens_generated", "target_calls", "wall_s")
_HF_ROW_KEYS = ("method", "temperature", "gamma", "tokens_per_s", "block_efficiency", "tokens_generated",
                "target_calls", "wall_s")


def _our_rows(rep: dict, time_checks: list) -> tuple[list, dict]:
  """One worker's report (float32 or bfloat16): its rows with speedups and ideals, and its costs ``c`` / ``v``.
  Appends the float32 rows' time breakdowns to ``time_checks``."""
  t1 = rep["target_forward_ms"]["1"]
  c = rep["drafter_forward_ms"] / t1
  v = {int(k): ms / t1 for k, ms in rep["target_forward_ms"].items()}
  costs = dict(c=c, v=v, target_1tok_ms=t1, drafter_1tok_ms=rep["drafter_forward_ms"])
  # Baselines per T: the faster of the autoregressive passes before and after the sweep (conservative speedups).
  ar_rows = [r for r in rep["results"] if r["method"] == "autoregressive"]
  ar = {t: max(r["tokens_per_s"] for r in ar_rows if r["temperature"] == t) for t in {r["temperature"] for r in ar_rows}}
  ar_decode = {t: max(r["decode_tokens_per_s"] for r in ar_rows if r["temperature"] == t) for t in ar}
  # The same c with the target step taken from the baseline's own loop (ms per autoregressive token, decode phase).
  c_loop = {t: rep["drafter_forward_ms"] * ar_decode[t] / 1e3 for t in ar}
  costs["c_loop"] = {str(t): x for t, x in c_loop.items()}
  rows = []
  for r in rep["results"]:
    row = dict(engine=f"ours-{'f32' if rep['dtype'] == 'float32' else 'bf16'}", **{k: r.get(k) for k in _ROW_KEYS})
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
      time_checks.append(time_breakdown(r, rep))
    rows.append(row)
  return rows, costs


def _hf_rows(hf: dict) -> list:
  """transformers' rows, with speedups against its own autoregressive row."""
  ar = {r["temperature"]: r["tokens_per_s"] for r in hf["results"] if r["method"] == "autoregressive"}
  rows = []
  for r in hf["results"]:
    row = dict(engine="hf-f32", **{k: r.get(k) for k in _HF_ROW_KEYS})
    base = ar.get(r["temperature"])
    row["speedup"] = r["tokens_per_s"] / base if base else None
    rows.append(row)
  return rows


def _find(rows, engine, method, t, g, repeat=0):
  """The row of ``engine``'s ``method`` at temperature ``t``, γ ``g`` and ``repeat`` (None if absent)."""
  return next((r for r in rows if r["engine"] == engine and r["method"] == method and r["temperature"] == t
               and r["gamma"] == g and (r.get("repeat") or 0) == repeat), None)


def _f32_checks(rows: list, checks: dict) -> None:
  """Per temperature of the float32 rows: (a) block against its ideal, the autoregressive drift, the fastest rule and
  γ, (c) block against token at T = 1."""
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
      tok, blk = _find(rows, "ours-f32", "token", t, g), _find(rows, "ours-f32", "block", t, g)
      if tok and blk and t == 1.0:
        checks["c"].append(dict(temperature=t, gamma=g, be_token=tok["block_efficiency"],
                                be_block=blk["block_efficiency"],
                                gain=blk["block_efficiency"] / tok["block_efficiency"] - 1,
                                passed=blk["block_efficiency"] >= tok["block_efficiency"]))


def _cross_engine_checks(rows: list, checks: dict) -> None:
  """(b) our block rows against transformers' assisted generation; bfloat16 rows against float32's."""
  for r in rows:
    if r["engine"] == "hf-f32" and r["method"] == "assisted":
      ours_row = _find(rows, "ours-f32", "block", r["temperature"], r["gamma"])
      if ours_row:
        ratio = ours_row["tokens_per_s"] / r["tokens_per_s"]
        checks["b"].append(dict(temperature=r["temperature"], gamma=r["gamma"], ours=ours_row["tokens_per_s"],
                                hf=r["tokens_per_s"], ratio=ratio, ours_be=ours_row["block_efficiency"],
                                hf_be=r["block_efficiency"], passed=ratio >= PEER_RATIO_TARGET))
  for r in rows:
    if r["engine"] == "ours-bf16":
      ref = _find(rows, "ours-f32", r["method"], r["temperature"], r["gamma"], r.get("repeat") or 0)
      if ref:
        checks["bf16"].append(dict(method=r["method"], temperature=r["temperature"], gamma=r["gamma"],
                                   repeat=r.get("repeat") or 0, bf16=r["tokens_per_s"], f32=ref["tokens_per_s"],
                                   ratio=r["tokens_per_s"] / ref["tokens_per_s"],
                                   decode_ratio=r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]))


def analyse(ours: dict, bf16: dict, hf: dict) -> dict:
  """Speedups, ideals and the checks (a), (b), (c): ``{"rows", "checks", "costs"}``."""
  rows, checks = [], dict(a=[], b=[], c=[], fastest={}, bf16=[], drift={}, time=[])
  costs = {}
  for rep in (ours, bf16):
    if rep:
      rep_rows, costs[rep["dtype"]] = _our_rows(rep, checks["time"])
      rows += rep_rows
  if hf:
    rows += _hf_rows(hf)
  _f32_checks(rows, checks)
  _cross_engine_checks(rows, checks)
  return dict(rows=rows, checks=checks, costs=costs)
