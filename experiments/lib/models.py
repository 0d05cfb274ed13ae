"""Models of the studies, with the parameterization chosen by name.

`PARAMETERIZATIONS` is the one table of methods (name -> weight layer and
normalization) and `layer` builds a hidden layer from a row; every study model
uses it (`MLP`, `CNN` here, `vision_models`, `deep_sigmoid_mlp`). The weight
layer of a row is one lookup in `WEIGHTS` (geoparam's paper-form layers, flax's
WeightNorm/SpectralNorm), or else the method's record in the library's registry;
its normalization one in `PRE_ACTIVATION` /
`POST_ACTIVATION`. Adding a method is adding a row (and, for a new kind of
weight layer or normalization, its row in those tables).

Methods of `MLP` and `CNN` (paper 002, `METHODS`): `sp` (plain Dense), `wn` (weight normalization),
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

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

import geoparam
from geoparam import analysis

glorot = nn.initializers.glorot_uniform()
BN_EPSILON = 1e-3  # MLP's BatchNorm (Keras' default)


@dataclasses.dataclass(frozen=True)
class Method:
  """A parameterization: the weight layer and the normalization that follows it.

  Attributes:
    weights: a key of `WEIGHTS`: 'plain' (nn.Dense / nn.Conv), 'wn' (nn.WeightNorm
      of it), 'gmp' (geoparam.GmPDense / GmPConv, the ReLU included), 'lcw'
      (LCWDense / LCWConv), 'cwn' (CWNDense / CWNConv) or 'sn' (nn.SpectralNorm
      of it); or any other name of `geoparam.methods.REGISTRY` (`geoparam.Reparam`
      of the plain layer: a method registered in the library is a study method with
      one row here).
    norm: None, 'bn' (BatchNorm on the pre-activations), 'mbn' (mean-only BN on
      the pre-activations), 'imn' (GmP's input mean normalization, every hidden
      layer after the first) or 'sl' (standardization of the activations).
    description: for help texts.
  """

  weights: str
  norm: str | None
  description: str


# The one table of parameterizations: a method is a row, every model builds its layers from it.
PARAMETERIZATIONS = {
    'sp': Method('plain', None, 'standard parameterization (plain Dense/Conv)'),
    'wn': Method('wn', None, 'weight normalization'),
    'wn_mbn': Method('wn', 'mbn', 'WN + mean-only batch norm'),
    'bn': Method('plain', 'bn', 'batch norm on the pre-activations'),
    'gmp': Method('gmp', None, 'geometric parameterization'),
    'gmp_imn': Method('gmp', 'imn', 'GmP + input mean normalization'),
    'lcw': Method('lcw', None, 'linearly constrained weights'),
    'bn_lcw': Method('lcw', 'bn', 'LCW + batch norm'),
    'cwn': Method('cwn', None, 'centered weight normalization'),
    'sn': Method('sn', None, 'spectral normalization'),
    'sl': Method('plain', 'sl', 'standardization layer on the activations'),
    'bn_wn': Method('wn', 'bn', 'WN + batch norm (paper 003, CNNs)'),
    'bn_cwn': Method('cwn', 'bn', 'CWN + batch norm (paper 003, CNNs)'),
    'bn_sn': Method('sn', 'bn', 'spectral norm + batch norm (paper 003, CNNs)'),
}
METHODS = ('sp', 'wn', 'wn_mbn', 'bn', 'gmp', 'gmp_imn')  # paper 002's ReLU methods (MLP, CNN)


def is_gmp(method: str) -> bool:
  """Whether `method` (a `PARAMETERIZATIONS` name) has GmP weights: what the paper's GmP
  claims and its learning-rate rule are about. False for an unknown name (the config checks
  refuse it, naming the accepted ones).

  >>> [m for m in METHODS if is_gmp(m)], is_gmp('foo')
  (['gmp', 'gmp_imn'], False)
  """
  return getattr(PARAMETERIZATIONS.get(method), 'weights', None) == 'gmp'


def check_methods(methods: Sequence[str], accepted: Sequence[str] = METHODS
                  ) -> tuple[str, ...]:
  """Returns the methods as a tuple; unknown names raise a ValueError listing the accepted ones."""
  methods = tuple(m.strip().lower() for m in methods if m.strip())
  unknown = [m for m in methods if m not in accepted]
  if unknown or not methods:
    raise ValueError(f'unknown methods {unknown or methods}; accepted: {", ".join(accepted)}.')
  return methods


class LayerArgs(NamedTuple):
  """What a weight kind and a normalization are built from (`layer`'s and `weights`' arguments)."""
  features: int
  name: str
  train: bool
  conv: dict  # kernel_size, strides, padding of a conv; {} for a dense layer
  use_bias: bool = True
  kernel_init: Any = glorot
  cwn_kernel_init: Any = None  # None: CWNDense/CWNConv's own (lecun normal)
  names: Mapping[str, str] = {}
  activation: Any = None  # GmP's own (applied inside its paper-form layer)
  imn: bool = False
  momentum: float = 0.99
  bn_epsilon: float = 1e-5
  glorot_scale: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32

  def part(self, kind: str) -> str:
    """Name of the wrapper or normalization `kind` ('wn', 'sn', 'bn', 'mbn', 'sl') of the layer."""
    return self.names.get(kind, f'{self.name}_{kind}')


def _layer(a: LayerArgs, dense, conv, **fields):
  """`dense` or `conv` (as `a.conv` says) with the layer's features, shape, dtypes and name."""
  return (conv if a.conv else dense)(a.features, dtype=a.dtype, param_dtype=a.param_dtype,
                                     name=a.name, **a.conv, **fields)


