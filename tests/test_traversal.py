"""Traversal verification (blockspec_jax.verify.traversal): chains against block verification's exact law, trees
against the target's sequence law, the jitted rule against an independent float64 transcription (itself checked
exactly lossless by enumeration), and hand-made cases.

Trees and continuations are drawn in numpy and every call of the rule is padded to one batch size, so the module
compiles the rule once per (sampling mode, N, V).

χ² goodness of fit with fixed seeds (zlib.crc32, never hash()): p > 1e-3 where the law must match; the outcome is
deterministic because the seeds are.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import theory
from blockspec_jax.verify import rules
from blockspec_jax.verify.traversal import (TreeVerifyResult, traversal_verify, traversal_verify_with_replacement,
                                            tree_postorder)
from helpers import PASS_P, stable_seed

RULES = {True: traversal_verify, False: traversal_verify_with_replacement}  # keyed by "without replacement"




def layout(branching) -> tuple[int, ...]:
  """Parents of the full tree with ``branching[d]`` children per node at depth d, numbered level by level."""
  parents, level = [], [-1]
  for width in branching:
    new_level = []
    for u in level:
      for _ in range(width):
        parents.append(u)
        new_level.append(len(parents) - 1)
    level = new_level
  return tuple(parents)


def path_to(parents, tokens, n) -> tuple:
  path = []
  while n != -1:
    path.append(tokens[n])
    n = parents[n]
  return tuple(path[::-1])


# --- drafting trees from tabular models (numpy, vectorised over samples) -------------------------------------------

def _rows_of(lm, prefix_BxL) -> np.ndarray:
  """Row indices of ``lm`` for a batch of equal-length prefixes (vectorised ``TabularLM.row_index``): int ``[B]``."""
  vocab, length = lm.vocab_size, prefix_BxL.shape[1]
  m = min(length, lm.depth)
  index_B = np.full(prefix_BxL.shape[0], sum(vocab**l for l in range(m)), np.int64)
  for j in range(m):
    index_B += prefix_BxL[:, length - m + j] * vocab**(m - 1 - j)
  return index_B


def _draw(rng, weights_BxV) -> np.ndarray:
  """One index per row, proportional to the non-negative ``weights_BxV`` (inverse CDF, float64)."""
  cdf_BxV = np.cumsum(weights_BxV, axis=1)
  u_B = rng.random(weights_BxV.shape[0]) * cdf_BxV[:, -1]
  return np.minimum(np.sum(cdf_BxV <= u_B[:, None], axis=1), weights_BxV.shape[1] - 1)


def draw_trees(rng, drafter, target, context, parents, num, without_replacement):
  """``num`` trees: tokens int32 ``[B, N]``, drafter rows ``[B, N, V]`` (parent contexts, before removal), target
  rows ``[B, N+1, V]`` (f32) and the node paths (with the context) as int ``[B, N, len(context) + depth]``."""
  num_nodes, ctx_len = len(parents), len(context)
  depth_N = [len(path_to(parents, list(range(num_nodes)), n)) for n in range(num_nodes)]
  paths_BxNxT = np.zeros((num, num_nodes, ctx_len + max(depth_N)), np.int64)
  paths_BxNxT[:, :, :ctx_len] = context
  tokens_BxN = np.zeros((num, num_nodes), np.int64)
  q_BxNxV = np.zeros((num, num_nodes, target.vocab_size))
  ctx_B = np.tile(np.asarray(context, np.int64), (num, 1))
  for n, u in enumerate(parents):
    prefix = ctx_B if u < 0 else paths_BxNxT[:, u, :ctx_len + depth_N[u]]
    q_BxNxV[:, n] = drafter.probs[_rows_of(drafter, prefix)]
    weights_BxV = q_BxNxV[:, n].copy()
    if without_replacement:
      for m in range(n):
        if parents[m] == u:
          weights_BxV[np.arange(num), tokens_BxN[:, m]] = 0.0
    tokens_BxN[:, n] = _draw(rng, weights_BxV)
    paths_BxNxT[:, n, :prefix.shape[1]] = prefix
    paths_BxNxT[:, n, prefix.shape[1]] = tokens_BxN[:, n]
  p_rows = [target.probs[_rows_of(target, ctx_B)]]
  p_rows += [target.probs[_rows_of(target, paths_BxNxT[:, n, :ctx_len + depth_N[n]])] for n in range(num_nodes)]
  return (tokens_BxN.astype(np.int32), q_BxNxV.astype(np.float32), np.stack(p_rows, 1).astype(np.float32),
          paths_BxNxT)


def emitted_sequences(rng, target, context, parents, paths_BxNxT, res, length) -> np.ndarray:
  """The first ``length`` tokens after ``context``: the accepted chain, Y, then the target's own samples."""
  ctx_len, num = len(context), paths_BxNxT.shape[0]
  tau_B, y_B, acc_BxN = np.asarray(res.num_accepted), np.asarray(res.next_token), np.asarray(res.accepted_N)
  depth_N = np.array([len(path_to(parents, list(range(len(parents))), n)) for n in range(len(parents))])
  node_B = np.argmax(np.where(acc_BxN, depth_N, 0), axis=1)
  seq_BxT = np.zeros((num, ctx_len + length), np.int64)
  seq_BxT[:, :ctx_len] = context
  width = min(paths_BxNxT.shape[2], ctx_len + length)
  seq_BxT[:, :width] = np.where(tau_B[:, None] > 0, paths_BxNxT[np.arange(num), node_B, :width], seq_BxT[:, :width])
  seq_BxT[:, :ctx_len] = context
  seq_BxT[tau_B < length, ctx_len + tau_B[tau_B < length]] = y_B[tau_B < length]
  for i in range(length):
    todo_B = tau_B < i
    rows_BxV = target.probs[_rows_of(target, seq_BxT[todo_B, :ctx_len + i])]
    seq_BxT[todo_B, ctx_len + i] = _draw(rng, rows_BxV)
  return seq_BxT[:, ctx_len:]


