"""Hyperspherical coordinates of paper 002 (eq. 10): the theta -> u(theta) map.

All functions act on ONE neuron (a single direction); layers vmap them over
neurons. They are pure, jit/vmap/grad friendly and keep the input dtype.

Conventions (n = fan-in, theta has n - 1 angles)::

  u_1 = cos(t_1)
  u_k = sin(t_1) ... sin(t_{k-1}) cos(t_k)      1 < k < n
  u_n = sin(t_1) ... sin(t_{n-1})

Canonical ranges returned by `from_cartesian`: t_1 .. t_{n-2} in [0, pi] and
t_{n-1} in [0, 2 pi). `to_cartesian` accepts ANY real theta (training leaves
the canonical ranges) and always returns a unit vector.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
  'to_cartesian',
  'from_cartesian',
  'metric_diag',
  'angle_between',
]


def to_cartesian(theta: jax.Array) -> jax.Array:
  """Unit vector u(theta) of eq. (10).

  Args:
    theta: angles, shape `(n - 1,)`, any real values, n >= 1.

  Returns:
    `u`, shape `(n,)`, same dtype, `|u| = 1`. For `n = 1` (empty theta) this is
    `[1.]`; layers with fan-in 1 carry the sign separately.

  No division and no logarithm is used, so values and gradients stay finite at
  the poles (`sin(theta_k) = 0`).
  """
  theta = jnp.asarray(theta)
  if theta.ndim != 1:
    raise ValueError(
        f'to_cartesian expects theta of shape (n - 1,), got shape {theta.shape}; '
        'vmap it over neurons for a batch.')
  if not jnp.issubdtype(theta.dtype, jnp.floating):
    theta = theta.astype(jnp.result_type(float))
  sin_prefix = jnp.cumprod(jnp.sin(theta))  # prod_{j <= k} sin(t_j), (n-1,)
  one = jnp.ones((1,), theta.dtype)
  exclusive = jnp.concatenate([one, sin_prefix])  # prod_{j < k} sin(t_j), (n,)
  cos_padded = jnp.concatenate([jnp.cos(theta), one])  # (n,)
  return exclusive * cos_padded


def from_cartesian(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inverse of `to_cartesian`: `w = radius * to_cartesian(theta)`.

  Args:
    w: nonzero vector, shape `(n,)`, n >= 2. Negative coordinates (the last one
      included) are kept: the last angle covers the full circle [0, 2 pi).

  Returns:
    `(theta, radius)`: theta shape `(n - 1,)` in the canonical ranges
    (`[0, pi]` for all but the last, `[0, 2 pi)` for the last), radius a scalar
    `|w|`; both of `w`'s dtype. A zero `w` gives `theta = 0` and `radius = 0`.

  Angles are computed as `atan2(|w_{k+1:}|, w_k)` from tail norms, which are
  formed after scaling by `max |w|`: no tiny products, so a uniformly drawn
  direction at fan-in 4608 keeps full float32 precision.
  """
  w = jnp.asarray(w)
  if w.ndim != 1 or w.shape[0] < 2:
    raise ValueError(
        f'from_cartesian expects w of shape (n,) with n >= 2, got shape {w.shape}; '
        'a fan-in-1 direction is a sign, not an angle.')
  if not jnp.issubdtype(w.dtype, jnp.floating):
    w = w.astype(jnp.result_type(float))
  peak = jnp.max(jnp.abs(w))
  safe_peak = jnp.where(peak > 0, peak, jnp.ones_like(peak))
  x = w / safe_peak
  # tail[k] = |x_{k:}|, computed as a reversed cumulative sum of squares.
  tail = jnp.sqrt(jnp.cumsum((x * x)[::-1])[::-1])
  first = jnp.arctan2(tail[1:-1], x[:-2])  # t_1 .. t_{n-2}, in [0, pi]
  last = jnp.arctan2(x[-1], x[-2])  # t_{n-1}, in (-pi, pi]
  last = jnp.where(last < 0, last + 2 * jnp.pi, last)
  theta = jnp.concatenate([first, last[None]])
  radius = tail[0] * safe_peak
  return theta, radius


def metric_diag(theta: jax.Array) -> jax.Array:
  """Diagonal of the metric tensor M of the hyperspherical chart (Theorem 3).

  `M = diag(1, m_22, ..., m_{n-1,n-1})` with `m_ii = prod_{j < i} sin^2(theta_j)`,
  the pullback of the Euclidean metric (eq. 13, 18, 21). Note: eq. (19)-(20) of
  the paper print a SUM of sin^2 where the derivation (and eq. 13/21) gives the
  PRODUCT; the product is what the pullback yields and what is returned here.

  Args:
    theta: shape `(n - 1,)`.

  Returns:
    shape `(n - 1,)`, same dtype, values in [0, 1].
  """
  theta = jnp.asarray(theta)
  if theta.ndim != 1:
    raise ValueError(f'metric_diag expects theta of shape (n - 1,), got shape {theta.shape}.')
  sin2 = jnp.sin(theta) ** 2
  return jnp.concatenate([jnp.ones((1,), sin2.dtype), jnp.cumprod(sin2)[:-1]])[: theta.shape[0]]


def angle_between(u: jax.Array, v: jax.Array) -> jax.Array:
  """Angle in radians, in [0, pi], between two nonzero vectors of shape `(n,)`.

  Uses `atan2(|u x v|, u . v)` in its n-dimensional form
  `atan2(| |v| u - |u| v |, | |v| u + |u| v |) * 2`, which is accurate for tiny
  and for nearly opposite angles (arccos of the cosine is not).
  """
  u = jnp.asarray(u)
  v = jnp.asarray(v)
  if u.shape != v.shape or u.ndim != 1:
    raise ValueError(
        f'angle_between expects two vectors of the same shape (n,), got {u.shape} and {v.shape}.')
  nu = jnp.linalg.norm(u)
  nv = jnp.linalg.norm(v)
  a = u * nv
  b = v * nu
  return 2 * jnp.arctan2(jnp.linalg.norm(a - b), jnp.linalg.norm(a + b))
