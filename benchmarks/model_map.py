r"""The theta -> u map of a whole model's GmP layers, forward and backward: its share of a step.

  python -m benchmarks.model_map [--models=resnet50,vgg6] [--maps=default] [--repeats=7] \
      [--bandwidth_gbs=0] [--out=FILE.json] [--tiny]

Every `theta` of the model's GmP+IMN parameters (`vision_models`, the shapes of
`benchmarks.vision_throughput`'s models; a "model" like `1023x1024` is one theta of that
shape) is mapped to `u(theta)`, and the gradient of `sum(<u, w> + <u, u> / 2)` (w a fixed
random array) with respect to all thetas is taken, in one jitted function: what a train step
spends on the map, forward and backward, whatever the batch or the image size. (A loss linear
in u would let XLA drop the forward.)

`--maps` lists the forms of the map to time, each in its own compiled function:

- `default`: `to_cartesian_batched` as the layers call it (its scheme by backend);
- `native`: the CPU's native kernels (`geoparam.native`), forced (on the CPU `default` is this
  one where they can be built);
- `sequential`, `associative`: the library's scan schemes, forced (`associative` on the CPU runs
  the accelerators' form there, with the CPU's range `lax.cond` in `sincos`);
- `window`: an experimental accelerator form kept here, not in the library: `lax.cumprod` for
  the prefix products of sines and ONE variadic `lax.reduce_window` for the backward's suffix
  recurrence `R_k = g_{k+1} c_{k+1} + s_{k+1} R_{k+1}`, with whole-array `jnp.sin`/`jnp.cos`.
  XLA:CPU runs out of memory compiling that reduce-window for some row counts above 256 (300,
  511, 512 and 4607 rows aborted the process with `std::bad_alloc`; 1023 compiled), so on the
  CPU it is for small (`--tiny`) models only.

Reported per model and map: the number of GmP layers and angles; the compile time (tracing
included); the median and min ms per call over `--repeats` calls; the number of StableHLO ops
of the lowered function (a function called by several layers of one shape counts once) and of
instructions in the optimized HLO (every layer, fusions' bodies included); the memory floor of
the map, 5 x 4 bytes per angle (read theta and write u forward; read theta and the cotangent
and write dL/dtheta backward), and with `--bandwidth_gbs` the time that takes and the measured
time over it; and, for every map after the first, the largest difference of its gradient from
the first map's, over the largest entry of that gradient. `--tiny` shrinks the models (the test
suite runs that).
"""

from __future__ import annotations

import functools
import json
import platform
import re
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import geoparam
from geoparam import hyperspherical
from benchmarks import vision_throughput

FLAGS = flags.FLAGS

MAPS = ('default', 'native', 'sequential', 'associative', 'window')
_SHAPE = re.compile(r'[0-9]+x[0-9]+')


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_list('models', list(vision_throughput.MODELS),
                    f'Models, among {", ".join(vision_throughput.MODELS)}, or one layer\'s theta '
                    'shape such as 1023x1024.')
  flags.DEFINE_list('maps', ['default'], f'Forms of the map, among {", ".join(MAPS)}.')
  flags.DEFINE_integer('repeats', 7, 'Timed calls per model and map.')
  flags.DEFINE_float('bandwidth_gbs', 0.0,
                     'Memory bandwidth in GB/s, for the floor in ms (0: bytes only). H100 SXM '
                     '3350, H200 4800.')
  flags.DEFINE_bool('tiny', False, 'Tiny models (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


def thetas_of(name: str, tiny: bool = False) -> list[jax.ShapeDtypeStruct]:
  """The shapes of every `theta` of model `name` under GmP+IMN, in parameter-tree order; a
  `name` like `1023x1024` is one layer's theta of that shape."""
  if _SHAPE.fullmatch(name):
    return [jax.ShapeDtypeStruct(tuple(int(v) for v in name.split('x')), jnp.float32)]
  model, shape = vision_throughput.build(name, 'gmp_imn', tiny)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1,) + shape)))
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(variables['params'])
          if jax.tree_util.keystr(path).endswith("['theta']")]


# --- the experimental `window` form ------------------------------------------------------------


def _compose(first, second):
  """`y -> a1 + b1 y` after `y -> a2 + b2 y`: the earlier row's affine map applied last."""
  a1, b1 = first
  a2, b2 = second
  return a1 + b1 * a2, b1 * b2


def _suffix_affine_window(a, b):
  """`y_j = a_j + b_j y_{j+1}`, `y_L = 0`, along axis 0, as ONE variadic reduce-window op: row
  j's window covers rows j..L-1 (padded at the end with the identity map (0, 1))."""
  length = a.shape[0]
  window = (length,) + (1,) * (a.ndim - 1)
  padding = ((0, length - 1),) + ((0, 0),) * (a.ndim - 1)
  y, _ = jax.lax.reduce_window((a, b), (jnp.zeros((), a.dtype), jnp.ones((), b.dtype)), _compose,
                               window, (1,) * a.ndim, padding)
  return y


def _exclusive_products(s):
  p = jax.lax.cumprod(s, axis=0)
  return jnp.concatenate([jnp.ones_like(s[:1]), p[:-1]]), p[-1:]


@jax.custom_vjp
def _window_map(theta):
  return _window_fwd(theta)[0]


def _window_fwd(theta):
  s, c = jnp.sin(theta), jnp.cos(theta)
  p_excl, p_last = _exclusive_products(s)
  return jnp.concatenate([p_excl * c, p_last]), (s, c)


