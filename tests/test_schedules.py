"""Tests for geoparam.schedules against plain-Python reimplementations of Keras' callbacks."""

import functools
import math

import jax
import jax.numpy as jnp
from hypothesis import given, settings, strategies as st
import numpy as np
import optax
import pytest

from geoparam import schedules


# --- references (Keras semantics, written from the callbacks' documented behaviour) ----------


class KerasReduceLROnPlateau:
  """keras.callbacks.ReduceLROnPlateau.on_epoch_end, one metric per call."""

  def __init__(self, lr, factor, patience, mode, min_delta, cooldown, min_lr):
    self.lr = np.float32(lr)  # the optimizer variable is float32
    self.factor, self.patience, self.cooldown, self.min_lr = factor, patience, cooldown, min_lr
    if mode == 'min':
      self.monitor_op = lambda a, b: np.less(a, b - min_delta)
      self.best = np.inf
    else:
      self.monitor_op = lambda a, b: np.greater(a, b + min_delta)
      self.best = -np.inf
    self.wait = 0
    self.cooldown_counter = 0

  def in_cooldown(self):
    return self.cooldown_counter > 0

  def on_epoch_end(self, current):
    if self.in_cooldown():
      self.cooldown_counter -= 1
      self.wait = 0
    if self.monitor_op(current, self.best):
      self.best = current
      self.wait = 0
    elif not self.in_cooldown():
      self.wait += 1
      if self.wait >= self.patience:
        old_lr = float(self.lr)
        if old_lr > np.float32(self.min_lr):
          new_lr = max(old_lr * self.factor, self.min_lr)
          self.lr = np.float32(new_lr)
          self.cooldown_counter = self.cooldown
          self.wait = 0


class KerasEarlyStopping:
  """keras.callbacks.EarlyStopping.on_epoch_end (no baseline, start_from_epoch=0)."""

  def __init__(self, patience, mode, min_delta):
    self.patience = patience
    self.monitor_op = np.less if mode == 'min' else np.greater
    self.min_delta = abs(min_delta) * (-1 if mode == 'min' else 1)
    self.best = np.inf if mode == 'min' else -np.inf
    self.best_epoch = None
    self.wait = 0
    self.stop_training = False
    self.improved = False

  def on_epoch_end(self, epoch, current):
    self.improved = False
    self.wait += 1  # incremented before the improvement check
    if self.monitor_op(current - self.min_delta, self.best):
      self.best = current
      self.best_epoch = epoch
      self.wait = 0
      self.improved = True
      return
    if self.wait >= self.patience and epoch > 0:
      self.stop_training = True


# --- library runners: jit per step and lax.scan, built once per hyperparameter set ------------


@functools.lru_cache(maxsize=None)
def _plateau_runners(factor, patience, mode, min_delta, cooldown, min_lr):
  sched = schedules.reduce_on_plateau(factor=factor, patience=patience, mode=mode,
                                      min_delta=min_delta, cooldown=cooldown, min_lr=min_lr)

  @jax.jit
  def scan(metrics):
    def body(state, metric):
      state = sched.update(state, metric)
      return state, state
    return jax.lax.scan(body, sched.init(1.0), metrics)[1]

  return sched, jax.jit(sched.update), scan


@functools.lru_cache(maxsize=None)
def _early_runners(patience, mode, min_delta):
  sched = schedules.early_stopping(patience=patience, mode=mode, min_delta=min_delta)

  @jax.jit
  def scan(metrics):
    def body(state, metric):
      state = sched.update(state, metric)
      return state, state
    return jax.lax.scan(body, sched.init(), metrics)[1]

  return sched, jax.jit(sched.update), scan


# Metrics are multiples of 1/4 (exact in float32) with min_delta in {0, 0.1, 0.25, 0.6}, so no
# comparison is decided by float32-vs-float64 rounding (0.25 gives exact ties, which must NOT
# count as improvements). Sequences: random levels (long plateaus), random walks (trends), NaN.
LENGTH = 30
_levels = st.lists(st.sampled_from([i / 4 for i in range(-6, 7)] + [math.nan]),
                   min_size=LENGTH, max_size=LENGTH)
_walks = st.lists(st.integers(-2, 2), min_size=LENGTH, max_size=LENGTH).map(
    lambda steps: list(np.cumsum(steps) / 4))
METRICS = st.one_of(_levels, _walks)

PLATEAU_CONFIGS = [
    # factor, patience, mode, min_delta, cooldown, min_lr
    (0.1, 0, 'min', 0.0, 0, 0.0),
    (0.5, 2, 'min', 0.1, 1, 0.3),
    (0.25, 3, 'max', 0.25, 3, 0.003),
    (0.5, 1, 'max', 0.0, 2, 0.003),
    (0.1, 4, 'min', 0.6, 0, 0.0),
    (0.1, 5, 'max', 0.0, 0, 0.0),
]


