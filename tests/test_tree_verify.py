"""Tree verification (blockspec_jax.verify.tree): exact laws by χ² with fixed seeds, hand-made cases (one tree at a
time jitted and not, ``chex.variants``, and in batches), errors.

The law tests are parametrised over ``TREE_RULES``: a newly registered rule is tested against the target sequence
law automatically, with trees drawn the way ``tree_sampling(rule)`` asks. Thresholds as in tests/test_laws.py:
p > 1e-3 where the law must be exact, p < 1e-6 where a bias must be detected (seeds are fixed).
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from blockspec_jax import theory
from blockspec_jax.decoding import reference as ref
from blockspec_jax.theory import trees as theory_trees
from blockspec_jax.verify import tree
from helpers import BIAS_P, PASS_P, row_counts, stable_seed, top_k_pair

NUM_SAMPLES = 150_000


# --- drawing trees from tabular models (test helpers) --------------------------------------------------------------

def _row(tables, prefix_T, length):
  """The tabular row after ``prefix_T[:length]``: ``ref.tabular_probs`` with only static powers (faster to compile).

  Row ``offset(m) + Σ_{j<m} s_j V^(m−1−j)`` over the last ``m = min(length, depth)`` tokens ``s``.
  """
  vocab, depth = tables.vocab_size, tables.depth
  m = jnp.minimum(length, depth)
  index = jnp.int32(0)
  for k in range(1, depth + 1):
    index = jnp.where(m == k, sum(vocab**l for l in range(k)), index)
  for j in range(depth):
    digit = prefix_T[jnp.clip(length - m + j, 0, prefix_T.shape[0] - 1)]
    for k in range(depth):
      index = index + jnp.where((j < m) & (m - 1 - j == k), digit * vocab**k, 0)
  return tables.probs_RxV[index]


def draw_tree(key, drafter, target, context_C, parents_N, replacement: bool):
  """Draw a tree of shape ``parents_N`` (may be traced) from the tabular ``drafter`` after ``context_C``; score it.

  Nodes are drawn in order (Gumbel-max), each from the drafter's row at its parent's context: i.i.d.
  (``replacement``), or with the tokens of its earlier siblings removed (sequential sampling without replacement,
  the law of Gumbel-top-k). Returns ``tokens_N, draft_probs_NxV, target_probs_N1xV, depth_N`` per the tree
  contract: draft row n = the drafter's (unmasked) row at n's parent context, target row 0 = root, n + 1 = after
  node n.
  """
  n_nodes, context_len = parents_N.shape[0], context_C.shape[0]
  vocab = drafter.vocab_size
  gumbel_NxV = jax.random.gumbel(key, (n_nodes, vocab), jnp.float32)
  prefix_N1xT = jnp.zeros((n_nodes + 1, context_len + n_nodes), jnp.int32).at[:, :context_len].set(context_C)
  depth_N1 = jnp.zeros((n_nodes + 1,), jnp.int32)
  tokens_N = jnp.zeros((n_nodes,), jnp.int32)
  q_rows = []
  for n in range(n_nodes):
    parent = parents_N[n]
    parent_prefix_T, parent_depth = prefix_N1xT[parent + 1], depth_N1[parent + 1]
    q_V = _row(drafter, parent_prefix_T, context_len + parent_depth)
    log_weights_V = jnp.log(q_V)
    if not replacement and n > 0:
      earlier_siblings_N = (parents_N == parent) & (jnp.arange(n_nodes) < n)
      taken_V = jnp.any(earlier_siblings_N[:, None] & (tokens_N[:, None] == jnp.arange(vocab)[None, :]), axis=0)
      log_weights_V = jnp.where(taken_V, -jnp.inf, log_weights_V)
    x = jnp.argmax(log_weights_V + gumbel_NxV[n]).astype(jnp.int32)
    tokens_N = tokens_N.at[n].set(x)
    q_rows.append(q_V)
    prefix_N1xT = prefix_N1xT.at[n + 1].set(parent_prefix_T.at[context_len + parent_depth].set(x))
    depth_N1 = depth_N1.at[n + 1].set(parent_depth + 1)
  p_N1xV = jax.vmap(lambda prefix_T, depth: _row(target, prefix_T, context_len + depth))(prefix_N1xT, depth_N1)
  return tokens_N, jnp.stack(q_rows), p_N1xV, depth_N1[1:]


def first_emitted(key, res, tokens_N, depth_N, target, context_C, length):
  """The first ``length`` tokens of the stream: accepted path, then Y, then fresh target draws where needed.

  Lossless means exactly that this has the target's law of the first ``length`` tokens.
  """
  context_len = context_C.shape[0]
  buffer_T = jnp.zeros((context_len + length,), jnp.int32).at[:context_len].set(context_C)
  gumbel_LxV = jax.random.gumbel(key, (length, target.vocab_size), jnp.float32)
  tau = res.num_accepted
  for i in range(length):
    fresh = jnp.argmax(jnp.log(_row(target, buffer_T, context_len + i)) + gumbel_LxV[i]).astype(jnp.int32)
    drafted = jnp.sum(jnp.where(res.accepted_N & (depth_N == i + 1), tokens_N, 0))
    token = jnp.where(i < tau, drafted, jnp.where(i == tau, res.next_token, fresh))
    buffer_T = buffer_T.at[context_len + i].set(token)
  return buffer_T[context_len:]


# Every run is split into batches of BATCH trees, all with N = 4 nodes, V = 5, a depth-2 model and a context of
# length 1: drawing compiles twice (with / without replacement), the extension once, each rule's verifier once.
BATCH = 50_000


@functools.lru_cache(maxsize=None)
def _draw_runner(replacement):
  return jax.jit(jax.vmap(functools.partial(draw_tree, replacement=replacement), in_axes=(0, None, None, None, None)))


@functools.lru_cache(maxsize=None)
def _verify_runner(rule):
  """jit(vmap) of ``tree_verify`` over a batch of trees; every input traced (parents included)."""
  return jax.jit(jax.vmap(functools.partial(tree.tree_verify, rule=rule)))


@functools.lru_cache(maxsize=None)
def _extend_runner(length):
  return jax.jit(jax.vmap(functools.partial(first_emitted, length=length), in_axes=(0, 0, 0, 0, None, None)))


def run_trees(rule, drafter_lm, target_lm, context, parents_N, num_samples, seed, replacement=None, length=3):
  """Draw ``num_samples`` trees of shape ``parents_N`` and verify them with ``rule``; numpy tokens, results and the
  first ``length`` emitted tokens. Trees are drawn as ``tree_sampling(rule)`` asks unless ``replacement`` is given."""
  if replacement is None:
    replacement = tree.tree_sampling(rule) == tree.WITH_REPLACEMENT
  drafter, target = ref.TabularTables.from_lm(drafter_lm), ref.TabularTables.from_lm(target_lm)
  context_C, parents_N = jnp.asarray(context, jnp.int32), jnp.asarray(parents_N, jnp.int32)
  outputs = []
  for batch_key in jax.random.split(jax.random.key(seed), -(-num_samples // BATCH)):
    key_draw, key_verify, key_extend = (jax.random.split(k, BATCH) for k in jax.random.split(batch_key, 3))
    tokens_BxN, q_BxNxV, p_BxN1xV, depth_BxN = _draw_runner(replacement)(key_draw, drafter, target, context_C,
                                                                       parents_N)
    parents_BxN = jnp.broadcast_to(parents_N, tokens_BxN.shape)
    res = _verify_runner(rule)(key_verify, tokens_BxN, parents_BxN, q_BxNxV, p_BxN1xV)
    emitted_BxL = _extend_runner(length)(key_extend, res, tokens_BxN, depth_BxN, target, context_C)
    outputs.append((tokens_BxN, res, emitted_BxL))
  tokens, res, emitted = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs])[:num_samples],
                                      *outputs)
  return tokens, res, emitted


def assert_paths_are_chains(res, parents_N, tokens=None):
  """Accepted nodes form a chain hanging from the root, ``num_accepted`` of them, at most one child per node. With
  ``tokens`` (``[..., N]``): in the tree whose equal prefixes are merged (``prefix_classes``: the with-replacement
  rules walk it), where an accepted node's parent may be another node of the same prefix."""
  accepted = np.asarray(res.accepted_N)
  n_nodes = accepted.shape[-1]
  assert np.array_equal(accepted.sum(-1), res.num_accepted)
  if tokens is None:
    classes = np.broadcast_to(np.arange(n_nodes), accepted.shape)
  else:
    classes = theory_trees.prefix_classes_np(np.asarray(tokens).reshape(-1, n_nodes), parents_N).reshape(
        accepted.shape)
  parent_class = np.where(parents_N < 0, -1, np.take_along_axis(
      classes, np.broadcast_to(np.maximum(parents_N, 0), accepted.shape), axis=-1))
  # every accepted node's parent class holds an accepted node (or is the root) ...
  parent_ok = (parent_class < 0) | np.any(accepted[..., None, :] & (classes[..., None, :] == parent_class[..., :, None]),
                                          axis=-1)
  assert np.all(~accepted | parent_ok)
  # ... and no parent class has two accepted children
  siblings = np.sum(accepted[..., None, :] & (parent_class[..., None, :] == parent_class[..., :, None]), axis=-1)
  assert np.all(~accepted | (siblings <= 1))




