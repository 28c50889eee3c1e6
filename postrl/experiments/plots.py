"""Curves for ``postrl report``: one PNG per panel, x = generated tokens.

Runs are grouped by recipe. Seeds of a recipe are interpolated onto a common token grid
(the range every seed covers, :data:`GRID_POINTS` points) and drawn as their mean with a
shaded band from the lowest to the highest seed. A group that cannot be put on a common grid
(one seed, a seed with fewer than two points, or seeds that do not overlap) is drawn seed by
seed instead. Figures are built on matplotlib's Agg canvas directly (no pyplot, no display).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

TOKENS = "rollout/tokens_generated"
GRID_POINTS = 50
FIGSIZE = (6.4, 3.6)
DPI = 100
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
          "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")

Records = list[dict[str, Any]]


@dataclass(frozen=True)
class Line:
    """One metric drawn in a panel; ``suffix`` tells lines of one recipe apart in the legend."""

    metric: str
    style: str = "-"
    suffix: str = ""


@dataclass(frozen=True)
class Panel:
    """One PNG: a title, a y label and the metrics it draws."""

    filename: str
    title: str
    ylabel: str
    lines: tuple[Line, ...]

    @property
    def metrics(self) -> tuple[str, ...]:
        return tuple(line.metric for line in self.lines)


PANELS: tuple[Panel, ...] = (
    Panel("reward.png", "Training reward", "reward/mean", (Line("reward/mean"),)),
    Panel("eval_accuracy.png", "Held-out accuracy (greedy pass@1)", "eval/accuracy",
          (Line("eval/accuracy"),)),
    Panel("length.png", "Response length", "tokens", (Line("length/mean"),)),
    Panel("length_by_correctness.png", "Response length: correct (solid) vs incorrect (dashed)",
          "tokens", (Line("length/correct_mean", "-", " correct"),
                     Line("length/incorrect_mean", "--", " incorrect"))),
    Panel("entropy.png", "Policy entropy", "nats", (Line("entropy/mean"),)),
    Panel("clip.png", "Clipped fraction: low (solid) / high (dashed)", "fraction",
          (Line("clip/low_frac", "-", " low"), Line("clip/high_frac", "--", " high"))),
    Panel("zero_variance.png", "Zero-variance groups", "fraction",
          (Line("batch/zero_variance_frac"),)),
    Panel("kl.png", "KL to the reference", "nats", (Line("kl/mean"),)),
    Panel("ratio_seq_std.png", "Sequence-ratio spread (std over responses of s_i)", "ratio",
          (Line("ratio/seq_std"),)),
)


def series(records: Records, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, values)`` over the steps where both are finite numbers, in step order."""
    xs, ys = [], []
    for record in records:
        x, y = record.get(TOKENS), record.get(metric)
        if _is_number(x) and _is_number(y):
            xs.append(float(x))
            ys.append(float(y))
    return np.asarray(xs), np.asarray(ys)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def has_data(groups: Mapping[str, Sequence[Records]], metric: str) -> bool:
    """True when at least one run logged a finite value of ``metric``."""
    return any(series(run, metric)[0].size for runs in groups.values() for run in runs)


def seed_band(
    curves: Sequence[tuple[np.ndarray, np.ndarray]], points: int = GRID_POINTS
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(grid, mean, low, high)`` of several seeds' curves on their common token range.

    Each curve is linearly interpolated onto ``points`` evenly spaced token counts between
    the largest first x and the smallest last x; ``low``/``high`` are the seed minimum and
    maximum. None when fewer than two curves, a curve has fewer than two points, or the
    curves do not overlap.
    """
    if len(curves) < 2 or any(x.size < 2 for x, _ in curves):
        return None
    start = max(float(x[0]) for x, _ in curves)
    stop = min(float(x[-1]) for x, _ in curves)
    if not stop > start:
        return None
    grid = np.linspace(start, stop, points)
    stacked = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid, stacked.mean(axis=0), stacked.min(axis=0), stacked.max(axis=0)


def plot_panel(panel: Panel, groups: Mapping[str, Sequence[Records]], out: Path) -> Path:
    """Draw ``panel`` for every recipe in ``groups`` (label → each seed's records); save it."""
    figure = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for index, (label, runs) in enumerate(groups.items()):
        color = COLORS[index % len(COLORS)]
        for line in panel.lines:
            curves = [c for c in (series(run, line.metric) for run in runs) if c[0].size]
            _draw(axes, curves, color, line.style, f"{label}{line.suffix} (n={len(runs)})")
    axes.set_title(panel.title, fontsize=10)
    axes.set_xlabel("generated tokens")
    axes.set_ylabel(panel.ylabel)
    axes.grid(alpha=0.3)
    axes.ticklabel_format(axis="y", useOffset=False)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)
    figure.tight_layout()
    path = out / panel.filename
    figure.savefig(path, format="png")
    return path


def _draw(axes: Any, curves: list[tuple[np.ndarray, np.ndarray]], color: str, style: str,
          label: str) -> None:
    """Mean line and seed band when the seeds share a grid; otherwise each seed's own line."""
    if not curves:
        return
    band = seed_band(curves)
    if band is not None:
        grid, mean, low, high = band
        axes.plot(grid, mean, style, color=color, label=label)
        axes.fill_between(grid, low, high, color=color, alpha=0.2, linewidth=0)
        return
    for index, (x, y) in enumerate(curves):
        axes.plot(x, y, style, marker="o", markersize=3, color=color,
                  label=label if index == 0 else None)


def plot_all(groups: Mapping[str, Sequence[Records]], out: Path) -> tuple[list[tuple[Panel, Path]],
                                                                          list[Panel]]:
    """Every panel with data, saved under ``out``; and the panels skipped for lack of data."""
    drawn, skipped = [], []
    for panel in PANELS:
        if any(has_data(groups, metric) for metric in panel.metrics):
            drawn.append((panel, plot_panel(panel, groups, out)))
        else:
            skipped.append(panel)
    return drawn, skipped
