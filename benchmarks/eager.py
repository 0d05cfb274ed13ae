r"""Eager (un-jitted) `init` and `apply` of every geoparam layer against its plain Flax layer.

  python -m benchmarks.eager [--cases=GmPDense,nnx:GmP(Conv)] [--repeats=20] [--out=FILE.json] \
      [--tiny]

Notebooks, debugging and analysis code call layers without `jax.jit`. For each
linen layer this times `layer.init(key, x)` and `layer.apply(variables, x)`
called eagerly; for each `geoparam.nnx` layer (cases `nnx:...`), "init" is
constructing the module (`gnnx.GmP(nnx.Linear(...), rngs=...)`, the wrapped
layer's construction included, as in its baseline) and "apply" is calling it,
`module(x)` (with IMN in train mode the call updates the running mean in
place, as `nnx.BatchNorm` does), against `nnx.Linear`/`nnx.Conv` of the same
shapes. Each: the first call (tracing and compiling included) and the median of
the next `repeats` calls (the steady state, where nothing may recompile), layer
and plain baseline in alternation, and the steady-state ratios (target <= 3).
"""

from __future__ import annotations

import json
import platform
import time
from typing import Any, Callable, NamedTuple

from absl import app
from absl import flags
import flax.linen as nn
from flax import nnx
import jax
import numpy as np

import geoparam
import geoparam.nnx as gnnx

FLAGS = flags.FLAGS


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_list('cases', [], 'Cases to run (default: all). See cases().')
  flags.DEFINE_integer('repeats', 20, 'Timed eager calls per layer after the first.')
  flags.DEFINE_bool('tiny', False, 'Tiny shapes (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


class NNXCase(NamedTuple):
  """An NNX case: builders of the layer and of its plain NNX baseline (each call a new module)."""
  make: Callable[[], nnx.Module]
  make_baseline: Callable[[], nnx.Module]
  shape: tuple[int, ...]
  kwargs: dict[str, Any]


def cases(tiny: bool):
  """`name -> (layer, plain baseline, input shape, apply kwargs)`, or an `NNXCase`."""
  f, c = (8, 4) if tiny else (256, 64)
  dense_x, conv_x = (4, f), (2, 8, 8, 3) if tiny else (8, 32, 32, 32)
  cin = conv_x[-1]
  imn = {'use_running_average': True}

  def linear():  # NNX builders: every call constructs a new module (fresh Rngs)
    return nnx.Linear(f, f, rngs=nnx.Rngs(0))

  def conv():
    return nnx.Conv(cin, c, (3, 3), rngs=nnx.Rngs(0))

  def gmp_linear(**kw):
    return lambda: gnnx.GmPLinear(f, f, rngs=nnx.Rngs(0), **kw)

  def wrapped(wrapper, layer, seeded=False, **kw):  # seeded: rngs=nnx.Rngs(1), a fresh one
    return lambda: wrapper(layer(), **({'rngs': nnx.Rngs(1)} if seeded else {}), **kw)

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
      'nnx:GmPLinear': NNXCase(gmp_linear(), linear, dense_x, {}),
      'nnx:GmPLinear+IMN': NNXCase(gmp_linear(input_mean_norm=True), linear, dense_x, {}),
      'nnx:GmPLinear+IMN(eval)': NNXCase(gmp_linear(input_mean_norm=True), linear, dense_x, imn),
      'nnx:GmPConv': NNXCase(lambda: gnnx.GmPConv(cin, c, (3, 3), rngs=nnx.Rngs(0)), conv,
                             conv_x, {}),
      'nnx:GmP(Linear)': NNXCase(wrapped(gnnx.GmP, linear, seeded=True), linear, dense_x, {}),
      'nnx:GmP(Linear)+IMN': NNXCase(wrapped(gnnx.GmP, linear, seeded=True, input_mean_norm=True),
                                     linear, dense_x, {}),
      'nnx:GmP(Conv)': NNXCase(wrapped(gnnx.GmP, conv, seeded=True), conv, conv_x, {}),
      'nnx:LCW(Linear)': NNXCase(wrapped(gnnx.LCW, linear), linear, dense_x, {}),
      'nnx:LCW(Conv)': NNXCase(wrapped(gnnx.LCW, conv), conv, conv_x, {}),
      'nnx:CWN(Linear)': NNXCase(wrapped(gnnx.CWN, linear), linear, dense_x, {}),
      'nnx:WN(Linear)': NNXCase(wrapped(gnnx.WN, linear), linear, dense_x, {}),
  }


def _seconds(fn):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _linen_thunks(layer, baseline, shape, kwargs):
  """`{who: (init thunk, builder of the apply thunk)}` of a linen case, `who` layer/baseline."""
  x = jax.random.normal(jax.random.key(0), shape)
  key = jax.random.key(1)
  thunks = {}
  for who, module, kw in (('layer', layer, kwargs), ('baseline', baseline, {})):
    def applier(m=module, k=kw):
      variables = m.init(key, x, **k)
      return lambda: m.apply(variables, x, **k)
    thunks[who] = (lambda m=module, k=kw: m.init(key, x, **k), applier)
  return thunks


def _nnx_thunks(case: NNXCase):
  """The same for an NNX case: init builds a module (its state returned), apply calls one."""
  x = jax.random.normal(jax.random.key(0), case.shape)
  thunks = {}
  for who, make, kw in (('layer', case.make, case.kwargs), ('baseline', case.make_baseline, {})):
    def applier(make=make, k=kw):
      module = make()
      return lambda: module(x, **k)
    thunks[who] = (lambda make=make: nnx.state(make()), applier)
  return thunks


def measure(layer, baseline=None, shape=None, kwargs=None, repeats=20):
  """First-call and median steady-state ms of eager init and apply, layer and baseline.

  `layer` is a linen module (with `baseline`, `shape`, `kwargs`) or an `NNXCase`.
  """
  if isinstance(layer, NNXCase):
    built = _nnx_thunks(layer)
  else:
    built = _linen_thunks(layer, baseline, shape, kwargs or {})
  row = {}
  thunks = {}
  for who, (init, applier) in built.items():
    row[f'{who}_init_first_ms'] = 1e3 * _seconds(init)
    apply = applier()
    row[f'{who}_apply_first_ms'] = 1e3 * _seconds(apply)
    thunks[who] = {'init': init, 'apply': apply}
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
  print(f'{"layer":24s} {"apply ms":>9s} {"plain ms":>9s} {"ratio":>6s} {"init ms":>8s} '
        f'{"plain ms":>9s} {"ratio":>6s} {"1st apply ms":>12s}')
  for name in names:
    case = table[name]
    case = (case,) if isinstance(case, NNXCase) else case
    row = {'case': name, **measure(*case, repeats=repeats)}
    rows.append(row)
    print(f'{name:24s} {row["layer_apply_ms"]:9.2f} {row["baseline_apply_ms"]:9.2f} '
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