CHUNK = 50_000  # every batch is padded to this size: one compile per (rule, N, V) for the whole module


@functools.lru_cache(maxsize=None)
def batched_rule(without_replacement):
  return jax.jit(jax.vmap(RULES[without_replacement]))


def run_batched(without_replacement, keys, tokens, parents, q, p) -> TreeVerifyResult:
  """The rule under ``jit(vmap)`` for every key; the tree arrays are per key (leading axis) or shared (no axis)."""
  num = keys.shape[0]
  args = [np.broadcast_to(np.asarray(x), (num,) + np.shape(x)[-rank:]) if np.ndim(x) == rank else np.asarray(x)
          for x, rank in ((tokens, 1), (parents, 1), (q, 2), (p, 2))]
  dtypes = (np.int32, np.int32, np.float32, np.float32)
  outs = []
  for start in range(0, num, CHUNK):
    stop = min(start + CHUNK, num)
    index = np.minimum(np.arange(start, start + CHUNK), num - 1)  # the last row repeated as padding
    chunk_args = [np.asarray(a, dtype)[index] for a, dtype in zip(args, dtypes)]
    res = batched_rule(without_replacement)(keys[index], *chunk_args)
    outs.append(jax.tree_util.tree_map(lambda x: np.asarray(x)[:stop - start], res))
  return jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *outs)


def counts_of(rows) -> dict:
  counts = {}
  for row in map(tuple, np.asarray(rows).tolist()):
    counts[row] = counts.get(row, 0) + 1
  return counts


# --- an independent float64 transcription of the rule (the specification) ----------------------------------------

def _clipped(w, p, q):
  return min(1.0, w * p / q) if q > 0 else (1.0 if w * p > 0 else 0.0)


