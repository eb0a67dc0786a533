"""Exact laws of the lossy rules on tabular models (numpy, float64): MJSD / MTAD joint verification (Qin et al.,
arXiv 2407.09722) and SPRINTER's learned verifier (Zhong et al., arXiv 2502.04557, :func:`sprinter_sequence_law`).

One MTAD iteration after context ``c`` (drafter ``M_s`` with rows ``q``, target ``M_b`` with rows ``p``):

1. a draft ``x^γ``: ``draft="sample"``, an ancestral sample of γ tokens from the drafter (law ``Π_i q_{i−1}(x_i)``;
   the model chain :class:`~blockspec_jax.drafters.ModelDrafter`); ``draft="beam"``, the best beam of a
   deterministic top-W beam search on cumulative ``log q`` (:func:`beam_search`, a function of ``c``; the JAX
   :class:`~blockspec_jax.drafters.BeamDrafter` with ``sample=False``); ``draft="beam_sampling"``, the most likely
   of W sequences drawn without replacement from the drafter (:func:`beam_sampling_law`: the law of stochastic beam
   search's best beam, ``BeamDrafter`` with ``sample=True``);
2. ``a = max{i ∈ 1..γ : L_i > log τ}`` (0 if none), ``L_i = Σ_{j≤i} [log p_{j−1}(x_j) − log q_{j−1}(x_j)]``
   (:func:`joint_log_ratios`, :func:`joint_accepted`: every prefix is scanned);
3. ``y ~ p_a`` (the plain target row): the iteration emits ``(x_1..x_a, y)``.

LOSSY for finite τ: the accepted prefix is the drafter's, judged by a likelihood ratio, and ``y`` is never a
residual. Exact at ``τ = inf`` (nothing is accepted: every iteration emits one target sample), and for a one-hot
target (only target-argmax tokens have ``p > 0``).

:func:`joint_log_ratios` / :func:`joint_accepted` are the numpy reference of
:func:`blockspec_jax.verify.rules.joint_log_ratios` and of the acceptance of
:func:`~blockspec_jax.verify.rules.joint_verify` (same conventions: a ``p = 0`` token makes every
longer prefix ``−inf``, a ``q = 0 < p`` token ``+inf`` until then; tests/test_mtad.py checks they agree).
This module does not import jax.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from blockspec_jax.theory.exact import (_check_gamma, _check_models, _drafts, _model_rows, emitted_prefix_law,
                                        sequence_law)
from blockspec_jax.theory.tabular import TabularLM

__all__ = ["DRAFT_KINDS", "check_tau", "joint_log_ratios", "joint_accepted", "joint_conditional_law", "beam_search",
           "beam_sampling_law", "per_step_beam_law", "mtad_block_law", "mtad_tau_law", "mtad_expected_accepted", "mtad_first_token_tv",
           "emitted_sequence_law", "mtad_sequence_tv"]

#: How the draft of one iteration is made: an ancestral sample of the drafter, the best deterministic beam, or the
#: best of a stochastic beam search (W sequences drawn without replacement).
DRAFT_KINDS = ("sample", "beam", "beam_sampling")


# --- argument checks ---------------------------------------------------------------------------------------------

def check_tau(tau) -> float:
  """τ as a float in ``(0, ∞]`` (the semantics of :func:`blockspec_jax.verify.rules.check_joint_tau`; numpy scalars
  are accepted here too); a ValueError naming tau otherwise (bools, strings, NaN, ``τ ≤ 0``)."""
  if isinstance(tau, (bool, np.bool_)) or not isinstance(tau, (int, float, np.integer, np.floating)) or not tau > 0:
    raise ValueError(f"MTAD's threshold tau must be a number > 0 (log tau is the acceptance bound; tau = inf "
                     f"accepts nothing), got {tau!r}")
  return float(tau)


def _check_draft(draft: str, width) -> int | None:
  """The beam width checked (None for ``draft="sample"``, where ``width`` is ignored)."""
  if draft not in DRAFT_KINDS:
    raise ValueError(f"unknown draft kind {draft!r}; known: {', '.join(DRAFT_KINDS)}")
  if draft == "sample":
    return None
  if isinstance(width, (bool, np.bool_)) or not isinstance(width, (int, np.integer)) or width < 1:
    raise ValueError(f"beam width must be an integer >= 1, got {width!r}")
  return int(width)


# --- one draft ---------------------------------------------------------------------------------------------------

def joint_log_ratios(p_tok_G, q_tok_G) -> np.ndarray:
  """``L_i = Σ_{j≤i} [log p(x_j) − log q(x_j)]``, i = 1..γ: float64 ``[γ]`` (numpy twin of the JAX rule's).

  A ``p = 0`` token gives ``−inf`` from there on (it dominates); a ``q = 0 < p`` token ``+inf`` until a later
  ``p = 0`` token; ``0/0`` counts ``−inf``.
  """
  p_G = np.asarray(p_tok_G, dtype=np.float64).reshape(-1)
  q_G = np.asarray(q_tok_G, dtype=np.float64).reshape(-1)
  if p_G.shape != q_G.shape:
    raise ValueError(f"p_tok_G and q_tok_G must have the same length, got {p_G.shape} and {q_G.shape}")
  with np.errstate(divide="ignore"):
    log_p_G = np.where(p_G > 0, np.log(np.where(p_G > 0, p_G, 1.0)), -np.inf)
    log_q_G = np.log(np.where(q_G > 0, q_G, 1.0))
  term_G = np.where(q_G > 0, log_p_G - log_q_G, np.where(p_G > 0, np.inf, -np.inf))
  dead_G = np.cumsum(term_G == -np.inf) > 0
  boosted_G = np.cumsum(term_G == np.inf) > 0
  finite_G = np.cumsum(np.where(np.isfinite(term_G), term_G, 0.0))
  return np.where(dead_G, -np.inf, np.where(boosted_G, np.inf, finite_G))


def joint_accepted(p_tok_G, q_tok_G, tau) -> int:
  """MTAD's accepted length ``a = max{i : L_i > log τ}`` (0 if none; every prefix scanned)."""
  log_tau = math.log(check_tau(tau))  # log(inf) = inf: nothing passes
  passes_G = joint_log_ratios(p_tok_G, q_tok_G) > log_tau
  return int(np.max(np.where(passes_G, np.arange(1, passes_G.shape[0] + 1), 0), initial=0))


def joint_conditional_law(p_rows_Gp1xV, q_rows_GxV, draft_G, tau) -> np.ndarray:
  """``P(τ_acc = t, Y = y | X^γ = draft)``: float64 ``[γ + 1, V]``, the single row ``a`` equal to ``p_a``.

  ``p_rows_Gp1xV`` target rows ``p_0..p_γ`` along the draft, ``q_rows_GxV`` drafter rows ``q_0..q_{γ−1}`` (read only
  at the drafted tokens), ``draft_G`` the γ tokens.
  """
  p_rows = np.asarray(p_rows_Gp1xV, dtype=np.float64)
  q_rows = np.asarray(q_rows_GxV, dtype=np.float64)
  draft = np.asarray(draft_G, dtype=np.int64).reshape(-1)
  gamma = _check_gamma(draft.shape[0])
  if p_rows.ndim != 2 or p_rows.shape[0] != gamma + 1 or q_rows.shape != (gamma, p_rows.shape[1]):
    raise ValueError(f"rows must be p [gamma+1, V] and q [gamma, V] for gamma = {gamma}, got {p_rows.shape} and "
                     f"{q_rows.shape}")
  steps_G = np.arange(gamma)
  a = joint_accepted(p_rows[steps_G, draft], q_rows[steps_G, draft], tau)
  law = np.zeros(p_rows.shape, dtype=np.float64)
  law[a] = p_rows[a]
  return law


def beam_search(drafter: TabularLM, context: Sequence[int], gamma: int, width: int) -> tuple[tuple[int, ...], float]:
  """Deterministic top-``width`` beam search on cumulative ``log q``: ``(best beam's γ tokens, its log q)``.

  Mirrors :class:`blockspec_jax.drafters.BeamDrafter` with ``sample=False`` exactly, ties included: at each depth the
  candidates ``(beam k, token x)`` are ranked by score with ties to the lower flat index ``k·V + x`` (``lax.top_k``'s
  order; ``−inf`` scores, i.e. zero-probability tokens, rank last and are tie-broken alike), beams are kept in that
  order, and the best final beam is the first one of maximal ``log q`` (``jnp.argmax``). The JAX drafter sums in
  float32, this in float64: near-ties may resolve differently (tests check that the two agree on their contexts).
  """
  context = drafter._checked_prefix(context)  # pylint: disable=protected-access
  gamma, width = _check_gamma(gamma), _check_draft("beam", width)
  vocab = drafter.vocab_size
  beams: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
  for _ in range(gamma):
    tokens, scores = [], []
    for prefix, log_prob in beams:
      with np.errstate(divide="ignore"):
        log_q_V = np.log(drafter.next_probs(context + prefix))
      for x in range(vocab):
        tokens.append(prefix + (x,))
        scores.append(log_prob + float(log_q_V[x]))
    order = np.argsort(-np.asarray(scores), kind="stable")[:width]  # descending, lower index first on ties
    beams = [(tokens[i], scores[i]) for i in order]
  best = int(np.argmax([log_prob for _, log_prob in beams]))
  return beams[best]


def beam_sampling_law(drafter: TabularLM, context: Sequence[int], gamma: int,
                      width: int) -> dict[tuple[int, ...], float]:
  """Law of the best beam of stochastic beam search (``BeamDrafter(sample=True)``): ``{draft: probability}``.

  By Kool et al. (ICML 2019) the W final beams of stochastic beam search are a sample of W sequences drawn without
  replacement from ``M_s(·|c)`` (their perturbed scores are independent ``Gumbel(log M_s(x|c))`` and the beams are
  the W largest), in draw order = decreasing score. The proposal is the first of maximal ``M_s`` in that order
  (``jnp.argmax`` over beams in top-k order: ties go to the earlier draw). Enumerates every ordered W-tuple of
  positive-probability sequences (``P = Π_i M_s(s_i) / (1 − Σ_{j<i} M_s(s_j))``; fewer than W when the support is
  smaller): ``O(N^W)`` for ``N ≤ V^γ`` sequences, meant for ``V^γ`` up to ~40 and W ≤ 3.
  """
  context = drafter._checked_prefix(context)  # pylint: disable=protected-access
  gamma, width = _check_gamma(gamma), _check_draft("beam", width)
  support = [(x, drafter.sequence_prob(context, x)) for x in _drafts(drafter.vocab_size, gamma)]
  support = [(x, prob) for x, prob in support if prob > 0.0]
  law: dict[tuple[int, ...], float] = {}

  def draw(chosen: tuple[int, ...], prob: float, mass_left: float) -> None:
    if len(chosen) == min(width, len(support)):
      best = max(chosen, key=lambda i: (support[i][1], -chosen.index(i)))  # first maximum in draw order
      law[support[best][0]] = law.get(support[best][0], 0.0) + prob
      return
    for i, (_, p_i) in enumerate(support):
      if i not in chosen:
        draw(chosen + (i,), prob * p_i / mass_left, mass_left - p_i)

  draw((), 1.0, sum(prob for _, prob in support))
  return {x: law[x] for x in sorted(law)}


def per_step_beam_law(drafter: TabularLM, context: Sequence[int], gamma: int,
                      width: int) -> dict[tuple[int, ...], float]:
  """Law of the proposal of the official MTAD code's beam sampler (``BeamDrafter(sample=True, per_step=True)``):
  ``{draft: probability}``.

  At every depth the candidates are the ``(beam, token)`` continuations of the current beams, each weighted by its
  cumulative ``M_s`` (the beam's probability times the token's); ``width`` of them are drawn one after another
  without replacement in proportion to their weights (the law of Gumbel-top-``width``), in draw order, and become
  the next beams. The proposal is the first final beam (in draw order) of maximal cumulative probability. Needs rows
  of full support (every continuation positive: no dead beams); enumerates every sequence of draws,
  ``O((W·V)^W)`` per depth per branch, meant for ``V`` ≤ 4, ``W`` ≤ 3, ``γ`` ≤ 3.
  """
  context = drafter._checked_prefix(context)  # pylint: disable=protected-access
  gamma, width = _check_gamma(gamma), _check_draft("beam", width)
  law: dict[tuple[int, ...], float] = {}

  def depth(beams: list[tuple[tuple[int, ...], float]], prob: float, d: int) -> None:
    if d == gamma:
      best = max(range(len(beams)), key=lambda i: (beams[i][1], -i))  # first maximum in draw order
      law[beams[best][0]] = law.get(beams[best][0], 0.0) + prob
      return
    candidates = []
    for prefix, weight in beams:
      q_V = drafter.next_probs(context + prefix)
      if np.any(q_V <= 0):
        raise ValueError("per_step_beam_law needs drafter rows of full support (no zero-probability token)")
      candidates += [(prefix + (x,), weight * float(q_V[x])) for x in range(drafter.vocab_size)]

    def draw(chosen: tuple[int, ...], p: float, mass_left: float) -> None:
      if len(chosen) == min(width, len(candidates)):
        depth([candidates[i] for i in chosen], p, d + 1)
        return
      for i, (_, w) in enumerate(candidates):
        if i not in chosen:
          draw(chosen + (i,), p * w / mass_left, mass_left - w)

    draw((), prob, sum(w for _, w in candidates))

  depth([((), 1.0)], 1.0, 0)
  return {x: law[x] for x in sorted(law)}


# --- one iteration -----------------------------------------------------------------------------------------------

def _block_law(drafter: TabularLM, target: TabularLM, context: tuple[int, ...], gamma: int, tau: float, kind: str,
               width: int | None) -> dict[tuple[int, ...], float]:
  if kind == "sample":
    drafts = ((x, drafter.sequence_prob(context, x)) for x in _drafts(target.vocab_size, gamma))
  elif kind == "beam":
    drafts = [(beam_search(drafter, context, gamma, width)[0], 1.0)]
  else:
    drafts = beam_sampling_law(drafter, context, gamma, width).items()
  law: dict[tuple[int, ...], float] = {}
  for draft, draft_prob in drafts:
    if draft_prob == 0.0:
      continue
    p_rows = _model_rows(target, context, draft, gamma + 1)
    q_rows = _model_rows(drafter, context, draft, gamma)
    law_Gp1xV = joint_conditional_law(p_rows, q_rows, draft, tau)
    for t, y in zip(*np.nonzero(law_Gp1xV)):
      outcome = draft[:t] + (int(y),)
      law[outcome] = law.get(outcome, 0.0) + draft_prob * float(law_Gp1xV[t, y])
  return {outcome: law[outcome] for outcome in sorted(law)}


def mtad_block_law(drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int, tau: float, *,
                   draft: str = "sample", width: int = 4) -> dict[tuple[int, ...], float]:
  """Exact law of one MTAD iteration's emitted block ``(x_1..x_a, y)`` (length ``a + 1``), by enumeration.

  ``draft="sample"``: ``P(o) = Σ_{x^γ} M_s(x^γ|c) · p_a(y) · [o = x^a ⊕ y, a = a(x^γ)]`` over all ``V^γ`` drafts;
  ``draft="beam"``: the one draft :func:`beam_search` ``(drafter, c, γ, width)``; ``draft="beam_sampling"``: drafts
  weighted by :func:`beam_sampling_law`. Only outcomes of positive probability are keys, sorted.
  """
  context = _check_models(drafter, target, context)
  return _block_law(drafter, target, context, _check_gamma(gamma), check_tau(tau), draft, _check_draft(draft, width))


def mtad_tau_law(drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int, tau: float, *,
                 draft: str = "sample", width: int = 4) -> np.ndarray:
  """``P(a = t)`` for t = 0..γ: float64 ``[γ + 1]`` (from :func:`mtad_block_law`)."""
  law = np.zeros(_check_gamma(gamma) + 1, dtype=np.float64)
  for outcome, prob in mtad_block_law(drafter, target, context, gamma, tau, draft=draft, width=width).items():
    law[len(outcome) - 1] += prob
  return law


def mtad_expected_accepted(drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int, tau: float, *,
                           draft: str = "sample", width: int = 4) -> float:
  """``E[a]`` of one iteration (block efficiency is this + 1)."""
  law = mtad_tau_law(drafter, target, context, gamma, tau, draft=draft, width=width)
  return float(np.dot(np.arange(law.shape[0], dtype=np.float64), law))


def mtad_first_token_tv(drafter: TabularLM, target: TabularLM, context: Sequence[int], gamma: int, tau: float, *,
                        draft: str = "sample", width: int = 4) -> float:
  """Exact TV between the law of MTAD's first emitted token after ``context`` and the target's ``M_b(·|c)``.

  The first token is ``x_1`` when ``a ≥ 1``, else ``y ~ p_0``. 0 at ``τ = inf``; positive for a finite τ whenever an
  accepted ``x_1`` shifts mass away from ``p_0``.
  """
  block = mtad_block_law(drafter, target, context, gamma, tau, draft=draft, width=width)
  emitted = emitted_prefix_law(block, target, context, 1)
  expected = sequence_law(target, context, 1)
  return 0.5 * float(sum(abs(emitted[s] - expected[s]) for s in expected))


# --- across iterations -------------------------------------------------------------------------------------------

def emitted_sequence_law(drafter: TabularLM, target: TabularLM, context: Sequence[int], n: int, gamma: int,
                         tau: float, *, draft: str = "sample", width: int = 4) -> dict[tuple[int, ...], float]:
  """Exact law of the first ``n`` tokens of MTAD decoding (every iteration MTAD, as the decoding loop runs it).

  ``P(s) = Σ_o P_c(o) · ([len(o) ≥ n] [o[:n] = s] + [len(o) < n] [s[:len(o)] = o] · P_{c⊕o}(s[len(o):]))`` with
  ``P_c`` the block law at context ``c`` (:func:`mtad_block_law`, memoised per context). Returns all ``V**n`` tuples
  (zeros included) in lexicographic order, like :func:`blockspec_jax.theory.exact.sequence_law`. The models are read
  at prefixes up to ``len(c) + n − 1 + γ`` tokens.
  """
  context = _check_models(drafter, target, context)
  n, gamma, tau, width = _check_gamma(n, minimum=0), _check_gamma(gamma), check_tau(tau), _check_draft(draft, width)

  @functools.lru_cache(maxsize=None)
  def block_after(suffix: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    return _block_law(drafter, target, context + suffix, gamma, tau, draft, width)

  @functools.lru_cache(maxsize=None)
  def law_after(suffix: tuple[int, ...], m: int) -> dict[tuple[int, ...], float]:
    law: dict[tuple[int, ...], float] = {}
    if m == 0:
      return {(): 1.0}
    for outcome, prob in block_after(suffix).items():
      if len(outcome) >= m:
        law[outcome[:m]] = law.get(outcome[:m], 0.0) + prob
        continue
      for rest, rest_prob in law_after(suffix + outcome, m - len(outcome)).items():
        law[outcome + rest] = law.get(outcome + rest, 0.0) + prob * rest_prob
    return law

  law = law_after((), n)
  return {tokens: law.get(tokens, 0.0) for tokens in _drafts(target.vocab_size, n)}


def mtad_sequence_tv(drafter: TabularLM, target: TabularLM, context: Sequence[int], n: int, gamma: int, tau: float,
                     *, draft: str = "sample", width: int = 4) -> float:
  """Exact TV between the first ``n`` tokens of MTAD decoding (:func:`emitted_sequence_law`) and the target's."""
  emitted = emitted_sequence_law(drafter, target, context, n, gamma, tau, draft=draft, width=width)
  expected = sequence_law(target, context, n)
  return 0.5 * float(sum(abs(emitted[s] - expected[s]) for s in expected))


# --- SPRINTER ---------------------------------------------------------------------------------------------------------

def sprinter_sequence_law(target_rows, drafter_rows, head_accepts, context: Sequence[int], n: int, cap: int,
                          vocab_size: int, bonus: bool = True) -> dict[tuple[int, ...], float]:
  """Exact law of SPRINTER's first ``n`` emitted tokens after ``context`` (a dict ``tokens → probability``).

  ``target_rows(ctx) -> p_V`` and ``drafter_rows(ctx) -> q_V`` give the (transformed) next-token laws of a context
  (a tuple of ids), ``head_accepts(ctx) -> bool`` the head's decision for the token drawn at that context (it reads
  only the context: :class:`~blockspec_jax.verify.SprinterVerifier`). A position is flagged when the head does not
  accept or when it is the ``cap``-th token of its segment; an accepted one has law ``q``. A flagged token ``x`` comes
  from the SD test: accepted with probability ``min(p, q)(x)``, the replacement with ``max(p − q, 0)(x)`` (together
  ``p(x)``). With ``bonus``, an accepted flagged token is followed by one token of law ``p``; a new segment starts
  after the bonus, or after the flagged token when there is none. ``V^n`` leaves at most (more paths: a flagged
  token splits into its accepted and its replaced branch).
  """
  _check_gamma(cap)
  law: dict[tuple[int, ...], float] = {}

  def visit(ctx: tuple[int, ...], emitted: tuple[int, ...], prob: float, segment_position: int, bonus_next: bool):
    if len(emitted) == n:
      law[emitted] = law.get(emitted, 0.0) + prob
      return
    if bonus_next:
      branches = [(np.asarray(target_rows(ctx), np.float64), False)]
    elif head_accepts(ctx) and segment_position < cap - 1:
      row_V = np.asarray(drafter_rows(ctx), np.float64)
      for x in np.flatnonzero(row_V > 0):
        visit(ctx + (int(x),), emitted + (int(x),), prob * float(row_V[x]), segment_position + 1, False)
      return
    elif not bonus:
      branches = [(np.asarray(target_rows(ctx), np.float64), False)]
    else:
      p_V, q_V = np.asarray(target_rows(ctx), np.float64), np.asarray(drafter_rows(ctx), np.float64)
      branches = [(np.minimum(p_V, q_V), True), (np.maximum(p_V - q_V, 0.0), False)]
    for row_V, then_bonus in branches:
      for x in np.flatnonzero(row_V > 0):
        visit(ctx + (int(x),), emitted + (int(x),), prob * float(row_V[x]), 0, then_bonus)

  visit(tuple(int(t) for t in context), (), 1.0, 0, False)
  return law


def ideal_head_accepts(target_rows, drafter_rows, threshold: float):
  """The Bayes-optimal head of a tabular pair: it accepts at context ``c`` when ``P_{x~q}[q(x) ≤ p(x)] ≥ threshold``
  (the probability of label 1 given the context alone, which a head reading the context's hidden state estimates)."""
  def accepts(ctx) -> bool:
    p_V = np.asarray(target_rows(ctx), np.float64)
    q_V = np.asarray(drafter_rows(ctx), np.float64)
    return float(np.sum(q_V[q_V <= p_V])) >= threshold
  return accepts


def law_tv(law_a: Mapping[tuple[int, ...], float], law_b: Mapping[tuple[int, ...], float]) -> float:
  """Total variation between two laws over token tuples (dicts; missing keys have probability 0)."""
  keys = set(law_a) | set(law_b)
  return 0.5 * float(sum(abs(law_a.get(k, 0.0) - law_b.get(k, 0.0)) for k in keys))
