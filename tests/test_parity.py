"""A reparameterized NNX layer is still its layer: type, fields, readable and assignable weights.

After `geoparam.nnx.reparameterize` (and for `Reparam(layer, ...)` and the named wrappers) the
layer is an instance of its own type, its fields read the same, `kernel`/`bias` read the
effective weights (equal to the baked ones, differentiable w.r.t. the method's variables) and
an assigned kernel converts exactly. Ties through a shared `nnx.Param` are refused by name.
"""

import warnings
import zlib

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam.nnx as gnnx
from geoparam import kinds
from tests import training
from geoparam.nnx import modules

METHODS = ['gmp', 'gmp_imn', 'lcw', 'cwn', 'wn']


def _einsum(rngs):
  return nnx.Einsum('btd,dnh->btnh', (4, 2, 3), (2, 3), rngs=rngs)


LAYERS = {
    'Linear': (lambda rngs: nnx.Linear(4, 5, rngs=rngs), (6, 4)),
    'Conv': (lambda rngs: nnx.Conv(3, 4, (3, 3), padding='VALID', rngs=rngs), (2, 6, 6, 3)),
    'LinearGeneral': (lambda rngs: nnx.LinearGeneral(4, (2, 3), rngs=rngs), (6, 4)),
    'Einsum': (_einsum, (2, 5, 4)),
    'ConvTranspose': (lambda rngs: nnx.ConvTranspose(3, 4, (3, 3), rngs=rngs), (2, 5, 5, 3)),
}


def _zero_sum(layer):
  """Makes each unit's kernel sum to zero (LCW and CWN represent only such kernels)."""
  layout = modules.layout_of(layer)
  k = np.asarray(layout.to_method(layer.kernel[...]))
  k = k - k.reshape(-1, k.shape[-1]).mean(0)
  layer.kernel[...] = jnp.asarray(layout.to_layer(k)[0])


def _layer(kind, method, seed=0):
  make, shape = LAYERS[kind]
  layer = make(nnx.Rngs(seed))
  if layer.bias is not None:
    layer.bias[...] = jax.random.normal(jax.random.key(seed + 7), layer.bias.shape)
  if method in ('lcw', 'cwn'):
    _zero_sum(layer)
  return layer, jax.random.normal(jax.random.key(seed + 1), shape)


def _fields(layer):
  return {k: v for k, v in vars(layer).items()
          if not k.startswith('_') and not isinstance(v, nnx.Variable)}


def _same(a, b):
  if isinstance(a, (np.ndarray, jax.Array)) or isinstance(b, (np.ndarray, jax.Array)):
    return np.array_equal(np.asarray(a), np.asarray(b))
  return a == b


def _perturb(module, seed=3):
  """Moves every method variable (as training would) and IMN's running mean off its start."""
  for i, (_, v) in enumerate(nnx.to_flat_state(nnx.state(module, nnx.Param))):
    v.set_value(v[...] + 0.05 * jax.random.normal(jax.random.key(seed + i), v.shape, v.dtype))
  if hasattr(module, 'input_mean_norm'):
    stat = module.input_mean_norm['mean']
    stat.set_value(0.3 * jax.random.normal(jax.random.key(seed), stat.shape, stat.dtype))


# ----------------------------------------------------------------------------- the grid

