"""MJSD / MTAD (a LOSSY chain rule with a beam drafter): joint verification on hand tables and against its numpy
twin, settings errors, the beam drafter (W = 1 is ancestral sampling / greedy drafting, beams beat greedy, rows and
caches are the drafter's, rows independent), the exact theory of :mod:`blockspec_jax.theory.lossy` on hand cases,
and the jitted loop's law against that theory (χ², fixed seeds) on tiny random models wrapped as tabular models.
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import drafters, theory, verify
from blockspec_jax import contracts
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import BeamDrafter, ModelDrafter
from blockspec_jax.models import decoder as dec
from blockspec_jax.theory import lossy
from blockspec_jax.verify import rules

from helpers import GREEDY, T1, model_pair, run_ar, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore:verifier 'mtad'")  # the lossy-rule warning at T = 1

PASS_P = 1e-3
INF = float("inf")

# --- hand tables: γ = 3, V = 3, draft (0, 1, 2), log τ = log 0.5 = −0.693 --------------------------------------
# token 1: p 0.2 / q 0.8 → L_1 = log 0.25 = −1.386 (fails); token 2: p 0.9 / q 0.3 → L_2 = −0.288 (passes);
# token 3: p 0.05 / q 0.5 → L_3 = −2.590 (fails). The scan must not stop at L_1: τ_acc = 2, Y ~ p_2.
DRAFT = np.array([0, 1, 2])
P_ROWS = np.array([[0.2, 0.4, 0.4], [0.05, 0.9, 0.05], [0.6, 0.35, 0.05], [0.1, 0.2, 0.7]])
Q_ROWS = np.array([[0.8, 0.1, 0.1], [0.35, 0.3, 0.35], [0.25, 0.25, 0.5]])
# token 2 has p = 0 (and token 3 a huge ratio): nothing beyond token 1 is ever accepted.
P_ZERO = np.array([[0.2, 0.4, 0.4], [0.5, 0.0, 0.5], [0.05, 0.05, 0.9], [0.1, 0.2, 0.7]])
Q_ZERO = np.array([[0.8, 0.1, 0.1], [0.35, 0.3, 0.35], [0.495, 0.495, 0.01]])
# token 1 has q = 0 < p: L = +inf for every prefix (no p = 0 token follows).
Q_BOOST = np.array([[0.0, 0.5, 0.5], [0.35, 0.3, 0.35], [0.25, 0.25, 0.5]])


def _joint(tau):
  return functools.partial(rules.joint_verify, tau=tau)


class JointTableTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_scan_passes_a_failed_prefix(self):
    rule = self.variant(_joint(0.5))
    res = rule(jax.random.key(0), DRAFT, Q_ROWS, P_ROWS)
    self.assertEqual(int(res.num_accepted), 2)
    np.testing.assert_array_equal(res.acceptance_probs, [1.0, 1.0, 0.0])
    np.testing.assert_allclose(rules.joint_log_ratios(jnp.asarray([0.2, 0.9, 0.05]), jnp.asarray([0.8, 0.3, 0.5])),
                               np.cumsum(np.log([0.25, 3.0, 0.1])), rtol=1e-6)
    for tau, expected in ((1.0, 0), (0.3, 2), (0.2, 2), (0.07, 3), (1e-30, 3), (INF, 0)):  # eager: one trace
      self.assertEqual(int(_joint(tau)(jax.random.key(1), DRAFT, Q_ROWS, P_ROWS).num_accepted), expected,
                       msg=f"tau = {tau}")

  @chex.variants(with_jit=True, without_jit=True)
  def test_zero_target_mass_ends_every_longer_prefix(self):
    for tau, expected in ((0.5, 0), (1e-30, 1), (1e-300, 1)):
      res = self.variant(_joint(tau))(jax.random.key(2), DRAFT, Q_ZERO, P_ZERO)
      self.assertEqual(int(res.num_accepted), expected, msg=f"tau = {tau}")
    L = rules.joint_log_ratios(jnp.asarray([0.2, 0.0, 0.9]), jnp.asarray([0.8, 0.3, 0.01]))
    np.testing.assert_array_equal(np.isneginf(L), [False, True, True])

  @chex.variants(with_jit=True, without_jit=True)
  def test_infinite_tau_accepts_nothing_and_q_zero_boosts(self):
    for tau, expected in ((INF, 0), (1e30, 3), (0.5, 3)):
      res = self.variant(_joint(tau))(jax.random.key(3), DRAFT, Q_BOOST, P_ROWS)
      self.assertEqual(int(res.num_accepted), expected, msg=f"tau = {tau}")
    L = rules.joint_log_ratios(jnp.asarray([0.2, 0.9, 0.05]), jnp.asarray([0.0, 0.3, 0.5]))
    np.testing.assert_array_equal(L, [INF] * 3)


@pytest.mark.parametrize("q_rows,p_rows,tau,row", [(Q_ROWS, P_ROWS, 0.5, 2), (Q_ROWS, P_ROWS, 1e-30, 3),
                                                   (Q_ZERO, P_ZERO, 1e-30, 1), (Q_BOOST, P_ROWS, INF, 0)])
def test_next_token_is_a_plain_sample_of_the_accepted_row(q_rows, p_rows, tau, row):
  """20k keys: Y ~ p_{τ_acc} (χ², fixed seed); tokens of probability 0 never appear (p_1 = (0.5, 0, 0.5))."""
  n = 20_000
  keys = jax.random.split(jax.random.key(11), n)
  res = jax.vmap(_joint(tau), in_axes=(0, None, None, None))(keys, DRAFT, q_rows, p_rows)
  np.testing.assert_array_equal(res.num_accepted, row)
  counts = np.bincount(np.asarray(res.next_token), minlength=3)
  assert theory.chi2_gof(counts, p_rows[row]).p_value > PASS_P


def test_numpy_twin_agrees_with_the_jax_rule():
  """theory.lossy's joint_log_ratios / joint_accepted equal the JAX rule's on 4096 random blocks with zeros in p
  and q (τ_acc compared where no L_i is within 1e-4 of log τ: float32 vs float64)."""
  rng = np.random.default_rng(5)
  batch, gamma, vocab = 4096, 4, 5
  p = rng.dirichlet(np.full(vocab, 0.7), size=(batch, gamma + 1))
  q = rng.dirichlet(np.full(vocab, 0.7), size=(batch, gamma))
  p[rng.random(p.shape) < 0.08] = 0.0
  q[rng.random(q.shape) < 0.08] = 0.0
  p /= p.sum(-1, keepdims=True)
  q = np.where(q.sum(-1, keepdims=True) > 0, q, 1.0 / vocab)
  q /= q.sum(-1, keepdims=True)
  draft = rng.integers(0, vocab, size=(batch, gamma))
  rows = np.arange(batch)[:, None], np.arange(gamma)[None, :]
  p_tok, q_tok = p[:, :-1][rows + (draft,)], q[rows + (draft,)]
  L_jax = np.asarray(jax.vmap(rules.joint_log_ratios)(jnp.asarray(p_tok, jnp.float32),
                                                       jnp.asarray(q_tok, jnp.float32)))
  L_np = np.stack([lossy.joint_log_ratios(a, b) for a, b in zip(p_tok, q_tok)])
  np.testing.assert_array_equal(np.isposinf(L_jax), np.isposinf(L_np))
  np.testing.assert_array_equal(np.isneginf(L_jax), np.isneginf(L_np))
  assert np.isposinf(L_np).any() and np.isneginf(L_np).any() and np.isfinite(L_np).any()
  finite = np.isfinite(L_np)
  np.testing.assert_allclose(L_jax[finite], L_np[finite], rtol=1e-5, atol=1e-5)
  keys = verify.row_keys(jax.random.key(0), batch)
  for tau in (0.5, 0.05, 2.0, INF):
    res = jax.vmap(_joint(tau))(keys, jnp.asarray(draft), jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32))
    expected = np.array([lossy.joint_accepted(a, b, tau) for a, b in zip(p_tok, q_tok)])
    clear = np.all(~np.isfinite(L_np) | (np.abs(np.where(np.isfinite(L_np), L_np, 0.0) - np.log(tau)) > 1e-4), axis=1)
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(np.asarray(res.num_accepted)[clear], expected[clear])
    assert 0 < expected.mean() < gamma or tau == INF


def test_settings_errors_name_tau():
  for bad in (0, 0.0, -1.0, float("nan"), -INF, True, False, "0.5", None):
    for make in (lambda t: verify.JointVerifier(tau=t), lambda t: verify.get_verifier("mtad", tau=t),
                 lossy.check_tau):
      with pytest.raises(ValueError, match="tau"):
        make(bad)
  v = verify.get_verifier("mtad", tau=0.3)
  assert isinstance(v, verify.JointVerifier) and v.tau == 0.3 and not v.lossless
  assert verify.get_verifier("mtad").tau == rules.JOINT_DEFAULT_TAU == 0.5
  assert not v.lossless_under(T1) and v.lossless_under(GREEDY)
  assert verify.JointVerifier(tau=INF).lossless_under(T1)
  assert verify.JointVerifier(tau=2).tau == 2.0  # ints are numbers


# --- the beam drafter ------------------------------------------------------------------------------------------
# One tiny pair for everything below (V = 6, one layer: the loop compiles fast). PROMPT ⊕ s for every suffix s of up
# to 2 tokens are the contexts the first 3 emitted tokens reach; their rows are fresh full forwards (decoder_table).

PROMPT, N_TOKENS, GAMMA, WIDTH, TAU, ROWS = (1, 4), 3, 2, 3, 0.5, 20_000
SUFFIXES = [s for length in range(N_TOKENS) for s in itertools.product(range(6), repeat=length)]
RAGGED6 = [[1, 2, 3, 4, 5, 0, 1], [2, 3], [4, 5, 0, 1], [3]]


def pair():
  return model_pair(vocab=6, seed=1, noise=1.0, layers=1)


@functools.partial(jax.jit, static_argnames="config")
def _last_logits(params, seqs_BxW, last_B, *, config):
  batch, width = seqs_BxW.shape
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  logits, _ = dec.Decoder(config).apply({"params": params}, seqs_BxW, positions, dec.init_cache(config, batch, width),
                                        dec.causal_mask(positions, width))
  return logits[jnp.arange(batch), last_B]


def decoder_table(config, params, prompt, depth):
  """The decoder's T = 1 conditionals after ``prompt`` as a TabularLM over continuations: the row of prefix ``s``
  (``len(s) ≤ depth``; rows by length, then lexicographic, as TabularLM orders them) is ``M(·|prompt ⊕ s)`` from one
  full forward of ``prompt ⊕ s`` (all prefixes in one right-padded batch: causal attention ignores the padding)."""
  seqs = [tuple(prompt) + s for length in range(depth + 1)
          for s in itertools.product(range(config.vocab_size), repeat=length)]
  seqs_BxW = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for i, seq in enumerate(seqs):
    seqs_BxW[i, :len(seq)] = seq
  logits = np.asarray(_last_logits(params, jnp.asarray(seqs_BxW), jnp.asarray([len(q) - 1 for q in seqs]),
                                   config=config), np.float64)
  probs = np.exp(logits - logits.max(1, keepdims=True))
  return theory.TabularLM(probs / probs.sum(1, keepdims=True), depth)


@functools.lru_cache(maxsize=None)
def tables():
  """``(drafter, target)`` tables after PROMPT, deep enough for every prefix the theory of 3 tokens reads."""
  config, target, drafter = pair()
  depth = N_TOKENS - 1 + GAMMA
  return decoder_table(config, drafter, PROMPT, depth), decoder_table(config, target, PROMPT, depth)


@functools.partial(jax.jit, static_argnames=("drafter", "max_len"))
def _prefill(params, tokens_BxP, prompt_len_B, *, drafter, max_len):
  return drafter.init_state(params, tokens_BxP, prompt_len_B, max_len)  # BeamDrafter's is ModelDrafter's


@functools.partial(jax.jit, static_argnames=("drafter", "gamma", "sampler"))
def _propose(params, state, tokens_BxS, length_B, key_B, *, drafter, gamma, sampler):
  return drafter.propose(params, state, tokens_BxS, length_B, key_B, gamma, sampler)


def propose(drafter, params, prompts, keys, gamma, sampler, cache_len=None):
  """One ``propose`` after a prefill of ``prompts`` (caches of ``cache_len`` slots): ``(state, Draft)``."""
  tokens_BxP, lens_B = spec.prepare_prompts(prompts)
  width = tokens_BxP.shape[1]
  cache_len = cache_len or width + gamma + 2
  tokens_BxS = jnp.pad(tokens_BxP, ((0, 0), (0, cache_len - width)))
  state = _prefill(params, tokens_BxP, lens_B, drafter=ModelDrafter(drafter.config), max_len=cache_len)
  return _propose(params, state, tokens_BxS, lens_B, keys, drafter=drafter, gamma=gamma, sampler=sampler)


def table_rows(table, suffix, chain):
  """f64 ``[γ, V]``: the table's rows along ``chain`` after ``suffix``."""
  return np.stack([table.next_probs(tuple(suffix) + tuple(int(t) for t in chain[:i])) for i in range(len(chain))])


