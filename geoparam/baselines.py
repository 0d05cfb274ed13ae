"""Baselines of paper 003 next to LCW: centered weight norm (CWN), standardization layer (SL).

* CWN (Huang et al. 2017): each unit's kernel is `w = g * c / |c|`, `c = k - mean(k)`
  (zero mean AND unit norm, times a gain `g`). Parameters: `kernel` (the
  unconstrained `k`, Flax kernel shape), `scale` (`g`, `(features,)`), `bias`.
* SL (Gulcehre & Bengio 2016): standardizes post-activations over the batch
  (no learned affine), with running statistics for inference, i.e. a
  `nn.BatchNorm` without scale and bias placed after the activation.
* Spectral normalization: use `nn.SpectralNorm(nn.Dense(...))` from Flax.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from geoparam import conv

__all__ = ['centered_weight_norm', 'CWNDense', 'CWNConv', 'StandardizationLayer']

Array = jax.Array

default_kernel_init = nn.initializers.lecun_normal()


def centered_weight_norm(kernel: Array, scale: Array, epsilon: float = 1e-12) -> Array:
  """`scale * c / |c|` per unit, `c` the unit's kernel minus its mean.

  Args:
    kernel: `(..., features)`; each unit's weights are all axes but the last.
    scale: `(features,)`, the gain `g`.
    epsilon: added to `|c|^2` under the square root.

  Returns:
    same shape as `kernel`; each unit sums to zero and has norm `|scale|`.
  """
  axes = tuple(range(kernel.ndim - 1))
  centered = kernel - jnp.mean(kernel, axis=axes, keepdims=True)
  inv_norm = lax.rsqrt(jnp.sum(centered**2, axis=axes, keepdims=True) + epsilon)
  return centered * inv_norm * scale


def _check_fan_in(layer: str, fan_in: int, detail: str) -> None:
  if fan_in < 2:
    raise ValueError(
        f'{layer} needs a fan-in of at least 2, got fan_in = {fan_in} ({detail}): a centered '
        'single weight is always zero.')


class CWNDense(nn.Module):
  """Dense layer with centered weight normalization.

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.baselines import CWNDense
    >>> params = CWNDense(4).init(jax.random.key(0), jnp.ones((1, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (4,), 'kernel': (3, 4), 'scale': (4,)}

  Attributes:
    features: number of output features.
    use_bias: whether to add a bias to the output.
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers.
    precision: numerical precision of the computation, see `jax.lax.Precision`.
    kernel_init: initializer of the unconstrained kernel `(fan_in, features)`.
    bias_init: initializer for the bias.
    scale_init: initializer of the gain `g` (ones: unit-norm units).
    epsilon: added to the squared norm before the square root.
  """

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: nn.initializers.Initializer = default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()
  scale_init: nn.initializers.Initializer = nn.initializers.ones_init()
  epsilon: float = 1e-12

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """`(..., fan_in) -> (..., features)`."""
    if self.features < 1:
      raise ValueError(f'CWNDense needs features >= 1, got features = {self.features}.')
    fan_in = jnp.shape(inputs)[-1]
    _check_fan_in('CWNDense', fan_in, f'input shape {jnp.shape(inputs)}')
    kernel = self.param('kernel', self.kernel_init, (fan_in, self.features), self.param_dtype)
    scale = self.param('scale', self.scale_init, (self.features,), self.param_dtype)
    bias = (
        self.param('bias', self.bias_init, (self.features,), self.param_dtype)
        if self.use_bias else None)
    kernel = centered_weight_norm(kernel, scale, self.epsilon)
    inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    y = lax.dot_general(
        inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class CWNConv(nn.Module):
  """Convolution with centered weight normalization (per output channel), `nn.Conv` semantics.

  Attributes:
    features: number of convolution filters.
    kernel_size: shape of the kernel; an int means a 1-D kernel.
    strides: an int or a sequence of `n` ints.
    padding: as `nn.Conv` ('SAME', 'VALID', 'CIRCULAR', 'REFLECT', 'CAUSAL', ints, pairs).
    input_dilation: an int or a sequence of `n` ints.
    kernel_dilation: an int or a sequence of `n` ints.
    feature_group_count: number of feature groups.
    use_bias: whether to add a bias to the output.
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype passed to parameter initializers.
    precision: numerical precision of the computation.
    kernel_init: initializer of the unconstrained kernel
      `(*kernel_size, in_features // feature_group_count, features)`.
    bias_init: initializer for the bias.
    scale_init: initializer of the gain `g`.
    epsilon: added to the squared norm before the square root.
  """

  features: int
  kernel_size: int | Sequence[int]
  strides: None | int | Sequence[int] = 1
  padding: nn.linear.PaddingLike = 'SAME'
  input_dilation: None | int | Sequence[int] = 1
  kernel_dilation: None | int | Sequence[int] = 1
  feature_group_count: int = 1
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: nn.initializers.Initializer = default_kernel_init
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()
  scale_init: nn.initializers.Initializer = nn.initializers.ones_init()
  epsilon: float = 1e-12

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Convolves `(*batch, *spatial, in_features)` into `(*batch, *spatial', features)`."""
    if self.features < 1:
      raise ValueError(f'CWNConv needs features >= 1, got features = {self.features}.')
    kernel_size = (
        (self.kernel_size,) if isinstance(self.kernel_size, int) else tuple(self.kernel_size))
    kernel_shape = conv.kernel_shape('CWNConv', kernel_size, jnp.shape(inputs), self.features,
                                     self.feature_group_count)
    _check_fan_in('CWNConv', math.prod(kernel_shape[:-1]), f'kernel shape {kernel_shape}')
    kernel = self.param('kernel', self.kernel_init, kernel_shape, self.param_dtype)
    scale = self.param('scale', self.scale_init, (self.features,), self.param_dtype)
    params = {'kernel': centered_weight_norm(kernel, scale, self.epsilon)}
    if self.use_bias:
      params['bias'] = self.param('bias', self.bias_init, (self.features,), self.param_dtype)
    return conv.apply(self, params, inputs)


class StandardizationLayer(nn.Module):
  """SL: `(a - mean) / sqrt(var + epsilon)` over the batch, no learned parameters.

  Put it after the activation (BN normalizes pre-activations, SL activations).
  Running statistics live in `batch_stats` (`mean`, `var` under `norm`), used
  when `use_running_average` is True, as in `nn.BatchNorm`.

  Attributes:
    use_running_average: use the running statistics instead of the batch's.
    axis: the feature axis.
    momentum: decay of the running averages.
    epsilon: added to the variance.
    dtype: the dtype of the result (default: infer from input).
    param_dtype: dtype of the running statistics.
    axis_name: axis name for cross-device statistics (as `nn.BatchNorm`).
  """

  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x: Array, use_running_average: bool | None = None) -> Array:
    """Standardizes `x` per feature; `use_running_average` overrides the field."""
    use_running_average = nn.merge_param(
        'use_running_average', self.use_running_average, use_running_average)
    return nn.BatchNorm(
        use_running_average=use_running_average, axis=self.axis, momentum=self.momentum,
        epsilon=self.epsilon, dtype=self.dtype, param_dtype=self.param_dtype,
        use_bias=False, use_scale=False, axis_name=self.axis_name, name='norm')(x)
