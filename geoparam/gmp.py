"""Geometric parameterization (GmP) layers, paper 002 eq. (15)-(16).

A GmP unit computes `scale * act(u(theta)^T x + lam)`: `u(theta)` is the unit
direction of eq. (10), `lam` the signed distance of the activation boundary
from the origin and `scale` the paper's `r`. With `input_mean_norm=True` the
input is centred first (IMN, eq. 16; GmPDense folds the mean into the bias,
`lam - u^T mu`; running mean in `batch_stats/input_mean_norm/mean`).

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
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from geoparam import conv
from geoparam import hyperspherical
from geoparam import initializers
from geoparam.normalization import InputMeanNorm

__all__ = ['directions', 'gmp_kernel', 'GmPDense', 'GmPConv']

Initializer = Callable[..., jax.Array]

# The single-neuron map over neurons: theta (n - 1, m) -> u (n, m). The batched form
# runs the same custom-VJP code on all columns at once and is tested equal to
# `jax.vmap(hyperspherical.to_cartesian, in_axes=1, out_axes=1)`.
directions = hyperspherical.to_cartesian_batched


def gmp_kernel(theta: jax.Array, sign: jax.Array | None = None) -> jax.Array:
  """Unit-norm kernel `(fan_in, features)` from angles `(fan_in - 1, features)`.

  For fan-in 1 (`theta` of shape `(0, features)`) the column is `sign(sign)`.
  """
  if theta.ndim != 2:
    raise ValueError(f'theta must have shape (fan_in - 1, features), got {theta.shape}.')
  u = directions(theta)
  if theta.shape[0] == 0:
    if sign is None:
      raise ValueError('a fan-in-1 GmP unit needs its fixed `sign` parameter.')
    u = u * jnp.sign(jax.lax.stop_gradient(sign)).astype(u.dtype)[None, :]
  return u


class _GmPBase(nn.Module):
  """Parameter creation and output shared by the GmP layers (fields live in the subclasses)."""

  def _check_features(self):
    if not isinstance(self.features, int) or self.features < 1:
      raise ValueError(f'features must be a positive integer, got {self.features!r}.')

  def _input_mean(self, x, use_running_average):
    """IMN's mean of the inputs `(in_features,)` (batch_stats/input_mean_norm/mean), or None."""
    if not self.input_mean_norm:
      return None
    imn = InputMeanNorm(
        use_running_average=self.use_running_average, momentum=self.momentum,
        name='input_mean_norm')
    return imn.mean(x, use_running_average)

  def _params(self, fan_in: int):
    """Creates theta, lam, scale (and sign for fan-in 1); returns the kernel and both vectors."""
    if fan_in < 1:
      raise ValueError(f'GmP needs fan_in >= 1, got {fan_in}.')
    shape = (fan_in - 1, self.features)
    if self.has_variable('params', 'theta'):
      existing = self.get_variable('params', 'theta').shape
      if existing != shape:
        raise ValueError(
            f'{type(self).__name__} {self.name or ""}: inputs give fan_in={fan_in} and theta '
            f'{shape}, but the given params have theta {existing} (fan_in={existing[0] + 1}).')
    theta = self.param('theta', self.theta_init, shape, self.param_dtype)
    lam = self.param('lam', self.lam_init, (self.features,), self.param_dtype)
    if self.scale_init is not None:
      scale_init = self.scale_init
    elif self.glorot_scale:
      scale_init = initializers.glorot_norm(fan_in, self.features)
    else:
      scale_init = nn.initializers.ones
    scale = self.param('scale', scale_init, (self.features,), self.param_dtype)
    sign = None
    if fan_in == 1:
      sign = self.param('sign', initializers.rademacher(), (self.features,), self.param_dtype)
    return gmp_kernel(theta, sign), lam, scale

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
    mean = self._input_mean(inputs, use_running_average)
    kernel, lam, scale = self._params(inputs.shape[-1])
    if mean is not None:
      # IMN folded into the bias: u^T (x - mu) + lam = u^T x + (lam - u^T mu); no pass over x.
      lam = lam - jnp.dot(mean.astype(kernel.dtype), kernel, precision=self.precision)
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
    mean = self._input_mean(inputs, use_running_average)
    if mean is not None:
      # Explicit subtraction: with zero padding, folding the mean into the bias would
      # also subtract it at padded positions, which IMN does not.
      inputs = inputs - mean.astype(inputs.dtype)
    kernel, lam, scale = self._params(math.prod(shape[:-1]))
    z = conv.apply(self, {'kernel': kernel.reshape(shape)}, inputs)
    _, lam, scale = nn.dtypes.promote_dtype(z, lam, scale, dtype=self.dtype)
    return self._finish(z, lam, scale)
