r"""Train-step cost of geoparam layers against the plain Flax layer, measured in the same run.

  python -m benchmarks.layers [--cases=gmp_dense_b1024,map] [--repeats=10] [--dtype=bfloat16] \
      [--out=FILE.json]

For each case: median train-step time (forward, backward, SGD-momentum update
on the squared error to a fixed random target; jitted, donated, after warm-up)
of the geoparam layer and of its plain Flax baseline, timed in alternation, their
ratio (median over rounds of layer / baseline: the number that matters, these
machines are noisy and absolute times drift), compile time, and the compiled
step's memory (`memory_analysis()`: temporaries + arguments + outputs -
aliased, without the regression target). The `map` case times the
theta -> u map (forward + backward) against `sin`/`cos` of the same array, its
floor, computed with `geoparam.hyperspherical.sincos` (and, for reference, with
`jnp.sin`/`jnp.cos`), and the CPU map's three row-by-row scans with no sin/cos
in them, its loop floor (`map` at (1023, 1024); `map_4608x512` at GmPConv 512c's
theta). `--dtype` is the computation dtype of the layer AND its baseline (inputs in
it, params float32, the map in float32 whatever it is; the loss in float32). The
`gmp_imn_conv_*` cases time GmPConv with IMN against GmPConv without it (IMN's
own cost), `gmp_imn_wrap_conv_*` the same through `geoparam.GmP(nn.Conv)`.
`--tiny` shrinks every shape (the test suite runs that).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import time
from typing import Any, Callable

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import geoparam
from geoparam import hyperspherical

FLAGS = flags.FLAGS
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_list('cases', [], 'Cases to run (default: all). See CASES.')
  flags.DEFINE_integer('repeats', 10, 'Timed steps per layer (median reported).')
  flags.DEFINE_bool('tiny', False, 'Tiny shapes (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')
  flags.DEFINE_enum('dtype', 'float32', list(DTYPES),
                    'Computation dtype of the layers and their baselines (params stay float32).')


@dataclasses.dataclass(frozen=True)
class Case:
  """A layer, its baseline and the input shape; `baseline_of` names another case's layer."""
  name: str
  make: Callable[[bool, Any], nn.Module]  # (tiny, dtype) -> module
  baseline: Callable[[bool, Any], nn.Module]
  shape: Callable[[bool], tuple[int, ...]]
  target: float
  needs_stats: bool = False


def _relu_after(layer):
  return nn.Sequential([layer, nn.relu])


class _Stats(nn.Module):
  """Calls a layer that takes `use_running_average` in training mode."""
  layer: nn.Module

  def __call__(self, x):
    return self.layer(x, use_running_average=False)


def _dense_case(name, batch, target, make, baseline=None):
  return Case(
      name, make=lambda tiny, dtype: make(16 if tiny else 1024, dtype),
      baseline=baseline or (
          lambda tiny, dtype: _relu_after(nn.Dense(16 if tiny else 1024, dtype=dtype))),
      shape=lambda tiny: (8, 16) if tiny else (batch, 1024), target=target)


def _conv_shape(channels, spatial):
  return lambda tiny: (2, 6, 6, 4) if tiny else (64, spatial, spatial, channels)


def _conv_case(name, channels, spatial, make, target, baseline=None):
  return Case(
      name, make=lambda tiny, dtype: make(4 if tiny else channels, dtype),
      baseline=lambda tiny, dtype: (baseline or (lambda f, dt: _relu_after(
          nn.Conv(f, (3, 3), dtype=dt))))(4 if tiny else channels, dtype),
      shape=_conv_shape(channels, spatial), target=target)


