"""Figure helpers shared by the studies (matplotlib is imported only when a figure is made)."""

from __future__ import annotations

import os


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


def legend_below(fig, ax, ncol: int = 4, fontsize: float = 8) -> None:
  """One legend for the figure, below the panels, from the entries of `ax`."""
  handles, labels = ax.get_legend_handles_labels()
  fig.legend(handles, labels, loc='lower center', ncol=ncol, fontsize=fontsize)


def square(ax, lim: float) -> None:
  """Shows `[-lim, lim]^2` at equal aspect (the 2-D studies' input plane)."""
  ax.set_xlim(-lim, lim)
  ax.set_ylim(-lim, lim)
  ax.set_aspect('equal')
