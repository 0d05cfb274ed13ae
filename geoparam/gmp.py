"""Geometric parameterization (GmP) layers in the paper's form, paper 002 eq. (15)-(16).

The `gmp` method (`geoparam.methods.gmp`) with the scale outside the activation:
the layer runs `nn.Dense`/`nn.Conv` with the kernel `u(theta)` and bias `lam`
(`geoparam.linen.wrappers.call`, the same code as every wrapper), then applies the
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

from collections.abc import Callable
import math

import flax.linen as nn
from flax.core import meta
import jax

from geoparam import initializers
from geoparam.linen import wrappers
from geoparam.methods.gmp import gmp_kernel
from geoparam.methods.gmp import paper_method

__all__ = ['gmp_kernel', 'GmPDense', 'GmPConv']

Initializer = Callable[..., jax.Array]


class _PaperGmP(nn.Module):
  """GmP's fields and the paper form's call, mixed into `nn.Dense`/`nn.Conv` (whose fields,
  `kernel_init` and `bias_init` aside, the layer keeps)."""

  activation: Callable[[jax.Array], jax.Array] | None = nn.relu
  input_mean_norm: bool = False
  use_running_average: bool | None = None
  momentum: float = 0.99
  axis_name: str | None = None
  theta_init: Initializer = initializers.sphere_uniform()
  lam_init: Initializer = nn.initializers.zeros
  scale_init: Initializer | None = None
  glorot_scale: bool = False
  reparameterized = True  # a reparameterized layer already: no whole-model transform's target

  @nn.compact
  def __call__(self, inputs, use_running_average: bool | None = None):
    """`scale * act(layer(inputs; u, lam))`, IMN included; the shapes of the plain layer."""
    layer = wrappers.plain(self)
    name = type(self).__name__
    for field in ('kernel_init', 'bias_init'):
      if getattr(self, field) is not getattr(type(layer), field):
        raise TypeError(f'{name}: {field} is not used (GmP draws its own parameters): set '
                        'theta_init, lam_init or scale_init, or wrap the plain layer with '
                        "geoparam.GmP(layer, initialization='layer') to convert its draw.")
    if isinstance(getattr(self, 'kernel_size', ()), int):  # one spatial dim, or a 3x3 meant?
      raise ValueError(f'{name}: kernel_size must be a tuple of positive ints, one per spatial '
                       f'dim, got {self.kernel_size!r}.')
    layout = wrappers.layout_of(layer, jax.numpy.shape(inputs), name)
    method = paper_method(self, math.prod(layout.method_shape[:-1]), name)
    y = wrappers.call(self, method, layer, inputs, use_running_average, self.use_running_average)
    if self.activation is not None:
      y = self.activation(y)
    y, scale = nn.dtypes.promote_dtype(y, meta.unbox(self.get_variable('params', 'scale')),
                                       dtype=self.dtype)
    return scale * y


class GmPDense(_PaperGmP, nn.Dense):
  """Dense layer in geometric parameterization: `scale * act(u(theta)^T x + lam)`.

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> layer = geoparam.GmPDense(features=4)
    >>> params = layer.init(jax.random.key(0), jnp.ones((2, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (4,), 'scale': (4,), 'theta': (2, 4)}

  Attributes:
    features, use_bias, dtype, param_dtype, precision, dot_general: as `nn.Dense`
      (`use_bias=False`: no `lam`; `kernel_init`/`bias_init` are not used).
    activation: elementwise activation inside the scale (default relu); None for linear.
    input_mean_norm: centre the inputs first (IMN); then `use_running_average`
      is needed at call time and the running mean lives in `batch_stats`.
    use_running_average: as `nn.BatchNorm`, only used with `input_mean_norm`.
    momentum: running-mean decay for IMN.
    axis_name: named axis for a cross-device IMN mean (inside shard_map/pmap),
      as `nn.BatchNorm`.
    theta_init: initializer of the angles (uniform directions on the sphere).
    lam_init: initializer of `lam` (zeros).
    scale_init: initializer of `scale` (ones when None, or see `glorot_scale`).
    glorot_scale: when `scale_init` is None, start `scale` at the norm of a
      Glorot-uniform weight vector, as the paper's reference code does.
  """


class GmPConv(_PaperGmP, nn.Conv):
  """Convolution in geometric parameterization, any number of spatial dims.

  Each output channel's flattened kernel (`prod(kernel_size) * in_features //
  feature_group_count` entries, ordered like `nn.Conv`'s kernel) is `u(theta)`.
  Convolution semantics (padding, strides, dilation, groups, batch dims, mask) are
  exactly `nn.Conv`'s: the layer runs `nn.Conv` with the built kernel.

  Example usage::

    >>> import jax, jax.numpy as jnp, geoparam
    >>> layer = geoparam.GmPConv(features=8, kernel_size=(3, 3))
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'lam': (8,), 'scale': (8,), 'theta': (17, 8)}

  Attributes:
    features, kernel_size, strides, padding, input_dilation, kernel_dilation,
      feature_group_count, use_bias, mask, dtype, param_dtype, precision: as in `nn.Conv`.
    (other fields): as in `GmPDense`.
  """
