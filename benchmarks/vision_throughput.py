r"""Train-step images/s of ResNet-50 and VGG-6: plain, BN, GmP and GmP+IMN timed in the same run.

  python -m benchmarks.vision_throughput [--models=resnet50,vgg6] [--repeats=20] \
      [--parameterizations=bn,gmp_imn] [--batch=0] [--image=0] \
      [--dtype=float32|bfloat16] [--out=FILE.json] [--tiny]

For each model, each parameterization (`sp`: plain, no normalization; `bn`; `gmp`;
`gmp_imn`, the paper form `scale * relu(conv(x; u) + lam)` of the studies' models, the first
conv without IMN; `gmp_imn_transform`: `geoparam.reparameterize(bn_model, 'gmp_imn',
drop_batchnorm=True)`, whose convs compute with `scale * u` and `scale * lam` and all have IMN,
the first one too; `gmp_imn_scans`: `gmp_imn` with its theta -> u maps traced as XLA's scans,
the `sequential` scheme, which the CPU runs where the native kernels of `geoparam.native`
cannot be built) is built and compiled, then their train steps (forward, backward,
SGD-momentum update, `batch_stats` update; jitted, donated, after two warm-up
steps) are timed in alternation, `repeats` times each, so drift of a shared
machine hits all alike. Reported: median images/s of each; the ratio GmP+IMN / BN
(median over rounds of the per-round ratio of images/s: the number to compare
across machines), likewise every other parameterization against BN and against
`sp` when they are timed; the compile time of each train step
(`jit(...).lower(...).compile()`, tracing included), as wall time and as this process's CPU
time (all threads; steadier than wall time on a machine that other jobs share); and the
device. Batch
(`--batch=0`: the papers' 256) and image sizes (`--image=0`) are paper 002's:
224x224 for ResNet-50, 32x32 for VGG-6, 1000 classes. `--dtype` is the
computation dtype of every model (params and the optimizer in float32, GmP's map
in float32, images in the dtype, the loss in float32). `--tiny` shrinks widths,
depths and images (the test suite runs that).
"""

from __future__ import annotations

import contextlib
import json
import platform
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import geoparam
from geoparam import hyperspherical
from experiments.vision import models as vision_models

FLAGS = flags.FLAGS
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
MODELS = ('resnet50', 'vgg6')
PARAMETERIZATIONS = ('sp', 'bn', 'gmp', 'gmp_imn', 'gmp_imn_transform', 'gmp_imn_scans')
DEFAULT_PARAMETERIZATIONS = ('bn', 'gmp_imn')