def _plateau_reference(config, metrics):
  factor, patience, mode, min_delta, cooldown, min_lr = config
  ref = KerasReduceLROnPlateau(1.0, factor, patience, mode, min_delta, cooldown, min_lr)
  trace = []
  for m in metrics:
    ref.on_epoch_end(np.float32(m))
    trace.append((float(ref.lr), float(ref.best), ref.wait, ref.cooldown_counter))
  return trace


@pytest.mark.parametrize('config', PLATEAU_CONFIGS)
@settings(max_examples=25, deadline=None)
@given(metrics=METRICS)
def test_reduce_on_plateau_matches_keras(config, metrics):
  sched, update, scan = _plateau_runners(*config)
  expected = _plateau_reference(config, metrics)
  # Inside lax.scan (jitted).
  states = scan(jnp.asarray(metrics, jnp.float32))
  for t, (lr, best, wait, cooldown_counter) in enumerate(expected):
    np.testing.assert_allclose(float(states.lr[t]), lr, rtol=1e-6, err_msg=f'step {t}')
    assert float(states.best[t]) == best, t
    assert int(states.wait[t]) == wait, t
    assert int(states.cooldown_counter[t]) == cooldown_counter, t
  # Under jax.jit, one epoch at a time.
  state = sched.init(1.0)
  for t, m in enumerate(metrics):
    state = update(state, m)
    assert state.lr.dtype == jnp.float32
    np.testing.assert_allclose(float(state.lr), expected[t][0], rtol=1e-6)
    np.testing.assert_allclose(float(state.lr), expected[t][0], rtol=1e-6)
    assert (int(state.wait), int(state.cooldown_counter)) == expected[t][2:]


EARLY_CONFIGS = [(0, 'min', 0.0), (1, 'max', 0.1), (2, 'min', 0.25), (3, 'max', 0.0),
                 (5, 'min', 0.6)]


@pytest.mark.parametrize('config', EARLY_CONFIGS)
@settings(max_examples=25, deadline=None)
@given(metrics=METRICS)
def test_early_stopping_matches_keras(config, metrics):
  sched, update, scan = _early_runners(*config)
  ref = KerasEarlyStopping(*config)
  states = scan(jnp.asarray(metrics, jnp.float32))
  state = sched.init()
  for t, m in enumerate(metrics):
    state = update(state, m)
    scanned = jax.tree.map(lambda v: v[t], states)
    if ref.stop_training:
      # Keras ended training at the previous epoch; the state machine keeps saying stop.
      assert bool(state.stop) and bool(scanned.stop), t
      continue
    ref.on_epoch_end(t, np.float32(m))
    for s in [state, scanned]:
      assert int(s.epoch) == t + 1
      assert float(s.best) == float(ref.best), t
      assert int(s.wait) == ref.wait, t
      assert bool(s.improved) == ref.improved, t
      assert int(s.best_epoch) == (-1 if ref.best_epoch is None else ref.best_epoch), t
      assert bool(s.stop) == ref.stop_training, t


def test_early_stopping_never_stops_at_epoch_zero():
  sched = schedules.early_stopping(patience=0)
  state = sched.update(sched.init(), jnp.nan)  # no improvement, wait 1 >= patience 0, epoch 0
  assert not bool(state.stop)
  state = sched.update(state, jnp.nan)
  assert bool(state.stop)


def test_plateau_reduces_after_patience_and_respects_min_lr():
  # A hand-checkable run: constant metric, patience 2, cooldown 1, factor 0.5, min_lr 0.3.
  sched = schedules.reduce_on_plateau(factor=0.5, patience=2, cooldown=1, min_lr=0.3)
  state = sched.init(1.0)
  lrs = []
  for _ in range(10):
    state = sched.update(state, 1.0)
    lrs.append(float(state.lr))
  # Epoch 1 improves (from inf); 2-3 wait, reduce at 3; 4 is the cooldown epoch (its counter
  # reaches 0 first, so it already counts: wait 1); 5 waits 2 and reduces to max(0.25, min_lr).
  np.testing.assert_allclose(lrs, [1, 1, 0.5, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3], rtol=1e-6)


def test_vmaps_over_runs():
  sched = schedules.reduce_on_plateau(factor=0.5, patience=1)
  metrics = jnp.asarray([[3.0, 2.0, 1.0], [3.0, 3.0, 3.0]])
  states = jax.vmap(lambda ms: jax.lax.scan(
      lambda s, m: (sched.update(s, m), None), sched.init(1.0), ms)[0])(metrics)
  np.testing.assert_allclose(states.lr, [1.0, 0.25], rtol=1e-6)


