"""GmP/LCW/CWN/WN wrappers of any layer: references, transforms, sharding, dtypes, bad input."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import geoparam
from conftest import ref_to_cartesian


def _numpy_gmp_dense(params, x):
  """Float64 reference: u from explicit products, `x @ (scale u) + scale lam`."""
  theta = np.asarray(params['theta'], np.float64)
  u = np.stack([ref_to_cartesian(theta[:, j]) for j in range(theta.shape[1])], axis=1)
  scale = np.asarray(params['scale'], np.float64)
  return np.asarray(x, np.float64) @ (u * scale) + scale * np.asarray(params['lam'], np.float64)


def _perturbed(params, key=1):
  """Params with nonzero lam and scales in (0.5, 1.5), so the checks see every term."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(key), len(leaves))
  return jax.tree.unflatten(tree, [
      a + 0.5 * jax.random.uniform(k, a.shape, a.dtype, -1, 1) for a, k in zip(leaves, keys)])


def test_gmp_dense_wrapper_equals_paper_form_and_float64_reference(x64):
  x = jax.random.normal(jax.random.key(0), (5, 7), jnp.float64)
  wrapped = geoparam.GmP(nn.Dense(4, param_dtype=jnp.float64))
  params = _perturbed(wrapped.init(jax.random.key(2), x)['params'])
  z = wrapped.apply({'params': params}, x)
  np.testing.assert_allclose(z, _numpy_gmp_dense(params, x), rtol=1e-12, atol=1e-12)
  # relu after the wrapper == the paper's scale * relu(u^T x + lam) for scale > 0.
  paper = geoparam.GmPDense(4, param_dtype=jnp.float64)
  np.testing.assert_allclose(nn.relu(z), paper.apply({'params': params}, x), rtol=1e-12,
                             atol=1e-14)


CONV_CASES = [
    dict(kernel_size=(3,), padding='SAME'),
    dict(kernel_size=(3, 3), strides=2, padding='VALID'),
    dict(kernel_size=(3, 2), padding='CIRCULAR', kernel_dilation=2),
    dict(kernel_size=(2, 2), padding=((1, 0), (2, 1)), feature_group_count=2),
    dict(kernel_size=(3, 3), padding=((1, 1), (0, 2)), input_dilation=(1, 2)),
    dict(kernel_size=(3, 3), padding='REFLECT'),
    dict(kernel_size=(2, 2, 2), padding='SAME'),
]


@pytest.mark.parametrize('case,imn', [(c, i % 2 == 1) for i, c in enumerate(CONV_CASES)] +
                         [(CONV_CASES[0], True), (CONV_CASES[1], False)])
def test_gmp_conv_wrapper_equals_paper_form(x64, case, imn, imn_path):
  nd = len(case['kernel_size'])
  x = jax.random.normal(jax.random.key(0), (2,) + (6,) * nd + (4,), jnp.float64) + 0.7
  layer = nn.Conv(6, param_dtype=jnp.float64, **case)
  wrapped = geoparam.GmP(layer, input_mean_norm=imn)
  paper = geoparam.GmPConv(6, activation=None, input_mean_norm=imn, param_dtype=jnp.float64,
                           **case)
  v = wrapped.init(jax.random.key(1), x, use_running_average=False)
  v = {**v, 'params': _perturbed(v['params'])}
  for ura in (False, True):
    got, upd = wrapped.apply(v, x, use_running_average=ura, mutable=['batch_stats'])
    want, upd_paper = paper.apply(v, x, use_running_average=ura, mutable=['batch_stats'])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    jax.tree.map(np.testing.assert_array_equal, upd, upd_paper)
  # The explicit float64 reference: nn.Conv with kernel = scale * u on the centred input.
  u = geoparam.gmp_kernel(v['params']['theta'])
  kernel = (u * v['params']['scale']).reshape(case['kernel_size'] + (4 // case.get(
      'feature_group_count', 1), 6))
  centred = x - (x.mean(axis=tuple(range(x.ndim - 1))) if imn else 0)
  ref = nn.Conv(6, param_dtype=jnp.float64, **case).apply(
      {'params': {'kernel': kernel, 'bias': v['params']['scale'] * v['params']['lam']}}, centred)
  np.testing.assert_allclose(wrapped.apply(v, x, use_running_average=False,
                                           mutable=['batch_stats'])[0], ref, rtol=1e-12,
                             atol=1e-12)


