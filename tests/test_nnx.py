"""geoparam.nnx: NNX layers equal the linen ones; in-place reparameterize/bake of NNX models.

The 8-device sharding test runs this file as a subprocess (`python tests/test_nnx.py
sharded`), because XLA_FLAGS must be set before JAX starts.
"""

import json
import os
import subprocess
import sys

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam
import geoparam.nnx as gnnx
import training


def _hashable(value):
  return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def linen_twin(layer):
  """The linen layer computing what the NNX `layer` computes (same kernel layout); no params."""
  common = dict(use_bias=layer.use_bias, dtype=layer.dtype, param_dtype=layer.param_dtype,
                precision=layer.precision)
  if isinstance(layer, nnx.Conv):
    return nn.Conv(layer.out_features, tuple(layer.kernel_size), strides=_hashable(layer.strides),
                   padding=_hashable(layer.padding),
                   input_dilation=_hashable(layer.input_dilation),
                   kernel_dilation=_hashable(layer.kernel_dilation),
                   feature_group_count=layer.feature_group_count, **common)
  if isinstance(layer, nnx.LinearGeneral):
    return nn.DenseGeneral(tuple(layer.out_features), axis=tuple(layer.axis), **common)
  return nn.Dense(layer.out_features, **common)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _x(shape, seed=1, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def _state(module):
  return jax.tree.map(np.asarray, nnx.state(module).to_pure_dict())


def _tree_close(a, b, **kw):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **kw), a, b)


# ----------------------------------------------------------------------------- layers vs linen

PAPER = [
  ('GmPLinear', lambda r: gnnx.GmPLinear(5, 4, rngs=r),
   geoparam.GmPDense(4), (6, 5)),
  ('GmPLinear+IMN', lambda r: gnnx.GmPLinear(5, 4, input_mean_norm=True, rngs=r),
   geoparam.GmPDense(4, input_mean_norm=True), (6, 5)),
  ('GmPConv+IMN', lambda r: gnnx.GmPConv(3, 4, (3, 3), strides=2, input_mean_norm=True,
                                         rngs=r),
   geoparam.GmPConv(4, (3, 3), strides=2, input_mean_norm=True), (2, 7, 7, 3)),
  ('LCWLinear', lambda r: gnnx.LCWLinear(5, 4, rngs=r), geoparam.LCWDense(4), (6, 5)),
  ('LCWConv', lambda r: gnnx.LCWConv(3, 4, (3,), padding='CIRCULAR', rngs=r),
   geoparam.LCWConv(4, (3,), padding='CIRCULAR'), (2, 6, 3)),
  ('CWNLinear', lambda r: gnnx.CWNLinear(5, 4, rngs=r), geoparam.CWNDense(4), (6, 5)),
  ('CWNConv', lambda r: gnnx.CWNConv(3, 4, (2, 2), feature_group_count=1, rngs=r),
   geoparam.CWNConv(4, (2, 2)), (2, 5, 5, 3)),
  ('PReLU', lambda r: gnnx.PReLU(5, rngs=r), geoparam.PReLU(), (6, 5)),
  ('InputMeanNorm', lambda r: gnnx.InputMeanNorm(5), geoparam.InputMeanNorm(), (6, 5)),
  ('MeanOnlyBatchNorm', lambda r: gnnx.MeanOnlyBatchNorm(5), geoparam.MeanOnlyBatchNorm(),
   (6, 5)),
]


def _linen_value_and_grad(module, variables, x, stats):
  """Linen outputs, param grads and new batch stats (training mode when there are stats)."""
  kwargs = {'use_running_average': False} if stats else {}

  def loss(params):
    out = module.apply({**variables, 'params': params}, x, mutable=['batch_stats'] if stats
                       else False, **kwargs)
    y, upd = out if stats else (out, {})
    return jnp.sum(jnp.sin(y)), (y, upd)

  (_, (y, upd)), g = jax.value_and_grad(loss, has_aux=True)(variables.get('params', {}))
  return y, g, upd