def define_flags():
  """Defines the command's flags (only when run as a script, so imports never clash)."""
  flags.DEFINE_list('models', list(MODELS), f'Models to time, among {", ".join(MODELS)}.')
  flags.DEFINE_list('parameterizations', list(DEFAULT_PARAMETERIZATIONS),
                    f'Parameterizations to time, among {", ".join(PARAMETERIZATIONS)}.')
  flags.DEFINE_integer('repeats', 20, 'Timed steps per parameterization (median reported).')
  flags.DEFINE_integer('batch', 0, 'Batch size (0: 256, the papers\').')
  flags.DEFINE_integer('image', 0, 'Image side in pixels (0: the paper\'s, 224 / 32).')
  flags.DEFINE_enum('dtype', 'float32', list(DTYPES), 'Computation dtype (params float32).')
  flags.DEFINE_bool('tiny', False, 'Tiny models and images (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


@contextlib.contextmanager
def _scans(on: bool):
  """While `on`, maps traced by default take the `sequential` scheme (XLA's scans)."""
  scheme = hyperspherical._scheme
  if on:
    hyperspherical._scheme = lambda s, for_map=False: scheme(s or 'sequential', for_map)
  try:
    yield
  finally:
    hyperspherical._scheme = scheme


def build(name: str, parameterization: str, tiny: bool, dtype=jnp.float32, image: int = 0):
  """(model, image shape) of a benchmark model in computation dtype `dtype`."""
  if parameterization == 'gmp_imn_scans':  # the same model; `run` traces its maps as scans
    return build(name, 'gmp_imn', tiny, dtype, image)
  if parameterization == 'gmp_imn_transform':  # the BN model, reparameterized as a whole
    model, shape = build(name, 'bn', tiny, dtype, image)
    return geoparam.reparameterize(model, 'gmp_imn', drop_batchnorm=True, exclude=['out']), shape
  if name == 'resnet50':
    if tiny:
      return (vision_models.ResNet(num_classes=10, stage_sizes=(1,), width=1 / 16,
                                   parameterization=parameterization, dtype=dtype),
              (image or 16,) * 2 + (3,))
    return (vision_models.ResNet50(num_classes=1000, parameterization=parameterization,
                                   dtype=dtype), (image or 224,) * 2 + (3,))
  if name == 'vgg6':
    if tiny:
      return vision_models.vgg6(10, parameterization, width=1 / 16, dtype=dtype), (
          (image or 8,) * 2 + (3,))
    return vision_models.vgg6(1000, parameterization, dtype=dtype), (image or 32,) * 2 + (3,)
  raise ValueError(f'unknown model {name!r}; accepted: {", ".join(MODELS)}.')


def make_step(model, tx):
  """`(params, batch_stats, opt_state, x, y) -> same + loss`: one SGD train step."""

  def step(params, batch_stats, opt_state, x, y):
    def loss_fn(p):
      logits, new = model.apply({'params': p, 'batch_stats': batch_stats}, x, train=True,
                                mutable=['batch_stats'])
      logits = logits.astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new
    (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new['batch_stats'], opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1, 2))


class _Runner:
  """One compiled train step and its state."""

  def __init__(self, model, shape, batch, seed=0, dtype=jnp.float32):
    self.tx = optax.sgd(0.01, momentum=0.9)
    key = jax.random.key(seed)
    self.x = jax.random.normal(key, (batch,) + shape, jnp.float32).astype(dtype)
    self.y = jax.random.randint(key, (batch,), 0, 10)
    variables = jax.jit(model.init)(key, self.x[:1])
    self.params, self.stats = variables['params'], variables.get('batch_stats', {})
    self.opt_state = self.tx.init(self.params)
    t, cpu = time.perf_counter(), time.process_time()
    self.step = make_step(model, self.tx).lower(
        self.params, self.stats, self.opt_state, self.x, self.y).compile()
    self.compile_s = time.perf_counter() - t
    self.compile_cpu_s = time.process_time() - cpu  # all threads of this process
    self.run()
    self.run()

  def run(self) -> float:
    t = time.perf_counter()
    self.params, self.stats, self.opt_state, loss = self.step(
        self.params, self.stats, self.opt_state, self.x, self.y)
    loss.block_until_ready()
    return time.perf_counter() - t


