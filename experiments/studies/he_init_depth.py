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
unit variance); `cifar10` uses the CIFAR-10 archive
(`experiments.data.cifar_arrays.load_flat_arrays`). The launch commands are in the
config's docstring:

  python -m experiments.main --config=experiments/configs/he_init_depth.py --workdir=/tmp/he_init

The training loop is `experiments.lib.protocol.train_epochs`. Writes to `workdir`:
`results.json` (per run `<activation>_<init>`: final train loss, test accuracy,
per-epoch curves, the std of every layer's pre-activation at init; the claims
against the measurements), `results.csv`, `results.md` and `curves.png` (train
loss and test accuracy per epoch, and the pre-activation std per layer at init).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import geoparam
from experiments.data import cifar_arrays
from experiments.lib import plotting
from experiments.lib import protocol
from experiments.lib import report
from experiments.configs import validate

ACTIVATIONS = ('relu', 'prelu')
INITS = ('glorot', 'he')
DATASETS = ('synthetic', 'cifar10')
PRELU_INIT = 0.25
INIT_TRAIN_EXAMPLES = 2048  # training examples evaluated at initialization
STD_EXAMPLES = 512  # examples of the pre-activation stds at init
# The study's own config fields (the others are validate.RULES').
CONFIG_RULES = {'dataset': validate.choice(DATASETS),
                'activations': validate.names_list(ACTIVATIONS),
                'inits': validate.names_list(INITS), 'width': validate.AT_LEAST_ONE,
                'train_examples': validate.mlp_examples(True)}


def check_data(config) -> None:
  """Raises `validate.ConfigError` unless CIFAR-10 (when read) is there and complete (or may
  download)."""
  if config.get('dataset') == 'cifar10':
    validate.check_cifar10(config.get('data_dir'), config.get('download', False),
                           config.get('cache_dir'))


def kernel_init(init: str, activation: str):
  """Glorot normal, or He normal for the activation's (initial) negative slope."""
  if init not in INITS:
    raise ValueError(f'unknown init {init!r}; accepted: {", ".join(INITS)}.')
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
  def __call__(self, x, train: bool = False):
    del train  # no layer behaves differently in training
    if self.activation not in ACTIVATIONS:
      raise ValueError(f'unknown activation {self.activation!r}; accepted: '
                       f'{", ".join(ACTIVATIONS)}.')
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


def load_data(config) -> dict[str, Any]:
  """The generated mixture or CIFAR-10 (flattened), as `config.dataset` says."""
  if config.dataset == 'synthetic':
    return make_synthetic(config.train_examples, config.test_examples, config.seed)
  return cifar_arrays.load_flat_arrays(config.data_dir, config.train_examples,
                                       config.test_examples, config.seed, config.cache_dir,
                                       config.download)


def preactivation_std(model, variables, x) -> list[float]:
  """Std of every Dense layer's output (pre-activation) on `x`, first to last."""
  _, inter = model.apply(variables, x, capture_intermediates=lambda m, _: isinstance(m, nn.Dense))
  inter = inter['intermediates']
  names = [f'dense_{i}' for i in range(model.depth)] + ['out']
  return [float(jnp.std(inter[n]['__call__'][0])) for n in names]


def train_run(activation: str, init: str, data, config, log=print) -> dict[str, Any]:
  """Trains one (activation, init) pair (`protocol.train_epochs`, constant rate)."""
  x_train = jnp.asarray(data['x_train'])
  model = DeepRectifierMLP(activation, init, depth=config.depth, width=config.width,
                           num_classes=data['num_classes'])
  key_init, key_data = jax.random.split(jax.random.key(config.seed))
  params = model.init(key_init, x_train[:config.batch_size])['params']
  out = protocol.train_epochs(
      model, {'params': params}, data, num_epochs=config.num_epochs,
      batch_size=config.batch_size, learning_rate=config.learning_rate, key=key_data,
      optimizer=protocol.masked_sgd(config.momentum, config.weight_decay),
      init_train_examples=INIT_TRAIN_EXAMPLES, log=log,
      label=f'[he_init_depth] {activation}_{init}')
  # Random rows, not the first: the CIFAR arrays are sorted by class.
  rows = np.random.default_rng(config.seed).permutation(x_train.shape[0])[:STD_EXAMPLES]
  out['preactivation_std_at_init'] = preactivation_std(model, {'params': params}, x_train[rows])
  if activation == 'prelu':
    final = out['variables']['params']
    out['prelu_mean_slope_per_layer'] = [
        float(np.asarray(final[f'prelu_{i}']['negative_slope']).mean())
        for i in range(config.depth)]
  return out