@pytest.mark.parametrize('name,make,linen,shape', PAPER, ids=[p[0] for p in PAPER])
def test_nnx_layer_equals_linen_layer_outputs_grads_and_stats_float64(name, make, linen, shape):
  with jax.enable_x64():
    layer = make(nnx.Rngs(0))
    x = _x(shape, dtype=jnp.float64)
    variables = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), layer.linen_variables())
    for path, var in nnx.to_flat_state(nnx.state(layer)):
      var.set_value(jnp.asarray(var.get_value(), jnp.float64))
    stats = 'batch_stats' in variables
    y_ref, g_ref, upd_ref = _linen_value_and_grad(linen, variables, x, stats)

    def loss(m):
      y = m(x)
      return jnp.sum(jnp.sin(y)), y

    (_, y), g = nnx.value_and_grad(loss, has_aux=True)(layer)
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    _tree_close(g.to_pure_dict() if hasattr(g, 'to_pure_dict') else g,
                {k: v for k, v in g_ref.items()}, rtol=1e-12, atol=1e-12)
    if stats:
      _tree_close(layer.linen_variables()['batch_stats'], upd_ref['batch_stats'], rtol=1e-12)
      assert np.any(np.asarray(jax.tree.leaves(upd_ref['batch_stats'])[0]) != 0)


WRAPPED = [
  ('Linear', lambda r: nnx.Linear(6, 5, rngs=r), (7, 6)),
  ('Linear1', lambda r: nnx.Linear(1, 5, bias_init=nnx.initializers.normal(1.0), rngs=r),
   (7, 1)),
  ('Conv', lambda r: nnx.Conv(4, 6, (3, 3), strides=(2, 1), padding=((1, 2), (0, 1)),
                              kernel_dilation=(1, 2), feature_group_count=2, rngs=r),
   (2, 7, 8, 4)),
  ('LinearGeneral', lambda r: nnx.LinearGeneral((2, 3), 5, axis=(-2, -1), rngs=r), (4, 2, 3)),
  ('LinearGeneralHeads', lambda r: nnx.LinearGeneral((2, 3), (2, 4), axis=(-2, -1), rngs=r),
   (4, 2, 3)),
]


@pytest.mark.parametrize('method', ['gmp', 'gmp_imn', 'lcw', 'cwn', 'wn'])
@pytest.mark.parametrize('name,make,shape', WRAPPED, ids=[w[0] for w in WRAPPED])
def test_nnx_wrapper_equals_linen_wrapper_on_the_same_params_float64(name, make, shape, method):
  with jax.enable_x64():
    layer = make(nnx.Rngs(0))
    kw = {'initialization': 'layer'} if method.startswith('gmp') else {}
    if name == 'Linear1' and method in ('lcw', 'cwn'):
      with pytest.raises(ValueError, match='fan-in of at least 2'):
        gnnx.Reparam(layer, method, **kw)
      return
    wrapper = gnnx.Reparam(layer, method, **kw)
    x = _x(shape, dtype=jnp.float64)
    for _, var in nnx.to_flat_state(nnx.state(wrapper)):
      var.set_value(jnp.asarray(var.get_value(), jnp.float64))
    linen = geoparam.Reparam(linen_twin(layer).clone(param_dtype=jnp.float64), method)
    variables = wrapper.linen_variables()
    stats = 'batch_stats' in variables
    y_ref, g_ref, _ = _linen_value_and_grad(linen, variables, x, stats)
    (_, y), g = nnx.value_and_grad(lambda m: (jnp.sum(jnp.sin(m(x))), m(x)), has_aux=True)(
        nnx.clone(wrapper))
    np.testing.assert_allclose(y, y_ref, rtol=1e-11, atol=1e-12)
    _tree_close(g.to_pure_dict(), g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('name,make,shape', WRAPPED, ids=[w[0] for w in WRAPPED])
def test_gmp_from_the_layer_is_exact_and_plain_layer_round_trips(name, make, shape):
  layer = make(nnx.Rngs(0))
  x = _x(shape)
  wrapper = gnnx.GmP(layer, initialization='layer')
  np.testing.assert_allclose(wrapper(x), layer(x), atol=2e-6)
  plain, _ = wrapper.plain_layer()
  assert type(plain) is type(layer)
  np.testing.assert_allclose(plain(x), layer(x), atol=2e-6)
  # The paper's initialization draws unit directions, lam = 0, scale = 1.
  paper = gnnx.GmP(layer, rngs=nnx.Rngs(3))
  np.testing.assert_array_equal(paper.scale[...], 1.0)
  np.testing.assert_array_equal(paper.lam[...], 0.0)


def test_train_eval_switch_the_running_mean_like_batchnorm():
  layer = gnnx.GmPLinear(3, 4, input_mean_norm=True, momentum=0.5, rngs=nnx.Rngs(0))
  x = _x((16, 3)) + 2.0
  assert layer.use_running_average is False
  layer(x)
  mean = np.asarray(layer.input_mean_norm['mean'][...])
  np.testing.assert_allclose(mean, 0.5 * np.asarray(x).mean(0), rtol=1e-5)
  layer.eval()
  assert layer.use_running_average is True
  y = layer(x)
  np.testing.assert_array_equal(layer.input_mean_norm['mean'][...], mean)  # unchanged
  layer.train()
  assert not np.allclose(layer(x), y)  # batch mean again
  with pytest.raises(ValueError, match='use_running_average is None'):
    gnnx.InputMeanNorm(3, use_running_average=None)(x)


def test_he_initializers_are_nnx_initializers():
  layer = nnx.Linear(2048, 256, kernel_init=gnnx.he_normal(), rngs=nnx.Rngs(0))
  std = float(np.std(np.asarray(layer.kernel[...])))
  assert abs(std - np.sqrt(2.0 / 2048)) < 0.02 * np.sqrt(2.0 / 2048)


# ----------------------------------------------------------------------------- NNX transforms

def test_jit_optimizer_scan_vmap_split_merge():
  model = gnnx.GmPLinear(3, 4, input_mean_norm=True, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  x = _x((8, 3))

  @nnx.jit
  def step(model, opt, x):
    loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - 1.0) ** 2))(model)
    opt.update(model, g)
    return loss

  losses = [float(step(model, opt, x)) for _ in range(5)]
  assert losses[-1] < losses[0]
  graphdef, state = nnx.split(model)
  np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), model(x))

  # nnx.vmap builds a stack of 3 GmP blocks, nnx.scan runs them in sequence.
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return gnnx.GmP(nnx.Linear(4, 4, rngs=nnx.Rngs(key)), rngs=nnx.Rngs(key))

  stack = make(jax.random.split(jax.random.key(0), 3))
  assert stack.theta.shape == (3, 3, 4)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  def run(h, block):
    return nnx.relu(block(h))

  h = run(_x((2, 4)), stack)
  ref = _x((2, 4))
  for i in range(3):
    block = gnnx.GmP(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
    nnx.update(block, jax.tree.map(lambda a: a[i], nnx.state(stack)))
    ref = nnx.relu(block(ref))
  np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-6)


