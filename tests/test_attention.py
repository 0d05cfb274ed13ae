"""Layers with several output axes (attention's q/k/v/out projections), every method, exactly.

A method sees a DenseGeneral/LinearGeneral kernel `(*contracted, *features)` as
`(*contracted, prod(features))`: its units are all the layer's outputs, their fan-in the
contracted axes. Here: the wrapped layer against float64 numpy einsums, trained attention
models (linen `nn.MultiHeadDotProductAttention`, NNX `nnx.MultiHeadAttention`) converted and
baked back, sharding names, and the kernel layers the transforms refuse by name.
"""

import math

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam
import geoparam.nnx as gnnx
from conftest import ref_to_cartesian

METHODS = ('gmp', 'gmp_imn', 'lcw', 'cwn', 'wn')


def _np_kernel(method, params, fan_in):
  """Float64 numpy reference of a method's `(kernel (fan_in, F), bias (F,))`, by its formula."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  if method.startswith('gmp'):
    u = np.stack([ref_to_cartesian(t) for t in p['theta'].T], axis=1)
    return u * p['scale'], p['scale'] * p['lam']
  if method == 'lcw':
    return np.asarray(geoparam.lcw.basis(fan_in, jnp.float64)) @ p['v'], p['bias']
  k = p['kernel'].reshape(fan_in, -1)
  if method == 'cwn':
    k = k - k.mean(0)
  return p['scale'] * k / np.sqrt(np.sum(k * k, 0) + 1e-12), p['bias']


DENSE_GENERAL = [  # (features, axis, input shape): a q projection; two axes in, two out
  ((2, 4), -1, (3, 5, 6)),
  ((2, 4), (-2, -1), (3, 5, 3, 2)),
]


@pytest.mark.parametrize('method,features,axis,shape', [
    (m,) + case for m in METHODS for case in DENSE_GENERAL
    if m in ('gmp', 'lcw') or case is DENSE_GENERAL[1]])  # every method on two axes in and out
def test_dense_general_with_tuple_features_equals_float64_einsum(x64, method, features, axis,
                                                                 shape):
  x = jax.random.normal(jax.random.key(0), shape, jnp.float64) + 0.3
  dense = nn.DenseGeneral(features, axis=axis, param_dtype=jnp.float64)
  layer = geoparam.Reparam(dense, method)
  variables = layer.init(jax.random.key(1), x, use_running_average=False)
  contracted = (shape[-1],) if axis == -1 else shape[-2:]
  fan_in, units = math.prod(contracted), math.prod(features)
  params = variables['params']
  # The method's units are every output: its variables are those of a (fan_in, 8) kernel.
  assert params['theta' if 'gmp' in method else 'v' if method == 'lcw' else 'kernel'].shape == (
      (fan_in - 1, units) if method in ('gmp', 'gmp_imn', 'lcw') else contracted + (units,))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  params = jax.tree.unflatten(tree, [a + 0.5 * jax.random.normal(k, a.shape, a.dtype)
                                     for a, k in zip(leaves, keys)])
  variables = {**variables, 'params': params}
  y, _ = layer.apply(variables, x, use_running_average=False, mutable=['batch_stats'])
  kernel, bias = _np_kernel(method, params, fan_in)
  kernel, bias = kernel.reshape(contracted + features), bias.reshape(features)
  xs = np.asarray(x)
  if method == 'gmp_imn':  # the batch mean of the contracted axes, per position of them
    xs = xs - xs.mean(axis=tuple(range(xs.ndim - len(contracted))), keepdims=True)
  spec = 'btc,chd->bthd' if axis == -1 else 'btij,ijhd->bthd'
  want = np.einsum(spec, xs, kernel) + bias
  np.testing.assert_allclose(y, want, rtol=1e-11, atol=1e-12)
  # The plain DenseGeneral with the method's (kernel, bias) in its own layout computes it too.
  plain = dense.apply({'params': {'kernel': kernel, 'bias': bias}}, jnp.asarray(xs))
  np.testing.assert_allclose(plain, want, rtol=1e-11, atol=1e-12)


# ----------------------------------------------------------------------------- whole models

class Block(nn.Module):
  """Self-attention (2 heads of 4) with a residual, then a GELU MLP and a head."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, name='attn')(x)
    return nn.Dense(3, name='head')(nn.gelu(nn.Dense(16, name='mlp')(x)))


def _centred(params):
  """Every unit's weights (over the contracted axes) summing to zero: LCW/CWN-convertible."""
  def centre(path, leaf):
    keys = [getattr(k, 'key', None) for k in path]
    if keys[-1] != 'kernel':
      return leaf
    contracted = (0, 1) if keys[-2] == 'out' else (0,)
    return leaf - leaf.mean(axis=contracted, keepdims=True)
  return jax.tree_util.tree_map_with_path(centre, params)


