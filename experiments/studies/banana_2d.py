r"""2-D Banana classification (paper 002, Sec. 3.5, Fig. 3): SP, WN, BN and GmP compared.

The protocol and its command are in `experiments/configs/banana_2d.py` (as in the
reference notebook, the held-out 20% is both the monitored validation set and
the reported test set). Every seed of a method trains in one jitted
`experiments.lib.protocol.fit`, which records the hidden units' boundary locations
`phi_i` and directions `u_i` (`geoparam.analysis`, BN folded with its running
statistics) after every optimizer step.

With `lr_selection='cv'` (paper 002, Appendix C) each method's rate is also
chosen from `lr_grid` by `cv_folds`-fold cross-validation on the training
points only (`experiments.lib.lr_search`; a fold is standardized with its fit
part's statistics, monitored and scored by its held-out accuracy, the mean over
folds and seeds decides), retrained at that rate and tested; results.json's
`cv` and a second table report it beside the protocol-rate runs.

Writes to `workdir`: results.json/csv/md (test accuracy and max angle change
per method and rate, the paper's claims), `trajectories.png` (Fig. 3 a-h,
seed 0), `angle_change.png` (Fig. 3 i, max over seeds) and
`decision_boundaries.png` (Fig. 3 j-m, seed 0; all seeds' accuracy).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments.data import banana_data, uci_data
from experiments.data import download as download_lib
from experiments.lib import lr_search, models, plotting, protocol, report
from experiments.configs import common, validate
from geoparam import analysis


def load_banana(data_dir: str | None = None, download: bool = False,
                cache_dir: str | None = None, base_url: str | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """`(x (N, 2) float64, y (N,) in {0, 1})` from `banana.csv` (header At1,At2,Class; class +-1)
  in `data_dir` (else `$GEOPARAM_DATA_DIR`); `download`: fetch it if missing. A file that cannot
  be parsed is a one-line ValueError naming the file and the line (`banana_data.parse`)."""
  return banana_data.load(data_dir, download, cache_dir, base_url)


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


def train(method: str, data, keys, c: ml_collections.ConfigDict, rates, dtype
          ) -> dict[float, dict[str, Any]]:
  """Trains one method at every rate of `rates` for every key in `keys`, all in ONE
  `experiments.lib.protocol.fit` call (members: rates x keys, `fit(learning_rate=...)`): an
  epoch is the reshuffled full batches plus one step on the remainder, plateau and early
  stopping watch the held-out accuracy, the hidden layer's boundaries are recorded every step.
  A member's data order and initialization depend on its key only, so a rate's members are
  the run of that rate alone. Returns `{rate: arrays with a leading seed axis}`."""
  rates = [float(r) for r in rates]
  x, y, x_test, y_test = (jnp.asarray(data[k]) for k in ('x_train', 'y_train', 'x_test', 'y_test'))
  n = x.shape[0]
  full, rest = divmod(n, c.batch_size)
  model, settings, accuracy, bce = _setup(method, c, rates[0], dtype, n)
  members = {'key': jnp.concatenate([keys] * len(rates)),
             'lr': jnp.repeat(jnp.asarray(rates, dtype), len(keys))}

  def batches(member, t):
    return _epoch(member['key'], t, x, y, c.batch_size)

  def finalize(initial, final, member):
    return dict(test_acc=accuracy(final, x_test, y_test), train_acc=accuracy(final, x, y),
                final_phi=analysis.boundary_location(models.hidden_layer(final, method), method))

  t0 = time.perf_counter()
  out = protocol.fit(
      settings, init=lambda m: model.init(jax.random.split(m['key'])[0], x, train=False),
      loss=lambda variables, batch, m: bce(variables, batch, m['key']),
      batches=batches, members=members, finalize=finalize, learning_rate=lambda m: m['lr'],
      evaluate=lambda variables, m: {'val_acc': accuracy(variables, x_test, y_test)},
      hook=lambda variables, m: analysis.snapshot(models.hidden_layer(variables, method), method))
  # Per-step tracks (members, epochs * steps_per_epoch + 1, hidden, 2), index 0 = initialization.
  track, variables = out['track'], out['variables']
  changes = models.boundary_changes(out['logs']['active'], track.location, track.direction,
                                    steps_per_epoch=full + (rest > 0))
  out = dict(out['final'], **changes, trace=out['logs'], epochs_run=out['epochs_run'],
             final_lr=out['final_lr'], locations=track.location, final_params=variables['params'],
             final_others={k: v for k, v in variables.items() if k != 'params'})
  out = jax.tree.map(np.asarray, out)
  seconds = time.perf_counter() - t0
  s = len(keys)
  return {lr: dict(jax.tree.map(lambda a, i=i: a[i * s:(i + 1) * s], out), seconds=seconds,
                   steps_per_epoch=full + (rest > 0), model=model, lr=lr)
          for i, lr in enumerate(rates)}


def _setup(method: str, c: ml_collections.ConfigDict, lr: float, dtype, n: int):
  """The model, the protocol's settings, `accuracy(variables, x, y)` and the loss
  `bce(variables, (x, y), member)` of `n` training points."""
  if n // c.batch_size < 1:
    raise ValueError(f'batch_size={c.batch_size} exceeds the {n} training points.')
  model = models.MLP(hidden=(c.hidden,), out=1, method=method,
                     gmp_glorot_scale=c.gmp_glorot_scale, param_dtype=dtype)
  settings = protocol.Protocol(num_epochs=c.num_epochs, learning_rate=lr, monitor='val_acc',
                               mode='max', plateau_patience=c.plateau_patience,
                               stop_patience=c.stop_patience)

  def accuracy(variables, inputs, labels):
    logits = model.apply(variables, inputs, train=False)
    return jnp.mean(((logits > 0).astype(labels.dtype) == labels).astype(jnp.float32))

  def bce(variables, batch, key):
    logits, updates = models.apply_train(model, variables, batch[0])
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch[1])), updates
  return model, settings, accuracy, bce


def _epoch(key, t, x, y, batch_size: int):
  """Epoch `t`'s batches of `(x, y)`: reshuffled (by `key`) full batches, then the remainder."""
  return protocol.shuffled_batches(jax.random.split(key)[1], t, (x, y), batch_size)


