"""The n-gram LM and the lattice searches of blockspec_jax.drafters.lattice: exact Kneser–Ney counts and log-probs
against a pure-Python reference (hand corpus, random corpora, a real 32-bit hash collision), a proper law over the
vocabulary, storage with SHA-256 checks, local rescoring's rows, p-best = brute force, and the n-gram-rescored BPD
drafter in the decoding loop (greedy = autoregressive, exact law at T = 1 under token and block verification)."""

import collections
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blockspec_jax.decoding import speculative as spec
from blockspec_jax.drafters import heads as heads_lib, lattice

from helpers import GREEDY, PROMPTS as RAGGED, T1, check_drafter_law_at_t1, model_pair, run_ar


# --- a pure-Python interpolated Kneser–Ney, the reference ------------------------------------------------------------

class ReferenceKN:
  """Dict-based interpolated Kneser–Ney with the module's discounts (the formulas of the lattice docstring)."""

  def __init__(self, sequences, vocab, order):
    self.vocab, self.order, bos = vocab, order, vocab
    top = collections.Counter()
    for seq in sequences:
      padded = [bos] * (order - 1) + list(seq)
      for i in range(len(seq)):
        top[tuple(padded[i:i + order])] += 1
    self.num = {order: dict(top)}
    for k in range(order - 1, 0, -1):
      self.num[k] = dict(collections.Counter(g[1:] for g in self.num[k + 1]))
    self.total, self.types, self.discount = {}, {}, {}
    for k, table in self.num.items():
      total, types = collections.Counter(), collections.Counter()
      for g, c in table.items():
        total[g[:-1]] += c
        types[g[:-1]] += 1
      self.total[k], self.types[k] = dict(total), dict(types)
      counts = list(table.values())
      n1, n2 = counts.count(1), counts.count(2)
      self.discount[k] = min(max(n1 / (n1 + 2 * n2) if n1 + 2 * n2 else 0.5, 0.1), 0.9)

  def prob(self, context, w):
    p = 1.0 / self.vocab
    for k in range(1, self.order + 1):
      h = tuple(context[len(context) - (k - 1):]) if k > 1 else ()
      total = self.total[k].get(h, 0)
      if total > 0:
        d = self.discount[k]
        p = (max(self.num[k].get(h + (w,), 0) - d, 0.0) + d * self.types[k][h] * p) / total
    return p


def logprob(lm, contexts, tokens):
  return np.asarray(jax.jit(lattice.ngram_logprob)(lm, jnp.asarray(contexts, jnp.int32),
                                                   jnp.asarray(tokens, jnp.int32)), np.float64)


HAND = [[1, 2, 3, 1, 2, 4], [2, 3]]


