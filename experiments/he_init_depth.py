r"""Glorot vs He init in a 30-layer ReLU / PReLU network (paper 001, He et al. 2015, Fig. 3).

Paper 001's claim: in an extremely deep (30-layer) rectifier network, Glorot
("Xavier") init, whose variance `2 / (fan_in + fan_out)` ignores the rectifier,
halves the signal variance at every layer and completely stalls learning, while
He init (`geoparam.he_normal`, `Var(w) = 2 / ((1 + a^2) fan_in)`) keeps it and
the network trains.

Setup: an MLP with 30 hidden layers of 256 units (ReLU, or channel-wise PReLU
with slopes initialized at 0.25 and He init using that slope), zero biases, a
linear softmax output; SGD with momentum 0.9, lr 0.01, batch 128, weight decay
5e-4 masked with `geoparam.decay_mask` (no decay on biases and PReLU slopes).
Data (default `synthetic`): a 10-class Gaussian mixture in 100 dimensions (8192
train, 2048 test points; class means N(0, I), noise N(0, 3^2 I), then scaled to
unit variance); `cifar10`
uses the CIFAR-10 JPEG archive (`--data_dir` or $GEOPARAM_DATA_DIR, subset
sizes as flags), loaded as in `experiments.deep_sigmoid_mlp`.

  python -m experiments.he_init_depth --workdir=/tmp/he_init
  python -m experiments.he_init_depth --workdir=/tmp/he_init_cifar --data=cifar10 \
      --data_dir=../shared/data --train_examples=10000

Writes to `workdir`: `results.json` (per run `<activation>_<init>`: final train
loss, test accuracy, per-epoch curves, the std of every layer's pre-activation
at init; the claims against the measurements) and `curves.png` (train loss and
test accuracy per epoch, and the pre-activation std per layer at init).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Sequence

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import geoparam

FLAGS = flags.FLAGS

ACTIVATIONS = ('relu', 'prelu')
INITS = ('glorot', 'he')
DATASETS = ('synthetic', 'cifar10')
PRELU_INIT = 0.25


def define_flags():
  """CLI flags; defined only when run as a script (tests and notebooks import the module)."""
  flags.DEFINE_string('workdir', None, 'Directory for results.json and curves.png.')
  flags.DEFINE_list('activations', list(ACTIVATIONS), f'Among {", ".join(ACTIVATIONS)}.')
  flags.DEFINE_list('inits', list(INITS), f'Among {", ".join(INITS)}.')
  flags.DEFINE_enum('data', 'synthetic', list(DATASETS), 'Generated mixture or CIFAR-10.')
  flags.DEFINE_string('data_dir', None, 'For --data=cifar10: folder holding cifar10-jpeg.tar.gz '
                      '(default: $GEOPARAM_DATA_DIR).')
  flags.DEFINE_string('cache_dir', None, 'Cache of the decoded archive (default ~/.cache/geoparam).')
  flags.DEFINE_bool('download', False, 'For --data=cifar10 with no archive in --data_dir: fetch '
                    'the official CIFAR-10 archive (170 MB) into the cache dir.')
  flags.DEFINE_integer('train_examples', 8192, 'Training examples (cifar10: 0 = all).')
  flags.DEFINE_integer('test_examples', 2048, 'Test examples (cifar10: 0 = all).')
  flags.DEFINE_integer('depth', 30, 'Hidden layers.')
  flags.DEFINE_integer('width', 256, 'Units per hidden layer.')
  flags.DEFINE_integer('epochs', 10, 'Epochs.')
  flags.DEFINE_integer('batch_size', 128, 'Minibatch size.')
  flags.DEFINE_float('lr', 0.01, 'SGD learning rate.')
  flags.DEFINE_float('momentum', 0.9, 'SGD momentum.')
  flags.DEFINE_float('weight_decay', 5e-4, 'Weight decay (kernels only).')
  flags.DEFINE_integer('seed', 0, 'Seed of the data, init and data order.')


def _check(names, valid, what) -> tuple[str, ...]:
  if isinstance(names, str):
    names = [n for n in names.split(',') if n]
  names = tuple(names)
  unknown = [n for n in names if n not in valid]
  if unknown or not names:
    raise ValueError(f'unknown {what} {unknown or list(names)}; valid {what}: {", ".join(valid)}.')
  return names


def check_activations(names):
  return _check(names, ACTIVATIONS, 'activations')


def check_inits(names):
  return _check(names, INITS, 'inits')


def kernel_init(init: str, activation: str):
  """Glorot normal, or He normal for the activation's (initial) negative slope."""
  check_inits([init])
  if init == 'glorot':
    return nn.initializers.glorot_normal()
  return geoparam.he_normal(negative_slope=PRELU_INIT if activation == 'prelu' else 0.0)


