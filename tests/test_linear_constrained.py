"""Tests for LCWDense and LCWConv."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geoparam import lcw
from geoparam.linen.layers import LCWConv, LCWDense
from geoparam.methods.lcw import kernel_from_v, v_from_kernel


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def normal(shape, seed=0):
  # numpy, not jax.random: each new jax.random shape costs seconds of compile on CPU.
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape))


def random_params(layer, x, seed=1):
  """Parameters of the shapes `layer.init` makes, filled with numpy normals."""
  shapes = jax.eval_shape(layer.init, jax.random.key(0), x)['params']
  leaves, tree = jax.tree.flatten(shapes)
  return jax.tree.unflatten(tree, [normal(l.shape, seed + i) for i, l in enumerate(leaves)])


def test_dense_shapes_and_reference(x64):
  layer = LCWDense(features=5, param_dtype=jnp.float64)
  x = normal((7, 11))
  params = layer.init(jax.random.key(1), x)['params']
  assert jax.tree.map(jnp.shape, params) == {'v': (10, 5), 'bias': (5,)}
  assert params['v'].dtype == jnp.float64
  params = {'v': params['v'], 'bias': jnp.arange(5.0)}
  y = layer.apply({'params': params}, x)
  b = np.asarray(lcw.basis(11, jnp.float64))
  ref = np.asarray(x) @ (b @ np.asarray(params['v'])) + np.arange(5.0)
  np.testing.assert_allclose(y, ref, atol=1e-12)


def test_dense_kernel_sums_to_zero_and_removes_shift(x64):
  # Paper 003 Prop. 3: inputs with mean gamma * 1 give zero-mean pre-activations.
  layer = LCWDense(features=64, use_bias=False, param_dtype=jnp.float64)
  x = jnp.asarray(np.random.default_rng(0).uniform(size=(4096, 100)))  # gamma = 0.5
  params = random_params(layer, x)
  kernel = kernel_from_v(params['v'])
  np.testing.assert_allclose(kernel.sum(axis=0), 0.0, atol=1e-12)
  y = layer.apply({'params': params}, x)
  unit_means = np.asarray(y.mean(axis=0))
  unit_stds = np.asarray(y.std(axis=0))
  assert np.max(np.abs(unit_means) / unit_stds) < 0.1
  # A plain Dense with the same kernel-init shows the shift (stripes of paper 003 Fig. 1).
  y_plain = x @ normal((100, 64), 5)
  assert np.max(np.abs(y_plain.mean(axis=0)) / y_plain.std(axis=0)) > 1.0


def test_dense_init_is_centered_kernel_init(x64):
  init = nn.initializers.lecun_normal()
  layer = LCWDense(features=3, kernel_init=init, param_dtype=jnp.float64)
  x = jnp.ones((1, 6), jnp.float64)
  v = layer.init(jax.random.key(3), x)['params']['v']
  # Flax derives the first parameter's key from the module path: a Dense draws the same kernel.
  w0 = nn.Dense(3, kernel_init=init, param_dtype=jnp.float64).init(
      jax.random.key(3), x)['params']['kernel']
  np.testing.assert_allclose(kernel_from_v(v), w0 - w0.mean(axis=0), atol=1e-12)


def test_dense_dtypes():
  layer = LCWDense(features=3, dtype=jnp.bfloat16)
  x = jnp.ones((2, 4))
  params = layer.init(jax.random.key(0), x)
  assert params['params']['v'].dtype == jnp.float32
  assert layer.apply(params, x).dtype == jnp.bfloat16


def test_dense_grad_wrt_v_matches_basis(x64):
  layer = LCWDense(features=2, use_bias=False, param_dtype=jnp.float64)
  x = normal((3, 4))
  params = random_params(layer, x)
  g = jax.grad(lambda p: jnp.sum(layer.apply({'params': p}, x) ** 2))(params)['v']
  # Chain rule through the explicit basis: dL/dv = B^T dL/dW.
  w = np.asarray(kernel_from_v(params['v']))
  dldw = 2 * np.asarray(x).T @ (np.asarray(x) @ w)
  np.testing.assert_allclose(g, np.asarray(lcw.basis(4, jnp.float64)).T @ dldw, atol=1e-10)


def test_v_from_kernel_roundtrip(x64):
  kernel = normal((3, 3, 2, 4))
  kernel = kernel - kernel.mean(axis=(0, 1, 2))
  v = v_from_kernel(kernel)
  assert v.shape == (17, 4)
  np.testing.assert_allclose(kernel_from_v(v, kernel.shape), kernel, atol=1e-12)


CONV_CASES = [
    dict(kernel_size=(3, 3), padding='SAME'),
    dict(kernel_size=(3, 2), strides=(2, 1), padding='VALID'),
    dict(kernel_size=(3, 3), kernel_dilation=2, padding=((1, 2), (0, 1))),
    dict(kernel_size=(2, 2), feature_group_count=2, padding='CIRCULAR'),
    dict(kernel_size=3, padding='CAUSAL'),  # int kernel_size: 1-D
    dict(kernel_size=(2, 2, 2), padding='SAME'),  # 3-D
    dict(kernel_size=(1, 1), use_bias=False),
]


@pytest.mark.parametrize('case', CONV_CASES)
def test_conv_equals_nn_conv_with_built_kernel(x64, case):
  ndim = 1 if isinstance(case['kernel_size'], int) else len(case['kernel_size'])
  x = normal((2,) + (5,) * ndim + (4,))
  layer = LCWConv(features=6, param_dtype=jnp.float64, **case)
  params = random_params(layer, x)
  groups = case.get('feature_group_count', 1)
  ks = (case['kernel_size'],) if ndim == 1 else case['kernel_size']
  kernel_shape = tuple(ks) + (4 // groups, 6)
  assert params['v'].shape == (int(np.prod(kernel_shape[:-1])) - 1, 6)
  kernel = kernel_from_v(params['v'], kernel_shape)
  np.testing.assert_allclose(kernel.reshape(-1, 6).sum(axis=0), 0.0, atol=1e-12)
  ref_params = {'kernel': kernel}
  if case.get('use_bias', True):
    params = dict(params, bias=jnp.linspace(-1.0, 1.0, 6))
    ref_params['bias'] = params['bias']
  y = layer.apply({'params': params}, x)
  ref = nn.Conv(features=6, param_dtype=jnp.float64, **case).apply({'params': ref_params}, x)
  assert y.shape == ref.shape
  np.testing.assert_allclose(y, ref, atol=1e-12)


def test_conv_against_explicit_correlation(x64):
  # Independent reference: VALID 2-D cross-correlation written with numpy loops.
  x = np.random.default_rng(0).normal(size=(1, 5, 4, 3))
  layer = LCWConv(features=2, kernel_size=(2, 3), padding='VALID', use_bias=False,
                  param_dtype=jnp.float64)
  params = random_params(layer, jnp.asarray(x))
  w = np.asarray(lcw.basis(18, jnp.float64)) @ np.asarray(params['v'])  # (18, 2)
  w = w.reshape(2, 3, 3, 2)
  ref = np.zeros((1, 4, 2, 2))
  for i in range(4):
    for j in range(2):
      ref[0, i, j] = np.einsum('abc,abcf->f', x[0, i:i + 2, j:j + 3], w)
  np.testing.assert_allclose(layer.apply({'params': params}, jnp.asarray(x)), ref, atol=1e-12)


def test_conv_unbatched_and_extra_batch_dims():
  layer = LCWConv(features=3, kernel_size=(3, 3))
  x = jnp.ones((2, 5, 7, 7, 2))
  params = {'params': random_params(layer, x)}
  assert layer.apply(params, x).shape == (2, 5, 7, 7, 3)
  assert layer.apply(params, x[0, 0]).shape == (7, 7, 3)


def test_conv_jit_grad_composes_with_batchnorm():
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x, train: bool):
      x = LCWConv(4, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.relu(x)
      return LCWDense(3)(x.mean(axis=(1, 2)))

  net = Net()
  x = normal((4, 6, 6, 2)).astype(jnp.float32)
  variables = net.init(jax.random.key(1), x, train=False)

  @jax.jit
  def loss(params):
    y, _ = net.apply({'params': params, 'batch_stats': variables['batch_stats']}, x,
                     train=True, mutable=['batch_stats'])
    return jnp.sum(y ** 2)

  grads = jax.grad(loss)(variables['params'])
  assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, variables['params'])
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_dense_bad_inputs():
  with pytest.raises(ValueError, match='fan-in of at least 2'):
    LCWDense(3).init(jax.random.key(0), jnp.ones((2, 1)))
  with pytest.raises(ValueError, match=r'features must be an integer in \[1,'):
    LCWDense(0).init(jax.random.key(0), jnp.ones((2, 3)))


def test_conv_bad_inputs():
  key = jax.random.key(0)
  with pytest.raises(ValueError, match='fan-in of at least 2'):
    LCWConv(3, (1, 1)).init(key, jnp.ones((1, 4, 4, 1)))
  with pytest.raises(ValueError, match='fan-in of at least 2'):  # depthwise 1x1
    LCWConv(2, (1, 1), feature_group_count=2).init(key, jnp.ones((1, 4, 4, 2)))
  with pytest.raises(ValueError, match='spatial dims'):
    LCWConv(3, (3, 3)).init(key, jnp.ones((4, 2)))
  with pytest.raises(ValueError, match='feature_group_count'):
    LCWConv(3, (3, 3), feature_group_count=2).init(key, jnp.ones((1, 4, 4, 3)))
  with pytest.raises(ValueError, match=r'features must be an integer in \[1,'):
    LCWConv(0, (3, 3)).init(key, jnp.ones((1, 4, 4, 3)))
  with pytest.raises(ValueError, match='kernel_size'):
    LCWConv(2, (0, 3)).init(key, jnp.ones((1, 4, 4, 3)))