def _rel(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


@pytest.fixture(scope='module')
def trained_block():
  model = Block()
  x = jax.random.normal(jax.random.key(0), (4, 5, 6)) + 0.5
  y = jax.random.normal(jax.random.key(1), (4, 5, 3))
  params = model.init(jax.random.key(2), x)['params']
  tx = optax.adam(1e-2)

  @jax.jit
  def step(params, opt):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply({'params': p}, x) - y) ** 2))(
        params)
    updates, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  opt = tx.init(params)
  losses = []
  for _ in range(5):
    params, opt, loss = step(params, opt)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  return model, {'params': params}, x


@pytest.mark.parametrize('method', METHODS)
def test_linen_attention_model_converts_and_bakes_exactly(trained_block, method):
  model, sp, x = trained_block
  if method in ('lcw', 'cwn'):
    sp = {'params': _centred(sp['params'])}
  ref = model.apply(sp, x)
  rp = geoparam.reparameterize(model, method)
  new = geoparam.to_reparameterized(rp, sp, x)
  assert _rel(rp.apply(new, x), ref) <= 1e-5, method
  query = new['params']['attn']['query']
  assert (query['theta'].shape if 'theta' in query else query['v'].shape if 'v' in query
          else query['kernel'].shape)[-1] == 8  # a unit is one (head, dim) output
  if method == 'gmp_imn':  # the out projection's mean is over its (heads, head_dim) input
    assert new['batch_stats']['attn']['out']['input_mean_norm']['mean'].shape == (8,)
  baked = geoparam.bake(rp, new, x)
  assert jax.tree.structure(baked) == jax.tree.structure(sp)
  assert jax.tree.map(jnp.shape, baked) == jax.tree.map(jnp.shape, sp)
  assert _rel(model.apply(baked, x), ref) <= 1e-5, method


class NNXBlock(nnx.Module):
  """`Block` in NNX: `nnx.MultiHeadAttention` (q/k/v/out LinearGeneral), a GELU MLP, a head."""

  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=6, qkv_features=8,
                                       decode=False, rngs=rngs)
    self.mlp = nnx.Linear(6, 16, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    return self.head(nnx.gelu(self.mlp(x)))


@pytest.fixture(scope='module')
def trained_nnx_block():
  """`NNXBlock` trained 3 Adam steps, split (each test merges its own copy), and its input."""
  model = NNXBlock(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (4, 5, 6)) + 0.5
  y = jax.random.normal(jax.random.key(1), (4, 5, 3))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  step = nnx.jit(lambda m, o: o.update(m, nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)))
  for _ in range(3):
    step(model, opt)
  return nnx.split(model), x


@pytest.mark.parametrize('method', METHODS)
def test_nnx_attention_model_reparameterizes_and_bakes_in_place_exactly(trained_nnx_block,
                                                                        method):
  (graphdef, state), x = trained_nnx_block
  model = nnx.merge(graphdef, jax.tree.map(jnp.array, state))  # a copy of its own
  if method in ('lcw', 'cwn'):
    for layer, contracted in [(model.attn.query, (0,)), (model.attn.key, (0,)),
                              (model.attn.value, (0,)), (model.attn.out, (0, 1)),
                              (model.mlp, (0,)), (model.head, (0,))]:
      k = layer.kernel[...]
      layer.kernel[...] = k - k.mean(axis=contracted, keepdims=True)
  ref = model(x)
  gnnx.reparameterize(model, method, x)
  assert isinstance(model.attn.query, gnnx.Reparam) and isinstance(model.attn.out, gnnx.Reparam)
  assert model.attn.query.kernel_shape == (6, 2, 4)
  assert _rel(model(x), ref) <= 1e-5, method
  gnnx.bake(model)
  assert isinstance(model.attn.out, nnx.LinearGeneral)
  assert model.attn.query.kernel.shape == (6, 2, 4) and model.attn.query.bias.shape == (2, 4)
  assert model.attn.out.kernel.shape == (2, 4, 6)
  assert _rel(model(x), ref) <= 1e-5, method


def test_a_registered_method_serves_attention_projections(trained_block):
  """A method defined outside geoparam (test_methods' expwn) on the same models, no edit."""
  from geoparam import methods
  from test_methods import expwn
  methods.register('expwn', expwn)
  try:
    model, sp, x = trained_block
    ref = model.apply(sp, x)
    rp = geoparam.reparameterize(model, 'expwn')
    new = geoparam.to_reparameterized(rp, sp, x)
    assert new['params']['attn']['query']['kernel'].shape == (6, 8)
    assert new['params']['attn']['out']['log_scale'].shape == (6,)
    assert _rel(rp.apply(new, x), ref) <= 1e-5
    assert _rel(model.apply(geoparam.bake(rp, new, x), x), ref) <= 1e-5
    nnx_model = NNXBlock(nnx.Rngs(0))
    ref = nnx_model(x)
    gnnx.reparameterize(nnx_model, 'expwn', x)
    assert nnx_model.attn.key.log_scale.shape == (8,)
    assert _rel(nnx_model(x), ref) <= 1e-5
    gnnx.bake(nnx_model)
    assert _rel(nnx_model(x), ref) <= 1e-5
  finally:
    del methods.REGISTRY['expwn']


