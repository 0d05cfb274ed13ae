"""Tests for geoparam.hyperspherical: the map u(theta) of eq. (10), its inverse and metric."""

import jax
import jax.numpy as jnp
from jax.test_util import check_grads
import numpy as np
import pytest

from geoparam import hyperspherical as hs
from tests.conftest import ref_to_cartesian

SIZES = [1, 3, 17, 1000, 5000]  # lengths of theta (n - 1)
KINDS = ['wide', 'half_pi', 'sphere']

# Jitted once per module: the map is compiled per shape and dtype.
_u = jax.jit(hs.to_cartesian)
_from = jax.jit(hs.from_cartesian)
_jac = jax.jit(jax.jacrev(hs.to_cartesian))
_grad_dot = jax.jit(jax.grad(lambda x, c: jnp.sum(c * hs.to_cartesian(x))))
_angle = jax.jit(hs.angle_between)
# Fan-ins shared by the tests below (theta lengths 1, 3, 17 and 1000 are compiled once).
N_SMALL = [2, 4, 18]


def _theta(rng, size, kind):
  if kind == 'wide':  # any reals, far outside the canonical ranges, both signs
    return rng.normal(scale=10.0, size=size)
  if kind == 'half_pi':  # energy pushed to the last coordinates
    return np.pi / 2 + rng.normal(scale=0.02, size=size)
  if kind == 'sphere':  # a uniform direction
    return np.asarray(hs.from_cartesian(jnp.asarray(rng.normal(size=size + 1)))[0])
  raise ValueError(kind)


# --- to_cartesian: unit norm, dtype, reference ----------------------------------------------


@pytest.mark.parametrize('size', SIZES)
def test_to_cartesian_unit_norm_float32(size):
  for kind in KINDS:
    theta = _theta(np.random.default_rng(size), size, kind).astype(np.float32)
    u = _u(jnp.asarray(theta))
    assert u.shape == (size + 1,)
    assert u.dtype == jnp.float32
    assert np.all(np.isfinite(u))
    np.testing.assert_allclose(np.linalg.norm(np.asarray(u, np.float64)), 1.0, rtol=2e-5)


@pytest.mark.parametrize('size', SIZES)
def test_to_cartesian_unit_norm_float64(x64, size):
  for kind in KINDS:
    theta = _theta(np.random.default_rng(size), size, kind)
    u = _u(jnp.asarray(theta))
    assert u.dtype == jnp.float64
    np.testing.assert_allclose(np.linalg.norm(np.asarray(u)), 1.0, rtol=1e-12)


def test_to_cartesian_eager_equals_jit():
  theta = jnp.asarray(np.random.default_rng(0).normal(size=20), jnp.float32)
  np.testing.assert_allclose(hs.to_cartesian(theta), _u(theta), rtol=1e-6, atol=1e-7)


def test_to_cartesian_empty_theta():
  u = hs.to_cartesian(jnp.zeros((0,), jnp.float32))
  assert u.shape == (1,)
  np.testing.assert_allclose(np.abs(u), 1.0)


@pytest.mark.parametrize('size', [1, 3, 17, 300])
def test_to_cartesian_matches_numpy_reference(x64, size):
  for kind in KINDS:
    theta = _theta(np.random.default_rng(100 + size), size, kind)
    u = np.asarray(_u(jnp.asarray(theta)))
    np.testing.assert_allclose(u, ref_to_cartesian(theta), rtol=1e-12, atol=1e-14)


def test_to_cartesian_matches_reference_float32():
  theta = np.random.default_rng(7).uniform(-7, 7, size=50)
  u = np.asarray(_u(jnp.asarray(theta, jnp.float32)))
  np.testing.assert_allclose(u, ref_to_cartesian(theta.astype(np.float32)), atol=2e-6)


def test_to_cartesian_rejects_batched_theta():
  with pytest.raises(ValueError):
    hs.to_cartesian(jnp.zeros((3, 4)))


# --- from_cartesian: inverse, ranges, dtype --------------------------------------------------