# All models share V = 5, depth 2 and a context of length 1, and all trees have N = 4 nodes, so each rule compiles
# its runner once.
MODELS = {
    "v5_d2": (lambda: (theory.TabularLM.random(13, 5, 2, 0.7), theory.TabularLM.random(14, 5, 2, 0.7)), (0,)),
    "topk3_v5_d2": (lambda: top_k_pair(22, 5, 2, 3), (2,)),
}

SHAPES = {
    "fork_left": [-1, -1, 0, 0],   # two root children, the first with two children, the second a leaf
    "fork_right": [-1, -1, 1, 1],  # the same with the leaf first: an accepted leaf leaves its sibling's subtree
    "one_three": [-1, 0, 0, 0],    # one root child with three children
    "star4": [-1, -1, -1, -1],     # four root children (depth 1)
    "chain4": tree.chain_parents(4).tolist(),
}

def test_row_helper_matches_tabular_lm():
  lm = MODELS["v5_d2"][0]()[0]
  tables = ref.TabularTables.from_lm(lm)
  row = jax.jit(_row)
  for prefix in [(), (3,), (1, 4), (2, 0, 4), (4, 4, 1, 2)]:
    buffer_T = jnp.zeros((6,), jnp.int32).at[:len(prefix)].set(jnp.asarray(prefix, jnp.int32))
    np.testing.assert_allclose(np.asarray(row(tables, buffer_T, len(prefix))), lm.next_probs(prefix), rtol=1e-6)


