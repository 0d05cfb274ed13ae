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
