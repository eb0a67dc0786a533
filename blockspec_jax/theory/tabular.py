"""Tabular language models: the law of the next token given the prefix, as an explicit table (numpy, float64).

A :class:`TabularLM` of depth ``L`` over a vocabulary of size ``V`` has one row (a distribution over ``V`` tokens)
for every prefix of length ``m ≤ L``, so it can express *any* law for the first ``L + 1`` tokens; a prefix longer
than ``L`` uses the row of its last ``L`` tokens (an order-``L`` Markov chain from there on). Rows are ordered by
prefix length, then lexicographically::

    offset(m) = Σ_{l<m} V**l                                  m = 0..L
    row(prefix) = offset(m) + Σ_{j<m} s_j · V**(m-1-j)          m = min(len(prefix), L), s = last m tokens of prefix
    num_rows = offset(L) + V**L = Σ_{l=0..L} V**l

Depth 0 is a context-free model (one row). These models are small by design: they are the ground truth for exact
enumeration in :mod:`blockspec_jax.theory.exact`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import numpy as np

__all__ = ["TabularLM", "row_offsets", "num_rows_for"]

_ROW_SUM_TOLERANCE = 1e-6


def _check_int(name: str, value, minimum: int) -> int:
  """``value`` as a Python int ``≥ minimum`` (bools rejected), else ``ValueError``."""
  if isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be an integer, got {value!r}")
  try:
    as_int = operator.index(value)
  except TypeError:
    raise ValueError(f"{name} must be an integer, got {value!r}") from None
  if as_int < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {as_int}")
  return as_int


def num_rows_for(vocab_size: int, depth: int) -> int:
  """``Σ_{l=0..depth} vocab_size**l`` as an exact Python int."""
  vocab_size = _check_int("vocab_size", vocab_size, 1)
  depth = _check_int("depth", depth, 0)
  return sum(vocab_size**l for l in range(depth + 1))


def row_offsets(vocab_size: int, depth: int) -> np.ndarray:
  """First row of each prefix length: int64 ``[depth + 1]``, entry ``m`` is ``offset(m) = Σ_{l<m} V**l``."""
  vocab_size = _check_int("vocab_size", vocab_size, 1)
  depth = _check_int("depth", depth, 0)
  return np.array([sum(vocab_size**l for l in range(m)) for m in range(depth + 1)], dtype=np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class TabularLM:
  """Next-token law given the prefix, as a table.

  Attributes:
    probs: float64 ``[num_rows, V]``, row ``r`` the law of the next token after the prefix(es) mapped to ``r`` (see
      the module docstring). Stored as a read-only float64 copy.
    depth: ``L ≥ 0``; prefixes of length ``≤ L`` each have their own row, longer ones use their last ``L`` tokens.

  Equality and hashing are by identity (``eq=False``): the table is an array, compare ``probs`` explicitly.
  """

  probs: np.ndarray
  depth: int

  def __post_init__(self):
    depth = _check_int("depth", self.depth, 0)
    probs = np.array(self.probs, dtype=np.float64, copy=True)
    if probs.ndim != 2:
      raise ValueError(f"probs must be 2-D [num_rows, V], got shape {probs.shape}")
    num_rows, vocab_size = probs.shape
    if vocab_size < 1:
      raise ValueError(f"probs must have at least one column (V >= 1), got shape {probs.shape}")
    expected_rows = num_rows_for(vocab_size, depth)
    if num_rows != expected_rows:
      raise ValueError(f"probs has {num_rows} rows but depth={depth}, V={vocab_size} needs "
                       f"sum_(l=0..{depth}) {vocab_size}**l = {expected_rows}")
    if not np.all(np.isfinite(probs)):
      raise ValueError("probs must be finite (found NaN or inf)")
    if np.any(probs < 0):
      bad_row = int(np.argwhere(probs < 0)[0, 0])
      raise ValueError(f"probs must be non-negative (row {bad_row} has a negative entry)")
    row_sums = probs.sum(axis=1)
    bad = np.abs(row_sums - 1.0) > _ROW_SUM_TOLERANCE
    if np.any(bad):
      bad_row = int(np.argmax(bad))
      raise ValueError(f"every row of probs must sum to 1 within {_ROW_SUM_TOLERANCE}; row {bad_row} sums to "
                       f"{row_sums[bad_row]!r}")
    probs.setflags(write=False)
    object.__setattr__(self, "probs", probs)
    object.__setattr__(self, "depth", depth)

  # --- structure -----------------------------------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    """``V``."""
    return int(self.probs.shape[1])

  @property
  def num_rows(self) -> int:
    """``Σ_{l=0..L} V**l``."""
    return int(self.probs.shape[0])

  def _checked_prefix(self, prefix: Sequence[int]) -> tuple[int, ...]:
    """``prefix`` as a tuple of Python ints in ``[0, V)``, else ``ValueError``."""
    tokens = []
    for token in prefix:
      if isinstance(token, (bool, np.bool_)):
        raise ValueError(f"tokens must be integers, got {token!r}")
      try:
        token = operator.index(token)
      except TypeError:
        raise ValueError(f"tokens must be integers, got {token!r}") from None
      if not 0 <= token < self.vocab_size:
        raise ValueError(f"token {token} out of range [0, {self.vocab_size})")
      tokens.append(token)
    return tuple(tokens)

  def row_index(self, prefix: Sequence[int]) -> int:
    """Row of ``prefix``: ``offset(m) + Σ_j s_j V**(m-1-j)``, ``m = min(len(prefix), L)``, ``s`` its last m tokens."""
    tokens = self._checked_prefix(prefix)
    m = min(len(tokens), self.depth)
    vocab_size = self.vocab_size
    index = sum(vocab_size**l for l in range(m))
    for j, token in enumerate(tokens[len(tokens) - m:]):
      index += token * vocab_size**(m - 1 - j)
    return index

  def next_probs(self, prefix: Sequence[int]) -> np.ndarray:
    """``M(· | prefix)``: read-only float64 ``[V]`` (a view of the table)."""
    return self.probs[self.row_index(prefix)]

  def sequence_prob(self, prefix: Sequence[int], tokens: Sequence[int]) -> float:
    """``M(tokens | prefix) = Π_i M(tokens_i | prefix ⊕ tokens_{<i})``, multiplied left to right (1.0 if empty)."""
    prefix = self._checked_prefix(prefix)
    tokens = self._checked_prefix(tokens)
    prob = 1.0
    for i, token in enumerate(tokens):
      prob *= float(self.probs[self.row_index(prefix + tokens[:i]), token])
    return prob

  # --- constructors --------------------------------------------------------------------------------------------

  @classmethod
  def context_free(cls, probs_V) -> "TabularLM":
    """Depth-0 model: the next token is ``probs_V`` (float ``[V]``) whatever the prefix."""
    probs_V = np.asarray(probs_V, dtype=np.float64)
    if probs_V.ndim != 1:
      raise ValueError(f"probs_V must be 1-D [V], got shape {probs_V.shape}")
    return cls(probs=probs_V[None, :], depth=0)

  @classmethod
  def random(cls, rng_or_seed, vocab_size: int, depth: int, concentration: float = 1.0) -> "TabularLM":
    """Every row drawn i.i.d. from ``Dirichlet(concentration · 1_V)`` with ``np.random.default_rng(rng_or_seed)``.

    Small concentrations give peaked rows (possibly with exact zeros); rows are used as drawn.
    """
    vocab_size = _check_int("vocab_size", vocab_size, 1)
    depth = _check_int("depth", depth, 0)
    if not (np.isfinite(concentration) and concentration > 0):
      raise ValueError(f"concentration must be a positive finite number, got {concentration!r}")
    rng = np.random.default_rng(rng_or_seed)
    probs = rng.dirichlet(np.full(vocab_size, float(concentration)), size=num_rows_for(vocab_size, depth))
    return cls(probs=probs, depth=depth)

  @classmethod
  def from_logits(cls, logits_RxV, depth: int) -> "TabularLM":
    """Row-wise softmax of float ``[num_rows, V]`` logits (max-subtracted, float64)."""
    logits_RxV = np.asarray(logits_RxV, dtype=np.float64)
    if logits_RxV.ndim != 2:
      raise ValueError(f"logits must be 2-D [num_rows, V], got shape {logits_RxV.shape}")
    if not np.all(np.isfinite(logits_RxV)):
      raise ValueError("logits must be finite")
    shifted_RxV = logits_RxV - logits_RxV.max(axis=1, keepdims=True)
    unnormalised_RxV = np.exp(shifted_RxV)
    return cls(probs=unnormalised_RxV / unnormalised_RxV.sum(axis=1, keepdims=True), depth=depth)

  def one_hot_argmax(self) -> "TabularLM":
    """The greedy (temperature 0) model: every row one-hot at its argmax (first index on ties)."""
    one_hot_RxV = np.zeros_like(self.probs)
    one_hot_RxV[np.arange(self.num_rows), np.argmax(self.probs, axis=1)] = 1.0
    return TabularLM(probs=one_hot_RxV, depth=self.depth)
