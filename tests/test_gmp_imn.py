"""IMN inside the GmP layers: the folded bias equals explicit subtraction (issue 6)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import geoparam


class _Explicit(nn.Module):
  """Reference: InputMeanNorm, then GmPDense without IMN, sharing the same params."""
  features: int

  @nn.compact
  def __call__(self, x, use_running_average):
    x = geoparam.InputMeanNorm(name='imn')(x, use_running_average=use_running_average)
    return geoparam.GmPDense(self.features, name='gmp')(x)


@pytest.mark.parametrize('shape', [(16, 7), (3, 5, 7)])
def test_folded_imn_equals_explicit_subtraction(shape):
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float64) * 2 + 3
    folded = geoparam.GmPDense(4, input_mean_norm=True, param_dtype=jnp.float64)
    v = folded.init(jax.random.key(1), x, use_running_average=False)
    v = jax.tree.map(lambda a: a + 0.1, v)  # non-zero lam and running mean
    explicit = _Explicit(4)
    ve = {'params': {'gmp': v['params']},
          'batch_stats': {'imn': {'mean': v['batch_stats']['input_mean_norm']['mean']}}}
    for train in (True, False):
      kw = dict(use_running_average=not train)
      if train:
        a, sa = folded.apply(v, x, mutable=['batch_stats'], **kw)
        b, sb = explicit.apply(ve, x, mutable=['batch_stats'], **kw)
        np.testing.assert_allclose(sa['batch_stats']['input_mean_norm']['mean'], sb['batch_stats']['imn']['mean'],
                                   rtol=1e-12)
      else:
        a = folded.apply(v, x, **kw)
        b = explicit.apply(ve, x, **kw)
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
      # Gradients w.r.t. params and inputs agree too (the batch mean depends on x in training).
      ga = jax.grad(lambda p, x: folded.apply({**v, 'params': p}, x, mutable=['batch_stats'], **kw)[0].sum()
                    if train else folded.apply({**v, 'params': p}, x, **kw).sum(), argnums=(0, 1))(v['params'], x)
      gb = jax.grad(lambda p, x: explicit.apply({**ve, 'params': {'gmp': p}}, x, mutable=['batch_stats'], **kw)[0].sum()
                    if train else explicit.apply({**ve, 'params': {'gmp': p}}, x, **kw).sum(), argnums=(0, 1))(v['params'], x)
      for ka in ('theta', 'lam', 'scale'):
        np.testing.assert_allclose(ga[0][ka], gb[0][ka], rtol=1e-9, atol=1e-12)
      np.testing.assert_allclose(ga[1], gb[1], rtol=1e-9, atol=1e-12)


def test_conv_imn_subtracts_before_padding():
  """GmPConv with IMN equals GmPConv without IMN applied to x - batch mean (zero padded)."""
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 3), jnp.float64) + 5
    conv = geoparam.GmPConv(4, (3, 3), padding='SAME', input_mean_norm=True, param_dtype=jnp.float64)
    v = conv.init(jax.random.key(1), x, use_running_average=False)
    y, _ = conv.apply(v, x, use_running_average=False, mutable=['batch_stats'])
    plain = geoparam.GmPConv(4, (3, 3), padding='SAME', param_dtype=jnp.float64)
    ref = plain.apply({'params': v['params']}, x - x.mean(axis=(0, 1, 2)))
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
