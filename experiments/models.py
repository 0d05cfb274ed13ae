"""Models of the studies, with the parameterization chosen by name.

Methods (paper 002): `sp` (plain Dense), `wn` (weight normalization),
`wn_mbn` (WN + mean-only batch norm on pre-activations), `bn` (batch norm on
pre-activations), `gmp` (geometric parameterization), `gmp_imn` (GmP with input
mean normalization on every hidden layer after the first). The output layer is
always a plain Dense, as in the paper.

Hidden layers are named `hidden_{i}` and the output `out` for every method, so
`geoparam.convert.sp_to_gmp` maps an `sp` checkpoint onto a `gmp` model.
Dense kernels start Glorot-uniform with zero bias (the reference code's Keras
defaults); BN uses Keras' epsilon 1e-3 and momentum 0.99.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

import geoparam
from geoparam import analysis

METHODS = ('sp', 'wn', 'wn_mbn', 'bn', 'gmp', 'gmp_imn')

glorot = nn.initializers.glorot_uniform()
BN_EPSILON = 1e-3  # MLP's BatchNorm (Keras' default)


def check_methods(methods: Sequence[str]) -> tuple[str, ...]:
  """Returns the methods as a tuple; unknown names raise a ValueError listing the accepted ones."""
  methods = tuple(m.strip().lower() for m in methods if m.strip())
  unknown = [m for m in methods if m not in METHODS]
  if unknown or not methods:
    raise ValueError(f'unknown methods {unknown or methods}; accepted: {", ".join(METHODS)}.')
  return methods


class MLP(nn.Module):
  """ReLU MLP whose hidden layers use the parameterization `method`.

  Attributes:
    hidden: widths of the hidden layers.
    out: output width.
    method: one of `METHODS`.
    gmp_glorot_scale: start GmP scales at the Glorot norm (reference code) instead of 1.
    param_dtype: parameter dtype (float64 for the toy studies).
  """

  hidden: Sequence[int]
  out: int
  method: str = 'sp'
  gmp_glorot_scale: bool = False
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_methods([self.method])
    pd = self.param_dtype
    for i, width in enumerate(self.hidden):
      name = f'hidden_{i}'
      if self.method == 'sp':
        x = nn.relu(nn.Dense(width, kernel_init=glorot, param_dtype=pd, name=name)(x))
      elif self.method in ('wn', 'wn_mbn'):
        use_bias = self.method == 'wn'
        dense = nn.Dense(width, use_bias=use_bias, kernel_init=glorot, param_dtype=pd, name=name)
        x = nn.WeightNorm(dense, param_dtype=pd, name=f'{name}_wn')(x)
        if self.method == 'wn_mbn':
          x = geoparam.MeanOnlyBatchNorm(param_dtype=pd, name=f'{name}_mbn')(
              x, use_running_average=not train)
        x = nn.relu(x)
      elif self.method == 'bn':
        x = nn.Dense(width, use_bias=False, kernel_init=glorot, param_dtype=pd, name=name)(x)
        x = nn.BatchNorm(momentum=0.99, epsilon=BN_EPSILON, param_dtype=pd, name=f'{name}_bn')(
            x, use_running_average=not train)
        x = nn.relu(x)
      else:
        x = geoparam.GmPDense(
            width, input_mean_norm=self.method == 'gmp_imn' and i > 0,
            glorot_scale=self.gmp_glorot_scale, param_dtype=pd, name=name)(
                x, use_running_average=not train)
    return nn.Dense(self.out, kernel_init=glorot, param_dtype=pd, name='out')(x)


def layer_variables(variables: Mapping[str, Any], kind: str, name: str = 'hidden_0',
                    bn_epsilon: float = BN_EPSILON, batch_stats=None) -> dict[str, Any]:
  """Canonical layer dict of layer `name` from a model's variables (`{'params': ..., ...}`).

  For `MLP`'s naming (the geoparam.analysis canonical form of `kind`, see its
  module docstring): the Dense (or GmPDense) layer is `name`; WN's gain lives in `{name}_wn` as `'{name}/kernel/scale'`; BN in
  `{name}_bn`, MBN in `{name}_mbn`; IMN's running mean in
  `batch_stats[name]['input_mean_norm']`.

  Args:
    variables: model variables with a `params` collection (and `batch_stats`).
    kind: one of `geoparam.analysis.KINDS` (the method names of `MLP`).
    name: the layer's name.
    bn_epsilon: BatchNorm's epsilon (kind 'bn'); `MLP`'s by default.
    batch_stats: optional statistics to use instead of the running ones (e.g.
      `batch_statistics(...)` for the training-mode function).
  """
  if kind not in analysis.KINDS:
    raise ValueError(f'unknown kind={kind!r}; valid kinds: {", ".join(analysis.KINDS)}.')
  if not isinstance(variables, Mapping):
    raise TypeError(
        f"variables must be a dict of collections ({{'params': ..., 'batch_stats': ...}}), got "
        f'{type(variables).__name__}.')
  p = _lookup(variables, ('params',), 'variables', kind)
  running = variables.get('batch_stats', {})
  if name not in p:
    raise ValueError(f'no layer {name!r} in params; layers: {sorted(p)}.')
  if kind == 'sp':
    return dict(p[name])
  if kind in ('wn', 'wn_mbn'):
    out = dict(kernel=_lookup(p, (name, 'kernel'), 'params', kind),
               scale=_lookup(p, (f'{name}_wn', f'{name}/kernel/scale'), 'params', kind))
    if kind == 'wn':
      out['bias'] = p[name].get('bias')
      return out
    out['mbn'] = dict(_lookup(p, (f'{name}_mbn',), 'params', kind))
    out['batch_stats'] = batch_stats if batch_stats is not None else _lookup(
        running, (f'{name}_mbn',), 'batch_stats', kind)
    return out
  if kind == 'bn':
    return dict(dense=dict(p[name]), bn=dict(_lookup(p, (f'{name}_bn',), 'params', kind)),
                batch_stats=batch_stats if batch_stats is not None else _lookup(
                    running, (f'{name}_bn',), 'batch_stats', kind),
                epsilon=bn_epsilon)
  out = dict(p[name])
  if kind == 'gmp_imn':
    if batch_stats is None:
      imn = running.get(name, {}).get('input_mean_norm')
      if imn is None:  # the first layer of gmp_imn has no IMN: plain GmP.
        fan_in = out['theta'].shape[0] + 1
        imn = {'mean': jnp.zeros((fan_in,), jnp.asarray(out['lam']).dtype)}
      batch_stats = imn
    out['batch_stats'] = batch_stats
  return out


def _lookup(tree, path, where, kind):
  """`tree[path[0]][path[1]]...`, or a ValueError naming the missing entry and the keys there."""
  node = tree
  for i, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      keys = sorted(node) if isinstance(node, Mapping) else type(node).__name__
      raise ValueError(
          f'kind={kind!r} needs {where}[{"][".join(repr(k) for k in path)}], but '
          f'{where}{"".join(f"[{k!r}]" for k in path[:i])} has no {key!r} (has {keys}); see '
          'layer_variables for the layer names it expects.')
    node = node[key]
  return node



VGG6_LAYERS = (128, 128, 'M', 256, 256, 'M', 512, 512, 'M')


class CNN(nn.Module):
  """VGG-style ReLU CNN whose conv layers use the parameterization `method`.

  `layers` lists conv widths (3x3, 'SAME') and 'M' for 2x2 max pooling; then a
  global average pool and a plain Dense classifier (named `out`). The default
  is paper 002's VGG-6 for ImageNet32 (`VGG6_LAYERS`). Conv layers are named
  `conv_{i}` for every method (WN wraps them as `conv_{i}_wn`, MBN/BN follow
  as `conv_{i}_mbn`/`conv_{i}_bn`), like `MLP`'s `hidden_{i}`.

  Methods as in `MLP`; `gmp_imn` centres the inputs of every conv layer after
  the first (IMN), the first sees the raw (normalized) image.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> m = CNN(layers=(8, 'M', 16), num_classes=10, method='gmp_imn')
    >>> v = m.init(jax.random.key(0), jnp.ones((2, 8, 8, 3)))
    >>> jax.tree.map(jnp.shape, v['params'])['conv_1']
    {'lam': (16,), 'scale': (16,), 'theta': (71, 16)}

  Attributes:
    num_classes: output width.
    layers: conv widths and 'M' (max pool) entries.
    method: one of `METHODS`.
    bn_momentum: running-average momentum of BN/MBN/IMN (flax convention).
    dtype: computation dtype (None: inferred).
    param_dtype: parameter dtype.
  """

  num_classes: int
  layers: Sequence[Any] = VGG6_LAYERS
  method: str = 'sp'
  bn_momentum: float = 0.9
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    check_methods([self.method])
    pd, dt, ura = self.param_dtype, self.dtype, not train
    he = nn.initializers.he_normal()
    conv_args = dict(kernel_size=(3, 3), padding='SAME', dtype=dt, param_dtype=pd)
    i = 0
    for layer in self.layers:
      if layer == 'M':
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        continue
      if not isinstance(layer, int) or layer < 1:
        raise ValueError(f"layers entries must be positive ints or 'M', got {layer!r}.")
      name = f'conv_{i}'
      if self.method == 'sp':
        x = nn.relu(nn.Conv(layer, kernel_init=he, name=name, **conv_args)(x))
      elif self.method in ('wn', 'wn_mbn'):
        conv = nn.Conv(layer, use_bias=self.method == 'wn', kernel_init=he, name=name, **conv_args)
        x = nn.WeightNorm(conv, param_dtype=pd, name=f'{name}_wn')(x)
        if self.method == 'wn_mbn':
          x = geoparam.MeanOnlyBatchNorm(
              momentum=self.bn_momentum, param_dtype=pd, name=f'{name}_mbn')(
                  x, use_running_average=ura)
        x = nn.relu(x)
      elif self.method == 'bn':
        x = nn.Conv(layer, use_bias=False, kernel_init=he, name=name, **conv_args)(x)
        x = nn.BatchNorm(momentum=self.bn_momentum, epsilon=1e-5, dtype=dt, param_dtype=pd,
                         name=f'{name}_bn')(x, use_running_average=ura)
        x = nn.relu(x)
      else:
        x = geoparam.GmPConv(
            layer, kernel_size=(3, 3), padding='SAME',
            input_mean_norm=self.method == 'gmp_imn' and i > 0, momentum=self.bn_momentum,
            dtype=dt, param_dtype=pd, name=name)(x, use_running_average=ura)
      i += 1
    x = jnp.mean(x, axis=(-3, -2))
    return nn.Dense(self.num_classes, dtype=dt, param_dtype=pd, name='out')(x)
