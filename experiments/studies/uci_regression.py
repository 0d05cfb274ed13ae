r"""UCI regression (paper 002, Table 3): SP, WN, BN and GmP MLPs on six UCI benchmarks.

The setting and its commands are in `experiments/configs/uci_regression.py`. Two
protocols: `reference` (the reference code: plateau and early stopping monitor
the *test* split's MSE, so the reported RMSE is selected on the test set) and
`clean` (they monitor a validation set, 20% of the training split, which is
also the only data the feature statistics come from). All splits of one
(dataset, method) train in one `experiments.lib.protocol.fit`, vmapped in chunks
that stay in cache (`chunk_size`), epochs in blocks that end once every split
stopped.

With `lr_selection='cv'` (paper 002, Appendix C) the run also chooses, per
dataset, method and split, the learning rate from `lr_grid` by `cv_folds`-fold
cross-validation on that split's training part (`experiments.lib.lr_search`;
the score is the mean held-out RMSE over the folds, the fold taking the place
of the test split), retrains on the whole training part at the chosen rate and
tests: its records (`lr_selection: cv`) and Table 3 rows sit beside the
fixed-rate ones, with the chosen rates and every rate's validation RMSE.

Writes to `workdir`: results.json (test RMSE mean and s.e. per dataset and
method, one record per split, the paper's Table 3, the claims), results.csv
(the records) and results.md (ours beside Table 3, the wall time and command).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments.lib import lr_search, models, plotting, report
from experiments.data import uci_data
from experiments.lib import protocol as protocol_lib
from experiments.configs import common, validate

PROTOCOLS = ('reference', 'clean')  # what plateau and early stopping watch
# The study's own config fields (the others are validate.RULES').
CONFIG_RULES = {'datasets': validate.distinct_names, 'protocol': validate.choice(PROTOCOLS),
                'num_splits': validate.AT_LEAST_ONE, **lr_search.CONFIG_RULES}


def check_data(config) -> None:
  """Raises `validate.ConfigError` unless every UCI set is in the data directory (or may
  download)."""
  try:
    uci_data.check_datasets(validate.split_names(config.datasets), config.get('data_dir'),
                            config.get('download', False))
  except ValueError as e:
    message = str(e).removeprefix('--config.datasets: ')
    raise validate.ConfigError(f'--config.datasets={config.datasets}: {message}') from None
  if config.get('lr_selection') == 'cv':
    for name in validate.split_names(config.datasets):
      try:  # a file still to be downloaded: its size is checked when the run carves the folds
        n = len(uci_data.load(name.lower(), config.get('data_dir')).y)
      except ValueError:
        continue
      lr_search.check_folds(config.cv_folds, training_rows(n, config.protocol), name,
                            fit_least=2)


def training_rows(n: int, protocol: str) -> int:
  """Rows of a split's training part the model is fit on (and the folds are carved from)."""
  return uci_data.split_sizes(n, TEST_FRACTION, VAL_FRACTION if protocol == 'clean' else 0.0)[0]

HIDDEN = 100
PLATEAU_PATIENCE, STOP_PATIENCE = 50, 100
TEST_FRACTION, VAL_FRACTION = 0.2, 0.2
# Epochs per `lax.scan` block; the while loop checks between blocks whether every split stopped.
BLOCK = 100
# Hidden-activation bytes per vmapped chunk of splits (see `chunk_size`).
CHUNK_BYTES = 8 << 20

# Paper 002, Table 3: test RMSE mean +- standard error over 10 splits.
PAPER_TABLE3 = {
  'sp': dict(boston=(3.370, 0.145), concrete=(5.472, 0.144), energy=(0.898, 0.274),
             power=(4.065, 0.029), wine=(0.623, 0.008), yacht=(0.639, 0.063)),
  'wn': dict(boston=(3.459, 0.156), concrete=(5.952, 0.148), energy=(2.093, 0.789),
             power=(4.073, 0.026), wine=(0.632, 0.008), yacht=(0.624, 0.076)),
  'bn': dict(boston=(3.469, 0.153), concrete=(5.695, 0.160), energy=(1.648, 0.302),
             power=(4.164, 0.026), wine=(0.622, 0.011), yacht=(0.777, 0.055)),
  'gmp': dict(boston=(3.057, 0.144), concrete=(5.153, 0.098), energy=(0.474, 0.013),
              power=(4.022, 0.025), wine=(0.613, 0.006), yacht=(0.584, 0.046)),
}