def exact_tree_law(tokens, parents, q_rows, p_rows, without_replacement) -> dict:
  """``P(accepted node, Y | tree)`` as ``{(node or -1, y): prob}`` by enumerating every coin outcome (float64)."""
  num_nodes = len(tokens)
  children = {u: [n for n in range(num_nodes) if parents[n] == u] for u in range(-1, num_nodes)}
  order = []

  def post(u):
    for c in children[u]:
      post(c)
    if u >= 0:
      order.append(u)
  post(-1)
  law = {}

  def emit(node, row, mass):
    row = np.asarray(row, np.float64)
    for y in range(row.shape[0]):
      if row[y] > 0:
        law[node, y] = law.get((node, y), 0.0) + mass * row[y] / row.sum()

  def alpha_of(n, rows, drafts, fixed):
    if n == -1:
      return 1.0
    if n in fixed:
      return fixed[n]
    u = parents[n]
    return _clipped(alpha_of(u, rows, drafts, fixed), rows[u][tokens[n]], drafts[u][tokens[n]])

  def visit(t, rows, drafts, fixed, mass):
    if t == num_nodes:
      emit(-1, rows[-1], mass)
      return
    v = order[t]
    alpha = alpha_of(v, rows, drafts, fixed)
    if alpha > 0:
      emit(v, rows[v], mass * alpha)
    if alpha < 1:
      u = parents[v]
      alpha_u = alpha_of(u, rows, drafts, fixed)
      residual = np.maximum(alpha_u * rows[u] - drafts[u], 0.0)
      mass_s = residual.sum()
      rows, drafts, fixed = dict(rows), dict(drafts), dict(fixed)
      rows[u] = residual / mass_s if mass_s > 0 else rows[u]
      fixed[u] = mass_s / (mass_s + 1.0 - alpha_u) if mass_s + 1.0 - alpha_u > 0 else 1.0
      if without_replacement:
        kept = drafts[u].copy()
        kept[tokens[v]] = 0.0
        drafts[u] = kept / kept.sum() if kept.sum() > 0 else kept
      visit(t + 1, rows, drafts, fixed, mass * (1.0 - alpha))

  rows = {-1: np.asarray(p_rows[0], np.float64)}
  rows.update({n: np.asarray(p_rows[n + 1], np.float64) for n in range(num_nodes)})
  drafts = {parents[n]: np.asarray(q_rows[n], np.float64) for n in range(num_nodes)}
  visit(0, rows, drafts, {}, 1.0)
  return law


def exact_emitted_law(drafter, target, context, parents, draw_without, rule_without) -> dict:
  """Law of the emitted tuple ``(chain tokens, Y)`` of one iteration, over every tree (float64 enumeration)."""
  vocab, law = target.vocab_size, {}

  def draw(tokens, prob):
    n = len(tokens)
    if n == len(parents):
      path = functools.partial(path_to, parents, tokens)
      p_rows = [target.next_probs(context)] + [target.next_probs(context + path(m)) for m in range(n)]
      q_rows = [drafter.next_probs(context + path(parents[m])) for m in range(n)]
      for (node, y), pr in exact_tree_law(tokens, parents, q_rows, p_rows, rule_without).items():
        outcome = (path(node) if node >= 0 else ()) + (y,)
        law[outcome] = law.get(outcome, 0.0) + prob * pr
      return
    q = np.array(drafter.next_probs(context + path_to(parents, tokens, parents[n])))
    if draw_without:
      for m in range(n):
        if parents[m] == parents[n]:
          q[tokens[m]] = 0.0
      q = q / q.sum()
    for x in range(vocab):
      if q[x] > 0:
        draw(tokens + [x], prob * q[x])

  draw([], 1.0)
  return law


def _max_gap(law_a, law_b):
  return max(abs(law_a.get(k, 0.0) - law_b.get(k, 0.0)) for k in set(law_a) | set(law_b))


# --- 1. the specification is exact ---------------------------------------------------------------------------------