def _linear(a: LayerArgs):
  """The plain nn.Dense / nn.Conv of the layer (its bias and kernel init)."""
  return _layer(a, nn.Dense, nn.Conv, use_bias=a.use_bias, kernel_init=a.kernel_init)


def _stored(params, name, kind) -> dict:
  """The layer's variables as it stores them at `name` (a plain Dense's, a method's)."""
  del kind
  return dict(params[name])


def _weight_norm(params, name, kind) -> dict:
  """flax's WeightNorm of a Dense in analysis' 'wn' form: its gain lives in `{name}_wn`."""
  return dict(kernel=_lookup(params, (name, 'kernel'), 'params', kind),
              scale=_lookup(params, (f'{name}_wn', f'{name}/kernel/scale'), 'params', kind),
              bias=params[name].get('bias'))


class WeightKind(NamedTuple):
  """How a weight kind is built: `build(x, args) -> y`; `activates`: the layer applies the
  activation itself (GmP's paper form, `scale * relu(u^T x + lam)`); `read(params, name, kind)`:
  its variables in `geoparam.analysis`' canonical form (`layer_variables`)."""
  build: Callable[[jax.Array, LayerArgs], jax.Array]
  activates: bool = False
  read: Callable[[Mapping[str, Any], str, str], dict] = _stored


