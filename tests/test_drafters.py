"""Drafters on the engine's contract: valid trees whose q rows are the drafter's own laws, the sibling laws each
rule needs (i.i.d. vs without replacement), the drafter-side path commit, n-gram lookup tables, the registry."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import drafters, sampling, theory, verify
from blockspec_jax.decoding import contracts
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.models import decoder as dec

from test_speculative import init_params

T1 = sampling.Sampler(temperature=1.0)
TREE_DRAFTERS = [("k_chains", {"k": 2}, 3), ("rsd_c", {"branching": (2, 2, 1)}, 3), ("rsd_s", {"width": 3}, 3)]
PROMPTS = [[1, 2, 3, 4, 5], [6, 7]]


def setup(vocab=64, seed=0):
  config = dec.DecoderConfig.tiny(vocab_size=vocab, num_layers=2)
  return config, init_params(config, seed)


def state_for(drafter, params, prompts, gamma, max_new=6):
  tokens_BxP, lens_B = spec.prepare_prompts(prompts)
  cache_len = tokens_BxP.shape[1] + max_new + drafter.num_nodes(gamma) + 1
  tokens_BxS = jnp.zeros((len(prompts), cache_len), jnp.int32).at[:, :tokens_BxP.shape[1]].set(tokens_BxP)
  return drafter.init_state(params, tokens_BxP, lens_B, cache_len), tokens_BxS, lens_B


def model_law(config, params, context):
  """The drafter model's next-token law after ``context`` (a fresh causal pass), f64."""
  tokens = jnp.asarray([context], jnp.int32)
  pos = jnp.arange(len(context))[None]
  logits, _ = dec.Decoder(config).apply({"params": params}, tokens, pos, dec.init_cache(config, 1, len(context)),
                                        dec.causal_mask(pos, len(context)))
  return np.asarray(jax.nn.softmax(logits[0, -1].astype(jnp.float32)), np.float64)


def path_to(parents, n):
  out = []
  while n >= 0:
    out.append(n)
    n = int(parents[n])
  return out[::-1]


@pytest.mark.parametrize("name,settings,gamma", TREE_DRAFTERS)
def test_tree_drafts_are_valid_and_q_rows_are_the_drafters_laws(name, settings, gamma):
  config, params = setup()
  drafter = drafters.make(name, config=config, **settings)
  state, tokens_BxS, lens_B = state_for(drafter, params, PROMPTS, gamma)
  keys = jax.random.split(jax.random.key(3), len(PROMPTS))
  _, draft = jax.jit(drafter.propose, static_argnums=(5, 6))(params, state, tokens_BxS, lens_B, keys, gamma, T1)
  n_nodes = drafter.num_nodes(gamma)
  assert draft.tokens_BxN.shape == draft.parents_BxN.shape == (2, n_nodes)
  assert draft.q_BxNxV.shape == (2, n_nodes, config.vocab_size) and not draft.is_chain
  eps = getattr(drafter, "epsilon", 0.0)
  for b, prompt in enumerate(PROMPTS):
    parents = np.asarray(draft.parents_BxN[b])
    verify.check_tree(draft.tokens_BxN[b], parents, draft.q_BxNxV[b],
                      jnp.zeros((n_nodes + 1, config.vocab_size)))
    for n in range(n_nodes):
      context = prompt + [int(draft.tokens_BxN[b, m]) for m in path_to(parents, int(parents[n]))]
      want = (1 - eps) * model_law(config, params, context) + eps / config.vocab_size
      np.testing.assert_allclose(np.asarray(draft.q_BxNxV[b, n], np.float64), want, atol=3e-6)
    if drafter.sibling_sampling == "without_replacement":  # siblings distinct
      for parent in set(parents.tolist()):
        kids = np.asarray(draft.tokens_BxN[b])[parents == parent]
        assert len(set(kids.tolist())) == len(kids)


def _root_pairs(name, settings, gamma, n, vocab=5):
  config, params = setup(vocab=vocab, seed=1)
  drafter = drafters.make(name, config=config, **settings)
  state, tokens_BxS, lens_B = state_for(drafter, params, [[1, 2]] * n, gamma)
  keys = jax.random.split(jax.random.key(11), n)
  _, draft = jax.jit(drafter.propose, static_argnums=(5, 6))(params, state, tokens_BxS, lens_B, keys, gamma, T1)
  q = np.asarray(draft.q_BxNxV[0, 0], np.float64)
  counts = {}
  for pair in map(tuple, np.asarray(draft.tokens_BxN[:, :2]).tolist()):
    counts[pair] = counts.get(pair, 0) + 1
  return q / q.sum(), counts


@pytest.mark.parametrize("name,settings", [("rsd_c", {"branching": (2, 1)}), ("rsd_s", {"width": 2})])
def test_without_replacement_root_children_have_the_sequential_law(name, settings):
  """The root's first two children: P(x1, x2) = q(x1) q(x2) / (1 − q(x1)) (χ², 40k seeded rows, V = 5)."""
  q, counts = _root_pairs(name, settings, 2, 40_000)
  law = {(a, b): q[a] * q[b] / (1 - q[a]) for a, b in itertools.permutations(range(len(q)), 2)}
  res = theory.chi2_gof(counts, law)
  assert res.p_value > 1e-3, res