@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('kind', list(LAYERS))
def test_a_converted_layer_keeps_its_type_fields_and_reads_its_effective_weights(kind, method):
  layer, x = _layer(kind, method)
  if kind == 'ConvTranspose' and method == 'gmp_imn':
    with pytest.raises(ValueError, match='IMN'):
      gnnx.reparameterize(layer, method, x)
    return
  plain = nnx.clone(layer)
  g = gnnx.reparameterize(nnx.clone(layer), method, x)
  assert isinstance(g, type(layer)) and isinstance(g, gnnx.Reparam)
  assert type(g).__name__ == f'Reparam[{kind}]'
  assert type(g) is type(gnnx.reparameterize(nnx.clone(layer), method, x))  # made once per pair
  for name, value in _fields(plain).items():
    assert _same(getattr(g, name), value), name
  # the effective weights: the layer's own, right after the exact conversion
  assert g.kernel.shape == plain.kernel.shape and g.kernel.dtype == plain.kernel.dtype
  np.testing.assert_allclose(g.kernel[...], plain.kernel[...], atol=1e-6)
  np.testing.assert_allclose(g.bias.get_value(), plain.bias[...], atol=1e-5)
  np.testing.assert_allclose(g(x), plain(x), atol=1e-5)
  # not a second copy: the state holds the method's variables only
  assert sorted(nnx.state(g, nnx.Param)) == sorted(g.param_names)
  # trained: the read equals what bake gives, eagerly and under jit
  _perturb(g)
  baked = gnnx.bake(nnx.clone(g))
  assert type(baked) is type(layer)
  np.testing.assert_allclose(g.kernel[...], baked.kernel[...], atol=1e-6)
  np.testing.assert_allclose(g.bias.value, baked.bias[...], atol=1e-6)
  jitted = nnx.jit(lambda m: (m.kernel[...], m.bias[...]))(g)
  np.testing.assert_allclose(jitted[0], baked.kernel[...], atol=1e-6)
  np.testing.assert_allclose(jitted[1], baked.bias[...], atol=1e-6)
  np.testing.assert_allclose(g(x), baked(x), atol=1e-5)


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('kind', ['Linear', 'Einsum', 'Conv'])
def test_the_gradient_of_the_read_kernel_is_that_of_the_methods_map(kind, method):
  layer, x = _layer(kind, method)
  g = gnnx.reparameterize(layer, method, x)
  _perturb(g)
  r = jax.random.normal(jax.random.key(5), g.kernel.shape)
  through_read = nnx.grad(lambda m: jnp.sum(m.kernel.value * r))(g)
  shape, layout = g.layout.method_shape, g.layout

  def through_map(params):
    return jnp.sum(layout.to_layer(g.method.apply(params, shape)[0])[0] * r)

  expected = jax.grad(through_map)(g.params())
  got = nnx.to_pure_dict(through_read)
  assert sorted(got) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_the_named_wrappers_and_reparam_keep_the_type():
  dense = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  for wrapper, method in ((gnnx.GmP, 'gmp'), (gnnx.LCW, 'lcw'), (gnnx.CWN, 'cwn'),
                          (gnnx.WN, 'wn')):
    w = wrapper(dense, rngs=nnx.Rngs(1))
    assert isinstance(w, nnx.Linear) and isinstance(w, wrapper) and isinstance(w, gnnx.Reparam)
    assert type(w).__name__ == f'{wrapper.__name__}[Linear]'
    assert (w.in_features, w.out_features, w.use_bias) == (3, 4, True)
    assert w.kernel.shape == (3, 4) and w.bias.shape == (4,)
    r = gnnx.Reparam(dense, method, rngs=nnx.Rngs(1))
    assert type(r).__name__ == 'Reparam[Linear]' and not isinstance(r, wrapper)
  conv = gnnx.Reparam(nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), 'wn')
  assert isinstance(conv, nnx.Conv) and conv.kernel_size == (3, 3)
  # the paper forms are not their plain layer (the scale multiplies after the activation)
  paper = gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0))
  assert not isinstance(paper, nnx.Linear) and not hasattr(paper, 'kernel')