def test_eager_calls_equal_traced_calls_and_follow_changed_attributes():
  """An eager call runs the module's pure core compiled once (module-level jit); it must equal
  the traced call, update the running mean the same way, and see a changed static attribute."""
  x = _x((6, 5)) + 1.0
  eager = gnnx.GmPLinear(5, 4, input_mean_norm=True, momentum=0.5, rngs=nnx.Rngs(0))
  traced = nnx.clone(eager)
  y_eager = eager(x)
  y_traced = nnx.jit(lambda m, x: m(x))(traced, x)
  np.testing.assert_allclose(y_eager, y_traced, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(eager.input_mean_norm['mean'][...],
                             traced.input_mean_norm['mean'][...], rtol=1e-6)
  np.testing.assert_allclose(eager.input_mean_norm['mean'][...], 0.5 * np.asarray(x).mean(0),
                             rtol=1e-6)
  eager.eval()
  relu = eager(x)
  eager.activation = None  # linear: negative outputs appear; a stale compilation would hide them
  linear = eager(x)
  assert np.all(np.asarray(relu) >= 0) and np.any(np.asarray(linear) < 0)
  np.testing.assert_allclose(np.maximum(linear, 0), relu, rtol=1e-6, atol=1e-7)


def test_orbax_round_trip_is_bit_exact(tmp_path):
  ocp = pytest.importorskip('orbax.checkpoint')
  model = gnnx.GmP(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), input_mean_norm=True,
                   rngs=nnx.Rngs(1))
  model(_x((2, 5, 5, 3)) + 1.0)  # a nonzero running mean
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / 'state', nnx.state(model))
  checkpointer.wait_until_finished()
  fresh = gnnx.GmP(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(5)), input_mean_norm=True,
                   rngs=nnx.Rngs(6))
  abstract = nnx.state(fresh)
  restored = checkpointer.restore(tmp_path / 'state', abstract)
  nnx.update(fresh, restored)
  for a, b in zip(jax.tree.leaves(_state(model)), jax.tree.leaves(_state(fresh))):
    np.testing.assert_array_equal(a, b)
  assert np.any(_state(fresh)['input_mean_norm']['mean'] != 0)


