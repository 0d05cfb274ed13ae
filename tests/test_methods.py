"""geoparam.methods: the registry, the records, and a new method added from this file alone.

`expwn` (weight normalization with an exponential gain, `kernel = exp(log_scale) * k / |k|`)
is defined and registered here, with no edit under geoparam/; every consumer (the linen
wrapper, the NNX wrapper, both whole-model transforms, conversion of a trained plain model and
bake) must then serve it, checked against float64 numpy references.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import geoparam
import geoparam.nnx as gnnx
from geoparam import methods


# ----------------------------------------------------------------------------- the new method

def _expwn_kernel(kernel, log_scale):
  axes = tuple(range(kernel.ndim - 1))
  return kernel * jax.lax.rsqrt(jnp.sum(kernel * kernel, axis=axes, keepdims=True)) * jnp.exp(
      log_scale)


def expwn() -> methods.Method:
  """Weight norm with gain `exp(log_scale)`: stores `kernel`, `log_scale (F,)`, the layer's bias."""

  def params(kernel_shape, layer, new_key):
    del new_key
    out = {'kernel': methods.Param(tuple(kernel_shape), layer.kernel_init),
           'log_scale': methods.Param((kernel_shape[-1],), nn.initializers.zeros)}
    if layer.use_bias:
      out['bias'] = methods.Param((kernel_shape[-1],), layer.bias_init)
    return out

  def apply(p, kernel_shape):
    del kernel_shape
    return _expwn_kernel(p['kernel'], p['log_scale']), p.get('bias')

  def convert(kernel, bias, dtype, use_bias):
    norms = np.linalg.norm(kernel.reshape(-1, kernel.shape[-1]), axis=0)
    if np.any(norms == 0):
      raise ValueError('a zero kernel column has no expwn form.')
    out = {'kernel': jnp.asarray(kernel, dtype), 'log_scale': jnp.asarray(np.log(norms), dtype)}
    if use_bias:
      out['bias'] = jnp.asarray(bias, dtype)
    elif np.any(bias != 0):
      raise ValueError('the layer has no bias.')
    return out

  def bake(p, kernel_shape):
    del kernel_shape
    kernel = _np_expwn(np.asarray(p['kernel'], np.float64), np.asarray(p['log_scale'], np.float64))
    return kernel, None if 'bias' not in p else np.asarray(p['bias'], np.float64)

  return methods.Method('expwn', params, apply, convert, bake)


def _np_expwn(kernel, log_scale):
  """Float64 numpy reference of expwn's kernel."""
  flat = kernel.reshape(-1, kernel.shape[-1])
  return (flat / np.linalg.norm(flat, axis=0) * np.exp(log_scale)).reshape(kernel.shape)


@pytest.fixture
def registered():
  methods.register('expwn', expwn)
  yield
  del methods.REGISTRY['expwn']


def _x(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float64)


def _f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ----------------------------------------------------------------------------- consumers

def test_linen_wrapper_of_a_new_method_matches_numpy(registered, x64):
  x = _x((6, 5))
  layer = geoparam.Reparam(nn.Dense(3, param_dtype=jnp.float64), 'expwn')
  variables = layer.init(jax.random.key(0), x)
  p = _f64(variables['params'])
  p['log_scale'] = np.linspace(-1.0, 1.0, 3)
  ref = np.asarray(x) @ _np_expwn(p['kernel'], p['log_scale']) + p['bias']
  np.testing.assert_allclose(layer.apply({'params': p}, x), ref, rtol=1e-12, atol=1e-12)
  # A conv, and the same record passed as an object (no registry needed).
  xc = _x((2, 6, 6, 2))
  conv = geoparam.Reparam(nn.Conv(4, (3, 3), param_dtype=jnp.float64), expwn())
  pc = _f64(conv.init(jax.random.key(1), xc)['params'])
  plain = nn.Conv(4, (3, 3), param_dtype=jnp.float64)
  ref = plain.apply({'params': {'kernel': _np_expwn(pc['kernel'], pc['log_scale']),
                                'bias': pc['bias']}}, xc)
  np.testing.assert_allclose(conv.apply({'params': pc}, xc), ref, rtol=1e-12, atol=1e-12)


