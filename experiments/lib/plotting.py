"""Figure helpers shared by the studies (matplotlib is imported only when a figure is made)."""

from __future__ import annotations

import os

import numpy as np


def save(fig, workdir: str, name: str, *, title: str | None = None, fontsize: float = 10,
         rect=None, dpi: int = 120) -> str:
  """Gives `fig` its suptitle `title`, lays it out (`tight_layout(rect=rect)`), writes
  `workdir/name` and closes it; returns `name` (for the report's list of figures)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  if title is not None:
    fig.suptitle(title, fontsize=fontsize)
  fig.tight_layout(rect=rect)
  fig.savefig(os.path.join(workdir, name), dpi=dpi)
  plt.close(fig)
  return name


# How figures name the methods of experiments.lib.models (the papers' spelling: GmP, not GMP).
_METHOD_LABELS = {'gmp': 'GmP', 'gmp_imn': 'GmP+IMN', 'wn_mbn': 'WN+MBN'}


def method_label(method: str) -> str:
  """The name of `method` in figures: `'gmp'` -> `'GmP'`, `'gmp_imn'` -> `'GmP+IMN'`, else upper.

  >>> [method_label(m) for m in ('sp', 'wn', 'bn', 'gmp', 'gmp_imn', 'wn_mbn')]
  ['SP', 'WN', 'BN', 'GmP', 'GmP+IMN', 'WN+MBN']
  """
  return _METHOD_LABELS.get(method, method.upper())


def log2_floor(values, floor: float = -30.0, limit: float = -60.0) -> float:
  """Lower y limit of a log2 plot of `values` (>= 0, NaN allowed): `floor`, or lower when a
  positive value is below `2**floor` (one unit under the lowest), never below `limit` (float64
  resolution; smaller values and exact zeros are drawn at the limit).

  >>> log2_floor([1.0, 2.0 ** -10]), log2_floor([1.0, 2.0 ** -44.5]), log2_floor([0.0, 1e-300])
  (-30.0, -46.0, -60.0)
  """

  values = np.asarray(values, np.float64)
  positive = values[np.isfinite(values) & (values > 0)]
  lowest = np.floor(np.log2(positive.min())) - 1 if positive.size else floor
  return float(max(min(floor, lowest), limit))


def legend_below(fig, ax, ncol: int = 4, fontsize: float = 8) -> None:
  """One legend for the figure, below the panels, from the entries of `ax`."""
  handles, labels = ax.get_legend_handles_labels()
  fig.legend(handles, labels, loc='lower center', ncol=ncol, fontsize=fontsize)


def square(ax, lim: float) -> None:
  """Shows `[-lim, lim]^2` at equal aspect (the 2-D studies' input plane)."""
  ax.set_xlim(-lim, lim)
  ax.set_ylim(-lim, lim)
  ax.set_aspect('equal')


def plot_variance_analysis(results, path: str) -> None:
  """Writes a PNG: per-layer pre-activation variance and gradient variance (log scale).

  Args:
    results: label (e.g. 'plain', 'LCW') -> the output of `geoparam.linen.variance.variance_analysis`
      (a list of its `LayerStats`).
    path: the PNG file to write.
  """
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for label, stats in results.items():
    layers = np.arange(1, len(stats) + 1)
    axes[0].plot(layers, [s.var for s in stats], marker='o', label=label)
    axes[1].plot(layers, [s.grad_var for s in stats], marker='o', label=label)
  axes[0].set(title='pre-activation variance (forward)', xlabel='layer', yscale='log')
  axes[1].set(title='gradient variance dL/dz (backward)', xlabel='layer', yscale='log')
  for ax in axes:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
