"""Trees and chains at equal target node budgets, paired on the same contexts (and the same drafts where rules can
share them): ``python -m blockspec_jax.eval.paired --trees``.

For every budget ``N`` (draft nodes scored per target call) the *arms* are drafters shaped to ``N`` nodes:

=========================  ===========================  ==================================================
arm                        drafts                       rules on the same drafts
=========================  ===========================  ==================================================
chain                      one chain, γ = N             token, block (Rao–Blackwellised E[τ])
spectr k=2 / k=4           k i.i.d. chains, depth N/k   rrs (SpecInfer), spectr (SpecTr)
rsd_c                      RSD-C tree (w/o replacement) rrs_wor (RSD), traversal
rsd_s                      RSD-S beam tree, width W     rrs_wor (RSD), traversal
rsd_c-2,2 / rsd_c-4,2      RSD-C branching at 2 depths  rrs_wor (RSD), traversal
=========================  ===========================  ==================================================

The chain, SpecTr, ``rsd_c`` and ``rsd_s`` arms have exactly ``N`` nodes. RSD-C's multi-level shapes (the paper
branches at several depths: ``(2, 2, 1, …)``, ``(4, 2, 1, …)``) reach none of the power-of-two budgets (``(2, 2, 1,
…)`` of depth γ has ``2 + 4(γ − 1)`` nodes), so at budget ``N`` they take the deepest such shape with at most ``N``
nodes (:func:`branching_within`: ``(2, 2)`` = 6 and ``(4, 2)`` does not fit at 8, ``(2, 2, 1, 1)`` = 14 and ``(4,
2)`` = 12 at 16), their node count in the label: fewer nodes than the budget, never more.

Per context (prompt + a prefix of a target sample, as :mod:`blockspec_jax.eval.paired`), ``draws`` drafts per arm,
each scored by the target in one pass; every rule of the arm verifies the same draft. Chain rules report the
Rao–Blackwellised ``Σ_i P(τ ≥ i | X^i)``; tree rules report the mean τ over ``verify_draws`` independent verifier keys
on that draft (the verifier's coins are cheap next to the target pass; their average takes most of the coin noise
out). Block efficiency = 1 + E[τ]; standard errors over contexts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from blockspec_jax.theory.stats import mean_stderr

from blockspec_jax import parallel, sampling
from blockspec_jax.decoding import speculative as spec
from blockspec_jax.verify import get_verifier

__all__ = ["Arm", "arms_for_budget", "branching_within", "RSD_C_LEVELS", "arm_table", "summarize_arms", "plot_arms"]

#: RSD-C's multi-level branchings of the budget study (each extended by 1s as deep as a budget allows).
RSD_C_LEVELS = ((2, 2), (4, 2))


@dataclasses.dataclass(frozen=True)
class Arm:
  """One drafting configuration: registry drafter ``drafter`` with ``settings``, maximum depth ``gamma``, verified by
  every rule in ``rules`` on the same drafts."""
  label: str
  drafter: str
  settings: tuple
  gamma: int
  rules: tuple[str, ...]


def arms_for_budget(budget: int) -> list[Arm]:
  """The arms of the module docstring at ``budget`` nodes (shapes from ``drafters.shape_for_budget``)."""
  from blockspec_jax import drafters
  arms = [Arm("chain", "model", (), budget, ("token", "block"))]
  for k in (2, 4):
    if budget % k == 0 and budget // k >= 2:  # k = 4 at 4 nodes is depth 1: one node per chain, no tree
      settings, gamma = drafters.shape_for_budget("k_chains", budget, k)
      arms.append(Arm(f"spectr k={k}", "k_chains", tuple(sorted(settings.items())), gamma, ("rrs", "spectr")))
  for kind in ("rsd_c", "rsd_s"):
    settings, gamma = drafters.shape_for_budget(kind, budget)
    label = kind + " " + ",".join(f"{k}={v}" for k, v in sorted(settings.items()))
    arms.append(Arm(label, kind, tuple(sorted(settings.items())), gamma, ("rrs_wor", "traversal")))
  for levels in RSD_C_LEVELS:
    shape = branching_within(levels, budget)
    if shape is not None:
      branching, nodes = shape
      arms.append(Arm(f"rsd_c-{','.join(map(str, levels))} branching={branching} ({nodes} nodes)", "rsd_c",
                      (("branching", branching),), len(branching), ("rrs_wor", "traversal")))
  return arms


def branching_within(levels: tuple[int, ...], budget: int) -> tuple[tuple[int, ...], int] | None:
  """``(branching, nodes)``: ``levels`` followed by as many 1s as keep the tree's node count (``Σ_d Π_{i ≤ d} b_i``)
  within ``budget``; None when ``levels`` alone exceeds it."""
  branching, nodes, width = [], 0, 1
  for b in levels:
    width *= b
    nodes += width
    branching.append(b)
  if nodes > budget:
    return None
  while nodes + width <= budget:
    nodes += width
    branching.append(1)
  return tuple(branching), nodes


def arm_table(target_params, drafter_params, keys_D, tokens_BxP, prompt_len_B, *, target, drafter, gamma: int,
              sampler: sampling.Sampler, rules: tuple[str, ...], verify_draws: int) -> jax.Array:
  """``E_DxBxR`` f32: for draw d, context b and rule r, the estimate of E[τ] on draw d's draft (see the module
  docstring). Row b's draft in draw d uses ``fold_in(keys_D[d], b)``."""
  verifiers = tuple(get_verifier(r) for r in rules)
  for v in verifiers:
    v.check_drafter(type(drafter).__name__, drafter)
  state = spec.speculative_prefill(target_params, drafter_params, tokens_BxP, prompt_len_B, target=target,
                                   drafter=drafter, gamma=gamma, max_new_tokens=1)
  batch = tokens_BxP.shape[0]

  def one_draw(key):
    row_keys_B = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
    scored = spec.draft_and_score(target_params, drafter_params, state, row_keys_B, target=target, drafter=drafter,
                                  gamma=gamma, sampler=sampler)
    per_rule = []
    for v in verifiers:
      verify = functools.partial(v.verify_draft, draft=scored.draft, p_BxN1xV=scored.p_BxN1xV,
                                 depth_BxN=scored.depth_BxN, gamma=gamma)
      if v.structure == "chain" and v.needs_draft_probs:
        per_rule.append(verify(row_keys_B).expected_accepted_B)
      else:
        coin_keys_KxB = jax.vmap(lambda k: jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys_B, k))(
            jnp.arange(1, verify_draws + 1))
        taus_KxB = jax.lax.map(lambda keys_B: verify(keys_B).num_accepted_B, coin_keys_KxB)
        per_rule.append(jnp.mean(taus_KxB.astype(jnp.float32), axis=0))
    return jnp.stack(per_rule, axis=1)  # [B, R]

  return jax.lax.map(one_draw, keys_D)


