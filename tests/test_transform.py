"""Whole-model transform: unmodified Flax models reparameterized with their trained weights kept."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam
import training
from transform_models import ResNet, SmallCNN, TransformerMLP


def _train(model, variables, x, y, steps, lr=1e-2, loss='xent'):
  """A few Adam steps in training mode; returns (variables, losses)."""
  tx = optax.adam(lr)
  params = variables['params']
  rest = {k: v for k, v in variables.items() if k != 'params'}

  def loss_fn(params, rest):
    out, upd = model.apply({'params': params, **rest}, x, train=True, mutable=list(rest))
    if loss == 'xent':
      value = optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
    else:
      value = jnp.mean((out - y) ** 2)
    return value, upd

  @jax.jit
  def step(params, rest, opt):
    (value, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), dict(rest), opt, value

  opt = tx.init(params)
  losses = []
  for _ in range(steps):
    params, rest, opt, value = step(params, rest, opt)
    losses.append(float(value))
  return {'params': params, **rest}, losses


def _rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.fixture(scope='module')
def resnet_sp():
  """A small flax-examples-style ResNet (BasicBlock + Bottleneck, BN) with weights and running
  statistics as training leaves them (`training.trained_like`: nothing compiles)."""
  model = ResNet()
  x = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 5)
  shapes = jax.eval_shape(functools.partial(model.init, train=False), jax.random.key(2), x)
  return model, training.trained_like(shapes, seed=2), x, y


def test_resnet_gmp_imn_drop_bn_keeps_function_trains_and_bakes(resnet_sp):
  model, sp, x, y = resnet_sp
  ref = model.apply(sp, x, train=False)
  rp = geoparam.reparameterize(model, 'gmp_imn', exclude=['head'], drop_batchnorm=True)
  new = geoparam.to_reparameterized(rp, sp, x, train=False)
  # Every conv is GmP with IMN, no BatchNorm is left, the head is plain.
  flat = jax.tree_util.tree_flatten_with_path(new)[0]
  names = {jax.tree_util.keystr(p) for p, _ in flat}
  assert not any('bn' in n.lower() or "'var'" in n or 'BatchNorm' in n for n in names), names
  assert set(new['params']['head']) == {'kernel', 'bias'}
  assert set(new['params']['conv_init']) == {'theta', 'lam', 'scale'}
  assert set(new['params']['Bottleneck_0']['proj']) == {'theta', 'lam', 'scale'}
  assert 'input_mean_norm' in new['batch_stats']['BasicBlock_0']['Conv_0']
  out = rp.apply(new, x, train=False)
  assert _rel(out, ref) <= 1e-4
  # Training goes on from the converted weights and the loss falls.
  trained, losses = _train(rp, new, x, y, 6)
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  # Bake back into the ORIGINAL model (BatchNorm back as an identity carrying the bias).
  baked = geoparam.bake(rp, trained, x, train=False, approximate_borders=True)
  assert jax.tree.structure(baked) == jax.tree.structure(sp)
  np.testing.assert_allclose(model.apply(baked, x, train=False),
                             rp.apply(trained, x, train=False), rtol=0, atol=0.05)
  with pytest.raises(ValueError, match='approximate_borders'):
    geoparam.bake(rp, trained, x, train=False)


def test_resnet_bake_round_trip_is_exact_before_training(resnet_sp):
  model, sp, x, _ = resnet_sp
  rp = geoparam.reparameterize(model, 'gmp_imn', exclude=['head'], drop_batchnorm=True)
  baked = geoparam.bake(rp, geoparam.to_reparameterized(rp, sp, x, train=False), x, train=False)
  ref = model.apply(sp, x, train=False)
  assert _rel(model.apply(baked, x, train=False), ref) <= 1e-4


@pytest.mark.parametrize('method', ['gmp', 'wn'])
def test_resnet_keep_bn_exact(resnet_sp, method):
  model, sp, x, _ = resnet_sp
  rp = geoparam.reparameterize(model, method)
  new = geoparam.to_reparameterized(rp, sp, x, train=False)
  assert 'scale' in new['params']['bn_init']  # BN kept
  ref = model.apply(sp, x, train=False)
  assert _rel(rp.apply(new, x, train=False), ref) <= 1e-4
  baked = geoparam.bake(rp, new, x, train=False)
  assert _rel(model.apply(baked, x, train=False), ref) <= 1e-4


@pytest.mark.parametrize('method', ['lcw', 'cwn'])
def test_resnet_constrained_methods_exact_for_zero_sum_kernels(resnet_sp, method):
  """LCW/CWN constrain kernels to sum to zero: exact for zero-sum SP kernels, an error otherwise."""
  model, sp, x, y = resnet_sp
  rp = geoparam.reparameterize(model, method, exclude=['head'])
  with pytest.raises(ValueError, match='sum to zero'):
    geoparam.to_reparameterized(rp, sp, x, train=False)

  def centre(path, leaf):
    keys = [getattr(k, 'key', None) for k in path]
    if keys[-1] == 'kernel' and 'head' not in keys:
      return leaf - leaf.mean(axis=tuple(range(leaf.ndim - 1)), keepdims=True)
    return leaf

  zero_sum = {**sp, 'params': jax.tree_util.tree_map_with_path(centre, sp['params'])}
  new = geoparam.to_reparameterized(rp, zero_sum, x, train=False)
  ref = model.apply(zero_sum, x, train=False)
  assert _rel(rp.apply(new, x, train=False), ref) <= 1e-4
  trained, losses = _train(rp, new, x, y, 5)
  assert losses[-1] < losses[0]
  baked = geoparam.bake(rp, new, x, train=False)
  assert _rel(model.apply(baked, x, train=False), ref) <= 1e-4


def test_transformer_mlp_dense_general_gelu():
  model = TransformerMLP()
  x = jax.random.normal(jax.random.key(0), (4, 5, 2, 4)) + 0.5
  sp = model.init(jax.random.key(1), x)
  sp, _ = _train(model, sp, x, x * 0.5, 5, loss='mse')
  ref = model.apply(sp, x)
  for method in ('gmp', 'gmp_imn', 'wn'):
    rp = geoparam.reparameterize(model, method)
    new = geoparam.to_reparameterized(rp, sp, x)
    assert new['params']['up']['theta' if 'gmp' in method else 'kernel'].shape[0] in (7, 2, 8)
    # GELU is not homogeneous: exact anyway, the scale sits inside the activation.
    assert _rel(rp.apply(new, x, train=False), ref) <= 1e-4, method
    if method == 'gmp_imn':  # the DenseGeneral input mean is (heads * head_dim,), calibrated
      up_input = nn.LayerNorm().apply({'params': sp['params']['ln']}, x)
      np.testing.assert_allclose(new['batch_stats']['up']['input_mean_norm']['mean'],
                                 np.asarray(up_input).reshape(-1, 8).mean(0), rtol=1e-4, atol=1e-6)
      out, _ = rp.apply(new, x, train=True, mutable=['batch_stats'])
      assert _rel(out, ref) <= 1e-4  # the calibration batch itself: train mode agrees too
    assert _rel(model.apply(geoparam.bake(rp, new, x), x), ref) <= 1e-4


def test_small_cnn_valid_circular_grouped_tanh():
  model = SmallCNN()
  x = jax.random.normal(jax.random.key(0), (6, 10, 10, 2)) + 1.0
  sp = model.init(jax.random.key(1), x)
  ref = model.apply(sp, x)
  rp = geoparam.reparameterize(model, 'gmp_imn', exclude=['head'])
  new = geoparam.to_reparameterized(rp, sp, x)
  # VALID and CIRCULAR pad no zeros: the running mean is calibrated, bake is exact.
  assert np.all(np.asarray(new['batch_stats']['c1']['input_mean_norm']['mean']) != 0)
  assert _rel(rp.apply(new, x), ref) <= 1e-4
  assert _rel(model.apply(geoparam.bake(rp, new, x), x), ref) <= 1e-4


def test_where_predicate_and_nested_model():
  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      body = geoparam.reparameterize(
          SmallCNN(name='body'), 'gmp', where=lambda layer, path: isinstance(layer, nn.Conv))
      return body(x)

  x = jnp.ones((2, 10, 10, 2))
  params = Outer().init(jax.random.key(0), x)['params']
  assert set(params) == {'body'}
  assert set(params['body']['c1']) == {'theta', 'lam', 'scale'}
  assert set(params['body']['head']) == {'kernel', 'bias'}  # not a Conv: kept plain


def test_initialization_layer_keeps_the_models_init_norms():
  model = SmallCNN()
  x = jnp.ones((2, 10, 10, 2))
  rp = geoparam.reparameterize(model, 'gmp', initialization='layer')
  v = rp.init(jax.random.key(0), x)
  scale = np.asarray(v['params']['c1']['scale'])
  assert not np.allclose(scale, 1.0)  # lecun-normal column norms, not the paper's 1
  assert 0.3 < scale.mean() < 3.0
  paper = geoparam.reparameterize(model, 'gmp').init(jax.random.key(0), x)
  np.testing.assert_array_equal(paper['params']['c1']['scale'], 1.0)


def test_imn_switch_follows_batch_stats_mutability():
  model = TransformerMLP()
  x = jax.random.normal(jax.random.key(0), (4, 5, 2, 4)) + 2.0
  rp = geoparam.reparameterize(model, 'gmp_imn')
  v = rp.init(jax.random.key(1), x)
  _, upd = rp.apply(v, x, mutable=['batch_stats'])  # training: batch mean, running mean moves
  assert not np.allclose(upd['batch_stats']['up']['input_mean_norm']['mean'], 0)
  eval_out = rp.apply(v, x)  # evaluation: running mean (zeros), no update
  fixed = geoparam.reparameterize(model, 'gmp_imn', use_running_average=True)
  np.testing.assert_array_equal(fixed.apply(v, x), eval_out)


# ----------------------------------------------------------------------------- bad input

def test_bad_method_and_options():
  with pytest.raises(ValueError, match="method must be one of"):
    geoparam.reparameterize(SmallCNN(), 'gmpp')
  with pytest.raises(TypeError, match='unknown'):
    geoparam.reparameterize(SmallCNN(), 'lcw', momentum=0.9)


def test_dropped_bn_without_a_layer_before_it():
  class PreAct(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
      x = nn.BatchNorm(use_running_average=not train)(x + 1.0)
      return nn.Dense(3)(x)

  x = jnp.ones((2, 4))
  sp = PreAct().init(jax.random.key(0), x)
  rp = geoparam.reparameterize(PreAct(), 'gmp_imn', drop_batchnorm=True)
  with pytest.raises(ValueError, match='BatchNorm_0 is dropped but its input'):
    geoparam.to_reparameterized(rp, sp, x)


def test_zero_column_names_the_layer():
  model = SmallCNN()
  x = jnp.ones((2, 10, 10, 2))
  sp = model.init(jax.random.key(0), x)
  sp['params']['c1']['kernel'] = sp['params']['c1']['kernel'].at[..., 2].set(0.0)
  rp = geoparam.reparameterize(model, 'gmp')
  with pytest.raises(ValueError, match='layer c1'):
    geoparam.to_reparameterized(rp, sp, x)


def test_a_selection_that_matches_nothing_is_an_error_not_a_no_op():
  """Issue 26 (no silent no-ops): a `where` that selects nothing, an `exclude` typo, a model with
  no Dense/Conv and a wrong model object are refused, in linen, NNX and the tree helpers."""
  from flax import nnx
  import geoparam.nnx as gnnx
  from geoparam import convert
  x = jnp.ones((2, 3))

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2, name='head')(nn.relu(nn.Dense(4, name='hidden')(x)))

  class NoLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.relu(x)

  with pytest.raises(ValueError, match=r"exclude entries \['haed'\] name no layer.*head, hidden"):
    geoparam.reparameterize(MLP(), 'gmp', exclude=['haed']).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='no layer was selected.*the model ran head, hidden'):
    geoparam.reparameterize(MLP(), 'gmp', where=lambda layer, path: False).init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match='no layer was selected.*the model ran none'):
    geoparam.reparameterize(NoLayers(), 'lcw').init(jax.random.key(0), x)
  sp = MLP().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"exclude entries \['haed'\]"):
    geoparam.to_reparameterized(geoparam.reparameterize(MLP(), 'gmp', exclude=['haed']), sp, x)
  with pytest.raises(TypeError, match='pass an instance'):
    geoparam.reparameterize(MLP, 'gmp')
  with pytest.raises(TypeError, match='flax.linen Module instance'):
    geoparam.reparameterize(lambda x: x, 'gmp')
  with pytest.raises(TypeError, match='geoparam.nnx.reparameterize'):
    geoparam.reparameterize(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), 'gmp')
  with pytest.raises(TypeError, match='for a linen model use geoparam.reparameterize'):
    gnnx.reparameterize(MLP(), 'gmp')
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.relu,
                         nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
  with pytest.raises(ValueError, match=r"exclude entries \['haed'\] name no layer"):
    gnnx.reparameterize(model, 'gmp', exclude=['haed'])
  with pytest.raises(ValueError, match='no layer was selected'):
    gnnx.reparameterize(model, 'gmp', where=lambda layer, path: False)
  assert isinstance(model.layers[0], nnx.Linear)  # nothing changed
  with pytest.raises(ValueError, match='no layer was converted'):
    convert.sp_to_gmp(sp['params'], select=lambda path: False)
  with pytest.raises(ValueError, match='no layer was converted'):
    convert.sp_to_gmp({'steps': 3})
  with pytest.raises(ValueError, match='holds no GmP layer'):
    convert.gmp_to_sp(sp['params'])


def test_resnet_keep_bn_bias_free_convs_stay_bias_free_through_adam_and_bake_exactly(resnet_sp):
  """Issue 26 item 2: a conv with use_bias=False gets no lam; with the BatchNorm kept, Adam used
  to turn lam's ~0 gradient into a real bias (2.3e-3) and bake then refused. Now bake is exact."""
  model, sp, x, y = resnet_sp
  rp = geoparam.reparameterize(model, 'gmp', exclude=['head'])
  new = geoparam.to_reparameterized(rp, sp, x, train=False)
  assert set(new['params']['conv_init']) == {'theta', 'scale'}
  assert jax.tree.structure(rp.init(jax.random.key(0), x, train=False)) == jax.tree.structure(new)
  trained, losses = _train(rp, new, x, y, 3)
  assert losses[-1] < losses[0], losses
  baked = geoparam.bake(rp, trained, x, train=False)
  assert jax.tree.structure(baked) == jax.tree.structure(sp)
  assert _rel(model.apply(baked, x, train=False), rp.apply(trained, x, train=False)) <= 1e-5


