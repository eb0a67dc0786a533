"""Benchmark: the CPU linear kernel on float32 weights vs on quantized GGUF weights, side by side in one run.

    python -m blockspec_jax.eval.bench_quant_kernel [--models target drafter] [--tokens 1 5] [--reps 20] [--xla]

For the layer shapes and GGUF types of the Qwen2.5-Coder 1.5B target (d = 1536, ffn 8960, vocab 151936; Q4_K_M:
Q4_K for most matrices, Q6_K for the head and half the layers' ffn_down / attn_v) and of the 0.5B drafter (d = 896,
ffn 4864; Q5_0 for most, Q8_0 for the head and half the attn_v, Q6_K / Q4_K ffn_down), it times one decode step
(M = 1 row) and a verify-width pass (M = 5 rows: γ = 4) of ``kernels.linear(x, w, impl="kernel")`` with ``w`` the
float32 weights and with ``w`` the :class:`~blockspec_jax.models.quant.QuantizedTensor` they were dequantized from
(both give the same bits). Weights are random blocks of the right type (no download). Each row prints the median
milliseconds per call, the GB/s of weight bytes read (float32: 4 B/weight; quantized: codes + scales + offsets) and
the speed ratio float32 / quantized; ``--xla`` adds ``quant.quantized_matmul`` (XLA's dequantize + dot). The model
rows sum one decode step's linear layers (every layer and the head, by their counts in the real files). The machine's
load average is printed: a loaded machine makes the figures unreliable.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax import kernels
from blockspec_jax.models import quant

#: Byte offsets of the float16 fields (d, m, dmin) inside one block of each type: made finite and of realistic size.


@dataclasses.dataclass(frozen=True)
class Layer:
  """One weight matrix [out, in] of a GGUF type, used ``count`` times per decode step."""
  name: str
  out: int
  inp: int
  qtype: str
  count: int


# Counts from the shipped GGUF files (qwen2.5-coder-1.5b-instruct-q4_k_m, qwen2.5-coder-0.5b-instruct-awq).
MODELS = {
    "target": ("Qwen2.5-Coder 1.5B (28 layers)", [
        Layer("attn_q", 1536, 1536, "Q4_K", 28), Layer("attn_k", 256, 1536, "Q4_K", 28),
        Layer("attn_v", 256, 1536, "Q4_K", 14), Layer("attn_v", 256, 1536, "Q6_K", 14),
        Layer("attn_output", 1536, 1536, "Q4_K", 28), Layer("ffn_gate", 8960, 1536, "Q4_K", 28),
        Layer("ffn_up", 8960, 1536, "Q4_K", 28), Layer("ffn_down", 1536, 8960, "Q4_K", 14),
        Layer("ffn_down", 1536, 8960, "Q6_K", 14), Layer("output", 151936, 1536, "Q6_K", 1)]),
    "drafter": ("Qwen2.5-Coder 0.5B (24 layers)", [
        Layer("attn_q", 896, 896, "Q5_0", 24), Layer("attn_k", 128, 896, "Q5_0", 24),
        Layer("attn_v", 128, 896, "Q5_0", 12), Layer("attn_v", 128, 896, "Q8_0", 12),
        Layer("attn_output", 896, 896, "Q5_0", 24), Layer("ffn_gate", 4864, 896, "Q5_0", 24),
        Layer("ffn_up", 4864, 896, "Q5_0", 24), Layer("ffn_down", 896, 4864, "Q4_K", 12),
        Layer("ffn_down", 896, 4864, "Q6_K", 12), Layer("output", 151936, 896, "Q8_0", 1)]),
}


def random_quantized(qtype: str, out: int, inp: int, seed: int) -> quant.QuantizedTensor:
  """A random [out, in] tensor of ``qtype``: random code bytes, float16 fields of realistic size (|d| ~ 1e-3)."""
  rng = np.random.default_rng(seed)
  layout = quant.LAYOUTS[qtype]
  num_blocks = out * inp // layout.block
  blocks = rng.integers(0, 256, (num_blocks, layout.type_size), dtype=np.uint8)
  for at in quant.F16_FIELDS[qtype]:
    d = rng.uniform(-2e-3, 2e-3, num_blocks).astype(np.float16)
    blocks[:, at:at + 2] = d.view(np.uint8).reshape(num_blocks, 2)
  return quant.quantize_from_gguf(blocks, qtype, (out, inp))


def _median_ms(fns, args, reps: int) -> list[float]:
  """Median milliseconds of each of ``fns`` (called with its args), measured round-robin after one warm-up call."""
  for fn, a in zip(fns, args):
    jax.block_until_ready(fn(*a))
  times = [[] for _ in fns]
  for _ in range(reps):
    for i, (fn, a) in enumerate(zip(fns, args)):
      start = time.perf_counter()
      jax.block_until_ready(fn(*a))
      times[i].append(time.perf_counter() - start)
  return [1e3 * statistics.median(t) for t in times]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument("--tokens", nargs="+", type=int, default=[1, 5], help="rows M per call (1: a step; 5: γ = 4)")
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--xla", action="store_true", help="also time quant.quantized_matmul (XLA)")
  args = parser.parse_args(argv)
  if jax.default_backend() != "cpu" or not kernels.kernel_available():
    raise SystemExit("bench_quant_kernel: needs the CPU backend and the CPU kernel")
  kernel = jax.jit(lambda x, w: kernels.linear(x, w, impl="kernel"))
  xla = jax.jit(quant.quantized_matmul)
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load average before {os.getloadavg()[0]:.2f}; "
        f"{args.reps} reps, median")
  head = (f"{'layer':12} {'type':5} {'N x K':>13} {'M':>2}  {'f32 ms':>8} {'GB/s':>5}  {'quant ms':>8} {'GB/s':>5}"
          f"  {'f32/quant':>9}" + (f"  {'xla ms':>8}" if args.xla else ""))
  for model in args.models:
    title, layers = MODELS[model]
    print(f"\n{title}\n{head}")
    totals = {m: [0.0, 0.0] for m in args.tokens}
    cache: dict = {}
    for i, layer in enumerate(layers):
      key = (layer.out, layer.inp, layer.qtype)
      if key not in cache:
        cache.clear()  # one layer's weights at a time (the heads are 0.5-0.9 GB in float32)
        qt = random_quantized(layer.qtype, layer.out, layer.inp, seed=i)
        w_NxK = jnp.asarray(quant.dequantize_np(qt))
        cache[key] = (jax.tree.map(jnp.asarray, qt), w_NxK)
      qt, w_NxK = cache[key]
      f32_bytes, q_bytes = layer.out * layer.inp * 4, quant.nbytes(qt)
      for m in args.tokens:
        x_MxK = jnp.asarray(np.random.default_rng(m).standard_normal((m, layer.inp)), jnp.float32)
        fns, fargs = [kernel, kernel], [(x_MxK, w_NxK), (x_MxK, qt)]
        if args.xla:
          fns.append(xla)
          fargs.append((x_MxK, qt))
        ms = _median_ms(fns, fargs, args.reps)
        totals[m][0] += layer.count * ms[0]
        totals[m][1] += layer.count * ms[1]
        row = (f"{layer.name:12} {layer.qtype:5} {f'{layer.out}x{layer.inp}':>13} {m:>2}  {ms[0]:8.3f} "
               f"{f32_bytes / ms[0] / 1e6:5.1f}  {ms[1]:8.3f} {q_bytes / ms[1] / 1e6:5.1f}  {ms[0] / ms[1]:9.2f}")
        print(row + (f"  {ms[2]:8.3f}" if args.xla else ""), flush=True)
    for m, (f32_ms, q_ms) in totals.items():
      print(f"{'step total':12} {'':5} {'(x counts)':>13} {m:>2}  {f32_ms:8.2f} {'':5}  {q_ms:8.2f} {'':5}  "
            f"{f32_ms / q_ms:9.2f}")
  print(f"\nload average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
