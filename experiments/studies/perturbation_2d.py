r"""Perturbation of one ReLU unit in R^2 (paper 002, Sec. 3.4-3.5, Fig. 1 b-e).

A unit `relu(w^T x + b)` with small weights (`w, b ~ N(0, 1e-3^2)`, drawn as in
the reference notebook `2d_perturbation.ipynb`, whose seed 1 is the default)
is written in three parameterizations of the SAME function: SP `(w, b)`, WN
`(v = w, g = |w|, b)` and GmP `(theta, lam, r)` (`geoparam.convert`). Every
parameter is then perturbed by `eps * 1` in its own coordinates
(`geoparam.analysis.perturb`), for eps in {1e-4, 1e-3, 1e-2, 1e-1}, and the
characteristic boundary before and after is compared: the angle between the
normals and the distance between the locations `phi`.

Theorem 3: under GmP the angle changes by at most `|eps * 1|_2` (in R^2
exactly `eps` radians); under SP and WN it is eq. (12)-(14), unbounded when
`|w|` is small. Besides the drawn unit, `num_draws` units are drawn the same
way and the median and maximum changes over them are reported.

  python -m experiments.main --config=experiments/configs/perturbation_2d.py \
      --workdir=/tmp/perturbation

Writes to `workdir`: `results.json` (angle and location changes per method and
eps, for the drawn unit and over the draws; the claims checked), `results.csv`
(one row per method, eps and draw), `results.md` and `perturbation.png` (Fig. 1
b-e: the drawn unit's boundaries before and after, per eps).
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
from experiments.configs import validate
from geoparam import analysis, convert

METHODS = ('sp', 'wn', 'gmp')
# The study's own config fields (the others are validate.RULES').
CONFIG_RULES = {'eps': validate.positive_reals, 'num_draws': validate.AT_LEAST_ONE,
                'weight_scale': validate.POSITIVE_REAL}


# Why perturbation.png shows the same angle for SP and WN (paper 002, eqs. 12 and 14).
WN_NOTE = (r'SP and WN turn by the same angle: WN starts at $v = w$, so $v + \epsilon\mathbf{1}$ '
           r'has the direction of $w + \epsilon\mathbf{1}$ (eq. 14 = eq. 12); the shifts of $g$ '
           'and $b$ move only the distance from the origin')


def draw_units(seed: int, num: int, scale: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
  """`num` units `(w (num, 2), b (num,))`; unit 0 is `np.random.seed(seed); randn(2), randn(1)`."""
  rng = np.random.RandomState(seed)
  ws, bs = [], []
  for _ in range(num):
    ws.append(rng.randn(2) * scale)
    bs.append(rng.randn(1)[0] * scale)
  return np.stack(ws), np.asarray(bs)


def layers(w: np.ndarray, b: np.ndarray) -> dict[str, dict[str, Any]]:
  """The same units (`w (m, 2)`, `b (m,)`) as SP, WN and GmP layer dicts (`geoparam.analysis` form)."""
  kernel = jnp.asarray(w.T)  # (fan_in = 2, features = m)
  bias = jnp.asarray(b)
  return {
      'sp': {'kernel': kernel, 'bias': bias},
      'wn': {'kernel': kernel, 'scale': jnp.linalg.norm(kernel, axis=0), 'bias': bias},
      'gmp': convert.dense_to_gmp(kernel, bias),
  }


def perturbation_changes(w: np.ndarray, b: np.ndarray, eps_values) -> dict[str, Any]:
  """Boundary changes of units `(w (m, 2), b (m,))` under `eps * 1` for SP, WN and GmP.

  Returns a dict method -> eps -> {'angle_deg': (m,), 'location_change': (m,),
  'phi_before': (m, 2), 'phi_after': (m, 2), 'u_after': (m, 2)} (numpy float64).
  """
  out = {}
  with jax.enable_x64(True):
    for kind, params in layers(np.asarray(w, np.float64), np.asarray(b, np.float64)).items():
      before = analysis.snapshot(params, kind)
      out[kind] = {}
      for eps in eps_values:
        after = analysis.snapshot(analysis.perturb(params, float(eps), kind), kind)
        out[kind][float(eps)] = dict(
            angle_deg=np.asarray(analysis.angle_change(before.direction, after.direction, True)),
            location_change=np.asarray(analysis.location_change(before.location, after.location)),
            phi_before=np.asarray(before.location), phi_after=np.asarray(after.location),
            u_before=np.asarray(before.direction), u_after=np.asarray(after.direction))
  return out


def check_claims(changes, eps_values) -> dict[str, str]:
  """Theorem 3 and Sec. 3.5's statements against the measured changes (all draws)."""
  out = {}
  gmp = [changes['gmp'][e]['angle_deg'] for e in eps_values]
  bound_ok = all(np.all(a <= np.degrees(e) * (1 + 1e-9)) for a, e in zip(gmp, eps_values))
  out['GmP: angle change <= |eps * 1|_2 (Theorem 3; = eps rad in R^2)'] = report.claim(
      bound_ok, 'max over draws and eps: {:.3g} x the bound',
      max(float(np.max(a)) / np.degrees(e) for a, e in zip(gmp, eps_values)))
  e = 1e-3 if 1e-3 in eps_values else min(eps_values)
  for kind in ('sp', 'wn'):
    med = float(np.median(changes[kind][e]['angle_deg']))
    out[f'{kind}: eps = {e:g} already changes the direction drastically'] = report.claim(
        med > 10, 'median {:.1f} deg vs GmP {:.3f} deg', med, np.degrees(e))
  return out


