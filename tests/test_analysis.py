"""Tests for geoparam.analysis: boundaries, folding, angle changes, perturbations, tracking."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import geoparam
from geoparam import analysis
from geoparam import convert
from geoparam import hyperspherical
from experiments.lib import models


def _mlp_variables(method, fan_in, features, seed=0, x=None):
  """A one-hidden-layer MLP with non-trivial biases, gains and running statistics."""
  model = models.MLP(hidden=(features,), out=1, method=method, param_dtype=jnp.float64)
  x = jnp.ones((4, fan_in), jnp.float64) if x is None else x
  variables = model.init(jax.random.key(seed), x, train=False)
  rng = np.random.default_rng(seed)

  def jitter(path, v):
    names = [getattr(k, 'key', '') for k in path]
    if names[-1] in ('bias', 'lam'):
      return v + rng.normal(size=v.shape)
    if names[-1] in ('mean',):
      return v + rng.normal(size=v.shape)
    if names[-1] in ('var',):
      return v + rng.uniform(0.2, 3.0, size=v.shape)
    if names[-1].endswith('scale') and 'out' not in names:
      return v * rng.uniform(0.3, 2.0, size=v.shape) * rng.choice([-1.0, 1.0], size=v.shape)
    return v

  return model, jax.tree_util.tree_map_with_path(jitter, variables)


def _captured_preactivation(model, variables, method, probe):
  """Hidden pre-activations on `probe` in eval mode, read from the model's own modules."""
  _, state = model.apply(variables, probe, train=False, capture_intermediates=True,
                         mutable=['intermediates'])
  inter = state['intermediates']
  name = {'sp': 'hidden_0', 'wn': 'hidden_0_wn', 'wn_mbn': 'hidden_0_mbn', 'bn': 'hidden_0_bn'}
  return inter[name[method]]['__call__'][0]


# --- boundary_location -------------------------------------------------------------------


@pytest.mark.parametrize('fan_in', [1, 2, 5])
def test_sp_and_its_gmp_conversion_agree(x64, fan_in):
  rng = np.random.default_rng(fan_in)
  kernel = rng.normal(size=(fan_in, 7)) * rng.uniform(1e-3, 10, size=(1, 7))
  bias = rng.normal(size=(7,))
  sp = {'kernel': jnp.asarray(kernel), 'bias': jnp.asarray(bias)}
  gm = convert.dense_to_gmp(sp['kernel'], sp['bias'])
  phi_sp = analysis.boundary_location(sp, 'sp')
  phi_gmp = analysis.boundary_location(gm, 'gmp')
  assert phi_sp.shape == phi_gmp.shape == (7, fan_in)
  np.testing.assert_allclose(phi_gmp, phi_sp, rtol=1e-10, atol=1e-12)
  # Independent formula, eq. (8): phi = -b w / (w^T w).
  np.testing.assert_allclose(phi_sp, (-bias * kernel / np.sum(kernel ** 2, 0)).T, rtol=1e-12)
  np.testing.assert_allclose(analysis.boundary_distance(gm, 'gmp'),
                             bias / np.linalg.norm(kernel, axis=0), rtol=1e-10)


@pytest.mark.parametrize('method', ['sp', 'wn', 'wn_mbn', 'bn'])
@pytest.mark.parametrize('fan_in', [1, 3])
def test_points_on_the_boundary_zero_the_models_preactivation(x64, method, fan_in):
  model, variables = _mlp_variables(method, fan_in, 6, seed=fan_in)
  layer = models.layer_variables(variables, method, bn_epsilon=1e-3)
  phi = analysis.boundary_location(layer, method)
  u = analysis.boundary_direction(layer, method)
  assert phi.shape == u.shape == (6, fan_in)
  on = _captured_preactivation(model, variables, method, phi)  # row i is phi_i
  off_plus = _captured_preactivation(model, variables, method, phi + 0.5 * u)
  off_minus = _captured_preactivation(model, variables, method, phi - 0.5 * u)
  scale = 1 + np.max(np.abs(off_plus))
  for i in range(6):
    assert abs(float(on[i, i])) < 1e-9 * scale, (method, i, on[i, i])
    assert off_plus[i, i] > 0 > off_minus[i, i], (method, i)  # u points to the active side


