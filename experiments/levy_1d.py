r"""1-D Levy regression (paper 002, Sec. 3.5, Fig. 2): SP, WN, BN and GmP compared.

Protocol (the paper and its reference notebook): 50 noisy points
(sigma 0.1) of the Levy function on [-10, 10], test grid step 0.1; MLP with one
hidden layer of 100 ReLU units; Adam, full batch, MAE loss; LR x0.1 when the
training loss has not improved for 500 epochs (Keras ReduceLROnPlateau
semantics) and early stop after 1000 (restoring the best weights); lr 0.1 for
GmP, 0.01 for the others; float64. Several initialization seeds run together
under `jax.vmap` inside one jitted `lax.scan` over epochs.

  python -m experiments.main --config=experiments/configs/levy_1d.py --workdir=/tmp/levy

(`python -m experiments.levy_1d --workdir=DIR [--config.x=...]` is the same command.) The
training is `experiments.protocol.fit` (the Keras protocol shared by the small studies).

Writes to `workdir`: `results.json` (method -> mean test RMSE, and details),
`results.csv` (one row per method and seed), `predictions.png` (before and
after training), `boundary_change.png` (log2 of max_i |phi_{i,t+1} - phi_{i,t}|
per epoch, Fig. 2c) and `location_spectra.png` (predictions above the spectra of
the 100 characteristic points at chosen steps, Fig. 2 d-g). The points are
`geoparam.analysis.boundary_location` of the hidden layer, recorded after every
epoch inside the training scan (`geoparam.analysis.scan_tracked`). results.json
also states the paper's claims against the measurements (`claims`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import models
from experiments import protocol
from experiments import report
from experiments.configs import common
from experiments.configs import validate
from geoparam import analysis


NUM_POINTS = 50
NOISE = 0.1
SPECTRUM_ROWS = 11  # bars in the location spectra (Fig. 2 d-g)


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


def hidden_layer(method: str, variables, x_train) -> dict[str, Any]:
  """The hidden layer in `geoparam.analysis` form, for the function trained on `x_train`.

  Training is full batch, so BN and MBN normalize with the statistics of
  `x_train` (training mode); those are folded, not the lagging running ones.
  """
  p = variables['params']
  stats = None
  if method == 'bn':
    stats = analysis.batch_statistics(x_train @ p['hidden_0']['kernel'])
  elif method == 'wn_mbn':
    w, _ = analysis.affine(models.layer_variables(variables, 'wn', 'hidden_0'), 'wn')
    stats = {'mean': jnp.mean(x_train @ w, axis=0)}
  return models.layer_variables(variables, method, 'hidden_0', bn_epsilon=1e-3,
                                  batch_stats=stats)


def boundary_points(method: str, variables, x_train) -> jax.Array:
  """Characteristic points phi (shape `(hidden,)`) of the hidden units, inputs in R^1.

  `geoparam.analysis.boundary_location` of `hidden_layer`: `-b / w` for SP, WN
  with `w = g v / |v|`, BN/MBN folded with the batch statistics of `x_train`,
  GmP `-lam * sign`.
  """
  return analysis.boundary_location(hidden_layer(method, variables, x_train), method)[:, 0]


def train(method: str, data, keys, epochs: int, lr: float, plateau_patience: int,
          stop_patience: int, hidden: int, gmp_glorot_scale: bool, dtype,
          plateau_factor: float = 0.1) -> dict[str, Any]:
  """Trains one method for every key in `keys` (vmapped) in one jitted scan over epochs.

  `experiments.protocol.fit` with the train loss monitored (full batch: the
  loss of the epoch's one step) and the hidden layer's characteristic points
  recorded after every epoch.
  """
  model = models.MLP(hidden=(hidden,), out=1, method=method, gmp_glorot_scale=gmp_glorot_scale,
                     param_dtype=dtype)
  x, y = jnp.asarray(data['x_train']), jnp.asarray(data['y_train'])
  x_test, y_test = jnp.asarray(data['x_test']), jnp.asarray(data['y_test'])
  settings = protocol.Protocol(num_epochs=epochs, learning_rate=lr, monitor='loss', mode='min',
                               plateau_factor=plateau_factor, plateau_patience=plateau_patience,
                               stop_patience=stop_patience)

  def mae(variables, batch, key):
    del key
    pred, updates = model.apply(variables, batch[0], train=True,
                                mutable=[k for k in variables if k != 'params'])
    return jnp.mean(jnp.abs(pred - batch[1])), updates

  def predict(variables):
    return model.apply(variables, x_test, train=False)

  def finalize(initial, final, key):
    del key
    pred = predict(final)
    return dict(init_pred=predict(initial)[:, 0], pred=pred[:, 0],
                rmse=jnp.sqrt(jnp.mean((pred - y_test) ** 2)),
                final_phi=boundary_points(method, final, x))

  t0 = time.perf_counter()
  out = protocol.fit(
      settings, init=lambda key: model.init(key, x, train=False), loss=mae,
      batches=protocol.full_batch(x, y), members=keys, finalize=finalize,
      hook=lambda variables, key: analysis.snapshot(hidden_layer(method, variables, x),
                                                    method).location)
  locations = out['track']  # (seeds, epochs + 1, hidden, 1)
  trace = dict(out['logs'])
  trace['max_dphi'] = jnp.where(trace['active'],
                                jax.vmap(analysis.max_location_change)(locations), jnp.nan)
  out = dict(out['final'], trace=trace, epochs_run=out['epochs_run'], final_lr=out['final_lr'],
             stopped=out['stopped'], locations=locations[..., 0])
  out = jax.tree.map(np.asarray, out)
  out['seconds'] = time.perf_counter() - t0
  if not np.all(np.isfinite(out['rmse'])):
    logging.warning('%s: non-finite test RMSE for seeds %s', method,
                    np.flatnonzero(~np.isfinite(out['rmse'])).tolist())
  return out


def check_claims(results) -> dict[str, str]:
  """The paper's Levy claims (Sec. 3.5), stated against what was measured (all seeds).

  A method whose test RMSE is not finite for some seed (a diverged run) gets no verdict.
  """
  out = {}
  peaks = {m: float(np.nanmax(r['trace']['max_dphi'])) for m, r in results.items()}
  for m, peak in peaks.items():
    if m.startswith('gmp'):
      out[f'{m}: max_i |dphi| < 1 at every step'] = report.claim(
          peak < 1, 'max over steps and seeds {:.3g}', peak, results[m]['rmse'])
    else:
      out[f'{m}: max_i |dphi| exceeds 1 by orders of magnitude at some step'] = report.claim(
          peak >= 8, 'max {:.3g} = 2^{:.1f}', peak, np.log2(peak), results[m]['rmse'])
  rmse = {m: float(np.mean(r['rmse'])) for m, r in results.items()}
  best = min(rmse, key=rmse.get)
  out['GmP has the lowest test RMSE'] = report.claim(
      best.startswith('gmp'), f'lowest: {best} {rmse[best]:.4f}', *rmse.values())
  return out


def summarize(results: dict[str, dict[str, Any]]) -> str:
  """Markdown table of test RMSE (mean +- standard error over seeds) per method."""
  best = min(results, key=lambda m: np.mean(results[m]['rmse']))
  rows = []
  for m, r in results.items():
    cell = report.format_mean_se(r['rmse'])
    dphi = r['trace']['max_dphi']
    peak = np.log2(np.nanmax(dphi)) if np.any(np.isfinite(dphi)) else float('nan')
    rows.append([m, f'**{cell}**' if m == best else cell, ', '.join(f'{v:.3f}' for v in r['rmse']),
                 ', '.join(str(int(e)) for e in r['epochs_run']), f'{peak:.1f}'])
  return report.markdown_table(['method', 'test RMSE (mean +- s.e.)', 'per seed', 'epochs run',
                                'max log2 max|dphi|'], rows)


def plot(results, data, workdir) -> list[str]:
  """predictions.png (every seed, before and after) and boundary_change.png (Fig. 2c)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  methods = list(results)
  n = len(results[methods[0]]['rmse'])
  x = data['x_test'][:, 0]
  fig, axes = plt.subplots(1, len(methods), figsize=(4 * len(methods), 3.6), squeeze=False,
                           sharey=True)
  for ax, m in zip(axes[0], methods):
    r = results[m]
    ax.plot(x, data['y_test'][:, 0], 'k-', lw=1, label='Levy function')
    ax.scatter(data['x_train'][:, 0], data['y_train'][:, 0], s=8, c='k', label='training points')
    for i in range(n):
      ax.plot(x, r['init_pred'][i], 'C1--', lw=0.7, alpha=0.7, label='initial' if i == 0 else None)
      ax.plot(x, r['pred'][i], 'C0-', lw=0.9, alpha=0.8, label='trained' if i == 0 else None)
    ax.set_title(f'{m.upper()}: test RMSE {report.format_mean_se(r["rmse"], 3)}', fontsize=10)
    ax.set_xlabel('x')
  axes[0][0].set_ylabel('y')
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='lower center', ncol=4, fontsize=8)
  fig.suptitle(f'Levy regression: predictions of all {n} seeds (RMSE mean +- s.e. over seeds)',
               fontsize=11)
  fig.tight_layout(rect=(0, 0.07, 1, 1))
  fig.savefig(os.path.join(workdir, 'predictions.png'), dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 3.6))
  for m in methods:
    dphi = results[m]['trace']['max_dphi']  # (seeds, epochs), NaN after a seed stopped
    worst = np.full(dphi.shape[1], np.nan)
    seen = np.any(np.isfinite(dphi), axis=0)
    worst[seen] = np.nanmax(dphi[:, seen], axis=0)
    ax.plot(np.arange(1, worst.size + 1), np.log2(np.maximum(worst, 1e-300)), lw=0.6,
            label=m.upper())
  ax.axhline(0.0, color='k', lw=0.8, ls=':')
  ax.set_xlabel('epoch (full-batch step)')
  ax.set_ylabel(r'$\log_2 \max_i |\Delta\phi_i|$')
  ax.set_ylim(bottom=-30)
  ax.set_title(f'Change of the characteristic points per step, max over units and {n} seeds',
               fontsize=10)
  ax.legend(fontsize=8, loc='center left', bbox_to_anchor=(1.01, 0.5))
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'boundary_change.png'), dpi=120)
  plt.close(fig)
  return ['predictions.png', 'boundary_change.png']