@pytest.mark.parametrize("without_replacement", [True, False])
def test_specification_is_exactly_lossless_and_mixing_sampling_modes_is_not(without_replacement):
  """Exact enumeration over every (2, 2) tree on V = 3: the first three tokens have the target law to 1e-12 when the
  rule matches how siblings were drawn, and are off by far more when it does not."""
  drafter, target = theory.TabularLM.random(11, 3, 2, 1.0), theory.TabularLM.random(12, 3, 2, 1.0)
  context, parents = (1,), layout((2, 2))
  want = theory.sequence_law(target, context, 3)
  matched = exact_emitted_law(drafter, target, context, parents, without_replacement, without_replacement)
  mixed = exact_emitted_law(drafter, target, context, parents, without_replacement, not without_replacement)
  assert _max_gap(theory.emitted_prefix_law(matched, target, context, 3), want) < 1e-12
  assert _max_gap(theory.emitted_prefix_law(mixed, target, context, 3), want) > 1e-3


def test_specification_on_a_chain_is_block_verification():
  drafter, target = theory.TabularLM.random(1, 3, 2, 0.5), theory.TabularLM.random(2, 3, 2, 0.5)
  law = exact_emitted_law(drafter, target, (0,), layout((1, 1, 1)), True, True)
  assert _max_gap(law, theory.exact_outcome_law("block", drafter, target, (0,), 3)) < 1e-12


# --- 2. chains: block verification's law, and its outcome key for key ---------------------------------------------

def test_chain_law_equals_block_verification():
  """Law of τ and of (X^τ, Y) on γ = 3 chains drawn from the drafter = block verification's exact law (200k seeded
  samples, χ²)."""
  drafter, target = theory.TabularLM.random(1, 3, 2, 0.5), theory.TabularLM.random(2, 3, 2, 0.5)
  context, gamma, num = (0,), 3, 200_000
  rng = np.random.default_rng(stable_seed("chain", "draw"))
  tokens, q, p, _ = draw_trees(rng, drafter, target, context, layout((1,) * gamma), num, True)
  keys = jax.random.split(jax.random.key(stable_seed("chain", "verify")), num)
  res = run_batched(True, keys, tokens, np.arange(-1, gamma - 1), q, p)
  tau, y = res.num_accepted, res.next_token
  np.testing.assert_array_equal(res.accepted_N, np.arange(gamma)[None, :] < tau[:, None])
  outcomes = {}
  for draft, t, last in zip(tokens.tolist(), tau.tolist(), y.tolist()):
    outcome = tuple(draft[:t]) + (last,)
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
  res_out = theory.chi2_gof(outcomes, theory.exact_outcome_law("block", drafter, target, context, gamma))
  res_tau = theory.chi2_gof(np.bincount(tau, minlength=gamma + 1),
                            theory.exact_tau_law("block", drafter, target, context, gamma))
  print(f"chain: (X^τ, Y) χ² p = {res_out.p_value:.4g} (dof {res_out.dof}), τ χ² p = {res_tau.p_value:.4g} "
        f"(dof {res_tau.dof})")
  assert res_out.p_value > PASS_P and res_tau.p_value > PASS_P


def test_chain_same_key_same_outcome_as_block_verify():
  """On a chain, node n's coin is block verification's η_{n+1} and the key split is the same: identical outcomes."""
  rng = np.random.default_rng(5)
  num, gamma, vocab = 20_000, 3, 3
  q = rng.dirichlet(np.full(vocab, 0.5), size=(num, gamma)).astype(np.float32)
  p = rng.dirichlet(np.full(vocab, 0.5), size=(num, gamma + 1)).astype(np.float32)
  x = _draw(rng, q.reshape(-1, vocab).astype(np.float64)).reshape(num, gamma).astype(np.int32)
  keys = jax.random.split(jax.random.key(3), num)
  ours = run_batched(True, keys, x, np.arange(-1, gamma - 1), q, p)
  block = jax.jit(jax.vmap(rules.block_verify))(keys, x, q, p)
  np.testing.assert_array_equal(ours.num_accepted, np.asarray(block.num_accepted))
  np.testing.assert_array_equal(ours.next_token, np.asarray(block.next_token))


# --- 3. trees: the target's law ------------------------------------------------------------------------------------

