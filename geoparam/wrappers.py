"""Reparameterization as a map of variables: `GmP(layer)`, `LCW(layer)`, `CWN(layer)`, `WN(layer)`.

A wrapper stores its own variables and hands the wrapped layer the `kernel` and
`bias` they stand for; the layer (`nn.Dense`, `nn.Conv`, `nn.DenseGeneral` with
one output axis) then runs unchanged, so padding, groups, dtypes and precision
are Flax's by construction. A layer's fan-in is every kernel axis but the last.

=======  ==========================================  ====================================
method   stored (collection `params`)                the layer sees
=======  ==========================================  ====================================
gmp      `theta (fan_in-1, F)`, `lam (F,)`,          `kernel = scale * u(theta)`,
         `scale (F,)` (+ fixed `sign` at fan-in 1)   `bias = scale * lam`
lcw      `v (fan_in-1, F)`, `bias`                   `kernel = B v` (columns sum to 0)
cwn      `kernel`, `scale (F,)`, `bias`              `scale * c / |c|`, `c = kernel - mean`
wn       `kernel`, `scale (F,)`, `bias`              `scale * kernel / |kernel|`
=======  ==========================================  ====================================

GmP hands the scale to the layer, so with the model's activation after it the
unit computes `act(scale * (u^T x + lam))`: for relu and leaky relu with
`scale > 0` this equals the paper's `scale * relu(u^T x + lam)` (positive
homogeneity, identical gradients), and for ANY activation it is an exact
reparameterization of `(kernel, bias)`, so trained weights convert exactly.

With `input_mean_norm=True` (IMN, GmP only) the mean of the layer's input is
subtracted without a pass over the activations: folded into the bias for dense
layers (`lam - u^T mu`); for convolutions `conv(x - mu) = conv(x) - conv(mu * 1)`
(`geoparam.conv.imn_bias`), a bias per output position where zeros are padded, so
padded borders see zeros, as IMN defines. Running mean in
`batch_stats/.../input_mean_norm/mean`.

The same functions serve the whole-model transform (`geoparam.transform`), which
creates these variables at the original layer's path.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import math
import numbers

import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp
from jax import lax

from geoparam import conv
from geoparam import initializers
from geoparam import lcw
from geoparam.gmp import get_or_create_param
from geoparam.gmp import gmp_from_dense
from geoparam.gmp import gmp_variables
from geoparam.gmp import imn_fold
from geoparam.gmp import imn_subtracts
from geoparam.normalization import InputMeanNorm

__all__ = ['GmP', 'LCW', 'CWN', 'WN', 'LAYER_TYPES', 'INITIALIZATIONS', 'CALLS',
           'layer_kernel_shape', 'contract_axes', 'run_layer', 'weight_norm',
           'centered_weight_norm', 'kernel_from_v', 'v_from_kernel']

Initializer = Callable[..., jax.Array]

LAYER_TYPES = (nn.Dense, nn.Conv, nn.DenseGeneral)
INITIALIZATIONS = ('paper', 'layer')


# ----------------------------------------------------------------------------- formulas

def weight_norm(kernel: jax.Array, scale: jax.Array, epsilon: float = 1e-12) -> jax.Array:
  """`scale * k / |k|` per unit (all axes but the last), as `nn.WeightNorm`'s formula."""
  axes = tuple(range(kernel.ndim - 1))
  inv_norm = lax.rsqrt(jnp.sum(kernel * kernel, axis=axes, keepdims=True) + epsilon)
  return kernel * inv_norm * scale


def centered_weight_norm(kernel: jax.Array, scale: jax.Array, epsilon: float = 1e-12) -> jax.Array:
  """`scale * c / |c|` per unit, `c` the unit's kernel minus its mean (CWN, Huang et al. 2017).

  Args:
    kernel: `(..., features)`; each unit's weights are all axes but the last.
    scale: `(features,)`, the gain `g`.
    epsilon: added to `|c|^2` under the square root.

  Returns:
    same shape as `kernel`; each unit sums to zero and has norm `|scale|`.
  """
  axes = tuple(range(kernel.ndim - 1))
  return weight_norm(kernel - jnp.mean(kernel, axis=axes, keepdims=True), scale, epsilon)


