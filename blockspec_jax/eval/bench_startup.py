"""Time to first result: how long a user waits for compilation and prefill before any token, and how fast prefill is
against this machine's own matmul peak, in float32 and bfloat16, one run.

    python -m blockspec_jax.eval.bench_startup [--gin_param "bench_startup.target = 'smollm2-135m'"]

Per dtype and layout (``scanned``: the layers stacked and compiled once, what the decoding jobs load; ``unrolled``:
one copy of every layer per program), on the target model (default: the Qwen2.5-Coder 1.5B target):

* ``load_s``: loading the converted weights from the cache (the first run also fetches and converts them);
* ``prefill_lower_s`` / ``prefill_compile_s``: tracing + lowering, and XLA compilation, of the prefill program at
  ``batch × prompt_width`` (``decoding.speculative.prefill_autoregressive``), timed apart with ``.lower().compile()``;
* ``decode_lower_s`` / ``decode_compile_s``: the same for the autoregressive decode loop (``max_new_tokens``);
* ``prefill_s`` (median of ``repeats`` runs of the compiled prefill), ``prefill_tokens_per_s`` and
  ``prefill_gflops``: 2 × (the decoder layers' linear weights) × tokens per second, the matmul work of a prefill
  (attention scores, norms and the LM head left out, so the figure is a lower bound on the work done);
  ``prefill_fraction_of_peak``: that against ``matmul_gflops`` of the same dtype;
* ``decode_tokens_per_s``: the compiled decode loop (median of ``repeats``);
* ``decode_bytes_per_token``: the weight bytes one batch-1 decode step must read (every parameter, less the
  embedding table when the LM head has its own weight: the embedding is then a one-row gather), and
  ``decode_roofline_tokens_per_s``: ``memory_gbps`` over that, the most tokens per second a batch-1 decode can reach
  on this machine whatever the code; ``decode_fraction_of_roofline``: the measured rate against it;
* ``first_token_s``: load + compile of both programs + one prefill: what a user waits before the first token;
* with a ``drafter`` (default the Qwen2.5-Coder 0.5B), the same for block verification at ``gamma``: ``block_*``
  lowering and compile times of its prefill (both models) and of the speculative loop, ``block_compile_s`` (their
  sum) and ``block_first_token_s`` (both models' load + compile + one prefill).

``matmul_gflops`` is the peak the same process reaches on a square ``jnp.dot`` of ``matmul_size`` in that dtype
(median of ``repeats``), measured in the same run, so the fraction compares like with like; ``memory_gbps`` is the
rate a jitted sum reads a ``bandwidth_mib`` array at (median of ``repeats``), this machine's memory bandwidth as XLA
sees it. Writes a JSON report.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import checks
from blockspec_jax import cli
from blockspec_jax import methods
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.models import hub, quant

__all__ = ["StartupSettings", "bench_startup_job", "matmul_gflops", "memory_gbps", "linear_params",
           "decode_weight_bytes", "main"]


def _median_s(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def matmul_gflops(size: int, dtype, repeats: int = 5) -> float:
  """GFLOP/s of a jitted square ``[size, size] @ [size, size]`` in ``dtype`` (median of ``repeats`` after a warm
  call): this process's matmul peak on this machine."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(dtype)
  f = jax.jit(jnp.dot)
  jax.block_until_ready(f(a, b))
  return 2 * size ** 3 / _median_s(lambda: f(a, b), repeats) / 1e9


def memory_gbps(mib: int, repeats: int = 5) -> float:
  """GB/s of a jitted sum over a float32 array of ``mib`` MiB (median of ``repeats`` after a warm call): how fast
  this process streams memory, the bound of every weight-reading (batch-1 decode) step. Pick ``mib`` well above the
  last-level cache."""
  x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  jax.block_until_ready(f(x))
  gbps = mib * 2 ** 20 / _median_s(lambda: f(x), repeats) / 1e9
  del x
  return gbps