@pytest.mark.parametrize('kwargs', [
    dict(factor=0.0), dict(factor=1.0), dict(factor=1.5), dict(factor=-0.1),
    dict(patience=-1), dict(cooldown=-1), dict(min_delta=-1e-3), dict(min_lr=-1.0),
    dict(mode='auto'), dict(mode='MIN'),
])
def test_reduce_on_plateau_bad_hyperparameters(kwargs):
  with pytest.raises(ValueError):
    schedules.reduce_on_plateau(**kwargs)


@pytest.mark.parametrize('kwargs', [dict(patience=-1), dict(min_delta=-0.5), dict(mode='auto')])
def test_early_stopping_bad_hyperparameters(kwargs):
  with pytest.raises(ValueError):
    schedules.early_stopping(**kwargs)


# --- helpers ----------------------------------------------------------------------------------


def test_keep_best_and_set_learning_rate():
  best = {'w': jnp.zeros(3)}
  current = {'w': jnp.ones(3)}
  np.testing.assert_array_equal(schedules.keep_best(jnp.asarray(True), best, current)['w'], 1.0)
  np.testing.assert_array_equal(schedules.keep_best(jnp.asarray(False), best, current)['w'], 0.0)

  opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  params = {'w': jnp.ones(2)}
  opt_state = schedules.set_learning_rate(opt.init(params), 0.5)
  updates, _ = jax.jit(opt.update)({'w': jnp.ones(2)}, opt_state)
  np.testing.assert_allclose(updates['w'], -0.5, rtol=1e-6)
  with pytest.raises(ValueError):
    schedules.set_learning_rate(optax.sgd(0.1).init(params), 0.5)


def test_per_epoch_decay():
  sched = schedules.per_epoch_decay(factor=0.5, min_lr=0.1)
  state = sched.init(1.0)
  lrs = []
  for _ in range(6):
    state = sched.update(state, None)
    lrs.append(float(state.lr))
  np.testing.assert_allclose(lrs, [max(0.5 ** e, 0.1) for e in range(1, 7)], rtol=1e-6)
  with pytest.raises(ValueError):
    schedules.per_epoch_decay(factor=0.0)


# --- bad input: types, non-finite values, shapes ----------------------------------------------


@pytest.mark.parametrize('make,kwargs', [
    (schedules.early_stopping, dict(patience='5')),
    (schedules.early_stopping, dict(patience=2.5)),
    (schedules.early_stopping, dict(patience=3.0)),
    (schedules.early_stopping, dict(patience=True)),
    (schedules.reduce_on_plateau, dict(patience=2.5)),
    (schedules.reduce_on_plateau, dict(patience=np.float64(2))),
    (schedules.reduce_on_plateau, dict(patience=[3])),
    (schedules.reduce_on_plateau, dict(cooldown=1.5)),
    (schedules.reduce_on_plateau, dict(cooldown=False)),
])
def test_epoch_counts_must_be_ints(make, kwargs):
  # Old code: patience=2.5 acted as 3, '5' gave "'<' not supported between 'str' and 'int'".
  (name,) = kwargs
  with pytest.raises(TypeError, match=f'{name} must be an int >= 0 .*not bool, float or str'):
    make(**kwargs)


def test_epoch_counts_accept_numpy_integers_and_bound_int32():
  metrics = [3.0, 3.0, 3.0, 3.0]
  lrs = {}
  for patience in (2, np.int64(2), np.int32(2)):
    sched = schedules.reduce_on_plateau(factor=0.5, patience=patience, cooldown=np.int8(1))
    state = sched.init(1.0)
    for m in metrics:
      state = sched.update(state, m)
    lrs[type(patience).__name__] = float(state.lr)
  assert set(lrs.values()) == {0.5}, lrs
  with pytest.raises(ValueError, match=r'patience must be an integer in \[0, 2147483647\]'):
    schedules.early_stopping(patience=2**31)  # old code: OverflowError at the first update


@pytest.mark.parametrize('make,kwargs,match', [
    (schedules.reduce_on_plateau, dict(min_delta=math.nan), 'min_delta must be a finite'),
    (schedules.reduce_on_plateau, dict(min_delta=math.inf), 'min_delta must be a finite'),
    (schedules.reduce_on_plateau, dict(min_lr=math.nan), 'min_lr must be a finite'),
    (schedules.reduce_on_plateau, dict(factor=math.nan), 'factor must be a finite'),
    (schedules.early_stopping, dict(min_delta=math.nan), 'min_delta must be a finite'),
    (schedules.per_epoch_decay, dict(min_lr=math.nan), 'min_lr must be a finite'),
])
def test_real_hyperparameters_must_be_finite(make, kwargs, match):
  # Old code accepted NaN min_delta / min_lr (nan < 0 is False): nothing ever improved, or the
  # rate became NaN.
  with pytest.raises(ValueError, match=match):
    make(**kwargs)


