r"""Deep sigmoid MLP on CIFAR-10 (paper 003, Sec. 6.1, Fig. 5): plain vs LCW vs BN, WN, CWN, SN, SL.

Protocol of the paper (`--full`): 50 hidden layers of 256 sigmoid units and a
softmax output, SGD with momentum 0.9, weight decay 1e-4 (masked with
`geoparam.decay_mask`: kernels and LCW `v` only), batch 128, 100 epochs, lr 0.1
multiplied by 0.95 after every epoch down to 0.001
(`geoparam.schedules.per_epoch_decay`), all 50000 training images. Inits as in
the paper: plain, LCW and BN+LCW use the minibatch-based init of Sec. 4.3
(`geoparam.variance.data_dependent_init`: every layer rescaled so that its
pre-activation has unit variance on one minibatch); WN and CWN the same
rescaling of their gains (the variance part of Salimans & Kingma's init; the
biases stay 0); BN, SL and SN Glorot (uniform) init.

Reduced default (a few minutes on 2 CPU cores): the same 50 x 256 network and
optimizer, 10000 training and 2000 test images, 5 epochs (the lr follows the same
x0.95 per-epoch rule), methods plain, lcw, bn, bn_lcw. Every method is
selectable with --methods.

  python -m experiments.deep_sigmoid_mlp --workdir=/tmp/deep_sigmoid --data_dir=../shared/data
  python -m experiments.deep_sigmoid_mlp --workdir=/tmp/deep_sigmoid_full --full \
      --methods=plain,lcw,bn,bn_lcw,wn,cwn,sn,sl

`--data_dir` (or $GEOPARAM_DATA_DIR) is the folder holding cifar10-jpeg.tar.gz;
it is decoded once by `experiments.input_pipeline.load_jpeg_archive` and cached
(~/.cache/geoparam or $GEOPARAM_CACHE_DIR). Images are scaled to [0, 1] and
standardized per channel (CIFAR mean/std), then flattened to 3072 inputs.

Writes to `workdir`: `results.json` (per method: final train loss, test loss and
accuracy, per-epoch curves, seconds; the config; the paper's claims against the
measurements) and `curves.png` (train loss and test accuracy per epoch and
method; epoch 0 is the initialization).
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
from geoparam import schedules
from geoparam import variance
from experiments import input_pipeline

FLAGS = flags.FLAGS

METHODS = ('plain', 'lcw', 'bn', 'bn_lcw', 'wn', 'cwn', 'sn', 'sl')
DEFAULT_METHODS = ('plain', 'lcw', 'bn', 'bn_lcw')
# Methods whose init is the minibatch-based rescaling (Sec. 4.3 / Salimans & Kingma);
# the others keep Glorot init, as in the paper.
DATA_DEPENDENT_INIT = ('plain', 'lcw', 'bn_lcw', 'wn', 'cwn')

REDUCED = dict(depth=50, width=256, train_examples=10000, test_examples=2000, epochs=5)
FULL = dict(depth=50, width=256, train_examples=0, test_examples=0, epochs=100)


def define_flags():
  """CLI flags; defined only when run as a script (tests and notebooks import the module)."""
  flags.DEFINE_string('workdir', None, 'Directory for results.json and curves.png.')
  flags.DEFINE_string('data_dir', None,
                      'Folder holding cifar10-jpeg.tar.gz (default: $GEOPARAM_DATA_DIR).')
  flags.DEFINE_string('cache_dir', None, 'Cache of the decoded archive (default ~/.cache/geoparam).')
  flags.DEFINE_bool('download', False, 'No archive in --data_dir: fetch the official CIFAR-10 '
                    'archive (170 MB) into the cache dir and decode it.')
  flags.DEFINE_list('methods', list(DEFAULT_METHODS), f'Methods, among {", ".join(METHODS)}.')
  flags.DEFINE_bool('full', False, 'The paper protocol: all images, 100 epochs (hours on CPU).')
  flags.DEFINE_integer('epochs', None, 'Epochs (default 5 reduced, 100 full).')
  flags.DEFINE_integer('train_examples', None, 'Training images, 0 = all (default 10000 reduced).')
  flags.DEFINE_integer('test_examples', None, 'Test images, 0 = all (default 2000 reduced).')
  flags.DEFINE_integer('depth', None, 'Hidden layers (default 50).')
  flags.DEFINE_integer('width', None, 'Units per hidden layer (default 256).')
  flags.DEFINE_integer('batch_size', 128, 'Minibatch size.')
  flags.DEFINE_float('lr', 0.1, 'Initial learning rate.')
  flags.DEFINE_float('lr_decay', 0.95, 'Learning-rate factor after every epoch.')
  flags.DEFINE_float('min_lr', 0.001, 'Lower threshold of the learning rate.')
  flags.DEFINE_float('momentum', 0.9, 'SGD momentum.')
  flags.DEFINE_float('weight_decay', 1e-4, 'Weight decay (kernels and LCW v only).')
  flags.DEFINE_integer('seed', 0, 'Seed of the subset, init and data order.')


def check_methods(methods: Sequence[str]) -> tuple[str, ...]:
  """The methods as a tuple; unknown or no names raise a ValueError listing the valid ones."""
  if isinstance(methods, str):
    methods = [m for m in methods.split(',') if m]
  methods = tuple(methods)
  unknown = [m for m in methods if m not in METHODS]
  if unknown or not methods:
    raise ValueError(f'unknown methods {unknown or list(methods)}; valid methods: '
                     f'{", ".join(METHODS)}.')
  return methods


# ---------------------------------------------------------------------------
# Model.


class WNDense(nn.Module):
  """Weight-normalized Dense (Salimans & Kingma): `w_i = g_i v_i / |v_i|` per output unit.

  Written out (rather than `nn.WeightNorm`) so that `variance.data_dependent_init`
  can rescale its gain `scale` (passed as an extra entry of `scaled_params`).
  """

  features: int
  kernel_init: Any = nn.initializers.glorot_uniform()

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', self.kernel_init, (x.shape[-1], self.features))
    scale = self.param('scale', nn.initializers.ones_init(), (self.features,))
    bias = self.param('bias', nn.initializers.zeros_init(), (self.features,))
    w = kernel * jax.lax.rsqrt(jnp.sum(kernel**2, axis=0, keepdims=True) + 1e-12) * scale
    return x @ w + bias


SCALED_PARAMS = {**variance.SCALED_PARAMS, WNDense: 'scale'}


class DeepMLP(nn.Module):
  """`depth` hidden layers of `width` units with `activation`, then `num_classes` logits.

  `method` picks the linear layer (Dense, LCWDense, WNDense, CWNDense,
  SpectralNorm(Dense)) used for every layer including the output one, and the
  normalization: BN on the hidden pre-activations (`bn`, `bn_lcw`), SL on the
  hidden activations (`sl`).
  """

  method: str
  depth: int = 50
  width: int = 256
  num_classes: int = 10
  activation: Any = nn.sigmoid

  @nn.compact
  def __call__(self, x, train: bool = False):
    m = self.method
    check_methods([m])
    glorot = nn.initializers.glorot_uniform()
    bn = m in ('bn', 'bn_lcw')
    x = x.reshape(x.shape[0], -1)
    for i in range(self.depth + 1):
      last = i == self.depth
      features = self.num_classes if last else self.width
      use_bias = last or not bn
      name = f'layer_{i}'
      if m in ('lcw', 'bn_lcw'):
        x = geoparam.LCWDense(features, use_bias=use_bias, kernel_init=glorot, name=name)(x)
      elif m == 'wn':
        x = WNDense(features, name=name)(x)
      elif m == 'cwn':
        x = geoparam.CWNDense(features, kernel_init=glorot, name=name)(x)
      elif m == 'sn':
        dense = nn.Dense(features, kernel_init=glorot, name=name)
        x = nn.SpectralNorm(dense, name=f'{name}_sn')(x, update_stats=train)
      else:
        x = nn.Dense(features, use_bias=use_bias, kernel_init=glorot, name=name)(x)
      if last:
        break
      if bn:
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f'bn_{i}')(x)
      x = self.activation(x)
      if m == 'sl':
        x = geoparam.StandardizationLayer(use_running_average=not train, momentum=0.9,
                                          name=f'sl_{i}')(x)
    return x


# ---------------------------------------------------------------------------
# Data.


def resolve_data_dir(data_dir: str | None) -> str:
  """`data_dir`, else $GEOPARAM_DATA_DIR; a clear error naming the flag when it is missing."""
  resolved = input_pipeline.resolve_data_dir(data_dir)
  if not resolved or not os.path.isdir(resolved):
    raise FileNotFoundError(
        f'CIFAR-10 data directory not found: data_dir={resolved!r} (--data_dir={data_dir!r}, '
        f'$GEOPARAM_DATA_DIR={os.environ.get("GEOPARAM_DATA_DIR")!r}). Pass --data_dir=DIR '
        f'(or set GEOPARAM_DATA_DIR) to the folder holding {input_pipeline.JPEG_ARCHIVE}; '
        'from the project root that is ../shared/data.')
  return resolved


def load_cifar(data_dir: str | None, train_examples: int = 0, test_examples: int = 0,
               seed: int = 0, cache_dir: str | None = None, download: bool = False
               ) -> dict[str, np.ndarray]:
  """CIFAR-10 from the JPEG archive as float32 `(n, 3072)` standardized images and labels.

  `train_examples`/`test_examples`: a fixed random subset (0: all). `download=True`: without
  a data directory holding the archive, fetch the official CIFAR-10 archive into the cache
  (`input_pipeline.load_jpeg_archive`).
  """
  if download:
    resolved = input_pipeline.resolve_data_dir(data_dir)
    data, classes = input_pipeline.load_jpeg_archive(resolved, cache_dir, download=True)
  else:
    resolved = resolve_data_dir(data_dir)
    try:
      data, classes = input_pipeline.load_jpeg_archive(resolved, cache_dir)
    except FileNotFoundError as e:
      raise FileNotFoundError(
          f'{input_pipeline.JPEG_ARCHIVE} not found in {resolved!r}: pass --data_dir=DIR (or set '
          'GEOPARAM_DATA_DIR) to the folder that holds it, or --download to fetch the official '
          'CIFAR-10 archive (170 MB) into the cache.') from e
  if 'test' not in data:
    raise ValueError(f'{input_pipeline.JPEG_ARCHIVE} has no test/ split; found {sorted(data)}.')
  mean, std = (np.asarray(v, np.float32) for v in input_pipeline.MEAN_STD['cifar'])
  out = {'num_classes': len(classes)}
  rng = np.random.default_rng(seed)
  for split, n in (('train', train_examples), ('test', test_examples)):
    src = data[split]
    idx = np.arange(len(src))
    if n and n < len(src):
      idx = np.sort(rng.permutation(len(src))[:n])  # the archive is sorted by class
    images, labels = src.get(idx)
    x = (np.asarray(images, np.float32) / 255.0 - mean) / std
    out[f'x_{split}'] = x.reshape(len(idx), -1)
    out[f'y_{split}'] = np.asarray(labels, np.int32)
  return out


# ---------------------------------------------------------------------------
# Training.


def make_optimizer(lr, momentum, weight_decay):
  """SGD with momentum and masked weight decay, learning rate settable per epoch."""
  def make(learning_rate):
    return optax.chain(optax.add_decayed_weights(weight_decay, mask=geoparam.decay_mask),
                       optax.sgd(learning_rate, momentum=momentum))
  return optax.inject_hyperparams(make)(learning_rate=lr)


def init_variables(model: DeepMLP, key, x_batch):
  """Glorot init, then (for DATA_DEPENDENT_INIT methods) the minibatch-based rescaling."""
  variables = model.init(key, x_batch, train=False)
  if model.method in DATA_DEPENDENT_INIT:
    kwargs = dict(train=True, mutable=['batch_stats']) if 'batch_stats' in variables else {}
    variables = variance.data_dependent_init(model, variables, x_batch,
                                             scaled_params=SCALED_PARAMS, **kwargs)
  return dict(variables)


def train_method(method: str, data, *, depth: int, width: int, epochs: int, batch_size: int,
                 lr: float, lr_decay: float, min_lr: float, momentum: float,
                 weight_decay: float, seed: int, log=print) -> dict[str, Any]:
  """Trains one method; per-epoch curves (epoch 0 = at init). One jitted scan per epoch."""
  x_train, y_train = jnp.asarray(data['x_train']), jnp.asarray(data['y_train'])
  x_test, y_test = jnp.asarray(data['x_test']), jnp.asarray(data['y_test'])
  n = len(y_train)
  steps = n // batch_size
  if steps < 1:
    raise ValueError(f'{n} training images are fewer than one batch ({batch_size}).')
  model = DeepMLP(method, depth=depth, width=width, num_classes=data['num_classes'])
  key_init, key_data = jax.random.split(jax.random.key(seed))
  init_idx = np.random.default_rng(seed).permutation(n)[:batch_size]
  variables = init_variables(model, key_init, x_train[init_idx])
  params = variables.pop('params')
  state = variables  # batch_stats (BN, SL running stats; SN power-iteration vectors)
  opt = make_optimizer(lr, momentum, weight_decay)
  sched = schedules.per_epoch_decay(lr_decay, min_lr)

  def loss_fn(params, state, x, y):
    logits, new_state = model.apply({'params': params, **state}, x, train=True,
                                    mutable=list(state))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (new_state, jnp.mean(jnp.argmax(logits, -1) == y))

  @jax.jit
  def run_epoch(params, state, opt_state, key):
    order = jax.random.permutation(key, n)[:steps * batch_size].reshape(steps, batch_size)

    def step(carry, idx):
      params, state, opt_state = carry
      (loss, (state, acc)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          params, state, x_train[idx], y_train[idx])
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), state, opt_state), (loss, acc)

    (params, state, opt_state), (loss, acc) = jax.lax.scan(step, (params, state, opt_state),
                                                           order)
    return params, state, opt_state, jnp.mean(loss), jnp.mean(acc)

  @jax.jit
  def evaluate(params, state, x, y):
    """Mean loss and accuracy in eval mode (running statistics), in chunks of 500."""
    chunk = 500
    m = x.shape[0]
    pad = -m % chunk
    xp = jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)])
    yp = jnp.concatenate([y, jnp.zeros((pad,), y.dtype)])
    w = jnp.concatenate([jnp.ones((m,)), jnp.zeros((pad,))])

    def one(args):
      xb, yb, wb = args
      logits = model.apply({'params': params, **state}, xb, train=False)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
      return jnp.sum(loss * wb), jnp.sum((jnp.argmax(logits, -1) == yb) * wb)

    loss, correct = jax.lax.map(one, (xp.reshape(-1, chunk, *x.shape[1:]),
                                      yp.reshape(-1, chunk), w.reshape(-1, chunk)))
    return jnp.sum(loss) / m, jnp.sum(correct) / m

  t0 = time.perf_counter()
  opt_state = opt.init(params)
  sched_state = sched.init(lr)
  curves = {k: [] for k in ('train_loss', 'train_acc', 'test_loss', 'test_acc', 'lr')}
  init_train = evaluate(params, state, x_train[:2000], y_train[:2000])
  init_test = evaluate(params, state, x_test, y_test)
  for k, v in zip(('train_loss', 'train_acc', 'test_loss', 'test_acc', 'lr'),
                  (*init_train, *init_test, float('nan'))):
    curves[k].append(float(v))
  for epoch in range(1, epochs + 1):
    cur_lr = float(sched_state.lr)
    opt_state = schedules.set_learning_rate(opt_state, sched_state.lr)
    params, state, opt_state, tr_loss, tr_acc = run_epoch(
        params, state, opt_state, jax.random.fold_in(key_data, epoch))
    te_loss, te_acc = evaluate(params, state, x_test, y_test)
    sched_state = sched.update(sched_state)
    for k, v in zip(('train_loss', 'train_acc', 'test_loss', 'test_acc', 'lr'),
                    (tr_loss, tr_acc, te_loss, te_acc, cur_lr)):
      curves[k].append(float(v))
    log(f'[deep_sigmoid_mlp] {method} epoch {epoch}/{epochs}: train loss {float(tr_loss):.4f} '
        f'acc {float(tr_acc):.3f}, test loss {float(te_loss):.4f} acc {float(te_acc):.3f} '
        f'(lr {cur_lr:.4g}, {time.perf_counter() - t0:.0f} s)')
  return dict(curves=curves, seconds=time.perf_counter() - t0,
              final_train_loss=curves['train_loss'][-1], final_test_acc=curves['test_acc'][-1],
              final_test_loss=curves['test_loss'][-1], final_train_acc=curves['train_acc'][-1])


def stalled(result, num_classes: int) -> bool:
  """No learning: final train loss within 5% of chance level ln(K) (or not finite)."""
  loss = result['final_train_loss']
  return not math.isfinite(loss) or loss > 0.95 * math.log(num_classes)


def check_claims(results, num_classes: int) -> dict[str, str]:
  """Paper 003 Sec. 6.1 claims against the measurements."""
  out = {}
  chance = math.log(num_classes)
  for m, r in results.items():
    verdict = 'stalls' if stalled(r, num_classes) else 'trains'
    out[f'{m} trains (train loss below 0.95 ln K = {0.95 * chance:.3f})'] = (
        f'{verdict} (final train loss {r["final_train_loss"]:.4f}, test acc '
        f'{r["final_test_acc"]:.3f})')
  if 'plain' in results and 'lcw' in results:
    holds = stalled(results['plain'], num_classes) and not stalled(results['lcw'], num_classes)
    out['plain 50-layer sigmoid MLP stalls while LCW trains'] = (
        f'{"holds" if holds else "does not hold"} (train loss plain '
        f'{results["plain"]["final_train_loss"]:.4f}, lcw {results["lcw"]["final_train_loss"]:.4f})')
  for m in ('wn', 'sn'):
    if m in results:
      out[f'{m} does not train at all (paper: omitted from Fig. 5)'] = (
          f'{"holds" if stalled(results[m], num_classes) else "does not hold"}')
  return out


def plot(results, workdir):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for m, r in results.items():
    c = r['curves']
    axes[0].plot(range(len(c['train_loss'])), c['train_loss'], 'o-', ms=3, label=m)
    axes[1].plot(range(len(c['test_acc'])), c['test_acc'], 'o-', ms=3, label=m)
  axes[0].set_ylabel('train loss (epoch 0: at init)')
  axes[1].set_ylabel('test accuracy')
  for ax in axes:
    ax.set_xlabel('epoch')
    ax.legend(fontsize=8)
  fig.suptitle('Deep sigmoid MLP on CIFAR-10 (paper 003, Fig. 5)')
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'curves.png'), dpi=120)
  plt.close(fig)


def run_study(workdir: str, methods: Sequence[str] = DEFAULT_METHODS, data_dir: str | None = None,
              *, full: bool = False, epochs: int | None = None, train_examples: int | None = None,
              test_examples: int | None = None, depth: int | None = None,
              width: int | None = None, batch_size: int = 128, lr: float = 0.1,
              lr_decay: float = 0.95, min_lr: float = 0.001, momentum: float = 0.9,
              weight_decay: float = 1e-4, seed: int = 0, cache_dir: str | None = None,
              make_plots: bool = True, log=print, download: bool = False) -> dict[str, Any]:
  """Runs the study (reduced default, or the paper protocol with `full=True`).

  Unset sizes come from `FULL` or `REDUCED`. Writes results.json and curves.png.
  `download=True` fetches CIFAR-10 when no data directory holds it (`load_cifar`).
  """
  methods = check_methods(methods)
  cfg = dict(FULL if full else REDUCED)
  for k, v in dict(epochs=epochs, train_examples=train_examples, test_examples=test_examples,
                   depth=depth, width=width).items():
    if v is not None:
      cfg[k] = v
  if cfg['epochs'] < 1 or cfg['depth'] < 1 or cfg['width'] < 2 or batch_size < 1:
    raise ValueError(f'need epochs >= 1, depth >= 1, width >= 2, batch_size >= 1; got {cfg} '
                     f'batch_size={batch_size}.')
  if cfg['train_examples'] < 0 or cfg['test_examples'] < 0:
    raise ValueError(f'train_examples and test_examples must be >= 0 (0 = all), got {cfg}.')
  data = load_cifar(data_dir, cfg['train_examples'], cfg['test_examples'], seed, cache_dir,
                    download)
  os.makedirs(workdir, exist_ok=True)
  log(f'[deep_sigmoid_mlp] {len(data["y_train"])} train / {len(data["y_test"])} test images, '
      f'{cfg["depth"]} x {cfg["width"]} sigmoid, {cfg["epochs"]} epochs, methods '
      f'{",".join(methods)}')
  t_start = time.perf_counter()
  results = {}
  for m in methods:
    results[m] = train_method(
        m, data, depth=cfg['depth'], width=cfg['width'], epochs=cfg['epochs'],
        batch_size=batch_size, lr=lr, lr_decay=lr_decay, min_lr=min_lr, momentum=momentum,
        weight_decay=weight_decay, seed=seed, log=log)
  k = data['num_classes']
  summary = {
      'final_train_loss': {m: r['final_train_loss'] for m, r in results.items()},
      'final_test_acc': {m: r['final_test_acc'] for m, r in results.items()},
      'final_test_loss': {m: r['final_test_loss'] for m, r in results.items()},
      'final_train_acc': {m: r['final_train_acc'] for m, r in results.items()},
      'stalled': {m: stalled(r, k) for m, r in results.items()},
      'curves': {m: r['curves'] for m, r in results.items()},
      'seconds': {m: r['seconds'] for m, r in results.items()},
      'claims': check_claims(results, k),
      'config': dict(cfg, methods=list(methods), full=full, batch_size=batch_size, lr=lr,
                     lr_decay=lr_decay, min_lr=min_lr, momentum=momentum,
                     weight_decay=weight_decay, seed=seed,
                     num_train=int(len(data['y_train'])), num_test=int(len(data['y_test'])),
                     data_dependent_init=[m for m in methods if m in DATA_DEPENDENT_INIT]),
      'wall_seconds': time.perf_counter() - t_start,
  }
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  if make_plots:
    plot(results, workdir)
  log('| method | final train loss | final test acc | seconds |')
  log('| --- | --- | --- | --- |')
  for m, r in results.items():
    log(f'| {m} | {r["final_train_loss"]:.4f} | {r["final_test_acc"]:.3f} | {r["seconds"]:.0f} |')
  for claim, verdict in summary['claims'].items():
    log(f'[deep_sigmoid_mlp] paper claim: {claim}: {verdict}')
  log(f'[deep_sigmoid_mlp] wrote results.json{", curves.png" if make_plots else ""} to {workdir} '
      f'in {summary["wall_seconds"]:.1f} s')
  return {'summary': summary, 'results': results}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required (a directory for results.json and curves.png).')
  try:
    check_methods(FLAGS.methods)
  except ValueError as e:
    raise app.UsageError(f'--methods: {e}') from e
  run_study(FLAGS.workdir, FLAGS.methods, FLAGS.data_dir, full=FLAGS.full, epochs=FLAGS.epochs,
            train_examples=FLAGS.train_examples, test_examples=FLAGS.test_examples,
            depth=FLAGS.depth, width=FLAGS.width, batch_size=FLAGS.batch_size, lr=FLAGS.lr,
            lr_decay=FLAGS.lr_decay, min_lr=FLAGS.min_lr, momentum=FLAGS.momentum,
            weight_decay=FLAGS.weight_decay, seed=FLAGS.seed, cache_dir=FLAGS.cache_dir,
            download=FLAGS.download)


if __name__ == '__main__':
  define_flags()
  app.run(main)