LAW_CASES = {
    "v5_d2_fork_left": ("v5_d2", "fork_left"),
    "v5_d2_fork_right": ("v5_d2", "fork_right"),
    "v5_d2_star4": ("v5_d2", "star4"),
    "topk3_one_three": ("topk3_v5_d2", "one_three"),
}

#: Built-in rules: the single-draft rule they reduce to on a chain (one child per node, k = 1).
CHAIN_EQUIVALENT = {"rrs": "token", "rrs_wor": "token", "spectr": "token"}


def _root_law(rule, p_V, q_V, num_children) -> dict:
  """Exact law (float64 enumeration) of (index of the accepted root child or −1, first emitted token).

  Root decisions depend only on the root's rows and its children's tokens, whatever lies below. A transcription of
  each built-in rule's definition, independent of the jax code; it also asserts that the first emitted token has law
  ``p`` exactly (the losslessness claim, in float64).
  """
  p_V, q_V = np.asarray(p_V, np.float64), np.asarray(q_V, np.float64)
  vocab = len(p_V)
  law = {}

  def add(key, mass):
    law[key] = law.get(key, 0.0) + mass

  def norm(w):
    return w / w.sum() if w.sum() > 0 else w

  if rule == "spectr":
    def excess(rho):
      beta = np.minimum(q_V, p_V / rho).sum()
      return 1 - (1 - beta)**num_children - rho * beta
    rho = 1.0 if excess(1.0) <= 1e-15 else optimize.brentq(excess, 1.0, num_children, xtol=1e-14)
    beta = np.minimum(q_V, p_V / rho).sum()
    scale = (1 - (1 - beta)**num_children) / beta if beta > 0 else num_children
    spectr_residual = norm(np.maximum(p_V - np.minimum(q_V, p_V / rho) * scale, 0.0))
  for draw in itertools.product(range(vocab), repeat=num_children):
    if rule == "rrs_wor":
      prob, q = 1.0, q_V.copy()
      for x in draw:
        prob *= q[x] / q.sum() if q.sum() > 0 else 0.0
        q[x] = 0.0
    else:
      prob = float(np.prod(q_V[list(draw)]))
    if prob == 0:
      continue
    reach, p, q = prob, p_V.copy(), q_V.copy()
    for k, x in enumerate(draw):
      if rule == "spectr":
        accept = min(1.0, p_V[x] / (rho * q_V[x]))
      else:
        accept = min(1.0, p[x] / q[x])
        p = norm(np.maximum(p - q, 0.0))
        if rule == "rrs_wor":
          q[x] = 0.0
          q = norm(q)
      add((k, x), reach * accept)
      reach *= 1 - accept
    final = spectr_residual if rule == "spectr" else p
    for y in range(vocab):
      add((-1, y), reach * final[y])
  token_law = np.zeros(vocab)
  for (_, y), mass in law.items():
    token_law[y] += mass
  np.testing.assert_allclose(token_law, p_V, atol=1e-12)
  return law


