"""Layers stacked by lifted transforms (issue 26 item 1): `nn.scan` over blocks (remat inside),
`nn.vmap` ensembles, `nn.remat`, and NNX stacks made by `nnx.vmap` and run by `nnx.scan`.

Each starts from trained weights (a few plain steps, or drawn as training leaves them), is
converted (one exact conversion per stacked layer, the stacked axis carried), checked to compute
the same function, trained on, and baked back.
"""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam
import geoparam.nnx as gnnx
import training


class Block(nn.Module):
  """A pre-norm transformer block in the style of flax's lm1b/wmt models (our own code)."""
  heads: int = 2

  @nn.compact
  def __call__(self, x, _):
    h = nn.LayerNorm(name='ln1')(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads, name='attn')(h, h)
    h = nn.gelu(nn.DenseGeneral(16, name='mlp_in')(nn.LayerNorm(name='ln2')(x)))
    return x + nn.DenseGeneral(x.shape[-1], name='mlp_out')(h), None


class ScanTransformer(nn.Module):
  """Embedding, `nn.scan` over `depth` remat'ed blocks (params and batch_stats stacked), head."""
  depth: int = 2

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(nn.remat(Block), variable_axes={'params': 0, 'batch_stats': 0},
                     split_rngs={'params': True}, length=self.depth)
    x, _ = blocks(name='blocks')(nn.Dense(8, name='embed')(x), None)
    return nn.Dense(3, name='head')(x.mean(1))


def _rel(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _train(model, variables, x, y, steps):
  """Adam steps on the squared error, IMN's running means updated; `(variables, losses)`."""
  tx = optax.adam(1e-2)
  params, rest = variables['params'], {k: v for k, v in variables.items() if k != 'params'}

  @jax.jit
  def step(params, rest, opt):
    def loss(params):
      out, new = model.apply({'params': params, **rest}, x, mutable=list(rest))
      return jnp.mean((out - y) ** 2), new
    (value, rest), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt = tx.update(grads, opt)
    return optax.apply_updates(params, updates), dict(rest), opt, value

  opt, losses = tx.init(params), []
  for _ in range(steps):
    params, rest, opt, value = step(params, rest, opt)
    losses.append(float(value))
  return {'params': params, **rest}, losses


@pytest.fixture(scope='module')
def trained_transformer():
  model = ScanTransformer()
  x = jax.random.normal(jax.random.key(0), (4, 5, 6))
  y = jax.random.normal(jax.random.key(1), (4, 3))
  sp = training.trained_like(jax.eval_shape(model.init, jax.random.key(2), x))
  return model, sp, x, y


def _zero_sum(variables):
  """Every kernel but the head's with units summing to zero (LCW and CWN constrain them so)."""
  def centre(path, leaf):
    keys = [getattr(k, 'key', None) for k in path]
    if keys[-1] != 'kernel' or 'head' in keys:
      return leaf
    stacked = 1 if 'blocks' in keys else 0  # the scan's axis, then the layer's own kernel
    features = 2 if keys[-2] in ('query', 'key', 'value') else 1  # (.., heads, head_dim)
    axes = tuple(range(stacked, leaf.ndim - features))
    return leaf - leaf.mean(axis=axes, keepdims=True)
  return {**variables, 'params': jax.tree_util.tree_map_with_path(centre, variables['params'])}


@pytest.mark.parametrize('method,train', [('gmp_imn', True), ('lcw', False), ('cwn', True)])
def test_scan_transformer_converts_trains_and_bakes(trained_transformer, method, train):
  """gmp_imn converts GmP, then IMN; lcw is converted and baked (CWN trains the constrained
  form on, a compile less for the suite)."""
  model, sp, x, y = trained_transformer
  if method in ('lcw', 'cwn'):
    sp = _zero_sum(sp)
  ref = model.apply(sp, x)
  rp = geoparam.reparameterize(model, method, exclude=['head'])
  new = geoparam.to_reparameterized(rp, sp, x)
  assert jax.tree.structure(new) == jax.tree.structure(
      jax.eval_shape(rp.init, jax.random.key(0), x))
  stored = new['params']['blocks']['mlp_in']
  assert all(v.shape[0] == 2 for v in stored.values())  # one entry per stacked block
  if method == 'gmp_imn':  # IMN's running mean per stacked block (traced: it starts at 0)
    assert stored['theta'].shape == (2, 7, 16)
    assert new['params']['blocks']['attn']['query']['theta'].shape == (2, 7, 8)  # 2 heads x 4
    np.testing.assert_array_equal(
        new['batch_stats']['blocks']['mlp_in']['input_mean_norm']['mean'], np.zeros((2, 8)))
  apply = jax.jit(rp.apply)  # compiled once for both calls
  assert _rel(apply(new, x), ref) <= 1e-5
  trained = new
  if train:
    trained, losses = _train(rp, new, x, y, 3)
    assert losses[-1] < losses[0], losses
  baked = geoparam.bake(rp, trained, x)
  assert jax.tree.structure(baked) == jax.tree.structure(sp)
  assert _rel(model.apply(baked, x), apply(trained, x)) <= 1e-5


class Member(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name='out')(nn.relu(nn.Dense(8, name='hidden')(x)))


class Ensemble(nn.Module):
  """An `nn.vmap` ensemble of 3 members beside one `nn.remat` member."""

  @nn.compact
  def __call__(self, x):
    members = nn.vmap(Member, variable_axes={'params': 0, 'batch_stats': 0},
                      split_rngs={'params': True}, in_axes=None, out_axes=0, axis_size=3)
    return members(name='ensemble')(x).mean(0) + nn.remat(Member)(name='solo')(x)


def test_vmap_ensemble_and_remat_member_gmp_imn():
  model = Ensemble()
  x = jax.random.normal(jax.random.key(0), (6, 5))
  sp = model.init(jax.random.key(1), x)
  ref = model.apply(sp, x)
  rp = geoparam.reparameterize(model, 'gmp_imn', exclude=['out'])
  new = geoparam.to_reparameterized(rp, sp, x)
  assert new['params']['ensemble']['hidden']['theta'].shape == (3, 4, 8)
  assert new['batch_stats']['ensemble']['hidden']['input_mean_norm']['mean'].shape == (3, 5)
  assert new['batch_stats']['solo']['hidden']['input_mean_norm']['mean'].shape == (5,)
  assert _rel(rp.apply(new, x), ref) <= 1e-5
  assert _rel(model.apply(geoparam.bake(rp, new, x), x), ref) <= 1e-5  # the scan test trains
  # each member is its own layer: a conversion error names the member
  with pytest.raises(ValueError, match=r'layer ensemble/hidden\[0\]: CWN constrains'):
    geoparam.to_reparameterized(geoparam.reparameterize(model, 'cwn', exclude=['out']), sp, x)


def test_stacking_errors_are_clear():
  class Stack(nn.Module):
    axes: dict

    @nn.compact
    def __call__(self, x):
      blocks = nn.scan(Block, variable_axes=self.axes, split_rngs={'params': True}, length=2)
      return blocks(name='blocks')(x, None)[0]

  x = jnp.ones((2, 3, 8))
  rp = geoparam.reparameterize(Stack({'params': 0}), 'gmp_imn')  # no batch_stats axis for IMN
  with pytest.raises(ValueError, match=r"keeps IMN's running mean.*variable_axes=\{'params': 0, "
                                       "'batch_stats': 0\}"):
    rp.init(jax.random.key(0), x)
  sideways = Stack({'params': 1})
  sp = sideways.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='stacked axes in front'):
    geoparam.to_reparameterized(geoparam.reparameterize(sideways, 'gmp'), sp, x)