def kernel_from_v(v: jax.Array, kernel_shape: tuple[int, ...] | None = None) -> jax.Array:
  """Zero-sum kernel `B v` from LCW coordinates `v (fan_in - 1, features)`.

  Returns `(fan_in, features)`, or `kernel_shape` (`(*spatial, in, features)`,
  whose product over all axes but the last is `fan_in`); each column sums to zero
  and has the norm of the matching column of `v`.
  """
  kernel = lcw.project_batched(v)
  return kernel if kernel_shape is None else kernel.reshape(kernel_shape)


def v_from_kernel(kernel: jax.Array) -> jax.Array:
  """LCW coordinates `v = B^T w (fan_in - 1, features)` of a kernel `(..., features)`.

  `kernel_from_v(v)` is the kernel minus its per-unit mean (the kernel itself when
  every unit already sums to zero).
  """
  features = kernel.shape[-1]
  return jax.vmap(lcw.coordinates, in_axes=1, out_axes=1)(kernel.reshape(-1, features))


# ----------------------------------------------------------------------------- the layer

def _describe(holder: nn.Module, layer: nn.Module | None = None) -> str:
  """`'LCWDense at 'a/b''`, `'GmP(Conv) at ...'` (a wrapper) for error messages."""
  name = type(holder).__name__
  if layer is not None and layer is not holder and isinstance(holder, (GmP, LCW, CWN, WN)):
    name += f'({type(layer).__name__})'
  path = holder.path if holder.scope is not None else ()
  where = '/'.join(path) if path else (holder.name or '')
  return name + (f' at {where!r}' if where else '')


def layer_kernel_shape(layer: nn.Module, inputs_shape: tuple[int, ...],
                       name: str | None = None) -> tuple[int, ...]:
  """The kernel shape `(*fan_in_axes, features)` that `layer` builds for inputs of this shape.

  Raises a TypeError naming the layer (or `name`) for types other than
  `LAYER_TYPES`, and a ValueError for kernels whose output is not one last axis.

    >>> import flax.linen as nn, geoparam
    >>> conv = nn.Conv(8, (3, 3), feature_group_count=2)
    >>> geoparam.wrappers.layer_kernel_shape(conv, (1, 5, 5, 4))
    (3, 3, 2, 8)
  """
  name = name or _describe(layer)
  if isinstance(layer, nn.Conv):
    kernel_size = layer.kernel_size
    if isinstance(kernel_size, numbers.Integral):
      kernel_size = (kernel_size,)
    return conv.kernel_shape(name, tuple(kernel_size), inputs_shape,
                             layer.features, layer.feature_group_count)
  if isinstance(layer, nn.DenseGeneral):
    features = layer.features
    features = (features,) if isinstance(features, numbers.Integral) else tuple(features)
    if len(features) != 1 or layer.batch_dims:
      raise ValueError(
          f'{name}: only DenseGeneral with one output axis and no batch_dims can be '
          f'reparameterized (features={layer.features!r}, batch_dims={layer.batch_dims!r}).')
    axis = (layer.axis,) if isinstance(layer.axis, numbers.Integral) else tuple(layer.axis)
    ndim = len(inputs_shape)
    return tuple(inputs_shape[a % ndim] for a in axis) + features
  if isinstance(layer, nn.Dense):
    if len(inputs_shape) < 1:
      raise ValueError(f'{name} expects inputs (..., fan_in), got a scalar.')
    return (inputs_shape[-1], layer.features)
  raise TypeError(
      f'{name} cannot be reparameterized: accepted layer types are '
      f'{", ".join(t.__name__ for t in LAYER_TYPES)} (a kernel with the output features on its '
      'last axis and the fan-in on all other axes).')