def test_k_chains_root_children_are_iid():
  q, counts = _root_pairs("k_chains", {"k": 2}, 2, 40_000)
  law = {(a, b): q[a] * q[b] for a, b in itertools.product(range(len(q)), repeat=2)}
  assert theory.chi2_gof(counts, law).p_value > 1e-3


@pytest.mark.parametrize("name,settings,gamma", TREE_DRAFTERS)
def test_drafter_path_commit_equals_a_fresh_autoregressive_pass(name, settings, gamma):
  config, params = setup()
  drafter = drafters.make(name, config=config, **settings)
  state, tokens_BxS, lens_B = state_for(drafter, params, PROMPTS, gamma)
  keys = jax.random.split(jax.random.key(5), len(PROMPTS))
  cache, draft = drafter.propose(params, state, tokens_BxS, lens_B, keys, gamma, T1)
  parents = np.asarray(draft.parents_BxN)
  # Accept, per row, the path to the LAST node of depth 2 (a non-first sibling or a later beam), then a bonus token.
  depth = np.asarray(contracts.node_depths(contracts.ancestors(draft.parents_BxN)))
  paths = [path_to(parents[b], int(np.flatnonzero(depth[b] == 2)[-1])) for b in range(2)]
  path_BxG = jnp.asarray([p + [-1] * (gamma - len(p)) for p in paths], jnp.int32)
  tau_B = jnp.asarray([len(p) for p in paths], jnp.int32)
  committed = [PROMPTS[b] + [int(draft.tokens_BxN[b, n]) for n in paths[b]] + [9] for b in range(2)]
  new_len_B = jnp.asarray([len(c) for c in committed], jnp.int32)
  commit = contracts.Commit(lens_B, new_len_B, tau_B, path_BxG, jnp.zeros((2, gamma + 1), jnp.int32),
                            jnp.zeros((2, gamma + 1, config.d_model)))
  cache = drafter.commit(params, cache, commit)
  cache_len = cache.max_len
  for b in range(2):
    row = jnp.asarray([committed[b]], jnp.int32)
    pos = jnp.arange(row.shape[1])[None]
    _, fresh = dec.Decoder(config).apply({"params": params}, row, pos, dec.init_cache(config, 1, cache_len),
                                         dec.causal_mask(pos, cache_len))
    valid = len(committed[b]) - 2  # the last path node may be an unfed leaf: the next propose re-feeds it
    np.testing.assert_allclose(cache.k_LxBxSxKxH[:, b, :valid], fresh.k_LxBxSxKxH[:, 0, :valid], atol=2e-6)
    np.testing.assert_allclose(cache.v_LxBxSxKxH[:, b, :valid], fresh.v_LxBxSxKxH[:, 0, :valid], atol=2e-6)


def test_ngram_lookup_tables():
  tokens = jnp.asarray([[5, 6, 7, 9, 5, 6, 7, 0, 0, 0, 0, 0],      # "5 6 7" seen before, then 9
                        [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0],      # no repeat: the last token repeated
                        [4, 8, 4, 8, 4, 8, 3, 3, 3, 3, 3, 3]], jnp.int32)  # match near the end: only committed read
  length = jnp.asarray([7, 4, 5], jnp.int32)
  out = np.asarray(drafters.lookup(tokens, length, 3))
  np.testing.assert_array_equal(out[0], [9, 5, 6])
  np.testing.assert_array_equal(out[1], [4, 4, 4])
  np.testing.assert_array_equal(out[2], [8, 4, 4])  # "4" last seen at 2 → continues 8 (pos 3), 4 (pos 4), then repeat
  jitted = jax.jit(drafters.lookup, static_argnums=(2, 3, 4))(tokens, length, 3, 3, 1)
  np.testing.assert_array_equal(jitted, out)
  d = drafters.make("ngram", vocab_size=16)
  _, draft = d.propose(None, None, tokens, length, None, 3, T1)
  assert draft.q_BxNxV is None and draft.is_chain


def test_registry_builds_every_drafter_and_names_errors():
  config, _ = setup()
  for name in drafters.DRAFTERS:
    d = drafters.make(name, config=config, vocab_size=config.vocab_size)
    contracts.check_drafter(d)
    assert d.vocab_size == config.vocab_size
  with pytest.raises(ValueError, match="unknown drafter 'beam'.*model, k_chains"):
    drafters.make("beam", config=config)
  with pytest.raises(ValueError, match="no settings \\['width'\\]"):
    drafters.make("k_chains", config=config, width=2)
  with pytest.raises(ValueError, match="gamma is 3"):
    drafters.make("rsd_c", config=config, branching=(2, 1)).num_nodes(3)
  with pytest.raises(ValueError, match="more distinct children"):
    drafters.make("rsd_c", config=config, branching=(65,))
  assert drafters.shape_for_budget("rsd_c", 8) == ({"branching": (2, 1, 1, 1)}, 4)
  assert drafters.make("rsd_s", config=config, width=2).num_nodes(4) == 8