def test_hand_corpus_counts_discounts_and_log_probs():
  lm = lattice.build_ngram(HAND, vocab_size=5, order=3)
  assert lm.order == 3 and lm.vocab_size == 5 and lm.bos == 5
  # order 3: 8 distinct trigrams (BOS = 5 pads the starts), each seen once: n1 = 8, n2 = 0 -> D = 1, clipped to 0.9
  top = lm.tables[2]
  assert top.key_hash_M.shape == (8,)
  assert sorted(map(tuple, np.asarray(top.key_tokens_MxK).tolist())) == sorted(
      [(5, 5, 1), (5, 1, 2), (1, 2, 3), (2, 3, 1), (3, 1, 2), (1, 2, 4), (5, 5, 2), (5, 2, 3)])
  # order 2, continuation counts N1+(• h w): (1,2) <- {5, 3}, (2,3) <- {1, 5}, the rest once
  bigrams = {tuple(k): c for k, c in zip(np.asarray(lm.tables[1].key_tokens_MxK).tolist(),
                                          np.asarray(lm.tables[1].count_M).tolist())}
  assert bigrams == {(1, 2): 2, (2, 3): 2, (5, 1): 1, (3, 1): 1, (2, 4): 1, (5, 2): 1}
  unigrams = {k[0]: c for k, c in zip(np.asarray(lm.tables[0].key_tokens_MxK).tolist(),
                                      np.asarray(lm.tables[0].count_M).tolist())}
  assert unigrams == {1: 2, 2: 2, 3: 1, 4: 1}
  np.testing.assert_allclose(np.asarray(lm.discount_N), [1 / 3, 0.5, 0.9], rtol=1e-6)
  # P(4 | 1 2) by hand
  p1 = ((1 - 1 / 3) + (1 / 3) * 4 * (1 / 5)) / 6
  p2 = ((1 - 0.5) + 0.5 * 2 * p1) / 3
  p3 = ((1 - 0.9) + 0.9 * 2 * p2) / 2
  np.testing.assert_allclose(logprob(lm, [[1, 2]], [4]), [np.log(p3)], rtol=1e-5)
  # an unseen context backs off entirely; the sentinel contexts are real contexts
  ref = ReferenceKN(HAND, 5, 3)
  contexts = [[1, 2], [4, 4], [5, 5], [5, 2], [0, 3], [3, 1]]
  for context in contexts:
    got = np.exp(logprob(lm, [context] * 5, list(range(5))))
    want = [ref.prob(context, w) for w in range(5)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert abs(got.sum() - 1.0) < 1e-5  # a proper law over the vocabulary


@pytest.mark.parametrize("order", [1, 2, 4])
def test_random_corpora_match_the_reference_and_sum_to_one(order):
  rng = np.random.default_rng(order)
  vocab = 12
  seqs = [rng.integers(0, vocab, rng.integers(0, 40)).tolist() for _ in range(8)]
  seqs.append([3, 3, 3, 3, 7, 3, 3])
  lm = lattice.build_ngram(seqs, vocab, order)
  ref = ReferenceKN([s for s in seqs if s], vocab, order)
  contexts = rng.integers(0, vocab + 1, size=(20, max(order - 1, 0) + 2))
  contexts[:4, :] = vocab  # sentence starts
  grid_c = np.repeat(contexts, vocab, axis=0)
  grid_w = np.tile(np.arange(vocab), len(contexts))
  got = np.exp(logprob(lm, grid_c, grid_w)).reshape(len(contexts), vocab)
  want = np.array([[ref.prob(c.tolist(), w) for w in range(vocab)] for c in contexts])
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=2e-5)


def _count_lookup(lm, k, rows):
  table = lm.tables[k - 1]
  found, index = jax.jit(lattice._find, static_argnums=(3, 4))(table.key_hash_M, table.key_tokens_MxK,
                                                               jnp.asarray(rows, jnp.int32), 2 * k, lm.probe)
  return np.where(np.asarray(found), np.asarray(table.count_M)[np.asarray(index)], 0.0)


def test_lookups_agree_with_a_python_dict_and_survive_hash_collisions():
  # a real collision of the order-2 key hash among random pairs of ids < 150000 (a Qwen-sized vocabulary; a
  # fixed-seed search, so deterministic)
  vocab = 150_000
  pairs = np.unique(np.random.default_rng(0).integers(0, vocab, size=(400_000, 2)), axis=0)
  hashes = lattice.hash_rows(pairs, 4, np)
  order = np.argsort(hashes, kind="stable")
  dup = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])[0]
  a, b = pairs[order[dup]].tolist(), pairs[order[dup + 1]].tolist()
  assert a != b and hashes[order[dup]] == hashes[order[dup + 1]]
  np.testing.assert_array_equal(lattice.hash_rows(jnp.asarray([a, b]), 4), hashes[order[dup:dup + 2]])
  rng = np.random.default_rng(0)
  seqs = [a, b, a] + [rng.integers(0, vocab, 30).tolist() for _ in range(5)]
  lm = lattice.build_ngram(seqs, vocab, 2)
  assert lm.probe >= 2  # the two bigrams share a hash: lookups must compare the ids
  ref = ReferenceKN(seqs, vocab, 2)
  for k in (1, 2):
    keys = list(ref.num[k])
    absent = [tuple(r) for r in rng.integers(0, vocab, size=(50, k)).tolist() if tuple(r) not in ref.num[k]]
    rows = keys + absent
    want = [ref.num[k].get(r, 0) for r in rows]
    np.testing.assert_array_equal(_count_lookup(lm, k, rows), want)
  assert ref.num[2][tuple(a)] == 2 and ref.num[2][tuple(b)] == 1
  np.testing.assert_allclose(np.exp(logprob(lm, [[a[0]], [b[0]]], [a[1], b[1]])),
                             [ref.prob([a[0]], a[1]), ref.prob([b[0]], b[1])], rtol=1e-5)