# --- exact laws -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(LAW_CASES))
@pytest.mark.parametrize("rule", sorted(tree.TREE_RULES))
def test_first_emitted_tokens_have_target_law(rule, case):
  """Path tokens, then Y, then target draws: the first 3 tokens follow the target law exactly (χ²). For the
  built-in rules the root's decision (which child, which token) also matches a float64 enumeration of the rule."""
  model, shape = LAW_CASES[case]
  make, context = MODELS[model]
  drafter, target = make()
  parents_N = np.asarray(SHAPES[shape], np.int32)
  tokens, res, emitted = run_trees(rule, drafter, target, context, parents_N, NUM_SAMPLES,
                                   seed=stable_seed("tree_law", rule, case))
  assert_paths_are_chains(res, parents_N, tokens)
  assert np.all((res.next_token >= 0) & (res.next_token < drafter.vocab_size))
  result = theory.chi2_gof(row_counts(emitted), theory.sequence_law(target, context, 3))
  message = (f"tree {rule} {case} ({tree.tree_sampling(rule)}): first 3 tokens χ² p = {result.p_value:.4g} "
             f"(dof {result.dof}), mean accepted {res.num_accepted.mean():.3f}")
  root_p = 1.0
  if rule in CHAIN_EQUIVALENT:
    root_children = np.flatnonzero(parents_N == -1)
    law = _root_law(rule, target.next_probs(context), drafter.next_probs(context), len(root_children))
    accepted_root = res.accepted_N[:, root_children]
    index = np.where(accepted_root.any(-1), np.argmax(accepted_root, axis=-1), -1)
    root_p = theory.chi2_gof(row_counts(np.stack([index, emitted[:, 0]], axis=-1)), law).p_value
    accept_exact = sum(mass for (k, _), mass in law.items() if k >= 0)
    message += (f"; root (child, token) χ² p = {root_p:.4g}, P(root child accepted) sampled "
                f"{np.mean(index >= 0):.4f} exact {accept_exact:.4f}")
  print(message)
  assert result.p_value > PASS_P and root_p > PASS_P


@functools.lru_cache(maxsize=None)
def _token_tau_law(model, gamma):
  make, context = MODELS[model]
  drafter, target = make()
  return theory.exact_tau_law("token", drafter, target, context, gamma)


@pytest.mark.parametrize("rule", sorted(CHAIN_EQUIVALENT))
def test_chain_matches_single_draft_rule(rule):
  """On a chain (parents [-1, 0, 1, 2]) τ has token verification's exact law, and the stream the target's."""
  assert CHAIN_EQUIVALENT[rule] == "token"
  make, context = MODELS["v5_d2"]
  drafter, target = make()
  parents_N = tree.chain_parents(4)
  _, res, emitted = run_trees(rule, drafter, target, context, parents_N, NUM_SAMPLES,
                              seed=stable_seed("tree_chain", rule))
  tau_result = theory.chi2_gof(np.bincount(res.num_accepted, minlength=5), _token_tau_law("v5_d2", 4))
  stream_result = theory.chi2_gof(row_counts(emitted), theory.sequence_law(target, context, 3))
  print(f"chain {rule}: τ χ² p = {tau_result.p_value:.4g} against token verification, first 3 tokens χ² p = "
        f"{stream_result.p_value:.4g}")
  assert tau_result.p_value > PASS_P and stream_result.p_value > PASS_P


def test_with_replacement_rule_on_trees_without_replacement_is_biased():
  """The χ² test has power: rrs fed siblings drawn without replacement (not the law it assumes) is detected."""
  make, context = MODELS["v5_d2"]
  drafter, target = make()
  _, _, emitted = run_trees("rrs", drafter, target, context, SHAPES["star4"], NUM_SAMPLES,
                            seed=stable_seed("tree_bias"), replacement=False)
  result = theory.chi2_gof(np.bincount(emitted[:, 0], minlength=5), target.next_probs(context))
  print(f"rrs on trees drawn without replacement: first token χ² p = {result.p_value:.3g}")
  assert result.p_value < BIAS_P


# --- hand-made cases ------------------------------------------------------------------------------------------------

HAND_PARENTS = np.array(SHAPES["fork_left"], np.int32)


def _constant_tree(draft_row_V, target_row_V, tokens_N):
  """A ``fork_left`` tree whose every draft row is ``draft_row_V`` and every target row ``target_row_V``."""
  n_nodes = len(HAND_PARENTS)
  return (jnp.asarray(tokens_N, jnp.int32), jnp.asarray(HAND_PARENTS),
          jnp.tile(jnp.asarray(draft_row_V, jnp.float32), (n_nodes, 1)),
          jnp.tile(jnp.asarray(target_row_V, jnp.float32), (n_nodes + 1, 1)))


