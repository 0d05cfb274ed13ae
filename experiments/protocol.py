"""The Keras training protocol of the small studies, as one jitted `lax.scan` vmapped over members.

Paper 002's reference code trains its toy and UCI models with Keras `fit`:
per epoch the optimizer steps over the epoch's batches, then the callbacks see
the epoch's logs: `ReduceLROnPlateau` (`geoparam.schedules.reduce_on_plateau`)
and `EarlyStopping(restore_best_weights=True)` (`geoparam.schedules.early_stopping`
and `keep_best`), both on one monitored metric (`Protocol.monitor`: the epoch's
mean training `'loss'`, or a metric that `evaluate` computes on any split after
the epoch). `fit` runs that for every member (initialization seed, data split)
of a batch at once: `jax.jit(jax.vmap(run))` over members, `run` one
`lax.scan` over epochs. A member that has stopped is frozen by masking (Keras:
the epoch that triggers the stop still runs), and at the end a member that
stopped early gets its best weights back (Keras 2's `restore_best_weights`).

Optional pieces: `trainable` (a mask of the params that are updated; the others
stay at their initial values), `hook` (a function of the variables recorded
before the first step and after every optimizer step, e.g. the characteristic
points of a layer), `finalize` (a function of the initial and final variables,
e.g. test predictions), all inside the same compiled call.

Example: two members fit `y = 3 x` by SGD from different starting points.

  >>> import jax, jax.numpy as jnp, optax
  >>> x = jnp.linspace(-1.0, 1.0, 8)[:, None]
  >>> p = Protocol(num_epochs=50, learning_rate=0.5, plateau_patience=5, stop_patience=10)
  >>> def mse(variables, batch, member):
  ...   return jnp.mean((batch * variables['params']['w'] - 3 * batch) ** 2), {}
  >>> out = fit(p, init=lambda w0: {'params': {'w': w0}}, loss=mse, batches=full_batch(x),
  ...           members=jnp.array([[0.0], [5.0]]), optimizer=optax.sgd)
  >>> out['variables']['params']['w'].shape, out['logs']['loss'].shape
  ((2, 1), (2, 50))
  >>> bool(jnp.allclose(out['variables']['params']['w'], 3.0, atol=1e-3))
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from geoparam import schedules


@dataclasses.dataclass(frozen=True)
class Protocol:
  """Settings of the Keras protocol (the reference code's `fit` and callbacks).

  Attributes:
    num_epochs: maximum number of epochs (>= 1).
    learning_rate: initial rate of the optimizer.
    monitor: the logged metric plateau and early stopping watch: `'loss'` (mean
      training loss of the epoch's steps, Keras' `loss`) or a key of `evaluate`'s dict.
    mode: `'min'` or `'max'` (for both callbacks).
    plateau_factor, plateau_patience, plateau_min_delta, plateau_cooldown, min_lr:
      `ReduceLROnPlateau`'s settings (Keras defaults but `patience`).
    stop_patience, stop_min_delta: `EarlyStopping`'s settings.
    restore_best: a member that stops early ends with its best weights.
  """

  num_epochs: int
  learning_rate: float
  monitor: str = 'loss'
  mode: str = 'min'
  plateau_factor: float = 0.1
  plateau_patience: int = 10
  plateau_min_delta: float = 1e-4
  plateau_cooldown: int = 0
  min_lr: float = 0.0
  stop_patience: int = 10
  stop_min_delta: float = 0.0
  restore_best: bool = True

  def schedules(self) -> tuple[schedules.Schedule, schedules.Schedule]:
    """`(plateau, stopper)` (their factories check the settings)."""
    plateau = schedules.reduce_on_plateau(
        factor=self.plateau_factor, patience=self.plateau_patience, mode=self.mode,
        min_delta=self.plateau_min_delta, cooldown=self.plateau_cooldown, min_lr=self.min_lr)
    stopper = schedules.early_stopping(patience=self.stop_patience, mode=self.mode,
                                       min_delta=self.stop_min_delta)
    return plateau, stopper


def full_batch(*arrays) -> Callable:
  """`batches` for full-batch training on `arrays` shared by every member: one step per epoch."""
  batch = arrays[0] if len(arrays) == 1 else tuple(arrays)
  return lambda member, epoch: (jax.tree.map(lambda a: a[None], batch),)


def _split(variables):
  return variables['params'], {k: v for k, v in variables.items() if k != 'params'}


def fit(protocol: Protocol, *, init: Callable, loss: Callable, batches: Callable, members,
        optimizer: Callable = optax.adam, evaluate: Callable | None = None,
        hook: Callable | None = None, finalize: Callable | None = None,
        trainable: Any = None, block: int | None = None,
        chunk: int | None = None) -> dict[str, Any]:
  """Trains every member of `members` under the Keras protocol; one compiled call.

  Args:
    protocol: the settings.
    init: `member -> variables` (`{'params': ..., **collections}`, e.g. `batch_stats`).
    loss: `(variables, batch, member) -> (scalar loss, updated collections)`;
      differentiated with respect to `variables['params']`. The collections it
      returns (e.g. BN running statistics) replace the old ones, cast to their dtype.
    batches: `(member, epoch) -> tuple of stacked batches`: each entry a pytree
      whose leading axis is the steps of a group (scanned in order), so an epoch
      of full batches plus a smaller remainder is `(full, remainder[None])`;
      `full_batch(x, y)` for one full-batch step per epoch.
    members: a pytree whose leading axis `(M, ...)` indexes the members
      (initialization keys, data splits, ...), vmapped over.
    optimizer: `learning_rate -> optax.GradientTransformation` (wrapped by
      `optax.inject_hyperparams`, so the plateau rule can set the rate).
    evaluate: `(variables, member) -> dict of scalars`, computed after every
      epoch with the epoch's final weights (Keras' validation metrics).
    hook: `(variables, member) -> pytree`, recorded before the first step and
      after every optimizer step.
    finalize: `(initial_variables, final_variables, member) -> pytree`, computed
      at the end inside the same compiled call (final = after restoring the best).
    trainable: None (all params train), or a pytree of Python bools with the
      structure of the params (or a function `params -> such a pytree`):
      params marked False keep their initial values.
    block: None (one `lax.scan` over all epochs), or epochs per `lax.scan` block
      inside a `lax.while_loop` that ends once every member (of the chunk) has
      stopped: the same results with less work when members stop early. The
      logs of epochs that did not run then repeat the last computed epoch's
      (with `active` False), and `track` repeats the last recorded state.
    chunk: None (all members in one `vmap`), or members per vmapped chunk (a
      divisor of `M`): the chunks run one after another (`lax.map`), which keeps
      a chunk's activations in cache and, with `block`, lets a chunk whose
      members have all stopped end its loop.

  Returns:
    A dict of arrays with a leading member axis `M`: `variables` (final),
    `logs` (per epoch `(M, num_epochs)`: `loss`, `evaluate`'s metrics, `lr` the
    rate the epoch used, `active` whether the epoch ran), `epochs_run`,
    `stopped`, `best_epoch` (0-based, -1 if none improved), `best` (best
    monitored value), `final_lr`, `epochs_computed` (epochs the member's loop
    ran, masked ones included: `num_epochs` without `block`); `track`
    (`(M, steps + 1, ...)`, index 0 the initial state) with a `hook`; `final`
    with a `finalize`.
  """
  plateau, stopper = protocol.schedules()
  lr = protocol.learning_rate
  opt = optax.inject_hyperparams(optimizer)(learning_rate=lr)

  def step(carry, batch, member, active):
    """One optimizer step; a member that has stopped (`~active`) keeps its state."""
    params, others, opt_state = carry

    def loss_fn(p):
      return loss({'params': p, **others}, batch, member)

    (value, updated), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    # Flax keeps BN running statistics in float32; keep their dtype stable in the carry.
    updated = jax.tree.map(lambda n, o: n.astype(o.dtype), updated, others)
    updates, new_opt = opt.update(grads, opt_state, params)
    if trainable is not None:
      mask = trainable(params) if callable(trainable) else trainable
      updates = jax.tree.map(lambda u, m: u if m else jnp.zeros_like(u), updates, mask)
    new = (optax.apply_updates(params, updates), updated, new_opt)
    new = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, carry)
    out = {'loss': value}
    if hook is not None:
      out['track'] = hook({'params': new[0], **new[1]}, member)
    return new, out

  def run(member):
    variables = init(member)
    params, others = _split(variables)
    carry = dict(state=(params, others, opt.init(params)), plateau=plateau.init(lr),
                 stop=stopper.init(), best=(params, others))

    def epoch(carry, t):
      # Keras: the epoch that triggers the stop still runs.
      active = ~carry['stop'].stop & (t < protocol.num_epochs)
      state, outs = carry['state'], []
      for group in batches(member, t):
        state, out = jax.lax.scan(lambda s, b: step(s, b, member, active), state, group)
        outs.append(out)
      out = jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
      params, others, opt_state = state
      logs = {'loss': jnp.mean(out['loss'])}
      if evaluate is not None:
        logs.update(evaluate({'params': params, **others}, member))
      metric = logs[protocol.monitor]
      plateau_state = plateau.update(carry['plateau'], metric)
      stop_state = stopper.update(carry['stop'], metric)
      new = dict(state=(params, others, schedules.set_learning_rate(opt_state, plateau_state.lr)),
                 plateau=plateau_state, stop=stop_state,
                 best=schedules.keep_best(stop_state.improved, carry['best'], (params, others)))
      new = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, carry)
      logs.update(lr=carry['plateau'].lr, active=active)
      return new, (logs, out.get('track'))

    if block is None:
      carry, (logs, track) = jax.lax.scan(epoch, carry, jnp.arange(protocol.num_epochs))
      computed = jnp.asarray(protocol.num_epochs, jnp.int32)
    else:
      carry, (logs, track), computed = _blocks(epoch, carry, protocol.num_epochs, block)
    current = carry['state'][:2]
    if protocol.restore_best:
      current = jax.tree.map(lambda b, c: jnp.where(carry['stop'].stop, b, c),
                             carry['best'], current)
    final = {'params': current[0], **current[1]}
    stop = carry['stop']
    result = dict(variables=final, logs=logs, epochs_run=jnp.sum(logs['active']),
                  stopped=stop.stop, best_epoch=stop.best_epoch, best=stop.best,
                  final_lr=carry['plateau'].lr, epochs_computed=computed)
    if hook is not None:
      first = hook(variables, member)
      # (epochs, steps per epoch, ...) -> (epochs * steps + 1, ...), index 0 the initial state.
      result['track'] = jax.tree.map(
          lambda a0, a: jnp.concatenate([a0[None], a.reshape((-1,) + a.shape[2:])]), first, track)
    if finalize is not None:
      result['final'] = finalize(variables, final, member)
    return result

  def run_all(members):
    size = jax.tree.leaves(members)[0].shape[0]
    if chunk is None or chunk >= size:
      return jax.vmap(run)(members)
    if size % chunk:
      raise ValueError(f'chunk={chunk} does not divide the {size} members.')
    split = lambda a: a.reshape((size // chunk, chunk) + a.shape[1:])
    out = jax.lax.map(jax.vmap(run), jax.tree.map(split, members))
    return jax.tree.map(lambda a: a.reshape((size,) + a.shape[2:]), out)

  return jax.jit(run_all)(members)


def _blocks(epoch: Callable, carry, num_epochs: int, block: int):
  """`lax.scan(epoch, carry, arange(num_epochs))` as blocks of `block` epochs in a while loop.

  The loop ends at `num_epochs` or once the member has stopped (under `vmap`:
  once every member has); epochs past the end are masked (`epoch`'s `active`).
  Outputs of epochs that did not run repeat the last computed epoch's, with
  `active` False; the per-step outputs (`track`) repeat the last step's.
  """
  if not (isinstance(block, int) and block >= 1):
    raise ValueError(f'block must be an int >= 1, got {block!r}.')
  length = -(-num_epochs // block) * block
  shapes = jax.eval_shape(lambda c: jax.lax.scan(epoch, c, jnp.arange(block))[1], carry)
  buffers = jax.tree.map(lambda a: jnp.zeros((length,) + a.shape[1:], a.dtype), shapes)

  def body(state):
    t, carry, buffers = state
    carry, out = jax.lax.scan(epoch, carry, t + jnp.arange(block))
    buffers = jax.tree.map(lambda b, o: jax.lax.dynamic_update_slice_in_dim(b, o, t, 0),
                           buffers, out)
    return t + block, carry, buffers

  def running(state):
    t, carry, _ = state
    return (t < num_epochs) & ~carry['stop'].stop

  ran, carry, (logs, track) = jax.lax.while_loop(
      running, body, (jnp.zeros((), jnp.int32), carry, buffers))

  def repeat_last(a, written):
    last = jax.lax.dynamic_index_in_dim(a, written - 1, 0, keepdims=False)
    rows = jnp.arange(a.shape[0]).reshape((-1,) + (1,) * (a.ndim - 1))
    return jnp.where(rows < written, a, last)

  logs = jax.tree.map(lambda a: repeat_last(a, ran)[:num_epochs], logs)
  logs['active'] = logs['active'] & (jnp.arange(num_epochs) < ran)
  if track is not None:
    track = jax.tree.map(
        lambda a: repeat_last(a.reshape((-1,) + a.shape[2:]), ran * a.shape[1]).reshape(
            a.shape)[:num_epochs], track)
  return carry, (logs, track), jnp.minimum(ran, num_epochs)
