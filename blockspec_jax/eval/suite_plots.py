"""The suite's plots (``eval.suite``'s module docstring lists them): one panel per category, drawn with matplotlib
when it is installed."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from blockspec_jax import methods as methods_lib

__all__ = ["write_plots"]

#: The figures against γ: (row field, file name, title, y label).
_GAMMA_FIGURES = (
    ("block_efficiency", "be_vs_gamma.png", "block efficiency (tokens / target call)", "block efficiency"),
    ("speedup", "speedup_vs_gamma.png", "speedup over autoregressive (tok/s)", "speedup (×)"))


def write_plots(rows: list[dict], out_dir) -> list[pathlib.Path]:
  """PNG plots of a suite's rows in ``out_dir``; the paths written ([] without matplotlib). The trade-off plot only
  when a row has its fidelity measured (``delta_logp_vs_ar``)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return []
  out_dir = pathlib.Path(out_dir)
  tasks = list(dict.fromkeys(r["task"] for r in rows))
  label = _labeller(rows)
  written = []
  for field, name, title, ylabel in _GAMMA_FIGURES:
    fig, axes = _panels(plt, tasks, title)
    for ax, task in zip(axes, tasks):
      _gamma_panel(ax, [r for r in rows if r["task"] == task], field, ylabel, label)
      ax.set_title(task)
    written.append(_save(plt, fig, out_dir / name))
  fig, axes = _panels(plt, tasks, "acceptance per position (each method at its largest γ)")
  for ax, task in zip(axes, tasks):
    _acceptance_panel(ax, [r for r in rows if r["task"] == task], label)
    ax.set_title(task)
  written.append(_save(plt, fig, out_dir / "acceptance_per_position.png"))
  if any(np.isfinite(r.get("delta_logp_vs_ar", float("nan"))) for r in rows):
    fig, axes = _panels(plt, tasks, "speed against fidelity: speedup vs Δ mean target log-likelihood from "
                                    "autoregressive sampling")
    for ax, task in zip(axes, tasks):
      _tradeoff_panel(ax, [r for r in rows if r["task"] == task], label)
      ax.set_title(task)
    written.append(_save(plt, fig, out_dir / "tradeoff.png"))
  return written


def _labeller(rows: list[dict]):
  """``row -> its legend label``: the method, with the temperature when the suite ran more than one."""
  several = len({r["temperature"] for r in rows}) > 1
  return lambda r: r["method"] + (f" T={r['temperature']:g}" if several else "")


def _panels(plt, tasks: list, title: str):
  """A figure of one panel per category (at most 4 a row; unused panels hidden) and its panels."""
  cols = min(len(tasks), 4)
  rows_of_panels = math.ceil(len(tasks) / cols)
  fig, axes = plt.subplots(rows_of_panels, cols, figsize=(4.2 * cols, 3.4 * rows_of_panels), squeeze=False)
  for ax in axes.flat[len(tasks):]:
    ax.set_visible(False)
  fig.suptitle(title)
  return fig, axes.flat


def _save(plt, fig, path: pathlib.Path) -> pathlib.Path:
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _integer_ticks(ax, values) -> None:
  """Ticks at exactly the integers ``values`` (γ or draft positions), with room either side of a single one:
  matplotlib would otherwise spread fractional ticks (3.80, 3.85, …) over the axis around one point."""
  from matplotlib.ticker import MaxNLocator
  values = sorted({int(v) for v in values})
  if not values:
    return
  if len(values) <= 12:
    ax.set_xticks(values)
  else:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  if len(values) == 1:
    ax.set_xlim(values[0] - 1, values[0] + 1)


def _gamma_panel(ax, rows: list[dict], field: str, ylabel: str, label) -> None:
  """One category's ``field`` against γ, a line per method (and temperature)."""
  series: dict[str, list] = {}
  for r in rows:
    if r["gamma"] is not None and r.get(field) is not None and np.isfinite(r[field]):
      series.setdefault(label(r), []).append((r["gamma"], r[field]))
  for name, points in series.items():
    points.sort()
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
  if field == "speedup":
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
  ax.set_xlabel("γ")
  ax.set_ylabel(ylabel)
  _integer_ticks(ax, [g for points in series.values() for g, _ in points])
  ax.grid(alpha=0.3)
  if series:
    ax.legend(fontsize=7)


def _acceptance_panel(ax, rows: list[dict], label) -> None:
  """One category's acceptance per draft position, each method at its largest γ."""
  top = {}
  for r in rows:
    if r.get("acceptance_per_position"):
      key = label(r)
      if key not in top or r["gamma"] > top[key]["gamma"]:
        top[key] = r
  for name, r in top.items():
    acc = r["acceptance_per_position"]
    ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{name} γ={r['gamma']}")
  ax.set_xlabel("draft position i")
  ax.set_ylabel("acceptance P(τ ≥ i)")
  _integer_ticks(ax, [i for r in top.values() for i in range(1, len(r["acceptance_per_position"]) + 1)])
  ax.set_ylim(0, 1.02)
  ax.grid(alpha=0.3)
  if top:
    ax.legend(fontsize=7)


def _tradeoff_panel(ax, rows: list[dict], label) -> None:
  """One category's speedup against Δ mean target log-likelihood from autoregressive sampling; lossy rows red."""
  for r in rows:
    x, y = r.get("delta_logp_vs_ar", float("nan")), r["speedup"]
    if r["method"] == methods_lib.AUTOREGRESSIVE or not (np.isfinite(x) and np.isfinite(y)):
      continue
    ax.scatter([x], [y], marker="^" if r.get("lossy") else "o", s=40, color="C3" if r.get("lossy") else "C0")
    ax.annotate(f"{label(r)} γ={r['gamma']}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
  ax.axvline(0.0, color="grey", lw=0.8, ls="--")
  ax.axhline(1.0, color="grey", lw=0.8, ls="--")
  ax.set_xlabel("Δ mean log p (target, T = 1) vs autoregressive")
  ax.set_ylabel("speedup")
  ax.grid(alpha=0.3)
