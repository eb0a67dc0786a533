"""Top-k lattice rescoring for blockwise parallel decoding (Stern et al. 2018; Kim, Suresh et al., arXiv 2404.09221):
a token n-gram LM with jittable lookups, and the local / global (p-best) searches over the lattice, shared by every
rescoring LM.

**The lattice.** Heads ``j = 0 .. γ − 1`` give independent laws over the draft's tokens; column ``j`` of the lattice
holds the ``k`` most likely tokens of head ``j`` (:func:`lattice_candidates`: top-k of the T = 1 log-softmax), so the
lattice has ``k^γ`` paths. A path's score adds, per column, the head's log-probability and ``λ ×`` the rescoring LM's
log-probability of the token given the committed context and the path's earlier tokens::

    score(x_0 .. x_j) = Σ_{i ≤ j} [ log q_i(x_i) + λ · log LM(x_i | context, x_0 .. x_{i−1}) ]

* :func:`local_rescore` (left to right, one path): token ``j`` is drawn from ``sampler.probs`` of the column's
  scores (``−inf`` off the ``k`` candidates) given the tokens already drawn. The ``[B, γ, V]`` rows it returns are
  exactly the laws the tokens were drawn from (zeros off the candidates), so every lossless verification rule stays
  lossless at any temperature; at T = 0 it is the paper's greedy local rescoring.
* :func:`pbest_search` (global): a beam search of width ``p`` over the lattice with the path score; the best path is
  deterministic given the committed tokens and the target's states, so it is a point-mass draft (``q = None``):
  lossless with every rule. With ``p ≥ k^(γ−1)`` no prefix is pruned and it is the exact best path.

Both searches take the LM as a :class:`LatticeLM` callback pair, so the n-gram LM (:func:`ngram_lattice_lm`) and a
neural LM (a drafter decoder with its own KV cache, :mod:`blockspec_jax.drafters.heads`) run through one search.

**The n-gram LM** (:class:`NGramLM`, built by :func:`build_ngram` from token sequences): interpolated Kneser–Ney of
order ``n`` (default 3) with one absolute discount per order, ``D_k = n1 / (n1 + 2 n2)`` (Ney's estimate from the
order's count-of-counts, clipped to [0.1, 0.9]). Every sequence is preceded by ``n − 1`` copies of the sentinel
``V`` ("before the start"), which only ever appears in contexts. With ``c_k(h, w)`` the raw count of ``h w`` at the
top order ``k = n`` and the continuation count ``N1+(• h w)`` (distinct left neighbours) below it, ``c_k(h) = Σ_w
c_k(h, w)`` and ``T_k(h) = |{w : c_k(h, w) > 0}|``::

    P_0(w)          = 1 / V
    P_k(w | h)      = (max(c_k(h, w) − D_k, 0) + D_k · T_k(h) · P_{k−1}(w | h'))  /  c_k(h)    if c_k(h) > 0
                    = P_{k−1}(w | h')                                                            otherwise

(``h'`` = ``h`` without its first token). Each level sums to one over ``w ∈ [0, V)``, so ``P_n`` is a proper law and
its log is finite everywhere (``D_k > 0``).

Storage: per order ``k`` two hash tables (the ``k``-grams ``h w`` and their contexts ``h``), each sorted by a 32-bit
hash of the token ids (:func:`hash_rows`, computed identically by numpy at build time and by jax at lookup) then by
the ids; the ids are stored too, so a lookup (``jnp.searchsorted`` on the hashes, then a check of the ``probe``
entries from there: ``probe`` = the longest run of equal hashes in any table) is exact, collisions included. Files:
:func:`save_ngram` / :func:`load_ngram` (``ngram.npz`` + ``ngram.json`` with its SHA-256).
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from blockspec_jax import artifacts, sampling
from blockspec_jax.checks import check_int

__all__ = ["NGramTable", "NGramLM", "NGRAM_JSON", "NGRAM_NPZ", "hash_rows", "build_ngram", "ngram_logprob",
           "context_window", "save_ngram", "load_ngram", "LatticeLM", "lattice_candidates", "ngram_lattice_lm",
           "local_rescore", "pbest_search", "pbest_paths", "zero_lattice_lm", "path_scores"]

NGRAM_JSON, NGRAM_NPZ = "ngram.json", "ngram.npz"
_NGRAM = artifacts.Artifact(
    NGRAM_NPZ, NGRAM_JSON, what="n-gram LM",
    absent="holds no n-gram LM (the BPD heads training job writes one: python -m blockspec_jax.train --gin_file "
    "gin/train/heads_*.gin)", remedy="rebuild the n-gram LM")
_TABLE_FIELDS = ("key_hash_M", "key_tokens_MxK", "count_M", "ctx_hash_C", "ctx_tokens_CxJ", "ctx_total_C",
                 "ctx_types_C")
_DISCOUNT_RANGE = (0.1, 0.9)


# --- hashing ----------------------------------------------------------------------------------------------------------

_FNV_OFFSET, _FNV_PRIME, _GOLDEN = 0x811C9DC5, 0x01000193, 0x9E3779B1


def hash_rows(tokens_xK, salt: int, xp=jnp):
  """uint32 ``[...]``: a hash of each row of non-negative token ids ``[..., K]`` (FNV-1a over the ids with a
  murmur3 finaliser), salted by ``salt`` (table role and order). ``xp`` is ``numpy`` (build) or ``jax.numpy``
  (lookup): both compute the same values (uint32 arithmetic wraps around in both)."""
  u32 = xp.uint32
  tokens_xK = xp.asarray(tokens_xK).astype(u32)
  seed = (_FNV_OFFSET ^ ((salt * _GOLDEN) & 0xFFFFFFFF)) & 0xFFFFFFFF
  h = xp.full(tokens_xK.shape[:-1], seed, dtype=u32)
  for i in range(tokens_xK.shape[-1]):
    h = (h ^ tokens_xK[..., i]) * u32(_FNV_PRIME)
    h = h ^ (h >> u32(13))
  h = h ^ (h >> u32(16))
  h = h * u32(0x85EBCA6B)
  h = h ^ (h >> u32(13))
  h = h * u32(0xC2B2AE35)
  return h ^ (h >> u32(16))


def _key_salt(order: int) -> int:
  return 2 * order


def _ctx_salt(order: int) -> int:
  return 2 * order + 1


# --- the n-gram LM ----------------------------------------------------------------------------------------------------

@struct.dataclass
class NGramTable:
  """One order ``k`` of :class:`NGramLM` (``M`` k-grams, ``C`` contexts of ``J = k − 1`` tokens), sorted by hash.

  ``key_hash_M`` uint32 ``[M]``, ``key_tokens_MxK`` int32 ``[M, k]`` (context then word), ``count_M`` f32 ``[M]``
  (raw count at the top order, continuation count below); ``ctx_hash_C`` uint32 ``[C]``, ``ctx_tokens_CxJ`` int32
  ``[C, k − 1]``, ``ctx_total_C`` f32 ``[C]`` (``c_k(h)``), ``ctx_types_C`` f32 ``[C]`` (``T_k(h)``).
  """
  key_hash_M: jax.Array
  key_tokens_MxK: jax.Array
  count_M: jax.Array
  ctx_hash_C: jax.Array
  ctx_tokens_CxJ: jax.Array
  ctx_total_C: jax.Array
  ctx_types_C: jax.Array


@struct.dataclass
class NGramLM:
  """An interpolated Kneser–Ney token LM (see the module docstring). A pytree (pass it in a drafter's params); the
  vocabulary, the order (``len(tables)``) and the probe length are static.

  ``tables``      one :class:`NGramTable` per order ``1 .. n``
  ``discount_N``  f32 ``[n]``: ``D_k`` of order ``k = 1 .. n``
  """
  tables: tuple
  discount_N: jax.Array
  vocab_size: int = struct.field(pytree_node=False)
  probe: int = struct.field(pytree_node=False, default=1)

  @property
  def order(self) -> int:
    return len(self.tables)

  @property
  def bos(self) -> int:
    """The sentinel id of positions before the start of a sequence (``V``)."""
    return self.vocab_size


def _check_vocab(vocab_size) -> int:
  return check_int(vocab_size, "vocab_size")


def _discount(counts: np.ndarray) -> float:
  n1, n2 = int(np.sum(counts == 1)), int(np.sum(counts == 2))
  d = n1 / (n1 + 2 * n2) if n1 + 2 * n2 > 0 else 0.5
  return float(np.clip(d, *_DISCOUNT_RANGE))


def _sorted_table(tokens_MxK: np.ndarray, salt: int, values: Sequence[np.ndarray]):
  """Rows sorted by (hash, ids): ``(hash_M, tokens_MxK, values…, longest run of one hash)``."""
  hash_M = hash_rows(tokens_MxK, salt, np)
  order = np.lexsort(tuple(tokens_MxK[:, i] for i in range(tokens_MxK.shape[1] - 1, -1, -1)) + (hash_M,))
  hash_M = hash_M[order]
  run = int(np.max(np.unique(hash_M, return_counts=True)[1], initial=1))
  return (hash_M, tokens_MxK[order].astype(np.int32), *(v[order] for v in values)), run


def build_ngram(sequences, vocab_size: int, order: int = 3) -> NGramLM:
  """The interpolated Kneser–Ney LM of ``order`` over ``sequences`` (an iterable of 1-D int sequences with ids in
  ``[0, V)``; empty ones are skipped). Host-side numpy; returns jax arrays. ValueError for bad ids, a bad order or no
  tokens at all."""
  vocab = _check_vocab(vocab_size)
  n = check_int(order, "n-gram order")
  windows = []
  for i, seq in enumerate(sequences):
    seq = np.asarray(seq)
    if seq.ndim != 1 or (seq.size and not np.issubdtype(seq.dtype, np.integer)):
      raise ValueError(f"sequence {i} must be a 1-D sequence of integer token ids, got shape {seq.shape} dtype "
                       f"{seq.dtype}")
    if seq.size == 0:
      continue
    if seq.min() < 0 or seq.max() >= vocab:
      raise ValueError(f"sequence {i} holds ids outside [0, V = {vocab}): min {seq.min()}, max {seq.max()}")
    padded = np.concatenate([np.full((n - 1,), vocab, np.int64), seq.astype(np.int64)])
    windows.append(np.lib.stride_tricks.sliding_window_view(padded, n))
  if not windows:
    raise ValueError("no tokens to build an n-gram LM from")
  grams = np.concatenate(windows, axis=0)
  keys = {n: np.unique(grams, axis=0, return_counts=True)}
  for k in range(n - 1, 0, -1):  # continuation counts: distinct left neighbours of each k-gram
    keys[k] = np.unique(keys[k + 1][0][:, 1:], axis=0, return_counts=True)
  tables, discounts, probe = [], [], 1
  for k in range(1, n + 1):
    tokens_MxK, counts_M = keys[k]
    counts_M = counts_M.astype(np.float32)
    discounts.append(_discount(counts_M))
    if k == 1:
      ctx_CxJ = np.zeros((1, 0), np.int64)
      total_C, types_C = np.array([counts_M.sum()], np.float32), np.array([len(counts_M)], np.float32)
    else:
      ctx_CxJ, inverse = np.unique(tokens_MxK[:, :k - 1], axis=0, return_inverse=True)
      inverse = inverse.reshape(-1)
      total_C = np.bincount(inverse, weights=counts_M, minlength=len(ctx_CxJ)).astype(np.float32)
      types_C = np.bincount(inverse, minlength=len(ctx_CxJ)).astype(np.float32)
    (key_hash, key_tokens, count), run_k = _sorted_table(tokens_MxK, _key_salt(k), (counts_M,))
    (ctx_hash, ctx_tokens, total, types), run_c = _sorted_table(ctx_CxJ, _ctx_salt(k), (total_C, types_C))
    probe = max(probe, run_k, run_c)
    tables.append(NGramTable(jnp.asarray(key_hash), jnp.asarray(key_tokens), jnp.asarray(count),
                             jnp.asarray(ctx_hash), jnp.asarray(ctx_tokens), jnp.asarray(total),
                             jnp.asarray(types)))
  return NGramLM(tuple(tables), jnp.asarray(discounts, jnp.float32), vocab, probe)


def _find(hash_M, tokens_MxK, query_xK, salt: int, probe: int):
  """``(found_x bool, index_x int32)`` of the rows ``query_xK`` in a sorted table (exact: ids compared)."""
  q_x = hash_rows(query_xK, salt, jnp)
  start_x = jnp.searchsorted(hash_M, q_x, side="left").astype(jnp.int32)
  last = hash_M.shape[0] - 1
  found_x = jnp.zeros(q_x.shape, bool)
  index_x = jnp.zeros(q_x.shape, jnp.int32)
  for r in range(probe):
    at_x = jnp.minimum(start_x + r, last)
    hit_x = (hash_M[at_x] == q_x) & jnp.all(tokens_MxK[at_x] == query_xK, axis=-1)
    index_x = jnp.where(hit_x & ~found_x, at_x, index_x)
    found_x = found_x | hit_x
  return found_x, index_x


def ngram_logprob(lm: NGramLM, context_xC: jax.Array, tokens_x: jax.Array) -> jax.Array:
  """f32 ``[...]``: ``log P_n(token | context)`` for ``tokens_x`` int ``[...]`` in ``[0, V)`` and ``context_xC``
  int ``[..., C]`` (same leading shape, ``C ≥ n − 1``: only its last ``n − 1`` ids are read; the sentinel ``V`` marks
  positions before the start). Jittable; every lookup is a binary search."""
  n = lm.order
  context_xC = jnp.asarray(context_xC, jnp.int32)
  tokens_x = jnp.asarray(tokens_x, jnp.int32)
  if context_xC.shape[-1] < n - 1 or context_xC.shape[:-1] != tokens_x.shape:
    raise ValueError(f"ngram_logprob needs contexts [..., C >= {n - 1}] with the tokens' leading shape; got "
                     f"contexts {context_xC.shape} and tokens {tokens_x.shape}")
  width = context_xC.shape[-1]
  prob_x = jnp.full(tokens_x.shape, 1.0 / lm.vocab_size, jnp.float32)
  for k in range(1, n + 1):
    table = lm.tables[k - 1]
    ctx_xJ = context_xC[..., width - (k - 1):]
    c_found, c_index = _find(table.ctx_hash_C, table.ctx_tokens_CxJ, ctx_xJ, _ctx_salt(k), lm.probe)
    total_x = jnp.where(c_found, table.ctx_total_C[c_index], 0.0)
    types_x = jnp.where(c_found, table.ctx_types_C[c_index], 0.0)
    k_found, k_index = _find(table.key_hash_M, table.key_tokens_MxK,
                             jnp.concatenate([ctx_xJ, tokens_x[..., None]], axis=-1), _key_salt(k), lm.probe)
    count_x = jnp.where(k_found, table.count_M[k_index], 0.0)
    d = lm.discount_N[k - 1]
    higher_x = (jnp.maximum(count_x - d, 0.0) + d * types_x * prob_x) / jnp.maximum(total_x, 1.0)
    prob_x = jnp.where(total_x > 0, higher_x, prob_x)
  return jnp.log(prob_x)


def context_window(tokens_BxS: jax.Array, length_B: jax.Array, width: int, bos: int) -> jax.Array:
  """int32 ``[B, width]``: each row's last ``width`` committed tokens ``tokens_BxS[b, length_b − width : length_b]``,
  ``bos`` where that reaches before position 0."""
  positions_BxW = length_B[:, None] - width + jnp.arange(width, dtype=jnp.int32)[None, :]
  rows_B = jnp.arange(tokens_BxS.shape[0])
  picked_BxW = tokens_BxS[rows_B[:, None], jnp.clip(positions_BxW, 0, tokens_BxS.shape[1] - 1)]
  return jnp.where(positions_BxW >= 0, picked_BxW, bos).astype(jnp.int32)


# --- storage ----------------------------------------------------------------------------------------------------------

def save_ngram(directory, lm: NGramLM, info: dict | None = None) -> pathlib.Path:
  """Write ``lm`` to ``<directory>/ngram.npz`` (the tables) and ``<directory>/ngram.json`` (``info``, JSON-able,
  plus the order, vocabulary, probe length, discounts, table sizes and the npz's SHA-256, checked on load), both
  atomically, the npz first. Returns the json's path."""
  arrays = {"discount_N": np.asarray(lm.discount_N, np.float32)}
  for k, table in enumerate(lm.tables, start=1):
    for field in _TABLE_FIELDS:
      arrays[f"k{k}_{field}"] = np.asarray(getattr(table, field))
  return _NGRAM.save(directory, arrays, info,
                     {"order": lm.order, "vocab_size": lm.vocab_size, "probe": lm.probe,
                      "discounts": [float(d) for d in np.asarray(lm.discount_N)],
                      "num_ngrams": [int(t.key_hash_M.shape[0]) for t in lm.tables]})


def load_ngram(directory, vocab_size: int | None = None) -> tuple[NGramLM, dict]:
  """``(lm, info)`` saved by :func:`save_ngram` in ``directory``. FileNotFoundError for a missing directory or file;
  ValueError for a corrupted or tampered file (SHA-256, shapes, the sort order and the probe length are checked) or,
  with ``vocab_size``, an LM of another vocabulary."""
  directory = pathlib.Path(directory).expanduser()
  info = _NGRAM.read_record(directory, convert={"order": int, "vocab_size": int, "probe": int})
  order, vocab, probe = info["order"], info["vocab_size"], info["probe"]
  path, npz_path = _NGRAM.paths(directory, info)
  if vocab_size is not None and int(vocab_size) != vocab:
    raise ValueError(f"the n-gram LM in {directory} has V = {vocab}; the target has V = {vocab_size} (vocabulary "
                     "mismatch: build it with the target's tokenizer)")
  names = ["discount_N"] + [f"k{k}_{field}" for k in range(1, order + 1) for field in _TABLE_FIELDS]
  arrays = _NGRAM.read_arrays(directory, info, names=names)
  discount_N = arrays["discount_N"].astype(np.float32)
  raw = [{field: arrays[f"k{k}_{field}"] for field in _TABLE_FIELDS} for k in range(1, order + 1)]
  if discount_N.shape != (order,) or not np.all((discount_N > 0) & (discount_N < 1)):
    raise ValueError(f"{npz_path}: discounts must be {order} numbers in (0, 1), got {discount_N.tolist()}")
  tables, longest = [], 1
  for k, t in enumerate(raw, start=1):
    m, c = t["key_hash_M"].shape[0], t["ctx_hash_C"].shape[0]
    shapes_ok = (t["key_tokens_MxK"].shape == (m, k) and t["count_M"].shape == (m,)
                 and t["ctx_tokens_CxJ"].shape == (c, k - 1) and t["ctx_total_C"].shape == (c,)
                 and t["ctx_types_C"].shape == (c,) and m > 0 and c > 0)
    if not shapes_ok or t["key_hash_M"].dtype != np.uint32 or t["ctx_hash_C"].dtype != np.uint32:
      raise ValueError(f"{npz_path}: the order-{k} tables have inconsistent shapes or dtypes")
    for hashes, tokens, salt in ((t["key_hash_M"], t["key_tokens_MxK"], _key_salt(k)),
                                 (t["ctx_hash_C"], t["ctx_tokens_CxJ"], _ctx_salt(k))):
      if np.any(np.diff(hashes.astype(np.int64)) < 0) or not np.array_equal(hash_rows(tokens, salt, np), hashes):
        raise ValueError(f"{npz_path}: the order-{k} tables are not sorted by their hashes")
      longest = max(longest, int(np.max(np.unique(hashes, return_counts=True)[1])))
    if np.any((t["key_tokens_MxK"] < 0) | (t["key_tokens_MxK"] > vocab)):
      raise ValueError(f"{npz_path}: the order-{k} table holds ids outside [0, V]")
    tables.append(NGramTable(*(jnp.asarray(t[field]) for field in _TABLE_FIELDS)))
  if longest != probe:
    raise ValueError(f"{npz_path}: probe length {probe} in {path} does not match the tables ({longest})")
  return NGramLM(tuple(tables), jnp.asarray(discount_N), vocab, probe), info


# --- the lattice and its searches -------------------------------------------------------------------------------------

class LatticeLM(NamedTuple):
  """A rescoring LM as the searches call it (``W`` paths are scored at once; ``G`` = γ, ``K`` = k).

  ``init(state, cand_BxK) -> (state, logp_BxK)``: log-probabilities of column 0's candidates after the committed
      tokens.
  ``extend(state, j, prefix_BxWxG, parent_BxW, cand_BxK) -> (state, logp_BxWxK)``: the paths now hold tokens
      ``prefix[:, w, :j]`` (``j ≥ 1``, possibly traced); path ``w`` extends the path ``parent[b, w]`` of the previous
      call (or of ``init``), i.e. ``prefix[:, w, j − 1]`` is the token just appended to it. Returns the
      log-probabilities of column ``j``'s candidates after each path. A stateless LM ignores ``parent``; a cached
      one feeds ``prefix[:, :, j − 1]``.
  """
  init: Callable[[Any, jax.Array], tuple]
  extend: Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], tuple]