def _nbytes(tree) -> int:
  """Bytes of every array in ``tree`` (a quantized weight: its codes, scales and offsets)."""
  return sum(int(np.size(leaf)) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(tree))


def decode_weight_bytes(params, tie_embeddings: bool) -> int:
  """Bytes of weights one batch-1 decode step reads: every parameter (quantized ones as stored), less the embedding
  table when the LM head is a separate weight (then the embedding is a one-row gather; tied, the table is the LM head
  and is read whole)."""
  total = _nbytes(params)
  if not tie_embeddings:
    total -= _nbytes(params["embed"]["embedding"])
  return total


def _logical_shape(leaf) -> tuple:
  """A parameter's shape: a quantized weight's stacked axes and logical shape, or an array's shape."""
  if isinstance(leaf, quant.QuantizedTensor):
    return tuple(np.shape(leaf.codes_OxC)[:np.ndim(leaf.codes_OxC) - len(leaf.shape)]) + tuple(leaf.shape)
  return tuple(np.shape(leaf))


def linear_params(params) -> int:
  """Weights of the decoder layers' linear maps (every 2-D ``weight`` under ``layers_*``, or 3-D under the stacked
  ``layers``): the multiply-adds per token of a forward, without attention scores, norms, embedding and LM head."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, quant.QuantizedTensor))[0]:
    names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
    shape = _logical_shape(leaf)
    if names and names[-1] == "weight" and ((names[0].startswith("layers_") and len(shape) == 2)
                                            or (names[0] == "layers" and len(shape) == 3)):
      total += int(np.prod(shape))
  return total


def _compile_and_time(prefill_fn, decode_fn, prefill_args, decode_args_of, repeats: int) -> dict:
  """Lower and compile the prefill program on ``prefill_args`` and the decode program on ``decode_args_of(state)``
  apart (``.lower().compile()``), run each once, then time each ``repeats`` times (median)."""
  t0 = time.perf_counter()
  lowered = prefill_fn.lower(*prefill_args)
  t1 = time.perf_counter()
  prefill = lowered.compile()
  t2 = time.perf_counter()
  state = jax.block_until_ready(prefill(*prefill_args))
  decode_args = decode_args_of(state)
  t3 = time.perf_counter()
  lowered_d = decode_fn.lower(*decode_args)
  t4 = time.perf_counter()
  decode = lowered_d.compile()
  t5 = time.perf_counter()
  jax.block_until_ready(decode(*decode_args))
  return dict(prefill_lower_s=t1 - t0, prefill_compile_s=t2 - t1, decode_lower_s=t4 - t3, decode_compile_s=t5 - t4,
              prefill_s=_median_s(lambda: prefill(*prefill_args), repeats),
              decode_s=_median_s(lambda: decode(*decode_args), repeats))


@gin.configurable("bench_startup")
@dataclasses.dataclass(frozen=True, kw_only=True)
class StartupSettings:
  """The benchmark's settings (gin: ``bench_startup.gamma = 2``, …), every one checked when made, before any model
  loads (a :class:`checks.UsageError` naming the setting otherwise)."""

  target: str = methods.DEFAULT_TARGET
  drafter: str | None = methods.DEFAULT_DRAFTER
  """With a drafter (None: skip), block verification's programs are compiled and timed too."""
  gamma: int = 4
  dtypes: tuple = ("float32", "bfloat16")
  layouts: tuple = ("scanned", "unrolled")
  weights: tuple = ("dequantized",)
  verify_tokens: tuple = ()
  """Pass widths T (e.g. 1..9) at which one target forward on the decode cache is timed (median of ``repeats``,
  interleaved; ``bench_decode.time_forwards``): ``forward_ms`` per T and ``verify_cost`` v(γ) = ms(γ + 1) / ms(1),
  what a verify pass at γ costs in decode steps. Empty: not measured."""
  """Each row's weights (``hub.WEIGHTS``): "dequantized" and / or "quantized" (the GGUF's blocks as stored). A model
  whose quantized weights cannot be stacked (block types mixed across layers) has no quantized "scanned" row."""
  """"scanned" (layers stacked and compiled once, what the decoding jobs load) and / or "unrolled" (one copy of every
  layer in each program), each a row per dtype, side by side."""
  prompt_width: int = 256
  batch: int = 1
  max_new_tokens: int = 32
  matmul_size: int = 2048
  """The square matmul that measures the machine's peak."""
  bandwidth_mib: int = 1024
  """The array the memory-bandwidth probe sums."""
  repeats: int = 3
  cache_dir: str | None = None
  output_json: str | None = "results/bench_startup.json"

  def __post_init__(self):
    for name in ("prompt_width", "batch", "max_new_tokens", "matmul_size", "bandwidth_mib", "repeats"):
      methods._check_positive_int(getattr(self, name), name)
    methods.check_gamma(self.gamma)
    methods.check_settings(models=(self.target,) + ((self.drafter,) if self.drafter else ()))
    for dtype in self.dtypes:
      methods.check_settings(dtype=dtype)
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in self.verify_tokens):
      raise checks.UsageError(f"bench_startup.verify_tokens must be positive integers, got {self.verify_tokens!r}")
    if not self.weights or any(w not in hub.WEIGHTS for w in self.weights):
      raise checks.UsageError(f"bench_startup.weights must name some of {hub.WEIGHTS}, got {list(self.weights)}")
    bad = [layout for layout in self.layouts if layout not in ("scanned", "unrolled")]
    if bad or not self.layouts:
      raise checks.UsageError(f"bench_startup.layouts must name 'scanned' and / or 'unrolled', got "
                              f"{list(self.layouts)}")


