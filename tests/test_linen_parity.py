"""What model code reads and supplies keeps working after the linen `geoparam.reparameterize`:
fields of its layers, kernels it applies itself (a tied head), partitioning names shorter than
the kernel, the effective kernel as an intermediate; and custom layer kinds fail clearly."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam
from geoparam import kinds
from geoparam.methods import gmp as gmp_method


def _sgd_steps(rp, variables, x, steps=2):
  """A few SGD steps of `rp` on `sum(y^2)`: the new variables and the losses."""
  tx = optax.sgd(1e-2)
  params, state, losses = variables['params'], tx.init(variables['params']), []
  for _ in range(steps):
    loss, grads = jax.value_and_grad(lambda p: jnp.sum(rp.apply({**variables, 'params': p}, x)
                                                       ** 2))(params)
    updates, state = tx.update(grads, state, params)
    params, losses = optax.apply_updates(params, updates), losses + [float(loss)]
  return {**variables, 'params': params}, losses


class Attention(nn.Module):
  """As flax's lm1b example: the output projection's 3-D kernel gets two logical names."""

  @nn.compact
  def __call__(self, x):
    init = lambda names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    y = nn.DenseGeneral((2, 4), kernel_init=init(('embed', 'heads', 'kv')), name='q')(x)
    return nn.DenseGeneral(8, axis=(-2, -1), kernel_init=init(('embed', 'kv')), name='out')(y)


def test_fewer_partition_names_than_kernel_axes_convert_train_and_bake():
  model, x = Attention(), jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)), jnp.float32)
  plain = model.init(jax.random.key(0), x)
  rp = geoparam.reparameterize(model, 'gmp')
  names = lambda v: jax.tree.map(lambda a: getattr(a, 'names', None), v['params'],
                                 is_leaf=lambda a: isinstance(a, nn.Partitioned))
  fresh = names(rp.init(jax.random.key(0), x))
  # the unnamed third axis of 'out' (its units) stays unnamed, as in a PartitionSpec
  assert fresh['out'] == {'lam': (None,), 'scale': (None,), 'theta': (None, None)}
  assert fresh['q'] == {'lam': ('heads',), 'scale': ('heads',), 'theta': (None, 'heads')}
  converted = geoparam.to_reparameterized(rp, plain, x)
  assert names(converted) == fresh
  np.testing.assert_allclose(rp.apply(converted, x), model.apply(plain, x), atol=1e-5)
  trained, losses = _sgd_steps(rp, converted, x)
  assert losses[1] < losses[0]
  baked = geoparam.bake(rp, trained, x)
  assert names(baked) == names(plain)
  np.testing.assert_allclose(model.apply(baked, x), rp.apply(trained, x), atol=1e-5)


class TiedHead(nn.Module):
  """A head that applies the embedding's transpose as its kernel (as Hugging Face Flax does)."""

  @nn.compact
  def __call__(self, ids):
    wte = nn.Embed(10, 8, name='wte')
    h = nn.relu(nn.Dense(8, name='mlp')(wte(ids)))
    return nn.Dense(10, use_bias=False).apply({'params': {'kernel': wte.embedding.T}}, h)


def test_a_kernel_the_model_supplies_itself_stays_plain_and_tied():
  model, ids = TiedHead(), jnp.arange(6).reshape(2, 3)
  plain = model.init(jax.random.key(0), ids)
  rp = geoparam.reparameterize(model, 'gmp')
  assert jax.tree.map(jnp.shape, rp.init(jax.random.key(0), ids)['params']) == {
      'mlp': {'lam': (8,), 'scale': (8,), 'theta': (7, 8)}, 'wte': {'embedding': (10, 8)}}
  converted = geoparam.to_reparameterized(rp, plain, ids)
  np.testing.assert_allclose(rp.apply(converted, ids), model.apply(plain, ids), atol=1e-5)
  # the tie holds: the embedding's gradient has the head's part (rows of ids never looked up)
  grads = jax.grad(lambda p: jnp.sum(rp.apply({'params': p}, ids) ** 2))(converted['params'])
  assert np.abs(np.asarray(grads['wte']['embedding'])[6:]).max() > 0
  trained, losses = _sgd_steps(rp, converted, ids)
  assert losses[1] < losses[0]
  baked = geoparam.bake(rp, trained, ids)
  np.testing.assert_allclose(model.apply(baked, ids), rp.apply(trained, ids), atol=1e-5)