def chain_log_q(draft):
  q_tok = np.take_along_axis(np.asarray(draft.q_BxNxV, np.float64), np.asarray(draft.tokens_BxN)[:, :, None], 2)
  return np.log(q_tok[:, :, 0]).sum(1)


def test_registry_validation_and_rule_pairing():
  config = tiny_config(vocab_size=6, num_layers=1)
  d = drafters.make("beam", config=config, vocab_size=6, width=2, sample=False)
  assert isinstance(d, BeamDrafter) and (d.width, d.sample, d.num_nodes(5)) == (2, False, 5)
  assert d.is_chain and d.sibling_sampling == contracts.SAMPLING_BEAM == "beam"
  assert drafters.DRAFTERS["beam"] is BeamDrafter and BeamDrafter(config).width == 4
  for bad in (0, 7, 1.5, True, "2", None):
    with pytest.raises(ValueError, match=r"width must be an integer in \[1, V = 6\]"):
      drafters.make("beam", config=config, width=bad)
  with pytest.raises(ValueError, match="sample must be a bool"):
    BeamDrafter(config, sample="yes")
  for rule in ("block", "token"):
    with pytest.raises(ValueError, match="mtad"):
      verify.get_verifier(rule).check_drafter("beam", BeamDrafter)
  for rule in ("mtad", "greedy", "exact_match"):
    verify.get_verifier(rule).check_drafter("beam", BeamDrafter)
    verify.get_verifier(rule).check_drafter("beam", d)