class DeepRectifierMLP(nn.Module):
  """`depth` hidden Dense + (P)ReLU layers of `width` units, then `num_classes` logits."""

  activation: str = 'relu'
  weight_init: str = 'he'  # 'glorot' or 'he' (`init` is taken by nn.Module.init)
  depth: int = 30
  width: int = 256
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    check_activations([self.activation])
    k_init = kernel_init(self.weight_init, self.activation)
    x = x.reshape(x.shape[0], -1)
    for i in range(self.depth):
      x = nn.Dense(self.width, kernel_init=k_init, name=f'dense_{i}')(x)
      if self.activation == 'relu':
        x = nn.relu(x)
      else:
        x = geoparam.PReLU(negative_slope_init=PRELU_INIT, name=f'prelu_{i}')(x)
    return nn.Dense(self.num_classes, kernel_init=k_init, name='out')(x)


def make_synthetic(train_examples: int, test_examples: int, seed: int, dim: int = 100,
                   num_classes: int = 10, noise: float = 3.0) -> dict[str, Any]:
  """A Gaussian mixture: class means N(0, I_dim), points mean + N(0, noise^2 I).

  Scaled by `1 / sqrt(1 + noise^2)` so that every input coordinate has unit variance.
  """
  if train_examples < 1 or test_examples < 1:
    raise ValueError(f'synthetic data needs train_examples and test_examples >= 1, got '
                     f'{train_examples}, {test_examples}.')
  rng = np.random.default_rng(seed)
  means = rng.normal(size=(num_classes, dim))
  out = {'num_classes': num_classes}
  for split, n in (('train', train_examples), ('test', test_examples)):
    y = rng.integers(0, num_classes, n).astype(np.int32)
    x = (means[y] + noise * rng.normal(size=(n, dim))) / math.sqrt(1.0 + noise**2)
    out[f'x_{split}'] = x.astype(np.float32)  # unit variance per coordinate
    out[f'y_{split}'] = y
  return out


def load_data(data: str, train_examples: int, test_examples: int, seed: int,
              data_dir: str | None = None, cache_dir: str | None = None,
              download: bool = False):
  if data not in DATASETS:
    raise ValueError(f'unknown data {data!r}; valid: {", ".join(DATASETS)}.')
  if data == 'synthetic':
    return make_synthetic(train_examples, test_examples, seed)
  from experiments import deep_sigmoid_mlp  # pylint: disable=g-import-not-at-top

  return deep_sigmoid_mlp.load_cifar(data_dir, train_examples, test_examples, seed, cache_dir,
                                     download)


def preactivation_std(model, variables, x) -> list[float]:
  """Std of every Dense layer's output (pre-activation) on `x`, first to last."""
  _, inter = model.apply(variables, x, capture_intermediates=lambda m, _: isinstance(m, nn.Dense))
  inter = inter['intermediates']
  names = [f'dense_{i}' for i in range(model.depth)] + ['out']
  return [float(jnp.std(inter[n]['__call__'][0])) for n in names]


