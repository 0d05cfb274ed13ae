"""The fast theta -> u map (custom VJP, sequential / associative scans) against plain references."""

import functools

import jax
import jax.numpy as jnp
from jax.test_util import check_grads
import numpy as np
import pytest

from geoparam import hyperspherical as hs


def _suffix_reference(a, b):
  y = np.zeros((a.shape[0] + 1,) + a.shape[1:])
  for j in range(a.shape[0] - 1, -1, -1):
    y[j] = a[j] + b[j] * y[j + 1]
  return y[:-1]


@pytest.mark.parametrize('scheme', hs.SCHEMES)
@pytest.mark.parametrize('length', [0, 1, 2, 15, 16, 17, 33, 257, 300])
def test_scans_equal_sequential_references(scheme, length):
  with jax.enable_x64(True):
    rng = np.random.default_rng(length)
    a = rng.normal(size=(length, 3))
    b = rng.uniform(-1.2, 1.2, size=(length, 3))
    np.testing.assert_allclose(hs.prefix_product(jnp.asarray(b), scheme), np.cumprod(b, axis=0),
                               rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(hs.suffix_affine(jnp.asarray(a), jnp.asarray(b), scheme),
                               _suffix_reference(a, b), rtol=1e-10, atol=1e-12)


def _random_theta(rng, n, dtype, poles=True):
  """Sphere-like angles plus noise, with exact poles (0 and pi) planted."""
  theta = np.asarray(hs.from_cartesian(jnp.asarray(rng.normal(size=n)))[0], np.float64)
  theta = theta + 0.3 * rng.normal(size=theta.shape)
  if poles and n > 4:
    theta[1], theta[3] = 0.0, np.pi
  return jnp.asarray(theta, dtype)


@functools.partial(jax.jit, static_argnums=2)
def _value_and_grads(theta, g, scheme):
  """Fast map, reference map and both gradients of <u, g>, in one compiled call."""
  fast, vjp_fast = jax.vjp(lambda t: hs.to_cartesian_batched(t, scheme), theta)
  ref, vjp_ref = jax.vjp(hs.to_cartesian_reference, theta)
  return fast, ref, vjp_fast(g)[0], vjp_ref(g)[0]


@pytest.mark.parametrize('scheme', hs.SCHEMES)
@pytest.mark.parametrize('dtype,n', [(d, n) for d in ('float32', 'float64')
                                     for n in (2, 3, 17, 100, 1025)] + [('float32', 4608)])
def test_fast_map_and_gradient_equal_autodiff_of_plain_formula(scheme, dtype, n):
  with jax.enable_x64(dtype == 'float64'):
    rng = np.random.default_rng(n)
    theta = _random_theta(rng, n, dtype)
    g = jnp.asarray(rng.normal(size=n), dtype)
    fast, ref, grad_fast, grad_ref = _value_and_grads(theta, g, scheme)
    assert fast.dtype == jnp.dtype(dtype)
    tol = 1e-12 if dtype == 'float64' else 2e-6
    np.testing.assert_allclose(fast, ref, rtol=tol, atol=tol)
    assert np.all(np.isfinite(grad_fast))
    scale = float(np.max(np.abs(grad_ref)))
    np.testing.assert_allclose(grad_fast, grad_ref, rtol=0, atol=(1e-12 if dtype == 'float64' else 5e-6) * scale)


@pytest.mark.parametrize('scheme', hs.SCHEMES)
def test_fast_map_vjp_passes_finite_differences(scheme):
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    theta = _random_theta(rng, 40, jnp.float64, poles=False).reshape(39, 1) * jnp.ones((1, 2))
    check_grads(lambda t: hs.to_cartesian_batched(t, scheme), (theta,), order=1, modes=['rev'])


def test_batched_equals_vmapped_single_neuron():
  rng = np.random.default_rng(1)
  theta = jnp.asarray(rng.uniform(-1, 4, size=(33, 5)), jnp.float32)
  # Both compiled: eager op-by-op evaluation may round differently (no fused multiply-add).
  np.testing.assert_array_equal(jax.jit(hs.to_cartesian_batched)(theta),
                                jax.jit(jax.vmap(hs.to_cartesian, in_axes=1, out_axes=1))(theta))


def test_unknown_scheme_is_a_clear_error():
  with pytest.raises(ValueError, match='scheme must be one of'):
    hs.to_cartesian_batched(jnp.zeros((3, 2)), scheme='cumprod')


def _ulps(got, exact):
  """Error of float32 `got` in units of the float32 spacing at the exact (float64) value."""
  return np.abs(got - exact) / np.spacing(np.abs(exact.astype(np.float32)))


@pytest.mark.parametrize('bound', [4.0, 125.0, 8192.0])
def test_sincos_is_within_few_ulps_of_float64(bound):
  rng = np.random.default_rng(int(bound))
  k = np.arange(-int(bound / (np.pi / 2)), int(bound / (np.pi / 2)) + 1)
  near = [(k * np.pi / 2).astype(np.float32)]  # near the zeros of sin and cos
  for _ in range(8):
    near.append(np.nextafter(near[-1], np.float32(np.inf)))
  x = np.concatenate(near + [rng.uniform(-bound, bound, 200_000).astype(np.float32)])
  x = x[(np.abs(x) <= bound) & (np.abs(x) > 1e-30)]  # CPU flushes subnormals to zero
  s, c = map(np.asarray, jax.jit(hs.sincos)(jnp.asarray(x)))
  x64 = x.astype(np.float64)
  assert s.dtype == c.dtype == np.float32
  assert np.max(_ulps(s, np.sin(x64))) <= 2.5
  assert np.max(_ulps(c, np.cos(x64))) <= 2.5


def test_sincos_falls_back_outside_its_range_and_propagates_nan():
  x = jnp.asarray([0.5, 1e5, -3.0], jnp.float32)  # one large angle: the whole array falls back
  s, c = hs.sincos(x)
  np.testing.assert_array_equal(s, jnp.sin(x))
  np.testing.assert_array_equal(c, jnp.cos(x))
  s, c = hs.sincos(jnp.asarray([np.nan, np.inf, -np.inf, 1.0], jnp.float32))
  assert np.all(np.isnan(s[:3])) and np.all(np.isnan(c[:3]))
  np.testing.assert_allclose([s[3], c[3]], [np.sin(1.0), np.cos(1.0)], rtol=2e-7)
  with jax.enable_x64(True):
    x64 = jnp.linspace(-10, 10, 101, dtype=jnp.float64)
    s, c = hs.sincos(x64)
    assert s.dtype == jnp.float64
    np.testing.assert_array_equal(s, jnp.sin(x64))
    np.testing.assert_array_equal(c, jnp.cos(x64))


def test_sincos_under_vmap_matches_the_batched_call():
  x = jnp.asarray(np.random.default_rng(3).uniform(-9, 9, size=(7, 4)), jnp.float32)
  batched = jax.jit(hs.sincos)(x)
  mapped = jax.jit(jax.vmap(hs.sincos, in_axes=1, out_axes=1))(x)
  for a, b in zip(batched, mapped):
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-7)