def _window_bwd(res, g):
  s, c = res
  p_excl, _ = _exclusive_products(s)
  a = jnp.concatenate([g[1:-1] * c[1:], g[-1:]])  # a_k = g_{k+1} c_{k+1}, last: g_n
  b = jnp.concatenate([s[1:], jnp.zeros_like(s[:1])])  # b_k = s_{k+1}
  return (p_excl * (c * _suffix_affine_window(a, b) - s * g[:-1]),)


_window_map.defvjp(_window_fwd, _window_bwd)


def map_fn(name: str):
  """`theta (n - 1, m) -> u (n, m)` in float32 for the map form `name` (see `MAPS`)."""
  if name == 'default':
    return geoparam.gmp_kernel
  if name in hyperspherical.SCHEMES:
    return functools.partial(hyperspherical.to_cartesian_batched, scheme=name)
  if name == 'window':
    return lambda t: _window_map(t) if t.shape[0] else jnp.ones((1,) + t.shape[1:], t.dtype)
  raise ValueError(f'unknown map {name!r}; accepted: {", ".join(MAPS)}.')


def _stablehlo_ops(text: str) -> int:
  return sum(1 for line in text.splitlines() if re.search(r'\b(stablehlo|chlo)\.[a-z_]+', line))


def _hlo_instructions(text: str) -> int:
  return sum(1 for line in text.splitlines() if re.match(r'\s+(ROOT )?%?[\w.\-]+ = ', line))


def run(models=vision_throughput.MODELS, repeats: int = 7, tiny: bool = False,
        out: str | None = None, maps=('default',), bandwidth_gbs: float = 0.0) -> list[dict]:
  """Times the map of each model (see the module docstring); returns one row per model and map."""
  unknown = [m for m in models if m not in vision_throughput.MODELS and not _SHAPE.fullmatch(m)]
  if unknown or not models:
    raise ValueError(f'unknown models {unknown or list(models)}; accepted: '
                     f'{", ".join(vision_throughput.MODELS)} or a theta shape like 1023x1024.')
  bad = [m for m in maps if m not in MAPS]
  if bad or not maps:
    raise ValueError(f'unknown maps {bad or list(maps)}; accepted: {", ".join(MAPS)}.')
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  rng = np.random.default_rng(0)
  rows = []
  for name in models:
    shapes = thetas_of(name, tiny)
    thetas = [jnp.asarray(rng.uniform(0.3, 2.8, t.shape), jnp.float32) for t in shapes]
    weights = [jnp.asarray(rng.normal(size=(t.shape[0] + 1,) + t.shape[1:]), jnp.float32)
               for t in shapes]
    angles = int(sum(np.prod(t.shape) for t in shapes))
    first_grads = None
    for map_name in maps:
      fn = map_fn(map_name)

      def loss(ts, fn=fn):
        us = [fn(t) for t in ts]
        return sum(jnp.vdot(u, w) + 0.5 * jnp.vdot(u, u) for u, w in zip(us, weights))

      start = time.perf_counter()
      lowered = jax.jit(jax.grad(loss)).lower(thetas)
      step = lowered.compile()
      compile_s = time.perf_counter() - start
      grads = jax.block_until_ready(step(thetas))
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(thetas))
        times.append(time.perf_counter() - start)
      row = {'model': name, 'map': map_name, 'layers': len(shapes), 'angles': angles,
             'compile_s': compile_s, 'ms': 1e3 * float(np.median(times)),
             'min_ms': 1e3 * float(np.min(times)),
             'stablehlo_ops': _stablehlo_ops(lowered.as_text()),
             'hlo_instructions': _hlo_instructions(step.as_text()),
             'floor_bytes': 5 * 4 * angles}
      report = (f'{name:9s} {map_name:11s} {row["layers"]} GmP layers, {angles:,} angles: '
                f'fwd+bwd {row["ms"]:.2f} ms (min {row["min_ms"]:.2f}), compile {compile_s:.2f} s, '
                f'{row["stablehlo_ops"]} StableHLO ops, {row["hlo_instructions"]} optimized HLO '
                f'instructions ({row["hlo_instructions"] / len(shapes):.0f} per layer)')
      if bandwidth_gbs > 0:
        row['floor_ms'] = 1e3 * row['floor_bytes'] / (bandwidth_gbs * 1e9)
        row['over_floor'] = row['min_ms'] / row['floor_ms']
        report += f', floor {row["floor_ms"]:.3f} ms (min / floor {row["over_floor"]:.1f})'
      if first_grads is None:
        first_grads = grads
      else:
        peak = max(float(jnp.max(jnp.abs(g))) for g in first_grads)
        row['grad_diff'] = max(float(jnp.max(jnp.abs(g - h)))
                               for g, h in zip(grads, first_grads)) / peak
        report += f', gradient vs {maps[0]} {row["grad_diff"]:.1e} (of its max)'
      rows.append(row)
      print(report, flush=True)
  if out:
    with open(out, 'w') as f:
      json.dump({'tiny': tiny, 'repeats': repeats, 'device': jax.devices()[0].device_kind,
                 'host': platform.node(), 'jax': jax.__version__, 'rows': rows}, f, indent=2)
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Too many command-line arguments: {argv[1:]}')
  run(tuple(FLAGS.models), repeats=FLAGS.repeats, tiny=FLAGS.tiny, out=FLAGS.out,
      maps=tuple(FLAGS.maps), bandwidth_gbs=FLAGS.bandwidth_gbs)


if __name__ == '__main__':
  define_flags()
  app.run(main)