@pytest.mark.parametrize('kind', ['gmp', 'gmp_imn'])
@pytest.mark.parametrize('fan_in', [1, 2, 4])
def test_points_on_the_boundary_zero_gmp_preactivation(x64, kind, fan_in):
  imn = kind == 'gmp_imn'
  layer_mod = geoparam.GmPDense(5, activation=None, input_mean_norm=imn, param_dtype=jnp.float64)
  x = jax.random.normal(jax.random.key(1), (8, fan_in), jnp.float64)
  variables = layer_mod.init(jax.random.key(fan_in), x, use_running_average=True)
  params = dict(variables['params'])
  params['lam'] = params['lam'] + jnp.linspace(-2, 3, 5)
  variables = {'params': params}
  layer = dict(params)
  if imn:
    mean = jnp.linspace(-1.0, 2.0, fan_in)
    variables['batch_stats'] = {'input_mean_norm': {'mean': mean}}
    layer['batch_stats'] = {'mean': mean}
  phi = analysis.boundary_location(layer, kind)
  u = analysis.boundary_direction(layer, kind)
  np.testing.assert_allclose(np.linalg.norm(u, axis=1), 1.0, rtol=1e-12)
  on = layer_mod.apply(variables, phi, use_running_average=True)
  plus = layer_mod.apply(variables, phi + 0.5 * u, use_running_average=True)
  for i in range(5):
    assert abs(float(on[i, i])) < 1e-10
    # scale * (u^T (phi + 0.5 u) + lam') = 0.5 * scale.
    np.testing.assert_allclose(plus[i, i], 0.5 * params['scale'][i], rtol=1e-10)


def test_one_dimensional_sign_convention(x64):
  sp = {'kernel': jnp.array([[2.0, -4.0, 0.5]]), 'bias': jnp.array([1.0, 1.0, -1.0])}
  np.testing.assert_allclose(analysis.boundary_location(sp, 'sp')[:, 0], [-0.5, 0.25, 2.0])
  np.testing.assert_array_equal(analysis.boundary_direction(sp, 'sp')[:, 0], [1.0, -1.0, 1.0])
  np.testing.assert_allclose(analysis.boundary_distance(sp, 'sp'), [0.5, 0.25, -2.0])
  gm = convert.dense_to_gmp(sp['kernel'], sp['bias'])
  np.testing.assert_allclose(analysis.boundary_location(gm, 'gmp'),
                             analysis.boundary_location(sp, 'sp'))
  flipped = dict(gm, sign=-gm['sign'])  # angle pi: the point moves to -phi
  np.testing.assert_allclose(analysis.boundary_location(flipped, 'gmp'),
                             -analysis.boundary_location(sp, 'sp'))


def test_bn_folding_matches_the_bn_layer_in_eval_mode(x64):
  model, variables = _mlp_variables('bn', 3, 6, seed=4)
  w, b = analysis.affine(models.layer_variables(variables, 'bn', bn_epsilon=1e-3), 'bn')
  x = jax.random.normal(jax.random.key(0), (20, 3), jnp.float64) * 3
  expected = _captured_preactivation(model, variables, 'bn', x)
  np.testing.assert_allclose(x @ w + b, expected, rtol=1e-12, atol=1e-12)
  # A wrong epsilon is visible: the test can fail.
  w5, b5 = analysis.affine(models.layer_variables(variables, 'bn', bn_epsilon=1e-5), 'bn')
  assert np.max(np.abs(x @ w5 + b5 - expected)) > 1e-6