def check_claims(results, num_classes: int) -> dict[str, str]:
  """Paper 001's claim per activation; a non-finite loss gets no verdict."""
  out = {}
  for act in ACTIVATIONS:
    g, h = results.get(f'{act}_glorot'), results.get(f'{act}_he')
    if g is None or h is None:
      continue
    holds = (protocol.stalled(g['final_train_loss'], num_classes)
             and not protocol.stalled(h['final_train_loss'], num_classes))
    out[f'{act}: Glorot stalls and He trains'] = report.claim(
        holds, 'final train loss Glorot {:.4f}, He {:.4f}; chance ln K = {:.3f}; test acc '
        'Glorot {:.3f}, He {:.3f}', g['final_train_loss'], h['final_train_loss'],
        math.log(num_classes), g['final_test_acc'], h['final_test_acc'])
  return out


def plot(results, config, num_train: int, workdir: str) -> list[str]:
  """curves.png: train loss, test accuracy per epoch, pre-activation std per layer at init."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 3, figsize=(15, 3.9))
  protocol.plot_epoch_curves(axes, results)
  for i, (name, r) in enumerate(results.items()):
    std = r['preactivation_std_at_init']
    axes[2].semilogy(range(1, len(std) + 1), std, marker='.', ls=('-', '--', '-.', ':')[i % 4],
                     label=name)
  axes[2].set_ylabel('pre-activation std at init')
  axes[2].set_xlabel('layer (last: output)')
  axes[2].set_title(f'signal at init ({STD_EXAMPLES} training examples)', fontsize=10)
  axes[2].legend(fontsize=8, loc='center left', bbox_to_anchor=(1.02, 0.5))
  return [plotting.save(fig, workdir, 'curves.png', title=(
      f'Glorot vs He init, {config.depth}-layer rectifier MLP on {config.dataset} '
      f'({num_train} training examples), seed {config.seed} (one run each; paper 001)'))]


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs every (activation, init) pair of `config` (`experiments/configs/he_init_depth.py`).

  Returns `{'summary': what results.json holds, 'results': run -> train_epochs result}`.
  """
  validate.check_config(config, CONFIG_RULES)
  data = load_data(config)
  num_train, num_test, k = len(data['y_train']), len(data['y_test']), data['num_classes']
  os.makedirs(workdir, exist_ok=True)
  print(f'[he_init_depth] {config.dataset}: {num_train} train / {num_test} test, {config.depth} '
        f'x {config.width} hidden, {config.num_epochs} epochs', flush=True)
  t_start = time.perf_counter()
  results = {f'{act}_{init}': train_run(act, init, data, config,
                                        log=lambda s: print(s, flush=True))
             for act in validate.split_names(config.activations)
             for init in validate.split_names(config.inits)}
  keep = ('curves', 'preactivation_std_at_init', 'prelu_mean_slope_per_layer', 'seconds',
          'final_train_loss', 'final_train_acc', 'final_test_loss', 'final_test_acc')
  summary = {
      'final_train_loss': {m: r['final_train_loss'] for m, r in results.items()},
      'final_test_acc': {m: r['final_test_acc'] for m, r in results.items()},
      'stalled': {m: protocol.stalled(r['final_train_loss'], k) for m, r in results.items()},
      'runs': {m: {key: r[key] for key in keep if key in r} for m, r in results.items()},
      'data': dict(num_train=num_train, num_test=num_test, num_classes=k),
      'prelu_init': PRELU_INIT,
  }
  rows = [dict(run=m, final_train_loss=r['final_train_loss'], final_test_acc=r['final_test_acc'],
               stalled=summary['stalled'][m], last_preactivation_std_at_init=(
                   r['preactivation_std_at_init'][-1]), seconds=r['seconds'])
          for m, r in results.items()]
  table = report.markdown_table(
      ['run', 'final train loss', 'final test acc', 'last-layer pre-act std at init', 'seconds'],
      [[m, f'{r["final_train_loss"]:.4f}', f'{r["final_test_acc"]:.3f}',
        f'{r["preactivation_std_at_init"][-1]:.3g}', f'{r["seconds"]:.0f}']
       for m, r in results.items()])
  figures = plot(results, config, num_train, workdir) if config.plots else []
  summary = report.write(workdir, 'he_init_depth', summary=summary, rows=rows, table=table,
                         claims=check_claims(results, k), config=config, started=t_start,
                         figures=figures)
  return {'summary': summary, 'results': results}

