"""The main job: autoregressive vs speculative decoding (token and block verification) on real models and prompts.

    python -m blockspec_jax.run [--gin_file gin/runs/qwen_pair.gin] [--gin_param "run_job.gamma = 6"]

Default: Qwen2.5-Coder 0.5B drafter → 1.5B target (one tokenizer), the shipped prompt file (code, chat, math), γ = 4,
T ∈ {0, 1}. For each temperature, every method decodes every prompt at batch 1 (one compiled program per method and
temperature: prompts are padded to a common width and carry their own lengths, so nothing recompiles per prompt;
the first prompt is run once untimed to compile). Prints a table and writes a JSON file with, per method and
temperature: block efficiency (mean acceptance length), draft acceptance rate, per-position acceptance, target calls,
tokens generated, wall time, tokens/s and speedup over autoregressive decoding at the same temperature, end to end
and for the decode phase alone (prefill and decode are compiled and timed apart). The generated
text of one prompt is printed per method so a person can see it is real.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sys
import time

import gin
import jax
import numpy as np

from blockspec_jax import sampling
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter
from blockspec_jax.eval import prompts as prompts_lib
from blockspec_jax.models import hub

METHODS = ("autoregressive", "token", "block")


def check_pair(target: hub.LoadedModel, drafter: hub.LoadedModel) -> None:
  """Drafter and target must share one tokenizer: same vocabulary size and the same ids for the same text."""
  if target.config.vocab_size != drafter.config.vocab_size:
    raise ValueError(f"vocabulary mismatch between drafter {drafter.spec.name} (V = {drafter.config.vocab_size}) and "
                     f"target {target.spec.name} (V = {target.config.vocab_size}): speculative decoding needs one "
                     "tokenizer")
  probe = "def f(x):\n    return x ** 2  # café ✓"
  if target.tokenizer.encode(probe) != drafter.tokenizer.encode(probe):
    raise ValueError(f"tokenizers of {drafter.spec.name} and {target.spec.name} differ on the same text")


def peak_rss_gb() -> float:
  """Peak resident memory of this process in GB (10^9 bytes); Linux reports ``ru_maxrss`` in KiB."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def encode_prompts(model: hub.LoadedModel, rows, chat: bool = True) -> list[list[int]]:
  out = []
  for row in rows:
    if chat and model.tokenizer.chat_template:
      text = model.tokenizer.apply_chat_template([{"role": "user", "content": row["text"]}])
      ids = model.tokenizer.encode(text)
    else:
      ids = model.tokenizer.encode(row["text"], add_special_tokens=True)
    out.append(ids)
  return out


def _phases(method: str, target, drafter, gamma: int, max_new_tokens: int, sampler, stop_ids):
  """The method's two compiled phases: ``prefill(tokens, lens) -> state`` and ``decode(keys, state) ->
  DecodeOutput`` (together exactly ``generate_autoregressive`` / ``generate_speculative``)."""
  tp = target.params["params"]
  if method == "autoregressive":
    common = dict(config=target.config, max_new_tokens=max_new_tokens)
    return (lambda tokens, lens: spec.prefill_autoregressive(tp, tokens, lens, **common),
            lambda keys, state: spec.decode_autoregressive(tp, keys, state, sampler=sampler, stop_ids=stop_ids,
                                                           **common))
  dp = drafter.params["params"]
  common = dict(config=target.config, drafter=ModelDrafter(drafter.config), gamma=gamma, max_new_tokens=max_new_tokens)
  return (lambda tokens, lens: spec.prefill_speculative(tp, dp, tokens, lens, **common),
          lambda keys, state: spec.decode_speculative(tp, dp, keys, state, verifier=method, sampler=sampler,
                                                      stop_ids=stop_ids, **common))