def test_analysis_accepts_the_nnx_layers_params():
  layer = gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0))
  params = nnx.state(layer, nnx.Param).to_pure_dict()
  linen_params = geoparam.GmPDense(4).init(jax.random.key(0), jnp.ones((1, 3)))['params']
  linen_params = jax.tree.map(lambda a, b: b, linen_params, dict(params))
  np.testing.assert_array_equal(geoparam.analysis.boundary_location(params, 'gmp'),
                                geoparam.analysis.boundary_location(linen_params, 'gmp'))
  u = geoparam.analysis.boundary_direction(params, 'gmp')
  assert u.shape == (4, 3)
  np.testing.assert_allclose(np.linalg.norm(u, axis=1), 1.0, rtol=1e-5)


# ----------------------------------------------------------------------------- whole models

class CNN(nnx.Module):
  """conv-BN-relu x 2, pool, head: the BN layers get folded when dropped."""

  def __init__(self, rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
    self.bn1 = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (3, 3), padding='VALID', rngs=rngs)
    self.bn2 = nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn1(self.conv1(x)))
    x = nnx.relu(self.bn2(self.conv2(x)))
    return self.head(x.mean(axis=(1, 2)))


class MLP(nnx.Module):
  """A transformer-style MLP block: LinearGeneral, GELU, residual."""

  def __init__(self, rngs):
    self.up = nnx.LinearGeneral(6, 12, rngs=rngs)
    self.layers = nnx.List([nnx.Linear(12, 12, rngs=rngs), nnx.Linear(12, 6, rngs=rngs)])

  def __call__(self, x):
    h = nnx.gelu(self.up(x))
    h = nnx.gelu(self.layers[0](h))
    return x + self.layers[1](h)


def _train(model, x, y, steps, lr=0.05):
  return training.nnx_train(model, x, y, steps, optax.sgd(lr, momentum=0.9))


def _rel(a, b):
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def test_trained_cnn_to_gmp_imn_with_bn_dropped_keeps_function_trains_and_bakes():
  model = CNN(nnx.Rngs(0))
  x, y = _x((8, 6, 6, 3)), _x((8, 3), seed=2)
  _train(model, x, y, 5)  # trained SP weights and BN statistics
  before = model(x)
  assert not np.allclose(model.bn1.mean[...], 0)
  gnnx.reparameterize(model, 'gmp_imn', x, exclude=['head'], drop_batchnorm=True)
  assert isinstance(model.conv1, gnnx.Reparam) and isinstance(model.bn1, gnnx.DroppedBatchNorm)
  assert isinstance(model.head, nnx.Linear)
  assert _rel(model(x), before) < 1e-5
  # conv2 pads nothing: IMN's running mean starts at the batch mean; conv1 pads: at 0.
  assert np.any(model.conv2.input_mean_norm['mean'][...] != 0)
  np.testing.assert_array_equal(model.conv1.input_mean_norm['mean'][...], 0)
  losses = _train(model, x, y, 8)
  assert losses[-1] < losses[0]
  after = model(x)
  gnnx.bake(model, approximate_borders=True)
  assert isinstance(model.conv1, nnx.Conv) and isinstance(model.bn1, nnx.BatchNorm)
  # conv1 pads zeros and its running mean is nonzero after training: folding the mean
  # into the bias is exact away from the borders only (6x6 images: most pixels touch one).
  assert _rel(model(x), after) < 0.05


def test_bake_right_after_reparameterize_is_exact_and_refuses_padded_imn_when_trained():
  model = CNN(nnx.Rngs(0))
  x = _x((4, 6, 6, 3))
  _train(model, x, _x((4, 3), seed=2), 2)
  before = model(x)
  gnnx.reparameterize(model, 'gmp_imn', x, drop_batchnorm=True)
  gnnx.bake(model)
  assert _rel(model(x), before) < 1e-5
  gnnx.reparameterize(model, 'gmp_imn', x, drop_batchnorm=False)
  _train(model, x, _x((4, 3), seed=2), 2)
  with pytest.raises(ValueError, match='approximate_borders'):
    gnnx.bake(model)


