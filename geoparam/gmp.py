"""Geometric parameterization (GmP) layers in the paper's form, paper 002 eq. (15)-(16).

The `gmp` method (`geoparam.methods.gmp`) with the scale outside the activation:
the layer runs `nn.Dense`/`nn.Conv` with the kernel `u(theta)` and bias `lam`
(`geoparam.wrappers.call`, the same code as every wrapper), then applies the
activation and multiplies by `scale`. A GmP unit computes `scale * act(u(theta)^T x + lam)`: `u(theta)` is the unit
direction of eq. (10), `lam` the signed distance of the activation boundary
from the origin and `scale` the paper's `r`. With `input_mean_norm=True` the
input is centred first (IMN, eq. 16; `geoparam.methods.run.forward`). Running
mean in `batch_stats/input_mean_norm/mean`.

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
import numbers
from typing import Any

import flax.linen as nn
from flax.core import meta
import jax
import jax.numpy as jnp

from geoparam import initializers
from geoparam import wrappers
from geoparam.methods import run
from geoparam.methods.gmp import gmp_kernel
from geoparam.methods.gmp import paper_method

__all__ = ['gmp_kernel', 'GmPDense', 'GmPConv']

Initializer = Callable[..., jax.Array]


class _GmPBase(nn.Module):
  """The paper form of the `gmp` method around `nn.Dense`/`nn.Conv` (fields in the subclasses)."""

  def _check_features(self):
    if (isinstance(self.features, bool) or not isinstance(self.features, numbers.Integral)
        or self.features < 1):
      raise ValueError(f'features must be a positive integer, got {self.features!r}.')
    if self.activation is not None and not callable(self.activation):
      raise TypeError(
          f'{type(self).__name__}: activation must be a function (e.g. nn.relu) or None for '
          f'linear, got {self.activation!r}.')

  def _finish(self, layer, inputs, use_running_average, ops=None):
    """`scale * act(layer(x; u, lam))`, IMN included."""
    layout = wrappers.layout_of(layer, jnp.shape(inputs), type(self).__name__)
    method = paper_method(self, math.prod(layout.method_shape[:-1]))
    y = wrappers.call(self, method, layer, inputs, use_running_average, self.use_running_average,
                      ops=ops)
    if self.activation is not None:
      y = self.activation(y)
    y, scale = nn.dtypes.promote_dtype(y, meta.unbox(self.get_variable('params', 'scale')),
                                       dtype=self.dtype)
    return scale * y


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
    dense = nn.Dense(self.features, dtype=self.dtype, param_dtype=self.param_dtype,
                     precision=self.precision, parent=None)

    def run_dense(kernel, bias, x):  # nn.Dense's computation, without a nested linen apply
      x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
      y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                              precision=self.precision)
      return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))

    ops = run.LayerOps(run_dense, (inputs.ndim - 1,), self.precision)
    return self._finish(dense, inputs, use_running_average, ops)


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
    layer = nn.Conv(self.features, tuple(self.kernel_size), self.strides, self.padding,
                    self.input_dilation, self.kernel_dilation, self.feature_group_count,
                    use_bias=True, dtype=self.dtype, param_dtype=self.param_dtype,
                    precision=self.precision, parent=None)  # lam: the paper's unit has a bias
    return self._finish(layer, jnp.asarray(inputs), use_running_average)
