"""Hyperspherical coordinates of paper 002 (eq. 10): the theta -> u(theta) map.

`to_cartesian` and the other chart functions act on ONE neuron (a single
direction); `to_cartesian_batched` maps a whole `(n - 1, features)` block at
once (what the layers use). All are pure, jit/vmap/grad friendly and keep the
input dtype.

Conventions (n = fan-in, theta has n - 1 angles)::

  u_1 = cos(t_1)
  u_k = sin(t_1) ... sin(t_{k-1}) cos(t_k)      1 < k < n
  u_n = sin(t_1) ... sin(t_{n-1})

Canonical ranges returned by `from_cartesian`: t_1 .. t_{n-2} in [0, pi] and
t_{n-1} in [0, 2 pi). `to_cartesian` accepts ANY real theta (training leaves
the canonical ranges) and always returns a unit vector.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = [
  'to_cartesian',
  'to_cartesian_batched',
  'to_cartesian_reference',
  'prefix_product',
  'suffix_affine',
  'SCHEMES',
  'sincos',
  'from_cartesian',
  'metric_diag',
  'angle_between',
]


SCHEMES = ('sequential', 'associative')


def _scheme(scheme: str | None) -> str:
  """The scan schedule: `sequential` on CPU, `associative` (log-depth) on GPU/TPU."""
  if scheme is None:
    return 'sequential' if jax.default_backend() == 'cpu' else 'associative'
  if scheme not in SCHEMES:
    raise ValueError(f'scheme must be one of {SCHEMES} or None, got {scheme!r}.')
  return scheme


def prefix_product(x: jax.Array, scheme: str | None = None) -> jax.Array:
  """Inclusive cumulative product along axis 0, `y_j = x_0 ... x_j`; shape of `x`.

  Equal to `jnp.cumprod(x, axis=0)`, scheduled for speed. `scheme='sequential'`
  (default on CPU): a `lax.scan` over axis 0 carrying one row, O(L) work and
  no extra memory; ~50x faster than `jnp.cumprod` on CPU for a (1023, 1024)
  array. `scheme='associative'` (default on GPU/TPU): `lax.associative_scan`,
  log depth (a long sequential loop starves an accelerator).
  """
  if x.shape[0] == 0:
    return x
  if _scheme(scheme) == 'associative':
    return jax.lax.associative_scan(jnp.multiply, x, axis=0)

  def step(carry, row):
    carry = carry * row
    return carry, carry

  return jax.lax.scan(step, jnp.ones_like(x[0]), x)[1]


def _affine_combine(first, second):
  """Composes y -> a1 + b1 y then y -> a2 + b2 y (associative)."""
  a1, b1 = first
  a2, b2 = second
  return a2 + b2 * a1, b2 * b1


def suffix_affine(a: jax.Array, b: jax.Array, scheme: str | None = None) -> jax.Array:
  """Reverse linear recurrence along axis 0: `y_j = a_j + b_j * y_{j+1}`, `y_L = 0`.

  O(L) work, no division; scheduled like `prefix_product`. Shapes of `a`.
  """
  if a.shape[0] == 0:
    return a
  if _scheme(scheme) == 'associative':
    y, _ = jax.lax.associative_scan(_affine_combine, (a, b), reverse=True, axis=0)
    return y

  def step(carry, ab):
    carry = ab[0] + ab[1] * carry
    return carry, carry

  return jax.lax.scan(step, jnp.zeros_like(a[0]), (a, b), reverse=True)[1]


# Cody-Waite split of pi/2 (SLEEF's float32 pi split, halved). The first three parts have 8-9
# significant bits, so k * part is exact for every k = round(x 2/pi) with |x| <= _SINCOS_BOUND;
# the last part's rounding is far below float32 resolution of the reduced angle.
_PIO2_PARTS = (1.5703125, 4.8351287841796875e-4, 3.13855707645416259765625e-7,
               6.077100628276710381e-11)
_SIN_COEFFS = (-1.6666654611e-1, 8.3321608736e-3, -1.9515295891e-4)  # Cephes sinf, |r| <= pi/4
_COS_COEFFS = (4.166664568298827e-2, -1.388731625493765e-3, 2.443315711809948e-5)  # Cephes cosf
_SINCOS_BOUND = 8192.0


def _sincos_poly(x):
  """float32 `(sin x, cos x)` from ONE range reduction and two short polynomials (|x| <= 8192)."""
  f = lambda v: jnp.asarray(v, x.dtype)
  k = jnp.round(x * f(2 / jnp.pi))
  r = x
  for part in _PIO2_PARTS:
    r = r - k * f(part)
  z = r * r
  s1, s2, s3 = map(f, _SIN_COEFFS)
  c1, c2, c3 = map(f, _COS_COEFFS)
  sin_r = r + r * z * (s1 + z * (s2 + z * s3))
  cos_r = 1 - f(0.5) * z + z * z * (c1 + z * (c2 + z * c3))
  q = k.astype(jnp.int32)  # quadrant: x = k pi/2 + r
  odd = (q & 1) == 1
  sin_x = jnp.where(odd, cos_r, sin_r)
  cos_x = jnp.where(odd, sin_r, cos_r)
  sin_x = jnp.where((q & 2) == 2, -sin_x, sin_x)
  sin_x = jnp.where(x == 0, x, sin_x)  # sin(-0.0) = -0.0, as jnp.sin
  return sin_x, jnp.where(((q + 1) & 2) == 2, -cos_x, cos_x)


def _jnp_sincos(x):
  return jnp.sin(x), jnp.cos(x)


@jax.custom_batching.custom_vmap
def _poly_applies(x):
  """Whether the polynomial covers all of `x` (every `|x| <= 8192`; False with NaN)."""
  return jnp.max(jnp.abs(x)) <= _SINCOS_BOUND


@_poly_applies.def_vmap
def _poly_applies_vmap(axis_size, in_batched, x):
  # One decision for the whole batch: a batched predicate would turn the `lax.cond` below
  # into a select that runs both branches (measured 10x slower under vmap).
  del axis_size, in_batched
  return _poly_applies(x), False


def _with_sincos(x, fn):
  """`fn(sincos_fn)` with the polynomial sincos when it applies to ALL of `x`, else jnp's.

  The range test runs once on the whole array (also under vmap), so code that
  evaluates sin/cos piecewise, e.g. row by row inside a scan, picks one branch.
  """
  if x.dtype != jnp.float32 or jax.default_backend() != 'cpu' or x.size == 0:
    return fn(_jnp_sincos)
  applies = _poly_applies(jax.lax.stop_gradient(x))
  return jax.lax.cond(applies, lambda: fn(_sincos_poly), lambda: fn(_jnp_sincos))


@jax.custom_jvp
def _sincos(x):
  return _with_sincos(x, lambda sincos_fn: sincos_fn(x))


@_sincos.defjvp
def _sincos_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  s, c = _sincos(x)
  return (s, c), (c * dx, -s * dx)


def sincos(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(sin x, cos x)`, elementwise, same shape and dtype as `x`.

  On CPU in float32 both come from one shared range reduction and two short
  polynomials (within 2.5 ulp of the exact value, measured; NaN/inf -> NaN):
  XLA's CPU `sin`/`cos` cost ~15x more and are evaluated in separate passes.
  Arrays with some `|x| > 8192` (or NaN), other dtypes and other backends use
  `jnp.sin`/`jnp.cos`. Differentiable (`d sin = cos dx`, `d cos = -sin dx`).
  """
  return _sincos(jnp.asarray(x))