class _BiasFree(nn.Module):
  """A bias-free conv before a BatchNorm, and one with nothing after it."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    y = nn.Conv(4, (3, 3), use_bias=False, name='c')(x)
    y = nn.relu(nn.BatchNorm(use_running_average=not train, name='bn')(y))
    y = nn.Conv(4, (3, 3), padding='VALID', use_bias=False, name='c2')(y)
    return nn.Dense(2, name='head')(y.mean((1, 2)))


@pytest.mark.parametrize('method,bias', [('gmp_imn', 'lam'), ('wn', 'bias'), ('lcw', 'bias')])
def test_a_bias_term_only_where_a_dropped_batchnorm_needs_one(method, bias):
  """A bias-free layer gets the method's bias term only when the transform drops the BatchNorm
  after it: that BatchNorm's shift (mean and bias) belongs there (paper 002's ResNet-50 GmP+IMN
  units have lam). Conversion carries it exactly; bake gives it back to the BatchNorm."""
  x = jax.random.normal(jax.random.key(1), (2, 6, 6, 3))
  keep = geoparam.reparameterize(_BiasFree(), method, exclude=['head'])
  drop = geoparam.reparameterize(_BiasFree(), method, exclude=['head'], drop_batchnorm=True)
  kept = keep.init(jax.random.key(0), x)['params']
  dropped = drop.init(jax.random.key(0), x)['params']
  assert bias not in kept['c'] and bias not in kept['c2'] and 'bn' in kept
  assert bias in dropped['c'] and bias not in dropped['c2'] and 'bn' not in dropped
  out, _ = drop.apply({'params': dropped, **{k: v for k, v in drop.init(
      jax.random.key(0), x).items() if k != 'params'}}, x, train=True, mutable=['batch_stats'])
  assert np.all(np.isfinite(out))
  model = _BiasFree()
  sp = model.init(jax.random.key(2), x)
  sp['batch_stats']['bn']['mean'] = jnp.linspace(-0.5, 0.5, 4)
  sp['params']['bn']['bias'] = jnp.linspace(0.3, -0.2, 4)
  if method in ('lcw', 'cwn'):  # constraints: exact only for zero-sum kernels
    centre = lambda k: k - k.mean(axis=(0, 1, 2), keepdims=True)
    for name in ('c', 'c2'):
      sp['params'][name]['kernel'] = centre(sp['params'][name]['kernel'])
  ref = model.apply(sp, x)
  for rp in (keep, drop):
    new = geoparam.to_reparameterized(rp, sp, x)
    assert jax.tree.structure(new['params']) == jax.tree.structure(
        rp.init(jax.random.key(0), x)['params'])
    assert _rel(rp.apply(new, x), ref) <= 1e-5
    baked = geoparam.bake(rp, new, x)
    assert _rel(model.apply(baked, x), ref) <= 1e-5
  shift = geoparam.to_reparameterized(drop, sp, x)['params']['c'][bias]
  assert float(jnp.abs(shift).max()) > 0.1  # the BatchNorm's shift is there


def test_a_checkpoint_with_lam_on_a_bias_free_layer_still_uses_it():
  """Variables that hold a bias term for a bias-free layer (made before issue 26) keep it."""
  layer = geoparam.GmP(nn.Dense(3, use_bias=False))
  x = jax.random.normal(jax.random.key(0), (4, 5))
  params = layer.init(jax.random.key(1), x)['params']
  assert set(params) == {'theta', 'scale'}
  old = {**params, 'lam': jnp.array([1.0, -2.0, 0.5])}
  kernel, _ = geoparam.methods.get('gmp').apply(params, (5, 3))
  np.testing.assert_allclose(layer.apply({'params': old}, x),
                             x @ kernel + old['scale'] * old['lam'], rtol=1e-5, atol=1e-6)


class _DenseBN(nn.Module):
  """Dense -> BatchNorm -> relu -> Dense: the smallest model with a BatchNorm to drop."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.BatchNorm(use_running_average=not train, name='bn')(nn.Dense(4, name='hidden')(x))
    return nn.Dense(2, name='head')(nn.relu(x))


