"""SPRINTER's loop: its exact law (head-accepted tokens from q, flagged ones from p, segments capped), the reductions
the paper states (a head that always flags is lossless: the target's law, and greedy = autoregressive), counters,
batch independence and the errors for bad settings."""

import dataclasses
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import theory, verify
from blockspec_jax import checks
from blockspec_jax import methods
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters.sprinter import SprinterDrafter, head_probs
from blockspec_jax.models import decoder as dec
from blockspec_jax.theory import lossy

from helpers import (GREEDY, PROMPTS as RAGGED, T1, model_pair, run_ar, target_sequence_law,
                     tiny_config)

PROMPT = [1, 4]


def random_head(config, seed=5):
  return {"w_D": jax.random.normal(jax.random.key(seed), (config.d_model,), jnp.float32),
          "b": jnp.float32(0.0)}


def run_sprinter(config, target, params, prompts, keys, max_new, threshold, cap, sampler=T1, bonus=True):
  tokens, lens = spec.prepare_prompts(prompts)
  return spec.generate_speculative(target, params, keys, tokens, lens, target=config, drafter=SprinterDrafter(config),
                                   gamma=cap, max_new_tokens=max_new,
                                   verifier=verify.SprinterVerifier(threshold=threshold, cap=cap, bonus=bonus),
                                   sampler=sampler)


def context_tables(config, target, drafter, head, prompt, n, sampler=T1):
  """``{context: (p_V, q_V, head probability)}`` for every context the first ``n`` emitted tokens can see (one batched
  full forward of each model over all ``V^n`` continuations, hidden states included)."""
  vocab = config.vocab_size
  conts = np.array(list(itertools.product(range(vocab), repeat=n)), np.int32)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1).astype(np.int32)
  width = seqs.shape[1]
  positions = jnp.broadcast_to(jnp.arange(width), seqs.shape)
  outs = []
  for params in (target, drafter):
    logits, _, hidden = dec.Decoder(config).apply({"params": params}, jnp.asarray(seqs), positions,
                                                  dec.init_cache(config, len(seqs), width),
                                                  dec.causal_mask(positions, width), return_hidden=True)
    rows = np.asarray(sampler.probs(logits), np.float64)
    outs.append((rows / rows.sum(-1, keepdims=True), hidden))  # f32 rows renormalised in f64
  (p_all, _), (q_all, hidden) = outs
  accept_all = np.asarray(head_probs(head, hidden), np.float64)
  p0 = len(prompt)
  table = {}
  for i, seq in enumerate(seqs.tolist()):
    for j in range(n):
      ctx = tuple(seq[:p0 + j])
      table.setdefault(ctx, (p_all[i, p0 - 1 + j], q_all[i, p0 - 1 + j], accept_all[i, p0 - 1 + j]))
  return table


def sprinter_law(table, prompt, n, cap, threshold, vocab, bonus=True):
  return lossy.sprinter_sequence_law(lambda c: table[c][0], lambda c: table[c][1], lambda c: table[c][2] >= threshold,
                                     prompt, n, cap, vocab, bonus=bonus)


def midpoint_threshold(table):
  """A threshold half-way between two middle head probabilities: the head accepts about half the contexts, and no
  probability sits near the threshold (so float rounding between the loop's cached and the full forward cannot flip a
  decision)."""
  probs = np.sort(np.unique([v[2] for v in table.values()]))
  k = len(probs) // 2
  return float((probs[k - 1] + probs[k]) / 2)


def empirical(out):
  counts = {}
  for row in map(tuple, np.asarray(out.tokens_BxN).tolist()):
    counts[row] = counts.get(row, 0) + 1
  return counts


@pytest.mark.parametrize("cap,bonus", [(2, True), pytest.param(3, True, marks=pytest.mark.slow),
                                       pytest.param(2, False, marks=pytest.mark.slow)])
def test_sprinter_loop_has_its_exact_law(cap, bonus):
  """T = 1, V = 6, a random head accepting about half the contexts: the first 3 emitted tokens follow the exact law
  ``p`` where flagged, ``q`` where the head accepts, segments capped at ``cap``, a bonus token from ``p`` after an
  accepted flagged token (``bonus``) (χ², 30k seeded rows), and that law is measurably not the target's (the test can
  tell them apart), nor the law of the other bonus setting."""
  config, target, drafter = model_pair(vocab=6, seed=3, noise=1.0)
  head = random_head(config)
  table = context_tables(config, target, drafter, head, PROMPT, 3)
  threshold = midpoint_threshold(table)
  law = sprinter_law(table, PROMPT, 3, cap, threshold, 6, bonus)
  other = sprinter_law(table, PROMPT, 3, cap, threshold, 6, not bonus)
  assert abs(sum(law.values()) - 1) < 1e-9
  target_law = target_sequence_law(config, target, PROMPT, 3)
  assert lossy.law_tv(law, target_law) > 0.05
  n = 30_000
  keys = jax.random.split(jax.random.key(11), n)
  out = run_sprinter(config, target, {"model": drafter, "head": head}, [PROMPT] * n, keys, 3, threshold, cap,
                     bonus=bonus)
  counts = empirical(out)
  res = theory.chi2_gof(counts, law)
  wrong = theory.chi2_gof(counts, target_law)
  print(f"cap {cap}, bonus {bonus}: χ² p = {res.p_value:.4g} vs exact law; p = {wrong.p_value:.3g} vs the target "
        f"law; TV to the other bonus setting's law {lossy.law_tv(law, other):.4f}")
  assert res.p_value > 1e-3
  assert wrong.p_value < 1e-6
  c = out.extra
  np.testing.assert_array_equal(np.asarray(out.metrics.num_drafts), np.asarray(c.num_head_flags + c.num_cap_flags))
  assert int(np.sum(c.num_head_accepted)) > 0 and int(np.sum(c.num_head_flags)) > 0
  assert (int(np.sum(c.num_bonus_tokens)) > 0) == bonus
  assert lossy.law_tv(law, other) > 0.01
  assert int(np.sum(out.metrics.invalid_prob_rows)) == 0


