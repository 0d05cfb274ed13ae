r"""1-D Levy regression (paper 002, Sec. 3.5, Fig. 2): SP, WN, BN and GmP compared.

Protocol (design.md and the paper's reference notebook): 50 noisy points
(sigma 0.1) of the Levy function on [-10, 10], test grid step 0.1; MLP with one
hidden layer of 100 ReLU units; Adam, full batch, MAE loss; LR x0.1 when the
training loss has not improved for 500 epochs (Keras ReduceLROnPlateau
semantics) and early stop after 1000 (restoring the best weights); lr 0.1 for
GmP, 0.01 for the others; float64. Several initialization seeds run together
under `jax.vmap` inside one jitted `lax.scan` over epochs.

  python -m experiments.levy_1d --workdir=/tmp/levy --epochs=10000 --methods=sp,wn,bn,gmp

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

import csv
import json
import os
import time
from typing import Any

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import models
from geoparam import analysis
from geoparam import schedules

FLAGS = flags.FLAGS


def define_flags():
  """Defines the CLI flags; called only when run as a script, so that importing several
  studies in one process (tests, notebooks) does not define a flag twice."""
  flags.DEFINE_string('workdir', None, 'Directory for results.json, results.csv and PNGs.')
  flags.DEFINE_list('methods', ['sp', 'wn', 'bn', 'gmp'], f'Methods, among {models.METHODS}.')
  flags.DEFINE_integer('epochs', 10000, 'Maximum number of full-batch epochs (paper: 10000).')
  flags.DEFINE_integer('seed', 0, 'Seed of the data draw and of the first initialization.')
  flags.DEFINE_integer('num_seeds', 5, 'Initialization seeds run together with vmap.')
  flags.DEFINE_bool('float64', True, 'Train in float64 as the paper does.')
  flags.DEFINE_float('lr_gmp', 0.1, 'Adam learning rate for GmP.')
  flags.DEFINE_float('lr_others', 0.01, 'Adam learning rate for SP, WN, BN.')
  flags.DEFINE_integer('plateau_patience', 500, 'Epochs without train-loss improvement before LR x0.1.')
  flags.DEFINE_integer('stop_patience', 1000, 'Epochs without train-loss improvement before stopping.')
  flags.DEFINE_bool('gmp_glorot_scale', True,
                    'Start GmP scales at the Glorot norm as the reference code that made Fig. 2 '
                    '(False: scale = 1 as the paper text says).')
  flags.DEFINE_integer('hidden', 100, 'Hidden units.')


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
    w, _ = analysis.affine(analysis.layer_variables(variables, 'wn', 'hidden_0'), 'wn')
    stats = {'mean': jnp.mean(x_train @ w, axis=0)}
  return analysis.layer_variables(variables, method, 'hidden_0', bn_epsilon=1e-3,
                                  batch_stats=stats)


def boundary_points(method: str, variables, x_train) -> jax.Array:
  """Characteristic points phi (shape `(hidden,)`) of the hidden units, inputs in R^1.

  `geoparam.analysis.boundary_location` of `hidden_layer`: `-b / w` for SP, WN
  with `w = g v / |v|`, BN/MBN folded with the batch statistics of `x_train`,
  GmP `-lam * sign`.
  """
  return analysis.boundary_location(hidden_layer(method, variables, x_train), method)[:, 0]


def train(method: str, data, keys, epochs: int, lr: float, plateau_patience: int,
          stop_patience: int, hidden: int, gmp_glorot_scale: bool, dtype) -> dict[str, Any]:
  """Trains one method for every key in `keys` (vmapped) in one jitted scan over epochs."""
  model = models.MLP(hidden=(hidden,), out=1, method=method, gmp_glorot_scale=gmp_glorot_scale,
                     param_dtype=dtype)
  x, y = jnp.asarray(data['x_train']), jnp.asarray(data['y_train'])
  x_test, y_test = jnp.asarray(data['x_test']), jnp.asarray(data['y_test'])
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
  plateau = schedules.reduce_on_plateau(factor=0.1, patience=plateau_patience, mode='min')
  stopper = schedules.early_stopping(patience=stop_patience, mode='min')

  def predict(variables, inputs):
    return model.apply(variables, inputs, train=False)

  def loss_fn(params, others):
    pred, updates = model.apply({'params': params, **others}, x, train=True,
                                mutable=list(others))
    return jnp.mean(jnp.abs(pred - y)), updates

  def run(key):
    variables = model.init(key, x, train=False)
    params = variables['params']
    others = {k: v for k, v in variables.items() if k != 'params'}
    init_pred = predict(variables, x_test)
    carry = dict(params=params, others=others, opt=opt.init(params), plateau=plateau.init(lr),
                 stop=stopper.init(), best=(params, others))

    def epoch(carry, _):
      (loss, others), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          carry['params'], carry['others'])
      # Flax keeps BN running statistics in float32; keep their dtype stable in the carry.
      others = jax.tree.map(lambda n, o: n.astype(o.dtype), others, carry['others'])
      updates, opt_state = opt.update(grads, carry['opt'], carry['params'])
      params = optax.apply_updates(carry['params'], updates)
      plateau_state = plateau.update(carry['plateau'], loss)
      stop_state = stopper.update(carry['stop'], loss)
      opt_state = schedules.set_learning_rate(opt_state, plateau_state.lr)
      new = dict(params=params, others=others, opt=opt_state, plateau=plateau_state,
                 stop=stop_state, best=schedules.keep_best(
                     stop_state.improved, carry['best'], (params, others)))
      active = ~carry['stop'].stop  # Keras: the epoch that triggers the stop still runs.
      out = dict(loss=loss, lr=carry['plateau'].lr, active=active)
      return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, carry), out

    # Boundary points of every hidden unit after every epoch, recorded inside the scan.
    layer = lambda c: hidden_layer(method, {'params': c['params'], **c['others']}, x)
    carry, trace, track = analysis.scan_tracked(epoch, carry, length=epochs, layer=layer,
                                                kind=method)
    trace['max_dphi'] = jnp.where(trace['active'],
                                  analysis.max_location_change(track.location), jnp.nan)
    # restore_best_weights: Keras restores the best weights when it stops early.
    final = jax.tree.map(lambda b, c: jnp.where(carry['stop'].stop, b, c),
                         carry['best'], (carry['params'], carry['others']))
    final_vars = {'params': final[0], **final[1]}
    pred = predict(final_vars, x_test)
    rmse = jnp.sqrt(jnp.mean((pred - y_test) ** 2))
    return dict(rmse=rmse, init_pred=init_pred[:, 0], pred=pred[:, 0], trace=trace,
                epochs_run=jnp.sum(trace['active']), final_lr=carry['plateau'].lr,
                stopped=carry['stop'].stop, final_phi=boundary_points(method, final_vars, x),
                locations=track.location[:, :, 0])

  t0 = time.perf_counter()
  out = jax.jit(jax.vmap(run))(keys)
  out = jax.tree.map(np.asarray, out)
  out['seconds'] = time.perf_counter() - t0
  if not np.all(np.isfinite(out['rmse'])):
    logging.warning('%s: non-finite test RMSE for seeds %s', method,
                    np.flatnonzero(~np.isfinite(out['rmse'])).tolist())
  return out


def learning_rate(method: str, lr_gmp: float, lr_others: float) -> float:
  return lr_gmp if method.startswith('gmp') else lr_others


def check_claims(results) -> dict[str, str]:
  """The paper's Levy claims (Sec. 3.5), stated against what was measured (all seeds)."""
  out = {}
  peaks = {m: float(np.nanmax(r['trace']['max_dphi'])) for m, r in results.items()}
  for m, peak in peaks.items():
    if m.startswith('gmp'):
      out[f'{m}: max_i |dphi| < 1 at every step'] = (
          f'{"holds" if peak < 1 else "FAILS"} (max over steps and seeds {peak:.3g})')
    else:
      out[f'{m}: max_i |dphi| exceeds 1 by orders of magnitude at some step'] = (
          f'{"holds" if peak >= 8 else "does not hold"} (max {peak:.3g} = 2^{np.log2(peak):.1f})')
  rmse = {m: float(np.mean(r['rmse'])) for m, r in results.items()}
  best = min(rmse, key=rmse.get)
  out['GmP has the lowest test RMSE'] = (
      f'{"holds" if best.startswith("gmp") else "does not hold"} (lowest: {best} '
      f'{rmse[best]:.4f})')
  return out


