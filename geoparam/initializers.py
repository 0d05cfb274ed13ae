"""Initializers for reparameterized layers (Flax initializer signature).

A Flax initializer is `init(key, shape, dtype) -> array`.

GmP (paper 002, Sec. 4.3): the direction `u(theta)` is uniform on the sphere.
That is NOT `theta_i ~ U(0, pi)` (which, at fan-in 4608, leaves ~97% of the
coordinates of `u` below 1e-30); instead a Gaussian vector is drawn and its
angles taken (`hyperspherical.uniform_direction_angles`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from geoparam import checks
from geoparam import hyperspherical

__all__ = ['sphere_uniform', 'rademacher', 'glorot_norm']


def sphere_uniform():
  """Angles `theta` of shape `(fan_in - 1, features)` whose directions are uniform on S^{fan_in-1}.

  Each column is `from_cartesian(g)[0]` of a standard Gaussian `g` in R^fan_in
  (the Gaussian is rotation invariant, so its direction is uniform):
  `hyperspherical.uniform_direction_angles`; fan-in 1 gives no angles.
  """

  def init(key, shape, dtype=jnp.float32):
    if len(shape) != 2:
      raise ValueError(f'sphere_uniform expects shape (fan_in - 1, features), got {shape}.')
    if shape[0] < 1:  # fan-in 1
      return jnp.zeros(shape, dtype)
    return hyperspherical.uniform_direction_angles(key, shape, dtype)

  return init


def rademacher():
  """Random signs in {-1, +1} (the direction of a fan-in-1 GmP unit)."""

  def init(key, shape, dtype=jnp.float32):
    return jax.random.rademacher(key, shape, dtype)

  return init


def glorot_norm(fan_in: int, fan_out: int):
  """Norm of a Glorot-uniform weight vector per unit, shape `(features,)`.

  The paper's reference code draws a Glorot-uniform kernel and uses each
  column's norm as the initial GmP scale `r`; this reproduces that draw.
  """
  checks.count('fan_in', fan_in, 1, 'glorot_norm')
  checks.count('fan_out', fan_out, 1, 'glorot_norm')
  limit = math.sqrt(6.0 / (fan_in + fan_out))

  def init(key, shape, dtype=jnp.float32):
    w = jax.random.uniform(key, (fan_in,) + tuple(shape), dtype, -limit, limit)
    return jnp.linalg.norm(w, axis=0)

  return init