def cross_validate(method: str, data, keys, c: ml_collections.ConfigDict, dtype,
                   rates) -> dict[str, Any]:
  """`lr_search.search` of `method` over `rates`: `c.cv_folds` folds of the training points
  (seed `[c.seed, 1]`) x `rates` x `keys`, one `protocol.fit` call; a member trains on its
  fold's fit part (standardized with that part's statistics) as `train` does, its held-out
  fold taking the test split's place (monitored and scored: accuracy, higher is better).
  Reads only `x_train` and `y_train`."""
  everything = np.arange(data['x_train'].shape[0])
  held = lr_search.carve_folds(everything, c.cv_folds, seed=[c.seed, 1])
  fits = lr_search.fit_parts(everything, held)
  parts = [uci_data.standardize(data['x_train'][f], data['x_train'][h])
           for f, h in zip(fits, held)]
  x_fit, x_val = (np.stack([p[i] for p in parts]).astype(dtype) for i in (0, 1))
  y_fit, y_val = data['y_train'][fits], data['y_train'][held]
  model, settings, accuracy, bce = _setup(method, c, float(rates[0]), dtype, fits.shape[1])

  def fit_grid(g):
    k = g['fold']
    members = dict(key=keys[g['seed']], lr=jnp.asarray(g['lr'], dtype),
                   x=jnp.asarray(x_fit[k]), y=jnp.asarray(y_fit[k]),
                   x_val=jnp.asarray(x_val[k]), y_val=jnp.asarray(y_val[k]))
    out = protocol.fit(
        settings, init=lambda m: model.init(jax.random.split(m['key'])[0], m['x'], train=False),
        loss=bce, batches=lambda m, t: _epoch(m['key'], t, m['x'], m['y'], c.batch_size),
        members=members, learning_rate=lambda m: m['lr'],
        evaluate=lambda v, m: {'val_acc': accuracy(v, m['x_val'], m['y_val'])},
        finalize=lambda first, final, m: accuracy(final, m['x_val'], m['y_val']))
    return np.asarray(out['final'])

  return lr_search.search(fit_grid, rates, c.cv_folds, len(keys), 'max')