def test_wn_and_cwn_keep_their_stored_kernel_name_and_read_the_effective_kernel():
  einsum = nnx.Einsum('btd,dnh->btnh', (4, 2, 3), (2, 3), rngs=nnx.Rngs(0))
  g = gnnx.reparameterize(nnx.clone(einsum), 'wn', jnp.ones((1, 1, 4)))
  state = nnx.state(g, nnx.Param)
  assert sorted(state) == ['bias', 'kernel', 'scale']  # checkpoints keep the names
  assert state['kernel'].shape == (4, 6)                # the stored direction: the method's layout
  assert g.kernel.shape == (4, 2, 3)                    # the effective kernel: the layer's
  assert g.params()['kernel'].shape == (4, 6)
  np.testing.assert_allclose(g.kernel[...], einsum.kernel[...], atol=1e-6)
  # split/merge, clone and nnx.update keep the stored variable under its name
  graphdef, st = nnx.split(g)
  merged = nnx.merge(graphdef, st)
  np.testing.assert_allclose(merged.kernel[...], g.kernel[...], atol=0)
  stored, read = np.asarray(vars(merged)['kernel'][...]), np.asarray(merged.kernel[...])
  nnx.update(merged, jax.tree.map(lambda a: a * 2, st))
  np.testing.assert_allclose(vars(merged)['kernel'][...], 2 * stored)  # updated in place
  np.testing.assert_allclose(merged.kernel[...], 2 * read, rtol=1e-6)  # WN: scale doubled
  assert type(nnx.clone(g)) is type(g)


# ----------------------------------------------------------------------------- assignment

@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('kind', ['Linear', 'Einsum', 'Conv'])
def test_an_assigned_kernel_or_bias_converts_exactly(kind, method):
  layer, x = _layer(kind, method)
  g = gnnx.reparameterize(nnx.clone(layer), method, x)
  _perturb(g)
  new, _ = _layer(kind, method, seed=11)
  w, b = np.asarray(new.kernel[...]), np.asarray(new.bias[...])
  g.kernel[...] = w
  np.testing.assert_allclose(g.kernel[...], w, atol=1e-6)
  g.bias[...] = b
  np.testing.assert_allclose(g.bias[...], b, atol=1e-5)
  np.testing.assert_allclose(g.kernel[...], w, atol=1e-6)  # the kernel kept
  plain = nnx.clone(layer)
  plain.kernel[...], plain.bias[...] = w, b
  np.testing.assert_allclose(g(x), plain(x), atol=1e-5)
  assert sorted(nnx.state(g, nnx.Param)) == sorted(g.param_names)  # no new variable
  # the other spellings
  g.kernel.set_value(2 * w)
  np.testing.assert_allclose(g.kernel.get_value(), 2 * w, atol=2e-6)
  g.kernel.value = w
  np.testing.assert_allclose(g.kernel.value, w, atol=1e-6)
  g.kernel = 3 * w
  np.testing.assert_allclose(g.kernel[...], 3 * w, atol=3e-6)
  g.bias = b + 1
  np.testing.assert_allclose(g.bias[...], b + 1, atol=1e-5)


def test_assignments_that_cannot_convert_raise_clearly():
  g = gnnx.reparameterize(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), 'gmp')
  w = np.asarray(g.kernel[...]).copy()
  w[:, 1] = 0
  with pytest.raises(ValueError, match=r"'gmp' cannot hold these weights.*zero.*bake"):
    g.kernel[...] = w
  lcw = gnnx.reparameterize(_layer('Linear', 'lcw')[0], 'lcw')
  with pytest.raises(ValueError, match=r"'lcw' cannot hold.*sum to zero"):
    lcw.kernel[...] = np.ones((4, 5))
  # IMN's running mean without a bias term: no exact form (bake refuses it too)
  free = nnx.Linear(3, 4, use_bias=False, rngs=nnx.Rngs(0))
  imn = gnnx.reparameterize(free, 'gmp_imn')
  assert imn.bias is None and free.bias is None
  imn.input_mean_norm['mean'][...] = jnp.ones(3)
  with pytest.raises(ValueError, match=r"'gmp_imn' has IMN.*running mean.*\[\.\.\.\] = 0"):
    imn.kernel[...] = np.asarray(free.kernel[...])
  with pytest.raises(ValueError, match='no bias'):
    imn.bias = np.ones(4)
  imn.input_mean_norm['mean'][...] = jnp.zeros(3)
  imn.kernel[...] = 2 * np.asarray(free.kernel[...])  # the way out
  np.testing.assert_allclose(imn.kernel[...], 2 * free.kernel[...], atol=1e-6)
  # wrong shapes, variables (a tie made after conversion) and traced assignments
  with pytest.raises(ValueError, match='shape'):
    g.kernel[...] = np.ones((4, 3))
  with pytest.raises(TypeError, match='tie'):
    g.kernel = nnx.Param(jnp.ones((3, 4)))

  def inside(m):
    m.kernel[...] = jnp.ones((3, 4))

  with pytest.raises(ValueError, match='outside jit'):
    nnx.jit(inside)(g)


