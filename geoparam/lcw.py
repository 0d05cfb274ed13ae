"""Linearly constrained weights (LCW, paper 003 Sec. 3): the map v -> w = B_m v.

`B_m` is an orthonormal basis, written as an `(m, m - 1)` matrix of columns, of
the zero-sum subspace `W_LC = {w in R^m : sum(w) = 0}`. We take the last
`m - 1` columns of the Householder reflection `H = I - 2 u u^T / (u^T u)` with
`u = e_1 + 1_m / sqrt(m)`, which maps `e_1` to `-1_m / sqrt(m)`: its other
columns are orthonormal and orthogonal to `1_m`. With `S = sum(v)`, applying it
to `(0, v)` gives, in O(m) and without forming `B_m`::

  w_1 = -S / sqrt(m)
  w_k = v_{k-1} - S / (m + sqrt(m))          k = 2 .. m

`H` is symmetric, so the transpose is as cheap: `coordinates(w) = B_m^T w`.

`project`, `coordinates` act on ONE unit (one weight vector); `project_batched`
maps a whole `(m - 1, features)` block (what the layers use). All are pure,
linear, jit/vmap/grad friendly and keep the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import checks

__all__ = ['project', 'project_batched', 'coordinates', 'basis']


def project(v: jax.Array) -> jax.Array:
  """Zero-sum weight vector `w = B_m v`.

  Args:
    v: coordinates, shape `(m - 1,)` with `m >= 2`.

  Returns:
    `w`, shape `(m,)`, same dtype as `v` (integers become the default float),
    with `sum(w) = 0` and `|w| = |v|`.

  Example usage::

    >>> import jax.numpy as jnp
    >>> from geoparam import lcw
    >>> w = lcw.project(jnp.asarray([1.0, 2.0, 3.0]))
    >>> w.shape, abs(float(w.sum())) < 1e-6, round(float(w @ w), 4)  # |w|^2 = |v|^2 = 14
    ((4,), True, 14.0)
  """
  v = checks.floating(v, 'v', 'project', complex_ok=True)
  if v.ndim != 1 or v.shape[0] < 1:
    raise ValueError(
        f'project expects v of shape (m - 1,) with m >= 2, got shape {v.shape}; '
        'a size-0 v (m = 1) has no nonzero zero-sum vector; use project_batched '
        '(or vmap) for several units.')
  return _project_batched_jit(v)


def project_batched(v: jax.Array) -> jax.Array:
  """`project` of every column: v `(m - 1, *batch)` -> w `(m, *batch)`.

  Equal to `project` vmapped over the trailing axes (what the LCW layers use,
  with `batch = (features,)`), but without moving the unit axis: a vmap with
  `in_axes=1` makes XLA build the kernel transposed and copy it (measured ~15%
  of a Dense 1024 step on CPU).
  """
  v = checks.floating(v, 'v', 'project_batched', complex_ok=True)
  if v.ndim < 1 or v.shape[0] < 1:
    raise ValueError(f'project_batched expects v of shape (m - 1, ...) with m >= 2, '
                     f'got shape {v.shape}.')
  return _project_batched_jit(v)


def _project_batched(v):
  # float16/bfloat16 are computed in float32 (one rounding per entry), then cast back.
  work = jnp.promote_types(v.dtype, jnp.float32)
  m = v.shape[0] + 1
  sqrt_m = math.sqrt(m)
  total = jnp.sum(v.astype(work), axis=0, keepdims=True)
  first = -total / sqrt_m
  rest = v.astype(work) - total / (m + sqrt_m)
  return jnp.concatenate([first, rest]).astype(v.dtype)


# Compiled once per shape and dtype: eager calls (and eager layers) dispatch one computation.
_project_batched_jit = jax.jit(_project_batched)


def coordinates(w: jax.Array) -> jax.Array:
  """Coordinates `v = B_m^T w` of (the zero-sum part of) `w`.

  `project(coordinates(w)) = w - mean(w)`, the orthogonal projection onto the
  zero-sum subspace; `coordinates(project(v)) = v`.

  Args:
    w: weight vector, shape `(m,)` with `m >= 2`.

  Returns:
    `v`, shape `(m - 1,)`, same dtype as `w`.
  """
  w = checks.floating(w, 'w', 'coordinates', complex_ok=True)
  if w.ndim != 1 or w.shape[0] < 2:
    raise ValueError(
        f'coordinates expects w of shape (m,) with m >= 2, got shape {w.shape}; '
        'vmap over units for a batch.')
  return _coordinates_jit(w)


def _coordinates(w):
  work = jnp.promote_types(w.dtype, jnp.float32)
  m = w.shape[0]
  sqrt_m = math.sqrt(m)
  # (H w)[1:] = w[1:] - (u.w / (1 + 1/sqrt(m))) / sqrt(m), u.w = w_1 + sum(w) / sqrt(m).
  x = w.astype(work)
  coef = (x[0] + jnp.sum(x) / sqrt_m) / (sqrt_m + 1.0)
  return (x[1:] - coef).astype(w.dtype)


_coordinates_jit = jax.jit(_coordinates)


def basis(m: int, dtype=jnp.float32) -> jax.Array:
  """The explicit orthonormal basis `B_m`, shape `(m, m - 1)`.

  `basis(m) @ v == project(v)`; `B_m^T B_m = I`, `B_m^T 1_m = 0`. Formed in
  float64 numpy from the Householder matrix, then cast. O(m^2) memory: for
  tests and analysis, never used by the layers.

  Args:
    m: the fan-in, `m >= 2`.
    dtype: dtype of the result, floating or complex (an integer dtype would
      truncate the entries: a TypeError).
  """
  m = checks.count('m', m, 2, 'basis')
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise TypeError(f'basis needs a floating (or complex) dtype, got dtype {jnp.dtype(dtype)}: '
                    'its entries are irrational.')
  u = np.full((m,), 1.0 / math.sqrt(m))
  u[0] += 1.0
  h = np.eye(m) - 2.0 * np.outer(u, u) / np.dot(u, u)
  return jnp.asarray(h[:, 1:], dtype=dtype)