def train_run(activation: str, init: str, data, *, depth: int, width: int, epochs: int,
              batch_size: int, lr: float, momentum: float, weight_decay: float, seed: int,
              log=print) -> dict[str, Any]:
  """Trains one (activation, init) pair; one jitted scan per epoch."""
  x_train, y_train = jnp.asarray(data['x_train']), jnp.asarray(data['y_train'])
  x_test, y_test = jnp.asarray(data['x_test']), jnp.asarray(data['y_test'])
  n = len(y_train)
  steps = n // batch_size
  if steps < 1:
    raise ValueError(f'{n} training examples are fewer than one batch ({batch_size}).')
  model = DeepRectifierMLP(activation, init, depth=depth, width=width,
                           num_classes=data['num_classes'])
  key_init, key_data = jax.random.split(jax.random.key(seed))
  params = model.init(key_init, x_train[:batch_size])['params']
  init_std = preactivation_std(model, {'params': params}, x_train[:512])
  opt = optax.chain(optax.add_decayed_weights(weight_decay, mask=geoparam.decay_mask),
                    optax.sgd(lr, momentum=momentum))

  def loss_fn(params, x, y):
    logits = model.apply({'params': params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def run_epoch(params, opt_state, key):
    order = jax.random.permutation(key, n)[:steps * batch_size].reshape(steps, batch_size)

    def step(carry, idx):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(loss_fn)(params, x_train[idx], y_train[idx])
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    (params, opt_state), loss = jax.lax.scan(step, (params, opt_state), order)
    return params, opt_state, jnp.mean(loss)

  @jax.jit
  def evaluate(params, x, y):
    logits = model.apply({'params': params}, x)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
            jnp.mean(jnp.argmax(logits, -1) == y))

  t0 = time.perf_counter()
  opt_state = opt.init(params)
  tr0, _ = evaluate(params, x_train[:2048], y_train[:2048])
  te_loss, te_acc = evaluate(params, x_test, y_test)
  curves = {'train_loss': [float(tr0)], 'test_loss': [float(te_loss)],
            'test_acc': [float(te_acc)]}
  name = f'{activation}_{init}'
  for epoch in range(1, epochs + 1):
    params, opt_state, tr_loss = run_epoch(params, opt_state, jax.random.fold_in(key_data, epoch))
    te_loss, te_acc = evaluate(params, x_test, y_test)
    for k, v in zip(('train_loss', 'test_loss', 'test_acc'), (tr_loss, te_loss, te_acc)):
      curves[k].append(float(v))
    log(f'[he_init_depth] {name} epoch {epoch}/{epochs}: train loss {float(tr_loss):.4f}, '
        f'test loss {float(te_loss):.4f} acc {float(te_acc):.3f} '
        f'({time.perf_counter() - t0:.0f} s)')
  out = dict(curves=curves, preactivation_std_at_init=init_std,
             final_train_loss=curves['train_loss'][-1], final_test_acc=curves['test_acc'][-1],
             seconds=time.perf_counter() - t0)
  if activation == 'prelu':
    slopes = [np.asarray(params[f'prelu_{i}']['negative_slope']) for i in range(depth)]
    out['prelu_mean_slope_per_layer'] = [float(s.mean()) for s in slopes]
  return out


def stalled(result, num_classes: int) -> bool:
  """No learning: final train loss within 5% of chance level ln(K) (or not finite)."""
  loss = result['final_train_loss']
  return not math.isfinite(loss) or loss > 0.95 * math.log(num_classes)


def check_claims(results, num_classes: int) -> dict[str, str]:
  out = {}
  for act in ACTIVATIONS:
    g, h = results.get(f'{act}_glorot'), results.get(f'{act}_he')
    if g is None or h is None:
      continue
    holds = stalled(g, num_classes) and not stalled(h, num_classes)
    out[f'{act}: Glorot stalls and He trains'] = (
        f'{"holds" if holds else "does not hold"} (final train loss Glorot '
        f'{g["final_train_loss"]:.4f}, He {h["final_train_loss"]:.4f}; chance ln K = '
        f'{math.log(num_classes):.3f}; test acc Glorot {g["final_test_acc"]:.3f}, He '
        f'{h["final_test_acc"]:.3f})')
  return out


def plot(results, workdir):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
  for name, r in results.items():
    c = r['curves']
    axes[0].plot(range(len(c['train_loss'])), c['train_loss'], 'o-', ms=3, label=name)
    axes[1].plot(range(len(c['test_acc'])), c['test_acc'], 'o-', ms=3, label=name)
    axes[2].semilogy(range(1, len(r['preactivation_std_at_init']) + 1),
                     r['preactivation_std_at_init'], '.-', label=name)
  axes[0].set_ylabel('train loss (epoch 0: at init)')
  axes[1].set_ylabel('test accuracy')
  axes[2].set_ylabel('pre-activation std at init')
  axes[2].set_xlabel('layer')
  for ax in axes[:2]:
    ax.set_xlabel('epoch')
  for ax in axes:
    ax.legend(fontsize=8)
  fig.suptitle('Glorot vs He init, deep rectifier MLP (paper 001)')
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'curves.png'), dpi=120)
  plt.close(fig)