@pytest.mark.parametrize('make,kwargs', [
    (schedules.reduce_on_plateau, dict(factor='0.5')),
    (schedules.reduce_on_plateau, dict(min_delta=True)),
    (schedules.per_epoch_decay, dict(factor=None)),
])
def test_real_hyperparameters_must_be_numbers(make, kwargs):
  (name,) = kwargs
  with pytest.raises(TypeError, match=f'{name} must be a real number'):
    make(**kwargs)


@pytest.mark.parametrize('lr,error,match', [
    (0.0, ValueError, 'lr must be a finite learning rate > 0, got lr = 0.0'),
    (-0.1, ValueError, 'lr must be a finite learning rate > 0'),
    (math.nan, ValueError, 'lr must be a finite learning rate > 0'),
    (math.inf, ValueError, 'lr must be a finite learning rate > 0'),
    (np.ones(2, np.float32), ValueError, r'lr must be a scalar learning rate \(shape \(\)\), got '
                                         r'shape \(2,\)'),
    ('0.1', TypeError, 'lr must be a real number > 0'),
])
def test_init_rejects_bad_learning_rates(lr, error, match):
  for sched in (schedules.reduce_on_plateau(), schedules.per_epoch_decay()):
    with pytest.raises(error, match=match):
      sched.init(lr)


def test_init_accepts_traced_learning_rates():
  sched = schedules.reduce_on_plateau(factor=0.5, patience=0)
  states = jax.jit(jax.vmap(sched.init))(jnp.asarray([0.1, 0.2]))
  np.testing.assert_allclose(states.lr, [0.1, 0.2], rtol=1e-6)


@pytest.mark.parametrize('make,init_args', [(schedules.reduce_on_plateau, (1.0,)),
                                            (schedules.early_stopping, ())])
def test_update_rejects_a_non_scalar_metric(make, init_args):
  # Old code broadcast the scalar state against the metric: a state of shape (3,) came back.
  sched = make(patience=1)
  state = sched.init(*init_args)
  match = r'metric must be one value per epoch .*\(\(\); a scalar.*got metric of shape \(3,\)'
  with pytest.raises(ValueError, match=match):
    sched.update(state, jnp.ones(3))
  with pytest.raises(ValueError, match=match):  # shapes are static: the check works under jit
    jax.jit(sched.update)(state, jnp.ones(3))
  with pytest.raises(ValueError, match=r'got metric of shape \(1,\)'):
    sched.update(state, np.ones(1, np.float32))
  # Under vmap each member's metric is a scalar inside: still fine.
  states = jax.vmap(lambda _: sched.init(*init_args))(jnp.arange(3))
  out = jax.jit(jax.vmap(sched.update))(states, jnp.asarray([1.0, 2.0, 3.0]))
  np.testing.assert_array_equal(out.best, [1.0, 2.0, 3.0])


@pytest.mark.parametrize('make,init_args', [(schedules.reduce_on_plateau, (1.0,)),
                                            (schedules.early_stopping, ())])
def test_update_rejects_a_non_numeric_metric(make, init_args):
  # jnp.asarray('1.0', float32) is 1.0: a str metric used to be read silently.
  sched = make(patience=1)
  state = sched.init(*init_args)
  for metric, kind in [('1.0', 'str'), (None, 'NoneType'), (True, 'bool'), (b'1', 'bytes'),
                       (np.asarray(1 + 2j), 'ndarray'), ({'acc': 1.0}, 'dict')]:
    with pytest.raises(TypeError, match=f'metric must be a real number .*of type {kind}'):
      sched.update(state, metric)
  with pytest.raises(TypeError, match=r"got '1.0' of type str"):
    sched.update(state, '1.0')
  with pytest.raises(TypeError, match='dtype bool'):  # a traced bool: dtypes are static
    jax.jit(sched.update)(state, jnp.asarray(True))
  # Numbers of every kind, and arrays under jit, still work.
  for metric in [1, 1.0, np.float64(1.0), np.int32(1), jnp.asarray(1.0, jnp.bfloat16)]:
    assert float(sched.update(state, metric).best) == 1.0
  assert float(jax.jit(sched.update)(state, jnp.asarray(2.0)).best) == 2.0
