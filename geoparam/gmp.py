"""Geometric parameterization (GmP) layers, paper 002 eq. (15)-(16).

A GmP unit computes `scale * act(u(theta)^T x + lam)`: `u(theta)` is the unit
direction of eq. (10), `lam` the signed distance of the activation boundary
from the origin and `scale` the paper's `r`. With `input_mean_norm=True` the
input is centred first (IMN, eq. 16), never by a pass over it: GmPDense folds
the mean into the bias, `lam - u^T mu`; GmPConv subtracts `conv(mu * 1)`, the
conv of one constant image (`conv.imn_bias`: `(features,)`, or per output
position where zeros are padded, exact at the borders). Running mean in
`batch_stats/input_mean_norm/mean`.

Parameters (collection `params`):
  theta: `(fan_in - 1, features)`, fan-in first like a Flax kernel.
  lam:   `(features,)`.
  scale: `(features,)`.
  sign:  `(features,)`, only when fan_in == 1: the direction is a sign, fixed at
         init; it receives no gradient (`stop_gradient`) and only its sign is
         used, so weight decay cannot flip it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import math
import numbers
from typing import Any

import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp
from jax import lax

from geoparam import conv
from geoparam import hyperspherical
from geoparam import initializers
from geoparam.normalization import InputMeanNorm

__all__ = ['directions', 'gmp_kernel', 'gmp_variables', 'imn_fold', 'imn_subtracts', 'GmPDense',
           'GmPConv']

Initializer = Callable[..., jax.Array]

# The single-neuron map over neurons: theta (n - 1, m) -> u (n, m). The batched form
# runs the same custom-VJP code on all columns at once and is tested equal to
# `jax.vmap(hyperspherical.to_cartesian, in_axes=1, out_axes=1)`.
directions = hyperspherical.to_cartesian_batched


def gmp_kernel(theta: jax.Array, sign: jax.Array | None = None) -> jax.Array:
  """Unit-norm kernel `(fan_in, features)` from angles `(fan_in - 1, features)`.

  The map runs in float32 at least (bf16 angles evaluated in bf16 give column
  norms ~1.6 at fan-in 4608); the result has that dtype, callers cast after.
  For fan-in 1 (`theta` of shape `(0, features)`) the column is `sign(sign)`.

    >>> import jax.numpy as jnp, geoparam
    >>> u = geoparam.gmp_kernel(jnp.zeros((2, 3), jnp.bfloat16))
    >>> u.shape, u.dtype
    ((3, 3), dtype('float32'))
  """
  theta = jnp.asarray(theta)
  if theta.ndim != 2:
    raise ValueError(f'theta must have shape (fan_in - 1, features), got {theta.shape}.')
  if jnp.issubdtype(theta.dtype, jnp.floating):
    theta = theta.astype(jnp.promote_types(theta.dtype, jnp.float32))
  u = directions(theta)
  if theta.shape[0] == 0:
    if sign is None:
      raise ValueError('a fan-in-1 GmP unit needs its fixed `sign` parameter.')
    u = u * jnp.sign(lax.stop_gradient(sign)).astype(u.dtype)[None, :]
  return u


def imn_fold(lam: jax.Array, u: jax.Array, mean: jax.Array, precision=None) -> jax.Array:
  """IMN folded into the bias: `u^T (x - mean) + lam = u^T x + imn_fold(lam, u, mean)`.

  Shapes: `lam (F,)`, `u (fan_in, F)`, `mean (fan_in,)`; returns `(F,)`.
  """
  return lam - jnp.dot(mean.astype(u.dtype), u, precision=precision)


def imn_subtracts(inputs_shape: Sequence[int], kernel_shape: Sequence[int]) -> bool:
  """Whether IMN is cheaper as `x - mean` than folded into the bias, for a layer's shapes.

  Both are exact. Subtracting is one elementwise pass over the inputs (fused with the
  reduction that takes their mean); folding (`imn_fold`, `conv.imn_split`) is work in
  proportion to the kernel (`u^T mean` forward, a rank-1 kernel gradient backward). So small
  activations and large kernels (ResNet-50's late stages at small batches or images) subtract,
  the papers' batch-256 activations fold.

    >>> imn_subtracts((16, 2, 2, 512), (3, 3, 512, 512))  # 32k activations, 2.4M kernel
    True
    >>> imn_subtracts((256, 56, 56, 64), (3, 3, 64, 64))
    False
  """
  return math.prod(inputs_shape) < math.prod(kernel_shape)


def get_or_create_param(module: nn.Module, name: str, make_init: Callable[[], Initializer],
                        shape: tuple[int, ...], dtype) -> jax.Array:
  """`module.param(name, make_init(), shape, dtype)`, but an existing param is read directly.

  Flax's `param` re-traces the initializer on every call to check the stored
  shape (tens of ms per eager call for the map's initializers); this checks the
  shape itself, with an error naming the module, and builds the initializer only
  when the param is created.
  """
  if module.has_variable('params', name):
    value = meta.unbox(module.get_variable('params', name))
    if jnp.shape(value) != tuple(shape):
      raise ValueError(
          f'{type(module).__name__} {"/".join(module.path) or module.name or ""}: the inputs '
          f'need param {name!r} of shape {tuple(shape)}, but the given params have '
          f'{jnp.shape(value)} (the fan_in or the features differ).')
    return value
  value = module.param(name, make_init(), shape, dtype)
  if jnp.shape(value) != tuple(shape):
    raise ValueError(f'{type(module).__name__} {module.name or ""}: {name} must have shape '
                     f'{tuple(shape)}, got {jnp.shape(value)} from its initializer.')
  return value


def gmp_from_dense(kernel: jax.Array, bias: jax.Array) -> dict[str, jax.Array]:
  """`theta`, `lam`, `scale` (+ `sign` at fan-in 1) with `scale * u = kernel`, `scale * lam = bias`.

  Traceable (no checks on values): `kernel (fan_in, F)` with nonzero columns,
  `bias (F,)`. `geoparam.convert.dense_to_gmp` is the checked version.
  """
  if kernel.shape[0] == 1:
    scale = jnp.abs(kernel[0])
    return {'theta': jnp.zeros((0, kernel.shape[1]), kernel.dtype), 'lam': bias / scale,
            'scale': scale, 'sign': jnp.sign(kernel[0])}
  theta, scale = jax.vmap(hyperspherical.from_cartesian, in_axes=1, out_axes=(1, 0))(kernel)
  return {'theta': theta, 'lam': bias / scale, 'scale': scale}


def gmp_variables(module: nn.Module, fan_in: int, features: int, *, param_dtype=jnp.float32,
                  theta_init: Initializer | None = None, lam_init: Initializer | None = None,
                  scale_init: Initializer | None = None, sign_init: Initializer | None = None):
  """Creates `theta`, `lam`, `scale` (+ `sign` at fan-in 1) in `module`; returns `(u, lam, scale)`.

  `u` is the unit kernel `(fan_in, features)` in float32 at least; `lam`, `scale`
  are `(features,)` in `param_dtype`. Call from inside a compact method.
  Initializers default to the paper's: sphere-uniform directions, `lam = 0`, `scale = 1`.
  """
  if fan_in < 1:
    raise ValueError(f'GmP needs fan_in >= 1, got {fan_in}.')
  get = functools.partial(get_or_create_param, module, dtype=param_dtype)
  theta = get('theta', lambda: theta_init or initializers.sphere_uniform(),
              shape=(fan_in - 1, features))
  lam = get('lam', lambda: lam_init or nn.initializers.zeros, shape=(features,))
  scale = get('scale', lambda: scale_init or nn.initializers.ones, shape=(features,))
  sign = None
  if fan_in == 1:
    sign = get('sign', lambda: sign_init or initializers.rademacher(), shape=(features,))
  return gmp_kernel(theta, sign), lam, scale


class _GmPBase(nn.Module):
  """Parameter creation and output shared by the GmP layers (fields live in the subclasses)."""

  def _check_features(self):
    if (isinstance(self.features, bool) or not isinstance(self.features, numbers.Integral)
        or self.features < 1):
      raise ValueError(f'features must be a positive integer, got {self.features!r}.')
    if self.activation is not None and not callable(self.activation):
      raise TypeError(
          f'{type(self).__name__}: activation must be a function (e.g. nn.relu) or None for '
          f'linear, got {self.activation!r}.')

  def _input_mean(self, x, kernel_shape, use_running_average):
    """IMN on the inputs `x` `(..., in_features)`: `(x - mean, None)` where the layer subtracts
    the mean (`imn_subtracts`), else `(x, mean)` with the mean `(in_features,)` for the layer to
    fold into its bias; `(x, None)` without IMN. The mean is batch_stats/input_mean_norm/mean."""
    if not self.input_mean_norm:
      return x, None
    imn = InputMeanNorm(
        use_running_average=self.use_running_average, momentum=self.momentum,
        axis_name=self.axis_name, name='input_mean_norm')
    if imn_subtracts(x.shape, kernel_shape):
      return imn(x, use_running_average), None
    return x, imn.mean(x, use_running_average)

  def _params(self, fan_in: int):
    """Creates theta, lam, scale (and sign for fan-in 1); returns the kernel and both vectors."""
    if self.scale_init is not None:
      scale_init = self.scale_init
    elif self.glorot_scale:
      scale_init = initializers.glorot_norm(fan_in, self.features)
    else:
      scale_init = nn.initializers.ones
    u, lam, scale = gmp_variables(self, fan_in, self.features, param_dtype=self.param_dtype,
                                  theta_init=self.theta_init, lam_init=self.lam_init,
                                  scale_init=scale_init)
    return u.astype(lam.dtype), lam, scale  # the map ran in float32 at least; params' dtype now

  def _finish(self, z, lam, scale):
    z = z + lam
    if self.activation is not None:
      z = self.activation(z)
    return scale * z


class GmPDense(_GmPBase):
  """Dense layer in geometric parameterization: `scale * act(u(theta)^T x + lam)`.

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> layer = geoparam.GmPDense(features=4)
    >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (4,), 'scale': (4,), 'theta': (2, 4)}

  Attributes:
    features: number of output units.
    activation: elementwise activation inside the scale (default relu); None for linear.
    input_mean_norm: centre the inputs first (IMN); then `use_running_average`
      is needed at call time and the running mean lives in `batch_stats`.
    use_running_average: as `nn.BatchNorm`, only used with `input_mean_norm`.
    momentum: running-mean decay for IMN.
    axis_name: named axis for a cross-device IMN mean (inside shard_map/pmap),
      as `nn.BatchNorm`.
    dtype: computation dtype (None: inferred from inputs and params).
    param_dtype: parameter dtype.
    precision: `jax.lax.Precision` of the matmul.
    theta_init: initializer of the angles (uniform directions on the sphere).
    lam_init: initializer of `lam` (zeros).
    scale_init: initializer of `scale` (ones when None, or see `glorot_scale`).
    glorot_scale: when `scale_init` is None, start `scale` at the norm of a
      Glorot-uniform weight vector, as the paper's reference code does.
  """

  features: int
  activation: Callable[[jax.Array], jax.Array] | None = nn.relu
  input_mean_norm: bool = False
  use_running_average: bool | None = None
  momentum: float = 0.99
  axis_name: str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  theta_init: Initializer = initializers.sphere_uniform()
  lam_init: Initializer = nn.initializers.zeros
  scale_init: Initializer | None = None
  glorot_scale: bool = False

  @nn.compact
  def __call__(self, inputs, use_running_average: bool | None = None):
    """Applies the layer to `inputs` of shape `(..., fan_in)`; returns `(..., features)`."""
    self._check_features()
    inputs = jnp.asarray(inputs)
    if inputs.ndim < 1:
      raise ValueError(f'GmPDense expects inputs of shape (..., fan_in), got {inputs.shape}.')
    inputs, mean = self._input_mean(inputs, (inputs.shape[-1], self.features),
                                    use_running_average)
    kernel, lam, scale = self._params(inputs.shape[-1])
    if mean is not None:
      # IMN folded into the bias: u^T (x - mu) + lam = u^T x + (lam - u^T mu); no pass over x.
      lam = imn_fold(lam, kernel, mean, self.precision)
    inputs, kernel, lam, scale = nn.dtypes.promote_dtype(
        inputs, kernel, lam, scale, dtype=self.dtype)
    z = jax.lax.dot_general(
        inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision)
    return self._finish(z, lam, scale)


class GmPConv(_GmPBase):
  """Convolution in geometric parameterization, any number of spatial dims.

  Each output channel's flattened kernel (`prod(kernel_size) * in_features //
  feature_group_count` entries, ordered like `nn.Conv`'s kernel) is `u(theta)`.
  Convolution semantics (padding, strides, dilation, groups, batch dims) are
  exactly `nn.Conv`'s: the layer runs `nn.Conv` with the built kernel.

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> layer = geoparam.GmPConv(features=8, kernel_size=(3, 3))
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (8,), 'scale': (8,), 'theta': (17, 8)}

  Attributes:
    features: number of output channels.
    kernel_size: tuple of spatial kernel sizes (its length is the number of
      spatial dims).
    strides, padding, input_dilation, kernel_dilation, feature_group_count:
      as in `nn.Conv`.
    (other fields): as in `GmPDense`.
  """

  features: int
  kernel_size: Sequence[int]
  strides: int | Sequence[int] = 1
  padding: Any = 'SAME'
  input_dilation: int | Sequence[int] = 1
  kernel_dilation: int | Sequence[int] = 1
  feature_group_count: int = 1
  activation: Callable[[jax.Array], jax.Array] | None = nn.relu
  input_mean_norm: bool = False
  use_running_average: bool | None = None
  momentum: float = 0.99
  axis_name: str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  theta_init: Initializer = initializers.sphere_uniform()
  lam_init: Initializer = nn.initializers.zeros
  scale_init: Initializer | None = None
  glorot_scale: bool = False

  @nn.compact
  def __call__(self, inputs, use_running_average: bool | None = None):
    """Applies the conv to `inputs` of shape `(*batch, *spatial, in_features)`."""
    self._check_features()
    if isinstance(self.kernel_size, int):
      raise ValueError(
          f'kernel_size must be a tuple of positive ints, one per spatial dim, '
          f'got {self.kernel_size!r}.')
    inputs = jnp.asarray(inputs)
    shape = conv.kernel_shape('GmPConv', tuple(self.kernel_size), inputs.shape, self.features,
                              self.feature_group_count)
    inputs, mean = self._input_mean(inputs, shape, use_running_average)
    kernel, lam, scale = self._params(math.prod(shape[:-1]))
    kernel = kernel.reshape(shape)
    positions = None
    if mean is not None:
      # IMN without a pass over x: conv(x - mu) = conv(x) - conv(mu * 1), the second term
      # (F,), folded into lam, plus a correction at the output positions whose windows hold
      # padded zeros (conv.imn_split).
      flat, positions, correction = conv.imn_split(conv.layer_of(self, shape), kernel, mean,
                                                   inputs.shape)
      lam = (lam - flat).astype(lam.dtype)
    z = conv.apply(self, {'kernel': kernel}, inputs)
    if positions is not None:
      z = conv.subtract_at(z, positions, correction, len(shape) - 2)
    _, lam, scale = nn.dtypes.promote_dtype(z, lam, scale, dtype=self.dtype)
    return self._finish(z, lam, scale)