@pytest.mark.parametrize("width", [1, WIDTH])
def test_beam_sampling_law(width):
  """Beam sampling (sample=True), γ = 2, 20k seeded rows (χ²): W = 1 is ancestral sampling (the drafter's sequence
  law, ModelDrafter's chain law); W = 3 proposes the most likely of 3 sequences drawn without replacement
  (lossy.beam_sampling_law, Kool et al.), far from the sequence law. Every chain's rows are the drafter's along it."""
  config, _, params = pair()
  drafter_table, _ = tables()
  _, draft = propose(BeamDrafter(config, width=width, sample=True), params, [list(PROMPT)] * ROWS,
                     jax.random.split(jax.random.key(21), ROWS), GAMMA, T1)
  counts = {}
  for row in map(tuple, np.asarray(draft.tokens_BxN).tolist()):
    counts[row] = counts.get(row, 0) + 1
  sequence_law = theory.sequence_law(drafter_table, (), GAMMA)
  law = sequence_law if width == 1 else lossy.beam_sampling_law(drafter_table, (), GAMMA, width)
  res = theory.chi2_gof(counts, law)
  assert res.p_value > PASS_P, res
  if width > 1:
    assert theory.chi2_gof(counts, sequence_law).p_value < 1e-6
  chains, idx = np.unique(np.asarray(draft.tokens_BxN), axis=0, return_index=True)
  assert len(chains) > 10
  for chain, i in zip(chains, idx):
    np.testing.assert_allclose(draft.q_BxNxV[i], table_rows(drafter_table, (), chain), atol=2e-6)