def prepare(ds: uci_data.Dataset, protocol: str, num_splits: int, seed: int,
            dtype=np.float64) -> dict[str, np.ndarray]:
  """Stacked, standardized splits: `x_*` `(num_splits, rows, d)`, `y_*` `(num_splits, rows, 1)`.

  `fit` is what the model trains on; `mon` what plateau and early stopping
  monitor (the test split for `reference`, the validation part for `clean`);
  `test` what the RMSE is reported on. Feature statistics come from `fit` only.
  Targets are not scaled (the reference code trains on raw targets).
  """
  if protocol not in PROTOCOLS:
    raise ValueError(f'--config.protocol={protocol}: must be one of {", ".join(PROTOCOLS)}.')
  splits = uci_data.make_splits(
      len(ds.y), num_splits, seed, test_fraction=TEST_FRACTION,
      val_fraction=VAL_FRACTION if protocol == 'clean' else 0.0,
      source=f'{ds.path} (last data row at line {ds.last_line})')
  mon = splits.val if protocol == 'clean' else splits.test
  parts = {k: [] for k in ('x_fit', 'x_mon', 'x_test')}
  for i in range(num_splits):
    for k, x in zip(parts, uci_data.standardize(ds.x[splits.fit[i]], ds.x[mon[i]],
                                                 ds.x[splits.test[i]])):
      parts[k].append(x)
  out = {k: np.stack(v).astype(dtype) for k, v in parts.items()}
  for k, rows in (('y_fit', splits.fit), ('y_mon', mon), ('y_test', splits.test)):
    out[k] = ds.y[rows][..., None].astype(dtype)
  return out


def prepare_cv(ds: uci_data.Dataset, protocol: str, num_splits: int, seed: int, num_folds: int,
               dtype=np.float64) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """The cross-validation folds of every split, from its training part only.

  The splits are `prepare`'s (same `make_splits` call); the folds of split `i`
  are carved from its fit rows with the seed `[seed, i, 1]` (`lr_search.carve_folds`).
  For split `i` and fold `k`: `fit` is the training part without fold `k`,
  `test` is fold `k` (the scored held-out part), `mon` is fold `k` for
  `reference` (the study monitors the split it scores) or the split's
  validation part for `clean`; features standardized with the fold's fit
  statistics. The split's test rows are never read.

  Returns `(data, folds)`: `data` like `prepare`'s with leading axes
  `(num_splits, num_folds)`, `folds` the dataset rows held out `(num_splits, num_folds, n // K)`.
  """
  splits = uci_data.make_splits(
      len(ds.y), num_splits, seed, test_fraction=TEST_FRACTION,
      val_fraction=VAL_FRACTION if protocol == 'clean' else 0.0,
      source=f'{ds.path} (last data row at line {ds.last_line})')
  names = ('fit', 'mon', 'test')
  parts = {f'{a}_{k}': [] for a in 'xy' for k in names}
  folds = []
  for i in range(num_splits):
    held = lr_search.carve_folds(splits.fit[i], num_folds, seed=[seed, i, 1])
    fits = lr_search.fit_parts(splits.fit[i], held)
    folds.append(held)
    for k in range(num_folds):
      rows = dict(fit=fits[k], mon=held[k] if protocol == 'reference' else splits.val[i],
                  test=held[k])
      xs = uci_data.standardize(*(ds.x[rows[n]] for n in names))
      for n, x in zip(names, xs):
        parts[f'x_{n}'].append(x)
        parts[f'y_{n}'].append(ds.y[rows[n]][..., None])
  data = {k: np.stack(v).astype(dtype).reshape((num_splits, num_folds) + v[0].shape)
          for k, v in parts.items()}
  return data, np.stack(folds)