def _check_features(name, layer):
  features = layer.features
  if isinstance(features, tuple) and len(features) == 1:
    features = features[0]
  if isinstance(features, bool) or not isinstance(features, numbers.Integral) or features < 1:
    raise ValueError(f'{name} needs features >= 1 (an integer), got {layer.features!r}.')


def run_layer(layer: nn.Module, kernel: jax.Array, bias: jax.Array | None, inputs):
  """Runs `layer` (its fields only) with the given `kernel` and optional `bias`."""
  params = {'kernel': kernel}
  if bias is not None:
    params['bias'] = bias
  layer = layer.clone(parent=None, name=None, use_bias=bias is not None)
  with conv.bypass():  # the transform's interceptor steps aside
    return layer.apply({'params': params}, inputs)


def bypassed() -> bool:
  """True while `run_layer` runs a layer (whole-model interceptors must pass it through)."""
  return conv.bypassed()


# ----------------------------------------------------------------------------- initializers

def _box_of(value):
  """`value` if it is a partitioning box (nn.Partitioned or a subclass), else None."""
  return value if isinstance(value, nn.Partitioned) else None


def _kernel_box(layer, kernel_shape, dtype):
  """The partitioning box of the layer's `kernel_init`, or None (traced, nothing is drawn)."""
  return _box_of(jax.eval_shape(lambda k: layer.kernel_init(k, kernel_shape, dtype),
                                jax.random.key(0)))


def _boxed(box, init, feature_axis_first: bool):
  """`init` whose output carries `box`'s metadata; the last kernel axis name goes to features.

  theta and v `(fan_in - 1, F)` get `(None, name)` (their fan-in axis is a
  sequential product, never sharded); vectors `(F,)` get `(name,)`.
  """
  if box is None:
    return init
  names = (box.names[-1],) if feature_axis_first else (None, box.names[-1])

  def boxed(key, shape, dtype=jnp.float32):
    return dataclasses.replace(box, value=meta.unbox(init(key, shape, dtype)), names=names)

  return boxed


def _check_initialization(initialization):
  if initialization not in INITIALIZATIONS:
    raise ValueError(f'initialization must be one of {INITIALIZATIONS}, got {initialization!r}.')


def _layer_draw(layer, kernel_shape, dtype, key):
  """The layer's own `kernel_init`/`bias_init` draws: `(kernel (fan_in, F), bias (F,))`."""
  k_key, b_key = jax.random.split(key)
  kernel = meta.unbox(layer.kernel_init(k_key, kernel_shape, dtype))
  features = kernel_shape[-1]
  if getattr(layer, 'use_bias', True):
    bias = meta.unbox(layer.bias_init(b_key, (features,), dtype))
  else:
    bias = jnp.zeros((features,), dtype)
  return kernel.reshape(-1, features), bias


def _gmp_inits(holder, cfg, layer, kernel_shape, dtype):
  """theta/lam/scale initializers: the paper's, or the layer's own draw converted exactly.

  Called only when the params are created. For `'layer'` one key drives the
  single draw that all three come from.
  """
  _check_initialization(cfg.initialization)
  box = _kernel_box(layer, kernel_shape, dtype)
  if cfg.initialization == 'paper':
    inits = (cfg.theta_init or initializers.sphere_uniform(),
             cfg.lam_init or nn.initializers.zeros, cfg.scale_init or nn.initializers.ones,
             initializers.rademacher())
  else:
    if any(i is not None for i in (cfg.theta_init, cfg.lam_init, cfg.scale_init)):
      raise ValueError("initialization='layer' takes the layer's own kernel_init/bias_init; "
                       'do not also pass theta_init, lam_init or scale_init.')
    key = holder.make_rng('params')
    gmp_params = lambda dtype: gmp_from_dense(*_layer_draw(layer, kernel_shape, dtype, key))
    inits = tuple(
        (lambda name: lambda _, shape, dtype=jnp.float32: gmp_params(dtype)[name])(name)
        for name in ('theta', 'lam', 'scale', 'sign'))  # sign: only at fan-in 1
  return (_boxed(box, inits[0], False), _boxed(box, inits[1], True), _boxed(box, inits[2], True),
          _boxed(box, inits[3], True))


