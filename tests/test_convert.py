"""Tests for geoparam.convert: function-preserving SP <-> GmP parameter conversion."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import geoparam
from geoparam import convert
from tests.conftest import ref_directions


# --- single layers ----------------------------------------------------------------------------


@pytest.mark.parametrize('fan_in', [1, 2, 300])
def test_dense_round_trip_float32(fan_in):
  rng = np.random.default_rng(fan_in)
  kernel = rng.normal(size=(fan_in, 6)).astype(np.float32)
  kernel[-1, :3] = -np.abs(kernel[-1, :3])  # negative last coordinates
  bias = rng.normal(size=6).astype(np.float32)
  params = convert.dense_to_gmp(kernel, bias)
  assert params['theta'].shape == (fan_in - 1, 6)
  assert all(v.dtype == jnp.float32 for v in params.values())
  if fan_in == 1:
    np.testing.assert_array_equal(params['sign'], np.sign(kernel[0]))
  # The formulas: scale = |w|, lam = b / |w|, u(theta) = w / |w|.
  norms = np.linalg.norm(kernel.astype(np.float64), axis=0)
  np.testing.assert_allclose(params['scale'], norms, rtol=1e-6)
  np.testing.assert_allclose(params['lam'], bias / norms, rtol=1e-5, atol=1e-7)
  if fan_in > 1:
    np.testing.assert_allclose(ref_directions(params['theta']), kernel / norms, atol=1e-5)
  k2, b2 = convert.gmp_to_dense(params)
  np.testing.assert_allclose(k2, kernel, rtol=1e-5, atol=1e-5 * np.abs(kernel).max())
  np.testing.assert_allclose(b2, bias, rtol=1e-5, atol=1e-6)


def test_dense_round_trip_float64(x64):
  rng = np.random.default_rng(0)
  kernel = rng.normal(size=(18, 5)) * rng.uniform(1e-3, 1e3, size=5)  # wildly different norms
  bias = rng.normal(size=5)
  params = convert.dense_to_gmp(jnp.asarray(kernel), jnp.asarray(bias))
  assert params['theta'].dtype == jnp.float64
  k2, b2 = convert.gmp_to_dense(params)
  np.testing.assert_allclose(k2, kernel, rtol=1e-11, atol=1e-13 * np.abs(kernel).max())
  np.testing.assert_allclose(b2, bias, rtol=1e-12)


def test_gmp_to_dense_to_gmp_round_trip(x64):
  rng = np.random.default_rng(1)
  theta = rng.uniform(0.2, np.pi - 0.2, size=(7, 4))
  theta[-1] = rng.uniform(0.1, 2 * np.pi - 0.1, size=4)
  params = {'theta': jnp.asarray(theta), 'lam': jnp.asarray(rng.normal(size=4)),
            'scale': jnp.asarray(rng.uniform(0.1, 3, size=4))}
  back = convert.dense_to_gmp(*convert.gmp_to_dense(params))
  for k in params:
    np.testing.assert_allclose(back[k], params[k], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize('activation,act_fn', [('relu', nn.relu), ('leaky_relu', nn.leaky_relu),
                                               (None, None)])
def test_converted_dense_layer_preserves_function(activation, act_fn):
  rng = np.random.default_rng(2)
  kernel = rng.normal(size=(5, 4)).astype(np.float32)
  bias = rng.normal(size=4).astype(np.float32)
  x = rng.normal(size=(30, 5)).astype(np.float32)
  params = convert.dense_to_gmp(kernel, bias, activation=activation)
  out = jax.jit(geoparam.GmPDense(4, activation=act_fn).apply)({'params': params}, x)
  z = x.astype(np.float64) @ kernel + bias
  expected = np.asarray(act_fn(z)) if act_fn is not None else z
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_conv_kernel_shape_round_trip():
  rng = np.random.default_rng(3)
  kernel = rng.normal(size=(3, 2, 4, 5)).astype(np.float32)
  bias = rng.normal(size=5).astype(np.float32)
  params = convert.dense_to_gmp(kernel, bias)
  assert params['theta'].shape == (3 * 2 * 4 - 1, 5)
  k2, b2 = convert.gmp_to_dense(params, kernel_shape=kernel.shape)
  assert k2.shape == kernel.shape
  np.testing.assert_allclose(k2, kernel, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(b2, bias, rtol=1e-5, atol=1e-6)
  # The flattening order is nn.Conv's: the GmP conv computes the same function.
  x = rng.normal(size=(2, 6, 5, 4)).astype(np.float32)
  sp = jax.jit(nn.Conv(5, (3, 2)).apply)({'params': {'kernel': kernel, 'bias': bias}}, x)
  gmp = jax.jit(geoparam.GmPConv(5, (3, 2)).apply)({'params': params}, x)
  np.testing.assert_allclose(gmp, nn.relu(sp), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError):
    convert.gmp_to_dense(params, kernel_shape=(3, 3, 4, 5))


# --- whole models -----------------------------------------------------------------------------


class SPMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, name='hidden_0')(x))
    x = nn.relu(nn.Dense(8, name='hidden_1')(x))
    return nn.Dense(3, name='out')(x)


class GmPMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = geoparam.GmPDense(16, name='hidden_0')(x)
    x = geoparam.GmPDense(8, name='hidden_1')(x)
    return nn.Dense(3, name='out')(x)


class SPCNN(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (2, 2), name='conv_0')(x))
    x = nn.relu(nn.Conv(8, (2, 2), strides=2, padding='VALID', name='conv_1')(x))
    x = x.mean(axis=(1, 2))
    return nn.Dense(2, name='out')(x)


class GmPCNN(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = geoparam.GmPConv(4, (2, 2), name='conv_0')(x)
    x = geoparam.GmPConv(8, (2, 2), strides=2, padding='VALID', name='conv_1')(x)
    x = x.mean(axis=(1, 2))
    return nn.Dense(2, name='out')(x)


def _init(model, x, rng=None):
  """SP params without compiling `init`: shapes from eval_shape, random values (nonzero
  biases, so that lam = b / |w| is exercised)."""
  rng = rng or np.random.default_rng(0)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)['params']

  def draw(path, s):
    if 'bias' in jax.tree_util.keystr(path):
      return jnp.asarray(rng.normal(size=s.shape) * 0.3, s.dtype)
    fan_in = int(np.prod(s.shape[:-1]))
    return jnp.asarray(rng.normal(size=s.shape) / np.sqrt(fan_in), s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _structure(model, x):
  return jax.tree.map(jnp.shape, jax.eval_shape(model.init, jax.random.key(0), x)['params'])


def _apply(model, params, x):
  return jax.jit(model.apply)({'params': params}, x)


def _not_output(path):
  return path[0] != 'out'


def _assert_close(a, b, tol=1e-5):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())


def test_mlp_sp_to_gmp_to_sp_preserves_outputs():
  rng = np.random.default_rng(4)
  x = rng.normal(size=(32, 5)).astype(np.float32)
  sp_params = _init(SPMLP(), x, rng)
  sp_out = _apply(SPMLP(), sp_params, x)

  gmp_params = convert.sp_to_gmp(sp_params, select=_not_output)
  assert set(gmp_params['hidden_0']) == {'theta', 'lam', 'scale'}
  assert set(gmp_params['out']) == {'kernel', 'bias'}  # the output layer stays plain
  np.testing.assert_array_equal(gmp_params['out']['kernel'], sp_params['out']['kernel'])
  # The GmP model accepts the converted tree as is (same structure as its own init).
  assert jax.tree.map(jnp.shape, gmp_params) == _structure(GmPMLP(), x)
  gmp_out = _apply(GmPMLP(), gmp_params, x)
  _assert_close(gmp_out, sp_out)

  back = convert.gmp_to_sp(gmp_params)
  assert jax.tree.map(jnp.shape, back) == jax.tree.map(jnp.shape, sp_params)
  _assert_close(_apply(SPMLP(), back, x), sp_out)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(sp_params)):
    _assert_close(a, b)


def test_cnn_sp_to_gmp_to_sp_preserves_outputs():
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, 7, 7, 2)).astype(np.float32)
  sp_params = _init(SPCNN(), x, rng)
  sp_out = _apply(SPCNN(), sp_params, x)

  gmp_params = convert.sp_to_gmp(sp_params, select=_not_output)
  assert gmp_params['conv_0']['theta'].shape == (2 * 2 * 2 - 1, 4)
  assert jax.tree.map(jnp.shape, gmp_params) == _structure(GmPCNN(), x)
  _assert_close(_apply(GmPCNN(), gmp_params, x), sp_out)

  like = jax.eval_shape(SPCNN().init, jax.random.key(0), x)['params']
  back = convert.gmp_to_sp(gmp_params, like=like)
  assert jax.tree.map(jnp.shape, back) == jax.tree.map(jnp.shape, sp_params)
  _assert_close(_apply(SPCNN(), back, x), sp_out)
  with pytest.raises(ValueError):
    convert.gmp_to_sp(gmp_params, like={'conv_0': like['conv_0']})  # no conv_1 in `like`


def test_fan_in_one_model_round_trip():
  class SP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1, name='out')(nn.relu(nn.Dense(10, name='hidden')(x)))

  class GmP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1, name='out')(geoparam.GmPDense(10, name='hidden')(x))

  rng = np.random.default_rng(6)
  x = np.linspace(-3, 3, 25, dtype=np.float32)[:, None]
  sp_params = _init(SP(), x, rng)
  assert np.any(sp_params['hidden']['kernel'] < 0) and np.any(sp_params['hidden']['kernel'] > 0)
  gmp_params = convert.sp_to_gmp(sp_params, select=_not_output)
  assert set(gmp_params['hidden']) == {'theta', 'lam', 'scale', 'sign'}
  _assert_close(_apply(GmP(), gmp_params, x), _apply(SP(), sp_params, x))
  back = convert.gmp_to_sp(gmp_params)
  _assert_close(back['hidden']['kernel'], sp_params['hidden']['kernel'])
  _assert_close(back['hidden']['bias'], sp_params['hidden']['bias'])


# --- bad input --------------------------------------------------------------------------------


def test_zero_weight_vector_raises():
  kernel = np.ones((4, 3), np.float32)
  kernel[:, 1] = 0.0
  with pytest.raises(ValueError, match='zero'):
    convert.dense_to_gmp(kernel, np.zeros(3, np.float32))
  with pytest.raises(ValueError):
    convert.sp_to_gmp({'layer': {'kernel': kernel, 'bias': np.zeros(3, np.float32)}})
  with pytest.raises(ValueError):
    convert.dense_to_gmp(np.zeros((1, 2), np.float32))  # fan-in 1 too


def test_negative_scale_with_relu_raises_but_linear_converts():
  rng = np.random.default_rng(7)
  params = convert.dense_to_gmp(rng.normal(size=(3, 2)).astype(np.float32))
  params = dict(params, scale=jnp.asarray([1.0, -2.0]))
  with pytest.raises(ValueError, match='scale'):
    convert.gmp_to_dense(params)
  with pytest.raises(ValueError, match='scale'):
    convert.gmp_to_dense(params, activation='leaky_relu')
  with pytest.raises(ValueError):
    convert.gmp_to_sp({'layer': params})
  kernel, bias = convert.gmp_to_dense(params, activation=None)
  x = rng.normal(size=(6, 3)).astype(np.float32)
  np.testing.assert_allclose(
      jax.jit(geoparam.GmPDense(2, activation=None).apply)({'params': params}, x),
      x @ np.asarray(kernel) + np.asarray(bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('activation', ['sigmoid', 'tanh', 'gelu'])
def test_non_homogeneous_activation_raises(activation):
  kernel = np.ones((3, 2), np.float32)
  with pytest.raises(ValueError, match='homogeneous'):
    convert.dense_to_gmp(kernel, activation=activation)
  params = convert.dense_to_gmp(kernel)
  with pytest.raises(ValueError, match='homogeneous'):
    convert.gmp_to_dense(params, activation=activation)
  with pytest.raises(ValueError):
    convert.sp_to_gmp({'l': {'kernel': kernel}}, activation=activation)
  with pytest.raises(ValueError):
    convert.gmp_to_sp({'l': params}, activation=activation)


def test_bad_shapes_raise():
  with pytest.raises(ValueError):
    convert.dense_to_gmp(np.ones((3,), np.float32))
  with pytest.raises(ValueError):
    convert.dense_to_gmp(np.ones((3, 2), np.float32), np.ones((3,), np.float32))
  with pytest.raises(ValueError):
    convert.gmp_to_dense({'theta': jnp.zeros((2, 2))})


# --- bad input: tiny and huge columns, activation functions, containers, select ---------------


@pytest.mark.parametrize('fan_in', [1, 3])
def test_column_below_the_smallest_normal_number_raises(fan_in):
  # Old code: scale flushed to 0 (or a subnormal), lam = inf, theta = 0: a NaN/inf GmP layer.
  kernel = np.ones((fan_in, 3), np.float32)
  kernel[:, 1] = 1e-39  # nonzero, but |w| < np.finfo(float32).tiny = 1.18e-38
  with pytest.raises(ValueError, match=r'kernel columns \[1\] have norm \|w\| .* below the '
                                       r'smallest normal float32 number \(np.finfo\(float32\)'
                                       r'.tiny = 1.175e-38\)'):
    convert.dense_to_gmp(kernel, np.ones(3, np.float32))
  with pytest.raises(ValueError, match=r'layer hidden: kernel columns \[1\]'):
    convert.sp_to_gmp({'hidden': {'kernel': kernel}})


def test_tiny_column_converts_in_float64(x64):
  kernel = np.ones((3, 2))
  kernel[:, 1] = 1e-39  # a normal float64 number
  params = convert.dense_to_gmp(jnp.asarray(kernel), jnp.asarray([1.0, 2.0]))
  for v in params.values():
    assert np.all(np.isfinite(v))
  assert np.all(params['scale'] > 0)
  np.testing.assert_allclose(params['lam'][1], 2.0 / (np.sqrt(3) * 1e-39), rtol=1e-12)


def test_bias_over_norm_overflowing_raises():
  kernel = np.full((3, 2), 1e-30, np.float32)  # normal, but b / |w| = 1e10 / 1.7e-30 > max
  kernel[:, 0] = 1.0
  with pytest.raises(ValueError, match=r'columns \[1\]: lam = b / \|w\| overflows float32'):
    convert.dense_to_gmp(kernel, np.full(2, 1e10, np.float32))


@pytest.mark.parametrize('kernel_value,bias,match', [
    (3e38, None, r'kernel columns \[0, 1\] have norm .* above the largest float32 number'),
    (1.0, [1.0, np.nan], r'bias entries \[1\] are not finite in float32'),
    (1.0, [1.0, 1e39], r'bias entries \[1\] are not finite in float32'),  # inf once cast
])
def test_overflowing_scale_and_non_finite_bias_raise(kernel_value, bias, match):
  # Old code: scale = inf, or lam = NaN / inf, returned silently.
  with pytest.raises(ValueError, match=match):
    convert.dense_to_gmp(np.full((3, 2), kernel_value, np.float32), bias)


@pytest.mark.parametrize('fn,name', [
    (nn.relu, 'relu'), (jax.nn.relu, 'relu'), (nn.leaky_relu, 'leaky_relu'),
    (jax.nn.leaky_relu, 'leaky_relu'), (jax.nn.identity, None),
])
def test_activation_functions_map_to_their_names(fn, name):
  # Old code: "activation=<function relu> is not positively homogeneous".
  rng = np.random.default_rng(8)
  kernel = rng.normal(size=(4, 3)).astype(np.float32)
  bias = rng.normal(size=3).astype(np.float32)
  expected = convert.dense_to_gmp(kernel, bias, activation=name)
  params = convert.dense_to_gmp(kernel, bias, activation=fn)
  for k in expected:
    np.testing.assert_array_equal(params[k], expected[k])
  for a, b in zip(convert.gmp_to_dense(params, activation=fn),
                  convert.gmp_to_dense(params, activation=name)):
    np.testing.assert_array_equal(a, b)
  tree = convert.sp_to_gmp({'h': {'kernel': kernel, 'bias': bias}}, activation=fn)
  np.testing.assert_array_equal(tree['h']['lam'], expected['lam'])
  back = convert.gmp_to_sp(tree, activation=fn)
  np.testing.assert_allclose(back['h']['kernel'], kernel, rtol=1e-5, atol=1e-6)


def test_identity_function_allows_negative_scales_and_leaky_slope_partial_converts():
  params = convert.dense_to_gmp(np.ones((3, 2), np.float32))
  params = dict(params, scale=jnp.asarray([1.0, -2.0]))
  kernel, _ = convert.gmp_to_dense(params, activation=jax.nn.identity)
  np.testing.assert_allclose(kernel[:, 1], -2.0 / np.sqrt(3), rtol=1e-6)
  with pytest.raises(ValueError, match='scale <= 0'):
    convert.gmp_to_dense(params, activation=nn.relu)
  leaky = functools.partial(nn.leaky_relu, negative_slope=0.2)
  rng = np.random.default_rng(9)
  kernel = rng.normal(size=(5, 4)).astype(np.float32)
  bias = rng.normal(size=4).astype(np.float32)
  x = rng.normal(size=(20, 5)).astype(np.float32)
  gm = convert.dense_to_gmp(kernel, bias, activation=leaky)
  out = geoparam.GmPDense(4, activation=leaky).apply({'params': gm}, x)
  np.testing.assert_allclose(out, leaky(x @ kernel + bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('fn', [nn.sigmoid, nn.gelu, lambda z: z, functools.partial(nn.gelu),
                                functools.partial(nn.relu, negative_slope=0.1)])
def test_other_activation_functions_raise_listing_the_accepted_ones(fn):
  kernel = np.ones((3, 2), np.float32)
  match = (r'activation=.* is not a positively homogeneous activation that conversion knows.*'
           r'accepted: .*None \(linear\), or the function jax.nn.relu / flax.linen.relu')
  with pytest.raises(ValueError, match=match):
    convert.dense_to_gmp(kernel, activation=fn)
  params = convert.dense_to_gmp(kernel)
  for call in (lambda: convert.gmp_to_dense(params, activation=fn),
               lambda: convert.sp_to_gmp({'l': {'kernel': kernel}}, activation=fn),
               lambda: convert.gmp_to_sp({'l': params}, activation=fn),
               lambda: convert.sp_to_gmp({}, activation=fn)):  # checked even without layers
    with pytest.raises(ValueError, match=match):
      call()


def _sp_layer():
  return {'kernel': np.ones((3, 2), np.float32), 'bias': np.zeros(2, np.float32)}


@pytest.mark.parametrize('make', [lambda layer: [layer, layer], lambda layer: (layer,),
                                  lambda layer: {'blocks': [layer, layer]},
                                  lambda layer: {'a': {'b': ({'c': layer},)}}])
def test_lists_and_tuples_of_layers_raise(make):
  # Old code returned lists and tuples unchanged: nothing converted, no error.
  with pytest.raises(TypeError, match=r'params must be a nested dict \(Mapping\) of layers.*'
                                      r'got (a )?(list|tuple)'):
    convert.sp_to_gmp(make(_sp_layer()))
  gmp_layer = convert.dense_to_gmp(np.ones((3, 2), np.float32))
  with pytest.raises(TypeError, match=r'params must be a nested dict \(Mapping\).*(list|tuple)'):
    convert.gmp_to_sp(make(gmp_layer))
  # Lists without layers in a dict are left alone, as before.
  assert convert.sp_to_gmp({'steps': [1, 2], 'h': _sp_layer()})['steps'] == [1, 2]


@pytest.mark.parametrize('params', [np.ones(3), None])
def test_params_that_are_no_dict_raise(params):
  with pytest.raises(TypeError, match='params must be a nested dict'):  # old: returned as is
    convert.sp_to_gmp(params)
  with pytest.raises(TypeError, match='params must be a nested dict'):
    convert.gmp_to_sp(params)


@pytest.mark.parametrize('select', [['h'], 'h', ('h',), True])
def test_select_must_be_callable(select):
  # Old code: "'list' object is not callable" from deep in the walk (or nothing for no layers).
  with pytest.raises(TypeError, match='select must be a callable taking a layer path tuple'):
    convert.sp_to_gmp({'h': _sp_layer()}, select=select)


def test_integer_kernel_does_not_truncate_a_float_bias():
  # Old code cast the bias to the kernel's int dtype: 0.5 became 0.
  params = convert.dense_to_gmp(np.ones((3, 2), np.int32), [0.5, 1.5])
  assert jnp.issubdtype(params['lam'].dtype, jnp.floating)
  np.testing.assert_allclose(params['lam'], np.array([0.5, 1.5]) / np.sqrt(3), rtol=1e-6)


def test_gmp_entries_of_the_wrong_shape_or_not_finite_raise():
  params = convert.dense_to_gmp(np.ones((3, 2), np.float32))
  # Old code broadcast a (1,) lam / scale silently and passed NaN scales (nan <= 0 is False).
  with pytest.raises(ValueError, match=r'lam must have shape \(2,\) to match theta of shape '
                                       r'\(2, 2\).*got shape \(1,\)'):
    convert.gmp_to_dense(dict(params, lam=jnp.ones(1)))
  with pytest.raises(ValueError, match=r'scale must have shape \(2,\)'):
    convert.gmp_to_dense(dict(params, scale=jnp.ones(1)))
  with pytest.raises(ValueError, match=r'scale has entries that are not finite \(units \[1\]\)'):
    convert.gmp_to_dense(dict(params, scale=jnp.asarray([1.0, np.nan])))
  with pytest.raises(ValueError, match=r'theta has entries that are not finite \(units \[0\]\)'):
    convert.gmp_to_dense(dict(params, theta=params['theta'].at[1, 0].set(np.inf)))
  with pytest.raises(ValueError, match=r'layer h: unexpected entries \[.bias.\] besides theta'):
    convert.gmp_to_sp({'h': dict(params, bias=jnp.zeros(2))})  # old code dropped 'bias'
  with pytest.raises(TypeError, match="params must be a dict of one GmP layer's entries"):
    convert.gmp_to_dense([params])
  with pytest.raises(ValueError, match=r"layer h: unexpected entries \['extra'\] besides kernel"):
    convert.sp_to_gmp({'h': dict(_sp_layer(), extra=jnp.ones(2))})
  with pytest.raises(ValueError, match='`like` has no SP kernel at h'):
    convert.gmp_to_sp({'h': params}, like={'h': {'theta': params['theta']}})  # old: KeyError
