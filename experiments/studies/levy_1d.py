r"""1-D Levy regression (paper 002, Sec. 3.5, Fig. 2): SP, WN, BN and GmP compared.

The protocol and its command are in `experiments/configs/levy_1d.py`. Every seed
of a method trains in one jitted `experiments.lib.protocol.fit`, which records the
hidden units' characteristic points (`geoparam.analysis`) after every epoch.

With `lr_selection='cv'` (paper 002, Appendix C) each method's rate is also
chosen from `lr_grid` by `cv_folds`-fold cross-validation on the 50 training
points (`experiments.lib.lr_search`; score: the mean held-out RMSE over folds
and seeds), retrained on all 50 at that rate and tested; results.json's `cv`
and a second table report it beside the fixed-rate runs (which the figures show).

Writes to `workdir`: results.json/csv/md (test RMSE per method and seed, the
boundary changes, the paper's claims), `predictions.png` (every seed, before
and after training), `boundary_change.png` (Fig. 2c: log2 max_i |dphi_i| per
epoch, max over seeds) and `location_spectra.png` (Fig. 2 d-g, seed 0).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from experiments.lib import lr_search, models, plotting, protocol, report
from experiments.configs import common, validate
from geoparam import analysis

NUM_POINTS = 50
NOISE = 0.1
SPECTRUM_ROWS = 11  # bars in the location spectra (Fig. 2 d-g)
# The study's own config fields (the others are validate.RULES'): the learning-rate search's.
CONFIG_RULES = dict(lr_search.CONFIG_RULES)


def check_data(config) -> None:
  """Raises `validate.ConfigError` when `cv_folds` does not fit the 50 training points."""
  if config.get('lr_selection') == 'cv':
    lr_search.check_folds(config.cv_folds, NUM_POINTS, 'the Levy training set')


def levy(x):
  """The 1-D Levy function of the reference code, `w = 1 + (x - 1) / 4`."""
  w = 1.0 + (x - 1.0) / 4.0
  return np.sin(np.pi * w) ** 2 + (w - 1.0) ** 2 * (1.0 + np.sin(2.0 * np.pi * w) ** 2)


def make_data(seed: int, dtype) -> dict[str, np.ndarray]:
  """Training points uniform on [-10, 10] with N(0, 0.1^2) noise; test grid step 0.1."""
  rng = np.random.RandomState(seed)
  x_train = rng.uniform(-10.0, 10.0, size=(NUM_POINTS, 1))
  y_train = levy(x_train) + rng.normal(0.0, NOISE, size=(NUM_POINTS, 1))
  x_test = np.arange(-100, 101).reshape(-1, 1) / 10.0
  y_test = levy(x_test)
  return {k: v.astype(dtype) for k, v in
          dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test).items()}


def boundary_points(method: str, variables, x_train) -> jax.Array:
  """Characteristic points phi (shape `(hidden,)`) of the hidden units of the function trained on
  `x_train` (full batch: BN/MBN folded with its statistics, `models.hidden_layer`)."""
  layer = models.hidden_layer(variables, method, x_train)
  return analysis.boundary_location(layer, method)[:, 0]


def _setup(method: str, c: ml_collections.ConfigDict, lr: float, dtype):
  """The model, the protocol's settings and the MAE loss `(variables, (x, y), member)`."""
  model = models.MLP(hidden=(c.hidden,), out=1, method=method,
                     gmp_glorot_scale=c.gmp_glorot_scale, param_dtype=dtype)
  settings = protocol.Protocol(num_epochs=c.num_epochs, learning_rate=lr, monitor='loss',
                               mode='min', plateau_factor=c.plateau_factor,
                               plateau_patience=c.plateau_patience, stop_patience=c.stop_patience)

  def mae(variables, batch, member):
    pred, updates = models.apply_train(model, variables, batch[0])
    return jnp.mean(jnp.abs(pred - batch[1])), updates
  return model, settings, mae


