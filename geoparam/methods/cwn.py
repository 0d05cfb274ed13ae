"""CWN, centred weight normalization (Huang et al. 2017): `kernel = scale * c / |c|`, `c = k - mean(k)`.

Stored: `kernel`, `scale (F,)`, `bias`, as WN; each unit has zero mean and
norm `|scale|`. A kernel whose units do not sum to zero has no CWN form.

    >>> import numpy as np
    >>> from geoparam import methods
    >>> cwn = methods.get('cwn', epsilon=0.0)
    >>> w = cwn.apply({'kernel': np.array([[1.0], [3.0]]), 'scale': np.array([2.0])}, (2, 1))[0]
    >>> [round(float(a), 4) for a in w.ravel()]
    [-1.4142, 1.4142]
"""

from __future__ import annotations

from jax.nn import initializers as jinit
import jax
import jax.numpy as jnp

from geoparam.methods import base
from geoparam.methods.wn import normed
from geoparam.methods.wn import weight_norm

__all__ = ['cwn', 'centered_weight_norm']


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


def cwn(scale_init=jinit.ones, epsilon: float = 1e-12) -> base.Method:
  """Centred weight normalization as a `Method`."""
  return normed('cwn', centered_weight_norm, scale_init, epsilon, min_fan_in=2,
                fan_in_reason='a centred single weight is always zero', zero_sum=True)
