"""Layer kinds as records (`geoparam.kinds`): Einsum, ConvTranspose and a kind of our own.

Each kind gets the wrappers, both whole-model transforms, exact conversion of a
trained model and bake back, checked against float64 numpy references.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam
from geoparam import kinds
import geoparam.nnx as gnnx


def _close(a, b, tol=1e-6):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- the layout

@pytest.mark.parametrize('seed', range(5))
def test_layout_round_trips_and_groups_units_like_an_explicit_reshape(seed):
  rng = np.random.default_rng(seed)
  ndim = rng.integers(2, 5)
  shape = tuple(rng.integers(1, 4, ndim))
  units = tuple(sorted(rng.choice(ndim, rng.integers(1, ndim), replace=False).tolist()))
  units = tuple(rng.permutation(units).tolist())
  layout = kinds.Layout(shape, units)
  k = rng.standard_normal(shape)
  m = layout.to_method(k)
  assert m.shape == layout.method_shape
  # column j of the method's kernel is unit j: the kernel entries at that unit's index
  for j, index in enumerate(np.ndindex(layout.units)):
    sl = [slice(None)] * ndim
    for a, i in zip(units, index):
      sl[a] = i
    np.testing.assert_array_equal(m[:, j] if m.ndim == 2 else m.reshape(-1, m.shape[-1])[:, j],
                                  k[tuple(sl)].reshape(-1))
  back, bias = layout.to_layer(m, np.arange(m.shape[-1]))
  np.testing.assert_array_equal(back, k)
  assert bias.shape == layout.units


def test_einsum_layout_reads_units_and_fan_in_from_the_string():
  assert kinds.einsum_layout('BTD,NDH->BTNH', (4, 8, 2)).method_shape == (8, 8)
  assert kinds.einsum_layout('BTNH,NHD->BTD', (4, 2, 8)).method_shape == (4, 2, 8)
  assert kinds.einsum_layout('BSD,CKDH->CBSKH', (2, 1, 8, 2)).units == (2, 1, 2)
  with pytest.raises(ValueError, match='no kernel axis reaches the output'):
    kinds.einsum_layout('btd,d->bt', (4,))
  with pytest.raises(ValueError, match='ellipsis in the kernel'):
    kinds.einsum_layout('btd,...d->bt', (4,))


def test_an_einsum_reading_a_kernel_diagonal_is_refused_by_name():
  """Was converted: 'bd,dd->bd' reads only the diagonal, so a unit's GmP direction and scale
  spread over weights the layer never uses."""
  with pytest.raises(ValueError, match=r"'bd,dd->bd': a kernel axis letter repeats"):
    kinds.einsum_layout('bd,dd->bd', (3, 3))
  with pytest.raises(ValueError, match='a kernel axis letter repeats'):
    geoparam.reparameterize(nn.Einsum((3, 3), 'bd,dd->bd'), 'gmp').init(
        jax.random.key(0), jnp.ones((2, 3)))


# ----------------------------------------------------------------------------- linen

class LinenAttention(nn.Module):
  """Gemma-style projections with nn.Einsum, a gated MLP and a plain head."""

  @nn.compact
  def __call__(self, x):
    q = nn.Einsum((2, 6, 3), 'BTD,NDH->BTNH', name='q')(x)
    kv = nn.Einsum((2, 1, 6, 3), 'BSD,CKDH->CBSKH', name='kv')(x)
    k, v = kv[0], kv[1]
    att = jax.nn.softmax(jnp.einsum('BTNH,BSKH->BNTS', q, k), axis=-1)
    o = jnp.einsum('BNTS,BSKH->BTNH', att, v)
    x = x + nn.Einsum((2, 3, 6), 'BTNH,NHD->BTD', name='out')(o)
    gate = nn.Einsum((2, 6, 5), 'BTD,GDF->GBTF', name='gating')(x)
    h = jax.nn.gelu(gate[0]) * gate[1]
    x = x + nn.Einsum((5, 6), 'BTF,FD->BTD', name='down')(h)
    return nn.Dense(2, name='head')(x)


class LinenDecoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.ConvTranspose(4, (3, 3), strides=(2, 2), name='up')(x))
    x = nn.relu(nn.ConvTranspose(3, (2, 2), transpose_kernel=True, name='up_t')(x))
    return nn.Conv(2, (1, 1), name='head')(x)


def _linen_round_trip(model, x, method='gmp'):
  plain = jax.jit(model.init)(jax.random.key(0), x)
  rp = geoparam.reparameterize(model, method, exclude=['head'])
  variables = geoparam.to_reparameterized(rp, plain, x)
  # One compilation each, not one per eager op.
  apply, apply_plain = jax.jit(rp.apply), jax.jit(model.apply)
  _close(apply(variables, x), apply_plain(plain, x))
  # one training step moves every reparameterized variable; bake gives the same function back
  loss = jax.jit(lambda p: jnp.mean(rp.apply({**variables, 'params': p}, x) ** 2))
  grads = jax.jit(jax.grad(loss))(variables['params'])
  trained = {**variables, 'params': jax.tree.map(lambda p, g: p - 0.1 * g,
                                                  variables['params'], grads)}
  assert loss(trained['params']) < loss(variables['params'])
  baked = geoparam.bake(rp, trained, x)
  _close(apply_plain(baked, x), apply(trained, x))
  return variables


def test_linen_einsum_projections_convert_train_and_bake_exactly(x64):
  x = jax.random.normal(jax.random.key(1), (2, 5, 6), jnp.float64)
  model = LinenAttention()
  variables = _linen_round_trip(model, x)
  params = variables['params']
  assert params['q']['theta'].shape == (5, 6)        # fan-in D = 6, units N * H = 6
  assert params['kv']['theta'].shape == (5, 6)       # units C * K * H = 2 * 1 * 3
  assert params['out']['theta'].shape == (5, 6)      # fan-in N * H = 6, units D
  assert params['gating']['theta'].shape == (5, 10)  # units G * F


def test_linen_einsum_gmp_imn_is_exact_where_defined(x64):
  x = jax.random.normal(jax.random.key(1), (3, 4, 6), jnp.float64) + 2.0
  class One(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Einsum((2, 6, 3), 'BTD,NDH->BTNH', name='q')(x)

  plain = One().init(jax.random.key(0), x)
  rp = geoparam.reparameterize(One(), 'gmp_imn')
  converted = geoparam.to_reparameterized(rp, plain, x)
  assert converted['batch_stats']['q']['input_mean_norm']['mean'].shape == (6,)
  _close(rp.apply(converted, x), One().apply(plain, x))
  y, _ = rp.apply(converted, x, mutable=['batch_stats'])  # training: the batch mean of x
  centred = One().apply(plain, x - x.mean((0, 1)))
  _close(y - y.mean((0, 1)), centred - centred.mean((0, 1)))

  class PerHead(nn.Module):  # the unit axis n is also an input axis: each unit has its own input
    @nn.compact
    def __call__(self, x):
      return nn.Einsum((2, 3, 4), 'BND,NDH->BNH', name='q')(x)

  with pytest.raises(ValueError, match=r"'gmp_imn' has IMN, but .*unit axis .* is also an input"):
    geoparam.reparameterize(PerHead(), 'gmp_imn').init(jax.random.key(0), jnp.ones((2, 2, 3)))


def test_linen_conv_transpose_converts_trains_and_bakes_exactly(x64):
  x = jax.random.normal(jax.random.key(1), (2, 4, 4, 3), jnp.float64)
  variables = _linen_round_trip(LinenDecoder(), x)
  assert variables['params']['up']['theta'].shape == (3 * 3 * 3 - 1, 4)
  assert variables['params']['up_t']['theta'].shape == (2 * 2 * 4 - 1, 3)
  with pytest.raises(ValueError, match="layer up: 'gmp_imn' has IMN, but IMN has no exact form"):
    geoparam.to_reparameterized(geoparam.reparameterize(LinenDecoder(), 'gmp_imn',
                                                        exclude=['head']),
                                LinenDecoder().init(jax.random.key(0), x), x)


@pytest.mark.parametrize('method', ['gmp', 'lcw', 'wn', 'cwn'])
def test_linen_wrappers_take_einsum_and_conv_transpose(method):
  x = jnp.ones((2, 4, 6))
  for layer, inputs in ((nn.Einsum((2, 6, 3), 'BTD,NDH->BTNH'), x),
                        (nn.ConvTranspose(4, (3,)), x)):
    variables = geoparam.Reparam(layer, method).init(jax.random.key(0), inputs)
    y = geoparam.Reparam(layer, method).apply(variables, inputs)
    assert y.shape == layer.init_with_output(jax.random.key(0), inputs)[0].shape


# ----------------------------------------------------------------------------- NNX

class Gemma(nnx.Module):
  """A Gemma-style block: Einsum q, kv and output projections, a gated Einsum MLP."""

  def __init__(self, d, n, h, f, rngs):
    self.q = nnx.Einsum('BTD,NDH->BTNH', (n, d, h), (n, h), rngs=rngs)
    self.kv = nnx.Einsum('BSD,CKDH->CBSKH', (2, 1, d, h), (2, 1, h), rngs=rngs)
    self.out = nnx.Einsum('BTNH,NHD->BTD', (n, h, d), (d,), rngs=rngs)
    self.gating = nnx.Einsum('BTD,GDF->GBTF', (2, d, f), rngs=rngs)
    self.down = nnx.Linear(f, d, rngs=rngs)
    self.head = nnx.Linear(d, 2, rngs=rngs)

  def __call__(self, x):
    q = self.q(x)
    kv = self.kv(x)
    att = jax.nn.softmax(jnp.einsum('BTNH,BSKH->BNTS', q, kv[0]), axis=-1)
    x = x + self.out(jnp.einsum('BNTS,BSKH->BTNH', att, kv[1]))
    gate = self.gating(x)
    x = x + self.down(jax.nn.gelu(gate[0]) * gate[1])
    return self.head(x)


def test_nnx_gemma_block_converts_trains_and_bakes_exactly(x64):
  x = jax.random.normal(jax.random.key(1), (2, 5, 8), jnp.float64)
  model = Gemma(8, 2, 4, 6, nnx.Rngs(0))
  for _, v in nnx.to_flat_state(nnx.state(model)):
    v.set_value(jnp.asarray(v.get_value(), jnp.float64))
  forward = nnx.jit(lambda m: m(x))  # one compilation per model graph, not one per eager op
  before = forward(model)
  gnnx.reparameterize(model, 'gmp', exclude=['head'])
  assert isinstance(model.q, gnnx.Reparam) and model.q.theta.shape == (7, 8)
  assert model.kv.theta.shape == (7, 8) and model.gating.theta.shape == (7, 12)
  assert not hasattr(model.gating, 'lam')  # the gating einsum has no bias: none is added
  _close(forward(model), before)
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  loss = lambda m: jnp.mean(m(x) ** 2)
  step = nnx.jit(lambda m, opt: opt.update(m, nnx.grad(loss)(m)))
  first = jnp.mean(forward(model) ** 2)
  for _ in range(3):
    step(model, optimizer)
  trained = forward(model)
  assert jnp.mean(trained ** 2) < first
  gnnx.bake(model)
  assert type(model.q) is nnx.Einsum and model.q.kernel.shape == (2, 8, 4)
  assert model.gating.bias is None
  _close(forward(model), trained)


def test_nnx_conv_transpose_converts_and_bakes_exactly(x64):
  model = nnx.Sequential(nnx.ConvTranspose(3, 4, (3, 3), strides=2, param_dtype=jnp.float64,
                                           rngs=nnx.Rngs(0)),
                         nnx.ConvTranspose(4, 2, (2, 2), transpose_kernel=True,
                                           param_dtype=jnp.float64, rngs=nnx.Rngs(1)))
  x = jax.random.normal(jax.random.key(1), (2, 4, 4, 3), jnp.float64)
  before = model(x)
  gnnx.reparameterize(model, 'gmp')
  _close(model(x), before)
  gnnx.bake(model)
  assert type(model.layers[1]) is nnx.ConvTranspose
  _close(model(x), before)


class LinenTransposedThenNorm(nn.Module):
  """A ConvTranspose whose units are not its kernel's last axis (transpose_kernel), then a
  BatchNorm with statistics far from the identity: the fold must scale the units' axis."""
  @nn.compact
  def __call__(self, x):
    x = nn.ConvTranspose(5, (2, 2), transpose_kernel=True, name='up_t')(x)
    return nn.BatchNorm(use_running_average=True, name='bn')(x)