def test_a_head_that_always_flags_is_lossless():
  """threshold > 1: every token is flagged, so SPRINTER is token verification one token per call: the target's law
  at T = 1 (χ²) and exactly the autoregressive tokens at T = 0 (ragged batch); one target call per token."""
  config, target, drafter = model_pair(vocab=6, seed=3, noise=1.0)
  params = {"model": drafter, "head": random_head(config)}
  assert verify.SprinterVerifier(threshold=1.5).lossless_under(T1)
  n = 20_000
  out = run_sprinter(config, target, params, [PROMPT] * n, jax.random.split(jax.random.key(2), n), 3, 1.5, 4)
  res = theory.chi2_gof(empirical(out), target_sequence_law(config, target, PROMPT, 3))
  assert res.p_value > 1e-3
  # one target call per flagged token, one token more per accepted one (the bonus): 2 or 3 calls for 3 tokens
  calls, bonuses = np.asarray(out.metrics.num_drafts), np.asarray(out.extra.num_bonus_tokens)
  assert np.all((calls >= 2) & (calls <= 3) & (calls + bonuses >= 3)) and calls.mean() < 2.9
  without = run_sprinter(config, target, params, [PROMPT] * 8, jax.random.split(jax.random.key(2), 8), 3, 1.5, 4,
                         bonus=False)
  np.testing.assert_array_equal(np.asarray(without.metrics.num_drafts), 3)
  config, target, drafter = model_pair()
  params = {"model": drafter, "head": random_head(config)}
  keys = jax.random.split(jax.random.key(0), len(RAGGED))
  ar = run_ar(config, target, RAGGED, keys, 12)
  out = run_sprinter(config, target, params, RAGGED, keys, 12, 1.5, 4, sampler=GREEDY)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)


