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

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from geoparam import methods
from geoparam import wrappers
from geoparam.methods.lcw import kernel_from_v
from geoparam.methods.lcw import v_from_kernel

__all__ = ['LCWDense', 'LCWConv', 'kernel_from_v', 'v_from_kernel']

Array = jax.Array

default_kernel_init = nn.initializers.lecun_normal()


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
    dense = nn.Dense(self.features, use_bias=self.use_bias, dtype=self.dtype,
                     param_dtype=self.param_dtype, precision=self.precision,
                     kernel_init=self.kernel_init, bias_init=self.bias_init, parent=None)
    return wrappers.call(self, methods.get('lcw'), dense, inputs)


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
    layer = nn.Conv(self.features, self.kernel_size, strides=self.strides, padding=self.padding,
                    input_dilation=self.input_dilation, kernel_dilation=self.kernel_dilation,
                    feature_group_count=self.feature_group_count, use_bias=self.use_bias,
                    dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
                    kernel_init=self.kernel_init, bias_init=self.bias_init, parent=None)
    return wrappers.call(self, methods.get('lcw'), layer, inputs)