CONV_SHAPES = ((128, 32), (256, 16), (512, 8))
CASES = [
    _dense_case('gmp_dense_b256', 256, 2.5, lambda f, dt: geoparam.GmPDense(f, dtype=dt)),
    _dense_case('gmp_dense_b1024', 1024, 1.5, lambda f, dt: geoparam.GmPDense(f, dtype=dt)),
    _dense_case('gmp_imn_dense_b1024', 1024, 1.05,
                lambda f, dt: _Stats(geoparam.GmPDense(f, input_mean_norm=True, dtype=dt)),
                baseline=lambda tiny, dt: geoparam.GmPDense(16 if tiny else 1024, dtype=dt)),
    _dense_case('lcw_dense_b1024', 1024, 1.10,
                lambda f, dt: _relu_after(geoparam.LCWDense(f, dtype=dt))),
    _dense_case('wn_dense_b1024', 1024, float('nan'),
                lambda f, dt: _relu_after(nn.WeightNorm(nn.Dense(f, dtype=dt)))),
] + [
    _conv_case(f'gmp_conv_{c}c_{s}px', c, s,
               lambda f, dt: geoparam.GmPConv(f, (3, 3), dtype=dt), 1.10)
    for c, s in CONV_SHAPES
] + [
    # IMN's own cost: GmPConv with IMN (training mode) against GmPConv without it.
    _conv_case(f'gmp_imn_conv_{c}c_{s}px', c, s,
               lambda f, dt: _Stats(geoparam.GmPConv(f, (3, 3), input_mean_norm=True, dtype=dt)),
               1.02, baseline=lambda f, dt: geoparam.GmPConv(f, (3, 3), dtype=dt))
    for c, s in CONV_SHAPES
] + [
    _conv_case(f'gmp_imn_wrap_conv_{c}c_{s}px', c, s,
               lambda f, dt: _relu_after(_Stats(geoparam.GmP(nn.Conv(f, (3, 3), dtype=dt),
                                                             input_mean_norm=True))),
               1.02, baseline=lambda f, dt: _relu_after(geoparam.GmP(nn.Conv(f, (3, 3),
                                                                              dtype=dt))))
    for c, s in CONV_SHAPES[:1]
] + [
    _conv_case(f'lcw_conv_{c}c_{s}px', c, s,
               lambda f, dt: _relu_after(geoparam.LCWConv(f, (3, 3), dtype=dt)), 1.10)
    for c, s in CONV_SHAPES
]
# The map alone at the Dense shape and at GmPConv 512c's theta (fan-in 3 * 3 * 512 = 4608).
MAP_SHAPES = {'map': (1024, 1024), 'map_4608x512': (4608, 512)}
CASE_NAMES = [c.name for c in CASES] + list(MAP_SHAPES)


def _train_step(model: nn.Module, x: jax.Array):
  """Jitted SGD-momentum step on `mean((model(x) - target)^2)`.

  Returns (step, state, batch, compile seconds, memory); call `step(state, *batch)`.
  The regression target is a fixed random array (an argument, not a constant).
  With a target-free loss such as `mean(y^2)` XLA derives the cotangent from y
  inside the plain layer's relu-gradient fusion, a saving no layer inside a
  network gets (its cotangent comes from the layer above); that flattered the
  plain conv's memory by one activation-sized buffer.
  """
  variables = model.init(jax.random.key(0), x)
  mutable = [k for k in variables if k != 'params']
  out = jax.eval_shape(lambda v, x: model.apply(v, x, mutable=mutable)[0], variables, x)
  batch = (x, jax.random.normal(jax.random.key(2), out.shape, jnp.float32))
  params = variables['params']
  others = {k: v for k, v in variables.items() if k != 'params'}
  opt = optax.sgd(1e-3, momentum=0.9)

  def step(state, x, target):
    params, opt_state, others = state

    def loss(p):
      y, upd = model.apply({'params': p, **others}, x, mutable=list(others))
      return jnp.mean(jnp.square(y.astype(jnp.float32) - target)), upd

    (_, upd), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, upd

  state = (params, opt.init(params), others)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=0).lower(state, *batch).compile()
  compile_s = time.perf_counter() - t0
  # The target exists only because of the benchmark's loss: leave it out of the memory.
  return compiled, state, batch, compile_s, _memory(compiled, exclude_bytes=batch[1].nbytes)


