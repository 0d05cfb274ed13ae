"""PReLU (paper 001): `f(y) = max(0, y) + a * min(0, y)` with a learned slope `a`.

Channel-wise: one slope per feature (last axis); channel-shared: one scalar
slope for the layer. Slopes start at 0.25 and should not be weight-decayed
(paper 001: decay pushes `a` towards 0, i.e. towards ReLU); see
`geoparam.masks.decay_mask`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ['prelu']


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