def test_greedy_sprinter_follows_its_point_mass_law():
  """T = 0 with a head that accepts everything (threshold 0): the drafter's greedy tokens, except every cap-th token,
  which is the target's argmax, followed (bonus) by the target's next argmax when the two argmaxes agree: exactly the
  point mass the exact law gives, in the target calls a walk over the argmaxes counts; with cap = 1 and no bonus it
  is autoregressive."""
  config, target, drafter = model_pair(vocab=6, seed=3, noise=0.1)  # argmaxes that agree at most contexts
  head = random_head(config)
  n = 4
  table = context_tables(config, target, drafter, head, PROMPT, n, sampler=GREEDY)
  argmax = lambda ctx, side: int(np.argmax(table[ctx][side]))

  def greedy_walk(cap, bonus):
    """(tokens, target calls): each segment drafts cap − 1 drafter argmaxes, then the flagged one."""
    ctx, calls = tuple(PROMPT), 0
    while len(ctx) - len(PROMPT) < n:
      calls += 1
      for _ in range(cap - 1):
        ctx += (argmax(ctx, 1),)
        if len(ctx) - len(PROMPT) == n:
          return ctx[len(PROMPT):], calls
      agree = argmax(ctx, 0) == argmax(ctx, 1)
      ctx += (argmax(ctx, 0),)
      if bonus and agree and len(ctx) - len(PROMPT) < n:
        ctx += (argmax(ctx, 0),)
    return ctx[len(PROMPT):], calls

  bonuses = 0
  for cap in (1, 2, 3):
    for bonus in (True, False):
      law = sprinter_law(table, PROMPT, n, cap, 0.0, 6, bonus)
      (expected, prob), = law.items()
      assert prob == pytest.approx(1.0)
      tokens, calls = greedy_walk(cap, bonus)
      assert tokens == expected
      out = run_sprinter(config, target, {"model": drafter, "head": head}, [PROMPT],
                         jax.random.split(jax.random.key(0), 1), n, 0.0, cap, sampler=GREEDY, bonus=bonus)
      assert tuple(np.asarray(out.tokens_BxN[0]).tolist()) == expected
      assert int(out.metrics.num_drafts[0]) == calls, (cap, bonus)
      bonuses += int(out.extra.num_bonus_tokens[0])
      if not bonus:
        assert calls == -(-n // cap)
  assert bonuses > 0  # the pair agrees somewhere: the bonus path ran


def test_rows_stay_independent_and_same_key_same_output():
  config, target, drafter = model_pair()
  params = {"model": drafter, "head": random_head(config)}
  keys = jax.random.split(jax.random.key(7), len(RAGGED))
  full = run_sprinter(config, target, params, RAGGED, keys, 10, 0.5, 3)
  again = run_sprinter(config, target, params, RAGGED, keys, 10, 0.5, 3)
  np.testing.assert_array_equal(full.tokens_BxN, again.tokens_BxN)
  for b in (0, 3):
    alone = run_sprinter(config, target, params, [RAGGED[b]], keys[b:b + 1], 10, 0.5, 3)
    np.testing.assert_array_equal(full.tokens_BxN[b], alone.tokens_BxN[0])


def test_sprinter_tv_is_eta_times_tv_on_one_step():
  """One step at one context: the emitted law is ``(1 − η)·p + η·q``, so ``TV = η·TV(p, q)`` (η ∈ {0, 1} for a
  deterministic head; the ideal head of a tabular pair decides by ``P_{x~q}[q(x) ≤ p(x)]``)."""
  p = np.array([0.5, 0.3, 0.2])
  q = np.array([0.2, 0.3, 0.5])
  rows = {(): (p, q)}
  tv_pq = 0.5 * np.abs(p - q).sum()
  for threshold, eta in ((0.9, 0), (0.4, 1)):  # P_q[q ≤ p] = 0.2 + 0.3 = 0.5
    accepts = lossy.ideal_head_accepts(lambda c: rows[c][0], lambda c: rows[c][1], threshold)
    law = lossy.sprinter_sequence_law(lambda c: rows[c][0], lambda c: rows[c][1], accepts, (), 1, 20, 3)
    assert lossy.law_tv(law, {(i,): p[i] for i in range(3)}) == pytest.approx(eta * tv_pq)


def test_bad_settings_are_clear_errors():
  for bad in (-0.1, float("nan"), "0.5", True):
    with pytest.raises(ValueError, match="threshold"):
      verify.SprinterVerifier(threshold=bad)
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match="cap"):
      verify.SprinterVerifier(cap=bad)
  for bad in (1, "yes", None):
    with pytest.raises(ValueError, match="SPRINTER's bonus must be True"):
      verify.SprinterVerifier(bonus=bad)
  config, target, drafter = model_pair(vocab=16)
  tokens, lens = spec.prepare_prompts([[1, 2]])
  keys = jax.random.split(jax.random.key(0), 1)
  from blockspec_jax.drafters import ModelDrafter
  with pytest.raises(ValueError, match="verifier head"):
    spec.generate_speculative(target, drafter, keys, tokens, lens, target=config, drafter=ModelDrafter(config),
                              gamma=4, max_new_tokens=4, verifier=verify.SprinterVerifier(cap=4), sampler=T1)
  with pytest.raises(ValueError, match="gamma = cap"):
    spec.generate_speculative(target, {"model": drafter, "head": random_head(config)}, keys, tokens, lens,
                              target=config, drafter=SprinterDrafter(config), gamma=3, max_new_tokens=4,
                              verifier=verify.SprinterVerifier(cap=4), sampler=T1)
  with pytest.raises(ValueError, match="skips the target"):
    verify.get_verifier("sprinter").verify_draft(None, None, None, None, 4)


def test_jobs_know_the_lossy_rules():
  assert methods.parse_method("sprinter") == ("sprinter", "sprinter")
  assert methods.parse_method("mtad@model") == ("mtad", "model")
  assert methods.method_gamma("sprinter", 4, {"sprinter": {"cap": 7}}) == 7
  assert methods.method_gamma("block", 4, {"sprinter": {"cap": 7}}) == 4
  for name in ("sprinter", "mtad", "lenient"):
    assert not verify.get_verifier(name).lossless_under(T1)
  with pytest.raises(checks.UsageError, match="needs a trained verifier head"):
    methods.drafter_params(SprinterDrafter(tiny_config()), None, None)


def test_drafters_that_differ_only_in_their_head_share_prefill_states():
  """The prefill feeds the drafter model alone: two heads give the same prefill key (``harness.PrefillCache`` shares
  the state between them) and the same state bit for bit; another drafter model does not share it."""
  config, target, drafter = model_pair()
  a, b = SprinterDrafter(config, head="runs/a"), SprinterDrafter(config, head="runs/b")
  assert a.prefill_key() == b.prefill_key() and hash(a.prefill_key()) == hash(b.prefill_key())
  other = SprinterDrafter(dataclasses.replace(config, num_layers=config.num_layers + 1), head="runs/a")
  assert other.prefill_key() != a.prefill_key()
  tokens, lens = spec.prepare_prompts(RAGGED)
  states = [spec.prefill_speculative(target, {"model": drafter, "head": random_head(config, seed)}, tokens, lens,
                                     target=config, drafter=d, gamma=2, max_new_tokens=4)
            for d, seed in ((a, 1), (b, 2))]
  chex.assert_trees_all_equal(*states)