def test_missing_variables_are_errors_naming_the_entry_and_the_layer():
  """Issue (clear errors): variables without batch_stats or without a layer's params."""
  model, x = _DenseBN(), jax.random.normal(jax.random.key(0), (4, 3))
  sp = model.init(jax.random.key(1), x, train=False)
  rp = geoparam.reparameterize(model, 'gmp_imn', exclude=['head'], drop_batchnorm=True)
  new = geoparam.to_reparameterized(rp, sp, x, train=False)
  # bake: IMN's running mean missing (was a bare KeyError 'batch_stats').
  with pytest.raises(ValueError, match=r"bake: the variables lack IMN's running mean "
                     r"batch_stats/hidden/input_mean_norm/mean for layer hidden .*to_reparameterized "
                     r"or training returned, with their params and batch_stats .*\['params'\]"):
    geoparam.bake(rp, {'params': new['params']}, x, train=False)
  # bake: a layer's params missing, or the plain model's given.
  with pytest.raises(ValueError, match=r"lack params/hidden of layer hidden \(gmp_imn's \['lam', "
                     r"'scale', 'theta'\]\)"):
    geoparam.bake(rp, {'params': {'head': new['params']['head']},
                       'batch_stats': new['batch_stats']}, x, train=False)
  with pytest.raises(ValueError, match=r"they hold \['bias', 'kernel'\]\): these are the plain "):
    geoparam.bake(rp, sp, x, train=False)
  # to_reparameterized: the dropped BatchNorm's statistics, or a layer's params, missing.
  with pytest.raises(ValueError, match=r'to_reparameterized: the variables do not fit the plain '
                     r'model _DenseBN .*"mean" from collection "batch_stats" in "/bn"'):
    geoparam.to_reparameterized(rp, {'params': sp['params']}, x, train=False)
  with pytest.raises(ValueError, match=r'parameter named "kernel" in scope "/hidden"'):
    geoparam.to_reparameterized(rp, {'params': {k: v for k, v in sp['params'].items()
                                                if k != 'hidden'},
                                     'batch_stats': sp['batch_stats']}, x, train=False)
  with pytest.raises(ValueError, match='give evaluation-mode arguments, e.g. train=False'):
    geoparam.to_reparameterized(rp, sp, x, train=True)


