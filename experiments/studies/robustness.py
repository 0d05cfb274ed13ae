r"""Robustness to the learning rate, the init scale and the width (issue 27; paper 002's claim).

The command and the defaults are in `experiments/configs/robustness.py`. For each dataset and
method two grids train, each cell for `num_seeds` initialization seeds (the same seeds in
every cell, so cells differ only in their rate, scale or width):

- rates x init scales at the dataset's width (`hidden`, 0: the paper's);
- rates x widths (`widths`) at the careless init (Sec. 4.3's claim that GmP needs no
  layer-size dependent init).

Every cell of one (dataset, method, width) trains in ONE `experiments.lib.protocol.fit` call:
the members are `{'key', 'lr', 'scale', 'careless'}` (`fit(learning_rate=...)` starts each at
its rate; `init` scales each member's variables), vmapped, in chunks that keep a chunk's
activations small.

Datasets: `levy` (paper 002 Sec. 3.5: 50 noisy points, full-batch Adam, MAE, test RMSE on the
grid), `banana` (1000 points 80/20, Adam batch 128, BCE, test accuracy) and any UCI file of
the data directory (one random 80/20 split of seed `seed`, features standardized on the
training part, raw targets, full-batch Adam, MAE, test RMSE). Seeds vary the initialization
only, so the standard errors are over initializations. LR x0.1 on a plateau and early
stopping (best weights restored) keep each dataset's paper patience (`TASKS`) but watch the
*training* loss for every dataset (no test-set selection), within `num_epochs`.

`cifar10`: a small CNN, reduced by default (the `cifar_*` fields). `models.CNN` with layers
`(w, 'M', 2w, 'M')`: two 3x3 'SAME' conv layers of the method (`conv_0`, `conv_1`; ReLU), each
followed by 2x2 max pooling, then a global average pool and a plain Dense classifier. Its
*width* is `w`, the channels of the first conv (the second has `2w`): `cifar_width` for the
rate x scale grid, `cifar_widths` for the width sweep. Two conv layers, so GmP+IMN (IMN on
`conv_1`'s input, paper 002's CNN rule) differs from GmP. Trained as the paper trains its CNNs:
SGD with momentum `cifar_momentum` (0.9), no weight decay, softmax cross-entropy, minibatches of
`cifar_batch_size` shuffled per seed and epoch (the last, smaller batch kept), for
`cifar_epochs` epochs (plateau x0.1 after 3 flat epochs, stop after 6, on the training loss),
always in float32. Data: `experiments.data.cifar_arrays` (the offline JPEG archive of the data
directory), standardized per channel, a fixed random subset of `cifar_train_examples` training
and `cifar_test_examples` test images (seed `seed`), averaged over `cifar_downsample` x
`cifar_downsample` pixel blocks (default 2: 16x16 images, 4x less compute; 1: 32x32). Test metric: accuracy (evaluation mode:
BN's running statistics), in chunks of the batch size; the final training loss is the mean of
training-mode losses over the training set in the batches of one fixed shuffle
(`whole_set_batches`: the arrays are sorted by class; a last partial batch left out).
Memory: before any work (`check_data`) the study estimates a CNN fit's memory, the activations
of one vmapped chunk of members (batch x the layers' feature maps x `CNN_COPIES` x 4 bytes per
member) plus every member's parameters, optimizer state and copies and the training images,
and refuses a grid over `cifar_memory_gb` with the size; below it members train in chunks whose
activations stay under `cifar_chunk_mb` MiB (0: one member at a time, the fastest on the CPU,
where 4 vmapped members took 1.6x the time of 4 in turn: XLA's grouped convolutions are slower
than plain ones; on a GPU, e.g. 4096, all members of a fit at once).

What "init scale" multiplies (the hidden layers, or the CNN's conv layers; the output layer
keeps its init in every method, so a method's scale changes only its parameterized layers; the
CNN's conv kernels start He-normal, `models.CNN`'s, instead of Glorot):

- SP: the kernel (Glorot uniform; std `sqrt(2 / (fan_in + fan_out))`).
- WN: the gain `g` (flax starts it at 1: unit-norm columns whatever `v`); `v` is left alone,
  the function only sees `v / |v|`.
- BN: the kernel, as SP. BN standardizes the pre-activations, so the initial function does not
  change (up to BN's epsilon); what changes is the effective step: Adam's steps have a fixed
  size, so the relative change of the kernel per step is ~ lr / scale. For BN a scale sweep
  is a learning-rate sweep of the hidden weights in disguise (gamma stays 1).
- GmP (and GmP+IMN): the radius `r` (1 by default, paper Sec. 4.3; the Glorot norm with
  `gmp_glorot_scale`), `theta` uniform on the sphere as always, `lam = 0`.
- 'careless': every method starts from the function of N(0, 1) hidden weights and zero
  biases (no 1/fan-in scaling): SP and BN kernel ~ N(0, 1); WN `v` the same draw and `g =
  |v|` per unit; GmP `theta` the direction of the draw (still uniform) and `r = |w|` per unit
  (~ sqrt(fan_in)). Multipliers and careless draws use the same seeds. For a conv layer
  "per unit" is per output channel and fan-in is `3 * 3 * channels in`.

A member has *diverged* when its training loss was not finite in an epoch that ran, or its
final training loss (whole training set, training mode) is not finite or above
`diverge_factor` (2) times its initial one. A cell's mean is over all its seeds (a NaN seed
makes it NaN); a cell is marked diverged when any seed diverged.

The learning-rate sensitivity (Wortsman et al. 2023, Sec. 2) is `sensitivity`: the mean over
the grid of `min(loss, loss at init) - best`, a diverged cell counting as its initial loss.
It is computed on the final training loss (Wortsman's) and on the test error (RMSE, or
1 - accuracy; its "init" value the test error of the initial network), over the rate grid
(init scale 1), over the init scales (careless included) and over the widths (careless init),
the last two at the method's best rate (best test error at scale 1, among cells with no
diverged seed: the rate one tunes once and keeps).

Writes to `workdir`: results.json (every cell; per dataset and method the best rate, the good
rates, the sensitivities; the claims; wall times), results.csv (every member), results.md,
and per dataset `lr_<dataset>.png` (test metric and train loss against the rate, one curve
per method, s.e. bands, diverged cells marked), `heatmap_<dataset>.png` (rate x init scale per
method, one shared colour scale) and `width_<dataset>.png`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments.configs import validate
from experiments.data import cifar_arrays, uci_data
from experiments.lib import models, plotting, protocol, report
from experiments.studies import banana_2d, levy_1d
import geoparam

CARELESS = 'careless'  # the init-scale entry of the N(0, 1) init
CIFAR = 'cifar10'  # the CNN dataset
CHUNK_BYTES = 64 << 20  # hidden activations per vmapped chunk of members
CNN_COPIES = 4  # feature maps kept per conv layer and image (pre-activation, normalized,
# activation, gradient): the memory estimate's factor
CIFAR_SHAPE = (32, 32, 3)  # the memory estimate's image


@dataclasses.dataclass(frozen=True)
class Task:
  """How a dataset trains: paper width, batch (None: full batch), loss and test metric, the
  paper's plateau and early-stopping patience (epochs)."""
  width: int
  batch_size: int | None
  loss: str  # 'mae', 'bce' or 'ce' (softmax cross-entropy)
  metric: str  # 'rmse' (lower is better) or 'accuracy'
  plateau_patience: int
  stop_patience: int