def bench_startup_job(**overrides) -> dict:
  """Run the benchmark (see the module docstring) on :class:`StartupSettings` from gin (``bench_startup.*``) and
  ``overrides``, checked before any model loads; returns the report."""
  s = StartupSettings(**overrides)
  runtime.enable_compilation_cache("off")  # compile times must be compile times, not cache loads
  bandwidth = memory_gbps(s.bandwidth_mib, s.repeats)
  print(f"memory bandwidth (jitted sum over {s.bandwidth_mib} MiB): {bandwidth:.1f} GB/s", flush=True)
  rows = [row for dtype in s.dtypes for weights in s.weights for layout in s.layouts
          if (row := _startup_row(s, dtype, layout, bandwidth, weights)) is not None]
  _print_rows(rows)
  report = dict(target=s.target, drafter=s.drafter, gamma=s.gamma, prompt_width=s.prompt_width, batch=s.batch,
                max_new_tokens=s.max_new_tokens, matmul_size=s.matmul_size, repeats=s.repeats, memory_gbps=bandwidth,
                bandwidth_mib=s.bandwidth_mib, jax=jax.__version__,
                platform=jax.devices()[0].platform, peak_rss_gb=runtime.peak_rss_gb(), rows=rows)
  if s.output_json and runtime.is_main_process():
    print(f"wrote {runtime.write_report(s.output_json, report)}")
  return report


