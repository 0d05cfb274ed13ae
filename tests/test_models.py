"""experiments.lib.models: the table of parameterizations and the layer built from each row."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import geoparam
from experiments.lib import models

EXPECTED = {  # method -> (module of `name`, extra submodules)
    'sp': ('Dense', ()), 'wn': ('Dense', ('_wn',)), 'wn_mbn': ('Dense', ('_wn', '_mbn')),
    'bn': ('Dense', ('_bn',)), 'gmp': ('GmPDense', ()), 'gmp_imn': ('GmPDense', ()),
    'lcw': ('LCWDense', ()), 'bn_lcw': ('LCWDense', ('_bn',)), 'cwn': ('CWNDense', ()),
    'sn': ('Dense', ('_sn',)), 'sl': ('Dense', ('_sl',)), 'bn_wn': ('Dense', ('_wn', '_bn')),
    'bn_cwn': ('CWNDense', ('_bn',)), 'bn_sn': ('Dense', ('_sn', '_bn')),
}


class One(nn.Module):
  method: str
  conv: bool = False
  activation: object = nn.relu

  @nn.compact
  def __call__(self, x, train=False):
    return models.layer(x, self.method, 6, name='h', train=train, first=False,
                        activation=self.activation, kernel_size=(3, 3) if self.conv else None)


def test_every_row_is_tested():
  assert set(EXPECTED) == set(models.PARAMETERIZATIONS)
  assert set(models.METHODS) < set(models.PARAMETERIZATIONS)


@pytest.mark.parametrize('conv', [False, True])
@pytest.mark.parametrize('method', sorted(EXPECTED))
def test_each_row_builds_its_layers(method, conv):
  x = jax.random.normal(jax.random.key(0), (4, 5, 5, 3) if conv else (4, 3))
  model = One(method, conv)
  variables = model.init(jax.random.key(1), x, train=False)
  y, state = model.apply(variables, x, train=True, mutable=['batch_stats', 'intermediates'])
  assert y.shape == x.shape[:-1] + (6,) and bool(jnp.all(jnp.isfinite(y)))
  if models.PARAMETERIZATIONS[method].norm != 'sl':  # SL standardizes after the ReLU
    assert bool(jnp.all(y >= 0)), 'a ReLU layer'
  names = set(variables['params']) | set(variables.get('batch_stats', {}))
  layer_cls, extra = EXPECTED[method]
  assert names == {'h', *(f'h{e}' for e in extra)}
  kind = layer_cls.replace('Dense', 'Conv') if conv else layer_cls
  called = {}

  def record(f, args, kwargs, context):
    called.setdefault(context.module.name, type(context.module).__name__)
    return f(*args, **kwargs)

  with nn.intercept_methods(record):
    model.apply(variables, x, mutable=['batch_stats'])
  assert called['h'] == kind
  # Pre-activation BN / MBN: the weight layer has no bias of its own.
  has_bias = 'bias' in variables['params']['h'] or 'lam' in variables['params']['h']
  assert has_bias == (models.PARAMETERIZATIONS[method].norm not in ('bn', 'mbn'))
  if method == 'gmp_imn':  # IMN keeps a running mean of the inputs
    assert state['batch_stats']['h']['input_mean_norm']['mean'].shape == (3,)


def test_lcw_rows_have_zero_sum_weights():
  x = jax.random.normal(jax.random.key(0), (4, 7))
  variables = One('lcw').init(jax.random.key(2), x)
  # The layer's effective kernel, read off by differentiating the pre-activation.
  pre = One('lcw', activation=lambda z: z)
  kernel = jax.jacfwd(lambda z: pre.apply(variables, z[None])[0])(x[0])  # (6, 7)
  np.testing.assert_allclose(kernel.sum(axis=1), 0.0, atol=1e-5)


def test_gmp_refuses_another_activation():
  with pytest.raises(ValueError, match='activation must be nn.relu'):
    One('gmp', activation=nn.sigmoid).init(jax.random.key(0), jnp.ones((2, 3)))


def test_check_methods_names_the_accepted_ones():
  assert models.check_methods(['GmP ', 'sp']) == ('gmp', 'sp')
  with pytest.raises(ValueError, match='accepted: sp, wn, wn_mbn, bn, gmp, gmp_imn'):
    models.check_methods(['lcw'])
  assert models.check_methods(['lcw'], accepted=models.PARAMETERIZATIONS) == ('lcw',)


def test_apply_train_updates_every_collection_but_params():
  model = models.MLP(hidden=(4,), out=1, method='bn')
  x = jax.random.normal(jax.random.key(0), (8, 3))
  variables = model.init(jax.random.key(1), x)
  out, updates = models.apply_train(model, variables, x)
  assert out.shape == (8, 1) and set(updates) == {'batch_stats'}
  ref, _ = model.apply(variables, x, train=True, mutable=['batch_stats'])
  np.testing.assert_array_equal(out, ref)
  assert not np.allclose(updates['batch_stats']['hidden_0_bn']['mean'],
                         variables['batch_stats']['hidden_0_bn']['mean'])
  sp = models.MLP(hidden=(4,), out=1, method='sp')
  assert models.apply_train(sp, sp.init(jax.random.key(1), x), x)[1] == {}


def test_member_takes_one_row_of_every_leaf():
  tree = {'a': jnp.arange(6).reshape(3, 2), 'b': {'c': jnp.arange(3.0)}}
  got = models.member(tree, 1)
  np.testing.assert_array_equal(got['a'], [2, 3])
  assert float(got['b']['c']) == 1.0


class _Pre(nn.Module):
  """MLP's hidden layer without its ReLU."""
  method: str

  @nn.compact
  def __call__(self, z, train):
    return models.layer(z, self.method, 5, name='hidden_0', train=train, first=True,
                        activation=lambda a: a, bn_epsilon=models.BN_EPSILON,
                        param_dtype=jnp.float64)


