r"""The theta -> u map of a whole model's GmP layers, forward and backward: its share of a step.

  python -m benchmarks.model_map [--models=resnet50,vgg6] [--repeats=7] [--out=FILE.json] [--tiny]

Every `theta` of the model's GmP+IMN parameters (`vision_models`, the shapes of
`benchmarks.vision_throughput`'s models) is mapped to `u(theta)` and contracted with a fixed
random array, and the gradient with respect to all thetas is taken, in one jitted function:
what a train step spends on the map, whatever the batch or the image size. Reported per model:
the number of GmP layers and angles, the compile time of that function and the median and min
ms per call over `--repeats` calls. `--tiny` shrinks the models (the test suite runs that).
"""

from __future__ import annotations

import json
import platform
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import geoparam
from benchmarks import vision_throughput

FLAGS = flags.FLAGS


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_list('models', list(vision_throughput.MODELS),
                    f'Models, among {", ".join(vision_throughput.MODELS)}.')
  flags.DEFINE_integer('repeats', 7, 'Timed calls per model.')
  flags.DEFINE_bool('tiny', False, 'Tiny models (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


def thetas_of(name: str, tiny: bool = False) -> list[jax.ShapeDtypeStruct]:
  """The shapes of every `theta` of model `name` under GmP+IMN, in parameter-tree order."""
  model, shape = vision_throughput.build(name, 'gmp_imn', tiny)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1,) + shape)))
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(variables['params'])
          if jax.tree_util.keystr(path).endswith("['theta']")]


def run(models=vision_throughput.MODELS, repeats: int = 7, tiny: bool = False,
        out: str | None = None) -> list[dict]:
  """Times the map of each model (see the module docstring); returns one row per model."""
  unknown = [m for m in models if m not in vision_throughput.MODELS]
  if unknown or not models:
    raise ValueError(f'unknown models {unknown or list(models)}; accepted: '
                     f'{", ".join(vision_throughput.MODELS)}.')
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  rng = np.random.default_rng(0)
  rows = []
  for name in models:
    shapes = thetas_of(name, tiny)
    thetas = [jnp.asarray(rng.uniform(0.3, 2.8, t.shape), jnp.float32) for t in shapes]
    weights = [jnp.asarray(rng.normal(size=(t.shape[0] + 1,) + t.shape[1:]), jnp.float32)
               for t in shapes]

    def loss(ts):
      return sum(jnp.vdot(geoparam.gmp_kernel(t), w) for t, w in zip(ts, weights))

    start = time.perf_counter()
    step = jax.jit(jax.grad(loss)).lower(thetas).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(step(thetas))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(step(thetas))
      times.append(time.perf_counter() - start)
    row = {'model': name, 'layers': len(shapes), 'angles': int(sum(np.prod(t.shape) for t in shapes)),
           'compile_s': compile_s, 'ms': 1e3 * float(np.median(times)),
           'min_ms': 1e3 * float(np.min(times))}
    rows.append(row)
    print(f'{name:9s} {row["layers"]} GmP layers, {row["angles"]:,} angles: map fwd+bwd '
          f'{row["ms"]:.1f} ms (min {row["min_ms"]:.1f}), compile {compile_s:.2f} s', flush=True)
  if out:
    with open(out, 'w') as f:
      json.dump({'tiny': tiny, 'repeats': repeats, 'device': jax.devices()[0].device_kind,
                 'host': platform.node(), 'jax': jax.__version__, 'rows': rows}, f, indent=2)
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Too many command-line arguments: {argv[1:]}')
  run(tuple(FLAGS.models), repeats=FLAGS.repeats, tiny=FLAGS.tiny, out=FLAGS.out)


if __name__ == '__main__':
  define_flags()
  app.run(main)
