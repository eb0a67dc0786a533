"""DistillSpec's lenient verification (a LOSSY chain rule): ε = 1 is token verification bit for bit, hand tables,
the jitted rule's law against exact enumeration (χ², fixed seeds), its exact one-step error (TV) and E[τ] as ε
decreases, input errors and the registry entry.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import sampling, theory, verify
from blockspec_jax import methods
from blockspec_jax.decoding import reference as ref
from blockspec_jax.eval.bench_verify import make_inputs
from blockspec_jax.theory import exact

PASS_P = 1e-3
BIAS_P = 1e-6
FS = verify.LENIENT_FUNCTIONS

# V = 3 hand case: the drafter puts more mass on token 2 than the target.
P3 = np.array([0.5, 0.3, 0.2])
Q3 = np.array([0.2, 0.2, 0.6])
# First-token TV at ε = 1/2 by hand: only x = 2 has q > p, and TV = min(q_2, f(p_2)) − p_2.
HAND_TV = {"div": 0.4 - 0.2, "div2": 0.6 - 0.2, "pow": np.sqrt(0.2) - 0.2}

# (drafter, target, context, γ). The χ² pair is MODELS["random_v3_d2"] of test_laws.py; the TV/E[τ] pair (V = 4) is
# one whose first rows differ enough that the error keeps growing down to ε = 0.2 (TV(p, q) = 0.405).
PAIR = (lambda: (theory.TabularLM.random(1, 3, 2, 0.5), theory.TabularLM.random(2, 3, 2, 0.5)), (0,), 3)
TV_PAIR = (lambda: (theory.TabularLM.random(29, 4, 1, 0.5), theory.TabularLM.random(30, 4, 1, 0.5)), (1,), 3)
EPSILONS = (1.0, 0.8, 0.6, 0.4, 0.2)


def _random_batch(seed, batch, gamma, vocab, mismatch=1.0):
  return make_inputs(jax.random.key(seed), batch, gamma, vocab, logit_scale=2.0, mismatch=mismatch)


# --- ε = 1 is token verification -------------------------------------------------------------------------------

@pytest.mark.parametrize("f", FS)
def test_epsilon_one_is_token_verification_bit_for_bit(f):
  tokens, q, p = _random_batch(7, 4096, 4, 9)
  keys = verify.row_keys(jax.random.key(3), 4096)
  token = jax.jit(verify.token_verify_batch)(keys, tokens, q, p)
  lenient = jax.jit(jax.vmap(functools.partial(verify.lenient_verify, epsilon=1.0, f=f)))(keys, tokens, q, p)
  via_registry = jax.jit(verify.get_verifier("lenient", epsilon=1, f=f).batch)(keys, tokens, q, p)
  for res in (lenient, via_registry):
    np.testing.assert_array_equal(res.num_accepted, token.num_accepted)
    np.testing.assert_array_equal(res.next_token, token.next_token)
    np.testing.assert_array_equal(res.acceptance_probs, token.acceptance_probs)
  assert 0 < float(jnp.mean(token.num_accepted)) < 4  # a non-degenerate mix of outcomes


# --- hand tables -----------------------------------------------------------------------------------------------

class ExactTableTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_two_token_table(self):
    # p = (1/3, 2/3), q = (2/3, 1/3); X1 = a: token accepts with prob 1/2; ε = 0.8: div (1/3)/0.8/(2/3) = 5/8,
    # div2 (1/3)/0.64/(2/3) = 25/32, pow (1/3)^0.8/(2/3) = 1.5·3^-0.8. X2 = b: accepted with prob 1 by every rule.
    p = jnp.tile(jnp.array([1 / 3, 2 / 3]), (3, 1))
    q = jnp.tile(jnp.array([2 / 3, 1 / 3]), (2, 1))
    tokens = jnp.array([0, 1])
    key = jax.random.key(0)
    expected = {"div": 5 / 8, "div2": 25 / 32, "pow": 1.5 * 3.0 ** -0.8}
    for f, a1 in expected.items():
      rule = self.variant(functools.partial(verify.lenient_verify, epsilon=0.8, f=f))
      res = rule(key, tokens, q, p, coins=jnp.array([0.6, 0.99]))  # 0.6 < a1 for every f: τ = 2
      np.testing.assert_allclose(res.acceptance_probs, [a1, a1], rtol=1e-6)
      self.assertEqual(int(res.num_accepted), 2)
      res = rule(key, tokens, q, p, coins=jnp.array([0.8, 0.0]))  # 0.8 ≥ a1: rejected; residual (0, 1/3) → b
      self.assertEqual((int(res.num_accepted), int(res.next_token)), (0, 1))
    # the same coins under token verification: 0.6 ≥ 1/2 rejects at once
    self.assertEqual(int(verify.token_verify(key, tokens, q, p, jnp.array([0.6, 0.99])).num_accepted), 0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_three_token_table(self):
    # Drafted x = 2 (p = 0.2, q = 0.6), ε = 1/2: div 0.4/0.6 = 2/3, div2 0.8/0.6 → 1, pow √0.2/0.6.
    p = jnp.tile(jnp.asarray(P3, jnp.float32), (2, 1))
    q = jnp.asarray(Q3, jnp.float32)[None]
    expected = {"div": 2 / 3, "div2": 1.0, "pow": np.sqrt(0.2) / 0.6}
    for f, a1 in expected.items():
      rule = self.variant(functools.partial(verify.lenient_verify, epsilon=0.5, f=f))
      res = rule(jax.random.key(1), jnp.array([2]), q, p, coins=jnp.array([0.0]))
      np.testing.assert_allclose(res.acceptance_probs, [a1], rtol=1e-6)
      self.assertEqual(int(res.num_accepted), 1)
    # Rejections correct from norm(max(p − q, 0)) = (3/4, 1/4, 0): never token 2.
    rule = self.variant(functools.partial(verify.lenient_verify, epsilon=0.5, f="div"))
    ys = [int(rule(jax.random.key(s), jnp.array([2]), q, p, coins=jnp.array([0.9])).next_token) for s in range(40)]
    assert set(ys) == {0, 1}

  def test_conditional_law_by_hand(self):
    # γ = 1, x = 2, div ε = 1/2: P(τ=1) = 2/3 (then Y ~ p), P(τ=0) = 1/3 with Y ~ (3/4, 1/4, 0).
    law = theory.conditional_law("lenient", np.stack([P3, P3]), Q3[None], [2], epsilon=0.5, f="div")
    np.testing.assert_allclose(law, [[1 / 4, 1 / 12, 0.0], [2 / 3 * 0.5, 2 / 3 * 0.3, 2 / 3 * 0.2]], atol=1e-15)

  def test_one_step_tv_by_hand(self):
    drafter, target = theory.TabularLM.context_free(Q3), theory.TabularLM.context_free(P3)
    for f, tv in HAND_TV.items():
      assert exact.one_step_tv("lenient", drafter, target, (), epsilon=0.5, f=f) == pytest.approx(tv, abs=1e-14)
      # a verifier object carries its settings
      assert exact.one_step_tv(verify.LenientVerifier(epsilon=0.5, f=f), drafter, target, ()) == pytest.approx(
          tv, abs=1e-14)
    assert exact.one_step_tv("token", drafter, target, ()) == pytest.approx(0.0, abs=1e-15)
    # div2 at ε = 1/2 accepts every draft here: the first token has the drafter's law, TV(p, q) = 0.4
    assert HAND_TV["div2"] == pytest.approx(0.5 * np.abs(P3 - Q3).sum())


def test_greedy_target_makes_lenient_the_greedy_rule():
  """A one-hot p: f(1) ≥ 1 accepts, f(0) = 0 rejects, the residual is the argmax: the greedy rule's verdicts."""
  tokens, q, _ = _random_batch(2, 2048, 4, 3)
  p_onehot = jax.nn.one_hot(jax.random.randint(jax.random.key(9), (2048, 5), 0, 3), 3)
  keys = verify.row_keys(jax.random.key(5), 2048)
  greedy = verify.greedy_verify_batch(keys, tokens, q, p_onehot)
  for f in FS:
    res = jax.vmap(functools.partial(verify.lenient_verify, epsilon=0.3, f=f))(keys, tokens, q, p_onehot)
    np.testing.assert_array_equal(res.num_accepted, greedy.num_accepted)
    np.testing.assert_array_equal(res.next_token, greedy.next_token)
  assert 0 < int(greedy.num_accepted.sum())