@pytest.mark.parametrize('method', ['bn', 'wn_mbn', 'sp'])
def test_hidden_layer_folds_batch_or_running_statistics(method):
  """phi of `hidden_layer(v, m, x)` zeroes the training-mode pre-activation on the batch x,
  phi of `hidden_layer(v, m)` the evaluation-mode one (running statistics)."""
  from geoparam import analysis  # pylint: disable=g-import-not-at-top
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), (16, 1), jnp.float64) * 3 + 1
    model = models.MLP(hidden=(5,), out=1, method=method, param_dtype=jnp.float64)
    variables = model.init(jax.random.key(2), x)
    variables = jax.tree.map(lambda a: a + 0.3, variables)  # running stats away from the batch's
    own = {k: {n: v for n, v in c.items() if n != 'out'} for k, c in variables.items()}
    for x_stats, train in ((x, True), (None, False)):
      phi = analysis.boundary_location(models.hidden_layer(variables, method, x_stats),
                                       method)[:, 0]
      pre = _Pre(method).apply(own, x, train, mutable=['batch_stats'])[0]  # (16, 5), affine in x
      slope = (pre[1] - pre[0]) / (x[1, 0] - x[0, 0])
      np.testing.assert_allclose(pre[0] + slope * (phi - x[0, 0]), 0.0,
                                 atol=1e-9 if train else 1e-6)  # eval BN: 2e-8 (flax)


def test_boundary_changes_masks_stopped_epochs():
  locations = jnp.array([[[[0.0]], [[1.0]], [[3.0]], [[3.5]], [[3.5]]]])  # (1, 5, 1, 1)
  directions = jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 1.0]], [[-1.0, 0.0]],
                           [[-1.0, 0.0]]]])  # (1, 5, 1, 2)
  active = jnp.array([[True, False]])  # two epochs of two steps; the second did not run
  got = models.boundary_changes(active, locations[..., :1, :], directions, steps_per_epoch=2)
  np.testing.assert_allclose(got['max_dphi'], [[1.0, 2.0, np.nan, np.nan]])
  np.testing.assert_allclose(got['max_dtheta_deg'], [[90.0, 0.0, np.nan, np.nan]], atol=1e-5)
  only = models.boundary_changes(jnp.array([[True, True, True, False]]), locations)
  assert set(only) == {'max_dphi'}
  np.testing.assert_allclose(only['max_dphi'], [[1.0, 2.0, 0.5, np.nan]])


def test_a_registered_library_method_is_a_study_method_with_one_row(monkeypatch):
  """A method of geoparam's registry that `WEIGHTS` does not list is built as
  `geoparam.Reparam` of the plain layer: one `PARAMETERIZATIONS` row makes it a study method."""
  monkeypatch.setitem(models.PARAMETERIZATIONS, 'cwn_imn',
                      models.Method(geoparam.methods.with_imn(geoparam.methods.get('cwn')),
                                    None, 'CWN + IMN from the library'))

  class Net(nn.Module):
    method: str

    @nn.compact
    def __call__(self, x, train=False):
      return models.layer(x, self.method, 3, name='h', train=train)

  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)) + 1.0, jnp.float32)
  variables = Net('cwn_imn').init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, variables) == {
      'batch_stats': {'h': {'input_mean_norm': {'mean': (4,)}}},
      'params': {'h': {'bias': (3,), 'kernel': (4, 3), 'scale': (3,)}}}
  p = variables['params']['h']
  y, _ = Net('cwn_imn').apply(variables, x, train=True, mutable=['batch_stats'])
  c = np.asarray(p['kernel']) - np.asarray(p['kernel']).mean(0)
  w = c / np.linalg.norm(c, axis=0) * np.asarray(p['scale'])
  xn = np.asarray(x, np.float64)
  ref = np.maximum((xn - xn.mean(0)) @ w + np.asarray(p['bias']), 0)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='REGISTRY'):
    models.weights(x, 'nope', 3, name='h', train=False)