def test_imn_dense_folded_equals_explicit_subtraction(x64, imn_path):
  x = jax.random.normal(jax.random.key(0), (8, 5), jnp.float64) * 2 + 3
  wrapped = geoparam.GmP(nn.Dense(3, param_dtype=jnp.float64), input_mean_norm=True)
  v = wrapped.init(jax.random.key(1), x, use_running_average=False)
  v = {'params': _perturbed(v['params']), 'batch_stats': _perturbed(v['batch_stats'])}
  for ura in (False, True):
    mean = v['batch_stats']['input_mean_norm']['mean'] if ura else x.mean(0)
    want = _numpy_gmp_dense(v['params'], np.asarray(x) - np.asarray(mean))
    got = wrapped.apply(v, x, use_running_average=ura, mutable=['batch_stats'])[0]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_lcw_and_cwn_wrappers_equal_paper_form_layers(x64):
  x = jax.random.normal(jax.random.key(0), (2, 5, 5, 4), jnp.float64)
  pairs = [
      (geoparam.LCW(nn.Conv(3, (3, 3), feature_group_count=1, param_dtype=jnp.float64)),
       geoparam.LCWConv(3, (3, 3), param_dtype=jnp.float64)),
      (geoparam.CWN(nn.Dense(3, param_dtype=jnp.float64)),
       geoparam.CWNDense(3, param_dtype=jnp.float64)),
  ]
  for wrapped, paper in pairs:
    params = _perturbed(wrapped.init(jax.random.key(1), x)['params'])
    np.testing.assert_allclose(wrapped.apply({'params': params}, x),
                               paper.apply({'params': params}, x), rtol=1e-12, atol=1e-12)
  # LCW's kernel sums to zero per unit; an explicit basis matrix gives the same kernel.
  v = jax.random.normal(jax.random.key(3), (6, 3), jnp.float64)
  np.testing.assert_allclose(geoparam.methods.lcw.kernel_from_v(v),
                             geoparam.lcw.basis(7, jnp.float64) @ v, atol=1e-12)


def test_wn_wrapper_formula(x64):
  x = jax.random.normal(jax.random.key(0), (3, 4), jnp.float64)
  wrapped = geoparam.WN(nn.Dense(2, param_dtype=jnp.float64))
  p = _perturbed(wrapped.init(jax.random.key(1), x)['params'])
  k = np.asarray(p['kernel'])
  want = x @ (k / np.linalg.norm(k, axis=0) * np.asarray(p['scale'])) + np.asarray(p['bias'])
  np.testing.assert_allclose(wrapped.apply({'params': p}, x), want, rtol=1e-10)


class _Block(nn.Module):
  """relu(GmP(Dense)) carried through scan/remat/vmap lifts."""
  features: int = 4

  @nn.compact
  def __call__(self, x, _=None):
    return nn.relu(geoparam.GmP(nn.Dense(self.features))(x)), None


class _PlainBlock(nn.Module):
  features: int = 4

  @nn.compact
  def __call__(self, x, _=None):
    return geoparam.GmPDense(self.features, name='GmP_0')(x), None


@pytest.mark.parametrize('lift', ['scan', 'remat', 'vmap'])
def test_wrapper_under_flax_lifts_jit_grad(lift):
  x = jax.random.normal(jax.random.key(0), (3, 4))

  def build(block):
    if lift == 'scan':
      return nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True}, length=3)()
    if lift == 'remat':
      return nn.remat(block)()
    if lift == 'vmap':
      return nn.vmap(block, variable_axes={'params': 0}, split_rngs={'params': True},
                     in_axes=0)()
    return block()

  wrapped, paper = build(_Block), build(_PlainBlock)
  params = wrapped.init(jax.random.key(1), x)['params']
  paper_params = paper.init(jax.random.key(1), x)['params']
  assert jax.tree.structure(params) == jax.tree.structure(paper_params)

  def loss(m, p):
    return jnp.sum(m.apply({'params': p}, x)[0] ** 2)

  np.testing.assert_allclose(jax.jit(functools.partial(loss, wrapped))(params),
                             loss(paper, params), rtol=1e-5)
  ga = jax.jit(jax.grad(functools.partial(loss, wrapped)))(params)
  gb = jax.grad(functools.partial(loss, paper))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), ga, gb)
  # jax.vmap over a batch of inputs.
  batched = jax.vmap(lambda xi: wrapped.apply({'params': params}, xi)[0])(jnp.stack([x, 2 * x]))
  np.testing.assert_allclose(batched[1], wrapped.apply({'params': params}, 2 * x)[0], rtol=1e-6)