def lattice_candidates(logits_BxGxV: jax.Array, k: int):
  """``(cand_BxGxK int32, logp_BxGxK f32)``: column ``j`` = the ``k`` most likely tokens of head ``j`` under its
  T = 1 law (``log_softmax``), best first."""
  logp_BxGxV = jax.nn.log_softmax(logits_BxGxV.astype(jnp.float32), axis=-1)
  logp_BxGxK, cand_BxGxK = jax.lax.top_k(logp_BxGxV, k)
  return cand_BxGxK.astype(jnp.int32), logp_BxGxK


def ngram_lattice_lm(lm: NGramLM, tokens_BxS: jax.Array, length_B: jax.Array):
  """``(LatticeLM, state)`` of the n-gram LM after each row's committed tokens (the state is the last ``n − 1``
  committed ids, ``[B, n − 1]``; the LM is stateless along a path: contexts are read from the prefix)."""
  n = lm.order
  tail_BxC = context_window(tokens_BxS, length_B, n - 1, lm.bos)

  def init(state, cand_BxK):
    context_BxKxC = jnp.broadcast_to(state[:, None, :], cand_BxK.shape + (n - 1,))
    return state, ngram_logprob(lm, context_BxKxC, cand_BxK)

  def extend(state, j, prefix_BxWxG, parent_BxW, cand_BxK):
    del parent_BxW
    batch, width, _ = prefix_BxWxG.shape
    full_BxWxL = jnp.concatenate([jnp.broadcast_to(state[:, None, :], (batch, width, n - 1)), prefix_BxWxG], axis=2)
    context_BxWxC = jax.lax.dynamic_slice_in_dim(full_BxWxL, j, n - 1, axis=2)  # ids j .. j + n − 2 = before x_j
    k = cand_BxK.shape[1]
    context_BxWxKxC = jnp.broadcast_to(context_BxWxC[:, :, None, :], (batch, width, k, n - 1))
    cand_BxWxK = jnp.broadcast_to(cand_BxK[:, None, :], (batch, width, k))
    return state, ngram_logprob(lm, context_BxWxKxC, cand_BxWxK)

  return LatticeLM(init, extend), tail_BxC


