"""Exact enumeration theory for tree verification (blockspec_jax.theory.trees) against the target law, the chain
rules of blockspec_jax.theory.exact, and the jitted rules of blockspec_jax.verify (Monte Carlo, fixed seeds).

Every law test is parametrised over ``verify.TREE_RULES``: a newly registered rule must name an exact transcription in
``theory.trees`` (the registry test fails otherwise). χ² thresholds as in tests/test_laws.py (p > 1e-3 where the law
must match; the seeds are fixed, so the outcome is deterministic); expectations within 5 standard errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import theory, verify
from blockspec_jax.theory import trees
from helpers import PASS_P, law_name, stable_seed, top_k_pair

MC_SAMPLES = 100_000  # one batch size for every jitted call: one compile per rule

MODELS = {  # name -> (drafter, target, context)
    "v3_d2": lambda: (theory.TabularLM.random(31, 3, 2, 0.7), theory.TabularLM.random(32, 3, 2, 0.7), (1,)),
    "v4_d1": lambda: (theory.TabularLM.random(41, 4, 1, 1.0), theory.TabularLM.random(42, 4, 1, 1.0), (2,)),
    "top2_v4_d1": lambda: top_k_pair(43, 4, 1, 2) + ((0,),),  # rows with exact zeros: fallbacks, clipped ratios
}

SHAPES = {  # name -> per-depth branching
    "chain3": (1, 1, 1),
    "two_chains_d2": (2, 1),  # SpecTr's k = 2 chains of depth 2 / RSD-C (2, 1)
    "binary_d2": (2, 2),
}

LOSSLESS_CASES = [(model, shape) for model in MODELS for shape in SHAPES
                  if (model, shape) != ("v4_d1", "binary_d2")]  # 4**6 trees × 21 contexts: covered by V = 3


@functools.lru_cache(maxsize=None)
def models(name):
  return MODELS[name]()


def test_registry_matches_the_jax_rules():
  """Every registered jax tree rule names an exact transcription (``theory_law``, a tree law) and takes its sibling
  sampling from it: the law's declaration is the only one, the sampling table is read from it."""
  for rule in verify.TREE_RULES:
    law = law_name(rule)
    assert law in trees.TREE_LAWS
    assert verify.VERIFIERS[rule].sibling_sampling == verify.tree_sampling(rule) == trees.TREE_LAWS[law].sampling
  assert dict(trees.TREE_RULE_SAMPLING) == {name: law.sampling for name, law in trees.TREE_LAWS.items()}


# --- exact: losslessness and the chain rules -----------------------------------------------------------------------

@pytest.mark.parametrize("model,shape", LOSSLESS_CASES)
@pytest.mark.parametrize("rule", sorted(verify.TREE_RULES))
def test_emitted_prefix_law_is_the_target_law(rule, model, shape):
  """Iterations of the rule on freshly drawn trees emit the target's law of the first m = 1, 2, 3 tokens (1e-9)."""
  drafter, target, context = models(model)
  parents_N = trees.branching_parents(SHAPES[shape])
  for m in (1, 2, 3):
    error = trees.tree_lossless_error(law_name(rule), drafter, target, context, parents_N, m=m)
    assert error < 1e-9, (rule, model, shape, m, error)
  tau_law = trees.tree_tau_law(law_name(rule), drafter, target, context, parents_N)
  assert tau_law.shape == (len(SHAPES[shape]) + 1,) and abs(tau_law.sum() - 1.0) < 1e-12


@pytest.mark.parametrize("rule", sorted(verify.TREE_RULES))
def test_conditional_laws_are_distributions(rule):
  """Every tree's ``P(end node, Y | tree)`` sums to 1; the draw probabilities sum to 1."""
  drafter, target, context = models("top2_v4_d1")
  draws = trees.enumerate_trees(drafter, target, context, trees.branching_parents((2, 2)),
                                verify.tree_sampling(rule))
  assert abs(draws.weights_T.sum() - 1.0) < 1e-12
  law_TxN1xV = trees.tree_conditional_law(law_name(rule), draws.tokens_TxN, draws.parents, draws.draft_probs_TxNxV,
                                          draws.target_probs_TxN1xV)
  assert law_TxN1xV.min() >= 0.0
  np.testing.assert_allclose(law_TxN1xV.sum(axis=(1, 2)), 1.0, atol=1e-12)


#: On a chain (one child per node) a tree rule is a single-draft rule of theory.exact.
CHAIN_EQUIVALENT = {"rrs": "token", "rrs_wor": "token", "spectr": "token", "traversal": "block"}


