"""Exact laws: every registered chain rule against the law it declares (``theory_law``, enumerated by
blockspec_jax.theory), and the reference loop's emitted sequence against the target law. The rules come from the
registry (helpers.lossless_rules): a newly registered lossless chain rule is tested here without an edit. χ² goodness
of fit with fixed seeds; thresholds are p > 1e-3 for exact rules (the seeds are fixed, so the outcome is
deterministic) and p < 1e-6 where a bias must be detected.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import theory, verify
from blockspec_jax.decoding import reference as ref

from helpers import (BIAS_P, GREEDY, PASS_P, T1, law_name, lossless_rules, outcome_counts, row_counts,
                     single_block_law_chi2, single_block_outcomes, stable_seed, top_k_pair)

#: Registered chain rules lossless at T = 1, and those lossless only for a greedy target (the registry's order).
EXACT_CHAIN_RULES = lossless_rules(T1, verify.CHAIN)
GREEDY_TARGET_RULES = [rule for rule in lossless_rules(GREEDY, verify.CHAIN) if rule not in EXACT_CHAIN_RULES
                       and verify.VERIFIERS[rule].requires_greedy_target]

MODELS = {
    "toy": (lambda: theory.paper_toy()[:2], ()),
    "random_v3_d2": (lambda: (theory.TabularLM.random(1, 3, 2, 0.5), theory.TabularLM.random(2, 3, 2, 0.5)), (0,)),
    "random_v4_d1": (lambda: (theory.TabularLM.random(3, 4, 1, 1.0), theory.TabularLM.random(4, 4, 1, 1.0)), (2,)),
}


def test_toy_monte_carlo_numbers():
  """10/9 (token) and 11/9 (block) accepted tokens per iteration on the paper's toy, by simulation (seeded)."""
  drafter, target, gamma = theory.paper_toy()
  n = 400_000
  for rule, exact in (("token", 10 / 9), ("block", 11 / 9)):
    _, tau, _, acc = single_block_outcomes(drafter, target, (), gamma, rule, n, seed=17)
    counted = theory.counting_estimate(tau)
    rb = theory.rao_blackwell_accepted(acc.astype(np.float64))
    print(f"toy {rule}: counted {counted.mean:.4f} ± {counted.stderr:.4f}, RB {rb.mean:.4f} ± {rb.stderr:.4f}, "
          f"exact {exact:.4f}")
    assert abs(counted.mean - exact) < 5 * counted.stderr
    assert abs(rb.mean - exact) < 5 * rb.stderr
    assert rb.stderr < counted.stderr  # Rao–Blackwellisation reduces variance
  assert theory.full_information_bound(drafter, target, (), gamma) == pytest.approx(12 / 9, rel=1e-12)


def check_single_block_law(model, rule):
  """Law of (X_1..X_τ, Y) and of τ from the jitted rule = the exact enumeration of its declared law (200k seeded
  samples, χ², p > PASS_P); the one law check every registered lossless chain rule goes through."""
  make, context = MODELS[model]
  drafter, target = make()
  res, tau_res = single_block_law_chi2(rule, drafter, target, context, 3, 200_000, seed=stable_seed(model, rule))
  print(f"single-block {rule} {model}: outcome χ² p = {res.p_value:.4g} (dof {res.dof}), τ χ² p = "
        f"{tau_res.p_value:.4g}")
  assert res.p_value > PASS_P and tau_res.p_value > PASS_P


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("rule", EXACT_CHAIN_RULES)
def test_single_block_law_matches_enumeration(model, rule):
  check_single_block_law(model, rule)


@pytest.mark.parametrize("rule", GREEDY_TARGET_RULES)
def test_single_block_greedy_law(rule):
  """Rules lossless only for a greedy target, against their law on a one-hot target (50k seeded samples)."""
  drafter, _ = MODELS["random_v3_d2"][0]()
  target = theory.TabularLM.random(5, 3, 2, 0.5).one_hot_argmax()
  draft, tau, y, _ = single_block_outcomes(drafter, target, (1,), 3, rule, 50_000, seed=3)
  law = theory.exact_outcome_law(law_name(rule), drafter, target, (1,), 3)
  res = theory.chi2_gof(outcome_counts(draft, tau, y), law)
  print(f"single-block {rule}: χ² p = {res.p_value:.4g}")
  assert res.p_value > PASS_P


def _loop_sequences(drafter, target, prompt, gamma, rule, num_tokens, num_samples, seed, coin_keying="iteration"):
  d, t = ref.TabularTables.from_lm(drafter), ref.TabularTables.from_lm(target)
  run = jax.jit(jax.vmap(lambda k: ref.speculative_decode_tabular(
      k, d, t, jnp.asarray(prompt, jnp.int32), gamma=gamma, num_tokens=num_tokens, verifier=rule,
      coin_keying=coin_keying)))
  tokens, state = run(jax.random.split(jax.random.key(seed), num_samples))
  return np.asarray(tokens), state


def _sequence_chi2(tokens_NxT, target, prompt):
  return theory.chi2_gof(row_counts(tokens_NxT), theory.sequence_law(target, prompt, tokens_NxT.shape[1]))


