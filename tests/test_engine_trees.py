"""The engine on trees: one target pass under the tree mask scores every node as an autoregressive pass over its
root-to-node path would, and the path commit leaves the cache a fresh autoregressive pass would leave."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import sampling
from blockspec_jax import contracts
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.models import decoder as dec
from blockspec_jax.models.scorer import DecoderScorer

from test_speculative import init_params

T1 = sampling.Sampler(temperature=1.0)

# Two rows with different trees (same N = 6); siblings consecutive, topological.
PARENTS = np.array([[-1, -1, 0, 0, 1, 2],     # root → {0, 1}; 0 → {2, 3}; 1 → {4}; 2 → {5}
                    [-1, -1, -1, 0, 1, 4]],   # root → {0, 1, 2}; 0 → {3}; 1 → {4}; 4 → {5}
                   np.int32)
TOKENS = np.array([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]], np.int32)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


@dataclasses.dataclass(frozen=True)
class FixedTreeDrafter:
  """Proposes the module's fixed trees with uniform rows q (no model): only the target side is under test."""
  vocab_size: int
  max_len = None
  sibling_sampling = "without_replacement"
  is_chain = False

  def num_nodes(self, gamma):
    return TOKENS.shape[1]

  def init_state(self, params, tokens_BxP, prompt_len_B, max_len):
    return None

  def propose(self, params, state, tokens_BxS, length_B, key_B, gamma, sampler):
    q_BxNxV = jnp.full(TOKENS.shape + (self.vocab_size,), 1.0 / self.vocab_size, jnp.float32)
    return state, contracts.Draft(jnp.asarray(TOKENS), jnp.asarray(PARENTS), q_BxNxV)

  def commit(self, params, state, commit):
    return state


def path_to(parents, node):
  path = []
  while node >= 0:
    path.append(node)
    node = parents[node]
  return path[::-1]


def fresh_pass(config, params, rows, cache_len):
  """Autoregressive-equivalent prefill over each row's tokens: (logits [B, W, V], cache)."""
  tokens_BxW, _ = spec.prepare_prompts(rows)
  batch, width = tokens_BxW.shape
  positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
  cache = dec.init_cache(config, batch, cache_len)
  return dec.Decoder(config).apply({"params": params}, tokens_BxW, positions, cache,
                                   dec.causal_mask(positions, cache_len))


def test_tree_pass_scores_root_to_node_paths_and_path_commit_restores_the_cache():
  config = dec.DecoderConfig.tiny(vocab_size=64, num_layers=2)
  params = init_params(config, 7)
  target = DecoderScorer(config)
  drafter = FixedTreeDrafter(config.vocab_size)
  tokens_BxP, lens_B = spec.prepare_prompts(PROMPTS)
  state = spec.speculative_prefill(params, None, tokens_BxP, lens_B, target=target, drafter=drafter, gamma=3,
                                   max_new_tokens=8)
  cache_len = state.tokens_BxS.shape[1]
  assert cache_len == tokens_BxP.shape[1] + 8 + TOKENS.shape[1] + 1
  scored = spec.draft_and_score(params, None, state, jax.random.split(jax.random.key(0), 2), target=target,
                                drafter=drafter, gamma=3, sampler=T1)
  np.testing.assert_array_equal(scored.depth_BxN, [[1, 1, 2, 2, 2, 3], [1, 1, 1, 2, 2, 3]])

  # Every node's target row equals the row of an autoregressive pass over prompt + its root-to-node path (all such
  # rows in one right-padded batch: causal attention keeps the padding out of every real position).
  rows, where = [], []
  for b, prompt in enumerate(PROMPTS):
    rows.append(prompt)
    where.append((b, 0))
    for n in range(TOKENS.shape[1]):
      rows.append(prompt + [int(TOKENS[b, m]) for m in path_to(PARENTS[b], n)])
      where.append((b, n + 1))
  logits, _ = fresh_pass(config, params, rows, cache_len)
  for i, (row, (b, t)) in enumerate(zip(rows, where)):
    np.testing.assert_allclose(scored.p_BxN1xV[b, t], jax.nn.softmax(logits[i, len(row) - 1]), atol=2e-6)

  # Accept a depth-2 path ending at a non-first sibling in row 0 (0 → 3), a depth-3 path in row 1 (1 → 4 → 5).
  path_BxG = jnp.asarray([[0, 3, -1], [1, 4, 5]], jnp.int32)
  tau_B = jnp.asarray([2, 3], jnp.int32)
  cache = target.move_slots(scored.target_cache, *contracts.path_slots(state.length_B, path_BxG, tau_B))
  committed = [PROMPTS[b] + [int(TOKENS[b, n]) for n in np.asarray(path_BxG[b]) if n >= 0] for b in range(2)]
  _, fresh = fresh_pass(config, params, committed, cache_len)
  for b in range(2):
    valid = len(committed[b])  # the prompt's last token and the path were fed; every slot below is final
    np.testing.assert_allclose(cache.k_LxBxSxKxH[:, b, :valid], fresh.k_LxBxSxKxH[:, b, :valid], atol=2e-6)
    np.testing.assert_allclose(cache.v_LxBxSxKxH[:, b, :valid], fresh.v_LxBxSxKxH[:, b, :valid], atol=2e-6)
  # The moves touched nothing below the committed length.
  np.testing.assert_array_equal(cache.k_LxBxSxKxH[:, 0, :4], scored.target_cache.k_LxBxSxKxH[:, 0, :4])


