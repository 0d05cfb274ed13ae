"""Variance analysis (paper 003 Sec. 4), the framework-neutral part.

* `activation_variance_factors` gives `phi_fw = V(f(z)) / V(z)` and
  `phi_bw = V(f'(z) g) / V(g)` for `z ~ N(0, sigma^2)` (003 Prop. 6).
* `activation_shift` measures the activation shift of 003 Fig. 1 in a layer's
  pre-activations, and `LayerStats` holds one layer's statistics.

The minibatch-based initialization (003 Sec. 4.3) and the per-layer variance
analysis of a linen model (`data_dependent_init`, and `variance_analysis`, one
`LayerStats` per layer) are `geoparam.linen.variance`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import checks

__all__ = [
    'LayerStats',
    'activation_variance_factors',
    'activation_shift',
]


class LayerStats(NamedTuple):
  """Statistics of one layer's pre-activation `z` and of `dL/dz` on a batch.

  Attributes:
    name: the layer's path, e.g. `'Dense_3'`.
    mean: the pooled mean of `z`.
    var: the pooled variance of `z`.
    grad_mean: the pooled mean of `dL/dz`.
    grad_var: the pooled variance of `dL/dz`.
    shift: the activation shift, `activation_shift(z)`.
    unit_means: `(units,)`, the mean of `z` per unit (last axis).
  """
  name: str
  mean: float
  var: float
  grad_mean: float
  grad_var: float
  shift: float
  unit_means: np.ndarray


def activation_shift(z: Any) -> float:
  """Strength of the stripes of 003 Fig. 1 in pre-activations `z` of shape `(..., units)`.

  The spread (std) over units of the per-unit means, divided by the average
  per-unit std: ~0 without activation shift, O(1) or more with it.
  """
  z = np.asarray(z, np.float64).reshape(-1, np.shape(z)[-1])
  return float(np.std(z.mean(axis=0)) / np.mean(z.std(axis=0)))


def activation_variance_factors(
    f: Callable[[jax.Array], jax.Array], sigma: float = 1.0, num_points: int = 200_001,
) -> tuple[float, float]:
  """`(phi_fw, phi_bw)` of an elementwise activation (003 Sec. 4.2).

  `phi_fw = V(f(z)) / sigma^2` and `phi_bw = V(f'(z) g) / V(g) = E[f'(z)^2]`
  for `z ~ N(0, sigma^2)` and an independent zero-mean gradient `g`. Computed
  by trapezoid quadrature on `[-12 sigma, 12 sigma]` (0 is a grid point, so
  kinks such as ReLU's are integrated accurately); deterministic.

  Paper 003 quotes ReLU factors as variance ratios (0.34, 0.5) but its sigmoid
  factors (0.236, 0.237), (0.208, 0.211), (0.157, 0.170) at sigma = 0.5, 1, 2
  are the square roots of these (ratios of standard deviations); the variance
  ratios at sigma = 1 are (0.0434, 0.0448). Either way `phi_fw ~ phi_bw`.

  Args:
    f: scalar activation (jax-differentiable), applied elementwise.
    sigma: standard deviation of the pre-activation, > 0.
    num_points: odd number of grid points.
  """
  checks.real('sigma', sigma, '> 0', lambda x: x > 0)
  if checks.count('num_points', num_points, 3) % 2 == 0:
    raise ValueError(f'num_points must be an odd integer >= 3, got num_points = {num_points}.')
  z = np.linspace(-12.0 * sigma, 12.0 * sigma, num_points)
  w = np.exp(-0.5 * (z / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
  w = w * (z[1] - z[0])
  w[0] *= 0.5
  w[-1] *= 0.5
  zj = jnp.asarray(z, jnp.float32)
  fz = np.asarray(jax.vmap(f)(zj), np.float64)
  dfz = np.asarray(jax.vmap(jax.grad(f))(zj), np.float64)
  mean = np.sum(w * fz)
  phi_fw = (np.sum(w * fz**2) - mean**2) / sigma**2
  phi_bw = np.sum(w * dfz**2)
  return float(phi_fw), float(phi_bw)
