"""Fidelity of generated text under the target: the target's log-likelihood of what a method emitted.

    total, count, per_seq = target_loglik(target_model, prompt_ids, outputs)

Teacher forcing over prompt + output with the target at T = 1 (untransformed), the LM head only at the generated
positions. A lossless rule samples the target's own law, so its mean log-likelihood differs from autoregressive
sampling by sampling noise only; a lossy rule's shift is its bias. Shared by ``eval.bench_lossy`` and the suites'
speed-against-fidelity plots (``eval.suite``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["target_loglik"]


@functools.partial(jax.jit, static_argnames=("config",))
def _generated_logp(params, tokens_BxT, positions_BxN, targets_BxN, *, config):
  """f32 ``[B, N]``: the target's log-probability (T = 1) of ``targets_BxN`` at ``positions_BxN``."""
  from blockspec_jax.train.distill import sequence_logits
  logits_BxNxV = sequence_logits(config, params, tokens_BxT, positions_BxN)
  logp_BxNxV = jax.nn.log_softmax(logits_BxNxV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp_BxNxV, targets_BxN[:, :, None], axis=-1)[:, :, 0]


def target_loglik(target_model, prompt_ids, outputs, batch_size: int = 4, width: int | None = None,
                  window: int | None = None) -> tuple[float, int, list[float]]:
  """``(Σ log p, number of tokens, per-sequence mean log p)`` of every generated token under the target at T = 1
  (untransformed; teacher forcing over prompt + output, the LM head only at the generated positions). One compiled
  program per model config and shape (the parameters are an argument, never captured as constants): ``width`` (tokens
  of prompt + output) and ``window`` (generated tokens) fix the shape, so calls over several prompt sets share one
  program (default: the longest of these prompts and outputs)."""
  config, params = target_model.config, target_model.params["params"]
  longest = max(len(p) + len(o) for p, o in zip(prompt_ids, outputs))
  most = max(max(len(o) for o in outputs), 1)
  width = longest if width is None else width
  window = most if window is None else window
  if width < longest or window < most:
    raise ValueError(f"target_loglik: width {width} / window {window} < the longest prompt + output {longest} / "
                     f"output {most}")
  total, count, per_seq = 0.0, 0, []
  for start in range(0, len(prompt_ids), batch_size):
    rows = list(range(start, min(start + batch_size, len(prompt_ids))))
    tokens = np.zeros((batch_size, width), np.int32)
    positions = np.zeros((batch_size, window), np.int32)
    targets = np.zeros((batch_size, window), np.int32)
    valid = np.zeros((batch_size, window), bool)
    for r, i in enumerate(rows):
      seq = list(prompt_ids[i]) + list(outputs[i])
      tokens[r, :len(seq)] = seq
      n_out = len(outputs[i])
      positions[r, :n_out] = len(prompt_ids[i]) - 1 + np.arange(n_out)
      targets[r, :n_out] = outputs[i]
      valid[r, :n_out] = True
    logp = np.asarray(_generated_logp(params, tokens, positions, targets, config=config), np.float64)
    for r, i in enumerate(rows):
      n_out = len(outputs[i])
      seq_sum = float(np.sum(logp[r][valid[r]]))
      total += seq_sum
      count += n_out
      per_seq.append(seq_sum / max(n_out, 1))
  return total, count, per_seq


