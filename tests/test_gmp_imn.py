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
def test_folded_imn_equals_explicit_subtraction(shape, imn_path):
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


# ----------------------------------------------------------------------------- conv IMN (issue 17)
# IMN in convs as conv(x) - conv(mu * 1) (`geoparam.conv.split`), never a pass over x: equal to
# the explicit subtraction for every padding (zeros padded or not), stride, dilation, group count
# and number of spatial dims, in training (batch mean, its gradient into x) and evaluation.

IMN_CONV_CASES = [
    dict(kernel_size=(3,), padding='SAME'),
    dict(kernel_size=(4,), padding='CAUSAL', kernel_dilation=2),
    dict(kernel_size=(3, 3), padding='SAME'),
    dict(kernel_size=(3, 3), padding='SAME', strides=2),
    dict(kernel_size=(2, 3), padding='SAME', strides=(2, 1), kernel_dilation=(1, 2)),
    dict(kernel_size=(3, 3), padding='VALID', strides=2),
    dict(kernel_size=(3, 2), padding='CIRCULAR', kernel_dilation=2),
    dict(kernel_size=(3, 3), padding='CIRCULAR', strides=2),
    dict(kernel_size=(3, 3), padding='REFLECT'),
    dict(kernel_size=(2, 2), padding=((1, 0), (2, 1)), feature_group_count=2),
    dict(kernel_size=(3, 3), padding=((0, 0), (0, 0))),
    dict(kernel_size=(3, 3), padding=1, strides=(1, 2), feature_group_count=2),
    dict(kernel_size=(3, 3), padding=((1, 1), (0, 2)), input_dilation=(1, 2)),
    dict(kernel_size=(3, 3), padding=((0, 0), (0, 0)), input_dilation=2),
    dict(kernel_size=(1, 1), padding='SAME', strides=2),
    dict(kernel_size=(2, 2, 2), padding='SAME'),
    dict(kernel_size=(3, 1, 2), padding='VALID', strides=(1, 2, 1), feature_group_count=2),
]
# Whether zeros reach some window (padded or inserted), i.e. the subtracted term is per position.
IMN_CONV_PER_POSITION = [True, True, True, True, True, False, False, False, False, True, False,
                         True, True, True, False, True, False]


class _ExplicitConv(nn.Module):
  """Reference: InputMeanNorm (explicit x - mean), then GmPConv without IMN."""
  case: dict

  @nn.compact
  def __call__(self, x, use_running_average):
    x = geoparam.InputMeanNorm(name='imn')(x, use_running_average=use_running_average)
    return geoparam.GmPConv(4, param_dtype=jnp.float64, name='gmp', **self.case)(x)


def _conv_input(case, key=0):
  nd = len(case['kernel_size'])
  return jax.random.normal(jax.random.key(key), (3,) + (7, 6, 5)[:nd] + (4,), jnp.float64) * 2 + 3


