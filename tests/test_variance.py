"""Tests for the minibatch-based init and the variance analysis (paper 003 Sec. 4)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.lib import plotting
from geoparam import methods
from geoparam import variance
from geoparam.linen import variance as linen_variance
from geoparam.linen.layers import CWNDense, LCWConv, LCWDense
from geoparam.methods.lcw import kernel_from_v, v_from_kernel


def numpy_params(model, x, seed=0, scale=1.0):
  """Parameters of `model.init`'s shapes: numpy uniform kernels, zero biases, unit gains."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)

  def fill(path, s):
    name = path[-1].key
    if name == 'bias':
      return jnp.zeros(s.shape, s.dtype)
    if name == 'scale':
      return jnp.ones(s.shape, s.dtype)
    return jnp.asarray(rng.uniform(-scale, scale, size=s.shape), s.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


def test_relu_factors_prop6():
  phi_fw, phi_bw = variance.activation_variance_factors(jax.nn.relu)
  assert phi_fw == pytest.approx((1 - 1 / np.pi) / 2, abs=1e-4)  # ~0.34
  assert phi_bw == pytest.approx(0.5, abs=1e-4)
  assert variance.activation_variance_factors(jax.nn.relu, 3.0)[0] == pytest.approx(
      (1 - 1 / np.pi) / 2, abs=1e-4)


@pytest.mark.parametrize('sigma,paper', [(0.5, (0.236, 0.237)), (1.0, (0.208, 0.211)),
                                         (2.0, (0.157, 0.170))])
def test_sigmoid_factors_match_paper_as_std_ratios(sigma, paper):
  # Paper 003 Sec. 4.2 quotes these numbers; they are ratios of STANDARD DEVIATIONS
  # (sqrt of our variance ratios), while its ReLU numbers are variance ratios.
  phi_fw, phi_bw = variance.activation_variance_factors(jax.nn.sigmoid, sigma)
  np.testing.assert_allclose(np.sqrt([phi_fw, phi_bw]), paper, atol=1.5e-3)


def test_sigmoid_factors_against_monte_carlo():
  z = np.random.default_rng(0).normal(size=2_000_000)
  s = 1 / (1 + np.exp(-z))
  phi_fw, phi_bw = variance.activation_variance_factors(jax.nn.sigmoid, 1.0)
  assert phi_fw == pytest.approx(s.var(), rel=3e-3)
  assert phi_bw == pytest.approx(np.mean((s * (1 - s)) ** 2), rel=3e-3)


def test_activation_shift_stripes_fig1():
  # 003 Fig. 1: W ~ U(-1, 1) (100 x 100), A ~ U(0, 1) (100 samples): rows of Z = W A have
  # means gamma * sum(w_i) (Prop. 1, gamma = 0.5); LCW removes them (Prop. 3).
  rng = np.random.default_rng(0)
  w = rng.uniform(-1, 1, size=(100, 100))
  a = rng.uniform(0, 1, size=(100, 100))  # (samples, inputs) = A^T
  x = jnp.asarray(a, jnp.float32)
  half_sq = lambda out: 0.5 * jnp.sum(out ** 2)

  dense = nn.Dense(100, use_bias=False)
  (stats,) = linen_variance.variance_analysis(
      dense, {'params': {'kernel': jnp.asarray(w.T, jnp.float32)}}, x, half_sq)
  z = a @ w.T
  np.testing.assert_allclose(stats.unit_means, z.mean(axis=0), rtol=1e-4, atol=1e-4)
  # Prop. 1 up to sampling error of the batch mean.
  assert np.max(np.abs(stats.unit_means - 0.5 * w.sum(axis=1))) < 4 * np.sqrt(
      (w**2).sum(axis=1) / 12 / 100).max()
  assert stats.shift > 1.0  # spread of means ~0.5 sqrt(100/3) vs unit std ~sqrt(100/36)
  assert stats.name == 'Dense'
  # d(0.5 |z|^2)/dz = z: the backward chain is exact for this loss.
  assert stats.grad_var == pytest.approx(z.var(), rel=1e-4)

  lcw = LCWDense(100, use_bias=False)
  v = v_from_kernel(jnp.asarray(w.T, jnp.float32))
  (stats_lcw,) = linen_variance.variance_analysis(lcw, {'params': {'v': v}}, x, half_sq)
  assert stats_lcw.shift < 0.3
  z_lcw = a @ np.asarray(kernel_from_v(v), np.float64)
  np.testing.assert_allclose(stats_lcw.var, z_lcw.var(), rtol=1e-4)


class SigmoidMLP(nn.Module):
  lcw: bool
  depth: int = 20
  width: int = 32

  @nn.compact
  def __call__(self, x):
    layer = LCWDense if self.lcw else nn.Dense
    for _ in range(self.depth):
      x = nn.sigmoid(layer(self.width)(x))
    return layer(10)(x)


def _capture_preactivations(model, variables, x):
  """Independent forward pass: Flax's capture_intermediates of every layer's output."""
  run = lambda v: model.apply(v, x, capture_intermediates=True, mutable=['intermediates'])[1]
  inter = jax.jit(run)(variables)['intermediates']
  inter = {k: inter[k] for k in sorted(inter, key=lambda k: (len(k), k))}  # Dense_2 < Dense_10
  return [np.asarray(v['__call__'][0], np.float64) for k, v in inter.items() if k != '__call__']


def test_fig4_vanishing_gradient_without_lcw_preserved_with_lcw(tmp_path):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(100, 48)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, size=100))
  loss = lambda logits: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  results = {}
  for lcw in (False, True):
    model = SigmoidMLP(lcw)
    variables = linen_variance.data_dependent_init(model, numpy_params(model, x), x)
    pre = _capture_preactivations(model, variables, x)
    assert len(pre) == 21
    for z in pre:  # unit pre-activation variance on the batch
      assert abs(z.var() - 1.0) < 1e-3
    stats = linen_variance.variance_analysis(model, variables, x, loss)
    prefix = 'LCWDense' if lcw else 'Dense'
    assert [s.name for s in stats] == [f'{prefix}_{i}' for i in range(21)]
    results['LCW' if lcw else 'plain'] = stats
  plain = np.array([s.grad_var for s in results['plain']])
  lcw = np.array([s.grad_var for s in results['LCW']])
  # Without LCW the gradient variance of the first hidden layer vanishes (003 Fig. 4a) ...
  assert plain[0] / plain[-2] < 1e-8
  # ... with LCW it is preserved, slightly growing backwards (003 Fig. 4b).
  assert 0.3 < lcw[0] / lcw[-2] < 30
  assert max(s.shift for s in results['LCW']) < 0.5
  assert max(s.shift for s in results['plain'][5:]) > 10
  png = tmp_path / 'fig4.png'
  plotting.plot_variance_analysis(results, str(png))
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