def _verify_many(rule, args, seed):
  """``BATCH`` verifications of one tree with independent keys."""
  batched = [jnp.broadcast_to(x, (BATCH,) + x.shape) for x in args]
  res = _verify_runner(rule)(jax.random.split(jax.random.key(seed), BATCH), *batched)
  return jax.tree.map(np.asarray, res)


@functools.lru_cache(maxsize=None)
def _one_tree(rule):
  """``tree_verify`` of one tree with ``rule`` bound: one function object per rule, so the jitted variants of the
  tests below share their compilations."""
  return functools.partial(tree.tree_verify, rule=rule)


class HandTreeTest(chex.TestCase):
  """Hand-made trees with determined outcomes, one tree at a time, jitted and not (``chex.variants``): each rule
  gives the same τ, path and range of Y both ways; on a random tree, the same results both ways."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_equal_models_accept_first_child_everywhere(self):
    row_V = np.array([0.4, 0.0, 0.3, 0.2, 0.1])
    args = _constant_tree(row_V, row_V, [0, 2, 3, 0])
    for rule in sorted(CHAIN_EQUIVALENT):
      run = self.variant(_one_tree(rule))
      for seed in range(2):
        res = jax.tree.map(np.asarray, run(jax.random.key(seed), *args))
        self.assertEqual(int(res.num_accepted), 2, rule)
        np.testing.assert_array_equal(res.accepted_N, [True, False, True, False], err_msg=rule)
        self.assertGreater(row_V[int(res.next_token)], 0, rule)

  @chex.variants(with_jit=True, without_jit=True)
  def test_disjoint_supports_accept_nothing(self):
    q_V = np.array([0.6, 0.4, 0.0, 0.0, 0.0])
    p_V = np.array([0.0, 0.0, 0.5, 0.3, 0.2])
    args = _constant_tree(q_V, p_V, [0, 1, 0, 1])
    for rule in sorted(CHAIN_EQUIVALENT):
      run = self.variant(_one_tree(rule))
      for seed in range(2):
        res = jax.tree.map(np.asarray, run(jax.random.key(seed), *args))
        self.assertEqual(int(res.num_accepted), 0, rule)
        self.assertFalse(res.accepted_N.any(), rule)
        self.assertIn(int(res.next_token), (2, 3, 4), rule)

  def test_same_results_jitted_and_not(self):
    """A random tree (Dirichlet rows, every outcome possible): every registered tree rule gives the same τ, path and
    Y eagerly as under ``jax.jit`` for the same keys (the jitted functions are those of the variants above)."""
    rng = np.random.default_rng(7)
    n_nodes = len(HAND_PARENTS)
    args = (jnp.asarray(rng.integers(0, 5, n_nodes), jnp.int32), jnp.asarray(HAND_PARENTS),
            jnp.asarray(rng.dirichlet(np.ones(5), n_nodes), jnp.float32),
            jnp.asarray(rng.dirichlet(np.ones(5), n_nodes + 1), jnp.float32))
    for rule in sorted(tree.TREE_RULES):
      jitted = jax.jit(_one_tree(rule))
      for key in jax.random.split(jax.random.key(stable_seed("jitted_and_not")), 2):
        chex.assert_trees_all_equal(_one_tree(rule)(key, *args), jitted(key, *args))

  @chex.variants(with_jit=True, without_jit=True)
  def test_spectr_rho_table(self):
    """ρ in closed form: p = q (ρ = 1), k = 1 (ρ = 1), and p = (½, ½, 0), q = (1, 0, 0), k = 2, where
    β = 1/(2ρ) and 1 − (1 − β)² = ρβ give ρ = 1 + 1/√2 = c and β = 1 − 1/√2."""
    rho_fn = self.variant(tree.spectr_rho)
    one_hot = jnp.array([0.0, 1.0, 0.0])
    self.assertEqual(float(rho_fn(one_hot, one_hot, 4)[0]), 1.0)
    p_V, q_V = jnp.array([0.5, 0.5, 0.0]), jnp.array([1.0, 0.0, 0.0])
    self.assertEqual(float(rho_fn(p_V, q_V, 1)[0]), 1.0)
    rho, beta, scale = (float(v) for v in rho_fn(p_V, q_V, 2))
    np.testing.assert_allclose([rho, beta, scale], [1 + 2**-0.5, 1 - 2**-0.5, 1 + 2**-0.5], rtol=1e-5)
    self.assertLessEqual(scale, rho * (1 + 1e-6))  # the lossless side


@pytest.mark.parametrize("rule", sorted(CHAIN_EQUIVALENT))
def test_equal_models_accept_first_child_everywhere(rule):
  """p == q: the first child is accepted at every node, the bonus comes from the row after the leaf."""
  row_V = np.array([0.4, 0.0, 0.3, 0.2, 0.1])
  res = _verify_many(rule, _constant_tree(row_V, row_V, [0, 2, 3, 0]), seed=stable_seed("equal", rule))
  assert np.all(res.num_accepted == 2)
  assert np.all(res.accepted_N == np.array([True, False, True, False]))
  result = theory.chi2_gof(np.bincount(res.next_token, minlength=5), row_V)
  assert result.p_value > PASS_P


@pytest.mark.parametrize("rule", sorted(CHAIN_EQUIVALENT))
def test_disjoint_supports_accept_nothing(rule):
  """Drafter on {0, 1}, target on {2, 3, 4}: nothing is accepted and Y ~ p exactly."""
  q_V = np.array([0.6, 0.4, 0.0, 0.0, 0.0])
  p_V = np.array([0.0, 0.0, 0.5, 0.3, 0.2])
  res = _verify_many(rule, _constant_tree(q_V, p_V, [0, 1, 0, 1]), seed=stable_seed("disjoint", rule))
  assert np.all(res.num_accepted == 0) and not res.accepted_N.any()
  result = theory.chi2_gof(np.bincount(res.next_token, minlength=5), p_V)
  print(f"disjoint {rule}: Y χ² p = {result.p_value:.4g}")
  assert result.p_value > PASS_P


@pytest.mark.parametrize("rule", sorted(tree.TREE_RULES))
def test_garbage_rows_keep_outputs_in_range(rule):
  """NaN / inf / negative / zero rows and traced out-of-range tokens: ids in [0, V), τ in [0, N], a chain."""
  uniform_V = np.full(5, 0.2)
  cases = {
      "nan_draft": _constant_tree(np.full(5, np.nan), uniform_V, [0, 4, 1, 2]),
      "nan_target": _constant_tree(uniform_V, np.full(5, np.nan), [0, 4, 1, 2]),
      "negative": _constant_tree(-uniform_V, -uniform_V, [0, 4, 1, 2]),
      "zeros": _constant_tree(np.zeros(5), np.zeros(5), [0, 4, 1, 2]),
      "inf": _constant_tree(uniform_V, np.array([0.2, 0.2, np.inf, 0.2, 0.2]), [0, 4, 1, 2]),
      "tokens_out_of_range": _constant_tree(uniform_V, uniform_V, [-1, 5, 2, 3]),
  }
  for name, args in cases.items():
    res = _verify_many(rule, args, seed=stable_seed(name, rule))
    assert np.all((res.next_token >= 0) & (res.next_token < 5)), name
    assert np.all((res.num_accepted >= 0) & (res.num_accepted <= len(HAND_PARENTS))), name
    assert_paths_are_chains(res, HAND_PARENTS)
    if name == "tokens_out_of_range":  # an id outside [0, V) is never accepted (both root children are)
      assert not res.accepted_N.any()


@pytest.mark.parametrize("rule", ["rrs", "spectr"])
def test_with_replacement_rules_verify_every_chain_consistent_with_the_accepted_prefix(rule):
  """SpecTr's two chains (a, b) and (a, c), the target sure of a and then of c: both chains share the accepted
  first token, so the second chain's c is a candidate at depth 2 and is accepted (τ = 2, nodes 0 and 3), every time;
  a walk of node 0's own subtree only would reject b and stop at τ = 1."""
  tokens_N = jnp.asarray([0, 0, 1, 2], jnp.int32)   # depth 1: a, a; depth 2: b under node 0, c under node 1
  parents_N = jnp.asarray([-1, -1, 0, 1], jnp.int32)
  q_NxV = jnp.asarray([[1.0, 0, 0], [1.0, 0, 0], [0, 0.5, 0.5], [0, 0.5, 0.5]], jnp.float32)
  p_N1xV = jnp.asarray([[1.0, 0, 0], [0, 0, 1.0], [0, 0, 1.0], [1 / 3] * 3, [1 / 3] * 3], jnp.float32)
  np.testing.assert_array_equal(np.asarray(tree.prefix_classes(tokens_N, parents_N)), [0, 0, 2, 3])
  for seed in range(20):
    res = tree.tree_verify(jax.random.key(seed), tokens_N, parents_N, q_NxV, p_N1xV, rule=rule)
    assert int(res.num_accepted) == 2 and np.asarray(res.accepted_N).tolist() == [True, False, False, True]
  law = theory_trees.tree_conditional_law(rule, np.asarray(tokens_N), np.asarray(parents_N), np.asarray(q_NxV),
                                          np.asarray(p_N1xV))
  assert law[4].sum() == pytest.approx(1.0)  # the walk ends at node 3, always