def plot(changes, eps_values, workdir, unit: int = 0, title: str = ''):
  """perturbation.png: Fig. 1 b-e, one panel per eps, boundaries of unit `unit` before/after."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  colors = {'sp': 'tab:red', 'wn': 'tab:green', 'gmp': 'tab:blue'}
  fig, axes = plt.subplots(1, len(eps_values), figsize=(4.2 * len(eps_values), 4.9),
                           squeeze=False)
  for ax, eps in zip(axes[0], eps_values):
    phi0 = changes['sp'][eps]['phi_before'][unit]
    points = [phi0] + [changes[k][eps]['phi_after'][unit] for k in METHODS]
    lim = min(max(2.0, 1.3 * max(float(np.max(np.abs(p))) for p in points)), 50.0)

    def boundary(phi, u, color, lw, ls, label, line_style='-'):
      normal_perp = np.array([-u[1], u[0]])
      ax.axline(phi, phi + normal_perp, color=color, lw=lw, ls=line_style, label=label)
      ax.plot([0, phi[0]], [0, phi[1]], color=color, ls=ls, lw=1.5)
      ax.plot(*phi, 'o', color=color, ms=5)

    boundary(phi0, changes['sp'][eps]['u_before'][unit], 'saddlebrown', 4, ':', 'original')
    for k in METHODS:
      c = changes[k][eps]
      boundary(c['phi_after'][unit], c['u_after'][unit], colors[k], 1.6, '--',
               f'{plotting.method_label(k)}: {c["angle_deg"][unit]:.2f} deg', '--' if k == 'wn' else '-')
    ax.plot(0, 0, 'ko', ms=5)
    plotting.square(ax, lim)
    ax.set_title(rf'$\epsilon$ = {eps:g}', fontsize=11)
    ax.legend(fontsize=7.5, loc='lower left', title='after perturbation', title_fontsize=7.5)
    ax.set_xlabel('$x_1$')
  axes[0][0].set_ylabel('$x_2$')
  title = title or (f'unit {unit}: boundary before (brown) and after a perturbation by '
                    r'$\epsilon$ in SP, WN and GmP coordinates')
  plotting.save(fig, workdir, 'perturbation.png', fontsize=11, title=title + '\n' + WN_NOTE)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` (`experiments/configs/perturbation_2d.py`) and writes its files.

  Returns `{'summary': what results.json holds, 'changes': perturbation_changes(...)}`.
  """
  t_start = time.perf_counter()
  eps_values = [float(e) for e in config.eps]
  w, b = draw_units(config.seed, config.num_draws, config.weight_scale)
  changes = perturbation_changes(w, b, eps_values)
  unit = {k: {f'{e:g}': dict(angle_deg=float(changes[k][e]['angle_deg'][0]),
                             location_change=float(changes[k][e]['location_change'][0]),
                             phi_before=changes[k][e]['phi_before'][0].tolist(),
                             phi_after=changes[k][e]['phi_after'][0].tolist())
                  for e in eps_values} for k in METHODS}
  stats = {k: {f'{e:g}': dict(
      median_angle_deg=float(np.median(changes[k][e]['angle_deg'])),
      max_angle_deg=float(np.max(changes[k][e]['angle_deg'])),
      median_location_change=float(np.median(changes[k][e]['location_change'])))
      for e in eps_values} for k in METHODS}
  rows = [dict(method=k, eps=e, draw=i, angle_deg=changes[k][e]['angle_deg'][i],
               location_change=changes[k][e]['location_change'][i])
          for k in METHODS for e in eps_values for i in range(config.num_draws)]
  header = [f'{plotting.method_label(k)} angle (deg): unit / median / max' for k in METHODS]
  table = report.markdown_table(['eps', *header], [
      [f'{e:g}'] + [f'{unit[k][f"{e:g}"]["angle_deg"]:.3g} / '
                    f'{stats[k][f"{e:g}"]["median_angle_deg"]:.3g} / '
                    f'{stats[k][f"{e:g}"]["max_angle_deg"]:.3g}' for k in METHODS]
      for e in eps_values])
  print(f'[perturbation_2d] unit w = {w[0].tolist()}, b = {b[0]:.3g}; {config.num_draws} draws')
  figures = []
  if config.plots:
    os.makedirs(workdir, exist_ok=True)
    plot(changes, eps_values, workdir, title=(
        f'One unit (seed {config.seed}: w = ({w[0][0]:.2g}, {w[0][1]:.2g}), b = {b[0]:.2g}): '
        r'boundary before (brown) and after every parameter moves by $\epsilon$ in its own '
        'coordinates'))
    figures = ['perturbation.png']
  summary = report.write(
      workdir, 'perturbation_2d',
      summary={'unit': {'w': w[0].tolist(), 'b': float(b[0]), 'changes': unit},
               'over_draws': stats},
      rows=rows, table=table, claims=check_claims(changes, eps_values), config=config,
      started=t_start, figures=figures)
  return {'summary': summary, 'changes': changes}

