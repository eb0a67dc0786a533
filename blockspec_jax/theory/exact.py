"""Exact laws of one speculative-decoding iteration by enumeration (numpy, float64; V up to ~8, γ up to ~4).

Conventions (docs/ALGORITHMS.md §1-3). Context ``c``; drafter ``M_s`` with rows ``q``, target ``M_b`` with rows ``p``;
draft ``X^γ ~ M_s(·|c)``. At a draft, row ``i`` of a model is its law given ``c ⊕ X^i`` (i = 0..γ): the target has
``γ + 1`` rows ``p_0..p_γ``, the drafter ``γ`` rows ``q_0..q_{γ-1}``. Every rule returns ``τ ∈ [0, γ]`` accepted draft
tokens and one extra token ``Y``; the iteration emits ``(X_1..X_τ, Y)``.

For every draft the conditional law ``P(τ = t, Y = y | X^γ = x)`` is computed in closed form
(:func:`conditional_law`, a ``[γ+1, V]`` table) and the outcome laws are sums over all ``V**γ`` drafts weighted by
``q(x^γ) = M_s(x^γ | c)``. Drafts with ``q(x^γ) = 0`` are skipped (they carry no mass).

Laws (:data:`LAWS`): each is a function ``fn(p_rows_Gp1xV, q_rows_GxV, draft_G, **settings)`` registered where it is
defined by the decorator :func:`chain_law` (``@chain_law("token")``); a verifier names the law it follows
(``verify.Verifier.theory_law``), so a new rule's law is one decorated function here and no other edit:

* ``"token"``: ``a_i = min(1, p_{i-1}(x_i)/q_{i-1}(x_i))`` (1 if ``q = 0 < p``, 0 if ``p = 0``);
  ``P(τ=t|x) = Π_{j≤t} a_j · (1 − a_{t+1})`` for ``t < γ``, ``Π_{j≤γ} a_j`` for ``t = γ``;
  ``Y | τ=t<γ ~ norm(max(p_t − q_t, 0))``, ``Y | τ=γ ~ p_γ``.
* ``"block"``: ``w_0 = 1``, ``w_i = min(1, w_{i-1} p_{i-1}(x_i)/q_{i-1}(x_i))``; for ``i < γ``
  ``Z_i = Σ_v max(w_i p_i(v) − q_i(v), 0)``, ``h_i = Z_i / (Z_i + (1 − w_i))`` (1 if both terms are 0); ``h_γ = w_γ``,
  ``h_0 := 1``. Independent coins ``η_i ≤ h_i``, ``τ`` the last success:
  ``P(τ=t|x) = h_t Π_{j=t+1..γ} (1 − h_j)``; ``Y | τ=t<γ ~ norm(max(w_t p_t − q_t, 0))``, ``Y | τ=γ ~ p_γ``.
* ``"greedy"``: ``τ`` = number of leading ``i`` with ``x_i == argmax p_{i-1}`` (first index on ties);
  ``Y = argmax p_τ``. Lossless only for a one-hot (greedy) target.
* ``"exact_match"``: ``Y_i ~ p_i`` independently (i = 0..γ), accept while ``Y_{i-1} == x_i``, emit the first
  mismatching sample: ``P(τ=t, Y=y|x) = Π_{j≤t} p_{j-1}(x_j) · p_t(y) · [y ≠ x_{t+1}]`` (t < γ),
  ``Π_{j≤γ} p_{j-1}(x_j) · p_γ(y)`` (t = γ).
* ``"lenient"`` (DistillSpec, lossy for ε < 1; settings ``epsilon`` ∈ (0, 1], default 0.5, and ``f`` ∈
  :data:`LENIENT_FUNCTIONS`, default "div"): the token rule with ``a_i = min(1, f(p_{i-1}(x_i), ε)/q_{i-1}(x_i))``,
  ``f = p/ε`` ("div"), ``p/ε²`` ("div2"), ``p^ε`` ("pow"); same residual and bonus. ε = 1 is "token".
  :func:`one_step_tv` gives its exact error.

Numerical fallback (token, lenient and block): a residual with zero total mass is replaced by the target row ``p_t``.
This only happens where ``P(τ = t | x) = 0`` in exact arithmetic (or through rounding), so the laws are unaffected;
it mirrors ``blockspec_jax.verify.rules``.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from blockspec_jax.theory.estimators import clipped_ratio
from blockspec_jax.theory.tabular import TabularLM

__all__ = ["LAWS", "ChainLaw", "chain_law", "conditional_law", "exact_outcome_law", "exact_tau_law",
           "expected_accepted", "expected_accepted_token_closed_form", "expected_accepted_block_closed_form",
           "full_information_bound", "sequence_law", "emitted_prefix_law", "iid_expected_accepted",
           "iid_block_efficiency", "acceptance_rate", "paper_toy", "one_step_tv", "LENIENT_FUNCTIONS",
           "LENIENT_DEFAULT_EPSILON"]

# Mirrors blockspec_jax.verify.rules (this package does not import jax); tests/test_lenient.py checks they agree.
LENIENT_FUNCTIONS = ("div", "div2", "pow")
LENIENT_DEFAULT_EPSILON = 0.5


# --- the registry of laws ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChainLaw:
  """One rule's exact conditional law (registered by :func:`chain_law`).

  ``fn(p_rows_Gp1xV, q_rows_GxV, draft_G, **settings)`` → ``P(τ = t, Y = y | X^γ = draft)``, float64 ``[γ+1, V]``
  (``q_rows_GxV`` is None when ``reads_draft_probs`` is False); ``settings(**given)`` → every setting of the law,
  checked, defaults filled in (None: the law takes none).
  """
  name: str
  fn: Callable[..., np.ndarray]
  reads_draft_probs: bool = True
  settings: Callable[..., dict] | None = None

  def checked_settings(self, given: Mapping[str, Any]) -> dict:
    """``given`` (settings passed by name; None values mean "the default") checked and completed."""
    given = {k: v for k, v in given.items() if v is not None}
    known = () if self.settings is None else tuple(inspect.signature(self.settings).parameters)
    unknown = sorted(set(given) - set(known))
    if unknown:
      raise ValueError(f"rule {self.name!r} takes no {' / '.join(unknown)} (its settings: "
                       f"{', '.join(known) or 'none'})")
    return {} if self.settings is None else self.settings(**given)


#: name -> :class:`ChainLaw`, filled by :func:`chain_law` (this module's laws, and any registered later).
LAWS: dict[str, ChainLaw] = {}


def chain_law(name: str, *, reads_draft_probs: bool = True, settings: Callable[..., dict] | None = None):
  """Decorator registering a law function under ``name`` in :data:`LAWS` (see :class:`ChainLaw` for ``fn``'s
  contract); a ValueError when the name is taken. The function is returned unchanged."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"a law's name is a non-empty string, got {name!r}")

  def register(fn):
    if name in LAWS:
      raise ValueError(f"law {name!r} is already registered ({LAWS[name].fn.__qualname__})")
    LAWS[name] = ChainLaw(name, fn, reads_draft_probs, settings)
    return fn

  return register