class NNXBlock(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 4, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.bn(self.linear(x)))


class NNXScanMLP(nnx.Module):
  """Flax's NNX scan-over-layers pattern: blocks made by `nnx.vmap`, run by `nnx.scan`."""

  def __init__(self, rngs, depth=3):
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return NNXBlock(rngs)

    self.blocks = create(rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return self.head(forward(x, self.blocks))


def _nnx_train(model, x, y, steps):
  return training.nnx_train(model, x, y, steps, optax.adam(1e-2))


@pytest.mark.parametrize('method,drop', [('gmp', False), ('gmp_imn', True), ('cwn', True)])
def test_nnx_scan_mlp_converts_trains_and_bakes(method, drop):
  x, y = jax.random.normal(jax.random.key(0), (8, 4)), jax.random.normal(jax.random.key(1), (8, 2))
  model = NNXScanMLP(nnx.Rngs(0))
  _nnx_train(model, x, y, 2)
  if method in ('lcw', 'cwn'):  # zero-sum units (per stacked layer), which they constrain to
    kernel = model.blocks.linear.kernel
    kernel[...] = kernel[...] - kernel[...].mean(axis=1, keepdims=True)
  before = model(x)
  gnnx.reparameterize(model, method, x, exclude=['head'], drop_batchnorm=drop)
  assert isinstance(model.blocks.linear, gnnx.Reparam) and model.blocks.linear.stack == (3,)
  assert isinstance(model.blocks.bn, gnnx.DroppedBatchNorm if drop else nnx.BatchNorm)
  params = nnx.state(model.blocks.linear, nnx.Param)
  assert all(v.shape[0] == 3 for v in jax.tree.leaves(params))
  assert ('lam' in params) == (drop and method.startswith('gmp'))  # the dropped BN's shift
  assert _rel(model(x), before) <= 1e-5
  losses = _nnx_train(model, x, y, 3)
  assert losses[-1] < losses[0], losses
  after = model(x)
  gnnx.bake(model)
  assert type(model.blocks.linear) is nnx.Linear and model.blocks.linear.kernel.shape == (3, 4, 4)
  assert type(model.blocks.bn) is nnx.BatchNorm and model.blocks.bn.mean.shape == (3, 4)
  assert _rel(model(x), after) <= 1e-5