def test_the_official_per_step_beam_sampler_has_its_own_law():
  """The official MTAD code's sampler (per_step=True), W = 3, γ = 2, 20k seeded rows (χ²): each step draws W
  (beam, token) pairs without replacement ∝ exp(cumulative log q) (lossy.per_step_beam_law), a law measurably apart
  from Kool's stochastic beam search (beam_sampling_law) and from the sequence law; rows are the drafter's."""
  config, _, params = pair()
  drafter_table, _ = tables()
  _, draft = propose(BeamDrafter(config, width=WIDTH, sample=True, per_step=True), params, [list(PROMPT)] * ROWS,
                     jax.random.split(jax.random.key(22), ROWS), GAMMA, T1)
  counts = {}
  for row in map(tuple, np.asarray(draft.tokens_BxN).tolist()):
    counts[row] = counts.get(row, 0) + 1
  law = lossy.per_step_beam_law(drafter_table, (), GAMMA, WIDTH)
  kool = lossy.beam_sampling_law(drafter_table, (), GAMMA, WIDTH)
  assert abs(sum(law.values()) - 1) < 1e-9
  assert theory.chi2_gof(counts, law).p_value > PASS_P
  assert theory.chi2_gof(counts, kool).p_value < 1e-6
  assert theory.chi2_gof(counts, theory.sequence_law(drafter_table, (), GAMMA)).p_value < 1e-6
  chains, idx = np.unique(np.asarray(draft.tokens_BxN), axis=0, return_index=True)
  for chain, i in zip(chains, idx):
    np.testing.assert_allclose(draft.q_BxNxV[i], table_rows(drafter_table, (), chain), atol=2e-6)
  with pytest.raises(ValueError, match="per_step must be a bool"):
    BeamDrafter(config, per_step="yes")