# --- argument checks ---------------------------------------------------------------------------------------------

def _law(rule: str) -> ChainLaw:
  if not isinstance(rule, str) or rule not in LAWS:
    raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(LAWS)}")
  return LAWS[rule]


def _lenient_settings(epsilon=LENIENT_DEFAULT_EPSILON, f="div") -> dict:
  """The settings of "lenient": ``epsilon`` ∈ (0, 1] and ``f`` ∈ :data:`LENIENT_FUNCTIONS`, checked."""
  if f not in LENIENT_FUNCTIONS:
    raise ValueError(f"unknown lenience function f={f!r}; known: {', '.join(LENIENT_FUNCTIONS)} "
                     f"(div: p/eps, div2: p/eps^2, pow: p^eps)")
  if isinstance(epsilon, (bool, np.bool_)) or not isinstance(epsilon, (int, float, np.integer, np.floating)):
    raise ValueError(f"epsilon must be a number in (0, 1], got {epsilon!r}")
  if not 0.0 < float(epsilon) <= 1.0:
    raise ValueError(f"epsilon must be in (0, 1], got {epsilon!r}")
  return {"epsilon": float(epsilon), "f": f}


def _check_gamma(gamma, minimum: int = 1) -> int:
  if isinstance(gamma, (bool, np.bool_)) or not isinstance(gamma, (int, np.integer)) or gamma < minimum:
    raise ValueError(f"gamma must be an integer >= {minimum}, got {gamma!r}")
  return int(gamma)