def test_fast_map_with_angles_beyond_the_polynomial_range_equals_reference():
  theta = jnp.asarray(np.random.default_rng(4).uniform(0, 3, size=(20, 3)), jnp.float32)
  theta = theta.at[5, 1].set(1e4 + 0.3)  # far outside [0, 2 pi): the jnp.sin/cos path
  fast, ref, grad_fast, grad_ref = _value_and_grads(theta, jnp.ones((21, 3)), None)
  np.testing.assert_allclose(fast, ref, rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(grad_fast, grad_ref, rtol=0, atol=5e-6 * float(np.max(np.abs(grad_ref))))


def test_sincos_gradient_keeps_sign_of_zero_and_vmap_keeps_one_branch():
  x = jnp.asarray(np.random.default_rng(5).uniform(-20, 20, size=(64, 3)), jnp.float32)
  a, b = jnp.cos(x[:, :1]), jnp.sin(x[:, 1:2])
  grad = jax.grad(lambda t: jnp.sum(hs.sincos(t)[0] * a + hs.sincos(t)[1] * b))(x)
  x64 = np.asarray(x, np.float64)
  np.testing.assert_allclose(grad, np.cos(x64) * np.asarray(a) - np.sin(x64) * np.asarray(b),
                             rtol=0, atol=5e-7)
  s, c = hs.sincos(jnp.asarray([-0.0, 0.0], jnp.float32))
  assert np.signbit(s[0]) and not np.signbit(s[1]) and np.all(c == 1)
  # Under vmap the sequential map's range test must stay ONE decision for the whole batch (a
  # cond), not a per-neuron select that would run XLA's slow sin/cos branch as well.
  sequential = functools.partial(hs.to_cartesian_batched, scheme='sequential')
  hlo = jax.jit(jax.vmap(sequential, in_axes=1, out_axes=1)).lower(x).compile().as_text()
  if jax.default_backend() == 'cpu':
    assert 'conditional' in hlo
