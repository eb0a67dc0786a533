"""Shared test helpers: tiny model pairs, prompts and the two decoding runs; exact laws and χ² helpers; the registries
as the law tests see them (every registered rule with every registered drafter it accepts).

Imported as ``from helpers import ...``: pytest's default ``prepend`` import mode puts a test file's directory
(``tests/``) on ``sys.path`` before importing it, so this module is found like a test module, without being one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import drafters, sampling, theory, verify
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import ModelDrafter
from blockspec_jax.models import decoder as dec
from blockspec_jax.theory import trees as theory_trees
from blockspec_jax.verify import tree as verify_tree

GREEDY = sampling.Sampler(temperature=0.0)
T1 = sampling.Sampler(temperature=1.0)

#: χ² thresholds: p > PASS_P where a law must be exact, p < BIAS_P where a bias must be detected (seeds are fixed,
#: so every outcome is deterministic).
PASS_P = 1e-3
BIAS_P = 1e-6


# --- models, prompts, runs -----------------------------------------------------------------------------------------

init_params = dec.init_params  # the tests' random models


def fake_devices_env(count: int, product_level: bool = False) -> dict[str, str]:
  """The environment for a subprocess on ``count`` fake CPU devices: this process's, with the device count added to
  its ``XLA_FLAGS`` (so the subprocess compiles with the tests' settings too: ``tests/conftest.py``).
  ``product_level``: without the tests' own settings (``tests/conftest.py``: ``BLOCKSPEC_JAX_TEST_XLA_FLAGS``), so it
  compiles as the jobs do (results compared with the recorded token ids of ``tests/test_main_job_ids.py``)."""
  test_only = tuple(f.lstrip("-").split("=")[0] for f in os.environ.get("BLOCKSPEC_JAX_TEST_XLA_FLAGS", "").split()
                    ) if product_level else ()
  drop = ("force_host_platform_device_count",) + test_only
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not any(d in f for d in drop))
  return dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={count}".strip(),
              JAX_PLATFORMS="cpu")


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago (the coordinator of a multi-process test binds it next)."""
  import socket
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def run_processes(script: str, count: int, args: tuple[str, ...], devices_each: int = 2, timeout: float = 420.0,
                  product_level: bool = False) -> list[tuple[int | None, str]]:
  """Start ``count`` processes of ``python <script> <process id> <count> <port> *args`` at once, each on
  ``devices_each`` fake CPU devices (:func:`fake_devices_env`, with ``product_level``), and wait for them with one
  deadline: ``[(return code or None if it was still running at the deadline and was killed, output)]`` in process
  order."""
  import subprocess
  import sys
  import time
  port = free_port()
  procs = [subprocess.Popen([sys.executable, script, str(i), str(count), str(port), *args], env=fake_devices_env(
      devices_each, product_level), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(count)]
  deadline, results = time.monotonic() + timeout, []
  for proc in procs:
    try:
      out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
      results.append((proc.returncode, out))
    except subprocess.TimeoutExpired:
      proc.kill()
      results.append((None, proc.communicate()[0]))
  return results


def tiny_config(**overrides) -> dec.DecoderConfig:
  """The tests' tiny model: exactly ``DecoderConfig.tiny(**overrides)`` (V 64, D 32, 2 layers, 4 heads / 2 KV heads
  of 8, F 64 unless ``overrides`` say otherwise). Every test model is built here or from :func:`small_config`."""
  return dec.DecoderConfig.tiny(**overrides)


def small_config(vocab_size: int = 64, **overrides) -> dec.DecoderConfig:
  """The tests' small drafter: ``DecoderConfig.tiny`` at half width (D 16, 2 heads / 1 KV head, F 32), one layer
  unless ``overrides`` say otherwise."""
  settings = dict(vocab_size=vocab_size, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=32)
  return tiny_config(**{**settings, **overrides})


def perturbed(params, seed, scale):
  """A drafter close to the target: its weights plus Gaussian noise (high, imperfect agreement)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


@functools.lru_cache(maxsize=None)
def model_pair(vocab=64, seed=0, noise=0.3, layers=2):
  """``(config, target params, drafter params)``: a tiny target and a perturbed copy as its drafter (one config)."""
  config = tiny_config(vocab_size=vocab, num_layers=layers)
  target = init_params(config, seed)
  return config, target, perturbed(target, seed + 1, noise)


#: Four ragged prompts (lengths 7, 2, 4, 1).
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def run_train_main(argv):
  """The training entry point (``python -m blockspec_jax.train``) in-process, with gin's configuration cleared before
  and after (a test's bindings never leak into the next)."""
  import gin
  from blockspec_jax.train import __main__ as train_main
  gin.clear_config()
  try:
    return train_main.main(argv)
  finally:
    gin.clear_config()


def run_ar(config, params, prompts, keys, max_new, sampler=GREEDY, stop_ids=()):
  tokens, lens = spec.prepare_prompts(prompts)
  return spec.generate_autoregressive(params, keys, tokens, lens, target=config, max_new_tokens=max_new,
                                      sampler=sampler, stop_ids=stop_ids)


def run_spec(config, target, drafter_params, prompts, keys, max_new, gamma, verifier="block", sampler=GREEDY,
             stop_ids=(), drafter_config=None):
  tokens, lens = spec.prepare_prompts(prompts)
  return spec.generate_speculative(target, drafter_params, keys, tokens, lens, target=config,
                                   drafter=ModelDrafter(drafter_config or config), gamma=gamma,
                                   max_new_tokens=max_new, verifier=verifier, sampler=sampler, stop_ids=stop_ids)


def target_sequence_law(config, params, prompt, n):
  """Exact law of the next n tokens at T = 1, by enumerating all V^n continuations in one batched forward."""
  vocab = config.vocab_size
  conts = np.array(list(itertools.product(range(vocab), repeat=n)), np.int32)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1).astype(np.int32)
  width = seqs.shape[1]
  positions = jnp.broadcast_to(jnp.arange(width), seqs.shape)
  cache = dec.init_cache(config, len(seqs), width)
  logits, _ = dec.Decoder(config).apply({"params": params}, jnp.asarray(seqs), positions, cache,
                                        dec.causal_mask(positions, width))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)
  p0 = len(prompt)
  total = np.zeros(len(conts))
  for j in range(n):
    total += logp[np.arange(len(conts)), p0 - 1 + j, conts[:, j]]
  probs = np.exp(total)
  return {tuple(c): float(p) for c, p in zip(conts.tolist(), probs / probs.sum())}


def check_drafter_law_at_t1(config, target, params, drafter, verifier, gamma, prompt=(1, 4), n=20_000, seed=11):
  """T = 1: the first 3 tokens ``drafter`` (with ``params``) and ``verifier`` emit after ``prompt`` in ``n`` rows
  (keys ``split(key(seed), n)``) follow the target's exact law (χ², p > 1e-3); no invalid rows; some drafts
  rejected, some accepted (the rule really decides). Returns the metrics."""
  prompt = list(prompt)
  tokens, lens = spec.prepare_prompts([prompt] * n)
  out = spec.generate_speculative(target, params, jax.random.split(jax.random.key(seed), n), tokens, lens,
                                  target=config, drafter=drafter, gamma=gamma, max_new_tokens=3, verifier=verifier,
                                  sampler=T1)
  res = theory.chi2_gof(row_counts(out.tokens_BxN), target_sequence_law(config, target, prompt, 3))
  assert res.p_value > 1e-3, res
  m = out.metrics
  assert 0 < int(m.num_accepted_tokens.sum()) < int(m.num_draft_tokens.sum())
  assert int(m.invalid_prob_rows.sum()) == 0
  return m


def check_drafter_greedy(config, target, params, drafter, verifier, gamma, max_new, prompts=PROMPTS):
  """T = 0: ``drafter`` (with ``params``) and ``verifier`` emit exactly the autoregressive tokens of ``prompts``
  (keys ``split(key(0), len(prompts))``) and accept some drafts. Returns the metrics."""
  keys = jax.random.split(jax.random.key(0), len(prompts))
  ar = run_ar(config, target, prompts, keys, max_new)
  tokens, lens = spec.prepare_prompts(prompts)
  out = spec.generate_speculative(target, params, keys, tokens, lens, target=config, drafter=drafter, gamma=gamma,
                                  max_new_tokens=max_new, verifier=verifier, sampler=GREEDY)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  assert int(out.metrics.num_accepted_tokens.sum()) > 0
  return out.metrics


# --- laws ----------------------------------------------------------------------------------------------------------

def stable_seed(*parts) -> int:
  """A seed from names that is the same in every process (``hash()`` of a string is salted per process by
  PYTHONHASHSEED, so it must never make a seed)."""
  return zlib.crc32("/".join(map(str, parts)).encode()) % 2**31


def top_k_pair(seed, vocab, depth, k):
  """Drafter and target after the *same* top-k transform (rows with zeros): losslessness w.r.t. the transformed law."""
  rng = np.random.default_rng(seed)
  rows = theory.num_rows_for(vocab, depth)
  pair = []
  for scale in (1.0, 2.0):
    logits = scale * rng.normal(size=(rows, vocab))
    probs = np.asarray(sampling.probs_from_logits(jnp.asarray(logits, jnp.float32), top_k=k), np.float64)
    pair.append(theory.TabularLM(probs / probs.sum(-1, keepdims=True), depth))
  return tuple(pair)


def row_counts(rows_NxT) -> dict:
  """``{tuple(row): count}`` over the rows of a small-valued int array ``[N, T]`` (e.g. emitted token sequences;
  rows coded as one integer each, so 10⁵ rows take milliseconds)."""
  rows_NxT = np.asarray(rows_NxT, np.int64)
  low, base = rows_NxT.min(), rows_NxT.max() - rows_NxT.min() + 1
  powers_T = base ** np.arange(rows_NxT.shape[1] - 1, -1, -1)
  codes_U, counts_U = np.unique((rows_NxT - low) @ powers_T, return_counts=True)
  digits_UxT = (codes_U[:, None] // powers_T[None, :]) % base + low
  return {tuple(int(v) for v in row): int(c) for row, c in zip(digits_UxT, counts_U)}


# --- the registries as the law tests see them ----------------------------------------------------------------------

def lossless_rules(sampler=T1, structure: str | None = None) -> list[str]:
  """Registered rules (registry order) whose default instance is lossless under ``sampler``; of one structure
  (``verify.CHAIN`` / ``verify.TREE``) when given."""
  return [name for name, cls in verify.VERIFIERS.items()
          if verify.get_verifier(name).lossless_under(sampler) and structure in (None, cls.structure)]


def verifies(rule: str, kind: str) -> bool:
  """Whether rule ``rule`` accepts drafts of the registered drafter ``kind`` (its ``check_drafter``)."""
  try:
    verify.get_verifier(rule).check_drafter(repr(kind), drafters.DRAFTERS[kind])
  except ValueError:
    return False
  return True


def rule_drafter_pairs(sampler=T1) -> list[tuple[str, str]]:
  """Every ``(rule, drafter)`` of the registries with the rule lossless under ``sampler`` and accepting the
  drafter, rules in registry order, then drafters."""
  return [(rule, kind) for rule in lossless_rules(sampler) for kind in drafters.DRAFTERS if verifies(rule, kind)]


def default_pairs(pairs) -> list[tuple[str, str]]:
  """The pairs the default test run checks, a cover of ``pairs``: every rule with its declared default drafter, then
  every drafter not yet covered with the first rule (registry order) that accepts it. The rest run with
  ``-m heavy``."""
  chosen = [(rule, verify.VERIFIERS[rule].default_drafter) for rule in dict.fromkeys(r for r, _ in pairs)]
  chosen = [pair for pair in chosen if pair in pairs]
  covered = {kind for _, kind in chosen}
  for rule, kind in pairs:
    if kind not in covered:
      chosen.append((rule, kind))
      covered.add(kind)
  return chosen


def registry_params(sampler=T1) -> list:
  """``pytest.param(rule, drafter)`` for :func:`rule_drafter_pairs`, id ``"<rule>@<drafter>"``; pairs outside
  :func:`default_pairs` are marked ``heavy`` (run them with ``python -m pytest -m heavy``)."""
  pairs = rule_drafter_pairs(sampler)
  default = set(default_pairs(pairs))
  return [pytest.param(rule, kind, id=f"{rule}@{kind}", marks=() if (rule, kind) in default else pytest.mark.heavy)
          for rule, kind in pairs]


def untrained_drafter(kind: str, config, target_params, drafter_params, gamma: int = 2):
  """``(drafter, params)``: the registered drafter ``kind`` on the pair (one config for target and drafter) with its
  trained parts at their initial values (the class's ``untrained``)."""
  return drafters.DRAFTERS[kind].untrained(config, target_params, config, drafter_params, gamma)


def run_pair(config, target, drafter_params, prompts, keys, max_new, rule, sampler, kind=None, gamma=2):
  """Decode ``prompts`` with rule ``rule`` and the registered drafter ``kind`` (default: the rule's declared
  default drafter), untrained (:func:`untrained_drafter`), γ = 2."""
  kind = kind or verify.VERIFIERS[rule].default_drafter
  drafter, params = untrained_drafter(kind, config, target, drafter_params, gamma)
  tokens, lens = spec.prepare_prompts(prompts)
  return spec.generate_speculative(target, params, keys, tokens, lens, target=config, drafter=drafter, gamma=gamma,
                                   max_new_tokens=max_new, verifier=rule, sampler=sampler)


def check_target_law_through_the_loop(rule, kind):
  """T = 1, V = 6: the first 3 emitted tokens of ``rule`` with the untrained registered drafter ``kind`` have the
  target's law (χ², 30k rows, key 42, p > PASS_P); no invalid rows; the rule's test decides (some drafts accepted,
  not all)."""
  config, target, drafter = model_pair(vocab=6, seed=3, noise=1.0)
  prompt = [1, 4]
  law = target_sequence_law(config, target, prompt, 3)
  n = 30_000
  keys = jax.random.split(jax.random.key(42), n)
  out = run_pair(config, target, drafter, [prompt] * n, keys, 3, rule, T1, kind)
  res = theory.chi2_gof(row_counts(out.tokens_BxN), law)
  m = out.metrics
  print(f"{rule}@{kind}: χ² p = {res.p_value:.4g} (dof {res.dof}), BE "
        f"{spec.summarize_metrics(m)['mean_acceptance_length']:.3f}")
  assert res.p_value > PASS_P
  assert int(m.invalid_prob_rows.sum()) == 0
  rate = float(m.num_accepted_tokens.sum() / m.num_draft_tokens.sum())
  assert 0 < rate < 0.95  # drafts are neither all rejected nor all accepted: the rule's test actually decides


def check_greedy_equals_autoregressive(rule, kind):
  """T = 0, ragged prompts: ``rule`` with the untrained registered drafter ``kind`` emits exactly the autoregressive
  tokens, and accepts some drafts (trees: the path commit is exercised)."""
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  ar = run_ar(config, target, PROMPTS, keys, 14)
  out = run_pair(config, target, drafter, PROMPTS, keys, 14, rule, GREEDY, kind)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  assert int(out.metrics.num_accepted_tokens.sum()) > 0


@contextlib.contextmanager
def registries_restored():
  """Run a block that registers rules, laws or drafters, then put every registry back as it was (the verifiers,
  the tree dispatch table, the chain and tree laws, the drafters), whatever the block did or raised."""
  registries = (verify.VERIFIERS, verify_tree.TREE_RULES, theory.LAWS, theory_trees.TREE_LAWS, drafters.DRAFTERS)
  saved = [dict(registry) for registry in registries]
  try:
    yield
  finally:
    for registry, contents in zip(registries, saved):
      registry.clear()
      registry.update(contents)


def law_name(rule: str) -> str:
  """The theory law registered rule ``rule`` declares (``theory_law``): a name of ``theory.LAWS`` (chain rules) or
  ``theory.TREE_LAWS`` (tree rules)."""
  law = verify.VERIFIERS[rule].theory_law
  assert law is not None, f"rule {rule!r} declares no theory_law"
  return law


def single_block_outcomes(drafter, target, context, gamma, rule, num_samples, seed):
  """One jitted iteration of ``rule`` per key on the tabular pair (``reference.verify_blocks_tabular``): numpy
  ``(draft_NxG, tau_N, y_N, acceptance_probs_NxG)``."""
  from blockspec_jax.decoding import reference as ref
  keys = jax.random.split(jax.random.key(seed), num_samples)
  run = jax.jit(functools.partial(ref.verify_blocks_tabular, gamma=gamma, verifier=rule))
  draft, res = run(keys, ref.TabularTables.from_lm(drafter), ref.TabularTables.from_lm(target),
                   jnp.asarray(context, jnp.int32))
  return (np.asarray(draft), np.asarray(res.num_accepted), np.asarray(res.next_token),
          np.asarray(res.acceptance_probs))


def outcome_counts(draft_NxG, tau_N, y_N) -> dict:
  """``{(X_1..X_τ, Y): count}`` of sampled iterations."""
  counts = {}
  for d, t, last in zip(draft_NxG, tau_N, y_N):
    key = tuple(int(v) for v in d[:t]) + (int(last),)
    counts[key] = counts.get(key, 0) + 1
  return counts


def single_block_law_chi2(rule, drafter, target, context, gamma, num_samples, seed):
  """χ² of one iteration's sampled outcomes ``(X_1..X_τ, Y)`` and of τ against the exact law the rule declares
  (``theory_law``, enumerated by ``theory.exact``): ``(outcome Chi2Result, τ Chi2Result)``."""
  draft, tau, y, _ = single_block_outcomes(drafter, target, context, gamma, rule, num_samples, seed)
  law = theory.exact_outcome_law(law_name(rule), drafter, target, context, gamma)
  tau_law = theory.exact_tau_law(law_name(rule), drafter, target, context, gamma)
  return (theory.chi2_gof(outcome_counts(draft, tau, y), law),
          theory.chi2_gof(np.bincount(tau, minlength=gamma + 1), tau_law))