def _input_mean(holder, cfg, x, contract_axes, use_running_average):
  """IMN's mean of the layer input over all but `contract_axes`, flattened to `(fan_in_part,)`."""
  moved = jnp.moveaxis(x, contract_axes, tuple(range(x.ndim - len(contract_axes), x.ndim)))
  flat = moved.reshape(moved.shape[:x.ndim - len(contract_axes)] + (-1,))
  imn = InputMeanNorm(use_running_average=cfg.use_running_average, momentum=cfg.momentum,
                      axis_name=cfg.axis_name, name='input_mean_norm', parent=holder)
  return imn.mean(flat, use_running_average)


def _subtract_mean(x, mean, contract_axes):
  """`x` minus `mean` `(fan_in_part,)` of `_input_mean` (flattened over `contract_axes`)."""
  m = mean.astype(x.dtype).reshape((1,) * (x.ndim - len(contract_axes)) +
                                   tuple(x.shape[a] for a in contract_axes))
  return x - jnp.moveaxis(m, tuple(range(x.ndim - len(contract_axes), x.ndim)), contract_axes)


def contract_axes(layer: nn.Module, ndim: int) -> tuple[int, ...]:
  """The input axes a layer contracts with its kernel (all fan-in axes but a conv's window)."""
  if isinstance(layer, nn.DenseGeneral):
    axis = (layer.axis,) if isinstance(layer.axis, numbers.Integral) else tuple(layer.axis)
    return tuple(a % ndim for a in axis)
  return (ndim - 1,)


def _shapes(holder, layer, inputs):
  """`(inputs, kernel_shape, fan_in, features)`, or a clear error naming `holder`."""
  inputs = jnp.asarray(inputs)
  name = _describe(holder, layer)
  kernel_shape = layer_kernel_shape(layer, inputs.shape, name)
  _check_features(name, layer)
  return inputs, kernel_shape, math.prod(kernel_shape[:-1]), kernel_shape[-1]


# ----------------------------------------------------------------------------- the maps

def gmp_call(holder, cfg, layer, inputs, use_running_average=None):
  """GmP (and IMN) around `layer`: variables in `holder`, options from `cfg` (a `GmP`)."""
  inputs, kernel_shape, fan_in, features = _shapes(holder, layer, inputs)
  dtype = layer.param_dtype
  mean = None
  if cfg.input_mean_norm:
    axes = contract_axes(layer, inputs.ndim)
    mean = _input_mean(holder, cfg, inputs, axes, use_running_average)
    if imn_subtracts(inputs.shape, kernel_shape):
      inputs, mean = _subtract_mean(inputs, mean, axes), None
  if holder.has_variable('params', 'theta'):
    inits = (None,) * 4  # never called: the params exist
  else:
    inits = _gmp_inits(holder, cfg, layer, kernel_shape, dtype)
  u, lam, scale = gmp_variables(holder, fan_in, features, param_dtype=dtype, theta_init=inits[0],
                                lam_init=inits[1], scale_init=inits[2], sign_init=inits[3])
  dtype = lam.dtype  # the stored params' dtype: the layer sees what its own params would be
  lam, scale = lam.astype(u.dtype), scale.astype(u.dtype)  # float32 at least until the cast
  kernel = (u * scale).reshape(kernel_shape).astype(dtype)
  if mean is not None and isinstance(layer, nn.Conv):
    # conv(x - mu) = conv(x) - conv(mu * 1): (F,) in the bias, plus a correction at the output
    # positions whose windows hold padded zeros (exact at the borders; conv.imn_split).
    flat, positions, correction = conv.imn_split(layer, kernel, mean, inputs.shape)
    y = run_layer(layer, kernel, (scale * lam - flat).astype(dtype), inputs)
    return conv.subtract_at(y, positions, correction.astype(dtype), len(kernel_shape) - 2)
  if mean is not None:
    lam = imn_fold(lam, u, mean, layer.precision)
  return run_layer(layer, kernel, (scale * lam).astype(dtype), inputs)


