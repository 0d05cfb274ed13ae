"""Vision models: exact parameter counts (formulas written out here), shapes, IMN running means
in ResNet blocks, SP -> GmP conversion of VGG-6 and ResNet, errors.

Counts and shapes come from `jax.eval_shape(model.init_with_output, ...)` (tracing only, no init
compute); the numerical tests run tiny widths.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib import models
from experiments.vision import models as vm
from geoparam import convert


def _n(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=None)
def _shapes(model, image):
  """(params, batch_stats, logits) shapes of `model` on a batch of 2 `image`-sized inputs."""
  logits, v = jax.eval_shape(model.init_with_output, jax.random.key(0),
                             jnp.zeros((2,) + image, jnp.float32))
  return v['params'], v.get('batch_stats', {}), logits


# --- Expected counts, from the architectures' definitions (no Flax involved). -------------
# Each helper returns (K, F, head): conv/dense weight entries of the parameterized layers,
# their number of units (output channels), and the plain output Dense's parameter count.


def _resnet_arch(stages, width, classes):
  """Also returns the IMN channels: the inputs of every conv but the stem."""
  c = lambda ch: vm.scaled(ch, width)
  k, f, imn = 7 * 7 * 3 * c(64), c(64), 0
  cin = c(64)
  for i, blocks in enumerate(stages):
    mid = c(64 * 2**i)
    for j in range(blocks):
      k += cin * mid + 9 * mid * mid + mid * 4 * mid
      f += mid + mid + 4 * mid
      imn += cin + mid + mid
      if j == 0:
        k += cin * 4 * mid
        f += 4 * mid
        imn += cin
      cin = 4 * mid
  return k, f, imn, cin * classes + classes


def _vgg19_arch(width, classes, fc=512):
  c = lambda ch: vm.scaled(ch, width)
  k = f = 0
  cin = 3
  for entry in vm.VGG19_LAYERS:
    if entry != 'M':
      k, f, cin = k + 9 * cin * c(entry), f + c(entry), c(entry)
  h = c(fc)
  k += cin * h + h * h  # 32x32 input: 1x1 after five pools
  f += 2 * h
  return k, f, f, h * classes + classes


def _preact18_arch(width, classes):
  """Also returns the BN channels: each block's two BNs (its input, its middle) and the final one."""
  c = lambda ch: vm.scaled(ch, width)
  k, f, cin, bn = 9 * 3 * c(64), c(64), c(64), 0
  for i in range(4):
    w = c(64 * 2**i)
    for j in range(2):
      k, f, bn = k + 9 * cin * w + 9 * w * w, f + 2 * w, bn + cin + w
      if cin != w or (i > 0 and j == 0):
        k, f = k + cin * w, f + w
      cin = w
  return k, f, bn + cin, cin * classes + classes


def _vgg6_arch(width, classes):
  k, f, cin = 0, 0, 3
  for entry in vm.scale_layers(models.VGG6_LAYERS, width):
    if entry != 'M':
      k, f, cin = k + 9 * cin * entry, f + entry, entry
  return k, f, cin * classes + classes


# Parameters per unit beyond its K weights, for paper 002's methods: a bias (sp, and GmP:
# theta has fan_in - 1 entries, plus lam and scale = fan_in + 1), WN's gain and bias, WN's gain
# and MBN's bias, BN's scale and bias.
_EXTRA_002 = {'sp': 1, 'gmp': 1, 'gmp_imn': 1, 'wn': 2, 'wn_mbn': 2, 'bn': 2}
# Paper 003's: (K offset per unit: LCW has fan_in - 1 free weights, gain per unit (WN, CWN),
# bias per unit (no BN), BN (scale and bias per BN channel)).
_EXTRA_003 = {'sp': (0, 0, 1, 0), 'bn': (0, 0, 0, 1), 'lcw': (-1, 0, 1, 0),
              'bn_lcw': (-1, 0, 0, 1), 'bn_wn': (0, 1, 0, 1), 'bn_cwn': (0, 1, 0, 1),
              'bn_sn': (0, 0, 0, 1)}


def _expected_003(p, k, f, bn, head):
  off, gain, bias, use_bn = _EXTRA_003[p]
  return k + (off + gain + bias) * f + 2 * use_bn * bn + head


@pytest.mark.parametrize('p', vm.RESNET_PARAMETERIZATIONS)
def test_resnet50_counts_and_shapes(p):
  params, stats, logits = _shapes(vm.ResNet50(num_classes=1000, parameterization=p),
                                  (64, 64, 3))
  k, f, imn, head = _resnet_arch((3, 4, 6, 3), 1.0, 1000)
  assert _n(params) == k + _EXTRA_002[p] * f + head
  assert logits.shape == (2, 1000)
  if p in ('bn', 'wn', 'wn_mbn'):
    assert _n(params) == 25_557_032  # the reference ResNet-50 (torchvision, flax examples)
  else:  # GmP = SP by construction; BN has a second vector per unit (26,560 units)
    assert _n(params) == 25_557_032 - 26_560
  # IMN: a mean per input channel of every GmP conv but the stem; BN two vectors per unit.
  expected_stats = {'sp': 0, 'wn': 0, 'gmp': 0, 'gmp_imn': imn, 'wn_mbn': f, 'bn': 2 * f}
  assert _n(stats) == expected_stats[p]


