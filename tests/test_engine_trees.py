"""The engine on trees: one target pass under the tree mask scores every node as an autoregressive pass over its
root-to-node path would, and the path commit leaves the cache a fresh autoregressive pass would leave. Then every
registered rule through the jitted loop with every registered drafter it accepts (helpers.registry_params): the
target's law at T = 1 and the autoregressive tokens at T = 0, without a test edit for a new rule or drafter."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import contracts, verify
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.models import decoder as dec
from blockspec_jax.models.scorer import DecoderScorer

from helpers import (GREEDY, PROMPTS as RAGGED, T1, check_greedy_equals_autoregressive,
                     check_target_law_through_the_loop, init_params, lossless_rules, model_pair, registry_params,
                     run_pair, tiny_config)

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
  config = tiny_config(vocab_size=64, num_layers=2)
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


def test_accepted_path_matches_numpy_on_random_chains_and_uses_no_scatter():
  """Root-to-node chains of every length 0..γ among nodes of random depths, exact against numpy. No scatter: on a GPU
  with ``--xla_gpu_deterministic_ops=true`` (JAX 0.11.2) a dropping scatter with repeated out-of-range indices, as the
  rejected nodes would be, put other nodes' numbers into the path (docs/results/gpu.md)."""
  batch, n_nodes, gamma = 64, 12, 4
  rng = np.random.default_rng(3)
  accepted_BxN = np.zeros((batch, n_nodes), bool)
  depth_BxN = rng.integers(1, gamma + 1, (batch, n_nodes)).astype(np.int32)
  want_BxG = np.full((batch, gamma), -1, np.int32)
  for b in range(batch):
    nodes = rng.choice(n_nodes, b % (gamma + 1), replace=False)
    accepted_BxN[b, nodes] = True
    depth_BxN[b, nodes] = np.arange(1, len(nodes) + 1)
    want_BxG[b, :len(nodes)] = nodes
  path_fn = jax.jit(lambda a, d: contracts.accepted_path(a, d, gamma))
  np.testing.assert_array_equal(path_fn(accepted_BxN, depth_BxN), want_BxG)
  jaxpr = str(jax.make_jaxpr(path_fn)(accepted_BxN, depth_BxN))
  assert "scatter" not in jaxpr, jaxpr


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
  config = tiny_config(vocab_size=64, num_layers=1)
  params = init_params(config, 0)
  tokens_BxP, lens_B = spec.prepare_prompts(PROMPTS)
  keys = jax.random.split(jax.random.key(0), 2)
  common = dict(target=config, drafter=FixedTreeDrafter(64), gamma=3, max_new_tokens=4, sampler=T1)
  with pytest.raises(ValueError, match="verifies chains.*draws trees"):
    spec.generate_speculative(params, None, keys, tokens_BxP, lens_B, verifier="block", **common)
  with pytest.raises(ValueError, match="needs siblings drawn with replacement"):
    spec.generate_speculative(params, None, keys, tokens_BxP, lens_B, verifier="rrs", **common)
  out = spec.generate_speculative(params, None, keys, tokens_BxP, lens_B, verifier="rrs_wor", **common)
  chex.assert_shape(out.tokens_BxN, (2, 4))


# --- every registered rule through the jitted loop, with every registered drafter it accepts ---------------------

@pytest.mark.parametrize("rule,kind", registry_params(T1))
def test_every_lossless_rule_has_the_target_law_through_the_loop(rule, kind):
  """Every registered rule lossless at T = 1 with every registered drafter it accepts (``check_drafter``); pairs
  outside helpers.default_pairs are ``heavy``."""
  check_target_law_through_the_loop(rule, kind)


def test_every_rule_but_sprinter_is_lossless_for_a_greedy_target():
  """SPRINTER's head-accepted tokens are the drafter's even at T = 0 (tests/test_sprinter.py); every other registered
  rule, the lossy ones included, emits the greedy target's tokens."""
  assert set(verify.VERIFIERS) - set(lossless_rules(GREEDY)) == {"sprinter"}


@pytest.mark.parametrize("rule,kind", registry_params(GREEDY))
def test_greedy_decoding_equals_autoregressive_for_every_rule(rule, kind):
  """Every registered rule lossless for a greedy target (greedy, exact-match, lenient and MTAD included) with every
  registered drafter it accepts; pairs outside helpers.default_pairs are ``heavy``."""
  check_greedy_equals_autoregressive(rule, kind)


@pytest.mark.slow  # row independence is tested by default for the chain loop and the sprinter loop
def test_rows_with_different_trees_stay_independent():
  """RSD-S draws a different tree for every row: a row's output does not depend on its batch neighbours."""
  config, target, drafter = model_pair()
  keys = jax.random.split(jax.random.key(7), 4)
  full = run_pair(config, target, drafter, RAGGED, keys, 8, "traversal", T1, "rsd_s")
  for b in (0, 3):
    alone = run_pair(config, target, drafter, [RAGGED[b]], keys[b:b + 1], 8, "traversal", T1, "rsd_s")
    np.testing.assert_array_equal(full.tokens_BxN[b], alone.tokens_BxN[0])