# Weight kind (a row's `weights`) -> its layer, from geoparam (paper-form layers) and flax
# (WeightNorm, SpectralNorm). `weights` looks it up; a new kind is a row here.
WEIGHTS = {
    'plain': WeightKind(lambda x, a: _linear(a)(x)),
    'wn': WeightKind(lambda x, a: nn.WeightNorm(  # gain in `{name}_wn` (flax)
        _linear(a), param_dtype=a.param_dtype, name=a.part('wn'))(x), read=_weight_norm),
    'sn': WeightKind(lambda x, a: nn.SpectralNorm(
        _linear(a), param_dtype=a.param_dtype, name=a.part('sn'))(x, update_stats=a.train)),
    'lcw': WeightKind(lambda x, a: _layer(a, geoparam.LCWDense, geoparam.LCWConv,
                                          use_bias=a.use_bias, kernel_init=a.kernel_init)(x)),
    'cwn': WeightKind(lambda x, a: _layer(
        a, geoparam.CWNDense, geoparam.CWNConv, use_bias=a.use_bias,
        **({} if a.cwn_kernel_init is None else {'kernel_init': a.cwn_kernel_init}))(x)),
    'gmp': WeightKind(lambda x, a: _layer(
        a, geoparam.GmPDense, geoparam.GmPConv, activation=a.activation, input_mean_norm=a.imn,
        momentum=a.momentum, glorot_scale=a.glorot_scale)(x, use_running_average=not a.train),
                      activates=True),
}
# Normalizations (a row's `norm`) on the pre-activations and on the activations; 'imn' is GmP's.
PRE_ACTIVATION = {
    'bn': lambda x, a: nn.BatchNorm(momentum=a.momentum, epsilon=a.bn_epsilon, dtype=a.dtype,
                                    param_dtype=a.param_dtype, name=a.part('bn'))(
                                        x, use_running_average=not a.train),
    'mbn': lambda x, a: geoparam.MeanOnlyBatchNorm(
        momentum=a.momentum, param_dtype=a.param_dtype, name=a.part('mbn'))(
            x, use_running_average=not a.train),
}
POST_ACTIVATION = {
    'sl': lambda x, a: geoparam.StandardizationLayer(
        use_running_average=not a.train, momentum=a.momentum, name=a.part('sl'))(x),
}
# Wrapper and normalization parts named by their kind alone ('wn', 'bn', ...), for a layer that
# is a module of its own (vision_models' ConvUnit and WeightLayer).
PART_NAMES = {kind: kind for kind in ('wn', 'sn', 'bn', 'mbn', 'sl')}


def _conv(kernel_size, padding, strides) -> dict:
  return {} if kernel_size is None else dict(kernel_size=kernel_size, padding=padding,
                                             strides=strides)


def _reparam(x, a: LayerArgs, method: str | geoparam.methods.Method):
  """Any method of the library's registry (or a `geoparam.methods.Method`) around the plain
  Dense/Conv: `geoparam.Reparam`, its variables at the layer's name."""
  plain = (nn.Conv if a.conv else nn.Dense)(
      a.features, dtype=a.dtype, param_dtype=a.param_dtype, use_bias=a.use_bias,
      kernel_init=a.kernel_init, parent=None, **a.conv)
  return geoparam.Reparam(plain, method, name=a.name)(x, use_running_average=not a.train)


def _kind(kind: str | WeightKind | geoparam.methods.Method) -> WeightKind:
  """`kind` itself (a study's own `WeightKind`), its row of `WEIGHTS`, or else a method of
  `geoparam.methods.REGISTRY` (or a `Method`) around the plain layer."""
  if isinstance(kind, WeightKind):
    return kind
  if isinstance(kind, geoparam.methods.Method) or (
      kind not in WEIGHTS and kind in geoparam.methods.REGISTRY):
    return WeightKind(lambda x, a: _reparam(x, a, kind))
  if kind not in WEIGHTS:
    raise ValueError(f'unknown weight kind {kind!r}; accepted: {", ".join(WEIGHTS)}, or a '
                     f'method of geoparam.methods.REGISTRY ({", ".join(geoparam.methods.REGISTRY)}).')
  return WEIGHTS[kind]


def weights(x, kind: str | WeightKind, features: int, *, name: str, train: bool,
            use_bias: bool = True, kernel_size=None, padding='SAME', strides=1,
            kernel_init=glorot, cwn_kernel_init=None, names: Mapping[str, str] | None = None,
            dtype=None, param_dtype=jnp.float32):
  """The weight layer of `kind` (a key of `WEIGHTS`, or a study's own `WeightKind`) alone on `x`.

  No normalization and no activation (GmP: its linear form). Dense when
  `kernel_size` is None, else a conv. The layer is named `name`, its wrapper
  `{name}_wn` / `{name}_sn` unless `names` maps the part ('wn': ...).
  `cwn_kernel_init`: CWN's kernel init (None: CWN's own, lecun normal).
  Call it inside a module's `@nn.compact` method.
  """
  return _kind(kind).build(x, LayerArgs(
      features, name, train, _conv(kernel_size, padding, strides), use_bias=use_bias,
      kernel_init=kernel_init, cwn_kernel_init=cwn_kernel_init, names=dict(names or {}),
      dtype=dtype, param_dtype=param_dtype))