# ----------------------------------------------------------------------------- a transformer

class Attention(nnx.Module):

  def __init__(self, d, heads, rngs):
    self.q = nnx.Linear(d, d, rngs=rngs)
    self.k = nnx.Linear(d, d, rngs=rngs)
    self.v = nnx.Einsum('btd,dnh->btnh', (d, heads, d // heads), (heads, d // heads),
                        rngs=rngs)
    self.o = nnx.Einsum('btnh,nhd->btd', (heads, d // heads, d), (d,), rngs=rngs)

  @property
  def head_dim(self):  # read off a kernel's shape, as Gemma does
    return self.v.kernel.shape[-1]

  def __call__(self, x):
    b, t, d = x.shape
    assert self.q.in_features == d, (self.q.in_features, d)
    heads = self.q.kernel.shape[1] // self.head_dim
    q = self.q(x).reshape(b, t, heads, self.head_dim)
    k = self.k(x).reshape(b, t, heads, self.head_dim)
    logits = jnp.einsum('bqnh,bknh->bnqk', q, k) / jnp.sqrt(self.head_dim)
    return self.o(jnp.einsum('bnqk,bknh->bqnh', jax.nn.softmax(logits), self.v(x)))


class Transformer(nnx.Module):

  def __init__(self, rngs, d=8, heads=2, vocab=11):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.attn = Attention(d, heads, rngs)
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, 2 * d, rngs=rngs)
    self.mlp_out = nnx.Linear(2 * d, d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    h = h + self.attn(self.norm(h))
    h = h + self.mlp_out(nnx.gelu(self.mlp_in(h)))
    # a readout by hand, from the head's kernel and bias
    return h @ self.head.kernel.value + self.head.bias.value


def init_scheme(model, key):
  """Draws every Linear and Einsum kernel anew, found by type (as init schemes do)."""
  for path, m in nnx.iter_graph(model):
    if isinstance(m, (nnx.Linear, nnx.Einsum)):
      shape = m.kernel.shape
      k = jax.random.fold_in(key, zlib.crc32('/'.join(map(str, path)).encode()))
      m.kernel[...] = jax.random.normal(k, shape) / np.sqrt(shape[0])


def _train(model, tokens, steps=3):
  loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens).mean()
  return training.nnx_train(model, None, None, steps, optax.adam(1e-2), loss)


@pytest.mark.parametrize('example', [True, False])
@pytest.mark.parametrize('method', ['gmp', 'gmp_imn', 'wn'])
def test_a_transformer_that_reads_its_layers_converts_trains_and_bakes(method, example):
  tokens = jnp.asarray(np.arange(12).reshape(2, 6) % 11)
  model = Transformer(nnx.Rngs(0))
  init_scheme(model, jax.random.key(0))
  before = model(tokens)
  args = (tokens,) if example else ()
  model = gnnx.reparameterize(model, method, *args, where=lambda m, p: 'embed' not in p)
  for name in ('q', 'k'):
    assert isinstance(getattr(model.attn, name), nnx.Linear)
  assert isinstance(model.attn.v, nnx.Einsum) and model.attn.head_dim == 4
  np.testing.assert_allclose(model(tokens), before, atol=1e-5)
  converted = nnx.state(model, nnx.Param)
  assert 'theta' in converted['attn']['q'] or 'scale' in converted['attn']['q']
  # the init scheme runs on the converted model too (its assignments convert exactly)
  reinit = nnx.clone(model)
  init_scheme(reinit, jax.random.key(1))
  plain_reinit = Transformer(nnx.Rngs(0))
  init_scheme(plain_reinit, jax.random.key(1))
  np.testing.assert_allclose(reinit(tokens), plain_reinit(tokens), atol=1e-4)
  losses = _train(model, tokens)
  assert losses[-1] < losses[0]
  trained = model(tokens)
  model = gnnx.bake(model)
  assert type(model.attn.q) is nnx.Linear and type(model.attn.v) is nnx.Einsum
  np.testing.assert_allclose(model(tokens), trained, atol=1e-5)


# ----------------------------------------------------------------------------- ties and the rest

class Tied(nnx.Module):

  def __init__(self, rngs):
    self.a = nnx.Linear(4, 4, rngs=rngs)
    self.b = nnx.Linear(4, 4, rngs=rngs)
    self.b.kernel = self.a.kernel  # one nnx.Param in two layers
    self.c = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.c(nnx.relu(self.b(nnx.relu(self.a(x)))))


def test_a_tie_through_a_shared_param_is_refused_by_name_never_untied():
  model = Tied(nnx.Rngs(0))
  assert len(nnx.to_flat_state(nnx.state(model, nnx.Param))) == 5
  with pytest.raises(ValueError, match=r'kernel of Linear at a is tied.*also at b/kernel.*exclude'):
    gnnx.reparameterize(model, 'gmp')
  with pytest.raises(ValueError, match=r'kernel of Linear at b is tied.*also at a/kernel'):
    gnnx.reparameterize(model, 'gmp', exclude=['a'])
  assert type(model.a) is nnx.Linear  # nothing changed
  model = gnnx.reparameterize(model, 'gmp', exclude=['a', 'b'])
  assert model.a.kernel is model.b.kernel and isinstance(model.c, gnnx.Reparam)
  x = jnp.ones((2, 4))
  _train_mse(model, x)
  assert model.a.kernel is model.b.kernel  # still tied after training
  model = gnnx.bake(model)
  assert model.a.kernel is model.b.kernel and type(model.c) is nnx.Linear


def _train_mse(model, x):
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  step = nnx.jit(lambda m, o: o.update(m, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)))
  for _ in range(3):
    step(model, opt)


def test_bake_of_a_model_with_nothing_to_bake_raises():
  with pytest.raises(ValueError, match='nothing to bake'):
    gnnx.bake(Tied(nnx.Rngs(0)))
  with pytest.raises(ValueError, match='nothing to bake'):
    gnnx.bake(gnnx.GmPLinear(3, 4, rngs=nnx.Rngs(0)))


def test_params_missing_a_variable_name_it():
  with pytest.raises(ValueError, match=r"params lacks \['theta', 'lam', 'scale'\].*'gmp'"):
    gnnx.Reparam(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), 'gmp', params={})


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def test_imn_differentiated_in_evaluation_mode_warns_once_it_bites():
  x = jax.random.normal(jax.random.key(0), (5, 3))
  model = gnnx.reparameterize(MLP(nnx.Rngs(0)), 'gmp_imn', x)
  assert model.hidden.use_running_average is True  # no module with a mode: evaluation
  loss = lambda m: jnp.sum(m(x) ** 2)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    model(x)  # evaluation: no warning
    assert not caught
    nnx.grad(loss)(model)
  assert any('model.train()' in str(w.message) for w in caught), [str(w.message) for w in caught]
  model.train()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    nnx.grad(loss)(model)
  assert not caught


