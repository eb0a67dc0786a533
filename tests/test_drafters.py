"""Drafters on the engine's contract: valid trees whose q rows are the drafter's own laws (also on rows with fewer
positive tokens than children), the sibling laws each rule needs (i.i.d., without replacement, stochastic beam search
at depth 2 by Kool et al.'s theorem), the drafter-side path commit against a fresh autoregressive prefill, n-gram
lookup tables, the registry.

Every jitted function is shared at module level (drafters, configs and samplers are static), so the tests that use the
same drafter on the same shapes compile it once."""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax import drafters, sampling, verify
from blockspec_jax import contracts
from blockspec_jax.models import decoder as dec
from blockspec_jax.theory.stats import chi2_gof
from helpers import tiny_config

T1 = sampling.Sampler(temperature=1.0)
TOP1 = sampling.Sampler(temperature=1.0, top_k=1)  # one token of positive mass per row
GREEDY = sampling.greedy_sampler()
GAMMA = 3
PROMPTS = [[1, 2, 3, 4, 5], [6, 7]]
WIDTH = 16  # prompts and committed rows are padded to this width (one prefill compile)
CACHE = 32  # cache slots: ≥ committed + N for two iterations of every drafter below
TREES = {"k1": ("k_chains", {"k": 1}), "k2": ("k_chains", {"k": 2}), "rsd_c": ("rsd_c", {"branching": (2, 2, 1)}),
         "rsd_s": ("rsd_s", {"width": 3}), "rsd_c31": ("rsd_c", {"branching": (3, 1)})}


# --- shared helpers -------------------------------------------------------------------------------------------------

# The tests' own jits skip XLA's backend (LLVM) optimisations: compiling a tiny drafter then takes a third of the time
# (the file runs in a fraction of the time on CPU); HLO and its numerics are unchanged.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)