TREE_CASES = {  # N = 6 nodes and V = 4 in every case (one compile per rule)
    "v4_d2_b22": (lambda: (theory.TabularLM.random(21, 4, 2, 1.0), theory.TabularLM.random(22, 4, 2, 1.0)), (3,),
                  (2, 2)),
    "v4_d1_b31": (lambda: (theory.TabularLM.random(23, 4, 1, 0.7), theory.TabularLM.random(24, 4, 1, 0.7)), (0,),
                  (3, 1)),
}


@pytest.mark.parametrize("without_replacement", [True, False], ids=["without_replacement", "with_replacement"])
@pytest.mark.parametrize("case", sorted(TREE_CASES))
def test_tree_emits_the_target_law(case, without_replacement):
  """One iteration on trees drawn as the rule requires, then the target: the first 1, 2 and 3 tokens have the
  target's law (200k seeded samples, χ²)."""
  make, context, branching = TREE_CASES[case]
  drafter, target = make()
  parents, length, num = layout(branching), len(branching) + 1, 200_000
  rng = np.random.default_rng(stable_seed("tree", case, without_replacement))
  tokens, q, p, paths = draw_trees(rng, drafter, target, context, parents, num, without_replacement)
  keys = jax.random.split(jax.random.key(stable_seed("tree", case, without_replacement, "verify")), num)
  res = run_batched(without_replacement, keys, tokens, parents, q, p)
  seqs = emitted_sequences(rng, target, context, parents, paths, res, length)
  p_values = [theory.chi2_gof(counts_of(seqs[:, :n]), theory.sequence_law(target, context, n)).p_value
              for n in range(1, length + 1)]
  print(f"tree {case} {'w/o' if without_replacement else 'with'} replacement: first 1/2/{length} tokens χ² p = "
        + ", ".join(f"{v:.4g}" for v in p_values) + f"; E[τ] ≈ {np.mean(res.num_accepted):.3f}")
  assert min(p_values) > PASS_P


def random_instances(rng, parents, num, without_replacement, vocab=4):
  """``num`` random trees of one shape: drafter rows (shared by siblings), target rows partly mixed with the drafter's
  (so that acceptance probabilities are moderate and every node gets some mass), tokens drawn as the rule requires."""
  num_nodes = len(parents)
  q_KxNxV = rng.dirichlet(np.ones(vocab), size=(num, num_nodes))
  p_KxN1xV = rng.dirichlet(np.ones(vocab), size=(num, num_nodes + 1))
  mix_K1 = rng.uniform(0.0, 0.7, size=(num, 1))
  tokens_KxN = np.zeros((num, num_nodes), np.int64)
  for n, u in enumerate(parents):
    if n > 0 and parents[n - 1] == u:
      q_KxNxV[:, n] = q_KxNxV[:, n - 1]
    else:
      p_KxN1xV[:, u + 1] = mix_K1 * q_KxNxV[:, n] + (1.0 - mix_K1) * p_KxN1xV[:, u + 1]
    weights_KxV = q_KxNxV[:, n].copy()
    if without_replacement:
      for m in range(n):
        if parents[m] == u:
          weights_KxV[np.arange(num), tokens_KxN[:, m]] = 0.0
    tokens_KxN[:, n] = _draw(rng, weights_KxV)
  return tokens_KxN, q_KxNxV, p_KxN1xV


