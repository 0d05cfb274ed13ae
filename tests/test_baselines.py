"""Tests for CWN and the standardization layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geoparam.linen.layers import CWNConv, CWNDense, StandardizationLayer
from geoparam.methods.cwn import centered_weight_norm


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def normal(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def test_cwn_dense_against_numpy(x64):
  rng = np.random.default_rng(0)
  k = rng.normal(size=(6, 4)) + 2.0
  g = rng.uniform(0.5, 2.0, size=(4,))
  b = rng.normal(size=(4,))
  x = rng.normal(size=(5, 6))
  c = k - k.mean(axis=0)
  w = g * c / np.linalg.norm(c, axis=0)
  layer = CWNDense(4, param_dtype=jnp.float64)
  y = layer.apply({'params': {'kernel': k, 'scale': g, 'bias': b}}, jnp.asarray(x))
  np.testing.assert_allclose(y, x @ w + b, rtol=1e-12)
  np.testing.assert_allclose(w.sum(axis=0), 0.0, atol=1e-12)


def test_cwn_init_shapes():
  layer = CWNDense(4, kernel_init=nn.initializers.ones)
  params = layer.init(jax.random.key(0), jnp.ones((1, 3)))['params']
  assert jax.tree.map(jnp.shape, params) == {'kernel': (3, 4), 'scale': (4,), 'bias': (4,)}
  np.testing.assert_array_equal(params['scale'], 1.0)


def test_cwn_conv_equals_nn_conv_with_normalized_kernel(x64):
  layer = CWNConv(6, (3, 3), strides=2, feature_group_count=2, param_dtype=jnp.float64)
  x = normal((2, 7, 7, 4))
  k, g, b = normal((3, 3, 2, 6), 1), normal((6,), 2), normal((6,), 3)
  y = layer.apply({'params': {'kernel': k, 'scale': g, 'bias': b}}, x)
  kn = np.asarray(k) - np.asarray(k).mean(axis=(0, 1, 2))
  kn = kn / np.linalg.norm(kn.reshape(-1, 6), axis=0) * np.asarray(g)
  ref = nn.Conv(6, (3, 3), strides=2, feature_group_count=2, param_dtype=jnp.float64).apply(
      {'params': {'kernel': kn, 'bias': b}}, x)
  np.testing.assert_allclose(y, ref, atol=1e-12)
  norms = np.linalg.norm(centered_weight_norm(k, g).reshape(-1, 6), axis=0)
  np.testing.assert_allclose(norms, np.abs(np.asarray(g)), rtol=1e-10)


def test_cwn_bad_inputs():
  with pytest.raises(ValueError, match='fan-in of at least 2'):
    CWNDense(2).init(jax.random.key(0), jnp.ones((1, 1)))
  with pytest.raises(ValueError, match='fan-in of at least 2'):
    CWNConv(2, (1, 1)).init(jax.random.key(0), jnp.ones((1, 3, 3, 1)))
  with pytest.raises(ValueError, match='feature_group_count'):
    CWNConv(3, (3, 3), feature_group_count=2).init(jax.random.key(0), jnp.ones((1, 3, 3, 2)))


def test_standardization_layer_train_and_eval(x64):
  rng = np.random.default_rng(0)
  a = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(256, 5)) * 2 + 1))
  sl = StandardizationLayer(param_dtype=jnp.float64)
  variables = sl.init(jax.random.key(0), a, use_running_average=False)
  assert 'params' not in variables
  y, updates = sl.apply(variables, a, use_running_average=False, mutable=['batch_stats'])
  np.testing.assert_allclose(y.mean(axis=0), 0.0, atol=1e-10)
  np.testing.assert_allclose(y.var(axis=0), 1.0, rtol=1e-3)  # epsilon = 1e-5
  stats = updates['batch_stats']['norm']
  np.testing.assert_allclose(stats['mean'], 0.01 * np.asarray(a).mean(axis=0), rtol=1e-10)
  # Eval mode uses the running stats: initial (0, 1) gives the identity up to epsilon.
  y_eval = sl.apply(variables, a, use_running_average=True)
  np.testing.assert_allclose(y_eval, a / np.sqrt(1 + 1e-5), rtol=1e-7)
