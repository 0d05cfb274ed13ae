"""experiments.models: the table of parameterizations and the layer built from each row."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import models

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