def test_bias_free_conv_gets_lam_only_when_its_batchnorm_is_dropped():
  """Issue 26 item 2 in NNX: conv1 (use_bias=False) gets no lam with its BatchNorm kept, so
  Adam cannot grow a bias and bake is exact after training; dropped, lam carries the BN's shift."""
  x, y = _x((4, 6, 6, 3)), _x((4, 3), seed=2)
  model = CNN(nnx.Rngs(0))
  _train(model, x, y, 2)
  gnnx.reparameterize(model, 'gmp', x, exclude=['head'])
  assert set(nnx.state(model.conv1, nnx.Param)) == {'theta', 'scale'}
  _train(model, x, y, 3)
  after = model(x)
  gnnx.bake(model)
  assert _rel(model(x), after) < 1e-5
  model = CNN(nnx.Rngs(0))
  _train(model, x, y, 2)
  before = model(x)
  gnnx.reparameterize(model, 'gmp', x, exclude=['head'], drop_batchnorm=True)
  assert set(nnx.state(model.conv1, nnx.Param)) == {'theta', 'lam', 'scale'}
  assert float(jnp.abs(model.conv1.lam[...]).max()) > 0
  assert _rel(model(x), before) < 1e-5


@pytest.mark.parametrize('method', ['gmp', 'wn'])
def test_mlp_with_gelu_and_list_reparameterized_in_place(method):
  model = MLP(nnx.Rngs(0))
  x, y = _x((16, 6)), _x((16, 6), seed=3)
  _train(model, x, y, 3)
  before = model(x)
  gnnx.reparameterize(model, method)
  assert all(isinstance(m, gnnx.Reparam) for m in (model.up, *model.layers))
  assert _rel(model(x), before) < 1e-5
  losses = _train(model, x, y, 6)
  assert losses[-1] < losses[0]
  after = model(x)
  gnnx.bake(model)
  assert isinstance(model.layers[1], nnx.Linear) and isinstance(model.up, nnx.LinearGeneral)
  assert _rel(model(x), after) < 1e-5


def test_lcw_conversion_needs_zero_sum_kernels():
  model = MLP(nnx.Rngs(0))
  with pytest.raises(ValueError, match='sum to zero'):
    gnnx.reparameterize(model, 'lcw')
  assert isinstance(model.up, nnx.LinearGeneral)  # nothing changed on failure
  for layer in (model.up, *model.layers):
    k = layer.kernel[...]
    layer.kernel[...] = k - k.reshape(-1, k.shape[-1]).mean(0)
  before = model(_x((3, 6)))
  gnnx.reparameterize(model, 'lcw')
  assert _rel(model(_x((3, 6))), before) < 1e-5


# ----------------------------------------------------------------------------- bad input

def test_bad_inputs_are_clear_errors():
  with pytest.raises(TypeError, match=r'accepted layer types are nnx.Linear'):
    gnnx.GmP(nnx.Embed(4, 3, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='pass rngs'):
    gnnx.GmP(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match=r"unknown \['momentun'\]"):
    gnnx.GmP(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), momentun=0.9, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='method must be one of'):
    gnnx.reparameterize(MLP(nnx.Rngs(0)), 'gmpp')
  with pytest.raises(ValueError, match=r'in_features must be an integer in \[1,'):
    gnnx.GmPLinear(0, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='features'):
    gnnx.GmPLinear(3, 0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='needs an example batch'):
    gnnx.reparameterize(CNN(nnx.Rngs(0)), 'gmp_imn', drop_batchnorm=True)
  layer = gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='fan_in or the features differ'):
    layer(jnp.ones((2, 5)))
  imn = gnnx.GmPLinear(3, 4, input_mean_norm=True, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match='int'):
    imn(jnp.ones((2, 3), jnp.int32))
  model = CNN(nnx.Rngs(0))
  with pytest.raises(ValueError, match='bn1.*not the output'):
    gnnx.reparameterize(model, 'gmp_imn', _x((2, 6, 6, 3)), drop_batchnorm=True,
                        exclude=['conv1'])
  assert isinstance(model.conv2, nnx.Conv)  # nothing changed on failure