def test_the_probe_shows_the_layer_to_the_models_code():
  class Reads(nnx.Module):

    def __init__(self, rngs):
      self.proj = nnx.Linear(4, 6, rngs=rngs)
      self.bn = nnx.BatchNorm(6, rngs=rngs)

    def __call__(self, x):
      assert isinstance(self.proj, nnx.Linear) and self.proj.kernel.shape == (4, 6)
      return self.bn(self.proj(x)) * self.proj.out_features

  x = jax.random.normal(jax.random.key(0), (5, 4))
  model = Reads(nnx.Rngs(0))
  model.eval()
  before = model(x)
  model = gnnx.reparameterize(model, 'gmp_imn', x, drop_batchnorm=True)
  np.testing.assert_allclose(model(x), before, atol=1e-4)
  assert type(model.proj).__name__ == 'Reparam[Linear]'


def test_the_read_kernel_carries_the_kernels_sharding_names():
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ('embed', 'mlp'))
  with jax.set_mesh(jax.make_mesh((1, 1), ('embed', 'mlp'))):
    dense = nnx.Linear(4, 6, kernel_init=init, rngs=nnx.Rngs(0))
    g = gnnx.reparameterize(nnx.clone(dense), 'gmp')
    np.testing.assert_allclose(nnx.jit(lambda m: m.kernel[...])(g), dense.kernel[...], atol=1e-6)
  assert dense.kernel.get_metadata()['out_sharding'] == ('embed', 'mlp')
  assert g.kernel.get_metadata('out_sharding') == ('embed', 'mlp')
  assert g.bias.get_metadata('out_sharding') == ('mlp',)
  assert g.kernel.sharding_names == ('embed', 'mlp')
  assert tuple(nnx.state(g, nnx.Param)['theta'].get_metadata()['out_sharding']) == (None, 'mlp')