TASKS = {'levy': Task(100, None, 'mae', 'rmse', 500, 1000),
         'banana': Task(10, 128, 'bce', 'accuracy', 50, 100),
         'uci': Task(100, None, 'mae', 'rmse', 50, 100),
         CIFAR: Task(16, 100, 'ce', 'accuracy', 3, 6)}  # width, batch: cifar_width, _batch_size


def task_of(dataset: str, c=None) -> Task:
  """`dataset`'s Task; cifar10's width and batch size from config `c` (when given)."""
  task = TASKS.get(dataset, TASKS['uci'])
  if dataset == CIFAR and c is not None:
    task = dataclasses.replace(task, width=c.cifar_width, batch_size=c.cifar_batch_size)
  return task


def widths_of(dataset: str, c) -> tuple[int, list[int]]:
  """`(width of the rate x scale grid, widths of the width sweep (that one included))`."""
  if dataset == CIFAR:
    return c.cifar_width, sorted(set(c.cifar_widths) | {c.cifar_width})
  width = c.hidden or task_of(dataset).width
  return width, sorted(set(c.widths) | {width})


def cnn_layers(width: int) -> tuple[Any, ...]:
  """The CIFAR-10 CNN's `models.CNN` layers at width `width` (the first conv's channels)."""
  return (width, 'M', 2 * width, 'M')