def test_accepted_path_and_hidden_rows():
  depth_BxN = jnp.asarray([[1, 1, 2, 2, 2, 3]], jnp.int32)
  accepted = jnp.asarray([[False, True, False, False, True, False]])
  np.testing.assert_array_equal(contracts.accepted_path(accepted, depth_BxN, 4), [[1, 4, -1, -1]])
  anc = contracts.ancestors(jnp.asarray(PARENTS))
  np.testing.assert_array_equal(contracts.node_depths(anc), [[1, 1, 2, 2, 2, 3], [1, 1, 1, 2, 2, 3]])
  for b in range(2):
    for n in range(6):
      np.testing.assert_array_equal(np.flatnonzero(np.asarray(anc[b, n])), sorted(path_to(PARENTS[b], n)))
  mask = contracts.tree_attention_mask(jnp.asarray([4, 3]), anc, 12)
  chain = contracts.tree_attention_mask(jnp.asarray([4]), contracts.ancestors(contracts.chain_parents_BxN(1, 6)), 12)
  positions = jnp.asarray([[3, 4, 5, 6, 7, 8, 9]])
  np.testing.assert_array_equal(chain, dec.causal_mask(positions, 12))  # on a chain: the causal mask
  np.testing.assert_array_equal(mask[0, 6], [True] * 4 + [True, False, True, False, False, True, False, False])
  np.testing.assert_array_equal(mask[0, 0], [True] * 4 + [False] * 8)


def test_a_chain_rule_refuses_a_tree_drafter_and_tree_rules_check_sampling():
  config = dec.DecoderConfig.tiny(vocab_size=64, num_layers=1)
  params = init_params(config, 0)
  tokens_BxP, lens_B = spec.prepare_prompts(PROMPTS)
  keys = jax.random.split(jax.random.key(0), 2)
  common = dict(target=config, drafter=FixedTreeDrafter(64), gamma=3, max_new_tokens=4, sampler=T1)
  with pytest.raises(ValueError, match="verifies chains.*draws trees"):
    spec.generate_speculative(params, None, keys, tokens_BxP, lens_B, verifier="block", **common)
  with pytest.raises(ValueError, match="needs siblings drawn with replacement"):
    spec.generate_speculative(params, None, keys, tokens_BxP, lens_B, verifier="rrs", **common)
  out = spec.generate_speculative(params, None, keys, tokens_BxP, lens_B, verifier="rrs_wor", **common)
  assert out.tokens_BxN.shape == (2, 4)


# --- every registered rule through the jitted loop, with a drafter that fits it ----------------------------------

from blockspec_jax import drafters, theory, verify  # noqa: E402

from test_speculative import PROMPTS as RAGGED, model_pair, run_ar, target_sequence_law  # noqa: E402

GREEDY = sampling.Sampler(temperature=0.0)


