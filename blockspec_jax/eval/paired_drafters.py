"""Drafters compared on the same contexts: a trained drafter against its base (``eval.paired --drafters``).

Each drafter drafts on the same contexts (prompts extended by prefixes of one target sample, see
:mod:`blockspec_jax.eval.paired`); its table ``E_DxBxRxG`` (draw, context, rule, γ) holds the Rao–Blackwellised
``Σ_i P(τ ≥ i | X^i)`` of every rule on the first γ tokens of each draft. Block efficiency = 1 + E[τ].

Per drafter, rule and γ: BE averaged over contexts, ± one standard error over contexts (draws of one context are
averaged first: they share it); per category (code, chat, math, … from the prompt rows); and against the first
drafter (the reference, e.g. the base model): the per-context difference of BE, averaged, ± its standard error over
contexts (paired by context, so the spread of contexts cancels), the relative gain in BE and the relative gain in
accepted tokens E[τ] (= BE − 1: the draft tokens kept per target call, without the one the target adds itself).
The groups may be any per-context labels: the prompts' categories, or the contexts' offsets past the prompt in bins
(``"+16–31"``, :func:`offset_bins`, sorted by number). :func:`summarize_within` pairs the difference within each
group instead (e.g. contexts at the prompt against those past it, :func:`prompt_split`), so each group gets its own
Δ ± se.
"""

from __future__ import annotations

import numpy as np

from blockspec_jax.checks import check_int
from blockspec_jax.theory.stats import mean_stderr

__all__ = ["MIN_REFERENCE_ACCEPTED", "summarize_drafters", "format_drafters", "offset_bins", "prompt_split",
           "summarize_within", "format_within"]