def _check_models(drafter: TabularLM, target: TabularLM, context: Sequence[int]) -> tuple[int, ...]:
  """Both models are TabularLMs over the same vocabulary; ``context`` as a validated tuple of ints."""
  for name, model in (("drafter", drafter), ("target", target)):
    if not isinstance(model, TabularLM):
      raise ValueError(f"{name} must be a TabularLM, got {type(model).__name__}")
  if drafter.vocab_size != target.vocab_size:
    raise ValueError(f"drafter and target vocabularies differ: {drafter.vocab_size} vs {target.vocab_size}")
  return target._checked_prefix(context)  # pylint: disable=protected-access


def _check_args(rule, drafter, target, context, gamma) -> tuple[ChainLaw, tuple[int, ...], int]:
  return _law(rule), _check_models(drafter, target, context), _check_gamma(gamma)


# --- one draft: the conditional law of (τ, Y) --------------------------------------------------------------------

def _normalised_or_fallback(residual_V: np.ndarray, fallback_V: np.ndarray) -> np.ndarray:
  """``residual / Σ residual``, or ``fallback`` when the residual has no mass."""
  mass = residual_V.sum()
  return residual_V / mass if mass > 0 else np.array(fallback_V, dtype=np.float64)


def _lenient_numerator(p: float, epsilon: float, f: str) -> float:
  """``f(p, ε)``: ``p/ε`` ("div"), ``p/ε²`` ("div2"), ``p^ε`` ("pow"); ``p`` itself at ε = 1."""
  if epsilon == 1.0:
    return p
  return {"div": p / epsilon, "div2": p / epsilon**2, "pow": p**epsilon}[f]


@chain_law("token")
def _token_law(p_rows_Gp1xV, q_rows_GxV, draft_G, epsilon: float = 1.0, f: str = "div") -> np.ndarray:
  """The token rule's law; with ``ε < 1`` the lenient rule's (acceptance numerator ``f(p, ε)``)."""
  gamma = len(draft_G)
  law = np.zeros(p_rows_Gp1xV.shape, dtype=np.float64)
  reach = 1.0  # Π_{j≤t} a_j
  for t in range(gamma):
    numerator = _lenient_numerator(float(p_rows_Gp1xV[t, draft_G[t]]), epsilon, f)
    a_next = float(clipped_ratio(1.0, numerator, q_rows_GxV[t, draft_G[t]]))
    residual_V = np.maximum(p_rows_Gp1xV[t] - q_rows_GxV[t], 0.0)
    law[t] = reach * (1.0 - a_next) * _normalised_or_fallback(residual_V, p_rows_Gp1xV[t])
    reach *= a_next
  law[gamma] = reach * p_rows_Gp1xV[gamma]
  return law


def _block_weights_and_thresholds(p_rows_Gp1xV, q_rows_GxV, draft_G) -> tuple[np.ndarray, np.ndarray]:
  """``w_0..w_γ`` and ``h_0..h_γ`` (``w_0 = h_0 = 1``), float64 ``[γ+1]`` each."""
  gamma = len(draft_G)
  w = np.ones(gamma + 1, dtype=np.float64)
  h = np.ones(gamma + 1, dtype=np.float64)
  for i in range(1, gamma + 1):
    w[i] = clipped_ratio(w[i - 1], p_rows_Gp1xV[i - 1, draft_G[i - 1]], q_rows_GxV[i - 1, draft_G[i - 1]])
    if i < gamma:
      mass = np.maximum(w[i] * p_rows_Gp1xV[i] - q_rows_GxV[i], 0.0).sum()
      denominator = mass + (1.0 - w[i])  # this order keeps h_i's precision when w_i ≈ 1
      h[i] = mass / denominator if denominator > 0 else 1.0
    else:
      h[i] = w[i]
  return w, h