def test_deterministic_beams_greedy_and_t0():
  """On the 43 ragged contexts PROMPT ⊕ s (γ = 2): W = 1 deterministic is greedy drafting (every token the argmax
  of the drafter's row along the chain); W = 3 never has a lower cumulative log q than greedy, a strictly higher one
  somewhere, rows equal to fresh forwards, and is exactly lossy.beam_search's beam (ties as lax.top_k breaks
  them); at T = 0 (one-hot rows, log 0 everywhere else) both modes return the greedy chain without NaN or inf."""
  config, _, params = pair()
  drafter_table, _ = tables()
  prompts = [list(PROMPT + s) for s in SUFFIXES]
  keys = jax.random.split(jax.random.key(0), len(prompts))
  _, greedy = propose(BeamDrafter(config, width=1, sample=False), params, prompts, keys, GAMMA, T1)
  _, beam = propose(BeamDrafter(config, width=WIDTH, sample=False), params, prompts, keys, GAMMA, T1)
  for b, s in enumerate(SUFFIXES):
    np.testing.assert_array_equal(np.argmax(table_rows(drafter_table, s, greedy.tokens_BxN[b]), 1),
                                  greedy.tokens_BxN[b])
    np.testing.assert_allclose(beam.q_BxNxV[b], table_rows(drafter_table, s, beam.tokens_BxN[b]), atol=2e-6)
    tokens, log_q = lossy.beam_search(drafter_table, s, GAMMA, WIDTH)
    np.testing.assert_array_equal(beam.tokens_BxN[b], tokens)
    assert log_q == pytest.approx(chain_log_q(beam)[b], abs=1e-5)
  gain = chain_log_q(beam) - chain_log_q(greedy)
  assert gain.min() > -1e-5 and (gain > 1e-2).sum() >= 3, gain
  for sample in (False, True):
    _, t0 = propose(BeamDrafter(config, width=WIDTH, sample=sample), params, prompts, keys, GAMMA, GREEDY)
    np.testing.assert_array_equal(t0.tokens_BxN, greedy.tokens_BxN)
    np.testing.assert_array_equal(t0.q_BxNxV, jax.nn.one_hot(greedy.tokens_BxN, 6))