class Reads(nn.Module):
  """Model code that reads its layer's fields."""

  def setup(self):
    self.proj = nn.Dense(6)
    self.out = nn.Dense(2)

  def __call__(self, x):
    h = nn.relu(self.proj(x)).reshape(x.shape[0], self.proj.features // 2, 2)
    return self.out(h.sum(1))


def test_the_effective_kernel_is_an_intermediate_and_fields_read_as_before():
  model, x = Reads(), jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)
  rp = geoparam.reparameterize(model, 'gmp', exclude=['out'])
  variables = rp.init(jax.random.key(0), x)
  y, state = rp.apply(variables, x, mutable=['intermediates'])
  np.testing.assert_array_equal(y, rp.apply(variables, x))
  kernel = state['intermediates']['proj']['kernel'][0]
  bias = state['intermediates']['proj']['bias'][0]
  baked = geoparam.bake(rp, variables, x)['params']['proj']
  np.testing.assert_allclose(kernel, baked['kernel'], atol=1e-6)
  np.testing.assert_allclose(bias, baked['bias'], atol=1e-6)
  # capture_intermediates gives it too, and its gradient is the method's map's
  _, captured = rp.apply(variables, x, capture_intermediates=True)
  np.testing.assert_array_equal(captured['intermediates']['proj']['kernel'][0], kernel)
  probe = jnp.asarray(np.random.default_rng(2).normal(size=kernel.shape), jnp.float32)

  def read(theta):
    params = {**variables['params'], 'proj': {**variables['params']['proj'], 'theta': theta}}
    _, s = rp.apply({'params': params}, x, mutable=['intermediates'])
    return jnp.sum(s['intermediates']['proj']['kernel'][0] * probe)

  theta, scale = variables['params']['proj']['theta'], variables['params']['proj']['scale']
  direct = jax.grad(lambda t: jnp.sum(scale * gmp_method.gmp_kernel(t) * probe))(theta)
  np.testing.assert_allclose(jax.grad(read)(theta), direct, rtol=1e-5, atol=1e-6)
  assert 'intermediates' not in rp.init(jax.random.key(0), x)  # nothing sown unless asked


def test_bake_under_jit_says_it_runs_on_concrete_variables():
  model, x = Reads(), jnp.ones((2, 3))
  rp = geoparam.reparameterize(model, 'gmp', exclude=['out'])
  variables = rp.init(jax.random.key(0), x)
  with pytest.raises(TypeError, match='traced.*outside the transformation'):
    jax.jit(lambda v: geoparam.bake(rp, v, x))(variables)


class MyDense(nn.Module):
  """A dense layer of a user's own, its kernel named `weight`."""
  features: int

  @nn.compact
  def __call__(self, x):
    w = self.param('weight', nn.initializers.lecun_normal(), (x.shape[-1], self.features))
    return x @ w


class UsesMine(nn.Module):

  @nn.compact
  def __call__(self, x):
    return MyDense(4, name='mine')(x)


def _kind(**fields):
  layout = lambda layer, shape: kinds.Layout((shape[-1], layer.features), (1,))
  return kinds.Kind('MyDense', **{'layout': layout, 'imn_axes': lambda layer, ndim: (ndim - 1,),
                                  'kernel': 'weight', 'has_bias': lambda layer: False, **fields})


def test_custom_kinds_fail_clearly(monkeypatch):
  model, x = UsesMine(), jnp.ones((2, 3))
  plain = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r'no layer was selected.*kinds\.register'):
    geoparam.reparameterize(model, 'gmp').init(jax.random.key(0), x)
  monkeypatch.setitem(kinds.REGISTRY, MyDense, _kind())  # registered right: it converts
  rp = geoparam.reparameterize(model, 'gmp')
  converted = geoparam.to_reparameterized(rp, plain, x)
  np.testing.assert_allclose(rp.apply(converted, x), model.apply(plain, x), atol=1e-5)
  monkeypatch.setitem(kinds.REGISTRY, MyDense, _kind(kernel='w'))
  with pytest.raises(ValueError, match=r"names the kernel variable 'w'.*holds \['weight'\]"):
    geoparam.to_reparameterized(geoparam.reparameterize(model, 'gmp'), plain, x)
  monkeypatch.setitem(kinds.REGISTRY, MyDense, _kind(layout=lambda layer, shape: (3, 4)))
  with pytest.raises(TypeError, match=r'returned \(3, 4\).*not a geoparam\.kinds\.Layout'):
    geoparam.to_reparameterized(geoparam.reparameterize(model, 'gmp'), plain, x)
  wrong = lambda layer, shape: kinds.Layout((shape[-1], 5), (1,))  # 5 features, not 4
  monkeypatch.setitem(kinds.REGISTRY, MyDense, _kind(layout=wrong))
  with pytest.raises(ValueError, match=r"\(3, 4\), but its kind's layout gives \(3, 5\)"):
    geoparam.to_reparameterized(geoparam.reparameterize(model, 'gmp'), plain, x)


def test_reparameterizing_a_reparameterized_model_says_how_to_mix_methods():
  rp = geoparam.reparameterize(Reads(), 'wn', exclude=['out'])
  with pytest.raises(TypeError, match=r"already reparameterized by 'wn'.*geoparam\.Reparam"):
    geoparam.reparameterize(rp, 'gmp')


def test_a_wrapped_layer_reads_its_layers_fields():
  class Model(nn.Module):

    def setup(self):
      self.dense = geoparam.GmP(nn.Dense(6))
      self.conv = geoparam.WN(nn.Conv(4, (3, 3), strides=2))

    def __call__(self, x):  # model code reading its layers' fields
      assert (self.dense.features, self.conv.kernel_size, self.conv.strides) == (6, (3, 3), 2)
      return self.dense(x)

  shapes = jax.eval_shape(Model().init, jax.random.key(0), jnp.ones((2, 3)))
  assert jax.tree.map(jnp.shape, shapes['params']['dense']) == {
      'lam': (6,), 'scale': (6,), 'theta': (2, 6)}
  with pytest.raises(AttributeError, match='nothing'):
    geoparam.GmP(nn.Dense(6)).nothing  # pylint: disable=expression-not-assigned