def _memory(compiled, exclude_bytes: int = 0) -> int | None:
  """Compiled step's bytes: temporaries + arguments + outputs - aliased - `exclude_bytes`."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # not available on every backend
    return None
  if m is None:
    return None
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
             - m.alias_size_in_bytes - exclude_bytes)


def _interleaved(fns, repeats) -> np.ndarray:
  """Seconds per call of each thunk in `fns`, shape (len(fns), repeats), timed in turns.

  One call of each thunk per round, after one untimed warm-up call of each:
  timing the layer and its baseline in alternation, rather than one after the
  other, keeps the slow drift of a shared machine out of their ratio.
  """
  for fn in fns:
    fn()
  times = np.zeros((len(fns), repeats))
  for r in range(repeats):
    for i, fn in enumerate(fns):
      t0 = time.perf_counter()
      fn()
      times[i, r] = time.perf_counter() - t0
  return times


def _paired_ratio(a: np.ndarray, b: np.ndarray) -> float:
  """Median over rounds of `a / b` (both timed in the same rounds)."""
  return float(np.median(a / b))


class _Stepper:
  """A compiled train step and its (donated) state; each call runs one step to completion."""

  def __init__(self, step, state, batch):
    self.step, self.state, self.batch = step, state, batch

  def __call__(self):
    self.state = self.step(self.state, *self.batch)
    jax.block_until_ready(self.state)


def run_case(case: Case, tiny: bool, repeats: int, dtype: str = 'float32') -> dict[str, Any]:
  """Times `case` (layer and baseline in computation dtype `dtype`, inputs in it)."""
  dt = DTYPES[dtype]
  x = jax.random.normal(jax.random.key(1), case.shape(tiny), jnp.float32).astype(dt)
  row = {'case': case.name, 'shape': list(x.shape), 'dtype': dtype, 'target_ratio': case.target}
  steppers = []
  for role, make in (('layer', case.make), ('baseline', case.baseline)):
    step, state, batch, compile_s, mem = _train_step(make(tiny, dt), x)
    steppers.append(_Stepper(step, state, batch))
    row[f'{role}_compile_s'] = compile_s
    row[f'{role}_bytes'] = mem
  layer_s, base_s = _interleaved(steppers, repeats)
  row.update(layer_ms=1e3 * float(np.median(layer_s)), baseline_ms=1e3 * float(np.median(base_s)),
             ratio=_paired_ratio(layer_s, base_s))
  if row['layer_bytes'] and row['baseline_bytes']:
    row['memory_ratio'] = row['layer_bytes'] / row['baseline_bytes']
  return row


def _bare_scans(theta, g):
  """The loop structure of the CPU map with no sin/cos: two forward scans, one reverse.

  Built from the library's own sequential scans (`prefix_product`, `suffix_affine`).
  On GPU/TPU the map uses associative scans instead; there this figure only says
  what the CPU schedule would cost.
  """
  p = hyperspherical.prefix_product(theta, 'sequential')
  q = hyperspherical.prefix_product(p, 'sequential')
  return hyperspherical.suffix_affine(g[:-1] * q, theta, 'sequential')


def run_map(tiny: bool, repeats: int, name: str = 'map') -> dict[str, Any]:
  """The theta -> u map (fast and plain cumprod form) vs sin/cos of the same array, fwd + bwd.

  Also times `_bare_scans`: the three row-by-row `lax.scan`s of the CPU map
  with only multiplies and adds in them, i.e. the loop cost the map pays for
  keeping theta as its only residual, whatever its sin/cos cost.
  """
  n, m = (17, 8) if tiny else MAP_SHAPES[name]
  theta = jax.random.uniform(jax.random.key(2), (n - 1, m), jnp.float32, 0.1, 3.0)
  g = jax.random.normal(jax.random.key(3), (n, m), jnp.float32)

  def grad_of(f):
    return jax.jit(jax.grad(lambda t: jnp.sum(f(t) * g)))

  # The floor: sin AND cos of every angle, forward and backward, nothing else, with the
  # fastest sin/cos we have (`hyperspherical.sincos`: one-pass polynomial on CPU, jnp
  # elsewhere); XLA's own jnp.sin/jnp.cos are timed too (on CPU they are ~15x slower).
  def floor_with(sincos):
    def f(t):
      s, c = sincos(t)
      return jnp.sum(s * g[:-1] + c * g[1:])
    return jax.jit(jax.grad(f))

  floor = floor_with(hyperspherical.sincos)
  jnp_floor = floor_with(lambda t: (jnp.sin(t), jnp.cos(t)))
  fast = grad_of(hyperspherical.to_cartesian_batched)
  plain = grad_of(hyperspherical.to_cartesian_reference)

  scans = jax.jit(lambda t: _bare_scans(t, g))
  names = ('layer', 'cumprod', 'jnp_floor', 'bare_scans', 'baseline')
  thunks = [functools.partial(lambda f: f(theta).block_until_ready(), f)
            for f in (fast, plain, jnp_floor, scans, floor)]
  times = dict(zip(names, _interleaved(thunks, repeats)))
  row = {'case': name, 'shape': [n - 1, m], 'target_ratio': 2.5}
  row.update({f'{k}_ms': 1e3 * float(np.median(t)) for k, t in times.items()})
  row['ratio'] = _paired_ratio(times['layer'], times['baseline'])
  row['ratio_to_jnp_floor'] = _paired_ratio(times['layer'], times['jnp_floor'])
  row['bare_scans_to_floor'] = _paired_ratio(times['bare_scans'], times['baseline'])
  return row


def run(cases=(), tiny=False, repeats=10, out=None, dtype='float32') -> list[dict[str, Any]]:
  """Runs the chosen cases (all by default), prints a table, optionally writes JSON.

  `dtype` (`'float32'` or `'bfloat16'`) is the computation dtype of every layer
  case and its baseline; the map cases always run in float32.
  """
  unknown = [c for c in cases if c not in CASE_NAMES]
  if unknown:
    raise ValueError(f'unknown cases {unknown}; accepted: {", ".join(CASE_NAMES)}.')
  if dtype not in DTYPES:
    raise ValueError(f'unknown dtype {dtype!r}; accepted: {", ".join(DTYPES)}.')
  chosen = list(cases) or CASE_NAMES
  device = jax.devices()[0]
  print(f'# backend={jax.default_backend()} device={device.device_kind} '
        f'jax={jax.__version__} host={platform.node()} tiny={tiny} repeats={repeats} '
        f'dtype={dtype}', flush=True)
  print(f'{"case":28s} {"layer ms":>9s} {"base ms":>9s} {"ratio":>6s} {"target":>6s} '
        f'{"compile s":>9s} {"mem ratio":>9s}', flush=True)
  rows = []
  for name in chosen:
    if name in MAP_SHAPES:
      row = run_map(tiny, repeats, name)
    else:
      row = run_case(next(c for c in CASES if c.name == name), tiny, repeats, dtype)
    rows.append(row)
    mem = row.get('memory_ratio')
    print(f'{row["case"]:28s} {row["layer_ms"]:9.3f} {row["baseline_ms"]:9.3f} '
          f'{row["ratio"]:6.2f} {row["target_ratio"]:6.2f} '
          f'{row.get("layer_compile_s", float("nan")):9.2f} '
          f'{mem if mem is not None else float("nan"):9.2f}', flush=True)
    if name in MAP_SHAPES:
      print(f'{"":28s} (vs jnp.sin/jnp.cos: {row["jnp_floor_ms"]:.3f} ms, ratio '
            f'{row["ratio_to_jnp_floor"]:.2f}; three bare scans {row["bare_scans_ms"]:.3f} ms, '
            f'{row["bare_scans_to_floor"]:.2f}x the floor; plain cumprod map '
            f'{row["cumprod_ms"]:.3f} ms)', flush=True)
  if out:
    with open(out, 'w') as f:
      json.dump({'backend': jax.default_backend(), 'device': device.device_kind,
                 'jax': jax.__version__, 'tiny': tiny, 'repeats': repeats, 'dtype': dtype,
                 'rows': rows}, f,
                indent=2)
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    run(FLAGS.cases, FLAGS.tiny, FLAGS.repeats, FLAGS.out, FLAGS.dtype)
  except ValueError as e:
    raise app.UsageError(str(e)) from e


if __name__ == '__main__':
  define_flags()
  app.run(main)
