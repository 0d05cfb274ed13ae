r"""UCI regression (paper 002, Table 3): SP, WN, BN and GmP MLPs on six UCI benchmarks.

Setup (paper 002, Sec. 5.3 and App. C.3, and its reference script
`uci_regression/uci_regression.py`): MLP with one hidden layer of 100 ReLU
units, 10 random 80/20 train/test splits, features standardized with training
statistics, Adam on the MAE loss, full batch, lr 0.1 for GmP and 0.01 for the
others, at most 5000 epochs, LR x0.1 after 50 epochs without improvement of the
monitored MSE and early stop after 100 (restoring the best weights; Keras
semantics, `geoparam.schedules`). Test RMSE, mean +- standard error over splits.

Two protocols:
  reference  what the reference code did: plateau and early stopping monitor the
             *test* split's MSE, so the reported RMSE is selected on the test set.
  clean      they monitor a validation set (20% of the training split, which is
             also the only data the feature statistics come from); the test split
             is used once, at the end.

All splits of one (dataset, method) train together in one compiled call:
`jax.vmap` over splits inside one jitted `lax.scan` over epochs. A split that
stops early is frozen by masking. Speed on CPU: the splits are vmapped in
chunks sized so that their hidden activations stay in cache (all 10 at once for
the small sets, 2 for `power`); a chunk whose splits have all stopped is
skipped by `lax.cond`, and the scan runs in blocks of epochs inside a
`lax.while_loop` that ends once every split has stopped (or at `max_epochs`).

  python -m experiments.uci_regression --data_dir=../shared/data --protocol=reference \
      --workdir=workdir/uci_reference
  python -m experiments.uci_regression --data_dir=../shared/data --protocol=clean \
      --workdir=workdir/uci_clean
  python -m experiments.uci_regression --download --datasets=yacht --workdir=/tmp/uci  # no data

Writes to `workdir`: `results.json` (a list with one record per dataset, method
and split: `dataset`, `method`, `split`, `rmse`, epochs run, ...) and `table.md`
(ours beside the paper's Table 3); prints the table and the wall time.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import download as download_lib
from experiments import models
from experiments import uci_data
from geoparam import schedules

FLAGS = flags.FLAGS


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_string('data_dir', None,
                      f'Folder holding uci/ (default: the environment variable {uci_data.ENV_VAR}).')
  flags.DEFINE_list('datasets', list(uci_data.PAPER_DATASETS), 'UCI datasets (file names in uci/).')
  flags.DEFINE_bool('download', False, 'Fetch missing UCI files of the six paper datasets from '
                    'their public source into the cache ($GEOPARAM_CACHE_DIR, ~/.cache/geoparam).')
  flags.DEFINE_list('methods', ['sp', 'wn', 'bn', 'gmp'], f'Methods, among {models.METHODS}.')
  flags.DEFINE_integer('num_splits', 10, 'Random 80/20 splits, trained together under vmap.')
  flags.DEFINE_integer('seed', 0, 'Seed of the splits and the initializations.')
  flags.DEFINE_string('protocol', 'reference', 'reference (monitor the test split) or clean '
                      '(monitor a validation part of the training split).')
  flags.DEFINE_integer('max_epochs', 5000, 'Maximum number of full-batch epochs (paper: 5000).')
  flags.DEFINE_bool('float64', False, 'Train in float64 as the reference code does (about 2x slower '
                    'on CPU; float32 by default).')
  flags.DEFINE_string('workdir', None, 'Directory for results.json and table.md.')


PROTOCOLS = ('reference', 'clean')
HIDDEN = 100
LR_GMP, LR_OTHERS = 0.1, 0.01
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


def check_protocol(protocol: str) -> str:
  if protocol not in PROTOCOLS:
    raise ValueError(f'--protocol must be one of {", ".join(PROTOCOLS)}, got {protocol!r}.')
  return protocol


def learning_rate(method: str) -> float:
  return LR_GMP if method.startswith('gmp') else LR_OTHERS


def prepare(ds: uci_data.Dataset, protocol: str, num_splits: int, seed: int,
            dtype=np.float64) -> dict[str, np.ndarray]:
  """Stacked, standardized splits: `x_*` `(num_splits, rows, d)`, `y_*` `(num_splits, rows, 1)`.

  `fit` is what the model trains on; `mon` what plateau and early stopping
  monitor (the test split for `reference`, the validation part for `clean`);
  `test` what the RMSE is reported on. Feature statistics come from `fit` only.
  Targets are not scaled (the reference code trains on raw targets).
  """
  check_protocol(protocol)
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

  `keys[i]` initializes split `i`. Returns per-split arrays: `rmse` (test, with
  the weights early stopping kept), `monitor_best` (best monitored MSE),
  `epochs_run`, `best_epoch` (0-based), `final_lr`, `stopped`.
  """
  run = _compiled_trainer(method, np.dtype(data['x_fit'].dtype).name, max_epochs, lr, hidden,
                          plateau_patience, stop_patience, block, chunk_bytes)
  out = run(keys, {k: jnp.asarray(v) for k, v in data.items()})
  return jax.tree.map(np.asarray, out)


