"""Tests for geoparam.initializers: sphere-uniform angles, fan-in-1 signs, Glorot norms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import geoparam
from geoparam import initializers
from geoparam.methods.gmp import gmp_kernel

_directions = jax.jit(jax.vmap(geoparam.hyperspherical.to_cartesian, in_axes=1, out_axes=1))


def _last_tenth_energy(theta):
  """Mean over neurons of sum(u_i^2) over the last tenth of the coordinates of u(theta)."""
  u = np.asarray(_directions(jnp.asarray(theta)), np.float64)  # (n, m)
  n = u.shape[0]
  return float(np.mean(np.sum(u[n - n // 10:] ** 2, axis=0))), n // 10 / n


def _energy_spread_ok(theta):
  energy, expected = _last_tenth_energy(theta)
  return expected / 2 <= energy <= expected * 2


def test_sphere_uniform_spreads_energy_and_uniform_angles_do_not():
  fan_in, neurons = 1152, 512
  theta = jax.jit(initializers.sphere_uniform(), static_argnums=1)(
      jax.random.key(0), (fan_in - 1, neurons))
  assert theta.shape == (fan_in - 1, neurons) and theta.dtype == jnp.float32
  energy, expected = _last_tenth_energy(theta)
  assert abs(expected - 0.1) < 0.01
  assert _energy_spread_ok(theta), energy
  # The same check rejects theta_i ~ U(0, pi): u then lives in its first few coordinates.
  naive = jax.random.uniform(jax.random.key(0), (fan_in - 1, neurons), jnp.float32, 0, np.pi)
  naive_energy, _ = _last_tenth_energy(naive)
  assert not _energy_spread_ok(naive), naive_energy


def test_sphere_uniform_directions_are_uniform():
  fan_in, neurons = 40, 4000
  theta = jax.jit(initializers.sphere_uniform(), static_argnums=1)(
      jax.random.key(1), (fan_in - 1, neurons))
  u = np.asarray(_directions(theta), np.float64)
  np.testing.assert_allclose(np.linalg.norm(u, axis=0), 1.0, rtol=1e-5)
  # E[u] = 0 and E[u u^T] = I / n for a uniform direction; the per-coordinate statistics over
  # 4000 neurons have standard errors ~ 1/sqrt(n * 4000) and ~ sqrt(2) / (n sqrt(4000)).
  se_mean = 1 / math.sqrt(fan_in * neurons)
  assert np.max(np.abs(u.mean(axis=1))) < 5 * se_mean
  second = (u ** 2).mean(axis=1)
  np.testing.assert_allclose(second, 1 / fan_in, atol=6 * math.sqrt(2) / fan_in / math.sqrt(neurons))
  cov = u @ u.T / neurons
  off = cov - np.diag(np.diag(cov))
  assert np.max(np.abs(off)) < 6 / fan_in / math.sqrt(neurons)
  # Every coordinate (the last included) takes both signs equally often.
  negative = (u < 0).mean(axis=1)
  assert np.all(np.abs(negative - 0.5) < 0.05), negative


def test_sphere_uniform_angles_in_canonical_ranges_and_reproducible():
  init = jax.jit(initializers.sphere_uniform(), static_argnums=1)
  theta = np.asarray(init(jax.random.key(2), (9, 300)))
  assert np.all(theta[:-1] >= 0) and np.all(theta[:-1] <= np.pi)
  assert np.all(theta[-1] >= 0) and np.all(theta[-1] < 2 * np.pi)
  assert np.any(theta[-1] > np.pi)  # last coordinates of u are negative for some neurons
  np.testing.assert_array_equal(theta, init(jax.random.key(2), (9, 300)))
  assert not np.allclose(theta, init(jax.random.key(3), (9, 300)))


@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_sphere_uniform_is_from_cartesian_of_a_gaussian_bit_for_bit(dtype, x64):
  """The initializer skips from_cartesian's exact scaling: the same angles, bit for bit (jitted,
  as the layers call it), and the angles of the draw computed in float64 numpy."""
  init = jax.jit(initializers.sphere_uniform(), static_argnums=(1, 2))
  exact = jax.jit(lambda w: jax.vmap(geoparam.hyperspherical.from_cartesian, in_axes=1,
                                     out_axes=(1, 0))(w)[0])
  for fan_in in (2, 300):
    key = jax.random.key(fan_in)
    theta = np.asarray(init(key, (fan_in - 1, 256), jnp.dtype(dtype)))
    g = jax.random.normal(key, (fan_in, 256), jnp.dtype(dtype))
    np.testing.assert_array_equal(theta, exact(g))
    w = np.asarray(g, np.float64)
    tail = np.sqrt(np.cumsum((w * w)[::-1], axis=0)[::-1])
    last = np.mod(np.arctan2(w[-1], w[-2]), 2 * np.pi)
    reference = np.concatenate([np.arctan2(tail[1:-1], w[:-2]), last[None]])
    np.testing.assert_allclose(theta, reference, rtol=0, atol=4e-6 if dtype == 'float32' else 1e-12)


def test_uniform_direction_angles_refuses_bad_shapes_and_dtypes():
  draw = geoparam.hyperspherical.uniform_direction_angles
  for shape in ((0, 3), (3,), (1, 2, 3)):
    with pytest.raises(ValueError, match=r'shape \(n - 1, features\) with n >= 2, got'):
      draw(jax.random.key(0), shape)
  with pytest.raises(TypeError, match='uniform_direction_angles expects a real floating dtype'):
    draw(jax.random.key(0), (3, 2), jnp.complex64)


def test_sphere_uniform_dtypes(x64):
  init = initializers.sphere_uniform()
  for dtype in [jnp.float64, jnp.float32]:  # traced, not run: the dtype is static
    out = jax.eval_shape(lambda k, dtype=dtype: init(k, (4, 3), dtype), jax.random.key(0))
    assert out.dtype == dtype and out.shape == (4, 3)
  assert init(jax.random.key(0), (0, 3)).shape == (0, 3)  # fan-in 1: no angles
  with pytest.raises(ValueError):
    init(jax.random.key(0), (4,))


def test_rademacher_signs():
  s = np.asarray(initializers.rademacher()(jax.random.key(0), (1000,)))
  assert set(np.unique(s).tolist()) == {-1.0, 1.0}
  assert 400 < np.sum(s > 0) < 600


def test_glorot_norm_matches_a_glorot_uniform_draw():
  fan_in, fan_out = 50, 30
  r = np.asarray(initializers.glorot_norm(fan_in, fan_out)(jax.random.key(0), (4000,)))
  assert r.shape == (4000,) and np.all(r > 0)
  limit = math.sqrt(6 / (fan_in + fan_out))
  # |w|^2 of fan_in iid U(-limit, limit) entries: mean fan_in limit^2 / 3, variance
  # fan_in * (limit^4 / 5 - limit^4 / 9).
  mean_sq = fan_in * limit ** 2 / 3
  sd_sq = math.sqrt(fan_in * limit ** 4 * (1 / 5 - 1 / 9))
  np.testing.assert_allclose(np.mean(r ** 2), mean_sq, atol=5 * sd_sq / math.sqrt(4000))
  np.testing.assert_allclose(np.std(r ** 2), sd_sq, rtol=0.1)
  assert np.all(r <= limit * math.sqrt(fan_in))
  with pytest.raises(ValueError):
    initializers.glorot_norm(0, 3)
  with pytest.raises(ValueError):
    initializers.glorot_norm(3, 0)


def test_gmp_dense_default_init():
  fan_in, features = 64, 256
  params = jax.jit(geoparam.GmPDense(features).init)(
      jax.random.key(0), jnp.ones((1, fan_in)))['params']
  assert set(params) == {'theta', 'lam', 'scale'}
  np.testing.assert_array_equal(params['lam'], 0.0)
  np.testing.assert_array_equal(params['scale'], 1.0)
  assert _energy_spread_ok(params['theta'])
  # The kernel's columns are uniform directions: no half-space bias of the last coordinate.
  u = np.asarray(gmp_kernel(params['theta']))
  assert 0.35 < np.mean(u[-1] < 0) < 0.65


def test_gmp_dense_glorot_scale_option():
  fan_in, features = 30, 1000
  params = jax.jit(geoparam.GmPDense(features, glorot_scale=True).init)(
      jax.random.key(0), jnp.ones((1, fan_in)))['params']
  r = np.asarray(params['scale'])
  limit = math.sqrt(6 / (fan_in + features))
  np.testing.assert_allclose(np.mean(r ** 2), fan_in * limit ** 2 / 3, rtol=0.07)
  # An explicit scale_init wins over the default ones.
  params = jax.jit(geoparam.GmPDense(3, scale_init=jax.nn.initializers.constant(2.5)).init)(
      jax.random.key(0), jnp.ones((1, 4)))['params']
  np.testing.assert_array_equal(params['scale'], 2.5)


def test_gmp_dense_fan_in_one_sign_init():
  params = jax.jit(geoparam.GmPDense(500).init)(jax.random.key(0), jnp.ones((2, 1)))['params']
  assert params['theta'].shape == (0, 500)
  sign = np.asarray(params['sign'])
  assert set(np.unique(sign).tolist()) == {-1.0, 1.0}
  kernel = np.asarray(gmp_kernel(params['theta'], params['sign']))
  np.testing.assert_array_equal(kernel, sign[None, :])
