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

The factories check their hyperparameters eagerly: epoch counts (`patience`,
`cooldown`) must be Python or NumPy integers >= 0 (a bool, float or str raises
`TypeError`), the real ones finite and in range (`ValueError`). `init` checks
a concrete rate (finite, > 0) and `update` the metric: a real number (a str,
None, bool or complex metric is a `TypeError`) of one value per epoch (dtypes
and shapes are static, so this holds under `jit` too).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from geoparam import checks

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
  """The state of `reduce_on_plateau`: scalar arrays (one more axis per `vmap`).

  Attributes:
    lr: `()` float32, the current learning rate.
    best: `()` float32, the best metric seen.
    wait: `()` int32, epochs since the last improvement.
    cooldown_counter: `()` int32, cooldown epochs left.
  """
  lr: jax.Array
  best: jax.Array
  wait: jax.Array
  cooldown_counter: jax.Array


class EarlyStoppingState(NamedTuple):
  """The state of `early_stopping`: scalar arrays (one more axis per `vmap`).

  Attributes:
    best: `()` float32, the best metric seen.
    wait: `()` int32, epochs since the last improvement.
    epoch: `()` int32, the number of updates seen.
    best_epoch: `()` int32, the epoch index of the best metric (-1 before any).
    improved: `()` bool, whether the LAST update improved (save the weights then).
    stop: `()` bool, whether training should stop (sticky once set).
  """
  best: jax.Array
  wait: jax.Array
  epoch: jax.Array
  best_epoch: jax.Array
  improved: jax.Array
  stop: jax.Array


class Schedule(NamedTuple):
  init: Callable[..., Any]
  update: Callable[..., Any]


def _check_lr(lr, zero_ok: bool = False):
  """A rate: a real scalar; where concrete (not traced), finite and > 0 (>= 0 with `zero_ok`)."""
  least = '>= 0' if zero_ok else '> 0'
  if isinstance(lr, (bool, np.bool_, str, bytes)) or lr is None:
    raise TypeError(f'lr must be a real number {least}, got {lr!r} of type {type(lr).__name__}.')
  if jnp.ndim(lr) != 0:
    raise ValueError(
        f'lr must be a scalar learning rate (shape ()), got shape {jnp.shape(lr)}; vmap init '
        'to run several schedules at once.')
  if isinstance(lr, jax.core.Tracer):
    return
  value = float(np.asarray(lr))
  if not (math.isfinite(value) and (value > 0 or zero_ok and value == 0)):
    raise ValueError(f'lr must be a finite learning rate {least}, got lr = {lr!r}.')


def _metric(metric, state):
  """The metric as float32, checked to be real numbers, one per schedule (jit-safe: dtypes and
  shapes are static)."""
  dtype = checks.real_dtype(metric)
  if dtype is None:
    dtype = getattr(metric, 'dtype', None)
    raise TypeError(
        f'metric must be a real number (a Python, NumPy or JAX int or float, or a float array '
        f'under jit), got {metric!r:.60} of type {type(metric).__name__}'
        + (f' (dtype {dtype})' if dtype is not None else '') + '.')
  metric = jnp.asarray(metric, jnp.float32)
  expected = jnp.shape(state.best)
  if metric.shape != expected:
    raise ValueError(
        f'metric must be one value per epoch with the shape of the state ({expected}; a scalar '
        f'for a state from init), got metric of shape {metric.shape}. Reduce it to a scalar '
        'first; to run several schedules at once, vmap init and update.')
  return metric


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

  Example usage::

    >>> from geoparam import schedules
    >>> plateau = schedules.reduce_on_plateau(factor=0.5, patience=1)
    >>> state = plateau.init(0.1)
    >>> for metric in [1.0, 1.0, 1.0]:
    ...   state = plateau.update(state, metric)
    >>> round(float(state.lr), 6)
    0.025
    >>> schedules.reduce_on_plateau(patience=2.5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    geoparam.checks.ArgumentError: patience must be an int >= 0 (...), got 2.5 of type float.
  """
  checks.one_of('mode', mode, _MODES)
  checks.real('factor', factor, 'in the range (0, 1)', lambda x: 0.0 < x < 1.0)
  checks.count('patience', patience)
  checks.count('cooldown', cooldown)
  checks.real('min_delta', min_delta, '>= 0', lambda x: x >= 0)
  checks.real('min_lr', min_lr, '>= 0', lambda x: x >= 0)

  def init(lr) -> PlateauState:
    _check_lr(lr)
    return PlateauState(
        lr=jnp.asarray(lr, jnp.float32), best=_worst(mode),
        wait=jnp.zeros((), jnp.int32), cooldown_counter=jnp.zeros((), jnp.int32))

  def update(state: PlateauState, metric) -> PlateauState:
    metric = _metric(metric, state)
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
  checks.one_of('mode', mode, _MODES)
  checks.count('patience', patience)
  checks.real('min_delta', min_delta, '>= 0', lambda x: x >= 0)

  def init() -> EarlyStoppingState:
    zero = jnp.zeros((), jnp.int32)
    return EarlyStoppingState(
        best=_worst(mode), wait=zero, epoch=zero, best_epoch=zero - 1,
        improved=jnp.zeros((), bool), stop=jnp.zeros((), bool))

  def update(state: EarlyStoppingState, metric) -> EarlyStoppingState:
    metric = _metric(metric, state)
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
  """The state of `per_epoch_decay`: scalar arrays (one more axis per `vmap`).

  Attributes:
    lr: `()` float32, the current learning rate.
    epoch: `()` int32, the number of updates seen.
  """
  lr: jax.Array
  epoch: jax.Array


def per_epoch_decay(factor: float = 0.95, min_lr: float = 1e-3) -> Schedule:
  """Multiply the rate by `factor` after every epoch, never going below `min_lr`.

  The LCW paper's rule (003, Sec. 5): lr 0.1, x0.95 per epoch down to 0.001.
  `update(state, metric=None)` ignores the metric (it has the same signature
  as `reduce_on_plateau`'s so the two are interchangeable in a training loop).
  After `e` updates the rate is `max(lr0 * factor**e, min_lr)`; an initial
  rate below `min_lr` is left as it is.
  """
  checks.real('factor', factor, 'in the range (0, 1]', lambda x: 0.0 < x <= 1.0)
  checks.real('min_lr', min_lr, '>= 0', lambda x: x >= 0)

  def init(lr) -> DecayState:
    _check_lr(lr)
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
  _check_lr(lr, zero_ok=True)  # (pass state.lr, not the schedule's state)
  hyperparams = dict(hyperparams)
  hyperparams['learning_rate'] = jnp.asarray(lr, jnp.asarray(hyperparams['learning_rate']).dtype)
  return opt_state._replace(hyperparams=hyperparams)