def test_spectr_rho_solves_its_equation():
  """ρ from the f32 bisection matches a float64 root (brentq) and lies on the lossless side (c ≤ ρ)."""
  rng = np.random.default_rng(0)
  vocab, trials = 24, 40
  p_TxV, q_TxV = np.zeros((trials, vocab)), np.zeros((trials, vocab))
  k_T = rng.integers(1, 9, size=trials)
  for t in range(trials):
    support = int(rng.integers(2, vocab + 1))  # zero padding beyond the support changes nothing
    p_TxV[t, :support] = rng.dirichlet(np.full(support, 0.5))
    q_TxV[t, :support] = rng.dirichlet(np.full(support, 0.5))
  rho_T, beta_T, scale_T = (np.asarray(v, np.float64) for v in jax.jit(jax.vmap(tree.spectr_rho))(
      jnp.asarray(p_TxV, jnp.float32), jnp.asarray(q_TxV, jnp.float32), jnp.asarray(k_T, jnp.int32)))
  for t in range(trials):
    p_V, q_V, k = p_TxV[t], q_TxV[t], int(k_T[t])

    def excess(r):
      b = np.minimum(q_V, p_V / r).sum()
      return 1 - (1 - b)**k - r * b

    expected = 1.0 if excess(1.0) <= 1e-12 else optimize.brentq(excess, 1.0, k, xtol=1e-14)
    assert rho_T[t] == pytest.approx(expected, rel=1e-5, abs=1e-5), (t, k)
    assert 1.0 <= rho_T[t] <= k
    assert scale_T[t] <= rho_T[t] * (1 + 1e-5)
    assert beta_T[t] == pytest.approx(np.minimum(q_V, p_V / rho_T[t]).sum(), rel=1e-4, abs=1e-6)
  assert np.all(rho_T[k_T == 1] == 1.0)  # k = 1: token verification
  one_hot = jnp.array([0.0, 1.0, 0.0])
  assert float(tree.spectr_rho(one_hot, one_hot, 4)[0]) == 1.0  # p == q