def check_claims(results, at_large_rate=None, large_rate=None) -> dict[str, str]:
  """The paper's Banana claims (Sec. 3.5) against all seeds of `results` (method -> run at its
  protocol rate) and `at_large_rate` (method -> run at the 10x rate, Fig. 3 i); no verdict on
  runs whose training loss was not finite in an epoch that ran (diverged)."""
  out = {}
  runs = at_large_rate or results
  where = f' at lr {large_rate:g}' if at_large_rate else ' at the protocol rates'
  peaks = {m: float(np.nanmax(r['max_dtheta_deg'])) for m, r in runs.items()}
  for m, peak in peaks.items():
    if models.is_gmp(m):
      out[f'{m}: max_i |dtheta| stays small{where}'] = f'max over steps and seeds {peak:.2f} deg'
    else:
      out[f'{m}: max_i |dtheta| jumps up to 180 deg at some step{where}'] = report.claim(
          peak > 90, 'max {:.1f} deg', peak, _losses(runs[m]))
  others = [p for m, p in peaks.items() if not models.is_gmp(m)]
  gmp_peaks = [p for m, p in peaks.items() if models.is_gmp(m)]
  if others and gmp_peaks:
    out[f'GmP max angle change below every other method{where}'] = report.claim(
        max(gmp_peaks) < min(others), 'GmP {:.2f} deg vs others min {:.2f} deg',
        max(gmp_peaks), min(others), *(_losses(r) for r in runs.values()))
  acc = {m: float(np.mean(r['test_acc'])) for m, r in results.items()}
  best = max(acc, key=acc.get)
  out['GmP has the highest test accuracy (protocol rates)'] = report.claim(
      models.is_gmp(best), f'highest mean: {best} {acc[best]:.4f}; '
      + ', '.join(f'{m} {a:.4f}' for m, a in acc.items()), *(_losses(r) for r in results.values()))
  return out


def _losses(run):
  """The training losses of the epochs that ran (non-finite if the run diverged)."""
  return run['trace']['loss'][run['trace']['active']]