@pytest.mark.parametrize("rule", sorted(CHAIN_EQUIVALENT))
def test_chain_is_the_single_draft_rule(rule):
  """On chains of γ = 1..3 the outcome law (hence τ's) is the chain rule's: traversal is block verification,
  rrs / rrs_wor / spectr (k = 1, ρ = 1) token verification."""
  chain_rule = CHAIN_EQUIVALENT[rule]
  for model in ("v3_d2", "v4_d1"):
    drafter, target, context = models(model)
    for gamma in (1, 2, 3):
      parents_N = verify.chain_parents(gamma)
      np.testing.assert_allclose(trees.tree_tau_law(law_name(rule), drafter, target, context, parents_N),
                                 theory.exact_tau_law(chain_rule, drafter, target, context, gamma), atol=1e-12)
      tree_law = trees.tree_outcome_law(law_name(rule), drafter, target, context, parents_N)
      chain_law = theory.exact_outcome_law(chain_rule, drafter, target, context, gamma)
      for outcome in set(tree_law) | set(chain_law):
        assert abs(tree_law.get(outcome, 0.0) - chain_law.get(outcome, 0.0)) < 1e-12, (model, gamma, outcome)


def test_known_orderings_of_expected_accepted():
  """On these pairs and shapes (identical shapes, each rule's own sampling): traversal ≥ rrs_wor everywhere;
  rrs_wor ≥ rrs and spectr ≥ rrs at one depth (siblings only). Deeper, the with-replacement rules walk every chain
  that shares the accepted prefix (merged), and rrs can beat rrs_wor (and spectr): on top2_v4_d1 with branching
  (2, 1), rrs 0.2946, spectr 0.2941, rrs_wor 0.2750. (Checked on these pairs, not theorems; rrs_wor vs spectr goes
  either way, so it is not asserted.)"""
  beaten = False
  for model in ("v3_d2", "v4_d1", "top2_v4_d1"):
    drafter, target, context = models(model)
    for branching in ((2,), (2, 1), (2, 2)):
      parents_N = trees.branching_parents(branching)
      e = {rule: trees.tree_expected_accepted(law_name(rule), drafter, target, context, parents_N)
           for rule in verify.TREE_RULES}
      print(model, branching, {rule: round(value, 4) for rule, value in e.items()})
      if branching == (2,):
        assert e["rrs_wor"] >= e["rrs"] - 1e-12 and e["spectr"] >= e["rrs"] - 1e-12
      beaten |= e["rrs"] > e["rrs_wor"] + 1e-3
      assert e["traversal"] >= e["rrs_wor"] - 1e-12
    if model != "top2_v4_d1":  # top-2 rows: every rule gives the same E[τ] on the binary tree
      assert e["rrs_wor"] > e["rrs"] + 1e-2  # strictly, on the binary tree
  assert beaten  # merging shared prefixes is worth something: with replacement wins once


def test_rsd_identity_star_of_all_tokens():
  """A star of V children drawn without replacement holds every token: exactly one is accepted (E[τ] = 1)."""
  drafter, target, context = models("v3_d2")
  for rule in ("rrs_wor", "traversal"):
    assert abs(trees.tree_expected_accepted(rule, drafter, target, context, [-1, -1, -1]) - 1.0) < 1e-12


# --- the draw law ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [trees.WITH_REPLACEMENT, trees.WITHOUT_REPLACEMENT])
def test_sample_trees_has_the_enumerated_draw_law(sampling):
  drafter, target, context = models("v3_d2")
  parents_N = trees.branching_parents((2, 1))
  draws = trees.enumerate_trees(drafter, target, context, parents_N, sampling)
  tokens_BxN, q_BxNxV, p_BxN1xV = trees.sample_trees(stable_seed("sample_trees", sampling), drafter, target, context,
                                                     parents_N, 50_000, sampling)
  counts = {}
  for row in map(tuple, tokens_BxN.tolist()):
    counts[row] = counts.get(row, 0) + 1
  expected = {tuple(row): w for row, w in zip(draws.tokens_TxN.tolist(), draws.weights_T)}
  assert theory.chi2_gof(counts, expected).p_value > PASS_P
  index = {tuple(row): t for t, row in enumerate(draws.tokens_TxN.tolist())}
  t = index[tuple(tokens_BxN[0].tolist())]
  np.testing.assert_array_equal(q_BxNxV[0], draws.draft_probs_TxNxV[t])
  np.testing.assert_array_equal(p_BxN1xV[0], draws.target_probs_TxN1xV[t])


# --- against the jitted rules (Monte Carlo) --------------------------------------------------------------------------

MC_MODEL, MC_BRANCHING = "v3_d2", (2, 2)  # N = 6, V = 3: every rule compiles once


