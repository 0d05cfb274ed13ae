"""He initialization for ReLU/PReLU networks (paper 001), as Flax initializers.

Weights are zero-mean with `Var(w) = 2 / ((1 + a^2) * fan)`, `a` the negative
slope of the (P)ReLU that follows the layer (0 for ReLU), so that
`1/2 (1 + a^2) fan Var(w) = 1`:

* `mode='fan_in'` (forward): `fan = k_1 ... k_d * C_in` keeps the variance of
  the responses constant through the layers;
* `mode='fan_out'` (backward): `fan = k_1 ... k_d * C_out` keeps the variance
  of the gradients constant.

Kernels are Flax-shaped: dense `(in, out)`, conv `(*kernel_size, in, out)`
(for grouped convs `in` is the per-group input size, which is the fan-in).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from geoparam import checks

__all__ = ['he_std', 'he_normal', 'he_uniform']

_MODES = ('fan_in', 'fan_out')


def _check(negative_slope: float, mode: str) -> None:
  checks.one_of('mode', mode, _MODES)
  checks.real('negative_slope', negative_slope)


def he_std(shape: Sequence[int], negative_slope: float = 0.0, mode: str = 'fan_in') -> float:
  """`sqrt(2 / ((1 + a^2) fan))` for a dense `(in, out)` or conv `(*k, in, out)` kernel."""
  _check(negative_slope, mode)
  shape = tuple(shape)
  if len(shape) < 2:
    raise ValueError(
        f'He init needs a kernel shape (in, out) or (*kernel_size, in, out), got shape {shape}.')
  receptive = math.prod(shape[:-2])
  fan = receptive * (shape[-2] if mode == 'fan_in' else shape[-1])
  if fan < 1:
    raise ValueError(f'He init needs a positive {mode}, got {fan} for shape {shape}.')
  return math.sqrt(2.0 / ((1.0 + negative_slope**2) * fan))


def _initializer(negative_slope: float, mode: str, draw):
  """`init(key, shape, dtype)`: `draw(key, shape, dtype, std)` at the He std of `shape`; the
  arguments are checked now, not at the first draw."""
  _check(negative_slope, mode)
  return lambda key, shape, dtype=jnp.float32: draw(key, shape, dtype,
                                                    he_std(shape, negative_slope, mode))


def he_normal(negative_slope: float = 0.0, mode: str = 'fan_in'):
  """Gaussian He initializer `init(key, shape, dtype)`: `N(0, 2 / ((1 + a^2) fan))`.

  Args:
    negative_slope: slope `a` of the following (P)ReLU; 0 for ReLU.
    mode: 'fan_in' (forward, default) or 'fan_out' (backward).
  """
  return _initializer(negative_slope, mode, lambda key, shape, dtype, std: (
      std * jax.random.normal(key, shape, dtype)).astype(dtype))


def he_uniform(negative_slope: float = 0.0, mode: str = 'fan_in'):
  """Uniform He initializer: `U(-b, b)`, `b = sqrt(3) * he_std`, same variance as `he_normal`.

  Args:
    negative_slope: slope `a` of the following (P)ReLU; 0 for ReLU.
    mode: 'fan_in' (forward, default) or 'fan_out' (backward).
  """
  return _initializer(negative_slope, mode, lambda key, shape, dtype, std: jax.random.uniform(
      key, shape, dtype, -math.sqrt(3.0) * std, math.sqrt(3.0) * std))
