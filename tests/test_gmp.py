"""Tests for GmPDense and GmPConv (linen.layers) against float64 numpy references and nn.Conv."""

import functools
import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import geoparam
from geoparam import hyperspherical as hs
from geoparam.methods.gmp import gmp_kernel
from tests.conftest import ref_directions

vmapped = jax.jit(jax.vmap(hs.to_cartesian, in_axes=1, out_axes=1))
_u = jax.jit(hs.to_cartesian)


def _shapes(layer, *args, **kwargs):
  """Variable shapes/dtypes of `layer.init`, without compiling or running it."""
  return jax.eval_shape(functools.partial(layer.init, **kwargs), jax.random.key(0), *args)


def _init(layer, *args, **kwargs):
  return jax.jit(functools.partial(layer.init, **kwargs))(jax.random.key(0), *args)


def _apply(layer, variables, *args, **kwargs):
  return jax.jit(functools.partial(layer.apply, **kwargs))(variables, *args)


def _zeros(shapes):
  """Zero arrays of the given shapes (a fresh running mean is zero)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _relu(z):
  return np.maximum(z, 0.0)


def _random_params(rng, fan_in, features, dtype=np.float64):
  """GmP params far from their defaults: any real angles, nonzero lam, scales of both signs."""
  return {
      'theta': jnp.asarray(rng.normal(scale=2.0, size=(fan_in - 1, features)), dtype),
      'lam': jnp.asarray(rng.normal(size=(features,)), dtype),
      'scale': jnp.asarray(rng.normal(size=(features,)) * 2, dtype),
  }


def _np(params):
  return {k: np.asarray(v, np.float64) for k, v in params.items()}


# --- the direction map: vmapped single-neuron map == the layer's kernel ------------------------


@pytest.mark.parametrize('fan_in', [2, 18, 100])
def test_vmapped_map_equals_gmp_kernel_and_layer(fan_in):
  rng = np.random.default_rng(fan_in)
  features = 7
  params = _random_params(rng, fan_in, features, np.float32)
  kernel = jax.jit(gmp_kernel)(params['theta'])
  u = vmapped(params['theta'])
  assert kernel.shape == (fan_in, features) and kernel.dtype == jnp.float32
  np.testing.assert_allclose(kernel, u, atol=1e-6)
  for j in range(features):  # and column by column, without vmap
    np.testing.assert_allclose(kernel[:, j], _u(params['theta'][:, j]), atol=1e-6)
  # The layer computes with that kernel.
  x = jnp.asarray(rng.normal(size=(5, fan_in)), jnp.float32)
  layer = geoparam.GmPDense(features, activation=None)
  out = jax.jit(layer.apply)({'params': params}, x)
  expected = np.asarray(params['scale'])[None] * (
      np.asarray(x, np.float64) @ np.asarray(u, np.float64) + np.asarray(params['lam'])[None])
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# --- GmPDense ---------------------------------------------------------------------------------


@pytest.mark.parametrize('fan_in,batch', [(2, (4,)), (5, (3, 2)), (33, (6,))])
def test_gmp_dense_matches_numpy_reference(x64, fan_in, batch):
  rng = np.random.default_rng(fan_in)
  features = 4
  params = _random_params(rng, fan_in, features)
  x = rng.normal(size=batch + (fan_in,))
  layer = geoparam.GmPDense(features, param_dtype=jnp.float64)
  out = jax.jit(layer.apply)({'params': params}, jnp.asarray(x))
  assert out.shape == batch + (features,) and out.dtype == jnp.float64
  p = _np(params)
  u = ref_directions(p['theta'])
  expected = p['scale'] * _relu(x @ u + p['lam'])
  np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
  assert np.any(expected == 0) or fan_in == 33  # relu actually clips somewhere


def test_gmp_dense_float32_matches_numpy_reference():
  rng = np.random.default_rng(0)
  params = _random_params(rng, 12, 5, np.float32)
  x = rng.normal(size=(8, 12)).astype(np.float32)
  out = _apply(geoparam.GmPDense(5), {'params': params}, x)
  assert out.dtype == jnp.float32
  p = _np(params)
  expected = p['scale'] * _relu(x.astype(np.float64) @ ref_directions(p['theta']) + p['lam'])
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_gmp_dense_init_shapes():
  variables = _shapes(geoparam.GmPDense(4), jnp.ones((2, 3)))
  assert set(variables) == {'params'}
  assert jax.tree.map(jnp.shape, variables['params']) == {
      'theta': (2, 4), 'lam': (4,), 'scale': (4,)}


def test_gmp_dense_activation_none_is_linear():
  rng = np.random.default_rng(1)
  params = _random_params(rng, 6, 3, np.float32)
  x = rng.normal(size=(50, 6)).astype(np.float32)
  out = np.asarray(_apply(geoparam.GmPDense(3, activation=None), {'params': params}, x))
  p = _np(params)
  expected = p['scale'] * (x @ ref_directions(p['theta']) + p['lam'])
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  assert np.any(expected * np.sign(p['scale']) < 0)  # negative pre-activations pass through
  # Linearity in x: f(a x1 + x2) - f(0) == a (f(x1) - f(0)) + (f(x2) - f(0)).
  linear = jax.jit(geoparam.GmPDense(3, activation=None).apply)
  f = lambda v: np.asarray(linear({'params': params}, v))
  zero = f(np.zeros_like(x[:1]))
  np.testing.assert_allclose(f(2 * x[:1] + x[1:2]) - zero,
                             2 * (f(x[:1]) - zero) + (f(x[1:2]) - zero), atol=1e-5)


def test_gmp_dense_other_activation():
  rng = np.random.default_rng(2)
  params = _random_params(rng, 4, 3, np.float32)
  x = rng.normal(size=(7, 4)).astype(np.float32)
  out = _apply(geoparam.GmPDense(3, activation=jnp.tanh), {'params': params}, x)
  p = _np(params)
  np.testing.assert_allclose(
      out, p['scale'] * np.tanh(x @ ref_directions(p['theta']) + p['lam']), atol=1e-5)


def test_gmp_dense_fan_in_one_sign_is_fixed():
  layer = geoparam.GmPDense(4)
  x = jnp.asarray(np.linspace(-2, 2, 9)[:, None], jnp.float32)
  params = jax.jit(layer.init)(jax.random.key(0), x)['params']
  assert params['theta'].shape == (0, 4)
  params = dict(params, sign=jnp.asarray([0.3, -2.0, 1.0, -1e-3]),
                lam=jnp.asarray([0.5, -0.2, 0.1, 0.0]), scale=jnp.asarray([1.0, 2.0, -1.0, 3.0]))
  out = np.asarray(_apply(layer, {'params': params}, x))
  sign = np.array([1.0, -1.0, 1.0, -1.0])  # only the sign of `sign` is used
  expected = np.asarray(params['scale']) * _relu(
      np.asarray(x) * sign + np.asarray(params['lam']))
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)

  def loss(p):
    return jnp.sum(layer.apply({'params': p}, x) ** 2)

  grads = jax.jit(jax.grad(loss))(params)
  np.testing.assert_array_equal(grads['sign'], 0.0)
  assert np.all(np.abs(np.asarray(grads['lam'])) > 0)
  assert grads['theta'].shape == (0, 4)


# --- GmPConv ----------------------------------------------------------------------------------


def _same_padding(sizes, kernel_size, strides, dilation):
  pads = []
  for length, k, s, d in zip(sizes, kernel_size, strides, dilation):
    out = -(-length // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - length, 0)
    pads.append((total // 2, total - total // 2))
  return pads


def ref_conv(x, kernel, strides, padding, dilation, groups):
  """Explicit-loop N-d convolution (cross-correlation, NHWC / HWIO like lax)."""
  nd = kernel.ndim - 2
  ks = kernel.shape[:nd]
  cin_g, features = kernel.shape[-2:]
  f_g = features // groups
  if padding == 'VALID':
    padding = [(0, 0)] * nd
  elif padding == 'SAME':
    padding = _same_padding(x.shape[1:-1], ks, strides, dilation)
  xp = np.pad(x, [(0, 0)] + list(padding) + [(0, 0)])
  out_sp = [(xp.shape[1 + i] - dilation[i] * (ks[i] - 1) - 1) // strides[i] + 1
            for i in range(nd)]
  out = np.zeros((x.shape[0],) + tuple(out_sp) + (features,))
  for o in itertools.product(*map(range, out_sp)):
    for k in itertools.product(*map(range, ks)):
      idx = tuple(o[i] * strides[i] + k[i] * dilation[i] for i in range(nd))
      patch = xp[(slice(None),) + idx]  # (B, C_in)
      for g in range(groups):
        out[(slice(None),) + o + (slice(g * f_g, (g + 1) * f_g),)] += (
            patch[:, g * cin_g:(g + 1) * cin_g] @ kernel[k][:, g * f_g:(g + 1) * f_g])
  return out


CONV_CASES = [
    # (input shape, features, kernel_size, strides, padding, dilation, groups)
    ((2, 9, 4), 6, (3,), (2,), [(1, 2)], (2,), 2),
    ((1, 10, 2), 4, (2,), (3,), 'VALID', (3,), 2),
    ((2, 7, 6, 4), 4, (3, 2), (2, 1), [(1, 0), (2, 1)], (1, 2), 2),
    ((2, 6, 5, 3), 4, (3, 3), (1, 2), 'SAME', (1, 1), 1),
    ((1, 5, 6, 4), 8, (2, 2), (1, 1), 'VALID', (2, 1), 4),
]


@pytest.mark.parametrize('case', CONV_CASES, ids=lambda c: f'{len(c[2])}d')
def test_gmp_conv_matches_numpy_reference(x64, case):
  shape, features, ks, strides, padding, dilation, groups = case
  rng = np.random.default_rng(sum(shape))
  fan_in = math.prod(ks) * shape[-1] // groups
  params = _random_params(rng, fan_in, features)
  x = rng.normal(size=shape)
  layer = geoparam.GmPConv(features, ks, strides=strides, padding=padding,
                           kernel_dilation=dilation, feature_group_count=groups,
                           param_dtype=jnp.float64)
  out = np.asarray(jax.jit(layer.apply)({'params': params}, jnp.asarray(x)))
  p = _np(params)
  kernel = ref_directions(p['theta']).reshape(tuple(ks) + (shape[-1] // groups, features))
  expected = p['scale'] * _relu(ref_conv(x, kernel, strides, padding, dilation, groups) + p['lam'])
  assert out.shape == expected.shape
  np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('case', [CONV_CASES[0], CONV_CASES[2]], ids=['1d', '2d'])
def test_gmp_conv_equals_nn_conv_with_kernel_from_u(case):
  shape, features, ks, strides, padding, dilation, groups = case
  rng = np.random.default_rng(1 + sum(shape))
  fan_in = math.prod(ks) * shape[-1] // groups
  params = _random_params(rng, fan_in, features, np.float32)
  x = jnp.asarray(rng.normal(size=shape), jnp.float32)
  kwargs = dict(strides=strides, padding=padding, kernel_dilation=dilation,
                feature_group_count=groups)
  out = _apply(geoparam.GmPConv(features, ks, **kwargs), {'params': params}, x)
  kernel = vmapped(params['theta']).reshape(tuple(ks) + (shape[-1] // groups, features))
  z = _apply(nn.Conv(features, ks, **kwargs),
             {'params': {'kernel': kernel, 'bias': params['lam']}}, x)
  np.testing.assert_allclose(out, params['scale'] * nn.relu(z), rtol=1e-6, atol=1e-6)


def test_gmp_conv_init_shapes_and_extra_batch_dims():
  layer = geoparam.GmPConv(8, (3, 3))
  shapes = _shapes(layer, jnp.ones((1, 5, 5, 2)))
  assert jax.tree.map(jnp.shape, shapes['params']) == {
      'theta': (17, 8), 'lam': (8,), 'scale': (8,)}
  variables = {'params': _random_params(np.random.default_rng(0), 18, 8, np.float32)}
  x = jax.random.normal(jax.random.key(1), (2, 3, 5, 5, 2))  # two batch dims
  out = _apply(layer, variables, x)
  assert out.shape == (2, 3, 5, 5, 8)
  np.testing.assert_allclose(out[1, 2], _apply(layer, variables, x[1, 2]), atol=1e-6)


def test_gmp_conv_fan_in_one():
  layer = geoparam.GmPConv(3, (1,))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 1)), jnp.float32)
  params = _init(layer, x)['params']
  assert params['theta'].shape == (0, 3) and params['sign'].shape == (3,)
  out = _apply(layer, {'params': params}, x)
  sign = np.sign(np.asarray(params['sign']))
  np.testing.assert_allclose(
      out, np.asarray(params['scale']) * _relu(np.asarray(x) * sign + np.asarray(params['lam'])),
      atol=1e-6)


# --- input mean normalization option -----------------------------------------------------------


def test_gmp_dense_input_mean_norm_train_and_eval():
  rng = np.random.default_rng(3)
  fan_in, features = 5, 4
  x = (rng.normal(size=(16, fan_in)) + rng.normal(size=fan_in) * 3).astype(np.float32)
  layer = geoparam.GmPDense(features, input_mean_norm=True, momentum=0.9)
  variables = _zeros(_shapes(layer, x, use_running_average=False))
  assert 'batch_stats' in variables
  params = _random_params(rng, fan_in, features, np.float32)
  p = _np(params)
  u = ref_directions(p['theta'])
  mu = x.astype(np.float64).mean(axis=0)
  out, updates = _apply(layer, {'params': params, 'batch_stats': variables['batch_stats']}, x,
                        use_running_average=False, mutable=['batch_stats'])
  np.testing.assert_allclose(out, p['scale'] * _relu((x - mu) @ u + p['lam']), atol=1e-5)
  running = np.asarray(jax.tree.leaves(updates['batch_stats'])[0])
  np.testing.assert_allclose(running, 0.1 * mu, rtol=1e-5, atol=1e-6)
  # Evaluation uses the running mean, whatever the batch.
  stats = jax.tree.map(lambda v: jnp.full_like(v, 0.0) + jnp.arange(fan_in, dtype=v.dtype),
                       updates['batch_stats'])
  out_eval = _apply(layer, {'params': params, 'batch_stats': stats}, x[:3],
                    use_running_average=True)
  expected = p['scale'] * _relu((x[:3] - np.arange(fan_in)) @ u + p['lam'])
  np.testing.assert_allclose(out_eval, expected, atol=1e-5)


def test_gmp_conv_input_mean_norm_train():
  rng = np.random.default_rng(4)
  x = (rng.normal(size=(2, 6, 6, 3)) + np.array([5.0, -2.0, 1.0])).astype(np.float32)
  layer = geoparam.GmPConv(4, (3, 3), padding='SAME', input_mean_norm=True)
  variables = _zeros(_shapes(layer, x, use_running_average=False))
  params = _random_params(rng, 27, 4, np.float32)
  out, _ = _apply(layer, {'params': params, 'batch_stats': variables['batch_stats']}, x,
                  use_running_average=False, mutable=['batch_stats'])
  p = _np(params)
  xc = x.astype(np.float64) - x.astype(np.float64).mean(axis=(0, 1, 2))
  kernel = ref_directions(p['theta']).reshape(3, 3, 3, 4)
  expected = p['scale'] * _relu(ref_conv(xc, kernel, (1, 1), 'SAME', (1, 1), 1) + p['lam'])
  np.testing.assert_allclose(out, expected, atol=2e-5)


# --- dtypes -----------------------------------------------------------------------------------


def test_dtype_and_param_dtype():
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  variables = {'params': _random_params(rng, 6, 3, np.float32)}
  out = _apply(geoparam.GmPDense(3, dtype=jnp.bfloat16), variables, x)
  assert out.dtype == jnp.bfloat16
  ref32 = _apply(geoparam.GmPDense(3), variables, x)
  assert ref32.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float32), ref32, rtol=5e-2, atol=5e-2)

  xc = jnp.asarray(rng.normal(size=(2, 5, 5, 2)), jnp.float32)
  variables = {'params': _random_params(rng, 18, 3, np.float32)}
  out = _apply(geoparam.GmPConv(3, (3, 3), dtype=jnp.bfloat16), variables, xc)
  assert out.dtype == jnp.bfloat16
  ref32 = _apply(geoparam.GmPConv(3, (3, 3)), variables, xc)
  np.testing.assert_allclose(np.asarray(out, np.float32), ref32, rtol=5e-2, atol=5e-2)

  for layer, xs in [(geoparam.GmPDense(3), x), (geoparam.GmPConv(3, (3, 3)), xc)]:
    shapes = _shapes(layer, xs)
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(shapes))
    shapes = _shapes(layer.clone(param_dtype=jnp.bfloat16), xs)
    # Issue 26: the angles stay float32 (their rounding compounds through the map).
    assert {k: v.dtype for k, v in shapes['params'].items()} == {
        'theta': jnp.float32, 'lam': jnp.bfloat16, 'scale': jnp.bfloat16}


def test_float64_params_and_inputs(x64):
  x = jnp.ones((2, 4), jnp.float64)
  for layer, xs in [(geoparam.GmPDense(3, param_dtype=jnp.float64), x),
                    (geoparam.GmPConv(3, (2,), param_dtype=jnp.float64), x[..., None])]:
    variables = _init(layer, xs)
    assert all(v.dtype == jnp.float64 for v in jax.tree.leaves(variables))
    assert _apply(layer, variables, xs).dtype == jnp.float64


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize('features', [0, -1])
def test_features_must_be_positive(features):
  with pytest.raises(ValueError, match='features'):
    _shapes(geoparam.GmPDense(features), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match='features'):
    _shapes(geoparam.GmPConv(features, (3,)), jnp.ones((2, 5, 3)))


def test_fan_in_mismatch_with_existing_params():
  # Traced with eval_shape: the check runs while tracing, nothing is compiled.
  dense = geoparam.GmPDense(4)
  variables = _shapes(dense, jnp.ones((2, 3)))
  jax.eval_shape(dense.apply, variables, jnp.ones((2, 3)))  # the right fan-in is fine
  with pytest.raises(ValueError, match='fan_in'):
    jax.eval_shape(dense.apply, variables, jnp.ones((2, 5)))
  conv = geoparam.GmPConv(4, (3,))
  variables = _shapes(conv, jnp.ones((2, 6, 2)))
  with pytest.raises(ValueError, match='fan_in'):
    jax.eval_shape(conv.apply, variables, jnp.ones((2, 6, 3)))


def test_kernel_size_rank_must_fit_input_rank():
  with pytest.raises(ValueError, match='kernel_size'):
    _shapes(geoparam.GmPConv(2, (3, 3)), jnp.ones((5, 2)))
  with pytest.raises(ValueError, match='kernel_size'):
    _shapes(geoparam.GmPConv(2, (3, 3, 3)), jnp.ones((2, 5, 5)))
  with pytest.raises(ValueError, match='kernel_size'):
    _shapes(geoparam.GmPConv(2, 3), jnp.ones((2, 5, 1)))


def test_feature_group_count_must_divide():
  with pytest.raises(ValueError, match='feature_group_count'):
    _shapes(geoparam.GmPConv(4, (3,), feature_group_count=2), jnp.ones((1, 5, 3)))


def test_sgd_moves_the_kernel_r_squared_times_faster(x64):
  """Why careless GmP needs small SGD rates (docs/robustness.md): with a loss linear in the
  outputs, d loss / d theta at radius r is r times its value at r = 1, so one SGD step on
  theta moves the kernel `r u(theta)` r^2 times as far (to first order), while the radius's
  own gradient does not depend on r."""
  x = jax.random.normal(jax.random.key(1), (16, 5), jnp.float64)
  model = geoparam.GmPDense(3, param_dtype=jnp.float64)
  params = {**model.init(jax.random.key(0), x)['params'], 'lam': jnp.full((3,), 0.3)}
  weights = jax.random.normal(jax.random.key(2), (16, 3), jnp.float64)
  with_r = lambda r: {**params, 'scale': jnp.full((3,), r)}
  grads = {r: jax.grad(lambda p: jnp.sum(model.apply({'params': p}, x) * weights))(with_r(r))
           for r in (1.0, 5.0)}
  np.testing.assert_allclose(grads[5.0]['theta'], 5 * grads[1.0]['theta'], rtol=1e-12)
  np.testing.assert_allclose(grads[5.0]['scale'], grads[1.0]['scale'], rtol=1e-12)
  # The kernel's first-order move under the step -lr * g: r * (d u / d theta)(-lr * g).
  jacobian = jax.jacrev(gmp_kernel)(params['theta'])  # (fan_in, 3, fan_in - 1, 3)
  moved = {r: r * jnp.einsum('ijkl,kl->ij', jacobian, -0.1 * grads[r]['theta'])
           for r in (1.0, 5.0)}
  assert float(jnp.max(jnp.abs(moved[1.0]))) > 1e-3  # some unit is active and moves
  np.testing.assert_allclose(moved[5.0], 25 * moved[1.0], rtol=1e-10, atol=1e-14)
