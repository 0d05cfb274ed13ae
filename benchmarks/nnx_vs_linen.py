r"""Train step of an NNX GmP MLP against its linen twin (same params, same run, in alternation).

  python -m benchmarks.nnx_vs_linen [--width=1024] [--batch=256] [--repeats=30] [--tiny]

Both models: GmP+IMN hidden layers (`geoparam.nnx.GmPLinear` / `geoparam.GmPDense`)
and a plain output layer; one SGD-momentum step on the squared error. The NNX
step is timed two ways: `nnx.jit` on the module (what NNX users write; it walks
the module graph on every call) and `jax.jit` on `nnx.split` state (the
functional form). Prints each ratio to the linen step.
"""

from __future__ import annotations

import json
import platform

from absl import app
from absl import flags
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import geoparam
import geoparam.nnx as gnnx
from benchmarks.layers import _interleaved

FLAGS = flags.FLAGS


def define_flags():
  """Defines the command's flags (only when run as a script)."""
  flags.DEFINE_integer('width', 1024, 'Hidden width (and input width).')
  flags.DEFINE_integer('batch', 256, 'Batch size.')
  flags.DEFINE_integer('depth', 2, 'Number of GmP+IMN hidden layers.')
  flags.DEFINE_integer('repeats', 30, 'Timed steps per model.')
  flags.DEFINE_bool('tiny', False, 'Tiny shapes (smoke test of the benchmark itself).')
  flags.DEFINE_string('out', None, 'Write the results as JSON to this file.')


class LinenMLP(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x, use_running_average: bool):
    for i in range(self.depth):
      x = geoparam.GmPDense(self.width, input_mean_norm=True, name=f'hidden_{i}')(
          x, use_running_average)
    return nn.Dense(1, name='out')(x)


class NNXMLP(nnx.Module):

  def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
    self.hidden = nnx.List([gnnx.GmPLinear(width, width, input_mean_norm=True, rngs=rngs)
                            for _ in range(depth)])
    self.out = nnx.Linear(width, 1, rngs=rngs)

  def __call__(self, x):
    for layer in self.hidden:
      x = layer(x)
    return self.out(x)


def measure(width: int, batch: int, depth: int, repeats: int) -> dict:
  """Median step ms of each form and the ratios to linen (median of per-round ratios)."""
  x = jax.random.normal(jax.random.key(0), (batch, width))
  y = jax.random.normal(jax.random.key(1), (batch, 1))
  tx = optax.sgd(0.01, momentum=0.9)

  linen = LinenMLP(width, depth)
  variables = linen.init(jax.random.key(2), x, use_running_average=False)

  def linen_loss(params, stats):
    out, upd = linen.apply({'params': params, 'batch_stats': stats}, x, False,
                           mutable=['batch_stats'])
    return jnp.mean((out - y) ** 2), upd['batch_stats']

  @jax.jit
  def linen_step(state):
    params, stats, opt_state = state
    (_, stats), g = jax.value_and_grad(linen_loss, has_aux=True)(params, stats)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state

  model = NNXMLP(width, depth, nnx.Rngs(2))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, opt):
    g = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, g)

  graphdef, state = nnx.split((model, opt))

  @jax.jit
  def functional_step(state):
    model, opt = nnx.merge(graphdef, state)
    g = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, g)
    return nnx.state((model, opt))

  box = {'linen': (variables['params'], variables['batch_stats'],
                   tx.init(variables['params'])), 'functional': state}

  def run_linen():
    box['linen'] = linen_step(box['linen'])
    jax.block_until_ready(box['linen'])

  def run_nnx():
    nnx_step(model, opt)
    jax.block_until_ready(nnx.state(model))

  def run_functional():
    box['functional'] = functional_step(box['functional'])
    jax.block_until_ready(box['functional'])

  times = _interleaved([run_linen, run_nnx, run_functional], repeats)
  return {
      'width': width, 'batch': batch, 'depth': depth, 'repeats': repeats,
      'linen_ms': 1e3 * float(np.median(times[0])),
      'nnx_jit_ms': 1e3 * float(np.median(times[1])),
      'nnx_split_ms': 1e3 * float(np.median(times[2])),
      'nnx_jit_ratio': float(np.median(times[1] / times[0])),
      'nnx_split_ratio': float(np.median(times[2] / times[0])),
      'machine': platform.processor() or platform.machine(),
      'device': jax.devices()[0].device_kind,
  }


def run(width: int = 1024, batch: int = 256, depth: int = 2, repeats: int = 30,
        tiny: bool = False, out: str | None = None) -> dict:
  """`measure`s (tiny: width 16, batch 8, 3 repeats), prints the row and writes it to `out`."""
  width, batch = (16, 8) if tiny else (width, batch)
  row = measure(width, batch, depth, 3 if tiny else repeats)
  print(f"GmP+IMN MLP {row['depth']}x{row['width']}, batch {row['batch']}, {row['device']}: "
        f"linen {row['linen_ms']:.2f} ms, nnx.jit {row['nnx_jit_ms']:.2f} ms "
        f"(ratio {row['nnx_jit_ratio']:.2f}), split/merge + jax.jit {row['nnx_split_ms']:.2f} ms "
        f"(ratio {row['nnx_split_ratio']:.2f})")
  if out:
    with open(out, 'w') as f:
      json.dump(row, f, indent=1)
  return row


def main(argv):
  del argv
  run(FLAGS.width, FLAGS.batch, FLAGS.depth, FLAGS.repeats, FLAGS.tiny, FLAGS.out)


if __name__ == '__main__':
  define_flags()
  app.run(main)