@chain_law("block")
def _block_law(p_rows_Gp1xV, q_rows_GxV, draft_G) -> np.ndarray:
  gamma = len(draft_G)
  w, h = _block_weights_and_thresholds(p_rows_Gp1xV, q_rows_GxV, draft_G)
  law = np.zeros(p_rows_Gp1xV.shape, dtype=np.float64)
  all_later_fail = 1.0  # Π_{j=t+1..γ} (1 − h_j), built from the top
  for t in range(gamma, -1, -1):
    prob_t = h[t] * all_later_fail
    if t == gamma:
      law[t] = prob_t * p_rows_Gp1xV[gamma]
    else:
      residual_V = np.maximum(w[t] * p_rows_Gp1xV[t] - q_rows_GxV[t], 0.0)
      law[t] = prob_t * _normalised_or_fallback(residual_V, p_rows_Gp1xV[t])
    all_later_fail *= 1.0 - h[t]
  return law


@chain_law("greedy", reads_draft_probs=False)
def _greedy_law(p_rows_Gp1xV, q_rows_GxV, draft_G) -> np.ndarray:
  del q_rows_GxV
  gamma = len(draft_G)
  tau = 0
  while tau < gamma and draft_G[tau] == int(np.argmax(p_rows_Gp1xV[tau])):
    tau += 1
  law = np.zeros(p_rows_Gp1xV.shape, dtype=np.float64)
  law[tau, int(np.argmax(p_rows_Gp1xV[tau]))] = 1.0
  return law


@chain_law("exact_match", reads_draft_probs=False)
def _exact_match_law(p_rows_Gp1xV, q_rows_GxV, draft_G) -> np.ndarray:
  del q_rows_GxV
  gamma = len(draft_G)
  law = np.zeros(p_rows_Gp1xV.shape, dtype=np.float64)
  reach = 1.0  # Π_{j≤t} p_{j-1}(x_j)
  for t in range(gamma):
    mismatch_V = np.array(p_rows_Gp1xV[t], dtype=np.float64)
    mismatch_V[draft_G[t]] = 0.0
    law[t] = reach * mismatch_V
    reach *= float(p_rows_Gp1xV[t, draft_G[t]])
  law[gamma] = reach * p_rows_Gp1xV[gamma]
  return law


@chain_law("lenient", settings=_lenient_settings)
def _lenient_law(p_rows_Gp1xV, q_rows_GxV, draft_G, *, epsilon: float, f: str) -> np.ndarray:
  """DistillSpec's lenient rule: the token law with the acceptance numerator ``f(p, ε)``."""
  return _token_law(p_rows_Gp1xV, q_rows_GxV, draft_G, epsilon, f)


def conditional_law(rule: str, p_rows_Gp1xV, q_rows_GxV, draft_G, **settings) -> np.ndarray:
  """``P(τ = t, Y = y | X^γ = draft)`` for one draft: float64 ``[γ+1, V]`` (entries sum to 1).

  Args:
    rule: a name of :data:`LAWS`.
    p_rows_Gp1xV: target rows ``p_i = M_b(·|c ⊕ x^i)``, i = 0..γ, float ``[γ+1, V]``.
    q_rows_GxV: drafter rows ``q_i = M_s(·|c ⊕ x^i)``, i = 0..γ-1, float ``[γ, V]``; may be None for laws that do
      not read it ("greedy", "exact_match": ``reads_draft_probs`` False).
    draft_G: the draft tokens ``x_1..x_γ``, ints ``[γ]``.
    settings: the law's settings by name, e.g. ``epsilon`` and ``f`` of "lenient" (None or absent: its defaults,
      ε = 0.5, f = "div"); an error for a law without them.
  """
  law = _law(rule)
  settings = law.checked_settings(settings)
  p_rows = np.asarray(p_rows_Gp1xV, dtype=np.float64)
  draft = tuple(int(x) for x in np.asarray(draft_G).reshape(-1))
  gamma = _check_gamma(len(draft))
  if p_rows.ndim != 2 or p_rows.shape[0] != gamma + 1:
    raise ValueError(f"target rows must have shape [gamma+1, V] = [{gamma + 1}, V], got {p_rows.shape}")
  vocab_size = p_rows.shape[1]
  if any(not 0 <= x < vocab_size for x in draft):
    raise ValueError(f"draft tokens must lie in [0, {vocab_size}), got {draft}")
  q_rows = None
  if law.reads_draft_probs:
    if q_rows_GxV is None:
      raise ValueError(f"rule {rule!r} needs the drafter rows q_rows_GxV")
    q_rows = np.asarray(q_rows_GxV, dtype=np.float64)
    if q_rows.shape != (gamma, vocab_size):
      raise ValueError(f"drafter rows must have shape [gamma, V] = [{gamma}, {vocab_size}], got {q_rows.shape}")
  return law.fn(p_rows, q_rows, draft, **settings)