# --- registry and errors --------------------------------------------------------------------------------------------

def test_registry_dispatch_and_sampling(monkeypatch):
  assert tree.tree_sampling("rrs") == "with_replacement"
  assert tree.tree_sampling("rrs_wor") == "without_replacement"
  assert tree.tree_sampling("spectr") == "with_replacement"
  calls = []

  def dummy(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV):
    calls.append(tokens_N.shape)
    return tree.rrs_tree_verify(key, tokens_N, parents_N, draft_probs_NxV, target_probs_N1xV)

  monkeypatch.setitem(tree.TREE_RULES, "dummy", (dummy, tree.WITH_REPLACEMENT))
  args = _constant_tree(np.full(5, 0.2), np.full(5, 0.2), [0, 1, 2, 3])
  shapes = jax.eval_shape(functools.partial(tree.tree_verify, rule="dummy"), jax.random.key(0), *args)
  assert shapes.accepted_N.shape == (4,) and shapes.num_accepted.dtype == jnp.int32
  assert calls == [(4,)] and tree.tree_sampling("dummy") == "with_replacement"
  with pytest.raises(ValueError, match="known rules: .*dummy.*rrs.*rrs_wor.*spectr"):
    tree.tree_verify(jax.random.key(0), *args, rule="nope")
  with pytest.raises(ValueError, match="unknown tree verification rule 'nope'"):
    tree.tree_sampling("nope")
  monkeypatch.setitem(tree.TREE_RULES, "bad_mode", (dummy, "sometimes"))
  with pytest.raises(ValueError, match="sampling 'sometimes'"):
    tree.tree_sampling("bad_mode")


def test_chain_parents():
  np.testing.assert_array_equal(tree.chain_parents(4), [-1, 0, 1, 2])
  assert tree.chain_parents(1).dtype == np.int32
  with pytest.raises(ValueError, match="gamma"):
    tree.chain_parents(0)