def _check_lattice(cand_BxGxK, logp_BxGxK):
  if cand_BxGxK.ndim != 3 or cand_BxGxK.shape != logp_BxGxK.shape:
    raise ValueError(f"the lattice needs candidates and log-probabilities [B, G, K] of one shape, got "
                     f"{cand_BxGxK.shape} and {logp_BxGxK.shape}")


def local_rescore(key_B: jax.Array, cand_BxGxK: jax.Array, head_logp_BxGxK: jax.Array, lm: LatticeLM, lm_state,
                  lm_weight: float, sampler: sampling.Sampler, vocab_size: int):
  """Left-to-right rescoring of one path per row: ``(lm_state, tokens_BxG int32, q_BxGxV f32)``.

  Token ``j`` is drawn (key ``split(key_B[b], γ)[j]``) from ``q_j = sampler.probs(s_j)``, ``s_j(x) = log q_j^head(x)
  + λ · log LM(x | context, x_0 .. x_{j−1})`` on column ``j``'s candidates and ``−inf`` elsewhere; ``q_BxGxV`` holds
  exactly these laws (the conditional law of each token given the earlier ones: lossless verification). At T = 0 it
  is the greedy local rescoring (ties: the lowest id)."""
  _check_lattice(cand_BxGxK, head_logp_BxGxK)
  batch, gamma, _ = cand_BxGxK.shape
  rows_Bx1 = jnp.arange(batch)[:, None]
  keys_GxB = jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, gamma))(key_B), 0, 1)

  def choose(cand_BxK, head_BxK, lm_BxK, key_B):
    score_BxK = head_BxK + jnp.float32(lm_weight) * lm_BxK
    score_BxV = jnp.full((batch, vocab_size), -jnp.inf, jnp.float32).at[rows_Bx1, cand_BxK].set(score_BxK)
    q_BxV = sampler.probs(score_BxV)
    return jax.vmap(sampling.sample)(key_B, q_BxV).astype(jnp.int32), q_BxV

  lm_state, lm0_BxK = lm.init(lm_state, cand_BxGxK[:, 0])
  x0_B, q0_BxV = choose(cand_BxGxK[:, 0], head_logp_BxGxK[:, 0], lm0_BxK, keys_GxB[0])
  index_G = jnp.arange(gamma, dtype=jnp.int32)
  prefix_Bx1xG = jnp.zeros((batch, 1, gamma), jnp.int32).at[:, 0, 0].set(x0_B)
  parent_Bx1 = jnp.zeros((batch, 1), jnp.int32)

  def step(carry, xs):
    lm_state, prefix_Bx1xG = carry
    j, cand_BxK, head_BxK, key_B = xs
    lm_state, lm_Bx1xK = lm.extend(lm_state, j, prefix_Bx1xG, parent_Bx1, cand_BxK)
    x_B, q_BxV = choose(cand_BxK, head_BxK, lm_Bx1xK[:, 0], key_B)
    prefix_Bx1xG = jnp.where((index_G == j)[None, None, :], x_B[:, None, None], prefix_Bx1xG)
    return (lm_state, prefix_Bx1xG), q_BxV

  xs = (index_G[1:], jnp.swapaxes(cand_BxGxK, 0, 1)[1:], jnp.swapaxes(head_logp_BxGxK, 0, 1)[1:], keys_GxB[1:])
  (lm_state, prefix_Bx1xG), q_GmxBxV = jax.lax.scan(step, (lm_state, prefix_Bx1xG), xs)
  q_BxGxV = jnp.concatenate([q0_BxV[:, None], jnp.swapaxes(q_GmxBxV, 0, 1)], axis=1)
  return lm_state, prefix_Bx1xG[:, 0], q_BxGxV