# --- enumeration over drafts -------------------------------------------------------------------------------------

def _model_rows(model: TabularLM, context: tuple[int, ...], draft: tuple[int, ...], num_rows: int) -> np.ndarray:
  """Rows ``M(·|c ⊕ x^i)`` for i = 0..num_rows-1: float64 ``[num_rows, V]``."""
  return np.stack([model.next_probs(context + draft[:i]) for i in range(num_rows)])


def _drafts(vocab_size: int, length: int):
  return itertools.product(range(vocab_size), repeat=length)


def _conditional_laws(law: ChainLaw, drafter, target, context, gamma, settings):
  """Yields ``(draft, M_s(draft | c), conditional_law)`` for every draft of positive drafter probability."""
  for draft in _drafts(target.vocab_size, gamma):
    draft_prob = drafter.sequence_prob(context, draft)
    if draft_prob == 0.0:
      continue
    p_rows = _model_rows(target, context, draft, gamma + 1)
    q_rows = _model_rows(drafter, context, draft, gamma) if law.reads_draft_probs else None
    yield draft, draft_prob, conditional_law(law.name, p_rows, q_rows, draft, **settings)


def exact_outcome_law(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int],
                      gamma: int, **settings) -> dict[tuple[int, ...], float]:
  """Law of the emitted tuple ``(X_1..X_τ, Y)`` (length ``τ + 1``) of one iteration.

  ``P(o) = Σ_{x^γ} q(x^γ) P(τ = t, Y = y | x^γ)`` over drafts with ``x^t = o[:t]``. Only outcomes of positive
  probability are keys (every term is non-negative, so a missing key has probability exactly 0); keys are sorted.
  ``settings``: the law's, e.g. ``epsilon`` and ``f`` of "lenient" (:func:`conditional_law`).
  """
  chain, context, gamma = _check_args(rule, drafter, target, context, gamma)
  settings = chain.checked_settings(settings)
  law: dict[tuple[int, ...], float] = {}
  for draft, draft_prob, law_Gp1xV in _conditional_laws(chain, drafter, target, context, gamma, settings):
    for t, y in zip(*np.nonzero(law_Gp1xV)):
      outcome = draft[:t] + (int(y),)
      law[outcome] = law.get(outcome, 0.0) + draft_prob * float(law_Gp1xV[t, y])
  return {outcome: law[outcome] for outcome in sorted(law)}


def exact_tau_law(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int,
                  **settings) -> np.ndarray:
  """``P(τ = t)`` for t = 0..γ: float64 ``[γ+1]`` (``settings``: the law's, e.g. ``epsilon``, ``f`` of "lenient")."""
  chain, context, gamma = _check_args(rule, drafter, target, context, gamma)
  settings = chain.checked_settings(settings)
  tau_law = np.zeros(gamma + 1, dtype=np.float64)
  for _, draft_prob, law_Gp1xV in _conditional_laws(chain, drafter, target, context, gamma, settings):
    tau_law += draft_prob * law_Gp1xV.sum(axis=1)
  return tau_law


def expected_accepted(rule: str, drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int,
                      **settings) -> float:
  """``E[τ] = Σ_t t P(τ = t)`` from :func:`exact_tau_law` (block efficiency is this + 1)."""
  tau_law = exact_tau_law(rule, drafter, target, context, gamma, **settings)
  return float(np.dot(np.arange(tau_law.shape[0], dtype=np.float64), tau_law))


# --- closed forms ------------------------------------------------------------------------------------------------