def run_study(workdir: str, activations: Sequence[str] = ACTIVATIONS,
              inits: Sequence[str] = INITS, data: str = 'synthetic', *,
              data_dir: str | None = None, cache_dir: str | None = None,
              train_examples: int = 8192, test_examples: int = 2048, depth: int = 30,
              width: int = 256, epochs: int = 10, batch_size: int = 128, lr: float = 0.01,
              momentum: float = 0.9, weight_decay: float = 5e-4, seed: int = 0,
              make_plots: bool = True, log=print, download: bool = False) -> dict[str, Any]:
  """Runs every (activation, init) pair; writes results.json and curves.png.

  `download=True` (data='cifar10'): fetch CIFAR-10 when no data directory holds it.
  """
  activations, inits = check_activations(activations), check_inits(inits)
  if depth < 1 or width < 1 or epochs < 1 or batch_size < 1:
    raise ValueError(f'depth, width, epochs and batch_size must be >= 1, got {depth}, {width}, '
                     f'{epochs}, {batch_size}.')
  dataset = load_data(data, train_examples, test_examples, seed, data_dir, cache_dir, download)
  os.makedirs(workdir, exist_ok=True)
  log(f'[he_init_depth] {data}: {len(dataset["y_train"])} train / {len(dataset["y_test"])} test, '
      f'{depth} x {width} hidden, {epochs} epochs')
  t_start = time.perf_counter()
  results = {}
  for act in activations:
    for init in inits:
      results[f'{act}_{init}'] = train_run(
          act, init, dataset, depth=depth, width=width, epochs=epochs, batch_size=batch_size,
          lr=lr, momentum=momentum, weight_decay=weight_decay, seed=seed, log=log)
  k = dataset['num_classes']
  summary = {
      'final_train_loss': {m: r['final_train_loss'] for m, r in results.items()},
      'final_test_acc': {m: r['final_test_acc'] for m, r in results.items()},
      'stalled': {m: stalled(r, k) for m, r in results.items()},
      'runs': results,
      'claims': check_claims(results, k),
      'config': dict(activations=list(activations), inits=list(inits), data=data,
                     num_train=int(len(dataset['y_train'])), num_test=int(len(dataset['y_test'])),
                     depth=depth, width=width, epochs=epochs, batch_size=batch_size, lr=lr,
                     momentum=momentum, weight_decay=weight_decay, seed=seed,
                     prelu_init=PRELU_INIT),
      'wall_seconds': time.perf_counter() - t_start,
  }
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  if make_plots:
    plot(results, workdir)
  log('| run | final train loss | final test acc | last-layer pre-act std at init | seconds |')
  log('| --- | --- | --- | --- | --- |')
  for m, r in results.items():
    log(f'| {m} | {r["final_train_loss"]:.4f} | {r["final_test_acc"]:.3f} | '
        f'{r["preactivation_std_at_init"][-1]:.3g} | {r["seconds"]:.0f} |')
  for claim, verdict in summary['claims'].items():
    log(f'[he_init_depth] paper claim: {claim}: {verdict}')
  log(f'[he_init_depth] wrote results.json{", curves.png" if make_plots else ""} to {workdir} '
      f'in {summary["wall_seconds"]:.1f} s')
  return {'summary': summary, 'results': results}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required (a directory for results.json and curves.png).')
  try:
    check_activations(FLAGS.activations)
    check_inits(FLAGS.inits)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  run_study(FLAGS.workdir, FLAGS.activations, FLAGS.inits, FLAGS.data, data_dir=FLAGS.data_dir,
            cache_dir=FLAGS.cache_dir, train_examples=FLAGS.train_examples,
            test_examples=FLAGS.test_examples, depth=FLAGS.depth, width=FLAGS.width,
            epochs=FLAGS.epochs, batch_size=FLAGS.batch_size, lr=FLAGS.lr,
            momentum=FLAGS.momentum, weight_decay=FLAGS.weight_decay, seed=FLAGS.seed,
            download=FLAGS.download)


if __name__ == '__main__':
  define_flags()
  app.run(main)
