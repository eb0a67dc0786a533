"""Peer benchmark: our JAX speculative decoding vs transformers' assisted generation (and llama.cpp's plain decoding
of the same GGUF file), same pair, prompts, γ, T.

    python -m blockspec_jax.eval.bench_peer [--quick] [--num-prompts 3] [--max-new-tokens 32]
        [--gammas 1,2,3,4,6,8] [--temperatures 0,1] [--hf-gammas 4] [--bf16-gammas 4]
        [--engines ours,bf16,hf[,quant,llamacpp]] [--json results/bench_peer.json]
    python -m blockspec_jax.eval.bench_peer --from-json results/bench_peer.json   # the report of a saved run

Default pair: Qwen2.5-Coder 0.5B drafter → 1.5B target (one tokenizer), batch 1, CPU. One invocation runs every engine,
each in its own subprocess (``--worker ours|hf|llamacpp``, which writes a JSON file), one after the other, so that only
one engine's copy of the models is resident at a time and each engine's peak resident memory (``ru_maxrss`` of the
worker) is its own. The parent collects the JSON files, prints one table and the target checks, and writes ``--json``.

Workers:

* ``ours`` (``--dtype float32``, and ``bfloat16`` for the bf16 row): loads the pair with ``hub.load_model`` and decodes
  with :func:`blockspec_jax.harness.run_method` (the main job's own function: prompts chat-templated and padded to one
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
  than it here). Where the time goes (:func:`peer_analysis.time_breakdown`): ms per decode iteration against γ
  drafter forwards plus one verify pass, the rest being sampling, verifier, commit and loop; and tokens kept per target
  call (below BE when the token budget cuts a run's last block).
* ``hf``: transformers ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` on the same GGUF files, float32,
  ``torch.set_num_threads(--threads)``; the same token ids (the same chat template through our tokenizer, read from the
  drafter's GGUF, passed as ``input_ids``); ``generate`` with max_new_tokens, do_sample = T > 0, temperature, top_k=0,
  top_p=1, eos_token_id = our stop ids, and (assisted) ``assistant_model`` with num_assistant_tokens = γ,
  num_assistant_tokens_schedule = "constant" and assistant_confidence_threshold = 0 (no early exit of the draft).
  The assisted candidate generator reads those three from the *assistant's* ``generation_config``, so they are set
  there as well as in the call. Mean acceptance length = tokens generated / target forward calls (a forward hook on
  the target). One untimed warm-up generate per configuration.

* ``quant`` (engine): the ``ours`` worker on the GGUF files' quantized weights (``--weights quantized``: the blocks as
  stored, streamed by the CPU kernel; the unrolled layout), autoregressive and block verification.
* ``llamacpp``: llama.cpp's plain decoding of the target's GGUF file (:mod:`blockspec_jax.eval.peer_llamacpp`; needs
  ``llama-cpp-python``, the ``peer`` extra). With ``quant`` and ``llamacpp`` the report adds a table of plain decoding
  on the one file (ours float32, ours quantized, llama.cpp) and the check that ours on quantized weights reaches
  ``peer_report.LLAMA_RATIO_TARGET`` of llama.cpp's decode rate.

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

from blockspec_jax.eval import peer_analysis, peer_llamacpp, peer_report, peer_workers

DEFAULT_GAMMAS = (1, 2, 3, 4, 6, 8)
ENGINES = ("ours", "bf16", "hf", "quant", "llamacpp")
WORKERS = {"ours": peer_workers.worker_ours, "hf": peer_workers.worker_hf,
           "llamacpp": peer_llamacpp.worker_llamacpp}


# ------------------------------------------------------------------------------------------------------------------
# Parent: estimate, spawn (the analysis and the report: peer_analysis, peer_report)


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
  if "quant" in args.engines:  # ≈ 8 tok/s quantized, 2 programs per T (autoregressive twice) and one block per γ
    est["quant"] = 30 + len(args.temperatures) * ((2 * decode(4) + 2 * compile_s) + len(args.gammas) * (
        decode(5) + compile_s))
  if "llamacpp" in args.engines:  # ≈ 30 tok/s
    est["llamacpp"] = 10 + len(args.temperatures) * decode(15)
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


def _ints(s):
  return [int(x) for x in s.split(",") if x]


def _floats(s):
  return [float(x) for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
  """The command line (also the gin job ``bench_peer``'s settings and defaults, ``blockspec_jax.main``)."""
  from blockspec_jax import methods as methods_lib
  from blockspec_jax.data import prompts as prompts_lib
  p = argparse.ArgumentParser(prog="python -m blockspec_jax.eval.bench_peer", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--target", default=methods_lib.DEFAULT_TARGET)
  p.add_argument("--drafter", default=methods_lib.DEFAULT_DRAFTER)
  p.add_argument("--prompts", default=str(prompts_lib.DEFAULT_PROMPTS))
  p.add_argument("--num-prompts", type=int, default=3, help="round-robin over tasks: 3 = one code, chat, math")
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--gammas", type=_ints, default=list(DEFAULT_GAMMAS), help="our γ sweep (comma separated)")
  p.add_argument("--hf-gammas", type=_ints, default=[4], help="γ values also run in transformers")
  p.add_argument("--bf16-gammas", type=_ints, default=[4], help="γ values of the bfloat16 row (block, first T)")
  p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
  p.add_argument("--engines", default="ours,bf16,hf",
                 help="subset of ours,bf16,hf,quant,llamacpp (quant: ours on the GGUF's quantized weights, "
                      "autoregressive and block; llamacpp: llama.cpp's plain decoding of the target's GGUF, needs "
                      "llama-cpp-python)")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--reps", type=int, default=9, help="rounds of the single-forward timings (median)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quick", action="store_true",
                 help="1 prompt, 16 new tokens, γ ∈ {2, 4}, transformers and bf16 at γ = 4, 3 reps")
  p.add_argument("--json", default="results/bench_peer.json")
  p.add_argument("--from-json", help="print the report of a saved run's measurements (its JSON) without running")
  p.add_argument("--worker", choices=("ours", "hf", "llamacpp"), help=argparse.SUPPRESS)
  p.add_argument("--worker-out", help=argparse.SUPPRESS)
  p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
  p.add_argument("--weights", default="dequantized", help=argparse.SUPPRESS)
  p.add_argument("--methods", default="autoregressive,token,block", help=argparse.SUPPRESS)
  return p


def parse_args(argv=None):
  p = build_parser()
  args = p.parse_args(argv)
  if args.quick and not args.worker:
    args.num_prompts, args.max_new_tokens, args.gammas, args.hf_gammas, args.bf16_gammas, args.reps = (
        1, 16, [2, 4], [4], [4], 3)
  args.engines = [e for e in args.engines.split(",") if e]
  unknown = sorted(set(args.engines) - set(ENGINES))
  if unknown:
    p.error(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
  args.methods = [m for m in args.methods.split(",") if m]
  if min(args.gammas + args.hf_gammas + args.bf16_gammas) < 1:
    p.error("every γ must be ≥ 1")
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    report = WORKERS[args.worker](args)
    pathlib.Path(args.worker_out).write_text(json.dumps(report))
    return 0
  if args.from_json:
    try:
      saved = json.loads(pathlib.Path(args.from_json).read_text())
      workers, config = saved["workers"], saved["config"]
    except (OSError, ValueError, KeyError) as e:
      raise SystemExit(f"--from-json {args.from_json}: not a bench_peer JSON with 'workers' and 'config' ({e!r})")
    peer_report.print_report(peer_analysis.analyse(workers["ours"], workers["bf16"], workers["hf"]), workers["ours"],
                             workers["bf16"], workers["hf"], types.SimpleNamespace(**config))
    peer_report.print_gguf_rows(workers.get("ours", {}), workers.get("quant", {}), workers.get("llamacpp", {}))
    return 0
  est = estimate_seconds(args)
  print(f"bench_peer: {args.drafter} → {args.target}; {args.num_prompts} prompts × {args.max_new_tokens} new tokens; "
        f"ours γ ∈ {args.gammas}, T ∈ {args.temperatures}; transformers γ ∈ {args.hf_gammas}; bf16 γ ∈ "
        f"{args.bf16_gammas}; engines {args.engines}; {args.threads} threads")
  print("estimated runtime (≈2 tok/s target, ≈20 s compile per JAX program): "
        + ", ".join(f"{k} {v / 60:.0f} min" for k, v in est.items()), flush=True)
  start = time.perf_counter()
  ours = bf16 = hf = quant = llama = {}
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
    if "quant" in args.engines:
      quant = _spawn("ours", args, ["--dtype", "float32", "--weights", "quantized", "--methods",
                                    "autoregressive,block"], tmp)
    if "llamacpp" in args.engines:
      llama = _spawn("llamacpp", args, [], tmp)
  config = {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")}
  workers = dict(ours=ours, bf16=bf16, hf=hf, quant=quant, llamacpp=llama)
  path = pathlib.Path(args.json) if args.json else None
  if path:  # the raw measurements first: an hour of work survives a failure in the analysis below
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(config=config, estimate_s=est, workers=workers), indent=2))
  analysis = peer_analysis.analyse(ours, bf16, hf)
  if ours or bf16 or hf:
    peer_report.print_report(analysis, ours, bf16, hf, args)
  peer_report.print_gguf_rows(ours, quant, llama)
  total = time.perf_counter() - start
  print(f"total runtime {total:.0f} s (estimated {est['total']:.0f} s)")
  if path:
    path.write_text(json.dumps(dict(config=config, estimate_s=est, total_s=total, workers=workers, **analysis),
                               indent=2))
    print(f"wrote {path}")
  return 0 if any(workers.values()) else 1


if __name__ == "__main__":
  sys.exit(main())