r"""Deep sigmoid MLP on CIFAR-10 (paper 003, Sec. 6.1, Fig. 5): SP vs LCW vs BN, WN, CWN, SN, SL.

Protocol of the paper (`experiments/configs/deep_sigmoid_mlp.py:full`): 50 hidden
layers of 256 sigmoid units and a softmax output, SGD with momentum 0.9, weight
decay 1e-4 (masked with `geoparam.decay_mask`: kernels and LCW `v` only), batch
128, 100 epochs, lr 0.1 multiplied by 0.95 after every epoch down to 0.001
(`geoparam.schedules.per_epoch_decay`), all 50000 training images. Inits as in
the paper: SP, LCW and BN+LCW use the minibatch-based init of Sec. 4.3
(`geoparam.linen.variance.data_dependent_init`: every layer rescaled so that its
pre-activation has unit variance on one minibatch); WN and CWN the same
rescaling of their gains (the variance part of Salimans & Kingma's init; the
biases stay 0); BN, SL and SN Glorot (uniform) init. The default config is the
same network and optimizer on 10000 training and 2000 test images for 5 epochs
(methods sp, lcw, bn, bn_lcw); the launch commands are in the config's docstring:

  python -m experiments.main --config=experiments/configs/deep_sigmoid_mlp.py \
      --workdir=/tmp/deep_sigmoid

Method names are rows of `experiments.lib.models.PARAMETERIZATIONS` (SP is the plain
Dense layer). The training loop is `experiments.lib.protocol.train_epochs`; the data
`experiments.data.cifar_arrays.load_flat_arrays` (standardized, flattened CIFAR-10).

Writes to `workdir`: `results.json` (per method: final train loss, test loss and
accuracy, per-epoch curves, seconds; the config; the paper's claims against the
measurements), `results.csv`, `results.md` and `curves.png` (train loss and test
accuracy per epoch and method; epoch 0 is the initialization).
"""

from __future__ import annotations

import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import geoparam
from geoparam import schedules
from geoparam.linen import variance
from experiments.data import cifar_arrays
from experiments.lib import models
from experiments.lib import plotting
from experiments.lib import protocol
from experiments.lib import report
from experiments.configs import validate

METHODS = ('sp', 'lcw', 'bn', 'bn_lcw', 'wn', 'cwn', 'sn', 'sl')  # rows of models.PARAMETERIZATIONS
# Methods whose init is the minibatch-based rescaling (Sec. 4.3 / Salimans & Kingma);
# the others keep Glorot init, as in the paper.
DATA_DEPENDENT_INIT = ('sp', 'lcw', 'bn_lcw', 'wn', 'cwn')
EVAL_CHUNK = 500  # test images per evaluated chunk
INIT_TRAIN_EXAMPLES = 2000  # training images evaluated at initialization
# The study's own config fields (the others are validate.RULES').
CONFIG_RULES = {'methods': validate.names_list(METHODS), 'width': validate.integer(2),
                'train_examples': validate.mlp_examples(True)}


def check_data(config) -> None:
  """Raises `validate.ConfigError` unless the CIFAR-10 archive is there and complete (or may
  download)."""
  validate.check_cifar10(config.get('data_dir'), config.get('download', False),
                         config.get('cache_dir'))


# This study's 'wn' weight kind (for `models.layer`): the library's WN wrapper around the Dense
# (variables `kernel`, `scale`, `bias` in `layer_{i}`; `variance.data_dependent_init` rescales
# its gain).
WEIGHT_KINDS = {'wn': models.WeightKind(
    lambda x, a: geoparam.WN(nn.Dense(a.features, kernel_init=a.kernel_init, parent=None),
                             name=a.name)(x))}


class DeepMLP(nn.Module):
  """`depth` hidden layers of `width` units with `activation`, then `num_classes` logits.

  Every layer is `models.layer` of `method` (a row of `models.PARAMETERIZATIONS`):
  the weight layer (plain Dense, LCWDense, geoparam.WN (`WEIGHT_KINDS`), CWNDense,
  SpectralNorm(Dense)), Glorot-initialized (CWN's kernel too), BN on the hidden
  pre-activations (`bn`, `bn_lcw`), SL on the hidden activations (`sl`). The
  output layer is reparameterized too (`models.weights`, with a bias). The
  layer names (`layer_{i}`, `bn_{i}`, `sl_{i}`, `layer_{i}_sn`) are those of
  the published runs.
  """

  method: str
  depth: int = 50
  width: int = 256
  num_classes: int = 10
  activation: Any = nn.sigmoid

  @nn.compact
  def __call__(self, x, train: bool = False):
    if self.method not in METHODS:
      raise ValueError(f'unknown method {self.method!r}; accepted: {", ".join(METHODS)}.')
    glorot = nn.initializers.glorot_uniform()
    x = x.reshape(x.shape[0], -1)
    for i in range(self.depth):
      x = models.layer(x, self.method, self.width, name=f'layer_{i}', train=train,
                       activation=self.activation, kernel_init=glorot, cwn_kernel_init=glorot,
                       momentum=0.9, names={'bn': f'bn_{i}', 'sl': f'sl_{i}'},
                       weight_kinds=WEIGHT_KINDS)
    kind = models.PARAMETERIZATIONS[self.method].weights
    return models.weights(x, WEIGHT_KINDS.get(kind, kind), self.num_classes,
                          name=f'layer_{self.depth}', train=train, kernel_init=glorot,
                          cwn_kernel_init=glorot)