def run(models=MODELS, tiny: bool = False, repeats: int = 20, batch: int = 0,
        out: str | None = None, dtype: str = 'float32', image: int = 0,
        parameterizations=DEFAULT_PARAMETERIZATIONS) -> list[dict]:
  """Times each model under each parameterization; returns one row per model (and writes `out`).

  `dtype` (`'float32'` or `'bfloat16'`): computation dtype of every model;
  `image`: image side (0: the paper's); `parameterizations`: among `PARAMETERIZATIONS`.
  A row holds `{p}_ms`, `{p}_images_per_s`, `{p}_compile_s` and `{p}_compile_cpu_s` of each
  parameterization `p`, and `{p}_vs_{q}` (images/s ratio), `{p}_vs_{q}_compile` and
  `{p}_vs_{q}_compile_cpu` for `q` in BN and `sp` when timed
  (`ratio` and `compile_ratio`: GmP+IMN against BN).
  """
  unknown = [m for m in models if m not in MODELS]
  if unknown or not models:
    raise ValueError(f'unknown models {unknown or list(models)}; accepted: {", ".join(MODELS)}.')
  ps = tuple(parameterizations)
  unknown = [p for p in ps if p not in PARAMETERIZATIONS]
  if unknown or not ps or len(set(ps)) != len(ps):
    raise ValueError(f'bad parameterizations {list(ps)}; accepted (each once): '
                     f'{", ".join(PARAMETERIZATIONS)}.')
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  if dtype not in DTYPES:
    raise ValueError(f'unknown dtype {dtype!r}; accepted: {", ".join(DTYPES)}.')
  batch = batch or (4 if tiny else 256)
  rows = []
  for name in models:
    runners = {}
    for p in ps:
      model, shape = build(name, p, tiny, DTYPES[dtype], image)
      with _scans(p == 'gmp_imn_scans'):
        runners[p] = _Runner(model, shape, batch, dtype=DTYPES[dtype])
    times = {p: [] for p in ps}
    for _ in range(repeats):
      for p in ps:
        times[p].append(runners[p].run())
    times = {p: np.array(t) for p, t in times.items()}
    row = {'model': name, 'batch': batch, 'image': list(shape), 'dtype': dtype}
    for p in ps:
      row[f'{p}_ms'] = 1e3 * float(np.median(times[p]))
      row[f'{p}_images_per_s'] = batch / float(np.median(times[p]))
      row[f'{p}_compile_s'] = runners[p].compile_s
      row[f'{p}_compile_cpu_s'] = runners[p].compile_cpu_s
    report = []
    for q in (q for q in ('bn', 'sp') if q in ps):  # the baselines timed
      for p in (p for p in ps if p not in (q, 'sp')):
        # images/s ratio p / q = q's time / p's time, per round (steps timed in turns).
        row[f'{p}_vs_{q}'] = float(np.median(times[q] / times[p]))
        row[f'{p}_vs_{q}_compile'] = compile_ratio = (row[f'{p}_compile_s'] /
                                                      row[f'{q}_compile_s'])
        row[f'{p}_vs_{q}_compile_cpu'] = cpu_ratio = (row[f'{p}_compile_cpu_s'] /
                                                      row[f'{q}_compile_cpu_s'])
        report.append(f'{p}/{q} {row[f"{p}_vs_{q}"]:.3f} (compile {compile_ratio:.2f}, '
                      f'CPU time {cpu_ratio:.2f})')
    if 'gmp_imn_vs_bn' in row:
      row['ratio'], row['compile_ratio'] = row['gmp_imn_vs_bn'], row['gmp_imn_vs_bn_compile']
    rows.append(row)
    each = ', '.join(f'{p} {row[f"{p}_images_per_s"]:.1f} img/s (compile '
                     f'{row[f"{p}_compile_s"]:.1f}s, CPU time {row[f"{p}_compile_cpu_s"]:.1f}s)'
                     for p in ps)
    print(f'{name:9s} batch {batch} {"x".join(map(str, shape))} {dtype}: {each}; '
          f'ratios {", ".join(report) or "-"}', flush=True)
  if out:
    device = jax.devices()[0]
    with open(out, 'w') as f:
      json.dump({'tiny': tiny, 'repeats': repeats, 'dtype': dtype, 'device': device.device_kind,
                 'platform': device.platform, 'host': platform.node(), 'jax': jax.__version__,
                 'rows': rows}, f, indent=2)
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Too many command-line arguments: {argv[1:]}')
  run(tuple(FLAGS.models), tiny=FLAGS.tiny, repeats=FLAGS.repeats, batch=FLAGS.batch,
      out=FLAGS.out, dtype=FLAGS.dtype, image=FLAGS.image,
      parameterizations=tuple(FLAGS.parameterizations))


if __name__ == '__main__':
  define_flags()
  app.run(main)
