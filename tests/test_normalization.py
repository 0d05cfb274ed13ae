"""Tests for geoparam.normalization (IMN, MBN) and the WN baseline built from nn.WeightNorm."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import geoparam


def _data(rng, shape):
  """Data with a large, feature-dependent mean (a wrong centring cannot hide)."""
  return (rng.normal(size=shape) + rng.normal(scale=5.0, size=shape[-1])).astype(np.float32)


def _train(module, variables, x):
  return jax.jit(functools.partial(module.apply, use_running_average=False,
                                   mutable=['batch_stats']))(variables, x)


def _eval(module, variables, x):
  return jax.jit(functools.partial(module.apply, use_running_average=True))(variables, x)


# --- InputMeanNorm ----------------------------------------------------------------------------


@pytest.mark.parametrize('shape', [(16, 5), (3, 4, 5), (2, 6, 7, 3)])
def test_imn_training_output_has_zero_batch_mean(shape):
  rng = np.random.default_rng(len(shape))
  x = _data(rng, shape)
  imn = geoparam.InputMeanNorm()
  variables = imn.init(jax.random.key(0), x, use_running_average=False)
  y, _ = _train(imn, variables, x)
  assert y.shape == x.shape and y.dtype == x.dtype
  axes = tuple(range(len(shape) - 1))
  np.testing.assert_allclose(np.asarray(y, np.float64).mean(axis=axes), 0.0, atol=1e-5)
  np.testing.assert_allclose(y, x - x.astype(np.float64).mean(axis=axes), atol=1e-5)


def test_imn_has_no_params_and_init_leaves_stats_at_zero():
  x = _data(np.random.default_rng(0), (8, 3))
  variables = geoparam.InputMeanNorm().init(jax.random.key(0), x, use_running_average=False)
  assert set(variables) == {'batch_stats'}
  np.testing.assert_array_equal(jax.tree.leaves(variables['batch_stats'])[0], 0.0)


def test_imn_eval_uses_running_mean():
  rng = np.random.default_rng(1)
  x = _data(rng, (6, 4))
  imn = geoparam.InputMeanNorm()
  variables = imn.init(jax.random.key(0), x, use_running_average=False)
  mu = rng.normal(size=4).astype(np.float32)
  variables = {'batch_stats': jax.tree.map(lambda v: jnp.asarray(mu), variables['batch_stats'])}
  y = _eval(imn, variables, x)
  np.testing.assert_allclose(y, x - mu, atol=1e-6)
  # Not the batch mean: with one example, eval output is not zero.
  assert np.all(np.abs(np.asarray(_eval(imn, variables, x[:1]))) > 0)
  # The field can be set on the module instead of at call time.
  y_field = geoparam.InputMeanNorm(use_running_average=True).apply(variables, x)
  np.testing.assert_allclose(y_field, y, atol=0)


@pytest.mark.parametrize('momentum', [0.0, 0.5, 0.9, 1.0])
def test_imn_running_mean_momentum_semantics(momentum):
  rng = np.random.default_rng(2)
  imn = geoparam.InputMeanNorm(momentum=momentum)
  batches = [_data(rng, (5, 2, 3)) for _ in range(4)]
  variables = imn.init(jax.random.key(0), batches[0], use_running_average=False)
  m = np.zeros(3)
  for x in batches:
    _, updates = _train(imn, variables, x)
    variables = updates
    m = momentum * m + (1 - momentum) * x.astype(np.float64).mean(axis=(0, 1))
    np.testing.assert_allclose(jax.tree.leaves(variables['batch_stats'])[0], m,
                               rtol=1e-5, atol=1e-5)


def test_imn_running_mean_converges_to_data_mean():
  rng = np.random.default_rng(3)
  mu = rng.normal(scale=4.0, size=3)
  imn = geoparam.InputMeanNorm(momentum=0.9)
  variables = imn.init(jax.random.key(0), jnp.zeros((32, 3)), use_running_average=False)
  step = jax.jit(functools.partial(imn.apply, use_running_average=False, mutable=['batch_stats']))
  for _ in range(300):
    _, variables = step(variables, (rng.normal(size=(32, 3)) + mu).astype(np.float32))
  # Stationary noise of the running mean: sd = sqrt((1 - m) / (1 + m)) / sqrt(32) ~ 0.04.
  np.testing.assert_allclose(jax.tree.leaves(variables['batch_stats'])[0], mu, atol=0.25)
  y = _eval(imn, variables, (rng.normal(size=(4000, 3)) + mu).astype(np.float32))
  np.testing.assert_allclose(np.asarray(y).mean(axis=0), 0.0, atol=0.3)


def test_imn_axis_name_averages_over_the_named_axis():
  rng = np.random.default_rng(4)
  x = _data(rng, (2, 8, 3))  # two "devices" with different data
  x[1] += 10.0
  imn = geoparam.InputMeanNorm(axis_name='d')
  variables = geoparam.InputMeanNorm().init(jax.random.key(0), x[0], use_running_average=False)
  y, _ = jax.vmap(
      lambda xb: imn.apply(variables, xb, use_running_average=False, mutable=['batch_stats']),
      axis_name='d')(x)
  np.testing.assert_allclose(y, x - x.astype(np.float64).mean(axis=(0, 1)), atol=1e-4)


@pytest.mark.parametrize('module', [geoparam.InputMeanNorm, geoparam.MeanOnlyBatchNorm])
def test_init_with_axis_name_outside_the_mapped_context(module):
  # Like nn.BatchNorm (which drops axis_name while initializing), a model holding a module with
  # axis_name can be initialized outside shard_map/pmap, e.g. by `jax.jit(model.init)`.
  x = jnp.ones((4, 3))
  nn.BatchNorm(axis_name='d').init(jax.random.key(0), x, use_running_average=False)
  variables = module(axis_name='d').init(jax.random.key(0), x, use_running_average=False)
  np.testing.assert_array_equal(variables['batch_stats']['mean'], 0.0)


def test_imn_bad_momentum_and_shapes():
  with pytest.raises(ValueError, match='momentum'):
    geoparam.InputMeanNorm(momentum=1.5).init(jax.random.key(0), jnp.ones((4, 2)),
                                              use_running_average=False)
  with pytest.raises(ValueError):
    geoparam.InputMeanNorm().init(jax.random.key(0), jnp.ones((4,)), use_running_average=False)


# --- MeanOnlyBatchNorm ------------------------------------------------------------------------


def test_mbn_train_is_centred_plus_bias_and_eval_uses_running_mean():
  rng = np.random.default_rng(5)
  x = _data(rng, (2, 5, 5, 3))
  mbn = geoparam.MeanOnlyBatchNorm(momentum=0.8)
  variables = mbn.init(jax.random.key(0), x, use_running_average=False)
  assert jax.tree.map(jnp.shape, variables) == {'batch_stats': {'mean': (3,)},
                                                'params': {'bias': (3,)}}
  bias = rng.normal(size=3).astype(np.float32)
  variables = {'params': {'bias': jnp.asarray(bias)}, 'batch_stats': variables['batch_stats']}
  y, updates = _train(mbn, variables, x)
  mu = x.astype(np.float64).mean(axis=(0, 1, 2))
  np.testing.assert_allclose(y, x - mu + bias, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y).mean(axis=(0, 1, 2)), bias, atol=1e-5)
  np.testing.assert_allclose(updates['batch_stats']['mean'], 0.2 * mu, rtol=1e-5)
  y_eval = _eval(mbn, {'params': variables['params'], **updates}, x)
  np.testing.assert_allclose(y_eval, x - 0.2 * mu + bias, atol=1e-5)
  # The bias is learned: it gets the gradient of the output.
  grad = jax.grad(lambda p: jnp.sum(mbn.apply({'params': p, **updates}, x,
                                              use_running_average=True)))(variables['params'])
  np.testing.assert_allclose(grad['bias'], np.prod(x.shape[:-1]), rtol=1e-6)


def test_mbn_without_bias():
  x = _data(np.random.default_rng(6), (10, 2))
  mbn = geoparam.MeanOnlyBatchNorm(use_bias=False)
  variables = mbn.init(jax.random.key(0), x, use_running_average=False)
  assert 'params' not in variables
  y, _ = _train(mbn, variables, x)
  np.testing.assert_allclose(y, x - x.astype(np.float64).mean(axis=0), atol=1e-5)


# --- WN baseline ------------------------------------------------------------------------------


@pytest.mark.parametrize('fan_in,features', [(1, 3), (7, 4)])
def test_weight_norm_dense_is_g_v_over_norm_v(fan_in, features):
  rng = np.random.default_rng(fan_in)
  model = nn.WeightNorm(nn.Dense(features))
  x = rng.normal(size=(5, fan_in)).astype(np.float32)
  params = model.init(jax.random.key(0), x)['params']
  # Move every parameter away from its default so that g, v and b all matter.
  params = jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape) * 2, p.dtype), params)
  out = model.apply({'params': params}, x)
  v = np.asarray(params['layer_instance']['kernel'], np.float64)
  b = np.asarray(params['layer_instance']['bias'], np.float64)
  (g,) = [np.asarray(leaf, np.float64) for path, leaf in
          jax.tree_util.tree_flatten_with_path(params)[0] if 'scale' in jax.tree_util.keystr(path)]
  assert g.shape == (features,)
  w = g[None, :] * v / np.linalg.norm(v, axis=0, keepdims=True)  # per output unit
  np.testing.assert_allclose(out, x.astype(np.float64) @ w + b, rtol=1e-5, atol=1e-5)