def test_dropped_batchnorm_folds_into_a_transposed_kernel_conv_transpose(x64):
  x = jax.random.normal(jax.random.key(1), (2, 3, 3, 4), jnp.float64)
  model = LinenTransposedThenNorm()
  plain = model.init(jax.random.key(0), x)
  stats = {'mean': jnp.linspace(-1.0, 2.0, 5), 'var': jnp.linspace(0.2, 3.0, 5)}
  plain = {'params': {**plain['params'], 'bn': {'scale': jnp.linspace(0.5, 2.0, 5),
                                                'bias': jnp.linspace(-1.0, 1.0, 5)}},
           'batch_stats': {'bn': stats}}
  rp = geoparam.reparameterize(model, 'gmp', drop_batchnorm=True)
  variables = geoparam.to_reparameterized(rp, plain, x)
  assert 'bn' not in variables['params']
  _close(rp.apply(variables, x), model.apply(plain, x))
  # the NNX transform folds it the same way
  nnx_model = nnx.Sequential(
      nnx.ConvTranspose(4, 5, (2, 2), transpose_kernel=True, param_dtype=jnp.float64,
                        rngs=nnx.Rngs(0)),
      nnx.BatchNorm(5, use_running_average=True, param_dtype=jnp.float64, rngs=nnx.Rngs(0)))
  norm = nnx_model.layers[1]
  for variable, value in ((norm.mean, stats['mean']), (norm.var, stats['var']),
                          (norm.scale, plain['params']['bn']['scale']),
                          (norm.bias, plain['params']['bn']['bias'])):
    variable.set_value(value)
  before = nnx_model(x)
  gnnx.reparameterize(nnx_model, 'gmp', x, drop_batchnorm=True)
  _close(nnx_model(x), before)