def test_apply_and_init_method_resolve_against_the_users_model():
  """`rp.apply(..., method=m)` works like `model.apply(..., method=m)`: the model's method by
  name, its unbound (or bound) method, a function of the module; rp's own `call` still works."""

  class Embedder(nn.Module):
    def setup(self):
      self.embed = nn.Dense(4, name='embed')
      self.head = nn.Dense(2, name='head')

    def embed_token_ids(self, x):
      return nn.relu(self.embed(x))

    def __call__(self, x):
      return self.head(self.embed_token_ids(x))

  model, x = Embedder(), jax.random.normal(jax.random.key(0), (3, 5))
  sp = model.init(jax.random.key(1), x)
  rp = geoparam.reparameterize(model, 'gmp', exclude=['head'])
  v = geoparam.to_reparameterized(rp, sp, x)
  ref = model.apply(sp, x, method='embed_token_ids')
  for method in ['embed_token_ids', Embedder.embed_token_ids, model.embed_token_ids,
                 lambda module, x: module.embed_token_ids(x)]:
    out = rp.apply(v, x, method=method)
    np.testing.assert_allclose(out, ref, atol=1e-5)
  assert 'theta' in rp.init(jax.random.key(2), x, method='embed_token_ids')['params']['embed']
  np.testing.assert_allclose(rp.apply(v, 'embed_token_ids', x, method='call'), ref, atol=1e-5)
  np.testing.assert_allclose(rp.apply(v, x, method=Embedder.__call__), model.apply(sp, x),
                             atol=1e-5)
  with pytest.raises(AttributeError, match='no attribute "nope"'):
    rp.apply(v, x, method='nope')