def _variables_like(module, x, seed=0):
  """Variables shaped as `module.init`'s, drawn in numpy (a nonzero lam and running mean): the
  shapes come from tracing, so no case compiles an initializer of its own."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(1), x, use_running_average=False))
  return jax.tree.map(lambda s: jnp.asarray(rng.uniform(0.2, 1.2, s.shape), s.dtype), shapes)


def _outputs_and_grads(apply, params, x, train):
  """Output, updated batch_stats (training) and gradients w.r.t. params and x of sum(out * w)."""
  def f(p, x):
    if train:
      y, upd = apply(p, x, mutable=['batch_stats'])
    else:
      y, upd = apply(p, x), None
    return y, upd
  y, upd = f(params, x)
  w = jax.random.normal(jax.random.key(9), y.shape, y.dtype)  # a cotangent with no symmetry
  grads = jax.grad(lambda p, x: jnp.sum(f(p, x)[0] * w), argnums=(0, 1))(params, x)
  return y, upd, grads


# Folding depends on the padding, stride, dilation and groups: every case. Subtracting does not:
# three cases (SAME 2-D, CIRCULAR, grouped with explicit pads).
IMN_PATHS = [(i, 'fold') for i in range(len(IMN_CONV_CASES))] + [(i, 'subtract') for i in (2, 6, 9)]


@pytest.mark.parametrize('i, imn_path', IMN_PATHS, indirect=['imn_path'])
def test_conv_imn_equals_explicit_subtraction(x64, i, imn_path):
  case = IMN_CONV_CASES[i]
  x = _conv_input(case)
  folded = geoparam.GmPConv(4, input_mean_norm=True, param_dtype=jnp.float64, **case)
  v = _variables_like(folded, x)
  ve = {'params': {'gmp': v['params']},
        'batch_stats': {'imn': {'mean': v['batch_stats']['input_mean_norm']['mean']}}}
  for train in (True, False):
    ya, sa, (gpa, gxa) = _outputs_and_grads(
        lambda p, x, **k: folded.apply({**v, 'params': p}, x, use_running_average=not train, **k),
        v['params'], x, train)
    yb, sb, (gpb, gxb) = _outputs_and_grads(
        lambda p, x, **k: _ExplicitConv(case).apply({**ve, 'params': {'gmp': p}}, x,
                                                    use_running_average=not train, **k),
        v['params'], x, train)
    np.testing.assert_allclose(ya, yb, rtol=1e-11, atol=1e-11)
    for name in ('theta', 'lam', 'scale'):
      np.testing.assert_allclose(gpa[name], gpb[name], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gxa, gxb, rtol=1e-10, atol=1e-10)
    if train:  # the running mean moves exactly as InputMeanNorm's
      np.testing.assert_array_equal(sa['batch_stats']['input_mean_norm']['mean'],
                                    sb['batch_stats']['imn']['mean'])
      assert not np.allclose(sa['batch_stats']['input_mean_norm']['mean'],
                             v['batch_stats']['input_mean_norm']['mean'])


@pytest.mark.parametrize('i, imn_path', IMN_PATHS, indirect=['imn_path'])
def test_wrapper_conv_imn_equals_explicit_subtraction(x64, i, imn_path):
  """GmP(nn.Conv, input_mean_norm=True) == nn.Conv(kernel = scale u, bias = scale lam)(x - mean)."""
  case = IMN_CONV_CASES[i]
  x = _conv_input(case, key=3)
  layer = nn.Conv(4, param_dtype=jnp.float64, **case)
  wrapped = geoparam.GmP(layer, input_mean_norm=True)
  v = _variables_like(wrapped, x, seed=1)
  running = v['batch_stats']['input_mean_norm']['mean']

  def explicit(p, x, train):
    mean = x.mean(axis=tuple(range(x.ndim - 1))) if train else running
    kernel = (geoparam.gmp_kernel(p['theta']) * p['scale']).reshape(
        tuple(case['kernel_size']) + (4 // case.get('feature_group_count', 1), 4))
    return layer.apply({'params': {'kernel': kernel, 'bias': p['scale'] * p['lam']}}, x - mean)

  for train in (True, False):
    kw = dict(use_running_average=not train)
    ya, upd, (gpa, gxa) = _outputs_and_grads(
        lambda p, x, **k: wrapped.apply({**v, 'params': p}, x, **kw, **k), v['params'], x, train)
    yb, _, (gpb, gxb) = _outputs_and_grads(lambda p, x: explicit(p, x, train), v['params'], x,
                                            False)
    np.testing.assert_allclose(ya, yb, rtol=1e-11, atol=1e-11)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10), gpa, gpb)
    np.testing.assert_allclose(gxa, gxb, rtol=1e-10, atol=1e-10)
    if train:
      mean = x.mean(axis=tuple(range(x.ndim - 1)))
      np.testing.assert_allclose(upd['batch_stats']['input_mean_norm']['mean'],
                                 0.99 * running + 0.01 * mean, rtol=1e-14)


@pytest.mark.parametrize('i', range(len(IMN_CONV_CASES)))
def test_imn_bias_is_per_position_exactly_where_zeros_are_padded(x64, i):
  case = IMN_CONV_CASES[i]
  x = _conv_input(case)
  layer = nn.Conv(4, param_dtype=jnp.float64, **case)
  kernel = jax.random.normal(jax.random.key(2), geoparam.linen.wrappers.layout_of(
      layer, x.shape, 'conv').kernel_shape, jnp.float64)
  mean = jnp.arange(1.0, 5.0)
  mask = geoparam.linen.wrappers.tap_mask(layer, x.shape[1:-1])
  flat, positions, correction = geoparam.conv.split(mask, kernel, mean, layer.precision)
  # what IMN subtracts from conv(x): `flat` everywhere, plus `correction` at `positions`
  bias = flat - geoparam.conv.subtract_at(jnp.zeros((1,) + mask.shape[:-1] + (4,)), positions,
                                          correction, kernel.ndim - 2)[0]
  # conv of the constant image itself (batch 1), the definition.
  want = layer.apply({'params': {'kernel': kernel, 'bias': jnp.zeros(4)}},
                     jnp.broadcast_to(mean, (1,) + x.shape[1:]))[0]
  assert (positions.size > 0) == IMN_CONV_PER_POSITION[i]  # a bias per position, or one
  np.testing.assert_allclose(jnp.broadcast_to(bias, want.shape), want, rtol=1e-13, atol=1e-13)


def test_conv_imn_makes_no_pass_over_the_activations_when_folded():
  """Folded (activations larger than the kernel, `gmp.imn_subtracts`): no elementwise op on an
  input-shaped array; the conv reads x, the batch mean reduces it."""
  x = jnp.ones((8, 6, 6, 3))
  assert not geoparam.methods.run.imn_subtracts(x.shape, (3, 3, 3, 4))
  for layer in (geoparam.GmPConv(4, (3, 3), input_mean_norm=True),
                geoparam.GmP(nn.Conv(4, (3, 3)), input_mean_norm=True)):
    v = layer.init(jax.random.key(0), x, use_running_average=False)
    for train in (True, False):
      shaped = _ops_on_inputs(_apply_jaxpr(layer, v, x, train), x.shape)
      assert shaped == [], shaped  # before issue 17: ['sub'] (x - mean)


def test_small_activations_subtract_the_mean_instead():
  """Activations smaller than the kernel: `x - mean` (one op on x) and no kernel-sized fold."""
  x = jnp.ones((1, 2, 2, 8))
  assert geoparam.methods.run.imn_subtracts(x.shape, (3, 3, 8, 16))
  for layer in (geoparam.GmPConv(16, (3, 3), input_mean_norm=True),
                geoparam.GmP(nn.Conv(16, (3, 3)), input_mean_norm=True)):
    v = layer.init(jax.random.key(0), x, use_running_average=False)
    jaxpr = _apply_jaxpr(layer, v, x, train=True)
    shaped = _ops_on_inputs(jaxpr, x.shape)
    assert shaped == ['sub'], shaped
    assert 'dot_general' not in _primitives(jaxpr.jaxpr)  # no u^T mean, no imn_split einsum


def _apply_jaxpr(layer, v, x, train):
  return jax.make_jaxpr(lambda v, x: layer.apply(
      v, x, use_running_average=not train, mutable=['batch_stats']))(v, x)


def _ops_on_inputs(jaxpr, shape) -> list[str]:
  """The top-level primitives of `jaxpr` that produce an array of the layer input's `shape`."""
  return [e.primitive.name for e in jaxpr.eqns
          if any(getattr(o.aval, 'shape', None) == shape for o in e.outvars)]