def summarize(runs, chosen) -> str:
  """Markdown table of test accuracy (mean +- s.e.) and max changes per method and rate (`runs`:
  lr -> method -> run); `chosen` (method -> run at its protocol rate) marked *, the best bold."""
  best = max(chosen, key=lambda m: np.mean(chosen[m]['test_acc']))
  rows = [[m + ('*' if r is chosen[m] else ''), f'{lr:g}',
           report.bold(report.format_mean_se(r['test_acc']), r is chosen[m] and m == best),
           report.format_values(r['test_acc']), report.format_values(r['epochs_run'], 'd'),
           f'{np.nanmax(r["max_dtheta_deg"]):.2f}', f'{np.nanmax(r["max_dphi"]):.3g}']
          for m in chosen for lr in sorted(runs) if m in runs[lr] for r in [runs[lr][m]]]
  return report.markdown_table(
      ['method', 'lr', 'test accuracy (mean +- s.e.)', 'per seed', 'epochs run',
       'max_t max_i abs(dtheta) (deg)', 'max_t max_i abs(dphi)'], rows) + (
      '\n\n`*`: the protocol rate of the method (lr 0.1 GmP, 0.01 others by default).')


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
  class_names = ('class -1', 'class +1')  # banana.csv's labels (y = 0, 1 here)

  height = 4.1 * len(rates) + 0.6  # 0.6 inch for the class legend below the panels
  fig, axes = plt.subplots(len(rates), len(methods), figsize=(3.6 * len(methods), height),
                           squeeze=False)
  for row, lr in enumerate(rates):
    for ax, m in zip(axes[row], methods):
      r = runs[lr].get(m)
      if r is None:
        ax.axis('off')
        continue
      steps = int(r['epochs_run'][0]) * r['steps_per_epoch'] + 1
      path = r['locations'][0, :steps]  # (steps, hidden, 2)
      for c, color in ((0, 'tab:blue'), (1, 'tab:orange')):
        pts = x_all[y_all == c]
        ax.scatter(pts[:, 0], pts[:, 1], s=4, c=color, alpha=0.2, lw=0, label=class_names[c])
      outside = 0
      for i in range(path.shape[1]):
        c = colors[i % 10]
        ax.plot(path[:, i, 0], path[:, i, 1], '-', color=c, lw=0.8, alpha=0.9)
        ax.plot(path[0, i, 0], path[0, i, 1], 'o', color=c, ms=4)
        ax.plot(path[-1, i, 0], path[-1, i, 1], '*', color=c, ms=11, mec='k', mew=0.5)
        outside += int(np.any(np.abs(path[:, i]) > lim))
      plotting.square(ax, lim)
      note = f', {outside} leave the frame' if outside else ''
      ax.set_title(f'{plotting.method_label(m)}, lr {lr:g}: {steps - 1} steps{note}', fontsize=9)
      ax.set_xlabel('$x_1$', fontsize=8)
      ax.set_ylabel('$x_2$', fontsize=8)
      ax.tick_params(labelsize=7)
  handles, labels = next(ax for ax in axes.flat if ax.axison).get_legend_handles_labels()
  legend = fig.legend(handles, labels, loc='lower center', ncol=2, fontsize=8, markerscale=3,
                      title='data points (training and test)', title_fontsize=8)
  for handle in legend.legend_handles:
    handle.set_alpha(1.0)
  figures = [plotting.save(fig, workdir, 'trajectories.png', dpi=110, rect=(0, 0.6 / height, 1, 1),
                           title=(r'Trajectories of the boundary locations $\phi_i$ during '
                                  'training (o start, * end; seed 0)'))]

  n = len(chosen[methods[0]]['test_acc'])
  fig, axes = plt.subplots(1, len(rates), figsize=(5.6 * len(rates), 4.0), squeeze=False,
                           sharey=True)
  for ax, lr in zip(axes[0], rates[::-1]):
    for k, m in enumerate(methods):
      if m not in runs[lr]:
        continue
      worst = report.max_over_members(runs[lr][m]['max_dtheta_deg'])
      ax.plot(np.arange(1, worst.size + 1), np.maximum(worst, 1e-6), lw=0.6, color=f'C{k}',
              label=f'{plotting.method_label(m)} (max {np.nanmax(worst):.1f})')
    ax.axhline(180, color='k', lw=0.8, ls=':', label='180 deg: the largest possible change')
    ax.set_yscale('log')
    ax.set_ylim(1e-4, 400)
    ax.set_xlabel('optimizer step')
    ax.set_title(f'lr {lr:g} for every method', fontsize=10)
    ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.16), ncol=3)
  axes[0][0].set_ylabel(r'$\max_i |\Delta\theta_i|$ (degrees)')
  figures.append(plotting.save(
      fig, workdir, 'angle_change.png',
      title=f'Largest angle change per step, max over units and {n} seeds'))

  g = np.linspace(-lim, lim, 200)
  gx, gy = np.meshgrid(g, g)
  grid = np.stack([gx.ravel(), gy.ravel()], 1).astype(data['x_train'].dtype)
  fig, axes = plt.subplots(1, len(methods), figsize=(3.9 * len(methods), 5.1), squeeze=False)
  for ax, m in zip(axes[0], methods):
    r = chosen[m]
    variables = {'params': models.member(r['final_params'], 0),
                 **models.member(r['final_others'], 0)}
    prob = np.asarray(jax.nn.sigmoid(r['model'].apply(variables, jnp.asarray(grid), train=False)))
    prob = prob[:, 0].reshape(gx.shape)
    ax.contourf(gx, gy, prob, levels=np.linspace(0, 1, 11), cmap='RdBu_r', alpha=0.35)
    ax.contour(gx, gy, prob, levels=[0.5], colors='k', linewidths=2.5)
    xt, yt = data['x_test'], data['y_test'][:, 0]
    for c, color in ((0, 'tab:blue'), (1, 'tab:red')):
      ax.scatter(xt[yt == c, 0], xt[yt == c, 1], s=9, c=color, edgecolors='none',
                 label=f'{class_names[c]} (test points)')
    phi = r['final_phi'][0]
    ax.plot(phi[:, 0], phi[:, 1], '*', color='red', ms=13, mec='k', mew=0.7,
            label=r'final boundary locations $\phi_i$')
    ax.plot([], [], 'k-', lw=2.5, label='decision boundary (p = 0.5)')
    plotting.square(ax, lim)
    ax.set_title(f'{plotting.method_label(m)} (lr {r["lr"]:g}), seed 0: test accuracy {r["test_acc"][0]:.3f}\n'
                 f'all {n} seeds: {report.format_mean_se(r["test_acc"], 3)}', fontsize=9)
    ax.set_xlabel('$x_1$')
  axes[0][0].set_ylabel('$x_2$')
  plotting.legend_below(fig, axes[0][0], fontsize=8)
  return figures + [plotting.save(
      fig, workdir, 'decision_boundaries.png', rect=(0, 0.07, 1, 0.95),
      title='Decision boundary (black, p = 0.5) and final boundary locations (stars) of seed 0 '
      'over the test points')]