def test_lenient_dominates_token_pathwise():
  """P(τ ≥ i | X^i) = Π_j min(1, f(p_j)/q_j) ≥ token's on every draft (f(p, ε) ≥ p on [0, 1])."""
  tokens, q, p = _random_batch(3, 4096, 6, 20, 1.5)
  keys = verify.row_keys(jax.random.key(5), 4096)
  token = verify.token_verify_batch(keys, tokens, q, p)
  for f in FS:
    res = jax.vmap(functools.partial(verify.lenient_verify, epsilon=0.5, f=f))(keys, tokens, q, p)
    assert np.all(np.asarray(res.acceptance_probs) >= np.asarray(token.acceptance_probs))
    assert float(res.acceptance_probs.sum()) > 1.05 * float(token.acceptance_probs.sum())
    assert np.all(np.isfinite(np.asarray(res.acceptance_probs)))


# --- the jitted rule against exact enumeration -----------------------------------------------------------------

def _outcome_counts(draft, tau, y):
  counts = {}
  for d, t, last in zip(draft, tau, y):
    key = tuple(int(v) for v in d[:t]) + (int(last),)
    counts[key] = counts.get(key, 0) + 1
  return counts


@pytest.mark.parametrize("f,epsilon", [("div", 0.5), ("div2", 0.7), ("pow", 0.3)])
def test_single_block_law_matches_enumeration(f, epsilon):
  """Law of (X_1..X_τ, Y) and of τ from the jitted rule = exact enumeration (100k seeded samples, χ²); the same
  samples are far from the token rule's (lossless) law."""
  make, context, gamma = PAIR
  drafter, target = make()
  n = 100_000
  keys = jax.random.split(jax.random.key(2024), n)
  run = jax.jit(functools.partial(ref.verify_blocks_tabular, gamma=gamma,
                                  verifier=verify.LenientVerifier(epsilon=epsilon, f=f)))
  draft, res = run(keys, ref.TabularTables.from_lm(drafter), ref.TabularTables.from_lm(target),
                   jnp.asarray(context, jnp.int32))
  draft, tau, y = np.asarray(draft), np.asarray(res.num_accepted), np.asarray(res.next_token)
  counts = _outcome_counts(draft, tau, y)
  law = theory.exact_outcome_law("lenient", drafter, target, context, gamma, epsilon=epsilon, f=f)
  outcome = theory.chi2_gof(counts, law)
  tau_res = theory.chi2_gof(np.bincount(tau, minlength=gamma + 1),
                            theory.exact_tau_law("lenient", drafter, target, context, gamma, epsilon=epsilon, f=f))
  biased = theory.chi2_gof(counts, theory.exact_outcome_law("token", drafter, target, context, gamma))
  print(f"lenient {f} ε={epsilon}: outcome χ² p = {outcome.p_value:.4g} (dof {outcome.dof}), τ χ² p = "
        f"{tau_res.p_value:.4g}, against the token law p = {biased.p_value:.3g}")
  assert outcome.p_value > PASS_P and tau_res.p_value > PASS_P
  assert biased.p_value < BIAS_P