class Mixed(nn.Module):

  @nn.compact
  def __call__(self, x):
    from geoparam.linen.layers import GmPDense  # pylint: disable=g-import-not-at-top
    x = nn.relu(LCWConv(4, (3, 3))(x))
    x = nn.relu(nn.Conv(3, (2, 2), padding='VALID')(x))
    x = x.reshape(x.shape[0], -1)
    x = jnp.tanh(CWNDense(6)(x))
    x = GmPDense(5)(x)
    return nn.Dense(2)(x)


def test_data_dependent_init_generic_and_deterministic():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(16, 6, 6, 2)) + 0.5, jnp.float32)
  model = Mixed()
  variables = numpy_params(model, x, scale=0.3)
  variables['params']['GmPDense_0']['theta'] = jnp.asarray(
      rng.uniform(0, np.pi, size=variables['params']['GmPDense_0']['theta'].shape), jnp.float32)
  new = linen_variance.data_dependent_init(model, variables, x)
  again = linen_variance.data_dependent_init(model, variables, x)
  jax.tree.map(np.testing.assert_array_equal, new, again)
  # GmP is left unchanged (identity), documented.
  jax.tree.map(np.testing.assert_array_equal, new['params']['GmPDense_0'],
               variables['params']['GmPDense_0'])
  # Only the documented parameters moved, by one scalar per layer.
  ratio = new['params']['CWNDense_0']['scale'] / variables['params']['CWNDense_0']['scale']
  np.testing.assert_allclose(ratio, ratio[0], rtol=1e-6)
  stats = linen_variance.variance_analysis(model, new, x, lambda out: jnp.sum(out))
  assert [s.name for s in stats] == ['LCWConv_0', 'Conv_0', 'CWNDense_0', 'Dense_0']
  for s in stats:
    assert s.var == pytest.approx(1.0, abs=1e-3)