@functools.lru_cache(maxsize=64)
def _compiled_trainer(method, dtype, max_epochs, lr, hidden, plateau_patience, stop_patience,
                      block, chunk_bytes):
  """The jitted `run(keys, data)` of `train` (cached, so equal settings compile once per shape)."""
  model = models.MLP(hidden=(hidden,), out=1, method=method, gmp_glorot_scale=True,
                     param_dtype=jnp.dtype(dtype))
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
  plateau = schedules.reduce_on_plateau(factor=0.1, patience=plateau_patience, mode='min')
  stopper = schedules.early_stopping(patience=stop_patience, mode='min')

  def mse(variables, x, y):
    return jnp.mean((model.apply(variables, x, train=False) - y) ** 2)

  def mae_loss(params, others, x, y):
    pred, updates = model.apply({'params': params, **others}, x, train=True, mutable=list(others))
    return jnp.mean(jnp.abs(pred - y)), updates

  def init(key, d):
    variables = model.init(key, d['x_fit'], train=False)
    params = variables['params']
    others = {k: v for k, v in variables.items() if k != 'params'}
    return dict(params=params, others=others, opt=opt.init(params), plateau=plateau.init(lr),
                stop=stopper.init(), best=(params, others))

  def epoch(state, d, in_budget):
    """One full-batch Adam step, then the schedules see the monitored MSE (Keras order)."""
    (_, others), grads = jax.value_and_grad(mae_loss, has_aux=True)(
        state['params'], state['others'], d['x_fit'], d['y_fit'])
    # Flax keeps BN running statistics in float32; keep their dtype stable in the carry.
    others = jax.tree.map(lambda n, o: n.astype(o.dtype), others, state['others'])
    updates, opt_state = opt.update(grads, state['opt'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    monitored = mse({'params': params, **others}, d['x_mon'], d['y_mon'])
    plateau_state = plateau.update(state['plateau'], monitored)
    stop_state = stopper.update(state['stop'], monitored)
    new = dict(params=params, others=others,
               opt=schedules.set_learning_rate(opt_state, plateau_state.lr),
               plateau=plateau_state, stop=stop_state,
               best=schedules.keep_best(stop_state.improved, state['best'], (params, others)))
    # Keras: the epoch that triggers the stop still runs; afterwards the split is frozen.
    active = in_budget & ~state['stop'].stop
    return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, state)

  def finish(state, d):
    # restore_best_weights: Keras (2.x) restores the best weights when it stops early.
    params, others = jax.tree.map(lambda b, c: jnp.where(state['stop'].stop, b, c),
                                  state['best'], (state['params'], state['others']))
    return dict(rmse=jnp.sqrt(mse({'params': params, **others}, d['x_test'], d['y_test'])),
                monitor_best=state['stop'].best, epochs_run=state['stop'].epoch,
                best_epoch=state['stop'].best_epoch, final_lr=state['plateau'].lr,
                stopped=state['stop'].stop)

  def run(keys, data):
    num_splits = keys.shape[0]
    chunk = chunk_size(num_splits, data['x_fit'].shape[1], hidden, data['x_fit'].dtype.itemsize,
                       chunk_bytes)
    num_chunks = num_splits // chunk
    # (num_splits, ...) -> (num_chunks, chunk, ...): the splits of one chunk run under vmap.
    chunked = lambda tree: jax.tree.map(
        lambda a: a.reshape((num_chunks, chunk) + a.shape[1:]), tree)
    state, data = chunked(jax.vmap(init)(keys, data)), chunked(data)

    def chunk_epoch(state, d, in_budget):
      # A chunk whose splits have all stopped is skipped (a real branch, not a mask).
      live = in_budget & jnp.any(~state['stop'].stop)
      return jax.lax.cond(live, lambda s: jax.vmap(epoch, in_axes=(0, 0, None))(s, d, in_budget),
                          lambda s: s, state)

    def scan_step(carry, _):
      t, state = carry
      if num_chunks == 1:
        state = jax.tree.map(lambda a: a[None], chunk_epoch(
            jax.tree.map(lambda a: a[0], state), jax.tree.map(lambda a: a[0], data),
            t < max_epochs))
      else:
        state = jax.lax.map(lambda sd: chunk_epoch(*sd, t < max_epochs), (state, data))
      return (t + 1, state), None

    def running(carry):
      t, state = carry
      return (t < max_epochs) & jnp.any(~state['stop'].stop)

    def run_block(carry):
      return jax.lax.scan(scan_step, carry, None, length=block)[0]

    _, state = jax.lax.while_loop(running, run_block, (jnp.zeros((), jnp.int32), state))
    flat = lambda tree: jax.tree.map(lambda a: a.reshape((num_splits,) + a.shape[2:]), tree)
    return jax.vmap(finish)(flat(state), flat(data))

  return jax.jit(run)


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


def _mean_se(values) -> tuple[float, float]:
  values = np.asarray(values, np.float64)
  se = np.std(values, ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float('nan')
  return float(np.mean(values)), float(se)


def summarize(records: list[dict[str, Any]], datasets, methods) -> dict[str, dict[str, tuple]]:
  """`{dataset: {method: (mean, standard error)}}` of the test RMSE over splits."""
  return {d: {m: _mean_se([r['rmse'] for r in records if r['dataset'] == d and r['method'] == m])
              for m in methods} for d in datasets}


def make_table(records: list[dict[str, Any]], datasets, methods, protocol: str) -> str:
  """Markdown table like Table 3 (methods x datasets), each of our rows above the paper's.

  Best mean per dataset in bold, among ours and among the paper's separately.
  """
  ours = summarize(records, datasets, methods)
  lines = [f'Test RMSE, mean +- standard error over splits (protocol `{protocol}`); '
           '"paper" rows: paper 002, Table 3.', '',
           '| method | ' + ' | '.join(d.capitalize() for d in datasets) + ' |',
           '| --- |' + ' --- |' * len(datasets)]
  best_ours = {d: min(methods, key=lambda m: ours[d][m][0]) for d in datasets}
  paper_methods = [m for m in methods if m in PAPER_TABLE3]
  best_paper = {d: min(paper_methods, key=lambda m: PAPER_TABLE3[m][d][0])
                for d in datasets
                if paper_methods and all(d in PAPER_TABLE3[m] for m in paper_methods)}

  def cell(mean, se, bold):
    text = f'{mean:.3f} +- {se:.3f}'
    return f'**{text}**' if bold else text

  for m in methods:
    name = 'GmP' if m == 'gmp' else m.upper()
    lines.append(f'| {name} | ' + ' | '.join(cell(*ours[d][m], best_ours[d] == m)
                                              for d in datasets) + ' |')
    if m in PAPER_TABLE3:
      lines.append(f'| {name}, paper | ' + ' | '.join(
          cell(*PAPER_TABLE3[m][d], best_paper.get(d) == m) if d in PAPER_TABLE3[m] else '-'
          for d in datasets) + ' |')
  lines.append('')
  if 'gmp' in methods and len(methods) > 1:
    best = [d for d in datasets if best_ours[d] == 'gmp']
    lines.append(f'GmP best (ours): {", ".join(best) or "none"}; not best: '
                 + (', '.join(f'{d} (best {best_ours[d]})' for d in datasets if d not in best)
                    or 'none') + '.')
  return '\n'.join(lines)


def run_study(workdir: str, datasets=uci_data.PAPER_DATASETS, methods=('sp', 'wn', 'bn', 'gmp'),
              num_splits: int = 10, seed: int = 0, protocol: str = 'reference',
              max_epochs: int = 5000, data_dir: str | None = None, float64: bool = False,
              hidden: int = HIDDEN, download: bool = False) -> dict[str, Any]:
  """Runs the study, writes `results.json` and `table.md` to `workdir`; usable from notebooks.

  float64 is enabled only inside this call (`jax.enable_x64`), not globally. `download=True`
  fetches missing data files into the cache (`uci_data.load`).
  """
  check_protocol(protocol)
  methods = models.check_methods(methods)
  datasets = uci_data.check_datasets(datasets, data_dir, download)
  if max_epochs < 1 or num_splits < 1:
    raise ValueError(
        f'--max_epochs and --num_splits must be >= 1, got {max_epochs}, {num_splits}.')
  with jax.enable_x64(float64):
    return _run_study(workdir, datasets, methods, num_splits, seed, protocol, max_epochs,
                      data_dir, float64, hidden, download)


def _run_study(workdir, datasets, methods, num_splits, seed, protocol, max_epochs, data_dir,
               float64, hidden, download=False):
  t_start, cpu_start = time.perf_counter(), time.process_time()
  dtype = np.float64 if float64 else np.float32
  # Load and split everything first, so bad files fail before any training.
  data = {d: prepare(uci_data.load(d, data_dir, download), protocol, num_splits, seed, dtype)
          for d in datasets}
  keys = split_keys(seed, num_splits)
  records = []
  for d in datasets:
    for m in methods:
      t0 = time.perf_counter()
      out = train(m, data[d], keys, max_epochs, learning_rate(m), hidden=hidden)
      seconds = time.perf_counter() - t0
      for i in range(num_splits):
        records.append(dict(
            dataset=d, method=m, split=i, rmse=float(out['rmse'][i]), protocol=protocol,
            monitor_best_mse=float(out['monitor_best'][i]), epochs_run=int(out['epochs_run'][i]),
            best_epoch=int(out['best_epoch'][i]), final_lr=float(out['final_lr'][i]),
            stopped=bool(out['stopped'][i]), seconds_all_splits=seconds))
      mean, se = _mean_se(out['rmse'])
      print(f'[uci_regression] {protocol} {d:>9s} {m:>4s}: test RMSE {mean:.3f} +- {se:.3f}, '
            f'epochs {int(out["epochs_run"].min())}-{int(out["epochs_run"].max())}, '
            f'{seconds:.1f} s incl. compile', flush=True)
  wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
  table = make_table(records, datasets, methods, protocol)
  command = (f'python -m experiments.uci_regression '
             f'--data_dir={data_dir or "$" + uci_data.ENV_VAR}{" --download" if download else ""} '
             f'--datasets={",".join(datasets)} '
             f'--methods={",".join(methods)} --num_splits={num_splits} --seed={seed} '
             f'--protocol={protocol} --max_epochs={max_epochs} --float64={float64} '
             f'--workdir={workdir}')
  footer = (f'\n\n{len(datasets)} datasets x {len(methods)} methods x {num_splits} splits, '
            f'up to {max_epochs} epochs, {"float64" if float64 else "float32"}, '
            f'{jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} CPU cores: '
            f'wall time {wall:.1f} s (process CPU time {cpu:.1f} s).\n'
            f'Command: `{command}`\n')
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(records, f, indent=1)
  with open(os.path.join(workdir, 'table.md'), 'w') as f:
    f.write(table + footer)
  print(table + footer)
  print(f'[uci_regression] wrote results.json and table.md to {workdir}; '
        f'wall time {wall:.1f} s', flush=True)
  return dict(records=records, summary=summarize(records, datasets, methods), table=table,
              wall_seconds=wall, cpu_seconds=cpu)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required (a directory for results.json and table.md).')
  try:
    check_protocol(FLAGS.protocol)
    models.check_methods(FLAGS.methods)
  except ValueError as e:
    raise app.UsageError(str(e) if str(e).startswith('--') else f'--methods: {e}') from e
  try:
    uci_data.check_datasets(FLAGS.datasets, FLAGS.data_dir, FLAGS.download)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  try:
    run_study(FLAGS.workdir, FLAGS.datasets, FLAGS.methods, num_splits=FLAGS.num_splits,
              seed=FLAGS.seed, protocol=FLAGS.protocol, max_epochs=FLAGS.max_epochs,
              data_dir=FLAGS.data_dir, float64=FLAGS.float64, download=FLAGS.download)
  except download_lib.DownloadError as e:
    raise app.UsageError(str(e)) from e


if __name__ == '__main__':
  define_flags()
  app.run(main)