# --- exact error and gain as ε decreases -----------------------------------------------------------------------

def test_exact_laws_at_epsilon_one_are_the_token_laws():
  make, context, gamma = PAIR
  drafter, target = make()
  token = theory.exact_outcome_law("token", drafter, target, context, gamma)
  for f in FS:
    assert theory.exact_outcome_law("lenient", drafter, target, context, gamma, epsilon=1.0, f=f) == token


def test_one_step_tv_and_expected_accepted_grow_as_epsilon_decreases():
  """Exact, on a fixed tabular pair (V = 4, γ = 3): the first emitted token's TV from the target is 0 at ε = 1 and
  grows as ε decreases (bounded by TV(p, q), reached when every draft is accepted); E[τ] grows too."""
  make, context, gamma = TV_PAIR
  drafter, target = make()
  p_V, q_V = target.next_probs(context), drafter.next_probs(context)
  tv_pq = 0.5 * float(np.abs(p_V - q_V).sum())
  e_token = theory.expected_accepted("token", drafter, target, context, gamma)
  print(f"\nTV(p, q) = {tv_pq:.4f}; token E[τ] = {e_token:.4f}")
  for f in FS:
    tvs = [exact.one_step_tv("lenient", drafter, target, context, gamma, epsilon=e, f=f) for e in EPSILONS]
    ets = [theory.expected_accepted("lenient", drafter, target, context, gamma, epsilon=e, f=f) for e in EPSILONS]
    print(f"lenient {f:4s}: " + ", ".join(f"ε={e}: TV {tv:.4f} E[τ] {et:.4f}" for e, tv, et in zip(EPSILONS, tvs, ets)))
    assert tvs[0] == pytest.approx(0.0, abs=1e-12)
    assert ets[0] == pytest.approx(e_token, rel=1e-12)
    assert all(b > a + 1e-3 for a, b in zip(tvs, tvs[1:]))  # TV(ε = 0.8) > 0.1 and growing as ε decreases
    assert all(tv <= tv_pq + 1e-12 for tv in tvs)
    assert all(b > a + 1e-3 for a, b in zip(ets, ets[1:]))
  # gamma does not change the first token's law; n = 2 tokens (one iteration, then the target) is lossy too
  assert exact.one_step_tv("lenient", drafter, target, context, 1, epsilon=0.4) == pytest.approx(
      exact.one_step_tv("lenient", drafter, target, context, gamma, epsilon=0.4), abs=1e-14)
  assert exact.one_step_tv("lenient", drafter, target, context, gamma, n=2, epsilon=0.4) > 0.0
  for rule in ("token", "block", "exact_match"):
    assert exact.one_step_tv(rule, drafter, target, context, gamma, n=2) == pytest.approx(0.0, abs=1e-12)


