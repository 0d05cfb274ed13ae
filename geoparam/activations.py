"""PReLU (paper 001): `f(y) = max(0, y) + a * min(0, y)` with a learned slope `a`.

Channel-wise: one slope per feature (last axis); channel-shared: one scalar
slope for the layer. Slopes start at 0.25 and should not be weight-decayed
(paper 001: decay pushes `a` towards 0, i.e. towards ReLU); see
`geoparam.masks.decay_mask`.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ['prelu', 'PReLU']


def prelu(x: jax.Array, negative_slope: jax.Array) -> jax.Array:
  """`x` where `x > 0`, else `negative_slope * x`.

  Args:
    x: pre-activations, shape `(..., C)`.
    negative_slope: shape `()` or `(C,)` (broadcast over the last axis).

  Returns:
    same shape as `x`. At `x = 0` the derivative is `negative_slope` w.r.t. `x`
    and 0 w.r.t. the slope (the "otherwise" branch of paper 001).
  """
  return jnp.where(x > 0, x, negative_slope * x)


class PReLU(nn.Module):
  """Parametric ReLU with a learned negative slope (parameter `negative_slope`).

  Example usage::

    >>> import jax, jax.numpy as jnp
    >>> from geoparam.activations import PReLU
    >>> params = PReLU().init(jax.random.key(0), jnp.ones((2, 3)))['params']
    >>> jax.tree.map(jnp.shape, params)
    {'negative_slope': (3,)}

  Attributes:
    channel_shared: one scalar slope for all channels (True) or one slope per
      feature along the last axis (False, the default).
    negative_slope_init: initial slope, a finite float (paper 001: 0.25).
    dtype: the dtype of the computation (default: infer from input and params).
    param_dtype: the dtype of the slope parameter.
  """

  channel_shared: bool = False
  negative_slope_init: float = 0.25
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    """Applies PReLU elementwise; `inputs` has shape `(..., C)`."""
    if not math.isfinite(self.negative_slope_init):
      raise ValueError(
          f'PReLU needs a finite negative_slope_init, got {self.negative_slope_init}.')
    if self.channel_shared:
      shape = ()
    else:
      if jnp.ndim(inputs) < 1:
        raise ValueError(
            'PReLU with channel_shared=False needs inputs with a channel (last) axis, '
            f'got shape {jnp.shape(inputs)}.')
      shape = (jnp.shape(inputs)[-1],)
    slope = self.param(
        'negative_slope', nn.initializers.constant(self.negative_slope_init), shape,
        self.param_dtype)
    inputs, slope = nn.dtypes.promote_dtype(inputs, slope, dtype=self.dtype)
    return prelu(inputs, slope)