def init_variables(model: DeepMLP, key, x_batch):
  """Glorot init, then (for DATA_DEPENDENT_INIT methods) the minibatch-based rescaling."""
  variables = model.init(key, x_batch, train=False)
  if model.method in DATA_DEPENDENT_INIT:
    kwargs = dict(train=True, mutable=['batch_stats']) if 'batch_stats' in variables else {}
    variables = variance.data_dependent_init(model, variables, x_batch,
                                             **kwargs)
  return dict(variables)


def train_method(method: str, data, config, log=print) -> dict[str, Any]:
  """Trains one method (`protocol.train_epochs`); curves per epoch, epoch 0 at init."""
  n = len(data['y_train'])
  model = DeepMLP(method, depth=config.depth, width=config.width,
                  num_classes=data['num_classes'])
  key_init, key_data = jax.random.split(jax.random.key(config.seed))
  init_idx = np.random.default_rng(config.seed).permutation(n)[:config.batch_size]
  variables = init_variables(model, key_init, jnp.asarray(data['x_train'])[init_idx])
  return protocol.train_epochs(
      model, variables, data, num_epochs=config.num_epochs, batch_size=config.batch_size,
      learning_rate=config.learning_rate, key=key_data,
      optimizer=protocol.masked_sgd(config.momentum, config.weight_decay),
      schedule=schedules.per_epoch_decay(config.decay_factor, config.min_lr),
      eval_chunk=EVAL_CHUNK, init_train_examples=INIT_TRAIN_EXAMPLES, log=log,
      label=f'[deep_sigmoid_mlp] {method}')


def check_claims(results, num_classes: int, depth: int) -> dict[str, str]:
  """Paper 003 Sec. 6.1 claims against the measurements; a non-finite loss gets no verdict.

  Stalling: a final train loss above 0.95 ln K (`protocol.stalled`); whether each
  method stalls is in the table, not a claim.
  """
  out = {}
  loss = {m: r['final_train_loss'] for m, r in results.items()}
  if 'sp' in results and 'lcw' in results:
    out[f'SP {depth}-layer sigmoid MLP stalls while LCW trains'] = report.claim(
        protocol.stalled(loss['sp'], num_classes) and not protocol.stalled(loss['lcw'],
                                                                            num_classes),
        'final train loss SP {:.4f}, LCW {:.4f}', loss['sp'], loss['lcw'])
  for m in ('wn', 'sn'):
    if m in results:
      out[f'{m} does not train at all (paper: omitted from Fig. 5)'] = report.claim(
          protocol.stalled(loss[m], num_classes), 'final train loss {:.4f}', loss[m])
  return out


def plot(results, config, num_train: int, workdir: str) -> list[str]:
  """curves.png: train loss and test accuracy per epoch of every method (one seed)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
  protocol.plot_epoch_curves(axes, {plotting.method_label(m): r for m, r in results.items()})
  axes[1].legend(fontsize=8, loc='center left', bbox_to_anchor=(1.02, 0.5))
  return [plotting.save(fig, workdir, 'curves.png', title=(
      f'Deep sigmoid MLP ({config.depth} x {config.width}) on CIFAR-10, {num_train} '
      f'training images, seed {config.seed} (one run per method; paper 003, Fig. 5)'))]


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Runs the study of `config` (`experiments/configs/deep_sigmoid_mlp.py`), writes its files.

  Returns `{'summary': what results.json holds, 'results': method -> train_epochs result}`.
  """
  validate.check_config(config, CONFIG_RULES)
  methods = validate.split_names(config.methods)
  data = cifar_arrays.load_flat_arrays(config.data_dir, config.train_examples,
                                       config.test_examples, config.seed, config.cache_dir,
                                       config.download)
  num_train, num_test, k = len(data['y_train']), len(data['y_test']), data['num_classes']
  os.makedirs(workdir, exist_ok=True)
  print(f'[deep_sigmoid_mlp] {num_train} train / {num_test} test images, {config.depth} x '
        f'{config.width} sigmoid, {config.num_epochs} epochs, methods {",".join(methods)}',
        flush=True)
  t_start = time.perf_counter()
  results = {m: train_method(m, data, config, log=lambda s: print(s, flush=True))
             for m in methods}
  final = {key: {m: r[key] for m, r in results.items()} for key in (
      'final_train_loss', 'final_test_acc', 'final_test_loss', 'final_train_acc')}
  summary = dict(final, stalled={m: protocol.stalled(r['final_train_loss'], k)
                                 for m, r in results.items()},
                 curves={m: r['curves'] for m, r in results.items()},
                 seconds={m: r['seconds'] for m, r in results.items()},
                 data=dict(num_train=num_train, num_test=num_test, num_classes=k),
                 data_dependent_init=[m for m in methods if m in DATA_DEPENDENT_INIT])
  rows = [dict(method=m, **{key: r[key] for key in final}, stalled=summary['stalled'][m],
               seconds=r['seconds']) for m, r in results.items()]
  table = report.markdown_table(
      ['method', 'final train loss', 'final train acc', 'final test loss', 'final test acc',
       f'stalls (train loss > 0.95 ln K = {0.95 * np.log(k):.3f})', 'seconds'],
      [[m, f'{r["final_train_loss"]:.4f}', f'{r["final_train_acc"]:.3f}',
        f'{r["final_test_loss"]:.4f}', f'{r["final_test_acc"]:.3f}',
        'yes' if summary['stalled'][m] else 'no', f'{r["seconds"]:.0f}']
       for m, r in results.items()])
  figures = plot(results, config, num_train, workdir) if config.plots else []
  summary = report.write(workdir, 'deep_sigmoid_mlp', summary=summary, rows=rows, table=table,
                         claims=check_claims(results, k, config.depth), config=config,
                         started=t_start, figures=figures)
  return {'summary': summary, 'results': results}