def test_bn_batch_statistics_give_the_training_mode_function(x64):
  model, variables = _mlp_variables('bn', 2, 4, seed=2)
  x = jax.random.normal(jax.random.key(3), (16, 2), jnp.float64)
  stats = analysis.batch_statistics(x @ variables['params']['hidden_0']['kernel'])
  layer = models.layer_variables(variables, 'bn', bn_epsilon=1e-3, batch_stats=stats)
  w, b = analysis.affine(layer, 'bn')
  _, state = model.apply(variables, x, train=True, capture_intermediates=True,
                         mutable=['intermediates', 'batch_stats'])
  np.testing.assert_allclose(x @ w + b, state['intermediates']['hidden_0_bn']['__call__'][0],
                             rtol=1e-10, atol=1e-12)


# --- bad input ---------------------------------------------------------------------------


_ZERO_SP = {'kernel': jnp.array([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]),
            'bias': jnp.array([1.0, 1.0, -2.0])}  # units 0 and 2 have w = 0


@pytest.mark.parametrize('fn', ['boundary_distance', 'boundary_direction', 'boundary_location',
                                'snapshot'])
def test_zero_weights_raise_eagerly_naming_params_and_units(x64, fn):
  # Old code: boundary_distance gave +-inf, boundary_direction and snapshot the zero vector.
  with pytest.raises(ValueError, match=rf"{fn}\(kind='sp'\): units \[0, 2\] have a zero weight "
                                       r'vector \(w = 0\) in params'):
    getattr(analysis, fn)(_ZERO_SP, 'sp')
  wn = {'kernel': jnp.ones((2, 2)), 'scale': jnp.array([0.0, 1.0])}
  with pytest.raises(ValueError, match=rf"{fn}\(kind='wn'\): units \[0\] have a zero"):
    getattr(analysis, fn)(wn, 'wn')


def test_zero_weights_give_nan_traced(x64):
  # Old code: +-inf distances, zero directions and +inf locations under jit.
  distance = np.asarray(jax.jit(lambda p: analysis.boundary_distance(p, 'sp'))(_ZERO_SP))
  assert np.isnan(distance[[0, 2]]).all() and np.isclose(distance[1], 1 / np.sqrt(2))
  for fn in (analysis.boundary_direction, analysis.boundary_location):
    rows = np.asarray(jax.jit(lambda p: fn(p, 'sp'))(_ZERO_SP))
    assert np.isnan(rows[[0, 2]]).all() and np.isfinite(rows[1]).all()
  snap = jax.vmap(lambda p: analysis.snapshot(p, 'sp'))(jax.tree.map(lambda a: a[None], _ZERO_SP))
  for rows in map(np.asarray, snap):
    assert np.isnan(rows[0, [0, 2]]).all() and np.isfinite(rows[0, 1]).all()
  phi = analysis.boundary_location(dict(_ZERO_SP, kernel=jnp.ones((2, 3))), 'sp')
  nan_phi = phi.at[0].set(jnp.nan)  # a unit without a location did not move by a number
  moved = analysis.location_change(phi, nan_phi)
  assert np.isnan(moved[0]) and np.all(moved[1:] == 0)