def test_shape_and_parent_errors():
  key = jax.random.key(0)
  tokens_N, parents_N = jnp.array([0, 1, 1, 0], jnp.int32), jnp.array([-1, -1, 0, 1], jnp.int32)
  q_NxV, p_N1xV = jnp.full((4, 2), 0.5), jnp.full((5, 2), 0.5)
  verify = functools.partial(tree.tree_verify, key, rule="rrs")
  bad = {
      "tokens_N must have shape": (tokens_N[None], parents_N, q_NxV, p_N1xV),
      "tokens_N must be integers": (tokens_N.astype(jnp.float32), parents_N, q_NxV, p_N1xV),
      "parents_N must be integers": (tokens_N, parents_N.astype(jnp.float32), q_NxV, p_N1xV),
      "parents_N has 3 entries": (tokens_N, parents_N[:3], q_NxV, p_N1xV),
      "draft_probs_NxV must have rank 2": (tokens_N, parents_N, q_NxV[None], p_N1xV),
      "target_probs_N1xV must have rank 2": (tokens_N, parents_N, q_NxV, p_N1xV[0]),
      "draft_probs_NxV must be floating": (tokens_N, parents_N, q_NxV.astype(jnp.int32), p_N1xV),
      "draft_probs_NxV must have N = 4 rows": (tokens_N, parents_N, q_NxV[:3], p_N1xV),
      "target_probs_N1xV must have N \\+ 1 = 5 rows": (tokens_N, parents_N, q_NxV, p_N1xV[:4]),
      "vocabulary mismatch": (tokens_N, parents_N, q_NxV, jnp.ones((5, 3), jnp.float32) / 3),
      "N >= 1": (tokens_N[:0], parents_N[:0], q_NxV[:0], p_N1xV[:1]),
      "topological.*parents\\[1\\] = 1": (tokens_N, jnp.array([-1, 1, 0, 1], jnp.int32), q_NxV, p_N1xV),
      "parents\\[2\\] = -2": (tokens_N, jnp.array([-1, -1, -2, 1], jnp.int32), q_NxV, p_N1xV),
      "children of node -1 are not consecutive": (tokens_N, jnp.array([-1, 0, -1, 1], jnp.int32), q_NxV, p_N1xV),
      "tokens_N out of range": (jnp.array([0, 2, 1, 0], jnp.int32), parents_N, q_NxV, p_N1xV),
  }
  for message, args in bad.items():
    with pytest.raises(ValueError, match=message):
      verify(*args)
  # Shape errors fire at trace time under jit / vmap as well.
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    jax.jit(verify)(tokens_N, parents_N, q_NxV, jnp.ones((5, 3), jnp.float32) / 3)
  with pytest.raises(ValueError, match="tokens_N must have shape"):
    jax.vmap(verify)(tokens_N[None, None], parents_N[None], q_NxV[None], p_N1xV[None])


def test_point_mass_rule_keeps_the_longest_prefix_any_path_shares_with_a_greedy_target():
  """T = 0 (one-hot target rows) over p fixed chains (BPD's p best paths; shared prefixes merged): the point-mass rule
  accepts exactly the longest prefix any chain shares with the target's greedy continuation, whatever the key, and
  Y is the target's next greedy token; the draft rows are never read (uniform here)."""
  rng = np.random.default_rng(0)
  vocab, width, depth = 3, 4, 3
  node_N = np.arange(width * depth)
  parents_N = np.where(node_N < width, -1, node_N - width)
  keys = jax.random.split(jax.random.key(5), 8)
  run = jax.jit(jax.vmap(tree.point_mass_tree_verify, in_axes=(0, None, None, None, None)))
  seen = set()
  for _ in range(40):
    greedy = rng.integers(0, vocab, depth + 1)
    paths_WxG = rng.integers(0, vocab, (width, depth))
    tokens_N = paths_WxG.T.reshape(-1)
    rows = [np.eye(vocab)[greedy[0]]]
    for n in node_N:
      d, w = n // width + 1, n % width
      on_greedy = np.array_equal(paths_WxG[w, :d], greedy[:d])
      rows.append(np.eye(vocab)[greedy[d] if on_greedy else (7 * n + 1) % vocab])
    matched = [next((j for j in range(depth) if paths_WxG[w, j] != greedy[j]), depth) for w in range(width)]
    expected = max(matched)
    seen.add(expected)
    res = run(keys, jnp.asarray(tokens_N, jnp.int32), jnp.asarray(parents_N, jnp.int32),
              jnp.full((width * depth, vocab), 1.0 / vocab, jnp.float32), jnp.asarray(np.stack(rows), jnp.float32))
    assert np.asarray(res.num_accepted).tolist() == [expected] * len(keys)
    assert np.asarray(res.next_token).tolist() == [int(greedy[expected])] * len(keys)
    accepted_tokens = tokens_N[np.asarray(res.accepted_N[0])]
    np.testing.assert_array_equal(accepted_tokens, greedy[:expected])
  assert seen == set(range(depth + 1))  # every prefix length occurred