# --- errors ----------------------------------------------------------------------------------------------------

def test_bad_settings_are_errors():
  p = jnp.tile(jnp.asarray(P3, jnp.float32), (2, 1))
  q = jnp.asarray(Q3, jnp.float32)[None]
  key, tokens = jax.random.key(0), jnp.array([2])
  for epsilon in (0.0, -0.5, 1.5, float("nan"), True):
    with pytest.raises(ValueError, match="epsilon must be"):
      verify.lenient_verify(key, tokens, q, p, epsilon=epsilon)
    with pytest.raises(ValueError, match="epsilon must be"):
      verify.LenientVerifier(epsilon=epsilon)
  with pytest.raises(ValueError, match="unknown lenience function f='sqrt'; known: div, div2, pow"):
    jax.jit(functools.partial(verify.lenient_verify, epsilon=0.5, f="sqrt"))(key, tokens, q, p)
  with pytest.raises(ValueError, match="unknown lenience function"):
    verify.get_verifier("lenient", f="sqrt")
  with pytest.raises(ValueError, match="concrete"):
    jax.jit(lambda e: verify.lenient_verify(key, tokens, q, p, epsilon=e))(0.5)
  drafter, target = theory.TabularLM.context_free(Q3), theory.TabularLM.context_free(P3)
  with pytest.raises(ValueError, match="epsilon must be in"):
    theory.exact_outcome_law("lenient", drafter, target, (), 2, epsilon=0.0)
  with pytest.raises(ValueError, match="known: div, div2, pow"):
    theory.expected_accepted("lenient", drafter, target, (), 2, f="p2")
  with pytest.raises(ValueError, match="takes no epsilon"):
    theory.exact_tau_law("token", drafter, target, (), 2, epsilon=0.5)


# --- registry --------------------------------------------------------------------------------------------------

def test_registry_entry():
  assert "lenient" in verify.VERIFIERS
  v = verify.get_verifier("lenient")
  assert isinstance(v, verify.LenientVerifier)
  assert v.lossless is False and v.needs_draft_probs and v.structure == verify.CHAIN
  assert (v.epsilon, v.f) == (0.5, "div")
  assert verify.get_verifier("lenient", epsilon=0.25, f="pow") == verify.LenientVerifier(epsilon=0.25, f="pow")
  assert not v.lossless_under(sampling.Sampler(1.0))
  assert not v.lossless_under(sampling.Sampler(0.7, top_k=5))
  assert v.lossless_under(sampling.Sampler(0.0))  # a one-hot target: the greedy rule's verdicts
  assert verify.LenientVerifier(epsilon=1.0, f="div2").lossless_under(sampling.Sampler(1.0))
  assert hash(v) == hash(verify.get_verifier("lenient"))  # static under jit
  with pytest.warns(UserWarning, match="lossy rule"):
    assert verify.warn_if_inexact(verify.LenientVerifier(epsilon=0.123), sampling.Sampler(0.8765))
  assert methods.parse_method("lenient") == ("lenient", "model")
  # the numpy theory mirrors the rule's constants
  assert exact.LENIENT_FUNCTIONS == verify.LENIENT_FUNCTIONS
  assert exact.LENIENT_DEFAULT_EPSILON == verify.LenientVerifier().epsilon
  assert verify.VERIFIERS["lenient"].theory_law == "lenient" and "lenient" in theory.LAWS