def test_sharding_names_of_tuple_features_go_to_the_first_feature_axis():
  """A kernel named ('embed', 'heads', 'kv'): the method's flattened unit axis is 'heads'."""
  names = ('embed', 'heads', 'kv')
  dense = nn.DenseGeneral((2, 4), kernel_init=nn.with_partitioning(
      nn.initializers.lecun_normal(), names))
  x = jnp.ones((1, 6))
  for method, want in [('gmp', {'theta': (None, 'heads'), 'lam': ('heads',)}),
                       ('wn', {'kernel': ('embed', 'heads'), 'scale': ('heads',)})]:
    boxed = jax.eval_shape(geoparam.Reparam(dense, method).init, jax.random.key(0), x)
    specs = nn.get_partition_spec(boxed)['params']
    for name, spec in want.items():
      assert tuple(specs[name]) == spec, (method, name, specs[name])
  mesh = jax.make_mesh((1, 1, 1), names, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    layer = nnx.LinearGeneral(6, (2, 4), kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), names), rngs=nnx.Rngs(0))
    wrapper = gnnx.Reparam(layer, 'gmp', initialization='layer')
    assert tuple(wrapper.theta.get_metadata()['out_sharding']) == (None, 'heads')
    assert tuple(wrapper.lam.get_metadata()['out_sharding']) == ('heads',)
    plain, _ = wrapper.plain_layer()  # the plain layer gets the kernel's own names back
    assert tuple(plain.kernel.get_metadata()['out_sharding']) == names


# ----------------------------------------------------------------------------- refused layers

class WithConvLocal(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.ConvLocal(4, (3,), padding='VALID', name='local')(x)
    return nn.Dense(3, name='head')(x)


@pytest.mark.parametrize('model,name,kind', [(WithConvLocal(), 'local', 'nn.ConvLocal')])
def test_selected_conv_local_is_refused_by_name(model, name, kind):
  x = jnp.ones((2, 5, 6))
  sp = model.init(jax.random.key(0), x)
  rp = geoparam.reparameterize(model, 'gmp')
  match = rf"'{name}' is an {kind}.*exclude=\['{name}'\]"
  with pytest.raises(ValueError, match=match):
    rp.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=match):
    geoparam.to_reparameterized(rp, sp, x)
  # Excluded (or left out by `where`), it stays plain and the rest is reparameterized.
  kept = geoparam.reparameterize(model, 'gmp', exclude=[name])
  new = geoparam.to_reparameterized(kept, sp, x)
  assert set(new['params'][name]) == set(sp['params'][name])
  assert set(new['params']['head']) == {'theta', 'lam', 'scale'}
  np.testing.assert_allclose(kept.apply(new, x), model.apply(sp, x), rtol=1e-5, atol=1e-6)
  dense_only = geoparam.reparameterize(model, 'gmp', where=lambda l, p: isinstance(l, nn.Dense))
  assert set(dense_only.init(jax.random.key(0), x)['params']['head']) == {'theta', 'lam', 'scale'}


def test_nnx_imn_on_a_conv_transpose_is_refused_by_name_before_any_change():
  transposed = nnx.Sequential(nnx.ConvTranspose(3, 4, (3,), rngs=nnx.Rngs(0)),
                              nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  with pytest.raises(ValueError, match=r"layers/0.*IMN has no exact form for a ConvTranspose"):
    gnnx.reparameterize(transposed, 'gmp_imn')
  assert isinstance(transposed.layers[1], nnx.Linear)  # nothing changed
  gnnx.reparameterize(transposed, 'gmp_imn', exclude=['0'])
  assert isinstance(transposed.layers[1], gnnx.Reparam)
  assert isinstance(transposed.layers[0], nnx.ConvTranspose)


def test_batch_dims_and_batch_axis_are_refused_by_name():
  with pytest.raises(ValueError, match='batch_axis'):
    gnnx.Reparam(nnx.LinearGeneral(3, (2, 4), batch_axis={0: 2}, rngs=nnx.Rngs(0)), 'wn')

  class Batched(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.DenseGeneral((2, 4), batch_dims=(0,), name='per_batch')(x)

  with pytest.raises(ValueError, match=r"per_batch.*batch_dims"):
    geoparam.reparameterize(Batched(), 'wn').init(jax.random.key(0), jnp.ones((2, 3)))