def offset_bins(offsets, width: int) -> list[str]:
  """Each context's offset past the prompt as its bin of ``width`` tokens, ``"+16–31"`` (``"+0"`` for width 1 at 0):
  a target sample that ends early (a short answer) puts its contexts at smaller offsets than the nominal
  ``0, n/k, …``, so the report groups by where the contexts actually are."""
  width = check_int(width, "width")
  labels = []
  for j in offsets:
    lo = (int(j) // width) * width
    labels.append(f"+{lo}" if width == 1 else f"+{lo}–{lo + width - 1}")
  return labels


def prompt_split(offsets) -> list[str]:
  """``"at the prompt"`` for a context that ends at the prompt (offset 0), ``"past the prompt"`` otherwise: where a
  drafter trained on how answers begin and one trained on how they go on part ways."""
  return ["at the prompt" if int(j) == 0 else "past the prompt" for j in offsets]


def _group_key(label: str):
  """Offset labels (``"+16"``, ``"+16–31"``) sort by their first number, before any other label; other labels
  alphabetically."""
  digits = label[1:].split("–")[0]
  return (0, int(digits), "") if label[:1] == "+" and digits.isdigit() else (1, 0, label)


#: Below this E[τ] (accepted tokens per target call) the reference accepts next to nothing, and a ratio over it is
#: rounding noise (a drafter that accepts 1e-8 tokens a call makes a 0.06 gain read +5,000,000%): its
#: ``accepted_gain`` is NaN, shown as n/a; ``diff`` and ``gain`` still compare the two.
MIN_REFERENCE_ACCEPTED = 1e-3


def _percent(value: float) -> str:
  """``+12.3%``, or ``n/a`` where the ratio is not defined (NaN)."""
  return "n/a" if np.isnan(value) else f"{100 * value:+.1f}%"


def summarize_drafters(tables: dict, tasks: list[str], rules: tuple[str, ...], gammas=None) -> list[dict]:
  """Rows ``{drafter, rule, gamma, be, be_se, by_task: {task: be}, diff, diff_se, gain, accepted_gain}`` for every
  drafter (in the order of ``tables``: label → ``E_DxBxRxG``), rule and γ (all γ of the tables, or ``gammas``).
  ``tasks`` labels each context (a category or an offset). The first drafter is the reference of ``diff`` (BE −
  reference BE, per context), ``gain`` (BE / reference BE − 1) and ``accepted_gain`` (E[τ] / reference E[τ] − 1;
  NaN where the reference's E[τ] is below :data:`MIN_REFERENCE_ACCEPTED`)."""
  labels = list(tables)
  if not labels:
    raise ValueError("no drafter tables to summarize")
  per_context = {k: np.asarray(v, np.float64).mean(axis=0) for k, v in tables.items()}  # [B, R, G]
  shapes = {v.shape for v in per_context.values()}
  if len(shapes) != 1:
    raise ValueError(f"drafter tables differ in shape (contexts, rules, γ): {sorted(shapes)}; they must share the "
                     "contexts")
  contexts, num_rules, num_gammas = shapes.pop()
  if len(rules) != num_rules or len(tasks) != contexts:
    raise ValueError(f"{len(rules)} rules and {len(tasks)} task labels for tables of {num_rules} rules and "
                     f"{contexts} contexts")
  ref = per_context[labels[0]]
  out = []
  task_names = sorted(set(tasks), key=_group_key)
  tasks_B = np.asarray(tasks)
  for label in labels:
    table = per_context[label]
    for r, rule in enumerate(rules):
      for g in range(num_gammas):
        if gammas is not None and g + 1 not in gammas:
          continue
        be_B = 1.0 + table[:, r, g]
        be, be_se = mean_stderr(be_B)
        diff, diff_se = mean_stderr(be_B - (1.0 + ref[:, r, g]))
        ref_be = mean_stderr(1.0 + ref[:, r, g])[0]  # the reference row: exactly 0 gain
        out.append(dict(drafter=label, rule=rule, gamma=g + 1, be=be, be_se=be_se,
                        by_task={t: float(be_B[tasks_B == t].mean()) for t in task_names},
                        diff=diff, diff_se=diff_se, gain=be / ref_be - 1.0,
                        accepted_gain=((be - 1.0) / (ref_be - 1.0) - 1.0 if ref_be - 1.0 >= MIN_REFERENCE_ACCEPTED
                                       else float("nan")),
                        contexts=int(contexts)))
  return out


def summarize_within(tables: dict, groups: list[str], rules: tuple[str, ...], gammas=None) -> list[dict]:
  """:func:`summarize_drafters` on each group's contexts alone (groups in :func:`_group_key` order): ``be``,
  ``diff`` ± ``diff_se``, ``gain`` and ``accepted_gain`` are over, and paired within, that group's contexts. Rows are
  those of :func:`summarize_drafters` with ``group`` added and ``by_task`` left out."""
  groups_B = np.asarray(groups)
  shapes = {np.shape(v)[1] for v in tables.values()}
  if shapes != {len(groups_B)}:
    raise ValueError(f"{len(groups_B)} group labels for tables of {sorted(shapes)} contexts")
  out = []
  for group in sorted(set(groups), key=_group_key):
    here = groups_B == group
    sub = {k: np.asarray(v)[:, here] for k, v in tables.items()}
    for row in summarize_drafters(sub, [group] * int(here.sum()), rules, gammas):
      row.pop("by_task")
      out.append({"group": group, **row})
  return out


def format_within(rows: list[dict], temperature: float) -> str:
  """A Markdown table of :func:`summarize_within` rows at one temperature."""
  ref = rows[0]["drafter"] if rows else ""
  lines = [f"T = {temperature:g}: block efficiency within each group of contexts, Δ vs {ref} paired within the "
           "group; ± one standard error over the group's contexts", "",
           f"| contexts | n | drafter | rule | γ | BE ± se | Δ vs {ref} ± se | gain | accepted gain |",
           "|" + "---|" * 9]
  for r in rows:
    lines.append(f"| {r['group']} | {r['contexts']} | {r['drafter']} | {r['rule']} | {r['gamma']} | "
                 f"{r['be']:.3f} ± {r['be_se']:.3f} | {r['diff']:+.3f} ± {r['diff_se']:.3f} | "
                 f"{_percent(r['gain'])} | {_percent(r['accepted_gain'])} |")
  return "\n".join(lines)


def format_drafters(rows: list[dict], temperature: float, groups: str = "category") -> str:
  """A Markdown table of :func:`summarize_drafters` rows at one temperature; ``groups`` names what the per-group
  columns are (the prompts' category, or the tokens past the prompt)."""
  tasks = list(rows[0]["by_task"]) if rows else []
  head = (f"| drafter | rule | γ | BE ± se | {' | '.join(tasks)} | Δ vs {rows[0]['drafter']} ± se | gain | "
          "accepted gain |" if rows else "")
  lines = [f"T = {temperature:g}: block efficiency (1 + E[τ], Rao–Blackwellised) on the same contexts, by {groups}; "
           "± one standard error over contexts; Δ paired by context; accepted gain = E[τ] / reference E[τ] − 1 (n/a: "
           "the reference accepts next to nothing)", "",
           head, "|" + "---|" * (7 + len(tasks))]
  for r in rows:
    by = " | ".join(f"{r['by_task'][t]:.3f}" for t in tasks)
    lines.append(f"| {r['drafter']} | {r['rule']} | {r['gamma']} | {r['be']:.3f} ± {r['be_se']:.3f} | {by} | "
                 f"{r['diff']:+.3f} ± {r['diff_se']:.3f} | {_percent(r['gain'])} | {_percent(r['accepted_gain'])} |")
  return "\n".join(lines)