def _num_points(v, config):
  """Banana points (>= 10), 80% of them for training: at least one batch of `batch_size`."""
  validate.integer(10)(v, config)
  batch = config.get('batch_size', 1)
  if isinstance(batch, int) and batch > v - v // 5:
    raise validate.Bad(f'must leave at least batch_size={batch} training points (80% of '
                       'num_points)')


# The study's own config fields (the others are validate.RULES').
CONFIG_RULES = {'num_points': _num_points, 'compare_rates': validate.boolean,
                **lr_search.CONFIG_RULES}


def check_data(config) -> None:
  """Raises `validate.ConfigError` unless banana.csv is in the data directory, parses and holds
  `num_points` points (or may be downloaded: the reference file's `REFERENCE_POINTS`), and
  `cv_folds` leaves every fold's fit part a batch."""
  if config.get('lr_selection') == 'cv':
    n = config.num_points - config.num_points // 5
    lr_search.check_folds(config.cv_folds, n, 'the Banana training set', config.batch_size)
  data_dir = config.get('data_dir')
  try:
    path = download_lib.find(banana_data.FILE, data_dir, flag='--config.data_dir',
                             error=validate.Bad)
    points = len(banana_data.parse(path)[0])
  except validate.Bad as e:
    if not config.get('download', False):
      raise validate.ConfigError(f'--config.data_dir={data_dir}: {e}') from None
    path, points = None, banana_data.REFERENCE_POINTS  # the run fetches the reference file
  except ValueError as e:
    raise validate.ConfigError(f'--config.data_dir={data_dir}: {e}') from None
  num_points = config.get('num_points')
  if isinstance(num_points, int) and num_points > points:
    where = path or f'the reference {banana_data.FILE} (downloaded)'
    raise validate.ConfigError(f'--config.num_points={num_points}: must be at most {points}, the '
                               f'points in {where}.')


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` and writes its files; float64 only inside (`jax.enable_x64`).

  Every method trains at its protocol rate (accuracy, Fig. 3 j-m); with
  `compare_rates` also at the other one (trajectories and angle changes, a-i).
  Returns `{'summary': results.json, 'runs': lr -> method -> run, 'results':
  method -> run at its protocol rate, 'data': the split}`.
  """
  validate.check_config(config, CONFIG_RULES)
  check_data(config)
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
  for m in methods:  # a method's rates train together, in one compiled call
    for lr, r in train(m, data, keys, c, rates or [common.paper_lr(m, c.lr_gmp, c.lr_others)],
                       dtype).items():
      runs.setdefault(lr, {})[m] = r
      print(f'[banana_2d] {m} lr {lr:g}: test accuracy {np.mean(r["test_acc"]):.4f}, max angle '
            f'change {np.nanmax(r["max_dtheta_deg"]):.2f} deg ({r["seconds"]:.1f} s incl. '
            'compile, all rates)', flush=True)
  chosen = {m: runs[common.paper_lr(m, c.lr_gmp, c.lr_others)][m] for m in methods}
  use_cv = c.get('lr_selection', 'fixed') == 'cv'
  rates_cv = tuple(c.lr_grid) if use_cv else ()
  selections, at_cv = {}, {}
  for m in methods if use_cv else ():
    t0 = time.perf_counter()
    selections[m] = s = cross_validate(m, data, keys, c, dtype, rates_cv)['selections'][0]
    # A run at the same rate (same keys and data) is the same computation: reused.
    at_cv[m] = (None if s.index < 0 else runs[s.rate][m] if m in runs.get(s.rate, {}) else
                train(m, data, keys, c, [s.rate], dtype)[s.rate])
    test = at_cv[m]['test_acc'] if at_cv[m] is not None else np.full(len(keys), np.nan)
    print(f'[banana_2d] {m}: CV chose lr {s.rate:g} (val accuracy by lr: '
          f'{", ".join(f"{v:.4f}" for v in s.scores)}); test accuracy {np.mean(test):.4f} '
          f'({time.perf_counter() - t0:.1f} s incl. compile)', flush=True)
  large = runs.get(max(c.lr_gmp, c.lr_others)) if c.compare_rates else None
  mean_acc = lambda r: float(np.mean(r['test_acc']))
  peak = lambda key: lambda r: float(np.nanmax(r[key]))
  epochs = lambda r: r['epochs_run'].tolist()
  summary = report.collect(
      chosen, test_accuracy=mean_acc, test_accuracy_se=lambda r: report.mean_se(r['test_acc'])[1],
      per_seed=lambda r: r['test_acc'].tolist(),
      train_accuracy=lambda r: float(np.mean(r['train_acc'])), epochs_run=epochs,
      max_angle_change_deg=peak('max_dtheta_deg'), max_location_change=peak('max_dphi'),
      final_locations_seed0=lambda r: r['final_phi'][0].tolist())
  summary['by_learning_rate'] = report.collect(
      {f'{lr:g}': by_m for lr, by_m in runs.items()}, depth=2, test_accuracy=mean_acc,
      max_angle_change_deg=peak('max_dtheta_deg'),
      max_angle_change_deg_per_seed=lambda r: np.nanmax(r['max_dtheta_deg'], axis=1).tolist(),
      steps_with_angle_change_over_90_deg=lambda r: int(np.nansum(r['max_dtheta_deg'] > 90)),
      median_angle_change_deg=lambda r: float(np.nanmedian(r['max_dtheta_deg'])),
      max_location_change=peak('max_dphi'), epochs_run=epochs)
  rows = report.member_rows(
      [(dict(method=m, lr=lr, protocol_rate=r is chosen[m]), r)
       for lr, by_m in sorted(runs.items()) for m, r in by_m.items()], 'seed_index',
      test_accuracy=lambda r: r['test_acc'], train_accuracy=lambda r: r['train_acc'],
      epochs_run=lambda r: r['epochs_run'],
      max_angle_change_deg=lambda r: np.nanmax(r['max_dtheta_deg'], axis=1),
      max_location_change=lambda r: np.nanmax(r['max_dphi'], axis=1))
  table = summarize(runs, chosen)
  claims = check_claims(chosen, large, max(c.lr_gmp, c.lr_others))
  if use_cv:
    test_fixed, test_cv = lr_search.metric_at_rates(
        selections, at_cv, chosen, lambda m: common.paper_lr(m, c.lr_gmp, c.lr_others),
        lambda r: r['test_acc'], len(keys))
    summary['cv'], cv_table, cv_claims = lr_search.seed_report(
        selections, rates_cv, folds=c.cv_folds, seeds=len(keys), metric='accuracy',
        key='test_accuracy', mode='max', fixed=test_fixed, chosen=test_cv,
        score='validation accuracy (monitored and scored on the held-out fold), mean over folds '
        'and seeds; ties: the smaller rate; a rate with a non-finite fold is never chosen')
    rows = [dict(row, lr_selection='fixed') for row in rows] + [
        dict(method=m, lr=rate, protocol_rate=False, seed_index=i, test_accuracy=v[i],
             train_accuracy=at_cv[m]['train_acc'][i] if at_cv[m] is not None else np.nan,
             epochs_run=at_cv[m]['epochs_run'][i] if at_cv[m] is not None else -1,
             max_angle_change_deg=np.nanmax(at_cv[m]['max_dtheta_deg'][i])
             if at_cv[m] is not None else np.nan,
             max_location_change=np.nanmax(at_cv[m]['max_dphi'][i])
             if at_cv[m] is not None else np.nan, lr_selection='cv')
        for m, (rate, v) in test_cv.items() for i in range(len(keys))]
    table += cv_table
    claims.update(cv_claims)
  figures = plot(runs, chosen, data, workdir) if c.plots else []
  config = dict(c.to_dict(), methods=list(methods),
                validation='held-out 20% (also the test set, as in the reference code)')
  summary = report.write(workdir, 'banana_2d', summary=summary, rows=rows, table=table,
                         claims=claims, config=config, started=t_start, figures=figures)
  return {'summary': summary, 'runs': runs, 'results': chosen, 'data': data}