def spectrum_steps(epochs_run: int, rows: int = SPECTRUM_ROWS) -> list[int]:
  """Steps from initialization (0) to the last epoch run, geometrically spaced, for the spectra.

  Geometric spacing shows the early epochs, where the points move most.
  """
  last = max(int(epochs_run), 1)
  return sorted({0, *(int(round(v)) for v in np.geomspace(1, last, rows - 1))})


def plot_spectra(results, data, workdir, rows: int = SPECTRUM_ROWS) -> list[str]:
  """location_spectra.png, Fig. 2 d-g: predictions (top) and boundary-point spectra (bottom).

  Seed 0 of each method. Each horizontal bar of the bottom row holds one tick per
  hidden unit at its characteristic point phi_i, for a chosen step, from
  initialization (bottom) to the end of training (top); points outside the
  plotted range are counted at the right.
  """
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
    ax.set_title(f'{m.upper()}, seed 0: test RMSE {r["rmse"][0]:.3f}', fontsize=10)
    ax.set_ylim(-0.6, float(np.max(data['y_train'])) + 0.6)
    ax = axes[1][j]
    steps = spectrum_steps(r['epochs_run'][0], rows)
    for k, t in enumerate(steps):
      phi = r['locations'][0, t]
      inside = phi[(phi >= lo) & (phi <= hi)]
      ax.vlines(inside, k - 0.38, k + 0.38, color=plt.cm.viridis(k / max(len(steps) - 1, 1)),
                lw=0.9)
      outside = phi.size - inside.size
      if outside:
        ax.text(hi, k, f' +{outside}', va='center', ha='left', fontsize=7, color='C3')
    ax.axvspan(-10, 10, color='0.93', zorder=-1)  # the data range
    ax.set_yticks(range(len(steps)))
    ax.set_yticklabels([str(t) for t in steps], fontsize=7)
    ax.set_ylim(-0.6, len(steps) - 0.4)
    ax.set_xlim(lo, hi)
    ax.set_xlabel(r'characteristic point $\phi_i$')
    if j == 0:
      ax.set_ylabel('step (epoch)')
  axes[0][0].set_ylabel('y')
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='lower center', ncol=4, fontsize=8)
  fig.suptitle('Levy regression, seed 0 of each method: predictions (top) and the characteristic '
               'points of the hidden units at chosen steps (bottom; grey: the data range)',
               fontsize=10)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(os.path.join(workdir, 'location_spectra.png'), dpi=120)
  plt.close(fig)
  return ['location_spectra.png']


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` (`experiments/configs/levy_1d.py`) and writes its files.

  float64 is enabled only inside this call (`jax.enable_x64`), not globally.
  Returns `{'summary': what results.json holds, 'results': method -> arrays}`.
  """
  validate.check_config(config)
  with jax.enable_x64(config.float64):
    return _run(config, workdir)


def _run(config, workdir):
  dtype = np.float64 if config.float64 else np.float32
  methods = models.check_methods(validate.split_names(config.methods))
  num_seeds = config.num_seeds
  os.makedirs(workdir, exist_ok=True)
  data = make_data(config.seed, dtype)
  keys = jax.random.split(jax.random.key(config.seed), num_seeds)
  results = {}
  t_start = time.perf_counter()
  for m in methods:
    lr = common.paper_lr(m, config.lr_gmp, config.lr_others)
    logging.info('training %s (lr %g, %d seeds, up to %d epochs)', m, lr, num_seeds,
                 config.num_epochs)
    results[m] = train(m, data, keys, config.num_epochs, lr, config.plateau_patience,
                       config.stop_patience, config.hidden, config.gmp_glorot_scale, dtype,
                       plateau_factor=config.plateau_factor)
    print(f'[levy_1d] {m}: test RMSE {np.mean(results[m]["rmse"]):.4f} '
          f'({results[m]["seconds"]:.1f} s incl. compile)', flush=True)
  summary = {
      'test_rmse': {m: report.mean_se(r['rmse'])[0] for m, r in results.items()},
      'test_rmse_se': {m: report.mean_se(r['rmse'])[1] for m, r in results.items()},
      'per_seed': {m: r['rmse'] for m, r in results.items()},
      'epochs_run': {m: r['epochs_run'] for m, r in results.items()},
      'max_abs_dphi': {m: np.nanmax(r['trace']['max_dphi']) for m, r in results.items()},
      'max_abs_dphi_per_seed': {m: np.nanmax(r['trace']['max_dphi'], axis=1)
                                for m, r in results.items()},
      'steps_with_dphi_ge_1': {m: np.nansum(r['trace']['max_dphi'] >= 1.0, axis=1)
                               for m, r in results.items()},
      'spectra_seed0': {m: {'steps': spectrum_steps(r['epochs_run'][0]),
                            'phi': [r['locations'][0, t]
                                    for t in spectrum_steps(r['epochs_run'][0])]}
                        for m, r in results.items()},
  }
  rows = [dict(method=m, seed_index=i, test_rmse=r['rmse'][i], epochs_run=r['epochs_run'][i],
               max_abs_dphi=np.nanmax(r['trace']['max_dphi'][i]))
          for m, r in results.items() for i in range(num_seeds)]
  figures = []
  if config.plots:
    figures = plot(results, data, workdir) + plot_spectra(results, data, workdir)
  summary = report.write(workdir, 'levy_1d', summary=summary, rows=rows, table=summarize(results),
                         claims=check_claims(results), config=config, started=t_start,
                         figures=figures)
  return {'summary': summary, 'results': results}


CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs', 'levy_1d.py')


if __name__ == '__main__':
  from experiments import main as _main  # pylint: disable=g-import-not-at-top
  _main.cli(CONFIG_FILE)