def test_a_shared_layer_is_refused_not_half_replaced():
  class Tied(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(3, 3, rngs=rngs)
      self.blocks = nnx.List([self.a])

    def __call__(self, x):
      return self.blocks[0](self.a(x))

  model = Tied(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r'Linear at a is shared \(also at blocks/0\)'):
    gnnx.reparameterize(model, 'gmp')
  assert isinstance(model.a, nnx.Linear)
  with pytest.raises(ValueError, match='no layer was selected'):  # all excluded: a no-op, refused
    gnnx.reparameterize(model, 'gmp', exclude=['a', 'blocks/0'])
  assert isinstance(model.a, nnx.Linear)


def test_linen_users_never_import_nnx_subpackage():
  code = 'import sys, geoparam; assert "geoparam.nnx" not in sys.modules, sorted(sys.modules)'
  subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT)


# ----------------------------------------------------------------------------- sharding

def _sharded_worker():
  """Prints the loss curves of a few steps on a (4, 2) data x model mesh and on one device."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  def make():
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'model'))
    return nnx.Sequential(
        gnnx.GmP(nnx.Linear(6, 8, kernel_init=init, rngs=nnx.Rngs(0)), input_mean_norm=True,
                 rngs=nnx.Rngs(1)),
        nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(2)))

  x, y = _x((16, 6)), _x((16, 2), seed=4)

  def run(mesh):
    with jax.set_mesh(mesh):
      model = make()
      opt = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
      xs = jax.device_put(x, NamedSharding(mesh, P('data')))
      ys = jax.device_put(y, NamedSharding(mesh, P('data')))

      @nnx.jit
      def step(model, opt, x, y):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, g)
        return loss

      losses = [float(step(model, opt, xs, ys)) for _ in range(4)]
      spec = model.layers[0].theta[...].sharding.spec
      return losses, list(map(str, spec)), np.asarray(model.layers[0].theta[...]).tolist()

  auto = (AxisType.Auto, AxisType.Auto)
  many = run(jax.make_mesh((4, 2), ('data', 'model'), axis_types=auto))
  one = run(jax.make_mesh((1, 1), ('data', 'model'), axis_types=auto,
                          devices=jax.devices()[:1]))
  print(json.dumps({'devices': jax.device_count(), 'many': many, 'one': one}))


def test_sharded_on_8_fake_devices_equals_one_device():
  env = dict(os.environ, XLA_FLAGS=os.environ.get('XLA_FLAGS', '') +
             ' --xla_force_host_platform_device_count=8',
             JAX_PLATFORMS='cpu', PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  out = subprocess.run([sys.executable, os.path.abspath(__file__), 'sharded'], env=env,
                       check=True, capture_output=True, text=True, timeout=300).stdout
  result = json.loads(out.strip().splitlines()[-1])
  assert result['devices'] == 8
  many, one = result['many'], result['one']
  assert many[1] == ['None', 'model']  # theta's features axis is sharded over 'model'
  np.testing.assert_allclose(many[0], one[0], rtol=1e-5)
  assert many[0][-1] < many[0][0]
  np.testing.assert_allclose(many[2], one[2], rtol=1e-5, atol=1e-6)


def test_nnx_vs_linen_benchmark_runs_on_tiny_shapes(tmp_path):
  from benchmarks import nnx_vs_linen  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'nnx.json'
  row = nnx_vs_linen.run(tiny=True, out=str(out))
  assert row == json.loads(out.read_text())
  assert row['width'] == 16 and row['linen_ms'] > 0
  assert row['nnx_jit_ratio'] > 0 and row['nnx_split_ratio'] > 0


if __name__ == '__main__' and sys.argv[1:] == ['sharded']:
  _sharded_worker()


def test_bake_errors_name_the_layer_path():
  """Issue (clear errors): bake's errors name the layer's path, not its type ('layer GmP')."""

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(2, 3, (3, 3), padding='SAME', rngs=rngs)
      self.dense = nnx.Linear(3, 3, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return self.dense(nnx.relu(self.conv(x)))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(rngs)])

    def __call__(self, x):
      return self.blocks[0](x)

  model = Net(nnx.Rngs(0))
  x = _x((2, 5, 5, 2))
  gnnx.reparameterize(model, 'gmp_imn', x, where=lambda layer, path: path[-1] == 'conv')
  model.blocks[0].conv.input_mean_norm['mean'][...] = jnp.ones(2)  # as after training
  with pytest.raises(ValueError, match='layer blocks/0/conv: a conv that pads zeros'):
    gnnx.bake(model)
  model = Net(nnx.Rngs(0))
  dense = model.blocks[0].dense  # a checkpoint that holds lam for a bias-free layer
  stored = gnnx.Reparam(dense, 'gmp', initialization='layer').params()
  model.blocks[0].dense = gnnx.Reparam(dense, 'gmp', params={**stored, 'lam': jnp.ones(3)})
  with pytest.raises(ValueError, match='layer blocks/0/dense has use_bias=False in the plain model'):
    gnnx.bake(model)


# ----------------------------------------------------------------------------- under tracing

class _BNMLP(nnx.Module):
  def __init__(self, rngs, sharded=True):
    init = nnx.initializers.lecun_normal()
    init = nnx.with_partitioning(init, (None, 'model')) if sharded else init
    self.hidden = nnx.Linear(3, 8, kernel_init=init, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.bn(self.hidden(x))))


def test_reparameterize_under_eval_shape_gives_the_abstract_model_with_shardings():
  with jax.set_mesh(jax.make_mesh((1,), ('model',))):
    abstract = nnx.eval_shape(lambda: gnnx.reparameterize(_BNMLP(nnx.Rngs(0)), 'gmp_imn',
                                                          exclude=['head']))
    real = gnnx.reparameterize(_BNMLP(nnx.Rngs(0)), 'gmp_imn', exclude=['head'])
  assert isinstance(abstract.hidden, gnnx.Reparam)
  assert isinstance(abstract.hidden.theta.get_value(), jax.ShapeDtypeStruct)
  assert tuple(abstract.hidden.theta.get_metadata()['out_sharding']) == (None, 'model')
  shapes = lambda m: jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), nnx.state(m))
  assert shapes(abstract) == shapes(real)  # a restore target for the real model's checkpoint


def test_reparameterize_under_nnx_jit_equals_the_eager_float64_conversion():
  x = jax.random.normal(jax.random.key(1), (6, 3)) + 1.0
  eager, traced = _BNMLP(nnx.Rngs(0), False), _BNMLP(nnx.Rngs(0), False)
  for m in (eager, traced):  # BatchNorm statistics that move the function
    m.bn.mean[...] = jnp.linspace(-1.0, 1.0, 8)
    m.bn.var[...] = jnp.linspace(0.5, 2.0, 8)
    m.eval()
  before = eager(x)
  gnnx.reparameterize(eager, 'gmp_imn', x, exclude=['head'], drop_batchnorm=True)

  @nnx.jit
  def convert(model, x):
    return gnnx.reparameterize(model, 'gmp_imn', x, exclude=['head'], drop_batchnorm=True)

  traced = convert(traced, x)
  assert isinstance(traced.hidden, gnnx.Reparam) and isinstance(traced.bn, gnnx.DroppedBatchNorm)
  for name in ('theta', 'lam', 'scale'):  # the BatchNorm fold in float32 under jit, the rest f64
    np.testing.assert_allclose(getattr(traced.hidden, name)[...],
                               getattr(eager.hidden, name)[...], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(traced(x), before, rtol=1e-5, atol=1e-5)


def test_reparam_without_rngs_refuses_a_method_that_draws_at_random():
  layer = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"'gmp' draws its initial variables at random.*rngs="):
    gnnx.Reparam(layer, 'gmp')
  a = gnnx.Reparam(layer, 'gmp', rngs=nnx.Rngs(1))
  b = gnnx.Reparam(nnx.Linear(3, 4, rngs=nnx.Rngs(2)), 'gmp', rngs=nnx.Rngs(2))
  assert not np.allclose(a.theta[...], b.theta[...])
  gnnx.Reparam(layer, 'lcw')  # from the layer's weights: no key needed
  with pytest.raises(TypeError, match='geoparam.nnx.bake takes an nnx.Module.*geoparam.bake'):
    gnnx.bake(nn.Dense(3))


def test_nnx_tabulate_works_on_a_reparameterized_model_with_plain_layers_of_the_same_class():
  model = gnnx.reparameterize(_BNMLP(nnx.Rngs(0), False), 'gmp', exclude=['head'])
  table = nnx.tabulate(model, jnp.ones((2, 3)))
  assert 'Reparam' in table and 'head' in table
  assert model.head(jnp.ones((2, 8))).shape == (2, 2)  # nnx.Linear's __call__ is restored
  assert nnx.Linear.__call__.__code__.co_name == '__call__'