def train(method: str, data, keys, c: ml_collections.ConfigDict, dtype,
          lr: float | None = None) -> dict[str, Any]:
  """Trains one method for every key in `keys` (vmapped) with `experiments.lib.protocol.fit`: MAE,
  the training loss monitored, the characteristic points recorded after every epoch; at `lr`
  (None: the config's rate of the method)."""
  x, y, x_test, y_test = (jnp.asarray(data[k]) for k in ('x_train', 'y_train', 'x_test', 'y_test'))
  lr = common.paper_lr(method, c.lr_gmp, c.lr_others) if lr is None else lr
  model, settings, mae = _setup(method, c, lr, dtype)

  def finalize(initial, final, key):
    pred = model.apply(final, x_test, train=False)
    return dict(init_pred=model.apply(initial, x_test, train=False)[:, 0], pred=pred[:, 0],
                rmse=jnp.sqrt(jnp.mean((pred - y_test) ** 2)),
                final_phi=boundary_points(method, final, x))

  t0 = time.perf_counter()
  out = protocol.fit(
      settings, init=lambda key: model.init(key, x, train=False), loss=mae,
      batches=protocol.full_batch(x, y), members=keys, finalize=finalize,
      hook=lambda variables, key: analysis.snapshot(models.hidden_layer(variables, method, x),
                                                    method).location)
  locations = out['track']  # (seeds, epochs + 1, hidden, 1)
  trace = dict(out['logs'], **models.boundary_changes(out['logs']['active'], locations))
  out = dict(out['final'], trace=trace, epochs_run=out['epochs_run'], final_lr=out['final_lr'],
             stopped=out['stopped'], locations=locations[..., 0])
  out = jax.tree.map(np.asarray, out)
  out['seconds'] = time.perf_counter() - t0
  if not np.all(np.isfinite(out['rmse'])):
    logging.warning('%s: non-finite test RMSE for seeds %s', method,
                    np.flatnonzero(~np.isfinite(out['rmse'])).tolist())
  return out


def cross_validate(method: str, data, keys, c: ml_collections.ConfigDict, dtype,
                   rates) -> dict[str, Any]:
  """`lr_search.search` of `method` over `rates`: `c.cv_folds` folds of the training points
  (seed `[c.seed, 1]`) x `rates` x `keys`, one `protocol.fit` call; a member trains on its
  fold's fit part as `train` does and is scored by the RMSE on the held-out fold. Reads only
  `x_train` and `y_train`."""
  everything = np.arange(data['x_train'].shape[0])
  held = lr_search.carve_folds(everything, c.cv_folds, seed=[c.seed, 1])
  fits = lr_search.fit_parts(everything, held)
  x, y = data['x_train'], data['y_train']
  model, settings, mae = _setup(method, c, float(rates[0]), dtype)

  def fit_grid(g):
    members = dict(key=keys[g['seed']], lr=jnp.asarray(g['lr'], dtype),
                   x=jnp.asarray(x[fits[g['fold']]]), y=jnp.asarray(y[fits[g['fold']]]),
                   x_val=jnp.asarray(x[held[g['fold']]]), y_val=jnp.asarray(y[held[g['fold']]]))
    out = protocol.fit(
        settings, init=lambda m: model.init(m['key'], m['x'], train=False), loss=mae,
        batches=lambda m, t: ((m['x'][None], m['y'][None]),), members=members,
        learning_rate=lambda m: m['lr'],
        finalize=lambda first, final, m: jnp.sqrt(jnp.mean(
            (model.apply(final, m['x_val'], train=False) - m['y_val']) ** 2)))
    return np.asarray(out['final'])

  return lr_search.search(fit_grid, rates, c.cv_folds, len(keys), 'min')


def check_claims(results) -> dict[str, str]:
  """The paper's Levy claims (Sec. 3.5) against all seeds; no verdict on a non-finite RMSE."""
  out = {}
  peaks = {m: float(np.nanmax(r['trace']['max_dphi'])) for m, r in results.items()}
  for m, peak in peaks.items():
    if models.is_gmp(m):
      out[f'{m}: max_i |dphi| < 1 at every step'] = report.claim(
          peak < 1, 'max over steps and seeds {:.3g}', peak, results[m]['rmse'])
    else:
      out[f'{m}: max_i |dphi| exceeds 1 by orders of magnitude at some step'] = report.claim(
          peak >= 8, 'max {:.3g} = 2^{:.1f}', peak, np.log2(peak), results[m]['rmse'])
  rmse = {m: float(np.mean(r['rmse'])) for m, r in results.items()}
  best = min(rmse, key=rmse.get)
  out['GmP has the lowest test RMSE'] = report.claim(
      models.is_gmp(best), f'lowest: {best} {rmse[best]:.4f}', *rmse.values())
  return out


