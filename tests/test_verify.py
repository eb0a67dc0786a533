"""Verification rules: exact tables, invariances, equality cases, numerics and input errors.

The exact tables run each rule jitted and not (``chex.variants``): the same numbers both ways. The numerics and range
tests run every registered single-block (chain) rule, jitted and not, and the input-error tests every one: a newly
registered rule is covered without an edit. Laws against enumeration live in
test_laws.py (they need blockspec_jax.theory).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import verify
from blockspec_jax.eval.bench_verify import make_inputs

P = jnp.array([1 / 3, 2 / 3])
Q = jnp.array([2 / 3, 1 / 3])
#: Every registered single-block rule at its default settings (a Verifier: ``v(key, tokens, q, p)``).
RULES = {name: verify.get_verifier(name) for name, cls in verify.VERIFIERS.items()
         if cls.structure == verify.CHAIN and not cls.skips_target}


def toy_block(tokens):
  tokens = jnp.asarray(tokens, jnp.int32)
  g = tokens.shape[0]
  return tokens, jnp.tile(Q, (g, 1)), jnp.tile(P, (g + 1, 1))


class ExactTableTest(chex.TestCase):
  """Hand-made p, q and coins with known τ (and Y where it is determined)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_rule_table(self):
    tokens, q, p = toy_block([0, 1])  # X1 = a: accept prob 1/2; X2 = b: accept prob 1
    key = jax.random.key(0)
    rule = self.variant(verify.token_verify)
    self.assertEqual(int(rule(key, tokens, q, p, jnp.array([0.4, 0.9])).num_accepted), 2)
    res = rule(key, tokens, q, p, jnp.array([0.6, 0.0]))
    self.assertEqual(int(res.num_accepted), 0)
    # residual at row 0 is max(p - q, 0) = (0, 1/3): the correction must be b
    self.assertEqual(int(res.next_token), 1)
    np.testing.assert_allclose(res.acceptance_probs, [0.5, 0.5], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_block_rule_table(self):
    tokens, q, p = toy_block([0, 0])  # w1 = 1/2, w2 = 1/4
    key = jax.random.key(0)
    rule = self.variant(verify.block_verify)
    # Z_1 = Σ max(w1 p - q, 0) = max(1/6 - 2/3, 0) + max(1/3 - 1/3, 0) = 0 -> h_1 = 0; h_2 = w_2 = 1/4
    np.testing.assert_allclose(
        self.variant(verify.block_acceptance_thresholds)(jnp.array([0.5, 0.25]), q, p), [0.0, 0.25], atol=1e-7)
    self.assertEqual(int(rule(key, tokens, q, p, jnp.array([0.0, 0.2])).num_accepted), 2)
    self.assertEqual(int(rule(key, tokens, q, p, jnp.array([0.0, 0.3])).num_accepted), 0)
    # (a, b): w1 = 1/2, w2 = min(1, 1/2 * 2) = 1, h_2 = 1: always accepted, even after a failed first coin
    tokens_ab, _, _ = toy_block([0, 1])
    res = rule(key, tokens_ab, q, p, jnp.array([0.99, 0.999]))
    self.assertEqual(int(res.num_accepted), 2)
    np.testing.assert_allclose(res.acceptance_probs, [0.5, 1.0], rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_block_scans_past_a_failed_coin(self):
    # γ = 3, V = 3: the coin at position 1 fails, position 2 succeeds -> τ = 2 (token verification would stop at 0).
    q = jnp.array([[0.5, 0.25, 0.25], [0.2, 0.4, 0.4], [1 / 3, 1 / 3, 1 / 3]])
    p = jnp.array([[0.25, 0.5, 0.25], [0.6, 0.2, 0.2], [0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])
    tokens = jnp.array([0, 0, 2])
    w = np.array([0.5, 1.0, 0.75])  # 0.25/0.5; min(1, 0.5*0.6/0.2); 1*0.25/(1/3)
    res = self.variant(verify.block_verify)(jax.random.key(0), tokens, q, p, jnp.array([0.99, 0.5, 0.9]))
    np.testing.assert_allclose(res.acceptance_probs, w, rtol=1e-6)
    self.assertEqual(int(res.num_accepted), 2)
    tok = self.variant(verify.token_verify)(jax.random.key(0), tokens, q, p, jnp.array([0.99, 0.5, 0.9]))
    self.assertEqual(int(tok.num_accepted), 0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_greedy_table(self):
    p = jnp.array([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3], [0.0, 0.0, 1.0]])
    q = jnp.full((2, 3), 1 / 3)
    rule = self.variant(verify.greedy_verify)
    res = rule(None, jnp.array([1, 0]), q, p)
    self.assertEqual((int(res.num_accepted), int(res.next_token)), (2, 2))
    res = rule(None, jnp.array([1, 2]), q, p)
    self.assertEqual((int(res.num_accepted), int(res.next_token)), (1, 0))
    res = rule(None, jnp.array([0, 0]), q, p)
    self.assertEqual((int(res.num_accepted), int(res.next_token)), (0, 1))

  @chex.variants(with_jit=True, without_jit=True)
  def test_exact_match_with_one_hot_target(self):
    p = jnp.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    q = jnp.full((2, 3), 1 / 3)
    rule = self.variant(verify.exact_match_verify)
    res = rule(jax.random.key(3), jnp.array([1, 0]), q, p)
    self.assertEqual((int(res.num_accepted), int(res.next_token)), (2, 2))
    res = rule(jax.random.key(3), jnp.array([1, 1]), q, p)
    self.assertEqual((int(res.num_accepted), int(res.next_token)), (1, 0))

  @chex.variants(with_jit=True, without_jit=True)
  def test_w_near_one_keeps_precision(self):
    """h = Z / (Z + (1 − w)) with w = 1 − 2^-24 and Z = 2^-25 (all exact in f32) is exactly 1/3.

    Summing (Z + 1) − w instead would round 1 + 2^-25 to 1 and give 1/2.
    """
    w = jnp.array([1.0 - 2.0 ** -24, 1.0], jnp.float32)
    q = jnp.array([[0.5, 0.5], [0.5 - 2.0 ** -24, 0.5 + 2.0 ** -24]], jnp.float32)
    p = jnp.full((3, 2), 0.5, jnp.float32)
    h = self.variant(verify.block_acceptance_thresholds)(w, q, p)
    np.testing.assert_allclose(float(h[0]), 1 / 3, rtol=1e-6)


def _random_batch(seed, batch, gamma, vocab, mismatch=1.0):
  return make_inputs(jax.random.key(seed), batch, gamma, vocab, logit_scale=2.0, mismatch=mismatch)


@pytest.mark.parametrize("gamma,vocab,mismatch", [(1, 5, 1.0), (3, 4, 0.5), (6, 50, 1.0),
                                                    pytest.param(8, 1000, 2.0, marks=pytest.mark.slow)])
def test_lazy_block_equals_eager_block(gamma, vocab, mismatch):
  """The lazily evaluated coin scan gives exactly the literal algorithm's τ and Y for the same key."""
  tokens, q, p = _random_batch(gamma * 7 + vocab, 4096, gamma, vocab, mismatch)
  keys = verify.row_keys(jax.random.key(11), 4096)
  lazy = jax.jit(verify.block_verify_batch)(keys, tokens, q, p)
  eager = jax.jit(jax.vmap(verify.block_verify_eager))(keys, tokens, q, p)
  np.testing.assert_array_equal(lazy.num_accepted, eager.num_accepted)
  np.testing.assert_array_equal(lazy.next_token, eager.next_token)
  assert 0 < float(jnp.mean(lazy.num_accepted)) < gamma  # a non-degenerate mix of outcomes


def test_gamma_one_block_equals_token_same_key():
  tokens, q, p = _random_batch(1, 2048, 1, 7)
  keys = verify.row_keys(jax.random.key(5), 2048)
  a = verify.block_verify_batch(keys, tokens, q, p)
  b = verify.token_verify_batch(keys, tokens, q, p)
  np.testing.assert_array_equal(a.num_accepted, b.num_accepted)
  np.testing.assert_array_equal(a.next_token, b.next_token)


def test_greedy_target_block_equals_token_same_key():
  tokens, q, _ = _random_batch(2, 2048, 4, 3)
  p_onehot = jax.nn.one_hot(jax.random.randint(jax.random.key(9), (2048, 5), 0, 3), 3)
  keys = verify.row_keys(jax.random.key(5), 2048)
  a = verify.block_verify_batch(keys, tokens, q, p_onehot)
  b = verify.token_verify_batch(keys, tokens, q, p_onehot)
  np.testing.assert_array_equal(a.num_accepted, b.num_accepted)
  np.testing.assert_array_equal(a.next_token, b.next_token)
  assert 0 < int(a.num_accepted.sum())


def test_block_dominates_token_pathwise():
  """On every draft, P(τ ≥ i | X^i) under block (w_i) is ≥ the token rule's Π_j min(1, p_j/q_j)."""
  tokens, q, p = _random_batch(3, 4096, 8, 20, 1.5)
  keys = verify.row_keys(jax.random.key(5), 4096)
  a = verify.block_verify_batch(keys, tokens, q, p)
  b = verify.token_verify_batch(keys, tokens, q, p)
  assert np.all(np.asarray(a.acceptance_probs) >= np.asarray(b.acceptance_probs) - 1e-6)
  assert float(a.acceptance_probs.sum()) > 1.02 * float(b.acceptance_probs.sum())


class EveryChainRuleTest(chex.TestCase):
  """Every registered single-block rule, jitted and not: finite, in range, typed and shaped as the contract says."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_no_nan_with_tiny_and_zero_q(self):
    q = jnp.array([[1e-45, 1.0 - 1e-45, 0.0], [1e-30, 0.5, 0.5 - 1e-30]])
    p = jnp.array([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    for name, rule in RULES.items():
      run = self.variant(rule)
      for tokens in ([0, 0], [2, 0], [1, 1]):
        res = run(jax.random.key(0), jnp.array(tokens), q, p)
        chex.assert_tree_all_finite(res.acceptance_probs)
        assert 0 <= int(res.num_accepted) <= 2 and 0 <= int(res.next_token) < 3, (name, tokens)

  @chex.variants(with_jit=True, without_jit=True)
  def test_outputs_in_range_and_dtypes(self):
    tokens, q, p = _random_batch(4, 64, 4, 11)
    for name, rule in RULES.items():
      res = self.variant(jax.vmap(rule))(verify.row_keys(jax.random.key(0), 64), tokens, q, p)
      chex.assert_type([res.num_accepted, res.next_token], jnp.int32)
      chex.assert_shape([res.num_accepted, res.next_token], (64,))
      chex.assert_shape(res.acceptance_probs, (64, 4))
      assert np.all((np.asarray(res.num_accepted) >= 0) & (np.asarray(res.num_accepted) <= 4)), name
      assert np.all((np.asarray(res.next_token) >= 0) & (np.asarray(res.next_token) < 11)), name
      probs = np.asarray(res.acceptance_probs)
      assert np.all((probs >= 0) & (probs <= 1)), name


def test_same_key_same_output_and_row_independence():
  tokens, q, p = _random_batch(5, 16, 4, 9)
  keys = verify.row_keys(jax.random.key(1), 16)
  for v in RULES.values():
    full = v.batch(keys, tokens, q, p)
    chex.assert_trees_all_equal(full, v.batch(keys, tokens, q, p))
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[3:7], full), v.batch(keys[3:7], tokens[3:7], q[3:7], p[3:7]))


class BadInputTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.tokens, self.q, self.p = toy_block([0, 1])
    self.key = jax.random.key(0)

  def test_gamma_below_one(self):
    for rule in RULES.values():
      with self.assertRaisesRegex(ValueError, "gamma must be >= 1"):
        rule(self.key, jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2)), jnp.zeros((1, 2)))

  def test_vocab_mismatch(self):
    for rule in RULES.values():
      with self.assertRaisesRegex(ValueError, "vocabulary mismatch"):
        jax.jit(rule)(self.key, self.tokens, jnp.full((2, 3), 1 / 3), self.p)

  def test_wrong_ranks_and_rows(self):
    with self.assertRaisesRegex(ValueError, "draft_tokens must have shape"):
      verify.block_verify(self.key, self.tokens[None], self.q, self.p)
    with self.assertRaisesRegex(ValueError, "draft_probs must have rank 2"):
      verify.block_verify(self.key, self.tokens, self.q[None], self.p)
    with self.assertRaisesRegex(ValueError, "target_probs must have gamma \\+ 1"):
      verify.block_verify(self.key, self.tokens, self.q, self.p[:2])
    with self.assertRaisesRegex(ValueError, "draft_probs must have gamma = 2 rows"):
      verify.token_verify(self.key, self.tokens, self.q[:1], self.p)
    with self.assertRaisesRegex(ValueError, "integer token ids"):
      verify.token_verify(self.key, self.tokens.astype(jnp.float32), self.q, self.p)
    with self.assertRaisesRegex(ValueError, "coins must have shape"):
      verify.block_verify(self.key, self.tokens, self.q, self.p, jnp.zeros(3))

  def test_batched_shapes(self):
    v = verify.BlockVerifier()
    keys = verify.row_keys(self.key, 2)
    with self.assertRaisesRegex(ValueError, "rank 2"):
      v.batch(keys, self.tokens, self.q, self.p)
    with self.assertRaisesRegex(ValueError, "batch sizes differ"):
      v.batch(keys, jnp.stack([self.tokens] * 3), jnp.stack([self.q] * 3), jnp.stack([self.p] * 3))

  def test_unknown_verifier(self):
    with self.assertRaisesRegex(ValueError, "unknown verifier 'blok'.*block, exact_match, greedy, lenient, mtad, "
                                            "point_mass, rrs, rrs_wor, spectr, sprinter, token, traversal"):
      verify.get_verifier("blok")

  def test_distribution_report(self):
    probs = np.array([[0.5, 0.5], [0.7, 0.7], [-0.1, 1.1], [np.nan, 1.0], [0.25, 0.75]], np.float32)
    flags = np.asarray(jax.jit(verify.distribution_errors)(probs))
    np.testing.assert_array_equal(flags, [0, verify.BAD_SUM, verify.NEGATIVE, verify.NOT_FINITE, 0])
    with self.assertRaisesRegex(ValueError, r"target_probs: 3 of 5 rows .*row \(1,\): does not sum to 1.*"
                                            r"row \(2,\): negative entry.*row \(3,\): NaN or inf"):
      verify.validate_distributions("target_probs", probs)

  def test_validate_block(self):
    verify.validate_block(self.tokens, self.q, self.p)  # valid: no error
    with self.assertRaisesRegex(ValueError, "out of range"):
      verify.validate_block(jnp.array([0, 2]), self.q, self.p)
    with self.assertRaisesRegex(ValueError, "probability 0 under draft_probs"):
      verify.validate_block(self.tokens, jnp.array([[0.0, 1.0], [0.5, 0.5]]), self.p)
    with self.assertRaisesRegex(ValueError, "draft_probs: 1 of 2 rows"):
      verify.validate_block(self.tokens, jnp.array([[0.9, 0.9], [0.5, 0.5]]), self.p)
