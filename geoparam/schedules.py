"""Plateau learning-rate decay and early stopping as pure, jit-able state machines.

Semantics follow Keras' `ReduceLROnPlateau` and `EarlyStopping` callbacks (the
papers' reference code uses them), driven by one metric per epoch:

  plateau = reduce_on_plateau(factor=0.1, patience=5, mode='max')
  state = plateau.init(0.1)
  state = plateau.update(state, val_accuracy)   # state.lr is the new rate

Both are `(init, update)` pairs of pure functions over NamedTuple states of
scalar arrays, so they run inside `jax.lax.scan`, vmap over runs and go into
checkpoints. Feed `state.lr` to an optimizer built with
`optax.inject_hyperparams` (see `set_learning_rate`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
  'PlateauState',
  'EarlyStoppingState',
  'reduce_on_plateau',
  'early_stopping',
  'DecayState',
  'per_epoch_decay',
  'keep_best',
  'set_learning_rate',
]

_MODES = ('min', 'max')


class PlateauState(NamedTuple):
  lr: jax.Array  # () float32, current learning rate
  best: jax.Array  # () float32, best metric seen
  wait: jax.Array  # () int32, epochs since the last improvement
  cooldown_counter: jax.Array  # () int32

  @property
  def scale(self) -> jax.Array:
    """The current rate (a scale of the base rate when `init(1.0)`); same as `lr`."""
    return self.lr


class EarlyStoppingState(NamedTuple):
  best: jax.Array  # () float32, best metric seen
  wait: jax.Array  # () int32
  epoch: jax.Array  # () int32, number of updates seen
  best_epoch: jax.Array  # () int32, epoch index of the best metric (-1 before any)
  improved: jax.Array  # () bool, whether the LAST update improved (save weights then)
  stop: jax.Array  # () bool, training should stop (sticky)

  @property
  def should_stop(self) -> jax.Array:
    """Whether training should stop; same as `stop`."""
    return self.stop


class Schedule(NamedTuple):
  init: Callable[..., Any]
  update: Callable[..., Any]


def _check_mode(mode):
  if mode not in _MODES:
    raise ValueError(f'mode must be one of {_MODES}, got {mode!r}.')


def _improved(current, best, mode, min_delta):
  if mode == 'min':
    return current < best - min_delta
  return current > best + min_delta


def _worst(mode):
  return jnp.asarray(jnp.inf if mode == 'min' else -jnp.inf, jnp.float32)


def reduce_on_plateau(
    factor: float = 0.1,
    patience: int = 10,
    mode: str = 'min',
    min_delta: float = 1e-4,
    cooldown: int = 0,
    min_lr: float = 0.0,
) -> Schedule:
  """Keras `ReduceLROnPlateau`: multiply the rate by `factor` after `patience` bad epochs.

  An epoch improves when the metric beats the best by more than `min_delta`
  (below for `mode='min'`, above for `'max'`). After `patience` epochs without
  improvement the rate becomes `max(lr * factor, min_lr)` and `cooldown` epochs
  follow in which bad epochs are not counted. A NaN metric never improves.
  """
  _check_mode(mode)
  if not 0.0 < factor < 1.0:
    raise ValueError(f'factor must be in the range (0, 1), got factor = {factor}.')
  if patience < 0 or cooldown < 0 or min_delta < 0 or min_lr < 0:
    raise ValueError(
        f'patience, cooldown, min_delta and min_lr must be >= 0, got {patience}, {cooldown}, '
        f'{min_delta}, {min_lr}.')

  def init(lr) -> PlateauState:
    return PlateauState(
        lr=jnp.asarray(lr, jnp.float32), best=_worst(mode),
        wait=jnp.zeros((), jnp.int32), cooldown_counter=jnp.zeros((), jnp.int32))

  def update(state: PlateauState, metric) -> PlateauState:
    metric = jnp.asarray(metric, jnp.float32)
    in_cooldown = state.cooldown_counter > 0
    cooldown_counter = jnp.where(in_cooldown, state.cooldown_counter - 1, state.cooldown_counter)
    wait = jnp.where(in_cooldown, 0, state.wait)
    better = _improved(metric, state.best, mode, min_delta)
    still_cooling = cooldown_counter > 0
    wait = jnp.where(better, 0, jnp.where(still_cooling, wait, wait + 1))
    reduce = (~better) & (~still_cooling) & (wait >= patience) & (state.lr > min_lr)
    lr = jnp.where(reduce, jnp.maximum(state.lr * factor, min_lr), state.lr)
    return PlateauState(
        lr=lr,
        best=jnp.where(better, metric, state.best),
        wait=jnp.where(reduce, 0, wait).astype(jnp.int32),
        cooldown_counter=jnp.where(reduce, cooldown, cooldown_counter).astype(jnp.int32))

  return Schedule(init, update)


def early_stopping(patience: int = 10, mode: str = 'min', min_delta: float = 0.0) -> Schedule:
  """Keras `EarlyStopping`: stop after `patience` epochs without improvement.

  `state.improved` tells the caller to keep the current weights as the best
  (see `keep_best`); restoring them at the end gives `restore_best_weights`.
  `state.stop` is sticky once set. A NaN metric never improves.
  """
  _check_mode(mode)
  if patience < 0 or min_delta < 0:
    raise ValueError(f'patience and min_delta must be >= 0, got {patience}, {min_delta}.')

  def init() -> EarlyStoppingState:
    zero = jnp.zeros((), jnp.int32)
    return EarlyStoppingState(
        best=_worst(mode), wait=zero, epoch=zero, best_epoch=zero - 1,
        improved=jnp.zeros((), bool), stop=jnp.zeros((), bool))

  def update(state: EarlyStoppingState, metric) -> EarlyStoppingState:
    metric = jnp.asarray(metric, jnp.float32)
    better = _improved(metric, state.best, mode, min_delta) & ~state.stop
    wait = jnp.where(better, 0, state.wait + 1)
    stop = state.stop | ((~better) & (wait >= patience) & (state.epoch > 0))
    return EarlyStoppingState(
        best=jnp.where(better, metric, state.best),
        wait=wait.astype(jnp.int32),
        epoch=state.epoch + 1,
        best_epoch=jnp.where(better, state.epoch, state.best_epoch),
        improved=better,
        stop=stop)

  return Schedule(init, update)


class DecayState(NamedTuple):
  lr: jax.Array  # () float32, current learning rate
  epoch: jax.Array  # () int32, number of updates seen

  @property
  def scale(self) -> jax.Array:
    """The current rate (a scale of the base rate when `init(1.0)`); same as `lr`."""
    return self.lr


def per_epoch_decay(factor: float = 0.95, min_lr: float = 1e-3) -> Schedule:
  """Multiply the rate by `factor` after every epoch, never going below `min_lr`.

  The LCW paper's rule (003, Sec. 5): lr 0.1, x0.95 per epoch down to 0.001.
  `update(state, metric=None)` ignores the metric (it has the same signature
  as `reduce_on_plateau`'s so the two are interchangeable in a training loop).
  After `e` updates the rate is `max(lr0 * factor**e, min_lr)`; an initial
  rate below `min_lr` is left as it is.
  """
  if not 0.0 < factor <= 1.0:
    raise ValueError(f'factor must be in the range (0, 1], got factor = {factor}.')
  if min_lr < 0:
    raise ValueError(f'min_lr must be >= 0, got {min_lr}.')

  def init(lr) -> DecayState:
    return DecayState(lr=jnp.asarray(lr, jnp.float32), epoch=jnp.zeros((), jnp.int32))

  def update(state: DecayState, metric=None) -> DecayState:
    del metric
    decayed = jnp.maximum(state.lr * jnp.float32(factor), jnp.float32(min_lr))
    return DecayState(lr=jnp.minimum(state.lr, decayed), epoch=state.epoch + 1)

  return Schedule(init, update)


def keep_best(improved, best_tree, current_tree):
  """Returns `current_tree` where `improved` else `best_tree` (leafwise, jit-able)."""
  return jax.tree.map(lambda b, c: jnp.where(improved, c, b), best_tree, current_tree)


def set_learning_rate(opt_state, lr):
  """Sets the rate of an optimizer state made by `optax.inject_hyperparams`."""
  hyperparams = getattr(opt_state, 'hyperparams', None)
  if hyperparams is None or 'learning_rate' not in hyperparams:
    raise ValueError(
        'set_learning_rate needs an optimizer built with optax.inject_hyperparams(...)'
        '(learning_rate=...); this state has no hyperparams["learning_rate"].')
  hyperparams = dict(hyperparams)
  hyperparams['learning_rate'] = jnp.asarray(lr, jnp.asarray(hyperparams['learning_rate']).dtype)
  return opt_state._replace(hyperparams=hyperparams)