def summarize(results: dict[str, dict[str, Any]]) -> str:
  """Markdown table of test RMSE (mean +- standard error over seeds) per method."""
  best = min(results, key=lambda m: np.mean(results[m]['rmse']))
  rows = []
  for m, r in results.items():
    dphi = r['trace']['max_dphi']
    peak = np.log2(np.nanmax(dphi)) if np.any(np.isfinite(dphi)) else float('nan')
    rows.append([m, report.bold(report.format_mean_se(r['rmse']), m == best),
                 report.format_values(r['rmse']), report.format_values(r['epochs_run'], 'd'),
                 f'{peak:.1f}'])
  return report.markdown_table(['method', 'test RMSE (mean +- s.e.)', 'per seed', 'epochs run',
                                'max log2 max|dphi|'], rows)


def prediction_ylim(data, preds, pad: float = 0.08) -> tuple[float, float]:
  """y range of predictions.png: the Levy function, the training points and the finite trained
  predictions `preds` (any shape), padded by `pad` of their span (initial lines may leave it)."""
  values = np.concatenate([np.ravel(data['y_test']), np.ravel(data['y_train']),
                           *(np.ravel(p) for p in preds)]).astype(np.float64)
  values = values[np.isfinite(values)]
  lo, hi = float(values.min()), float(values.max())
  margin = pad * max(hi - lo, 1e-12)
  return lo - margin, hi + margin


