"""per_epoch_decay (LCW paper's x0.95 down to a floor) and hand-computed plateau/stop traces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from geoparam import schedules


def _run(sched, init_args, metrics):
  state = sched.init(*init_args)
  update = jax.jit(sched.update)
  out = []
  for m in metrics:
    state = update(state, jnp.float32(m))
    out.append(state)
  return out


def test_per_epoch_decay_trace_to_floor():
  sched = schedules.per_epoch_decay(factor=0.5, min_lr=0.02)
  lrs = [float(s.lr) for s in _run(sched, (0.1,), [0.0] * 5)]
  np.testing.assert_allclose(lrs, [0.05, 0.025, 0.02, 0.02, 0.02], rtol=1e-6)


def test_per_epoch_decay_lcw_rule():
  sched = schedules.per_epoch_decay()  # x0.95 down to 1e-3
  state = sched.init(0.1)
  for e in range(1, 120):
    state = sched.update(state)
    np.testing.assert_allclose(float(state.lr), max(0.1 * 0.95**e, 1e-3), rtol=1e-5)
  assert int(state.epoch) == 119
  assert float(state.lr) == pytest.approx(1e-3)  # 0.1 * 0.95**90 < 1e-3


def test_per_epoch_decay_below_floor_and_errors():
  state = schedules.per_epoch_decay(0.5, min_lr=0.1).update(
      schedules.per_epoch_decay(0.5, 0.1).init(0.01))
  assert float(state.lr) == pytest.approx(0.01)  # never raised to the floor
  with pytest.raises(ValueError, match='factor'):
    schedules.per_epoch_decay(factor=0.0)
  with pytest.raises(ValueError, match='min_lr'):
    schedules.per_epoch_decay(min_lr=-1.0)


def test_plateau_trace_max_mode_with_min_delta_and_cooldown():
  # Keras semantics by hand: factor 0.1, patience 2, min_delta 0.05, cooldown 1, mode max.
  sched = schedules.reduce_on_plateau(factor=0.1, patience=2, mode='max', min_delta=0.05,
                                      cooldown=1, min_lr=1e-3)
  metrics = [0.5, 0.52, 0.54, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.7]
  # epoch: best / wait / lr
  # 0: 0.5 improves (best -inf) -> best .5, wait 0
  # 1: .52 not > .55 -> wait 1;   2: .54 -> wait 2 >= 2 -> lr .01, wait 0, cooldown 1
  # 3: .6 > .55 improves -> best .6, cooldown 1->0, wait 0
  # 4: .6 -> wait 1; 5: -> wait 2 -> lr .001 (cooldown 1); 6: cooldown 1->0, wait 0 -> +1 = 1
  # 7: wait 2 -> would reduce, but lr == min_lr: stays .001; 8: wait 3; 9: .7 improves.
  states = _run(sched, (0.1,), metrics)
  np.testing.assert_allclose([float(s.lr) for s in states],
                             [.1, .1, .01, .01, .01, .001, .001, .001, .001, .001], rtol=1e-6)
  assert [int(s.wait) for s in states][:7] == [0, 1, 0, 0, 1, 0, 1]
  np.testing.assert_allclose(float(states[-1].best), 0.7, rtol=1e-6)


def test_early_stopping_trace_min_mode():
  sched = schedules.early_stopping(patience=2, mode='min', min_delta=0.1)
  metrics = [1.0, 0.95, 0.8, 0.85, 0.75, 0.9, 0.2]
  states = _run(sched, (), metrics)
  # 0 improves (best 1.0); 1: .95 not < .9 -> wait 1; 2: .8 < .9 -> best .8; 3: wait 1;
  # 4: .75 not < .7 -> wait 2 -> stop (sticky; 6 would improve but stop holds).
  assert [bool(s.stop) for s in states] == [False, False, False, False, True, True, True]
  assert [bool(s.improved) for s in states] == [True, False, True, False, False, False, False]
  assert int(states[-1].best_epoch) == 2