def _bias(holder, layer, features, box):
  if not getattr(layer, 'use_bias', True):
    return None
  return get_or_create_param(holder, 'bias', lambda: _boxed(box(), layer.bias_init, True),
                             (features,), layer.param_dtype)


def lcw_call(holder, cfg, layer, inputs, use_running_average=None):
  """LCW around `layer`: `v (fan_in - 1, F)` and `bias` in `holder`; kernel `B v`."""
  del cfg, use_running_average
  inputs, kernel_shape, fan_in, features = _shapes(holder, layer, inputs)
  if fan_in < 2:
    raise ValueError(f'{_describe(holder, layer)}: LCW needs a fan-in of at least 2, got {fan_in} '
                     f'(kernel {kernel_shape}): one weight has no nonzero zero-sum value.')
  dtype = layer.param_dtype

  def v_init(key, shape, dtype=jnp.float32):  # the zero-sum part of the layer's own draw
    del shape
    drawn = layer.kernel_init(key, kernel_shape, dtype)
    v = v_from_kernel(meta.unbox(drawn))
    return _boxed(_box_of(drawn), lambda *_: v, False)(None, None)

  v = get_or_create_param(holder, 'v', lambda: v_init, (fan_in - 1, features), dtype)
  kernel = kernel_from_v(v, kernel_shape)
  box = lambda: _box_of(holder.get_variable('params', 'v'))  # the draw's metadata, if any
  return run_layer(layer, kernel, _bias(holder, layer, features, box), inputs)


def _normed_call(formula, holder, cfg, layer, inputs, min_fan_in, why):
  inputs, kernel_shape, fan_in, features = _shapes(holder, layer, inputs)
  if fan_in < min_fan_in:
    raise ValueError(f'{_describe(holder, layer)}: needs a fan-in of at least {min_fan_in}, got '
                     f'{fan_in} (kernel {kernel_shape}): {why}.')
  dtype = layer.param_dtype
  kernel = get_or_create_param(holder, 'kernel', lambda: layer.kernel_init, kernel_shape, dtype)
  box = lambda: _box_of(holder.get_variable('params', 'kernel'))  # kernel_init's metadata
  scale = get_or_create_param(holder, 'scale', lambda: _boxed(box(), cfg.scale_init, True),
                              (features,), dtype)
  kernel = formula(kernel, scale, cfg.epsilon)
  return run_layer(layer, kernel, _bias(holder, layer, features, box), inputs)


def cwn_call(holder, cfg, layer, inputs, use_running_average=None):
  """CWN around `layer`: `kernel`, `scale`, `bias` in `holder`; kernel `scale * c / |c|`."""
  del use_running_average
  return _normed_call(centered_weight_norm, holder, cfg, layer, inputs, 2,
                      'a centred single weight is always zero')


def wn_call(holder, cfg, layer, inputs, use_running_average=None):
  """WN around `layer`: `kernel`, `scale`, `bias` in `holder`; kernel `scale * k / |k|`."""
  del use_running_average
  return _normed_call(weight_norm, holder, cfg, layer, inputs, 1, '')


# ----------------------------------------------------------------------------- wrapper modules

def _check_layer(wrapper, layer):
  if not isinstance(layer, LAYER_TYPES):
    raise TypeError(
        f'{wrapper} wraps {", ".join(t.__name__ for t in LAYER_TYPES)}; got '
        f'{type(layer).__name__}.')