def _startup_row(s: StartupSettings, dtype: str, layout: str, bandwidth: float, weights: str = "dequantized"
                 ) -> dict | None:
  """One row: the target's load, the autoregressive programs' compile and run times in ``dtype``, ``layout`` and
  ``weights`` against the matmul peak and the memory roofline; with ``s.drafter``, block verification's too. Prints
  its line; None (with the reason printed) for quantized weights that cannot be stacked."""
  from blockspec_jax import sampling
  from blockspec_jax.decoding import speculative as spec
  target, drafter, gamma = s.target, s.drafter, s.gamma
  batch, prompt_width, max_new_tokens, repeats = s.batch, s.prompt_width, s.max_new_tokens, s.repeats
  scan = layout == "scanned"
  sampler = sampling.Sampler(temperature=1.0)
  peak = matmul_gflops(s.matmul_size, jnp.dtype(dtype), repeats)
  start = time.perf_counter()
  try:
    model = sources.load_model(target, dtype, s.cache_dir, progress=False, scan_layers=scan, weights=weights)
  except ValueError as e:
    if weights != "quantized" or not scan or "scan_layers=False" not in str(e):
      raise
    print(f"{target} {dtype} {layout} {weights}: skipped ({e})", flush=True)
    return None
  load_s = time.perf_counter() - start
  tp, config = model.params["params"], model.config
  methods.check_cache_room(prompt_width, max_new_tokens, gamma if drafter else 0, config)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size, (batch, prompt_width), dtype=np.int32)
  lens = np.full((batch,), prompt_width, np.int32)
  keys = jax.random.split(jax.random.key(0), batch)
  static = dict(target=config, max_new_tokens=max_new_tokens)
  ar = _compile_and_time(
      _Bound(spec.prefill_autoregressive.jitted, static),
      _Bound(spec.decode_autoregressive, dict(static, sampler=sampler, stop_ids=())),
      (tp, tokens, lens), lambda state: (tp, keys, state), repeats)
  work = 2 * linear_params(tp) * batch * prompt_width
  row = dict(dtype=dtype, layout=layout, weights=weights, matmul_gflops=peak, load_s=load_s,
             **{k: v for k, v in ar.items() if k != "decode_s"},
             prefill_tokens_per_s=batch * prompt_width / ar["prefill_s"],
             prefill_gflops=work / ar["prefill_s"] / 1e9,
             decode_tokens_per_s=batch * max_new_tokens / ar["decode_s"])
  row["prefill_fraction_of_peak"] = row["prefill_gflops"] / peak
  row["decode_bytes_per_token"] = decode_weight_bytes(tp, config.tie_embeddings)
  row["decode_roofline_tokens_per_s"] = bandwidth * 1e9 / row["decode_bytes_per_token"]
  row["decode_fraction_of_roofline"] = row["decode_tokens_per_s"] / row["decode_roofline_tokens_per_s"]
  row["first_token_s"] = (load_s + row["prefill_lower_s"] + row["prefill_compile_s"] + row["decode_lower_s"]
                          + row["decode_compile_s"] + row["prefill_s"])
  line = (f"{target} {dtype} {layout} {weights}: load {load_s:.1f} s, prefill compile {row['prefill_lower_s']:.1f} + "
          f"{row['prefill_compile_s']:.1f} s, decode compile {row['decode_lower_s']:.1f} + "
          f"{row['decode_compile_s']:.1f} s; prefill {row['prefill_tokens_per_s']:.0f} tok/s = "
          f"{row['prefill_gflops']:.1f} GFLOP/s ({100 * row['prefill_fraction_of_peak']:.0f}% of the {peak:.1f} "
          f"GFLOP/s matmul peak); decode {row['decode_tokens_per_s']:.2f} tok/s "
          f"({100 * row['decode_fraction_of_roofline']:.0f}% of the {row['decode_roofline_tokens_per_s']:.2f} tok/s "
          f"that {row['decode_bytes_per_token'] / 1e9:.2f} GB of weights per token allow at {bandwidth:.1f} GB/s)")
  if s.verify_tokens:
    line += _verify_costs(row, config, tp, s)
  if drafter:
    start = time.perf_counter()
    dmodel = sources.load_model(drafter, dtype, s.cache_dir, progress=False, scan_layers=scan, weights=weights)
    sources.check_pair(model, dmodel)
    row["drafter_load_s"] = time.perf_counter() - start
    block = _time_block(model, dmodel, gamma, static, sampler, (tokens, lens, keys), repeats)
    row.update({f"block_{k}": v for k, v in block.items() if k != "decode_s"})
    row["block_compile_s"] = sum(block[k] for k in ("prefill_lower_s", "prefill_compile_s", "decode_lower_s",
                                                    "decode_compile_s"))
    row["block_first_token_s"] = (load_s + row["drafter_load_s"] + row["block_compile_s"] + block["prefill_s"])
    line += (f"; block (γ = {gamma}, drafter {drafter}): compile {row['block_compile_s']:.1f} s, first token after "
             f"{row['block_first_token_s']:.1f} s")
    del dmodel
  print(line, flush=True)
  return row