# ----------------------------------------------------------------------------- a kind of our own

class MyDense(nn.Module):
  """A Dense-like linen layer with params `w (fan_in, features)` and `b`."""
  features: int

  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    b = self.param('b', nn.initializers.normal(1.0), (self.features,))
    return x @ w + b


class MyLinear(nnx.Module):
  """The same layer in NNX: `w`, `b`."""

  def __init__(self, in_features, out_features, rngs):
    self.in_features, self.out_features = in_features, out_features
    self.w = nnx.Param(jax.random.normal(rngs.params(), (in_features, out_features)))
    self.b = nnx.Param(jax.random.normal(rngs.params(), (out_features,)))

  def __call__(self, x):
    return x @ self.w[...] + self.b[...]


MY_KIND = kinds.Kind(
    'MyDense', layout=lambda layer, shape: kinds.Layout(
        (shape[-1], getattr(layer, 'features', None) or layer.out_features), (1,)),
    imn_axes=lambda layer, ndim: (ndim - 1,),
    example_shape=lambda layer: (1, layer.in_features), kernel='w', bias='b')


@pytest.fixture
def my_kind():
  kinds.register(MY_KIND, MyDense, MyLinear)
  yield
  for cls in (MyDense, MyLinear):
    del kinds.REGISTRY[cls]


class MyNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(MyDense(5, name='hidden')(x))
    return MyDense(2, name='head')(x)


def _gmp_reference(w, b):
  """float64 numpy: GmP's (theta-free) view of a plain layer: scale, unit directions, lam."""
  scale = np.linalg.norm(w, axis=0)
  return scale, w / scale, b / scale


@pytest.mark.parametrize('method', ['gmp', 'gmp_imn'])
def test_a_kind_registered_in_a_test_gets_wrappers_transforms_and_bake(x64, my_kind, method):
  x = jax.random.normal(jax.random.key(1), (6, 4), jnp.float64) + 1.0
  model = MyNet()
  plain = model.init(jax.random.key(0), x)
  # the linen wrapper
  wrapped = geoparam.Reparam(MyDense(5), 'gmp').init(jax.random.key(0), x)
  assert set(wrapped['params']) == {'theta', 'lam', 'scale'}
  # the linen transform: exact against float64 numpy
  rp = geoparam.reparameterize(model, method, exclude=['head'])
  variables = geoparam.to_reparameterized(rp, plain, x)
  w, b = (np.asarray(plain['params']['hidden'][n]) for n in ('w', 'b'))
  scale, u, lam = _gmp_reference(w, b)
  np.testing.assert_allclose(variables['params']['hidden']['scale'], scale, rtol=1e-12)
  h = np.maximum(np.asarray(x) @ w + b, 0.0)
  ref = h @ np.asarray(plain['params']['head']['w']) + np.asarray(plain['params']['head']['b'])
  _close(rp.apply(variables, x), ref, 1e-10)
  np.testing.assert_allclose(geoparam.hyperspherical.to_cartesian(
      variables['params']['hidden']['theta'][:, 0]), u[:, 0], atol=1e-12)
  if method == 'gmp':
    np.testing.assert_allclose(variables['params']['hidden']['lam'], lam, rtol=1e-10)
  baked = geoparam.bake(rp, variables, x)
  np.testing.assert_allclose(baked['params']['hidden']['w'], w, atol=1e-12)
  np.testing.assert_allclose(baked['params']['hidden']['b'], b, atol=1e-12)
  # the NNX wrapper and transform
  net = nnx.Sequential(MyLinear(4, 5, nnx.Rngs(0)), nnx.relu, MyLinear(5, 2, nnx.Rngs(1)))
  for _, v in nnx.to_flat_state(nnx.state(net)):
    v.set_value(jnp.asarray(v.get_value(), jnp.float64))
  before = net(x)
  w = np.asarray(net.layers[0].w[...])
  gnnx.reparameterize(net, method, x, exclude=['2'])
  assert isinstance(net.layers[0], gnnx.Reparam)
  np.testing.assert_allclose(net.layers[0].scale[...], np.linalg.norm(w, axis=0), rtol=1e-12)
  _close(net(x), before, 1e-10)
  gnnx.bake(net)
  assert type(net.layers[0]) is MyLinear
  np.testing.assert_allclose(net.layers[0].w[...], w, atol=1e-12)
  _close(net(x), before, 1e-10)


