"""bench_peer's two workers, each run in its own subprocess (``python -m blockspec_jax.eval.bench_peer --worker
ours|hf --worker-out FILE ...``; what they measure: the module docstring of :mod:`blockspec_jax.eval.bench_peer`).

* :func:`worker_ours`: our engine (:func:`blockspec_jax.harness.run_method`) over the γ sweep, then the isolated forward
  costs c and v(γ);
* :func:`worker_hf`: transformers ``generate``, autoregressive and assisted, on the same GGUF files and token ids.

Each returns a JSON-able report (with the worker's peak resident memory). JAX and torch are imported inside the
workers, so importing this module loads neither.
"""

from __future__ import annotations

import time
import types


def _rows(args):
  from blockspec_jax.data import prompts as prompts_lib
  return prompts_lib.load_prompts(args.prompts, limit=args.num_prompts)


def gguf_prompt_ids(args, model: str):
  """``(path, prompt_ids, stop_ids)`` for a peer engine that reads ``model``'s GGUF file itself: the prompts encoded by
  the tokenizer in that file exactly as ours encodes them (chat-templated), so every engine decodes the same ids."""
  from blockspec_jax.data import prompts as prompts_lib
  from blockspec_jax.models import gguf_convert, registry
  from blockspec_jax.models.tokenizer import tokenizer_from_gguf
  path = registry.fetch_gguf(model, progress=False)
  tokenizer = tokenizer_from_gguf(gguf_convert.read_gguf(path).metadata)
  prompt_ids = prompts_lib.encode_prompts(types.SimpleNamespace(tokenizer=tokenizer), _rows(args), chat=True)
  return path, prompt_ids, [] if tokenizer.eos_id is None else [tokenizer.eos_id]


# ------------------------------------------------------------------------------------------------------------------
# Worker: ours


def worker_ours(args) -> dict:
  import jax
  from blockspec_jax import methods as methods_lib, runtime, sources
  from blockspec_jax.data import prompts as prompts_lib
  from blockspec_jax.eval import bench_decode, bench_verify, harness

  rows = _rows(args)
  start = time.perf_counter()
  weights = getattr(args, "weights", "dequantized")
  # Quantized layers of mixed block types (the Qwen Q4_K_M files) do not stack: the unrolled layout for them.
  target, (drafter,), _ = sources.load_models(args.target, [args.drafter], args.dtype,
                                              scan_layers=weights == "dequantized", weights=weights)
  load_s = time.perf_counter() - start
  label = args.dtype if weights == "dequantized" else f"{args.dtype}, {weights}"
  print(f"[ours {label}] loaded {args.drafter} → {args.target} in {load_s:.1f} s (jax {jax.__version__}, "
        f"{jax.devices()[0].platform})", flush=True)
  prompt_ids = prompts_lib.encode_prompts(target, rows, chat=True)
  width = max(len(p) for p in prompt_ids)
  stop_ids = target.stop_ids
  max_gamma = max(args.gammas)
  # Raises when the prompts leave no room; the slots of the largest-γ loop size the cache the forwards are timed on.
  cache_len = methods_lib.check_cache_room(width, args.max_new_tokens, max_gamma, target.config, drafter.config)
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
        summary, _ = harness.run_method(method, target, drafter, prompt_ids, width, gamma=gamma or 1,
                                     max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed,
                                     stop_ids=stop_ids)
        summary["gamma"] = gamma
        summary["repeat"] = repeat
        summary["total_s_incl_compile"] = time.perf_counter() - t0
        results.append(summary)
        print(f"[ours {label}] {method:<14} T={temperature:g} γ={gamma or '-'}"
              f"{' (again)' if repeat else ''}: {summary['tokens_per_s']:.2f} tok/s end to end, "
              f"{summary['decode_tokens_per_s']:.2f} decode phase (prefill {summary['prefill_s']:.1f} s)"
              + (f", BE {summary['block_efficiency']:.2f}" if "block_efficiency" in summary else "")
              + f" ({summary['total_s_incl_compile']:.0f} s with compile)", flush=True)
  # Forward costs at a representative position of a cache of the loop's size.
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
  print(f"[ours {label}] forwards: target {', '.join(f'{t} tok {ms:.0f} ms' for t, ms in target_ms.items())}; "
        f"drafter 1 tok {drafter_ms[1]:.0f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
  return dict(engine="ours", dtype=args.dtype, weights=weights, load_s=load_s, prompt_ids=prompt_ids,
              stop_ids=list(stop_ids), width=width, cache_len=cache_len, position=position,
              target_forward_ms={str(k): v for k, v in target_ms.items()}, drafter_forward_ms=drafter_ms[1],
              results=results, peak_rss_gb=runtime.peak_rss_gb())


# ------------------------------------------------------------------------------------------------------------------
# Worker: transformers


def worker_hf(args) -> dict:
  import torch
  import transformers
  from blockspec_jax import runtime
  from blockspec_jax.models import registry

  torch.set_num_threads(args.threads)
  target_path = registry.fetch_gguf(args.target, progress=False)
  drafter_path, prompt_ids, stop_ids = gguf_prompt_ids(args, args.drafter)
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
              peak_rss_gb=runtime.peak_rss_gb())