def _sum_over_prefixes(drafter: TabularLM, target: TabularLM, context: tuple[int, ...], gamma: int,
                       step: Callable[[Any, float, float], Any], init: Any = 1.0,
                       contribution: Callable[[Any], float] = float) -> float:
  """``Σ_{i=1..γ} Σ_{x^i} contribution(s(x^i))`` with ``s(x^0) = init``,
  ``s(x^i) = step(s(x^{i-1}), p_{i-1}(x_i), q_{i-1}(x_i))``.

  Depth-first over prefixes; a prefix contributing 0 is pruned (in every use here its extensions contribute 0 too).
  """
  total = 0.0

  def visit(prefix: tuple[int, ...], state) -> None:
    nonlocal total
    if len(prefix) == gamma:
      return
    p_V = target.next_probs(context + prefix)
    q_V = drafter.next_probs(context + prefix)
    for x in range(target.vocab_size):
      child = step(state, float(p_V[x]), float(q_V[x]))
      value = contribution(child)
      if value != 0.0:
        total += value
        visit(prefix + (x,), child)

  visit((), init)
  return total


def expected_accepted_token_closed_form(drafter: TabularLM, target: TabularLM, context: Sequence[int],
                                        gamma: int) -> float:
  """``E[τ_token] = Σ_{i=1..γ} Σ_{x^i} Π_{j≤i} min(q_{j-1}(x_j), p_{j-1}(x_j))``."""
  context = _check_models(drafter, target, context)
  gamma = _check_gamma(gamma)
  return _sum_over_prefixes(drafter, target, context, gamma, lambda value, p, q: value * min(q, p))


def expected_accepted_block_closed_form(drafter: TabularLM, target: TabularLM, context: Sequence[int],
                                        gamma: int) -> float:
  """``E[τ_block] = Σ_{i=1..γ} E_{X^i ~ M_s}[w_i]`` (``P(τ ≥ i | X^i) = w_i``).

  Accumulates ``M_s(x^i|c) · w_i(x^i)`` over prefixes; the running state is ``(M_s(x^i|c), w_i)``.
  """
  context = _check_models(drafter, target, context)
  gamma = _check_gamma(gamma)
  return _sum_over_prefixes(
      drafter, target, context, gamma,
      lambda state, p, q: (state[0] * q, float(clipped_ratio(state[1], p, q))), init=(1.0, 1.0),
      contribution=lambda state: state[0] * state[1])


def full_information_bound(drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int) -> float:
  """``Σ_{i=1..γ} Σ_{x^i} min(M_s(x^i|c), M_b(x^i|c))`` (joint sequence probabilities).

  An upper bound on ``E[τ]`` for any valid verifier that sees one draft; reachable only with state carried across
  iterations (docs/ALGORITHMS.md §2, §8).
  """
  context = _check_models(drafter, target, context)
  gamma = _check_gamma(gamma)
  return _sum_over_prefixes(drafter, target, context, gamma,
                            lambda state, p, q: (state[0] * q, state[1] * p), init=(1.0, 1.0),
                            contribution=lambda state: min(state))


# --- sequence laws and losslessness -----------------------------------------------------------------------------

def sequence_law(model: TabularLM, context: Sequence[int], n: int) -> dict[tuple[int, ...], float]:
  """Law of the next ``n`` tokens after ``context``: all ``V**n`` tuples (zeros included), lexicographic order."""
  context = model._checked_prefix(context)  # pylint: disable=protected-access
  n = _check_gamma(n, minimum=0)
  return {tokens: model.sequence_prob(context, tokens) for tokens in _drafts(model.vocab_size, n)}


def emitted_prefix_law(outcome_law: Mapping[tuple[int, ...], float], target: TabularLM, context: Sequence[int],
                       n: int) -> dict[tuple[int, ...], float]:
  """Law of the first ``n`` tokens when one iteration (law ``outcome_law``) is followed by the target itself.

  ``P(s) = Σ_o P(o) · [o[:n] = s]`` for outcomes with ``len(o) ≥ n``, plus
  ``Σ_o P(o) · M_b(s[len(o):] | c ⊕ o) · [s[:len(o)] = o]`` for shorter ones. A lossless rule gives exactly
  :func:`sequence_law` ``(target, context, n)``. Returns all ``V**n`` tuples (zeros included), lexicographic order.
  """
  context = target._checked_prefix(context)  # pylint: disable=protected-access
  n = _check_gamma(n, minimum=0)
  law = {tokens: 0.0 for tokens in _drafts(target.vocab_size, n)}
  for outcome, prob in outcome_law.items():
    outcome = target._checked_prefix(outcome)  # pylint: disable=protected-access
    if len(outcome) >= n:
      law[outcome[:n]] += prob
      continue
    for rest in _drafts(target.vocab_size, n - len(outcome)):
      law[outcome + rest] += prob * target.sequence_prob(context + outcome, rest)
  return law


