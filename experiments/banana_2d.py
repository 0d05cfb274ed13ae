r"""2-D Banana classification (paper 002, Sec. 3.5, Fig. 3): SP, WN, BN and GmP compared.

Protocol (the paper's reference notebook `2d_banana.ipynb`): 1000
points drawn without replacement from `banana.csv`, split 80/20, features
standardized with the training statistics; MLP with one hidden layer of 10
ReLU units and a sigmoid output, binary cross-entropy; Adam, batch 128
(reshuffled every epoch, the last batch of 32 kept as Keras does), up to 5000
epochs; LR x0.1 when the held-out accuracy has not improved for 50 epochs,
early stop after 100 (restoring the best weights); lr 0.1 for GmP, 0.01 for
the others; float64. As in the reference notebook the held-out 20% is both the
monitored validation set and the reported test set, so the accuracies are
best-epoch held-out accuracies (optimistic for every method alike).

The training is `experiments.protocol.fit` (the Keras protocol shared by the
small studies), several initialization seeds together under `jax.vmap`. The
boundary location `phi_i` and direction `u_i` of every hidden unit are recorded
after every optimizer step inside the jitted training scan (`geoparam.analysis`);
BN is folded with its running statistics (the evaluation-mode function). Figures
show seed 0.

  python -m experiments.main --config=experiments/configs/banana_2d.py --workdir=/tmp/banana
  python -m experiments.main --config=experiments/configs/banana_2d.py --workdir=/tmp/banana \
      --config.download=True   # no data folder: fetch banana.csv

(`python -m experiments.banana_2d --workdir=DIR [--config.x=...]` is the same command.)

Writes to `workdir`: `results.json` (test accuracy and max angle change per
method, the paper's claims checked), `results.csv` (per seed), `results.md`,
`trajectories.png` (Fig. 3 a-h: paths of the 10 boundary locations),
`angle_change.png` (Fig. 3 i: max_i |delta theta_i| per step, degrees) and
`decision_boundaries.png` (Fig. 3 j-m: predictions, test accuracy, final
locations as red stars).
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
import optax

from experiments import download as download_lib
from experiments import models
from experiments import protocol
from experiments import report
from experiments.configs import common
from experiments.configs import validate
from geoparam import analysis

BN_EPSILON = 1e-3  # experiments.models uses Keras' BatchNorm epsilon.


def load_banana(data_dir: str | None = None, download: bool = False,
                cache_dir: str | None = None, base_url: str | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """`(x (N, 2) float64, y (N,) in {0, 1})` from `banana.csv` (header At1,At2,Class; class +-1).

  The file is read from `data_dir` (else `$GEOPARAM_DATA_DIR`); with `download=True` a missing
  file is fetched once from its public source (or the mirror `base_url`) into the cache
  (`experiments.download`).
  """
  data_dir = data_dir or os.environ.get('GEOPARAM_DATA_DIR')
  if not data_dir and not download:
    raise ValueError('no data directory: pass --data_dir (or data_dir=) or set GEOPARAM_DATA_DIR '
                     'to the folder holding banana.csv, or allow the download (--download, '
                     'download=True).')
  path = download_lib.find('banana.csv', data_dir, download, cache_dir, base_url,
                           error=ValueError)
  table = np.loadtxt(path, delimiter=',', skiprows=1)
  if table.ndim != 2 or table.shape[1] != 3:
    raise ValueError(f'{path}: expected 3 columns At1,At2,Class, got shape {table.shape}.')
  labels = table[:, 2]
  if not np.all(np.isin(labels, (-1, 1))):
    raise ValueError(f'{path}: classes must be -1 or 1, got {np.unique(labels)}.')
  return table[:, :2], (labels > 0).astype(np.int64)


def make_data(x_all, y_all, seed: int, num_points: int = 1000, dtype=np.float64):
  """Draws `num_points`, splits 80/20 and standardizes with the training mean and std."""
  if not 10 <= num_points <= x_all.shape[0]:
    raise ValueError(f'num_points must be in [10, {x_all.shape[0]}], got {num_points}.')
  rng = np.random.RandomState(seed)
  idx = rng.choice(x_all.shape[0], size=num_points, replace=False)
  x, y = x_all[idx], y_all[idx]
  perm = rng.permutation(num_points)
  n_test = num_points // 5
  test, train = perm[:n_test], perm[n_test:]
  mean, std = x[train].mean(0), x[train].std(0)
  prep = lambda a: ((a - mean) / std).astype(dtype)
  return dict(x_train=prep(x[train]), y_train=y[train].astype(dtype)[:, None],
              x_test=prep(x[test]), y_test=y[test].astype(dtype)[:, None])


def hidden_layer(method: str, variables) -> dict[str, Any]:
  """The hidden layer in `geoparam.analysis` form (BN/MBN folded with running statistics)."""
  return models.layer_variables(variables, method, 'hidden_0', bn_epsilon=BN_EPSILON)


def train(method: str, data, keys, epochs: int, batch_size: int, lr: float,
          plateau_patience: int, stop_patience: int, hidden: int, gmp_glorot_scale: bool,
          dtype) -> dict[str, Any]:
  """Trains one method for every key in `keys` (vmapped) with `experiments.protocol.fit`.

  Each epoch is the reshuffled full batches plus one step on the remainder;
  plateau and early stopping watch the held-out accuracy; the boundary snapshot
  of the hidden layer is taken after every step.
  """
  model = models.MLP(hidden=(hidden,), out=1, method=method, gmp_glorot_scale=gmp_glorot_scale,
                     param_dtype=dtype)
  x, y = jnp.asarray(data['x_train']), jnp.asarray(data['y_train'])
  x_test, y_test = jnp.asarray(data['x_test']), jnp.asarray(data['y_test'])
  n = x.shape[0]
  full, rest = divmod(n, batch_size)
  if full < 1:
    raise ValueError(f'batch_size={batch_size} exceeds the {n} training points.')
  steps_per_epoch = full + (rest > 0)
  settings = protocol.Protocol(num_epochs=epochs, learning_rate=lr, monitor='val_acc', mode='max',
                               plateau_patience=plateau_patience, stop_patience=stop_patience)

  def accuracy(variables, inputs, labels):
    logits = model.apply(variables, inputs, train=False)
    return jnp.mean(((logits > 0).astype(labels.dtype) == labels).astype(jnp.float32))

  def bce(variables, batch, key):
    del key
    logits, updates = model.apply(variables, batch[0], train=True,
                                  mutable=[k for k in variables if k != 'params'])
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch[1])), updates

  def batches(key, t):
    perm = jax.random.permutation(jax.random.fold_in(jax.random.split(key)[1], t), n)
    xs, ys = x[perm], y[perm]
    cut = full * batch_size
    groups = ((xs[:cut].reshape(full, batch_size, -1), ys[:cut].reshape(full, batch_size, -1)),)
    return groups + (((xs[cut:][None], ys[cut:][None]),) if rest else ())

  def finalize(initial, final, key):
    del initial, key
    return dict(test_acc=accuracy(final, x_test, y_test), train_acc=accuracy(final, x, y),
                final_phi=analysis.boundary_location(hidden_layer(method, final), method))

  t0 = time.perf_counter()
  out = protocol.fit(
      settings, init=lambda key: model.init(jax.random.split(key)[0], x, train=False), loss=bce,
      batches=batches, members=keys, finalize=finalize,
      evaluate=lambda variables, key: {'val_acc': accuracy(variables, x_test, y_test)},
      hook=lambda variables, key: analysis.snapshot(hidden_layer(method, variables), method))
  # Per-step tracks (seeds, epochs * steps_per_epoch + 1, hidden, 2), index 0 = initialization.
  locations, directions = out['track'].location, out['track'].direction
  step_active = jnp.repeat(out['logs']['active'], steps_per_epoch, axis=1)
  changes = jax.jit(jax.vmap(lambda d, p: dict(
      max_dtheta_deg=analysis.max_angle_change(d, degrees=True),
      max_dphi=analysis.max_location_change(p))))(directions, locations)
  changes = {k: jnp.where(step_active, v, jnp.nan) for k, v in changes.items()}
  variables = out['variables']
  out = dict(out['final'], **changes, trace=out['logs'], epochs_run=out['epochs_run'],
             final_lr=out['final_lr'], locations=locations, final_params=variables['params'],
             final_others={k: v for k, v in variables.items() if k != 'params'})
  out = jax.tree.map(np.asarray, out)
  out.update(seconds=time.perf_counter() - t0, steps_per_epoch=steps_per_epoch, model=model)
  return out


def check_claims(results, at_large_rate=None, large_rate=None) -> dict[str, str]:
  """The paper's Banana claims (Sec. 3.5), stated against what was measured (all seeds).

  `results`: method -> run at its protocol rate; `at_large_rate`: method -> run
  at the 10x rate (Fig. 3 i compares the angle changes there). A claim about
  runs whose training loss was not finite at some epoch (diverged) gets no verdict.
  """
  out = {}
  runs = at_large_rate or results
  where = f' at lr {large_rate:g}' if at_large_rate else ' at the protocol rates'
  peaks = {m: float(np.nanmax(r['max_dtheta_deg'])) for m, r in runs.items()}
  for m, peak in peaks.items():
    if m.startswith('gmp'):
      out[f'{m}: max_i |dtheta| stays small{where}'] = f'max over steps and seeds {peak:.2f} deg'
    else:
      out[f'{m}: max_i |dtheta| jumps up to 180 deg at some step{where}'] = report.claim(
          peak > 90, 'max {:.1f} deg', peak, _losses(runs[m]))
  others = [p for m, p in peaks.items() if not m.startswith('gmp')]
  gmp_peaks = [p for m, p in peaks.items() if m.startswith('gmp')]
  if others and gmp_peaks:
    out[f'GmP max angle change below every other method{where}'] = report.claim(
        max(gmp_peaks) < min(others), 'GmP {:.2f} deg vs others min {:.2f} deg',
        max(gmp_peaks), min(others), *(_losses(r) for r in runs.values()))
  acc = {m: float(np.mean(r['test_acc'])) for m, r in results.items()}
  best = max(acc, key=acc.get)
  out['GmP has the highest test accuracy (protocol rates)'] = report.claim(
      best.startswith('gmp'), f'highest mean: {best} {acc[best]:.4f}; '
      + ', '.join(f'{m} {a:.4f}' for m, a in acc.items()), *(_losses(r) for r in results.values()))
  return out


def _losses(run):
  """The training losses of the epochs that ran (non-finite if the run diverged)."""
  return run['trace']['loss'][run['trace']['active']]


def summarize(runs, chosen) -> str:
  """Markdown table: test accuracy (mean +- s.e.) and max changes per method and rate.

  `runs`: lr -> method -> run; `chosen`: method -> the run at its protocol
  rate (its rows are marked *, the best accuracy among them in bold).
  """
  lines = ['| method | lr | test accuracy (mean +- s.e.) | per seed | epochs run | '
           'max_t max_i abs(dtheta) (deg) | max_t max_i abs(dphi) |',
           '| --- | --- | --- | --- | --- | --- | --- |']
  best = max(chosen, key=lambda m: np.mean(chosen[m]['test_acc']))
  for m in chosen:
    for lr in sorted(runs):
      if m not in runs[lr]:
        continue
      r = runs[lr][m]
      acc = r['test_acc']
      cell = report.format_mean_se(acc)
      if r is chosen[m] and m == best:
        cell = f'**{cell}**'
      star = '*' if r is chosen[m] else ''
      lines.append(f'| {m}{star} | {lr:g} | {cell} | {", ".join(f"{a:.3f}" for a in acc)} | '
                   f'{", ".join(str(int(e)) for e in r["epochs_run"])} | '
                   f'{np.nanmax(r["max_dtheta_deg"]):.2f} | {np.nanmax(r["max_dphi"]):.3g} |')
  lines.append('')
  lines.append('`*`: the protocol rate of the method (lr 0.1 GmP, 0.01 others by default).')
  return '\n'.join(lines)


def _predict_grid(r, grid):
  variables = {'params': jax.tree.map(lambda a: a[0], r['final_params']),
               **jax.tree.map(lambda a: a[0], r['final_others'])}
  logits = r['model'].apply(variables, jnp.asarray(grid), train=False)
  return np.asarray(jax.nn.sigmoid(logits))[:, 0]


def plot(runs, chosen, data, workdir) -> list[str]:
  """trajectories.png (Fig. 3 a-h, seed 0), angle_change.png (i, max over seeds),
  decision_boundaries.png (j-m, seed 0, accuracy of every seed in the titles).

  `runs`: lr -> method -> run (one row of trajectories per rate, the angle
  changes at every rate); `chosen`: method -> run at its protocol rate.
  """
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  methods = list(chosen)
  rates = sorted(runs)
  x_all = np.concatenate([data['x_train'], data['x_test']])
  y_all = np.concatenate([data['y_train'], data['y_test']])[:, 0]
  lim = float(np.max(np.abs(x_all))) + 0.5
  colors = plt.cm.tab10(np.arange(10) % 10)

  fig, axes = plt.subplots(len(rates), len(methods), figsize=(3.6 * len(methods),
                                                              3.9 * len(rates)), squeeze=False)
  for row, lr in enumerate(rates):
    for ax, m in zip(axes[row], methods):
      r = runs[lr].get(m)
      if r is None:
        ax.axis('off')
        continue
      steps = int(r['epochs_run'][0]) * r['steps_per_epoch'] + 1
      path = r['locations'][0, :steps]  # (steps, hidden, 2)
      for c, label in ((0, 'tab:blue'), (1, 'tab:orange')):
        pts = x_all[y_all == c]
        ax.scatter(pts[:, 0], pts[:, 1], s=4, c=label, alpha=0.2, lw=0)
      outside = 0
      for i in range(path.shape[1]):
        c = colors[i % 10]
        ax.plot(path[:, i, 0], path[:, i, 1], '-', color=c, lw=0.8, alpha=0.9)
        ax.plot(path[0, i, 0], path[0, i, 1], 'o', color=c, ms=4)
        ax.plot(path[-1, i, 0], path[-1, i, 1], '*', color=c, ms=11, mec='k', mew=0.5)
        outside += int(np.any(np.abs(path[:, i]) > lim))
      ax.set_xlim(-lim, lim)
      ax.set_ylim(-lim, lim)
      ax.set_aspect('equal')
      note = f', {outside} leave the frame' if outside else ''
      ax.set_title(f'{m.upper()}, lr {lr:g}: {steps - 1} steps{note}', fontsize=9)
      ax.set_xlabel('$x_1$', fontsize=8)
      ax.set_ylabel('$x_2$', fontsize=8)
      ax.tick_params(labelsize=7)
  fig.suptitle(r'Trajectories of the boundary locations $\phi_i$ during training '
               '(o start, * end; seed 0)', fontsize=10)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'trajectories.png'), dpi=110)
  plt.close(fig)

  n = len(chosen[methods[0]]['test_acc'])
  fig, axes = plt.subplots(1, len(rates), figsize=(5.6 * len(rates), 4.0), squeeze=False,
                           sharey=True)
  for ax, lr in zip(axes[0], rates[::-1]):
    for k, m in enumerate(methods):
      if m not in runs[lr]:
        continue
      d = runs[lr][m]['max_dtheta_deg']  # (seeds, steps), NaN after a seed stopped
      seen = np.any(np.isfinite(d), axis=0)
      worst = np.nanmax(d[:, seen], axis=0)
      ax.plot(np.arange(1, worst.size + 1), np.maximum(worst, 1e-6), lw=0.6, color=f'C{k}',
              label=f'{m.upper()} (max {worst.max():.1f})')
    ax.axhline(180, color='k', lw=0.8, ls=':')
    ax.set_yscale('log')
    ax.set_ylim(1e-4, 400)
    ax.set_xlabel('optimizer step')
    ax.set_title(f'lr {lr:g} for every method', fontsize=10)
    ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.16), ncol=len(methods))
  axes[0][0].set_ylabel(r'$\max_i |\Delta\theta_i|$ (degrees)')
  fig.suptitle(f'Largest angle change per step, max over units and {n} seeds', fontsize=10)
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'angle_change.png'), dpi=120)
  plt.close(fig)

  g = np.linspace(-lim, lim, 200)
  gx, gy = np.meshgrid(g, g)
  grid = np.stack([gx.ravel(), gy.ravel()], 1).astype(data['x_train'].dtype)
  fig, axes = plt.subplots(1, len(methods), figsize=(3.9 * len(methods), 4.7), squeeze=False)
  for ax, m in zip(axes[0], methods):
    r = chosen[m]
    prob = _predict_grid(r, grid).reshape(gx.shape)
    ax.contourf(gx, gy, prob, levels=np.linspace(0, 1, 11), cmap='RdBu_r', alpha=0.35)
    ax.contour(gx, gy, prob, levels=[0.5], colors='k', linewidths=2.5)
    xt, yt = data['x_test'], data['y_test'][:, 0]
    ax.scatter(xt[yt == 0, 0], xt[yt == 0, 1], s=9, c='tab:blue', edgecolors='none')
    ax.scatter(xt[yt == 1, 0], xt[yt == 1, 1], s=9, c='tab:red', edgecolors='none')
    phi = r['final_phi'][0]
    ax.plot(phi[:, 0], phi[:, 1], '*', color='red', ms=13, mec='k', mew=0.7)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect('equal')
    ax.set_title(f'{m.upper()} (lr {r["lr"]:g}), seed 0: test accuracy {r["test_acc"][0]:.3f}\n'
                 f'all {n} seeds: {report.format_mean_se(r["test_acc"], 3)}', fontsize=9)
    ax.set_xlabel('$x_1$')
  axes[0][0].set_ylabel('$x_2$')
  fig.suptitle('Decision boundary (black, p = 0.5) and final boundary locations (stars) of '
               'seed 0 over the test points', fontsize=10)
  fig.tight_layout(rect=(0, 0, 1, 0.95))
  fig.savefig(os.path.join(workdir, 'decision_boundaries.png'), dpi=120)
  plt.close(fig)
  return ['trajectories.png', 'angle_change.png', 'decision_boundaries.png']


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` (`experiments/configs/banana_2d.py`) and writes its files.

  Every method trains at its protocol rate (`lr_gmp` for GmP, `lr_others`
  otherwise: accuracy, Fig. 3 j-m); with `compare_rates` also at the other one,
  so that trajectories (a-h) and angle changes (i) compare all methods at both.
  float64 is enabled only inside this call (`jax.enable_x64`), not globally.
  Returns `{'summary': results.json, 'runs': lr -> method -> run, 'results':
  method -> run at its protocol rate, 'data': the split}`.
  """
  validate.check_config(config)
  validate.check_data(config)
  methods = models.check_methods(validate.split_names(config.methods))
  x_all, y_all = load_banana(config.data_dir, config.download)
  with jax.enable_x64(config.float64):
    return _run(config, workdir, methods, x_all, y_all)


