"""Tests for PReLU against the formulas of paper 001."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geoparam import PReLU, prelu


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def ref_f(y, a):
  return np.maximum(0, y) + a * np.minimum(0, y)


def test_values_and_default_init():
  x = jnp.array([[-2.0, -0.5, 0.0, 0.5, 3.0]])
  params = PReLU().init(jax.random.key(0), x)['params']
  np.testing.assert_array_equal(params['negative_slope'], np.full((5,), 0.25, np.float32))
  np.testing.assert_allclose(PReLU().apply({'params': params}, x), ref_f(np.asarray(x), 0.25))


def test_channel_wise_slopes_follow_last_axis(x64):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 3, 6))
  a = rng.uniform(-0.5, 1.5, size=(6,))
  y = PReLU(param_dtype=jnp.float64).apply({'params': {'negative_slope': jnp.asarray(a)}}, x)
  np.testing.assert_allclose(y, ref_f(x, a[None, None, :]), rtol=1e-15)


def test_gradients_channel_wise(x64):
  # Paper 001: df/dy = 1 if y > 0 else a; dE/da_i = sum over y_i (dE/df) * (0 if y > 0 else y).
  rng = np.random.default_rng(1)
  x = rng.normal(size=(5, 4))
  g = rng.normal(size=(5, 4))  # upstream dE/df
  a = np.array([0.25, -0.1, 0.7, 0.0])
  layer = PReLU(param_dtype=jnp.float64)

  def energy(params, x):
    return jnp.sum(jnp.asarray(g) * layer.apply({'params': params}, x))

  params = {'negative_slope': jnp.asarray(a)}
  da = jax.grad(energy)(params, jnp.asarray(x))['negative_slope']
  dx = jax.grad(energy, argnums=1)(params, jnp.asarray(x))
  np.testing.assert_allclose(da, np.sum(g * np.where(x > 0, 0.0, x), axis=0), rtol=1e-13)
  np.testing.assert_allclose(dx, g * np.where(x > 0, 1.0, a), rtol=1e-13)


def test_gradient_channel_shared_and_finite_difference(x64):
  rng = np.random.default_rng(2)
  x = rng.normal(size=(3, 7))
  g = rng.normal(size=(3, 7))
  layer = PReLU(channel_shared=True, param_dtype=jnp.float64)
  params = layer.init(jax.random.key(0), jnp.asarray(x))['params']
  assert params['negative_slope'].shape == ()

  def energy(a):
    return jnp.sum(jnp.asarray(g) * layer.apply({'params': {'negative_slope': a}}, x))

  a0 = jnp.float64(0.25)
  da = jax.grad(energy)(a0)
  # dE/da = sum_i sum_{y_i} dE/df * df/da (paper 001, channel-shared form).
  np.testing.assert_allclose(da, np.sum(g * np.minimum(x, 0.0)), rtol=1e-13)
  eps = 1e-6
  fd = (energy(a0 + eps) - energy(a0 - eps)) / (2 * eps)
  np.testing.assert_allclose(da, fd, rtol=1e-7)


def test_gradient_at_zero_is_negative_branch():
  da, dx = jax.grad(prelu, argnums=(1, 0))(0.0, 0.3)
  assert float(dx) == pytest.approx(0.3)
  assert float(da) == 0.0


def test_dtypes(float16_converts):
  x = jnp.ones((2, 3), jnp.bfloat16)
  variables = PReLU().init(jax.random.key(0), x)
  assert variables['params']['negative_slope'].dtype == jnp.float32
  assert PReLU(dtype=jnp.bfloat16).apply(variables, x).dtype == jnp.bfloat16
  assert PReLU().apply(variables, x).dtype == jnp.float32  # promoted, like flax layers
  if float16_converts:  # not on a vector ISA without F16C (tests/conftest.py)
    v16 = PReLU(param_dtype=jnp.float16).init(jax.random.key(0), x)
    assert v16['params']['negative_slope'].dtype == jnp.float16


def test_custom_init_and_in_a_model():
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(4, kernel_init=nn.initializers.ones)(x)
      x = PReLU(negative_slope_init=0.1)(x)
      return nn.Dense(1, kernel_init=nn.initializers.ones)(x)

  x = jnp.ones((2, 3))
  params = Net().init(jax.random.key(0), x)['params']
  np.testing.assert_allclose(params['PReLU_0']['negative_slope'], 0.1)


@pytest.mark.parametrize('bad', [float('nan'), float('inf'), -float('inf')])
def test_non_finite_slope_init(bad):
  with pytest.raises(ValueError, match='negative_slope_init'):
    PReLU(negative_slope_init=bad).init(jax.random.key(0), jnp.ones((2, 3)))


def test_scalar_input_needs_channel_axis():
  with pytest.raises(ValueError, match='channel'):
    PReLU().init(jax.random.key(0), jnp.float32(1.0))
  assert PReLU(channel_shared=True).apply({'params': {'negative_slope': 0.5}}, -2.0) == -1.0