_arm_table = jax.jit(arm_table, static_argnames=("target", "drafter", "gamma", "sampler", "rules", "verify_draws"))


def run_arm(target_params, drafter_params, contexts: Sequence[Sequence[int]], arm: Arm, *, target, drafter, draws: int,
            temperature: float, seed: int, verify_draws: int = 16, mesh=None) -> np.ndarray:
  """Ragged ``contexts`` → ``[draws, contexts, rules]`` for one arm (``drafter``: the arm's drafter object).

  ``mesh`` (``parallel.make_mesh``, of several devices): the contexts over its ``data`` axis (padded to a multiple of
  it by repeating the last context, the padding cut from the table), both models' parameters laid out as
  ``parallel`` says (pass them placed already, ``parallel.shard_models``, to place them once for every arm); every
  process of a multi-host run passes the same contexts and gets the whole table. Context ``b`` drafts and verifies
  with the keys of row ``b`` wherever it runs, so the table is one device's up to float rounding."""
  mesh, (target_params, drafter_params), keys_D, data = parallel.layout_rows(
      mesh, (target_params, drafter_params), jax.random.split(jax.random.key(seed), draws))
  rows = len(contexts)
  index = parallel.pad_rows(np.arange(rows), rows + -rows % data)
  tokens_BxP, prompt_len_B = spec.prepare_prompts([list(contexts[i]) for i in index])
  if mesh is not None:
    tokens_BxP, prompt_len_B = parallel.shard_batch(mesh, tokens_BxP, prompt_len_B)
  table = _arm_table(target_params, drafter_params, keys_D, tokens_BxP, prompt_len_B, target=target,
                     drafter=drafter, gamma=arm.gamma, sampler=sampling.Sampler(temperature=temperature),
                     rules=arm.rules, verify_draws=verify_draws)
  return parallel.gather(table)[:, :rows]


def summarize_arms(results: Sequence[dict]) -> list[dict]:
  """Per (budget, arm, rule): block efficiency (1 + mean E[τ]) and its standard error over contexts. ``results``:
  dicts with ``budget``, ``arm`` (label), ``rules`` and ``table`` ([D, B, R])."""
  rows = []
  for res in results:
    per_context_BxR = np.asarray(res["table"], np.float64).mean(axis=0)
    contexts = per_context_BxR.shape[0]
    for r, rule in enumerate(res["rules"]):
      mean, stderr = mean_stderr(per_context_BxR[:, r])
      rows.append(dict(budget=res["budget"], arm=res["arm"], rule=rule, gamma=res["gamma"], be=1.0 + mean,
                       be_stderr=stderr, contexts=contexts, draws=int(np.asarray(res["table"]).shape[0])))
  return rows


def _per_context(results: Sequence[dict], budget: int, arm: str, rule: str) -> np.ndarray:
  """float64 ``[contexts]``: E[τ] of ``rule`` on ``arm`` at ``budget``, averaged over the arm's draws."""
  for res in results:
    if res["budget"] == budget and res["arm"] == arm:
      return np.asarray(res["table"], np.float64).mean(axis=0)[:, res["rules"].index(rule)]
  raise KeyError(f"no arm {arm!r} at budget {budget}")


def paired_difference(results: Sequence[dict], budget: int, arm: str, better: str, worse: str,
                      worse_arm: str | None = None):
  """``(mean, stderr)`` over contexts of E[τ] of rule ``better`` on ``arm`` minus rule ``worse`` on ``worse_arm``
  (default: the same arm, i.e. the same drafts). Across arms the contexts are shared but the drafts are each arm's
  own, so the difference is paired on contexts only."""
  diff_B = _per_context(results, budget, arm, better) - _per_context(results, budget, worse_arm or arm, worse)
  return mean_stderr(diff_B)


def plot_arms(rows: Sequence[dict], temperature: float) -> str:
  """SVG: block efficiency against the node budget, one line per (arm kind, rule)."""
  from blockspec_jax.eval.plots import line_plot_svg
  series: dict[str, list] = {}
  for r in rows:
    name = f"{r['rule']} · {r['arm'].split(' ')[0] if r['arm'].startswith('rsd') else r['arm']}"  # rsd_c, rsd_c-2,2, …
    series.setdefault(name, []).append((r["budget"], r["be"], r["be_stderr"]))
  return line_plot_svg(series, title=f"Block efficiency at equal target node budgets (T = {temperature:g})",
                       xlabel="draft nodes per target call", ylabel="block efficiency (tokens per target call)")