def plot(results, data, workdir) -> list[str]:
  """predictions.png (every seed, before and after; the y range of the data and the trained
  predictions, initial lines beyond it clipped and counted) and boundary_change.png (Fig. 2c)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  methods = list(results)
  n = len(results[methods[0]]['rmse'])
  x = data['x_test'][:, 0]
  lo, hi = prediction_ylim(data, [results[m]['pred'] for m in methods])
  fig, axes = plt.subplots(1, len(methods), figsize=(4 * len(methods), 3.6), squeeze=False,
                           sharey=True)
  for ax, m in zip(axes[0], methods):
    r = results[m]
    ax.plot(x, data['y_test'][:, 0], 'k-', lw=1, label='Levy function')
    ax.scatter(data['x_train'][:, 0], data['y_train'][:, 0], s=8, c='k', label='training points')
    for i in range(n):
      ax.plot(x, r['init_pred'][i], 'C1--', lw=0.7, alpha=0.7,
              label='initial (clipped at the y range)' if i == 0 else None)
      ax.plot(x, r['pred'][i], 'C0-', lw=0.9, alpha=0.8, label='trained' if i == 0 else None)
    init = np.asarray(r['init_pred'], np.float64)
    off = int(np.sum(np.any(~np.isfinite(init) | (init < lo) | (init > hi), axis=1)))
    if off:
      ax.text(0.5, 0.97, f'{off} of {n} initial lines\nleave the axis (clipped)',
              transform=ax.transAxes, ha='center', va='top', fontsize=7, color='C1')
    ax.set_title(f'{plotting.method_label(m)}: test RMSE {report.format_mean_se(r["rmse"], 3)}',
                 fontsize=10)
    ax.set_xlabel('x')
  axes[0][0].set_ylim(lo, hi)
  axes[0][0].set_ylabel('y')
  plotting.legend_below(fig, axes[0][0])
  figures = [plotting.save(
      fig, workdir, 'predictions.png', rect=(0, 0.07, 1, 1), fontsize=11,
      title=f'Levy regression: predictions of all {n} seeds (RMSE mean +- s.e. over seeds); '
      'y range: the data and the trained predictions')]

  fig, ax = plt.subplots(figsize=(8.6, 3.6))  # the plot as wide as with 4 legend entries
  worst = {m: report.max_over_members(results[m]['trace']['max_dphi']) for m in methods}
  # The y axis reaches the lowest curve (BN's changes shrink to ~2^-45 in the full run); below
  # 2^-60 (float64 resolution) and exact zeros are drawn on the bottom edge.
  bottom = plotting.log2_floor(np.concatenate([w.ravel() for w in worst.values()]))
  for m in methods:
    ax.plot(np.arange(1, worst[m].size + 1), np.log2(np.maximum(worst[m], 2.0 ** bottom)),
            lw=0.6, label=plotting.method_label(m))
  ax.axhline(0.0, color='k', lw=0.8, ls=':',
             label=r'$|\Delta\phi| = 1$ (paper: GmP stays below)')
  ax.set_xlabel('epoch (full-batch step)')
  ax.set_ylabel(r'$\log_2 \max_i |\Delta\phi_i|$')
  ax.set_ylim(bottom=bottom - 1)
  ax.set_title(f'Change of the characteristic points per step, max over units and {n} seeds',
               fontsize=10)
  ax.legend(fontsize=8, loc='center left', bbox_to_anchor=(1.01, 0.5))
  return figures + [plotting.save(fig, workdir, 'boundary_change.png')]


def spectrum_steps(epochs_run: int, rows: int = SPECTRUM_ROWS) -> list[int]:
  """Steps from 0 (initialization) to the last epoch run, geometrically spaced (early epochs
  move most)."""
  last = max(int(epochs_run), 1)
  return sorted({0, *(int(round(v)) for v in np.geomspace(1, last, rows - 1))})


def plot_spectra(results, data, workdir, rows: int = SPECTRUM_ROWS) -> list[str]:
  """location_spectra.png, Fig. 2 d-g, seed 0: predictions (top) and, per chosen step (bottom
  row, initialization at the bottom), a tick per hidden unit at its phi_i; units beyond the axis
  (|phi_i| > 12) are counted at its right edge, `+n`, as the title says."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  methods = list(results)
  lo, hi = -12.0, 12.0
  fig, axes = plt.subplots(2, len(methods), figsize=(3.6 * len(methods), 6.6), squeeze=False,
                           gridspec_kw=dict(height_ratios=[1, 1.3]), sharex=True)
  for j, m in enumerate(methods):
    r = results[m]
    ax = axes[0][j]
    ax.plot(data['x_test'][:, 0], data['y_test'][:, 0], 'k-', lw=1, label='Levy')
    ax.scatter(data['x_train'][:, 0], data['y_train'][:, 0], s=8, c='k', label='train')
    ax.plot(data['x_test'][:, 0], r['init_pred'][0], 'C1--', lw=1, label='init')
    ax.plot(data['x_test'][:, 0], r['pred'][0], 'C0-', lw=1.2, label='trained')
    ax.set_title(f'{plotting.method_label(m)}, seed 0: test RMSE {r["rmse"][0]:.3f}',
                 fontsize=10)
    ax.set_ylim(-0.6, float(np.max(data['y_train'])) + 0.6)
    ax = axes[1][j]
    steps = spectrum_steps(r['epochs_run'][0], rows)
    for k, t in enumerate(steps):
      phi = r['locations'][0, t]
      inside = phi[(phi >= lo) & (phi <= hi)]
      ax.vlines(inside, k - 0.38, k + 0.38, color=plt.cm.viridis(k / max(len(steps) - 1, 1)),
                lw=0.9)
      outside = phi.size - inside.size
      if outside:  # units whose phi_i lies beyond the axis: counted at the right edge
        ax.text(hi, k, f' +{outside}', va='center', ha='left', fontsize=7, color='0.25')
    ax.axvspan(-10, 10, color='0.93', zorder=-1)  # the data range
    ax.set_yticks(range(len(steps)))
    ax.set_yticklabels([str(t) for t in steps], fontsize=7)
    ax.set_ylim(-0.6, len(steps) - 0.4)
    ax.set_xlim(lo, hi)
    ax.set_xlabel(r'characteristic point $\phi_i$')
    if j == 0:
      ax.set_ylabel('step (epoch)')
  axes[0][0].set_ylabel('y')
  plotting.legend_below(fig, axes[0][0])
  return [plotting.save(
      fig, workdir, 'location_spectra.png', rect=(0, 0.04, 1, 1),
      title='Levy regression, seed 0 of each method: predictions (top) and the characteristic '
      'points of the hidden units at chosen steps\n(bottom; grey: the data range; +n at the '
      f'right: n units with $\\phi_i$ beyond $\\pm${hi:g}, off the axis)')]


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` and writes its files; float64 only inside (`jax.enable_x64`).

  Returns `{'summary': what results.json holds, 'results': method -> arrays}`.
  """
  validate.check_config(config, CONFIG_RULES)
  with jax.enable_x64(config.float64):
    return _run(config, workdir)


def _run(c, workdir):
  dtype = np.float64 if c.float64 else np.float32
  os.makedirs(workdir, exist_ok=True)
  data = make_data(c.seed, dtype)
  keys = jax.random.split(jax.random.key(c.seed), c.num_seeds)
  results = {}
  use_cv = c.get('lr_selection', 'fixed') == 'cv'
  rates = tuple(c.lr_grid) if use_cv else ()
  selections, at_cv = {}, {}
  t_start = time.perf_counter()
  for m in models.check_methods(validate.split_names(c.methods)):
    results[m] = r = train(m, data, keys, c, dtype)
    print(f'[levy_1d] {m}: test RMSE {np.mean(r["rmse"]):.4f} ({r["seconds"]:.1f} s incl. '
          'compile)', flush=True)
    if use_cv:
      t0 = time.perf_counter()
      selections[m] = s = cross_validate(m, data, keys, c, dtype, rates)['selections'][0]
      fixed_lr = common.paper_lr(m, c.lr_gmp, c.lr_others)
      # The same rate, keys and data as the fixed run: the same computation, so it is reused.
      at_cv[m] = (r if s.rate == fixed_lr else train(m, data, keys, c, dtype, lr=s.rate)
                  if s.index >= 0 else None)
      test = at_cv[m]['rmse'] if at_cv[m] is not None else np.full(len(keys), np.nan)
      print(f'[levy_1d] {m}: CV chose lr {s.rate:g} (val RMSE by lr: '
            f'{", ".join(f"{v:.4f}" for v in s.scores)}); test RMSE {np.mean(test):.4f} '
            f'({time.perf_counter() - t0:.1f} s incl. compile)', flush=True)
  dphi = lambda r: r['trace']['max_dphi']
  spectra = lambda r: spectrum_steps(r['epochs_run'][0])
  summary = report.collect(
      results, test_rmse=lambda r: report.mean_se(r['rmse'])[0],
      test_rmse_se=lambda r: report.mean_se(r['rmse'])[1], per_seed=lambda r: r['rmse'],
      epochs_run=lambda r: r['epochs_run'], max_abs_dphi=lambda r: np.nanmax(dphi(r)),
      max_abs_dphi_per_seed=lambda r: np.nanmax(dphi(r), axis=1),
      steps_with_dphi_ge_1=lambda r: np.nansum(dphi(r) >= 1.0, axis=1),
      spectra_seed0=lambda r: {'steps': spectra(r),
                               'phi': [r['locations'][0, t] for t in spectra(r)]})
  rows = report.member_rows(
      [({'method': m}, r) for m, r in results.items()], 'seed_index',
      test_rmse=lambda r: r['rmse'], epochs_run=lambda r: r['epochs_run'],
      max_abs_dphi=lambda r: np.nanmax(dphi(r), axis=1))
  table, claims = summarize(results), check_claims(results)
  if use_cv:
    test_fixed, test_cv = lr_search.metric_at_rates(
        selections, at_cv, results, lambda m: common.paper_lr(m, c.lr_gmp, c.lr_others),
        lambda r: r['rmse'], len(keys))
    summary['cv'], cv_table, cv_claims = lr_search.seed_report(
        selections, rates, folds=c.cv_folds, seeds=len(keys), metric='RMSE', key='test_rmse',
        mode='min', fixed=test_fixed, chosen=test_cv,
        score='validation RMSE, mean over folds and seeds; ties: the smaller rate; a rate with '
        'a non-finite fold is never chosen')
    rows = [dict(row, lr_selection='fixed', lr=test_fixed[row['method']][0]) for row in rows] + [
        dict(method=m, seed_index=i, test_rmse=v[i], epochs_run=at_cv[m]['epochs_run'][i]
             if at_cv[m] is not None else -1,
             max_abs_dphi=np.nanmax(dphi(at_cv[m])[i]) if at_cv[m] is not None else np.nan,
             lr_selection='cv', lr=rate)
        for m, (rate, v) in test_cv.items() for i in range(len(keys))]
    table += cv_table
    claims.update(cv_claims)
  figures = plot(results, data, workdir) + plot_spectra(results, data, workdir) if c.plots else []
  summary = report.write(workdir, 'levy_1d', summary=summary, rows=rows, table=table,
                         claims=claims, config=c, started=t_start, figures=figures)
  return {'summary': summary, 'results': results}

