"""bench_peer's llama.cpp worker: plain decoding of the same GGUF file with llama.cpp (``llama-cpp-python``, the
optional ``peer`` extra, built from source), in its own subprocess (``python -m blockspec_jax.eval.bench_peer --worker
llamacpp``), on the token ids our engine decodes (the prompts chat-templated by our tokenizer) and the same token
budget and temperatures.

Per temperature: one untimed warm-up decode of prompt 0, then every prompt from a fresh context: ``eval`` of the
prompt ids (the prefill), then one token at a time, each sampled from the last logits (T = 0: argmax; T > 0: the full
distribution at temperature T: top-k 0, top-p 1, min-p 0, no penalties) and fed back with ``eval``, until a stop id
or ``max_new_tokens``. ``prefill_s`` times the prompt's ``eval`` and the first sample; ``decode_s`` the rest, so
``decode_tokens_per_s`` = (tokens − 1) / ``decode_s`` per prompt, summed: the steady decode rate, as our decode phase
is. Threads: ``--threads`` for both decode and batch (prefill) work.

Speculative decoding in llama.cpp is not run: the Python bindings (0.3.36) expose only prompt-lookup drafting
(``LlamaPromptLookupDecoding``), not a draft model.
"""

from __future__ import annotations

import time

#: The version the peer figures were measured with (``pip install llama-cpp-python==0.3.36``, a 12-minute build on the
#: project's 2-core machine with ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON ..."``: docs/results/quantized.md).
PINNED = "0.3.36"


def import_llama_cpp():
  """``llama_cpp``, or SystemExit naming the extra and how to build it."""
  try:
    import llama_cpp
  except ImportError:
    raise SystemExit(f"the llama.cpp engine needs llama-cpp-python (the optional 'peer' extra): pip install "
                     f"llama-cpp-python=={PINNED} (builds llama.cpp from source; with GGML_NATIVE=ON the build of "
                     "0.3.36 crashed in its first eval on this project's machine: set CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
                     "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON\")") from None
  return llama_cpp


def decode(llm, ids: list[int], temperature: float, max_new_tokens: int, stop_ids) -> dict:
  """One prompt, plain decoding from a fresh context: the new ids and the prefill / decode seconds."""
  llm.reset()
  sample = dict(top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, temp=temperature, repeat_penalty=1.0)
  start = time.perf_counter()
  llm.eval(ids)
  new = [llm.sample(**sample)]
  first = time.perf_counter()
  while len(new) < max_new_tokens and new[-1] not in stop_ids:
    llm.eval([new[-1]])
    new.append(llm.sample(**sample))
  end = time.perf_counter()
  return dict(ids=new, prefill_s=first - start, decode_s=end - first)


def worker_llamacpp(args) -> dict:
  from blockspec_jax import runtime
  from blockspec_jax.eval.peer_workers import gguf_prompt_ids

  llama_cpp = import_llama_cpp()
  path, prompt_ids, stop_ids = gguf_prompt_ids(args, args.target)
  start = time.perf_counter()
  llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(map(len, prompt_ids)) + args.max_new_tokens + 8,
                        n_threads=args.threads, n_threads_batch=args.threads, seed=args.seed, verbose=False)
  load_s = time.perf_counter() - start
  print(f"[llama.cpp] llama-cpp-python {llama_cpp.__version__}, {args.threads} threads; loaded {path.name} in "
        f"{load_s:.1f} s", flush=True)
  results = []
  for temperature in args.temperatures:
    decode(llm, prompt_ids[0], temperature, args.max_new_tokens, stop_ids)  # warm-up
    runs = [decode(llm, ids, temperature, args.max_new_tokens, stop_ids) for ids in prompt_ids]
    tokens = sum(len(r["ids"]) for r in runs)
    prefill_s, decode_s = sum(r["prefill_s"] for r in runs), sum(r["decode_s"] for r in runs)
    summary = dict(method="autoregressive", temperature=temperature, gamma=None, prompts=len(prompt_ids),
                   tokens_generated=tokens, target_calls=tokens, prefill_s=prefill_s, decode_s=decode_s,
                   wall_s=prefill_s + decode_s, tokens_per_s=tokens / (prefill_s + decode_s),
                   decode_tokens_per_s=(tokens - len(runs)) / decode_s, generated_ids=[r["ids"] for r in runs])
    results.append(summary)
    print(f"[llama.cpp] autoregressive T={temperature:g}: {summary['tokens_per_s']:.2f} tok/s end to end, "
          f"{summary['decode_tokens_per_s']:.2f} decode phase (prefill {prefill_s:.1f} s)", flush=True)
  return dict(engine="llamacpp", weights="gguf", load_s=load_s, threads=args.threads, prompt_ids=prompt_ids,
              stop_ids=stop_ids, llama_cpp=llama_cpp.__version__, results=results, peak_rss_gb=runtime.peak_rss_gb())