def _gaussians(rng, n, count=8):
  w = rng.normal(size=(count, n))
  w[: count // 2, -1] = -np.abs(w[: count // 2, -1])  # half with negative last coordinate
  w[count // 2:, -1] = np.abs(w[count // 2:, -1])
  w[0, -2] = -abs(w[0, -2])  # and every sign pattern of the last pair
  w[1, -2] = abs(w[1, -2])
  return w


def _check_ranges(theta):
  theta = np.asarray(theta)
  assert np.all(theta[:-1] >= 0) and np.all(theta[:-1] <= np.pi)
  assert np.all(theta[-1] >= 0) and np.all(theta[-1] < 2 * np.pi)


@pytest.mark.parametrize('n', [2, 3, 17, 4608])
@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_from_cartesian_round_trip(n, dtype):
  with jax.enable_x64(dtype == 'float64'):
    rng = np.random.default_rng(n)
    tol = 1e-5 if dtype == 'float32' else 1e-12
    for w in _gaussians(rng, n):
      w = jnp.asarray(w, dtype)
      theta, radius = _from(w)
      assert theta.shape == (n - 1,) and radius.shape == ()
      assert theta.dtype == w.dtype and radius.dtype == w.dtype
      _check_ranges(theta)
      w64 = np.asarray(w, np.float64)
      back = np.asarray(radius, np.float64) * np.asarray(_u(theta), np.float64)
      assert np.linalg.norm(back - w64) < tol * np.linalg.norm(w64)
      np.testing.assert_allclose(float(radius), np.linalg.norm(w64), rtol=tol)
      # Every coordinate keeps its sign (the last one included).
      big = np.abs(w64) > 1e-3 * np.linalg.norm(w64)
      assert np.all(np.sign(back[big]) == np.sign(w64[big]))


def test_from_cartesian_to_cartesian_round_trip_of_angles(x64):
  # to_cartesian o from_cartesian = id on the sphere and from_cartesian o to_cartesian = id on
  # the canonical chart (away from its singular set).
  rng = np.random.default_rng(3)
  for n in N_SMALL:
    theta = rng.uniform(0.1, np.pi - 0.1, size=n - 1)
    theta[-1] = rng.uniform(0.1, 2 * np.pi - 0.1)
    back, radius = _from(_u(jnp.asarray(theta)))
    np.testing.assert_allclose(back, theta, atol=1e-12)
    np.testing.assert_allclose(radius, 1.0, rtol=1e-14)


def test_from_cartesian_vmaps_over_columns(x64):
  rng = np.random.default_rng(5)
  w = rng.normal(size=(18, 6))
  theta, radius = jax.jit(jax.vmap(hs.from_cartesian, in_axes=1, out_axes=(1, 0)))(jnp.asarray(w))
  assert theta.shape == (17, 6) and radius.shape == (6,)
  for j in range(6):
    t_j, r_j = _from(jnp.asarray(w[:, j]))
    np.testing.assert_allclose(theta[:, j], t_j, atol=1e-14)
    np.testing.assert_allclose(radius[j], r_j, rtol=1e-14)


@pytest.mark.parametrize('w', [
    [1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, -2.0], [0.0, -3.0, 0.0], [0.0, 0.0, 0.0, 5.0],
    [1e-30, 0.0, -1e-30], [3e30, -4e30],
])
def test_from_cartesian_axes_and_extremes(w):
  w = jnp.asarray(w, jnp.float32)
  theta, radius = hs.from_cartesian(w)
  assert np.all(np.isfinite(theta)) and np.isfinite(radius)
  _check_ranges(theta)
  w64 = np.asarray(w, np.float64)
  np.testing.assert_allclose(float(radius), np.linalg.norm(w64), rtol=1e-6)
  back = np.asarray(hs.to_cartesian(theta), np.float64)
  np.testing.assert_allclose(back, w64 / np.linalg.norm(w64), atol=1e-6)


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_from_cartesian_tiny_negative_last_coordinate_stays_below_two_pi(dtype):
  # A last pair (x_{n-1}, x_n) = (1, -tiny) has a last angle just below 2 pi: in the working
  # precision it must still land in [0, 2 pi), i.e. strictly below the rounded 2 pi.
  with jax.enable_x64(dtype == 'float64'):
    for tiny in [1e-9, 1e-20]:
      w = jnp.asarray([0.5, 1.0, -tiny], dtype)
      theta, _ = hs.from_cartesian(w)
      last = np.asarray(theta)[-1]
      assert 0 <= last < np.asarray(2 * np.pi, dtype), (dtype, tiny, last)


def test_from_cartesian_rejects_bad_shapes():
  with pytest.raises(ValueError):
    hs.from_cartesian(jnp.ones((1,)))
  with pytest.raises(ValueError):
    hs.from_cartesian(jnp.ones((3, 2)))


def test_float32_fan_in_4608_uniform_direction_does_not_underflow():
  n = 4608
  for seed in range(3):
    g = np.asarray(jax.random.normal(jax.random.key(seed), (n,), jnp.float32))
    theta, _ = _from(jnp.asarray(g))
    u = np.asarray(_u(theta), np.float64)
    d = g.astype(np.float64) / np.linalg.norm(g.astype(np.float64))
    # Every coordinate reproduces the Gaussian direction, the last ones included
    # (typical |d_i| ~ 1/sqrt(n) ~ 0.015).
    assert np.max(np.abs(u - d)) < 2e-6, np.max(np.abs(u - d))
    assert np.linalg.norm(u - d) < 1e-5
    tail = slice(n - n // 10, n)
    np.testing.assert_allclose(np.sum(u[tail] ** 2), np.sum(d[tail] ** 2), rtol=1e-4)
    assert np.count_nonzero(np.abs(u) < 1e-30) == np.count_nonzero(np.abs(d) < 1e-30)


# --- Theorem 3 and the metric -----------------------------------------------------------------


def _random_theta(rng, n):
  # Canonical-range angles, kept away from the poles so that M is not degenerate.
  theta = rng.uniform(0.3, np.pi - 0.3, size=n - 1)
  theta[-1] = rng.uniform(0, 2 * np.pi)
  return theta


@pytest.mark.parametrize('n', N_SMALL + [1001])
def test_theorem3_first_order(x64, n):
  rng = np.random.default_rng(n)
  for _ in range(4):
    theta = _random_theta(rng, n)
    d = rng.normal(size=n - 1)
    d /= np.linalg.norm(d)
    m = np.asarray(hs.metric_diag(jnp.asarray(theta)))
    u0 = _u(jnp.asarray(theta))
    rel = []
    for t in [1e-2, 1e-3, 1e-4]:
      theta2 = theta + t * d
      eps = theta2 - theta  # the perturbation actually applied, after rounding
      angle = float(_angle(u0, _u(jnp.asarray(theta2))))
      predicted = np.sqrt(eps @ (m * eps))
      assert angle <= np.linalg.norm(eps) * (1 + 1e-10)
      rel.append(abs(angle - predicted) / predicted)
    # The relative error is O(|eps|): bounded by C |eps| with one C for all three sizes, and
    # shrinking by about 10x with every 10x smaller eps (or already at rounding level).
    assert max(r / t for r, t in zip(rel, [1e-2, 1e-3, 1e-4])) < 20, rel
    assert rel[2] < 0.2 * rel[1] + 1e-9 and rel[1] < 0.2 * rel[0] + 1e-9, rel


@pytest.mark.parametrize('n', N_SMALL + [1001])
def test_theorem3_bound_never_exceeded(x64, n):
  rng = np.random.default_rng(1000 + n)
  u_fn = _u
  angle_fn = _angle
  for _ in range(30):
    theta = rng.normal(scale=3.0, size=n - 1)  # any reals
    theta2 = theta + rng.normal(size=n - 1) * 10.0 ** rng.uniform(-6, 0)
    eps = theta2 - theta
    angle = float(angle_fn(u_fn(jnp.asarray(theta)), u_fn(jnp.asarray(theta2))))
    assert angle <= np.linalg.norm(eps) * (1 + 1e-10) + 1e-15


@pytest.mark.parametrize('n', N_SMALL)
def test_metric_diag_is_pullback_metric(x64, n):
  rng = np.random.default_rng(n)
  for theta in [rng.normal(scale=3.0, size=n - 1), _random_theta(rng, n)]:
    jac = np.asarray(_jac(jnp.asarray(theta)))
    assert jac.shape == (n, n - 1)
    g = jac.T @ jac
    np.testing.assert_allclose(g - np.diag(np.diag(g)), 0.0, atol=1e-12)  # M is diagonal
    m = np.asarray(hs.metric_diag(jnp.asarray(theta)))
    assert m.shape == (n - 1,) and m.dtype == np.float64
    np.testing.assert_allclose(m, np.diag(g), rtol=1e-12, atol=1e-14)


def test_metric_diag_float32_dtype_and_range():
  theta = jnp.asarray(np.random.default_rng(0).normal(size=30), jnp.float32)
  m = hs.metric_diag(theta)
  assert m.dtype == jnp.float32 and m.shape == (30,)
  assert np.all(np.asarray(m) >= 0) and np.all(np.asarray(m) <= 1 + 1e-6)


# --- gradients -----------------------------------------------------------------------------
# Reverse mode only: the library documents that forward mode (jvp) is not available through
# its custom VJP.


def _fd_jacobian(theta, h=1e-6):
  """Central finite-difference Jacobian of the float64 numpy reference, shape (n, n - 1)."""
  theta = np.asarray(theta, np.float64)
  cols = []
  for k in range(theta.shape[0]):
    e = np.zeros_like(theta)
    e[k] = h
    cols.append((ref_to_cartesian(theta + e) - ref_to_cartesian(theta - e)) / (2 * h))
  return np.stack(cols, axis=1)


@pytest.mark.parametrize('n', N_SMALL)
def test_gradients_match_finite_differences(x64, n):
  rng = np.random.default_rng(n)
  theta = jnp.asarray(rng.normal(scale=2.0, size=n - 1))
  check_grads(_u, (theta,), order=2 if n <= 4 else 1, modes=('rev',), atol=1e-6, rtol=1e-6)
  jac = _jac(theta)
  np.testing.assert_allclose(jac, _fd_jacobian(theta), atol=1e-8)


@pytest.mark.parametrize('n', N_SMALL[:2])
def test_gradients_match_finite_differences_at_poles(x64, n):
  rng = np.random.default_rng(n)
  theta = rng.normal(size=n - 1)
  theta[:: 2] = 0.0
  theta[1:: 2] = np.pi
  check_grads(_u, (jnp.asarray(theta),), order=2, modes=('rev',), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_values_and_gradients_finite_at_poles(dtype):
  with jax.enable_x64(dtype == 'float64'):
    atol = 1e-5 if dtype == 'float32' else 1e-8
    jac_fn, grad_fn, u_fn = _jac, _grad_dot, _u
    for n in N_SMALL:
      for pole in [0.0, np.pi]:
        rng = np.random.default_rng(n)
        theta = rng.normal(size=n - 1)
        theta[:: 3] = pole  # several angles exactly at a pole, the first included
        for t in [theta, np.full(n - 1, pole)]:  # some, or all, angles at a pole
          t_j = jnp.asarray(t, dtype)
          u = u_fn(t_j)
          assert np.all(np.isfinite(u))
          np.testing.assert_allclose(float(jnp.linalg.norm(u)), 1.0, rtol=1e-5)
          jac = np.asarray(jac_fn(t_j))
          assert jac.dtype == t_j.dtype and np.all(np.isfinite(jac))
          np.testing.assert_allclose(jac, _fd_jacobian(np.asarray(t_j, np.float64)), atol=atol)
          c = jnp.asarray(rng.normal(size=n), dtype)
          grad = grad_fn(t_j, c)
          assert grad.dtype == t_j.dtype and np.all(np.isfinite(grad))
          np.testing.assert_allclose(grad, np.asarray(c, np.float64) @ jac, atol=atol)
        # All angles at the pole: du_2/dtheta_1 = cos(t_1) cos(t_2) (cos(t_1) for n = 2) is
        # +-1, neither 0 nor NaN.
        expected = np.cos(pole) * (np.cos(pole) if n > 2 else 1.0)
        np.testing.assert_allclose(jac[1, 0], expected, atol=1e-6)


# --- angle_between -------------------------------------------------------------------------


def test_angle_between_matches_arccos(x64):
  rng = np.random.default_rng(0)
  for n in [2, 3, 50]:
    for _ in range(10):
      u, v = rng.normal(size=(2, n)) * rng.uniform(0.1, 10, size=(2, 1))
      expected = np.arccos(np.clip(u @ v / np.linalg.norm(u) / np.linalg.norm(v), -1, 1))
      np.testing.assert_allclose(float(hs.angle_between(jnp.asarray(u), jnp.asarray(v))),
                                 expected, rtol=1e-10, atol=1e-12)
    e = np.eye(n)[0]
    np.testing.assert_allclose(float(hs.angle_between(jnp.asarray(e), jnp.asarray(-3 * e))),
                               np.pi, rtol=1e-14)
    # Tiny angles are resolved (arccos of the cosine would return 0).
    tiny = np.array([np.cos(1e-9), np.sin(1e-9)] + [0.0] * (n - 2))
    np.testing.assert_allclose(float(hs.angle_between(jnp.asarray(e), jnp.asarray(tiny))),
                               1e-9, rtol=1e-6)


# --- bad inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize('fn', [hs.to_cartesian, hs.to_cartesian_batched, hs.metric_diag,
                                hs.to_cartesian_reference, hs.from_cartesian])
@pytest.mark.parametrize('dtype', ['complex64', 'complex128'])
def test_complex_input_is_a_type_error_naming_the_dtype(fn, dtype):
  # Casting to real would silently drop the imaginary part.
  with jax.enable_x64(dtype == 'complex128'):
    z = jnp.asarray([0.3 + 1j, 1.2, 2.0], dtype)
    with pytest.raises(TypeError, match=f'dtype {dtype}') as info:
      fn(z)
    assert 'real floating (or integer)' in str(info.value)


def test_angle_between_complex_is_a_type_error():
  with pytest.raises(TypeError, match='complex64'):
    hs.angle_between(jnp.ones(3, jnp.complex64), jnp.ones(3))


def test_integer_theta_is_accepted_as_float():
  u = hs.to_cartesian(jnp.arange(4))
  assert u.dtype == jnp.float32
  np.testing.assert_allclose(u, ref_to_cartesian(np.arange(4.0)), atol=2e-6)
  np.testing.assert_allclose(hs.metric_diag(jnp.arange(3)),
                             hs.metric_diag(jnp.arange(3, dtype=jnp.float32)))


def _scaled_norm(w):
  """|w| in float64 without under/overflow (numpy squares subnormal float64 to zero)."""
  w = np.asarray(w, np.float64)
  peak = np.max(np.abs(w))
  return peak * np.linalg.norm(w / peak)


@pytest.mark.parametrize('dtype,w', [
    ('float32', [1e-40, -3e-41, 2e-40]),  # subnormal (CPUs flush these to zero in arithmetic)
    ('float32', [0.0, -1e-45, 0.0, 0.0]),  # the smallest subnormal alone
    ('float32', [1e-38, 2e-40, -1e-39, 5e-41]),  # normal and subnormal entries mixed
    ('float32', [1e-38, 3e-39, -2e-38]),  # tiny normal
    ('float32', [1e38, -3e37, 2e38]),  # huge (|w| still representable)
    ('float32', [-1e38, 1e38, -1e38]),
    ('float64', [1e-310, -3e-311, 2e-310]),
    ('float64', [1e-305, 3e-306, -2e-305]),
    ('float64', [1e307, -3e306, -8e307]),
])
def test_from_cartesian_subnormal_tiny_and_huge_vectors(dtype, w):
  with jax.enable_x64(dtype == 'float64'):
    w = np.asarray(w, dtype)
    theta, radius = hs.from_cartesian(jnp.asarray(w))
    assert theta.dtype == w.dtype and radius.dtype == w.dtype
    _check_ranges(theta)
    w64 = w.astype(np.float64)
    norm = _scaled_norm(w64)
    u = np.asarray(hs.to_cartesian(theta), np.float64)
    # The direction to full precision, the radius to its correct rounding.
    np.testing.assert_allclose(u, w64 / norm, rtol=0, atol=1e-6)
    assert abs(float(radius) - norm) <= np.spacing(np.asarray(norm, dtype)), (radius, norm)
    back = float(radius) * u
    assert np.linalg.norm((back - w64) / norm) < 1e-6, (back, w64)


@pytest.mark.parametrize('dtype,exponents', [('float32', [-140, -120, -60, 60, 120]),
                                             ('float64', [-1000, -500, 500, 1000])])
def test_from_cartesian_is_exactly_scale_invariant_by_powers_of_two(dtype, exponents):
  with jax.enable_x64(dtype == 'float64'):
    g = np.random.default_rng(9).normal(size=40).astype(dtype)
    theta, radius = map(np.asarray, hs.from_cartesian(jnp.asarray(g)))
    for k in exponents:
      w = np.ldexp(g, k)  # exact while every entry stays normal
      if np.min(np.abs(w)) < np.finfo(dtype).tiny:
        continue
      theta_k, radius_k = map(np.asarray, hs.from_cartesian(jnp.asarray(w)))
      np.testing.assert_array_equal(theta_k, theta)
      assert radius_k == np.ldexp(radius, k)


def test_from_cartesian_subnormal_result_radius_under_jit_and_vmap():
  w = np.asarray([[1e-40, 3.0], [-3e-41, -4.0], [2e-40, 0.0]], np.float32)
  theta, radius = jax.jit(jax.vmap(hs.from_cartesian, in_axes=1, out_axes=(1, 0)))(w)
  np.testing.assert_allclose(np.asarray(radius, np.float64),
                             [_scaled_norm(w[:, 0]), 5.0], rtol=4e-6)
  np.testing.assert_allclose(hs.to_cartesian(theta[:, 0]), w[:, 0] / _scaled_norm(w[:, 0]),
                             atol=1e-6)


def test_from_cartesian_non_finite_gives_nan_angles():
  theta, radius = hs.from_cartesian(jnp.asarray([np.inf, 1.0, 2.0]))
  assert np.all(np.isnan(theta)) and radius == np.inf
  theta, radius = hs.from_cartesian(jnp.asarray([1.0, np.nan, 2.0]))
  assert np.all(np.isnan(theta)) and np.isnan(radius)


def test_from_cartesian_zero_vector_raises_eagerly_and_gives_nan_angles_traced():
  # A zero vector has no direction: a concrete one is a ValueError naming w, a traced one (jit,
  # vmap over the columns of a kernel) NaN angles with radius 0, never the angles 0 silently.
  for dtype in ['float32', 'bfloat16']:
    with pytest.raises(ValueError, match='w is zero.*no direction'):
      hs.from_cartesian(jnp.zeros(3, dtype))
  with pytest.raises(ValueError, match='w is zero'):
    hs.from_cartesian(np.zeros(4, np.int32))
  theta, radius = _from(jnp.zeros(3))
  assert np.all(np.isnan(theta)) and radius == 0
  w = np.asarray([[0.0, 3.0], [0.0, -4.0], [0.0, 0.0]], np.float32)
  theta, radius = jax.vmap(hs.from_cartesian, in_axes=1, out_axes=(1, 0))(w)
  assert np.all(np.isnan(theta[:, 0])) and np.all(np.isfinite(theta[:, 1]))
  np.testing.assert_allclose(radius, [0.0, 5.0])
  # A subnormal w is not zero (numpy reads it; XLA on CPU would flush it).
  assert np.all(np.isfinite(hs.from_cartesian(jnp.asarray([1e-45, 0.0], jnp.float32))[0]))


def test_from_cartesian_gradient_is_scale_covariant(x64):
  w = jnp.asarray(np.random.default_rng(4).normal(size=6))
  check_grads(hs.from_cartesian, (w,), order=1, modes=('rev', 'fwd'))
  jac_theta, jac_radius = jax.jacrev(hs.from_cartesian)(w)
  for s in [2.0**-900, 1e-20, 1e20, 2.0**900]:
    jt, jr = jax.jacrev(hs.from_cartesian)(w * s)
    np.testing.assert_allclose(np.asarray(jt) * s, jac_theta, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(jr, jac_radius, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_narrow_float_directions_are_evaluated_in_float32(dtype):
  # bf16 angles evaluated in bf16 give |u| ~ 1.6 at fan-in 4608; here the map runs in float32
  # and only the result is rounded.
  g = jax.random.normal(jax.random.key(0), (4608,), jnp.float32)
  theta = hs.from_cartesian(g.astype(dtype))[0]
  assert theta.dtype == jnp.dtype(dtype)
  assert 0 <= float(theta[-1]) < 2 * np.pi
  u = hs.to_cartesian(theta)
  assert u.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(u, hs.to_cartesian(theta.astype(jnp.float32)).astype(dtype))
  np.testing.assert_allclose(float(jnp.linalg.norm(u.astype(jnp.float32))), 1.0, rtol=1e-2)
  d = np.asarray(g, np.float64) / np.linalg.norm(np.asarray(g, np.float64))
  eps = float(jnp.finfo(dtype).eps)
  assert np.max(np.abs(np.asarray(u, np.float64) - d)) < 20 * eps * np.max(np.abs(d))


def test_angle_with_a_zero_vector_raises_and_is_nan_traced():
  zeros, ones = jnp.zeros(3), jnp.ones(3)
  for u, v, name in [(zeros, ones, 'u'), (ones, zeros, 'v'), (zeros, zeros, 'u')]:
    with pytest.raises(ValueError, match=f'angle_between: {name} is zero'):
      hs.angle_between(u, v)
    assert np.isnan(_angle(u, v))
  tiny = jnp.asarray(np.asarray([0.0, 1e-45, 0.0], np.float32))  # subnormal: not zero
  np.testing.assert_allclose(float(hs.angle_between(tiny, ones)), np.arccos(1 / np.sqrt(3)),
                             rtol=1e-6)
  assert np.isnan(hs.angle_between(jnp.asarray([np.inf, 1.0]), jnp.asarray([1.0, 1.0])))


@pytest.mark.parametrize('scale', [1e-40, 1e-30, 1e-20, 1e20, 1e30, 1e38])
def test_angle_between_tiny_and_huge_vectors(scale):
  # |u| underflows (1e-30 squared is 0 in float32) or |v| u overflows without rescaling.
  # (Built in numpy: jax arithmetic on CPU flushes subnormals to zero.)
  u = jnp.asarray(np.asarray([scale, 0.0, 0.0], np.float32))
  v = np.asarray([scale, scale, 0.0], np.float32)
  np.testing.assert_allclose(float(hs.angle_between(u, jnp.asarray(v))), np.pi / 4, rtol=1e-6)
  other = jnp.asarray(v * np.float32(1e-3 if scale > 1 else 1e3))  # differently scaled
  np.testing.assert_allclose(float(hs.angle_between(u, other)), np.pi / 4, rtol=1e-6)


def test_scan_functions_reject_scalars_and_mismatched_shapes():
  with pytest.raises(ValueError, match='scalar'):
    hs.prefix_product(jnp.float32(2.0))
  with pytest.raises(ValueError, match='scalar'):
    hs.suffix_affine(jnp.float32(1.0), jnp.float32(2.0))
  with pytest.raises(ValueError, match='same shape'):
    hs.suffix_affine(jnp.ones((3, 2)), jnp.ones((4, 2)))
  with pytest.raises(ValueError, match='scheme must be one of'):
    hs.prefix_product(jnp.ones((0, 2)), 'cumprod')