def layer(x, method: str, features: int, *, name: str, train: bool, first: bool = False,
          activation=nn.relu, kernel_size=None, padding='SAME', strides=1,
          kernel_init=glorot, cwn_kernel_init=None, momentum: float = 0.99,
          bn_epsilon: float = 1e-5, glorot_scale: bool = False,
          names: Mapping[str, str] | None = None,
          weight_kinds: Mapping[str, str | WeightKind] | None = None,
          dtype=None, param_dtype=jnp.float32):
  """One hidden layer of `method` (a `PARAMETERIZATIONS` row) on `x`: weights, norm, activation.

  The one factory of the studies' hidden layers (`MLP`, `CNN`, `vision_models`,
  `deep_sigmoid_mlp`): the row's weight kind is looked up in `WEIGHTS`, its
  normalization in `PRE_ACTIVATION` / `POST_ACTIVATION`. Dense when
  `kernel_size` is None, else a conv. Submodules are named `name` (the weight
  layer), `{name}_wn`/`{name}_sn` (its wrapper), `{name}_bn`, `{name}_mbn`,
  `{name}_sl`, or as `names` maps the part ('bn': 'bn_3', ...). The weight
  layer has a bias unless BN/MBN follows. GmP applies its own ReLU
  (`activation` must be nn.relu, or None for a linear GmP layer); `first` turns
  IMN off (the first layer sees the raw inputs); `activation=None`: no
  activation. `weight_kinds` replaces row kinds for one model (a `WEIGHTS` key
  or a `WeightKind`: deep_sigmoid_mlp's 'wn'). Call it inside a module's
  `@nn.compact` method.
  """
  m = PARAMETERIZATIONS[method]
  kind = _kind((weight_kinds or {}).get(m.weights, m.weights))
  if kind.activates and activation not in (nn.relu, None):
    raise ValueError(f'method {method!r} is a ReLU layer; activation must be nn.relu (or None).')
  a = LayerArgs(features, name, train, _conv(kernel_size, padding, strides),
                use_bias=m.norm not in PRE_ACTIVATION, kernel_init=kernel_init,
                cwn_kernel_init=cwn_kernel_init, names=dict(names or {}), activation=activation,
                imn=m.norm == 'imn' and not first, momentum=momentum, bn_epsilon=bn_epsilon,
                glorot_scale=glorot_scale, dtype=dtype, param_dtype=param_dtype)
  x = kind.build(x, a)
  if kind.activates:
    return x
  if m.norm in PRE_ACTIVATION:
    x = PRE_ACTIVATION[m.norm](x, a)
  if activation is not None:
    x = activation(x)
  if m.norm in POST_ACTIVATION:
    x = POST_ACTIVATION[m.norm](x, a)
  return x


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
      x = layer(x, self.method, width, name=f'hidden_{i}', train=train, first=i == 0,
                kernel_init=glorot, momentum=0.99, bn_epsilon=BN_EPSILON,
                glorot_scale=self.gmp_glorot_scale, param_dtype=pd)
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
  row = PARAMETERIZATIONS[kind]
  out = WEIGHTS[row.weights].read(p, name, kind)
  if row.norm in NORM_PARTS:
    part = f'{name}_{row.norm}'
    norm_params = dict(_lookup(p, (part,), 'params', kind))
    stats = batch_stats if batch_stats is not None else _lookup(
        running, (part,), 'batch_stats', kind)
    return NORM_PARTS[row.norm](out, norm_params, stats, bn_epsilon)
  method = geoparam.methods.REGISTRY.get(kind, lambda: None)()
  if method is not None and method.imn is not None:
    if batch_stats is None:
      batch_stats = running.get(name, {}).get('input_mean_norm')
    if batch_stats is None:  # the first layer has no IMN (the studies' placement): mean 0
      shape, spec = geoparam.methods.base.dense_spec(method, out, name)
      batch_stats = {'mean': jnp.zeros(shape[:1], geoparam.methods.base.layer_dtype(out, spec))}
    out['batch_stats'] = batch_stats
  return out