def test_rows_are_independent_and_the_state_is_the_best_beams_cache():
  """Beam sampling (W = 3, T = 1) on ragged rows: a row's draft does not depend on its batch neighbours; after any
  accepted prefix a ≤ γ of the chain plus one token, the next proposal from the returned state equals the proposal
  after a fresh prefill of the committed tokens (the state's positions < new_length − 2 are the chain's)."""
  config, _, params = pair()
  drafter, gamma, cache_len = BeamDrafter(config, width=WIDTH, sample=True), 3, 16
  keys = jax.random.split(jax.random.key(1), len(RAGGED6))
  state, draft = propose(drafter, params, RAGGED6, keys, gamma, T1, cache_len)
  neighbours = [RAGGED6[0], [5, 5, 5], [0], RAGGED6[3]]
  other_keys = keys.at[1].set(jax.random.key(77)).at[2].set(jax.random.key(78))
  _, other = propose(drafter, params, neighbours, other_keys, gamma, T1, cache_len)
  for b in (0, 3):
    np.testing.assert_array_equal(draft.tokens_BxN[b], other.tokens_BxN[b])
    np.testing.assert_allclose(draft.q_BxNxV[b], other.q_BxNxV[b], atol=1e-6)
  committed = [p + [int(t) for t in np.asarray(draft.tokens_BxN[b, :a])] + [b]
               for b, (p, a) in enumerate(zip(RAGGED6, [0, 2, 3, 1]))]
  tokens_BxC, lens_B = spec.prepare_prompts(committed)
  tokens_BxS = jnp.pad(tokens_BxC, ((0, 0), (0, cache_len - tokens_BxC.shape[1])))
  next_keys = jax.random.split(jax.random.key(2), len(RAGGED6))
  _, again = _propose(params, state, tokens_BxS, lens_B, next_keys, drafter=drafter, gamma=gamma, sampler=T1)
  _, fresh = propose(drafter, params, committed, next_keys, gamma, T1, cache_len)
  np.testing.assert_array_equal(again.tokens_BxN, fresh.tokens_BxN)
  np.testing.assert_allclose(again.q_BxNxV, fresh.q_BxNxV, atol=2e-6)


# --- exact theory on hand cases ---------------------------------------------------------------------------------

P3 = np.array([0.5, 0.3, 0.2])
Q3 = np.array([0.2, 0.2, 0.6])


def test_theory_by_hand():
  """Context-free V = 3, γ = 1, τ = 1/2: p/q = (2.5, 1.5, 1/3), so x = 0, 1 pass and x = 2 fails. First token:
  q·[pass] + q(2)·p = (0.5, 0.38, 0.12), TV = 0.08. The beam draft is argmax q = 2: rejected at τ = 1/2 (TV 0),
  always accepted at τ = 0.3 (the first token is 2: TV = 1 − 0.2)."""
  drafter, target = theory.TabularLM.context_free(Q3), theory.TabularLM.context_free(P3)
  block = lossy.mtad_block_law(drafter, target, (), 1, 0.5)
  expected = {(0,): 0.3, (0, 0): 0.1, (0, 1): 0.06, (0, 2): 0.04, (1,): 0.18, (1, 0): 0.1, (1, 1): 0.06,
              (1, 2): 0.04, (2,): 0.12}
  assert block.keys() == expected.keys()
  np.testing.assert_allclose([block[k] for k in expected], list(expected.values()), atol=1e-15)
  assert lossy.mtad_first_token_tv(drafter, target, (), 1, 0.5) == pytest.approx(0.08, abs=1e-15)
  assert lossy.mtad_first_token_tv(drafter, target, (), 1, 0.5, draft="beam", width=2) == pytest.approx(0, abs=1e-15)
  assert lossy.mtad_first_token_tv(drafter, target, (), 1, 0.3, draft="beam", width=2) == pytest.approx(0.8)
  assert lossy.mtad_expected_accepted(drafter, target, (), 1, 0.5) == pytest.approx(0.4)
  for draft in lossy.DRAFT_KINDS:
    assert lossy.mtad_first_token_tv(drafter, target, (), 3, INF, draft=draft, width=2) == pytest.approx(0, abs=1e-15)
  # a deterministic beam that beats greedy: greedy takes 0 (0.6) then 0 (0.5) = 0.3; W = 2 finds (1, 0) = 0.4
  beamy = theory.TabularLM(np.array([[0.6, 0.4], [0.5, 0.5], [1.0, 0.0]]), depth=1)
  assert lossy.beam_search(beamy, (), 2, 1) == ((0, 0), pytest.approx(np.log(0.3)))
  assert lossy.beam_search(beamy, (), 2, 2) == ((1, 0), pytest.approx(np.log(0.4)))
  # Beam sampling, W = 2: two draws without replacement from {00: .3, 01: .3, 10: .4}. 10 is best whenever drawn:
  # first (.4) or second (2 · .3 · .4/.7); 00 and 01 tie, the earlier draw wins: 00 first then 01 (.3 · .3/.7), and
  # symmetrically for 01. W = 1 is the sequence law; W ≥ the support always proposes its most likely sequence.
  law = lossy.beam_sampling_law(beamy, (), 2, 2)
  assert law == {(0, 0): pytest.approx(.09 / .7), (0, 1): pytest.approx(.09 / .7), (1, 0): pytest.approx(.4 + .24 / .7)}
  assert lossy.beam_sampling_law(beamy, (), 2, 1) == pytest.approx({(0, 0): .3, (0, 1): .3, (1, 0): .4})
  assert lossy.beam_sampling_law(beamy, (), 2, 4) == {(1, 0): 1.0}  # the whole support: its most likely
  with pytest.raises(ValueError, match="draft kind"):
    lossy.mtad_block_law(drafter, target, (), 1, 0.5, draft="greedy")
  with pytest.raises(ValueError, match="width"):
    lossy.mtad_block_law(drafter, target, (), 1, 0.5, draft="beam", width=0)