def _run(c, workdir, methods, x_all, y_all):
  dtype = np.float64 if c.float64 else np.float32
  os.makedirs(workdir, exist_ok=True)
  data = make_data(x_all, y_all, c.seed, c.num_points, dtype)
  keys = jax.random.split(jax.random.key(c.seed), c.num_seeds)
  rates = sorted({c.lr_gmp, c.lr_others}) if c.compare_rates else []
  runs: dict[float, dict[str, Any]] = {}
  t_start = time.perf_counter()
  for m in methods:
    for lr in rates or [common.paper_lr(m, c.lr_gmp, c.lr_others)]:
      logging.info('training %s (lr %g, %d seeds, up to %d epochs)', m, lr, c.num_seeds,
                   c.num_epochs)
      r = train(m, data, keys, c.num_epochs, c.batch_size, lr, c.plateau_patience,
                c.stop_patience, c.hidden, c.gmp_glorot_scale, dtype)
      r['lr'] = lr
      runs.setdefault(lr, {})[m] = r
      print(f'[banana_2d] {m} lr {lr:g}: test accuracy {np.mean(r["test_acc"]):.4f}, max angle '
            f'change {np.nanmax(r["max_dtheta_deg"]):.2f} deg ({r["seconds"]:.1f} s incl. '
            'compile)', flush=True)
  chosen = {m: runs[common.paper_lr(m, c.lr_gmp, c.lr_others)][m] for m in methods}
  large = runs.get(max(c.lr_gmp, c.lr_others)) if c.compare_rates else None
  per_rate = lambda fn: {f'{lr:g}': {m: fn(r) for m, r in by_m.items()}
                         for lr, by_m in runs.items()}
  n = c.num_seeds
  summary = {
      'test_accuracy': {m: float(np.mean(r['test_acc'])) for m, r in chosen.items()},
      'test_accuracy_se': {m: report.mean_se(r['test_acc'])[1] for m, r in chosen.items()},
      'per_seed': {m: r['test_acc'].tolist() for m, r in chosen.items()},
      'train_accuracy': {m: float(np.mean(r['train_acc'])) for m, r in chosen.items()},
      'epochs_run': {m: r['epochs_run'].tolist() for m, r in chosen.items()},
      'max_angle_change_deg': {m: float(np.nanmax(r['max_dtheta_deg'])) for m, r in chosen.items()},
      'max_location_change': {m: float(np.nanmax(r['max_dphi'])) for m, r in chosen.items()},
      'final_locations_seed0': {m: r['final_phi'][0].tolist() for m, r in chosen.items()},
      'by_learning_rate': {
          'test_accuracy': per_rate(lambda r: float(np.mean(r['test_acc']))),
          'max_angle_change_deg': per_rate(lambda r: float(np.nanmax(r['max_dtheta_deg']))),
          'max_angle_change_deg_per_seed': per_rate(
              lambda r: np.nanmax(r['max_dtheta_deg'], axis=1).tolist()),
          'steps_with_angle_change_over_90_deg': per_rate(
              lambda r: int(np.nansum(r['max_dtheta_deg'] > 90))),
          'median_angle_change_deg': per_rate(lambda r: float(np.nanmedian(r['max_dtheta_deg']))),
          'max_location_change': per_rate(lambda r: float(np.nanmax(r['max_dphi']))),
          'epochs_run': per_rate(lambda r: r['epochs_run'].tolist()),
      },
  }
  rows = [dict(method=m, lr=lr, protocol_rate=r is chosen[m], seed_index=i,
               test_accuracy=r['test_acc'][i], train_accuracy=r['train_acc'][i],
               epochs_run=r['epochs_run'][i], max_angle_change_deg=np.nanmax(r['max_dtheta_deg'][i]),
               max_location_change=np.nanmax(r['max_dphi'][i]))
          for lr, by_m in sorted(runs.items()) for m, r in by_m.items() for i in range(n)]
  figures = plot(runs, chosen, data, workdir) if c.plots else []
  config = dict(c.to_dict(), methods=list(methods),
                validation='held-out 20% (also the test set, as in the reference code)')
  summary = report.write(workdir, 'banana_2d', summary=summary, rows=rows,
                         table=summarize(runs, chosen),
                         claims=check_claims(chosen, large, max(c.lr_gmp, c.lr_others)),
                         config=config, started=t_start, figures=figures)
  return {'summary': summary, 'runs': runs, 'results': chosen, 'data': data}


CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs', 'banana_2d.py')


if __name__ == '__main__':
  from experiments import main as _main  # pylint: disable=g-import-not-at-top
  _main.cli(CONFIG_FILE)