# A normalization's part of `layer_variables` (analysis' canonical form), from the weight
# layer's variables, the normalization's params, its statistics and BN's epsilon.
NORM_PARTS = {
    'bn': lambda out, params, stats, eps: dict(dense=out, bn=params, batch_stats=stats,
                                               epsilon=eps),
    'mbn': lambda out, params, stats, eps: {**out, 'mbn': params, 'batch_stats': stats},
}
# A normalization's statistics on a batch `x` of the layer's inputs (the training-mode function).
TRAINING_STATS = {
    'bn': lambda variables, name, x: analysis.batch_statistics(
        x @ variables['params'][name]['kernel']),
    'mbn': lambda variables, name, x: {'mean': jnp.mean(x @ analysis.affine(  # WN's (WN+MBN)
        layer_variables(variables, 'wn', name), 'wn')[0], axis=0)},
}


def apply_train(model: nn.Module, variables: Mapping[str, Any], x):
  """`model.apply(variables, x, train=True)` with every collection but `params` mutable.

  Returns `(output, updated collections)`, what a loss of `experiments.lib.protocol.fit` returns
  beside its value.
  """
  return model.apply(variables, x, train=True, mutable=[k for k in variables if k != 'params'])


def member(tree, i: int):
  """Member `i` (a seed, a split) of a pytree stacked over members: every leaf's row `i`."""
  return jax.tree.map(lambda a: a[i], tree)


def hidden_layer(variables: Mapping[str, Any], method: str, x=None,
                 name: str = 'hidden_0') -> dict[str, Any]:
  """`MLP`'s first hidden layer `name` in `geoparam.analysis` form (`layer_variables`).

  BN and MBN are folded with their running statistics, or, given the layer's
  inputs `x` (the full batch), with the statistics of `x`: the function the
  layer computes in training mode on that batch.
  """
  norm = PARAMETERIZATIONS[method].norm
  stats = None if x is None or norm not in TRAINING_STATS else TRAINING_STATS[norm](
      variables, name, x)
  return layer_variables(variables, method, name, batch_stats=stats)


def boundary_changes(active, locations, directions=None, steps_per_epoch: int = 1
                     ) -> dict[str, jax.Array]:
  """Per optimizer step, the largest change over the units of tracked boundaries.

  `locations` (and optionally `directions`): `(members, steps + 1, units, d)`
  recorded before the first step and after every step (`geoparam.analysis.snapshot`);
  `active`: `(members, epochs)`, whether the member's epoch ran. Returns
  `max_dphi` (`max_i |phi_{i,t+1} - phi_{i,t}|`) and, with `directions`,
  `max_dtheta_deg` (the largest angle change, degrees), each `(members, steps)`,
  NaN in the epochs a member did not run.
  """
  def one(p, d):
    out = {'max_dphi': analysis.max_location_change(p)}
    if d is not None:
      out['max_dtheta_deg'] = analysis.max_angle_change(d, degrees=True)
    return out

  step_active = jnp.repeat(active, steps_per_epoch, axis=1)
  return {k: jnp.where(step_active, v, jnp.nan)
          for k, v in jax.jit(jax.vmap(one))(locations, directions).items()}


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
    i = 0
    for spec in self.layers:
      if spec == 'M':
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        continue
      if not isinstance(spec, int) or spec < 1:
        raise ValueError(f"layers entries must be positive ints or 'M', got {spec!r}.")
      x = layer(x, self.method, spec, name=f'conv_{i}', train=train, first=i == 0,
                kernel_size=(3, 3), kernel_init=nn.initializers.he_normal(),
                momentum=self.bn_momentum, bn_epsilon=1e-5, dtype=self.dtype,
                param_dtype=self.param_dtype)
      i += 1
    x = jnp.mean(x, axis=(-3, -2))
    return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype,
                    name='out')(x)