def test_theory_across_iterations():
  """The n-token law sums to 1, is the target's at τ = inf and after one token equals the first-token law."""
  drafter, target = theory.TabularLM.random(1, 3, 2, 0.5), theory.TabularLM.random(2, 3, 2, 0.5)
  for draft in lossy.DRAFT_KINDS:
    law = lossy.emitted_sequence_law(drafter, target, (0,), 3, 2, 0.5, draft=draft, width=2)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
    exact = lossy.emitted_sequence_law(drafter, target, (0,), 3, 2, INF, draft=draft, width=2)
    expected = theory.sequence_law(target, (0,), 3)
    np.testing.assert_allclose([exact[s] for s in expected], list(expected.values()), atol=1e-14)
    first = theory.emitted_prefix_law(lossy.mtad_block_law(drafter, target, (0,), 2, 0.5, draft=draft, width=2),
                                      target, (0,), 1)
    one = lossy.emitted_sequence_law(drafter, target, (0,), 1, 2, 0.5, draft=draft, width=2)
    np.testing.assert_allclose([one[s] for s in first], list(first.values()), atol=1e-14)
    assert lossy.mtad_sequence_tv(drafter, target, (0,), 3, 2, 0.5, draft=draft, width=2) > 0.05


# --- the jitted loop against the exact theory -------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def loop_counts(kind: str, tau: float, seed: int):
  """Counts of the first N_TOKENS emitted tokens over ROWS seeded rows at T = 1, the metrics summary and the number
  of invalid probability rows."""
  config, target, drafter_params = pair()
  drafter = {"sample": ModelDrafter(config), "beam": BeamDrafter(config, width=WIDTH, sample=False),
             "beam_sampling": BeamDrafter(config, width=WIDTH, sample=True)}[kind]
  tokens, lens = spec.prepare_prompts([list(PROMPT)] * ROWS)
  out = spec.generate_speculative(target, drafter_params, jax.random.split(jax.random.key(seed), ROWS), tokens, lens,
                                  target=config, drafter=drafter, gamma=GAMMA, max_new_tokens=N_TOKENS,
                                  verifier=verify.JointVerifier(tau=tau), sampler=T1)
  counts = {}
  for row in map(tuple, np.asarray(out.tokens_BxN).tolist()):
    counts[row] = counts.get(row, 0) + 1
  return counts, spec.summarize_metrics(out.metrics), int(out.metrics.invalid_prob_rows.sum())


def margin(drafter_table, target_table, tau, draft):
  """The smallest ``|L_i − log τ|`` over every draft the theory weighs (every context the first N_TOKENS reach): the
  float32 loop and the float64 theory agree on every verdict when it is well above float32 rounding."""
  smallest = INF
  for suffix in SUFFIXES:
    drafts = ([lossy.beam_search(drafter_table, suffix, GAMMA, WIDTH)[0]] if draft == "beam"
              else itertools.product(range(6), repeat=GAMMA))
    for x in drafts:
      p_tok = [target_table.next_probs(suffix + x[:i])[x[i]] for i in range(GAMMA)]
      q_tok = [drafter_table.next_probs(suffix + x[:i])[x[i]] for i in range(GAMMA)]
      L = lossy.joint_log_ratios(p_tok, q_tok)
      smallest = min(smallest, float(np.min(np.abs(L[np.isfinite(L)] - np.log(tau)), initial=INF)))
  return smallest


