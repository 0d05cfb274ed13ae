r"""UCI regression (paper 002, Table 3): SP, WN, BN and GmP MLPs on six UCI benchmarks.

The setting and its commands are in `experiments/configs/uci_regression.py`. Two
protocols: `reference` (the reference code: plateau and early stopping monitor
the *test* split's MSE, so the reported RMSE is selected on the test set) and
`clean` (they monitor a validation set, 20% of the training split, which is
also the only data the feature statistics come from). All splits of one
(dataset, method) train in one `experiments.lib.protocol.fit`, vmapped in chunks
that stay in cache (`chunk_size`), epochs in blocks that end once every split
stopped.

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

from experiments.lib import models, plotting, report
from experiments.data import uci_data
from experiments.lib import protocol as protocol_lib
from experiments.configs import common, validate

PROTOCOLS = ('reference', 'clean')  # what plateau and early stopping watch
# The study's own config fields (the others are validate.RULES').
CONFIG_RULES = {'datasets': validate.distinct_names, 'protocol': validate.choice(PROTOCOLS),
                'num_splits': validate.AT_LEAST_ONE}


def check_data(config) -> None:
  """Raises `validate.ConfigError` unless every UCI set is in the data directory (or may
  download)."""
  try:
    uci_data.check_datasets(validate.split_names(config.datasets), config.get('data_dir'),
                            config.get('download', False))
  except ValueError as e:
    message = str(e).removeprefix('--config.datasets: ')
    raise validate.ConfigError(f'--config.datasets={config.datasets}: {message}') from None
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


def train(method: str, data: dict[str, Any], keys: jax.Array, max_epochs: int, lr: float,
          hidden: int = HIDDEN, plateau_patience: int = PLATEAU_PATIENCE,
          stop_patience: int = STOP_PATIENCE, block: int = BLOCK,
          chunk_bytes: int = CHUNK_BYTES) -> dict[str, np.ndarray]:
  """Trains `method` on every split of `data` (leading axis) at once; one compiled call.

  `keys[i]` initializes split `i`. One full-batch Adam step per epoch on the MAE,
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
  out = protocol_lib.fit(
      settings, init=lambda m: model.init(m['key'], m['data']['x_fit'], train=False),
      loss=lambda v, b, m: mae(v, b, m['data']),
      batches=lambda m, t: (jnp.zeros((1, 1)),),  # one full-batch step: the data is the member's
      members=dict(key=keys, data={k: jnp.asarray(v) for k, v in data.items()}),
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
  if 'gmp' not in methods or len(methods) < 2:
    return {}
  out = {}
  for d in datasets:
    best = min(methods, key=lambda m: ours[d][m][0])
    out[f'GmP has the lowest test RMSE on {d}'] = report.claim(
        best == 'gmp', f'lowest: {best} {ours[d][best][0]:.3f}', *(ours[d][m][0] for m in methods))
  return out


def summarize(records: list[dict[str, Any]], datasets, methods) -> dict[str, dict[str, tuple]]:
  """`{dataset: {method: (mean, standard error)}}` of the test RMSE over splits."""
  return {d: {m: report.mean_se([r['rmse'] for r in records
                                 if r['dataset'] == d and r['method'] == m], single=float('nan'))
              for m in methods} for d in datasets}


def make_table(records: list[dict[str, Any]], datasets, methods, protocol: str) -> str:
  """Markdown table like Table 3 (methods x datasets), each of our rows above the paper's; the
  best mean per dataset in bold, among ours and among the paper's separately."""
  ours = summarize(records, datasets, methods)
  best_ours = {d: min(methods, key=lambda m: ours[d][m][0]) for d in datasets}
  paper_methods = [m for m in methods if m in PAPER_TABLE3]
  best_paper = {d: min(paper_methods, key=lambda m: PAPER_TABLE3[m][d][0])
                for d in datasets
                if paper_methods and all(d in PAPER_TABLE3[m] for m in paper_methods)}
  rows = []
  for m in methods:
    name = plotting.method_label(m)
    rows.append([name] + [report.bold(report.format_pair(*ours[d][m], 3), best_ours[d] == m)
                          for d in datasets])
    if m in PAPER_TABLE3:
      rows.append([f'{name}, paper'] + [
          report.bold(report.format_pair(*PAPER_TABLE3[m][d], 3), best_paper.get(d) == m)
          if d in PAPER_TABLE3[m] else '-' for d in datasets])
  return (f'Test RMSE, mean +- standard error over splits (protocol `{protocol}`); "paper" rows: '
          'paper 002, Table 3.\n\n' + report.markdown_table(
              ['method'] + [d.capitalize() for d in datasets], rows) + '\n')


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
  # Load and split everything first, so bad files fail before any training.
  data = {d: prepare(uci_data.load(d, c.data_dir, c.download), c.protocol, c.num_splits, c.seed,
                     dtype) for d in datasets}
  keys = split_keys(c.seed, c.num_splits)
  records = []
  for d in datasets:
    for m in methods:
      t0 = time.perf_counter()
      out = train(m, data[d], keys, c.num_epochs, common.paper_lr(m, c.lr_gmp, c.lr_others),
                  hidden=c.hidden, plateau_patience=c.plateau_patience,
                  stop_patience=c.stop_patience)
      seconds = time.perf_counter() - t0
      field = lambda k: lambda o: o[k].tolist()  # Python scalars, as results.json holds them
      records += report.member_rows(
          [(dict(dataset=d, method=m), out)], 'split', rmse=field('rmse'),
          protocol=lambda o: c.protocol, monitor_best_mse=field('monitor_best'),
          epochs_run=field('epochs_run'), best_epoch=field('best_epoch'),
          final_lr=field('final_lr'), stopped=field('stopped'),
          seconds_all_splits=lambda o: seconds)
      mean, se = report.mean_se(out['rmse'], single=float('nan'))
      print(f'[uci_regression] {c.protocol} {d:>9s} {m:>4s}: test RMSE {mean:.3f} +- {se:.3f}, '
            f'epochs {int(out["epochs_run"].min())}-{int(out["epochs_run"].max())}, '
            f'{seconds:.1f} s incl. compile', flush=True)
  wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
  table = make_table(records, datasets, methods, c.protocol)
  footer = (f'\n\n{len(datasets)} datasets x {len(methods)} methods x {c.num_splits} splits, '
            f'up to {c.num_epochs} epochs, {"float64" if c.float64 else "float32"}, '
            f'{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} CPU cores: '
            f'wall time {wall:.1f} s (process CPU time {cpu:.1f} s).\n'
            f'Command: `{_command(c, workdir)}`\n')
  ours = summarize(records, datasets, methods)
  summary = dict(report.collect(ours, depth=2, test_rmse=lambda v: v[0],
                                test_rmse_se=lambda v: v[1]), records=records, cpu_seconds=cpu)
  report.write(workdir, 'uci_regression', summary=summary, rows=records, table=table + footer,
               claims=check_claims(ours, datasets, methods), config=c, started=t_start,
               paper={'table3_test_rmse_mean_se': PAPER_TABLE3})
  return dict(records=records, summary=ours, table=table,
              wall_seconds=wall, cpu_seconds=cpu)

