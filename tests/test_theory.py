"""Tests of blockspec_jax.theory: exact enumeration, closed forms, losslessness, estimators and the χ² check.

Everything here is exact (float64 enumeration, tolerances at rounding level) except the sampling tests, which name
their seed, sample size and threshold and are deterministic.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from blockspec_jax import theory, verify
from blockspec_jax.theory import TabularLM

from helpers import T1, law_name, lossless_rules

#: The laws of the registered chain rules lossless at T = 1 (a new rule's law is checked here without an edit).
LOSSLESS_RULES = tuple(dict.fromkeys(law_name(rule) for rule in lossless_rules(T1, verify.CHAIN)))


def _random_context(seed: int, vocab_size: int, length: int) -> tuple[int, ...]:
  return tuple(int(x) for x in np.random.default_rng(seed).integers(0, vocab_size, size=length))


def _sparse_model(seed: int, vocab_size: int, depth: int, zero_fraction: float = 0.4) -> TabularLM:
  """Random rows with about ``zero_fraction`` exact zeros (every row keeps at least one positive entry)."""
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.ones(vocab_size), size=theory.num_rows_for(vocab_size, depth))
  zero = rng.random(probs.shape) < zero_fraction
  zero[np.arange(probs.shape[0]), rng.integers(0, vocab_size, size=probs.shape[0])] = False
  probs = np.where(zero, 0.0, probs)
  return TabularLM(probs=probs / probs.sum(axis=1, keepdims=True), depth=depth)


def _model_pairs():
  """(drafter, target, context, gamma) cases: dense, peaked, sparse, equal models; contexts longer than depth."""
  cases = []
  seed = 0
  for vocab_size, depth, gamma in itertools.product((2, 3, 4), (0, 1, 3), (1, 2, 3)):
    seed += 1
    concentration = (1.0, 0.3)[seed % 2]
    drafter = TabularLM.random(10 * seed, vocab_size, depth, concentration)
    target = TabularLM.random(10 * seed + 1, vocab_size, depth, concentration)
    context = _random_context(10 * seed + 2, vocab_size, seed % 3)
    cases.append(pytest.param(drafter, target, context, gamma, id=f"V{vocab_size}-L{depth}-g{gamma}-c{len(context)}"))
  return cases


SPARSE_CASES = [
    pytest.param(_sparse_model(101, 3, 1), _sparse_model(102, 3, 1), (2,), 3, id="sparse-V3-L1-g3"),
    pytest.param(_sparse_model(103, 4, 2), _sparse_model(104, 4, 2), (), 2, id="sparse-V4-L2-g2"),
    pytest.param(_sparse_model(105, 2, 3), _sparse_model(106, 2, 3), (1, 0), 3, id="sparse-V2-L3-g3"),
]
SAME_MODEL = TabularLM.random(107, 3, 2)
EQUAL_CASES = [pytest.param(SAME_MODEL, SAME_MODEL, (1,), 3, id="drafter-equals-target")]
ALL_CASES = _model_pairs() + SPARSE_CASES + EQUAL_CASES


# --- TabularLM -----------------------------------------------------------------------------------------------------

def test_row_offsets_and_indexing():
  np.testing.assert_array_equal(theory.row_offsets(3, 2), [0, 1, 4])
  np.testing.assert_array_equal(theory.row_offsets(5, 0), [0])
  assert theory.num_rows_for(3, 2) == 13
  model = TabularLM.random(0, 3, 2)
  assert model.num_rows == 13 and model.vocab_size == 3
  assert model.row_index(()) == 0
  assert model.row_index((2,)) == 1 + 2
  assert model.row_index((1, 2)) == 4 + 1 * 3 + 2
  assert model.row_index((0, 0, 1, 2)) == model.row_index((1, 2))  # longer prefixes use the last L tokens
  # Every prefix of length <= L has its own row.
  rows = {model.row_index(prefix) for m in range(3) for prefix in itertools.product(range(3), repeat=m)}
  assert rows == set(range(13))
  np.testing.assert_array_equal(model.next_probs((0, 1, 2)), model.probs[4 + 1 * 3 + 2])
  with pytest.raises(ValueError, match="out of range"):
    model.row_index((3,))


def test_sequence_prob_is_product_of_conditionals():
  model = TabularLM.random(1, 3, 1)
  expected = model.probs[model.row_index((2,)), 0] * model.probs[model.row_index((0,)), 1]
  assert model.sequence_prob((2,), (0, 1)) == expected
  assert model.sequence_prob((2,), ()) == 1.0
  law = theory.sequence_law(model, (2,), 3)
  assert len(law) == 27 and sum(law.values()) == pytest.approx(1.0, abs=1e-15)


def test_constructors():
  model = TabularLM.context_free([0.25, 0.75])
  assert model.depth == 0 and model.next_probs((1, 0, 1))[1] == 0.75
  logits = np.array([[0.0, np.log(3.0)], [1.0, 1.0], [5.0, -2.0]])
  from_logits = TabularLM.from_logits(logits, depth=1)
  np.testing.assert_allclose(from_logits.probs[0], [0.25, 0.75], rtol=1e-15)
  np.testing.assert_array_equal(from_logits.probs[1], [0.5, 0.5])
  greedy = TabularLM(probs=np.array([[0.5, 0.5], [0.2, 0.8], [0.6, 0.4]]), depth=1).one_hot_argmax()
  np.testing.assert_array_equal(greedy.probs, [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # ties -> first index
  same_seed = TabularLM.random(np.random.default_rng(4), 4, 1, 0.5)
  np.testing.assert_array_equal(same_seed.probs, TabularLM.random(4, 4, 1, 0.5).probs)
  assert same_seed.probs.dtype == np.float64 and not same_seed.probs.flags.writeable


@pytest.mark.parametrize("probs, depth, match", [
    (np.array([0.5, 0.5]), 0, "2-D"),
    (np.ones((2, 2)) / 2, 0, "rows"),  # depth 0 needs exactly 1 row
    (np.ones((3, 2)) / 2, 2, "rows"),  # depth 2, V=2 needs 7 rows
    (np.array([[0.5, 0.6]]), 0, "sum to 1"),
    (np.array([[1.2, -0.2]]), 0, "non-negative"),
    (np.array([[np.nan, 1.0]]), 0, "finite"),
    (np.ones((1, 2)) / 2, -1, "depth"),
])
def test_tabular_validation(probs, depth, match):
  with pytest.raises(ValueError, match=match):
    TabularLM(probs=probs, depth=depth)


# --- the paper's toy -----------------------------------------------------------------------------------------------

def test_paper_toy():
  drafter, target, gamma = theory.paper_toy()
  assert gamma == 2
  assert theory.expected_accepted_token_closed_form(drafter, target, (), gamma) == pytest.approx(10 / 9, rel=1e-12)
  assert theory.expected_accepted("token", drafter, target, (), gamma) == pytest.approx(10 / 9, rel=1e-12)
  assert theory.expected_accepted_block_closed_form(drafter, target, (), gamma) == pytest.approx(11 / 9, rel=1e-12)
  assert theory.expected_accepted("block", drafter, target, (), gamma) == pytest.approx(11 / 9, rel=1e-12)
  assert theory.full_information_bound(drafter, target, (), gamma) == pytest.approx(12 / 9, rel=1e-12)
  alpha = theory.acceptance_rate(target.probs[0], drafter.probs[0])
  assert alpha == pytest.approx(2 / 3, rel=1e-15)
  assert theory.iid_expected_accepted(alpha, gamma) == pytest.approx(10 / 9, rel=1e-12)
  assert theory.iid_block_efficiency(alpha, gamma) == pytest.approx(19 / 9, rel=1e-12)


def test_iid_formulas():
  assert theory.iid_block_efficiency(1.0, 4) == 5.0
  assert theory.iid_expected_accepted(1.0, 4) == 4.0
  assert theory.iid_block_efficiency(0.0, 4) == 1.0
  for alpha in (0.1, 0.5, 0.9, 0.999):
    assert theory.iid_block_efficiency(alpha, 6) == pytest.approx((1 - alpha**7) / (1 - alpha), rel=1e-12)
    assert theory.iid_block_efficiency(alpha, 6) == pytest.approx(1 + theory.iid_expected_accepted(alpha, 6), rel=1e-15)
  with pytest.raises(ValueError):
    theory.iid_expected_accepted(1.5, 2)


@pytest.mark.parametrize("seed", range(4))
def test_iid_formula_matches_token_on_context_free_models(seed):
  drafter = TabularLM.random(seed, 4, 0)
  target = TabularLM.random(seed + 100, 4, 0)
  alpha = theory.acceptance_rate(target.probs[0], drafter.probs[0])
  for gamma in (1, 2, 3):
    assert theory.expected_accepted("token", drafter, target, (), gamma) == pytest.approx(
        theory.iid_expected_accepted(alpha, gamma), rel=1e-12)


# --- enumeration vs closed forms, orderings ------------------------------------------------------------------------

@pytest.mark.parametrize("drafter, target, context, gamma", ALL_CASES)
def test_closed_forms_match_enumeration(drafter, target, context, gamma):
  token = theory.expected_accepted("token", drafter, target, context, gamma)
  block = theory.expected_accepted("block", drafter, target, context, gamma)
  assert theory.expected_accepted_token_closed_form(drafter, target, context, gamma) == pytest.approx(
      token, rel=1e-12, abs=1e-15)
  assert theory.expected_accepted_block_closed_form(drafter, target, context, gamma) == pytest.approx(
      block, rel=1e-12, abs=1e-15)
  bound = theory.full_information_bound(drafter, target, context, gamma)
  tol = 1e-12
  assert block >= token - tol
  assert bound >= block - tol
  assert theory.expected_accepted("exact_match", drafter, target, context, gamma) <= token + tol
  if gamma == 1:
    assert block == pytest.approx(token, rel=1e-12, abs=1e-15)


def test_equal_models_accept_everything():
  for rule in ("token", "block"):
    tau_law = theory.exact_tau_law(rule, SAME_MODEL, SAME_MODEL, (1,), 3)
    np.testing.assert_array_equal(tau_law[:3], [0.0, 0.0, 0.0])  # exactly: every ratio is exactly 1
    assert tau_law[3] == pytest.approx(1.0, abs=1e-14)  # Σ over drafts of q(x^γ), up to rounding
  assert theory.full_information_bound(SAME_MODEL, SAME_MODEL, (1,), 3) == pytest.approx(3.0, rel=1e-12)


def test_block_gain_is_strict_somewhere():
  drafter = TabularLM.random(7, 3, 1)
  target = TabularLM.random(8, 3, 1)
  token = theory.expected_accepted("token", drafter, target, (), 3)
  block = theory.expected_accepted("block", drafter, target, (), 3)
  assert block > token + 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_block_equals_token_for_greedy_target(seed):
  drafter = TabularLM.random(seed, 3, 1)
  target = TabularLM.random(seed + 50, 3, 1).one_hot_argmax()
  for gamma in (2, 3):
    np.testing.assert_allclose(theory.exact_tau_law("block", drafter, target, (0,), gamma),
                               theory.exact_tau_law("token", drafter, target, (0,), gamma), rtol=0, atol=1e-14)


@pytest.mark.parametrize("seed", range(3))
def test_block_equals_token_in_expectation_for_one_hot_drafter(seed):
  drafter = TabularLM.random(seed, 3, 2).one_hot_argmax()
  target = TabularLM.random(seed + 50, 3, 2)
  for gamma in (2, 3):
    assert theory.expected_accepted("block", drafter, target, (1,), gamma) == pytest.approx(
        theory.expected_accepted("token", drafter, target, (1,), gamma), rel=1e-12, abs=1e-15)


# --- laws and losslessness -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", list(theory.LAWS))
def test_outcome_laws_are_distributions(rule):
  drafter, target = TabularLM.random(11, 3, 2, 0.5), TabularLM.random(12, 3, 2, 0.5)
  law = theory.exact_outcome_law(rule, drafter, target, (2,), 3)
  assert sum(law.values()) == pytest.approx(1.0, abs=1e-14)
  assert all(1 <= len(outcome) <= 4 and prob > 0 for outcome, prob in law.items())
  tau_law = theory.exact_tau_law(rule, drafter, target, (2,), 3)
  for t in range(4):
    assert tau_law[t] == pytest.approx(sum(p for o, p in law.items() if len(o) == t + 1), abs=1e-14)


@pytest.mark.parametrize("rule", LOSSLESS_RULES)
@pytest.mark.parametrize("drafter, target, context, gamma", ALL_CASES)
def test_lossless_rules_emit_the_target_law(rule, drafter, target, context, gamma):
  outcome_law = theory.exact_outcome_law(rule, drafter, target, context, gamma)
  for n in (1, 2, 3):
    emitted = theory.emitted_prefix_law(outcome_law, target, context, n)
    expected = theory.sequence_law(target, context, n)
    assert emitted.keys() == expected.keys()
    np.testing.assert_allclose([emitted[k] for k in expected], list(expected.values()), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_is_lossless_for_one_hot_target(seed):
  drafter = TabularLM.random(seed, 3, 1, 0.5)
  target = TabularLM.random(seed + 30, 3, 1).one_hot_argmax()
  outcome_law = theory.exact_outcome_law("greedy", drafter, target, (1,), 3)
  for n in (1, 2, 3):
    emitted = theory.emitted_prefix_law(outcome_law, target, (1,), n)
    expected = theory.sequence_law(target, (1,), n)
    np.testing.assert_allclose([emitted[k] for k in expected], list(expected.values()), rtol=0, atol=1e-12)


def test_losslessness_check_detects_a_lossy_rule():
  drafter, target = TabularLM.random(21, 3, 1), TabularLM.random(22, 3, 1)
  outcome_law = theory.exact_outcome_law("greedy", drafter, target, (), 2)
  emitted = theory.emitted_prefix_law(outcome_law, target, (), 2)
  expected = theory.sequence_law(target, (), 2)
  assert max(abs(emitted[k] - expected[k]) for k in expected) > 0.05


def test_conditional_law_by_hand():
  # γ = 1, p_0 = (1/4, 3/4), q_0 = (1/2, 1/2), draft x_1 = 0: a_1 = 1/2; residual (0, 1/4) -> Y = 1.
  p_rows = np.array([[0.25, 0.75], [0.6, 0.4]])
  q_rows = np.array([[0.5, 0.5]])
  for rule in ("token", "block"):
    np.testing.assert_allclose(theory.conditional_law(rule, p_rows, q_rows, [0]),
                               [[0.0, 0.5], [0.3, 0.2]], rtol=0, atol=1e-16)
  np.testing.assert_array_equal(theory.conditional_law("greedy", p_rows, None, [1]), [[0, 0], [1, 0]])
  np.testing.assert_allclose(theory.conditional_law("exact_match", p_rows, None, [1]),
                             [[0.25, 0.0], [0.45, 0.3]], rtol=0, atol=1e-16)


@pytest.mark.parametrize("call", [
    lambda d, t: theory.exact_outcome_law("speculative", d, t, (), 2),
    lambda d, t: theory.exact_tau_law("block", d, t, (), 0),
    lambda d, t: theory.expected_accepted("token", d, TabularLM.random(0, 3, 0), (), 2),
    lambda d, t: theory.expected_accepted("token", d, t, (5,), 2),
])
def test_exact_argument_validation(call):
  drafter, target, _ = theory.paper_toy()
  with pytest.raises(ValueError):
    call(drafter, target)


def test_unknown_rule_lists_known_rules():
  drafter, target, gamma = theory.paper_toy()
  with pytest.raises(ValueError, match="token, block, greedy, exact_match"):
    theory.expected_accepted("typo", drafter, target, (), gamma)


# --- literal simulation of the rules vs the exact outcome law ------------------------------------------------------

def _draw(rng, probs_V):
  cdf_V = np.cumsum(probs_V)
  return int(min(np.searchsorted(cdf_V, rng.random() * cdf_V[-1], side="right"), len(probs_V) - 1))


def _simulate(rule, rng, drafter, target, context, gamma):
  """One iteration, transcribed literally from docs/ALGORITHMS.md §1-2 (stop-at-first-rejection / coin scan)."""
  draft = []
  for _ in range(gamma):
    draft.append(_draw(rng, drafter.next_probs(context + tuple(draft))))
  p_rows = [target.next_probs(context + tuple(draft[:i])) for i in range(gamma + 1)]
  q_rows = [drafter.next_probs(context + tuple(draft[:i])) for i in range(gamma)]
  if rule == "token":
    tau = gamma
    for i in range(1, gamma + 1):
      if rng.random() >= min(1.0, p_rows[i - 1][draft[i - 1]] / q_rows[i - 1][draft[i - 1]]):
        tau = i - 1
        break
    weight = 1.0
  else:
    w = [1.0]
    h = [1.0]
    for i in range(1, gamma + 1):
      w.append(min(1.0, w[-1] * p_rows[i - 1][draft[i - 1]] / q_rows[i - 1][draft[i - 1]]))
      if i < gamma:
        z = np.maximum(w[i] * p_rows[i] - q_rows[i], 0.0).sum()
        h.append(z / (z + (1.0 - w[i])) if z + (1.0 - w[i]) > 0 else 1.0)
      else:
        h.append(w[i])
    eta = rng.random(gamma)
    tau = max([i for i in range(1, gamma + 1) if eta[i - 1] <= h[i]], default=0)
    weight = w[tau]
  if tau == gamma:
    y = _draw(rng, p_rows[gamma])
  else:
    y = _draw(rng, np.maximum(weight * p_rows[tau] - q_rows[tau], 0.0))
  return tuple(draft[:tau]) + (y,)


@pytest.mark.parametrize("rule", ["token", "block"])
def test_simulated_rules_match_exact_outcome_law(rule):
  """Seed 1234, 6000 iterations, p > 1e-4 for the χ² test over all outcomes (V=3, γ=2: 39 outcomes)."""
  drafter, target, context, gamma = TabularLM.random(31, 3, 1), TabularLM.random(32, 3, 1), (0,), 2
  rng = np.random.default_rng(1234)
  counts: dict[tuple[int, ...], int] = {}
  for _ in range(6000):
    outcome = _simulate(rule, rng, drafter, target, context, gamma)
    counts[outcome] = counts.get(outcome, 0) + 1
  result = theory.chi2_gof(counts, theory.exact_outcome_law(rule, drafter, target, context, gamma))
  assert result.n == 6000 and result.dof > 10
  assert result.p_value > 1e-4, result


# --- estimators ----------------------------------------------------------------------------------------------------

def test_rao_blackwell_matches_exact_expectation():
  """Seed 2024, 20000 drafts from the drafter; |estimate − exact| < 4 stderr for block and token weights."""
  drafter, target, context, gamma = TabularLM.random(41, 4, 2), TabularLM.random(42, 4, 2), (3, 1), 3
  sample = theory.sample_drafts(drafter, target, context, gamma, 20000, rng=2024)
  assert sample.drafts_NxG.shape == (20000, 3)
  for k in range(3):  # the sampled tokens and their recorded probabilities agree with the tables
    prefix = context + tuple(int(x) for x in sample.drafts_NxG[k])
    for i in range(gamma):
      assert sample.q_tok_NxG[k, i] == drafter.next_probs(prefix[:len(context) + i])[prefix[len(context) + i]]
      assert sample.p_tok_NxG[k, i] == target.next_probs(prefix[:len(context) + i])[prefix[len(context) + i]]
  block_w = theory.block_weights(sample.p_tok_NxG, sample.q_tok_NxG)
  token_w = theory.token_weights(sample.p_tok_NxG, sample.q_tok_NxG)
  assert np.all(block_w >= token_w * (1 - 1e-14))  # pathwise (up to rounding: (w·p)/q vs t·(p/q))
  for weights, rule in ((block_w, "block"), (token_w, "token")):
    estimate = theory.rao_blackwell_accepted(weights)
    exact = theory.expected_accepted(rule, drafter, target, context, gamma)
    assert estimate.n == 20000 and 0 < estimate.stderr < 0.02
    assert abs(estimate.mean - exact) < 4 * estimate.stderr, (rule, estimate, exact)


def test_rao_blackwell_has_less_variance_than_counting():
  """Seed 7, 3000 token-verification iterations on the toy: both estimates agree with 10/9, RB stderr is smaller."""
  drafter, target, gamma = theory.paper_toy()
  rng = np.random.default_rng(7)
  sample = theory.sample_drafts(drafter, target, (), gamma, 3000, rng)
  weights = theory.token_weights(sample.p_tok_NxG, sample.q_tok_NxG)
  accept_NxG = rng.random(weights.shape) < theory.clipped_ratio(1.0, sample.p_tok_NxG, sample.q_tok_NxG)
  num_accepted = np.cumprod(accept_NxG, axis=1).sum(axis=1)
  rb = theory.rao_blackwell_accepted(weights)
  counting = theory.counting_estimate(num_accepted)
  assert rb.stderr < counting.stderr
  for estimate in (rb, counting):
    assert abs(estimate.mean - 10 / 9) < 4 * estimate.stderr


def test_weights_are_zero_safe():
  p = np.array([[0.5, 0.0, 0.3], [0.0, 0.4, 1.0], [1.0, 1.0, 1.0], [0.9, 0.2, 0.7]])
  q = np.array([[0.0, 0.0, 0.5], [0.0, 0.5, 1e-45], [1e-45, 1e-320, 0.0], [1e-320, 5e-324, 0.0]])
  with np.errstate(all="raise"):
    block_w = theory.block_weights(p, q)
    token_w = theory.token_weights(p, q)
  assert np.all(np.isfinite(block_w)) and np.all(np.isfinite(token_w))
  np.testing.assert_array_equal(block_w[0], [1.0, 0.0, 0.0])   # q = 0 < p: ratio +inf -> 1; p = 0 -> 0 forever
  np.testing.assert_array_equal(block_w[1], [0.0, 0.0, 0.0])   # p = q = 0 -> 0
  np.testing.assert_array_equal(block_w[2], [1.0, 1.0, 1.0])   # tiny q clips to 1
  np.testing.assert_array_equal(block_w[3], [1.0, 1.0, 1.0])
  np.testing.assert_array_equal(token_w[0], [1.0, 0.0, 0.0])
  np.testing.assert_array_equal(token_w[2], [1.0, 1.0, 1.0])
  np.testing.assert_array_equal(theory.block_weights(np.array([0.2, 0.9]), np.array([0.4, 0.3])), [0.5, 1.0])
  estimate = theory.rao_blackwell_accepted(block_w)
  assert np.isfinite(estimate.mean) and np.isfinite(estimate.stderr)


# --- χ² goodness of fit --------------------------------------------------------------------------------------------

def test_chi2_passes_on_samples_from_the_law():
  """Seed 99, 5000 draws from the exact block outcome law of the toy; p > 1e-3."""
  drafter, target, gamma = theory.paper_toy()
  law = theory.exact_outcome_law("block", drafter, target, (), gamma)
  keys = list(law)
  counts_K = np.random.default_rng(99).multinomial(5000, np.array([law[k] for k in keys]))
  result = theory.chi2_gof(dict(zip(keys, counts_K.tolist())), law)
  assert result.n == 5000 and result.dof == len(keys) - 1
  assert result.p_value > 1e-3
  array_result = theory.chi2_gof(counts_K, np.array([law[k] for k in keys]))
  assert array_result == result


def test_chi2_impossible_category_fails_hard():
  expected = {"a": 0.5, "b": 0.5, "c": 0.0}
  result = theory.chi2_gof({"a": 500, "b": 499, "c": 1}, expected)
  assert result.p_value == 0.0 and result.statistic == float("inf")
  assert theory.chi2_gof({"a": 500, "b": 499, "z": 1}, {"a": 0.5, "b": 0.5}).p_value == 0.0
  assert theory.chi2_gof(np.array([10, 0, 3]), np.array([0.5, 0.5, 0.0])).p_value == 0.0


def test_chi2_detects_a_wrong_law_and_pools_small_bins():
  rng = np.random.default_rng(5)
  probs = np.array([0.3, 0.3, 0.3, 0.04, 0.03, 0.03])
  counts = rng.multinomial(100, probs)
  result = theory.chi2_gof(counts, probs, min_expected=5.0)
  assert result.dof == 3  # 3 bins of 30 and one pooled bin of 10
  wrong = rng.multinomial(5000, [0.4, 0.3, 0.2, 0.05, 0.03, 0.02])
  assert theory.chi2_gof(wrong, probs).p_value < 1e-6
  with pytest.raises(ValueError):
    theory.chi2_gof(np.array([1, 2]), np.array([0.5, 0.6]))


def test_chi2_merges_a_pooled_bin_that_is_still_small():
  # Expected (50, 49, 1): the pooled bin (1) is below 5 and is merged into the smallest large bin -> 2 bins, dof 1.
  result = theory.chi2_gof({0: 50, 1: 48, 2: 2}, [0.5, 0.49, 0.01])
  assert result.dof == 1 and result.statistic == pytest.approx(0.0, abs=1e-12)
  assert theory.chi2_gof({0: 50, 1: 48, 2: 2}, [0.5, 0.49, 0.01], min_expected=0.0).dof == 2


def test_sample_drafts_respects_zeros():
  """Seed 3, 5000 drafts from a sparse drafter: no drafted token has drafter probability 0."""
  drafter, target = _sparse_model(201, 4, 1, zero_fraction=0.6), _sparse_model(202, 4, 1)
  sample = theory.sample_drafts(drafter, target, (2,), 3, 5000, rng=3)
  assert np.all(sample.q_tok_NxG > 0)
  assert set(np.unique(sample.drafts_NxG[:, 0]).tolist()) == set(np.flatnonzero(drafter.next_probs((2,))).tolist())