@pytest.mark.parametrize("kind", ["sample", "beam", "beam_sampling"])
def test_loop_law_matches_the_exact_theory(kind):
  """T = 1, V = 6, γ = 2, τ = 1/2: the first 3 emitted tokens (several iterations) of the jitted loop, drafting with
  ModelDrafter's chain ("sample"), the deterministic W = 3 beam ("beam") or W = 3 beam sampling, have the law of
  theory.lossy.emitted_sequence_law (χ², 20k seeded rows), which is far from the target's (the test has power)."""
  drafter_table, target_table = tables()
  assert margin(drafter_table, target_table, TAU, kind) > 1e-4
  law = lossy.emitted_sequence_law(drafter_table, target_table, (), N_TOKENS, GAMMA, TAU, draft=kind, width=WIDTH)
  counts, summary, invalid = loop_counts(kind, TAU, 42)
  res = theory.chi2_gof(counts, law)
  print(f"mtad@{kind}: χ² p = {res.p_value:.4g} (dof {res.dof}), BE {summary['mean_acceptance_length']:.3f}")
  assert res.p_value > PASS_P and invalid == 0
  assert 0.05 < summary["draft_acceptance_rate"] < 0.95
  assert theory.chi2_gof(counts, theory.sequence_law(target_table, (), N_TOKENS)).p_value < 1e-6


def test_first_token_tv_agrees_with_the_loop():
  """theory.lossy.mtad_first_token_tv against the empirical TV of the loop's first token (20k rows: the sampling
  error of a 6-bin TV is ≈ 0.006); it is 0 at τ = inf and clearly positive at τ = 1/2."""
  drafter_table, target_table = tables()
  counts, _, _ = loop_counts("sample", TAU, 42)
  first = np.zeros(6)
  for row, c in counts.items():
    first[row[0]] += c
  empirical_tv = 0.5 * np.abs(first / first.sum() - target_table.next_probs(())).sum()
  tv = lossy.mtad_first_token_tv(drafter_table, target_table, (), GAMMA, TAU)
  assert tv > 0.05 and abs(empirical_tv - tv) < 0.02, (tv, empirical_tv)
  for draft in lossy.DRAFT_KINDS:
    assert lossy.mtad_first_token_tv(drafter_table, target_table, (), GAMMA, INF, draft=draft) == pytest.approx(
        0, abs=1e-12)


def test_infinite_tau_through_the_loop_is_the_target_and_accepts_nothing():
  """τ = inf with beam sampling (W = 3): nothing accepted, the first 3 tokens have the target's law (χ²)."""
  _, target_table = tables()
  counts, summary, invalid = loop_counts("beam_sampling", INF, 43)
  assert summary["draft_acceptance_rate"] == 0.0 and invalid == 0
  assert theory.chi2_gof(counts, theory.sequence_law(target_table, (), N_TOKENS)).p_value > PASS_P


@pytest.mark.parametrize("tau,sample", [(0.5, False), (2.0, True)])
def test_greedy_target_gives_the_autoregressive_tokens(tau, sample):
  """T = 0, ragged prompts: with one-hot rows only target-argmax tokens pass (L = 0 on a match, −inf otherwise), so
  the beam drafter + MTAD emits exactly the greedy tokens; τ = 1/2 accepts matches (0 > log τ), τ = 2 none."""
  config, target, drafter_params = pair()
  keys = jax.random.split(jax.random.key(0), len(RAGGED6))
  ar = run_ar(config, target, RAGGED6, keys, 14)
  tokens, lens = spec.prepare_prompts(RAGGED6)
  out = spec.generate_speculative(target, drafter_params, keys, tokens, lens, target=config,
                                  drafter=BeamDrafter(config, width=WIDTH, sample=sample), gamma=3, max_new_tokens=14,
                                  verifier=verify.JointVerifier(tau=tau), sampler=GREEDY)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  accepted = int(out.metrics.num_accepted_tokens.sum())
  assert (accepted > 0) if tau < 1 else (accepted == 0)
  assert int(out.metrics.invalid_prob_rows.sum()) == 0