def cross_validate(method: str, fold_data: dict[str, np.ndarray], keys: jax.Array,
                   rates, max_epochs: int, **kwargs) -> dict[str, Any]:
  """`lr_search.search` of `method` over `rates` on `prepare_cv`'s folds, one `train` call
  (rates x folds x splits vmapped, split `s` initialized by `keys[s]` at every rate and
  fold); the score is the mean held-out RMSE over a split's folds, one choice per split.
  `kwargs` go to `train` (hidden, patience...)."""
  num_splits, num_folds = fold_data['x_fit'].shape[:2]

  def fit_grid(members):
    data = {k: v[members['seed'], members['fold']] for k, v in fold_data.items()}
    return train(method, data, keys[members['seed']], max_epochs, float(rates[0]),
                 lrs=members['lr'], **kwargs)['rmse']

  return lr_search.search(fit_grid, rates, num_folds, num_splits, 'min', per_seed=True)


def train(method: str, data: dict[str, Any], keys: jax.Array, max_epochs: int, lr: float,
          hidden: int = HIDDEN, plateau_patience: int = PLATEAU_PATIENCE,
          stop_patience: int = STOP_PATIENCE, block: int = BLOCK,
          chunk_bytes: int = CHUNK_BYTES, lrs=None) -> dict[str, np.ndarray]:
  """Trains `method` on every split of `data` (leading axis) at once; one compiled call.

  `keys[i]` initializes split `i`; `lrs` None (every split starts at `lr`) or the
  initial rate of every split `(num_splits,)` (a grid of rates in the same call).
  One full-batch Adam step per epoch on the MAE,
  then plateau and early stopping see the monitored MSE (Keras order). Returns
  per-split arrays: `rmse` (test, with the weights early stopping kept),
  `monitor_best` (best monitored MSE), `epochs_run`, `best_epoch` (0-based),
  `final_lr`, `stopped`.
  """
  model = models.MLP(hidden=(hidden,), out=1, method=method, gmp_glorot_scale=True,
                     param_dtype=data['x_fit'].dtype)
  settings = protocol_lib.Protocol(num_epochs=max_epochs, learning_rate=lr, monitor='mse',
                                   mode='min', plateau_patience=plateau_patience,
                                   stop_patience=stop_patience)

  def mse(variables, x, y):
    return jnp.mean((model.apply(variables, x, train=False) - y) ** 2)

  def mae(variables, batch, d):
    pred, updates = models.apply_train(model, variables, d['x_fit'])
    return jnp.mean(jnp.abs(pred - d['y_fit'])), updates

  num_splits, rows = data['x_fit'].shape[:2]
  members = dict(key=keys, data={k: jnp.asarray(v) for k, v in data.items()})
  if lrs is not None:
    members['lr'] = jnp.asarray(lrs, data['x_fit'].dtype)
  out = protocol_lib.fit(
      settings, init=lambda m: model.init(m['key'], m['data']['x_fit'], train=False),
      loss=lambda v, b, m: mae(v, b, m['data']),
      batches=lambda m, t: (jnp.zeros((1, 1)),),  # one full-batch step: the data is the member's
      members=members, learning_rate=None if lrs is None else (lambda m: m['lr']),
      evaluate=lambda v, m: {'mse': mse(v, m['data']['x_mon'], m['data']['y_mon'])},
      finalize=lambda first, final, m: jnp.sqrt(mse(final, m['data']['x_test'],
                                                    m['data']['y_test'])),
      block=block, chunk=chunk_size(num_splits, rows, hidden, data['x_fit'].dtype.itemsize,
                                    chunk_bytes))
  return jax.tree.map(np.asarray, dict(
      rmse=out['final'], monitor_best=out['best'], epochs_run=out['epochs_run'],
      best_epoch=out['best_epoch'], final_lr=out['final_lr'], stopped=out['stopped']))


def chunk_size(num_splits: int, rows: int, hidden: int, itemsize: int,
               budget_bytes: int = CHUNK_BYTES) -> int:
  """Splits per vmapped chunk: the largest divisor of `num_splits` whose hidden activations fit.

  On CPU one vmapped step over all splits of `power` (10 x 7654 x 100 floats)
  streams its activations through memory several times per epoch; chunks whose
  activations stay in cache run faster (measured: 10 splits 36 ms, chunks of 2
  15 ms per epoch in float32), and a chunk whose splits all stopped is skipped.
  """
  per_split = max(1, rows * hidden * itemsize)
  fits = max(1, budget_bytes // per_split)
  return max(c for c in range(1, num_splits + 1) if num_splits % c == 0 and c <= fits)


def split_keys(seed: int, num_splits: int) -> jax.Array:
  """Initialization key of each split; split `i`'s key depends only on `(seed, i)`."""
  return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(num_splits))


