"""Sampling transforms: exact tables, T = 0, and the law of `sample` (χ², fixed seeds)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from blockspec_jax import sampling


class TransformTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_temperature_one_is_softmax(self):
    logits = jnp.array([[0.0, 1.0, 2.0, -1.0]])
    out = self.variant(lambda x: sampling.probs_from_logits(x))(logits)
    np.testing.assert_allclose(out, jax.nn.softmax(logits), rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_temperature_scales(self):
    logits = jnp.array([0.0, 1.0, 2.0])
    out = self.variant(lambda x: sampling.probs_from_logits(x, temperature=0.5))(logits)
    np.testing.assert_allclose(out, jax.nn.softmax(2 * logits), rtol=1e-6)

  def test_temperature_zero_is_one_hot_argmax_first_on_ties(self):
    logits = jnp.array([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    out = sampling.probs_from_logits(logits, temperature=0.0, top_k=2, top_p=0.5)
    np.testing.assert_array_equal(out, [[0, 1, 0, 0], [1, 0, 0, 0]])

  def test_top_k_exact_table_keeps_ties(self):
    logits = jnp.log(jnp.array([0.1, 0.4, 0.2, 0.2, 0.1]))
    out = np.asarray(sampling.probs_from_logits(logits, top_k=2))
    # 2nd largest value is 0.2, tied: both 0.2 entries are kept.
    np.testing.assert_allclose(out, [0, 0.5, 0.25, 0.25, 0], rtol=1e-6)
    out1 = np.asarray(sampling.probs_from_logits(logits, top_k=1))
    np.testing.assert_allclose(out1, [0, 1, 0, 0, 0])

  def test_top_p_exact_table(self):
    probs = jnp.array([0.05, 0.5, 0.3, 0.15])
    logits = jnp.log(probs)
    # sorted: .5 .3 .15 .05; mass before: 0 .5 .8 .95 -> top_p=0.8 keeps .5 and .3 only
    out = np.asarray(sampling.probs_from_logits(logits, top_p=0.8))
    np.testing.assert_allclose(out, [0, 0.625, 0.375, 0], rtol=1e-6)
    out2 = np.asarray(sampling.probs_from_logits(logits, top_p=0.81))
    np.testing.assert_allclose(out2, [0, 0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95], rtol=1e-6)
    # the top token is always kept
    np.testing.assert_allclose(sampling.probs_from_logits(logits, top_p=0.01), [0, 1, 0, 0])

  def test_combination_order_temperature_topk_topp(self):
    logits = jnp.array([2.0, 1.0, 0.0, -1.0])
    out = np.asarray(sampling.probs_from_logits(logits, temperature=2.0, top_k=3, top_p=0.7))
    scaled = np.exp(np.array([1.0, 0.5, 0.0]))
    p3 = scaled / scaled.sum()  # after top-k=3 at T=2
    keep = np.cumsum(p3) - p3 < 0.7
    expected = np.where(keep, p3, 0)
    expected = np.concatenate([expected / expected.sum(), [0.0]])
    np.testing.assert_allclose(out, expected, rtol=1e-6)

  def test_masked_logits_get_zero(self):
    out = sampling.probs_from_logits(jnp.array([0.0, -jnp.inf, 0.0]))
    np.testing.assert_allclose(out, [0.5, 0.0, 0.5])

  @pytest.mark.filterwarnings("ignore")
  def test_bad_settings_raise(self):
    with self.assertRaisesRegex(ValueError, "temperature"):
      sampling.Sampler(temperature=-1.0)
    with self.assertRaisesRegex(ValueError, "top_k"):
      sampling.Sampler(top_k=-2)
    with self.assertRaisesRegex(ValueError, "top_p"):
      sampling.Sampler(top_p=0.0)

  def test_sampler_is_hashable_static(self):
    s = sampling.Sampler(0.7, 5, 0.9)
    f = jax.jit(lambda x, s: s.probs(x), static_argnums=1)
    np.testing.assert_allclose(f(jnp.arange(8.0), s),
                               sampling.probs_from_logits(jnp.arange(8.0), temperature=0.7, top_k=5, top_p=0.9))


@pytest.mark.parametrize("vocab", [50, 1000, 151936])
def test_filters_equal_sorting_the_whole_row(vocab):
  """Top-k and top-p from the largest candidates (``sampling._top_p_keep``) keep exactly the tokens sorting every
  row keeps, with the same probabilities up to the float rounding of the normalising sum (XLA sums a row in an order
  that depends on the program around it), on rows the candidates decide (peaked ones, top-k) and on rows they do not (flat ones: the sort), with
  ties (logits rounded to bfloat16, a row of equal logits) and leading batch dimensions."""
  rng = np.random.default_rng(vocab)
  rows = [rng.normal(size=vocab) * scale for scale in (0.3, 1.0, 3.0, 8.0)]
  rows.append(np.asarray(jnp.asarray(rng.normal(size=vocab) * 4.0, jnp.bfloat16), np.float32))  # many ties
  rows.append(np.zeros(vocab))  # all equal
  tied = rng.normal(size=vocab) * 2.0
  tied[rng.choice(vocab, 30, replace=False)] = tied.max() + 1.0  # 30 tokens tied at the top
  rows.append(tied)
  logits_2xRxV = jnp.asarray(np.stack([np.stack(rows), np.stack(rows[::-1])]), jnp.float32)
  for temperature, top_k, top_p in [(1.0, 0, 0.9), (1.0, 10, 0.9), (0.7, 5, 0.5), (1.0, 100, 0.99), (1.3, 0, 0.2),
                                    (1.0, 40, 1.0), (1.0, 0, 0.999)]:
    want = np.asarray(sampling.probs_by_sorting(logits_2xRxV, temperature=temperature, top_k=top_k,
                                                top_p=top_p))
    eager = sampling.probs_from_logits(logits_2xRxV, temperature=temperature, top_k=top_k, top_p=top_p)
    jitted = jax.jit(lambda x: sampling.probs_from_logits(x, temperature=temperature, top_k=top_k, top_p=top_p))
    for got in (np.asarray(eager), np.asarray(jitted(logits_2xRxV))):
      np.testing.assert_array_equal(got > 0, want > 0, err_msg=f"{(temperature, top_k, top_p)}")
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"{(temperature, top_k, top_p)}")


def _chi2_pvalue(counts, probs):
  n = counts.sum()
  expected = probs / probs.sum() * n
  assert np.all(counts[probs == 0] == 0), "sampled a token of probability 0"
  keep = expected > 0
  return stats.chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize("vocab", [2, 7, 300, 20000])
def test_sample_law_chi2(vocab):
  """Seeded: 200k draws; zero-probability tokens never appear; χ² p-value > 1e-3 (deterministic given the seed)."""
  rng = np.random.default_rng(vocab)
  probs = rng.dirichlet(np.full(vocab, 0.3)).astype(np.float32)
  if vocab > 2:
    probs[1] = 0.0
  if vocab > 300:  # concentrate so that expected counts are large enough for χ²
    probs[:] = 0.0
    probs[rng.choice(vocab, 50, replace=False)] = rng.dirichlet(np.ones(50))
  probs = probs / probs.sum()
  n = 200_000
  keys = jax.random.split(jax.random.key(vocab), n)
  draws = np.asarray(jax.jit(jax.vmap(sampling.sample, in_axes=(0, None)))(keys, jnp.asarray(probs)))
  counts = np.bincount(draws, minlength=vocab)
  assert counts.shape == (vocab,)
  assert _chi2_pvalue(counts, probs.astype(np.float64)) > 1e-3


def test_sample_unnormalised_weights_and_edges():
  w = jnp.array([0.0, 0.0, 3.0, 0.0, 1.0, 0.0])
  keys = jax.random.split(jax.random.key(0), 4000)
  draws = np.asarray(jax.vmap(sampling.sample_from_weights, in_axes=(0, None))(keys, w))
  assert set(np.unique(draws)) == {2, 4}
  assert abs((draws == 2).mean() - 0.75) < 0.03
  # one-hot rows always give their index, including the last index of a padded tree
  for v, idx in [(5, 4), (130, 129), (20000, 16384), (20000, 0)]:
    row = jnp.zeros((v,)).at[idx].set(1.0)
    got = jax.vmap(sampling.sample_from_weights, in_axes=(0, None))(jax.random.split(jax.random.key(1), 64), row)
    assert np.all(np.asarray(got) == idx)