@functools.lru_cache(maxsize=None)
def setup(vocab=64, seed=0, layers=1):
  """A tiny random drafter model (``DecoderConfig.tiny``) and random parameters: the Flax parameter tree's shapes
  (``eval_shape``, nothing compiled: a jitted Flax init takes seconds to compile on CPU) filled with numpy draws —
  norms 1, weights ``[out, in]`` N(0, 1/in) (LeCun, as the decoder's initialiser), embeddings N(0, 1), so the rows
  are neither uniform nor one-hot. One layer by default (compile time): the tree mask shows in the logits, i.e. in
  every q row checked, and the slots and rotary positions in the cache entries the path-commit test compares."""
  config = tiny_config(vocab_size=vocab, num_layers=layers)
  pos = jnp.zeros((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda: dec.Decoder(config).init(jax.random.key(0), pos, pos, dec.init_cache(config, 1, 4),
                                                           dec.causal_mask(pos, 4))["params"])
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.ones(leaf.shape, leaf.dtype)
    if "bias" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    std = 1.0 if "embed" in name else 1.0 / np.sqrt(leaf.shape[-1])
    return jnp.asarray(rng.normal(0.0, std, leaf.shape), leaf.dtype)

  return config, jax.tree_util.tree_map_with_path(fill, shapes)


def tree(case, config):
  name, settings = TREES[case]
  return drafters.make(name, config=config, **settings)


@functools.partial(jit, static_argnums=(0, 6, 7))
def _propose(drafter, params, state, tokens_BxS, length_B, keys_B, gamma, sampler):
  return drafter.propose(params, state, tokens_BxS, length_B, keys_B, gamma, sampler)


@functools.partial(jit, static_argnums=(0, 4))
def _prefill(config, params, tokens_BxP, length_B, cache_len):
  """A fresh autoregressive (causal) prefill of the drafter model: the model drafters' ``init_state``."""
  return drafters.ModelDrafter(config).init_state(params, tokens_BxP, length_B, cache_len)


@functools.partial(jit, static_argnums=0)
def _logits(config, params, tokens_MxC, length_M):
  """Row m: the drafter model's logits after ``tokens_MxC[m, :length_M[m]]`` (one causal pass, no cache reuse)."""
  rows, width = tokens_MxC.shape
  pos_MxC = jnp.broadcast_to(jnp.arange(width), (rows, width))
  logits_MxCxV, _ = dec.Decoder(config).apply({"params": params}, tokens_MxC, pos_MxC,
                                              dec.init_cache(config, rows, width), dec.causal_mask(pos_MxC, width))
  return logits_MxCxV[jnp.arange(rows), length_M - 1].astype(jnp.float32)


def sampler_law(logits_MxV, sampler):
  """The samplers of these tests in numpy (f64): T = 1 is the softmax; T = 0 and top-k = 1 the argmax's one-hot."""
  logits_MxV = np.asarray(logits_MxV, np.float64)
  if sampler == T1:
    e = np.exp(logits_MxV - logits_MxV.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
  assert sampler in (GREEDY, TOP1), sampler
  return np.eye(logits_MxV.shape[-1])[logits_MxV.argmax(-1)]


def padded(rows, width=WIDTH):
  out = np.zeros((len(rows), width), np.int32)
  for b, row in enumerate(rows):
    out[b, :len(row)] = row
  return jnp.asarray(out), jnp.asarray([len(r) for r in rows], jnp.int32)


def laws(config, params, contexts, sampler=T1, epsilon=0.0):
  """f64 ``[len(contexts), V]``: the (smoothed) drafter law after each context, in fixed-size batches of 64."""
  out = []
  for i in range(0, len(contexts), 64):
    chunk = contexts[i:i + 64]
    tokens, lens = padded(chunk + [[0]] * (64 - len(chunk)))
    out.append(np.asarray(_logits(config, params, tokens, lens))[:len(chunk)])
  return (1 - epsilon) * sampler_law(np.concatenate(out), sampler) + epsilon / config.vocab_size


def start(drafter, config, params, prompts, width=WIDTH, cache_len=CACHE):
  """``(state, tokens_BxS, length_B)`` after prefilling ``prompts`` (tokens padded to the cache's slots)."""
  tokens_BxP, lens_B = padded(prompts, width)
  tokens_BxS, _ = padded(prompts, cache_len)
  return _prefill(config, params, tokens_BxP, lens_B, cache_len), tokens_BxS, lens_B


def row_keys(seed, batch):
  return jax.random.split(jax.random.key(seed), batch)


def depths(parents_BxN):
  """int ``[B, N]``: nodes on each node's root-to-node path (numpy; parents precede children)."""
  parents_BxN = np.asarray(parents_BxN)
  depth = np.zeros(parents_BxN.shape, np.int64)
  for n in range(parents_BxN.shape[1]):
    parent = parents_BxN[:, n]
    depth[:, n] = 1 + np.where(parent >= 0, depth[np.arange(len(parent)), np.maximum(parent, 0)], 0)
  return depth


def path_to(parents, n):
  out = []
  while n >= 0:
    out.append(int(n))
    n = int(parents[n])
  return out[::-1]


def check_draft(drafter, config, params, draft, contexts, sampler, gamma=GAMMA):
  """A valid tree per row whose q rows are the drafter's law at each node's parent context."""
  batch = len(contexts)
  n_nodes = drafter.num_nodes(gamma)
  vocab = config.vocab_size
  chex.assert_shape([draft.tokens_BxN, draft.parents_BxN], (batch, n_nodes))
  chex.assert_type([draft.tokens_BxN, draft.parents_BxN], jnp.int32)
  chex.assert_shape(draft.q_BxNxV, (batch, n_nodes, vocab))
  chex.assert_type(draft.q_BxNxV, jnp.float32)
  assert not draft.is_chain
  tokens, parents = np.asarray(draft.tokens_BxN), np.asarray(draft.parents_BxN)
  q = np.asarray(draft.q_BxNxV, np.float64)
  depth = depths(parents)
  eps = getattr(drafter, "epsilon", 0.0)
  wanted = []
  for b in range(batch):
    verify.check_tree(tokens[b], parents[b], q[b], np.zeros((n_nodes + 1, vocab)))  # also token ids < V
    assert np.all(np.diff(depth[b]) >= 0) and depth[b].max() == gamma  # depth-major, γ deep
    np.testing.assert_array_equal(np.bincount(depth[b])[1:], drafter.widths(gamma))
    for n in range(n_nodes):
      wanted.append(contexts[b] + [int(tokens[b, m]) for m in path_to(parents[b], parents[b, n])])
      if drafter.sibling_sampling == "without_replacement":
        kids = tokens[b][parents[b] == parents[b, n]]
        assert len(set(kids.tolist())) == len(kids), (b, n, kids)
  np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
  want = laws(config, params, wanted, sampler, eps).reshape(batch, n_nodes, vocab)
  np.testing.assert_allclose(q, want, atol=3e-6)


# --- valid trees, q = the drafter's own law ------------------------------------------------------------------------

@pytest.mark.parametrize("case,sampler,gamma", [("k2", T1, GAMMA), ("rsd_c", T1, GAMMA), ("rsd_s", T1, GAMMA),
                                                ("rsd_c31", TOP1, 2), ("rsd_s", GREEDY, 2)])
def test_tree_drafts_are_valid_and_q_rows_are_the_drafters_laws(case, sampler, gamma):
  """Also with rows of a single positive token (top-k = 1, T = 0): without-replacement children stay distinct,
  drawn from the reported ``q_ε``. Constant widths (k-chains, RSD-S, RSD-C (3, 1)) run the depths in a scan, RSD-C
  (2, 2, 1) unrolled."""
  config, params = setup()
  drafter = tree(case, config)
  state, tokens_BxS, lens_B = start(drafter, config, params, PROMPTS)
  _, draft = _propose(drafter, params, state, tokens_BxS, lens_B, row_keys(3, 2), gamma, sampler)
  check_draft(drafter, config, params, draft, PROMPTS, sampler, gamma)
  parents = np.asarray(draft.parents_BxN)
  if case == "k2":  # chain c's node at depth d + 1 is node dk + c, child of node (d − 1)k + c
    np.testing.assert_array_equal(parents, np.broadcast_to([-1, -1, 0, 1, 2, 3], (2, 6)))
  if sampler is not T1:  # the argmax first (ε-smoothed rows: it holds almost all the mass), then distinct fillers
    root = np.asarray(draft.q_BxNxV[:, 0]).argmax(-1)
    np.testing.assert_array_equal(np.asarray(draft.tokens_BxN[:, 0]), root)


def test_one_chain_is_the_model_drafters_chain():
  """k_chains with k = 1 drafts ModelDrafter's chain: a chain, and at T = 0 the same tokens and rows (at T = 1 its
  rows are the model's law by the same code as k = 2's, checked above)."""
  config, params = setup()
  one = tree("k1", config)
  model = drafters.make("model", config=config)
  state, tokens_BxS, lens_B = start(one, config, params, PROMPTS)
  _, tree_draft = _propose(one, params, state, tokens_BxS, lens_B, row_keys(4, 2), GAMMA, GREEDY)
  _, chain_draft = _propose(model, params, state, tokens_BxS, lens_B, row_keys(4, 2), GAMMA, GREEDY)
  check_draft(one, config, params, tree_draft, PROMPTS, GREEDY)
  np.testing.assert_array_equal(tree_draft.parents_BxN, contracts.chain_parents_BxN(2, GAMMA))
  np.testing.assert_array_equal(tree_draft.tokens_BxN, chain_draft.tokens_BxN)
  np.testing.assert_array_equal(tree_draft.parents_BxN, chain_draft.parents_BxN)
  np.testing.assert_allclose(tree_draft.q_BxNxV, chain_draft.q_BxNxV, atol=1e-6)


# --- sibling laws (χ², fixed seeds) --------------------------------------------------------------------------------

N_LAW = 40_000
V_LAW = 4


def draws(name, settings, gamma, seed):
  """``(drafter, config, params, Draft)`` for ``N_LAW`` rows drafting after the prompt ``[1, 2]`` (one-layer model,
  V = 4: only the rows matter here)."""
  config, params = setup(vocab=V_LAW, seed=1, layers=1)
  drafter = drafters.make(name, config=config, **settings)
  state, tokens_BxS, lens_B = start(drafter, config, params, [[1, 2]] * N_LAW, width=2, cache_len=8)
  _, draft = _propose(drafter, params, state, tokens_BxS, lens_B, row_keys(seed, N_LAW), gamma, T1)
  return drafter, config, params, draft


def counts_of(rows):
  counts = {}
  for row in map(tuple, rows):
    counts[row] = counts.get(row, 0) + 1
  return counts


def test_k_chains_root_children_are_iid():
  """SpecTr's chains: the root's children are i.i.d. from the root row, P(x1, x2) = q(x1) q(x2)."""
  drafter, config, params, draft = draws("k_chains", {"k": 2}, 1, 11)
  q = laws(config, params, [[1, 2]])[0]
  law = {(a, b): q[a] * q[b] for a, b in itertools.product(range(V_LAW), repeat=2)}
  res = chi2_gof(counts_of(np.asarray(draft.tokens_BxN).tolist()), law)
  assert res.p_value > 1e-3, res


def test_rsd_c_root_children_are_drawn_without_replacement():
  """RSD-C: the root's ordered children have the sequential law P(x1, x2) = q(x1) q(x2) / (1 − q(x1))."""
  drafter, config, params, draft = draws("rsd_c", {"branching": (2,)}, 1, 12)
  q = laws(config, params, [[1, 2]], epsilon=drafter.epsilon)[0]
  law = {(a, b): q[a] * q[b] / (1 - q[a]) for a, b in itertools.permutations(range(V_LAW), 2)}
  res = chi2_gof(counts_of(np.asarray(draft.tokens_BxN).tolist()), law)
  assert res.p_value > 1e-3, res


def test_rsd_s_depth_one_and_two_laws():
  """RSD-S, W = 2, γ = 2, V = 4. Depth 1: the root's Gumbel-top-2, an ordered sample without replacement. Depth 2:
  the two beams are a without-replacement sample of two length-2 sequences from q(s) = q(x1) q(x2 | x1) (Kool et al.,
  Theorem; a plain per-beam Gumbel-top-k or unconditioned scores give another law). Two beams under one parent are
  stored in their sampling order, P = q(s) q(s') / (1 − q(s)); beams under different parents are stored in parent
  order, so there only the pair {s, s'} is compared: P = q(s) q(s') (1/(1 − q(s)) + 1/(1 − q(s')))."""
  drafter, config, params, draft = draws("rsd_s", {"width": 2}, 2, 13)
  eps = drafter.epsilon
  q1 = laws(config, params, [[1, 2]], epsilon=eps)[0]
  q2 = laws(config, params, [[1, 2, x] for x in range(V_LAW)], epsilon=eps)
  tokens, parents = np.asarray(draft.tokens_BxN), np.asarray(draft.parents_BxN)
  law1 = {(a, b): q1[a] * q1[b] / (1 - q1[a]) for a, b in itertools.permutations(range(V_LAW), 2)}
  res1 = chi2_gof(counts_of(tokens[:, :2].tolist()), law1)
  assert res1.p_value > 1e-3, res1
  assert np.all(parents[:, :2] == -1) and np.all(np.isin(parents[:, 2:], [0, 1]))
  assert np.all(parents[:, 2] <= parents[:, 3])  # grouped by parent
  seq = lambda s: q1[s[0]] * q2[s[0], s[1]]  # noqa: E731
  law2, observed = {}, []
  for s, t in itertools.permutations(itertools.product(range(V_LAW), repeat=2), 2):
    if s[0] == t[0]:
      law2[("same", s, t)] = seq(s) * seq(t) / (1 - seq(s))
    else:
      key = ("diff",) + tuple(sorted((s, t)))
      law2[key] = law2.get(key, 0.0) + seq(s) * seq(t) / (1 - seq(s))
  assert abs(sum(law2.values()) - 1) < 1e-9
  for row, par in zip(tokens.tolist(), parents.tolist()):
    s, t = (row[par[2]], row[2]), (row[par[3]], row[3])
    observed.append(("same", s, t) if par[2] == par[3] else ("diff",) + tuple(sorted((s, t))))
  res2 = chi2_gof(counts_of(observed), law2)
  assert res2.p_value > 1e-3, res2


# --- path commit -------------------------------------------------------------------------------------------------

def pick_paths(draft):
  """Row 0: a path of depth 2 ending at a non-first sibling (else at the last depth-2 node, below a non-first
  sibling); row 1: the path to the last node of depth γ (a leaf the drafter never fed)."""
  parents = np.asarray(draft.parents_BxN)
  depth = depths(parents)
  at2 = np.flatnonzero(depth[0] == 2)
  later = [n for n in at2 if n > 0 and parents[0, n - 1] == parents[0, n]]
  path0 = path_to(parents[0], later[-1] if later else at2[-1])
  path1 = path_to(parents[1], np.flatnonzero(depth[1] == GAMMA)[-1])
  assert path0 != [0, 1] and path1 != list(range(GAMMA))  # something moves
  return [path0, path1]


@pytest.mark.parametrize("case", ["k2", "rsd_c", "rsd_s"])
def test_drafter_path_commit_equals_a_fresh_autoregressive_prefill(case):
  """After propose and a Commit of a path ending at a non-first sibling, the drafter's cache equals a fresh causal
  prefill over the committed tokens at every slot < new_length − 1 (< new_length − 2 for a path to a depth-γ leaf,
  which is never fed), and the next draft's rows are again exactly the drafter's laws (its re-feed covers the rest)."""
  config, params = setup()
  drafter = tree(case, config)
  state, tokens_BxS, lens_B = start(drafter, config, params, PROMPTS)
  cache, draft = _propose(drafter, params, state, tokens_BxS, lens_B, row_keys(3, 2), GAMMA, T1)
  paths = pick_paths(draft)
  path_BxG = jnp.asarray([p + [-1] * (GAMMA - len(p)) for p in paths], jnp.int32)
  tau_B = jnp.asarray([len(p) for p in paths], jnp.int32)
  committed = [PROMPTS[b] + [int(draft.tokens_BxN[b, n]) for n in paths[b]] + [9 + b] for b in range(2)]
  block = [[int(draft.tokens_BxN[b, n]) for n in paths[b]] + [9 + b] for b in range(2)]
  new_tokens, new_len_B = padded(committed)
  commit = contracts.Commit(lens_B, new_len_B, tau_B, path_BxG,
                            jnp.asarray([r + [0] * (GAMMA + 1 - len(r)) for r in block], jnp.int32),
                            jnp.zeros((2, GAMMA + 1, config.d_model)))
  cache = drafter.commit(params, cache, commit)
  fresh = _prefill(config, params, new_tokens, new_len_B, CACHE)
  for b, valid in enumerate([len(committed[0]) - 1, len(committed[1]) - 2]):
    np.testing.assert_allclose(cache.k_LxBxSxKxH[:, b, :valid], fresh.k_LxBxSxKxH[:, b, :valid], atol=1e-5)
    np.testing.assert_allclose(cache.v_LxBxSxKxH[:, b, :valid], fresh.v_LxBxSxKxH[:, b, :valid], atol=1e-5)
  tokens2_BxS, _ = padded(committed, CACHE)
  _, draft2 = _propose(drafter, params, cache, tokens2_BxS, new_len_B, row_keys(6, 2), GAMMA, T1)
  check_draft(drafter, config, params, draft2, committed, T1)


# --- n-gram lookup -------------------------------------------------------------------------------------------------

NGRAM_TABLE = [  # (committed tokens, garbage after them, expected draft of γ = 3 with n = 3..1)
    ([5, 6, 7, 9, 5, 6, 7], [0, 0], [9, 5, 6]),            # "5 6 7" seen before: what followed it
    ([1, 2, 3, 4], [4, 5, 6], [4, 4, 4]),                  # no repeat: the last token repeated
    ([4, 8, 4, 8, 4], [8, 3], [8, 4, 8]),                  # continuation past the end: overlapping copy
    ([5, 6, 0, 5, 6], [5, 6, 8, 8], [0, 5, 6]),            # a later "5 6" beyond the length is never read
    ([1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3], [], [7, 9, 2]),    # longest n wins over a later shorter match
    ([3], [3, 3, 4], [3, 3, 3]),                           # one committed token: fallback
    ([2, 2], [7, 7], [2, 2, 2]),                           # period 1
    ([7, 1, 9, 1], [9, 9], [9, 1, 9]),                     # only a 1-gram matches
]


_lookup = jit(drafters.lookup, static_argnums=(2, 3, 4))


def test_ngram_lookup_tables_and_jit():
  tokens = np.full((len(NGRAM_TABLE), 14), 0, np.int32)
  for b, (row, garbage, _) in enumerate(NGRAM_TABLE):
    tokens[b, :len(row) + len(garbage)] = row + garbage
  tokens = jnp.asarray(tokens)
  length = jnp.asarray([len(r) for r, _, _ in NGRAM_TABLE], jnp.int32)
  out = np.asarray(_lookup(tokens, length, 3, 3, 1))
  np.testing.assert_array_equal(out, [want for _, _, want in NGRAM_TABLE])
  # min_ngram = 2: a row whose only match is a single token falls back; max_ngram = 2: the latest 2-gram match.
  np.testing.assert_array_equal(np.asarray(_lookup(tokens, length, 3, 3, 2))[7], [1, 1, 1])
  np.testing.assert_array_equal(np.asarray(_lookup(tokens, length, 3, 2, 1))[4], [8, 1, 2])
  d = drafters.make("ngram", vocab_size=16)
  state = d.init_state(None, tokens, length, 14)
  state, draft = jax.jit(d.propose, static_argnums=(5, 6))(None, state, tokens, length, None, 3, T1)
  assert draft.q_BxNxV is None and draft.is_chain and state is None
  np.testing.assert_array_equal(draft.tokens_BxN, out)
  np.testing.assert_array_equal(draft.parents_BxN, contracts.chain_parents_BxN(len(NGRAM_TABLE), 3))
  chex.assert_shape(draft.q_rows(16), (len(NGRAM_TABLE), 3, 16))
  assert d.commit(None, state, None) is None and d.num_nodes(5) == 5 and d.max_len is None


def test_ngram_never_reads_past_the_committed_length():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 4, size=(64, 24)).astype(np.int32)
  length = jnp.asarray(rng.integers(1, 24, size=64), jnp.int32)
  other = tokens.copy()
  for b in range(64):
    other[b, int(length[b]):] = rng.integers(0, 4, size=24 - int(length[b]))
  a, b_ = _lookup(jnp.asarray(tokens), length, 5, 3, 1), _lookup(jnp.asarray(other), length, 5, 3, 1)
  np.testing.assert_array_equal(a, b_)
  # and every drafted token is a committed token of its row
  for b in range(64):
    assert set(np.asarray(a[b]).tolist()) <= set(tokens[b, :int(length[b])].tolist())


# --- registry ------------------------------------------------------------------------------------------------------

def test_registry_builds_every_drafter_and_names_errors():
  config, _ = setup()
  for name in drafters.DRAFTERS:
    d = drafters.make(name, config=config, vocab_size=config.vocab_size)
    contracts.check_drafter(d)
    assert d.vocab_size == config.vocab_size
    assert d.sibling_sampling in ("chain", "with_replacement", "without_replacement", "beam", "point_mass")
    assert d.is_chain == (d.sibling_sampling in ("chain", "beam"))
  assert drafters.make("ngram", config=config).vocab_size == 64  # model-free: the vocabulary from config
  bad = {"unknown drafter 'lattice'.*known drafters: model, k_chains, rsd_c, rsd_s, ngram, sprinter, beam, heads, "
         "heads_tree, steered":
         ("lattice", {}),
         r"beam width must be an integer": ("beam", {"width": 0}),
         r"no settings \['width'\]": ("k_chains", {"width": 2}),
         "k >= 1": ("k_chains", {"k": 0}),
         "non-empty tuple of integers >= 1": ("rsd_c", {"branching": (2, 0)}),
         "more distinct children": ("rsd_c", {"branching": (65,)}),
         "epsilon must be in": ("rsd_s", {"epsilon": 0.0}),
         r"width must be an integer in \[1, V = 64\]": ("rsd_s", {"width": 65}),
         "min_ngram <= max_ngram": ("ngram", {"max_ngram": 0})}
  for message, (name, settings) in bad.items():
    with pytest.raises(ValueError, match=message):
      drafters.make(name, config=config, **settings)
  for settings in ({"branching": ()}, {"branching": (1.5,)}, {"branching": 2}):
    with pytest.raises(ValueError, match="non-empty tuple"):
      drafters.make("rsd_c", config=config, **settings)
  with pytest.raises(ValueError, match="gamma is 3"):
    drafters.make("rsd_c", config=config, branching=(2, 1)).num_nodes(3)
  with pytest.raises(ValueError, match="pass its DecoderConfig"):
    drafters.make("rsd_s")
  with pytest.raises(ValueError, match="needs the target's vocab_size"):
    drafters.make("ngram")
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    drafters.make("k_chains", config=config, vocab_size=65)
  assert drafters.make("rsd_c", config=config, branching=(3, 2, 1)).num_nodes(3) == 3 + 6 + 6
  assert drafters.make("rsd_s", config=config, width=2).num_nodes(4) == 8


@pytest.mark.parametrize("budget", [4, 8, 16])
def test_shapes_for_budgets_have_exactly_the_budget(budget):
  config, _ = setup()
  assert drafters.shape_for_budget("rsd_c", budget) == ({"branching": (2,) + (1,) * (budget // 2 - 1)}, budget // 2)
  for kind in drafters.DRAFTERS:  # every registered drafter declares its shape at a budget (budget_shape)
    for branches in (2, 4):
      settings, gamma = drafters.shape_for_budget(kind, budget, branches)
      d = drafters.make(kind, config=config, **settings)
      assert d.num_nodes(gamma) == budget, (kind, branches)
  with pytest.raises(ValueError, match="divisible by 4"):
    drafters.shape_for_budget("k_chains", 6, 4)
  with pytest.raises(ValueError, match="no budget shapes for drafter 'lattice'"):
    drafters.shape_for_budget("lattice", budget)