def check_claims(ours, datasets, methods) -> dict[str, str]:
  """Paper 002 Table 3: GmP has the lowest test RMSE on every dataset (ours: `summarize`)."""
  if not any(map(models.is_gmp, methods)) or len(methods) < 2:
    return {}
  out = {}
  for d in datasets:
    best = min(methods, key=lambda m: ours[d][m][0])
    out[f'GmP has the lowest test RMSE on {d}'] = report.claim(
        models.is_gmp(best), f'lowest: {best} {ours[d][best][0]:.3f}', *(ours[d][m][0] for m in methods))
  return out


def summarize(records: list[dict[str, Any]], datasets, methods) -> dict[str, dict[str, tuple]]:
  """`{dataset: {method: (mean, standard error)}}` of the test RMSE over splits."""
  return {d: {m: report.mean_se([r['rmse'] for r in records
                                 if r['dataset'] == d and r['method'] == m], single=float('nan'))
              for m in methods} for d in datasets}


def make_table(records: list[dict[str, Any]], datasets, methods, protocol: str,
               cv_records: list[dict[str, Any]] | None = None) -> str:
  """Markdown table like Table 3 (methods x datasets), each of our rows above the paper's; the
  best mean per dataset in bold, among ours and among the paper's separately. With
  `cv_records` (the CV-chosen rates' runs) each method's fixed-rate row is followed by its
  `CV lr` row (bold: the best among the CV rows)."""
  ours = summarize(records, datasets, methods)
  best_ours = {d: min(methods, key=lambda m: ours[d][m][0]) for d in datasets}
  cv = summarize(cv_records, datasets, methods) if cv_records else None
  best_cv = {d: min(methods, key=lambda m: cv[d][m][0]) for d in datasets} if cv else {}
  paper_methods = [m for m in methods if m in PAPER_TABLE3]
  best_paper = {d: min(paper_methods, key=lambda m: PAPER_TABLE3[m][d][0])
                for d in datasets
                if paper_methods and all(d in PAPER_TABLE3[m] for m in paper_methods)}
  rows = []
  for m in methods:
    name = plotting.method_label(m)
    rows.append([name] + [report.bold(report.format_pair(*ours[d][m], 3), best_ours[d] == m)
                          for d in datasets])
    if cv:
      rows.append([f'{name}, CV lr'] + [
          report.bold(report.format_pair(*cv[d][m], 3), best_cv[d] == m) for d in datasets])
    if m in PAPER_TABLE3:
      rows.append([f'{name}, paper'] + [
          report.bold(report.format_pair(*PAPER_TABLE3[m][d], 3), best_paper.get(d) == m)
          if d in PAPER_TABLE3[m] else '-' for d in datasets])
  cv_note = ('; "CV lr" rows: each split at the rate its cross-validation chose (the other '
             'rows: lr 0.1 GmP, 0.01 others, or the config\'s lr_gmp/lr_others)') if cv else ''
  return (f'Test RMSE, mean +- standard error over splits (protocol `{protocol}`); "paper" rows: '
          f'paper 002, Table 3{cv_note}.\n\n' + report.markdown_table(
              ['method'] + [d.capitalize() for d in datasets], rows) + '\n')


def cv_tables(cv: dict[str, dict[str, dict[str, Any]]], datasets, methods, rates) -> str:
  """Markdown: the chosen rates (how often each, over splits) per method and dataset, and
  every rate's validation RMSE (mean over splits of the mean over folds; `diverged (n)`: n
  splits had a non-finite fold) per dataset and method."""
  chosen = report.markdown_table(
      ['method'] + [d.capitalize() for d in datasets],
      [[plotting.method_label(m)] + [', '.join(f'{r} x{n}' for r, n in
                                               cv[d][m]['chosen_lr_distribution'].items())
                                     for d in datasets] for m in methods])
  rows = []
  for d in datasets:
    for m in methods:
      r = cv[d][m]
      rows.append([d, plotting.method_label(m)] + [
          f'diverged ({n})' if n else f'{v:.3f}'
          for v, n in zip(r['val_rmse_by_lr'].values(), r['diverged_splits_by_lr'].values())])
  scores = report.markdown_table(['dataset', 'method'] + [f'lr {r:g}' for r in rates], rows)
  return ('Learning rates chosen by cross-validation (rate x number of splits that chose it):'
          '\n\n' + chosen + '\n\nValidation RMSE per rate (mean over splits of the mean over '
          'the folds of the training part):\n\n' + scores + '\n')


