"""Tests for the weight-decay mask helper."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from geoparam import PReLU
from geoparam.linen.layers import LCWDense
from geoparam.masks import decay_mask, decay_mask_by


class Net(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4)(x)
    x = nn.LayerNorm()(x)
    x = PReLU()(x)
    x = LCWDense(4)(x)
    x = PReLU(channel_shared=True)(x)
    return nn.Dense(2, use_bias=False)(x)


@pytest.fixture(scope='module')
def params():
  # Shapes from eval_shape, values from numpy (no jax.random compile).
  shapes = jax.eval_shape(Net().init, jax.random.key(0), jnp.ones((1, 3)))['params']
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), shapes)


def test_mask_values(params):
  mask = decay_mask(params)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  assert mask['Dense_0'] == {'kernel': True, 'bias': False}
  assert mask['LayerNorm_0'] == {'scale': False, 'bias': False}
  assert mask['PReLU_0'] == {'negative_slope': False}
  assert mask['PReLU_1'] == {'negative_slope': False}
  assert mask['LCWDense_0'] == {'v': True, 'bias': False}
  assert mask['Dense_1'] == {'kernel': True}


def test_gmp_style_names_not_decayed():
  params = {'GmPDense_0': {'theta': jnp.ones((2, 3)), 'lam': jnp.ones(3), 'scale': jnp.ones(3)}}
  mask = decay_mask(params)
  assert not any(jax.tree.leaves(mask))
  mask = decay_mask(params, decayed_names=('scale',))
  assert mask['GmPDense_0'] == {'theta': False, 'lam': False, 'scale': True}


def test_add_decayed_weights_skips_slopes(params):
  wd = 0.5
  tx = optax.add_decayed_weights(wd, mask=decay_mask)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  # Decayed leaves get wd * p, others stay 0.
  np.testing.assert_allclose(updates['Dense_0']['kernel'], wd * params['Dense_0']['kernel'])
  np.testing.assert_allclose(updates['LCWDense_0']['v'], wd * params['LCWDense_0']['v'])
  for leaf in (updates['PReLU_0']['negative_slope'], updates['PReLU_1']['negative_slope'],
               updates['Dense_0']['bias'], updates['LayerNorm_0']['scale']):
    np.testing.assert_array_equal(leaf, 0.0)


def test_sgd_with_masked_decay_keeps_slope(params):
  tx = optax.chain(optax.add_decayed_weights(0.1, mask=decay_mask(params)), optax.sgd(1.0))
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new['PReLU_0']['negative_slope'],
                                params['PReLU_0']['negative_slope'])
  np.testing.assert_allclose(new['Dense_1']['kernel'], 0.9 * params['Dense_1']['kernel'],
                             rtol=1e-6)


def test_optax_masked_with_mask(params):
  tx = optax.masked(optax.add_decayed_weights(1.0), decay_mask)
  updates, _ = tx.update(params, tx.init(params), params)
  np.testing.assert_allclose(updates['Dense_0']['kernel'], 2 * params['Dense_0']['kernel'])
  np.testing.assert_allclose(updates['PReLU_0']['negative_slope'],
                             params['PReLU_0']['negative_slope'])


def test_predicate_and_bad_names():
  params = {'a': {'kernel': jnp.ones(2)}, 'b': {'kernel': jnp.ones(2)}}
  mask = decay_mask_by(params, lambda names, leaf: names[0] == 'a')
  assert mask == {'a': {'kernel': True}, 'b': {'kernel': False}}
  with pytest.raises(ValueError, match='decayed_names'):
    decay_mask(params, decayed_names='kernel')


# ----------------------------------------------------------------------------- param_groups

from flax import nnx  # noqa: E402

import geoparam  # noqa: E402
import geoparam.nnx as gnnx  # noqa: E402
from geoparam.masks import GROUPS, param_groups  # noqa: E402
from tests import transform_models  # noqa: E402

# What each method's variables are, written out here (the code reads them off the records).
ROLES = {
    'gmp': {'theta': 'direction', 'lam': 'bias', 'scale': 'scale'},
    'gmp_imn': {'theta': 'direction', 'lam': 'bias', 'scale': 'scale'},
    'lcw': {'v': 'direction', 'bias': 'bias'},
    'wn': {'kernel': 'direction', 'scale': 'scale', 'bias': 'bias'},
    'cwn': {'kernel': 'direction', 'scale': 'scale', 'bias': 'bias'},
}
RATES = {'direction': 0.1, 'scale': 0.01, 'bias': 0.001, 'weight': 1.0, 'norm': 0.5,
         'fixed': 0.0, 'other': 0.0}


def _partition():
  return optax.partition({g: optax.sgd(RATES[g]) for g in GROUPS}, param_groups)


@pytest.mark.parametrize('method', sorted(ROLES))
def test_param_groups_of_every_method_from_its_record(method):
  wrap = lambda layer: geoparam.Reparam(layer, method, use_running_average=False)
  model = nn.Sequential([wrap(nn.Dense(4)), nn.LayerNorm(), wrap(nn.Dense(2, use_bias=False)),
                         nn.Dense(2)])
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 3)))['params']
  labels = param_groups(params)
  assert jax.tree.structure(labels) == jax.tree.structure(params)
  assert labels['layers_0'] == ROLES[method]
  assert labels['layers_1'] == {'scale': 'norm', 'bias': 'norm'}
  no_bias = {k: v for k, v in ROLES[method].items() if v != 'bias'}
  assert labels['layers_2'] == no_bias
  assert labels['layers_3'] == {'kernel': 'weight', 'bias': 'bias'}


def test_param_groups_fixed_sign_and_other_leaves():
  shapes = lambda m, x: jax.eval_shape(m.init, jax.random.key(0), x)['params']
  x = jnp.ones((2, 1))
  params = {'layers_0': shapes(geoparam.GmP(nn.Dense(3)), x),
            'layers_1': shapes(geoparam.PReLU(), x),
            'layers_2': shapes(nn.Embed(5, 2), jnp.ones((2,), jnp.int32))}
  labels = param_groups(params)
  assert labels['layers_0'] == {'theta': 'direction', 'lam': 'bias', 'scale': 'scale',
                                'sign': 'fixed'}  # fan-in 1
  assert labels['layers_1'] == {'negative_slope': 'other'}
  assert labels['layers_2'] == {'embedding': 'weight'}


def test_param_groups_label_a_converted_resnet_and_step_each_group_at_its_rate():
  model = transform_models.ResNet(stage_sizes=(1, 1), num_filters=4, num_classes=3)
  rp = geoparam.reparameterize(model, 'gmp_imn', drop_batchnorm=True, exclude=['head'])
  x = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
  params = jax.eval_shape(lambda x: rp.init(jax.random.key(0), x, train=False), x)['params']
  labels = param_groups(params)
  leaves = jax.tree_util.tree_flatten_with_path(labels)[0]
  assert {label for _, label in leaves} == {'direction', 'scale', 'bias', 'weight'}
  for path, label in leaves:  # every conv is GmP (its BatchNorm dropped), the head plain
    name = path[-1].key
    expected = ('weight' if name == 'kernel' else 'bias') if path[0].key == 'head' else (
        ROLES['gmp'][name])
    assert label == expected, (path, label)
  # one step of three (and more) rates: each group moves by its own rate times its gradient
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 2.0), params)
  tx = _partition()
  updates, _ = tx.update(grads, tx.init(params), params)
  for u, label in zip(jax.tree.leaves(updates), jax.tree.leaves(labels)):
    np.testing.assert_allclose(u, -2.0 * RATES[label], rtol=1e-6)


class _Attention(nnx.Module):
  """A small attention block whose call reads its projections' sizes as model code does."""

  def __init__(self, dim, heads, rngs):
    self.heads = heads
    self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
    self.out = nnx.Linear(dim, dim, rngs=rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.down = nnx.Linear(2 * dim, dim, rngs=rngs)
    self.head = nnx.Linear(dim, 3, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.norm(x)), 3, axis=-1)
    split = lambda a: a.reshape(b, t, self.heads, d // self.heads)
    w = jax.nn.softmax(jnp.einsum('bthd,bshd->bhts', split(q), split(k)) / 2.0, axis=-1)
    x = x + self.out(jnp.einsum('bhts,bshd->bthd', w, split(v)).reshape(b, t, d))
    x = x + self.down(nnx.relu(self.up(x)))
    return self.head(x)


def test_param_groups_of_an_nnx_transformer_in_nnx_optimizer():
  model = _Attention(8, 2, nnx.Rngs(0))
  model = gnnx.reparameterize(model, 'gmp', where=lambda _, p: p[-1] in ('up', 'down'))
  model = gnnx.reparameterize(model, 'wn', where=lambda _, p: p[-1] in ('qkv', 'out'))
  state = nnx.state(model, nnx.Param)
  labels = param_groups(state).to_pure_dict()
  assert labels['up'] == labels['down'] == ROLES['gmp']
  assert labels['qkv'] == labels['out'] == ROLES['wn']
  assert labels['norm'] == {'scale': 'norm', 'bias': 'norm'}
  assert labels['head'] == {'kernel': 'weight', 'bias': 'bias'}
  # the mask reads NNX paths (they end in a Variable's .value) by their names
  mask = decay_mask(state).to_pure_dict()
  assert mask['head'] == {'kernel': True, 'bias': False} and mask['qkv']['kernel']
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 8)), jnp.float32)
  optimizer = nnx.Optimizer(model, _partition(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return grads

  for _ in range(2):
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict())
    g = step(model, optimizer).to_pure_dict()
    after = nnx.state(model, nnx.Param).to_pure_dict()
    for layer, leaves in labels.items():
      for name, label in leaves.items():
        assert np.any(g[layer][name] != 0), (layer, name)
        np.testing.assert_allclose(after[layer][name] - before[layer][name],
                                   -RATES[label] * g[layer][name], rtol=1e-4, atol=1e-6,
                                   err_msg=f'{layer}/{name}')


class _LinenBlock(nn.Module):
  """A pre-LN transformer block of flax's own attention and an MLP, then a plain head."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(2, name='attn')(nn.LayerNorm(name='ln1')(x))
    h = nn.relu(geoparam.GmP(nn.Dense(16), name='up')(nn.LayerNorm(name='ln2')(x)))
    return nn.Dense(3, name='head')(x + geoparam.GmP(nn.Dense(8), name='down')(h))


def test_param_groups_of_a_converted_linen_transformer_train_at_their_rates():
  model, x = _LinenBlock(), jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 8)),
                                        jnp.float32)
  rp = geoparam.reparameterize(model, 'wn', where=lambda _, p: p[0] == 'attn')  # GmP: its own
  params = rp.init(jax.random.key(0), x)['params']
  labels = param_groups(params)
  assert {k: labels['attn'][k] for k in ('query', 'key', 'value', 'out')} == dict.fromkeys(
      ('query', 'key', 'value', 'out'), ROLES['wn'])
  assert labels['up'] == labels['down'] == ROLES['gmp']
  assert labels['ln1'] == {'scale': 'norm', 'bias': 'norm'}
  assert labels['head'] == {'kernel': 'weight', 'bias': 'bias'}
  tx = _partition()

  @jax.jit
  def step(params, state):
    grads = jax.grad(lambda p: jnp.sum(rp.apply({'params': p}, x) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, grads

  new, _, grads = step(params, tx.init(params))
  moved = jax.tree.map(lambda a, b, g, label: (np.asarray(a - b), -RATES[label] * np.asarray(g)),
                       new, params, grads, labels)
  for delta, expected in jax.tree.leaves(moved, is_leaf=lambda t: isinstance(t, tuple)):
    np.testing.assert_allclose(delta, expected, rtol=1e-4, atol=1e-6)