def test_bad_corpora_are_clear_errors():
  with pytest.raises(ValueError, match=r"outside \[0, V = 5\)"):
    lattice.build_ngram([[1, 5]], 5)
  with pytest.raises(ValueError, match="no tokens"):
    lattice.build_ngram([[], []], 5)
  with pytest.raises(ValueError, match="order must be an integer >= 1"):
    lattice.build_ngram([[1]], 5, order=0)
  with pytest.raises(ValueError, match="vocab_size"):
    lattice.build_ngram([[1]], 0)
  lm = lattice.build_ngram(HAND, 5, 3)
  with pytest.raises(ValueError, match="contexts"):
    lattice.ngram_logprob(lm, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2,), jnp.int32))


def test_save_load_round_trip_and_corruption(tmp_path):
  lm = lattice.build_ngram(HAND + [[0, 1, 0, 1]], 5, 3)
  lattice.save_ngram(tmp_path / "lm", lm, {"source": "hand"})
  back, info = lattice.load_ngram(tmp_path / "lm", vocab_size=5)
  assert info["source"] == "hand" and info["order"] == 3 and back.probe == lm.probe
  for t_a, t_b in zip(lm.tables, back.tables):
    for a, b in zip(jax.tree.leaves(t_a), jax.tree.leaves(t_b)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  contexts, tokens = [[5, 5], [1, 2], [3, 0]], [1, 3, 4]
  np.testing.assert_array_equal(logprob(lm, contexts, tokens), logprob(back, contexts, tokens))
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    lattice.load_ngram(tmp_path / "lm", vocab_size=6)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    lattice.load_ngram(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match="holds no n-gram LM"):
    lattice.load_ngram(tmp_path)
  npz = tmp_path / "lm" / lattice.NGRAM_NPZ
  raw = bytearray(npz.read_bytes())
  raw[len(raw) // 2] ^= 0xFF
  npz.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match="SHA-256 does not match"):
    lattice.load_ngram(tmp_path / "lm")
  (tmp_path / "lm" / lattice.NGRAM_JSON).write_text("{not json")
  with pytest.raises(ValueError, match="corrupted"):
    lattice.load_ngram(tmp_path / "lm")
  # a consistent file whose tables are not what the hashes say is refused too
  lattice.save_ngram(tmp_path / "bad", lm)
  path = tmp_path / "bad" / lattice.NGRAM_JSON
  record = json.loads(path.read_text())
  record["probe"] = lm.probe + 1
  path.write_text(json.dumps(record))
  with pytest.raises(ValueError, match="probe length"):
    lattice.load_ngram(tmp_path / "bad")


# --- the searches -----------------------------------------------------------------------------------------------------

def _lattice_case(seed=0, batch=3, gamma=3, k=3, vocab=9):
  rng = np.random.default_rng(seed)
  lm = lattice.build_ngram([rng.integers(0, vocab, 60).tolist() for _ in range(4)], vocab, 3)
  logits = jnp.asarray(rng.normal(size=(batch, gamma, vocab)) * 2.0, jnp.float32)
  cand, head_logp = lattice.lattice_candidates(logits, k)
  tokens_BxS = jnp.asarray(rng.integers(0, vocab, size=(batch, 10)), jnp.int32)
  length_B = jnp.asarray([1, 5, 10][:batch], jnp.int32)
  return lm, cand, head_logp, tokens_BxS, length_B


def _ngram_path_logp(lm, tokens_BxS, length_B):
  """``lm_logp_fn`` for lattice.path_scores: the n-gram log-probability of each path token given the committed
  text and the path's earlier tokens (computed directly, not through the search's callbacks)."""
  tail = lattice.context_window(tokens_BxS, length_B, lm.order - 1, lm.bos)

  def fn(tokens_BxPxG):
    batch, paths, gamma = tokens_BxPxG.shape
    full = jnp.concatenate([jnp.broadcast_to(tail[:, None], (batch, paths, lm.order - 1)), tokens_BxPxG], axis=2)
    contexts = jnp.stack([full[:, :, j:j + lm.order - 1] for j in range(gamma)], axis=2)
    return lattice.ngram_logprob(lm, contexts, tokens_BxPxG)

  return fn


@functools.partial(jax.jit, static_argnames=("width",))
def _searches(lm, cand, head_logp, tokens_BxS, length_B, lm_weight, *, width):
  """p-best at ``width``, p-best at width 1, local rescoring at T = 0 (its tokens and rows), in one program."""
  lattice_lm = lambda: lattice.ngram_lattice_lm(lm, tokens_BxS, length_B)
  _, best, score, _ = lattice.pbest_search(cand, head_logp, *lattice_lm(), lm_weight, width)
  _, greedy, _, _ = lattice.pbest_search(cand, head_logp, *lattice_lm(), lm_weight, 1)
  keys = jax.random.split(jax.random.key(0), cand.shape[0])
  _, local, q = lattice.local_rescore(keys, cand, head_logp, *lattice_lm(), lm_weight, GREEDY, lm.vocab_size)
  return best, score, greedy, local, q


def test_pbest_with_full_width_is_the_brute_force_best_path():
  lm, cand, head_logp, tokens_BxS, length_B = _lattice_case()
  batch, gamma, k = cand.shape
  paths = jnp.asarray(list(itertools.product(range(k), repeat=gamma)), jnp.int32)
  brute = jax.jit(lambda w: lattice.path_scores(jnp.broadcast_to(paths, (batch,) + paths.shape), cand, head_logp,
                                                _ngram_path_logp(lm, tokens_BxS, length_B), w))
  for lm_weight in (0.0, 0.7, 3.0):
    scores = np.asarray(brute(lm_weight))
    best = np.asarray(paths)[np.argmax(scores, axis=1)]
    want = np.take_along_axis(np.asarray(cand), best[:, :, None], axis=2)[:, :, 0]
    tokens, score, greedy, local, q = _searches(lm, cand, head_logp, tokens_BxS, length_B, lm_weight,
                                                width=k ** (gamma - 1))
    np.testing.assert_array_equal(tokens, want)
    np.testing.assert_allclose(score, np.max(scores, axis=1), rtol=1e-5)
    # width 1 is the greedy left-to-right path: local rescoring at T = 0
    np.testing.assert_array_equal(greedy, local)
    np.testing.assert_array_equal(np.asarray(q).argmax(-1), local)
  assert not np.array_equal(want, np.asarray(cand)[:, :, 0])  # the LM changed the best path: a real case
  # a width larger than the first column (more paths than candidates) still finds the best path
  wide, *_ = _searches(lm, cand, head_logp, tokens_BxS, length_B, 3.0, width=k ** gamma + 2)
  np.testing.assert_array_equal(wide, want)


def test_local_rescoring_rows_are_the_laws_the_tokens_were_drawn_from():
  lm, cand, head_logp, tokens_BxS, length_B = _lattice_case(seed=1, batch=2, gamma=3, k=4)
  keys = jax.random.split(jax.random.key(3), 2)
  local = jax.jit(lambda keys: lattice.local_rescore(keys, cand, head_logp,
                                                     *lattice.ngram_lattice_lm(lm, tokens_BxS, length_B), 0.5, T1, 9))
  _, tokens, q = local(keys)
  q = np.asarray(q)
  np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-6)
  logp_fn = jax.jit(_ngram_path_logp(lm, tokens_BxS, length_B))
  for j in range(3):
    # the law of token j given the drawn prefix: softmax of head + λ·LM over the candidates, zero elsewhere
    prefix = np.asarray(tokens)[:, None, :].repeat(4, axis=1)
    prefix[:, :, j] = np.asarray(cand)[:, j]
    lm_logp = np.asarray(logp_fn(jnp.asarray(prefix)))[:, :, j]
    score = np.asarray(head_logp)[:, j] + 0.5 * lm_logp
    want = np.zeros((2, 9))
    np.put_along_axis(want, np.asarray(cand)[:, j], np.exp(score - score.max(1, keepdims=True)), axis=1)
    np.testing.assert_allclose(q[:, j], want / want.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert np.all(q[np.arange(2), j, np.asarray(tokens)[:, j]] > 0)


# --- the n-gram-rescored drafter in the loop --------------------------------------------------------------------------

def _drafter_params(config, target, seed=7, num_heads=4):
  heads = heads_lib.init_heads(config.d_model, num_heads, jax.random.key(seed))
  heads["w2_HxDxD"] = jax.random.normal(jax.random.key(seed + 1), heads["w2_HxDxD"].shape) / np.sqrt(config.d_model)
  return {"heads": heads, "lm_head": heads_lib.lm_head_weight(config, target)}


def _random_ngram(vocab, seed=0):
  """An n-gram LM of random text: its scores are far from flat, which is all the lossless tests need."""
  rng = np.random.default_rng(seed)
  return lattice.build_ngram([rng.integers(0, vocab, 80).tolist() for _ in range(6)], vocab, 3)


@pytest.mark.parametrize("rescore", ["ngram", "pbest_ngram"])
def test_greedy_ngram_rescored_drafts_emit_the_autoregressive_tokens(rescore):
  config, target, _ = model_pair()
  keys = jax.random.split(jax.random.key(0), 4)
  ar = run_ar(config, target, RAGGED, keys, 16)
  # the n-gram of the greedy text itself plus random text: rescoring pulls drafts toward the target, not all the way
  text = [list(p) + np.asarray(o).tolist() for p, o in zip(RAGGED, ar.tokens_BxN)][:2]
  rng = np.random.default_rng(0)
  ngram = lattice.build_ngram(text + [rng.integers(0, 64, 200).tolist()], 64, 3)
  params = {**_drafter_params(config, target), "ngram": ngram}
  drafter = heads_lib.HeadsDrafter(config, num_heads=4, rescore=rescore, top_k=8, lm_weight=1.0, pbest=3)
  tokens, lens = spec.prepare_prompts(RAGGED)
  out = spec.generate_speculative(target, params, keys, tokens, lens, target=config, drafter=drafter, gamma=4,
                                  max_new_tokens=16, verifier="block", sampler=GREEDY)
  np.testing.assert_array_equal(out.tokens_BxN, ar.tokens_BxN)
  m = out.metrics
  assert 0 < int(m.num_accepted_tokens.sum()) < int(m.num_draft_tokens.sum())
  assert int(m.invalid_prob_rows.sum()) == 0


@pytest.mark.parametrize("verifier", ["token", "block"])
def test_ngram_local_rescoring_is_lossless_at_t1(verifier):
  """V = 6, γ = 2, k = 3 of 6 candidates: the first 3 emitted tokens follow the target's exact law (χ², 20k rows)
  while drafts are often rejected (the rule really works)."""
  config, target, _ = model_pair(vocab=6, seed=3, noise=1.0)
  prompt = [1, 4]
  params = {**_drafter_params(config, target, num_heads=2), "ngram": _random_ngram(6)}
  drafter = heads_lib.HeadsDrafter(config, num_heads=2, rescore="ngram", top_k=3, lm_weight=1.0)
  check_drafter_law_at_t1(config, target, params, drafter, verifier, gamma=2, prompt=prompt)
