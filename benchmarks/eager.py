r"""Eager (un-jitted) `init` and `apply` of every geoparam layer against its plain Flax layer.

  python -m benchmarks.eager [--cases=GmPDense,GmP(Conv)] [--repeats=20] [--out=FILE.json] [--tiny]

Notebooks, debugging and analysis code call layers without `jax.jit`. For each
layer this times `layer.init(key, x)` and `layer.apply(variables, x)` called
eagerly: the first call (tracing and compiling included) and the median of the
next `repeats` calls (the steady state, where nothing may recompile), layer and
plain baseline in alternation, and prints the steady-state ratios (target <= 3).
"""

from __future__ import annotations

import json
import platform
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import numpy as np

import geoparam

FLAGS = flags.FLAGS


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_list('cases', [], 'Cases to run (default: all). See cases().')
  flags.DEFINE_integer('repeats', 20, 'Timed eager calls per layer after the first.')
  flags.DEFINE_bool('tiny', False, 'Tiny shapes (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


def cases(tiny: bool):
  """`name -> (layer, plain baseline, input shape, apply kwargs)`."""
  f, c = (8, 4) if tiny else (256, 64)
  dense_x, conv_x = (4, f), (2, 8, 8, 3) if tiny else (8, 32, 32, 32)
  imn = {'use_running_average': True}
  return {
      'GmPDense': (geoparam.GmPDense(f), nn.Dense(f), dense_x, {}),
      'GmPDense+IMN': (geoparam.GmPDense(f, input_mean_norm=True), nn.Dense(f), dense_x, imn),
      'GmPConv': (geoparam.GmPConv(c, (3, 3)), nn.Conv(c, (3, 3)), conv_x, {}),
      'LCWDense': (geoparam.LCWDense(f), nn.Dense(f), dense_x, {}),
      'LCWConv': (geoparam.LCWConv(c, (3, 3)), nn.Conv(c, (3, 3)), conv_x, {}),
      'CWNDense': (geoparam.CWNDense(f), nn.Dense(f), dense_x, {}),
      'GmP(Dense)': (geoparam.GmP(nn.Dense(f)), nn.Dense(f), dense_x, {}),
      'GmP(Dense)+IMN': (geoparam.GmP(nn.Dense(f), input_mean_norm=True), nn.Dense(f), dense_x,
                         imn),
      'GmP(Conv)': (geoparam.GmP(nn.Conv(c, (3, 3))), nn.Conv(c, (3, 3)), conv_x, {}),
      'LCW(Conv)': (geoparam.LCW(nn.Conv(c, (3, 3))), nn.Conv(c, (3, 3)), conv_x, {}),
      'CWN(Dense)': (geoparam.CWN(nn.Dense(f)), nn.Dense(f), dense_x, {}),
      'WN(Dense)': (geoparam.WN(nn.Dense(f)), nn.Dense(f), dense_x, {}),
  }


def _seconds(fn):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def measure(layer, baseline, shape, kwargs, repeats):
  """First-call and median steady-state ms of eager init and apply, layer and baseline."""
  x = jax.random.normal(jax.random.key(0), shape)
  key = jax.random.key(1)
  row = {}
  thunks = {}
  for who, module, kw in (('layer', layer, kwargs), ('baseline', baseline, {})):
    row[f'{who}_init_first_ms'] = 1e3 * _seconds(lambda m=module, k=kw: m.init(key, x, **k))
    variables = module.init(key, x, **kw)
    row[f'{who}_apply_first_ms'] = 1e3 * _seconds(lambda m=module, v=variables, k=kw: m.apply(
        v, x, **k))
    thunks[who] = {'init': lambda m=module, k=kw: m.init(key, x, **k),
                   'apply': lambda m=module, v=variables, k=kw: m.apply(v, x, **k)}
  for what in ('init', 'apply'):
    times = {'layer': [], 'baseline': []}
    for _ in range(repeats):  # in alternation, so drift hits both alike
      for who in ('layer', 'baseline'):
        times[who].append(_seconds(thunks[who][what]))
    for who in times:
      row[f'{who}_{what}_ms'] = 1e3 * float(np.median(times[who]))
    row[f'{what}_ratio'] = float(np.median(np.asarray(times['layer']) /
                                           np.asarray(times['baseline'])))
  return row


def run(names=None, tiny=False, repeats=20, out=None):
  """Measures the named cases (default: all); prints a table; returns the rows."""
  table = cases(tiny)
  names = list(table) if not names else list(names)
  unknown = [n for n in names if n not in table]
  if unknown:
    raise ValueError(f'unknown cases {unknown}; accepted: {", ".join(table)}.')
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  rows = []
  print(f'{"layer":16s} {"apply ms":>9s} {"plain ms":>9s} {"ratio":>6s} {"init ms":>8s} '
        f'{"plain ms":>9s} {"ratio":>6s} {"1st apply ms":>12s}')
  for name in names:
    row = {'case': name, **measure(*table[name], repeats)}
    rows.append(row)
    print(f'{name:16s} {row["layer_apply_ms"]:9.2f} {row["baseline_apply_ms"]:9.2f} '
          f'{row["apply_ratio"]:6.2f} {row["layer_init_ms"]:8.2f} {row["baseline_init_ms"]:9.2f} '
          f'{row["init_ratio"]:6.2f} {row["layer_apply_first_ms"]:12.1f}', flush=True)
  if out:
    with open(out, 'w') as f:
      json.dump({'rows': rows, 'tiny': tiny, 'repeats': repeats, 'backend': jax.default_backend(),
                 'machine': platform.machine(), 'jax': jax.__version__}, f, indent=1)
  return rows


def main(argv):
  del argv
  run(FLAGS.cases, tiny=FLAGS.tiny, repeats=FLAGS.repeats, out=FLAGS.out)


if __name__ == '__main__':
  define_flags()
  app.run(main)