def pbest_search(cand_BxGxK: jax.Array, head_logp_BxGxK: jax.Array, lm: LatticeLM, lm_state, lm_weight: float,
                 width: int):
  """Beam search of ``width`` paths over the lattice with the path score of the module docstring:
  ``(lm_state, tokens_BxG int32, score_B f32, lm_path_B int32)``: the best path found, its score, and the index of
  its prefix (tokens ``0 .. γ − 2``) among the paths of the last ``lm.extend`` call (0 when ``γ = 1``), for a cached
  LM that keeps the chosen path. Deterministic; exhaustive (the exact best path) when ``width ≥ k^(γ−1)``. Ties go
  to the earlier path in (beam, candidate) order. :func:`pbest_paths` returns all ``width`` paths."""
  lm_state, paths_BxWxG, score_BxW, parent_BxW = pbest_paths(cand_BxGxK, head_logp_BxGxK, lm, lm_state, lm_weight,
                                                             width)
  return lm_state, paths_BxWxG[:, 0], score_BxW[:, 0], parent_BxW[:, 0]


def zero_lattice_lm() -> tuple[LatticeLM, None]:
  """The "0-gram" LM: every candidate scores 0, so a search ranks paths by the heads' scores alone (the BPD paper's
  control)."""

  def init(state, cand_BxK):
    return state, jnp.zeros(cand_BxK.shape, jnp.float32)

  def extend(state, j, prefix_BxWxG, parent_BxW, cand_BxK):
    del j, parent_BxW
    return state, jnp.zeros(prefix_BxWxG.shape[:2] + cand_BxK.shape[1:], jnp.float32)

  return LatticeLM(init, extend), None