def test_a_zero_direction_makes_no_angle(x64):
  # Old code: angle_change gave +inf for a zero row, eagerly too.
  u = jnp.array([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
  with pytest.raises(ValueError, match=r'angle_change: units \[0\] have a zero vector in before'):
    analysis.angle_change(u, jnp.ones((3, 2)))
  with pytest.raises(ValueError, match=r'angle_change: units \[0\] have a zero vector in after'):
    analysis.angle_change(jnp.ones((3, 2)), u)
  with pytest.raises(ValueError, match=r'max_angle_change: units \[0\] have a zero vector in '
                                       'directions'):
    analysis.max_angle_change(jnp.stack([jnp.ones((3, 2)), u]))
  change = jax.jit(analysis.angle_change)(u, u)
  assert np.isnan(change[0]) and np.all(change[1:] == 0)
  assert np.isnan(jax.jit(analysis.max_angle_change)(jnp.stack([u, u])))


def test_unknown_kind_lists_the_valid_ones():
  with pytest.raises(ValueError, match="valid kinds: sp, wn, wn_mbn, bn, gmp, gmp_imn"):
    analysis.boundary_location({'kernel': jnp.ones((2, 2))}, 'SPX')
  with pytest.raises(ValueError, match='missing'):
    analysis.boundary_location({'kernel': jnp.ones((2, 2))}, 'wn')
  with pytest.raises(ValueError, match='valid kinds'):
    analysis.perturb({}, 1e-3, 'lcwx')  # 'lcw' is a registry method now, read by its record


# --- angles, Theorem 3 -------------------------------------------------------------------


def test_angle_change_equals_the_arccos_formula(x64):
  rng = np.random.default_rng(0)
  a = rng.normal(size=(50, 4)) * rng.uniform(1e-4, 1e2, size=(50, 1))
  b = rng.normal(size=(50, 4))
  cos = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
  np.testing.assert_allclose(analysis.angle_change(a, b), np.arccos(cos), rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(analysis.angle_change(a, b, degrees=True),
                             np.degrees(np.arccos(cos)), rtol=1e-9)
  # Eq. (12)'s example: eps = -(1 + e) w flips the direction whatever the size of w.
  w = a * 1e-6
  np.testing.assert_allclose(analysis.angle_change(w, w - 1.001 * w), np.pi, rtol=1e-12)


@pytest.mark.parametrize('n', [2, 3, 10, 64])
def test_theorem_3_bound_holds_for_gmp_perturbations(x64, n):
  rng = np.random.default_rng(n)
  theta = jnp.asarray(rng.uniform(0, np.pi, size=(n - 1, 30)))
  params = {'theta': theta, 'lam': jnp.zeros(30), 'scale': jnp.ones(30)}
  for eps in (1e-4, 1e-2, 1e-1):
    after = analysis.perturb(params, eps, 'gmp')
    change = analysis.angle_change(analysis.boundary_direction(params, 'gmp'),
                                   analysis.boundary_direction(after, 'gmp'))
    bound = eps * np.sqrt(n - 1)  # |eps * 1|_2
    assert np.all(change <= bound * (1 + 1e-9)), (eps, np.max(change / bound))
    # To first order the change is the metric norm |eps|_M of eq. (21).
    metric = jax.vmap(hyperspherical.metric_diag, in_axes=1)(theta)
    first_order = eps * np.sqrt(np.sum(metric, axis=1))
    if eps <= 1e-4:
      np.testing.assert_allclose(change, first_order, rtol=1e-3)
  # Random (not constant) perturbations obey the bound too.
  noise = jnp.asarray(rng.normal(size=theta.shape) * 0.05)
  after = dict(params, theta=theta + noise)
  change = analysis.angle_change(analysis.boundary_direction(params, 'gmp'),
                                 analysis.boundary_direction(after, 'gmp'))
  assert np.all(change <= np.linalg.norm(noise, axis=0) * (1 + 1e-9))


def test_sp_has_no_such_bound_for_small_weights(x64):
  params = {'kernel': jnp.array([[1e-3], [-1e-3]]), 'bias': jnp.array([1e-3])}
  after = analysis.perturb(params, 1e-3, 'sp')
  change = analysis.angle_change(analysis.boundary_direction(params, 'sp'),
                                 analysis.boundary_direction(after, 'sp'))
  assert change[0] > 0.5  # radians, for a perturbation of norm 1.7e-3


def test_perturb_touches_only_trainable_entries(x64):
  gm = {'theta': jnp.zeros((0, 3)), 'lam': jnp.zeros(3), 'scale': jnp.ones(3),
        'sign': jnp.array([1.0, -1.0, 1.0])}
  out = analysis.perturb(gm, 0.1, 'gmp')
  np.testing.assert_array_equal(out['sign'], gm['sign'])
  np.testing.assert_allclose(out['lam'], 0.1)
  np.testing.assert_allclose(out['scale'], 1.1)
  bn = {'dense': {'kernel': jnp.ones((2, 3))}, 'bn': {'scale': jnp.ones(3), 'bias': jnp.zeros(3)},
        'batch_stats': {'mean': jnp.zeros(3), 'var': jnp.ones(3)}, 'epsilon': 1e-3}
  out = analysis.perturb(bn, 0.5, 'bn')
  np.testing.assert_allclose(out['dense']['kernel'], 1.5)
  np.testing.assert_allclose(out['bn']['scale'], 1.5)
  np.testing.assert_allclose(out['batch_stats']['var'], 1.0)
  np.testing.assert_allclose(bn['dense']['kernel'], 1.0)  # input not mutated
  assert out['epsilon'] == 1e-3
  wn = {'kernel': jnp.ones((2, 1)), 'scale': jnp.ones(1), 'bias': jnp.zeros(1)}
  np.testing.assert_allclose(analysis.perturb(wn, 1e-3, 'wn')['scale'], 1.001)


# --- tracking inside lax.scan --------------------------------------------------------------


def _tiny_problem():
  x = jax.random.normal(jax.random.key(0), (16, 2), jnp.float64)
  y = jnp.maximum(x @ jnp.array([[1.0], [-2.0]]) + 0.3, 0.0)
  model = models.MLP(hidden=(4,), out=1, method='gmp', param_dtype=jnp.float64)
  params = model.init(jax.random.key(1), x)['params']
  opt = optax.adam(0.05)

  def step(carry, _):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((model.apply({'params': p}, x) - y) ** 2))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step, (params, opt.init(params))


@pytest.mark.parametrize('every', [1, 3])
def test_tracking_inside_scan_equals_a_python_loop(x64, every):
  step, carry0 = _tiny_problem()
  layer = lambda c: c[0]['hidden_0']  # a GmP layer's params are its canonical dict
  run = jax.jit(lambda c: analysis.scan_tracked(step, c, length=12, layer=layer, kind='gmp',
                                                every=every))
  carry, losses, track = run(carry0)
  assert track.location.shape == (12 // every + 1, 4, 2)
  assert losses.shape == (12,)

  carry_ref, locs, dirs, losses_ref = carry0, [], [], []
  jstep = jax.jit(step)
  for t in range(12):
    if t % every == 0:
      snap = analysis.snapshot(layer(carry_ref), 'gmp')
      locs.append(snap.location)
      dirs.append(snap.direction)
    carry_ref, loss = jstep(carry_ref, None)
    losses_ref.append(loss)
  snap = analysis.snapshot(layer(carry_ref), 'gmp')
  locs.append(snap.location)
  dirs.append(snap.direction)
  np.testing.assert_allclose(track.location, np.stack(locs), rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(track.direction, np.stack(dirs), rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(losses, np.stack(losses_ref), rtol=1e-10)
  # Summaries against numpy.
  locs = np.stack(locs)
  expected = np.max(np.linalg.norm(np.diff(locs, axis=0), axis=2), axis=1)
  np.testing.assert_allclose(analysis.max_location_change(track.location), expected, rtol=1e-9)
  dirs = np.stack(dirs)
  cos = np.clip(np.sum(dirs[1:] * dirs[:-1], axis=2), -1, 1)
  np.testing.assert_allclose(analysis.max_angle_change(track.direction),
                             np.degrees(np.max(np.arccos(cos), axis=1)), rtol=1e-6, atol=1e-6)


def test_scan_tracked_checks_every():
  step = lambda c, x: (c, x)
  with pytest.raises(ValueError, match='divide'):
    analysis.scan_tracked(step, {'kernel': jnp.ones((1, 1))}, length=10, every=3,
                          layer=lambda c: c, kind='sp')


# --- bad input: shapes of the per-unit entries, names, static ints -------------------------


@pytest.mark.parametrize('fn', [analysis.boundary_location, analysis.boundary_direction,
                                analysis.boundary_distance, analysis.affine, analysis.snapshot])
@pytest.mark.parametrize('bias_shape', [(4,), (1,), (), (3, 1)])
def test_bias_of_the_wrong_length_names_both_shapes(fn, bias_shape):
  # Old code: (4,) failed deep inside a broadcast; (1,), () and (3, 1) broadcast silently.
  sp = {'kernel': jnp.ones((2, 3)), 'bias': jnp.ones(bias_shape)}
  match = (r"kind='sp': bias must have shape \(3,\) to match the kernel of shape \(2, 3\) .*"
           rf'got shape {re.escape(str(bias_shape))}')
  with pytest.raises(ValueError, match=match):
    fn(sp, 'sp')
  with pytest.raises(ValueError, match=match):  # shapes are static: raised under jit too
    jax.jit(lambda p: fn(p, 'sp'))(sp)


def _bn_layer(**changes):
  layer = {'dense': {'kernel': jnp.ones((2, 3)), 'bias': jnp.zeros(3)},
           'bn': {'scale': jnp.ones(3), 'bias': jnp.zeros(3)},
           'batch_stats': {'mean': jnp.zeros(3), 'var': jnp.ones(3)}}
  for path, value in changes.items():
    outer, inner = path.split('__')
    layer[outer] = dict(layer[outer], **{inner: value})
  return layer


@pytest.mark.parametrize('kind,params,match', [
    ('wn', {'kernel': jnp.ones((2, 3)), 'scale': jnp.ones(2)}, r'scale must have shape \(3,\)'),
    ('wn', {'kernel': jnp.ones((2, 3)), 'scale': jnp.ones(3), 'bias': jnp.ones(2)},
     r'bias must have shape \(3,\)'),
    ('wn_mbn', {'kernel': jnp.ones((2, 3)), 'scale': jnp.ones(3), 'mbn': {'bias': jnp.ones(1)},
                'batch_stats': {'mean': jnp.zeros(3)}}, r'mbn/bias must have shape \(3,\)'),
    ('wn_mbn', {'kernel': jnp.ones((2, 3)), 'scale': jnp.ones(3),
                'batch_stats': {'mean': jnp.zeros(2)}}, r'batch_stats/mean must have shape \(3,\)'),
    ('wn_mbn', {'kernel': jnp.ones((2, 3)), 'scale': jnp.ones(3), 'batch_stats': {}},
     r"missing \['mean'\]"),
    ('bn', _bn_layer(dense__bias=jnp.ones(4)), r'dense/bias must have shape \(3,\)'),
    ('bn', _bn_layer(bn__scale=jnp.ones(1)), r'bn/scale must have shape \(3,\)'),
    ('bn', _bn_layer(bn__bias=jnp.ones(2)), r'bn/bias must have shape \(3,\)'),
    ('bn', _bn_layer(batch_stats__var=jnp.ones(1)), r'batch_stats/var must have shape \(3,\)'),
    ('bn', _bn_layer(batch_stats__mean=jnp.ones(2)), r'batch_stats/mean must have shape \(3,\)'),
    ('gmp', {'theta': jnp.zeros((1, 3)), 'lam': jnp.zeros(1)},
     r"kind='gmp': lam must have shape \(3,\) to match theta of shape \(1, 3\)"),
    ('gmp', {'theta': jnp.zeros((0, 3)), 'lam': jnp.zeros(3), 'sign': jnp.ones(1)},
     r'sign must have shape \(3,\) to match theta of shape \(0, 3\)'),
    ('gmp_imn', {'theta': jnp.zeros((1, 3)), 'lam': jnp.zeros(3),
                 'batch_stats': {'mean': jnp.zeros(3)}},
     r'batch_stats/mean \(the running input mean\) must have shape \(2,\) to match fan_in = 2'),
])
def test_per_unit_entries_of_the_wrong_shape_raise(kind, params, match):
  # Old code: broadcast silently (length 1, e.g. one sign for all units) or failed in a dot.
  with pytest.raises(ValueError, match=match):
    analysis.boundary_location(params, kind)


def test_layer_variables_names_a_missing_sub_layer():
  variables = {'params': {'hidden_0': {'kernel': jnp.ones((2, 3))}}}
  # Old code: KeyError('hidden_0_wn') / KeyError('hidden_0_bn') / KeyError('params').
  with pytest.raises(ValueError, match=r"needs params\['hidden_0_wn'\]\['hidden_0/kernel/scale'\]"):
    models.layer_variables(variables, 'wn')
  with pytest.raises(ValueError, match=r"needs params\['hidden_0_bn'\], but params has no "
                                       r"'hidden_0_bn' \(has \['hidden_0'\]\)"):
    models.layer_variables(variables, 'bn')
  with pytest.raises(ValueError, match=r"needs variables\['params'\]"):
    models.layer_variables(variables['params'], 'sp')


def test_perturb_rejects_a_non_dict_layer():
  with pytest.raises(ValueError, match="kind='sp' expects a dict of layer variables, got list"):
    analysis.perturb([jnp.ones((2, 2))], 1e-3, 'sp')  # old code: AttributeError on .items()


@pytest.mark.parametrize('kwargs,name', [(dict(length=10, every=2.5), 'every'),
                                         (dict(length=10.0, every=2), 'length'),
                                         (dict(length=4, every=True), 'every')])
def test_scan_tracked_needs_integer_every_and_length(kwargs, name):
  # Old code ran every=2.5 (10 % 2.5 == 0) as 4 chunks of a length-2.5 inner scan.
  with pytest.raises(TypeError, match=f'{name} must be an int'):
    analysis.scan_tracked(lambda c, x: (c, x), {'kernel': jnp.ones((1, 1))}, layer=lambda c: c,
                          kind='sp', **kwargs)
  carry, _, track = analysis.scan_tracked(
      lambda c, x: (c, x), {'kernel': jnp.ones((1, 1))}, length=np.int64(4), every=np.int32(2),
      layer=lambda c: c, kind='sp')
  assert track.location.shape == (3, 1, 1)


def test_any_registered_method_is_read_through_its_record():
  """'lcw', 'cwn' (registry names outside KINDS) and a composed Method (WN with IMN) give the
  boundaries of their effective (w, b), checked against numpy."""
  from geoparam import methods
  rng = np.random.default_rng(5)
  w = rng.normal(size=(4, 3))
  w -= w.mean(0)  # zero-sum: LCW and CWN represent it exactly
  b = rng.normal(size=3)
  ref = -(b / np.sum(w * w, axis=0))[:, None] * w.T
  for name in ('lcw', 'cwn'):
    params = methods.get(name).convert(w, b, np.float32, True)
    np.testing.assert_allclose(analysis.boundary_location(params, name), ref, rtol=2e-5,
                               atol=1e-6)
    moved = analysis.perturb(params, 0.1, name)
    assert set(moved) == set(params) and all(
        np.allclose(moved[k], np.asarray(params[k]) + 0.1) for k in params)
  wn_imn = methods.with_imn(methods.get('wn', epsilon=0.0))
  mean = rng.normal(size=4)
  params = dict(wn_imn.convert(w, b, np.float32, True), batch_stats={'mean': mean})
  b_imn = b - mean @ w
  np.testing.assert_allclose(analysis.boundary_location(params, wn_imn),
                             -(b_imn / np.sum(w * w, axis=0))[:, None] * w.T, rtol=2e-5,
                             atol=1e-6)
  with pytest.raises(ValueError, match='not those the method stores'):
    analysis.boundary_location({'v': np.ones((3, 2)), 'extra': np.ones(2)}, 'lcw')
  with pytest.raises(ValueError, match='REGISTRY'):
    analysis.boundary_location(params, 'nope')


def test_perturb_rejects_non_finite_and_non_numeric_eps():
  # A NaN eps used to return all-NaN params.
  params = {'kernel': jnp.ones((2, 1)), 'bias': jnp.zeros(1)}
  for eps in [np.nan, np.inf, -np.inf, jnp.asarray([1e-3, np.nan])]:
    with pytest.raises(ValueError, match='perturb: eps must be finite.*got eps = '):
      analysis.perturb(params, eps, 'sp')
  for eps in ['1e-3', None, True]:
    with pytest.raises(TypeError, match='perturb: eps must be a real number'):
      analysis.perturb(params, eps, 'sp')
  np.testing.assert_allclose(analysis.perturb(params, -0.5, 'sp')['kernel'], 0.5)  # negative: fine
  traced = jax.jit(lambda e: analysis.perturb(params, e, 'sp')['bias'])(1e-3)
  np.testing.assert_allclose(traced, 1e-3)