LOOP_CASES = {
    "random_v3_d2_g3": (MODELS["random_v3_d2"][0], (0,), 3),
    "random_v4_d1_g2": (MODELS["random_v4_d1"][0], (2,), 2),
    "topk2_v4_d2_g4": (lambda: top_k_pair(8, 4, 2, 2), (1, 3), 4),
}


#: Every rule runs the smallest case by default; the other two cases are ``slow`` (``python -m pytest -m slow``).
@pytest.mark.parametrize("case", [c if c == "random_v4_d1_g2" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(LOOP_CASES)])
@pytest.mark.parametrize("rule", EXACT_CHAIN_RULES)
def test_reference_loop_first_four_tokens_have_target_law(case, rule):
  """Several iterations of draft → verify → commit: the first 4 emitted tokens follow the target law exactly."""
  make, prompt, gamma = LOOP_CASES[case]
  drafter, target = make()
  tokens, state = _loop_sequences(drafter, target, prompt, gamma, rule, 4, 200_000, seed=stable_seed(case, rule))
  res = _sequence_chi2(tokens, target, prompt)
  iters = float(np.mean(np.asarray(state.iteration)))
  print(f"loop {rule} {case}: χ² p = {res.p_value:.4g} (dof {res.dof}), mean iterations {iters:.2f}")
  assert res.p_value > PASS_P
  assert iters > 1.2  # several iterations really happened (the law spans block boundaries)


@pytest.mark.parametrize("rule", GREEDY_TARGET_RULES)
def test_reference_loop_greedy_rule_emits_target_argmax_chain(rule):
  drafter, _ = MODELS["random_v3_d2"][0]()
  target = theory.TabularLM.random(6, 3, 2, 0.5).one_hot_argmax()
  tokens, state = _loop_sequences(drafter, target, (0,), 3, rule, 6, 2_000, seed=0)
  expected, prefix = [], [0]
  for _ in range(6):
    nxt = int(np.argmax(target.next_probs(tuple(prefix))))
    expected.append(nxt)
    prefix.append(nxt)
  np.testing.assert_array_equal(tokens, np.tile(expected, (2_000, 1)))
  assert float(np.mean(np.asarray(state.num_accepted))) > 0


def test_block_beats_token_in_the_loop():
  """Fewer target calls for the same tokens: mean iterations to emit 8 tokens, block < token (seeded)."""
  drafter, target = MODELS["random_v3_d2"][0]()
  _, s_tok = _loop_sequences(drafter, target, (0,), 4, "token", 8, 50_000, seed=1)
  _, s_blk = _loop_sequences(drafter, target, (0,), 4, "block", 8, 50_000, seed=1)
  it_tok, it_blk = float(np.mean(np.asarray(s_tok.iteration))), float(np.mean(np.asarray(s_blk.iteration)))
  print(f"iterations for 8 tokens: token {it_tok:.3f}, block {it_blk:.3f}")
  assert it_blk < it_tok - 0.02


@pytest.mark.slow  # a long Monte Carlo on the coins' keying; the loop's exact laws run by default
def test_position_keyed_coins_bias_block_but_not_token():
  """Uniforms keyed by absolute position are reused when a position is re-drafted. Token verification never looks
  past its first rejection, so it stays exact; block verification scans every coin, so its output law shifts."""
  drafter, target = MODELS["random_v3_d2"][0]()
  prompt, gamma = (0,), 2
  results = {}
  for rule in ("token", "block"):
    for keying in ("iteration", "position"):
      tokens, _ = _loop_sequences(drafter, target, prompt, gamma, rule, 4, 200_000, seed=0, coin_keying=keying)
      results[rule, keying] = _sequence_chi2(tokens, target, prompt).p_value
  print("position keying χ² p-values:", {f"{r}/{k}": f"{p:.3g}" for (r, k), p in results.items()})
  assert results["block", "position"] < BIAS_P
  assert results["block", "iteration"] > PASS_P
  assert results["token", "position"] > PASS_P
  assert results["token", "iteration"] > PASS_P


def test_reference_loop_errors():
  d = ref.TabularTables.from_lm(theory.TabularLM.random(0, 3, 1))
  t4 = ref.TabularTables.from_lm(theory.TabularLM.random(0, 4, 1))
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    ref.speculative_decode_tabular(jax.random.key(0), d, t4, jnp.array([0]), gamma=2, num_tokens=3)
  with pytest.raises(ValueError, match="gamma must be >= 1"):
    ref.speculative_decode_tabular(jax.random.key(0), d, d, jnp.array([0]), gamma=0, num_tokens=3)
  with pytest.raises(ValueError, match="unknown verifier"):
    ref.speculative_decode_tabular(jax.random.key(0), d, d, jnp.array([0]), gamma=2, num_tokens=3, verifier="x")


def test_row_index_matches_numpy():
  lm = theory.TabularLM.random(0, 3, 3)
  rng = np.random.default_rng(0)
  for length in range(0, 7):
    tokens = rng.integers(0, 3, size=8)
    got = int(ref.tabular_row_index(jnp.asarray(tokens, jnp.int32), jnp.int32(length), 3, 3))
    assert got == lm.row_index(tuple(int(t) for t in tokens[:length]))