def _verify_costs(row: dict, config, params, s: StartupSettings) -> str:
  """Time one target forward over each of ``s.verify_tokens`` tokens at the decode position (after the prompt) on a
  cache of the decode loop's size; fill ``row`` (``forward_ms``, ``verify_cost``) and return the printed part."""
  from blockspec_jax.eval import bench_decode
  widths = sorted(set(s.verify_tokens) | {1})
  cache_len = s.prompt_width + s.max_new_tokens + max(widths)
  ms = bench_decode.time_forwards(config, params, cache_len, s.prompt_width, widths, s.repeats,
                                  jax.random.key(1))
  row["forward_ms"] = {int(t): float(ms[t]) for t in widths}
  row["verify_cost"] = {int(t) - 1: float(ms[t] / ms[1]) for t in widths if t > 1}
  return "; v(γ) " + ", ".join(f"{g}: {v:.2f}" for g, v in row["verify_cost"].items())


def _time_block(model, dmodel, gamma: int, static: dict, sampler, inputs: tuple, repeats: int) -> dict:
  """Block verification's programs (prefill of both models, the speculative loop at ``gamma``) compiled and timed on
  ``inputs`` (tokens, lengths, keys), as :func:`_compile_and_time`."""
  from blockspec_jax import drafters as drafters_lib
  from blockspec_jax.decoding import speculative as spec
  tokens, lens, keys = inputs
  tp, dp = model.params["params"], dmodel.params["params"]
  sstatic = dict(static, drafter=drafters_lib.ModelDrafter(dmodel.config), gamma=gamma)
  return _compile_and_time(
      _Bound(spec.prefill_speculative.jitted, sstatic),
      _Bound(spec.decode_speculative, dict(sstatic, verifier="block", sampler=sampler, stop_ids=())),
      (tp, dp, tokens, lens), lambda state: (tp, dp, keys, state), repeats)


def _print_rows(rows: list[dict]) -> None:
  """The benchmark's table."""
  header = (f"{'dtype':<9} {'layout':<8} {'weights':<11} {'peak GF/s':>9} {'load s':>7} {'AR compile s':>12} "
            f"{'prefill tok/s':>13} {'GF/s':>6} {'% peak':>6} {'decode tok/s':>12} {'% roofline':>10} "
            f"{'first token s':>13} {'block compile s':>15} {'block first s':>13}")
  print("\n" + header + "\n" + "-" * len(header))
  for r in rows:
    compile_s = r["prefill_lower_s"] + r["prefill_compile_s"] + r["decode_lower_s"] + r["decode_compile_s"]
    print(f"{r['dtype']:<9} {r['layout']:<8} {r['weights']:<11} {r['matmul_gflops']:>9.1f} {r['load_s']:>7.1f} "
          f"{compile_s:>12.1f} {r['prefill_tokens_per_s']:>13.0f} {r['prefill_gflops']:>6.1f} "
          f"{100 * r['prefill_fraction_of_peak']:>5.0f}% {r['decode_tokens_per_s']:>12.2f} "
          f"{100 * r['decode_fraction_of_roofline']:>9.0f}% {r['first_token_s']:>13.1f} "
          f"{r.get('block_compile_s', float('nan')):>15.1f} {r.get('block_first_token_s', float('nan')):>13.1f}")


class _Bound:
  """A jitted function with its static keyword arguments bound, exposing ``lower``."""

  def __init__(self, jitted, static: dict):
    self.jitted, self.static = jitted, static

  def lower(self, *args):
    return self.jitted.lower(*args, **self.static)


def main(argv=None) -> int:
  return cli.gin_main("python -m blockspec_jax.eval.bench_startup", __doc__, bench_startup_job, argv)


if __name__ == "__main__":
  sys.exit(main())