def _rows_after(lm, context, paths_BxD) -> np.ndarray:
  """``lm.next_probs(context + path)`` for every row of ``paths_BxD`` (looked up once per distinct path)."""
  vocab, depth = lm.vocab_size, paths_BxD.shape[1]
  codes_B = paths_BxD @ (vocab ** np.arange(depth - 1, -1, -1, dtype=np.int64))  # one integer per path
  _, first_U, inverse_B = np.unique(codes_B, return_index=True, return_inverse=True)
  rows_UxV = np.stack([lm.next_probs(tuple(context) + tuple(int(x) for x in paths_BxD[b])) for b in first_U])
  return rows_UxV[inverse_B.reshape(-1)]


def gumbel_trees(seed, drafter, target, context, parents_N, num, without_replacement):
  """Trees by Gumbel-max per node in order (the earlier siblings' tokens masked when ``without_replacement``: the
  law of Gumbel-top-k), written independently of ``trees.sample_trees``; rows in the tree contract."""
  rng = np.random.default_rng(seed)
  num_nodes, vocab = len(parents_N), target.vocab_size
  paths = {-1: np.zeros((num, 0), np.int64)}
  tokens_BxN = np.zeros((num, num_nodes), np.int64)
  q_rows = []
  for n, u in enumerate(parents_N):
    q_BxV = _rows_after(drafter, context, paths[u])
    log_q_BxV = np.log(np.where(q_BxV > 0, q_BxV, 1.0)) + np.where(q_BxV > 0, 0.0, -np.inf)
    if without_replacement:
      for s in range(n):
        if parents_N[s] == u:
          log_q_BxV[np.arange(num), tokens_BxN[:, s]] = -np.inf
    tokens_BxN[:, n] = np.argmax(log_q_BxV + rng.gumbel(size=(num, vocab)), axis=1)
    paths[n] = np.concatenate([paths[u], tokens_BxN[:, n:n + 1]], axis=1)
    q_rows.append(q_BxV)
  p_rows = [_rows_after(target, context, paths[u]) for u in range(-1, num_nodes)]
  return tokens_BxN, np.stack(q_rows, 1), np.stack(p_rows, 1)


@functools.lru_cache(maxsize=None)
def jitted_rule(rule, parents):
  """jit(vmap) of the rule for one shape; on CPU with XLA's backend optimisation off (3x faster compiles, which
  dominate this module's runtime; the rule's law is the same)."""
  parents_N = np.asarray(parents, np.int32)
  options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
  return jax.jit(jax.vmap(lambda key, tokens_N, q_NxV, p_N1xV: verify.tree_verify(
      key, tokens_N, parents_N, q_NxV, p_N1xV, rule=rule)), compiler_options=options)


def run_jitted(rule, parents_N, seed, tokens_BxN, q_BxNxV, p_BxN1xV):
  """``(end node + 1, τ, Y)`` per tree (end 0: nothing accepted) from the jitted, vmapped ``tree_verify``."""
  keys = jax.random.split(jax.random.key(seed), tokens_BxN.shape[0])
  res = jitted_rule(rule, tuple(int(u) for u in parents_N))(
      keys, jnp.asarray(tokens_BxN, jnp.int32), jnp.asarray(q_BxNxV, jnp.float32), jnp.asarray(p_BxN1xV, jnp.float32))
  accepted_BxN = np.asarray(res.accepted_N)
  tau_B = np.asarray(res.num_accepted)
  end_B = np.where(accepted_BxN.any(axis=1), accepted_BxN.shape[1] - np.argmax(accepted_BxN[:, ::-1], axis=1), 0)
  assert np.array_equal(accepted_BxN.sum(axis=1), tau_B)
  return end_B, tau_B, np.asarray(res.next_token)


def _end_counts(end_B, y_B, num_nodes, vocab):
  return np.bincount(end_B * vocab + y_B, minlength=(num_nodes + 1) * vocab)