def pbest_paths(cand_BxGxK: jax.Array, head_logp_BxGxK: jax.Array, lm: LatticeLM, lm_state, lm_weight: float,
                width: int):
  """The beam search of :func:`pbest_search`, every path kept: ``(lm_state, paths_BxWxG int32, score_BxW f32,
  lm_parent_BxW int32)``, best first (path ``w``'s prefix is path ``lm_parent[w]`` of the last ``lm.extend`` call).
  The paths are distinct while the lattice holds ``width`` finite-score paths (``k^γ ≥ width``); where it holds
  fewer, the last ones repeat a path with score ``−inf``."""
  _check_lattice(cand_BxGxK, head_logp_BxGxK)
  width = check_int(width, "p-best width")
  batch, gamma, k = cand_BxGxK.shape
  lam = jnp.float32(lm_weight)
  index_G = jnp.arange(gamma, dtype=jnp.int32)

  def select(total_BxWxK, cand_BxK, prefix_BxWxG, j):
    """The ``width`` best expansions: ``(score_BxW, parent_BxW, prefix_BxWxG)`` with token ``j`` appended."""
    flat_BxF = total_BxWxK.reshape(batch, -1)
    score_BxW, pick_BxW = jax.lax.top_k(flat_BxF, width) if flat_BxF.shape[1] >= width else _top_pad(flat_BxF,
                                                                                                      width)
    parent_BxW, column_BxW = pick_BxW // k, pick_BxW % k
    token_BxW = jnp.take_along_axis(cand_BxK, column_BxW, axis=1)
    prefix_BxWxG = jnp.take_along_axis(prefix_BxWxG, parent_BxW[:, :, None], axis=1)
    prefix_BxWxG = jnp.where((index_G == j)[None, None, :], token_BxW[:, :, None], prefix_BxWxG)
    return score_BxW, parent_BxW.astype(jnp.int32), prefix_BxWxG

  lm_state, lm0_BxK = lm.init(lm_state, cand_BxGxK[:, 0])
  total_Bx1xK = (head_logp_BxGxK[:, 0] + lam * lm0_BxK)[:, None, :]
  score_BxW, parent_BxW, prefix_BxWxG = select(total_Bx1xK, cand_BxGxK[:, 0],
                                               jnp.zeros((batch, 1, gamma), jnp.int32), 0)
  last_parent_BxW = jnp.zeros_like(parent_BxW)

  def step(carry, xs):
    lm_state, score_BxW, parent_BxW, prefix_BxWxG, _ = carry
    j, cand_BxK, head_BxK = xs
    lm_state, lm_BxWxK = lm.extend(lm_state, j, prefix_BxWxG, parent_BxW, cand_BxK)
    total_BxWxK = score_BxW[:, :, None] + head_BxK[:, None, :] + lam * lm_BxWxK
    new_score_BxW, new_parent_BxW, prefix_BxWxG = select(total_BxWxK, cand_BxK, prefix_BxWxG, j)
    return (lm_state, new_score_BxW, new_parent_BxW, prefix_BxWxG, new_parent_BxW), None

  xs = (index_G[1:], jnp.swapaxes(cand_BxGxK, 0, 1)[1:], jnp.swapaxes(head_logp_BxGxK, 0, 1)[1:])
  (lm_state, score_BxW, _, prefix_BxWxG, last_parent_BxW), _ = jax.lax.scan(
      step, (lm_state, score_BxW, parent_BxW, prefix_BxWxG, last_parent_BxW), xs)
  # top_k sorts best first: path 0 is the best one.
  return lm_state, prefix_BxWxG, score_BxW, last_parent_BxW