def summarize(results: dict[str, dict[str, Any]]) -> str:
  """Markdown table of test RMSE (mean +- standard error over seeds) per method."""
  lines = ['| method | test RMSE (mean +- s.e.) | per seed | epochs run | max log2 max|dphi| |',
           '| --- | --- | --- | --- | --- |']
  best = min(results, key=lambda m: np.mean(results[m]['rmse']))
  for m, r in results.items():
    rmse = r['rmse']
    se = np.std(rmse, ddof=1) / np.sqrt(len(rmse)) if len(rmse) > 1 else float('nan')
    cell = f'{np.mean(rmse):.4f} +- {se:.4f}'
    if m == best:
      cell = f'**{cell}**'
    dphi = r['trace']['max_dphi']
    peak = np.log2(np.nanmax(dphi)) if np.any(np.isfinite(dphi)) else float('nan')
    lines.append(f'| {m} | {cell} | {", ".join(f"{v:.3f}" for v in rmse)} | '
                 f'{", ".join(str(int(e)) for e in r["epochs_run"])} | {peak:.1f} |')
  return '\n'.join(lines)


def plot(results, data, workdir):
  """predictions.png (before/after, seed 0) and boundary_change.png (Fig. 2c)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  methods = list(results)
  fig, axes = plt.subplots(1, len(methods), figsize=(4 * len(methods), 3.4), squeeze=False)
  for ax, m in zip(axes[0], methods):
    r = results[m]
    ax.plot(data['x_test'][:, 0], data['y_test'][:, 0], 'k-', lw=1, label='Levy')
    ax.scatter(data['x_train'][:, 0], data['y_train'][:, 0], s=10, c='k', label='train')
    ax.plot(data['x_test'][:, 0], r['init_pred'][0], 'C1--', label='init')
    ax.plot(data['x_test'][:, 0], r['pred'][0], 'C0-', label='trained')
    ax.set_title(f'{m.upper()}: test RMSE {r["rmse"][0]:.3f}')
    ax.set_xlabel('x')
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'predictions.png'), dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 3.4))
  for m in methods:
    dphi = results[m]['trace']['max_dphi'][0]
    ax.plot(np.log2(np.maximum(dphi, 1e-300)), lw=0.6, label=m.upper())
  ax.axhline(0.0, color='k', lw=0.8, ls=':')
  ax.set_xlabel('epoch (full-batch step)')
  ax.set_ylabel(r'$\log_2 \max_i |\Delta\phi_i|$')
  ax.set_ylim(bottom=-30)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'boundary_change.png'), dpi=120)
  plt.close(fig)


def spectrum_steps(epochs_run: int, rows: int = SPECTRUM_ROWS) -> list[int]:
  """Steps from initialization (0) to the last epoch run, geometrically spaced, for the spectra.

  Geometric spacing shows the early epochs, where the points move most.
  """
  last = max(int(epochs_run), 1)
  return sorted({0, *(int(round(v)) for v in np.geomspace(1, last, rows - 1))})


def plot_spectra(results, data, workdir, rows: int = SPECTRUM_ROWS):
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
    ax.set_title(f'{m.upper()}: RMSE {r["rmse"][0]:.3f}', fontsize=10)
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
  axes[0][0].legend(fontsize=7, loc='upper center', ncol=2)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'location_spectra.png'), dpi=120)
  plt.close(fig)


def run_study(workdir: str, methods, epochs: int = 10000, seed: int = 0, num_seeds: int = 5,
              float64: bool = True, lr_gmp: float = 0.1, lr_others: float = 0.01,
              plateau_patience: int = 500, stop_patience: int = 1000, hidden: int = 100,
              gmp_glorot_scale: bool = True, make_plots: bool = True) -> dict[str, Any]:
  """Runs the study and writes its files; callable from notebooks and tests.

  float64 is enabled only inside this call (`jax.enable_x64`), not globally.
  """
  methods = models.check_methods(methods)
  if epochs < 1 or num_seeds < 1 or hidden < 1:
    raise ValueError(f'epochs, num_seeds and hidden must be >= 1, got {epochs}, {num_seeds}, '
                     f'{hidden}.')
  with jax.enable_x64(float64):
    return _run_study(workdir, methods, epochs, seed, num_seeds, float64, lr_gmp, lr_others,
                      plateau_patience, stop_patience, hidden, gmp_glorot_scale, make_plots)


def _run_study(workdir, methods, epochs, seed, num_seeds, float64, lr_gmp, lr_others,
               plateau_patience, stop_patience, hidden, gmp_glorot_scale, make_plots):
  dtype = np.float64 if float64 else np.float32
  os.makedirs(workdir, exist_ok=True)
  data = make_data(seed, dtype)
  keys = jax.random.split(jax.random.key(seed), num_seeds)
  results = {}
  t_start = time.perf_counter()
  for m in methods:
    lr = learning_rate(m, lr_gmp, lr_others)
    logging.info('training %s (lr %g, %d seeds, up to %d epochs)', m, lr, num_seeds, epochs)
    results[m] = train(m, data, keys, epochs, lr, plateau_patience, stop_patience, hidden,
                       gmp_glorot_scale, dtype)
    print(f'[levy_1d] {m}: test RMSE {np.mean(results[m]["rmse"]):.4f} '
          f'({results[m]["seconds"]:.1f} s incl. compile)', flush=True)
  table = summarize(results)
  summary = {
      'test_rmse': {m: float(np.mean(r['rmse'])) for m, r in results.items()},
      'test_rmse_se': {m: float(np.std(r['rmse'], ddof=1) / np.sqrt(num_seeds))
                       if num_seeds > 1 else None for m, r in results.items()},
      'per_seed': {m: r['rmse'].tolist() for m, r in results.items()},
      'epochs_run': {m: r['epochs_run'].tolist() for m, r in results.items()},
      'max_abs_dphi': {m: float(np.nanmax(r['trace']['max_dphi'])) for m, r in results.items()},
      'max_abs_dphi_per_seed': {m: np.nanmax(r['trace']['max_dphi'], axis=1).tolist()
                                for m, r in results.items()},
      'steps_with_dphi_ge_1': {m: np.nansum(r['trace']['max_dphi'] >= 1.0, axis=1).tolist()
                               for m, r in results.items()},
      'spectra_seed0': {m: {'steps': spectrum_steps(r['epochs_run'][0]),
                            'phi': [r['locations'][0, t].tolist()
                                    for t in spectrum_steps(r['epochs_run'][0])]}
                        for m, r in results.items()},
      'claims': check_claims(results),
      'config': dict(methods=list(methods), epochs=epochs, seed=seed, num_seeds=num_seeds,
                     float64=float64, lr_gmp=lr_gmp, lr_others=lr_others,
                     plateau_patience=plateau_patience, stop_patience=stop_patience,
                     hidden=hidden, gmp_glorot_scale=gmp_glorot_scale),
      'wall_seconds': time.perf_counter() - t_start,
  }
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  with open(os.path.join(workdir, 'results.csv'), 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['method', 'seed_index', 'test_rmse', 'epochs_run', 'max_abs_dphi'])
    for m, r in results.items():
      for i in range(num_seeds):
        writer.writerow([m, i, float(r['rmse'][i]), int(r['epochs_run'][i]),
                         float(np.nanmax(r['trace']['max_dphi'][i]))])
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(table + '\n')
  if make_plots:
    plot(results, data, workdir)
    plot_spectra(results, data, workdir)
  print(table)
  for claim, verdict in summary['claims'].items():
    print(f'[levy_1d] paper claim: {claim}: {verdict}')
  print(f'[levy_1d] wrote results.json, results.csv, results.md'
        f'{", predictions.png, boundary_change.png, location_spectra.png" if make_plots else ""} '
        f'to {workdir} '
        f'in {summary["wall_seconds"]:.1f} s')
  return {'summary': summary, 'results': results}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required (a directory for results and figures).')
  try:
    models.check_methods(FLAGS.methods)
  except ValueError as e:
    raise app.UsageError(f'--methods: {e}') from e
  run_study(FLAGS.workdir, FLAGS.methods, epochs=FLAGS.epochs, seed=FLAGS.seed,
            num_seeds=FLAGS.num_seeds, float64=FLAGS.float64, lr_gmp=FLAGS.lr_gmp,
            lr_others=FLAGS.lr_others, plateau_patience=FLAGS.plateau_patience,
            stop_patience=FLAGS.stop_patience, hidden=FLAGS.hidden,
            gmp_glorot_scale=FLAGS.gmp_glorot_scale)


if __name__ == '__main__':
  define_flags()
  app.run(main)