def test_partitioning_metadata_carries_to_the_stored_params():
  init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, 'model'))
  conv_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, None, None, 'model'))
  x = jnp.ones((2, 6, 6, 4))
  cases = {
      'gmp': geoparam.GmP(nn.Conv(8, (3, 3), kernel_init=conv_init)),
      'gmp_dense': geoparam.GmP(nn.Dense(8, kernel_init=init), initialization='layer'),
      'lcw_paper': geoparam.LCWDense(8, kernel_init=init),
      'cwn': geoparam.CWN(nn.Dense(8, kernel_init=init)),
      'gmp_theta_init': geoparam.GmPDense(8, theta_init=nn.with_partitioning(
          geoparam.initializers.sphere_uniform(), (None, 'model'))),
  }
  mesh = jax.make_mesh((1, 1), ('data', 'model'))
  for name, layer in cases.items():
    boxed = layer.init(jax.random.key(0), x)
    specs = nn.get_partition_spec(boxed)['params']
    for key, spec in specs.items():
      if key in ('theta', 'v'):
        assert tuple(spec) == (None, 'model'), (name, key, spec)
      elif key in ('lam', 'scale', 'bias') and name != 'gmp_theta_init':
        assert tuple(spec) == ('model',), (name, key, spec)
    if name == 'gmp':  # the specs are what jit takes as out_shardings
      shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(boxed))
      out = jax.jit(lambda k: nn.unbox(layer.init(k, x)), out_shardings=shardings)(
          jax.random.key(0))
      assert jax.tree.structure(out) == jax.tree.structure(nn.unbox(boxed))


@pytest.mark.parametrize('dtype', [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
def test_direction_map_runs_in_float32_at_least(dtype):
  with jax.enable_x64(dtype == jnp.float64):
    layer = geoparam.GmPDense(64, param_dtype=dtype)
    params = layer.init(jax.random.key(0), jnp.ones((1, 4608), dtype))['params']
    assert params['theta'].dtype == jnp.promote_types(dtype, jnp.float32)  # stored wide (issue 26)
    u = geoparam.gmp_kernel(params['theta'])
    assert u.dtype == jnp.promote_types(dtype, jnp.float32)
    err = np.abs(np.linalg.norm(np.asarray(u, np.float64), axis=0) - 1)
    assert err.max() < 1e-5, err.max()


def test_bf16_computation_with_float32_params():
  x = jax.random.normal(jax.random.key(0), (4, 6, 6, 3)).astype(jnp.bfloat16)
  for wrapped in (geoparam.GmP(nn.Conv(8, (3, 3), dtype=jnp.bfloat16), input_mean_norm=True),
                  geoparam.LCW(nn.Dense(5, dtype=jnp.bfloat16)),
                  geoparam.CWN(nn.Dense(5, dtype=jnp.bfloat16))):
    v = wrapped.init(jax.random.key(1), x, **({'use_running_average': False}
                                               if isinstance(wrapped, geoparam.GmP) else {}))
    kw = {'use_running_average': False} if isinstance(wrapped, geoparam.GmP) else {}

    def loss(p):
      y = wrapped.apply({**v, 'params': p}, x, mutable=['batch_stats'], **kw)[0]
      assert y.dtype == jnp.bfloat16
      return jnp.sum(y.astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(v['params'])
    for g in jax.tree.leaves(grads):
      assert g.dtype == jnp.float32 and np.all(np.isfinite(g))


def test_imn_axis_name_averages_over_the_named_axis():
  """IMN with axis_name inside a mapped axis (vmap here, shard_map/pmap alike) = global mean."""
  x = jax.random.normal(jax.random.key(0), (4, 6, 3)) * 2 + jnp.arange(4.0)[:, None, None]
  layer = geoparam.GmP(nn.Dense(2), input_mean_norm=True, axis_name='devices')
  v = layer.init(jax.random.key(1), x[0], use_running_average=False)
  _, upd = jax.vmap(lambda xi: layer.apply(v, xi, use_running_average=False,
                                           mutable=['batch_stats']), axis_name='devices')(x)
  mean = upd['batch_stats']['input_mean_norm']['mean']
  want = 0.99 * 0 + 0.01 * x.reshape(-1, 3).mean(0)
  np.testing.assert_allclose(mean, jnp.broadcast_to(want, (4, 3)), rtol=1e-5, atol=1e-7)
  paper = geoparam.GmPDense(2, input_mean_norm=True, axis_name='devices')
  _, upd_paper = jax.vmap(lambda xi: paper.apply(v, xi, use_running_average=False,
                                                 mutable=['batch_stats']), axis_name='devices')(x)
  np.testing.assert_allclose(upd_paper['batch_stats']['input_mean_norm']['mean'], mean,
                             rtol=1e-6)


# ----------------------------------------------------------------------------- bad input

def test_unsupported_layers_and_shapes_are_named():
  x = jnp.ones((2, 5, 5, 3))
  with pytest.raises(TypeError, match='ConvLocal'):
    geoparam.GmP(nn.ConvLocal(4, (3, 3))).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='IMN has no exact form for a ConvTranspose'):
    geoparam.GmP(nn.ConvTranspose(4, (3, 3)), input_mean_norm=True).init(
        jax.random.key(0), x, use_running_average=False)
  with pytest.raises(ValueError, match=r'Reparam\(DenseGeneral\).*batch_dims'):
    geoparam.Reparam(nn.DenseGeneral((2, 3), batch_dims=(0,)), 'wn').init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r'features must be an integer in \[1,'):
    geoparam.LCW(nn.Dense(0)).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='fan-in of at least 2'):
    geoparam.LCW(nn.Dense(3)).init(jax.random.key(0), jnp.ones((2, 1)))
  with pytest.raises(ValueError, match="initialization must be one of"):
    geoparam.GmP(nn.Dense(3), initialization='he').init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='do not also pass'):
    geoparam.GmP(nn.Dense(3), initialization='layer', scale_init=nn.initializers.ones).init(
        jax.random.key(0), x)


