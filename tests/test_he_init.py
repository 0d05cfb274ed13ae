"""Tests for He initialization (paper 001: 1/2 (1 + a^2) n Var(w) = 1)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geoparam.he_init import he_normal, he_std, he_uniform

# One large draw per distribution: each new jax.random shape costs a compile on CPU.
SHAPE = (3, 3, 256, 128)  # fan_in = 2304, fan_out = 1152; 295k samples


@pytest.mark.parametrize('make', [he_normal, he_uniform])
@pytest.mark.parametrize('a,mode,fan', [
    (0.0, 'fan_in', 9 * 256),
    (0.25, 'fan_in', 9 * 256),
    (0.0, 'fan_out', 9 * 128),
    (1.0, 'fan_out', 9 * 128),
])
def test_empirical_variance_within_5_percent(make, a, mode, fan):
  w = np.asarray(make(negative_slope=a, mode=mode)(jax.random.key(0), SHAPE), np.float64)
  target = 2.0 / ((1.0 + a * a) * fan)
  assert abs(w.var() / target - 1.0) < 0.05
  assert abs(w.mean()) < 5 * np.sqrt(target / w.size)
  # The defining identity of paper 001.
  assert abs(0.5 * (1 + a * a) * fan * w.var() - 1.0) < 0.05


def test_distribution_shapes():
  wn = np.asarray(he_normal()(jax.random.key(1), SHAPE))
  wu = np.asarray(he_uniform()(jax.random.key(1), SHAPE))
  std = np.sqrt(2.0 / 2304)
  # Uniform: bounded by sqrt(3) std; normal: has tails beyond it (kurtosis 3 vs 1.8).
  assert np.max(np.abs(wu)) <= np.sqrt(3) * std * (1 + 1e-6)
  assert np.max(np.abs(wn)) > 3 * std
  kurt = lambda w: np.mean(w**4) / np.mean(w**2) ** 2
  assert abs(kurt(wn) - 3.0) < 0.1
  assert abs(kurt(wu) - 1.8) < 0.05


@pytest.mark.parametrize('shape,mode,fan', [
    ((100, 30), 'fan_in', 100),
    ((100, 30), 'fan_out', 30),
    ((5, 8, 16), 'fan_in', 40),  # 1-D conv
    ((5, 8, 16), 'fan_out', 80),
    ((2, 3, 4, 8, 16), 'fan_in', 24 * 8),  # 3-D conv
])
def test_he_std_fans(shape, mode, fan):
  assert he_std(shape, 0.5, mode) == pytest.approx(np.sqrt(2.0 / (1.25 * fan)), rel=1e-12)


def test_flax_initializer_in_layers():
  dense = nn.Dense(64, kernel_init=he_normal(mode='fan_out'))
  kernel = dense.init(jax.random.key(0), jnp.ones((1, 32)))['params']['kernel']
  assert kernel.shape == (32, 64) and kernel.dtype == jnp.float32


def test_bad_arguments():
  with pytest.raises(ValueError, match="mode must be one of"):
    he_normal(mode='fan_avg')
  with pytest.raises(ValueError, match="mode must be one of"):
    he_uniform(mode='forward')
  with pytest.raises(ValueError, match='negative_slope'):
    he_normal(negative_slope=float('nan'))
  with pytest.raises(ValueError, match='kernel shape'):
    he_normal()(jax.random.key(0), (10,))