def test_imn_composes_with_a_new_method(registered, x64, imn_path):
  x = _x((8, 5)) + 2.0
  layer = geoparam.Reparam(nn.Dense(3, param_dtype=jnp.float64), methods.with_imn(expwn()))
  variables = layer.init(jax.random.key(0), x, use_running_average=False)
  y, upd = layer.apply(variables, x, use_running_average=False, mutable=['batch_stats'])
  p = _f64(variables['params'])
  xn = np.asarray(x)
  ref = (xn - xn.mean(0)) @ _np_expwn(p['kernel'], p['log_scale']) + p['bias']
  np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(upd['batch_stats']['input_mean_norm']['mean'], 0.01 * xn.mean(0),
                             rtol=1e-12)


def test_nnx_wrapper_of_a_new_method_matches_numpy(registered, x64):
  x = _x((6, 5))
  dense = nnx.Linear(5, 3, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
  wrapped = gnnx.Reparam(dense, 'expwn')
  np.testing.assert_array_equal(wrapped.params()['kernel'], dense.kernel[...])  # from the layer
  wrapped.log_scale[...] = jnp.linspace(-1.0, 1.0, 3)
  ref = np.asarray(x) @ _np_expwn(np.asarray(dense.kernel[...]), np.linspace(-1.0, 1.0, 3))
  np.testing.assert_allclose(wrapped(x), ref + np.asarray(dense.bias[...]), rtol=1e-12,
                             atol=1e-12)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(wrapped)
  assert set(grads.to_pure_dict()) == {'kernel', 'log_scale', 'bias'}


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8, param_dtype=jnp.float64, name='hidden')(x))
    return nn.Dense(2, param_dtype=jnp.float64, name='head')(x)


def _trained_linen(x, y):
  model = MLP()
  params = model.init(jax.random.key(0), x)['params']
  opt = optax.adam(0.05)
  state = opt.init(params)
  loss = lambda p: jnp.mean((model.apply({'params': p}, x) - y) ** 2)
  for _ in range(20):
    grads = jax.grad(loss)(params)
    updates, state = opt.update(grads, state)
    params = optax.apply_updates(params, updates)
  return model, {'params': params}


def test_linen_transform_converts_a_trained_model_exactly_and_bakes_back(registered, x64):
  x, y = _x((16, 4)), _x((16, 2), seed=1)
  model, trained = _trained_linen(x, y)
  rp = geoparam.reparameterize(model, 'expwn', exclude=['head'])
  converted = geoparam.to_reparameterized(rp, trained, x)
  hidden = _f64(converted['params']['hidden'])
  w = np.asarray(trained['params']['hidden']['kernel'], np.float64)
  np.testing.assert_allclose(hidden['log_scale'], np.log(np.linalg.norm(w, axis=0)), rtol=1e-13)
  np.testing.assert_allclose(_np_expwn(hidden['kernel'], hidden['log_scale']), w, rtol=1e-12)
  np.testing.assert_allclose(rp.apply(converted, x), model.apply(trained, x), rtol=1e-12,
                             atol=1e-12)
  baked = geoparam.bake(rp, converted, x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14),
               baked['params'], trained['params'])