def test_an_unregistered_layer_is_named_with_the_registry_hint():
  with pytest.raises(TypeError, match=r'MyDense.*geoparam.kinds.register'):
    geoparam.Reparam(MyDense(3), 'gmp').init(jax.random.key(0), jnp.ones((1, 2)))
  with pytest.raises(TypeError, match='must be a geoparam.kinds.Kind'):
    kinds.register('dense', MyDense)


# ----------------------------------------------------------------------------- masked convs
# A conv's `mask` multiplies its kernel: IMN's fold (forward, conversion, bake) must see the
# kernel through it, in both shells.

MASK = np.ones((3, 3, 2, 4))
MASK[2], MASK[1, 2] = 0, 0  # a causal mask: rows below and the taps right of the centre


@pytest.mark.parametrize('padding', ['VALID', 'SAME'])
def test_masked_conv_gmp_imn_converts_and_bakes_exactly_in_both_shells(x64, padding):
  """Was: the conversion and bake folded IMN's mean through the unmasked kernel (linen: outputs
  off by 1.8 with no error; NNX refused masked convs)."""
  x = jax.random.normal(jax.random.key(0), (3, 6, 6, 2), jnp.float64) + 1.5
  interior = (slice(None), slice(1, -1), slice(1, -1))  # SAME: exact away from the borders
  where = interior if padding == 'SAME' else (slice(None),)

  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Conv(4, (3, 3), padding=padding, mask=MASK, param_dtype=jnp.float64,
                     name='conv')(x)

  variables = Linen().init(jax.random.key(1), x)
  rp = geoparam.reparameterize(Linen(), 'gmp_imn')
  converted = geoparam.to_reparameterized(rp, variables, x)
  np.testing.assert_allclose(rp.apply(converted, x), Linen().apply(variables, x), atol=1e-12)
  moved = jax.tree.map(lambda a: a + 0.3, converted)  # IMN's mean and the params trained
  baked = geoparam.bake(rp, moved, x, approximate_borders=padding == 'SAME')
  np.testing.assert_allclose(Linen().apply(baked, x)[where], rp.apply(moved, x)[where],
                             atol=1e-12)

  layer = nnx.Conv(2, 4, (3, 3), padding=padding, mask=jnp.asarray(MASK),
                   param_dtype=jnp.float64, rngs=nnx.Rngs(1))
  y = layer(x)
  wrapper = gnnx.reparameterize(layer, 'gmp_imn', x)
  np.testing.assert_allclose(wrapper(x), y, atol=1e-12)
  wrapper.input_mean_norm['mean'][...] = wrapper.input_mean_norm['mean'][...] + 0.3
  want = wrapper(x)
  plain = gnnx.bake(wrapper, approximate_borders=padding == 'SAME')
  np.testing.assert_allclose(plain(x)[where], want[where], atol=1e-12)
