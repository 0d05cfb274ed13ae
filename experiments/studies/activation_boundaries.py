r"""Characteristic activation boundaries of one ReLU unit (paper 002, appendix A, Fig. 5-6).

A GmP unit `z = relu(u(theta)^T x + lam)`: in R (Fig. 5, `u = cos(theta)` with
theta in {0, pi}) the boundary is the point `phi = -lam u`; in R^2 (Fig. 6,
`u = (cos theta, sin theta)`) it is the line `u^T x + lam = 0` with `phi` its
point nearest the origin. The panels show `z`, the boundary, `phi`, and the
active (green) and inactive (red) sides for chosen `(lam, theta)`. Every `phi`
is `geoparam.analysis.boundary_location` of the unit's GmP parameters and is
checked to zero the pre-activation.

  python -m experiments.main --config=experiments/configs/activation_boundaries.py \
      --workdir=/tmp/boundaries

Writes to `workdir`: `results.json` (lam, theta, phi per panel), `results.csv`,
`results.md`, `boundaries_1d.png` (Fig. 5) and `boundaries_2d.png` (Fig. 6).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments.lib import plotting, report
from geoparam import analysis

# (lam, theta) of the panels.
CASES_1D = ((1.0, 0.0), (-1.0, 0.0), (1.0, np.pi), (-1.0, np.pi))
CASES_2D = ((1.0, np.pi / 4), (-1.0, np.pi / 4), (1.0, 3 * np.pi / 4), (0.5, 4 * np.pi / 3))


def unit_params(lam: float, theta: float, fan_in: int) -> dict[str, jax.Array]:
  """GmP parameters of one unit: R^1 uses the sign `cos(theta)` (theta in {0, pi}), R^2 the angle."""
  if fan_in == 1:
    if not np.isclose(abs(np.cos(theta)), 1.0):
      raise ValueError(f'in R^1 theta must be 0 or pi (a sign), got {theta}.')
    sign = np.sign(np.cos(theta))
    return {'theta': jnp.zeros((0, 1)), 'lam': jnp.array([lam]), 'scale': jnp.ones(1),
            'sign': jnp.array([sign])}
  if fan_in == 2:
    return {'theta': jnp.array([[theta]]), 'lam': jnp.array([lam]), 'scale': jnp.ones(1)}
  raise ValueError(f'fan_in must be 1 or 2, got {fan_in}.')


def describe(lam: float, theta: float, fan_in: int) -> dict[str, Any]:
  """`phi`, `u` and the pre-activation at `phi` (0 up to rounding) of one unit."""
  with jax.enable_x64(True):
    params = unit_params(lam, theta, fan_in)
    phi = np.asarray(analysis.boundary_location(params, 'gmp'))[0]
    u = np.asarray(analysis.boundary_direction(params, 'gmp'))[0]
  return dict(lam=lam, theta=float(theta), phi=phi.tolist(), u=u.tolist(),
              preactivation_at_phi=float(u @ phi + lam))


def plot_1d(rows, path):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 3.4), squeeze=False)
  x = np.linspace(-3, 3, 601)
  for ax, r in zip(axes[0], rows):
    u, lam, phi = r['u'][0], r['lam'], r['phi'][0]
    ax.plot(x, np.maximum(u * x + lam, 0), color='tab:blue', lw=2, label='z = relu(u x + lam)')
    ax.axhline(0, color='k', lw=0.6)
    ax.axvline(phi, color='saddlebrown', lw=2.5, label=r'boundary $\mathcal{B}$')
    ax.annotate('', xy=(phi, 0.15), xytext=(0, 0.15),
                arrowprops=dict(arrowstyle='->', color='saddlebrown', lw=1.5, ls=':'))
    ax.plot(phi, 0, 'o', color='saddlebrown', ms=6)
    ax.annotate('', xy=(phi + 1.2 * u, -0.35), xytext=(phi, -0.35),
                arrowprops=dict(arrowstyle='->', color='green', lw=2))
    ax.annotate('', xy=(phi - 1.2 * u, -0.35), xytext=(phi, -0.35),
                arrowprops=dict(arrowstyle='->', color='red', lw=2))
    ax.set_xlim(-3, 3)
    ax.set_ylim(-0.7, 3.5)
    ax.set_title(rf'$\lambda$ = {lam:g}, $\theta$ = {r["theta"] / np.pi:g}$\pi$, '
                 rf'$\phi$ = {phi:g}', fontsize=10)
    ax.set_xlabel('x')
  axes[0][0].legend(fontsize=7, loc='upper left')
  plotting.save(fig, *os.path.split(path), rect=(0, 0, 1, 0.94),
                title='ReLU unit in R: active side (green) and inactive side (red) of the point '
                r'$\phi = -\lambda u(\theta)$')


def plot_2d(rows, path):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, len(rows), figsize=(3.8 * len(rows), 4.4), squeeze=False)
  g = np.linspace(-2.5, 2.5, 201)
  gx, gy = np.meshgrid(g, g)
  for ax, r in zip(axes[0], rows):
    u, lam, phi = np.asarray(r['u']), r['lam'], np.asarray(r['phi'])
    z = np.maximum(u[0] * gx + u[1] * gy + lam, 0)
    ax.contourf(gx, gy, z, levels=12, cmap='Blues', alpha=0.6)
    ax.axline(phi, phi + np.array([-u[1], u[0]]), color='saddlebrown', lw=2.5)
    ax.plot([0, phi[0]], [0, phi[1]], color='saddlebrown', ls=':', lw=2)
    ax.plot(*phi, 'o', color='saddlebrown', ms=6)
    ax.plot(0, 0, 'ko', ms=4)
    ax.annotate('', xy=phi + 0.9 * u, xytext=phi, arrowprops=dict(arrowstyle='->', color='green',
                                                                  lw=2))
    ax.annotate('', xy=phi - 0.9 * u, xytext=phi, arrowprops=dict(arrowstyle='->', color='red',
                                                                  lw=2))
    plotting.square(ax, 2.5)
    ax.set_title(rf'$\lambda$ = {lam:g}, $\theta$ = {r["theta"] / np.pi:.3g}$\pi$', fontsize=10)
    ax.set_xlabel('$x_1$')
  axes[0][0].set_ylabel('$x_2$')
  plotting.save(fig, *os.path.split(path), rect=(0, 0, 1, 0.94),
                title=r'ReLU unit in R$^2$: $z$ (blue), boundary $\mathcal{B}$ and '
                r'$\phi = -\lambda u(\theta)$ (brown), active (green) / inactive (red)')


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Computes `phi` for each panel of `CASES_1D`/`CASES_2D`, writes the report and figures.

  Returns `{'summary': what results.json holds}`.
  """
  t_start = time.perf_counter()
  rows_1d = [describe(lam, theta, 1) for lam, theta in CASES_1D]
  rows_2d = [describe(lam, theta, 2) for lam, theta in CASES_2D]
  worst = max(abs(r['preactivation_at_phi']) for r in rows_1d + rows_2d)
  rows = [dict(space=f'R^{n}', lam=r['lam'], theta=r['theta'], phi=r['phi'],
               preactivation_at_phi=r['preactivation_at_phi'])
          for n, group in ((1, rows_1d), (2, rows_2d)) for r in group]
  table = report.markdown_table(
      ['space', 'lam', 'theta / pi', 'phi', 'u^T phi + lam'],
      [[r['space'], f'{r["lam"]:g}', f'{r["theta"] / np.pi:.4g}',
        '(' + ', '.join(f'{p:.4f}' for p in r['phi']) + ')',
        f'{r["preactivation_at_phi"]:.1e}'] for r in rows])
  figures = []
  if config.plots:
    os.makedirs(workdir, exist_ok=True)
    plot_1d(rows_1d, os.path.join(workdir, 'boundaries_1d.png'))
    plot_2d(rows_2d, os.path.join(workdir, 'boundaries_2d.png'))
    figures = ['boundaries_1d.png', 'boundaries_2d.png']
  claims = {'phi = -lam u(theta) lies on the boundary (u^T phi + lam = 0, float64)': report.claim(
      worst < 1e-12, 'max |u^T phi + lam| = {:.1e}', worst)}
  summary = report.write(
      workdir, 'activation_boundaries',
      summary={'r1': rows_1d, 'r2': rows_2d, 'max_abs_preactivation_at_phi': worst},
      rows=rows, table=table, claims=claims, config=config, started=t_start, figures=figures)
  return {'summary': summary}