@pytest.mark.parametrize("without_replacement", [True, False])
@pytest.mark.parametrize("parents", [(-1, -1, 0, 0, 1, 1), (-1, -1, -1, 0, 0, 3)], ids=["b22", "irregular"])
def test_jitted_rule_matches_the_specification(parents, without_replacement):
  """The law of (accepted node, Y) over 500 random trees × 200 keys = the mean of the float64 transcription's exact
  laws (χ²): the jitted rule is the specification, internal nodes and residual rows included."""
  num_instances, keys_per_instance = 500, 200
  rng = np.random.default_rng(stable_seed("spec", parents, without_replacement))
  tokens, q, p = random_instances(rng, parents, num_instances, without_replacement)
  law = {}
  for k in range(num_instances):
    for outcome, prob in exact_tree_law(tokens[k].tolist(), parents, q[k], p[k], without_replacement).items():
      law[outcome] = law.get(outcome, 0.0) + prob / num_instances
  keys = jax.random.split(jax.random.key(stable_seed("spec", parents, without_replacement, "verify")),
                          num_instances * keys_per_instance)
  rep = lambda x: np.repeat(x, keys_per_instance, axis=0)
  res = run_batched(without_replacement, keys, rep(tokens), parents, rep(q), rep(p))
  depth_N = np.array([len(path_to(parents, list(range(len(parents))), n)) for n in range(len(parents))])
  node = np.where(res.accepted_N.any(1), np.argmax(np.where(res.accepted_N, depth_N, 0), axis=1), -1)
  np.testing.assert_array_equal(res.num_accepted, res.accepted_N.sum(1))
  chi2 = theory.chi2_gof(counts_of(np.stack([node, res.next_token], 1)), law)
  node_mass = {n: round(float(sum(v for (m, _), v in law.items() if m == n)), 3) for n in range(-1, len(parents))}
  print(f"spec {parents} (w/o replacement = {without_replacement}): χ² p = {chi2.p_value:.4g} (dof {chi2.dof}); "
        f"mass per accepted node {node_mass}")
  assert chi2.p_value > PASS_P


# --- 4. hand-made cases, garbage and shapes --------------------------------------------------------------------------

def _same_rows(row_V, num_nodes=6):
  row_V = np.asarray(row_V, np.float32)
  return np.tile(row_V, (num_nodes, 1)), np.tile(row_V, (num_nodes + 1, 1))


def test_postorder():
  postorder = jax.jit(tree_postorder)
  np.testing.assert_array_equal(postorder(jnp.array([-1, -1, 0, 0, 1, 1])), [2, 3, 0, 4, 5, 1])
  np.testing.assert_array_equal(postorder(jnp.array([-1, 0, 0, -1, 2, 1])), [5, 1, 4, 2, 0, 3])
  np.testing.assert_array_equal(postorder(jnp.array([-1, 0, 1, 2, 3, 4])), [5, 4, 3, 2, 1, 0])


def test_equal_models_accept_the_first_deepest_path():
  """p == q everywhere: the first leaf in post-order (first children all the way down) is accepted."""
  parents = np.array([-1, -1, 0, 0, 2, 1])  # first-child chain 0 → 2 → 4
  tokens = np.array([0, 1, 2, 3, 1, 0])
  q_NxV, p_N1xV = _same_rows([0.1, 0.2, 0.3, 0.4])
  for without_replacement in RULES:
    res = run_batched(without_replacement, jax.random.split(jax.random.key(0), 64), tokens, parents, q_NxV, p_N1xV)
    np.testing.assert_array_equal(res.num_accepted, 3)
    np.testing.assert_array_equal(res.accepted_N, np.tile([True, False, True, False, True, False], (64, 1)))


def test_disjoint_support_accepts_nothing_and_draws_from_the_root_row():
  """The drafter puts its mass where the target has none: every node is rejected and Y ~ p_root."""
  parents = np.array([-1, -1, 0, 1, 2, 3])
  tokens = np.array([0, 1, 0, 1, 0, 1])
  q_NxV, _ = _same_rows([0.5, 0.5, 0.0, 0.0])
  p_root_V = np.array([0.0, 0.0, 0.3, 0.7])
  _, p_N1xV = _same_rows(p_root_V)
  for without_replacement in RULES:
    res = run_batched(without_replacement, jax.random.split(jax.random.key(stable_seed("disjoint")), 50_000), tokens,
                      parents, q_NxV, p_N1xV)
    assert not res.accepted_N.any() and not res.num_accepted.any()
    assert theory.chi2_gof(np.bincount(res.next_token, minlength=4), p_root_V).p_value > PASS_P