def one_step_tv(rule, drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int = 1, *, n: int = 1,
                **settings) -> float:
  """Exact total variation between the law of the first ``n`` emitted tokens and the target's, after ``context``.

  One iteration of ``rule`` with ``gamma`` draft tokens, continued by the target itself when it emits fewer than
  ``n`` tokens (:func:`emitted_prefix_law`), against :func:`sequence_law` ``(target, context, n)``:
  ``½ Σ_s |P_emitted(s) − M_b(s | c)|``. 0 (up to rounding) for a lossless rule; for "lenient" with ε < 1 it is
  the rule's error. With ``n = 1`` (default) it does not depend on ``gamma``: it compares the law of the first
  emitted token, ``min(q, f(p)) + (Σ max(q − f(p), 0)) · norm(max(p − q, 0))`` for the lenient rule, with ``p``.

  ``rule`` is a name of :data:`LAWS` or a verifier object (anything with ``theory_law`` or ``name`` naming its law,
  whose dataclass fields are its settings, e.g. ``verify.LenientVerifier(epsilon=0.3, f="pow")``); ``settings`` as
  in :func:`exact_outcome_law`, taken from the verifier's fields where one is passed and they are absent or None.
  """
  if not isinstance(rule, str):
    own = ({field.name: getattr(rule, field.name) for field in dataclasses.fields(rule)}
           if dataclasses.is_dataclass(rule) else {})
    settings = {**own, **{k: v for k, v in settings.items() if v is not None}}
    rule = getattr(rule, "theory_law", None) or getattr(rule, "name", rule)
  n = _check_gamma(n)
  outcome_law = exact_outcome_law(rule, drafter, target, context, gamma, **settings)
  emitted = emitted_prefix_law(outcome_law, target, context, n)
  expected = sequence_law(target, context, n)
  return 0.5 * float(sum(abs(emitted[s] - expected[s]) for s in expected))


# --- i.i.d. formulas ---------------------------------------------------------------------------------------------

def _check_alpha(alpha) -> float:
  alpha = float(alpha)
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
  return alpha


def iid_expected_accepted(alpha: float, gamma: int) -> float:
  """``E[τ] = Σ_{i=1..γ} α^i`` when every draft token is accepted independently with probability ``α`` (γ ≥ 0)."""
  alpha, gamma = _check_alpha(alpha), _check_gamma(gamma, minimum=0)
  return float(sum(alpha**i for i in range(1, gamma + 1)))


def iid_block_efficiency(alpha: float, gamma: int) -> float:
  """``E[τ] + 1 = (1 − α^{γ+1}) / (1 − α)`` (``γ + 1`` at ``α = 1``), evaluated as ``Σ_{i=0..γ} α^i`` (γ ≥ 0).

  The sum form is the same quantity without the cancellation of the quotient near ``α = 1``.
  """
  alpha, gamma = _check_alpha(alpha), _check_gamma(gamma, minimum=0)
  return float(sum(alpha**i for i in range(gamma + 1)))


def acceptance_rate(p_V, q_V) -> float:
  """Token acceptance probability ``α = Σ_v min(p(v), q(v)) = 1 − TV(p, q)``; float ``[V]`` each."""
  p_V = np.asarray(p_V, dtype=np.float64)
  q_V = np.asarray(q_V, dtype=np.float64)
  if p_V.ndim != 1 or p_V.shape != q_V.shape:
    raise ValueError(f"p_V and q_V must be 1-D of the same length, got {p_V.shape} and {q_V.shape}")
  return float(np.minimum(p_V, q_V).sum())


def paper_toy() -> tuple[TabularLM, TabularLM, int]:
  """The toy of docs/ALGORITHMS.md §2: ``(drafter, target, gamma=2)``, V = {a, b}, context-free.

  ``q = (2/3, 1/3)``, ``p = (1/3, 2/3)``: token verification accepts 10/9, block 11/9, the full-information bound
  is 12/9 tokens per iteration.
  """
  drafter = TabularLM.context_free(np.array([2.0, 1.0]) / 3.0)
  target = TabularLM.context_free(np.array([1.0, 2.0]) / 3.0)
  return drafter, target, 2