class GmP(nn.Module):
  """Geometric parameterization of any Dense/Conv/DenseGeneral layer (see module docstring).

  The layer sees `kernel = scale * u(theta)` and `bias = scale * lam`; follow it
  with the activation as usual. Exact for any activation as a map of
  `(kernel, bias)`; the paper's `scale * relu(u^T x + lam)` for relu while `scale > 0`.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn, geoparam
    >>> layer = geoparam.GmP(nn.Conv(8, (3, 3)))
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (8,), 'scale': (8,), 'theta': (17, 8)}

  Attributes:
    layer: the wrapped layer (only its fields are used; it creates no variables).
    input_mean_norm: IMN; then `use_running_average` is needed (field or call).
    use_running_average: as `nn.BatchNorm`, for IMN.
    momentum: running-mean decay for IMN.
    axis_name: named axis for a cross-device IMN mean (shard_map/pmap).
    initialization: `'paper'` (sphere-uniform `u`, `lam = 0`, `scale = 1`) or
      `'layer'` (the layer's own `kernel_init`/`bias_init` draw, converted exactly).
    theta_init, lam_init, scale_init: override the paper's initializers.
  """

  layer: nn.Module
  input_mean_norm: bool = False
  use_running_average: bool | None = None
  momentum: float = 0.99
  axis_name: str | None = None
  initialization: str = 'paper'
  theta_init: Initializer | None = None
  lam_init: Initializer | None = None
  scale_init: Initializer | None = None

  @nn.compact
  def __call__(self, inputs, use_running_average: bool | None = None):
    """Applies the layer to `inputs` with its reparameterized kernel and bias."""
    _check_layer('GmP', self.layer)
    return gmp_call(self, self, self.layer, inputs, use_running_average)


class LCW(nn.Module):
  """Linearly constrained weights of any Dense/Conv/DenseGeneral layer: kernel `B_m v`.

  `v` starts as the coordinates of the layer's own `kernel_init` draw (its
  zero-sum part); the bias is the layer's.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn, geoparam
    >>> params = geoparam.LCW(nn.Dense(4)).init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'v': (2, 4)}

  Attributes:
    layer: the wrapped layer (only its fields are used).
  """

  layer: nn.Module

  @nn.compact
  def __call__(self, inputs):
    """Applies the layer with the zero-sum kernel `B v`."""
    _check_layer('LCW', self.layer)
    return lcw_call(self, self, self.layer, inputs)


class CWN(nn.Module):
  """Centred weight normalization of any Dense/Conv/DenseGeneral layer.

  Example usage::

    >>> import jax, jax.numpy as jnp, flax.linen as nn, geoparam
    >>> params = geoparam.CWN(nn.Dense(4)).init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'kernel': (3, 4), 'scale': (4,)}

  Attributes:
    layer: the wrapped layer (only its fields are used).
    scale_init: initializer of the gain (ones).
    epsilon: added to the squared norm.
  """

  layer: nn.Module
  scale_init: Initializer = nn.initializers.ones
  epsilon: float = 1e-12

  @nn.compact
  def __call__(self, inputs):
    """Applies the layer with kernel `scale * c / |c|`, `c` the centred stored kernel."""
    _check_layer('CWN', self.layer)
    return cwn_call(self, self, self.layer, inputs)


class WN(nn.Module):
  """Weight normalization of any Dense/Conv/DenseGeneral layer, variables at the layer's path.

  Same formula as `nn.WeightNorm` (`scale * k / |k|` per output unit), but the
  gain is stored as `scale (features,)` beside `kernel`, so conversion is a rename.

  Attributes:
    layer: the wrapped layer (only its fields are used).
    scale_init: initializer of the gain (ones).
    epsilon: added to the squared norm.
  """

  layer: nn.Module
  scale_init: Initializer = nn.initializers.ones
  epsilon: float = 1e-12

  @nn.compact
  def __call__(self, inputs):
    """Applies the layer with kernel `scale * k / |k|`."""
    _check_layer('WN', self.layer)
    return wn_call(self, self, self.layer, inputs)


# Wrapper class -> the function that runs it (also used by the whole-model transform).
CALLS = {GmP: gmp_call, LCW: lcw_call, CWN: cwn_call, WN: wn_call}