def _sequential_fwd(theta):
  """u(theta) by one scan over the n - 1 angles (rows), sin/cos computed row by row."""

  def run(sincos_fn):
    def step(p, t):
      s, c = sincos_fn(t)
      return p * s, p * c

    p_last, head = jax.lax.scan(step, jnp.ones_like(theta[0]), theta)
    return jnp.concatenate([head, p_last[None]])

  return _with_sincos(theta, run)


def _sequential_bwd(theta, g):
  """dL/dtheta from two scans; no (n, ...) array besides the prefix products is kept."""

  def run(sincos_fn):
    def prefix_step(p, t):  # emits P_excl_k = prod_{j<k} s_j
      return p * sincos_fn(t)[0], p

    _, p_excl = jax.lax.scan(prefix_step, jnp.ones_like(theta[0]), theta)

    def grad_step(r, x):  # carry R_k (see _unit_vector_bwd); emits dL/dtheta_k, passes R_{k-1}
      t, g_k, p = x
      s, c = sincos_fn(t)
      return g_k * c + s * r, p * (c * r - s * g_k)

    _, d_theta = jax.lax.scan(grad_step, g[-1], (theta, g[:-1], p_excl), reverse=True)
    return d_theta

  return _with_sincos(theta, run)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unit_vector(theta, scheme):
  return _unit_vector_fwd(theta, scheme)[0]


def _exclusive_sin_products(s, scheme):
  """`(P_excl, P_last)`: `P_excl_k = prod_{j<k} s_j` (n-1, ...), `P_last = prod_j s_j` (1, ...)."""
  p = prefix_product(s, scheme)
  return jnp.concatenate([jnp.ones_like(s[:1]), p[:-1]]), p[-1:]