def test_garbage_stays_in_range():
  """NaN rows, invalid parents and out-of-range tokens: outputs stay valid (a chain, τ ∈ [0, N], Y ∈ [0, V))."""
  vocab, num_nodes = 4, 6
  q_NxV, p_N1xV = _same_rows(np.full(vocab, 0.25))
  tokens, parents = np.array([0, 1, 2, 3, 0, 1]), np.array([-1, 0, 0, 1, 1, 2])
  nan_q, nan_p = q_NxV.copy(), np.full_like(p_N1xV, np.nan)
  nan_q[1] = np.nan
  negative_p = p_N1xV.copy()
  negative_p[0] = -1.0
  cases = [(tokens, parents, nan_q, p_N1xV), (tokens, parents, q_NxV, nan_p),
           (np.array([9, -3, 2, 3, 1, 0]), np.array([-1, 7, 0, 3, -5, 2]), q_NxV, negative_p),
           (tokens, parents, np.zeros_like(q_NxV), np.zeros_like(p_N1xV))]
  keys = jax.random.split(jax.random.key(1), 256)
  for tokens_N, parents_N, q, p in cases:
    safe = np.where((parents_N >= -1) & (parents_N < np.arange(num_nodes)), parents_N, -1)
    for without_replacement in RULES:
      res = run_batched(without_replacement, keys, tokens_N, parents_N, q, p)
      tau, acc, y = res.num_accepted, res.accepted_N, res.next_token
      assert ((0 <= y) & (y < vocab)).all() and ((0 <= tau) & (tau <= num_nodes)).all()
      np.testing.assert_array_equal(acc.sum(1), tau)
      for row in acc:  # the accepted nodes form a root-to-node chain
        nodes = np.flatnonzero(row)
        assert all(safe[b] == a for a, b in zip(itertools.chain([-1], nodes), nodes))


def test_vmap_over_different_tree_shapes():
  """A batch may mix tree shapes (parents is data): each row equals the rule run on that tree alone."""
  q_NxV, p_N1xV = _same_rows([0.1, 0.2, 0.3, 0.4])
  p_N1xV[1:] = [0.5, 0.2, 0.2, 0.1]
  parents_BxN = np.array([[-1, 0, 1, 2, 3, 4], [-1, -1, 0, 0, 1, 1], [-1, -1, -1, -1, -1, -1]])
  tokens_BxN = np.tile([0, 1, 2, 3, 0, 1], (3, 1))
  keys = jax.random.split(jax.random.key(2), 3)
  mixed = run_batched(True, keys, tokens_BxN, parents_BxN, q_NxV, p_N1xV)
  for b in range(3):
    alone = run_batched(True, keys, tokens_BxN[b], parents_BxN[b], q_NxV, p_N1xV)
    for field in ("num_accepted", "accepted_N", "next_token"):
      np.testing.assert_array_equal(getattr(alone, field)[b], getattr(mixed, field)[b])


def test_shape_errors_at_trace_time():
  key = jax.random.key(0)
  tokens, parents = jnp.zeros((3,), jnp.int32), jnp.array([-1, 0, 1], jnp.int32)
  q, p = jnp.full((3, 4), 0.25), jnp.full((4, 4), 0.25)
  rule = jax.jit(traversal_verify)
  with pytest.raises(ValueError, match="tokens_N must have shape"):
    rule(key, tokens[None], parents, q, p)
  with pytest.raises(ValueError, match="must be integers"):
    rule(key, tokens.astype(jnp.float32), parents, q, p)
  with pytest.raises(ValueError, match="parents_N has 2 entries but tokens_N has N = 3"):
    rule(key, tokens, parents[:2], q, p)
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    rule(key, tokens, parents, q, jnp.full((4, 5), 0.2))
  with pytest.raises(ValueError, match="draft_probs_NxV must have N = 3 rows"):
    rule(key, tokens, parents, q[:2], p)
  with pytest.raises(ValueError, match="target_probs_N1xV must have N \\+ 1 = 4 rows"):
    rule(key, tokens, parents, q, p[:3])
  with pytest.raises(ValueError, match="at least one node"):
    rule(key, tokens[:0], parents[:0], q[:0], p[:1])
  with pytest.raises(ValueError, match="coins must have shape"):
    rule(key, tokens, parents, q, p, coins=jnp.zeros((2,)))