def check_cv_claims(cv, ours_cv, datasets, methods) -> dict[str, str]:
  """Paper 002 (Appendix C): CV finds 0.1 for GmP and 0.01 for the others (our verdict: the
  rate most splits chose, per dataset); and GmP's test RMSE is the lowest at the CV rates."""
  out = {}
  for d in datasets:
    out[f'{lr_search.PAPER_CLAIM} on {d} (most frequent over splits)'] = lr_search.paper_claim(
        {m: cv[d][m]['modal_lr'] for m in methods})
  if any(map(models.is_gmp, methods)) and len(methods) > 1:
    for d in datasets:
      best = min(methods, key=lambda m: ours_cv[d][m][0])
      out[f'GmP has the lowest test RMSE on {d} at the CV-chosen rates'] = report.claim(
          models.is_gmp(best), f'lowest: {best} {ours_cv[d][best][0]:.3f}',
          *(ours_cv[d][m][0] for m in methods))
  return out


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` and writes its files; float64 only inside (`jax.enable_x64`).

  Returns `records` (one dict per dataset, method and split), `summary`,
  `table`, `wall_seconds`, `cpu_seconds`.
  """
  validate.check_config(config, CONFIG_RULES)
  check_data(config)
  with jax.enable_x64(config.float64):
    return _run(config, workdir)


def _command(config, workdir: str) -> str:
  """The command line of `config`: the fields that differ from the default config."""
  from experiments.configs import uci_regression as defaults  # pylint: disable=g-import-not-at-top
  default = defaults.get_config()
  fields = ' '.join(f'--config.{k}={v}' for k, v in config.items() if v != default.get(k))
  return (f'python -m experiments.main --config=experiments/configs/uci_regression.py '
          f'{fields}{" " if fields else ""}--workdir={workdir}')


def _run(c, workdir):
  t_start, cpu_start = time.perf_counter(), time.process_time()
  dtype = np.float64 if c.float64 else np.float32
  datasets = tuple(n.lower() for n in validate.split_names(c.datasets))
  methods = models.check_methods(validate.split_names(c.methods))
  use_cv = c.get('lr_selection', 'fixed') == 'cv'
  rates = tuple(c.lr_grid) if use_cv else ()
  # Load and split everything first, so bad files fail before any training.
  loaded = {d: uci_data.load(d, c.data_dir, c.download) for d in datasets}
  data = {d: prepare(loaded[d], c.protocol, c.num_splits, c.seed, dtype) for d in datasets}
  folds = {}
  if use_cv:
    for d in datasets:
      lr_search.check_folds(c.cv_folds, training_rows(len(loaded[d].y), c.protocol), d, 2)
      folds[d] = prepare_cv(loaded[d], c.protocol, c.num_splits, c.seed, c.cv_folds, dtype)[0]
  keys = split_keys(c.seed, c.num_splits)
  kwargs = dict(hidden=c.hidden, plateau_patience=c.plateau_patience,
                stop_patience=c.stop_patience)
  records, cv_records, cv = [], [], {}
  field = lambda k: lambda o: o[k].tolist()  # Python scalars, as results.json holds them

  def rows(d, m, out, seconds, selection, **extra):
    more = dict(lr_selection=lambda o: selection, lr=field('lr'),
                cv_val_rmse=field('cv_val_rmse')) if use_cv else {}
    return report.member_rows(
        [(dict(dataset=d, method=m), dict(out, **extra))], 'split', rmse=field('rmse'),
        protocol=lambda o: c.protocol, monitor_best_mse=field('monitor_best'),
        epochs_run=field('epochs_run'), best_epoch=field('best_epoch'),
        final_lr=field('final_lr'), stopped=field('stopped'),
        seconds_all_splits=lambda o: seconds, **more)

  for d in datasets:
    for m in methods:
      t0 = time.perf_counter()
      lr = common.paper_lr(m, c.lr_gmp, c.lr_others)
      out = train(m, data[d], keys, c.num_epochs, lr, **kwargs)
      seconds = time.perf_counter() - t0
      nan = np.full(c.num_splits, np.nan)
      records += rows(d, m, out, seconds, 'fixed', lr=np.full(c.num_splits, lr), cv_val_rmse=nan)
      mean, se = report.mean_se(out['rmse'], single=float('nan'))
      print(f'[uci_regression] {c.protocol} {d:>9s} {m:>4s}: test RMSE {mean:.3f} +- {se:.3f}, '
            f'epochs {int(out["epochs_run"].min())}-{int(out["epochs_run"].max())}, '
            f'{seconds:.1f} s incl. compile', flush=True)
      if use_cv:
        t0 = time.perf_counter()
        found = cross_validate(m, folds[d], keys, rates, c.num_epochs, **kwargs)
        chosen = np.array([s.rate for s in found['selections']])
        # A split with no finite rate (every rate diverged in some fold) gets NaN, not a pick.
        out = train(m, data[d], keys, c.num_epochs, lr,
                    lrs=np.where(np.isfinite(chosen), chosen, rates[0]), **kwargs)
        out['rmse'] = np.where(np.isfinite(chosen), out['rmse'], np.nan)
        seconds = time.perf_counter() - t0
        val = np.array([s.scores[s.index] if s.index >= 0 else np.nan
                        for s in found['selections']])
        cv_records += rows(d, m, out, seconds, 'cv', lr=chosen, cv_val_rmse=val)
        split_scores = np.stack([s.scores for s in found['selections']])  # (splits, rates)
        cv.setdefault(d, {})[m] = dict(
            chosen_lr=chosen.tolist(), chosen_lr_distribution=lr_search.distribution(chosen),
            modal_lr=lr_search.modal(chosen),
            val_rmse_by_lr={f'{r:g}': float(np.mean(split_scores[:, i]))
                            for i, r in enumerate(rates)},
            diverged_splits_by_lr={f'{r:g}': int(sum(s.diverged[i] for s in found['selections']))
                                   for i, r in enumerate(rates)},
            val_rmse_per_split=split_scores.tolist(), seconds=seconds)
        mean, se = report.mean_se(out['rmse'], single=float('nan'))
        print(f'[uci_regression] {c.protocol} {d:>9s} {m:>4s}: CV chose lr '
              f'{lr_search.distribution(chosen)}; test RMSE {mean:.3f} +- {se:.3f} '
              f'({seconds:.1f} s incl. compile, {len(rates)} rates x {c.cv_folds} folds)',
              flush=True)
  wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
  table = make_table(records, datasets, methods, c.protocol, cv_records or None)
  if use_cv:
    table += '\n' + cv_tables(cv, datasets, methods, rates)
  footer = (f'\n\n{len(datasets)} datasets x {len(methods)} methods x {c.num_splits} splits, '
            f'up to {c.num_epochs} epochs, {"float64" if c.float64 else "float32"}, '
            f'{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} CPU cores: '
            f'wall time {wall:.1f} s (process CPU time {cpu:.1f} s).\n'
            f'Command: `{_command(c, workdir)}`\n')
  ours = summarize(records, datasets, methods)
  summary = dict(report.collect(ours, depth=2, test_rmse=lambda v: v[0],
                                test_rmse_se=lambda v: v[1]), records=records, cpu_seconds=cpu)
  claims = check_claims(ours, datasets, methods)
  if use_cv:
    ours_cv = summarize(cv_records, datasets, methods)
    summary['cv'] = dict(
        lr_grid=list(rates), cv_folds=c.cv_folds, records=cv_records,
        score='mean held-out RMSE over the folds of the split\'s training part; ties: the '
        'smaller rate; a rate with a non-finite fold is never chosen',
        **report.collect(ours_cv, depth=2, test_rmse=lambda v: v[0], test_rmse_se=lambda v: v[1]),
        **{k: {d: {m: cv[d][m][k] for m in methods} for d in datasets} for k in cv[datasets[0]][
            methods[0]]})
    claims.update(check_cv_claims(cv, ours_cv, datasets, methods))
  report.write(workdir, 'uci_regression', summary=summary, rows=records + cv_records,
               table=table + footer, claims=claims, config=c, started=t_start,
               paper={'table3_test_rmse_mean_se': PAPER_TABLE3})
  return dict(records=records, summary=ours, table=table, cv_records=cv_records, cv=cv,
              wall_seconds=wall, cpu_seconds=cpu)