def cnn_memory(width: int, members: int, batch: int, images: int, num_classes: int = 10,
               shape=CIFAR_SHAPE, itemsize: int = 4, chunk_bytes: int = 0) -> dict[str, int]:
  """Estimated bytes of one CNN fit (`members` members at `width`, float32): `member` (the
  activations of one member's batch: every layer's feature maps x `CNN_COPIES`, the input
  once), `chunk` (members per vmapped chunk: the largest divisor of `members` whose activations
  stay under `chunk_bytes`, at least 1), `fixed` (every member's parameters x 5: params, gradient, momentum, best and
  initial copies; the training images) and `total` (`chunk * member + fixed`).

  >>> m = cnn_memory(16, 6, 100, 5000)
  >>> m['chunk'], cnn_memory(16, 6, 100, 5000, chunk_bytes=4 * m['member'])['chunk']
  (1, 3)
  >>> m['member'] == 100 * (3072 + 4 * (32 * 32 * 16 + 16 * 16 * 32) + 16 * 16 * 16 + 8 * 8 * 32) * 4
  True
  """
  h, w, ch = shape
  pixels = h * w * ch
  side, floats, params = h * w, pixels, 0
  for spec in cnn_layers(width):
    if spec == 'M':
      side //= 4
      floats += side * ch
    else:
      params += 9 * ch * spec + 2 * spec
      ch = spec
      floats += CNN_COPIES * side * ch
  params += ch * num_classes + num_classes
  member = batch * floats * itemsize
  fits = max(1, chunk_bytes // max(1, member))
  chunk = max(k for k in range(1, members + 1) if members % k == 0 and k <= fits)
  fixed = (members * 5 * params + images * pixels) * itemsize
  return dict(member=member, chunk=chunk, fixed=fixed, total=chunk * member + fixed)


# ---------------------------------------------------------------------------
# Config rules and data checks.


def _scales(v, config):
  validate.distinct_positive_reals(v, config)
  if not any(s == 1 for s in v):
    raise validate.Bad('must hold 1 (the default init, where the learning-rate curves are '
                       'read), e.g. "(0.1,1.0,10.0)"')


def _widths(v, config):
  validate.int_tuple(1)(v, config)
  if len(set(v)) != len(v):
    raise validate.Bad('must be distinct ints >= 1')


CONFIG_RULES = {'datasets': validate.distinct_names,
                'learning_rates': validate.distinct_positive_reals,
                'init_scales': _scales, 'widths': _widths, 'hidden': validate.integer(0),
                'diverge_factor': validate.real(1.0), 'good_tolerance': validate.real(0.0),
                'cifar_width': validate.integer(1), 'cifar_widths': _widths,
                'cifar_train_examples': validate.integer(0),
                'cifar_test_examples': validate.integer(0),
                'cifar_epochs': validate.integer(1), 'cifar_batch_size': validate.integer(1),
                'cifar_momentum': validate.real(0.0, 1.0, open_high=True),
                'cifar_memory_gb': validate.real(0.0, open_low=True),
                'cifar_chunk_mb': validate.integer(0),
                'cifar_downsample': validate.integer(1)}


def check_cnn_memory(config) -> None:
  """Raises `validate.ConfigError` (one line, with the size) when a CIFAR-10 CNN fit of the
  grid would need more than `cifar_memory_gb` (`cnn_memory`'s estimate), before any work."""
  c = config
  rates, scales = len(c.learning_rates), len(c.init_scales) + 1
  images = c.cifar_train_examples or 50000
  width, widths = widths_of(CIFAR, c)
  for w in widths:
    members = rates * (scales if w == width else 1) * c.num_seeds
    side = CIFAR_SHAPE[0] // c.cifar_downsample
    m = cnn_memory(w, members, c.cifar_batch_size, images, shape=(side, side, 3),
                   chunk_bytes=c.cifar_chunk_mb << 20)
    if m['total'] > c.cifar_memory_gb * 2 ** 30:
      raise validate.ConfigError(
          f'--config.cifar_memory_gb={c.cifar_memory_gb:g}: the cifar10 CNN grid at width {w} '
          f'({members} members, batch {c.cifar_batch_size}, {images} images) needs about '
          f'{m["total"] / 2 ** 30:.1f} GiB ({m["member"] / 2 ** 30:.2f} GiB of activations per '
          f'member x {m["chunk"]} per chunk, {m["fixed"] / 2 ** 30:.2f} GiB of parameters, '
          'optimizer states and images); lower cifar_width(s), cifar_batch_size, '
          'cifar_train_examples, the grid or num_seeds, or raise cifar_memory_gb.')


def check_data(config) -> None:
  """Raises `validate.ConfigError` for a CNN grid too large, or a missing or broken file."""
  names = [n.lower() for n in validate.split_names(config.datasets)]
  flag = f'--config.datasets={config.datasets}'
  if CIFAR in names:
    check_cnn_memory(config)
    if 0 < config.cifar_train_examples < config.cifar_batch_size:
      raise validate.ConfigError(
          f'--config.cifar_batch_size={config.cifar_batch_size}: more than the '
          f'{config.cifar_train_examples} training images (cifar_train_examples).')
    validate.check_cifar10(config.get('data_dir'), config.get('download', False),
                           config.get('cache_dir'))
  if 'banana' in names:
    banana_2d.check_data(config)
  uci = [n for n in names if n not in TASKS]
  if uci:
    try:
      uci_data.check_datasets(uci, config.get('data_dir'), config.get('download', False))
    except ValueError as e:
      message = str(e).removeprefix('--config.datasets: ')
      raise validate.ConfigError(f'{flag}: {message} (or levy, banana, cifar10)') from None


def load_data(dataset: str, c, dtype) -> dict[str, np.ndarray]:
  """`x_train, y_train, x_test, y_test` of `dataset` (targets `(rows, 1)`; cifar10: images
  `(n, 32, 32, 3)`, integer labels `(n,)` and `num_classes`)."""
  if dataset == CIFAR:
    a = cifar_arrays.load_flat_arrays(c.data_dir, c.cifar_train_examples, c.cifar_test_examples,
                                      c.seed, c.get('cache_dir'), c.download)
    side = int(round(math.sqrt(a['x_train'].shape[1] / 3)))
    if len(a['y_train']) < c.cifar_batch_size:
      raise validate.ConfigError(
          f'--config.cifar_batch_size={c.cifar_batch_size}: more than the '
          f'{len(a["y_train"])} training images of the archive.')
    f = c.cifar_downsample  # f x f average pooling of the (standardized) images
    shrink = lambda x: x.reshape(-1, side // f, f, side // f, f, 3).mean(axis=(2, 4))
    if side % f:
      raise validate.ConfigError(f'--config.cifar_downsample={f}: does not divide the '
                                 f'{side}x{side} images.')
    return dict(x_train=shrink(a['x_train']), y_train=a['y_train'],
                x_test=shrink(a['x_test']), y_test=a['y_test'], num_classes=a['num_classes'])
  if dataset == 'levy':
    return levy_1d.make_data(c.seed, dtype)
  if dataset == 'banana':
    x_all, y_all = banana_2d.load_banana(c.data_dir, c.download)
    return banana_2d.make_data(x_all, y_all, c.seed, dtype=dtype)
  ds = uci_data.load(dataset, c.data_dir, c.download)
  split = uci_data.make_splits(len(ds.y), 1, c.seed, source=ds.path)
  x_train, x_test = uci_data.standardize(ds.x[split.fit[0]], ds.x[split.test[0]])
  return {k: v.astype(dtype) for k, v in dict(
      x_train=x_train, y_train=ds.y[split.fit[0]][:, None], x_test=x_test,
      y_test=ds.y[split.test[0]][:, None]).items()}


# ---------------------------------------------------------------------------
# Initial scales.


def _hidden_names(params) -> list[str]:
  """`MLP`'s `hidden_{i}` and `CNN`'s `conv_{i}` layers."""
  return sorted(n for n in params for p in ('hidden_', 'conv_')
                if n.startswith(p) and n[len(p):].isdigit())


def _rescale_plain(params, name, draw, scale, pick) -> dict:
  """nn.Dense/nn.Conv: the kernel scaled, or the careless draw itself."""
  layer = dict(params[name])
  kernel = layer['kernel']
  layer['kernel'] = pick(draw(kernel.shape, kernel.dtype), scale * kernel)
  return {name: layer}


def _rescale_weight_norm(params, name, draw, scale, pick) -> dict:
  """flax's WeightNorm of it: the gain scaled; careless, the draw and its norm per unit."""
  layer, wn = dict(params[name]), dict(params[f'{name}_wn'])
  w = draw(layer['kernel'].shape, layer['kernel'].dtype)
  layer['kernel'] = pick(w, layer['kernel'])
  norm = jnp.sqrt(jnp.sum(w ** 2, axis=tuple(range(w.ndim - 1))))
  wn[f'{name}/kernel/scale'] = pick(norm, scale * wn[f'{name}/kernel/scale'])
  return {name: layer, f'{name}_wn': wn}


def _rescale_method(kind: str):
  """A method's variables (GmP's): its record's gain scaled; careless, its record's form
  (`from_kernel`) of the N(0, 1) draw."""
  record = geoparam.methods.get(kind)
  if record.gain is None or record.from_kernel is None:
    raise ValueError(f'weight kind {kind!r}: its method has no gain or no from_kernel, so no '
                     'init scale is defined.')

  def rescale(params, name, draw, scale, pick):
    layer = params[name]
    shape, _ = geoparam.methods.base.dense_spec(record, layer, name)
    w = draw(shape, layer[record.gain].dtype)
    new = record.from_kernel(w, jnp.zeros(shape[1:], w.dtype), True)
    return {name: {k: pick(new[k], scale * v if k == record.gain else v)
                   for k, v in layer.items()}}
  return rescale


# A weight kind's rescaling (`models.WEIGHTS`' keys; any other is a method of the library).
RESCALE = {'plain': _rescale_plain, 'wn': _rescale_weight_norm}


def rescale(variables, method: str, scale, careless, key):
  """`variables` of `models.MLP` (or `models.CNN`) with the hidden (conv) layers' init scaled by
  `scale`, or (where `careless`) replaced by the careless N(0, 1) init (see the module
  docstring); traceable, so `scale` and `careless` may differ per vmapped member. A conv
  kernel's units are its output channels (last axis)."""
  kind = models.PARAMETERIZATIONS[method].weights
  layer_rescale = RESCALE[kind] if kind in RESCALE else _rescale_method(kind)
  params = dict(variables['params'])  # a shallow copy: edited layers are new dicts
  pick = lambda new, old: jnp.where(careless, new, old).astype(old.dtype)
  for i, name in enumerate(_hidden_names(params)):
    draw = lambda shape, dtype, i=i: jax.random.normal(jax.random.fold_in(key, i), shape, dtype)
    params.update(layer_rescale(params, name, draw, scale, pick))
  return {**variables, 'params': params}


# ---------------------------------------------------------------------------
# Training.


def seed_keys(seed: int, num_seeds: int) -> jax.Array:
  """Raw keys `(num_seeds, 2)`; seed `i`'s depends only on `(seed, i)`."""
  return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(
      jnp.arange(num_seeds))


def members_of(cells: Sequence[tuple[float, Any]], keys, dtype) -> dict[str, jax.Array]:
  """Members of `fit` for `cells` (`(lr, scale)`, scale a multiplier or CARELESS) x seeds,
  cell-major: member `i` is cell `i // S`, seed `i % S`."""
  s = keys.shape[0]
  rep = lambda v: jnp.repeat(jnp.asarray(v), s)
  return dict(key=jnp.tile(keys, (len(cells), 1)),
              lr=rep(np.array([lr for lr, _ in cells], dtype)),
              scale=rep(np.array([1.0 if sc == CARELESS else sc for _, sc in cells], dtype)),
              careless=rep(np.array([sc == CARELESS for _, sc in cells])))


def _chunk(members: int, rows: int, width: int, itemsize: int) -> int:
  """Members per vmapped chunk: the largest divisor of `members` whose activations fit."""
  fits = max(1, CHUNK_BYTES // max(1, rows * width * itemsize))
  return max(k for k in range(1, members + 1) if members % k == 0 and k <= fits)


def train_cells(dataset: str, data, method: str, width: int, cells, c, dtype
                ) -> dict[str, np.ndarray]:
  """Trains every cell of `cells` for every seed, all in one `protocol.fit` call.

  Returns per-member arrays shaped `(cells, seeds)`: `train_loss`, `train_loss_init` (whole
  training set, training mode), `test`, `test_init` (the test metric), `nonfinite` (a
  non-finite training loss in an epoch that ran), `diverged`, `epochs_run`; and `seconds`.
  cifar10 trains the CNN (`width`: its first conv's channels) with SGD + momentum.
  """
  task = task_of(dataset, c)
  if dataset == CIFAR:
    parts = _cnn_parts(data, method, width, c, task, dtype)
  else:
    parts = _mlp_parts(data, method, width, c, task, dtype)
  model, train_loss, whole_loss, metric, batches, example = parts

  def init(member):
    k_init, k_careless, _ = jax.random.split(member['key'], 3)
    return rescale(model.init(k_init, example, train=False), method, member['scale'],
                   member['careless'], k_careless)

  def finalize(initial, final, member):
    if dataset != CIFAR:
      return dict(train_loss_init=whole_loss(initial), train_loss=whole_loss(final),
                  test_init=metric(initial), test=metric(final))
    # The CNN: both variable sets in one vmapped evaluation (one copy of the net to compile).
    both = jax.tree.map(lambda a, b: jnp.stack([a, b]), initial, final)
    loss, test = jax.vmap(lambda v: (whole_loss(v), metric(v)))(both)
    return dict(train_loss_init=loss[0], train_loss=loss[1], test_init=test[0], test=test[1])

  settings = protocol.Protocol(num_epochs=c.cifar_epochs if dataset == CIFAR else c.num_epochs,
                               learning_rate=1.0, monitor='loss',
                               mode='min', plateau_patience=task.plateau_patience,
                               stop_patience=task.stop_patience)
  members = members_of(cells, seed_keys(c.seed, c.num_seeds), dtype)
  size = len(cells) * c.num_seeds
  if dataset == CIFAR:
    optimizer = lambda learning_rate: optax.sgd(learning_rate, momentum=c.cifar_momentum)
    chunk = cnn_memory(width, size, task.batch_size, len(data['y_train']),
                       int(data['num_classes']), data['x_train'].shape[1:],
                       chunk_bytes=c.cifar_chunk_mb << 20)['chunk']
  else:
    optimizer = optax.adam
    chunk = _chunk(size, task.batch_size or data['x_train'].shape[0], width,
                   np.dtype(dtype).itemsize)
  t0 = time.perf_counter()
  out = protocol.fit(settings, init=init, loss=train_loss, batches=batches, members=members,
                     finalize=finalize, optimizer=optimizer, learning_rate=lambda m: m['lr'],
                     chunk=chunk)
  logs = jax.tree.map(np.asarray, out['logs'])
  result = {k: np.asarray(v, np.float64) for k, v in out['final'].items()}
  result['nonfinite'] = np.any(~np.isfinite(logs['loss']) & logs['active'], axis=1)
  result['epochs_run'] = np.asarray(out['epochs_run'])
  result['diverged'] = diverged(result['train_loss'], result['train_loss_init'],
                                result['nonfinite'], c.diverge_factor)
  result = {k: v.reshape(len(cells), c.num_seeds) for k, v in result.items()}
  result['seconds'] = time.perf_counter() - t0
  return result


def _mlp_parts(data, method, width, c, task, dtype):
  """`(model, loss of fit, whole-set train loss, test metric, batches, init input)` of the MLP
  datasets (full-batch or minibatches of data)."""
  model = models.MLP(hidden=(width,) * c.depth, out=1, method=method,
                     gmp_glorot_scale=c.gmp_glorot_scale, param_dtype=dtype)
  x, y, x_test, y_test = (jnp.asarray(data[k]) for k in ('x_train', 'y_train', 'x_test',
                                                          'y_test'))

  def train_loss(variables, inputs, targets):
    pred, updates = models.apply_train(model, variables, inputs)
    if task.loss == 'mae':
      return jnp.mean(jnp.abs(pred - targets)), updates
    return jnp.mean(optax.sigmoid_binary_cross_entropy(pred, targets)), updates

  def metric(variables):
    pred = model.apply(variables, x_test, train=False)
    if task.metric == 'rmse':
      return jnp.sqrt(jnp.mean((pred - y_test) ** 2))
    return jnp.mean(((pred > 0).astype(y_test.dtype) == y_test).astype(pred.dtype))

  if task.batch_size is None:
    batches = protocol.full_batch(x, y)
  else:
    def batches(member, t):
      return protocol.shuffled_batches(jax.random.split(member['key'], 3)[2], t, (x, y),
                                       task.batch_size)

  return (model, lambda v, b, m: train_loss(v, *b), lambda v: train_loss(v, x, y)[0], metric,
          batches, x)


def whole_set_batches(n: int, batch_size: int) -> jax.Array:
  """`(n // batch_size, batch_size)` indices: the batches of the CNN's whole-set training loss,
  the full batches of one fixed shuffle (`protocol.shuffled_batches`, key 0). Training mode
  normalizes each batch with its own statistics (BN, MBN, IMN), and the arrays are sorted by
  class, so consecutive rows would give one-class batches and a wrong loss (measured on the
  default CNN grid: BN's final loss 2.67 where its epochs' and the whole set's at once were
  1.93 and 1.86).

  >>> whole_set_batches(7, 3).shape
  (2, 3)
  """
  return protocol.shuffled_batches(jax.random.key(0), 0, jnp.arange(n), batch_size)[0]


def _cnn_parts(data, method, width, c, task, dtype):
  """`_mlp_parts` of the CIFAR-10 CNN: batches are index vectors into the (shared) training
  images; the whole-set loss and the test accuracy run in chunks of the batch size."""
  model = models.CNN(num_classes=int(data['num_classes']), layers=cnn_layers(width),
                     method=method, param_dtype=dtype)
  x, y, x_test, y_test = (jnp.asarray(data[k]) for k in ('x_train', 'y_train', 'x_test',
                                                          'y_test'))
  n, b = x.shape[0], task.batch_size

  def train_loss(variables, idx):
    logits, updates = models.apply_train(model, variables, x[idx])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y[idx]).mean(), updates

  order = whole_set_batches(n, b)

  def whole_loss(variables):  # training mode per batch; a last partial batch left out
    return jnp.mean(jax.lax.map(lambda i: train_loss(variables, i)[0], order))

  def metric(variables):  # evaluation mode, padded chunks masked
    m = x_test.shape[0]
    pad = -m % b
    idx = jnp.concatenate([jnp.arange(m), jnp.zeros((pad,), jnp.int32)]).reshape(-1, b)
    keep = (jnp.arange(m + pad) < m).reshape(-1, b)

    def one(args):
      i, k = args
      logits = model.apply(variables, x_test[i], train=False)
      return jnp.sum((jnp.argmax(logits, -1) == y_test[i]) & k)

    return (jnp.sum(jax.lax.map(one, (idx, keep))) / m).astype(dtype)

  def batches(member, t):
    return protocol.shuffled_batches(jax.random.split(member['key'], 3)[2], t, jnp.arange(n), b)

  return model, lambda v, i, m: train_loss(v, i), whole_loss, metric, batches, x[:2]


def diverged(final, initial, nonfinite, factor: float) -> np.ndarray:
  """The divergence rule: a non-finite loss in an epoch that ran, or a final training loss
  that is not finite or above `factor` times the initial one.

  >>> diverged([0.1, np.nan, 3.0, 1.9], [1.0, 1.0, 1.0, 1.0], [False, False, False, True], 2.0)
  array([False,  True,  True,  True])
  """
  final, initial = np.asarray(final, np.float64), np.asarray(initial, np.float64)
  with np.errstate(invalid='ignore'):
    return np.asarray(nonfinite) | ~np.isfinite(final) | (final > factor * initial)


# ---------------------------------------------------------------------------
# Statistics.


def sensitivity(losses, initial) -> float:
  """Wortsman et al. 2023 (Sec. 2) sensitivity of `losses` over a grid (log-spaced rates,
  init scales, widths): `mean(min(loss, initial) - best)` over the cells, a non-finite cell
  counting as `initial` (a diverged run counts as the loss at init, not NaN); `best` is the
  smallest of those capped values, so the statistic is >= 0 (Wortsman's `min loss` whenever a
  cell beats its initial loss). `initial`: a scalar or one value per cell; a cell whose loss
  and initial value are both non-finite is left out. NaN only if no loss is finite.

  >>> round(sensitivity([0.5, 0.2, float('nan'), 3.0], 1.0), 9)  # (0.3 + 0 + 0.8 + 0.8) / 4
  0.475
  >>> sensitivity([float('nan'), float('inf')], 1.0)
  nan
  """
  loss = np.asarray(losses, np.float64).ravel()
  init = np.broadcast_to(np.asarray(initial, np.float64), np.shape(losses)).ravel()
  if not np.any(np.isfinite(loss)):
    return math.nan
  capped = np.where(np.isfinite(loss), np.fmin(loss, init), init)
  capped = capped[np.isfinite(capped)]
  return float(np.mean(capped - capped.min()))


def error(metric: str, values):
  """The test metric as an error (lower is better): RMSE itself, 1 - accuracy."""
  values = np.asarray(values, np.float64)
  return values if metric == 'rmse' else 1.0 - values


def cell_summary(dataset: str, method: str, width: int, lr: float, scale, r, j: int
                 ) -> dict[str, Any]:
  """The results.json record of cell `j` of a `train_cells` result `r`."""
  mean, se = report.mean_se(r['test'][j], single=math.nan)
  return dict(dataset=dataset, method=method, width=width, lr=lr, scale=scale,
              train_loss=float(np.mean(r['train_loss'][j])),
              train_loss_init=float(np.mean(r['train_loss_init'][j])),
              test_metric=mean, test_metric_se=se,
              test_metric_init=float(np.mean(r['test_init'][j])),
              diverged=bool(np.any(r['diverged'][j])),
              diverged_seeds=int(np.sum(r['diverged'][j])),
              epochs_run=float(np.mean(r['epochs_run'][j])))


def analyze(cells: Sequence[Mapping[str, Any]], metric: str, rates, scales, widths,
            default_width: int, tolerance: float) -> dict[str, Any]:
  """Per-method statistics of one dataset's and method's cells (`cell_summary` records).

  `best_lr`: the rate of the lowest mean test error at init scale 1 among cells with no
  diverged seed (NaN if none); `good_lrs`: those rates whose error is within `tolerance` of the
  best (`error <= (1 + tolerance) * best`), `good_decades` their span `log10(max / min)`;
  sensitivities (`sensitivity`) of the train loss and of the test error over the rates (scale
  1), the init scales and the widths (careless init), the last two at `best_lr`.
  """
  at = {(c['width'], c['lr'], c['scale']): c for c in cells}
  loss = lambda c: math.nan if c['diverged'] else c['train_loss']
  err = lambda c: math.nan if c['diverged'] else float(error(metric, c['test_metric']))
  err_init = lambda c: float(error(metric, c['test_metric_init']))

  def stats(row):
    return dict(loss=sensitivity([loss(c) for c in row], [c['train_loss_init'] for c in row]),
                test=sensitivity([err(c) for c in row], [err_init(c) for c in row]))

  by_lr = [at[(default_width, lr, 1.0)] for lr in rates]
  errors = np.array([err(c) for c in by_lr])
  out: dict[str, Any] = dict(best_lr=math.nan, best_metric=math.nan, best_metric_se=math.nan,
                             good_lrs=[], good_decades=math.nan)
  if np.any(np.isfinite(errors)):
    b = int(np.nanargmin(errors))
    good = [lr for lr, e in zip(rates, errors) if e <= (1 + tolerance) * errors[b]]
    out.update(best_lr=rates[b], best_metric=by_lr[b]['test_metric'],
               best_metric_se=by_lr[b]['test_metric_se'], good_lrs=good,
               good_decades=float(np.log10(max(good) / min(good))))
  lr_s = stats(by_lr)
  out.update(lr_sensitivity=lr_s['loss'], lr_sensitivity_test=lr_s['test'])
  for name, keys in (('scale', [(default_width, s) for s in scales]),
                     ('width', [(w, CARELESS) for w in widths])):
    row = [at[(w, out['best_lr'], sc)] for w, sc in keys] if np.isfinite(out['best_lr']) else []
    s = stats(row) if row else dict(loss=math.nan, test=math.nan)
    # Trained: some cell's test error is below (1 - tolerance) x the row's mean initial error. A
    # row that never leaves its initial error has sensitivity 0 without being robust.
    trained = bool(row) and bool(np.nanmin([err(c) for c in row] + [math.inf]) <
                                 (1 - tolerance) * np.mean([err_init(c) for c in row]))
    out.update({f'{name}_sensitivity': s['loss'], f'{name}_sensitivity_test': s['test'],
                f'{name}_trained': trained})
  out['diverged_cells'] = sum(c['diverged'] for c in cells)
  out['cells'] = len(cells)
  return out


def check_claims(analysis: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, str]:
  """Paper 002's robustness claims, per dataset, against `analysis` (dataset -> method ->
  `analyze`'s dict); `report.claim` gives no verdict on non-finite numbers. Needs GmP (`gmp`,
  else another `models.is_gmp` method, e.g. `gmp_imn`) and a method that is not."""
  out = {}
  for d, by_method in analysis.items():
    gmps = [m for m in by_method if models.is_gmp(m)]  # plain GmP first when it ran
    gmp = 'gmp' if 'gmp' in gmps else next(iter(gmps), None)
    others = [m for m in by_method if not models.is_gmp(m)]
    if gmp is None or not others:
      continue
    g = by_method[gmp]
    best = {m: by_method[m]['best_lr'] for m in others}
    out[f"{d}: GmP's best learning rate is >= 3x every other method's"] = report.claim(
        all(g['best_lr'] >= 3 * b for b in best.values()),
        f'GmP {g["best_lr"]:g}; ' + ', '.join(f'{m} {b:g}' for m, b in best.items()),
        g['best_lr'], *best.values())
    for key, what in (('lr_sensitivity', 'the lowest learning-rate sensitivity (train loss)'),
                      ('scale_sensitivity_test', 'the test metric that varies least across '
                       'init scales (sensitivity of the test error)'),
                      ('width_sensitivity_test', 'the test metric that varies least across '
                       'widths (sensitivity of the test error)')):
      values = {m: by_method[m][key] for m in (gmp, *others)}
      grid = key.split('_')[0]  # lr, scale, width
      # A method that never trains on the grid varies by 0: no claim of robustness for GmP then.
      untrained = [m for m in values if not by_method[m].get(f'{grid}_trained', True)]
      detail = ', '.join(f'{plotting.method_label(m)} {v:.4g}' for m, v in values.items())
      if untrained:
        detail += '; did not train (test error within the tolerance of its init): ' + ', '.join(
            plotting.method_label(m) for m in untrained)
      out[f'{d}: GmP has {what}'] = report.claim(
          gmp not in untrained and all(values[gmp] < values[m] for m in others), detail,
          *values.values())
  return out


# ---------------------------------------------------------------------------
# Tables and figures.


def make_table(analysis, metrics, rates) -> str:
  """One markdown table per dataset: best rate, its test metric, the good rates, the
  sensitivities and the diverged cells per method."""
  parts = []
  for d, by_method in analysis.items():
    rows = []
    for m, a in by_method.items():
      good = (f'{min(a["good_lrs"]):g}-{max(a["good_lrs"]):g} ({len(a["good_lrs"])} of '
              f'{len(rates)}, {a["good_decades"]:.1f} dec.)' if a['good_lrs'] else '-')
      rows.append([plotting.method_label(m), f'{a["best_lr"]:g}',
                   report.format_pair(a['best_metric'], a['best_metric_se'], 4), good,
                   f'{a["lr_sensitivity"]:.4g}', f'{a["lr_sensitivity_test"]:.4g}',
                   f'{a["scale_sensitivity_test"]:.4g}', f'{a["width_sensitivity_test"]:.4g}',
                   f'{a["diverged_cells"]} / {a["cells"]}'])
    parts.append(f'**{d}** (test {metrics[d]}):\n\n' + report.markdown_table(
        ['method', 'best lr', f'test {metrics[d]} at best lr', 'good lrs', 'LR sens. (loss)',
         'LR sens. (test)', 'scale sens. (test)', 'width sens. (test)', 'diverged cells'],
        rows))
  return '\n\n'.join(parts)


def _scale_label(s) -> str:
  return 'N(0,1)' if s == CARELESS else f'x{s:g}'


def _plot_curve(ax, xs, cells, key, color, label, top=None):
  """Mean +- s.e. of `key` over `cells` against `xs`; diverged cells marked x (non-finite or
  above `top`: drawn at the top edge)."""
  mean = np.array([c[key] for c in cells], np.float64)
  se = np.array([c.get(f'{key}_se', math.nan) for c in cells], np.float64)
  ax.plot(xs, mean, '-o', ms=3, color=color, label=label)
  ok = np.isfinite(mean) & np.isfinite(se)
  ax.fill_between(np.asarray(xs)[ok], (mean - se)[ok], (mean + se)[ok], color=color, alpha=0.2,
                  lw=0)
  bad = np.array([c['diverged'] for c in cells])
  if np.any(bad):
    lim = top if top is not None else np.nanmax(np.where(np.isfinite(mean), mean, np.nan))
    shown = np.where(np.isfinite(mean) & (mean <= lim), mean, lim)
    ax.plot(np.asarray(xs)[bad], shown[bad], 'x', ms=8, mew=2, color=color)


def _plain_log_axis(axis) -> None:
  """Plain numbers (0.5, 2, 30) on a log axis, major and minor ticks: the minor ones at 2 and
  5, or all of them when the axis spans less than a factor of 3 (else it may show one label)."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  def minor(v, _):
    lo, hi = sorted(axis.get_view_interval())
    return f'{v:g}' if (hi < 3 * lo or f'{v:.0e}'[0] in '25') else ''  # 0.5: '5e-01'

  axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f'{v:g}'))
  axis.set_minor_formatter(ticker.FuncFormatter(minor))


def _top(values, ratio: float = 30.0) -> float:
  """An upper y limit for a log plot of positive `values`: at most `ratio` x their smallest."""
  v = np.asarray(values, np.float64)
  v = v[np.isfinite(v) & (v > 0)]
  return float(min(v.max(), ratio * v.min()) * 1.3) if v.size else 1.0


def plot(dataset, cells, analysis, methods, rates, scales, widths, width, metric, n, workdir,
         cnn: bool = False) -> list[str]:
  """lr_<d>.png, heatmap_<d>.png and width_<d>.png of one dataset (`cells` its records,
  `analysis` method -> `analyze`'s dict, `n` seeds per cell, `cnn`: the CIFAR-10 CNN's
  optimizer and width; see the module docstring)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import colors, ticker  # pylint: disable=g-import-not-at-top

  at = {(x['method'], x['width'], x['lr'], x['scale']): x for x in cells}
  figures = []
  log_metric = metric == 'rmse'

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for key, ax in zip(('test_metric', 'train_loss'), axes):
    row = {m: [at[(m, width, lr, 1.0)] for lr in rates] for m in methods}
    values = [x[key] for r in row.values() for x in r]
    top = _top(values) if (log_metric or key == 'train_loss') else None
    # The train loss at init (mean over the rates' cells), dotted: the y range reaches it.
    inits = ({m: np.mean([x['train_loss_init'] for x in row[m]]) for m in methods}
             if key == 'train_loss' else {})
    shown = [v for v in inits.values() if np.isfinite(v) and v > 0]
    if shown:
      top = max(top, 1.3 * max(shown))
    for k, m in enumerate(methods):
      _plot_curve(ax, rates, row[m], key, f'C{k}', plotting.method_label(m), top)
      if m in inits and np.isfinite(inits[m]):
        ax.axhline(inits[m], color=f'C{k}', ls=':', lw=1.2)
    ax.set_xscale('log')
    if top is not None:
      ax.set_yscale('log')
      ax.set_ylim(top=top)
      _plain_log_axis(ax.yaxis)
    ax.set_xlabel('SGD (momentum) learning rate' if cnn else 'Adam learning rate')
  axes[0].set_ylabel(f'test {metric}' + (' (higher is better)' if metric == 'accuracy' else ''))
  axes[0].set_title(f'test {metric}, mean +- s.e. over {n} seeds', fontsize=10)
  axes[1].set_ylabel('final train loss')
  axes[1].set_title('final train loss (dotted: at init)', fontsize=10)
  axes[1].plot([], [], 'k:', lw=1.2, label='train loss at init (method colour)')
  axes[1].plot([], [], 'kx', ms=8, mew=2, label='diverged (non-finite / off-scale: top edge)')
  axes[1].legend(fontsize=8, loc='center left', bbox_to_anchor=(1.01, 0.5))
  figures.append(plotting.save(
      fig, workdir, f'lr_{dataset}.png',
      title=f'{dataset}: learning-rate sweep at init scale x1, width {width}'))

  fig, axes = plt.subplots(1, len(methods), figsize=(3.3 * len(methods) + 1.2, 3.6),
                           squeeze=False)
  grids = {m: np.array([[at[(m, width, lr, s)]['test_metric'] for lr in rates] for s in scales])
           for m in methods}
  finite = np.concatenate([g[np.isfinite(g)] for g in grids.values()] + [np.zeros(0)])
  if log_metric and finite.size:
    norm = colors.LogNorm(vmin=finite.min(), vmax=_top(finite, 10.0) / 1.3)
  elif finite.size:
    norm = colors.Normalize(vmin=finite.min(), vmax=finite.max())
  else:
    norm = colors.Normalize(0, 1)
  cmap = plt.get_cmap('viridis_r' if log_metric else 'viridis').with_extremes(bad='0.8')
  image = None
  for ax, m in zip(axes[0], methods):
    # Rows top to bottom: the init scales ascending (x1 the default), the careless N(0,1) last.
    image = ax.imshow(np.ma.masked_invalid(grids[m]), norm=norm, cmap=cmap, aspect='auto',
                      origin='upper')
    for i, s in enumerate(scales):
      for j, lr in enumerate(rates):
        if at[(m, width, lr, s)]['diverged']:
          ax.text(j, i, 'x', ha='center', va='center', color='red', fontsize=9, weight='bold')
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([f'{lr:g}' for lr in rates], rotation=90, fontsize=7)
    ax.set_yticks(range(len(scales)))
    ax.set_yticklabels([_scale_label(s) for s in scales], fontsize=7)
    ax.set_xlabel('learning rate')
    ax.set_title(plotting.method_label(m), fontsize=10)
  axes[0][0].set_ylabel('init scale')
  bar = fig.colorbar(image, ax=list(axes[0]), extend='max' if log_metric else 'neither',
                     fraction=0.03, pad=0.02)
  bar.set_label(f'test {metric} (mean over {n} seeds)')
  if log_metric:
    _plain_log_axis(bar.ax.yaxis)
  fig.suptitle(f'{dataset}: test {metric} over learning rate x init scale, width {width} '
               '(red x: diverged; grey: non-finite)', fontsize=10, y=1.03)
  fig.savefig(os.path.join(workdir, f'heatmap_{dataset}.png'), dpi=120, bbox_inches='tight')
  plt.close(fig)
  figures.append(f'heatmap_{dataset}.png')

  fig, ax = plt.subplots(figsize=(7, 4))
  values = []
  for k, m in enumerate(methods):
    best = {w: min((at[(m, w, lr, CARELESS)] for lr in rates),
                   key=lambda x: (x['diverged'] or not np.isfinite(x['test_metric']),
                                  float(error(metric, x['test_metric']))))
            for w in widths}
    values += [b['test_metric'] for b in best.values()]
    ax.plot(widths, [best[w]['test_metric'] for w in widths], '--', color=f'C{k}', lw=0.9,
            label=f'{plotting.method_label(m)}, best rate per width')
    chosen = analysis[m]['best_lr']
    if np.isfinite(chosen):
      row = [at[(m, w, chosen, CARELESS)] for w in widths]
      values += [x['test_metric'] for x in row]
      _plot_curve(ax, widths, row, 'test_metric', f'C{k}',
                  f'{plotting.method_label(m)}, lr {chosen:g} (best at x1)')
  ax.set_xscale('log')
  if log_metric:
    ax.set_yscale('log')
    ax.set_ylim(top=_top(values))
    _plain_log_axis(ax.yaxis)
  ax.xaxis.set_minor_locator(ticker.NullLocator())
  ax.set_xticks(widths)
  ax.set_xticklabels([str(w) for w in widths])
  ax.set_xlabel('channels of the first conv (second: 2x)' if cnn else 'hidden width')
  ax.set_ylabel(f'test {metric}')
  ax.plot([], [], 'kx', ms=8, mew=2, label='diverged')
  ax.legend(fontsize=7, loc='center left', bbox_to_anchor=(1.01, 0.5))
  figures.append(plotting.save(
      fig, workdir, f'width_{dataset}.png',
      title=f'{dataset}: test {metric} against the width at the careless N(0,1) init '
            f'(mean +- s.e., {n} seeds)'))
  return figures


# ---------------------------------------------------------------------------
# The study.


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` and writes its files; float64 only inside (`jax.enable_x64`).

  Returns `{'summary': what results.json holds, 'cells': every cell's record, 'runs':
  (dataset, method, width) -> train_cells' arrays}`.
  """
  validate.check_config(config, CONFIG_RULES)
  check_data(config)
  with jax.enable_x64(config.float64):
    return _run(config, workdir)


def _run(c, workdir):
  t_start = time.perf_counter()
  dtype = np.float64 if c.float64 else np.float32
  datasets = [n.lower() for n in validate.split_names(c.datasets)]
  methods = models.check_methods(validate.split_names(c.methods))
  rates = sorted(float(r) for r in c.learning_rates)
  scales = sorted(float(s) for s in c.init_scales) + [CARELESS]
  dtype_of = lambda d: np.float32 if d == CIFAR else dtype  # the CNN trains in float32
  data = {d: load_data(d, c, dtype_of(d)) for d in datasets}  # every file read before training
  os.makedirs(workdir, exist_ok=True)
  if CIFAR in data:
    x = data[CIFAR]['x_train']
    print(f'[robustness] cifar10: {len(x)} train / {len(data[CIFAR]["x_test"])} test images of '
          f'{x.shape[1]}x{x.shape[2]}, CNN {cnn_layers(c.cifar_width)}, SGD momentum '
          f'{c.cifar_momentum:g}, batch {c.cifar_batch_size}, {c.cifar_epochs} epochs', flush=True)
  cells, runs, rows, timings, analysis, metrics = [], {}, [], [], {}, {}
  for d in datasets:
    width, widths = widths_of(d, c)
    metrics[d] = task_of(d).metric
    analysis[d] = {}
    for m in methods:
      mine = []
      for w in [width] + [w for w in widths if w != width]:
        grid = [(lr, s) for lr in rates for s in (scales if w == width else [CARELESS])]
        r = train_cells(d, data[d], m, w, grid, c, dtype_of(d))
        runs[(d, m, w)] = r
        for j, (lr, s) in enumerate(grid):
          mine.append(cell_summary(d, m, w, lr, s, r, j))
          rows += [dict(dataset=d, method=m, width=w, lr=lr, scale=s, seed_index=i,
                        train_loss=r['train_loss'][j, i],
                        train_loss_init=r['train_loss_init'][j, i], test_metric=r['test'][j, i],
                        test_metric_init=r['test_init'][j, i],
                        diverged=bool(r['diverged'][j, i]), epochs_run=int(r['epochs_run'][j, i]))
                   for i in range(c.num_seeds)]
        timings.append(dict(dataset=d, method=m, width=w, members=len(grid) * c.num_seeds,
                            seconds=r['seconds']))
        bad = sum(x['diverged'] for x in mine[-len(grid):])
        print(f'[robustness] {d} {m} width {w}: {len(grid)} cells x {c.num_seeds} seeds in one '
              f'fit, {bad} diverged, {r["seconds"]:.1f} s incl. compile', flush=True)
      cells += mine
      analysis[d][m] = analyze(mine, metrics[d], rates, scales, widths, width, c.good_tolerance)
  claims = check_claims(analysis)
  figures = []
  if c.plots:
    for d in datasets:
      width, widths = widths_of(d, c)
      figures += plot(d, [x for x in cells if x['dataset'] == d], analysis[d], methods, rates,
                      scales, widths, width, metrics[d], c.num_seeds, workdir,
                      cnn=d == CIFAR)
  table = make_table(analysis, metrics, rates) + (
      '\n\nWall time per (dataset, method, width), one fit each (compile included):\n\n' +
      report.markdown_table(['dataset', 'method', 'width', 'members', 'seconds'],
                            [[t['dataset'], t['method'], t['width'], t['members'],
                              f'{t["seconds"]:.1f}'] for t in timings]))
  summary = dict(cells=cells, analysis=analysis, timings=timings, metrics=metrics,
                 learning_rates=rates, init_scales=scales,
                 divergence_rule=f'a non-finite training loss in an epoch that ran, or a final '
                 f'training loss not finite or above {c.diverge_factor:g} x the initial one')
  summary = report.write(workdir, 'robustness', summary=summary, rows=rows, table=table,
                         claims=claims, config=c, started=t_start, figures=figures)
  return {'summary': summary, 'cells': cells, 'runs': runs}