class Wrapped(nn.Module):
  """One `geoparam.Reparam` per method: the method's record says which variable is rescaled."""

  @nn.compact
  def __call__(self, x):
    import geoparam  # pylint: disable=g-import-not-at-top
    for m in ('lcw', 'cwn', 'wn', 'gmp', methods.get('wn')._replace(name='wn_fixed',
                                                                      linear_in=None)):
      x = jnp.tanh(geoparam.Reparam(nn.Dense(5), m, name=getattr(m, 'name', m))(x))
    return x


def test_data_dependent_init_reads_the_methods_record():
  """`scaled_param` is the method's `linear_in`: LCW's v, CWN's and WN's scale rescaled to unit
  pre-activation variance; GmP and a method whose record names none left as they are."""
  x = jnp.asarray(np.random.default_rng(2).normal(size=(32, 4)) + 0.5, jnp.float32)
  model = Wrapped()
  variables = numpy_params(model, x, scale=0.3)
  new = linen_variance.data_dependent_init(model, variables, x)
  moved = {name: [n for n in p if not np.array_equal(p[n], new['params'][name][n])]
           for name, p in variables['params'].items()}
  assert moved == {'lcw': ['v'], 'cwn': ['scale'], 'wn': ['scale'], 'gmp': [], 'wn_fixed': []}
  assert [methods.get(m).linear_in for m in ('lcw', 'cwn', 'wn', 'gmp')] == ['v', 'scale',
                                                                            'scale', None]
  stats = linen_variance.variance_analysis(model, new, x, lambda out: jnp.sum(out))
  assert [s.name for s in stats] == ['lcw', 'cwn', 'wn']  # layers with a scaled parameter
  for s in stats:
    assert s.var == pytest.approx(1.0, abs=1e-3)


class TwoLayers(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name='head')(jnp.tanh(nn.Dense(4, name='hidden')(x)))


@pytest.mark.parametrize('method, moved', [('lcw', 'v'), ('cwn', 'scale'), ('wn', 'scale'),
                                           ('gmp', None)])
def test_data_dependent_init_of_a_whole_model_transform(method, moved):
  """`geoparam.reparameterize`'s layers hold the method's variables: the method's `linear_in` is
  rescaled (before: a KeyError for LCW, and CWN's and WN's raw kernel scaled, which leaves their
  output as it was: a silently wrong init); the excluded head's kernel as a plain layer's."""
  import geoparam  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.key(0), (16, 3)) + 1.0
  rp = geoparam.reparameterize(TwoLayers(), method, exclude=['head'])
  variables = rp.init(jax.random.key(1), x)
  new = linen_variance.data_dependent_init(rp, variables, x)
  changed = {layer: [n for n in p if not np.array_equal(p[n], new['params'][layer][n])]
             for layer, p in variables['params'].items()}
  assert changed == {'hidden': [moved] if moved else [], 'head': ['kernel']}
  stats = {s.name: s.var for s in linen_variance.variance_analysis(rp, new, x, jnp.sum)}
  assert stats['head'] == pytest.approx(1.0, abs=1e-3)
  if moved:
    assert stats['hidden'] == pytest.approx(1.0, abs=1e-3)


def test_data_dependent_init_refuses_a_reparameterized_layer_it_cannot_see_as_such():
  """A `geoparam.reparameterize` model inside another module: its CWN layer holds `kernel`,
  `scale` and `bias`; scaling the raw kernel would change nothing (silently), so it raises."""
  import geoparam  # pylint: disable=g-import-not-at-top

  class Outer(nn.Module):

    @nn.compact
    def __call__(self, x):
      return geoparam.reparameterize(TwoLayers(), 'cwn', exclude=['head'])(x)

  x = jax.random.normal(jax.random.key(0), (16, 3)) + 1.0
  variables = Outer().init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"holds \['bias', 'kernel', 'scale'\], not a plain layer"):
    linen_variance.data_dependent_init(Outer(), variables, x)


def test_data_dependent_init_zero_variance_error():
  model = nn.Dense(3)
  x = jnp.zeros((4, 2))
  variables = {'params': {'kernel': jnp.ones((2, 3)), 'bias': jnp.zeros(3)}}
  with pytest.raises(ValueError, match='zero'):
    linen_variance.data_dependent_init(model, variables, x)


def test_bad_factor_arguments():
  with pytest.raises(ValueError, match='sigma'):
    variance.activation_variance_factors(jax.nn.relu, 0.0)
  with pytest.raises(ValueError, match='num_points'):
    variance.activation_variance_factors(jax.nn.relu, 1.0, num_points=10)
