r"""Train-step images/s of ResNet-50 and VGG-6 under GmP+IMN against BN, measured in the same run.

  python -m benchmarks.vision_throughput [--models=resnet50,vgg6] [--repeats=20] \
      [--batch=0] [--out=FILE.json] [--tiny]

For each model, both parameterizations are built and compiled, then their
train steps (forward, backward, SGD-momentum update, `batch_stats` update;
jitted, donated, after two warm-up steps) are timed in alternation, `repeats`
times each, so drift of a shared machine hits both alike. Reported: median
images/s of each and the ratio GmP+IMN / BN (the number to compare across
machines), compile times, and the device. Batch (`--batch=0`: the papers'
256 for both) and image sizes are paper 002's: 224x224 for ResNet-50, 32x32
for VGG-6, 1000 classes. `--tiny` shrinks widths, depths and images (the test
suite runs that).
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
import optax

from experiments import vision_models

FLAGS = flags.FLAGS
MODELS = ('resnet50', 'vgg6')
PARAMETERIZATIONS = ('bn', 'gmp_imn')


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_list('models', list(MODELS), f'Models to time, among {", ".join(MODELS)}.')
  flags.DEFINE_integer('repeats', 20, 'Timed steps per parameterization (median reported).')
  flags.DEFINE_integer('batch', 0, 'Batch size (0: 256, the papers\').')
  flags.DEFINE_bool('tiny', False, 'Tiny models and images (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


def build(name: str, parameterization: str, tiny: bool):
  """(model, image shape) of a benchmark model."""
  if name == 'resnet50':
    if tiny:
      return (vision_models.ResNet(num_classes=10, stage_sizes=(1,), width=1 / 16,
                                   parameterization=parameterization), (16, 16, 3))
    return vision_models.ResNet50(num_classes=1000, parameterization=parameterization), (224,
                                                                                         224, 3)
  if name == 'vgg6':
    if tiny:
      return vision_models.vgg6(10, parameterization, width=1 / 16), (8, 8, 3)
    return vision_models.vgg6(1000, parameterization), (32, 32, 3)
  raise ValueError(f'unknown model {name!r}; accepted: {", ".join(MODELS)}.')


def make_step(model, tx):
  """`(params, batch_stats, opt_state, x, y) -> same + loss`: one SGD train step."""

  def step(params, batch_stats, opt_state, x, y):
    def loss_fn(p):
      logits, new = model.apply({'params': p, 'batch_stats': batch_stats}, x, train=True,
                                mutable=['batch_stats'])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new
    (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new['batch_stats'], opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2))


class _Runner:
  """One compiled train step and its state."""

  def __init__(self, model, shape, batch, seed=0):
    self.tx = optax.sgd(0.01, momentum=0.9)
    key = jax.random.key(seed)
    self.x = jax.random.normal(key, (batch,) + shape, jnp.float32)
    self.y = jax.random.randint(key, (batch,), 0, 10)
    t = time.perf_counter()
    variables = jax.jit(model.init)(key, self.x[:1])
    self.params, self.stats = variables['params'], variables.get('batch_stats', {})
    self.opt_state = self.tx.init(self.params)
    self.step = make_step(model, self.tx)
    self.run()
    self.compile_s = time.perf_counter() - t
    self.run()

  def run(self) -> float:
    t = time.perf_counter()
    self.params, self.stats, self.opt_state, loss = self.step(
        self.params, self.stats, self.opt_state, self.x, self.y)
    loss.block_until_ready()
    return time.perf_counter() - t


def run(models=MODELS, tiny: bool = False, repeats: int = 20, batch: int = 0,
        out: str | None = None) -> list[dict]:
  """Times each model under BN and GmP+IMN; returns one row per model (and writes `out`)."""
  unknown = [m for m in models if m not in MODELS]
  if unknown or not models:
    raise ValueError(f'unknown models {unknown or list(models)}; accepted: {", ".join(MODELS)}.')
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  batch = batch or (4 if tiny else 256)
  rows = []
  for name in models:
    runners = {}
    for p in PARAMETERIZATIONS:
      model, shape = build(name, p, tiny)
      runners[p] = _Runner(model, shape, batch)
    times = {p: [] for p in PARAMETERIZATIONS}
    for _ in range(repeats):
      for p in PARAMETERIZATIONS:
        times[p].append(runners[p].run())
    row = {'model': name, 'batch': batch, 'image': list(shape)}
    for p in PARAMETERIZATIONS:
      row[f'{p}_ms'] = 1e3 * float(np.median(times[p]))
      row[f'{p}_images_per_s'] = batch / float(np.median(times[p]))
      row[f'{p}_compile_s'] = runners[p].compile_s
    row['ratio'] = row['gmp_imn_images_per_s'] / row['bn_images_per_s']
    rows.append(row)
    print(f'{name:9s} batch {batch}: BN {row["bn_images_per_s"]:9.1f} img/s, GmP+IMN '
          f'{row["gmp_imn_images_per_s"]:9.1f} img/s, ratio GmP+IMN/BN {row["ratio"]:.3f} '
          f'(compile {row["bn_compile_s"]:.1f}s / {row["gmp_imn_compile_s"]:.1f}s)', flush=True)
  if out:
    device = jax.devices()[0]
    with open(out, 'w') as f:
      json.dump({'tiny': tiny, 'repeats': repeats, 'device': device.device_kind,
                 'platform': device.platform, 'host': platform.node(), 'jax': jax.__version__,
                 'rows': rows}, f, indent=2)
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Too many command-line arguments: {argv[1:]}')
  run(tuple(FLAGS.models), tiny=FLAGS.tiny, repeats=FLAGS.repeats, batch=FLAGS.batch,
      out=FLAGS.out)


if __name__ == '__main__':
  define_flags()
  app.run(main)