def run_method(method, target, drafter, prompt_ids, width, *, gamma, max_new_tokens, temperature, seed, stop_ids):
  """Decode every prompt at batch 1; returns the summary row and the generated token lists.

  Prefill and decode phase are compiled and timed apart (each ends in ``block_until_ready``): ``wall_s`` is their
  sum, ``prefill_s`` the prompt forwards (target, and drafter for speculative methods), ``decode_s`` the loop, which
  is the phase the ideal speedup BE / (1 + γ·c) describes.
  """
  sampler = sampling.Sampler(temperature=temperature)
  prefill, decode = _phases(method, target, drafter, gamma, max_new_tokens, sampler, stop_ids)
  padded = [(ids + [0] * (width - len(ids))) for ids in prompt_ids]
  key = jax.random.key(seed)

  def one(keys, row, length):
    lens = np.asarray([length], np.int32)
    start = time.perf_counter()
    state = jax.block_until_ready(prefill(np.asarray([row], np.int32), lens))
    middle = time.perf_counter()
    out = jax.block_until_ready(decode(keys, state))
    return out, middle - start, time.perf_counter() - middle

  one(jax.random.split(key, 1), padded[0], len(prompt_ids[0]))  # compile both phases once per method and T
  prefill_s, decode_s, tokens, calls, outputs, metrics = 0.0, 0.0, 0, 0, [], []
  for i, (row, ids) in enumerate(zip(padded, prompt_ids)):
    out, p_s, d_s = one(jax.random.fold_in(key, i)[None], row, len(ids))
    prefill_s, decode_s = prefill_s + p_s, decode_s + d_s
    n = int(out.num_tokens_B[0])
    tokens += n
    calls += n if method == "autoregressive" else int(out.metrics.num_drafts[0])
    outputs.append(np.asarray(out.tokens_BxN[0, :n]).tolist())
    metrics.append(out.metrics)
  wall = prefill_s + decode_s
  summary = dict(method=method, temperature=temperature, gamma=None if method == "autoregressive" else gamma,
                 prompts=len(prompt_ids), tokens_generated=tokens, target_calls=calls, wall_s=wall,
                 tokens_per_s=tokens / wall, prefill_s=prefill_s, decode_s=decode_s,
                 decode_tokens_per_s=tokens / decode_s)
  if method != "autoregressive":
    merged = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *metrics)
    s = spec.summarize_metrics(merged)
    summary.update(block_efficiency=s["mean_acceptance_length"], draft_acceptance_rate=s["draft_acceptance_rate"],
                   acceptance_per_position=s["acceptance_per_position"],
                   expected_accepted_per_draft=s["expected_accepted_per_draft"],
                   per_prompt_acceptance_length=s["per_row_mean_acceptance_length"],
                   invalid_prob_rows=s["invalid_prob_rows"])
  return summary, outputs


def format_table(rows) -> str:
  header = (f"{'method':<15} {'T':>4} {'γ':>3} | {'BE':>5} {'accept':>7} | {'calls':>6} {'tokens':>6} {'wall s':>8} "
            f"{'tok/s':>7} {'speedup':>7} | {'prefill s':>9} {'dec tok/s':>9} {'dec x':>6}")
  lines = [header, "-" * len(header)]
  for r in rows:
    be = f"{r['block_efficiency']:5.2f}" if "block_efficiency" in r else "    -"
    acc = f"{r['draft_acceptance_rate']:7.3f}" if "draft_acceptance_rate" in r else "      -"
    lines.append(f"{r['method']:<15} {r['temperature']:>4.1f} {r['gamma'] or '-':>3} | {be} {acc} | "
                 f"{r['target_calls']:>6} {r['tokens_generated']:>6} {r['wall_s']:>8.2f} {r['tokens_per_s']:>7.2f} "
                 f"{r['speedup']:>6.2f}x | {r['prefill_s']:>9.2f} {r['decode_tokens_per_s']:>9.2f} "
                 f"{r['decode_speedup']:>5.2f}x")
  lines.append("BE: block efficiency = mean tokens per target call (1 + accepted / drafts); accept: draft acceptance "
               "rate; speedup: tokens/s over autoregressive decoding of the target at the same temperature, end to "
               "end (prefill + decode); dec: the decode phase alone (prompt forwards timed apart and left out).")
  return "\n".join(lines)


