"""LCW layers (paper 003 Sec. 3): Dense and Conv whose unit kernels sum to zero.

Each output unit's kernel (for a conv: its flattened `K_1 x ... x K_d x C_in`
kernel) is `w = B_m v` (`geoparam.lcw.project`), with the trainable parameter
`v` of shape `(fan_in - 1, features)`, fan-in first like a Flax kernel. The
layers are drop-in replacements for `nn.Dense` / `nn.Conv` (same fields, same
padding/stride/dilation/group semantics); `B_m` is never formed.

`kernel_init` draws a kernel of the usual shape (so fan-based initializers see
the real fans) and `v` is its coordinates `B_m^T w`: the initial kernel is that
draw minus its per-unit mean.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from geoparam import conv
from geoparam import lcw

__all__ = ['LCWDense', 'LCWConv', 'kernel_from_v', 'v_from_kernel']

Array = jax.Array

default_kernel_init = nn.initializers.lecun_normal()


def kernel_from_v(v: Array, kernel_shape: Sequence[int] | None = None) -> Array:
  """Zero-sum kernel from coordinates `v`.

  Args:
    v: shape `(fan_in - 1, features)`.
    kernel_shape: optional shape `(*spatial, in, features)` to reshape to; its
      product over all axes but the last must be `fan_in`.

  Returns:
    kernel of shape `(fan_in, features)` or `kernel_shape`; each column (unit)
    sums to zero and has the norm of the matching column of `v`.
  """
  kernel = lcw.project_batched(v)
  if kernel_shape is not None:
    kernel = kernel.reshape(kernel_shape)
  return kernel


def v_from_kernel(kernel: Array) -> Array:
  """Coordinates `v = B^T w` per unit of a kernel `(..., features)`.

  Returns shape `(fan_in - 1, features)`; `kernel_from_v` of it is the kernel
  minus its per-unit mean (exactly the kernel when it already sums to zero).
  """
  features = kernel.shape[-1]
  return jax.vmap(lcw.coordinates, in_axes=1, out_axes=1)(kernel.reshape(-1, features))


def _v_init(kernel_init, kernel_shape):
  """Initializer for `v` that draws a kernel with `kernel_init` and centers it."""

  def init(key, shape, dtype=jnp.float32):
    del shape
    return v_from_kernel(kernel_init(key, kernel_shape, dtype))

  return init


def _check_fan_in(layer: str, fan_in: int, detail: str) -> None:
  if fan_in < 2:
    raise ValueError(
        f'{layer} needs a fan-in of at least 2, got fan_in = {fan_in} ({detail}): '
        'a single input weight has no nonzero zero-sum value.')


class LCWDense(nn.Module):
  """A Dense layer with linearly constrained (zero-sum) weights.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.linear_constrained import LCWDense
    >>> layer = LCWDense(features=4)
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'v': (2, 4)}

  Attributes:
    features: the number of output features.
    use_bias: whether to add a bias to the output.
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers.
    precision: numerical precision of the computation, see `jax.lax.Precision`.
    kernel_init: initializer of the (unconstrained) kernel `(fan_in, features)`;
      `v` is the coordinates of its zero-sum part.
    bias_init: initializer for the bias.
  """

  features: int
  use_bias: bool = True
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32
  precision: lax.PrecisionLike = None
  kernel_init: nn.initializers.Initializer = default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Applies `inputs @ B v + bias` along the last axis: `(..., fan_in) -> (..., features)`."""
    if self.features < 1:
      raise ValueError(f'LCWDense needs features >= 1, got features = {self.features}.')
    fan_in = jnp.shape(inputs)[-1]
    _check_fan_in('LCWDense', fan_in, f'input shape {jnp.shape(inputs)}')
    v = self.param(
        'v', _v_init(self.kernel_init, (fan_in, self.features)),
        (fan_in - 1, self.features), self.param_dtype)
    bias = (
        self.param('bias', self.bias_init, (self.features,), self.param_dtype)
        if self.use_bias else None)
    kernel = kernel_from_v(v)
    inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    y = lax.dot_general(
        inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class LCWConv(nn.Module):
  """A convolution (any number of spatial dims) with zero-sum kernels per output channel.

  Same fields and semantics as `nn.Conv` (channels-last inputs
  `(*batch, *spatial, in_features)`); the kernel is built from `v` and applied
  through `nn.Conv` itself, so padding, strides, dilations and groups behave
  exactly as there. Each output channel's `K_1 x ... x K_d x (in_features //
  feature_group_count)` kernel sums to zero.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.linear_constrained import LCWConv
    >>> layer = LCWConv(features=8, kernel_size=(3, 3))
    >>> params = layer.init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (8,), 'v': (17, 8)}

  Attributes:
    features: number of convolution filters (output channels).
    kernel_size: shape of the kernel; an int means a 1-D kernel, as in `nn.Conv`.
    strides: an int or a sequence of `n` ints, the inter-window strides.
    padding: 'SAME', 'VALID', 'CIRCULAR', 'REFLECT', 'CAUSAL', an int, or a
      sequence of `n` `(low, high)` pairs, as in `nn.Conv`.
    input_dilation: an int or a sequence of `n` ints (transposed-conv style).
    kernel_dilation: an int or a sequence of `n` ints (atrous convolution).
    feature_group_count: number of feature groups (depthwise when equal to
      `in_features`).
    use_bias: whether to add a bias to the output.
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers.
    precision: numerical precision of the computation, see `jax.lax.Precision`.
    kernel_init: initializer of the (unconstrained) kernel
      `(*kernel_size, in_features // feature_group_count, features)`; `v` is the
      coordinates of its per-channel zero-sum part.
    bias_init: initializer for the bias.
  """

  features: int
  kernel_size: int | Sequence[int]
  strides: None | int | Sequence[int] = 1
  padding: nn.linear.PaddingLike = 'SAME'
  input_dilation: None | int | Sequence[int] = 1
  kernel_dilation: None | int | Sequence[int] = 1
  feature_group_count: int = 1
  use_bias: bool = True
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32
  precision: lax.PrecisionLike = None
  kernel_init: nn.initializers.Initializer = default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Convolves `(*batch, *spatial, in_features)` into `(*batch, *spatial', features)`."""
    if self.features < 1:
      raise ValueError(f'LCWConv needs features >= 1, got features = {self.features}.')
    if isinstance(self.kernel_size, int):
      kernel_size = (self.kernel_size,)
    else:
      kernel_size = tuple(self.kernel_size)
    kernel_shape = conv.kernel_shape('LCWConv', kernel_size, jnp.shape(inputs), self.features,
                                     self.feature_group_count)
    fan_in = math.prod(kernel_shape[:-1])
    _check_fan_in('LCWConv', fan_in, f'kernel shape {kernel_shape}')
    v = self.param(
        'v', _v_init(self.kernel_init, kernel_shape), (fan_in - 1, self.features),
        self.param_dtype)
    params = {'kernel': kernel_from_v(v, kernel_shape)}
    if self.use_bias:
      params['bias'] = self.param('bias', self.bias_init, (self.features,), self.param_dtype)
    return conv.apply(self, params, inputs)