class _OwnLinear(nnx.Module):
  """A user's layer: kernel `w`, read as `self.w.value` in its call (as older NNX code does)."""

  def __init__(self, i, o, rngs):
    self.in_features, self.out_features, self.use_bias = i, o, False
    self.w = nnx.Param(jax.random.normal(rngs.params(), (i, o)) / i ** 0.5)

  def __call__(self, x):
    return x @ self.w.get_value()


def _own_kind(**fields):
  return kinds.Kind('OwnLinear', **{
      'layout': lambda layer, shape: kinds.Layout((layer.in_features, layer.out_features), (1,)),
      'imn_axes': lambda layer, ndim: (ndim - 1,), 'example_shape': lambda l: (1, l.in_features),
      'kernel': 'w', 'has_bias': lambda layer: False, **fields})


@pytest.mark.parametrize('case', ['plain', 'layout_reads_kernel', 'call_reads_variable'])
def test_a_kind_of_your_own_converts_runs_traced_and_reads_its_kernel(monkeypatch, case):
  layer_cls = _OwnLinear
  if case == 'call_reads_variable':  # .value, deprecated in NNX, still read by much code
    layer_cls = type('OwnLinearValue', (_OwnLinear,), {'__call__': lambda self, x: x @ self.w.value})
  layout = None
  if case == 'layout_reads_kernel':  # the layout reads the layer's own kernel's shape
    layout = lambda layer, shape: kinds.Layout(tuple(layer.w.shape), (1,))
  monkeypatch.setitem(kinds.REGISTRY, layer_cls, _own_kind(
      **({'layout': layout} if layout else {})))
  layer = layer_cls(3, 4, nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3)), jnp.float32)
  before, kernel = layer(x), layer.w[...]
  g = gnnx.reparameterize(layer, 'gmp', x)
  assert isinstance(g, layer_cls)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(g, x), before, atol=1e-5)
  np.testing.assert_allclose(g.w[...], kernel, atol=1e-6)  # the kind's kernel name reads it


def test_a_kind_naming_a_kernel_the_layer_lacks_says_what_it_holds(monkeypatch):
  monkeypatch.setitem(kinds.REGISTRY, _OwnLinear, _own_kind(kernel='weight'))
  with pytest.raises(ValueError, match=r"names the kernel variable 'weight'.*holds \['w'\]"):
    gnnx.reparameterize(_OwnLinear(3, 4, nnx.Rngs(0)), 'gmp')