def _unit_vector_fwd(theta, scheme):
  if scheme == 'sequential':
    # The only residual is theta itself (a parameter, alive anyway): the backward
    # recomputes sin/cos row by row, so a step holds no extra (n, ...) arrays for it.
    return _sequential_fwd(theta), theta
  s, c = sincos(theta)
  p_excl, p_last = _exclusive_sin_products(s, scheme)
  u = jnp.concatenate([p_excl * c, p_last])  # (n, ...)
  # Residuals are sin and cos only; the backward recomputes the (cheap) prefix product.
  return u, (s, c)


def _unit_vector_bwd(scheme, res, g):
  # u_k = P_{k-1} c_k (k < n), u_n = P_{n-1}, P_k = prod_{j<=k} s_j. Division-free:
  # dL/dtheta_k = P_{k-1} (c_k R_k - s_k g_k), R_k = sum_{i>k} g_i c_i prod_{k<j<i} s_j
  # (c_n := 1), i.e. R_k = g_{k+1} c_{k+1} + s_{k+1} R_{k+1}, R_{n-1} = g_n.
  if scheme == 'sequential':
    return (_sequential_bwd(res, g),)
  s, c = res
  p_excl, _ = _exclusive_sin_products(s, scheme)
  gc = jnp.concatenate([g[1:-1] * c[1:], g[-1:]])  # a_k = g_{k+1} c_{k+1}, last: g_n
  shifted_s = jnp.concatenate([s[1:], jnp.zeros_like(s[:1])])  # b_k = s_{k+1}
  r = suffix_affine(gc, shifted_s, scheme)
  return (p_excl * (c * r - s * g[:-1]),)


_unit_vector.defvjp(_unit_vector_fwd, _unit_vector_bwd)


def _as_float(x):
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    x = x.astype(jnp.result_type(float))
  return x


def to_cartesian(theta: jax.Array) -> jax.Array:
  """Unit vector u(theta) of eq. (10).

  Args:
    theta: angles, shape `(n - 1,)`, any real values, n >= 1.

  Returns:
    `u`, shape `(n,)`, same dtype, `|u| = 1`. For `n = 1` (empty theta) this is
    `[1.]`; layers with fan-in 1 carry the sign separately.

  No division and no logarithm is used, so values and gradients stay finite at
  the poles (`sin(theta_k) = 0`). Reverse-mode derivatives use a hand-written
  O(n) VJP (a reverse linear recurrence); forward-mode (`jax.jvp`) is not
  available through it.
  """
  theta = _as_float(theta)
  if theta.ndim != 1:
    raise ValueError(
        f'to_cartesian expects theta of shape (n - 1,), got shape {theta.shape}; '
        'use to_cartesian_batched (or vmap) for several neurons.')
  return to_cartesian_batched(theta)


def to_cartesian_batched(theta: jax.Array, scheme: str | None = None) -> jax.Array:
  """`to_cartesian` of every column: theta `(n - 1, *batch)` -> u `(n, *batch)`.

  Equal to `to_cartesian` vmapped over the trailing axes (what the layers use,
  with `batch = (features,)`), but without moving the neuron axis. `scheme`
  picks the scan schedule (`SCHEMES`; None: by backend, see `prefix_product`).
  """
  theta = _as_float(theta)
  if theta.ndim < 1:
    raise ValueError(f'theta must have shape (n - 1, ...), got a scalar.')
  if theta.shape[0] == 0:
    return jnp.ones((1,) + theta.shape[1:], theta.dtype)
  return _unit_vector(theta, _scheme(scheme))


def to_cartesian_reference(theta: jax.Array) -> jax.Array:
  """Plain `jnp.cumprod` form of eq. (10), shape `(n - 1,) -> (n,)`; autodiff through it.

  Kept as the reference the fast `to_cartesian` is tested (and benchmarked) against.
  """
  theta = _as_float(theta)
  one = jnp.ones((1,) + theta.shape[1:], theta.dtype)
  sin_prefix = jnp.cumprod(jnp.sin(theta), axis=0)
  return jnp.concatenate([one, sin_prefix]) * jnp.concatenate([jnp.cos(theta), one])


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
  two_pi = jnp.asarray(2 * jnp.pi, last.dtype)
  # A tiny negative angle plus 2 pi rounds up to 2 pi; clamp to the largest value below it.
  last = jnp.where(last < 0, jnp.minimum(last + two_pi, jnp.nextafter(two_pi, 0)), last)
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