def test_imn_mode_cannot_silently_contradict_the_models_train_flag():
  """A train step that forgets mutable=['batch_stats'] would train with IMN frozen at its
  calibration mean: the model's own flags (its dropped BatchNorm's use_running_average, a
  Dropout's deterministic) say it trains, so that is an error, under jit and grad too."""
  model, x = _DenseBN(), jax.random.normal(jax.random.key(0), (4, 3)) + 1.0
  sp = model.init(jax.random.key(1), x, train=False)
  rp = geoparam.reparameterize(model, 'gmp_imn', exclude=['head'], drop_batchnorm=True)
  v = geoparam.to_reparameterized(rp, sp, x, train=False)
  forgot = r"training mode \(BatchNorm bn with use_running_average=False\) but batch_stats is " \
           r"not mutable, so IMN would silently use its frozen running mean: pass mutable="
  with pytest.raises(ValueError, match=forgot):
    rp.apply(v, x, train=True)
  loss = lambda params: jnp.sum(rp.apply({**v, 'params': params}, x, train=True))
  with pytest.raises(ValueError, match=forgot):
    jax.jit(jax.grad(loss))(v['params'])
  with pytest.raises(ValueError, match=r"evaluation mode \(BatchNorm bn with use_running_average="
                     r"True\) but batch_stats is mutable"):
    rp.apply(v, x, train=False, mutable=['batch_stats'])
  # The consistent calls work: training moves the running mean, evaluation reads it.
  _, upd = rp.apply(v, x * 3, train=True, mutable=['batch_stats'])
  assert not np.allclose(upd['batch_stats']['hidden']['input_mean_norm']['mean'],
                         v['batch_stats']['hidden']['input_mean_norm']['mean'])
  rp.apply(v, x, train=False)
  rp.init(jax.random.key(2), x, train=False)  # init: every collection is mutable, no check
  # An explicit use_running_average is the user's choice: not checked.
  fixed = geoparam.reparameterize(model, 'gmp_imn', exclude=['head'], drop_batchnorm=True,
                                  use_running_average=True)
  np.testing.assert_array_equal(fixed.apply(v, x, train=True), rp.apply(v, x, train=False))

  class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
      x = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(4, name='hidden')(x)))
      return nn.Dense(2, name='head')(x)

  rp = geoparam.reparameterize(DropoutMLP(), 'gmp_imn')
  v = rp.init(jax.random.key(0), x, train=False)
  with pytest.raises(ValueError, match=r'training mode \(Dropout Dropout_0 with deterministic=False'):
    rp.apply(v, x, train=True, rngs={'dropout': jax.random.key(1)})
  rp.apply(v, x, train=False, mutable=['batch_stats'])  # no BatchNorm: mutability decides