@pytest.mark.parametrize('p', vm.CIFAR_PARAMETERIZATIONS)
def test_cifar_model_counts_and_shapes(p):
  params, _, logits = _shapes(vm.VGG19(num_classes=10, parameterization=p), (32, 32, 3))
  assert _n(params) == _expected_003(p, *_vgg19_arch(1.0, 10)), 'vgg19'
  assert logits.shape == (2, 10)
  params, _, logits = _shapes(
      vm.PreActResNet18(num_classes=100, parameterization=p, width=0.25), (32, 32, 3))
  assert _n(params) == _expected_003(p, *_preact18_arch(0.25, 100)), 'preact_resnet18'
  assert logits.shape == (2, 100)


def test_cifar_reference_numbers():
  """Full-width VGG19 (BN) and pre-activation ResNet18 (BN) for CIFAR-10, from the formulas."""
  assert _expected_003('bn', *_vgg19_arch(1.0, 10)) == 20_561_354
  assert _expected_003('bn', *_preact18_arch(1.0, 10)) == 11_172_170


@pytest.mark.parametrize('p', models.METHODS)
def test_vgg6_counts_and_shapes(p):
  params, _, logits = _shapes(vm.vgg6(1000, p), (32, 32, 3))
  k, f, head = _vgg6_arch(1.0, 1000)
  assert _n(params) == k + _EXTRA_002[p] * f + head
  assert logits.shape == (2, 1000)
  if p in ('sp', 'gmp', 'gmp_imn'):
    assert _n(params) == 5_089_384


def test_gmp_imn_resnet_blocks_keep_and_use_running_means():
  model = vm.ResNet(num_classes=5, stage_sizes=(1,), width=1 / 16, parameterization='gmp_imn',
                    bn_momentum=0.0)
  x = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  other = x.at[1:].set(jax.random.normal(jax.random.key(2), (3, 16, 16, 3)))

  @jax.jit
  def run(x, other):  # one compile: init, a training-mode pass, evaluations
    v = model.init(jax.random.key(0), x)
    y_train, new = model.apply(v, x, train=True, mutable=['batch_stats'])
    v_new = {'params': v['params'], 'batch_stats': new['batch_stats']}
    return (v['batch_stats'], new['batch_stats'], y_train, model.apply(v_new, x),
            model.apply(v_new, other), model.apply(v, x))

  stats0, stats, y_train, y_eval, y_other, y_init = run(x, other)
  paths = {'/'.join(k.key for k in path[:-1])
           for path, _ in jax.tree_util.tree_leaves_with_path(stats0)}
  assert paths == {f'stage0_block0/{c}/conv/input_mean_norm'
                   for c in ('conv1', 'conv2', 'conv3', 'proj')}  # all GmP convs but the stem
  for leaf in jax.tree.leaves(stats):
    assert float(jnp.max(jnp.abs(leaf))) > 0  # momentum 0: running mean = this batch's mean
  # Evaluation with the running means of this batch is the training-mode function ...
  np.testing.assert_allclose(y_eval, y_train, rtol=1e-4, atol=1e-5)
  # ... per example (the rest of the batch does not matter), and differs from the zero means.
  np.testing.assert_allclose(y_other[0], y_train[0], rtol=1e-4, atol=1e-5)
  assert not np.allclose(y_other[1:], y_train[1:], atol=1e-3)
  assert not np.allclose(y_init, y_train, atol=1e-4)


def test_converted_sp_checkpoint_of_vgg6_gives_the_same_logits_as_gmp():
  sp, gmp = vm.vgg6(7, 'sp', width=1 / 64), vm.vgg6(7, 'gmp', width=1 / 64)
  x = jax.random.normal(jax.random.key(2), (3, 8, 8, 3))
  # SP params without compiling init: eval_shape's shapes, random values, non-zero biases.
  shapes = jax.eval_shape(sp.init, jax.random.key(0), x)['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.normal(0.0, 0.3, s.shape).astype(np.float32), shapes)
  gmp_params = convert.sp_to_gmp(params, select=lambda path: path[0] != 'out')
  expected = jax.tree.map(jnp.shape, jax.eval_shape(gmp.init, jax.random.key(0), x)['params'])
  assert jax.tree.map(jnp.shape, gmp_params) == expected
  assert gmp_params['conv_5']['theta'].shape == (71, 8) and 'kernel' in gmp_params['out']
  y_sp, y_gmp = jax.jit(lambda a, b: (sp.apply({'params': a}, x), gmp.apply({'params': b}, x)))(
      params, gmp_params)
  np.testing.assert_allclose(y_gmp, y_sp, rtol=2e-4, atol=2e-5)
  assert float(jnp.std(y_sp)) > 1e-3


def test_errors_name_bad_values_and_accepted_ones():
  x = jnp.zeros((1, 32, 32, 3))
  with pytest.raises(ValueError, match=r"'lcw'.*accepted: sp, wn, wn_mbn, bn, gmp, gmp_imn"):
    jax.eval_shape(vm.ResNet(num_classes=3, stage_sizes=(1,), parameterization='lcw').init,
                   jax.random.key(0), x)
  with pytest.raises(ValueError,
                     match=r"'gmp'.*accepted: sp, bn, lcw, bn_lcw, bn_wn, bn_cwn, bn_sn"):
    jax.eval_shape(vm.VGG19(num_classes=3, parameterization='gmp').init, jax.random.key(0), x)
  with pytest.raises(ValueError, match='width must be > 0, got 0'):
    vm.vgg6(3, 'sp', width=0)
  with pytest.raises(ValueError, match="unknown model 'vgg16'; accepted: cnn, vgg6"):
    import ml_collections
    vm.create_model(ml_collections.ConfigDict(dict(model='vgg16', method='sp')), 10)