def test_nnx_transform_converts_in_place_exactly_and_bakes_back(registered, x64):
  class NNXMLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(4, 8, param_dtype=jnp.float64, rngs=rngs)
      self.head = nnx.Linear(8, 2, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.hidden(x)))

  x, y = _x((16, 4)), _x((16, 2), seed=1)
  model = NNXMLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
  for _ in range(20):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
  before, kernel = model(x), np.asarray(model.hidden.kernel[...])
  gnnx.reparameterize(model, 'expwn', x, exclude=['head'])
  assert isinstance(model.hidden, gnnx.Reparam) and model.hidden.method.name == 'expwn'
  np.testing.assert_allclose(model.hidden.log_scale[...],
                             np.log(np.linalg.norm(kernel, axis=0)), rtol=1e-13)
  np.testing.assert_allclose(model(x), before, rtol=1e-12, atol=1e-12)
  gnnx.bake(model)
  assert type(model.hidden) is nnx.Linear
  np.testing.assert_allclose(model.hidden.kernel[...], kernel, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(model(x), before, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- the registry

def test_registry_errors_name_the_choices():
  with pytest.raises(ValueError, match=r"method must be one of \('gmp'.*got 'gmpp'"):
    methods.get('gmpp')
  with pytest.raises(TypeError, match=r"'wn' takes the options \['epsilon', 'scale_init'\]"):
    methods.get('wn', eps=1.0)
  with pytest.raises(TypeError, match='build it with them'):
    methods.get(methods.get('wn'), epsilon=0.1)
  with pytest.raises(ValueError, match='momentum must be a finite real number in'):
    methods.get('gmp_imn', momentum=1.5)
  with pytest.raises(ValueError, match='epsilon must be a finite real number >= 0'):
    methods.get('cwn', epsilon=-1.0)
  with pytest.raises(ValueError, match='initialization must be one of'):
    methods.get('gmp', initialization='he')


@pytest.mark.parametrize('name', ['gmp', 'gmp_imn', 'lcw', 'cwn', 'wn'])
def test_convert_then_bake_is_the_identity_float64(name, x64):
  """Every registered method: `bake(convert(k, b)) == (k, b)` and `apply` builds the same
  kernel, for a conv-shaped random kernel (zero-sum per unit where the method needs it)."""
  method = methods.get(name, **({'epsilon': 0.0} if name in ('wn', 'cwn') else {}))
  rng = np.random.default_rng(3)
  kernel = rng.normal(size=(3, 3, 4, 5))
  if name in ('lcw', 'cwn'):
    kernel -= kernel.reshape(-1, 5).mean(0)
  bias = rng.normal(size=5)
  params = method.convert(kernel, bias, jnp.float64, True)
  back_kernel, back_bias = method.bake(params, kernel.shape)
  np.testing.assert_allclose(back_kernel, kernel, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(back_bias, bias, rtol=1e-12, atol=1e-13)
  applied_kernel, applied_bias = method.apply(params, kernel.shape)
  np.testing.assert_allclose(applied_kernel, kernel, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(applied_bias, bias, rtol=1e-12, atol=1e-13)
  shapes = jax.tree.map(jnp.shape, methods.init(method, jax.random.key(0), kernel.shape))
  assert shapes == jax.tree.map(jnp.shape, params)


@pytest.mark.parametrize('name', ['gmp', 'gmp_imn', 'lcw', 'cwn', 'wn'])
def test_a_bias_free_layer_gets_no_bias_term(name, x64):
  """Issue 26 item 2, every registered method: with `use_bias=False` nothing is stored that
  could grow a bias, `convert` refuses a nonzero bias, and `bake` gives no bias back."""
  method = methods.get(name)
  kernel = np.random.default_rng(4).normal(size=(6, 3))
  kernel -= kernel.mean(0)  # zero-sum units, for LCW and CWN
  names = methods.base.bias_names(method, kernel.shape)
  assert names
  free = methods.init(method, jax.random.key(0), kernel.shape, methods.Layer(use_bias=False))
  assert not set(names) & set(free)
  params = method.convert(kernel, np.zeros(3), jnp.float64, False)
  assert set(params) == set(free)
  back_kernel, back_bias = method.bake(params, kernel.shape)
  assert back_bias is None and method.apply(params, kernel.shape)[1] is None
  np.testing.assert_allclose(back_kernel, kernel, rtol=1e-12, atol=1e-13)
  with pytest.raises(ValueError, match='use_bias=False but a nonzero bias'):
    method.convert(kernel, np.ones(3), jnp.float64, False)


@pytest.mark.parametrize('name', ['gmp', 'gmp_imn', 'lcw', 'cwn', 'wn'])
def test_from_kernel_is_convert_traced_and_gain_is_the_unit_norm(name, x64):
  """`from_kernel` (under jit) gives what `convert` gives; where a method has a `gain`, `apply`
  at gain 1 has unit-norm columns and the bias over the norm; only GmP's sign is `fixed`."""
  method = methods.get(name, **({'epsilon': 0.0} if name in ('wn', 'cwn') else {}))
  rng = np.random.default_rng(6)
  kernel = rng.normal(size=(3, 3, 4, 5))
  kernel -= kernel.reshape(-1, 5).mean(0)
  bias = rng.normal(size=5)
  for use_bias in (True, False):
    b = bias if use_bias else np.zeros(5)
    traced = jax.jit(method.from_kernel, static_argnums=2)(kernel, b, use_bias)
    converted = method.convert(kernel, b, jnp.float64, use_bias)
    assert set(traced) == set(converted)
    for k in traced:
      np.testing.assert_allclose(traced[k], converted[k], rtol=1e-12, atol=1e-13)
  assert method.gain == ('scale' if name.startswith('gmp') else None)
  if method.gain:
    params = method.convert(kernel, bias, jnp.float64, True)
    w, b = method.apply({**params, method.gain: np.ones(5)}, kernel.shape)
    norm = np.linalg.norm(kernel.reshape(-1, 5), axis=0)
    np.testing.assert_allclose(np.linalg.norm(np.reshape(w, (-1, 5)), axis=0), 1.0, rtol=1e-12)
    np.testing.assert_allclose(b, bias / norm, rtol=1e-12)
  fixed = [n for n, p in method.params((1, 5), methods.Layer(), lambda: None).items() if p.fixed]
  assert fixed == (['sign'] if name.startswith('gmp') else [])


def _worst_angle(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  cos = np.sum(a * b, 0) / (np.linalg.norm(a, axis=0) * np.linalg.norm(b, axis=0))
  return float(np.max(np.arccos(np.clip(cos, -1.0, 1.0))))


def test_bf16_params_keep_the_angles_in_float32():
  """Issue 26 item 3: with `param_dtype=bfloat16` GmP stores theta in float32 (lam and scale in
  bf16), so at fan-in 4608 the kernel's direction is off by no more than a bf16 kernel's."""
  fan_in, features = 4608, 8
  x = jnp.ones((1, fan_in))
  v32 = geoparam.GmP(nn.Dense(features)).init(jax.random.key(0), x)['params']
  v32 = dict(v32, lam=jnp.zeros(features))  # bias 0: the layer's output on eye(n) is its kernel
  k32 = methods.get('gmp').apply(v32, (fan_in, features))[0]
  bf16 = geoparam.GmP(nn.Dense(features, param_dtype=jnp.bfloat16))
  stored = bf16.init(jax.random.key(0), x)['params']
  assert stored['theta'].dtype == jnp.float32
  assert stored['lam'].dtype == stored['scale'].dtype == jnp.bfloat16
  p16 = {k: v.astype(stored[k].dtype) for k, v in v32.items()}
  k16 = bf16.apply({'params': p16}, jnp.eye(fan_in))  # the kernel the bf16 layer computes with
  bound = _worst_angle(k32, np.asarray(k32.astype(jnp.bfloat16)))
  assert _worst_angle(k32, k16) <= 1.01 * bound + 1e-7
  # Angles stored in bf16 (what param_dtype alone would give) are far off: the reason.
  k_bf16_angles = methods.get('gmp').apply(dict(v32, theta=v32['theta'].astype(jnp.bfloat16)),
                                           (fan_in, features))[0]
  assert _worst_angle(k32, k_bf16_angles) > 10 * bound
  # The same policy in the paper form, the NNX modules and conversion.
  assert geoparam.GmPDense(features, param_dtype=jnp.bfloat16).init(
      jax.random.key(0), x)['params']['theta'].dtype == jnp.float32
  assert gnnx.GmPLinear(64, 4, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)).theta.dtype == (
      jnp.float32)
  converted = methods.get('gmp').convert(np.ones((5, 2)), np.zeros(2), jnp.bfloat16, True)
  assert converted['theta'].dtype == jnp.float32 and converted['scale'].dtype == jnp.bfloat16


def test_with_imn_keeps_the_imn_a_method_has():
  built = methods.get('gmp_imn', momentum=0.5, axis_name='batch')
  assert methods.with_imn(built).imn == methods.IMN(0.5, 'batch')
  assert methods.with_imn(built, momentum=0.9).imn == methods.IMN(0.9, 'batch')
  assert methods.with_imn(methods.get('wn')).imn == methods.IMN()  # the defaults
  with pytest.raises(ValueError, match='momentum'):
    methods.with_imn(built, momentum=1.5)