def test_imn_rejects_integer_inputs():
  images = jnp.full((2, 4, 4, 3), 200, jnp.uint8)
  for layer in (geoparam.GmP(nn.Conv(4, (3, 3)), input_mean_norm=True),
                geoparam.GmPConv(4, (3, 3), input_mean_norm=True), geoparam.InputMeanNorm()):
    with pytest.raises(TypeError, match='floating inputs, got dtype uint8'):
      layer.init(jax.random.key(0), images, use_running_average=False)
  with pytest.raises(TypeError, match='int32'):
    geoparam.GmPDense(3, input_mean_norm=True).init(
        jax.random.key(0), jnp.ones((2, 3), jnp.int32), use_running_average=False)


def test_paper_form_field_checks():
  x = jnp.ones((2, 3))
  assert geoparam.GmPDense(np.int64(4)).init(jax.random.key(0), x)['params']['lam'].shape == (4,)
  with pytest.raises(ValueError, match='features'):
    geoparam.LCWDense(2.5).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="activation must be a function"):
    geoparam.GmPDense(4, activation='relu').init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r'scale must have shape \(4,\)'):
    geoparam.GmPDense(4, scale_init=lambda k, s, d: jnp.ones((3,), d)).init(
        jax.random.key(0), x)
  params = geoparam.GmPDense(4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='fan_in'):
    geoparam.GmPDense(4).apply(params, jnp.ones((2, 5)))


@pytest.mark.parametrize('fan_in', [1, 3])
def test_layer_initialization_is_the_layers_own_draw_exactly(fan_in):
  # At fan-in 1 the direction is the fixed `sign`: it must come from the draw too (it was
  # drawn at random, flipping units of the layer's function). Fixed draws of both signs.
  kernel = jnp.array([[0.5, -0.7, 1.2, -2.0, 0.3], [1.0, 2.0, -1.0, 0.1, 0.2],
                      [-0.3, 0.4, 0.5, -0.6, 0.7]])[:fan_in]
  dense = nn.Dense(5, kernel_init=lambda k, s, d=jnp.float32: kernel.astype(d),
                   bias_init=lambda k, s, d=jnp.float32: jnp.linspace(-1.0, 1.0, 5, dtype=d))
  x = jax.random.normal(jax.random.key(1), (6, fan_in))
  wrapped = geoparam.GmP(dense, initialization='layer')
  for seed in range(3):
    key = jax.random.key(seed)
    np.testing.assert_allclose(wrapped.apply(wrapped.init(key, x), x),
                               dense.apply(dense.init(key, x), x), rtol=1e-5, atol=1e-6)