def _top_pad(flat_BxF, width: int):
  """``top_k`` for fewer entries than ``width``: the sorted entries, then ``−inf`` copies of the last one."""
  values_BxF, index_BxF = jax.lax.top_k(flat_BxF, flat_BxF.shape[1])
  pad = width - flat_BxF.shape[1]
  values_BxW = jnp.concatenate([values_BxF, jnp.full((flat_BxF.shape[0], pad), -jnp.inf, values_BxF.dtype)], axis=1)
  index_BxW = jnp.concatenate([index_BxF, jnp.repeat(index_BxF[:, -1:], pad, axis=1)], axis=1)
  return values_BxW, index_BxW


def path_scores(paths_BxPxG: jax.Array, cand_BxGxK: jax.Array, head_logp_BxGxK: jax.Array,
                lm_logp_fn: Callable[[jax.Array], jax.Array], lm_weight: float) -> jax.Array:
  """f32 ``[B, P]``: the score of explicit lattice paths ``paths_BxPxG`` (column indices into the candidates), for
  brute-force checks and reports. ``lm_logp_fn(tokens_BxPxG) -> [B, P, G]`` gives ``log LM(x_j | context, x_<j)``."""
  tokens_BxPxG = jnp.take_along_axis(cand_BxGxK[:, None], paths_BxPxG[..., None], axis=3)[..., 0]
  head_BxPxG = jnp.take_along_axis(head_logp_BxGxK[:, None], paths_BxPxG[..., None], axis=3)[..., 0]
  return jnp.sum(head_BxPxG + jnp.float32(lm_weight) * lm_logp_fn(tokens_BxPxG), axis=-1)