@pytest.mark.parametrize("rule", sorted(verify.TREE_RULES))
def test_exact_laws_match_the_jitted_rule(rule):
  """Sampled trees (drawn by an independent Gumbel sampler as the rule requires) verified by the jitted rule: τ's law
  and the law of (end node, Y) by χ², E[τ] within 5 s.e. Then one fixed tree, many keys: the exact conditional law
  ``P(end node, Y | tree)`` by χ² (the rule's internal decisions, not only their marginals)."""
  drafter, target, context = models(MC_MODEL)
  parents_N = trees.branching_parents(MC_BRANCHING)
  num_nodes, vocab = len(parents_N), target.vocab_size
  without_replacement = verify.tree_sampling(rule) == trees.WITHOUT_REPLACEMENT
  if verify.tree_sampling(rule) == trees.POINT_MASS:  # no draw: the drafter's top-token tree, every row
    tokens_BxN, q_BxNxV, p_BxN1xV = trees.sample_trees(0, drafter, target, context, parents_N, MC_SAMPLES,
                                                       trees.POINT_MASS)
  else:
    tokens_BxN, q_BxNxV, p_BxN1xV = gumbel_trees(stable_seed("mc_trees", rule), drafter, target, context, parents_N,
                                                 MC_SAMPLES, without_replacement)
  end_B, tau_B, y_B = run_jitted(rule, parents_N, stable_seed("mc_verify", rule), tokens_BxN, q_BxNxV, p_BxN1xV)

  law = law_name(rule)
  tau_law = trees.tree_tau_law(law, drafter, target, context, parents_N)
  expected_tau = trees.tree_expected_accepted(law, drafter, target, context, parents_N)
  counted = theory.counting_estimate(tau_B)
  tau_p = theory.chi2_gof(np.bincount(tau_B, minlength=tau_law.shape[0]), tau_law).p_value
  draws = trees.enumerate_trees(drafter, target, context, parents_N, verify.tree_sampling(rule))
  law_TxN1xV = trees.tree_conditional_law(law, draws.tokens_TxN, parents_N, draws.draft_probs_TxNxV,
                                          draws.target_probs_TxN1xV)
  end_law = np.einsum("t,tev->ev", draws.weights_T, law_TxN1xV).reshape(-1)
  end_p = theory.chi2_gof(_end_counts(end_B, y_B, num_nodes, vocab), end_law).p_value
  print(f"{rule}: E[τ] exact {expected_tau:.4f}, measured {counted.mean:.4f} ± {counted.stderr:.4f}; τ χ² p = "
        f"{tau_p:.3g}, (end, Y) χ² p = {end_p:.3g}")
  assert abs(counted.mean - expected_tau) < 5 * counted.stderr
  assert tau_p > PASS_P and end_p > PASS_P

  # One fixed tree (distinct siblings: legal for both samplings), every key fresh.
  tokens_N = np.array([2, 0, 1, 0, 0, 2])
  paths = {-1: ()}
  q_rows, p_rows = [], [target.next_probs(context)]
  for n, u in enumerate(parents_N):
    q_rows.append(drafter.next_probs(context + paths[u]))
    paths[n] = paths[u] + (int(tokens_N[n]),)
    p_rows.append(target.next_probs(context + paths[n]))
  q_NxV, p_N1xV = np.stack(q_rows), np.stack(p_rows)
  exact = trees.tree_conditional_law(law, tokens_N, parents_N, q_NxV, p_N1xV).reshape(-1)
  end_B, _, y_B = run_jitted(rule, parents_N, stable_seed("mc_fixed_tree", rule),
                             *(np.broadcast_to(x, (MC_SAMPLES,) + x.shape) for x in (tokens_N, q_NxV, p_N1xV)))
  fixed_p = theory.chi2_gof(_end_counts(end_B, y_B, num_nodes, vocab), exact).p_value
  print(f"{rule} fixed tree {tokens_N.tolist()}: (end, Y) χ² p = {fixed_p:.3g}")
  assert fixed_p > PASS_P


# --- errors ----------------------------------------------------------------------------------------------------------

def test_errors():
  drafter, target, context = models("v3_d2")
  with pytest.raises(ValueError, match="known tree rules: point_mass, rrs, rrs_wor, spectr, traversal"):
    trees.tree_expected_accepted("specinfer", drafter, target, context, [-1])
  with pytest.raises(ValueError, match="topological"):
    trees.tree_expected_accepted("rrs", drafter, target, context, [-1, 2, 0])
  with pytest.raises(ValueError, match="not consecutive"):
    trees.tree_expected_accepted("rrs", drafter, target, context, [-1, 0, -1])
  with pytest.raises(ValueError, match="too many to enumerate"):
    trees.tree_expected_accepted("rrs", drafter, target, context, verify.chain_parents(12))
  with pytest.raises(ValueError, match="branching"):
    trees.branching_parents((2, 0))
  with pytest.raises(ValueError, match="only V = 3 tokens"):
    trees.tree_expected_accepted("traversal", drafter, target, context, [-1, -1, -1, -1])
  with pytest.raises(ValueError, match="vocabularies differ"):
    trees.tree_expected_accepted("rrs", drafter, models("v4_d1")[1], context, [-1])
  # Without replacement, a sibling group may not outnumber the tokens of positive drafter probability (top-2 rows).
  drafter, target, context = models("top2_v4_d1")
  with pytest.raises(ValueError, match="positive drafter probability"):
    trees.tree_expected_accepted("rrs_wor", drafter, target, context, [-1, -1, -1])
  # ... unless the drafter is smoothed as the without-replacement drafters do; the rule stays lossless.
  for rule in ("rrs_wor", "traversal"):
    assert trees.tree_lossless_error(rule, drafter, target, context, [-1, -1, -1], m=2, epsilon=1e-3) < 1e-9
  assert trees.tree_lossless_error("rrs", drafter, target, context, [-1, -1, -1], m=2) < 1e-9