def _primitives(jaxpr) -> set[str]:
  """Every primitive in `jaxpr` and the jaxprs nested in its equations (pjit, scan, cond...)."""
  names = set()
  for e in jaxpr.eqns:
    names.add(e.primitive.name)
    for value in e.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          names |= _primitives(inner)
  return names


@pytest.mark.parametrize('axis', [(1, 2), (-1,), (0, 3)])
def test_dense_general_imn_both_ways_equals_numpy(x64, imn_path, axis):
  """IMN over the contracted axes of a DenseGeneral (moved and flattened) matches x - mean."""
  x = jax.random.normal(jax.random.key(0), (3, 2, 4, 5), jnp.float64) * 2 + 1
  layer = nn.DenseGeneral(3, axis=axis, param_dtype=jnp.float64)
  wrapped = geoparam.GmP(layer, input_mean_norm=True)
  v = wrapped.init(jax.random.key(1), x, use_running_average=False)
  v = jax.tree.map(lambda a: a + 0.2, v)
  axes = tuple(a % 4 for a in axis)
  kernel = (geoparam.gmp_kernel(v['params']['theta']) * v['params']['scale']).reshape(
      tuple(x.shape[a] for a in axes) + (3,))
  plain = {'params': {'kernel': kernel, 'bias': v['params']['scale'] * v['params']['lam']}}
  batch_axes = tuple(a for a in range(4) if a not in axes)
  for train in (True, False):
    mean = (np.asarray(x).mean(axis=batch_axes, keepdims=True) if train else np.moveaxis(
        np.asarray(v['batch_stats']['input_mean_norm']['mean']).reshape(
            (1,) * len(batch_axes) + tuple(x.shape[a] for a in axes)),
        tuple(range(len(batch_axes), 4)), axes))
    got, _ = wrapped.apply(v, x, use_running_average=not train, mutable=['batch_stats'])
    np.testing.assert_allclose(got, layer.apply(plain, np.asarray(x) - mean), rtol=1e-12,
                               atol=1e-12)
