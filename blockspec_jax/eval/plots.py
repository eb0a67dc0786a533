"""Dependency-free SVG line plots (no matplotlib on the lock): series of (x, y ± err) points with a legend."""

from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

__all__ = ["line_plot_svg"]

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
            "#bcbd22")


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
  if hi <= lo:
    hi = lo + 1.0
  raw = (hi - lo) / count
  step = 10 ** math.floor(math.log10(raw))
  for mult in (1, 2, 5, 10):
    if raw <= mult * step:
      step *= mult
      break
  first = math.ceil(lo / step) * step
  return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def line_plot_svg(series: Mapping[str, Sequence[tuple[float, float, float]]], *, title: str, xlabel: str,
                  ylabel: str, width: int = 720, height: int = 440) -> str:
  """An SVG document: one polyline per series of ``(x, y, stderr)`` points (error bars at ± stderr), x ticks at the
  points' x values, a legend on the right."""
  points = [p for pts in series.values() for p in pts]
  if not points:
    raise ValueError("nothing to plot: every series is empty")
  xs = sorted({p[0] for p in points})
  y_lo = min(p[1] - (p[2] if p[2] == p[2] else 0) for p in points)
  y_hi = max(p[1] + (p[2] if p[2] == p[2] else 0) for p in points)
  pad = 0.05 * (y_hi - y_lo or 1.0)
  y_lo, y_hi = y_lo - pad, y_hi + pad
  left, right, top, bottom = 60, 200, 40, 50
  plot_w, plot_h = width - left - right, height - top - bottom
  x_lo, x_hi = (xs[0], xs[-1]) if xs[-1] > xs[0] else (xs[0] - 1, xs[0] + 1)

  def sx(x):
    return left + (x - x_lo) / (x_hi - x_lo) * plot_w

  def sy(y):
    return top + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h

  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
         f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="{left + plot_w / 2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}</text>',
         f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>']
  for x in xs:
    out.append(f'<line x1="{sx(x):.1f}" y1="{top + plot_h}" x2="{sx(x):.1f}" y2="{top + plot_h + 5}" stroke="black"/>')
    out.append(f'<text x="{sx(x):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{x:g}</text>')
  for y in _ticks(y_lo, y_hi):
    out.append(f'<line x1="{left - 5}" y1="{sy(y):.1f}" x2="{left + plot_w}" y2="{sy(y):.1f}" stroke="#ddd"/>')
    out.append(f'<text x="{left - 8}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
  out.append(f'<text x="{left + plot_w / 2}" y="{height - 12}" text-anchor="middle">{html.escape(xlabel)}</text>')
  out.append(f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" transform="rotate(-90 16 '
             f'{top + plot_h / 2})">{html.escape(ylabel)}</text>')
  for i, (name, pts) in enumerate(series.items()):
    colour = _COLOURS[i % len(_COLOURS)]
    pts = sorted(pts)
    if pts:
      path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in pts)
      out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
    for x, y, err in pts:
      out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>')
      if err == err and err > 0:
        out.append(f'<line x1="{sx(x):.1f}" y1="{sy(y - err):.1f}" x2="{sx(x):.1f}" y2="{sy(y + err):.1f}" '
                   f'stroke="{colour}"/>')
    ly = top + 14 + 18 * i
    out.append(f'<line x1="{left + plot_w + 10}" y1="{ly - 4}" x2="{left + plot_w + 30}" y2="{ly - 4}" '
               f'stroke="{colour}" stroke-width="2"/>')
    out.append(f'<text x="{left + plot_w + 35}" y="{ly}">{html.escape(name)}</text>')
  out.append("</svg>")
  return "\n".join(out) + "\n"
