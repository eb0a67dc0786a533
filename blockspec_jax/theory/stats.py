"""Goodness-of-fit checks of sampled outcomes against exact laws (numpy/scipy, float64)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Union

import numpy as np
from scipy import stats as scipy_stats

__all__ = ["Chi2Result", "chi2_gof", "mean_stderr"]

_PROB_SUM_TOLERANCE = 1e-6

CountsLike = Union[Mapping[Hashable, int], np.ndarray]
ProbsLike = Union[Mapping[Hashable, float], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Chi2Result:
  """Pearson χ² goodness of fit.

  Attributes:
    statistic: ``Σ_bins (O − E)² / E`` after pooling; ``inf`` when a category of probability 0 was observed.
    dof: number of bins after pooling minus 1.
    p_value: ``P(χ²_dof ≥ statistic)``; exactly 0.0 when a category of probability 0 was observed, 1.0 when a
      single bin is left (nothing to test).
    n: total number of observations.
  """
  statistic: float
  dof: int
  p_value: float
  n: int


def _aligned(observed_counts: CountsLike, expected_probs: ProbsLike) -> tuple[np.ndarray, np.ndarray]:
  """Observed counts and expected probabilities as aligned float64 vectors over the union of categories.

  Two arrays must have the same shape (flattened together). Otherwise an array stands for the mapping
  ``{index: value}`` over its 1-D positions, and categories are the union of both key sets (missing = 0).
  """
  observed_is_map = isinstance(observed_counts, Mapping)
  expected_is_map = isinstance(expected_probs, Mapping)
  if not observed_is_map and not expected_is_map:
    observed = np.asarray(observed_counts, dtype=np.float64)
    expected = np.asarray(expected_probs, dtype=np.float64)
    if observed.shape != expected.shape:
      raise ValueError(f"observed and expected arrays must have the same shape, got {observed.shape} and "
                       f"{expected.shape}")
    return observed.reshape(-1), expected.reshape(-1)

  def as_map(values, name):
    if isinstance(values, Mapping):
      return dict(values)
    array = np.asarray(values)
    if array.ndim != 1:
      raise ValueError(f"{name} given as an array next to a mapping must be 1-D, got shape {array.shape}")
    return {i: array[i] for i in range(array.shape[0])}

  observed_map = as_map(observed_counts, "observed_counts")
  expected_map = as_map(expected_probs, "expected_probs")
  keys = list(expected_map) + [key for key in observed_map if key not in expected_map]
  observed = np.array([float(observed_map.get(key, 0)) for key in keys], dtype=np.float64)
  expected = np.array([float(expected_map.get(key, 0.0)) for key in keys], dtype=np.float64)
  return observed, expected


def chi2_gof(observed_counts: CountsLike, expected_probs: ProbsLike, min_expected: float = 5.0) -> Chi2Result:
  """Pearson χ² test of observed category counts against an exact law.

  Args:
    observed_counts: counts per category, a mapping ``key -> int`` or an array.
    expected_probs: probabilities per category (a mapping or an array), non-negative, summing to 1 within 1e-6
      (they are divided by their sum). Categories missing from one side count as 0 there.
    min_expected: bins with expected count ``n · p < min_expected`` are pooled into one bin; if that pooled bin is
      itself below ``min_expected`` it is merged into the smallest remaining bin (when there is one).

  Observations in a category of expected probability 0 are a hard failure: ``statistic = inf``, ``p_value = 0.0``.
  Categories of probability 0 with no observations are ignored. ``dof = (number of bins after pooling) − 1``.
  """
  observed, expected_p = _aligned(observed_counts, expected_probs)
  if not np.all(np.isfinite(observed)) or np.any(observed < 0) or np.any(observed != np.round(observed)):
    raise ValueError("observed counts must be non-negative integers")
  if not np.all(np.isfinite(expected_p)) or np.any(expected_p < 0):
    raise ValueError("expected probabilities must be finite and non-negative")
  total_prob = float(expected_p.sum())
  if abs(total_prob - 1.0) > _PROB_SUM_TOLERANCE:
    raise ValueError(f"expected probabilities must sum to 1 within {_PROB_SUM_TOLERANCE}, got {total_prob!r}")
  if not (min_expected >= 0):
    raise ValueError(f"min_expected must be >= 0, got {min_expected!r}")
  n = int(observed.sum())
  if n == 0:
    raise ValueError("no observations")

  support = expected_p > 0
  expected = n * (expected_p / total_prob)
  if np.any(observed[~support] > 0):
    dof = max(int(np.count_nonzero(support)) - 1, 0)
    return Chi2Result(statistic=float("inf"), dof=dof, p_value=0.0, n=n)

  observed, expected = observed[support], expected[support]
  small = expected < min_expected
  bins_observed = list(observed[~small])
  bins_expected = list(expected[~small])
  if np.any(small):
    pooled_observed, pooled_expected = float(observed[small].sum()), float(expected[small].sum())
    if pooled_expected < min_expected and bins_expected:
      smallest = int(np.argmin(bins_expected))
      bins_observed[smallest] += pooled_observed
      bins_expected[smallest] += pooled_expected
    else:
      bins_observed.append(pooled_observed)
      bins_expected.append(pooled_expected)
  bins_observed_arr = np.array(bins_observed, dtype=np.float64)
  bins_expected_arr = np.array(bins_expected, dtype=np.float64)
  dof = len(bins_expected) - 1
  if dof < 1:
    return Chi2Result(statistic=0.0, dof=0, p_value=1.0, n=n)
  statistic = float(np.sum((bins_observed_arr - bins_expected_arr) ** 2 / bins_expected_arr))
  return Chi2Result(statistic=statistic, dof=dof, p_value=float(scipy_stats.chi2.sf(statistic, dof)), n=n)


def mean_stderr(values_B) -> tuple[float, float]:
  """``(mean, standard error)`` of per-context values: ``std(ddof=1) / sqrt(n)``, NaN for a single context. Every
  paired comparison (rules, trees, drafters) reports its spread over contexts this way."""
  values_B = np.asarray(values_B, np.float64)
  n = len(values_B)
  return float(values_B.mean()), float(values_B.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