def drafter_for(rule: str, config, kind: str | None = None):
  """``(drafter, gamma)``: the registry drafter a rule runs with in these tests (small trees: N ≤ 6)."""
  v = verify.get_verifier(rule)
  if kind is None:
    kind = (v.default_drafter if v.default_drafter is not None else "model" if v.structure == verify.CHAIN else
            "k_chains" if v.sibling_sampling == "with_replacement" else "rsd_c")
  settings = {"model": {}, "ngram": {}, "k_chains": {"k": 2}, "rsd_c": {"branching": (2, 1)},
              "rsd_s": {"width": 2}, "beam": {"width": 2}}[kind]
  return drafters.make(kind, config=config, vocab_size=config.vocab_size, **settings), 2


def run_rule(config, target, drafter_params, prompts, keys, max_new, rule, sampler, kind=None):
  tokens, lens = spec.prepare_prompts(prompts)
  drafter, gamma = drafter_for(rule, config, kind)
  return spec.generate_speculative(target, drafter_params, keys, tokens, lens, target=config, drafter=drafter,
                                   gamma=gamma, max_new_tokens=max_new, verifier=rule, sampler=sampler)


LAW_CASES = ([(name, None) for name in verify.VERIFIERS
              if verify.get_verifier(name).lossless_under(sampling.Sampler(1.0))]
             + [("rrs_wor", "rsd_s"), ("traversal", "rsd_s"), ("block", "ngram")])


@pytest.mark.parametrize("rule,kind", LAW_CASES)
def test_every_lossless_rule_has_the_target_law_through_the_loop(rule, kind):
  """T = 1, V = 6: the first 3 emitted tokens have the target's law (χ², 30k seeded rows) for every registered rule
  that is lossless at T = 1, each with a drafter of the sampling it needs (and RSD-S beams, n-gram point masses)."""
  config, target, drafter = model_pair(vocab=6, seed=3, noise=1.0)
  prompt = [1, 4]
  law = target_sequence_law(config, target, prompt, 3)
  n = 30_000
  keys = jax.random.split(jax.random.key(42), n)
  out = run_rule(config, target, drafter, [prompt] * n, keys, 3, rule, T1, kind)
  counts = {}
  for row in map(tuple, np.asarray(out.tokens_BxN).tolist()):
    counts[row] = counts.get(row, 0) + 1
  res = theory.chi2_gof(counts, law)
  m = out.metrics
  print(f"{rule}@{kind}: χ² p = {res.p_value:.4g} (dof {res.dof}), BE "
        f"{spec.summarize_metrics(m)['mean_acceptance_length']:.3f}")
  assert res.p_value > 1e-3
  assert int(m.invalid_prob_rows.sum()) == 0
  rate = float(m.num_accepted_tokens.sum() / m.num_draft_tokens.sum())
  assert 0 < rate < 0.95  # drafts are neither all rejected nor all accepted: the rule's test actually decides


GREEDY_CASES = [name for name in verify.VERIFIERS if verify.get_verifier(name).lossless_under(GREEDY)]


def test_every_rule_but_sprinter_is_lossless_for_a_greedy_target():
  """SPRINTER's head-accepted tokens are the drafter's even at T = 0 (tests/test_sprinter.py); every other registered
  rule, the lossy ones included, emits the greedy target's tokens."""
  assert set(verify.VERIFIERS) - set(GREEDY_CASES) == {"sprinter"}


@pytest.mark.parametrize("rule", GREEDY_CASES + ["block@ngram", "rrs_wor@rsd_s", "mtad@model"])
def test_greedy_decoding_equals_autoregressive_for_every_rule(rule):
  """T = 0, ragged prompts: every registered rule that is lossless for a greedy target (greedy, exact-match, lenient
  and MTAD included) with its drafter emits exactly the autoregressive tokens; trees accept some nodes, so the path
  commit is exercised."""
  rule, _, kind = rule.partition("@")
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  ar = run_ar(config, target, RAGGED, keys, 14)
  out = run_rule(config, target, drafter, RAGGED, keys, 14, rule, GREEDY, kind or None)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  assert int(out.metrics.num_accepted_tokens.sum()) > 0


def test_rows_with_different_trees_stay_independent():
  """RSD-S draws a different tree for every row: a row's output does not depend on its batch neighbours."""
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(7), 4)
  full = run_rule(config, target, drafter, RAGGED, keys, 8, "traversal", T1, "rsd_s")
  for b in (0, 3):
    alone = run_rule(config, target, drafter, [RAGGED[b]], keys[b:b + 1], 8, "traversal", T1, "rsd_s")
    np.testing.assert_array_equal(full.tokens_BxN[b], alone.tokens_BxN[0])