@gin.configurable("run_job")
def run_job(target: str = "qwen2.5-coder-1.5b", drafter: str = "qwen2.5-coder-0.5b",
            prompts_path: str = str(prompts_lib.DEFAULT_PROMPTS), num_prompts: int | None = 6, gamma: int = 4,
            temperatures=(0.0, 1.0), methods=METHODS, max_new_tokens: int = 64, dtype: str = "float32",
            seed: int = 0, chat: bool = True, output_json: str | None = "results/run.json",
            cache_dir: str | None = None, show_text: bool = True) -> dict:
  if gamma < 1:
    raise ValueError(f"gamma must be >= 1, got {gamma}")
  unknown = set(methods) - set(METHODS)
  if unknown:
    raise ValueError(f"unknown methods {sorted(unknown)}; known: {METHODS}")
  rows = prompts_lib.load_prompts(prompts_path, limit=num_prompts)
  start = time.perf_counter()
  target_model = hub.load_model(target, dtype, cache_dir)
  drafter_model = hub.load_model(drafter, dtype, cache_dir)
  check_pair(target_model, drafter_model)
  print(f"loaded {drafter} → {target} ({dtype}) in {time.perf_counter() - start:.1f} s; {len(rows)} prompts; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}", flush=True)
  prompt_ids = encode_prompts(target_model, rows, chat)
  width = max(len(p) for p in prompt_ids)
  needed = width + max_new_tokens + gamma + 1
  if needed > min(target_model.config.max_len, drafter_model.config.max_len):
    raise ValueError(f"prompts too long for the cache: longest prompt {width} tokens + {max_new_tokens} new + "
                     f"{gamma + 1} draft slots > max_len {target_model.config.max_len}")
  stop_ids = target_model.stop_ids
  results, texts = [], {}
  for temperature in temperatures:
    baseline = None
    for method in methods:
      summary, outputs = run_method(method, target_model, drafter_model, prompt_ids, width, gamma=gamma,
                                    max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                    stop_ids=stop_ids)
      if method == "autoregressive":
        baseline = summary
      summary["speedup"] = summary["tokens_per_s"] / baseline["tokens_per_s"] if baseline else float("nan")
      summary["decode_speedup"] = (summary["decode_tokens_per_s"] / baseline["decode_tokens_per_s"] if baseline
                                   else float("nan"))
      results.append(summary)
      texts[f"{method}@T={temperature}"] = target_model.tokenizer.decode(outputs[0], skip_special_tokens=True)
      print(f"  {method:<15} T={temperature}: {summary['tokens_per_s']:.2f} tok/s"
            + (f", BE {summary['block_efficiency']:.2f}" if "block_efficiency" in summary else ""), flush=True)
  print()
  print(format_table(results))
  if show_text:
    print(f"\nprompt [{rows[0]['id']}]: {rows[0]['text'][:300]}")
    for name, text in texts.items():
      print(f"\n--- {name} ---\n{text}")
  rss_gb = peak_rss_gb()
  print(f"\npeak resident memory of this job: {rss_gb:.2f} GB (10^9 bytes)")
  report = dict(target=target, drafter=drafter, dtype=dtype, gamma=gamma, max_new_tokens=max_new_tokens,
                peak_rss_gb=rss_gb,
                prompts=[dict(id=r["id"], task=r["task"], source=r["source"], licence=r["licence"]) for r in rows],
                results=results, sample_text=texts)
  if output_json:
    path = pathlib.Path(output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
  return report


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m blockspec_jax.run", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[])
  parser.add_argument("--gin_param", action="append", default=[])
  args = parser.parse_args(argv)
  gin.parse_config_files_and_bindings(args.gin_file, args.gin_param)
  run_job()
  return 0


if __name__ == "__main__":
  sys.exit(main())
